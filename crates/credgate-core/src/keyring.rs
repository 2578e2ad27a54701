//! The keyring: which credentials of which sources apply to an image, in the order a puller
//! should try them.
//!
//! Auth keys are normalized (scheme dropped, `/v1/` and `/v2/` prefixes dropped), every
//! credential whose key matches is returned, ordered by normalized key in descending byte order,
//! and for equal keys by source order (node-wide docker config files first, then providers in
//! config order), exactly as the kubelet merges its providers into one keyring. When nothing
//! matched and the image is on Docker Hub, the credentials stored under `index.docker.io` are
//! returned.

use smallvec::SmallVec;

use crate::pattern::{parse_schemeless, Pattern, PatternError, Target};
use crate::reference::is_default_registry;
use crate::wire::AuthConfig;

/// The key under which Docker Hub credentials are stored.
pub const DOCKER_HUB_KEY: &str = "index.docker.io";

/// Normalizes an auth key: `https://index.docker.io/v1/` is `index.docker.io`,
/// `http://reg.io/v2/team` is `reg.io/team`.
pub fn normalize_key(raw: &str) -> Result<String, PatternError> {
    let s = raw
        .strip_prefix("https://")
        .or_else(|| raw.strip_prefix("http://"))
        .unwrap_or(raw);
    let parts = parse_schemeless(s)?;
    let mut path = parts.path.as_str();
    if path.starts_with("/v2/") || path.starts_with("/v1/") {
        path = &path[3..];
    }
    if path.is_empty() || path == "/" {
        Ok(parts.authority)
    } else {
        Ok(format!("{}{path}", parts.authority))
    }
}

/// One credential under its normalized key.
#[derive(Debug, Clone)]
pub struct KeyedAuth {
    key: Box<str>,
    pattern: Pattern,
    pub auth: AuthConfig,
}

impl KeyedAuth {
    /// The normalized key (the pattern that matched).
    pub fn key(&self) -> &str {
        &self.key
    }
}

/// An auth key that could not be parsed and was left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidKey {
    pub key: String,
    pub error: PatternError,
}

/// The credentials of one source, prepared for many lookups: keys normalized and parsed once,
/// sorted in try-order.
#[derive(Debug, Clone, Default)]
pub struct AuthSet {
    entries: Vec<KeyedAuth>,
}

impl AuthSet {
    /// Prepares a source's `(key, credential)` pairs; keys that do not parse are returned apart
    /// and left out, as the kubelet ignores them.
    pub fn new(items: impl IntoIterator<Item = (String, AuthConfig)>) -> (Self, Vec<InvalidKey>) {
        let mut entries = Vec::new();
        let mut invalid = Vec::new();
        for (raw, auth) in items {
            let parsed = normalize_key(&raw).and_then(|k| Pattern::parse(&k).map(|p| (k, p)));
            match parsed {
                Ok((key, pattern)) => entries.push(KeyedAuth {
                    key: key.into(),
                    pattern,
                    auth,
                }),
                Err(error) => invalid.push(InvalidKey { key: raw, error }),
            }
        }
        entries.sort_by(|a, b| b.key.cmp(&a.key));
        (AuthSet { entries }, invalid)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The credential at `index` in try-order.
    pub fn get(&self, index: usize) -> Option<&KeyedAuth> {
        self.entries.get(index)
    }

    /// The index of a credential borrowed from this set.
    pub fn position(&self, auth: &KeyedAuth) -> Option<usize> {
        self.entries.iter().position(|e| std::ptr::eq(e, auth))
    }
}

/// The selected credentials: each with the caller's tag for its source.
pub type Selection<'a, S> = SmallVec<[(S, &'a KeyedAuth); 4]>;

/// Selects the credentials of `sources` (in source order) that apply to the normalized image
/// `name`, in the order a puller should try them.
pub fn select<'a, S: Copy>(name: &str, sources: &[(S, &'a AuthSet)]) -> Selection<'a, S> {
    select_target(
        &Target::from_image_name(name),
        is_default_registry(name),
        sources,
    )
}

/// [`select`] for a target that is already split; `docker_hub` says whether the Docker Hub
/// fallback applies.
pub fn select_target<'a, S: Copy>(
    target: &Target<'_>,
    docker_hub: bool,
    sources: &[(S, &'a AuthSet)],
) -> Selection<'a, S> {
    let mut out: Selection<'a, S> = SmallVec::new();
    for (tag, set) in sources {
        for e in set.entries.iter().filter(|e| e.pattern.matches(target)) {
            out.push((*tag, e));
        }
    }
    if out.len() > 1 {
        out.sort_by(|a, b| b.1.key.cmp(&a.1.key));
    }
    if out.is_empty() && docker_hub {
        for (tag, set) in sources {
            for e in set.entries.iter().filter(|e| &*e.key == DOCKER_HUB_KEY) {
                out.push((*tag, e));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::SecretString;

    fn set(keys: &[(&str, &str)]) -> AuthSet {
        let items = keys.iter().map(|(k, user)| {
            let auth = AuthConfig {
                username: (*user).to_owned(),
                password: SecretString::from("pw"),
            };
            ((*k).to_owned(), auth)
        });
        let (set, invalid) = AuthSet::new(items);
        assert!(invalid.is_empty(), "{invalid:?}");
        set
    }

    fn users(name: &str, sources: &[(usize, &AuthSet)]) -> Vec<String> {
        select(name, sources)
            .iter()
            .map(|(src, e)| format!("{src}:{}", e.auth.username))
            .collect()
    }

    #[test]
    fn normalizes_keys() {
        for (raw, want) in [
            ("https://index.docker.io/v1/", "index.docker.io"),
            ("http://reg.io/v2/team", "reg.io/team"),
            ("reg.io/v1/", "reg.io"),
            ("reg.io/", "reg.io"),
            ("reg.io", "reg.io"),
            ("reg.io:5000/team/app", "reg.io:5000/team/app"),
            ("https://reg.io/v2", "reg.io/v2"),
        ] {
            assert_eq!(normalize_key(raw).unwrap(), want, "{raw}");
        }
        assert!(normalize_key("reg.io:abc").is_err());
    }

    #[test]
    fn order_within_one_source() {
        let s = set(&[
            ("*.example.com", "wild"),
            ("registry.example.com", "host"),
            ("registry.example.com/team", "team"),
            ("registry.example.com/team/app", "app"),
            ("other.io", "other"),
        ]);
        assert_eq!(
            users("registry.example.com/team/app", &[(0, &s)]),
            vec!["0:app", "0:team", "0:host", "0:wild"]
        );
        assert_eq!(
            users("registry.example.com/x", &[(0, &s)]),
            vec!["0:host", "0:wild"]
        );
        assert_eq!(users("a.example.com/x", &[(0, &s)]), vec!["0:wild"]);
        assert!(users("example.com/x", &[(0, &s)]).is_empty());
    }

    #[test]
    fn order_across_sources_is_by_key_then_source() {
        let docker = set(&[
            ("*.example.com", "docker-wild"),
            ("registry.example.com", "docker"),
        ]);
        let p1 = set(&[("registry.example.com", "p1")]);
        let p2 = set(&[
            ("registry.example.com/team", "p2-team"),
            ("registry.example.com", "p2"),
        ]);
        assert_eq!(
            users(
                "registry.example.com/team/app",
                &[(0, &docker), (1, &p1), (2, &p2)]
            ),
            vec!["2:p2-team", "0:docker", "1:p1", "2:p2", "0:docker-wild"]
        );
    }

    #[test]
    fn docker_hub_fallback_only_when_nothing_matched() {
        let hub = set(&[
            ("https://index.docker.io/v1/", "hub"),
            ("docker.io", "dockerio"),
        ]);
        assert_eq!(
            users("docker.io/library/nginx", &[(0, &hub)]),
            vec!["0:dockerio"]
        );
        let only_hub = set(&[("https://index.docker.io/v1/", "hub")]);
        let other = set(&[("index.docker.io", "hub2")]);
        assert_eq!(
            users("docker.io/library/nginx", &[(0, &only_hub), (1, &other)]),
            vec!["0:hub", "1:hub2"]
        );
        assert_eq!(
            users("docker.io/team/app", &[(0, &only_hub)]),
            vec!["0:hub"]
        );
        assert!(users("quay.io/team/app", &[(0, &only_hub)]).is_empty());
        assert!(users("localhost:5000/app", &[(0, &only_hub)]).is_empty());
    }

    #[test]
    fn invalid_keys_are_left_out() {
        let items = vec![
            (
                "reg.io:abc".to_owned(),
                AuthConfig {
                    username: "x".into(),
                    password: SecretString::from("y"),
                },
            ),
            (
                "reg.io".to_owned(),
                AuthConfig {
                    username: "u".into(),
                    password: SecretString::from("p"),
                },
            ),
        ];
        let (set, invalid) = AuthSet::new(items);
        assert_eq!(set.len(), 1);
        assert_eq!(invalid[0].key, "reg.io:abc");
    }
}
