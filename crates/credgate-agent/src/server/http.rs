//! The HTTP/2 side of the API server: accepting on the unix socket within the connection
//! budget, one hyper connection per client with the caller's kernel credentials attached to
//! every request, the deadlines of a connection (handshake, idle, per request), and graceful
//! shutdown with a deadline of its own.
//!
//! Every call runs as a task of its own on the runtime (hyper-util's `TokioExecutor`), so a
//! slow call never holds up the other calls of its connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic::codegen::Service;
use tonic::service::Routes;

use super::{Limits, Peer};
use crate::agent::CallerAllowlist;
use crate::conn::{self, Activity, Slots, Throttle, Watched};
use crate::metrics::AgentMetrics;

/// The HTTP/2 client preface (`PRI * HTTP/2.0...`) is this long; a client that has not sent
/// it within the handshake deadline is not speaking HTTP/2 to us.
const PREFACE_LEN: u64 = 24;

/// How many bytes one stream may have queued for a client that does not read.
pub const STREAM_SEND_BUFFER: usize = 64 << 10;
/// The server's receive window: what a client may send on a stream, and on a connection,
/// before the agent has read it.
pub const STREAM_WINDOW: u32 = 64 << 10;
pub const CONNECTION_WINDOW: u32 = 256 << 10;
/// The largest header block a client may send.
pub const MAX_HEADER_LIST: u32 = 16 << 10;

static ACCEPT_ERRORS: Throttle = Throttle::new(Duration::from_secs(10));
static REFUSALS: Throttle = Throttle::new(Duration::from_secs(10));

/// Serves `routes` on `listener` until `shutdown` turns true; then stops accepting, asks every
/// connection to finish (HTTP/2 GOAWAY: calls in flight complete, no new ones start), waits for
/// them at most `limits.shutdown_timeout` and closes what is left.
pub(super) async fn serve(
    routes: Routes,
    listener: UnixListener,
    callers: CallerAllowlist,
    limits: Limits,
    metrics: AgentMetrics,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_streams)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_send_buf_size(STREAM_SEND_BUFFER)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_pending_accept_reset_streams(Some(32))
        .max_local_error_reset_streams(Some(256))
        .keep_alive_interval(Some(limits.keepalive_interval))
        .keep_alive_timeout(limits.keepalive_timeout);
    let builder = Arc::new(builder);
    // Root and the agent's own uid count only against the total, so that another local user
    // can never take every connection from them.
    let slots = Slots::new(
        limits.max_connections,
        limits.max_connections_per_uid,
        vec![0, rustix::process::geteuid().as_raw()],
    );
    let open = metrics.open_connections("api");
    let mut connections = JoinSet::new();
    while let Some(stream) = conn::next_connection(
        "api",
        &ACCEPT_ERRORS,
        &mut shutdown,
        &mut connections,
        || listener.accept(),
    )
    .await
    {
        let peer = match stream.peer_cred() {
            Ok(c) => Peer {
                uid: Some(c.uid()),
                gid: Some(c.gid()),
                pid: c.pid(),
            },
            Err(_) => Peer::default(),
        };
        // A caller that no service admits has nothing to do here: closed at once, holding
        // nothing.
        if !callers.admits_any(peer.uid) {
            refuse(&metrics, "not_allowed", peer);
            continue;
        }
        let slot = match slots.try_take(peer.uid) {
            Ok(slot) => slot,
            Err(why) => {
                refuse(&metrics, why.as_str(), peer);
                continue;
            }
        };
        let open = open.clone();
        open.inc();
        let activity = Activity::new();
        let streams = Arc::new(AtomicUsize::new(0));
        let service = CallService {
            routes: routes.clone(),
            peer,
            streams: streams.clone(),
            timeout: limits.request_timeout,
        };
        let io = TokioIo::new(Watched::new(
            stream,
            activity.clone(),
            4 * MAX_HEADER_LIST as usize,
        ));
        let connection = builder.serve_connection(io, service);
        let deadlines = Deadlines {
            handshake: limits.handshake_timeout,
            idle: limits.idle_timeout,
            activity,
            streams,
        };
        let metrics = metrics.clone();
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let _slot = slot;
            if let Some(reason) = drive(connection, deadlines, shutdown).await {
                metrics.connection_closed("api", reason);
            }
            open.dec();
        });
    }
    drop(listener);
    // Connections saw the same shutdown signal and are finishing their calls.
    conn::drain("api", &mut connections, limits.shutdown_timeout).await;
}

fn refuse(metrics: &AgentMetrics, reason: &'static str, peer: Peer) {
    metrics.connection_closed("api", reason);
    if let Some(held) = REFUSALS.check() {
        tracing::warn!(
            reason,
            uid = peer.uid,
            pid = peer.pid,
            repeated = held,
            "API connection refused"
        );
    }
}

/// The per-request side: the caller's credentials on the request, a deadline for its answer
/// (the head of a Watch stream: the stream itself may last), the connection's count of open
/// streams.
#[derive(Clone)]
struct CallService {
    routes: Routes,
    peer: Peer,
    streams: Arc<AtomicUsize>,
    timeout: Duration,
}

type Answer = hyper::Response<Counted<tonic::body::Body>>;

impl hyper::service::Service<hyper::Request<Incoming>> for CallService {
    type Response = Answer;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Answer, Self::Error>> + Send>>;

    fn call(&self, mut request: hyper::Request<Incoming>) -> Self::Future {
        request.extensions_mut().insert(self.peer);
        let open = OpenStream::new(self.streams.clone());
        let call = self.routes.clone().call(request);
        let timeout = self.timeout;
        Box::pin(async move {
            let response = match tokio::time::timeout(timeout, call).await {
                Ok(Ok(response)) => response,
                Ok(Err(never)) => match never {},
                Err(_) => tonic::Status::from(crate::status::ApiError::Deadline(format!(
                    "the call took longer than the agent's request timeout ({})",
                    credgate_core::duration::Rounded(timeout)
                )))
                .into_http(),
            };
            let mut response = response;
            undecodable_is_invalid_argument(response.headers_mut());
            Ok(response.map(|body| Counted { body, _open: open }))
        })
    }
}

/// A request whose message does not decode is the client's error: INVALID_ARGUMENT, not the
/// INTERNAL that tonic's codec answers (a status in the answer's head, for every call that
/// fails before its handler).
fn undecodable_is_invalid_argument(headers: &mut hyper::HeaderMap) {
    let undecodable = headers.get("grpc-status").is_some_and(|s| s == "13")
        && headers.get("grpc-message").is_some_and(|m| {
            m.as_bytes().starts_with(b"failed%20to%20decode")
                || m.as_bytes().starts_with(b"failed to decode")
        });
    if undecodable {
        headers.insert("grpc-status", hyper::header::HeaderValue::from_static("3"));
    }
}

/// A stream counted as open while its request is handled and its answer is being sent.
struct OpenStream(Arc<AtomicUsize>);

impl OpenStream {
    fn new(count: Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        OpenStream(count)
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that keeps its stream counted until it is dropped.
pub(super) struct Counted<B> {
    body: B,
    _open: OpenStream,
}

impl<B: Body + Unpin> Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

struct Deadlines {
    handshake: Duration,
    idle: Duration,
    activity: Arc<Activity>,
    streams: Arc<AtomicUsize>,
}

impl Deadlines {
    /// Why the connection should close now, if it should.
    fn expired(&self) -> Option<&'static str> {
        if self.activity.bytes() < PREFACE_LEN && self.activity.age() >= self.handshake {
            return Some("handshake_timeout");
        }
        if self.streams.load(Ordering::Relaxed) == 0 && self.activity.quiet_for() >= self.idle {
            return Some("idle_timeout");
        }
        None
    }

    fn check_every(&self) -> Duration {
        (self.handshake.min(self.idle) / 4).clamp(Duration::from_millis(10), Duration::from_secs(5))
    }
}

/// Runs a connection to its end: until the client closes it, a deadline passes (the client
/// sent no preface in time, or it has been idle with no stream open), or the agent stops.
/// Returns why the agent closed it early, if it did.
async fn drive<I, S, B>(
    connection: hyper::server::conn::http2::Connection<I, S, TokioExecutor>,
    deadlines: Deadlines,
    mut shutdown: watch::Receiver<bool>,
) -> Option<&'static str>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    TokioExecutor: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    let mut connection = std::pin::pin!(connection);
    let mut tick = tokio::time::interval(deadlines.check_every());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut closing = false;
    loop {
        tokio::select! {
            ended = connection.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "API connection ended with an error");
                }
                return None;
            }
            _ = tick.tick() => {
                if let Some(reason) = deadlines.expired() {
                    // A silent or idle client has no call in flight: nothing to finish.
                    tracing::debug!(reason, "closing an API connection");
                    return Some(reason);
                }
            }
            _ = shutdown.wait_for(|s| *s), if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}
