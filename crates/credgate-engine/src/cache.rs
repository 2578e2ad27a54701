//! One provider's response cache: keyed by `Image`, `Registry` or `Global` (and the service
//! account scope), read without locks through an atomically swapped snapshot, written
//! copy-on-write under a mutex. Writes purge dead entries and evict the soonest-expiring ones
//! beyond the capacity, so memory stays bounded whatever the request pattern.

use parking_lot::Mutex;
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use arc_swap::{ArcSwap, Guard};
use credgate_core::keyring::AuthSet;
use credgate_core::wire::CacheKeyType;
use hashbrown::{Equivalent, HashMap};

/// The service account part of a key (KEP-4412): coordinates, the selected annotations and,
/// for `cacheType: Token`, a hash of the token.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub annotations: Vec<(String, String)>,
    pub token_sha256: Option<[u8; 32]>,
}

impl std::fmt::Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("uid", &self.uid)
            .field("annotations", &self.annotations)
            .field("token_sha256", &self.token_sha256.map(|_| "<hashed>"))
            .finish()
    }
}

/// A cached (or just fetched) response.
#[derive(Debug)]
pub struct Entry {
    pub auth: AuthSet,
    pub key_type: CacheKeyType,
    /// The image the plugin was asked about.
    pub image: Arc<str>,
    /// The registry part of that image.
    pub registry: Arc<str>,
    pub scope: Option<Arc<Scope>>,
    /// Monotonic expiry; `None` when the response must not be cached (duration 0).
    pub expires: Option<Instant>,
    /// The same expiry on the wall clock, for reports.
    pub expires_wall: Option<SystemTime>,
    /// When the plugin answered, monotonic (renewal computes lifetimes from it).
    pub fetched: Instant,
}

impl Entry {
    /// Whether the entry is still alive at `t`: dead the moment its expiry has passed.
    pub fn alive_at(&self, t: Instant) -> bool {
        self.expires.is_some_and(|e| t < e)
    }

    /// Whether this response answers requests for `image` of `registry`, in any scope.
    pub fn covers_image(&self, image: &str, registry: &str) -> bool {
        match self.key_type {
            CacheKeyType::Image => *self.image == *image,
            CacheKeyType::Registry => *self.registry == *registry,
            CacheKeyType::Global => true,
        }
    }

    /// Whether this response holds the credential `username`:`password`.
    pub fn holds(&self, username: &str, password: &str) -> bool {
        use secrecy::ExposeSecret;
        (0..self.auth.len())
            .filter_map(|i| self.auth.get(i))
            .any(|a| a.auth.username == username && a.auth.password.expose_secret() == password)
    }

    /// Whether this response answers a request for `image` of `registry` in `scope`.
    pub fn covers(&self, image: &str, registry: &str, scope: Option<&Scope>) -> bool {
        self.scope.as_deref() == scope && self.covers_image(image, registry)
    }

    /// The cache key this response is stored under.
    pub fn key(&self) -> CacheKey {
        let name = match self.key_type {
            CacheKeyType::Image => self.image.clone(),
            CacheKeyType::Registry => self.registry.clone(),
            CacheKeyType::Global => Arc::from(""),
        };
        CacheKey {
            scope: self.scope.clone(),
            kind: self.key_type,
            name,
        }
    }
}

/// An owned cache key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    scope: Option<Arc<Scope>>,
    kind: CacheKeyType,
    name: Arc<str>,
}

impl CacheKey {
    /// How the response behind this key may be reused.
    pub fn kind(&self) -> CacheKeyType {
        self.kind
    }
}

/// A borrowed key for lookups; hashes exactly as [`CacheKey`].
#[derive(Hash)]
struct KeyRef<'a> {
    scope: Option<&'a Scope>,
    kind: CacheKeyType,
    name: &'a str,
}

impl Equivalent<CacheKey> for KeyRef<'_> {
    fn equivalent(&self, key: &CacheKey) -> bool {
        self.kind == key.kind && self.name == &*key.name && self.scope == key.scope.as_deref()
    }
}

/// An immutable snapshot of the cache.
#[derive(Default)]
pub struct Snapshot {
    entries: HashMap<CacheKey, Arc<Entry>>,
    /// How many entries of each kind, so a lookup skips kinds that have none.
    counts: [usize; 3],
}

fn kind_index(kind: CacheKeyType) -> usize {
    match kind {
        CacheKeyType::Image => 0,
        CacheKeyType::Registry => 1,
        CacheKeyType::Global => 2,
    }
}

impl Snapshot {
    fn from_entries(entries: HashMap<CacheKey, Arc<Entry>>) -> Self {
        let mut counts = [0; 3];
        for k in entries.keys() {
            counts[kind_index(k.kind)] += 1;
        }
        Snapshot { entries, counts }
    }

    /// The first entry that is alive until `fresh_until`, trying the image key, then the
    /// registry key, then the global key.
    pub fn find(
        &self,
        image: &str,
        registry: &str,
        scope: Option<&Scope>,
        fresh_until: Instant,
    ) -> Option<&Arc<Entry>> {
        let probes = [
            (CacheKeyType::Image, image),
            (CacheKeyType::Registry, registry),
            (CacheKeyType::Global, ""),
        ];
        probes.into_iter().find_map(|(kind, name)| {
            if self.counts[kind_index(kind)] == 0 {
                return None;
            }
            self.entries
                .get(&KeyRef { scope, kind, name })
                .filter(|e| e.alive_at(fresh_until))
        })
    }

    /// Entries alive at `now`.
    pub fn live(&self, now: Instant) -> usize {
        self.entries.values().filter(|e| e.alive_at(now)).count()
    }

    /// Every entry, dead or alive.
    pub fn entries(&self) -> impl Iterator<Item = &Arc<Entry>> {
        self.entries.values()
    }

    /// How many entries, dead or alive.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

/// A provider's cache.
pub struct Cache {
    current: ArcSwap<Snapshot>,
    writer: Mutex<()>,
    capacity: usize,
}

impl Cache {
    pub fn new(capacity: usize) -> Self {
        Cache {
            current: ArcSwap::from_pointee(Snapshot::default()),
            writer: Mutex::new(()),
            capacity: capacity.max(1),
        }
    }

    /// The current snapshot; lock-free.
    pub fn load(&self) -> Guard<Arc<Snapshot>> {
        self.current.load()
    }

    /// Stores a response under its key, purging dead entries and evicting the soonest-expiring
    /// beyond the capacity. Returns the number of entries after the write.
    pub fn insert(&self, entry: Arc<Entry>, now: Instant) -> usize {
        if !entry.alive_at(now) {
            return self.load().len();
        }
        let _w = self.writer.lock();
        let cur = self.current.load();
        // The table copied as it is (no key hashed again: with thousands of long image keys,
        // rehashing every key at each insert cost a core under a tenant's tracked refs), then
        // the dead entries left out.
        let mut next: HashMap<CacheKey, Arc<Entry>> = cur.entries.clone();
        next.retain(|_, e| e.alive_at(now));
        next.insert(entry.key(), entry);
        while next.len() > self.capacity {
            let victim = next
                .iter()
                .min_by_key(|(_, e)| e.expires)
                .map(|(k, _)| k.clone())
                .expect("over capacity means not empty");
            next.remove(&victim);
        }
        let len = next.len();
        self.current.store(Arc::new(Snapshot::from_entries(next)));
        len
    }

    /// Removes every entry `drop` picks (and the dead ones); returns the removed live ones.
    pub fn remove(&self, drop: impl Fn(&Entry) -> bool, now: Instant) -> Vec<Arc<Entry>> {
        let _w = self.writer.lock();
        let cur = self.current.load();
        let mut removed = Vec::new();
        let mut next = HashMap::with_capacity(cur.entries.len());
        for (k, e) in &cur.entries {
            if !e.alive_at(now) {
                continue;
            }
            if drop(e) {
                removed.push(e.clone());
            } else {
                next.insert(k.clone(), e.clone());
            }
        }
        if !removed.is_empty() {
            self.current.store(Arc::new(Snapshot::from_entries(next)));
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn entry(kind: CacheKeyType, image: &str, now: Instant, ttl: u64) -> Arc<Entry> {
        Arc::new(Entry {
            auth: AuthSet::default(),
            key_type: kind,
            image: image.into(),
            registry: image.split('/').next().unwrap().into(),
            scope: None,
            expires: Some(now + Duration::from_secs(ttl)),
            expires_wall: None,
            fetched: Instant::now(),
        })
    }

    #[test]
    fn probes_image_registry_global() {
        let now = Instant::now();
        let c = Cache::new(10);
        c.insert(entry(CacheKeyType::Registry, "r.io/a", now, 60), now);
        let snap = c.load();
        assert!(snap.find("r.io/b", "r.io", None, now).is_some());
        assert!(snap.find("q.io/b", "q.io", None, now).is_none());
        assert!(snap
            .find("r.io/b", "r.io", None, now + Duration::from_secs(60))
            .is_none());
        c.insert(entry(CacheKeyType::Global, "x.io/a", now, 60), now);
        assert!(c.load().find("q.io/b", "q.io", None, now).is_some());
        let scope = Scope {
            namespace: "ns".into(),
            name: "sa".into(),
            uid: "u".into(),
            annotations: vec![],
            token_sha256: None,
        };
        assert!(c.load().find("q.io/b", "q.io", Some(&scope), now).is_none());
    }

    #[test]
    fn bounded_and_purged() {
        let now = Instant::now();
        let c = Cache::new(3);
        for i in 0..10 {
            c.insert(
                entry(CacheKeyType::Image, &format!("r.io/{i}"), now, 100 + i),
                now,
            );
        }
        let snap = c.load();
        assert_eq!(snap.len(), 3);
        assert!(snap.find("r.io/9", "r.io", None, now).is_some());
        assert!(snap.find("r.io/0", "r.io", None, now).is_none());
        let later = now + Duration::from_secs(200);
        c.insert(entry(CacheKeyType::Image, "r.io/new", later, 5), later);
        assert_eq!(c.load().len(), 1);
    }

    #[test]
    fn removal_takes_only_what_it_picks() {
        let now = Instant::now();
        let c = Cache::new(10);
        c.insert(entry(CacheKeyType::Image, "r.io/a", now, 60), now);
        c.insert(entry(CacheKeyType::Registry, "q.io/b", now, 60), now);
        let gone = c.remove(|e| e.covers_image("q.io/x", "q.io"), now);
        assert_eq!(gone.len(), 1);
        assert_eq!(&*gone[0].registry, "q.io");
        let snap = c.load();
        assert!(snap.find("r.io/a", "r.io", None, now).is_some());
        assert!(snap.find("q.io/b", "q.io", None, now).is_none());
        assert!(c.remove(|_| false, now).is_empty());
    }

    #[test]
    fn zero_duration_is_not_stored() {
        let now = Instant::now();
        let c = Cache::new(3);
        let mut e = entry(CacheKeyType::Image, "r.io/a", now, 1);
        Arc::get_mut(&mut e).unwrap().expires = None;
        c.insert(e, now);
        assert_eq!(c.load().len(), 0);
    }
}
