//! The one accept loop of every listener of the agent: the API socket, the CRI proxy's socket,
//! the registry mirror's and the metrics port.
//!
//! A [`Listener`] decides at accept whether a connection may stay (the caller's uid admitted,
//! a slot free in its budget: in all and per uid), owns every connection task it starts
//! (stopped and drained at shutdown within a deadline), and counts what it refused. HTTP/2
//! connections are served by [`Listener::serve_http2`], which closes them when their peer sent no preface in
//! time or has been idle with no stream open. Each listener has its own budget, and the
//! budgets together fit in the open-file limit (`credgate serve` sizes them), so that no
//! listener can take descriptors from another.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::task::JoinSet;

pub mod conn;
mod rewrite;

use crate::conn::{Activity, Slot, Slots, Throttle};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// Who is calling: the peer's credentials of a unix socket (SO_PEERCRED); nothing for TCP.
#[derive(Debug, Clone, Copy, Default)]
pub struct Peer {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub pid: Option<i32>,
}

/// The HTTP/2 client preface's length; a client that has not sent it within the handshake
/// deadline is not speaking HTTP/2 to us.
const PREFACE_LEN: u64 = credgate_api::frame::PREFACE.len() as u64;

/// A listening socket of some kind. `accept` must be cancel-safe: the listener's loop drops it
/// whenever a connection task ends first, so nothing may be awaited after a connection is
/// taken (it would be dropped unanswered, a reset the client sees).
pub trait Accept: Send {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, Peer)>> + Send;
}

impl Accept for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept(&self) -> io::Result<(Self::Stream, Peer)> {
        let (stream, _) = tokio::net::UnixListener::accept(self).await?;
        let peer = match stream.peer_cred() {
            Ok(c) => Peer {
                uid: Some(c.uid()),
                gid: Some(c.gid()),
                pid: c.pid(),
            },
            Err(_) => Peer::default(),
        };
        Ok((stream, peer))
    }
}

impl Accept for tokio::net::TcpListener {
    type Stream = tokio::net::TcpStream;
    async fn accept(&self) -> io::Result<(Self::Stream, Peer)> {
        let (stream, _) = tokio::net::TcpListener::accept(self).await?;
        Ok((stream, Peer::default()))
    }
}

/// How many bytes one stream may have queued for a client that does not read (beyond it, a
/// proxied answer waits in the runtime's own windows of that caller's connection).
pub const STREAM_SEND_BUFFER: usize = 64 << 10;
/// The server's receive window: what a client may send on a stream, and on a connection,
/// before the agent has read it.
pub const STREAM_WINDOW: u32 = 64 << 10;
pub const CONNECTION_WINDOW: u32 = 256 << 10;

/// hyper's executor for a listener's streams: each stream's task (hyper spawns one a request)
/// is one of the listener's, ended when the listener drains, never left running detached.
#[derive(Clone, Default)]
pub struct Streams(Arc<parking_lot::Mutex<JoinSet<()>>>);

impl<F> hyper::rt::Executor<F> for Streams
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    fn execute(&self, stream: F) {
        let mut set = self.0.lock();
        // Streams that ended are reaped here, so the set holds the running ones.
        while set.try_join_next().is_some() {}
        set.spawn(stream);
    }
}

impl Streams {
    /// Ends every stream still running.
    fn abort(&self) {
        self.0.lock().abort_all();
    }
}

/// The HTTP/2 server settings every gRPC listener of the agent shares: at most `max_streams`
/// open streams and `max_header_list` bytes of headers per request, the windows and send
/// buffer above, and bounds on streams a client resets or makes fail; the streams run as
/// tasks of the listener that made it ([`Listener::http2`]). The header bound is kept beside
/// the builder, as the `:authority` rewriter in front of each connection needs it too.
pub struct Http2 {
    pub builder: hyper::server::conn::http2::Builder<Streams>,
    max_header_list: u32,
}

impl Http2 {
    fn new(streams: Streams, max_streams: u32, max_header_list: u32) -> Self {
        let mut b = hyper::server::conn::http2::Builder::new(streams);
        b.timer(hyper_util::rt::TokioTimer::new())
            .max_concurrent_streams(max_streams)
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_send_buf_size(STREAM_SEND_BUFFER)
            .max_header_list_size(max_header_list)
            .max_pending_accept_reset_streams(Some(32))
            .max_local_error_reset_streams(Some(256))
            // What the `:authority` rewriter in front of every connection assumes of the
            // server: pinned, not left to hyper's defaults.
            .max_frame_size(credgate_api::authority::MAX_FRAME as u32)
            .header_table_size(credgate_api::authority::HEADER_TABLE_SIZE as u32);
        Http2 {
            builder: b,
            max_header_list,
        }
    }
}

/// A listener's budget and deadlines.
#[derive(Debug, Clone)]
pub struct ListenerLimits {
    /// Connections open at once, in all.
    pub max_connections: usize,
    /// Connections open at once for one uid that is not exempt.
    pub max_connections_per_uid: usize,
    /// Uids that count only against the total (root and the agent's own, on unix sockets).
    pub exempt: Vec<u32>,
    /// A new connection that has not sent the HTTP/2 preface by then is closed.
    pub handshake_timeout: Duration,
    /// A connection with no stream open and no request opened or ended for this long is
    /// closed (PINGs and SETTINGS do not count).
    pub idle_timeout: Duration,
    /// How long a stop waits for connections to finish their calls.
    pub shutdown_timeout: Duration,
}

impl ListenerLimits {
    /// Root and this process's uid exempt from the per-uid share.
    pub fn root_and_own_exempt(mut self) -> Self {
        self.exempt = vec![0, rustix::process::geteuid().as_raw()];
        self
    }
}

type Admit = Arc<dyn Fn(Option<u32>) -> bool + Send + Sync>;

/// A listener's name (`api`, `metrics`, `cri-proxy`, `registry-mirror`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

/// A connection a listener closed: its name and `reason`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClosedLabels {
    listener: &'static str,
    reason: &'static str,
}

/// The connection families every listener counts into (`credgate_connections`,
/// `credgate_connections_closed_total`). Cheap to clone; clones count into the same families.
#[derive(Clone, Default)]
pub struct ConnectionMetrics {
    open: Family<ListenerLabels, Gauge>,
    closed: Family<ClosedLabels, Counter>,
}

impl ConnectionMetrics {
    /// Registers both families (into a registry with the `credgate` prefix).
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "connections",
            "Open connections by listener (api, metrics, cri-proxy, registry-mirror)",
            self.open.clone(),
        );
        r.register(
            "connections_closed",
            "Connections the agent closed at once or early, by listener and reason",
            self.closed.clone(),
        );
    }

    /// The gauge of open connections of `listener`.
    pub fn open(&self, listener: &'static str) -> Gauge {
        self.open
            .get_or_create(&ListenerLabels { listener })
            .clone()
    }

    /// Counts a connection a listener closed at once or early (limit, uid_limit,
    /// not_allowed, handshake_timeout, idle_timeout).
    pub fn closed(&self, listener: &'static str, reason: &'static str) {
        self.closed
            .get_or_create(&ClosedLabels { listener, reason })
            .inc();
    }
}

/// A listening socket and the connections it accepted.
pub struct Listener<L> {
    what: &'static str,
    socket: L,
    slots: Slots,
    limits: ListenerLimits,
    admit: Admit,
    metrics: ConnectionMetrics,
    open: Gauge,
    accept_errors: Throttle,
    refusals: Throttle,
    connections: JoinSet<()>,
    streams: Streams,
}

/// A connection that may stay: its stream, who is on the other end, and its place in the
/// budget (given back when [`Held`] is dropped).
pub struct Accepted<S> {
    pub stream: S,
    pub peer: Peer,
    pub held: Held,
}

/// A connection's slot in its listener's budget, and its count among the open ones.
pub struct Held {
    _slot: Slot,
    open: Gauge,
    what: &'static str,
    metrics: ConnectionMetrics,
}

impl Held {
    /// Counts why the agent closed the connection early.
    pub fn closed(&self, reason: &'static str) {
        self.metrics.closed(self.what, reason);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl<L: Accept> Listener<L> {
    /// `what` names the listener in metrics (`listener` label) and logs.
    pub fn new(
        what: &'static str,
        socket: L,
        limits: ListenerLimits,
        metrics: ConnectionMetrics,
    ) -> Self {
        Listener {
            what,
            socket,
            slots: Slots::new(
                limits.max_connections,
                limits.max_connections_per_uid,
                limits.exempt.clone(),
            ),
            open: metrics.open(what),
            limits,
            admit: Arc::new(|_| true),
            metrics,
            accept_errors: Throttle::new(Duration::from_secs(10)),
            refusals: Throttle::new(Duration::from_secs(10)),
            connections: JoinSet::new(),
            streams: Streams::default(),
        }
    }

    /// The shared HTTP/2 settings ([`Http2`]) for this listener's connections, their streams
    /// run as its tasks.
    pub fn http2(&self, max_streams: u32, max_header_list: u32) -> Http2 {
        Http2::new(self.streams.clone(), max_streams, max_header_list)
    }

    /// Closes at once the connections of callers `admit` says no to.
    pub fn admit(mut self, admit: impl Fn(Option<u32>) -> bool + Send + Sync + 'static) -> Self {
        self.admit = Arc::new(admit);
        self
    }

    /// The next connection that may stay; `None` once `shutdown` is cancelled. Refused ones are
    /// closed here, holding nothing, and counted.
    pub async fn next(&mut self, shutdown: &CancellationToken) -> Option<Accepted<L::Stream>> {
        loop {
            let (stream, peer) = conn::next_connection(
                self.what,
                &self.accept_errors,
                shutdown,
                &mut self.connections,
                || self.socket.accept(),
            )
            .await?;
            if !(self.admit)(peer.uid) {
                self.refuse("not_allowed", peer);
                continue;
            }
            match self.slots.try_take(peer.uid) {
                Ok(slot) => {
                    self.open.inc();
                    let held = Held {
                        _slot: slot,
                        open: self.open.clone(),
                        what: self.what,
                        metrics: self.metrics.clone(),
                    };
                    return Some(Accepted { stream, peer, held });
                }
                Err(why) => self.refuse(why.as_str(), peer),
            }
        }
    }

    fn refuse(&self, reason: &'static str, peer: Peer) {
        self.metrics.closed(self.what, reason);
        if let Some(held) = self.refusals.check() {
            tracing::warn!(
                listener = self.what,
                reason,
                uid = peer.uid,
                pid = peer.pid,
                repeated = held,
                "connection refused"
            );
        }
    }

    /// Runs a connection's task, owned by the listener.
    pub fn spawn(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        self.connections.spawn(task);
    }

    /// Serves an accepted connection with HTTP/2 as `builder` is set up, `service` answering
    /// its requests: the client's header blocks re-emitted with `:authority: localhost` (each
    /// at most 4 x `max_header_list`, as sent or decoded), each request counted as an open
    /// stream until its answer's body ends (a connection with one is never idle), the
    /// connection driven under the listener's deadlines by a task the listener owns.
    pub fn serve_http2<S, B>(
        &mut self,
        accepted: Accepted<L::Stream>,
        http2: &Http2,
        service: S,
        shutdown: CancellationToken,
    ) where
        S: hyper::service::Service<hyper::Request<Incoming>, Response = hyper::Response<B>>
            + Send
            + 'static,
        S::Error: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
        S::Future: Send + 'static,
        B: Body + Send + Unpin + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let tracker = ConnectionState::new();
        let io = hyper_util::rt::TokioIo::new(crate::rewrite::Rewritten::new(
            conn::Watched::new(accepted.stream, tracker.activity.clone()),
            4 * http2.max_header_list as usize,
        ));
        let counted = Counted {
            service,
            state: tracker.clone(),
        };
        let connection = http2.builder.serve_connection(io, counted);
        let task = drive(
            connection,
            tracker,
            self.limits.clone(),
            accepted.held,
            shutdown,
        );
        self.connections.spawn(task);
    }

    /// After `shutdown` (the connections saw it too and are finishing their calls): stops
    /// accepting, waits for them at most the shutdown deadline, then ends those left.
    pub async fn drain(mut self) {
        drop(self.socket);
        conn::drain(
            self.what,
            &mut self.connections,
            self.limits.shutdown_timeout,
        )
        .await;
        // Their connections ended (or were closed at the deadline): what is left of their
        // streams has no one to answer.
        self.streams.abort();
    }
}

/// What an HTTP/2 connection's deadlines watch: how much its peer sent and when, and how many
/// of its streams are open.
#[derive(Clone)]
struct ConnectionState {
    activity: Arc<Activity>,
    streams: Arc<AtomicUsize>,
}

impl ConnectionState {
    fn new() -> Self {
        ConnectionState {
            activity: Activity::new(),
            streams: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// A stream counted as open until the returned guard (kept with its answer's body) drops.
    fn stream(&self) -> OpenStream {
        self.streams.fetch_add(1, Ordering::Relaxed);
        self.activity.requested();
        OpenStream(self.streams.clone(), self.activity.clone())
    }

    /// Why the connection should close now, if it should.
    fn expired(&self, limits: &ListenerLimits) -> Option<&'static str> {
        if self.activity.bytes() < PREFACE_LEN && self.activity.age() >= limits.handshake_timeout {
            return Some("handshake_timeout");
        }
        if self.streams.load(Ordering::Relaxed) == 0
            && self.activity.quiet_for() >= limits.idle_timeout
        {
            return Some("idle_timeout");
        }
        None
    }
}

/// A stream counted as open while its request is handled and its answer is being sent.
struct OpenStream(Arc<AtomicUsize>, Arc<Activity>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        self.1.requested();
    }
}

/// A response body that keeps its stream counted until it is dropped.
type OpenBody<B> = Guarded<B, OpenStream>;

/// A connection's service with each request counted as one of its open streams until the
/// answer's body is dropped.
#[derive(Clone)]
struct Counted<S> {
    service: S,
    state: ConnectionState,
}

type CountedAnswer<B, E> =
    Pin<Box<dyn Future<Output = Result<hyper::Response<OpenBody<B>>, E>> + Send>>;

impl<S, B> hyper::service::Service<hyper::Request<Incoming>> for Counted<S>
where
    S: hyper::service::Service<hyper::Request<Incoming>, Response = hyper::Response<B>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    B: 'static,
{
    type Response = hyper::Response<OpenBody<B>>;
    type Error = S::Error;
    type Future = CountedAnswer<B, S::Error>;

    fn call(&self, request: hyper::Request<Incoming>) -> Self::Future {
        let open = self.state.stream();
        let answer = self.service.call(request);
        Box::pin(async move { Ok(answer.await?.map(|body| OpenBody::new(body, open))) })
    }
}

/// A body that keeps `G` (a count, a budget) until it is dropped.
pub struct Guarded<B, G> {
    body: B,
    _guard: G,
}

impl<B, G> Guarded<B, G> {
    pub fn new(body: B, guard: G) -> Self {
        Guarded {
            body,
            _guard: guard,
        }
    }
}

impl<B: Body + Unpin, G: Unpin> Body for Guarded<B, G> {
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

/// Runs an HTTP/2 connection to its end: until the client closes it, a deadline of `limits`
/// passes (no preface in time; idle with no stream open), or the agent stops (then it is
/// asked to finish: GOAWAY, calls in flight complete). Counts why the agent closed it early.
async fn drive<I, S, B>(
    connection: hyper::server::conn::http2::Connection<I, S, Streams>,
    tracker: ConnectionState,
    limits: ListenerLimits,
    held: Held,
    shutdown: CancellationToken,
) where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    Streams: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    let mut connection = std::pin::pin!(connection);
    let every = (limits.handshake_timeout.min(limits.idle_timeout) / 4)
        .clamp(Duration::from_millis(10), Duration::from_secs(5));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut closing = false;
    loop {
        tokio::select! {
            ended = connection.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(listener = held.what, error = %e, "connection ended with an error");
                }
                return;
            }
            _ = tick.tick() => {
                if let Some(reason) = tracker.expired(&limits) {
                    // A silent or idle client has no call in flight: nothing to finish.
                    tracing::debug!(listener = held.what, reason, "closing a connection");
                    held.closed(reason);
                    return;
                }
            }
            () = shutdown.cancelled(), if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}
