//! What the agent remembers of the credentials it handed out and of those registries refused,
//! by keyed fingerprint (never the secret), across restarts.
//!
//! - **Refused**: a credential a registry refused (confirmed, `refusal.rs`), until the answer it
//!   came from would have expired: a second refusal within [`HOLDOFF`] does nothing, and the
//!   CRI proxy replaces a client's stale copy of it ([`Refusals::known`]).
//! - **Handed**: a provider's credential the agent answered the kubelet's bridge with, until the
//!   kubelet may still hold it (the answer's `cacheDuration` and a margin): when the provider
//!   has moved on to another answer and the registry refuses the one the kubelet still sends,
//!   the proxy knows whose it was ([`Refusals::handed`]) and asks the provider again.
//!
//! Both survive a restart (issue 49): the fingerprints are keyed by a key derived from the node
//! key, and the memory is kept sealed in `STATE_DIR/memory.sealed`, written by the saver when it
//! changes ([`MemoryFile`]). Without a state directory (or with `--no-persist-cache`) the key
//! is random and nothing outlives the process.

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::confirm::Fingerprint;
use crate::refusal::Given;
use crate::state::key::NodeKey;
use crate::state::sealed::{self, Kind, Sealed};

/// A refusal of a credential already refused this recently changes nothing.
pub const HOLDOFF: Duration = Duration::from_secs(30);
/// Refused credentials remembered (the oldest is forgotten first).
const REMEMBERED: usize = 1024;
/// Handed-out credentials remembered (the one that expires first is forgotten first).
const HANDED: usize = 4096;
/// How long after the `cacheDuration` it was answered with a handed-out credential is still
/// taken for the provider's (a client's clock, a slow pull).
const HANDED_MARGIN: Duration = Duration::from_secs(60);
/// The longest a handed-out credential is remembered, whatever its answer said.
const HANDED_MAX: Duration = Duration::from_secs(3600);

struct Remembered {
    given: Given,
    at: Instant,
    until: Instant,
    /// `until` by the wall clock, for the file.
    until_wall: SystemTime,
}

/// A docker config entry a registry refused, for `explain` and `ctl status`.
#[derive(Debug, Clone)]
pub struct DockerRefusal {
    pub at: SystemTime,
    pub image: String,
}

#[derive(Default)]
struct State {
    refused: HashMap<Fingerprint, Remembered>,
    /// Provider by fingerprint, and until when a client may hold it.
    handed: HashMap<Fingerprint, (String, SystemTime)>,
    /// Docker config files by path: the last refusal of one of their entries.
    docker: BTreeMap<String, DockerRefusal>,
}

/// The agent's memory of refused and handed-out credentials.
pub struct Refusals {
    key: zeroize::Zeroizing<[u8; 32]>,
    state: Mutex<State>,
    /// Bumped at each change the file should keep.
    version: AtomicU64,
}

impl Default for Refusals {
    fn default() -> Self {
        Refusals::with_key(zeroize::Zeroizing::new(random_key()))
    }
}

/// A key for this process's fingerprints, from the operating system's random source (as the
/// sealed files' nonces are).
fn random_key() -> [u8; 32] {
    use chacha20poly1305::aead::{KeyInit, OsRng};
    chacha20poly1305::ChaCha20Poly1305::generate_key(&mut OsRng).into()
}

impl Refusals {
    /// A memory whose fingerprints are keyed by `key` (derived from the node key: the same
    /// after a restart).
    pub fn with_key(key: zeroize::Zeroizing<[u8; 32]>) -> Refusals {
        Refusals {
            key,
            state: Mutex::default(),
            version: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Changes since the start, for the saver.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    fn changed(&self) {
        self.version.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn fingerprint(&self, username: &str, password: &str) -> Fingerprint {
        let mut mac = Hmac::<Sha256>::new_from_slice(&*self.key).expect("any key length");
        mac.update(&(username.len() as u64).to_be_bytes());
        mac.update(username.as_bytes());
        mac.update(password.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// The source of a refused credential the agent still remembers (until the answer it
    /// came from would have expired).
    pub fn known(&self, username: &str, password: &str, now: Instant) -> Option<Given> {
        let fp = self.fingerprint(username, password);
        self.lock()
            .refused
            .get(&fp)
            .filter(|r| now < r.until)
            .map(|r| r.given.clone())
    }

    /// The provider that handed `username`:`password` to the kubelet's bridge, while a client
    /// may still hold it.
    pub fn handed(&self, username: &str, password: &str, now: SystemTime) -> Option<Given> {
        let fp = self.fingerprint(username, password);
        self.lock()
            .handed
            .get(&fp)
            .filter(|(_, until)| now < *until)
            .map(|(provider, _)| Given::Provider(provider.clone()))
    }

    /// Provider `provider` answered the kubelet's bridge with `username`:`password`, which the
    /// kubelet may keep `cache_for`.
    pub fn hand_out(
        &self,
        provider: &str,
        username: &str,
        password: &str,
        cache_for: Duration,
        now: SystemTime,
    ) {
        let fp = self.fingerprint(username, password);
        let until = now + (cache_for + HANDED_MARGIN).min(HANDED_MAX);
        let mut st = self.lock();
        // Kept while it covers this answer to within the margin: a kubelet asking every
        // minute does not rewrite the file every minute.
        if st
            .handed
            .get(&fp)
            .is_some_and(|(p, held)| p == provider && *held + HANDED_MARGIN >= until)
        {
            return;
        }
        st.handed.retain(|_, (_, held)| now < *held);
        if st.handed.len() >= HANDED && !st.handed.contains_key(&fp) {
            if let Some(first) = st
                .handed
                .iter()
                .min_by_key(|(_, (_, held))| *held)
                .map(|(k, _)| *k)
            {
                st.handed.remove(&first);
            }
        }
        st.handed.insert(fp, (provider.to_owned(), until));
        drop(st);
        self.changed();
    }

    /// Whether it was refused within [`HOLDOFF`] of `now`.
    pub(crate) fn recently_refused(&self, fp: &Fingerprint, now: Instant) -> bool {
        self.lock()
            .refused
            .get(fp)
            .is_some_and(|r| now < r.at + HOLDOFF)
    }

    /// Remembers a refusal until `until` (`wall` is now by the wall clock); false when it was
    /// refused within [`HOLDOFF`] already.
    pub(crate) fn note(
        &self,
        fp: Fingerprint,
        given: &Given,
        now: Instant,
        until: Instant,
        wall: SystemTime,
    ) -> bool {
        let mut st = self.lock();
        if st.refused.get(&fp).is_some_and(|r| now < r.at + HOLDOFF) {
            return false;
        }
        st.refused.retain(|_, r| now < r.until);
        if st.refused.len() >= REMEMBERED {
            if let Some(oldest) = st.refused.iter().min_by_key(|(_, r)| r.at).map(|(k, _)| *k) {
                st.refused.remove(&oldest);
            }
        }
        let until = until.max(now + HOLDOFF);
        st.refused.insert(
            fp,
            Remembered {
                given: given.clone(),
                at: now,
                until,
                until_wall: wall + (until - now),
            },
        );
        drop(st);
        self.changed();
        true
    }

    /// The last refusal of an entry of docker config `file`.
    pub fn docker_report(&self, file: &str) -> Option<DockerRefusal> {
        self.lock().docker.get(file).cloned()
    }

    pub(crate) fn report_docker(&self, file: &str, report: DockerRefusal) {
        let mut st = self.lock();
        if st.docker.len() < REMEMBERED || st.docker.contains_key(file) {
            st.docker.insert(file.to_owned(), report);
        }
    }

    /// What the file keeps: every refusal and hand-out not yet past.
    fn stored(&self, wall: SystemTime) -> Stored {
        let st = self.lock();
        let refused = st
            .refused
            .iter()
            .filter(|(_, r)| wall < r.until_wall)
            .map(|(fp, r)| StoredFingerprint::of(fp, &r.given, r.until_wall))
            .collect();
        let handed = st
            .handed
            .iter()
            .filter(|(_, (_, until))| wall < *until)
            .map(|(fp, (p, until))| StoredFingerprint::of(fp, &Given::Provider(p.clone()), *until))
            .collect();
        Stored { refused, handed }
    }

    /// Puts back what an earlier run kept; what is past, or malformed, is left out. A refusal
    /// put back is not held off again (its `at` is long past): a client's copy is still
    /// replaced, and a new refusal acts.
    fn restore(&self, stored: Stored, now: Instant, wall: SystemTime) -> usize {
        let mut st = self.lock();
        let mut n = 0;
        for s in stored.refused.into_iter().take(REMEMBERED) {
            let Some((fp, given, until_wall)) = s.parts() else {
                continue;
            };
            let Ok(left) = until_wall.duration_since(wall) else {
                continue;
            };
            st.refused.insert(
                fp,
                Remembered {
                    given,
                    at: now.checked_sub(HOLDOFF).unwrap_or(now),
                    until: now + left,
                    until_wall,
                },
            );
            n += 1;
        }
        for s in stored.handed.into_iter().take(HANDED) {
            let Some((fp, Given::Provider(provider), until)) = s.parts() else {
                continue;
            };
            if wall < until {
                st.handed.insert(fp, (provider, until));
                n += 1;
            }
        }
        n
    }
}

/// The memory as the file keeps it: fingerprints (keyed by the node key: nothing a reader
/// without it can match a credential against), sources and expiries; never a secret.
#[derive(Serialize, Deserialize, Default)]
struct Stored {
    refused: Vec<StoredFingerprint>,
    handed: Vec<StoredFingerprint>,
}

#[derive(Serialize, Deserialize)]
struct StoredFingerprint {
    fingerprint: String,
    /// `provider`, `docker_config` or `captured`.
    kind: String,
    name: String,
    until_ms: u64,
}

impl StoredFingerprint {
    fn of(fp: &Fingerprint, given: &Given, until: SystemTime) -> StoredFingerprint {
        let (kind, name) = match given {
            Given::Provider(n) => ("provider", n),
            Given::DockerConfig(n) => ("docker_config", n),
            Given::Captured(n) => ("captured", n),
        };
        StoredFingerprint {
            fingerprint: hex::encode(fp),
            kind: kind.into(),
            name: name.clone(),
            until_ms: until
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        }
    }

    fn parts(self) -> Option<(Fingerprint, Given, SystemTime)> {
        let fp: Fingerprint = hex::decode(&self.fingerprint).ok()?.try_into().ok()?;
        let given = match self.kind.as_str() {
            "provider" => Given::Provider(self.name),
            "docker_config" => Given::DockerConfig(self.name),
            "captured" => Given::Captured(self.name),
            _ => return None,
        };
        Some((fp, given, UNIX_EPOCH + Duration::from_millis(self.until_ms)))
    }
}

/// The largest file read or written (2 MiB: 5,120 fingerprints of about 200 bytes, and room).
const MAX_FILE: u64 = 2 << 20;

const KIND: Kind = Kind {
    file: "memory.sealed",
    magic: b"CGMEMRY\n",
    version: 1,
    label: b"credential memory v1",
    max: MAX_FILE,
};

/// The memory's sealed file in a state directory, and the memory's key.
pub struct MemoryFile {
    sealed: Sealed,
}

impl MemoryFile {
    /// The file of `state_dir` and a memory keyed by the node key, what an earlier run kept put
    /// back in it; `None` when the node key cannot be had (then nothing is kept).
    pub fn open(
        state_dir: &Path,
        now: Instant,
        wall: SystemTime,
    ) -> Option<(MemoryFile, Refusals)> {
        let node = match NodeKey::load_or_create(state_dir) {
            Ok(node) => node,
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e), "refused and handed-out credentials are not remembered across restarts");
                return None;
            }
        };
        let memory = Refusals::with_key(node.derive(b"credential memory fingerprints v1"));
        let file = MemoryFile {
            sealed: Sealed::new(state_dir, KIND, &node),
        };
        let path = file.sealed.path();
        match file.sealed.read() {
            sealed::Read::Absent => {}
            sealed::Read::Newer { version, kept } => {
                tracing::warn!(path = %path.display(), version, kept = %kept.display(), "the credential memory's file was written by a newer credgate: kept aside, not read");
            }
            sealed::Read::Refused(why) => {
                tracing::warn!(path = %path.display(), error = %why, "the credential memory's file is refused: nothing is put back");
            }
            sealed::Read::Unreadable => {
                tracing::warn!(path = %path.display(), "the credential memory's file is sealed under another node key, of another version, or damaged: discarded");
                let _ = file.sealed.remove();
            }
            sealed::Read::Body(body) => match serde_json::from_slice::<Stored>(&body) {
                Ok(stored) => {
                    let n = memory.restore(stored, now, wall);
                    tracing::info!(
                        fingerprints = n,
                        "refused and handed-out credentials remembered from before the restart"
                    );
                }
                Err(_) => {
                    tracing::warn!(path = %path.display(), "the credential memory's file does not parse: discarded");
                    let _ = file.sealed.remove();
                }
            },
        }
        Some((file, memory))
    }

    /// Seals what `memory` holds now and replaces the file (fsynced). Blocking.
    pub fn save(&self, memory: &Refusals, wall: SystemTime) -> Result<(), SaveError> {
        let body = serde_json::to_vec(&memory.stored(wall))?;
        Ok(self.sealed.write(&body)?)
    }

    /// Removes the file of an earlier run (an agent that keeps nothing across restarts).
    pub fn discard(state_dir: &Path) -> std::io::Result<bool> {
        crate::state::discard(state_dir, KIND.file)
    }
}

/// Why the memory was not saved.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error(transparent)]
    Encode(#[from] serde_json::Error),
    #[error(transparent)]
    Write(#[from] crate::state::sealed::WriteError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(r: &Refusals, fp: Fingerprint, given: &Given, now: Instant, until: Instant) -> bool {
        r.note(fp, given, now, until, SystemTime::now())
    }

    #[test]
    fn a_refusal_is_remembered_and_held_off() {
        let r = Refusals::default();
        let now = Instant::now();
        let fp = r.fingerprint("u", "p");
        let given = Given::Provider("ecr".into());
        assert!(r.known("u", "p", now).is_none());
        assert!(note(&r, fp, &given, now, now + Duration::from_secs(600)));
        assert_eq!(r.known("u", "p", now), Some(given.clone()));
        assert!(r.known("u", "other", now).is_none());
        assert!(r.known("other", "p", now).is_none());
        assert!(!note(&r, fp, &given, now + Duration::from_secs(1), now));
        let later = now + HOLDOFF + Duration::from_secs(1);
        assert!(note(&r, fp, &given, later, later + Duration::from_secs(60)));
        assert!(r.known("u", "p", later + Duration::from_secs(61)).is_none());
    }

    #[test]
    fn the_memory_is_bounded() {
        let r = Refusals::default();
        let now = Instant::now();
        let given = Given::Provider("p".into());
        for i in 0..(REMEMBERED + 10) {
            let fp = r.fingerprint("u", &i.to_string());
            let at = now + Duration::from_millis(i as u64);
            assert!(note(&r, fp, &given, at, at + Duration::from_secs(3600)));
        }
        assert_eq!(r.lock().refused.len(), REMEMBERED);
        assert!(r.known("u", "0", now).is_none(), "the oldest is forgotten");
        let wall = SystemTime::now();
        for i in 0..(HANDED + 10) {
            r.hand_out(
                "p",
                "u",
                &i.to_string(),
                Duration::from_secs(i as u64),
                wall,
            );
        }
        assert_eq!(r.lock().handed.len(), HANDED);
        assert!(
            r.handed("u", "0", wall).is_none(),
            "the first to expire is forgotten"
        );
        assert!(r.handed("u", &HANDED.to_string(), wall).is_some());
    }

    #[test]
    fn fingerprints_separate_user_from_password() {
        let r = Refusals::default();
        assert_ne!(r.fingerprint("ab", "c"), r.fingerprint("a", "bc"));
        assert_ne!(
            r.fingerprint("u", "p"),
            Refusals::default().fingerprint("u", "p")
        );
    }

    /// A restart (a new memory from the same state directory) still knows what was refused and
    /// what was handed out while a client may hold it, and nothing past; the file holds no
    /// secret and opens under no other node key.
    #[test]
    fn refusals_and_hand_outs_survive_a_restart_sealed() {
        let dir = crate::state::private_dir();
        let (now, wall) = (Instant::now(), SystemTime::now());
        let (file, memory) = MemoryFile::open(dir.path(), now, wall).unwrap();
        let given = Given::Provider("ecr".into());
        let fp = memory.fingerprint("alice", "old-Pa55word");
        assert!(memory.note(fp, &given, now, now + Duration::from_secs(300), wall));
        memory.hand_out(
            "ecr",
            "alice",
            "handed-Pa55word",
            Duration::from_secs(300),
            wall,
        );
        memory.hand_out(
            "ecr",
            "alice",
            "short-Pa55word",
            Duration::ZERO,
            wall - HANDED_MAX,
        );
        file.save(&memory, wall).unwrap();
        let raw = std::fs::read(dir.path().join("memory.sealed")).unwrap();
        for secret in ["old-Pa55word", "handed-Pa55word", "alice", "ecr"] {
            assert!(
                !raw.windows(secret.len()).any(|w| w == secret.as_bytes()),
                "{secret} in the clear"
            );
        }
        drop((file, memory));
        let later = now + Duration::from_secs(10);
        let (_, again) = MemoryFile::open(dir.path(), later, wall).unwrap();
        assert_eq!(
            again.known("alice", "old-Pa55word", later),
            Some(given.clone())
        );
        assert_eq!(again.handed("alice", "handed-Pa55word", wall), Some(given));
        assert!(again.handed("alice", "short-Pa55word", wall).is_none());
        assert!(again.known("alice", "other", later).is_none());
        // Not held off: a new refusal of it acts.
        assert!(!again.recently_refused(&again.fingerprint("alice", "old-Pa55word"), later));
        // Under another node key, nothing is put back and the file is discarded.
        std::fs::remove_file(dir.path().join("node.key")).unwrap();
        let (_, other) = MemoryFile::open(dir.path(), later, wall).unwrap();
        assert!(other.known("alice", "old-Pa55word", later).is_none());
        assert!(!dir.path().join("memory.sealed").exists());
    }
}
