//! Image references: parsing and the kubelet's normalization (`nginx:1.25` is
//! `docker.io/library/nginx`), with the grammar of the distribution project's reference package.
//!
//! Hand-written rather than regex-driven: it sits on the lookup hot path, and a reference that is
//! already normalized borrows from its input with no allocation.

use std::borrow::Cow;

/// The registry the kubelet assumes when an image names none.
pub const DEFAULT_DOMAIN: &str = "docker.io";
/// The legacy spelling of the default registry, rewritten to [`DEFAULT_DOMAIN`].
pub const LEGACY_DEFAULT_DOMAIN: &str = "index.docker.io";
const OFFICIAL_PREFIX: &str = "library/";
const NAME_MAX: usize = 255;
const TAG_MAX: usize = 128;

/// Why a string is not an image reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    #[error("invalid reference format: empty reference")]
    Empty,
    #[error("invalid reference format: repository name must be lowercase")]
    Uppercase,
    #[error("invalid repository name: cannot be a 64-character hexadecimal string")]
    IdentifierLike,
    #[error("invalid reference format: repository name longer than 255 characters")]
    NameTooLong,
    #[error("invalid reference format: bad registry host")]
    InvalidDomain,
    #[error("invalid reference format: bad repository path")]
    InvalidPath,
    #[error("invalid reference format: bad tag")]
    InvalidTag,
    #[error("invalid reference format: bad digest")]
    InvalidDigest,
}

/// A parsed, normalized image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef<'a> {
    name: Cow<'a, str>,
    domain_len: usize,
    tag: Option<&'a str>,
    digest: Option<&'a str>,
}

impl<'a> ImageRef<'a> {
    /// Parses `input` and normalizes it as the kubelet does before asking for credentials.
    pub fn parse(input: &'a str) -> Result<Self, ReferenceError> {
        if input.is_empty() {
            return Err(ReferenceError::Empty);
        }
        if is_identifier(input) {
            return Err(ReferenceError::IdentifierLike);
        }
        let (domain, remainder, explicit) = split_domain(input);
        let (before_digest, digest) = match remainder.split_once('@') {
            Some((b, d)) => (b, Some(d)),
            None => (remainder, None),
        };
        let (path, tag) = split_tag(before_digest);
        if path.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(ReferenceError::Uppercase);
        }
        let domain = if domain == LEGACY_DEFAULT_DOMAIN {
            DEFAULT_DOMAIN
        } else {
            domain
        };
        validate_domain(domain)?;
        validate_path(path)?;
        if let Some(tag) = tag {
            validate_tag(tag)?;
        }
        if let Some(digest) = digest {
            validate_digest(digest)?;
        }
        let official = domain == DEFAULT_DOMAIN && !path.contains('/');
        let name = if explicit && !official && domain.len() == input.find('/').unwrap_or(0) {
            Cow::Borrowed(&input[..domain.len() + 1 + path.len()])
        } else {
            let prefix = if official { OFFICIAL_PREFIX } else { "" };
            Cow::Owned(format!("{domain}/{prefix}{path}"))
        };
        if name.len() > NAME_MAX {
            return Err(ReferenceError::NameTooLong);
        }
        Ok(ImageRef {
            domain_len: domain.len(),
            name,
            tag,
            digest,
        })
    }

    /// The normalized repository (`docker.io/library/nginx`): what a plugin is asked about.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The registry part of the name, with its port (`registry.example.com:5000`).
    pub fn registry(&self) -> &str {
        &self.name[..self.domain_len]
    }

    /// The repository path below the registry (`library/nginx`).
    pub fn path(&self) -> &str {
        &self.name[self.domain_len + 1..]
    }

    /// The tag, if the reference named one.
    pub fn tag(&self) -> Option<&'a str> {
        self.tag
    }

    /// The digest, if the reference named one.
    pub fn digest(&self) -> Option<&'a str> {
        self.digest
    }

    /// Whether the reference borrowed its name from the input without allocating.
    pub fn is_borrowed(&self) -> bool {
        matches!(self.name, Cow::Borrowed(_))
    }

    /// An owned copy.
    pub fn into_owned(self) -> ImageRef<'static> {
        ImageRef {
            name: Cow::Owned(self.name.into_owned()),
            domain_len: self.domain_len,
            tag: None,
            digest: None,
        }
    }
}

/// Whether the image lives on the default registry, by the kubelet's rule for the Docker Hub
/// fallback (applied to a normalized name: no `/`, `docker.io`/`index.docker.io`, or a first
/// segment without `.` and `:`).
pub fn is_default_registry(name: &str) -> bool {
    match name.split_once('/') {
        None => !name.is_empty(),
        Some(("", _)) => false,
        Some((first, _)) => {
            first == DEFAULT_DOMAIN
                || first == LEGACY_DEFAULT_DOMAIN
                || !first.contains(['.', ':'])
        }
    }
}

/// Splits off the registry: the first segment is one when it contains `.` or `:`, is
/// `localhost`, or has an upper-case letter. Returns (domain, remainder, explicit).
fn split_domain(input: &str) -> (&str, &str, bool) {
    match input.split_once('/') {
        Some((first, rest))
            if first.contains(['.', ':'])
                || first == "localhost"
                || first.bytes().any(|b| b.is_ascii_uppercase()) =>
        {
            (first, rest, true)
        }
        _ => (DEFAULT_DOMAIN, input, false),
    }
}

/// Splits `path[:tag]`; a colon only starts a tag after the last `/`.
fn split_tag(s: &str) -> (&str, Option<&str>) {
    let last_slash = s.rfind('/').map_or(0, |i| i + 1);
    match s[last_slash..].find(':') {
        Some(i) => (&s[..last_slash + i], Some(&s[last_slash + i + 1..])),
        None => (s, None),
    }
}

fn is_identifier(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn validate_domain(domain: &str) -> Result<(), ReferenceError> {
    let (host, port) = if let Some(rest) = domain.strip_prefix('[') {
        let end = rest.find(']').ok_or(ReferenceError::InvalidDomain)?;
        let ip = &rest[..end];
        if ip.is_empty() || !ip.bytes().all(|b| b.is_ascii_hexdigit() || b == b':') {
            return Err(ReferenceError::InvalidDomain);
        }
        (None, &rest[end + 1..])
    } else {
        match domain.find(':') {
            Some(i) => (Some(&domain[..i]), &domain[i..]),
            None => (Some(domain), ""),
        }
    };
    if let Some(host) = host {
        if host.is_empty() || !host.split('.').all(valid_domain_component) {
            return Err(ReferenceError::InvalidDomain);
        }
    }
    if !port.is_empty() {
        let digits = port.strip_prefix(':').ok_or(ReferenceError::InvalidDomain)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ReferenceError::InvalidDomain);
        }
    }
    Ok(())
}

fn valid_domain_component(c: &str) -> bool {
    let b = c.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|x| x.is_ascii_alphanumeric() || *x == b'-')
}

fn validate_path(path: &str) -> Result<(), ReferenceError> {
    if path.split('/').all(valid_path_component) {
        Ok(())
    } else {
        Err(ReferenceError::InvalidPath)
    }
}

/// `[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*`
fn valid_path_component(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &b[start..i];
        let ok = sep == b"." || sep == b"_" || sep == b"__" || sep.iter().all(|x| *x == b'-');
        if !ok {
            return false;
        }
    }
    true
}

/// `[\w][\w.-]{0,127}`
fn validate_tag(tag: &str) -> Result<(), ReferenceError> {
    let word = |x: u8| x.is_ascii_alphanumeric() || x == b'_';
    let b = tag.as_bytes();
    if b.is_empty() || b.len() > TAG_MAX || !word(b[0]) {
        return Err(ReferenceError::InvalidTag);
    }
    if b.iter().all(|x| word(*x) || *x == b'.' || *x == b'-') {
        Ok(())
    } else {
        Err(ReferenceError::InvalidTag)
    }
}

/// `algorithm:hex`, with the exact lengths of the registered algorithms.
fn validate_digest(digest: &str) -> Result<(), ReferenceError> {
    let (alg, hex) = digest.split_once(':').ok_or(ReferenceError::InvalidDigest)?;
    let alg_ok = !alg.is_empty()
        && alg.split(['-', '_', '+', '.']).all(|part| {
            part.as_bytes().first().is_some_and(u8::is_ascii_alphabetic)
                && part.bytes().all(|x| x.is_ascii_alphanumeric())
        });
    if !alg_ok || hex.len() < 32 || !hex.bytes().all(|x| x.is_ascii_hexdigit()) {
        return Err(ReferenceError::InvalidDigest);
    }
    let lower = hex.bytes().all(|x| !x.is_ascii_uppercase());
    let exact = match alg {
        "sha256" => Some(64),
        "sha384" => Some(96),
        "sha512" => Some(128),
        _ => None,
    };
    match exact {
        Some(len) if hex.len() != len || !lower => Err(ReferenceError::InvalidDigest),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn normalizes_like_the_kubelet() {
        let digest_ref = format!("nginx@{D}");
        let tag_and_digest = format!("quay.io/coreos/etcd:v3@{D}");
        let cases: Vec<(&str, &str, &str, Option<&str>, Option<&str>)> = vec![
            ("nginx", "docker.io/library/nginx", "docker.io", None, None),
            ("nginx:1.25", "docker.io/library/nginx", "docker.io", Some("1.25"), None),
            (&digest_ref, "docker.io/library/nginx", "docker.io", None, Some(D)),
            ("library/nginx", "docker.io/library/nginx", "docker.io", None, None),
            ("team/app", "docker.io/team/app", "docker.io", None, None),
            ("docker.io/nginx", "docker.io/library/nginx", "docker.io", None, None),
            ("index.docker.io/nginx", "docker.io/library/nginx", "docker.io", None, None),
            ("index.docker.io/team/app:v1", "docker.io/team/app", "docker.io", Some("v1"), None),
            ("docker.io/team/app", "docker.io/team/app", "docker.io", None, None),
            ("localhost/app", "localhost/app", "localhost", None, None),
            ("localhost:5000/app:v1", "localhost:5000/app", "localhost:5000", Some("v1"), None),
            ("127.0.0.1:5000/team-a/app:v1", "127.0.0.1:5000/team-a/app", "127.0.0.1:5000", Some("v1"), None),
            ("registry.example.com/team/app-0:v1", "registry.example.com/team/app-0", "registry.example.com", Some("v1"), None),
            ("Registry.Example.com/app", "Registry.Example.com/app", "Registry.Example.com", None, None),
            ("UPPERHOST/app", "UPPERHOST/app", "UPPERHOST", None, None),
            ("[::1]:5000/app", "[::1]:5000/app", "[::1]:5000", None, None),
            ("[fe80::1]/app", "[fe80::1]/app", "[fe80::1]", None, None),
            ("localhost:5000", "docker.io/library/localhost", "docker.io", Some("5000"), None),
            ("a/b/c/d/e", "docker.io/a/b/c/d/e", "docker.io", None, None),
            ("gcr.io/a__b/c--d/e.f_g", "gcr.io/a__b/c--d/e.f_g", "gcr.io", None, None),
            (&tag_and_digest, "quay.io/coreos/etcd", "quay.io", Some("v3"), Some(D)),
            ("x.io/app:Tag_1.2-rc", "x.io/app", "x.io", Some("Tag_1.2-rc"), None),
        ];
        for (input, name, registry, tag, digest) in cases {
            let r = ImageRef::parse(input).unwrap_or_else(|e| panic!("{input}: {e}"));
            assert_eq!(r.name(), name, "{input}");
            assert_eq!(r.registry(), registry, "{input}");
            assert_eq!(r.tag(), tag, "{input}");
            assert_eq!(r.digest(), digest, "{input}");
            assert_eq!(&r.name()[r.registry().len() + 1..], r.path());
        }
    }

    #[test]
    fn refuses_invalid_references() {
        use ReferenceError::*;
        let long = format!("x.io/{}", "a".repeat(260));
        let long_tag = format!("x.io/app:{}", "t".repeat(129));
        let cases: Vec<(&str, ReferenceError)> = vec![
            ("", Empty),
            ("Nginx", Uppercase),
            ("docker.io/Team/app", Uppercase),
            ("x.io/Team/app", Uppercase),
            ("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", IdentifierLike),
            (&long, NameTooLong),
            ("x.io/app:", InvalidTag),
            ("x.io/app:-v1", InvalidTag),
            (&long_tag, InvalidTag),
            ("x.io/app@sha256:abc", InvalidDigest),
            ("x.io/app@sha256:0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef", InvalidDigest),
            ("x.io/app@", InvalidDigest),
            ("x.io//app", InvalidPath),
            ("x.io/app/", InvalidPath),
            ("x.io/a..b", InvalidPath),
            ("x.io/a___b", InvalidPath),
            ("x.io/-a", InvalidPath),
            ("x.io/a_", InvalidPath),
            ("x.io/a b", InvalidPath),
            ("-x.io/app", InvalidDomain),
            ("x.io:abc/app", InvalidDomain),
            ("x.io:/app", InvalidDomain),
            ("x..io/app", InvalidDomain),
            ("[::1/app", InvalidDomain),
            ("[zz]/app", InvalidPath),
            ("[zz:1]/app", InvalidDomain),
        ];
        for (input, want) in cases {
            assert_eq!(ImageRef::parse(input), Err(want), "{input:?}");
        }
    }

    #[test]
    fn canonical_names_borrow() {
        assert!(ImageRef::parse("registry.example.com/team/app-0:v1").unwrap().is_borrowed());
        assert!(ImageRef::parse("docker.io/library/nginx").unwrap().is_borrowed());
        assert!(!ImageRef::parse("nginx").unwrap().is_borrowed());
        assert!(!ImageRef::parse("index.docker.io/team/app").unwrap().is_borrowed());
    }

    #[test]
    fn default_registry_rule() {
        for (name, want) in [
            ("docker.io/library/nginx", true),
            ("index.docker.io/x/y", true),
            ("nginx", true),
            ("team/app", true),
            ("quay.io/x", false),
            ("localhost:5000/x", false),
            ("/x", false),
            ("", false),
        ] {
            assert_eq!(is_default_registry(name), want, "{name}");
        }
    }
}
