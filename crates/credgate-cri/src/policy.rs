//! What the proxy may change in a `PullImage` (decision 0017), and nothing else:
//!
//! - fill: a pull that came without a credential, for an image one of the operator's patterns
//!   names (`--cri-proxy-fill`), gets the credential the agent's sources give for it;
//! - scope: the credential's `server_address`, which decides which of the hosts the runtime
//!   tries for the image may receive it (`--cri-proxy-scope-credentials`,
//!   `--cri-proxy-trusted-mirror`). containerd's CRI (1.5 through 2.x, `ParseAuth`) gives a
//!   credential whose `server_address` is empty to every host it tries for the pull, mirrors
//!   of `hosts.toml` included, and one whose `server_address` is set only to the host that
//!   address names. With scope on, a pull's credential names the image's registry, unless
//!   every mirror configured for that registry is trusted with its pods' credentials; then it
//!   names none, and the registry and those mirrors receive it.
//!
//! Sans-IO: containerd's hosts directories are read at the start and when they change
//! ([`crate::hosts`]); a pull's scope is decided from the last reading, in memory.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::hosts::Hosts;

use credgate_core::pattern::{Pattern, PatternError, Target};

/// Why the policy's flags were refused.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("--cri-proxy-fill {0:?}")]
    Pattern(String, #[source] PatternError),
    #[error("--cri-proxy-trusted-mirror {0:?}: expected REGISTRY=MIRROR[,MIRROR...], each a HOST[:PORT]")]
    Mirror(String),
    #[error("--cri-proxy-fill {0:?}: a pattern names images as their references do, without a scheme (drop {1}://)")]
    Scheme(String, String),
}

/// The proxy's credential policy; by default it changes nothing.
#[derive(Debug, Clone, Default)]
pub struct ProxyPolicy {
    fill: Vec<Pattern>,
    scope: Option<Scope>,
}

#[derive(Debug, Clone)]
struct Scope {
    /// Per registry (as image references name it), the mirror hosts trusted with its pods'
    /// credentials.
    trusted: BTreeMap<String, Vec<String>>,
    /// containerd's `config_path`, split as `filepath.SplitList` splits it, and its last
    /// reading: when set, a registry's mirrors are found as containerd finds them
    /// ([`crate::hosts::HostsView::configured_mirrors`]), and every one must be trusted for the
    /// credential to reach any.
    hosts: Option<Arc<Hosts>>,
}

/// What the policy does with a pull's `server_address`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scoped {
    /// Scope is off: as the caller sent it.
    AsSent,
    /// Set to the registry's own host: no mirror receives the credential.
    Registry { address: String, why: String },
    /// Cleared: the registry and its mirrors, all trusted, receive it.
    TrustedMirrors { mirrors: Vec<String> },
}

impl Scoped {
    /// The pull log's and metrics' name of it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Scoped::AsSent => "as-sent",
            Scoped::Registry { .. } => "registry-only",
            Scoped::TrustedMirrors { .. } => "trusted-mirrors",
        }
    }

    /// The `server_address` the runtime gets, given what was sent.
    pub fn server_address(&self, sent: &str) -> String {
        match self {
            Scoped::AsSent => sent.to_owned(),
            Scoped::Registry { address, .. } => address.clone(),
            Scoped::TrustedMirrors { .. } => String::new(),
        }
    }

    /// One sentence for people (explain, the log).
    pub fn describe(&self) -> String {
        match self {
            Scoped::AsSent => "mirror trust is off: the credential's server address goes as the caller sent it (containerd gives a credential without one to every mirror hosts.toml names)".into(),
            Scoped::Registry { address, why } => {
                format!("server address set to {address}: only the registry receives the credential ({why})")
            }
            Scoped::TrustedMirrors { mirrors } if mirrors.is_empty() => {
                "server address cleared: the registry receives the credential, and no mirror is configured".into()
            }
            Scoped::TrustedMirrors { mirrors } => format!(
                "server address cleared: the registry and its trusted mirrors ({}) receive the credential",
                mirrors.join(", ")
            ),
        }
    }
}

/// The registry's name as image references give it, for Docker Hub's aliases too.
fn registry_key(registry: &str) -> &str {
    match registry {
        "index.docker.io" | "registry-1.docker.io" => "docker.io",
        r => r,
    }
}

/// The host containerd contacts for `registry` when no mirror answers, which its
/// `ParseAuth` compares with the host of the credential's `server_address`.
pub fn runtime_host(registry: &str) -> &str {
    match registry_key(registry) {
        "docker.io" => "registry-1.docker.io",
        r => r,
    }
}

fn valid_host(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 262
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
}

impl ProxyPolicy {
    /// `fill`: matchImages patterns; `scope`: the policy on; `trusted`: `REGISTRY=MIRROR,...`
    /// (scope on when any is given); `hosts_dir`: containerd's `config_path`, read now (the
    /// proxy's [`Hosts::watch`] keeps it current).
    pub fn new(
        fill: &[String],
        scope: bool,
        trusted: &[String],
        hosts_dir: Option<PathBuf>,
    ) -> Result<ProxyPolicy, PolicyError> {
        let fill = fill
            .iter()
            .map(|p| {
                // matchImages takes a scheme, but no image reference has one: a pattern with
                // one would read as naming images it never names.
                if let Some((scheme, _)) = p.split_once("://") {
                    return Err(PolicyError::Scheme(p.clone(), scheme.to_owned()));
                }
                Pattern::parse(p).map_err(|e| PolicyError::Pattern(p.clone(), e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for t in trusted {
            let (registry, mirrors) = t
                .split_once('=')
                .ok_or_else(|| PolicyError::Mirror(t.clone()))?;
            let mirrors: Vec<String> = mirrors.split(',').map(|m| m.trim().to_owned()).collect();
            if !valid_host(registry) || !mirrors.iter().all(|m| valid_host(m)) {
                return Err(PolicyError::Mirror(t.clone()));
            }
            map.entry(registry_key(registry).to_owned())
                .or_default()
                .extend(mirrors);
        }
        let scope = (scope || !map.is_empty()).then(|| Scope {
            trusted: map,
            hosts: hosts_dir
                .map(|d| std::env::split_paths(&d).collect::<Vec<PathBuf>>())
                .filter(|roots| !roots.is_empty())
                .map(|roots| Arc::new(Hosts::new(roots))),
        });
        Ok(ProxyPolicy { fill, scope })
    }

    /// containerd's hosts directories, when the scope reads them: the proxy watches them.
    pub fn hosts(&self) -> Option<&Arc<Hosts>> {
        self.scope.as_ref().and_then(|s| s.hosts.as_ref())
    }

    /// Whether the policy changes anything at all.
    pub fn is_off(&self) -> bool {
        self.fill.is_empty() && self.scope.is_none()
    }

    /// The fill pattern that names `image` (a normalized image name), if any: as
    /// `matchImages` matches, but a pattern's path names whole segments (`r/team-p` fills
    /// `r/team-p/app`, never `r/team-private/app`): a fill gives the node's credential away.
    pub fn fill_pattern(&self, image: &str) -> Option<&str> {
        let target = Target::from_image_name(image);
        self.fill
            .iter()
            .find(|p| p.matches_whole_segments(&target))
            .map(Pattern::as_str)
    }

    /// Whether fill is on at all.
    pub fn fills(&self) -> bool {
        !self.fill.is_empty()
    }

    /// What becomes of the `server_address` of a credential for an image of `registry`.
    pub fn scope(&self, registry: &str) -> Scoped {
        let Some(scope) = &self.scope else {
            return Scoped::AsSent;
        };
        let key = registry_key(registry);
        let address = format!("https://{}", runtime_host(key));
        let Some(trusted) = scope.trusted.get(key) else {
            return Scoped::Registry {
                address,
                why: format!("no mirror of {key} is trusted with its pods' credentials"),
            };
        };
        let Some(hosts) = &scope.hosts else {
            return Scoped::TrustedMirrors {
                mirrors: trusted.clone(),
            };
        };
        // The directory containerd reads is its reference's host, Docker Hub's
        // `registry-1.docker.io` unfolded: only `index.docker.io` becomes `docker.io` there.
        match hosts.view().configured_mirrors(registry) {
            Err(e) => Scoped::Registry {
                address,
                why: format!(
                    "where containerd finds its hosts is not certain: {}",
                    credgate_core::text::error_chain(&e)
                ),
            },
            Ok(configured) => {
                let untrusted: Vec<&String> =
                    configured.iter().filter(|m| !trusted.contains(m)).collect();
                if untrusted.is_empty() {
                    Scoped::TrustedMirrors {
                        mirrors: configured,
                    }
                } else {
                    Scoped::Registry {
                        address,
                        why: format!(
                            "hosts.toml names mirrors not trusted with its pods' credentials: {}",
                            untrusted
                                .iter()
                                .map(|m| m.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    }
                }
            }
        }
    }
}

/// Why a `hosts.toml` is not read as naming its mirrors with certainty.
#[derive(Debug, thiserror::Error)]
pub enum HostsTomlError {
    /// Not TOML (containerd refuses it). The parser's message only: its snippet of the file is
    /// left out.
    #[error("{}", .0.message())]
    Toml(#[source] toml::de::Error),
    #[error("both {0:?} and {1:?}: which one containerd reads is not certain")]
    TwoSpellings(String, String),
    #[error("{0} is not a {1}")]
    WrongKind(&'static str, &'static str),
}

/// The one value of `key` in `table` as containerd's TOML readers find it: go-toml v2
/// (containerd 2.x) matches a field's name whatever its case, go-toml v1 (1.6) retries it in
/// title case. Every spelling is read; two spellings of one key are refused (which one
/// containerd takes is not certain).
fn field<'t>(table: &'t toml::Table, key: &str) -> Result<Option<&'t toml::Value>, HostsTomlError> {
    let mut found = table.iter().filter(|(k, _)| k.eq_ignore_ascii_case(key));
    let first = found.next();
    if let Some((other, _)) = found.next() {
        return Err(HostsTomlError::TwoSpellings(
            first.map_or(String::new(), |(k, _)| k.clone()),
            other.clone(),
        ));
    }
    Ok(first.map(|(_, v)| v))
}

/// The mirrors a `hosts.toml` names for `registry`: `server` and every `[host."URL"]`, their
/// keys in any case (as containerd reads them). A value of the wrong kind is an error
/// (containerd refuses the file).
pub fn mirrors_in(text: &str, registry: &str) -> Result<Vec<String>, HostsTomlError> {
    let table: toml::Table = text.parse().map_err(HostsTomlError::Toml)?;
    let own = [registry_key(registry), runtime_host(registry)];
    let mut out: Vec<String> = Vec::new();
    let server = match field(&table, "server")? {
        None => None,
        Some(toml::Value::String(s)) => Some(s.as_str()),
        Some(_) => return Err(HostsTomlError::WrongKind("server", "string")),
    };
    let hosts = match field(&table, "host")? {
        None => Vec::new(),
        Some(toml::Value::Table(t)) => t.keys().map(String::as_str).collect::<Vec<_>>(),
        Some(_) => return Err(HostsTomlError::WrongKind("host", "table")),
    };
    for url in server.into_iter().chain(hosts) {
        let host = host_of(url);
        if !own.contains(&host) && !out.iter().any(|o| o == host) {
            out.push(host.to_owned());
        }
    }
    Ok(out)
}

/// Whether containerd's CRI sends a pull's credential to the image's registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// It does: no `server_address`, or one whose host is the registry's.
    Yes,
    /// It does not: why (for the pull log and `explain`).
    No(String),
}

/// What containerd's CRI (1.6 through 2.4: `ParseAuth`) does with a credential whose
/// `server_address` is `address` when it contacts `registry`'s own host: an empty address goes
/// to every host; otherwise Go's `url.Parse(address).Host` must equal the host it contacts,
/// exactly (no scheme added, no case folded), and an address that does not parse fails the
/// pull. A bare `host:port` does not parse; a bare `host` parses with no host.
pub fn sent_to_registry(address: &str, registry: &str) -> Sent {
    if address.is_empty() {
        return Sent::Yes;
    }
    let contacted = runtime_host(registry);
    match go_url_host(address) {
        Some(host) if host == contacted => Sent::Yes,
        Some("") => Sent::No(format!(
            "its server_address names no host as containerd parses it (a URL such as https://{contacted} does): containerd sent it to no registry host"
        )),
        Some(host) => Sent::No(format!(
            "its server_address names {host}: containerd sends it only there, not to {contacted}"
        )),
        None => Sent::No(
            "its server_address does not parse as a URL (Go's url.Parse): containerd sent it nowhere".into(),
        ),
    }
}

/// The `Host` Go's `url.Parse` gives `s` (empty when it has no authority); `None` where it
/// fails. Follows `net/url`: control characters fail; a scheme is a letter and then letters,
/// digits, `+`, `-`, `.` before the first `:`; without one, a first segment with `:` fails;
/// the authority follows `//`, its host after the last `@`, and a port must be digits.
fn go_url_host(s: &str) -> Option<&str> {
    if s.bytes().any(|b| b < 0x20 || b == 0x7f) {
        return None;
    }
    let s = s.split('#').next().unwrap_or(s);
    let scheme_end = s.find(':').filter(|&i| {
        let scheme = &s[..i];
        scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b))
    });
    if s.starts_with(':') {
        return None;
    }
    let rest = match scheme_end {
        Some(i) => &s[i + 1..],
        None => {
            let first = s.split('/').next().unwrap_or(s);
            if first.contains(':') {
                return None;
            }
            s
        }
    };
    let rest = rest.split('?').next().unwrap_or(rest);
    let Some(after) = rest.strip_prefix("//") else {
        return Some("");
    };
    let authority = after.split('/').next().unwrap_or(after);
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let port = if let Some(v6) = host.strip_prefix('[') {
        let (_, after) = v6.split_once(']')?;
        after
    } else {
        host.rfind(':').map_or("", |i| &host[i..])
    };
    let port_ok =
        port.is_empty() || (port.starts_with(':') && port[1..].bytes().all(|b| b.is_ascii_digit()));
    let chars_ok = host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:[]".contains(&b));
    (port_ok && chars_ok).then_some(host)
}

/// `host[:port]` of a URL (or of a bare host, as containerd also accepts).
fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.split(['/', '?', '#']).next().unwrap_or(rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hosts::host_dirs;
    use std::path::Path;

    /// containerd sends a credential to the registry only as `ParseAuth` reads its address.
    #[test]
    fn a_credential_is_sent_where_containerds_parse_auth_sends_it() {
        for (address, registry) in [
            ("", "r.example:5000"),
            ("https://r.example:5000", "r.example:5000"),
            ("http://r.example:5000/v2/", "r.example:5000"),
            ("https://user@r.example", "r.example"),
            ("https://registry-1.docker.io", "docker.io"),
            ("//r.example", "r.example"),
        ] {
            assert_eq!(sent_to_registry(address, registry), Sent::Yes, "{address}");
        }
        for (address, registry) in [
            // No scheme: a first segment with a colon does not parse, a bare host has none.
            ("r.example:5000", "r.example:5000"),
            ("r.example", "r.example"),
            ("https://index.docker.io/v1/", "docker.io"),
            ("https://R.example", "r.example"),
            ("https://other.example", "r.example"),
            ("https://r.example:5000", "r.example"),
            ("https://r.example:http", "r.example"),
            ("https://r.example\n", "r.example"),
            (":r.example", "r.example"),
        ] {
            assert!(
                matches!(sent_to_registry(address, registry), Sent::No(_)),
                "{address}"
            );
        }
    }

    /// The scope of `registry` after the hosts directories are read again (what the proxy's
    /// watcher does when they change).
    fn scope(p: &ProxyPolicy, registry: &str) -> Scoped {
        if let Some(hosts) = p.hosts() {
            hosts.reread();
        }
        p.scope(registry)
    }

    fn policy(trusted: &[&str], dir: Option<&Path>) -> ProxyPolicy {
        let trusted: Vec<String> = trusted.iter().map(|s| (*s).to_owned()).collect();
        ProxyPolicy::new(&[], true, &trusted, dir.map(Path::to_owned)).unwrap()
    }

    #[test]
    fn off_by_default_and_as_sent() {
        let p = ProxyPolicy::default();
        assert!(p.is_off());
        assert_eq!(scope(&p, "r.example"), Scoped::AsSent);
        assert_eq!(Scoped::AsSent.server_address("x"), "x");
    }

    #[test]
    fn a_registry_without_trusted_mirrors_is_pinned_to_its_runtime_host() {
        let p = policy(&[], None);
        let s = scope(&p, "docker.io");
        assert_eq!(
            s.server_address("https://elsewhere"),
            "https://registry-1.docker.io"
        );
        assert_eq!(s.as_str(), "registry-only");
        assert_eq!(
            scope(&p, "127.0.0.1:5000").server_address(""),
            "https://127.0.0.1:5000"
        );
    }

    #[test]
    fn trusted_mirrors_clear_the_address_unless_hosts_toml_names_another() {
        let dir = tempfile::tempdir().unwrap();
        let p = policy(&["r.example:5000=m1.example,m2.example"], Some(dir.path()));
        // No hosts.toml: no mirror configured, nothing to withhold.
        assert_eq!(scope(&p, "r.example:5000").server_address("x"), "");
        let d = dir.path().join("r.example:5000");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("hosts.toml"),
            "server = \"https://r.example:5000\"\n[host.\"http://m1.example\"]\ncapabilities = [\"pull\"]\n",
        )
        .unwrap();
        assert_eq!(
            scope(&p, "r.example:5000"),
            Scoped::TrustedMirrors {
                mirrors: vec!["m1.example".into()]
            }
        );
        std::fs::write(
            d.join("hosts.toml"),
            "[host.\"http://m1.example\"]\n[host.\"https://m3.example/v2\"]\n",
        )
        .unwrap();
        let s = scope(&p, "r.example:5000");
        assert_eq!(s.server_address(""), "https://r.example:5000");
        assert!(s.describe().contains("m3.example"), "{}", s.describe());
        std::fs::write(d.join("hosts.toml"), "[host.\"http://m1").unwrap();
        assert!(scope(&p, "r.example:5000")
            .describe()
            .contains("is not certain"));
    }

    /// Hosts are resolved as containerd's `hostPaths` finds them: `HOST_PORT_` before
    /// `HOST:PORT`, then `_default`; the first directory that exists decides, even one without a
    /// `hosts.toml`; in the first root of a `config_path` list that has any.
    #[test]
    fn hosts_are_found_where_containerd_finds_them() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let p = policy(&["r.example:5000=trusted.example"], Some(root));
        let write = |sub: &str, body: &str| {
            std::fs::create_dir_all(root.join(sub)).unwrap();
            std::fs::write(root.join(sub).join("hosts.toml"), body).unwrap();
        };
        let pinned = |p: &ProxyPolicy| !scope(p, "r.example:5000").server_address("").is_empty();
        // The catch-all names an untrusted mirror, and the registry has no directory.
        write("_default", "[host.\"https://evil.example\"]\n");
        assert!(pinned(&p), "{}", scope(&p, "r.example:5000").describe());
        // Its own directory, without mirrors, comes first.
        write("r.example:5000", "server = \"https://r.example:5000\"\n");
        assert!(!pinned(&p));
        // But HOST_PORT_ comes before HOST:PORT.
        write("r.example_5000_", "[host.\"https://evil.example\"]\n");
        assert!(pinned(&p));
        assert!(scope(&p, "r.example:5000")
            .describe()
            .contains("evil.example"));
        // A directory that exists decides even without a hosts.toml.
        std::fs::remove_file(root.join("r.example_5000_").join("hosts.toml")).unwrap();
        assert!(!pinned(&p));
        // A candidate that is not a directory: containerd fails; credgate is not sure.
        std::fs::remove_dir_all(root.join("r.example_5000_")).unwrap();
        std::fs::write(root.join("r.example_5000_"), "").unwrap();
        assert!(pinned(&p));
        // A config_path list: the first root holding any candidate decides.
        let first = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(first.path().join("_default")).unwrap();
        std::fs::write(
            first.path().join("_default").join("hosts.toml"),
            "[host.\"https://trusted.example\"]\n",
        )
        .unwrap();
        let list = std::env::join_paths([first.path(), root]).unwrap();
        let p = policy(&["r.example:5000=trusted.example"], Some(Path::new(&list)));
        assert_eq!(
            scope(&p, "r.example:5000"),
            Scoped::TrustedMirrors {
                mirrors: vec!["trusted.example".into()]
            }
        );
        assert_eq!(
            host_dirs(Path::new("/d"), "[::1]:5000"),
            [
                PathBuf::from("/d/[::1]_5000_"),
                PathBuf::from("/d/[::1]:5000"),
                PathBuf::from("/d/_default")
            ]
        );
    }

    /// Docker Hub's spellings read the directories containerd reads: `docker.io` and
    /// `index.docker.io` (which its reference folds into `docker.io`) read `docker.io/`;
    /// `registry-1.docker.io` reads `registry-1.docker.io/` and then `_default/`, never
    /// `docker.io/`; a port reads `HOST_PORT_/` first. Trust of `docker.io`'s mirrors never
    /// clears the address of a pull whose directory names another.
    #[test]
    fn docker_hubs_spellings_read_the_directories_containerd_reads() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let write = |sub: &str, body: &str| {
            std::fs::create_dir_all(root.join(sub)).unwrap();
            std::fs::write(root.join(sub).join("hosts.toml"), body).unwrap();
        };
        write("docker.io", "[host.\"http://trusted.example\"]\n");
        write("_default", "[host.\"http://evil.example\"]\n");
        let p = policy(&["docker.io=trusted.example"], Some(root));
        for (registry, cleared) in [
            ("docker.io", true),
            ("index.docker.io", true),
            ("registry-1.docker.io", false),
            ("registry-1.docker.io:443", false),
            ("docker.io:443", false),
            ("index.docker.io:443", false),
        ] {
            let scoped = scope(&p, registry);
            assert_eq!(
                scoped.server_address("").is_empty(),
                cleared,
                "{registry}: {}",
                scoped.describe()
            );
        }
        assert_eq!(
            scope(&p, "registry-1.docker.io").server_address(""),
            "https://registry-1.docker.io"
        );
        assert!(scope(&p, "registry-1.docker.io")
            .describe()
            .contains("evil.example"));
        assert_eq!(
            host_dirs(root, "registry-1.docker.io:443"),
            [
                root.join("registry-1.docker.io_443_"),
                root.join("registry-1.docker.io:443"),
                root.join("_default")
            ]
        );
        assert_eq!(
            host_dirs(root, "index.docker.io")[0],
            root.join("docker.io")
        );
        // registry-1.docker.io's own directory, naming only the trusted mirror, is read.
        write(
            "registry-1.docker.io",
            "[host.\"http://trusted.example\"]\n",
        );
        assert!(scope(&p, "registry-1.docker.io")
            .server_address("")
            .is_empty());
    }

    /// containerd reads hosts.toml's keys whatever their case (go-toml v2; v1's title-case
    /// retry): so does credgate, and two spellings of one key are not guessed at.
    #[test]
    fn hosts_toml_keys_are_read_in_any_case() {
        for text in [
            "SERVER = \"http://evil.example\"\n",
            "Server = \"http://evil.example\"\n",
            "server = \"http://evil.example\"\n",
            "[HOST.\"http://evil.example\"]\n",
            "[Host.\"http://evil.example\"]\n",
        ] {
            assert_eq!(
                mirrors_in(text, "r.example").unwrap(),
                ["evil.example"],
                "{text}"
            );
        }
        assert!(mirrors_in(
            "server = \"https://r.example\"\nSERVER = \"http://evil.example\"\n",
            "r.example"
        )
        .is_err());
        assert!(mirrors_in("server = 3\n", "r.example").is_err());
        assert!(mirrors_in("host = \"x\"\n", "r.example").is_err());
        assert!(mirrors_in("Server = \"https://r.example\"\n", "r.example")
            .unwrap()
            .is_empty());
    }

    #[test]
    fn docker_hub_aliases_are_one_registry() {
        let p = policy(&["index.docker.io=mirror.example"], None);
        assert_eq!(scope(&p, "docker.io").server_address("x"), "");
    }

    #[test]
    fn bad_flags_are_refused() {
        assert!(ProxyPolicy::new(&[], false, &["nomirrors".into()], None).is_err());
        assert!(ProxyPolicy::new(&[], false, &["r=m/x".into()], None).is_err());
        assert!(ProxyPolicy::new(&["*.example.com:x:y".into()], false, &[], None).is_err());
        let e = ProxyPolicy::new(&["https://r.example/team".into()], false, &[], None).unwrap_err();
        assert!(e.to_string().contains("drop https://"), "{e}");
    }

    #[test]
    fn fill_patterns_match_as_match_images() {
        let p = ProxyPolicy::new(&["*.example.com/team".into()], false, &[], None).unwrap();
        assert_eq!(
            p.fill_pattern("r.example.com/team/app"),
            Some("*.example.com/team")
        );
        assert_eq!(p.fill_pattern("r.example.com/other/app"), None);
        assert_eq!(p.fill_pattern("a.b.example.com/team/app"), None);
    }

    /// `matchImages` compares paths as string prefixes; fill compares whole segments.
    #[test]
    fn fill_patterns_name_whole_path_segments() {
        let p = ProxyPolicy::new(
            &["r.example/team-p".into(), "q.example".into()],
            false,
            &[],
            None,
        )
        .unwrap();
        assert_eq!(
            p.fill_pattern("r.example/team-p/app"),
            Some("r.example/team-p")
        );
        assert_eq!(p.fill_pattern("r.example/team-p"), Some("r.example/team-p"));
        assert_eq!(p.fill_pattern("r.example/team-private/app"), None);
        assert_eq!(p.fill_pattern("r.example/team-p2"), None);
        assert_eq!(p.fill_pattern("q.example/any/app"), Some("q.example"));
    }
}
