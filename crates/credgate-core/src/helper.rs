//! The input of a docker credential helper's `get`: a server URL on stdin, which clients send
//! as a bare `host[:port]` (skopeo, podman) or as a URL (`https://index.docker.io/v1/`).

use crate::pattern::{parse_schemeless, PatternError};

/// The most `get` reads from stdin; a server URL is a few dozen bytes.
pub const MAX_INPUT: usize = 8 * 1024;
/// The most `store` and `erase` read from stdin (a JSON document with a secret, or a URL).
pub const MAX_STORE_INPUT: usize = 64 * 1024;

/// Why the input of `get` is not a server URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HelperInputError {
    #[error("no server URL on stdin")]
    Empty,
    #[error("the server URL on stdin is longer than {MAX_INPUT} bytes")]
    TooLong,
    #[error("the server URL on stdin is not UTF-8")]
    NotUtf8,
    #[error("the server URL on stdin is not a registry host: {0}")]
    Invalid(PatternError),
    #[error("the server URL on stdin has port {}, not a port (1 to 65535)", crate::text::Quoted(.0))]
    BadPort(String),
}

/// A parsed `get` request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerUrl<'a> {
    /// The input, trimmed: echoed back as `ServerURL`.
    pub url: &'a str,
    /// The registry `host[:port]` to look credentials up for.
    pub host: &'a str,
}

/// Parses the stdin of `get`: `https://index.docker.io/v1/` → host `docker.io` (every Docker
/// Hub server name is), `127.0.0.1:5000` unchanged.
pub fn parse_get(input: &[u8]) -> Result<ServerUrl<'_>, HelperInputError> {
    if input.len() > MAX_INPUT {
        return Err(HelperInputError::TooLong);
    }
    let url = std::str::from_utf8(input)
        .map_err(|_| HelperInputError::NotUtf8)?
        .trim();
    // Schemes are case-insensitive (`HTTPS://host` is a URL, not host "HTTPS:").
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    let rest = if lower.starts_with("https://") {
        &url[8..]
    } else if lower.starts_with("http://") {
        &url[7..]
    } else {
        url
    };
    let host = rest.split('/').next().unwrap_or_default();
    if host.is_empty() {
        return Err(HelperInputError::Empty);
    }
    let parsed = parse_schemeless(host).map_err(HelperInputError::Invalid)?;
    if let Some((_, port)) = parsed
        .authority
        .rsplit_once(':')
        .filter(|_| !host.ends_with(']'))
    {
        if !port.is_empty() && port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(HelperInputError::BadPort(port.to_owned()));
        }
    }
    Ok(ServerUrl {
        url,
        host: docker_hub(host),
    })
}

/// Whether a CRI `AuthConfig.server_address` (`registry.example.com:5000`,
/// `https://index.docker.io/v1/`) names `registry`, the host of an image reference (`docker.io`
/// for Docker Hub): the same host after normalization, ignoring scheme, path and case. An
/// address that is not a registry host names nothing.
pub fn names_registry(server_address: &str, registry: &str) -> bool {
    parse_get(server_address.as_bytes()).is_ok_and(|u| u.host.eq_ignore_ascii_case(registry))
}

/// Docker Hub's server names as clients send them (the docker CLI and SDK ask for
/// `https://index.docker.io/v1/`), as the name images and providers use: `docker.io`.
fn docker_hub(host: &str) -> &str {
    match host.to_ascii_lowercase().as_str() {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" | "docker.io" => {
            crate::reference::DEFAULT_DOMAIN
        }
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(s: &str) -> Result<&str, HelperInputError> {
        parse_get(s.as_bytes()).map(|u| u.host)
    }

    #[test]
    fn server_addresses_name_their_registry_only() {
        for (address, registry) in [
            ("registry.example.com", "registry.example.com"),
            ("https://registry.example.com/v2/", "registry.example.com"),
            ("REGISTRY.example.com:5000", "registry.example.com:5000"),
            ("https://index.docker.io/v1/", "docker.io"),
            ("registry-1.docker.io", "docker.io"),
        ] {
            assert!(names_registry(address, registry), "{address} {registry}");
        }
        for (address, registry) in [
            ("registry.example.com", "other.example.com"),
            ("registry.example.com:5000", "registry.example.com"),
            ("registry.example.com", "registry.example.com:5000"),
            ("https://index.docker.io/v1/", "quay.io"),
            ("", "registry.example.com"),
            ("not a host", "registry.example.com"),
        ] {
            assert!(!names_registry(address, registry), "{address} {registry}");
        }
    }

    /// A scheme in capitals is still a scheme; a port past 65535 (or 0) is no port.
    #[test]
    fn schemes_in_any_case_and_ports_out_of_range() {
        assert_eq!(
            host("HTTP://registry.example.com"),
            Ok("registry.example.com")
        );
        assert_eq!(
            host("Https://registry.example.com:5000/v2/"),
            Ok("registry.example.com:5000")
        );
        assert_eq!(
            host("registry.example.com:411610"),
            Err(HelperInputError::BadPort("411610".into()))
        );
        assert!(matches!(
            host("registry.example.com:0"),
            Err(HelperInputError::BadPort(_))
        ));
        assert_eq!(host("[::1]:5000"), Ok("[::1]:5000"));
    }

    #[test]
    fn server_urls_become_hosts() {
        assert_eq!(host("127.0.0.1:5000\n"), Ok("127.0.0.1:5000"));
        assert_eq!(host("https://index.docker.io/v1/"), Ok("docker.io"));
        assert_eq!(host("index.docker.io"), Ok("docker.io"));
        assert_eq!(host("https://registry-1.docker.io"), Ok("docker.io"));
        assert_eq!(host("registry.hub.docker.com"), Ok("docker.io"));
        assert_eq!(
            parse_get(b"https://index.docker.io/v1/").unwrap().url,
            "https://index.docker.io/v1/",
            "the ServerURL is echoed as the client sent it"
        );
        assert_eq!(host("http://reg.example:8080/x"), Ok("reg.example:8080"));
        assert_eq!(host("  quay.io  "), Ok("quay.io"));
        assert_eq!(
            parse_get(b" https://quay.io/ \n").unwrap().url,
            "https://quay.io/"
        );
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        assert_eq!(host(""), Err(HelperInputError::Empty));
        assert_eq!(host("\n"), Err(HelperInputError::Empty));
        assert_eq!(host("https://"), Err(HelperInputError::Empty));
        assert_eq!(parse_get(b"\xff\xfe"), Err(HelperInputError::NotUtf8));
        assert_eq!(
            parse_get(&vec![b'a'; MAX_INPUT + 1]),
            Err(HelperInputError::TooLong)
        );
        assert!(matches!(
            host("reg\u{7f}.example"),
            Err(HelperInputError::Invalid(_))
        ));
        assert!(matches!(
            host("reg.example:port"),
            Err(HelperInputError::Invalid(_))
        ));
    }
}
