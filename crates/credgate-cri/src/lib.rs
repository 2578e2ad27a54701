//! The CRI image-service proxy: the kubelet's `--image-service-endpoint` points at the agent,
//! which forwards every call to the container runtime and returns its answer unchanged.
//!
//! Calls pass through as HTTP/2 requests, their bodies and answers streamed frame by frame and
//! never decoded, so a method credgate has no code for (a newer kubelet's) reaches the runtime
//! as it is, and the runtime's status codes and messages come back as they are. Two are read:
//! a `PullImage`, whose credential the operator's policy may fill in or replace before it is
//! forwarded and which is captured once the runtime and the registry accept it (module
//! `pulls`), and a `RemoveImage`, after which the captures of repositories with no image left
//! go (module `check`). The runtime unreachable: `UNAVAILABLE` with what failed. A call never
//! outlives the caller's own deadline (`grpc-timeout`).

use std::convert::Infallible;
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use credgate_api::cri::{PULL_IMAGE, PULL_IMAGE_V1ALPHA2, REMOVE_IMAGE, REMOVE_IMAGE_V1ALPHA2};
use http_body_util::BodyExt;
use hyper::body::{Bytes, Incoming};
use tokio::net::UnixListener;

use credgate_listener::{Listener, ListenerLimits};

mod budget;
mod capture;
mod check;
mod context;
mod decision;
mod fill;
pub mod hosts;
mod keep;
pub mod metrics;
pub mod node_images;
pub mod outcome;
pub mod policy;
pub mod pull_log;
mod pull_request;
mod pulls;
mod runtime;
use budget::Budgets;
use check::remove;
pub use context::Context;
use pulls::{pull, Capture, Pulls};
use runtime::{broken_runtime, status, unreachable_runtime, CallerConn, Runtime};

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
/// The most of a `ListImages` answer, or of one `StreamImages` batch, the proxy reads for
/// itself: containerd's own default limit for a gRPC message (and the kubelet's). A list
/// larger than that is read through `StreamImages` where the runtime serves it; where it does
/// not, the check says so and acts on nothing.
pub const MAX_LIST_MESSAGE: usize = 16 << 20;

/// Forwards one call to the runtime.
async fn forward(
    caller: &CallerConn,
    pulls: &Pulls,
    request: hyper::Request<Incoming>,
) -> hyper::Response<Body> {
    let limit = deadline(request.headers());
    let runtime = &caller.runtime;
    pulls
        .ctx
        .metrics
        .calls
        .get_or_create(&crate::metrics::CallLabels {
            method: crate::metrics::Method::of(request.uri().path()),
        })
        .inc();
    let removal = matches!(request.uri().path(), REMOVE_IMAGE | REMOVE_IMAGE_V1ALPHA2);
    let call = async {
        // v1alpha2's messages have v1's fields: its pulls are logged, recorded and captured
        // as v1's are.
        match (request.uri().path(), &pulls.capture) {
            (PULL_IMAGE | PULL_IMAGE_V1ALPHA2, _) => return pull(caller, pulls, request).await,
            (REMOVE_IMAGE | REMOVE_IMAGE_V1ALPHA2, Some(capture)) => {
                return remove(caller, &capture.view, &capture.captured, request).await
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
            Err(e) => broken_runtime(runtime, &e),
        }
    };
    let answer = match tokio::time::timeout(limit, call).await {
        Ok(answer) => answer,
        Err(_) => status(runtime::ProxyError::Deadline(
            "credgate: the container runtime did not answer within the caller's deadline".into(),
        )),
    };
    if removal {
        // The runtime answered the removal: a kept image it took is pulled again.
        pulls.removed.send_modify(|n| *n = n.wrapping_add(1));
    }
    answer
}

/// How the proxy runs.
pub struct ProxyOptions {
    /// The runtime's socket.
    pub runtime: PathBuf,
    /// Where pull credentials are captured; none captured when `None`.
    pub captured: Option<std::sync::Arc<credgate_agent::captured::Captured>>,
    /// The image access guard the pulls are recorded in, when it is enabled.
    pub guard: Option<credgate_agent::guard::Guard>,
    /// The listener's budget and deadlines (connections in all and per uid, handshake, idle,
    /// shutdown).
    pub limits: ListenerLimits,
    /// How often the runtime's image list is checked against the captured credentials.
    pub check_every: Duration,
    /// How registries are reached to confirm a credential before it is captured.
    pub registry: credgate_agent::guard::registry::RegistryOptions,
    /// What the proxy uses of the agent.
    pub context: Context,
    /// The images the node keeps present, pulled on its own behalf (decision 0022).
    pub node_images: Vec<crate::node_images::NodeImage>,
    /// How often the runtime is asked whether it has them.
    pub keep_every: Duration,
    /// The most of a `ListImages` answer the proxy reads for itself ([`MAX_LIST_MESSAGE`];
    /// tests lower it to stand for a node whose list is larger than that).
    pub list_limit: usize,
    /// How long a pull's answer waits for its credential's capture ([`CAPTURE_WAIT`]; tests
    /// shorten it).
    pub capture_wait: Duration,
}

/// How long a pull's answer waits for its capture to be confirmed by the registry and on
/// disk; past it the answer goes back and the capture goes on (counted as late).
pub const CAPTURE_WAIT: Duration = Duration::from_secs(2);

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

/// One caller connection's calls, each forwarded.
fn service(
    caller: std::sync::Arc<CallerConn>,
    pulls: std::sync::Arc<Pulls>,
) -> impl hyper::service::Service<
    hyper::Request<Incoming>,
    Response = hyper::Response<Body>,
    Error = Infallible,
    Future = impl std::future::Future<Output = Result<hyper::Response<Body>, Infallible>> + Send,
> + Clone {
    hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let caller = caller.clone();
        let pulls = pulls.clone();
        async move { Ok::<_, Infallible>(forward(&caller, &pulls, request).await) }
    })
}

/// Streams one caller connection may have open: a kubelet pulls a few images at a time.
pub const MAX_STREAMS: u32 = 64;

/// Serves the proxy on `listener`, forwarding to the runtime at `runtime`, until `shutdown`
/// is cancelled; then stops accepting and lets calls in flight finish for at most the
/// shutdown deadline.
pub async fn serve(listener: UnixListener, options: ProxyOptions, shutdown: CancellationToken) {
    let metrics = options.context.metrics.clone();
    let connections = options.context.connections.clone();
    let proxy_budget = Budgets::proxy(metrics.held_bytes.clone());
    let runtime = options.runtime.clone();
    let limits = options.limits.clone();
    let shutdown_timeout = limits.shutdown_timeout;
    let background = Background::start(options, &proxy_budget, &shutdown);
    let unreachable = metrics.runtime_unreachable.clone();
    let mut listener = Listener::new("cri-proxy", listener, limits, connections);
    // The API's windows, send buffer and reset bounds.
    let http2 = listener.http2(MAX_STREAMS, MAX_HEADER_LIST);
    while let Some(accepted) = listener.next(&shutdown).await {
        // Each caller has a connection to the runtime and a buffer budget of its own.
        let caller = std::sync::Arc::new(CallerConn {
            runtime: std::sync::Arc::new(Runtime::new(runtime.clone(), unreachable.clone())),
            budgets: Budgets::connection(&proxy_budget, budget::CONNECTION_BYTES),
        });
        let service = service(caller, background.pulls.clone());
        listener.serve_http2(accepted, &http2, service, shutdown.clone());
    }
    listener.drain().await;
    background.stop(shutdown_timeout).await;
}

/// The proxy on its own thread and single-threaded runtime (a proxied call's tasks, the
/// kubelet's connection, the call and the runtime's connection, wake each other on one
/// thread instead of across workers), serving `listener` until `shutdown` is cancelled.
/// Returns once it serves, with its thread, which the caller owns and joins.
pub async fn start(
    listener: std::os::unix::net::UnixListener,
    options: ProxyOptions,
    shutdown: CancellationToken,
) -> Result<std::thread::JoinHandle<std::io::Result<()>>, StartError> {
    let (started, serving) = tokio::sync::oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("cri-proxy".into())
        .spawn(move || run(listener, options, shutdown, started))
        .map_err(StartError::Thread)?;
    match serving.await {
        Ok(Ok(())) => Ok(thread),
        Ok(Err(e)) => Err(StartError::Runtime(e)),
        Err(_) => Err(StartError::Ended),
    }
}

/// Why the proxy did not start serving ([`start`]).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot start its thread")]
    Thread(#[source] std::io::Error),
    #[error("cannot start its runtime or take its socket")]
    Runtime(#[source] std::io::Error),
    #[error("its thread ended before it served")]
    Ended,
}

/// The proxy's thread: its runtime, then [`serve`] until `shutdown`; says on `started` whether
/// it got as far as serving.
fn run(
    listener: std::os::unix::net::UnixListener,
    options: ProxyOptions,
    shutdown: CancellationToken,
    started: tokio::sync::oneshot::Sender<std::io::Result<()>>,
) -> std::io::Result<()> {
    let ready = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .and_then(|runtime| {
            let _entered = runtime.enter();
            Ok((UnixListener::from_std(listener)?, runtime))
        });
    let (listener, runtime) = match ready {
        Ok(ready) => {
            let _ = started.send(Ok(()));
            ready
        }
        Err(e) => {
            let _ = started.send(Err(std::io::Error::new(e.kind(), e.to_string())));
            return Err(e);
        }
    };
    runtime.block_on(serve(listener, options, shutdown));
    Ok(())
}

/// What the proxy does besides forwarding: its own runtime connection and view of the
/// runtime's images, the watcher of containerd's hosts directories, the sweeper of captures,
/// the capture task and the keeper of the node's images.
struct Background {
    pulls: std::sync::Arc<Pulls>,
    own: std::sync::Arc<CallerConn>,
    /// The hosts watcher, the sweeper and the keeper, ended when the listener drained.
    periodic: Vec<tokio::task::JoinHandle<()>>,
    /// Ends once the last capturer is gone, after the offers it took.
    capture: Option<tokio::task::JoinHandle<()>>,
}

impl Background {
    fn start(
        options: ProxyOptions,
        proxy_budget: &budget::ProxyBudget,
        shutdown: &CancellationToken,
    ) -> Background {
        let ProxyOptions {
            runtime,
            captured,
            guard,
            check_every,
            registry,
            context,
            node_images,
            keep_every,
            list_limit,
            capture_wait,
            limits: _,
        } = options;
        let metrics = context.metrics.clone();
        // The proxy's own calls use a runtime connection and a budget of their own.
        let own = std::sync::Arc::new(CallerConn {
            runtime: std::sync::Arc::new(Runtime::new(
                runtime,
                metrics.runtime_unreachable.clone(),
            )),
            budgets: Budgets::connection(proxy_budget, budget::PROXY_BYTES),
        });
        let view = std::sync::Arc::new(check::ImageView {
            own: own.clone(),
            limit: list_limit,
            metrics: metrics.clone(),
            reading: tokio::sync::Mutex::new(()),
        });
        let mut periodic = Vec::new();
        // containerd's hosts directories, read again when they change: a pull never reads them.
        if let Some(hosts) = context.policy.hosts() {
            periodic.push(tokio::spawn(hosts.clone().watch(shutdown.clone())));
        }
        // Removals that bypass the proxy (crictl rmi, the runtime's own garbage collection):
        // the runtime's image list, checked periodically, drops what no image is left of.
        if let Some(captured) = captured.clone() {
            let sweep = check::every(check_every, view.clone(), captured, shutdown.clone());
            periodic.push(tokio::spawn(sweep));
        }
        let (capture, capture_task) = match captured {
            Some(captured) => {
                let (capture, task) =
                    Capture::start(captured, registry, &view, &metrics, capture_wait);
                (Some(capture), Some(task))
            }
            None => (None, None),
        };
        let pulls = std::sync::Arc::new(Pulls {
            ctx: context,
            guard,
            capture,
            removed: tokio::sync::watch::Sender::new(0),
        });
        if !node_images.is_empty() {
            let keeper = keep::Keeper {
                images: node_images,
                pulls: pulls.clone(),
                own: own.clone(),
                every: keep_every,
            };
            periodic.push(tokio::spawn(keeper.run(shutdown.clone())));
        }
        Background {
            pulls,
            own,
            periodic,
            capture: capture_task,
        }
    }

    /// Ends the periodic tasks, then lets the capture task finish the offers it took, at
    /// most `deadline`.
    async fn stop(self, deadline: Duration) {
        for task in self.periodic {
            task.abort();
            let _ = task.await;
        }
        drop(self.pulls);
        if let Some(task) = self.capture {
            if tokio::time::timeout(deadline, task).await.is_err() {
                tracing::warn!("captures still being confirmed at the shutdown deadline: dropped");
            }
        }
        drop(self.own);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seam between the proxy and the agent (issue 52): the proxy names the captures, the
    /// guard and the refusal service, and owns the rest of what it uses.
    #[test]
    fn the_proxy_names_three_agent_modules() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut named = std::collections::BTreeSet::new();
        for entry in std::fs::read_dir(&src).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            let code = text.lines().filter(|l| !l.trim_start().starts_with("//"));
            for line in code {
                for (at, needle) in line.match_indices("credgate_agent::") {
                    if line[..at].ends_with('"') {
                        continue; // this test's own needle
                    }
                    let rest = &line[at + needle.len()..];
                    let module: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    // `credgate_agent::{a, b}` would hide modules from this count.
                    assert!(
                        !module.is_empty(),
                        "a grouped import of the agent: name each path"
                    );
                    named.insert(module);
                }
            }
        }
        assert_eq!(
            named.into_iter().collect::<Vec<_>>(),
            ["captured", "guard", "refusal"],
            "the agent modules the proxy names"
        );
    }

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
