//! The CRI image-service proxy: the kubelet's `--image-service-endpoint` points at the agent,
//! which forwards every call to the container runtime and returns its answer unchanged.
//!
//! Calls pass through as HTTP/2 requests, their bodies and answers streamed frame by frame and
//! never decoded, so a method credgate has no code for (a newer kubelet's) reaches the runtime
//! as it is, and the runtime's status codes and messages come back as they are. The runtime
//! unreachable: `UNAVAILABLE` with what failed. A call never outlives the caller's own
//! deadline (`grpc-timeout`).

use std::convert::Infallible;
use std::path::PathBuf;
use std::time::Duration;

use credgate_api::cri::{self as wire, PULL_IMAGE, REMOVE_IMAGE};
use http_body_util::BodyExt;
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, Mutex};
use tokio::task::JoinSet;

use crate::conn::Watched;
use crate::listener::{drive, Counted, Guarded, Listener, ListenerLimits, Tracker};
use crate::status::ApiError;

mod budget;
mod capture;
mod decision;
use budget::{Budgets, Refused, Taken};
use capture::{Capturer, Offer};

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

/// One HTTP/2 connection to the runtime, made on first use and again after it fails.
struct Runtime {
    path: PathBuf,
    sender: Mutex<Option<hyper::client::conn::http2::SendRequest<Body>>>,
    tasks: std::sync::Mutex<JoinSet<()>>,
}

impl Runtime {
    fn new(path: PathBuf) -> Runtime {
        Runtime {
            path,
            sender: Mutex::new(None),
            tasks: std::sync::Mutex::new(JoinSet::new()),
        }
    }

    async fn sender(&self) -> std::io::Result<hyper::client::conn::http2::SendRequest<Body>> {
        let mut slot = self.sender.lock().await;
        if let Some(s) = slot.as_ref().filter(|s| !s.is_closed()) {
            return Ok(s.clone());
        }
        let stream = UnixStream::connect(&self.path).await?;
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .handshake(TokioIo::new(stream))
            .await
            .map_err(std::io::Error::other)?;
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        // Connections that ended are reaped here, so the set holds the live one only.
        while tasks.try_join_next().is_some() {}
        tasks.spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "runtime connection ended");
            }
        });
        drop(tasks);
        *slot = Some(sender.clone());
        Ok(sender)
    }
}

/// One caller connection's side of the proxy: a connection to the runtime of its own, so that
/// a caller that stops reading its answers fills only its own flow-control windows and holds
/// back only its own calls, and its share of what the proxy may buffer. Dropped with the
/// caller's connection, which closes its runtime connection.
struct Caller {
    runtime: std::sync::Arc<Runtime>,
    budgets: Budgets,
}

/// The proxy's own error as a trailers-only answer.
fn status(e: ApiError) -> hyper::Response<Body> {
    tonic::Status::from(e)
        .into_http::<tonic::body::Body>()
        .map(|b| b.map_err(|e| Box::new(e) as _).boxed_unsync())
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

/// The most of a `PullImage` or `RemoveImage` request or answer the proxy buffers (all small
/// messages).
const MAX_PULL_MESSAGE: usize = 1 << 20;
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

/// One unary call of our own to the runtime: its answer's message when it succeeded and fit
/// in `limit` bytes.
async fn ask<M: prost::Message, R: prost::Message + Default>(
    caller: &Caller,
    method: &str,
    message: &M,
    limit: usize,
) -> Option<R> {
    let frame = credgate_api::unary::grpc_message(message);
    let (parts, ()) = hyper::Request::post(method)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .ok()?
        .into_parts();
    let whole = exchange(caller, parts, Bytes::from(frame), limit)
        .await
        .ok()?;
    if whole.code() != Some(0) {
        return None;
    }
    R::decode(grpc_message(&whole.data)?).ok()
}

/// A `RemoveImage`: the image's repositories are read first (the request may name it by ID);
/// when the runtime removed it, a repository of which it has no image left loses its
/// captured credential.
async fn remove(
    caller: &Caller,
    captured: &std::sync::Arc<crate::captured::Captured>,
    request: hyper::Request<Incoming>,
) -> hyper::Response<Body> {
    use prost::Message as _;
    let (parts, bytes, _taken) = match read_whole(caller, request, "RemoveImage").await {
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
        forget_absent(caller, captured, before).await;
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

/// An answer read whole: its head, its message bytes, its trailers.
struct Whole {
    parts: hyper::http::response::Parts,
    data: Bytes,
    trailers: Option<hyper::HeaderMap>,
    /// What the answer takes of the budgets, until its body is sent or dropped.
    taken: Taken,
}

impl Whole {
    /// The gRPC status code (in the trailers, or in the head of a trailers-only answer).
    fn code(&self) -> Option<i32> {
        self.trailers
            .as_ref()
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| self.parts.headers.get("grpc-status"))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    }

    /// The gRPC status message, percent-decoded.
    fn message(&self) -> String {
        let raw = self
            .trailers
            .as_ref()
            .and_then(|t| t.get("grpc-message"))
            .or_else(|| self.parts.headers.get("grpc-message"))
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        decision::percent_decode(raw)
    }

    /// The answer as the runtime gave it, in the same shape: a trailers-only answer (the
    /// status in the head, which ended the stream) goes back as one, since grpc-go reads a
    /// status in a head that does not end the stream as `server closed the stream without
    /// sending trailers`.
    fn into_response(self) -> hyper::Response<Body> {
        if self.data.is_empty() && self.trailers.is_none() {
            let body = http_body_util::Empty::new()
                .map_err(|never| match never {})
                .boxed_unsync();
            return hyper::Response::from_parts(self.parts, body);
        }
        let trailers = self.trailers;
        let body = Guarded::new(
            http_body_util::Full::new(self.data)
                .map_err(|never| match never {})
                .with_trailers(async move { trailers.map(Ok) })
                .boxed_unsync(),
            self.taken,
        )
        .boxed_unsync();
        hyper::Response::from_parts(self.parts, body)
    }
}

/// A request body read whole, within the bound and the caller's budgets; an answer to give
/// instead when it is over.
async fn read_whole(
    caller: &Caller,
    request: hyper::Request<Incoming>,
    what: &str,
) -> Result<(hyper::http::request::Parts, Bytes, Taken), hyper::Response<Body>> {
    let (parts, body) = request.into_parts();
    match budget::collect(body, MAX_PULL_MESSAGE, &caller.budgets).await {
        Ok(c) => Ok((parts, c.data, c.taken)),
        Err(Refused::TooLarge) => Err(status(ApiError::TooLarge(format!(
            "credgate: a {what} request larger than {} KiB",
            MAX_PULL_MESSAGE >> 10
        )))),
        Err(Refused::Exhausted) => Err(status(ApiError::TooLarge(format!(
            "credgate: too many unfinished requests held for this connection or for all callers; {what} refused"
        )))),
        Err(Refused::Broken) => Err(status(ApiError::Cancelled(format!(
            "credgate: the {what} request ended before its message did"
        )))),
    }
}

/// Forwards a call whose request was read whole and reads its answer whole (at most `limit`
/// bytes); an answer to give instead when the runtime cannot be reached or its answer is too
/// large.
async fn exchange(
    caller: &Caller,
    parts: hyper::http::request::Parts,
    bytes: Bytes,
    limit: usize,
) -> Result<Whole, hyper::Response<Body>> {
    let runtime = &caller.runtime;
    let outbound = hyper::Request::from_parts(
        parts,
        http_body_util::Full::new(bytes)
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    let mut sender = runtime
        .sender()
        .await
        .map_err(|e| unreachable_runtime(runtime, &e))?;
    let answer = sender
        .send_request(outbound)
        .await
        .map_err(|e| broken_runtime(&e))?;
    let (parts, body) = answer.into_parts();
    let collected =
        match budget::collect(body, limit, &caller.budgets).await {
            Ok(c) => c,
            Err(Refused::Exhausted) => return Err(status(ApiError::TooLarge(
                "credgate: too many unfinished answers held for this connection or for all callers"
                    .into(),
            ))),
            Err(Refused::TooLarge | Refused::Broken) => {
                return Err(status(ApiError::Runtime(
                    "credgate: the runtime's answer was cut short or too large".into(),
                )))
            }
        };
    Ok(Whole {
        parts,
        data: collected.data,
        trailers: collected.trailers,
        taken: collected.taken,
    })
}

/// The message of an uncompressed gRPC frame.
fn grpc_message(frame: &[u8]) -> Option<&[u8]> {
    let (&flag, rest) = frame.split_first()?;
    if flag != 0 {
        return None;
    }
    let (len, msg) = rest.split_at_checked(4)?;
    let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
    msg.get(..len)
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
}

/// `now_ms`: when it is captured, by the agent's clock.
fn pull_of(message: &[u8], now_ms: i64) -> Option<Pull> {
    use prost::Message as _;
    let req = wire::PullImageRequest::decode(message).ok()?;
    let image = req.image?.image;
    let parsed = credgate_core::reference::ImageRef::parse(&image).ok()?;
    let repository = parsed.name().to_owned();
    let other_registry = req.auth.as_ref().is_some_and(|a| {
        !a.server_address.is_empty()
            && !credgate_core::helper::names_registry(&a.server_address, parsed.registry())
    });
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
    })
}

/// How the image access guard records a pull: a pull with a credential as a secret of the
/// pod's namespace named after its content (`PullImage` carries no secret name; the guard
/// matches by content across names anyway); one without as node-wide. A pull with a
/// credential but no pod is never recorded as node-wide: its result is not recorded at all,
/// and the intent keeps the image requiring authentication.
fn recorded_as(
    pull: &Pull,
    captured: &crate::captured::Captured,
) -> Option<crate::guard::CredentialIn> {
    use crate::guard::CredentialIn;
    match &pull.credential {
        None => Some(CredentialIn::NodeWide),
        Some(_) if !pull.in_pod || pull.other_registry => None,
        Some(c) => Some(CredentialIn::Secret {
            coords: credgate_core::guard::Coords {
                namespace: c.namespace.clone(),
                name: captured.name_for(c),
                uid: String::new(),
            },
            username: c.username.clone(),
            password: c.password.clone(),
        }),
    }
}

/// A `PullImage`: read whole (bounded), forwarded, its answer read whole; when the runtime
/// says it succeeded, the credential it carried for the image's registry is offered for
/// capture (confirmed with the registry and written after the answer goes back).
async fn pull(
    caller: &Caller,
    proxy: &Capture,
    guard: Option<&crate::guard::Guard>,
    request: hyper::Request<Incoming>,
) -> hyper::Response<Body> {
    let captured = &*proxy.captured;
    let (parts, bytes, _taken) = match read_whole(caller, request, "PullImage").await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    let asked = grpc_message(&bytes).and_then(|m| pull_of(m, captured.now_ms()));
    // The intent is on disk before the runtime starts pulling.
    if let (Some(guard), Some(pull)) = (guard, &asked) {
        if let Err(e) = guard.record_intent(&pull.image).await {
            tracing::error!(error = %crate::error_chain(&e), "pull intent not recorded");
        }
    }
    let started = std::time::Instant::now();
    let whole = match exchange(caller, parts, bytes, MAX_PULL_MESSAGE).await {
        Ok(whole) => whole,
        Err(refused) => return refused,
    };
    let Some(pull) = asked else {
        return whole.into_response();
    };
    decision::log(
        &proxy.agent,
        &pull,
        whole.code().unwrap_or(2),
        &whole.message(),
        started.elapsed(),
    );
    use prost::Message as _;
    let image_ref = (whole.code() == Some(0))
        .then(|| grpc_message(&whole.data))
        .flatten()
        .and_then(|m| wire::PullImageResponse::decode(m).ok())
        .map(|r| r.image_ref)
        .filter(|r| !r.is_empty());
    if let Some(guard) = guard {
        let used = recorded_as(&pull, captured);
        let result = match (&image_ref, &used) {
            (Some(id), Some(used)) => guard.record_result(&pull.image, id, true, Some(used)).await,
            (Some(_), None) => Ok(()),
            (None, _) => guard.record_result(&pull.image, "", false, None).await,
        };
        if let Err(e) = result {
            tracing::error!(error = %crate::error_chain(&e), "pull result not recorded");
        }
    }
    if let (Some(_), Some(credential)) = (&image_ref, pull.credential) {
        if pull.other_registry {
            proxy.metrics.capture("other_registry");
            tracing::warn!(repository = %pull.repository, "pull credentials not captured: their server address names another registry");
        } else {
            proxy.capturer.offer(Offer {
                image: pull.image,
                repository: pull.repository,
                credential,
            });
        }
    }
    whole.into_response()
}

fn unreachable_runtime(runtime: &Runtime, e: &std::io::Error) -> hyper::Response<Body> {
    status(ApiError::Runtime(format!(
        "credgate: cannot reach the container runtime at {}: {e}",
        runtime.path.display()
    )))
}

fn broken_runtime(e: &hyper::Error) -> hyper::Response<Body> {
    status(ApiError::Runtime(format!(
        "credgate: the container runtime's connection failed: {e}"
    )))
}

/// What the proxy captures with: where captures are kept, the task that confirms and writes
/// them.
struct Capture {
    captured: std::sync::Arc<crate::captured::Captured>,
    capturer: Capturer,
    metrics: crate::metrics::AgentMetrics,
    /// For the pull decision log: the engine, the pull ring.
    agent: crate::Agent,
}

/// Forwards one call to the runtime.
async fn forward(
    caller: &Caller,
    capture: Option<&Capture>,
    guard: Option<&crate::guard::Guard>,
    request: hyper::Request<Incoming>,
) -> hyper::Response<Body> {
    let limit = deadline(request.headers());
    let runtime = &caller.runtime;
    let call = async {
        if let Some(capture) = capture {
            match request.uri().path() {
                PULL_IMAGE => return pull(caller, capture, guard, request).await,
                REMOVE_IMAGE => return remove(caller, &capture.captured, request).await,
                _ => {}
            }
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
    pub metrics: crate::metrics::AgentMetrics,
    /// The agent whose engine and pull log the pull decisions use.
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
/// What a caller may send on a stream, and on its connection, before the proxy reads it.
const STREAM_WINDOW: u32 = 64 << 10;
const CONNECTION_WINDOW: u32 = 256 << 10;
/// What the proxy queues for a caller that does not read, per stream (beyond it, the
/// runtime's answer waits in the runtime's own windows of that caller's connection).
const STREAM_SEND_BUFFER: usize = 64 << 10;

/// Serves the proxy on `listener`, forwarding to the runtime at `runtime`, until `shutdown`
/// turns true; then stops accepting and lets calls in flight finish for at most the
/// shutdown deadline.
pub async fn serve(
    listener: UnixListener,
    options: ProxyOptions,
    mut shutdown: watch::Receiver<bool>,
) {
    let ProxyOptions {
        runtime,
        captured,
        guard,
        limits,
        check_every,
        registry,
        metrics,
        agent,
    } = options;
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
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(check_every) => {}
                    () = async { let _ = stop.wait_for(|s| *s).await; } => return,
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
            let capture = Capture {
                captured,
                capturer,
                metrics: metrics.clone(),
                agent,
            };
            (Some(std::sync::Arc::new(capture)), Some(task))
        }
        None => (None, None),
    };
    let builder = std::sync::Arc::new({
        let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        b.timer(TokioTimer::new())
            .max_concurrent_streams(MAX_STREAMS)
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_send_buf_size(STREAM_SEND_BUFFER)
            .max_header_list_size(MAX_HEADER_LIST)
            .max_pending_accept_reset_streams(Some(32))
            .max_local_error_reset_streams(Some(256));
        b
    });
    let shutdown_timeout = limits.shutdown_timeout;
    let mut listener = Listener::new("cri-proxy", listener, limits, metrics);
    while let Some(accepted) = listener.next(&mut shutdown).await {
        let caller = std::sync::Arc::new(Caller {
            runtime: std::sync::Arc::new(Runtime::new(runtime.clone())),
            budgets: Budgets::connection(&proxy_budget, budget::CONNECTION_BYTES),
        });
        let tracker = Tracker::new();
        let capture = capture.clone();
        let guard = guard.clone();
        let streams = tracker.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let caller = caller.clone();
            let capture = capture.clone();
            let guard = guard.clone();
            let open = streams.stream();
            async move {
                let answer = forward(&caller, capture.as_deref(), guard.as_ref(), request).await;
                Ok::<_, Infallible>(answer.map(|body| Counted::new(body, open)))
            }
        });
        let io = Watched::new(
            accepted.stream,
            tracker.activity.clone(),
            Some(4 * MAX_HEADER_LIST as usize),
        );
        let connection = builder.serve_connection(TokioIo::new(io), service);
        let task = drive(
            connection,
            tracker,
            listener.limits().clone(),
            accepted.held,
            shutdown.clone(),
        );
        listener.spawn(task);
    }
    listener.drain().await;
    if let Some(sweeper) = sweeper {
        sweeper.abort();
        let _ = sweeper.await;
    }
    // The capture task ends once the last capturer is gone, after the offers it took.
    drop(capture);
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
