//! Which consumers depend on which refs: the bookkeeping behind `Track`, `Untrack` and the
//! atomic `SetTracked` reconcile. A ref stays tracked while any consumer holds it; once the last
//! one lets go it is kept for a grace period (see [`Tracker::evictable`]), so a ref released
//! by a reconcile that raced a pull's registration is not dropped before the registration
//! lands.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

#[derive(Debug, Default, Clone)]
struct Holders {
    consumers: BTreeSet<String>,
    /// When the last consumer let go; `None` while held.
    released: Option<Instant>,
}

/// What a change did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Change {
    /// Refs the consumer holds now that it did not hold before.
    pub added: Vec<String>,
    /// Refs the consumer no longer holds.
    pub removed: Vec<String>,
    /// Refs that were not tracked at all before (a subset of `added`).
    pub new_refs: Vec<String>,
}

/// Consumers and their refs.
#[derive(Debug, Default, Clone)]
pub struct Tracker {
    refs: BTreeMap<String, Holders>,
    consumers: BTreeMap<String, BTreeSet<String>>,
    /// Released refs by when they were released: eviction costs what is evicted, not what is
    /// held.
    released: BTreeSet<(Instant, String)>,
}

impl Tracker {
    /// How many consumers other than Watch streams (`watch:` names) hold at least one ref.
    pub fn consumers(&self) -> usize {
        self.consumers
            .iter()
            .filter(|(name, held)| !held.is_empty() && !name.starts_with("watch:"))
            .count()
    }

    /// Whether `consumer` holds at least one ref.
    pub fn has_consumer(&self, consumer: &str) -> bool {
        self.consumers
            .get(consumer)
            .is_some_and(|held| !held.is_empty())
    }

    /// Adds `refs` to what `consumer` holds.
    pub fn track<'a>(
        &mut self,
        consumer: &str,
        refs: impl IntoIterator<Item = &'a str>,
        _now: Instant,
    ) -> Change {
        let mut change = Change::default();
        for r in refs {
            let held = self.consumers.entry(consumer.to_owned()).or_default();
            if !held.insert(r.to_owned()) {
                continue;
            }
            let holders = self.refs.entry(r.to_owned()).or_insert_with(|| {
                change.new_refs.push(r.to_owned());
                Holders::default()
            });
            holders.consumers.insert(consumer.to_owned());
            if let Some(t) = holders.released.take() {
                self.released.remove(&(t, r.to_owned()));
            }
            change.added.push(r.to_owned());
        }
        change
    }

    /// Removes `refs` from what `consumer` holds.
    pub fn untrack<'a>(
        &mut self,
        consumer: &str,
        refs: impl IntoIterator<Item = &'a str>,
        now: Instant,
    ) -> Change {
        let mut change = Change::default();
        for r in refs {
            let Some(held) = self.consumers.get_mut(consumer) else {
                break;
            };
            if !held.remove(r) {
                continue;
            }
            if let Some(h) = self.refs.get_mut(r) {
                h.consumers.remove(consumer);
                if h.consumers.is_empty() && h.released.is_none() {
                    h.released = Some(now);
                    self.released.insert((now, r.to_owned()));
                }
            }
            change.removed.push(r.to_owned());
        }
        if self.consumers.get(consumer).is_some_and(BTreeSet::is_empty) {
            self.consumers.remove(consumer);
        }
        change
    }

    /// Makes `refs` exactly what `consumer` holds, in one step.
    pub fn set<'a>(
        &mut self,
        consumer: &str,
        refs: impl IntoIterator<Item = &'a str>,
        now: Instant,
    ) -> Change {
        let wanted: BTreeSet<&str> = refs.into_iter().collect();
        let stale: Vec<String> = self
            .consumers
            .get(consumer)
            .map(|held| {
                held.iter()
                    .filter(|r| !wanted.contains(r.as_str()))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let removed = self.untrack(consumer, stale.iter().map(String::as_str), now);
        let mut change = self.track(consumer, wanted, now);
        change.removed = removed.removed;
        change
    }

    /// Releases everything `consumer` holds.
    pub fn drop_consumer(&mut self, consumer: &str, now: Instant) -> Change {
        self.set(consumer, [], now)
    }

    /// Refs nobody has held for at least `grace`; they are forgotten.
    pub fn evict(&mut self, now: Instant, grace: Duration) -> Vec<String> {
        let mut gone = Vec::new();
        while let Some(first) = self.released.first() {
            if now.saturating_duration_since(first.0) < grace {
                break;
            }
            let (_, r) = self.released.pop_first().expect("a first");
            self.refs.remove(&r);
            gone.push(r);
        }
        gone
    }

    /// Refs nobody has held for at least `grace`.
    pub fn evictable(&self, now: Instant, grace: Duration) -> impl Iterator<Item = &str> {
        self.released
            .iter()
            .take_while(move |(t, _)| now.saturating_duration_since(*t) >= grace)
            .map(|(_, r)| r.as_str())
    }

    /// When the next ref becomes evictable.
    pub fn next_eviction(&self, grace: Duration) -> Option<Instant> {
        self.released.first().map(|(t, _)| *t + grace)
    }

    /// Whether `r` is known (held, or within its grace period).
    pub fn contains(&self, r: &str) -> bool {
        self.refs.contains_key(r)
    }

    /// The consumers holding `r`.
    pub fn holders(&self, r: &str) -> impl Iterator<Item = &str> {
        self.refs
            .get(r)
            .into_iter()
            .flat_map(|h| h.consumers.iter().map(String::as_str))
    }

    /// The refs `consumer` holds.
    pub fn held_by(&self, consumer: &str) -> impl Iterator<Item = &str> {
        self.consumers
            .get(consumer)
            .into_iter()
            .flat_map(|s| s.iter().map(String::as_str))
    }

    /// Consumers other than Watch streams, with the refs each holds (what outlives a restart:
    /// a Watch stream does not).
    pub fn named(&self) -> impl Iterator<Item = (&str, impl Iterator<Item = &str>)> {
        self.consumers
            .iter()
            .filter(|(name, held)| !held.is_empty() && !name.starts_with("watch:"))
            .map(|(name, held)| (name.as_str(), held.iter().map(String::as_str)))
    }

    /// Every known ref, sorted.
    pub fn refs(&self) -> impl Iterator<Item = &str> {
        self.refs.keys().map(String::as_str)
    }

    /// How many refs are known.
    pub fn len(&self) -> usize {
        self.refs.len()
    }

    /// Whether no ref is known.
    pub fn is_empty(&self) -> bool {
        self.refs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(600);

    #[test]
    fn shared_ref_stays_while_any_consumer_holds_it() {
        let t0 = Instant::now();
        let mut t = Tracker::default();
        let c = t.track("a", ["r1", "r2"], t0);
        assert_eq!(c.new_refs, ["r1", "r2"]);
        let c = t.track("b", ["r1"], t0);
        assert!(c.new_refs.is_empty());
        assert_eq!(c.added, ["r1"]);
        t.untrack("a", ["r1", "r2"], t0);
        let later = t0 + GRACE * 10;
        assert_eq!(t.evict(later, GRACE), ["r2"]);
        assert!(t.contains("r1"));
        assert_eq!(t.holders("r1").collect::<Vec<_>>(), ["b"]);
    }

    #[test]
    fn set_replaces_atomically_and_reports_the_difference() {
        let t0 = Instant::now();
        let mut t = Tracker::default();
        t.track("a", ["r1", "r2", "r3"], t0);
        let c = t.set("a", ["r2", "r4"], t0);
        assert_eq!(c.added, ["r4"]);
        assert_eq!(c.removed, ["r1", "r3"]);
        assert_eq!(t.held_by("a").collect::<Vec<_>>(), ["r2", "r4"]);
        let c = t.set("a", ["r2", "r4"], t0);
        assert_eq!(c, Change::default());
    }

    #[test]
    fn released_refs_survive_the_grace_period_and_can_come_back() {
        let t0 = Instant::now();
        let mut t = Tracker::default();
        t.track("a", ["r1"], t0);
        t.set("a", [], t0);
        assert!(t
            .evict(t0 + GRACE - Duration::from_secs(1), GRACE)
            .is_empty());
        assert_eq!(t.next_eviction(GRACE), Some(t0 + GRACE));
        // The registration lands within the grace period: the ref is held again.
        let c = t.track("a", ["r1"], t0 + GRACE / 2);
        assert!(c.new_refs.is_empty());
        assert!(t.evict(t0 + GRACE * 5, GRACE).is_empty());
        assert_eq!(t.next_eviction(GRACE), None);
    }

    #[test]
    fn dropping_a_consumer_releases_all_it_held() {
        let t0 = Instant::now();
        let mut t = Tracker::default();
        t.track("watch:1", ["r1", "r2"], t0);
        let c = t.drop_consumer("watch:1", t0);
        assert_eq!(c.removed, ["r1", "r2"]);
        assert_eq!(t.held_by("watch:1").count(), 0);
        assert_eq!(t.evict(t0 + GRACE, GRACE), ["r1", "r2"]);
        assert!(t.is_empty());
    }
}
