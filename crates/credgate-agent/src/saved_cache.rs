//! The providers' answers and the tracked refs, kept across restarts in
//! `STATE_DIR/cache.sealed`, so that a restart (a reboot, an upgrade, a fleet-wide rollout of
//! the agent) costs no plugin run while the answers are valid.
//!
//! The file is a [`crate::state::sealed`] file (`CGCACHE\n`, version 1) of a JSON body.
//! Without the node key nothing in it can be read; a file sealed under another key, of another
//! version or damaged is discarded with a warning. The engine decides what of it may be served
//! again ([`credgate_engine::saved`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use credgate_engine::saved::{SavedAuth, SavedEntry, SavedScope, Unrestored};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::state::key::NodeKey;
use crate::state::sealed::{self, Kind, Sealed};

/// The largest file read or written.
pub const MAX_FILE: u64 = 16 << 20;

const KIND: Kind = Kind {
    file: "cache.sealed",
    magic: b"CGCACHE\n",
    version: 1,
    label: b"provider cache v1",
    max: MAX_FILE,
};
/// The most answers kept (the longest-lived first).
pub const MAX_ENTRIES: usize = 4096;

/// Why the saved state could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum SavedError {
    #[error("the node key is unavailable: {0}")]
    Key(String),
    /// The cause is in the message (and so not a `source`: a chain prints it once).
    #[error("cannot write {path}: {error}")]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
}

#[derive(Serialize, Deserialize)]
struct StoredScope {
    namespace: String,
    name: String,
    uid: String,
    annotations: Vec<(String, String)>,
    token_sha256: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct StoredAuth {
    key: String,
    username: String,
    password: String,
}

#[derive(Serialize, Deserialize)]
struct StoredEntry {
    provider: String,
    identity: String,
    key_type: String,
    image: String,
    registry: String,
    scope: Option<StoredScope>,
    auth: Vec<StoredAuth>,
    fetched_ms: u64,
    expires_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct StoredConsumer {
    consumer: String,
    refs: Vec<String>,
}

#[derive(Serialize, Deserialize, Default)]
struct Stored {
    entries: Vec<StoredEntry>,
    consumers: Vec<StoredConsumer>,
}

/// What was read at start.
#[derive(Debug, Default)]
pub struct Loaded {
    pub entries: Vec<SavedEntry>,
    /// Named consumers and their refs.
    pub consumers: Vec<(String, Vec<String>)>,
    /// Why nothing (or not everything) could be read.
    pub dropped: BTreeMap<DropReason, u64>,
}

/// Why a saved provider answer, or the whole file, was not restored at start: the file's and
/// the consumers' reasons here, the engine's ([`Unrestored`]) for the entries it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DropReason {
    /// The file was refused unread (a link, another uid's, too large).
    Refused,
    /// Sealed under another node key, of another version, or damaged.
    NodeKey,
    /// An entry that does not decode, or whose credential is not valid.
    Invalid,
    /// A named consumer's refs the renewer would not take back.
    ConsumerInvalid,
    ProviderGone,
    ConfigChanged,
    Expired,
}

impl DropReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Refused => "refused",
            DropReason::NodeKey => "node_key",
            DropReason::Invalid => "invalid",
            DropReason::ConsumerInvalid => "consumer_invalid",
            DropReason::ProviderGone => "provider_gone",
            DropReason::ConfigChanged => "config_changed",
            DropReason::Expired => "expired",
        }
    }
}

impl From<Unrestored> for DropReason {
    fn from(why: Unrestored) -> Self {
        match why {
            Unrestored::ProviderGone => DropReason::ProviderGone,
            Unrestored::ConfigChanged => DropReason::ConfigChanged,
            Unrestored::Expired => DropReason::Expired,
            Unrestored::Invalid => DropReason::Invalid,
        }
    }
}

/// The sealed file of one state directory.
pub struct SavedCache {
    sealed: Sealed,
}

fn ms(t: SystemTime) -> u64 {
    u64::try_from(credgate_engine::clock::unix_ms(t)).unwrap_or(0)
}

fn at(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

impl SavedCache {
    /// Removes the sealed file of an earlier run from `state_dir`, for an agent that keeps no
    /// provider answers (`--no-persist-cache`): none kept before is served again, nor left
    /// on disk. Whether there was one.
    pub fn discard(state_dir: &Path) -> std::io::Result<bool> {
        crate::state::discard(state_dir, KIND.file)
    }

    /// The sealed file of `state_dir` (the node key's directory).
    pub fn open(state_dir: &Path) -> Result<SavedCache, SavedError> {
        let node = NodeKey::load_or_create(state_dir)
            .map_err(|e| SavedError::Key(crate::error_chain(&e)))?;
        Ok(SavedCache {
            sealed: Sealed::new(state_dir, KIND, &node),
        })
    }

    fn path(&self) -> PathBuf {
        self.sealed.path()
    }

    /// Reads the file, if there is one; what cannot be read is counted in `dropped`, with a
    /// warning, and a file sealed under another key is removed.
    pub fn load(&self) -> Loaded {
        let mut loaded = Loaded::default();
        let path = self.path();
        let stored = match self.sealed.read() {
            sealed::Read::Absent => return loaded,
            sealed::Read::Newer { version, kept } => {
                tracing::warn!(path = %path.display(), version, kept = %kept.display(), "saved provider answers were written by a newer credgate (a rollback): kept aside as they are, not read; nothing is restored");
                return loaded;
            }
            sealed::Read::Refused(why) => {
                tracing::warn!(path = %path.display(), error = %why, "saved provider answers refused: nothing is restored from the file");
                loaded.dropped.insert(DropReason::Refused, 1);
                return loaded;
            }
            sealed::Read::Body(body) => serde_json::from_slice::<Stored>(&body).ok(),
            sealed::Read::Unreadable => None,
        };
        let Some(stored) = stored else {
            tracing::warn!(path = %path.display(), "saved provider answers sealed under another node key, of another version, or damaged: discarded");
            let _ = self.sealed.remove();
            loaded.dropped.insert(DropReason::NodeKey, 1);
            return loaded;
        };
        for e in stored.entries {
            match entry(e) {
                Some(e) => loaded.entries.push(e),
                None => *loaded.dropped.entry(DropReason::Invalid).or_default() += 1,
            }
        }
        loaded.consumers = stored
            .consumers
            .into_iter()
            .map(|c| (c.consumer, c.refs))
            .collect();
        loaded
    }

    /// Seals `entries` (the longest-lived [`MAX_ENTRIES`]) and `consumers` and replaces the
    /// file, fsynced before it returns; how many entries it holds. Blocking: call it off the
    /// lookup path.
    pub fn save(
        &self,
        mut entries: Vec<SavedEntry>,
        consumers: Vec<(String, Vec<String>)>,
    ) -> Result<usize, SavedError> {
        entries.sort_by_key(|e| std::cmp::Reverse(e.expires));
        entries.truncate(MAX_ENTRIES);
        let mut stored = Stored {
            entries: entries.into_iter().map(stored).collect(),
            consumers: Vec::new(),
        };
        // Within the reader's limit, providers' answers first: the shortest-lived go when they
        // alone would not fit (each measured once, never the whole re-encoded per drop).
        let room = MAX_FILE as usize - 64;
        let sizes: Vec<usize> = stored
            .entries
            .iter()
            .map(|e| Zeroizing::new(serde_json::to_vec(e).expect("entries serialize")).len() + 1)
            .collect();
        let mut used = 32;
        let mut fit = 0;
        for size in &sizes {
            if used + size > room {
                break;
            }
            used += size;
            fit += 1;
        }
        stored.entries.truncate(fit);
        // Then the consumers, those holding the fewest refs first: one that holds thousands
        // of long refs is the one not kept (it tracks them again at its next SetTracked).
        let mut consumers: Vec<(usize, StoredConsumer)> = consumers
            .into_iter()
            .map(|(consumer, refs)| {
                let c = StoredConsumer { consumer, refs };
                (
                    serde_json::to_vec(&c).map_or(usize::MAX, |v| v.len() + 1),
                    c,
                )
            })
            .collect();
        consumers.sort_by_key(|(size, _)| *size);
        let mut left_out = 0;
        for (size, c) in consumers {
            if used.saturating_add(size) > room {
                left_out += 1;
                continue;
            }
            used += size;
            stored.consumers.push(c);
        }
        if left_out > 0 {
            tracing::warn!(
                consumers = left_out,
                "tracked refs of consumers not kept across restarts: the sealed cache is at its limit"
            );
        }
        let plain = Zeroizing::new(serde_json::to_vec(&stored).expect("entries serialize"));
        let n = stored.entries.len();
        for e in stored.entries {
            for a in e.auth {
                drop(Zeroizing::new(a.password));
            }
        }
        // The sizes above add up to the whole: the sealed file refuses what would pass the
        // reader's limit, never writing a file the next start refuses.
        self.sealed
            .write(&plain)
            .map_err(|error| SavedError::Write {
                path: self.path(),
                error: error.into(),
            })?;
        Ok(n)
    }
}

fn stored(e: SavedEntry) -> StoredEntry {
    StoredEntry {
        provider: e.provider,
        identity: e.provider_identity,
        key_type: e.key_type.as_str().to_owned(),
        image: e.image,
        registry: e.registry,
        scope: e.scope.map(|s| StoredScope {
            namespace: s.namespace,
            name: s.name,
            uid: s.uid,
            annotations: s.annotations,
            token_sha256: s.token_sha256.map(hex::encode),
        }),
        auth: e
            .auth
            .into_iter()
            .map(|a| StoredAuth {
                key: a.key,
                username: a.username,
                password: a.password.expose_secret().to_owned(),
            })
            .collect(),
        fetched_ms: ms(e.fetched),
        expires_ms: ms(e.expires),
    }
}

fn entry(e: StoredEntry) -> Option<SavedEntry> {
    let scope = match e.scope {
        None => None,
        Some(s) => Some(SavedScope {
            namespace: s.namespace,
            name: s.name,
            uid: s.uid,
            annotations: s.annotations,
            token_sha256: match s.token_sha256 {
                None => None,
                Some(h) => Some(hex::decode(h).ok()?.try_into().ok()?),
            },
        }),
    };
    Some(SavedEntry {
        provider: e.provider,
        provider_identity: e.identity,
        key_type: e.key_type.parse().ok()?,
        image: e.image,
        registry: e.registry,
        scope,
        auth: e
            .auth
            .into_iter()
            .map(|a| SavedAuth {
                key: a.key,
                username: a.username,
                password: SecretString::from(a.password),
            })
            .collect(),
        fetched: at(e.fetched_ms),
        expires: at(e.expires_ms),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use credgate_core::wire::CacheKeyType;
    use std::os::unix::fs::PermissionsExt;

    use crate::state::private_dir;

    fn saved(password: &str) -> SavedEntry {
        SavedEntry {
            provider: "ecr".into(),
            provider_identity: "sha256:abc".into(),
            key_type: CacheKeyType::Registry,
            image: "1234.dkr.ecr.eu-west-1.amazonaws.com/app:v1".into(),
            registry: "1234.dkr.ecr.eu-west-1.amazonaws.com".into(),
            scope: Some(SavedScope {
                namespace: "team-a".into(),
                name: "builder".into(),
                uid: "u1".into(),
                annotations: vec![("role".into(), "r".into())],
                token_sha256: Some([7; 32]),
            }),
            auth: vec![SavedAuth {
                key: "*.dkr.ecr.*.amazonaws.com".into(),
                username: "AWS".into(),
                password: SecretString::from(password.to_owned()),
            }],
            fetched: SystemTime::now(),
            expires: SystemTime::now() + Duration::from_secs(3600),
        }
    }

    #[test]
    fn sealed_round_trip_nothing_in_the_clear_and_another_key_discards() {
        let dir = private_dir();
        let cache = SavedCache::open(dir.path()).unwrap();
        let n = cache
            .save(
                vec![saved("ecr-password-not-in-clear")],
                vec![("nydus".into(), vec!["registry.example.com/app:v1".into()])],
            )
            .unwrap();
        assert_eq!(n, 1);
        let bytes = std::fs::read(dir.path().join(KIND.file)).unwrap();
        for clear in [
            &b"ecr-password-not-in-clear"[..],
            b"AWS",
            b"nydus",
            b"team-a",
            b"ecr",
        ] {
            assert!(
                !bytes.windows(clear.len()).any(|w| w == clear),
                "{clear:?} in the clear"
            );
        }
        let loaded = SavedCache::open(dir.path()).unwrap().load();
        assert_eq!(loaded.entries.len(), 1);
        let e = &loaded.entries[0];
        assert_eq!(
            e.auth[0].password.expose_secret(),
            "ecr-password-not-in-clear"
        );
        assert_eq!(e.scope.as_ref().unwrap().token_sha256, Some([7; 32]));
        assert_eq!(loaded.consumers[0].0, "nydus");
        // The header is bound: another version or key id does not open.
        let mut tampered = bytes.clone();
        tampered[11] ^= 1;
        std::fs::write(dir.path().join(KIND.file), &tampered).unwrap();
        let loaded = SavedCache::open(dir.path()).unwrap().load();
        assert_eq!(loaded.dropped.get(&DropReason::NodeKey), Some(&1));
        assert!(loaded.entries.is_empty());
        // A replaced node key: discarded.
        cache.save(vec![saved("x")], vec![]).unwrap();
        std::fs::write(dir.path().join("node.key"), [3u8; 32]).unwrap();
        let loaded = SavedCache::open(dir.path()).unwrap().load();
        assert_eq!(loaded.dropped.get(&DropReason::NodeKey), Some(&1));
        assert!(!dir.path().join(KIND.file).exists());
    }

    /// 60 consumers of 1000 refs of 340 bytes each (20 MB) beside a provider's answer: the
    /// file stays within what the reader takes, the answer and the small consumer are kept,
    /// and the next start restores them.
    #[test]
    fn what_is_written_stays_readable_answers_first() {
        let dir = private_dir();
        let cache = SavedCache::open(dir.path()).unwrap();
        let long_ref =
            |c: usize, i: usize| format!("registry.example.com/{}/app-{c}-{i}:v1", "x".repeat(300));
        let mut consumers: Vec<(String, Vec<String>)> = (0..60)
            .map(|c| {
                (
                    format!("big-{c}"),
                    (0..1000).map(|i| long_ref(c, i)).collect(),
                )
            })
            .collect();
        consumers.push(("nydus".into(), vec!["registry.example.com/app:v1".into()]));
        let n = cache.save(vec![saved("kept-answer")], consumers).unwrap();
        assert_eq!(n, 1);
        let size = std::fs::metadata(dir.path().join(KIND.file)).unwrap().len();
        assert!(size <= MAX_FILE, "{size} bytes written");
        let loaded = SavedCache::open(dir.path()).unwrap().load();
        assert!(loaded.dropped.is_empty(), "{:?}", loaded.dropped);
        assert_eq!(loaded.entries.len(), 1, "the provider's answer first");
        assert!(loaded.consumers.iter().any(|(c, _)| c == "nydus"));
        assert!(loaded.consumers.len() < 61);
    }

    #[test]
    fn a_link_or_an_oversized_file_is_refused() {
        let dir = private_dir();
        let cache = SavedCache::open(dir.path()).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.path().join(KIND.file)).unwrap();
        assert_eq!(cache.load().dropped.get(&DropReason::Refused), Some(&1));
        std::fs::remove_file(dir.path().join(KIND.file)).unwrap();
        let f = std::fs::File::create(dir.path().join(KIND.file)).unwrap();
        f.set_len(MAX_FILE + 1).unwrap();
        std::fs::set_permissions(
            dir.path().join(KIND.file),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        assert_eq!(cache.load().dropped.get(&DropReason::Refused), Some(&1));
    }
}
