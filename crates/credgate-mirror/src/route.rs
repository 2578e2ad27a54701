//! What a consumer asked the mirror for: an OCI distribution read (`/v2/NAME/manifests/REF`,
//! `/blobs/DIGEST`, `/tags/list`, `/referrers/DIGEST`) of a registry the operator named, which
//! the `ns` query parameter names (containerd and its resolvers add it for a mirror) or, without
//! it, the first of them. Anything else is refused here, before a credential is looked at.

use credgate_core::reference::ImageRef;

/// A read the mirror forwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The upstream registry, as the operator named it (`docker.io` for Docker Hub).
    pub registry: String,
    /// The repository's normalized name with its registry (`docker.io/library/nginx`): what
    /// the agent's sources are asked about.
    pub image: String,
    /// The path after `/v2/`, as the upstream is asked (`library/nginx/manifests/1.27`).
    pub path: String,
    /// The query without `ns`, or empty.
    pub query: String,
}

/// Why a request is not forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotRoute {
    /// `GET /v2/`: the API version check, answered by the mirror itself.
    Ping,
    /// Not a distribution read (a push, another path).
    NotARead,
    /// A registry the operator did not name.
    NotServed(String),
}

const KINDS: [&str; 4] = ["/manifests/", "/blobs/", "/tags/list", "/referrers/"];

/// The route of `path`?`query` among `registries` (the first is the default).
pub fn route(path: &str, query: Option<&str>, registries: &[String]) -> Result<Route, NotRoute> {
    let Some(rest) = path.strip_prefix("/v2/") else {
        return Err(NotRoute::NotARead);
    };
    if rest.is_empty() {
        return Err(NotRoute::Ping);
    }
    let mut ns = None;
    let mut kept = Vec::new();
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair.strip_prefix("ns=") {
            // containerd escapes it (`127.0.0.1%3A5000`).
            Some(v) => ns = Some(percent_encoding::percent_decode_str(v).decode_utf8_lossy()),
            None => kept.push(pair),
        }
    }
    let registry = match ns {
        Some(ns) => registries
            .iter()
            .find(|r| r.eq_ignore_ascii_case(&ns))
            .ok_or_else(|| NotRoute::NotServed(ns.into_owned()))?,
        None => registries
            .first()
            .ok_or_else(|| NotRoute::NotServed(String::new()))?,
    };
    let (name, kind, tail) = KINDS
        .iter()
        .filter_map(|k| {
            rest.rfind(k)
                .map(|at| (&rest[..at], *k, &rest[at + k.len()..]))
        })
        .max_by_key(|(name, _, _)| name.len())
        .ok_or(NotRoute::NotARead)?;
    let tail_ok = match kind {
        "/tags/list" => tail.is_empty(),
        _ => {
            !tail.is_empty()
                && tail.len() <= 255
                && tail
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.:-+=".contains(&b))
        }
    };
    if !tail_ok || name.is_empty() || name.len() > 255 {
        return Err(NotRoute::NotARead);
    }
    // The name as the agent's sources know it; a name that does not parse, or that parses to
    // another repository (`..`, upper case, a tag), is not a read.
    let joined = format!("{registry}/{name}");
    let parsed = ImageRef::parse(&joined).map_err(|_| NotRoute::NotARead)?;
    if parsed.path() != name || parsed.tag().is_some() || parsed.digest().is_some() {
        return Err(NotRoute::NotARead);
    }
    let query = kept
        .into_iter()
        .filter(|p| {
            p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.:-+=%".contains(&b))
        })
        .collect::<Vec<_>>()
        .join("&");
    Ok(Route {
        registry: registry.clone(),
        image: parsed.name().to_owned(),
        path: format!("{name}{kind}{tail}"),
        query,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regs() -> Vec<String> {
        vec!["registry.example.com".into(), "docker.io".into()]
    }

    #[test]
    fn reads_of_named_registries_route() {
        let r = route(
            "/v2/library/nginx/manifests/1.27",
            Some("ns=docker.io"),
            &regs(),
        )
        .unwrap();
        assert_eq!(r.registry, "docker.io");
        assert_eq!(r.image, "docker.io/library/nginx");
        assert_eq!(r.path, "library/nginx/manifests/1.27");
        let r = route("/v2/team/app/blobs/sha256:0123abcd", None, &regs()).unwrap();
        assert_eq!(r.image, "registry.example.com/team/app");
        let r = route(
            "/v2/team/app/tags/list",
            Some("n=10&ns=registry.example.com&last=b"),
            &regs(),
        )
        .unwrap();
        assert_eq!(
            (r.path.as_str(), r.query.as_str()),
            ("team/app/tags/list", "n=10&last=b")
        );
        // A repository whose name holds a kind's word routes by the last one.
        let r = route("/v2/a/blobs/x/manifests/v1", None, &regs()).unwrap();
        assert_eq!(r.image, "registry.example.com/a/blobs/x");
    }

    #[test]
    fn anything_else_is_refused_before_a_credential() {
        assert_eq!(route("/v2/", None, &regs()), Err(NotRoute::Ping));
        assert_eq!(
            route(
                "/v2/team/app/manifests/v1",
                Some("ns=evil.example"),
                &regs()
            ),
            Err(NotRoute::NotServed("evil.example".into()))
        );
        for bad in [
            "/v2/team/app/blobs/uploads/",
            "/v2/team/../app/manifests/v1",
            "/v2/Team/app/manifests/v1",
            "/v2/team/app/manifests/v1/x",
            "/v2/team/app/manifests/",
            "/v2/team/app/tags/list/x",
            "/v1/team/app/manifests/v1",
            "/v2/team/app:v1/manifests/v1",
        ] {
            assert_eq!(route(bad, None, &regs()), Err(NotRoute::NotARead), "{bad}");
        }
    }
}
