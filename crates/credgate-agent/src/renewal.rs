//! Renewal: keeps the credentials of tracked refs fresh ahead of their expiry and pushes
//! changes to watchers.
//!
//! Each tracked ref remembers the cache entries its last good resolution came from. It falls
//! due when the first of them reaches its renewal time ([`RenewalPolicy::renew_at`], jittered
//! per entry, so every ref an entry serves falls due at the same moment). A due ref is looked up
//! again asking for validity past that entry's old expiry: the first such lookup runs the
//! plugin, and every other ref the entry serves is answered by the renewed entry (or joins the
//! run in flight), so an entry is renewed once however many refs share it. A failure keeps the
//! last good credentials and retries with capped, jittered exponential backoff.
//!
//! Everything reads time from the injected [`Clock`] and sleeps with tokio's timer, so a test
//! on a paused runtime moves through days of renewals in milliseconds.

use parking_lot::{Mutex, MutexGuard};
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use credgate_core::reference::{ImageRef, ReferenceError};
use credgate_core::renewal::{self, RenewalPolicy};
use credgate_core::tracking::{Change, Tracker};
use credgate_engine::clock::Clock;
use credgate_engine::{Credential, Engine, EntryInfo, LookupRequest};
use secrecy::{ExposeSecret, SecretString};
use tokio::sync::{watch, Notify};

use crate::captured::{Captured, PodCredential};
use crate::metrics::AgentMetrics;
use crate::tasks::Tasks;

/// The shortest time between two renewals of one ref.
const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// The longest consumer name.
pub const CONSUMER_NAME_MAX: usize = 253;
/// The most refs one consumer (or one Watch stream) holds.
pub const MAX_REFS_PER_CONSUMER: usize = 4096;
/// The most named consumers at once (Watch streams are bounded by the connections instead).
pub const MAX_CONSUMERS: usize = 1024;
/// The most refs the named consumers of one caller uid hold together (root and the agent's
/// own uid excepted): a uid of the socket group cannot grow the tracked set, and the sealed
/// cache that keeps it, by naming more consumers. Each ref may cost a plugin run per renewal
/// (4096 refs behind a provider with 20 s answers made ~400 runs a second in the soak), so a
/// tenant gets far fewer than a node's own consumers (root) may hold.
pub const MAX_REFS_PER_UID: usize = 512;
/// The most refs the consumers of every uid other than root and the agent's own hold
/// together: uids are cheap (a pod can pick its `runAsUser`), so the per-uid bound alone let
/// ~800 uids track 409k refs (1.64 GB). Root's and the agent's own room is kept beside it, as
/// the listener keeps theirs.
pub const MAX_REFS_UNPRIVILEGED: usize = 8192;

/// Why a tracking call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrackError {
    #[error("consumer name must not be empty")]
    NoConsumer,
    #[error("consumer names starting with \"watch:\" are reserved for Watch streams")]
    ReservedConsumer,
    #[error("invalid ref {}: {error}", credgate_core::text::Quoted(image))]
    InvalidRef {
        image: String,
        error: ReferenceError,
    },
    #[error("consumer name {} is invalid: at most {CONSUMER_NAME_MAX} characters of letters, digits and -._:/@", credgate_core::text::Quoted(.0))]
    BadConsumer(String),
    #[error("a consumer may hold at most {MAX_REFS_PER_CONSUMER} refs")]
    TooManyRefs,
    #[error("at most {MAX_CONSUMERS} consumers may track refs at once")]
    TooManyConsumers,
    #[error("the consumers of one caller may hold at most {MAX_REFS_PER_UID} refs together")]
    TooManyRefsForCaller,
    #[error("the consumers of callers other than root and the agent's own hold {MAX_REFS_UNPRIVILEGED} refs together already")]
    TooManyRefsUnprivileged,
}

/// A ref's credentials as watchers see them.
#[derive(Debug)]
pub struct Value {
    /// Increases by one with each change.
    pub revision: u64,
    /// In try-order.
    pub credentials: Vec<Credential>,
    /// The pull credential the CRI proxy captured for the ref's repository (tried before
    /// `credentials`), with that repository.
    pub captured: Option<(String, PodCredential)>,
}

impl Value {
    fn same(&self, credentials: &[Credential], captured: &Option<(String, PodCredential)>) -> bool {
        same(&self.credentials, credentials)
            && match (&self.captured, captured) {
                (None, None) => true,
                (Some((ra, a)), Some((rb, b))) => ra == rb && a.same(b),
                _ => false,
            }
    }
}

/// How far the first renewal checks of restored refs are spread.
pub const RESTORE_JITTER: Duration = Duration::from_secs(10);

/// A delay in `[0, max)` that differs by ref and by process (a stable hash, not a random
/// source: enough to spread agents and refs apart).
fn jitter(seed: u64, r: &str, max: Duration) -> Duration {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    seed.hash(&mut h);
    r.hash(&mut h);
    let max_ms = u64::try_from(max.as_millis()).unwrap_or(u64::MAX).max(1);
    Duration::from_millis(h.finish() % max_ms)
}

/// Renewal state of one ref, for operators.
#[derive(Debug, Clone)]
pub struct TrackedInfo {
    pub image: String,
    pub consumers: Vec<String>,
    pub last_success: Option<SystemTime>,
    pub last_error: Option<String>,
    pub next_attempt: Option<SystemTime>,
    pub consecutive_failures: u32,
    pub credentials: usize,
    /// `None` too once its cache entries were flushed, until a renewal succeeds.
    pub expires_at: Option<SystemTime>,
    /// An operator flushed the cache entries its credentials came from (`ctl flush`): it is
    /// renewed at once, and what it holds until then is last-known-good.
    pub flushed: bool,
}

struct RefState {
    tx: watch::Sender<Option<Arc<Value>>>,
    /// Last known good.
    value: Option<Arc<Value>>,
    entries: Vec<EntryInfo>,
    last_success: Option<SystemTime>,
    last_error: Option<String>,
    failures: u32,
    /// When it falls due; `None` while a renewal is in flight.
    next: Option<Instant>,
    /// Credentials of its value a registry refused since its last renewal.
    refused: Vec<(String, SecretString)>,
    /// The cache entries its value came from were flushed since its last renewal.
    flushed: bool,
}

impl RefState {
    fn new() -> Self {
        RefState {
            tx: watch::Sender::new(None),
            value: None,
            entries: Vec::new(),
            last_success: None,
            last_error: None,
            failures: 0,
            next: None,
            refused: Vec::new(),
            flushed: false,
        }
    }
}

#[derive(Default)]
struct State {
    tracker: Tracker,
    refs: HashMap<String, RefState>,
    /// Each ref's `next`, in time order: a wake costs what falls due, not what is tracked.
    queue: std::collections::BTreeSet<(Instant, String)>,
    /// The uid that named each consumer (not root's or the agent's own).
    owners: HashMap<String, u32>,
}

impl State {
    /// Sets when `image` falls due (`None`: a renewal is in flight), in its state and the
    /// queue.
    fn set_next(&mut self, image: &str, next: Option<Instant>) {
        let Some(rs) = self.refs.get_mut(image) else {
            return;
        };
        if let Some(old) = rs.next {
            self.queue.remove(&(old, image.to_owned()));
        }
        rs.next = next;
        if let Some(t) = next {
            self.queue.insert((t, image.to_owned()));
        }
    }

    /// Forgets `image`.
    fn remove(&mut self, image: &str) {
        if let Some(rs) = self.refs.remove(image) {
            if let Some(t) = rs.next {
                self.queue.remove(&(t, image.to_owned()));
            }
        }
    }
}

struct Shared {
    state: Mutex<State>,
    wake: Notify,
    engine: Arc<ArcSwap<Engine>>,
    clock: Arc<dyn Clock>,
    policy: RenewalPolicy,
    metrics: AgentMetrics,
    watch_ids: AtomicU64,
    /// Bumped whenever a consumer's set of refs changes (to know when to save them).
    version: AtomicU64,
    /// Pull credentials captured by the CRI proxy, when it runs.
    captured: Option<Arc<Captured>>,
    /// Where renewals run, and their stop.
    tasks: Tasks,
}

/// The renewal service. Cheap to clone.
#[derive(Clone)]
pub struct Renewer {
    shared: Arc<Shared>,
}

/// A Watch subscription; releases the refs it tracked when dropped.
pub struct Subscription {
    renewer: Renewer,
    consumer: String,
    /// One receiver per ref.
    pub receivers: Vec<(String, watch::Receiver<Option<Arc<Value>>>)>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let now = self.renewer.shared.clock.now();
        let mut st = self.renewer.lock();
        st.tracker.drop_consumer(&self.consumer, now);
        drop(st);
        self.renewer.shared.metrics.watchers.dec();
        self.renewer.shared.wake.notify_one();
    }
}

/// Refuses `mine` refs for `consumer` when, with what the other consumers of caller `uid`
/// hold, they pass [`MAX_REFS_PER_UID`], or with what every unprivileged uid's consumers hold,
/// [`MAX_REFS_UNPRIVILEGED`]; root's and the agent's own uid are not bounded.
fn uid_room(st: &State, uid: Option<u32>, consumer: &str, mine: usize) -> Result<(), TrackError> {
    let Some(uid) = uid.filter(|u| !exempt(*u)) else {
        return Ok(());
    };
    let (mut same_uid, mut unprivileged) = (0, 0);
    for (c, o) in st.owners.iter().filter(|(c, _)| *c != consumer) {
        let held = st.tracker.held_by(c).count();
        unprivileged += held;
        if *o == uid {
            same_uid += held;
        }
    }
    if same_uid + mine > MAX_REFS_PER_UID {
        return Err(TrackError::TooManyRefsForCaller);
    }
    if unprivileged + mine > MAX_REFS_UNPRIVILEGED {
        return Err(TrackError::TooManyRefsUnprivileged);
    }
    Ok(())
}

/// Root and the agent's own uid: not bounded per uid.
fn exempt(uid: u32) -> bool {
    uid == 0 || uid == rustix::process::geteuid().as_raw()
}

fn seed(x: &impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    x.hash(&mut h);
    h.finish()
}

/// Makes `credentials` (after `captured`) the ref's value when they differ from its last one:
/// a new revision, sent to its watchers.
fn publish(
    rs: &mut RefState,
    credentials: Vec<Credential>,
    captured: Option<(String, PodCredential)>,
) {
    if rs
        .value
        .as_ref()
        .is_some_and(|v| v.same(&credentials, &captured))
    {
        return;
    }
    let value = Arc::new(Value {
        revision: rs.value.as_ref().map_or(1, |v| v.revision + 1),
        credentials,
        captured,
    });
    rs.value = Some(value.clone());
    rs.tx.send_replace(Some(value));
}

/// The credentials of `value` but those refused.
fn without_refused(value: Option<&Value>, refused: &[(String, SecretString)]) -> Vec<Credential> {
    let Some(value) = value else {
        return Vec::new();
    };
    value
        .credentials
        .iter()
        .filter(|c| {
            !refused
                .iter()
                .any(|(u, p)| c.username == *u && c.password.expose_secret() == p.expose_secret())
        })
        .cloned()
        .collect()
}

/// Whether two credential lists are the same for a consumer (expiry alone does not count).
fn same(a: &[Credential], b: &[Credential]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.source == y.source
                && x.pattern == y.pattern
                && x.username == y.username
                && x.password.expose_secret() == y.password.expose_secret()
        })
}

impl Renewer {
    pub fn new(
        engine: Arc<ArcSwap<Engine>>,
        clock: Arc<dyn Clock>,
        policy: RenewalPolicy,
        metrics: AgentMetrics,
        tasks: Tasks,
        captured: Option<Arc<Captured>>,
    ) -> Self {
        Renewer {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                wake: Notify::new(),
                engine,
                clock,
                policy,
                metrics,
                watch_ids: AtomicU64::new(0),
                version: AtomicU64::new(0),
                captured,
                tasks,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock()
    }

    fn validate(consumer: &str, refs: &[String]) -> Result<(), TrackError> {
        Self::validate_consumer(consumer)?;
        if consumer.starts_with("watch:") {
            return Err(TrackError::ReservedConsumer);
        }
        Self::validate_refs(refs)
    }

    fn validate_consumer(consumer: &str) -> Result<(), TrackError> {
        if consumer.is_empty() {
            return Err(TrackError::NoConsumer);
        }
        let ok_char = |c: char| c.is_ascii_alphanumeric() || "-._:/@".contains(c);
        if consumer.len() > CONSUMER_NAME_MAX || !consumer.chars().all(ok_char) {
            return Err(TrackError::BadConsumer(consumer.to_owned()));
        }
        Ok(())
    }

    /// Refuses a change that would leave `consumer` holding more refs than allowed, its
    /// caller `uid`'s consumers more than [`MAX_REFS_PER_UID`] together or every other uid's
    /// more than [`MAX_REFS_UNPRIVILEGED`] ([`uid_room`]), or add a consumer past the limit.
    /// `replace`: the refs become all it holds (SetTracked).
    fn check_room(
        &self,
        uid: Option<u32>,
        consumer: &str,
        refs: &[String],
        replace: bool,
    ) -> Result<(), TrackError> {
        let st = self.lock();
        let mut mine: std::collections::BTreeSet<&str> = if replace {
            Default::default()
        } else {
            st.tracker.held_by(consumer).collect()
        };
        mine.extend(refs.iter().map(String::as_str));
        uid_room(&st, uid, consumer, mine.len())?;
        let known = st.tracker.has_consumer(consumer);
        if !known && !refs.is_empty() && st.tracker.consumers() >= MAX_CONSUMERS {
            return Err(TrackError::TooManyConsumers);
        }
        let mut after: std::collections::BTreeSet<&str> = if replace {
            Default::default()
        } else {
            st.tracker.held_by(consumer).collect()
        };
        for r in refs {
            after.insert(r);
            if after.len() > MAX_REFS_PER_CONSUMER {
                return Err(TrackError::TooManyRefs);
            }
        }
        Ok(())
    }

    fn validate_refs(refs: &[String]) -> Result<(), TrackError> {
        if refs.len() > MAX_REFS_PER_CONSUMER {
            return Err(TrackError::TooManyRefs);
        }
        for r in refs {
            ImageRef::parse(r).map_err(|error| TrackError::InvalidRef {
                image: r.clone(),
                error,
            })?;
        }
        Ok(())
    }

    /// Applies a tracking change and schedules new refs at once.
    fn apply(&self, f: impl FnOnce(&mut Tracker, Instant) -> Change) -> Change {
        self.apply_at(f, |_| Duration::ZERO)
    }

    /// Applies a tracking change and schedules each new ref `delay(ref)` from now.
    fn apply_at(
        &self,
        f: impl FnOnce(&mut Tracker, Instant) -> Change,
        delay: impl Fn(&str) -> Duration,
    ) -> Change {
        let now = self.shared.clock.now();
        let mut st = self.lock();
        let change = f(&mut st.tracker, now);
        for r in &change.new_refs {
            st.refs.insert(r.clone(), RefState::new());
            st.set_next(r, Some(now + delay(r)));
        }
        self.shared
            .metrics
            .tracked_refs
            .set(st.tracker.len() as i64);
        drop(st);
        if !change.added.is_empty() || !change.removed.is_empty() {
            self.shared.version.fetch_add(1, Ordering::Release);
        }
        if !change.new_refs.is_empty() || !change.removed.is_empty() {
            self.shared.wake.notify_one();
        }
        change
    }

    /// Adds refs to what `consumer` holds; returns how many it holds now.
    pub fn track(&self, consumer: &str, refs: &[String]) -> Result<usize, TrackError> {
        self.track_as(None, consumer, refs)
    }

    /// [`Renewer::track`] for a caller of `uid` (`None`: in-process, unbounded by uid).
    pub fn track_as(
        &self,
        uid: Option<u32>,
        consumer: &str,
        refs: &[String],
    ) -> Result<usize, TrackError> {
        Self::validate(consumer, refs)?;
        self.check_room(uid, consumer, refs, false)?;
        self.own(uid, consumer);
        self.apply(|t, now| t.track(consumer, refs.iter().map(String::as_str), now));
        Ok(self.lock().tracker.held_by(consumer).count())
    }

    /// Counts `consumer`'s refs against `uid` from now on (not root's or the agent's own).
    fn own(&self, uid: Option<u32>, consumer: &str) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let tracker = &st.tracker;
        st.owners
            .retain(|c, _| c == consumer || tracker.has_consumer(c));
        match uid.filter(|u| !exempt(*u)) {
            Some(u) => {
                st.owners.insert(consumer.to_owned(), u);
            }
            None => {
                st.owners.remove(consumer);
            }
        }
    }

    /// Removes refs from what `consumer` holds; returns how many it holds now.
    pub fn untrack(&self, consumer: &str, refs: &[String]) -> Result<usize, TrackError> {
        Self::validate_consumer(consumer)?;
        self.apply(|t, now| t.untrack(consumer, refs.iter().map(String::as_str), now));
        Ok(self.lock().tracker.held_by(consumer).count())
    }

    /// Makes `refs` all that `consumer` holds.
    pub fn set_tracked(&self, consumer: &str, refs: &[String]) -> Result<Change, TrackError> {
        self.set_tracked_as(None, consumer, refs)
    }

    /// [`Renewer::set_tracked`] for a caller of `uid` (`None`: in-process).
    pub fn set_tracked_as(
        &self,
        uid: Option<u32>,
        consumer: &str,
        refs: &[String],
    ) -> Result<Change, TrackError> {
        Self::validate(consumer, refs)?;
        self.check_room(uid, consumer, refs, true)?;
        self.own(uid, consumer);
        Ok(self.apply(|t, now| t.set(consumer, refs.iter().map(String::as_str), now)))
    }

    /// What a restart restores: like [`Renewer::set_tracked`], with each ref's first check
    /// spread over [`RESTORE_JITTER`], so that agents restarted together (a rollout, a
    /// reboot of many nodes) do not renew at the same instant. A ref whose saved answer is
    /// still valid beyond the renewal lead costs no plugin run at that check.
    pub fn restore(&self, consumer: &str, refs: &[String]) -> Result<Change, TrackError> {
        Self::validate(consumer, refs)?;
        self.check_room(None, consumer, refs, true)?;
        let seed = u64::from(std::process::id());
        Ok(self.apply_at(
            |t, now| t.set(consumer, refs.iter().map(String::as_str), now),
            |r| jitter(seed, r, self.restore_window(r)),
        ))
    }

    /// How far a restored ref's first check may be spread: [`RESTORE_JITTER`], or a quarter
    /// of what is left of its restored credentials' validity when that is less, so that the
    /// check is never later than their expiry.
    fn restore_window(&self, image: &str) -> Duration {
        let engine = self.shared.engine.load();
        let wall = self.shared.clock.wall();
        let earliest = engine
            .lookup_cached(
                &LookupRequest {
                    image,
                    ..Default::default()
                },
                |creds| creds.iter().filter_map(|c| c.expires_at).min(),
            )
            .ok()
            .flatten()
            .flatten();
        match earliest {
            Some(t) => RESTORE_JITTER.min(t.duration_since(wall).unwrap_or_default() / 4),
            None => RESTORE_JITTER,
        }
    }

    /// Subscribes to refs; each is tracked by the subscription while it lives.
    pub fn watch(&self, refs: &[String]) -> Result<Subscription, TrackError> {
        self.watch_as(None, refs)
    }

    /// [`Renewer::watch`] for caller `uid`: a stream's refs count with its named consumers'
    /// against [`MAX_REFS_PER_UID`] (root and the agent's own uid excepted), so that Watch
    /// streams are no way around the bound.
    pub fn watch_as(&self, uid: Option<u32>, refs: &[String]) -> Result<Subscription, TrackError> {
        Self::validate_refs(refs)?;
        let id = self.shared.watch_ids.fetch_add(1, Ordering::Relaxed);
        let consumer = format!("watch:{id}");
        {
            let distinct: std::collections::BTreeSet<&str> =
                refs.iter().map(String::as_str).collect();
            uid_room(&self.lock(), uid, &consumer, distinct.len())?;
        }
        self.own(uid, &consumer);
        self.apply(|t, now| t.track(&consumer, refs.iter().map(String::as_str), now));
        self.shared.metrics.watchers.inc();
        let st = self.lock();
        let mut receivers: Vec<(String, watch::Receiver<Option<Arc<Value>>>)> = Vec::new();
        for r in refs {
            if receivers.iter().any(|(x, _)| x == r) {
                continue;
            }
            if let Some(rs) = st.refs.get(r) {
                receivers.push((r.clone(), rs.tx.subscribe()));
            }
        }
        drop(st);
        Ok(Subscription {
            renewer: self.clone(),
            consumer,
            receivers,
        })
    }

    /// Tracked refs whose credentials are within their renewal lead of expiry now: renewal
    /// is late for them (failing, or in backoff).
    pub fn due_count(&self) -> usize {
        let now = self.shared.clock.now();
        let policy = self.shared.policy;
        self.lock()
            .refs
            .values()
            .filter(|r| {
                policy
                    .due_lead(now, r.entries.iter().map(|e| e.times()))
                    .is_some()
            })
            .count()
    }

    /// When credentials are renewed ahead of their expiry.
    pub fn policy(&self) -> &RenewalPolicy {
        &self.shared.policy
    }

    /// The last good credentials of a tracked ref.
    pub fn last_good(&self, image: &str) -> Option<Arc<Value>> {
        self.lock().refs.get(image).and_then(|r| r.value.clone())
    }

    /// How many refs are tracked (grace periods included).
    pub fn len(&self) -> usize {
        self.lock().tracker.len()
    }

    /// Whether nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn wall_of(&self, t: Instant) -> SystemTime {
        let (now, wall) = (self.shared.clock.now(), self.shared.clock.wall());
        if t >= now {
            wall + (t - now)
        } else {
            wall - (now - t)
        }
    }

    /// A number that changes whenever a consumer's set of refs changes.
    pub fn version(&self) -> u64 {
        self.shared.version.load(Ordering::Acquire)
    }

    /// Named consumers (not Watch streams) and the refs each holds: what a restart restores.
    pub fn named_consumers(&self) -> Vec<(String, Vec<String>)> {
        self.lock()
            .tracker
            .named()
            .map(|(c, refs)| (c.to_owned(), refs.map(str::to_owned).collect()))
            .collect()
    }

    /// Tracked refs with their state, sorted; only those `consumer` holds when given.
    pub fn list(&self, consumer: Option<&str>) -> Vec<TrackedInfo> {
        let st = self.lock();
        let refs: Vec<&str> = match consumer {
            Some(c) => st.tracker.held_by(c).collect(),
            None => st.tracker.refs().collect(),
        };
        refs.into_iter()
            .filter_map(|r| {
                let rs = st.refs.get(r)?;
                Some(TrackedInfo {
                    image: r.to_owned(),
                    consumers: st.tracker.holders(r).map(str::to_owned).collect(),
                    last_success: rs.last_success,
                    last_error: rs.last_error.clone(),
                    next_attempt: rs.next.map(|t| self.wall_of(t)),
                    consecutive_failures: rs.failures,
                    credentials: rs.value.as_ref().map_or(0, |v| v.credentials.len()),
                    expires_at: rs
                        .value
                        .as_ref()
                        .filter(|_| !rs.flushed)
                        .and_then(|v| v.credentials.iter().filter_map(|c| c.expires_at).min()),
                    flushed: rs.flushed,
                })
            })
            .collect()
    }

    /// The earliest scheduled renewal per provider index.
    pub fn next_renewal_by_provider(&self, providers: usize) -> Vec<Option<SystemTime>> {
        let st = self.lock();
        let mut out: Vec<Option<Instant>> = vec![None; providers];
        for rs in st.refs.values() {
            let Some(next) = rs.next else { continue };
            for e in &rs.entries {
                if let Some(slot) = out.get_mut(e.provider) {
                    *slot = Some(slot.map_or(next, |t| t.min(next)));
                }
            }
        }
        drop(st);
        out.into_iter()
            .map(|t| t.map(|t| self.wall_of(t)))
            .collect()
    }

    /// A registry refused `username`:`password`: every ref whose value holds it falls due now.
    /// Its renewal publishes the source's new answer (Watch streams get it); should the
    /// renewal fail, the ref's value loses the refused credential instead of keeping it as
    /// last known good.
    pub fn refused(&self, username: &str, password: &str) {
        let now = self.shared.clock.now();
        let mut st = self.lock();
        let mut due = Vec::new();
        for (image, rs) in st.refs.iter_mut() {
            let holds = rs.value.as_ref().is_some_and(|v| {
                v.credentials
                    .iter()
                    .any(|c| c.username == username && c.password.expose_secret() == password)
            });
            if holds {
                rs.refused
                    .push((username.to_owned(), SecretString::from(password.to_owned())));
                if rs.next.is_some() {
                    due.push(image.clone());
                }
            }
        }
        for image in due {
            st.set_next(&image, Some(now));
        }
        drop(st);
        self.shared.wake.notify_one();
    }

    /// An operator flushed these cache entries: a ref whose value holds a credential of one
    /// of them (the same provider, the same expiry) is marked flushed until it is renewed, and
    /// every ref is due now.
    pub fn flushed(&self, dropped: &[credgate_engine::Dropped]) {
        {
            let mut st = self.lock();
            for rs in st.refs.values_mut() {
                let held = rs.value.as_ref().is_some_and(|v| {
                    v.credentials.iter().any(|c| {
                        dropped.iter().any(|d| {
                            matches!(&c.source, credgate_engine::Source::Provider(p) if *p == d.provider)
                                && d.expires == c.expires_at
                        })
                    })
                });
                rs.flushed |= held;
            }
        }
        self.refresh_all();
    }

    /// Makes every ref due now (after a config reload).
    pub fn refresh_all(&self) {
        let now = self.shared.clock.now();
        let mut st = self.lock();
        let scheduled: Vec<String> = st.queue.iter().map(|(_, r)| r.clone()).collect();
        for image in scheduled {
            st.set_next(&image, Some(now));
        }
        drop(st);
        self.shared.wake.notify_one();
    }

    /// When a ref resolved from `entries` falls due.
    fn schedule(&self, image: &str, entries: &[EntryInfo], now: Instant) -> Instant {
        let p = &self.shared.policy;
        entries
            .iter()
            .map(|e| p.renew_at(e.fetched, e.expires, renewal::sample(seed(e))))
            .min()
            .unwrap_or_else(|| p.renew_at(now, None, renewal::sample(seed(&image))))
    }

    /// The validity a renewal asks for: past the old expiry of every entry that is due, so that
    /// exactly those are fetched again.
    fn force_for(&self, entries: &[EntryInfo], now: Instant) -> Duration {
        let p = &self.shared.policy;
        entries
            .iter()
            .filter(|e| p.renew_at(e.fetched, e.expires, renewal::sample(seed(e))) <= now)
            .filter_map(|e| e.expires)
            .max()
            .map_or(Duration::ZERO, |exp| {
                exp.saturating_duration_since(now) + Duration::from_millis(1)
            })
    }

    /// The captured credential for `image`'s repository.
    fn captured_for(&self, image: &str) -> Option<(String, PodCredential)> {
        let captured = self.shared.captured.as_ref()?;
        let name = ImageRef::parse(image).ok()?.name().to_string();
        let credential = captured.for_repository(&name)?;
        Some((name, credential))
    }

    /// Republishes every tracked ref whose captured credential changed.
    fn apply_captured(&self) {
        let mut st = self.lock();
        for (image, rs) in st.refs.iter_mut() {
            let captured = self.captured_for(image);
            if rs.value.is_none() && captured.is_none() {
                continue;
            }
            let credentials = rs
                .value
                .as_ref()
                .map(|v| v.credentials.clone())
                .unwrap_or_default();
            publish(rs, credentials, captured);
        }
    }

    /// Runs the renewal loop until its tasks stop. Each tracked ref's value carries the pull
    /// credential the CRI proxy captured for its repository, and a capture or a drop is pushed
    /// to its watchers.
    pub async fn run(self) {
        let shutdown = self.shared.tasks.token().clone();
        let mut captured_changes = self.shared.captured.as_ref().map(|captured| {
            let mut rx = captured.changes();
            rx.mark_changed();
            rx
        });
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            let now = self.shared.clock.now();
            let grace = self.shared.policy.grace;
            let (due, next) = {
                let mut st = self.lock();
                for gone in st.tracker.evict(now, grace) {
                    st.remove(&gone);
                    tracing::debug!(image = %gone, "evicted untracked ref");
                }
                self.shared
                    .metrics
                    .tracked_refs
                    .set(st.tracker.len() as i64);
                // Only what is due is touched.
                let mut due = Vec::new();
                while let Some((t, r)) = st.queue.first().cloned() {
                    if t > now {
                        break;
                    }
                    st.set_next(&r, None);
                    let entries = st
                        .refs
                        .get(&r)
                        .map(|rs| rs.entries.as_slice())
                        .unwrap_or_default();
                    let force = self.force_for(entries, now);
                    due.push((r, force));
                }
                let next = [
                    st.tracker.next_eviction(grace),
                    st.queue.first().map(|(t, _)| *t),
                ]
                .into_iter()
                .flatten()
                .min();
                (due, next)
            };
            for (image, force) in due {
                let this = self.clone();
                self.shared
                    .tasks
                    .spawn(async move { this.renew(image, force).await });
            }
            let sleep = async {
                match next {
                    Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                    None => std::future::pending().await,
                }
            };
            let captured_changed = async {
                match captured_changes.as_mut() {
                    Some(rx) => rx.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = sleep => {}
                _ = self.shared.wake.notified() => {}
                () = shutdown.cancelled() => {}
                true = captured_changed => self.apply_captured(),
            }
        }
    }

    async fn renew(&self, image: String, min_valid_for: Duration) {
        let engine = self.shared.engine.load_full();
        let request = LookupRequest {
            image: &image,
            min_valid_for,
            ..Default::default()
        };
        let result = engine.lookup(&request).await;
        let now = self.shared.clock.now();
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(rs) = st.refs.get_mut(&image) else {
            return;
        };
        let (credentials, entries, error) = match result {
            Ok(l) if l.errors.is_empty() => (Some(l.credentials), l.entries, None),
            Ok(l) => {
                let msg = l
                    .errors
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ");
                let partial = rs
                    .value
                    .as_ref()
                    .is_none_or(|v| v.credentials.is_empty())
                    .then_some(l.credentials);
                (partial, l.entries, Some(msg))
            }
            Err(e) => (None, Vec::new(), Some(e.to_string())),
        };
        let refused = std::mem::take(&mut rs.refused);
        if let Some(credentials) = credentials {
            let captured = self.captured_for(&image);
            publish(rs, credentials, captured);
        } else if error.is_some() && !refused.is_empty() {
            // A refused credential is no last known good: it goes, whatever is left.
            let kept = without_refused(rs.value.as_deref(), &refused);
            let captured = self.captured_for(&image);
            publish(rs, kept, captured);
        }
        match error {
            None => {
                rs.failures = 0;
                rs.last_error = None;
                rs.flushed = false;
                rs.last_success = Some(self.shared.clock.wall());
                // At least a second apart, whatever a plugin answers: no hot loop.
                let next = self.schedule(&image, &entries, now).max(now + MIN_INTERVAL);
                rs.entries = entries;
                st.set_next(&image, Some(next));
                self.shared.metrics.renewal(true);
            }
            Some(msg) => {
                rs.failures += 1;
                if rs.value.as_ref().is_some_and(|v| !v.credentials.is_empty()) {
                    tracing::warn!(image = %image, failures = rs.failures, error = %msg, "renewal failed; keeping the last good credentials");
                } else {
                    tracing::warn!(image = %image, failures = rs.failures, error = %msg, "renewal failed; the ref has no credentials yet");
                }
                rs.last_error = Some(msg);
                let sample = renewal::sample(seed(&(&image, rs.failures)));
                let next = self.shared.policy.retry_at(now, rs.failures, sample);
                if rs.entries.is_empty() {
                    rs.entries = entries;
                }
                st.set_next(&image, Some(next));
                self.shared.metrics.renewal(false);
            }
        }
        drop(guard);
        self.shared.wake.notify_one();
    }
}
