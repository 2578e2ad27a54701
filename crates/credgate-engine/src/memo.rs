//! Resolved lookups, remembered by the caller's image string: which cache entries answered it
//! and which of their credentials, in try-order. A repeated lookup of the same string skips
//! parsing, matching, probing and ordering while the memo is fresh: no provider cache changed
//! since (a global generation) and every entry it used is still alive for the caller.
//!
//! Sharded copy-on-write maps keep reads lock-free and writes cheap; each shard holds a bounded
//! number of resolutions and of bytes of keys and names, and starts over when either is full.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use hashbrown::HashMap;
use smallvec::SmallVec;

use crate::cache::Entry;

const SHARDS: usize = 64;

/// Where a picked credential lives.
#[derive(Debug, Clone, Copy)]
pub enum PickSource {
    /// A static source, by index.
    Static(usize),
    /// An entry of [`Resolved::entries`], by index.
    Entry(usize),
}

/// One credential of a resolution: its source and its index in that source's `AuthSet`.
#[derive(Debug, Clone, Copy)]
pub struct Pick {
    pub source: PickSource,
    pub index: usize,
}

/// A resolved lookup.
#[derive(Debug)]
pub struct Resolved {
    /// The normalized image name.
    pub name: Box<str>,
    /// The cache generation it was computed at.
    pub generation: u64,
    /// The earliest expiry among `entries`; `None` when only static sources answered.
    pub valid_until: Option<Instant>,
    /// (provider index, entry) for every provider that answered.
    pub entries: SmallVec<[(usize, Arc<Entry>); 2]>,
    /// The credentials in try-order.
    pub picks: SmallVec<[Pick; 2]>,
}

impl Resolved {
    /// Whether it still answers a lookup at `generation` that needs validity until
    /// `fresh_until`.
    pub fn fresh(&self, generation: u64, fresh_until: Instant) -> bool {
        self.generation == generation && self.valid_until.is_none_or(|v| fresh_until < v)
    }
}

#[derive(Default)]
struct Shard {
    map: HashMap<Box<str>, Arc<Resolved>>,
    /// Bytes of the keys and names held.
    bytes: usize,
}

/// The bytes a resolution holds beyond its fixed size.
fn weight(key: &str, resolved: &Resolved) -> usize {
    key.len() + resolved.name.len()
}

/// The most bytes of keys and names the whole memo holds, whatever its capacity in entries.
pub const MEMO_BYTES: usize = 16 << 20;

/// The memo.
pub struct Memo {
    shards: Box<[ArcSwap<Shard>]>,
    writer: Mutex<()>,
    per_shard: usize,
    per_shard_bytes: usize,
    /// Bumped whenever any provider cache changes.
    pub generation: Arc<AtomicU64>,
}

fn shard_of(key: &str) -> usize {
    let b = key.as_bytes();
    let mix = b.len().wrapping_mul(31)
        ^ usize::from(b.last().copied().unwrap_or(0)).wrapping_mul(131)
        ^ usize::from(b.get(b.len() / 2).copied().unwrap_or(0)).wrapping_mul(7);
    mix % SHARDS
}

impl Memo {
    /// A memo holding about `capacity` resolutions and at most [`MEMO_BYTES`] of keys.
    pub fn new(capacity: usize) -> Self {
        Self::bounded(capacity, MEMO_BYTES)
    }

    /// A memo holding about `capacity` resolutions and at most `bytes` of keys and names.
    pub fn bounded(capacity: usize, bytes: usize) -> Self {
        Memo {
            shards: (0..SHARDS)
                .map(|_| ArcSwap::from_pointee(Shard::default()))
                .collect(),
            writer: Mutex::new(()),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            per_shard_bytes: (bytes / SHARDS).max(1),
            generation: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The current generation; read it before the caches a resolution is built from.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Calls `f` with the resolution for `key` if there is one; lock-free.
    pub fn with<R>(&self, key: &str, f: impl FnOnce(&Resolved) -> R) -> Option<R> {
        let shard = self.shards[shard_of(key)].load();
        shard.map.get(key).map(|r| f(r))
    }

    /// Remembers a resolution.
    pub fn insert(&self, key: &str, resolved: Arc<Resolved>) {
        let _w = self.writer.lock();
        let slot = &self.shards[shard_of(key)];
        let current = slot.load();
        let added = weight(key, &resolved);
        let mut next = if current.map.len() >= self.per_shard
            || current.bytes + added > self.per_shard_bytes
        {
            Shard::default()
        } else {
            Shard {
                map: current
                    .map
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                bytes: current.bytes,
            }
        };
        if let Some(old) = next.map.insert(key.into(), resolved) {
            next.bytes -= weight(key, &old);
        }
        next.bytes += added;
        slot.store(Arc::new(next));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn resolved(generation: u64, valid_until: Option<Instant>) -> Arc<Resolved> {
        Arc::new(Resolved {
            name: "r.io/a".into(),
            generation,
            valid_until,
            entries: SmallVec::new(),
            picks: SmallVec::new(),
        })
    }

    #[test]
    fn fresh_only_at_the_same_generation_and_before_expiry() {
        let now = Instant::now();
        let r = resolved(3, Some(now + Duration::from_secs(10)));
        assert!(r.fresh(3, now));
        assert!(!r.fresh(4, now), "a cache write invalidates");
        assert!(!r.fresh(3, now + Duration::from_secs(10)), "dead at expiry");
        assert!(resolved(3, None).fresh(3, now + Duration::from_secs(1 << 30)));
    }

    #[test]
    fn shards_stay_bounded() {
        let memo = Memo::new(SHARDS * 2);
        for i in 0..10_000 {
            memo.insert(&format!("r.io/app-{i}"), resolved(0, None));
        }
        let total: usize = memo.shards.iter().map(|s| s.load().map.len()).sum();
        assert!(total <= SHARDS * 2, "{total}");
        memo.insert("r.io/x", resolved(7, None));
        assert_eq!(memo.with("r.io/x", |r| r.generation), Some(7));
        assert_eq!(memo.with("r.io/absent", |r| r.generation), None);
    }

    #[test]
    fn long_keys_are_bounded_by_bytes_not_entries() {
        let budget = 1 << 20;
        let memo = Memo::bounded(1 << 20, budget);
        for i in 0..3_000 {
            let key = format!("r.io/app@sha999:{i:0>1000}");
            memo.insert(&key, resolved(0, None));
        }
        let bytes: usize = memo.shards.iter().map(|s| s.load().bytes).sum();
        let counted: usize = memo
            .shards
            .iter()
            .map(|s| {
                let s = s.load();
                s.map.iter().map(|(k, r)| weight(k, r)).sum::<usize>()
            })
            .sum();
        assert_eq!(bytes, counted, "the running count is true");
        assert!(bytes <= budget, "{bytes}");
    }
}
