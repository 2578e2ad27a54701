//! How a pull through the proxy went: the credential it went with and the runtime's answer,
//! in the words the pull log, the proxy's metrics, `Status` and `explain` share.

use credgate_agent::refusal::Given;

/// The credential a pull through the proxy went with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullAuth {
    None,
    /// One this source of the agent gives.
    Given(Given),
    /// The kubelet sent none; the proxy filled in this source's.
    Filled(Given),
    /// One no source of the agent gives: a pod's own pull secret the proxy has not captured.
    Unknown,
}

impl std::fmt::Display for PullAuth {
    /// As the pull log shows it: `none`, `captured`, `provider:NAME`, `docker-config`,
    /// `filled:provider:NAME`, `unknown`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PullAuth::None => f.write_str("none"),
            PullAuth::Given(g) => g.fmt(f),
            PullAuth::Filled(g) => write!(f, "filled:{g}"),
            PullAuth::Unknown => f.write_str("unknown"),
        }
    }
}

impl PullAuth {
    /// The API's form: what the pull went with, and the source that gave it (unspecified
    /// and empty for none and unknown).
    pub fn wire(
        &self,
    ) -> (
        credgate_api::v1::PullAuth,
        credgate_api::v1::SourceKind,
        String,
    ) {
        use credgate_api::v1::{PullAuth as Wire, SourceKind};
        match self {
            PullAuth::None => (Wire::None, SourceKind::Unspecified, String::new()),
            PullAuth::Given(g) => {
                let (kind, name) = g.wire();
                (Wire::Given, kind, name)
            }
            PullAuth::Filled(g) => {
                let (kind, name) = g.wire();
                (Wire::Filled, kind, name)
            }
            PullAuth::Unknown => (Wire::Unknown, SourceKind::Unspecified, String::new()),
        }
    }

    /// `credgate_cri_pulls_total`'s `auth` label: which kind of source, never its name.
    pub fn label(&self) -> AuthLabel {
        match self {
            PullAuth::None => AuthLabel::None,
            PullAuth::Given(g) => AuthLabel::of(g),
            PullAuth::Filled(_) => AuthLabel::Filled,
            PullAuth::Unknown => AuthLabel::Unknown,
        }
    }
}

/// The `auth` label of a pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuthLabel {
    None,
    Captured,
    DockerConfig,
    Provider,
    Filled,
    Unknown,
}

impl AuthLabel {
    /// A source's kind.
    pub fn of(given: &Given) -> AuthLabel {
        match given {
            Given::Provider(_) => AuthLabel::Provider,
            Given::DockerConfig(_) => AuthLabel::DockerConfig,
            Given::Captured(_) => AuthLabel::Captured,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AuthLabel::None => "none",
            AuthLabel::Captured => "captured",
            AuthLabel::DockerConfig => "docker_config",
            AuthLabel::Provider => "provider",
            AuthLabel::Filled => "filled",
            AuthLabel::Unknown => "unknown",
        }
    }
}

/// What the runtime's answer to a pull says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PullResult {
    Ok,
    Unauthorized,
    NotFound,
    Error,
}

impl PullResult {
    /// Read from the runtime's gRPC code and, when the code does not say, the registry's
    /// status in the message's structure (`...: 401 Unauthorized`, as Go prints a response's
    /// status after the request it answers); never from words the caller chose: the image
    /// name, which runtimes quote in the message, is left out.
    pub fn of(code: i32, message: &str) -> PullResult {
        match code {
            0 => PullResult::Ok,
            // NOT_FOUND
            5 => PullResult::NotFound,
            // PERMISSION_DENIED, UNAUTHENTICATED
            7 | 16 => PullResult::Unauthorized,
            _ => {
                let m = unquoted(message).to_ascii_lowercase();
                if [
                    ": 401 unauthorized",
                    ": 403 forbidden",
                    "pull access denied",
                ]
                .iter()
                .any(|s| m.contains(s))
                {
                    PullResult::Unauthorized
                } else if m.contains(": 404 not found") || m.contains(": not found") {
                    PullResult::NotFound
                } else {
                    PullResult::Error
                }
            }
        }
    }

    /// The API's form.
    pub fn wire(self) -> credgate_api::v1::PullResult {
        use credgate_api::v1::PullResult as Wire;
        match self {
            PullResult::Ok => Wire::Ok,
            PullResult::Unauthorized => Wire::Unauthorized,
            PullResult::NotFound => Wire::NotFound,
            PullResult::Error => Wire::Error,
        }
    }

    /// The metric label: the API's word for it.
    pub fn as_str(self) -> &'static str {
        self.wire().word()
    }
}

/// `message` without what it quotes (`"..."`, with Go's `\"` escapes): runtimes quote the
/// image name a caller chose.
fn unquoted(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let (mut quoted, mut escaped) = (false, false);
    for c in message.chars() {
        match (quoted, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => quoted = !quoted,
            (false, _, c) => out.push(c),
            (true, false, _) => {}
        }
    }
    out
}

credgate_engine::label_values!(AuthLabel, PullResult, Why);

/// Why the node keeps an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Why {
    /// The runtime's sandbox image, which it pulls itself with no credential when a pod starts.
    Sandbox,
    /// The operator named it (`--cri-proxy-keep-image`).
    Kept,
}

impl Why {
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Sandbox => "sandbox",
            Why::Kept => "kept",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{unquoted, PullResult};

    #[test]
    fn answers_are_classified_by_code_and_the_registrys_status_only() {
        for (code, message, class) in [
            // containerd 1.6 and 2.x, a Basic registry refusing the credential.
            (
                2,
                r#"failed to pull and unpack image "127.0.0.1:5000/team/app:v1": failed to resolve reference "127.0.0.1:5000/team/app:v1": pulling from host 127.0.0.1:5000 failed with status code [manifests v1]: 401 Unauthorized"#,
                "unauthorized",
            ),
            (
                2,
                r#"failed to pull and unpack image "r.example/a:v1": failed to resolve image: unexpected status from HEAD request to http://r.example/v2/a/manifests/v1: 403 Forbidden"#,
                "unauthorized",
            ),
            // A token realm refusing it.
            (
                2,
                r#"failed to resolve reference "docker.io/x/y:v1": failed to authorize: failed to fetch oauth token: unexpected status from POST request to https://auth.docker.io/token: 401 Unauthorized"#,
                "unauthorized",
            ),
            // Docker Hub's answer for a repository that does not exist or may not be read.
            (
                2,
                r#"failed to resolve reference "docker.io/x/typo:v1": pull access denied, repository does not exist or may require authorization: server message: insufficient_scope: authorization failed"#,
                "unauthorized",
            ),
            (16, "anything", "unauthorized"),
            (7, "anything", "unauthorized"),
            // A missing tag whose name holds words of a refusal.
            (
                5,
                r#"failed to pull and unpack image "r.example/team-a/app:gone-403": failed to resolve reference "r.example/team-a/app:gone-403": r.example/team-a/app:gone-403: not found"#,
                "not_found",
            ),
            (
                2,
                r#"failed to resolve reference "r.example/denied/unauthorized-401:x-403": unexpected status from HEAD request to http://r.example/v2/denied/unauthorized-401/manifests/x-403: 404 Not Found"#,
                "not_found",
            ),
            (
                2,
                r#"failed to pull "r.example/a:401-unauthorized-denied": connection refused"#,
                "error",
            ),
            (2, "invalid reference format", "error"),
        ] {
            assert_eq!(PullResult::of(code, message).as_str(), class, "{message}");
        }
        assert_eq!(unquoted(r#"a "b \" c" d"#), "a  d");
    }
}
