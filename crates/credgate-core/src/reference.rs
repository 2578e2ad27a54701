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
/// The longest digest algorithm and encoded part accepted for an algorithm the OCI spec does
/// not register (the registered ones have exact lengths, up to 128 for sha512).
const DIGEST_ALGORITHM_MAX: usize = 64;
const DIGEST_ENCODED_MAX: usize = 256;
/// The longest reference accepted, checked before anything else: a name, tag and digest at
/// their limits, with room for a registry spelled the long way (`index.docker.io`).
pub const REFERENCE_MAX: usize = 1024;

/// Why a string is not an image reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    #[error("invalid reference format: empty reference")]
    Empty,
    #[error("invalid reference format: longer than {REFERENCE_MAX} bytes")]
    TooLong,
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
        if input.len() > REFERENCE_MAX {
            return Err(ReferenceError::TooLong);
        }
        if is_identifier(input) {
            return Err(ReferenceError::IdentifierLike);
        }
        let b = input.as_bytes();
        let first_end = b.iter().position(|x| *x == b'/');
        let (domain, rest_start, explicit) = match first_end {
            Some(s) if is_registry(&b[..s]) => (&input[..s], s + 1, true),
            _ => (DEFAULT_DOMAIN, 0, false),
        };
        let tail = Tail::scan(&b[rest_start..]).map_err(|e| match e {
            ReferenceError::InvalidPath
                if input[rest_start..].bytes().any(|x| x.is_ascii_uppercase()) =>
            {
                ReferenceError::Uppercase
            }
            e => e,
        })?;
        let path_end = rest_start + tail.path_len;
        let path = &input[rest_start..path_end];
        let tag = tail
            .tag
            .map(|(from, to)| &input[rest_start + from..rest_start + to]);
        let digest = tail.digest_from.map(|from| &input[rest_start + from..]);
        let domain = if domain == LEGACY_DEFAULT_DOMAIN {
            DEFAULT_DOMAIN
        } else {
            domain
        };
        validate_domain(domain)?;
        if let Some(digest) = digest {
            validate_digest(digest)?;
        }
        let official = domain == DEFAULT_DOMAIN && !tail.nested;
        let name = if explicit && !official && domain.as_ptr() == input.as_ptr() {
            Cow::Borrowed(&input[..path_end])
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
}

/// Whether the image lives on the default registry, by the kubelet's rule for the Docker Hub
/// fallback (applied to a normalized name: no `/`, `docker.io`/`index.docker.io`, or a first
/// segment without `.` and `:`).
pub fn is_default_registry(name: &str) -> bool {
    match name.split_once('/') {
        None => !name.is_empty(),
        Some(("", _)) => false,
        Some((first, _)) => {
            first == DEFAULT_DOMAIN || first == LEGACY_DEFAULT_DOMAIN || !first.contains(['.', ':'])
        }
    }
}

/// Whether the first segment names a registry: it has `.`, `:` or an upper-case letter, or is
/// `localhost`.
fn is_registry(first: &[u8]) -> bool {
    first == b"localhost"
        || first
            .iter()
            .any(|x| *x == b'.' || *x == b':' || x.is_ascii_uppercase())
}

/// Byte classes of the repository grammar.
const C_ALNUM: u8 = 0;
const C_SLASH: u8 = 1;
const C_DOT: u8 = 2;
const C_UNDER: u8 = 3;
const C_DASH: u8 = 4;
const C_COLON: u8 = 5;
const C_AT: u8 = 6;
const C_OTHER: u8 = 7;

const CLASS: [u8; 256] = {
    let mut t = [C_OTHER; 256];
    let mut i = 0;
    while i < 256 {
        let c = i as u8;
        t[i] = match c {
            b'a'..=b'z' | b'0'..=b'9' => C_ALNUM,
            b'/' => C_SLASH,
            b'.' => C_DOT,
            b'_' => C_UNDER,
            b'-' => C_DASH,
            b':' => C_COLON,
            b'@' => C_AT,
            _ => C_OTHER,
        };
        i += 1;
    }
    t
};

/// Path states: at a component start, after an alphanumeric, after `.`, `_`, `__`, `-`+.
const S_START: u8 = 0;
const S_ALNUM: u8 = 1;
const S_DOT: u8 = 2;
const S_UNDER: u8 = 3;
const S_UNDER2: u8 = 4;
const S_DASH: u8 = 5;
const S_BAD: u8 = 6;

/// `NEXT[state][class]`: the path grammar
/// `[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*(?:/...)*`; `:` and `@` end the path (handled by
/// the caller), anything else is `S_BAD`.
const NEXT: [[u8; 8]; 6] = [
    // alnum    /        .      _         -       :      @      other
    [S_ALNUM, S_BAD, S_BAD, S_BAD, S_BAD, S_BAD, S_BAD, S_BAD], // start
    [
        S_ALNUM, S_START, S_DOT, S_UNDER, S_DASH, S_BAD, S_BAD, S_BAD,
    ], // alnum
    [S_ALNUM, S_BAD, S_BAD, S_BAD, S_BAD, S_BAD, S_BAD, S_BAD], // .
    [S_ALNUM, S_BAD, S_BAD, S_UNDER2, S_BAD, S_BAD, S_BAD, S_BAD], // _
    [S_ALNUM, S_BAD, S_BAD, S_BAD, S_BAD, S_BAD, S_BAD, S_BAD], // __
    [S_ALNUM, S_BAD, S_BAD, S_BAD, S_DASH, S_BAD, S_BAD, S_BAD], // -
];

/// The repository path, tag and digest after the registry, validated in one forward pass.
struct Tail {
    path_len: usize,
    /// Whether the path has more than one component.
    nested: bool,
    tag: Option<(usize, usize)>,
    digest_from: Option<usize>,
}

impl Tail {
    fn scan(b: &[u8]) -> Result<Self, ReferenceError> {
        let mut state = S_START;
        let mut nested = false;
        let mut i = 0;
        while i < b.len() {
            let class = CLASS[b[i] as usize];
            if class == C_COLON || class == C_AT {
                break;
            }
            nested |= class == C_SLASH;
            state = NEXT[state as usize][class as usize];
            if state == S_BAD {
                return Err(ReferenceError::InvalidPath);
            }
            i += 1;
        }
        if state != S_ALNUM {
            return Err(ReferenceError::InvalidPath);
        }
        let path_len = i;
        let mut tag = None;
        if b.get(i) == Some(&b':') {
            let start = i + 1;
            let end = b[start..]
                .iter()
                .position(|x| *x == b'@')
                .map_or(b.len(), |p| start + p);
            validate_tag(&b[start..end])?;
            tag = Some((start, end));
            i = end;
        }
        let digest_from = (b.get(i) == Some(&b'@')).then_some(i + 1);
        Ok(Tail {
            path_len,
            nested,
            tag,
            digest_from,
        })
    }
}

fn is_identifier(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn validate_domain(domain: &str) -> Result<(), ReferenceError> {
    let b = domain.as_bytes();
    let port_at = if b.first() == Some(&b'[') {
        let end = b
            .iter()
            .position(|x| *x == b']')
            .ok_or(ReferenceError::InvalidDomain)?;
        let ip = &b[1..end];
        if ip.is_empty() || !ip.iter().all(|x| x.is_ascii_hexdigit() || *x == b':') {
            return Err(ReferenceError::InvalidDomain);
        }
        end + 1
    } else {
        let end = b.iter().position(|x| *x == b':').unwrap_or(b.len());
        if !valid_host(&b[..end]) {
            return Err(ReferenceError::InvalidDomain);
        }
        end
    };
    let port = &b[port_at..];
    if !port.is_empty() {
        let digits = port
            .strip_prefix(b":")
            .ok_or(ReferenceError::InvalidDomain)?;
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return Err(ReferenceError::InvalidDomain);
        }
    }
    Ok(())
}

/// Dot-separated components, each alphanumeric at both ends with `-` inside.
fn valid_host(b: &[u8]) -> bool {
    let mut prev = b'.';
    for &x in b {
        let ok = match x {
            b'.' => prev != b'.' && prev != b'-',
            b'-' => prev != b'.',
            _ => x.is_ascii_alphanumeric(),
        };
        if !ok {
            return false;
        }
        prev = x;
    }
    prev != b'.' && prev != b'-'
}

/// `[\w][\w.-]{0,127}`
fn validate_tag(b: &[u8]) -> Result<(), ReferenceError> {
    let word = |x: u8| x.is_ascii_alphanumeric() || x == b'_';
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
    let (alg, hex) = digest
        .split_once(':')
        .ok_or(ReferenceError::InvalidDigest)?;
    let alg_ok = !alg.is_empty()
        && alg.split(['-', '_', '+', '.']).all(|part| {
            part.as_bytes().first().is_some_and(u8::is_ascii_alphabetic)
                && part.bytes().all(|x| x.is_ascii_alphanumeric())
        });
    if !alg_ok
        || alg.len() > DIGEST_ALGORITHM_MAX
        || hex.len() < 32
        || hex.len() > DIGEST_ENCODED_MAX
        || !hex.bytes().all(|x| x.is_ascii_hexdigit())
    {
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
    fn references_and_digests_have_length_limits() {
        let long_digest = format!("reg.io/app@sha999:{}", "a".repeat(DIGEST_ENCODED_MAX + 1));
        assert_eq!(
            ImageRef::parse(&long_digest),
            Err(ReferenceError::InvalidDigest)
        );
        let ok_digest = format!("reg.io/app@sha999:{}", "a".repeat(DIGEST_ENCODED_MAX));
        assert!(ImageRef::parse(&ok_digest).is_ok());
        let long_alg = format!("reg.io/app@{}:{}", "a".repeat(65), "0".repeat(64));
        assert_eq!(
            ImageRef::parse(&long_alg),
            Err(ReferenceError::InvalidDigest)
        );
        let huge = format!("reg.io/app@sha999:{}", "a".repeat(4 << 20));
        assert_eq!(ImageRef::parse(&huge), Err(ReferenceError::TooLong));
    }

    #[test]
    fn normalizes_like_the_kubelet() {
        let digest_ref = format!("nginx@{D}");
        let tag_and_digest = format!("quay.io/coreos/etcd:v3@{D}");
        type Case<'a> = (&'a str, &'a str, &'a str, Option<&'a str>, Option<&'a str>);
        let cases: Vec<Case<'_>> = vec![
            ("nginx", "docker.io/library/nginx", "docker.io", None, None),
            (
                "nginx:1.25",
                "docker.io/library/nginx",
                "docker.io",
                Some("1.25"),
                None,
            ),
            (
                &digest_ref,
                "docker.io/library/nginx",
                "docker.io",
                None,
                Some(D),
            ),
            (
                "library/nginx",
                "docker.io/library/nginx",
                "docker.io",
                None,
                None,
            ),
            ("team/app", "docker.io/team/app", "docker.io", None, None),
            (
                "docker.io/nginx",
                "docker.io/library/nginx",
                "docker.io",
                None,
                None,
            ),
            (
                "index.docker.io/nginx",
                "docker.io/library/nginx",
                "docker.io",
                None,
                None,
            ),
            (
                "index.docker.io/team/app:v1",
                "docker.io/team/app",
                "docker.io",
                Some("v1"),
                None,
            ),
            (
                "docker.io/team/app",
                "docker.io/team/app",
                "docker.io",
                None,
                None,
            ),
            ("localhost/app", "localhost/app", "localhost", None, None),
            (
                "localhost:5000/app:v1",
                "localhost:5000/app",
                "localhost:5000",
                Some("v1"),
                None,
            ),
            (
                "127.0.0.1:5000/team-a/app:v1",
                "127.0.0.1:5000/team-a/app",
                "127.0.0.1:5000",
                Some("v1"),
                None,
            ),
            (
                "registry.example.com/team/app-0:v1",
                "registry.example.com/team/app-0",
                "registry.example.com",
                Some("v1"),
                None,
            ),
            (
                "Registry.Example.com/app",
                "Registry.Example.com/app",
                "Registry.Example.com",
                None,
                None,
            ),
            ("UPPERHOST/app", "UPPERHOST/app", "UPPERHOST", None, None),
            ("[::1]:5000/app", "[::1]:5000/app", "[::1]:5000", None, None),
            ("[fe80::1]/app", "[fe80::1]/app", "[fe80::1]", None, None),
            (
                "localhost:5000",
                "docker.io/library/localhost",
                "docker.io",
                Some("5000"),
                None,
            ),
            ("a/b/c/d/e", "docker.io/a/b/c/d/e", "docker.io", None, None),
            (
                "gcr.io/a__b/c--d/e.f_g",
                "gcr.io/a__b/c--d/e.f_g",
                "gcr.io",
                None,
                None,
            ),
            (
                &tag_and_digest,
                "quay.io/coreos/etcd",
                "quay.io",
                Some("v3"),
                Some(D),
            ),
            (
                "x.io/app:Tag_1.2-rc",
                "x.io/app",
                "x.io",
                Some("Tag_1.2-rc"),
                None,
            ),
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
            (
                "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                IdentifierLike,
            ),
            (&long, NameTooLong),
            ("x.io/app:", InvalidTag),
            ("x.io/app:-v1", InvalidTag),
            (&long_tag, InvalidTag),
            ("x.io/app@sha256:abc", InvalidDigest),
            (
                "x.io/app@sha256:0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef",
                InvalidDigest,
            ),
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
        assert!(ImageRef::parse("registry.example.com/team/app-0:v1")
            .unwrap()
            .is_borrowed());
        assert!(ImageRef::parse("docker.io/library/nginx")
            .unwrap()
            .is_borrowed());
        assert!(!ImageRef::parse("nginx").unwrap().is_borrowed());
        assert!(!ImageRef::parse("index.docker.io/team/app")
            .unwrap()
            .is_borrowed());
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
