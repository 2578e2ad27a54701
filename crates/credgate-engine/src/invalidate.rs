//! Cached answers dropped before their expiry: the registry refused a credential one holds
//! ([`Engine::refuse`]), or an operator flushed them ([`Engine::flush`]). A dropped answer is
//! gone from the provider's cache and from every remembered resolution at once; the next
//! lookup it would have answered runs the plugin again, coalesced with the others and under
//! the provider's backoff and rate, as any miss.

use std::time::SystemTime;

use credgate_core::keyring;
use credgate_core::pattern::Target;
use credgate_core::reference::ImageRef;
use credgate_core::wire::CacheKeyType;

use crate::cache::Entry;
use crate::engine::{Engine, LookupError, Source};

/// One cached answer that was dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    pub provider: String,
    pub key_type: CacheKeyType,
    /// The key's name: the image, the registry, or empty for `Global`.
    pub key: String,
    /// When it would have expired.
    pub expires: Option<SystemTime>,
    /// Whether it was keyed by a service account (KEP-4412).
    pub scoped: bool,
}

impl Dropped {
    fn of(provider: &str, e: &Entry) -> Dropped {
        let key = match e.key_type {
            CacheKeyType::Image => e.image.to_string(),
            CacheKeyType::Registry => e.registry.to_string(),
            CacheKeyType::Global => String::new(),
        };
        Dropped {
            provider: provider.to_owned(),
            key_type: e.key_type,
            key,
            expires: e.expires_wall,
            scoped: e.scope.is_some(),
        }
    }
}

/// Why a flush was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlushError {
    #[error("no provider {} in the config", credgate_core::text::Quoted(.0))]
    UnknownProvider(String),
    #[error(transparent)]
    Lookup(#[from] LookupError),
}

impl Engine {
    /// Which of the engine's sources give the credential `username`:`password` for `image`
    /// now, in try-order: docker config entries that match the image, providers' live cached
    /// answers for it. Empty for any other credential (a pod's own pull secret). Runs no
    /// plugin.
    pub fn given_by(&self, image: &str, username: &str, password: &str) -> Vec<Source> {
        use secrecy::ExposeSecret;
        let Ok(parsed) = ImageRef::parse(image) else {
            return Vec::new();
        };
        let name = parsed.name();
        let target = Target::from_image_name(name);
        let default_registry = credgate_core::reference::is_default_registry(name);
        let mut out = Vec::new();
        for s in self.statics() {
            let picked = keyring::select_target(&target, default_registry, &[(0usize, &s.auth)]);
            if picked.iter().any(|(_, a)| {
                a.auth.username == username && a.auth.password.expose_secret() == password
            }) {
                out.push(Source::DockerConfig(s.name.clone()));
            }
        }
        let mut providers: Vec<&str> = self
            .answers_holding(&parsed, username, password)
            .into_iter()
            .map(|(provider, _)| provider)
            .collect();
        // A provider's answers come together: one source each.
        providers.dedup();
        out.extend(
            providers
                .into_iter()
                .map(|p| Source::Provider(p.to_owned())),
        );
        out
    }

    /// Providers' live cached answers for `image` that hold `username`:`password`, as (the
    /// provider, the answer's service-account scope when it is keyed by one), in the
    /// providers' order.
    fn answers_holding(
        &self,
        image: &ImageRef,
        username: &str,
        password: &str,
    ) -> Vec<(&str, Option<std::sync::Arc<crate::cache::Scope>>)> {
        let (name, registry) = (image.name(), image.registry());
        let target = Target::from_image_name(name);
        let now = self.clock().now();
        let mut out = Vec::new();
        for p in self.providers().iter().filter(|p| p.applies(&target)) {
            for e in p.cache.load().entries() {
                if e.alive_at(now) && e.covers_image(name, registry) && e.holds(username, password)
                {
                    out.push((p.spec.name.as_str(), e.scope.clone()));
                }
            }
        }
        out
    }

    /// The service accounts (namespace, name, uid) that providers' live cached answers gave
    /// `username`:`password` for `image` (KEP-4412 providers, answers keyed by service
    /// account), without repeats. Runs no plugin.
    pub fn service_accounts_given(
        &self,
        image: &str,
        username: &str,
        password: &str,
    ) -> Vec<(String, String, String)> {
        let Ok(parsed) = ImageRef::parse(image) else {
            return Vec::new();
        };
        let mut out: Vec<(String, String, String)> = Vec::new();
        for (_, scope) in self.answers_holding(&parsed, username, password) {
            let Some(scope) = scope else {
                continue;
            };
            let sa = (
                scope.namespace.clone(),
                scope.name.clone(),
                scope.uid.clone(),
            );
            if !out.contains(&sa) {
                out.push(sa);
            }
        }
        out
    }

    /// Drops provider `provider`'s cached answers for `image` that hold the credential
    /// `username`:`password`, which the registry refused; `why` is what `ctl status` and
    /// `explain` say. Nothing when the provider has no such answer (it was dropped already,
    /// or the credential is not this provider's).
    pub fn refuse(
        &self,
        provider: &str,
        image: &str,
        username: &str,
        password: &str,
        why: &str,
    ) -> Result<Vec<Dropped>, LookupError> {
        let parsed = ImageRef::parse(image)?;
        let (name, registry) = (parsed.name(), parsed.registry());
        let Some(p) = self.providers().iter().find(|p| p.spec.name == provider) else {
            return Ok(Vec::new());
        };
        let removed = p.drop_entries(
            |e| e.covers_image(name, registry) && e.holds(username, password),
            why,
        );
        p.remember_refused(registry, username, password);
        Ok(removed.iter().map(|e| Dropped::of(provider, e)).collect())
    }

    /// Since when provider `provider`, asked again after a registry refused its credential,
    /// still answers that credential (its answers are then kept seconds, not their
    /// cacheDuration); `None` when it does not.
    pub fn answers_refused_since(&self, provider: &str) -> Option<SystemTime> {
        self.providers()
            .iter()
            .find(|p| p.spec.name == provider)
            .and_then(|p| p.answers_refused_since())
    }

    /// Drops cached answers: of provider `provider` (every provider when `None`), those that
    /// answer one of `images` (all when empty), whatever their service account scope.
    pub fn flush(
        &self,
        provider: Option<&str>,
        images: &[String],
        why: &str,
    ) -> Result<Vec<Dropped>, FlushError> {
        if let Some(name) = provider.filter(|n| !self.has_provider(n)) {
            return Err(FlushError::UnknownProvider(name.to_owned()));
        }
        let mut targets = Vec::with_capacity(images.len());
        for image in images {
            let parsed = ImageRef::parse(image).map_err(LookupError::from)?;
            targets.push((parsed.name().to_owned(), parsed.registry().to_owned()));
        }
        let mut out = Vec::new();
        for p in self.providers() {
            if provider.is_some_and(|only| only != p.spec.name) {
                continue;
            }
            let removed = p.drop_entries(
                |e| targets.is_empty() || targets.iter().any(|(n, r)| e.covers_image(n, r)),
                why,
            );
            out.extend(removed.iter().map(|e| Dropped::of(&p.spec.name, e)));
        }
        Ok(out)
    }
}
