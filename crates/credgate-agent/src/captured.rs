//! Pull credentials captured from the kubelet's `PullImage` calls (through the CRI proxy), kept
//! per image repository and pod namespace so that consumers that fetch layers after the pull
//! (lazy-pull snapshotters, the registry mirror) get them, and sealed in the state directory so
//! that they survive restarts.
//!
//! Each namespace that pulled a repository keeps its own capture (decision 0030): a tenant that
//! pulls the same image with its own credential, and later revokes it, does not take away the
//! credential another namespace's pods read through. A `Lookup` gets the newest capture; the
//! mirror tries them all, newest first.
//!
//! The file (`captured.sealed`, 0600) is a [`crate::state::sealed`] file (`CGCAPTR\n`,
//! version 2) of a JSON body, under a key derived from the node key: a lost or replaced node
//! key makes it unreadable, and then it is discarded with a warning, never served as garbage.
//! It is written, fsynced and renamed into place before the proxy answers the pull, unless
//! confirming and writing take longer than the proxy's capture wait (2 s): then the answer goes
//! first and the capture follows, counted as late.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::state::key::NodeKey;
use crate::state::sealed::{self, Kind, Sealed};

const KIND: Kind = Kind {
    file: "captured.sealed",
    magic: b"CGCAPTR\n",
    version: 2,
    label: b"captured pull credentials v1",
    max: MAX_FILE,
};
const FILE: &str = KIND.file;

/// One captured credential.
#[derive(Clone)]
pub struct PodCredential {
    /// The pod's namespace (empty when the pull carried no sandbox config).
    pub namespace: String,
    pub username: String,
    pub password: SecretString,
    /// When it was captured (Unix ms).
    pub captured_ms: i64,
}

impl std::fmt::Debug for PodCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodCredential")
            .field("namespace", &self.namespace)
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .field("captured_ms", &self.captured_ms)
            .finish()
    }
}

impl PodCredential {
    /// Whether two credentials carry the same secret for the same namespace.
    pub fn same(&self, other: &PodCredential) -> bool {
        self.namespace == other.namespace
            && self.username == other.username
            && self.password.expose_secret() == other.password.expose_secret()
    }
}

/// What the sealed file holds, in the clear only inside this process.
#[derive(Serialize, Deserialize)]
struct Stored {
    repository: String,
    namespace: String,
    username: String,
    password: String,
    captured_ms: i64,
}

impl Stored {
    /// `c` for `repository`, as the file holds it (its password in the clear: sealed before
    /// it is written, zeroed by the caller after).
    fn of(repository: &str, c: &PodCredential) -> Stored {
        Stored {
            repository: repository.to_owned(),
            namespace: c.namespace.clone(),
            username: c.username.clone(),
            password: c.password.expose_secret().to_owned(),
            captured_ms: c.captured_ms,
        }
    }
}

/// Where a capture is kept: its repository, then the pod's namespace.
type Key = (String, String);

/// The captures, by repository and namespace.
type Entries = BTreeMap<Key, PodCredential>;

/// A change to the captured credentials: what it answers when it changed something.
type Edit = Box<dyn FnOnce(&mut Entries) -> Option<usize> + Send>;

/// Where a change waiting for the writer gets its outcome.
#[derive(Default)]
struct Ticket(Mutex<Option<Result<Option<usize>, CaptureError>>>);

impl Ticket {
    fn give(&self, outcome: Result<Option<usize>, CaptureError>) {
        *self.0.lock() = Some(outcome);
    }

    fn take(&self) -> Option<Result<Option<usize>, CaptureError>> {
        self.0.lock().take()
    }
}

/// Why the captured credentials could not be written.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The cause is in the message (and so not a `source`: a chain prints it once).
    #[error("cannot write the captured credentials to {path}: {error}")]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("the node key is unavailable: {0}")]
    Key(String),
    /// The write that carried this change with others failed (its cause in the message).
    #[error("{0}")]
    Batch(String),
    /// A credential larger than any a registry needs: not kept.
    #[error(
        "a credential of {0} bytes as stored, above the {MAX_CREDENTIAL}-byte limit: not captured"
    )]
    TooLarge(usize),
}

/// The credentials of a sealed body.
fn entries(plain: &[u8]) -> Option<Entries> {
    let stored: Vec<Stored> = serde_json::from_slice(plain).ok()?;
    Some(
        stored
            .into_iter()
            .map(|s| {
                (
                    (s.repository, s.namespace.clone()),
                    PodCredential {
                        namespace: s.namespace,
                        username: s.username,
                        password: SecretString::from(s.password),
                        captured_ms: s.captured_ms,
                    },
                )
            })
            .collect(),
    )
}

/// The most one captured credential may take as it is stored (username, password, namespace
/// and repository, encoded: a control character takes six bytes there): the CRI's fields are
/// small, and registry tokens a few KiB at most.
pub const MAX_CREDENTIAL: usize = 12 << 10;
/// How many captures are kept (a repository once per namespace that pulled it); beyond it the
/// namespace holding the most loses its oldest capture, so that a namespace holding few keeps
/// them.
pub const MAX_ENTRIES: usize = 1024;
/// How many of them one namespace may hold: beyond it, that namespace's oldest capture is
/// dropped, never another tenant's.
pub const MAX_ENTRIES_PER_NAMESPACE: usize = MAX_ENTRIES / 4;

/// The namespace holding the most captures but `new` (of those, the one holding the oldest).
fn largest_namespace(entries: &Entries, new: &Key) -> String {
    let mut counts: std::collections::HashMap<&str, (usize, i64)> = Default::default();
    for c in entries.iter().filter(|(k, _)| *k != new).map(|(_, c)| c) {
        let e = counts.entry(c.namespace.as_str()).or_insert((0, i64::MAX));
        e.0 += 1;
        e.1 = e.1.min(c.captured_ms);
    }
    counts
        .into_iter()
        .max_by_key(|(_, (n, oldest))| (*n, std::cmp::Reverse(*oldest)))
        .map(|(ns, _)| ns.to_owned())
        .unwrap_or_default()
}

/// The captured credentials, by normalized repository (`registry.example.com/team/app`) and
/// pod namespace.
pub struct Captured {
    sealed: Sealed,
    max_age: Option<Duration>,
    max_entries: usize,
    /// The agent's clock (ages of captures).
    clock: std::sync::Arc<dyn credgate_engine::clock::Clock>,
    /// What is served; held only to read or swap, never across the sealed write.
    by_repository: Mutex<Entries>,
    /// Serializes writers (each seals the whole map, fsyncs, then swaps it in), so that a
    /// capture's fsync never holds up a `Lookup` reading the map.
    writer: Mutex<()>,
    /// Changes waiting for the writer: whoever holds it next applies all of them and writes
    /// once (group commit), and each caller returns once its own change is on disk.
    pending: Mutex<Vec<(Edit, std::sync::Arc<Ticket>)>>,
    /// Counts the writes that ended, and wakes the callers waiting for one.
    written: (Mutex<u64>, parking_lot::Condvar),
    /// Counts changes, for those who push them on (the renewer, to Watch streams).
    changes: tokio::sync::watch::Sender<u64>,
    /// The credentials of pulls under way, by pull: in memory only, never captured by this.
    pulling: Mutex<Vec<(u64, String, PodCredential)>>,
    next_pull: std::sync::atomic::AtomicU64,
}

/// How many pulls under way lend their credential to the mirror at once; past it a pull
/// lends none (its credential is captured once confirmed, as any).
pub const MAX_PULLING: usize = 256;

/// A pull under way lending its credential to the mirror: withdrawn when dropped.
pub struct Pulling {
    captured: std::sync::Arc<Captured>,
    id: u64,
}

impl Drop for Pulling {
    fn drop(&mut self) {
        self.captured
            .pulling
            .lock()
            .retain(|(id, _, _)| *id != self.id);
    }
}

impl Captured {
    /// Removes the sealed file of an earlier run from `state_dir`, for an agent that keeps no
    /// captured credentials (none kept before is served again, nor left on disk). Whether
    /// there was one.
    pub fn discard(state_dir: &Path) -> std::io::Result<bool> {
        crate::state::discard(state_dir, FILE)
    }

    /// Opens the sealed file in `state_dir` (the node key's directory). A file sealed under
    /// another key, or damaged, is discarded with a warning.
    pub fn open(state_dir: &Path, max_age: Option<Duration>) -> Result<Captured, CaptureError> {
        let node = NodeKey::load_or_create(state_dir)
            .map_err(|e| CaptureError::Key(crate::error_chain(&e)))?;
        let captured = Captured {
            sealed: Sealed::new(state_dir, KIND, &node),
            max_age,
            max_entries: MAX_ENTRIES,
            clock: std::sync::Arc::new(credgate_engine::clock::SystemClock::new()),
            by_repository: Mutex::new(BTreeMap::new()),
            writer: Mutex::new(()),
            pending: Mutex::new(Vec::new()),
            written: (Mutex::new(0), parking_lot::Condvar::new()),
            changes: tokio::sync::watch::Sender::new(0),
            pulling: Mutex::new(Vec::new()),
            next_pull: std::sync::atomic::AtomicU64::new(0),
        };
        let path = captured.path();
        match captured.sealed.read() {
            sealed::Read::Body(body) => match entries(&body) {
                Some(entries) => *captured.lock() = entries,
                None => captured.discard_unreadable(),
            },
            sealed::Read::Unreadable => captured.discard_unreadable(),
            sealed::Read::Absent => {}
            sealed::Read::Newer { version, kept } => tracing::warn!(
                path = %path.display(),
                version,
                kept = %kept.display(),
                "captured pull credentials written by a newer credgate: kept aside, not read"
            ),
            // Nothing is served from it; the next capture replaces it (a rename replaces a
            // link or a FIFO, never writes through it).
            sealed::Read::Refused(why) => tracing::warn!(
                path = %path.display(),
                error = %why,
                "captured pull credentials refused: nothing is served from the file"
            ),
        }
        captured.expire();
        Ok(captured)
    }

    fn path(&self) -> PathBuf {
        self.sealed.path()
    }

    fn discard_unreadable(&self) {
        let path = self.path();
        tracing::warn!(
            path = %path.display(),
            "captured pull credentials sealed under another node key (or damaged): discarded"
        );
        let _ = self.sealed.remove();
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Entries> {
        self.by_repository.lock()
    }

    /// Seals `entries` and replaces the file: written, fsynced, renamed, the directory fsynced.
    fn persist(&self, entries: &Entries) -> Result<(), CaptureError> {
        let stored: Vec<Stored> = entries
            .iter()
            .map(|((repository, _), c)| Stored::of(repository, c))
            .collect();
        let plain = Zeroizing::new(serde_json::to_vec(&stored).expect("entries serialize"));
        for s in stored {
            drop(Zeroizing::new(s.password));
        }
        // Never a file the reader refuses (every entry was checked at capture; this is the
        // last guard, and refuses the write instead of losing every tenant's captures).
        self.sealed
            .write(&plain)
            .map_err(|error| CaptureError::Write {
                path: self.path(),
                error: error.into(),
            })
    }

    /// Tells the age of captures by `clock` (the agent's) instead of the system's.
    pub fn with_clock(mut self, clock: std::sync::Arc<dyn credgate_engine::clock::Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Now, in Unix ms, by the agent's clock: what a capture is stamped with.
    pub fn now_ms(&self) -> i64 {
        credgate_engine::clock::unix_ms(self.clock.wall())
    }

    /// Keeps at most `n` captures (and `n / 4` a namespace) instead of [`MAX_ENTRIES`].
    pub fn with_max_entries(mut self, n: usize) -> Self {
        self.max_entries = n.max(1);
        self
    }

    /// Keeps `credential` for `repository` and its namespace, replacing what that namespace
    /// held there (another namespace's capture stays), on disk before it returns (a blocking
    /// write: call it where blocking is allowed). When that puts its namespace over its share,
    /// that namespace's oldest other capture is dropped; when it puts the store over its limit,
    /// the oldest capture of the namespace holding the most: how many were dropped.
    pub fn capture(
        &self,
        repository: &str,
        credential: PodCredential,
    ) -> Result<usize, CaptureError> {
        fits(repository, &credential)?;
        let max = self.max_entries;
        let per_namespace = (max / 4).max(1);
        let namespace = credential.namespace.clone();
        let key: Key = (repository.to_owned(), namespace.clone());
        let dropped = self.change(Box::new(move |entries| {
            let mut dropped = 0;
            entries.insert(key.clone(), credential);
            let theirs = entries
                .values()
                .filter(|c| c.namespace == namespace)
                .count();
            // A namespace over its share loses its own oldest; otherwise the namespace that
            // holds the most loses its oldest, so that tenants holding few captures keep them
            // however many namespaces another tenant fills to their share.
            let own_only = theirs > per_namespace;
            while entries.len() > max
                || (own_only
                    && entries
                        .values()
                        .filter(|c| c.namespace == namespace)
                        .count()
                        > per_namespace)
            {
                let from = if own_only {
                    namespace.clone()
                } else {
                    largest_namespace(entries, &key)
                };
                let oldest = entries
                    .iter()
                    .filter(|(k, c)| **k != key && c.namespace == from)
                    .min_by_key(|(_, c)| c.captured_ms)
                    .map(|(k, _)| k.clone());
                match oldest {
                    Some(r) => {
                        entries.remove(&r);
                        dropped += 1;
                    }
                    None => break,
                }
            }
            Some(dropped)
        }))?;
        Ok(dropped.unwrap_or(0))
    }

    /// Applies `edit` to a copy of the map; when it says it changed something, seals and
    /// fsyncs the copy, swaps it in and counts the change. What the edit answered (`None`:
    /// nothing changed), once the change is on disk.
    ///
    /// Group commit: the edit waits with any others for the writer; whoever takes the writer
    /// applies every edit waiting, in order, and writes the file once for all of them. A
    /// burst of captures costs a few writes of the whole file, not one each, and each caller
    /// still returns only once its change is on disk (or with the write's error).
    fn change(&self, edit: Edit) -> Result<Option<usize>, CaptureError> {
        let ticket = std::sync::Arc::new(Ticket::default());
        self.pending.lock().push((edit, ticket.clone()));
        loop {
            if let Some(done) = ticket.take() {
                return done;
            }
            let seen = *self.written.0.lock();
            if let Some(writer) = self.writer.try_lock() {
                // This caller writes: every change waiting, its own included.
                let own_error = self.write_pending();
                drop(writer);
                *self.written.0.lock() += 1;
                self.written.1.notify_all();
                if let Some(e) = own_error {
                    // Its own change went with the failed write: the error, whole.
                    let _ = ticket.take();
                    return Err(e);
                }
                continue;
            }
            // Another writes: wait for its write to end, then look again (its batch may
            // have carried this change; if not, this caller may write the next).
            let mut written = self.written.0.lock();
            if *written == seen {
                self.written.1.wait(&mut written);
            }
        }
    }

    /// Applies every change waiting to a copy of the map and, when one changed something,
    /// writes it once and swaps it in; tells each waiting caller its outcome. The write's
    /// error, when it failed.
    fn write_pending(&self) -> Option<CaptureError> {
        let batch = std::mem::take(&mut *self.pending.lock());
        if batch.is_empty() {
            return None;
        }
        let mut next = self.lock().clone();
        let mut answered = Vec::with_capacity(batch.len());
        for (edit, waiter) in batch {
            answered.push((edit(&mut next), waiter));
        }
        let changed = answered.iter().any(|(a, _)| a.is_some());
        let written = if changed { self.persist(&next) } else { Ok(()) };
        let failed = written.as_ref().err().map(ToString::to_string);
        if changed && failed.is_none() {
            *self.lock() = next;
            self.changes.send_modify(|n| *n += 1);
        }
        for (answer, waiter) in answered {
            waiter.give(match &failed {
                None => Ok(answer),
                Some(why) => Err(CaptureError::Batch(why.clone())),
            });
        }
        written.err()
    }

    /// Drops every namespace's credential of `repository`; whether there was one.
    pub fn forget(&self, repository: &str) -> Result<bool, CaptureError> {
        let repository = repository.to_owned();
        self.drop_where(move |(r, _), _| *r == repository)
    }

    /// Drops the captures `which` picks, on disk before it returns; whether there was one.
    fn drop_where(
        &self,
        which: impl Fn(&Key, &PodCredential) -> bool + Send + 'static,
    ) -> Result<bool, CaptureError> {
        Ok(self
            .change(Box::new(move |entries| {
                let before = entries.len();
                entries.retain(|k, c| !which(k, c));
                (entries.len() < before).then_some(before - entries.len())
            }))?
            .is_some())
    }

    /// Drops the captures of `repository` that still are `username`:`password`, in whichever
    /// namespace (the registry refused it; a newer capture, and another namespace's own
    /// credential, stay); whether one was dropped.
    pub fn forget_refused(
        &self,
        repository: &str,
        username: &str,
        password: &str,
    ) -> Result<bool, CaptureError> {
        let (repository, username) = (repository.to_owned(), username.to_owned());
        let password = SecretString::from(password.to_owned());
        self.drop_where(move |(r, _), c| {
            *r == repository
                && c.username == username
                && c.password.expose_secret() == password.expose_secret()
        })
    }

    /// A receiver that sees each change (a capture or a drop) as it happens.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Drops credentials older than the maximum age.
    pub fn expire(&self) {
        let Some(max) = self.max_age else { return };
        let oldest = self.now_ms() - i64::try_from(max.as_millis()).unwrap_or(i64::MAX);
        if !self.lock().values().any(|c| c.captured_ms < oldest) {
            return;
        }
        if let Err(e) = self.drop_where(move |_, c| c.captured_ms < oldest) {
            tracing::warn!(error = %e, "cannot drop an expired captured credential");
        }
    }

    /// The newest credential captured for the repository `name` (a normalized image name),
    /// whichever namespace pulled it: what a `Lookup` of the repository gives.
    pub fn for_repository(&self, name: &str) -> Option<PodCredential> {
        self.all_for_repository(name).into_iter().next()
    }

    /// Every namespace's credential for the repository `name`, newest first: what the
    /// registry mirror tries, one after another when the registry refuses one.
    pub fn all_for_repository(&self, name: &str) -> Vec<PodCredential> {
        let mut all: Vec<PodCredential> = self
            .lock()
            .range((name.to_owned(), String::new())..)
            .take_while(|((r, _), _)| r == name)
            .map(|(_, c)| c.clone())
            .collect();
        all.sort_by_key(|c| std::cmp::Reverse(c.captured_ms));
        all
    }

    /// Lends the credential of a pull of `repository` under way to the mirror until the
    /// returned value is dropped (decision 0030): a lazy-pull snapshotter prepares the image's
    /// layers during the pull, before its credential can be confirmed and captured. Never
    /// written anywhere nor given to a `Lookup`; none past [`MAX_PULLING`] at once.
    pub fn pulling(
        self: &std::sync::Arc<Self>,
        repository: &str,
        credential: PodCredential,
    ) -> Option<Pulling> {
        let mut pulling = self.pulling.lock();
        if pulling.len() >= MAX_PULLING || fits(repository, &credential).is_err() {
            return None;
        }
        let id = self
            .next_pull
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        pulling.push((id, repository.to_owned(), credential));
        Some(Pulling {
            captured: self.clone(),
            id,
        })
    }

    /// The credentials of the pulls of the repository `name` under way, newest first.
    pub fn pulling_for(&self, name: &str) -> Vec<PodCredential> {
        self.pulling
            .lock()
            .iter()
            .rev()
            .filter(|(_, r, _)| r == name)
            .map(|(_, _, c)| c.clone())
            .collect()
    }

    /// What `namespace` captured for the repository `name`.
    pub fn for_namespace(&self, name: &str, namespace: &str) -> Option<PodCredential> {
        self.lock()
            .get(&(name.to_owned(), namespace.to_owned()))
            .cloned()
    }

    /// How long a credential is kept, when there is a limit.
    pub fn max_age(&self) -> Option<Duration> {
        self.max_age
    }

    /// Every captured credential, by repository (once per namespace that captured it).
    pub fn list(&self) -> Vec<(String, PodCredential)> {
        self.lock()
            .iter()
            .map(|((r, _), c)| (r.clone(), c.clone()))
            .collect()
    }
}

/// Whether `credential` for `repository` is within [`MAX_CREDENTIAL`] as it is stored.
pub fn fits(repository: &str, credential: &PodCredential) -> Result<(), CaptureError> {
    let raw = repository.len()
        + credential.namespace.len()
        + credential.username.len()
        + credential.password.expose_secret().len();
    // The encoding at most sextuples a string: only one that may be large is encoded.
    if raw > MAX_CREDENTIAL {
        return Err(CaptureError::TooLarge(raw));
    }
    let size = stored_size(repository, credential);
    if size > MAX_CREDENTIAL {
        return Err(CaptureError::TooLarge(size));
    }
    Ok(())
}

/// How many bytes one credential takes in the file's (sealed) body.
fn stored_size(repository: &str, c: &PodCredential) -> usize {
    let stored = Stored::of(repository, c);
    let n = serde_json::to_vec(&stored).map_or(usize::MAX, |v| Zeroizing::new(v).len());
    drop(Zeroizing::new(stored.password));
    n
}

/// The most the sealed file may hold: [`MAX_ENTRIES`] credentials of [`MAX_CREDENTIAL`] bytes
/// as stored, sealed, with room to spare. Nothing larger is ever written: the reader would
/// refuse it.
pub const MAX_FILE: u64 = 16 << 20;

/// A credential as `PullImage.auth` carries it: username and password, `auth` (base64 of
/// `user:password`), an identity token or a registry token.
pub fn from_auth(
    username: String,
    password: String,
    auth: &str,
    identity_token: String,
    registry_token: String,
) -> Option<(String, SecretString)> {
    if !username.is_empty() || !password.is_empty() {
        return Some((username, SecretString::from(password)));
    }
    if !auth.is_empty() {
        return credgate_core::dockerconfig::decode_auth(auth);
    }
    if !registry_token.is_empty() {
        return Some((String::new(), SecretString::from(registry_token)));
    }
    if !identity_token.is_empty() {
        return Some(("<token>".to_owned(), SecretString::from(identity_token)));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};

    fn cred(ns: &str, user: &str, pass: &str, at: i64) -> PodCredential {
        PodCredential {
            namespace: ns.into(),
            username: user.into(),
            password: SecretString::from(pass.to_owned()),
            captured_ms: at,
        }
    }

    use crate::state::private_dir;

    #[test]
    fn sealed_across_reopen_unreadable_in_the_clear_and_dropped_with_another_key() {
        let dir = private_dir();
        let c = Captured::open(dir.path(), None).unwrap();
        c.capture(
            "reg.io/team/app",
            cred("team-a", "alice", "s3cret-pw", crate::state::now_ms()),
        )
        .unwrap();
        c.capture(
            "reg.io/team/db",
            cred("team-a", "bob", "other-pw", crate::state::now_ms() + 1),
        )
        .unwrap();
        let file = std::fs::read(dir.path().join(FILE)).unwrap();
        assert!(!file.windows(9).any(|w| w == b"s3cret-pw"));
        assert!(!file.windows(5).any(|w| w == b"alice"));
        let mode = std::fs::metadata(dir.path().join(FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = Captured::open(dir.path(), None).unwrap();
        let got = again.for_repository("reg.io/team/app").unwrap();
        assert_eq!(
            (got.username.as_str(), got.password.expose_secret()),
            ("alice", "s3cret-pw")
        );
        assert_eq!(
            again.for_repository("reg.io/team/db").unwrap().username,
            "bob"
        );
        assert!(!format!("{got:?}").contains("s3cret-pw"));
        // A replaced node key: the file is discarded, not served.
        std::fs::write(dir.path().join("node.key"), [9u8; 32]).unwrap();
        let replaced = Captured::open(dir.path(), None).unwrap();
        assert!(replaced.list().is_empty());
        assert!(!dir.path().join(FILE).exists());
    }

    #[test]
    fn size_and_count_are_bounded_the_oldest_dropped_first() {
        let dir = private_dir();
        let c = Captured::open(dir.path(), None)
            .unwrap()
            .with_max_entries(3);
        let huge = "p".repeat(MAX_CREDENTIAL);
        let e = c
            .capture("reg.io/big", cred("ns", "u", &huge, 1))
            .unwrap_err();
        assert!(matches!(e, CaptureError::TooLarge(_)), "{e}");
        assert!(!e.to_string().contains(&huge[..32]));
        assert!(c.list().is_empty());
        for (i, repo) in ["reg.io/a", "reg.io/b", "reg.io/c"].iter().enumerate() {
            assert_eq!(
                c.capture(repo, cred(&format!("ns-{i}"), "u", "p", 10 + i as i64))
                    .unwrap(),
                0
            );
        }
        // A fourth drops the oldest; replacing one that is there drops nothing.
        assert_eq!(c.capture("reg.io/d", cred("ns-3", "u", "p", 5)).unwrap(), 1);
        assert_eq!(c.capture("reg.io/d", cred("ns-3", "u", "q", 6)).unwrap(), 0);
        let kept: Vec<String> = c.list().into_iter().map(|(r, _)| r).collect();
        assert_eq!(kept, ["reg.io/b", "reg.io/c", "reg.io/d"]);
    }

    /// The bound is what the file takes, not the raw bytes: control characters take six bytes
    /// each there. A credential small in raw bytes but large as stored is refused; the most
    /// entries of the largest accepted size always fit the reader's limit, so the file is
    /// never written past what the next start reads.
    #[test]
    fn what_is_written_is_bounded_as_stored_and_always_readable() {
        assert!(
            (MAX_ENTRIES * (MAX_CREDENTIAL + 1) + sealed::OVERHEAD + 2) as u64 <= MAX_FILE,
            "the file's limit holds every entry at its largest"
        );
        let dir = private_dir();
        let c = Captured::open(dir.path(), None)
            .unwrap()
            .with_max_entries(40);
        let controls = "\u{1}".repeat(2100);
        let e = c
            .capture("reg.io/ctl", cred("ns", "u", &controls, 1))
            .unwrap_err();
        assert!(
            matches!(e, CaptureError::TooLarge(n) if n > MAX_CREDENTIAL),
            "{e}"
        );
        // The largest that fits, as stored, 50 times over 40 slots in 10 namespaces.
        let mut n = 2000;
        while stored_size(
            "reg.io/team/app-00",
            &cred("ns-0", "u", &"\u{1}".repeat(n + 1), 1),
        ) <= MAX_CREDENTIAL
        {
            n += 1;
        }
        let largest = "\u{1}".repeat(n);
        for i in 0..50 {
            c.capture(
                &format!("reg.io/team/app-{i:02}"),
                cred(&format!("ns-{}", i % 10), "u", &largest, i),
            )
            .unwrap();
        }
        let size = std::fs::metadata(dir.path().join(FILE)).unwrap().len();
        assert!(
            size <= (40 * (MAX_CREDENTIAL + 1) + sealed::OVERHEAD + 2) as u64,
            "{size}"
        );
        let again = Captured::open(dir.path(), None).unwrap();
        assert_eq!(again.list().len(), 40, "every kept capture is read back");
    }

    /// One namespace capturing without end drops its own oldest captures once it holds its
    /// share (a quarter), never another tenant's.
    #[test]
    fn one_namespace_cannot_evict_the_others() {
        let dir = private_dir();
        let c = Captured::open(dir.path(), None)
            .unwrap()
            .with_max_entries(8);
        c.capture("reg.io/victim/a", cred("victim", "u", "p", 1))
            .unwrap();
        c.capture("reg.io/victim/b", cred("victim", "u", "p", 2))
            .unwrap();
        for i in 0..20 {
            c.capture(
                &format!("reg.io/greedy/{i}"),
                cred("greedy", "u", "p", 10 + i),
            )
            .unwrap();
        }
        let list = c.list();
        let victims = list.iter().filter(|(_, c)| c.namespace == "victim").count();
        let greedy: Vec<&String> = list
            .iter()
            .filter(|(_, c)| c.namespace == "greedy")
            .map(|(r, _)| r)
            .collect();
        assert_eq!(victims, 2, "{list:?}");
        assert_eq!(greedy, ["reg.io/greedy/18", "reg.io/greedy/19"]);
    }

    /// Captures that wait for the writer together are written together: twenty captures
    /// queued behind a write cost one more write of the file, and each is on disk when its
    /// call returns.
    #[test]
    fn captures_waiting_together_are_written_once() {
        let dir = private_dir();
        let c = std::sync::Arc::new(Captured::open(dir.path(), None).unwrap());
        let changes = c.changes();
        let held = c.writer.lock();
        let threads: Vec<_> = (0..20)
            .map(|i| {
                let c = c.clone();
                std::thread::spawn(move || {
                    c.capture(&format!("reg.io/team/app-{i}"), cred("ns", "u", "p", i))
                })
            })
            .collect();
        while c.pending.lock().len() < 20 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // The test held the writer as a write in progress would; its end wakes the waiters.
        drop(held);
        *c.written.0.lock() += 1;
        c.written.1.notify_all();
        for t in threads {
            assert_eq!(t.join().unwrap().unwrap(), 0);
        }
        assert_eq!(*changes.borrow(), 1, "one write for the twenty");
        let again = Captured::open(dir.path(), None).unwrap();
        assert_eq!(again.list().len(), 20, "all on disk");
    }

    /// One tenant filling four namespaces to their share (a quarter each, the whole store)
    /// evicts its own namespaces' captures, never those of a namespace holding few.
    #[test]
    fn four_namespaces_of_one_tenant_cannot_evict_the_others() {
        let dir = private_dir();
        let c = Captured::open(dir.path(), None)
            .unwrap()
            .with_max_entries(8);
        c.capture("reg.io/victim/a", cred("victim", "u", "p", 1))
            .unwrap();
        for i in 0..40 {
            c.capture(
                &format!("reg.io/greedy/{i}"),
                cred(&format!("greedy-{}", i % 4), "u", "p", 10 + i),
            )
            .unwrap();
        }
        let list = c.list();
        assert_eq!(list.len(), 8);
        assert!(
            list.iter().any(|(r, _)| r == "reg.io/victim/a"),
            "the victim's capture is kept: {list:?}"
        );
        // And the victim's next capture takes its room from the largest holder.
        c.capture("reg.io/victim/b", cred("victim", "u", "p", 100))
            .unwrap();
        let victims = c
            .list()
            .iter()
            .filter(|(_, c)| c.namespace == "victim")
            .count();
        assert_eq!(victims, 2);
    }

    /// A sealed file with a second name (a hard link, perhaps from where another user can
    /// swap its content) is refused.
    #[test]
    fn a_hard_linked_sealed_file_is_refused() {
        let dir = private_dir();
        let c = Captured::open(dir.path(), None).unwrap();
        c.capture("reg.io/a", cred("ns", "u", "p", 1)).unwrap();
        std::fs::hard_link(dir.path().join(FILE), dir.path().join("elsewhere")).unwrap();
        assert!(Captured::open(dir.path(), None).unwrap().list().is_empty());
        std::fs::remove_file(dir.path().join("elsewhere")).unwrap();
        assert_eq!(Captured::open(dir.path(), None).unwrap().list().len(), 1);
    }

    /// A FIFO, a link, /dev/zero or an oversized file in place of the sealed file: a
    /// warning, nothing served, never a hang; the next capture replaces it.
    #[test]
    fn a_sealed_file_that_is_not_a_small_private_regular_file_is_refused() {
        let dir = private_dir();
        let path = dir.path().join(FILE);
        Captured::open(dir.path(), None).unwrap();
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &path,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let c = Captured::open(dir.path(), None).unwrap();
        assert!(c.list().is_empty());
        c.capture("reg.io/a", cred("", "u", "p", 1)).unwrap();
        assert!(std::fs::metadata(&path).unwrap().is_file());
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert!(Captured::open(dir.path(), None).unwrap().list().is_empty());
        std::fs::remove_file(&path).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .unwrap();
        f.set_len(MAX_FILE + 1).unwrap();
        assert!(Captured::open(dir.path(), None).unwrap().list().is_empty());
    }

    fn usernames(credentials: Vec<PodCredential>) -> Vec<String> {
        credentials.into_iter().map(|c| c.username).collect()
    }

    /// Two namespaces that pull one repository with their own credentials each keep theirs:
    /// the newest is what a `Lookup` gets, a refused one is dropped alone, and both survive a
    /// restart.
    #[test]
    fn each_namespace_keeps_its_own_capture_of_a_repository() {
        let dir = private_dir();
        let c = Captured::open(dir.path(), None).unwrap();
        c.capture("reg.io/shared/app", cred("team-a", "alice", "pw-a", 10))
            .unwrap();
        c.capture("reg.io/shared/app", cred("team-b", "bob", "pw-b", 20))
            .unwrap();
        c.capture("reg.io/other", cred("team-b", "bob", "pw-b", 30))
            .unwrap();
        let users = |c: &Captured| usernames(c.all_for_repository("reg.io/shared/app"));
        assert_eq!(users(&c), ["bob", "alice"], "newest first");
        assert_eq!(
            c.for_repository("reg.io/shared/app").unwrap().username,
            "bob"
        );
        assert_eq!(
            c.for_namespace("reg.io/shared/app", "team-a")
                .unwrap()
                .username,
            "alice"
        );
        // A namespace's new capture replaces its own only.
        c.capture("reg.io/shared/app", cred("team-a", "alice", "pw-a2", 40))
            .unwrap();
        assert_eq!(users(&c), ["alice", "bob"]);
        assert_eq!(
            users(&Captured::open(dir.path(), None).unwrap()),
            ["alice", "bob"]
        );
        // team-a's credential revoked: dropped there, team-b's and other repositories stay.
        assert!(c
            .forget_refused("reg.io/shared/app", "alice", "pw-a2")
            .unwrap());
        assert!(!c
            .forget_refused("reg.io/shared/app", "alice", "pw-a2")
            .unwrap());
        assert_eq!(users(&c), ["bob"]);
        assert!(c.for_repository("reg.io/other").is_some());
        assert!(c.forget("reg.io/shared/app").unwrap());
        assert!(users(&c).is_empty());
        assert_eq!(c.list().len(), 1);
    }

    /// A pull under way lends its credential until it ends, bounded, never on disk.
    #[test]
    fn a_pull_under_way_lends_its_credential_until_it_ends() {
        let dir = private_dir();
        let c = std::sync::Arc::new(Captured::open(dir.path(), None).unwrap());
        let first = c
            .pulling("reg.io/app", cred("team-a", "alice", "pw-a", 1))
            .unwrap();
        let second = c
            .pulling("reg.io/app", cred("team-b", "bob", "pw-b", 2))
            .unwrap();
        let users = |c: &Captured| usernames(c.pulling_for("reg.io/app"));
        assert_eq!(users(&c), ["bob", "alice"]);
        assert!(c.pulling_for("reg.io/other").is_empty());
        assert!(c.for_repository("reg.io/app").is_none(), "not a capture");
        assert!(!dir.path().join(FILE).exists(), "never written");
        drop(second);
        assert_eq!(users(&c), ["alice"]);
        drop(first);
        assert!(users(&c).is_empty());
        let held: Vec<_> = (0..MAX_PULLING)
            .map(|i| {
                c.pulling(&format!("reg.io/{i}"), cred("ns", "u", "p", 1))
                    .unwrap()
            })
            .collect();
        assert!(c
            .pulling("reg.io/one-more", cred("ns", "u", "p", 1))
            .is_none());
        drop(held);
        assert!(c
            .pulling("reg.io/one-more", cred("ns", "u", "p", 1))
            .is_some());
    }

    #[test]
    fn forgetting_and_expiry() {
        let dir = private_dir();
        let c = Captured::open(dir.path(), Some(Duration::from_secs(60))).unwrap();
        c.capture("reg.io/a", cred("", "u", "p", crate::state::now_ms()))
            .unwrap();
        c.capture(
            "reg.io/old",
            cred("", "u", "p", crate::state::now_ms() - 120_000),
        )
        .unwrap();
        c.expire();
        assert!(c.for_repository("reg.io/old").is_none());
        assert!(c.forget("reg.io/a").unwrap());
        assert!(!c.forget("reg.io/a").unwrap());
        assert!(Captured::open(dir.path(), None).unwrap().list().is_empty());
    }

    #[test]
    fn every_form_of_auth_config_is_read() {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD.encode("user:pa:ss");
        let (u, p) = from_auth(
            String::new(),
            String::new(),
            &b64,
            String::new(),
            String::new(),
        )
        .unwrap();
        assert_eq!((u.as_str(), p.expose_secret()), ("user", "pa:ss"));
        let (u, p) = from_auth("a".into(), "b".into(), "", String::new(), String::new()).unwrap();
        assert_eq!((u.as_str(), p.expose_secret()), ("a", "b"));
        let (u, _) = from_auth(
            String::new(),
            String::new(),
            "",
            "idt".into(),
            String::new(),
        )
        .unwrap();
        assert_eq!(u, "<token>");
        assert!(from_auth(
            String::new(),
            String::new(),
            "",
            String::new(),
            String::new()
        )
        .is_none());
    }
}
