//! Resolved lookups, remembered by the caller's image string: which cache entries answered it
//! and which of their credentials, in try-order. A repeated lookup of the same string skips
//! parsing, matching, probing and ordering while the memo is fresh: no provider cache changed
//! since (a global generation) and every entry it used is still alive for the caller.
//!
//! Sharded copy-on-write maps keep reads lock-free and writes cheap; each shard holds a bounded
//! number of resolutions and starts over when full.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
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

type Shard = HashMap<Box<str>, Arc<Resolved>>;

/// The memo.
pub struct Memo {
    shards: Box<[ArcSwap<Shard>]>,
    writer: Mutex<()>,
    per_shard: usize,
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
    /// A memo holding about `capacity` resolutions.
    pub fn new(capacity: usize) -> Self {
        Memo {
            shards: (0..SHARDS)
                .map(|_| ArcSwap::from_pointee(Shard::default()))
                .collect(),
            writer: Mutex::new(()),
            per_shard: capacity.div_ceil(SHARDS).max(1),
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
        shard.get(key).map(|r| f(r))
    }

    /// Remembers a resolution.
    pub fn insert(&self, key: &str, resolved: Arc<Resolved>) {
        let _w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &self.shards[shard_of(key)];
        let current = slot.load();
        let mut next: Shard = if current.len() >= self.per_shard {
            Shard::default()
        } else {
            current
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        next.insert(key.into(), resolved);
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
        let total: usize = memo.shards.iter().map(|s| s.load().len()).sum();
        assert!(total <= SHARDS * 2, "{total}");
        memo.insert("r.io/x", resolved(7, None));
        assert_eq!(memo.with("r.io/x", |r| r.generation), Some(7));
        assert_eq!(memo.with("r.io/absent", |r| r.generation), None);
    }
}
