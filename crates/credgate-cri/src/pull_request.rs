//! What a `PullImage` asks, read from the caller's request: the image, the credential it
//! carries and every secret string in it, the pod it is for.

use credgate_api::cri as wire;
use secrecy::ExposeSecret as _;

use super::policy;

/// What a `PullImage` asks: the image, and the credential it carries, to keep (and record)
/// once the runtime says it succeeded.
pub(super) struct Pull {
    pub(super) image: String,
    pub(super) repository: String,
    /// `None`: a pull without credentials (anonymous or the runtime's own).
    pub(super) credential: Option<credgate_agent::captured::PodCredential>,
    /// Whether the pull came with a pod's sandbox config.
    pub(super) in_pod: bool,
    /// The credential names another registry (`server_address`) than the image's: the
    /// runtime does not use it, and it is neither captured nor recorded.
    pub(super) other_registry: bool,
    pub(super) pod_namespace: String,
    pub(super) pod_name: String,
    /// The pull carried a credential of this provider that its registry had refused, and the
    /// proxy sent the provider's answer of now instead.
    pub(super) replaced: Option<String>,
    /// The reference parses: the pull is recorded, refused and captured as well as logged.
    pub(super) valid: bool,
    /// The credential's `server_address` as sent (kept when the proxy replaces a refused
    /// credential).
    pub(super) server_address: String,
    /// The pull came without a credential and the proxy filled in the one this source of the
    /// agent gives (`provider:NAME`, `docker-config`), for a `--cri-proxy-fill` pattern.
    pub(super) filled: Option<credgate_agent::refusal::Given>,
    /// What the credential scope did with its `server_address`.
    pub(super) scope: policy::Scoped,
    /// Every string the pull's `auth` carried (user name, password, `auth` and its decoded
    /// form, tokens): taken out of the runtime's message before it is logged, kept or shown
    /// (containerd quotes a malformed `auth` whole).
    pub(super) carried: Vec<secrecy::SecretString>,
    /// The agent pulls the image itself, on the node's behalf (`keep.rs`), and why.
    pub(super) node_image: Option<crate::outcome::Why>,
}

/// `now_ms`: when it is captured, by the agent's clock.
pub(super) fn pull_of(message: &[u8], now_ms: i64) -> Option<Pull> {
    use crate::pull_log::{capped, IMAGE, NAMESPACE, POD_NAME};
    use prost::Message as _;
    let req = wire::PullImageRequest::decode(message).ok()?;
    // Every string a caller chose is kept (and logged) within what a real one needs: a longer
    // image is no reference anyway, and a cut one ends in `…`, which no valid one holds.
    let image = capped(&req.image.map(|i| i.image).unwrap_or_default(), IMAGE);
    // A reference that does not parse is still logged, listed and counted (the runtime
    // refuses it); nothing else is done with it.
    let parsed = credgate_core::reference::ImageRef::parse(&image).ok();
    let repository = parsed
        .as_ref()
        .map_or_else(|| image.clone(), |p| p.name().to_owned());
    let other_registry = req.auth.as_ref().is_some_and(|a| {
        !a.server_address.is_empty()
            && parsed.as_ref().is_some_and(|p| {
                !credgate_core::helper::names_registry(&a.server_address, p.registry())
            })
    });
    let valid = parsed.is_some();
    let server_address = req
        .auth
        .as_ref()
        .map(|a| a.server_address.clone())
        .unwrap_or_default();
    let metadata = req.sandbox_config.and_then(|s| s.metadata);
    let in_pod = metadata.is_some();
    let pod_name = capped(metadata.as_ref().map_or("", |m| m.name.as_str()), POD_NAME);
    let namespace = capped(
        metadata.map(|m| m.namespace).unwrap_or_default().as_str(),
        NAMESPACE,
    );
    let carried = req.auth.as_ref().map(carried_by).unwrap_or_default();
    let credential = req.auth.and_then(|auth| {
        credgate_agent::captured::from_auth(
            auth.username,
            auth.password,
            &auth.auth,
            auth.identity_token,
            auth.registry_token,
        )
    });
    Some(Pull {
        image,
        repository,
        credential: credential.map(|(username, password)| {
            credgate_agent::captured::PodCredential {
                namespace: namespace.clone(),
                username,
                password,
                captured_ms: now_ms,
            }
        }),
        in_pod,
        other_registry,
        pod_namespace: namespace.clone(),
        pod_name,
        replaced: None,
        valid,
        server_address,
        filled: None,
        scope: policy::Scoped::AsSent,
        carried,
        node_image: None,
    })
}

impl Pull {
    /// Whether the pull carried anything in `auth` (even one that does not decode): never
    /// filled.
    pub(super) fn sent_auth(&self) -> bool {
        !self.carried.is_empty()
    }
}

/// The non-empty strings of `auth` that could be secret, and `auth`'s decoded bytes (as text).
fn carried_by(auth: &wire::AuthConfig) -> Vec<secrecy::SecretString> {
    use base64::Engine as _;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(auth.auth.trim())
        .ok()
        .map(|b| String::from_utf8_lossy(&b).into_owned());
    let mut decoded_parts = Vec::new();
    if let Some(d) = &decoded {
        if let Some((u, p)) = d.split_once(':') {
            decoded_parts.extend([u.to_owned(), p.to_owned()]);
        }
    }
    [
        auth.username.clone(),
        auth.password.clone(),
        auth.auth.clone(),
        auth.identity_token.clone(),
        auth.registry_token.clone(),
    ]
    .into_iter()
    .chain(decoded)
    .chain(decoded_parts)
    .filter(|s| !s.is_empty())
    .map(secrecy::SecretString::from)
    .collect()
}

/// `message` with every string the pull carried replaced by `[redacted]`, as sent and as Go's
/// `%q` quotes it; the longest first, so that a password inside `user:password` goes too.
pub(super) fn redacted(message: &str, carried: &[secrecy::SecretString]) -> String {
    let mut secrets: Vec<String> = carried
        .iter()
        .flat_map(|s| {
            let s = s.expose_secret();
            let quoted = s.replace('\\', "\\\\").replace('"', "\\\"");
            [s.to_owned(), quoted]
        })
        .collect();
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets.dedup();
    let mut out = message.to_owned();
    for s in &secrets {
        out = out.replace(s.as_str(), "[redacted]");
    }
    out
}
