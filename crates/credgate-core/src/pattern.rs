//! The kubelet's image patterns (`matchImages` entries and `auth` keys) and the matching rule:
//! equal ports, equal label counts, per-label shell globs, and a plain path prefix.
//!
//! A [`Pattern`] is parsed once, when a config or a plugin response is loaded; matching a
//! [`Target`] then does no parsing and no allocation.

use std::fmt;

/// Why a pattern is not the `host[:port][/path]` of an https URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("invalid control character in pattern")]
    ControlCharacter,
    #[error("invalid character {0:?} in host name")]
    InvalidHostCharacter(char),
    #[error("invalid port {0:?} after host")]
    InvalidPort(String),
    #[error("missing ']' in host")]
    UnclosedBracket,
    #[error("invalid URL escape {0:?}")]
    InvalidEscape(String),
}

/// A pattern the kubelet accepts but that can never match anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PatternLint {
    /// `https://host`: the scheme becomes part of the host.
    Scheme,
    /// `host/*`: a `*` in the path is a literal asterisk, not a glob.
    GlobInPath,
    /// `host?x`: `?` starts a URL query, so the host ends before it.
    Query,
    /// A host label that is not a valid glob (`[a-`), so it never matches.
    BadGlob(String),
}

impl fmt::Display for PatternLint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PatternLint::Scheme => f.write_str(
                "contains a URL scheme; patterns are host[:port][/path] and this one never matches",
            ),
            PatternLint::GlobInPath => f.write_str(
                "has '*' in its path; paths are plain prefixes, '*' there only matches a literal '*'",
            ),
            PatternLint::Query => f.write_str(
                "contains '?', which starts a URL query: the host ends before it, so it is no glob",
            ),
            PatternLint::BadGlob(label) => {
                write!(f, "host label {label:?} is not a valid glob and never matches")
            }
        }
    }
}

/// The parts of a schemeless URL that matching uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlParts {
    /// Host as `url.Host` has it: brackets and port included.
    pub authority: String,
    /// Unescaped path, with its leading `/` (empty when absent).
    pub path: String,
}

/// Reads `s` as the authority and path of `https://` + `s`, as Go's `url.Parse` does.
pub fn parse_schemeless(s: &str) -> Result<UrlParts, PatternError> {
    if s.bytes().any(|b| b < 0x20 || b == 0x7f) {
        return Err(PatternError::ControlCharacter);
    }
    let s = match s.split_once('#') {
        Some((before, fragment)) => {
            unescape(fragment)?;
            before
        }
        None => s,
    };
    let s = s.split_once('?').map_or(s, |(before, _)| before);
    let (authority, path) = match s.find('/') {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, ""),
    };
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    validate_host(host)?;
    Ok(UrlParts {
        authority: host.to_owned(),
        path: unescape(path)?,
    })
}

fn validate_host(host: &str) -> Result<(), PatternError> {
    let port = if let Some(rest) = host.strip_prefix('[') {
        let end = rest.find(']').ok_or(PatternError::UnclosedBracket)?;
        &rest[end + 1..]
    } else {
        host.rfind(':').map_or("", |i| &host[i..])
    };
    let port_ok =
        port.is_empty() || (port.starts_with(':') && port[1..].bytes().all(|b| b.is_ascii_digit()));
    if !port_ok {
        return Err(PatternError::InvalidPort(port.to_owned()));
    }
    if host.contains('%') {
        return Err(PatternError::InvalidEscape(host.to_owned()));
    }
    match host.chars().find(|c| c.is_ascii() && !host_char_ok(*c)) {
        Some(c) => Err(PatternError::InvalidHostCharacter(c)),
        None => Ok(()),
    }
}

fn host_char_ok(c: char) -> bool {
    c.is_ascii_alphanumeric() || "-_.~!$&'()*+,;=:[]<>\"".contains(c)
}

/// Percent-decoding as Go's `url.Parse` does it: a `%` not followed by two hex digits is an
/// error (the decoder itself would pass it on).
fn unescape(s: &str) -> Result<String, PatternError> {
    let bad = s.match_indices('%').map(|(i, _)| i).find(|&i| {
        !s.as_bytes()
            .get(i + 1..i + 3)
            .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
    });
    if let Some(i) = bad {
        return Err(PatternError::InvalidEscape(
            s[i..].chars().take(3).collect(),
        ));
    }
    Ok(percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned())
}

/// Go's `net.SplitHostPort`, falling back to (whole, "") when it fails, as the kubelet does.
pub fn split_host_port(authority: &str) -> (&str, &str) {
    if let Some(rest) = authority.strip_prefix('[') {
        if let Some(end) = rest.find(']') {
            let after = &rest[end + 1..];
            if let Some(port) = after.strip_prefix(':') {
                if !port.contains(':') {
                    return (&rest[..end], port);
                }
            }
        }
        return (authority, "");
    }
    match authority.rfind(':') {
        Some(i) if !authority[..i].contains(':') => (&authority[..i], &authority[i + 1..]),
        _ => (authority, ""),
    }
}

/// One host label of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Label {
    Literal(Box<str>),
    Glob(Box<str>),
    /// Not a valid glob: never matches.
    Bad,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Host {
    /// No glob metacharacters: the host must be equal as a whole.
    Literal(Box<str>),
    Labels(Box<[Label]>),
}

/// A parsed pattern, ready to be matched many times.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    raw: Box<str>,
    host: Host,
    port: Box<str>,
    path: Box<str>,
}

impl Pattern {
    /// Parses a `matchImages` entry or an `auth` key.
    pub fn parse(raw: &str) -> Result<Self, PatternError> {
        let parts = parse_schemeless(raw)?;
        let (host, port) = split_host_port(&parts.authority);
        let host = if host.split('.').any(has_glob_meta) {
            Host::Labels(host.split('.').map(label).collect())
        } else {
            Host::Literal(host.into())
        };
        Ok(Pattern {
            raw: raw.into(),
            host,
            port: port.into(),
            path: parts.path.into(),
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.raw
    }

    /// Whether it matches `target` and its path ends where one of the target's path segments
    /// does (`r/team` matches `r/team/app`, not `r/team-private/app`): the kubelet's
    /// `matchImages` compares paths as string prefixes; a decision that gives credentials
    /// away wants whole segments.
    pub fn matches_whole_segments(&self, target: &Target<'_>) -> bool {
        self.matches(target) && {
            let rest = &target.path[self.path.len()..];
            rest.is_empty() || rest.starts_with('/') || self.path.ends_with('/')
        }
    }

    /// Whether this pattern matches the target.
    pub fn matches(&self, target: &Target<'_>) -> bool {
        if *self.port != *target.port || !target.path.starts_with(&*self.path) {
            return false;
        }
        match &self.host {
            Host::Literal(h) => **h == *target.host,
            Host::Labels(labels) => {
                let mut parts = target.host.split('.');
                let all = labels.iter().all(|l| match (l, parts.next()) {
                    (Label::Literal(want), Some(got)) => **want == *got,
                    (Label::Glob(glob), Some(got)) => glob_match(glob, got),
                    _ => false,
                });
                all && parts.next().is_none()
            }
        }
    }

    /// Why this pattern does not match the target (`None` when it does): what `credgate
    /// explain` says of a provider whose `matchImages` miss an image.
    pub fn mismatch(&self, target: &Target<'_>) -> Option<Mismatch> {
        if self.matches(target) {
            return None;
        }
        let host = match &self.host {
            Host::Literal(h) => (**h != *target.host).then(|| Mismatch::Host {
                want: h.to_string(),
                got: target.host.to_owned(),
                matching_labels: 0,
            }),
            Host::Labels(labels) => {
                let got: Vec<&str> = target.host.split('.').collect();
                if got.len() != labels.len() {
                    Some(Mismatch::LabelCount {
                        want: labels.len(),
                        got: got.len(),
                    })
                } else {
                    let authority = self.raw_authority();
                    let texts: Vec<&str> = split_host_port(&authority).0.split('.').collect();
                    labels.iter().zip(&got).enumerate().find_map(|(i, (l, g))| {
                        let ok = match l {
                            Label::Literal(w) => **w == **g,
                            Label::Glob(glob) => glob_match(glob, g),
                            Label::Bad => false,
                        };
                        (!ok).then(|| Mismatch::Host {
                            want: texts.get(i).copied().unwrap_or_default().to_owned(),
                            got: (*g).to_owned(),
                            matching_labels: i,
                        })
                    })
                }
            }
        };
        if let Some(m) = host {
            return Some(m);
        }
        if *self.port != *target.port {
            return Some(Mismatch::Port {
                want: self.port.to_string(),
                got: target.port.to_owned(),
            });
        }
        Some(Mismatch::Path {
            want: self.path.to_string(),
            got: target.path.to_owned(),
        })
    }

    fn raw_authority(&self) -> String {
        parse_schemeless(&self.raw)
            .map(|p| p.authority)
            .unwrap_or_default()
    }

    /// The reasons this pattern can never match anything, for `check-config`.
    pub fn lints(&self) -> Vec<PatternLint> {
        let mut out = Vec::new();
        if self.raw.contains("://") {
            out.push(PatternLint::Scheme);
        }
        if self.path.contains('*') {
            out.push(PatternLint::GlobInPath);
        }
        if self.raw.contains('?') {
            out.push(PatternLint::Query);
        }
        if let (Host::Labels(labels), Ok(parts)) = (&self.host, parse_schemeless(&self.raw)) {
            let (host, _) = split_host_port(&parts.authority);
            for (l, text) in labels.iter().zip(host.split('.')) {
                if *l == Label::Bad {
                    out.push(PatternLint::BadGlob(text.to_owned()));
                }
            }
        }
        out
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.raw)
    }
}

/// Why a pattern does not match an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// A host label (or a literal host) differs: the first `matching_labels` agreed.
    Host {
        want: String,
        got: String,
        matching_labels: usize,
    },
    /// Another number of host labels: a `*` stands for exactly one label.
    LabelCount { want: usize, got: usize },
    /// The host matches; the port does not (either side may have none).
    Port { want: String, got: String },
    /// Host and port match; the pattern's path is not a prefix of the image's.
    Path { want: String, got: String },
}

impl Mismatch {
    /// How close it came: the higher, the closer (a port or path miss beats any host miss).
    pub fn closeness(&self) -> usize {
        match self {
            Mismatch::Path { .. } => 1001,
            Mismatch::Port { .. } => 1000,
            Mismatch::Host {
                matching_labels, ..
            } => 1 + matching_labels,
            Mismatch::LabelCount { .. } => 0,
        }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Host { want, got, .. } => {
                write!(f, "host label {got:?} does not match {want:?}")
            }
            Mismatch::LabelCount { want, got } => write!(
                f,
                "the pattern's host has {want} labels, the image's {got} (a * matches exactly one label)"
            ),
            Mismatch::Port { want, got } => match (want.is_empty(), got.is_empty()) {
                (true, false) => write!(
                    f,
                    "the pattern has no port and does not match a host with a port (:{got})"
                ),
                (false, true) => write!(f, "the pattern wants port :{want}, the image has none"),
                _ => write!(f, "the pattern wants port :{want}, the image has :{got}"),
            },
            Mismatch::Path { want, got } => write!(
                f,
                "the pattern's path {want:?} is not a prefix of the image's path {got:?}"
            ),
        }
    }
}

fn has_glob_meta(s: &str) -> bool {
    s.contains(['*', '?', '[', '\\'])
}

fn label(text: &str) -> Label {
    if !has_glob_meta(text) {
        Label::Literal(text.into())
    } else if glob_valid(text) {
        Label::Glob(text.into())
    } else {
        Label::Bad
    }
}

/// What a pattern is matched against: an image name or a registry host, split once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    host: &'a str,
    port: &'a str,
    path: &'a str,
}

impl<'a> Target<'a> {
    /// A target from a normalized image name (`registry:port/path`), which the reference
    /// grammar guarantees has no URL escapes, queries or user info.
    pub fn from_image_name(name: &'a str) -> Self {
        let (authority, path) = match name.find('/') {
            Some(i) => (&name[..i], &name[i..]),
            None => (name, ""),
        };
        let (host, port) = split_host_port(authority);
        Target { host, port, path }
    }

    /// A target from arbitrary schemeless URL parts (a registry host given to the docker
    /// credential helper, say).
    pub fn from_parts(parts: &'a UrlParts) -> Self {
        let (host, port) = split_host_port(&parts.authority);
        Target {
            host,
            port,
            path: &parts.path,
        }
    }
}

/// Checks the glob syntax of Go's `path.Match`.
pub fn glob_valid(pattern: &str) -> bool {
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.next().is_none() => return false,
            '[' => {
                if chars.peek() == Some(&'^') {
                    chars.next();
                }
                let mut first = true;
                loop {
                    match chars.peek() {
                        None => return false,
                        Some(']') if !first => {
                            chars.next();
                            break;
                        }
                        _ => {}
                    }
                    first = false;
                    if class_char(&mut chars).is_none() {
                        return false;
                    }
                    if chars.peek() == Some(&'-') {
                        chars.next();
                        if class_char(&mut chars).is_none() {
                            return false;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    true
}

fn class_char(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) -> Option<char> {
    match chars.next()? {
        '-' | ']' => None,
        '\\' => chars.next(),
        c => Some(c),
    }
}

/// Go's `path.Match` for one label (no separators): `*`, `?`, `[...]`, `\` escapes.
/// Call only with a pattern for which [`glob_valid`] holds. ASCII input (every real host) is
/// matched byte-wise without allocating.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    if pattern.is_ascii() && text.is_ascii() {
        glob_at(pattern.as_bytes(), text.as_bytes())
    } else {
        let p: Vec<char> = pattern.chars().collect();
        let t: Vec<char> = text.chars().collect();
        glob_at(&p, &t)
    }
}

/// A pattern or text symbol: a byte or a char.
trait Sym: Copy + Ord {
    fn is(self, c: u8) -> bool;
}

impl Sym for u8 {
    fn is(self, c: u8) -> bool {
        self == c
    }
}

impl Sym for char {
    fn is(self, c: u8) -> bool {
        self == char::from(c)
    }
}

fn glob_at<T: Sym>(p: &[T], t: &[T]) -> bool {
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi].is(b'*') {
            star = Some((pi, ti));
            pi += 1;
            continue;
        }
        if pi < p.len() {
            if let Some(next) = single(p, pi, t[ti]) {
                pi = next;
                ti += 1;
                continue;
            }
        }
        match star {
            Some((sp, st)) => {
                pi = sp + 1;
                ti = st + 1;
                star = Some((sp, st + 1));
            }
            None => return false,
        }
    }
    p[pi..].iter().all(|c| c.is(b'*'))
}

/// Matches one non-star pattern item at `p[pi]` against `c`; returns the next pattern index.
fn single<T: Sym>(p: &[T], pi: usize, c: T) -> Option<usize> {
    let x = p[pi];
    if x.is(b'?') {
        Some(pi + 1)
    } else if x.is(b'\\') {
        (p.get(pi + 1) == Some(&c)).then_some(pi + 2)
    } else if x.is(b'[') {
        class(p, pi + 1, c)
    } else {
        (x == c).then_some(pi + 1)
    }
}

fn class<T: Sym>(p: &[T], mut i: usize, c: T) -> Option<usize> {
    let negated = p[i].is(b'^');
    if negated {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    loop {
        if p[i].is(b']') && !first {
            i += 1;
            break;
        }
        first = false;
        let (lo, next) = class_item(p, i);
        let (hi, next) = if p[next].is(b'-') {
            class_item(p, next + 1)
        } else {
            (lo, next)
        };
        if lo <= c && c <= hi {
            matched = true;
        }
        i = next;
    }
    (matched != negated).then_some(i)
}

fn class_item<T: Sym>(p: &[T], i: usize) -> (T, usize) {
    if p[i].is(b'\\') {
        (p[i + 1], i + 2)
    } else {
        (p[i], i + 1)
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod mismatch_tests {
    use super::*;

    fn why(pattern: &str, image: &str) -> Option<String> {
        Pattern::parse(pattern)
            .unwrap()
            .mismatch(&Target::from_image_name(image))
            .map(|m| m.to_string())
    }

    #[test]
    fn each_way_a_pattern_misses_is_named() {
        assert_eq!(why("*.example.com", "registry.example.com/a"), None);
        assert_eq!(
            why("*.example.com", "registry.example.com:5000/a").unwrap(),
            "the pattern has no port and does not match a host with a port (:5000)"
        );
        assert_eq!(
            why("*.example.com", "a.b.example.com/x").unwrap(),
            "the pattern's host has 3 labels, the image's 4 (a * matches exactly one label)"
        );
        assert_eq!(
            why(
                "*.dkr.ecr.*.amazonaws.com",
                "1.dkr.ecr.us-east-1.amazonaws.cn/x"
            )
            .unwrap(),
            "host label \"cn\" does not match \"com\""
        );
        assert_eq!(
            why(
                "registry.example.com/team",
                "registry.example.com/other/app"
            )
            .unwrap(),
            "the pattern's path \"/team\" is not a prefix of the image's path \"/other/app\""
        );
        assert_eq!(
            why("reg.io:5000", "reg.io/a").unwrap(),
            "the pattern wants port :5000, the image has none"
        );
        assert_eq!(
            why("reg.io", "other.io/a").unwrap(),
            "host label \"other.io\" does not match \"reg.io\""
        );
        let port = Pattern::parse("*.example.com")
            .unwrap()
            .mismatch(&Target::from_image_name("r.example.com:5000/a"))
            .unwrap();
        let host = Pattern::parse("*.other.com")
            .unwrap()
            .mismatch(&Target::from_image_name("r.example.com:5000/a"))
            .unwrap();
        assert!(port.closeness() > host.closeness());
    }
}
