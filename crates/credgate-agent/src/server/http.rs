//! The HTTP/2 side of the API server: accepting on the unix socket, one hyper connection per
//! client with the caller's kernel credentials attached to every request, and graceful
//! shutdown.
//!
//! Calls run on [`FirstPollHere`], an executor that polls a new call once on the connection's
//! own task before handing it to the runtime. A call that is ready at once (a warm `Lookup`,
//! `Ping`) thus has its whole answer queued before the connection next writes, and the answer
//! leaves in the same write as the connection's SETTINGS acknowledgement: one wake-up of the
//! client instead of two. A call that could block its thread or wait long (a plugin run on a
//! miss, a registry round trip) must not do it on the connection's task;
//! [`FirstPollHere::active`] tells it where it is, and [`leave_connection_task`] moves it to
//! its own task.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::ready;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tonic::codegen::Service;
use tonic::service::Routes;

use super::Peer;

/// How long accepting pauses after an error that is not the client's (too many open files):
/// retrying at once would spin.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// Serves `routes` on `listener` until `shutdown` turns true; then stops accepting, asks every
/// connection to finish (HTTP/2 GOAWAY: calls in flight complete, no new ones start) and waits
/// for them.
pub(super) async fn serve(
    routes: Routes,
    listener: UnixListener,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut builder = hyper::server::conn::http2::Builder::new(FirstPollHere);
    builder.timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            () = async { let _ = shutdown.wait_for(|s| *s).await; } => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept an API connection");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                    continue;
                }
            },
        };
        let peer = match stream.peer_cred() {
            Ok(c) => Peer {
                uid: Some(c.uid()),
                gid: Some(c.gid()),
                pid: c.pid(),
            },
            Err(_) => Peer::default(),
        };
        let routes = routes.clone();
        let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
            request.extensions_mut().insert(peer);
            let mut routes = routes.clone();
            routes.call(request)
        });
        let (io, out) = corked(stream);
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(io), service));
        tokio::spawn(async move {
            let connection = Box::pin(connection);
            if let Err(e) = (Uncork { connection, out }).await {
                tracing::debug!(error = %e, "API connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

thread_local! {
    static FIRST_POLL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as in a call's first poll until dropped (also when the poll panics).
struct FirstPoll;

impl FirstPoll {
    fn enter() -> Self {
        FIRST_POLL.with(|f| f.set(true));
        FirstPoll
    }
}

impl Drop for FirstPoll {
    fn drop(&mut self) {
        FIRST_POLL.with(|f| f.set(false));
    }
}

/// The executor of calls: polls a call once where it is handed over (the connection's task),
/// then, if it is not finished, spawns it as a task of its own.
#[derive(Clone, Copy, Debug)]
pub(super) struct FirstPollHere;

impl FirstPollHere {
    /// Whether this is a call's first poll, on its connection's task.
    pub(super) fn active() -> bool {
        FIRST_POLL.with(std::cell::Cell::get)
    }
}

impl<F> hyper::rt::Executor<F> for FirstPollHere
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, call: F) {
        let relay = Arc::new(Relay::default());
        let mut call = Box::pin(call);
        let waker = Waker::from(relay.clone());
        // A call that panics is dropped, as the runtime drops a task that panics: its stream is
        // reset and the connection's other calls go on.
        let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _first = FirstPoll::enter();
            call.as_mut().poll(&mut Context::from_waker(&waker))
        }));
        if let Ok(Poll::Pending) = first {
            tokio::spawn(Relayed { call, relay });
        }
    }
}

/// Forwards wake-ups registered during the first poll to the task the call moved to. A wake-up
/// that comes before the task's first poll needs no forwarding: a new task is polled anyway.
#[derive(Default)]
struct Relay {
    task: Mutex<Option<Waker>>,
}

impl Wake for Relay {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(task) = task {
            task.wake();
        }
    }
}

struct Relayed<F> {
    call: Pin<Box<F>>,
    relay: Arc<Relay>,
}

impl<F: Future> Future for Relayed<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        {
            let mut task = self.relay.task.lock().unwrap_or_else(|p| p.into_inner());
            if !task.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *task = Some(cx.waker().clone());
            }
        }
        self.call.as_mut().poll(cx)
    }
}

/// A future that, on a call's first poll on its connection's task, asks to be polled again
/// (on the call's own task) and is pending; anywhere else it is ready at once. A call awaits it
/// before anything that could block or wait long.
pub(super) fn leave_connection_task() -> impl Future<Output = ()> {
    std::future::poll_fn(|cx| {
        if FirstPollHere::active() {
            cx.waker().wake_by_ref();
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
}

/// The most bytes a connection holds back before its writes wait for the socket.
const CORK_LIMIT: usize = 256 << 10;

/// A connection's socket whose writes are held back until the connection's task has finished
/// its turn ([`Uncork`]), so that what one turn writes (at a client's first call: the SETTINGS,
/// their acknowledgement and the answer) leaves in one write and wakes the client once.
struct Corked {
    read: OwnedReadHalf,
    out: Arc<Mutex<Out>>,
}

struct Out {
    write: OwnedWriteHalf,
    held: Vec<u8>,
}

impl Out {
    /// Writes what is held, until it is all written or the socket is full.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.held.is_empty() {
            let n = ready!(Pin::new(&mut self.write).poll_write(cx, &self.held))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.held.drain(..n);
        }
        Poll::Ready(Ok(()))
    }
}

fn corked(stream: UnixStream) -> (Corked, Arc<Mutex<Out>>) {
    let (read, write) = stream.into_split();
    let out = Arc::new(Mutex::new(Out {
        write,
        held: Vec::new(),
    }));
    (
        Corked {
            read,
            out: out.clone(),
        },
        out,
    )
}

fn lock(out: &Mutex<Out>) -> std::sync::MutexGuard<'_, Out> {
    out.lock().unwrap_or_else(|p| p.into_inner())
}

impl AsyncRead for Corked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.read).poll_read(cx, buf)
    }
}

impl AsyncWrite for Corked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut out = lock(&self.out);
        if out.held.len() >= CORK_LIMIT {
            ready!(out.poll_drain(cx))?;
        }
        out.held.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Held bytes are written when the connection's turn ends.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut out = lock(&self.out);
        ready!(out.poll_drain(cx))?;
        Pin::new(&mut out.write).poll_shutdown(cx)
    }
}

/// A connection's task: each turn of the connection, then the turn's writes in one go.
struct Uncork<C> {
    connection: Pin<Box<C>>,
    out: Arc<Mutex<Out>>,
}

impl<C> Future for Uncork<C>
where
    C: Future<Output = Result<(), hyper::Error>>,
{
    type Output = Result<(), Box<dyn std::error::Error + Send + Sync>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let turn = self.connection.as_mut().poll(cx);
        let drained = lock(&self.out).poll_drain(cx);
        match (turn, drained) {
            (Poll::Ready(done), _) => Poll::Ready(done.map_err(Into::into)),
            (Poll::Pending, Poll::Ready(Err(e))) => Poll::Ready(Err(e.into())),
            (Poll::Pending, _) => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn exec<F: Future<Output = ()> + Send + 'static>(f: F) {
        hyper::rt::Executor::execute(&FirstPollHere, f);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ready_call_finishes_where_it_is_handed_over() {
        let done = Arc::new(AtomicUsize::new(0));
        let d = done.clone();
        exec(async move {
            assert!(FirstPollHere::active(), "first poll is marked");
            d.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(done.load(Ordering::SeqCst), 1, "ran inline");
        assert!(!FirstPollHere::active(), "the mark is gone after the poll");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pending_call_moves_to_a_task_and_keeps_its_wake_ups() {
        // Woken before the task's first poll, and after it.
        for late in [false, true] {
            let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
            let (done_tx, done_rx) = tokio::sync::oneshot::channel();
            exec(async move {
                let v = rx.await.unwrap();
                assert!(!FirstPollHere::active());
                done_tx.send(v).unwrap();
            });
            if late {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tx.send(7).unwrap();
            let got = tokio::time::timeout(Duration::from_secs(5), done_rx).await;
            assert_eq!(got.expect("woken").unwrap(), 7, "late={late}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leaving_the_connection_task_continues_on_the_calls_own_task() {
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        exec(async move {
            let before = FirstPollHere::active();
            leave_connection_task().await;
            done_tx.send((before, FirstPollHere::active())).unwrap();
        });
        let (before, after) = tokio::time::timeout(Duration::from_secs(5), done_rx)
            .await
            .expect("continued")
            .unwrap();
        assert!(before && !after);
        // Outside a first poll, leaving is immediate.
        leave_connection_task().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_that_panics_is_dropped_and_the_mark_cleared() {
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        exec(async { panic!("handler bug") });
        std::panic::set_hook(hook);
        assert!(!FirstPollHere::active());
        // The executor still works.
        let (tx, rx) = tokio::sync::oneshot::channel();
        exec(async move { tx.send(()).unwrap() });
        rx.await.unwrap();
    }

    /// A connection whose one turn writes `chunks` through the cork and checks the peer has
    /// seen none of them yet.
    struct Turn {
        io: Corked,
        peer: std::os::unix::net::UnixStream,
        chunks: Vec<Vec<u8>>,
        next: usize,
    }

    impl Future for Turn {
        type Output = Result<(), hyper::Error>;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
            while self.next < self.chunks.len() {
                let this = &mut *self;
                let chunk = &this.chunks[this.next];
                match Pin::new(&mut this.io).poll_write(cx, chunk) {
                    Poll::Ready(Ok(n)) => assert_eq!(n, chunk.len()),
                    Poll::Ready(Err(e)) => panic!("write: {e}"),
                    Poll::Pending => return Poll::Pending,
                }
                this.next += 1;
                assert!(Pin::new(&mut this.io).poll_flush(cx).is_ready());
            }
            if self.next == self.chunks.len() && self.chunks.len() == 3 {
                // Small writes: none has reached the socket during the turn.
                let mut b = [0u8; 1];
                let e = std::io::Read::read(&mut &self.peer, &mut b).unwrap_err();
                assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "nothing sent mid-turn");
            }
            match Pin::new(&mut self.io).poll_shutdown(cx) {
                Poll::Ready(r) => Poll::Ready(r.map_err(|e| panic!("shutdown: {e}"))),
                Poll::Pending => Poll::Pending,
            }
        }
    }

    async fn through_the_cork(chunks: Vec<Vec<u8>>) -> Vec<u8> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        theirs.set_nonblocking(true).unwrap();
        let (io, out) = corked(UnixStream::from_std(ours).unwrap());
        let peer = theirs.try_clone().unwrap();
        let turn = Turn {
            io,
            peer,
            chunks,
            next: 0,
        };
        let task = tokio::spawn(Uncork {
            connection: Box::pin(turn),
            out,
        });
        let mut theirs = UnixStream::from_std(theirs).unwrap();
        let mut got = Vec::new();
        theirs.read_to_end(&mut got).await.unwrap();
        task.await.unwrap().unwrap();
        let _ = theirs.shutdown().await;
        got
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_turns_writes_leave_together_when_it_ends() {
        let chunks = vec![b"settings".to_vec(), b"ack".to_vec(), b"answer".to_vec()];
        assert_eq!(through_the_cork(chunks).await, b"settingsackanswer");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn more_than_the_cork_holds_waits_for_the_reader_and_arrives_whole() {
        // Several times the limit and the socket's buffer, in uneven pieces.
        let chunks: Vec<Vec<u8>> = (0..40u8)
            .map(|i| vec![i; 30_000 + usize::from(i) * 7])
            .collect();
        let want: Vec<u8> = chunks.concat();
        assert!(want.len() > 4 * CORK_LIMIT);
        assert_eq!(through_the_cork(chunks).await, want);
    }
}
