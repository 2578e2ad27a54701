//! The CRI image-service proxy: the kubelet's `--image-service-endpoint` points at the agent,
//! which forwards every call to the container runtime and returns its answer unchanged.
//!
//! Calls pass through as HTTP/2 requests, their bodies and answers streamed frame by frame and
//! never decoded, so a method credgate has no code for (a newer kubelet's) reaches the runtime
//! as it is, and the runtime's status codes and messages come back as they are. The runtime
//! unreachable: `UNAVAILABLE` with what failed. A call never outlives the caller's own
//! deadline (`grpc-timeout`).

use crate::tasks::CancellationToken;
use std::convert::Infallible;
use std::path::PathBuf;
use std::time::Duration;

use credgate_api::cri::{
    self as wire, PULL_IMAGE, PULL_IMAGE_V1ALPHA2, REMOVE_IMAGE, REMOVE_IMAGE_V1ALPHA2,
};
use http_body_util::BodyExt;
use hyper::body::{Bytes, Incoming};
use secrecy::ExposeSecret as _;
use tokio::net::UnixListener;

use crate::listener::{Counted, Listener, ListenerLimits, Tracker};
use crate::status::ApiError;

mod budget;
mod capture;
mod decision;
pub mod policy;
mod runtime;
use budget::Budgets;
use capture::Capturer;
use runtime::{
    ask, broken_runtime, exchange, framed, grpc_message, read_whole, status, unreachable_runtime,
    Caller, Runtime,
};

/// A body of either side.
type Body =
    http_body_util::combinators::UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// The largest header block a caller may send.
const MAX_HEADER_LIST: u32 = 64 << 10;

/// The longest a call may take when the caller sets no deadline.
const DEFAULT_DEADLINE: Duration = Duration::from_secs(300);

/// `unix:///run/containerd/containerd.sock` (or a bare path) as a socket path.
pub fn endpoint_path(endpoint: &str) -> PathBuf {
    PathBuf::from(endpoint.strip_prefix("unix://").unwrap_or(endpoint))
}

/// The caller's deadline from `grpc-timeout` (`120S`, `500m`, ...).
fn deadline(headers: &hyper::HeaderMap) -> Duration {
    let Some(v) = headers.get("grpc-timeout").and_then(|v| v.to_str().ok()) else {
        return DEFAULT_DEADLINE;
    };
    let (n, unit) = v.split_at(v.len().saturating_sub(1));
    let Ok(n) = n.parse::<u64>() else {
        return DEFAULT_DEADLINE;
    };
    match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => DEFAULT_DEADLINE,
    }
}

/// The most of a `PullImage` or `RemoveImage` answer, or a `RemoveImage` request, the proxy
/// buffers (all small messages).
const MAX_PULL_MESSAGE: usize = 1 << 20;
/// The largest `PullImage` request: a reference, a credential of a few KiB and the pod's
/// sandbox config (whose annotations Kubernetes bounds at 256 KiB), far below a connection's
/// budget, so that one pull never holds what the next pull needs.
pub const MAX_PULL_REQUEST: usize = 512 << 10;
/// The most of a `ListImages` answer the proxy reads for itself: containerd's own default
/// limit for a gRPC message.
const MAX_LIST_MESSAGE: usize = 16 << 20;

/// The repositories an image is known by (from its tags and digests).
fn repositories(image: &wire::Image) -> Vec<String> {
    let mut out: Vec<String> = image
        .repo_tags
        .iter()
        .chain(&image.repo_digests)
        .filter_map(|r| credgate_core::reference::ImageRef::parse(r).ok())
        .map(|r| r.name().to_owned())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// A `RemoveImage`: the image's repositories are read first (the request may name it by ID);
/// when the runtime removed it, a repository of which it has no image left loses its
/// captured credential.
async fn remove(
    caller: &Caller,
    capture: &Capture,
    request: hyper::Request<Incoming>,
) -> hyper::Response<Body> {
    use prost::Message as _;
    let (parts, bytes, _taken) =
        match read_whole(caller, request, "RemoveImage", MAX_PULL_MESSAGE).await {
            Ok(read) => read,
            Err(refused) => return refused,
        };
    let named = grpc_message(&bytes)
        .and_then(|m| wire::RemoveImageRequest::decode(m).ok())
        .and_then(|r| r.image);
    let before: Vec<String> = match named {
        Some(spec) => ask::<_, wire::ImageStatusResponse>(
            caller,
            wire::IMAGE_STATUS,
            &wire::ImageStatusRequest { image: Some(spec) },
            MAX_PULL_MESSAGE,
        )
        .await
        .and_then(|s| s.image)
        .map(|i| repositories(&i))
        .unwrap_or_default(),
        None => Vec::new(),
    };
    let whole = match exchange(caller, parts, bytes, MAX_PULL_MESSAGE).await {
        Ok(whole) => whole,
        Err(refused) => return refused,
    };
    if whole.code() == Some(0) && !before.is_empty() {
        // The runtime's image list is read from the proxy's own budget, not the caller's.
        forget_absent(&capture.own, &capture.captured, before).await;
    }
    whole.into_response()
}

/// Drops the captured credentials of those `repositories` the runtime has no image of any
/// more; when its image list cannot be read, nothing.
async fn forget_absent(
    caller: &Caller,
    captured: &std::sync::Arc<crate::captured::Captured>,
    candidates: Vec<String>,
) {
    let Some(left) = ask::<_, wire::ListImagesResponse>(
        caller,
        wire::LIST_IMAGES,
        &wire::ListImagesRequest {},
        MAX_LIST_MESSAGE,
    )
    .await
    else {
        return;
    };
    let remaining: Vec<String> = left.images.iter().flat_map(repositories).collect();
    let gone: Vec<String> = candidates
        .into_iter()
        .filter(|r| !remaining.contains(r))
        .collect();
    if gone.is_empty() {
        return;
    }
    // The sealed file is rewritten and fsynced: on a blocking thread, never on the ones that
    // forward calls.
    let captured = captured.clone();
    let _ = tokio::task::spawn_blocking(move || {
        for repo in gone {
            match captured.forget(&repo) {
                Ok(true) => {
                    tracing::info!(repository = %repo, "captured pull credentials dropped: the runtime has no image of the repository")
                }
                Ok(false) => {}
                Err(e) => tracing::error!(error = %e, "cannot drop captured pull credentials"),
            }
        }
    })
    .await;
}

/// What a `PullImage` asks: the image, and the credential it carries, to keep (and record)
/// once the runtime says it succeeded.
struct Pull {
    image: String,
    repository: String,
    /// `None`: a pull without credentials (anonymous or the runtime's own).
    credential: Option<crate::captured::Credential>,
    /// Whether the pull came with a pod's sandbox config.
    in_pod: bool,
    /// The credential names another registry (`server_address`) than the image's: the
    /// runtime does not use it, and it is neither captured nor recorded.
    other_registry: bool,
    pod_namespace: String,
    pod_name: String,
    /// The pull carried a credential of this provider that its registry had refused, and the
    /// proxy sent the provider's answer of now instead.
    replaced: Option<String>,
    /// The reference parses: the pull is recorded, refused and captured as well as logged.
    valid: bool,
    /// The credential's `server_address` as sent (kept when the proxy replaces a refused
    /// credential).
    server_address: String,
    /// The pull came without a credential and the proxy filled in the one this source of the
    /// agent gives (`provider:NAME`, `docker-config`), for a `--cri-proxy-fill` pattern.
    filled: Option<String>,
    /// What the credential scope did with its `server_address`.
    scope: &'static str,
}

/// `now_ms`: when it is captured, by the agent's clock.
fn pull_of(message: &[u8], now_ms: i64) -> Option<Pull> {
    use prost::Message as _;
    let req = wire::PullImageRequest::decode(message).ok()?;
    let image = req.image.map(|i| i.image).unwrap_or_default();
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
    let pod_name = metadata
        .as_ref()
        .map(|m| m.name.clone())
        .unwrap_or_default();
    let namespace = metadata.map(|m| m.namespace).unwrap_or_default();
    let credential = req.auth.and_then(|auth| {
        crate::captured::from_auth(
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
        credential: credential.map(|(username, password)| crate::captured::Credential {
            namespace: namespace.clone(),
            username,
            password,
            captured_ms: now_ms,
        }),
        in_pod,
        other_registry,
        pod_namespace: namespace.clone(),
        pod_name,
        replaced: None,
        valid,
        server_address,
        filled: None,
        scope: policy::Scoped::AsSent.as_str(),
    })
}

/// How long a pull's answer waits for its capture to be confirmed by the registry and on
/// disk; past it the answer goes back and the capture goes on (counted as late).
pub const CAPTURE_WAIT: Duration = Duration::from_secs(2);

/// A pull that carries a credential its registry refused, from a provider of the agent (the
/// kubelet keeps what the bridge gave it for the `cacheDuration` it got): the same request
/// with that provider's answer of now instead (its plugin runs when its refused answer was
/// dropped), as a gRPC frame. `None`, and the request goes as it came, for any other pull, or
/// when the provider has no other credential for the image.
async fn refreshed(agent: &crate::Agent, pull: &mut Pull, frame: &[u8]) -> Option<Bytes> {
    let sent = pull.credential.as_ref()?;
    let now = agent.clock().now();
    let crate::refusal::Given::Provider(provider) =
        agent
            .refusals()
            .known(&sent.username, sent.password.expose_secret(), now)?
    else {
        return None;
    };
    let lookup = agent
        .engine()
        .lookup(&credgate_engine::LookupRequest {
            image: &pull.image,
            provider: Some(&provider),
            ..Default::default()
        })
        .await
        .ok()?;
    let fresh = lookup.credentials.into_iter().find(|c| {
        !(c.username == sent.username
            && c.password.expose_secret() == sent.password.expose_secret())
    })?;
    let replaced = wire::with_pull_auth(
        grpc_message(frame)?,
        &wire::AuthConfig {
            username: fresh.username.clone(),
            password: fresh.password.expose_secret().to_owned(),
            server_address: pull.server_address.clone(),
            ..Default::default()
        },
    )?;
    let frame = framed(&replaced)?;
    tracing::info!(image = %pull.image, provider = %provider, "a pull carried a credential the registry refused: provider {provider}'s answer of now is sent instead");
    if let Some(c) = pull.credential.as_mut() {
        c.username = fresh.username;
        c.password = fresh.password;
    }
    pull.replaced = Some(provider);
    Some(frame)
}

/// The operator's policy ([`policy`]) applied to a pull: one that came without a credential,
/// for an image a fill pattern names, gets the first credential the agent's sources give for
/// it (never a service-account-keyed provider's, never a captured pod credential); the
/// credential's `server_address` is scoped. `None`, and the request goes as it is, when the
/// policy changes nothing.
async fn apply_policy(agent: &crate::Agent, pull: &mut Pull, frame: &[u8]) -> Option<Bytes> {
    use prost::Message as _;
    let policy = agent.pull_policy();
    if policy.is_off() || pull.other_registry {
        // A credential named for another registry is not the image's: the runtime does not
        // use it, and the policy does not make it usable.
        return None;
    }
    let parsed = credgate_core::reference::ImageRef::parse(&pull.image).ok()?;
    // Decoded from the frame as it is now: a refused credential may have been replaced.
    let message = grpc_message(frame)?;
    let sent = wire::PullImageRequest::decode(message).ok()?.auth;
    let mut auth = match (&pull.credential, sent) {
        (Some(_), Some(auth)) => auth,
        (Some(_), None) => return None,
        (None, _) => {
            let pattern = policy.fill_pattern(parsed.name())?;
            let Some((source, credential)) = fill(agent, &pull.image).await else {
                tracing::info!(image = %pull.image, pattern, "a pull without credentials is not filled: no source of the agent gives a credential for it");
                return None;
            };
            let auth = wire::AuthConfig {
                username: credential.username.clone(),
                password: credential.password.expose_secret().to_owned(),
                ..Default::default()
            };
            pull.credential = Some(crate::captured::Credential {
                namespace: pull.pod_namespace.clone(),
                username: credential.username,
                password: credential.password,
                captured_ms: 0,
            });
            pull.filled = Some(source);
            auth
        }
    };
    let scoped = policy.scope(parsed.registry());
    pull.scope = scoped.as_str();
    let address = scoped.server_address(&auth.server_address);
    if pull.filled.is_none() && address == auth.server_address {
        return None;
    }
    if let policy::Scoped::Registry { why, .. } = &scoped {
        tracing::debug!(image = %pull.image, why = %why, "the pull's credential is scoped to its registry");
    }
    auth.server_address = address;
    framed(&wire::with_pull_auth(message, &auth)?)
}

/// The credential a pull without one is filled with: the first the agent's sources give for
/// `image` in their try-order (the same cache and runs as a Lookup), but none of a provider
/// keyed by service account (the CRI carries no identity to ask with). With the source's
/// name for the log.
async fn fill(agent: &crate::Agent, image: &str) -> Option<(String, credgate_engine::Credential)> {
    let engine = agent.engine();
    let lookup = engine
        .lookup(&credgate_engine::LookupRequest {
            image,
            ..Default::default()
        })
        .await
        .ok()?;
    let credential = lookup.credentials.into_iter().find(|c| match &c.source {
        credgate_engine::Source::Provider(name) => !engine.keyed_by_service_account(name),
        credgate_engine::Source::DockerConfig(_) => true,
    })?;
    let source = crate::refusal::Given::from(credential.source.clone()).auth();
    Some((source, credential))
}

/// Which of the agent's sources gave the pull's credential (or, when none does now, the one a
/// refusal of it remembers), found once for the log, a refusal and capture; and whether a
/// provider or a docker config gives it now (the node's own credential, not a pod's).
fn sources_of(agent: &crate::Agent, pull: &Pull) -> (Vec<crate::refusal::Given>, bool) {
    let Some(c) = &pull.credential else {
        return (Vec::new(), false);
    };
    let password = c.password.expose_secret();
    let now =
        crate::refusal::given_now(agent, &pull.image, &pull.repository, &c.username, password);
    let own = now
        .iter()
        .any(|g| !matches!(g, crate::refusal::Given::Captured(_)));
    (
        crate::refusal::or_known(agent, now, &c.username, password),
        own,
    )
}

/// The runtime says the registry refused the pull's credential: when one of the agent's
/// sources gave it, it is refused ([`crate::refusal`]); a pod's own secret changes nothing.
async fn refused(agent: &crate::Agent, pull: &Pull, given: &[crate::refusal::Given]) {
    let Some(c) = &pull.credential else { return };
    if given.is_empty() {
        return;
    }
    crate::refusal::refuse(
        agent,
        &pull.image,
        &pull.repository,
        &c.username,
        &c.password,
        given,
        "a pull through the CRI proxy",
    )
    .await;
}

/// How the image access guard records a pull: a pull with a credential as a secret of the
/// pod's namespace named after its content (`PullImage` carries no secret name; the guard
/// matches by content across names anyway); one without as node-wide. A pull with a
/// credential but no pod is never recorded as node-wide: its result is not recorded at all,
/// and the intent keeps the image requiring authentication.
fn recorded_as(pull: &Pull, guard: &crate::guard::Guard) -> Option<crate::guard::CredentialIn> {
    use crate::guard::CredentialIn;
    match &pull.credential {
        // Filled by the proxy with the node's credential: as the kubelet records a pull with
        // a credential provider's (no service account) or its config.json's.
        None => Some(CredentialIn::NodeWide),
        Some(_) if pull.filled.is_some() => Some(CredentialIn::NodeWide),
        Some(_) if !pull.in_pod || pull.other_registry => None,
        Some(c) => Some(CredentialIn::Secret {
            coords: credgate_core::guard::Coords {
                namespace: c.namespace.clone(),
                // Without the node key no name, and `record_result` refuses the record for
                // the missing key, as it does any secret then.
                name: guard
                    .unnamed_secret(&c.username, &c.password)
                    .unwrap_or_default(),
                uid: String::new(),
            },
            username: c.username.clone(),
            password: c.password.clone(),
        }),
    }
}

/// A `PullImage`: read whole (bounded), forwarded, its answer read whole, then logged
/// ([`decision`]), recorded by the guard (when it is on) and, when the runtime says it
/// succeeded, the credential it carried for the image's registry offered for capture (when
/// capture is on; confirmed with the registry and written after the answer goes back).
async fn pull(
    caller: &Caller,
    pulls: &Pulls,
    request: hyper::Request<Incoming>,
) -> hyper::Response<Body> {
    let (mut parts, mut bytes, taken) =
        match read_whole(caller, request, "PullImage", MAX_PULL_REQUEST).await {
            Ok(read) => read,
            Err(refused) => return refused,
        };
    let now_ms = crate::state::unix_ms(pulls.agent.clock().wall());
    let mut asked = grpc_message(&bytes).and_then(|m| pull_of(m, now_ms));
    if let Some(pull) = asked.as_mut().filter(|p| p.valid) {
        if let Some(frame) = refreshed(&pulls.agent, pull, &bytes).await {
            parts.headers.remove(hyper::header::CONTENT_LENGTH);
            bytes = frame;
        }
        if let Some(frame) = apply_policy(&pulls.agent, pull, &bytes).await {
            parts.headers.remove(hyper::header::CONTENT_LENGTH);
            bytes = frame;
        }
    }
    // The intent is on disk before the runtime starts pulling.
    if let (Some(guard), Some(pull)) = (&pulls.guard, asked.as_ref().filter(|p| p.valid)) {
        if let Err(e) = guard.record_intent(&pull.image).await {
            tracing::error!(error = %crate::error_chain(&e), "pull intent not recorded");
        }
    }
    // The request goes to the runtime as soon as the pull is forwarded: what it held of the
    // caller's budget is given back now, not when the pull ends (a registry that stalls would
    // otherwise let a few slow pulls hold the connection's whole budget).
    drop(taken);
    let started = std::time::Instant::now();
    let whole = match exchange(caller, parts, bytes, MAX_PULL_MESSAGE).await {
        Ok(whole) => whole,
        Err(refused) => return refused,
    };
    let Some(pull) = asked else {
        return whole.into_response();
    };
    let code = whole.code().unwrap_or(2);
    let message = whole.message();
    let (given, own) = sources_of(&pulls.agent, &pull);
    decision::log(
        &pulls.agent,
        &pull,
        &given,
        code,
        &message,
        started.elapsed(),
    );
    if pull.valid {
        if crate::pulls::result_of(code, &message) == "unauthorized" {
            refused(&pulls.agent, &pull, &given).await;
        }
        settle(pulls, pull, own, &whole).await;
    }
    whole.into_response()
}

/// What a forwarded pull leaves once the runtime answered: the guard's record of its result
/// (with the guard), its credential's capture when it succeeded (with capture), on disk before
/// the answer goes back (bounded by [`CAPTURE_WAIT`]).
/// `own`: the credential is the node's (see [`sources_of`]), never captured as a pod's.
async fn settle(pulls: &Pulls, pull: Pull, own: bool, whole: &runtime::Whole) {
    use prost::Message as _;
    let image_ref = (whole.code() == Some(0))
        .then(|| grpc_message(&whole.data))
        .flatten()
        .and_then(|m| wire::PullImageResponse::decode(m).ok())
        .map(|r| r.image_ref)
        .filter(|r| !r.is_empty());
    if let Some(guard) = &pulls.guard {
        let used = recorded_as(&pull, guard);
        let result = match (&image_ref, &used) {
            (Some(id), Some(used)) => guard.record_result(&pull.image, id, true, Some(used)).await,
            (Some(_), None) => Ok(()),
            (None, _) => guard.record_result(&pull.image, "", false, None).await,
        };
        if let Err(e) = result {
            tracing::error!(error = %crate::error_chain(&e), "pull result not recorded");
        }
    }
    let (Some(_), Some(credential), Some(capture)) = (&image_ref, pull.credential, &pulls.capture)
    else {
        return;
    };
    if pull.other_registry {
        pulls.agent.metrics().capture("other_registry");
        tracing::warn!(repository = %pull.repository, "pull credentials not captured: their server address names another registry");
        return;
    }
    if own {
        // The node's own credential (the kubelet got it from a provider through the bridge,
        // or from a docker config): not a pod's secret, and a copy would outlive the
        // provider's rotation of it.
        pulls.agent.metrics().capture("own_source");
        return;
    }
    let repository = pull.repository.clone();
    if let Some(settled) = capture
        .capturer
        .offer(pull.image, pull.repository, credential)
    {
        // Acknowledged means kept: a crash right after the answer loses no confirmed capture.
        // A registry slow to confirm holds the answer only so long.
        if tokio::time::timeout(CAPTURE_WAIT, settled).await.is_err() {
            pulls.agent.metrics().cri_captures_late.inc();
            tracing::warn!(repository = %repository, "the pull is answered before its credential's capture is confirmed: the registry did not confirm it within {CAPTURE_WAIT:?}; the capture goes on");
        }
    }
}

/// What the proxy does with pulls besides forwarding them, each part independent of the
/// others: the decision log (always), the guard's records (with the guard), capture (with
/// captured credentials).
struct Pulls {
    /// Its metrics, and for the pull decision log its engine, clock and pull ring.
    agent: crate::Agent,
    guard: Option<crate::guard::Guard>,
    capture: Option<Capture>,
}

/// What the proxy captures with: where captures are kept, the task that confirms and writes
/// them.
struct Capture {
    captured: std::sync::Arc<crate::captured::Captured>,
    capturer: Capturer,
    /// The proxy's own calls to the runtime (its image list), on a budget of their own.
    own: std::sync::Arc<Caller>,
}

/// Forwards one call to the runtime.
async fn forward(
    caller: &Caller,
    pulls: &Pulls,
    request: hyper::Request<Incoming>,
) -> hyper::Response<Body> {
    let limit = deadline(request.headers());
    let runtime = &caller.runtime;
    let call = async {
        // v1alpha2's messages have v1's fields: its pulls are logged, recorded and captured
        // as v1's are.
        match (request.uri().path(), &pulls.capture) {
            (PULL_IMAGE | PULL_IMAGE_V1ALPHA2, _) => return pull(caller, pulls, request).await,
            (REMOVE_IMAGE | REMOVE_IMAGE_V1ALPHA2, Some(capture)) => {
                return remove(caller, capture, request).await
            }
            _ => {}
        }
        let mut sender = match runtime.sender().await {
            Ok(s) => s,
            Err(e) => return unreachable_runtime(runtime, &e),
        };
        let (parts, body) = request.into_parts();
        let outbound =
            hyper::Request::from_parts(parts, body.map_err(|e| Box::new(e) as _).boxed_unsync());
        match sender.send_request(outbound).await {
            Ok(answer) => answer.map(|b| b.map_err(|e| Box::new(e) as _).boxed_unsync()),
            Err(e) => broken_runtime(&e),
        }
    };
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => answer,
        Err(_) => status(ApiError::Deadline(
            "credgate: the container runtime did not answer within the caller's deadline".into(),
        )),
    }
}

/// How the proxy runs.
pub struct ProxyOptions {
    /// The runtime's socket.
    pub runtime: PathBuf,
    /// Where pull credentials are captured; none captured when `None`.
    pub captured: Option<std::sync::Arc<crate::captured::Captured>>,
    /// The image access guard the pulls are recorded in, when it is enabled.
    pub guard: Option<crate::guard::Guard>,
    /// The listener's budget and deadlines (connections in all and per uid, handshake, idle,
    /// shutdown).
    pub limits: ListenerLimits,
    /// How often the runtime's image list is checked against the captured credentials.
    pub check_every: Duration,
    /// How registries are reached to confirm a credential before it is captured.
    pub registry: crate::guard::registry::RegistryOptions,
    /// The agent: its metrics, and the engine and pull log the pull decisions use.
    pub agent: crate::Agent,
}

/// The proxy's listener limits by default: far more connections than a kubelet and the
/// runtime's own tools open, the API socket's deadlines.
pub fn default_limits() -> ListenerLimits {
    ListenerLimits {
        max_connections: 128,
        max_connections_per_uid: 32,
        exempt: Vec::new(),
        handshake_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(300),
        shutdown_timeout: Duration::from_secs(10),
    }
    .root_and_own_exempt()
}

/// Streams one caller connection may have open: a kubelet pulls a few images at a time.
pub const MAX_STREAMS: u32 = 64;

/// Serves the proxy on `listener`, forwarding to the runtime at `runtime`, until `shutdown`
/// is cancelled; then stops accepting and lets calls in flight finish for at most the
/// shutdown deadline.
pub async fn serve(listener: UnixListener, options: ProxyOptions, shutdown: CancellationToken) {
    let ProxyOptions {
        runtime,
        captured,
        guard,
        limits,
        check_every,
        registry,
        agent,
    } = options;
    let metrics = agent.metrics().clone();
    let proxy_budget = Budgets::proxy();
    // The proxy's own calls (the sweeper's) use a runtime connection of their own.
    let own = std::sync::Arc::new(Caller {
        runtime: std::sync::Arc::new(Runtime::new(runtime.clone())),
        budgets: Budgets::connection(&proxy_budget, budget::PROXY_BYTES),
    });
    // Removals that bypass the proxy (crictl rmi, the runtime's own garbage collection): the
    // runtime's image list, checked periodically, drops what no image is left of.
    let sweeper = captured.clone().map(|captured| {
        let own = own.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(check_every) => {}
                    () = stop.cancelled() => return,
                }
                let expiring = captured.clone();
                let _ = tokio::task::spawn_blocking(move || expiring.expire()).await;
                let held = captured.list().into_iter().map(|(repo, _)| repo).collect();
                forget_absent(&own, &captured, held).await;
            }
        })
    });
    let (capture, capture_task) = match captured.clone() {
        Some(captured) => {
            let verifier = crate::guard::registry::Verifier::new(registry);
            let (capturer, task) = Capturer::start(captured.clone(), verifier, metrics.clone());
            (
                Some(Capture {
                    captured,
                    capturer,
                    own: own.clone(),
                }),
                Some(task),
            )
        }
        None => (None, None),
    };
    let pulls = std::sync::Arc::new(Pulls {
        agent,
        guard,
        capture,
    });
    // The API's windows, send buffer and reset bounds.
    let builder = crate::listener::http2_builder(MAX_STREAMS, MAX_HEADER_LIST);
    let shutdown_timeout = limits.shutdown_timeout;
    let mut listener = Listener::new("cri-proxy", listener, limits, metrics);
    while let Some(accepted) = listener.next(&shutdown).await {
        let caller = std::sync::Arc::new(Caller {
            runtime: std::sync::Arc::new(Runtime::new(runtime.clone())),
            budgets: Budgets::connection(&proxy_budget, budget::CONNECTION_BYTES),
        });
        let tracker = Tracker::new();
        let pulls = pulls.clone();
        let streams = tracker.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let caller = caller.clone();
            let pulls = pulls.clone();
            let open = streams.stream();
            async move {
                let answer = forward(&caller, &pulls, request).await;
                Ok::<_, Infallible>(answer.map(|body| Counted::new(body, open)))
            }
        });
        listener.serve_http2(
            accepted,
            tracker,
            &builder,
            service,
            MAX_HEADER_LIST,
            shutdown.clone(),
        );
    }
    listener.drain().await;
    if let Some(sweeper) = sweeper {
        sweeper.abort();
        let _ = sweeper.await;
    }
    // The capture task ends once the last capturer is gone, after the offers it took.
    drop(pulls);
    if let Some(task) = capture_task {
        if tokio::time::timeout(shutdown_timeout, task).await.is_err() {
            tracing::warn!("captures still being confirmed at the shutdown deadline: dropped");
        }
    }
    drop(own);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_and_anything_else_is_the_default() {
        let mut h = hyper::HeaderMap::new();
        assert_eq!(deadline(&h), DEFAULT_DEADLINE);
        for (v, want) in [
            ("120S", Duration::from_secs(120)),
            ("2M", Duration::from_secs(120)),
            ("1H", Duration::from_secs(3600)),
            ("500m", Duration::from_millis(500)),
            ("7u", Duration::from_micros(7)),
            ("9n", Duration::from_nanos(9)),
            ("x", DEFAULT_DEADLINE),
            ("12Q", DEFAULT_DEADLINE),
        ] {
            h.insert("grpc-timeout", v.parse().unwrap());
            assert_eq!(deadline(&h), want, "{v}");
        }
        assert_eq!(
            endpoint_path("unix:///run/containerd/containerd.sock"),
            PathBuf::from("/run/containerd/containerd.sock")
        );
    }
}
