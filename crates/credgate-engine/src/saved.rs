//! Provider answers as they are kept across restarts: what the engine hands out to be kept
//! ([`Engine::saved_entries`]) and takes back at start ([`Engine::restore`]). The engine says
//! nothing about where or how they are stored (the agent seals them under the node key); it
//! only decides which may be served again: an answer whose provider still exists with the
//! same identity (its config entry and plugin binary) and that has not expired.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use credgate_core::keyring::AuthSet;
use credgate_core::wire::{AuthConfig, CacheKeyType};
use secrecy::{ExposeSecret, SecretString};

use crate::cache::{Entry, Scope};
use crate::engine::Engine;

/// A service account scope of a saved answer (KEP-4412).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedScope {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub annotations: Vec<(String, String)>,
    /// For `cacheType: Token`: the token's SHA-256 (never the token).
    pub token_sha256: Option<[u8; 32]>,
}

/// One credential of a saved answer: its key (the pattern it is for) and the secret.
#[derive(Clone)]
pub struct SavedAuth {
    pub key: String,
    pub username: String,
    pub password: SecretString,
}

impl std::fmt::Debug for SavedAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedAuth")
            .field("key", &self.key)
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// A provider's cached answer, with what decides whether it may be served again.
#[derive(Debug, Clone)]
pub struct SavedEntry {
    pub provider: String,
    /// The provider's identity when it answered ([`Engine::provider_identity`]).
    pub provider_identity: String,
    pub key_type: CacheKeyType,
    pub image: String,
    pub registry: String,
    pub scope: Option<SavedScope>,
    pub auth: Vec<SavedAuth>,
    pub fetched: SystemTime,
    pub expires: SystemTime,
}

/// What [`Engine::restore`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restored {
    pub restored: u64,
    /// Dropped entries by reason.
    pub dropped: BTreeMap<Unrestored, u64>,
}

/// Why [`Engine::restore`] dropped a saved answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Unrestored {
    /// No provider of that name any more.
    ProviderGone,
    /// The provider's identity (its config entry or plugin) changed.
    ConfigChanged,
    Expired,
    /// No credential, or one that does not make a valid auth entry.
    Invalid,
}

impl Unrestored {
    pub fn as_str(self) -> &'static str {
        match self {
            Unrestored::ProviderGone => "provider_gone",
            Unrestored::ConfigChanged => "config_changed",
            Unrestored::Expired => "expired",
            Unrestored::Invalid => "invalid",
        }
    }
}

impl Engine {
    /// A number that changes whenever any provider cache changes (to know when to save).
    pub fn generation(&self) -> u64 {
        self.generation_counter().load(Ordering::Acquire)
    }

    /// The identity of provider `name`, if the engine has it.
    pub fn provider_identity(&self, name: &str) -> Option<&str> {
        self.providers()
            .iter()
            .find(|p| p.spec.name == name)
            .map(|p| p.identity.as_str())
    }

    /// Every live cached answer of every provider, to be kept.
    pub fn saved_entries(&self) -> Vec<SavedEntry> {
        let (now, wall) = (self.clock().now(), self.clock().wall());
        let mut out = Vec::new();
        for p in self.providers() {
            let snapshot = p.cache.load();
            for e in snapshot.entries() {
                // An answer with no credential is not kept: it would be refused as invalid at
                // the next start anyway, and the plugin is asked again then.
                let Some(expires) = e.expires.filter(|x| *x > now && !e.auth.is_empty()) else {
                    continue;
                };
                let auth = (0..e.auth.len())
                    .filter_map(|i| e.auth.get(i))
                    .map(|a| SavedAuth {
                        key: a.key().to_owned(),
                        username: a.auth.username.clone(),
                        password: a.auth.password.clone(),
                    })
                    .collect();
                out.push(SavedEntry {
                    provider: p.spec.name.clone(),
                    provider_identity: p.identity.clone(),
                    key_type: e.key_type,
                    image: e.image.to_string(),
                    registry: e.registry.to_string(),
                    scope: e.scope.as_deref().map(|s| SavedScope {
                        namespace: s.namespace.clone(),
                        name: s.name.clone(),
                        uid: s.uid.clone(),
                        annotations: s.annotations.clone(),
                        token_sha256: s.token_sha256,
                    }),
                    auth,
                    fetched: wall - now.saturating_duration_since(e.fetched),
                    expires: wall + (expires - now),
                });
            }
        }
        out
    }

    /// Puts saved answers back into their providers' caches, each only if its provider
    /// exists with the same identity and it has not expired. Runs no plugin.
    pub fn restore(&self, entries: Vec<SavedEntry>) -> Restored {
        let (now, wall) = (self.clock().now(), self.clock().wall());
        let mut report = Restored::default();
        let mut drop = |why: Unrestored| *report.dropped.entry(why).or_default() += 1;
        let mut restored = 0;
        for s in entries {
            let Some(p) = self.providers().iter().find(|p| p.spec.name == s.provider) else {
                drop(Unrestored::ProviderGone);
                continue;
            };
            if p.identity != s.provider_identity {
                drop(Unrestored::ConfigChanged);
                continue;
            }
            let Ok(left) = s.expires.duration_since(wall) else {
                drop(Unrestored::Expired);
                continue;
            };
            if left.is_zero() || s.auth.is_empty() {
                drop(if left.is_zero() {
                    Unrestored::Expired
                } else {
                    Unrestored::Invalid
                });
                continue;
            }
            let age = wall.duration_since(s.fetched).unwrap_or(Duration::ZERO);
            let (auth, invalid) = AuthSet::new(s.auth.into_iter().map(|a| {
                (
                    a.key,
                    AuthConfig {
                        username: a.username,
                        password: SecretString::from(a.password.expose_secret().to_owned()),
                    },
                )
            }));
            if !invalid.is_empty() || auth.is_empty() {
                drop(Unrestored::Invalid);
                continue;
            }
            let entry = Entry {
                auth,
                key_type: s.key_type,
                image: s.image.into(),
                registry: s.registry.into(),
                scope: s.scope.map(|s| {
                    Arc::new(Scope {
                        namespace: s.namespace,
                        name: s.name,
                        uid: s.uid,
                        annotations: s.annotations,
                        token_sha256: s.token_sha256,
                    })
                }),
                expires: Some(now + left),
                expires_wall: Some(s.expires),
                fetched: now.checked_sub(age).unwrap_or(now),
            };
            let n = p.cache.insert(Arc::new(entry), now);
            p.metrics.entries.set(i64::try_from(n).unwrap_or(i64::MAX));
            restored += 1;
        }
        report.restored = restored;
        self.generation_counter().fetch_add(1, Ordering::Release);
        report
    }
}
