//! What every listener of the agent shares: a bounded number of connections (in all and per
//! uid), accept errors that pause instead of spinning, warnings that cannot flood the log, and
//! IO that remembers how much its peer sent and when.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use tokio::io::{AsyncRead, ReadBuf};

/// How long accepting pauses after an error that is not the client's (too many open files):
/// retrying at once would spin.
pub const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// A budget of connections: at most `max` in all and, for a uid that is not exempt, at most
/// `per_uid` of them; the last [`reserved`] slots are for exempt uids (root and the agent's
/// own) alone, so that no number of other callers can lock them out.
#[derive(Clone)]
pub struct Slots {
    inner: Arc<SlotsInner>,
}

struct SlotsInner {
    max: usize,
    /// Of `max`, the slots only exempt uids may take.
    reserved: usize,
    per_uid: usize,
    exempt: Vec<u32>,
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    total: usize,
    by_uid: HashMap<u32, usize>,
}

/// Why a connection got no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoSlot {
    /// Every slot is taken.
    Full,
    /// The caller's uid holds its share.
    UidFull,
}

impl NoSlot {
    pub fn as_str(self) -> &'static str {
        match self {
            NoSlot::Full => "limit",
            NoSlot::UidFull => "uid_limit",
        }
    }
}

/// Of a budget of `max` connections, how many only root and the agent's own uid may take: an
/// eighth, at least one (and none of a budget of one).
pub fn reserved(max: usize) -> usize {
    if max <= 1 {
        0
    } else {
        (max / 8).max(1)
    }
}

/// A connection's place in a [`Slots`] budget, given back on drop.
pub struct Slot {
    inner: Arc<SlotsInner>,
    uid: Option<u32>,
}

impl Slots {
    /// `exempt` uids (root, the agent's own) count only against `max`, and they alone may
    /// take the last [`reserved`]`(max)` slots.
    pub fn new(max: usize, per_uid: usize, exempt: Vec<u32>) -> Self {
        Slots {
            inner: Arc::new(SlotsInner {
                max,
                reserved: if exempt.is_empty() { 0 } else { reserved(max) },
                per_uid,
                exempt,
                state: Mutex::new(SlotState::default()),
            }),
        }
    }

    /// A slot for a connection of `uid` (`None` for TCP peers), if the budget has one.
    pub fn try_take(&self, uid: Option<u32>) -> Result<Slot, NoSlot> {
        let mut state = self.inner.state.lock();
        if state.total >= self.inner.max {
            return Err(NoSlot::Full);
        }
        let counted = uid.filter(|u| !self.inner.exempt.contains(u));
        let exempt = uid.is_some_and(|u| self.inner.exempt.contains(&u));
        if !exempt && state.total + self.inner.reserved >= self.inner.max {
            return Err(NoSlot::Full);
        }
        if let Some(u) = counted {
            let n = state.by_uid.entry(u).or_default();
            if *n >= self.inner.per_uid {
                return Err(NoSlot::UidFull);
            }
            *n += 1;
        }
        state.total += 1;
        Ok(Slot {
            inner: self.inner.clone(),
            uid: counted,
        })
    }

    /// Connections holding a slot now.
    #[cfg(test)]
    fn in_use(&self) -> usize {
        self.inner.state.lock().total
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut state = self.inner.state.lock();
        state.total -= 1;
        if let Some(u) = self.uid {
            if let Some(n) = state.by_uid.get_mut(&u) {
                *n -= 1;
                if *n == 0 {
                    state.by_uid.remove(&u);
                }
            }
        }
    }
}

/// Lets a repeated warning through at most once per period, counting what it held back.
pub struct Throttle {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub const fn new(every: Duration) -> Self {
        Throttle {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(n)` when this occurrence should be logged, `n` being how many were held back since
    /// the last one that was; `None` when it should not.
    pub fn check(&self) -> Option<u64> {
        let now = Instant::now();
        let mut state = self.state.lock();
        match state.0 {
            Some(last) if now.duration_since(last) < self.every => {
                state.1 += 1;
                None
            }
            _ => {
                let held = std::mem::take(&mut state.1);
                state.0 = Some(now);
                Some(held)
            }
        }
    }
}

/// Logs an accept error (throttled) and pauses, so that running out of descriptors neither
/// spins a core nor fills the disk with log lines.
pub async fn accept_failed(what: &'static str, throttle: &Throttle, e: &io::Error) {
    if let Some(held) = throttle.check() {
        tracing::warn!(listener = what, error = %e, repeated = held, "cannot accept a connection");
    }
    tokio::time::sleep(ACCEPT_PAUSE).await;
}

/// The next connection a listener accepts, reaping finished connection tasks meanwhile (so
/// that `connections` holds only live ones) and pausing on accept errors; `None` once
/// `shutdown` is cancelled.
pub async fn next_connection<S, A, F>(
    what: &'static str,
    throttle: &Throttle,
    shutdown: &CancellationToken,
    connections: &mut tokio::task::JoinSet<()>,
    mut accept: impl FnMut() -> F,
) -> Option<(S, A)>
where
    F: std::future::Future<Output = io::Result<(S, A)>>,
{
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return None,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = accept() => match accepted {
                Ok(pair) => return Some(pair),
                Err(e) => accept_failed(what, throttle, &e).await,
            },
        }
    }
}

/// Waits at most `timeout` for `connections` (already told to finish) to end, then ends those
/// left, with a warning unless the timeout was zero (nothing is waited for).
pub async fn drain(
    what: &'static str,
    connections: &mut tokio::task::JoinSet<()>,
    timeout: Duration,
) {
    let finished = tokio::time::timeout(timeout, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if finished.is_err() && !timeout.is_zero() {
        tracing::warn!(
            listener = what,
            connections = connections.len(),
            timeout = %credgate_core::duration::Rounded(timeout),
            "closing connections still open at the shutdown deadline"
        );
        connections.shutdown().await;
    }
}

/// How much a connection's peer sent, and when it last opened or ended a request. Its time
/// is tokio's, as the deadlines that read it are: a test on a paused runtime steps it.
pub struct Activity {
    origin: tokio::time::Instant,
    bytes: AtomicU64,
    last_ms: AtomicU64,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        Arc::new(Activity {
            origin: tokio::time::Instant::now(),
            bytes: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
        })
    }

    /// Bytes read from the peer so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// How long the connection has been open.
    pub fn age(&self) -> Duration {
        self.origin.elapsed()
    }

    /// How long since the peer last opened a request or one of its requests ended (or since
    /// the connection opened). Bytes alone are no activity: a peer that only sends PINGs or
    /// SETTINGS holds a slot for nothing.
    pub fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.origin.elapsed().saturating_sub(last)
    }

    fn read(&self, n: usize) {
        if n > 0 {
            self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// A request opened or ended now.
    pub fn requested(&self) {
        let now = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(now, Ordering::Relaxed);
    }
}

/// A connection's IO that counts what its peer sent into its [`Activity`].
pub struct Watched<T> {
    io: T,
    activity: Arc<Activity>,
}

impl<T> Watched<T> {
    pub fn new(io: T, activity: Arc<Activity>) -> Self {
        Watched { io, activity }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        std::task::ready!(Pin::new(&mut self.io).poll_read(cx, buf))?;
        self.activity.read(buf.filled().len() - before);
        Poll::Ready(Ok(()))
    }
}

forward_write!(Watched);

/// `AsyncWrite` for a wrapper whose field `io` is written unchanged.
macro_rules! forward_write {
    ($wrapper:ident) => {
        impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for $wrapper<T> {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                data: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.io).poll_write(cx, data)
            }

            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.io.is_write_vectored()
            }

            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.io).poll_flush(cx)
            }

            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
            }
        }
    };
}
pub(crate) use forward_write;

/// Raises the soft limit of open descriptors to the hard one and returns it, so that the
/// connection budgets can be checked against what the process may really open.
pub fn raise_nofile_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        limit.current = limit.maximum;
        let _ = setrlimit(Resource::Nofile, limit);
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_bound_the_total_and_each_uid_and_come_back_on_drop() {
        // 5 slots, 1 of them kept for exempt uids.
        let slots = Slots::new(5, 2, vec![0]);
        let a = slots.try_take(Some(1000)).unwrap();
        let _b = slots.try_take(Some(1000)).unwrap();
        assert_eq!(slots.try_take(Some(1000)).err(), Some(NoSlot::UidFull));
        // Another uid and an exempt one still get in, up to the total.
        let _c = slots.try_take(Some(1001)).unwrap();
        let _d = slots.try_take(Some(0)).unwrap();
        let _e = slots.try_take(Some(0)).unwrap();
        assert_eq!(slots.try_take(Some(0)).err(), Some(NoSlot::Full));
        assert_eq!(slots.in_use(), 5);
        drop(a);
        assert_eq!(slots.in_use(), 4);
        let _f = slots.try_take(Some(0)).expect("the slot came back");
    }

    /// Uids that are not exempt, however many, leave the reserved slots to root and the
    /// agent's own uid.
    #[test]
    fn the_reserved_slots_are_for_exempt_uids_alone() {
        let slots = Slots::new(16, 4, vec![0, 7]);
        assert_eq!(reserved(16), 2);
        let others: Vec<Slot> = (0..14)
            .map(|i| slots.try_take(Some(1000 + i / 4)).unwrap())
            .collect();
        assert_eq!(slots.try_take(Some(2000)).err(), Some(NoSlot::Full));
        assert_eq!(slots.try_take(None).err(), Some(NoSlot::Full));
        let root = slots.try_take(Some(0)).expect("root's reserved slot");
        let own = slots.try_take(Some(7)).expect("the agent's reserved slot");
        assert_eq!(slots.try_take(Some(0)).err(), Some(NoSlot::Full));
        drop((others, root, own));
        assert_eq!(slots.in_use(), 0);
        assert_eq!((reserved(1), reserved(2), reserved(512)), (0, 1, 64));
    }

    #[test]
    fn exempt_uids_count_only_against_the_total() {
        let slots = Slots::new(3, 1, vec![0]);
        let held: Vec<Slot> = (0..3).map(|_| slots.try_take(Some(0)).unwrap()).collect();
        assert_eq!(held.len(), 3);
        assert_eq!(slots.try_take(None).err(), Some(NoSlot::Full));
    }

    #[test]
    fn a_throttle_lets_one_through_per_period_and_counts_the_rest() {
        let t = Throttle::new(Duration::from_secs(3600));
        assert_eq!(t.check(), Some(0));
        for _ in 0..5 {
            assert_eq!(t.check(), None);
        }
        let t = Throttle::new(Duration::ZERO);
        assert_eq!(t.check(), Some(0));
        assert_eq!(t.check(), Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn counted_io_counts_what_it_reads_and_bytes_are_no_request() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (a, mut b) = tokio::io::duplex(64);
        let activity = Activity::new();
        let mut w = Watched::new(a, activity.clone());
        assert_eq!(activity.bytes(), 0);
        tokio::time::advance(Duration::from_millis(30)).await;
        b.write_all(b"hello").await.unwrap();
        let mut buf = [0u8; 5];
        w.read_exact(&mut buf).await.unwrap();
        assert_eq!(activity.bytes(), 5);
        // Bytes alone leave the connection quiet since it opened; a request ends that.
        assert_eq!(activity.quiet_for(), Duration::from_millis(30));
        assert_eq!(activity.age(), Duration::from_millis(30));
        activity.requested();
        assert_eq!(activity.quiet_for(), Duration::ZERO);
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(activity.quiet_for(), Duration::from_millis(10));
        w.write_all(b"back").await.unwrap();
        let mut back = [0u8; 4];
        b.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"back");
    }
}
