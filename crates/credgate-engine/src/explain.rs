//! Why a lookup gives what it gives: each source in try-order, whether it applies to the image
//! and why not (the pattern that matched, or the closest one and how it missed), and for each
//! provider that applies what its cache holds, its last run and its backoff. Runs no plugin.

use std::time::{Duration, Instant, SystemTime};

use credgate_core::keyring;
use credgate_core::pattern::{Mismatch, Pattern, Target};
use credgate_core::wire::CacheKeyType;

use crate::engine::{Engine, LookupError, LookupRequest, SourceKind, StaticSource};
use crate::provider::{Mode, Provider, ProviderStatus, ServiceAccount};

/// A provider's cached answer for the image.
#[derive(Debug, Clone)]
pub struct CachedView {
    pub key_type: CacheKeyType,
    pub expires: Option<SystemTime>,
    pub age: Duration,
    pub credentials: usize,
}

/// What a provider that applies would do now.
#[derive(Debug, Clone)]
pub struct ProviderView {
    pub cached: Option<CachedView>,
    pub status: ProviderStatus,
    pub backoff_until: Option<SystemTime>,
    /// It needs a service account (`tokenAttributes.requireServiceAccount`) and none was given:
    /// it is not run.
    pub skipped_without_service_account: bool,
}

/// One source of the lookup.
#[derive(Debug, Clone)]
pub struct ExplainedSource {
    pub kind: SourceKind,
    pub name: String,
    pub matched: bool,
    /// The pattern (or docker config key) that matched, or the closest one that did not.
    pub pattern: Option<String>,
    /// Why the closest pattern did not match.
    pub why_not: Option<String>,
    /// How close that pattern came (the higher, the closer: a port or path miss beats any
    /// host miss); 0 when it matched or there is none.
    pub closeness: usize,
    /// For a provider that applies.
    pub provider: Option<ProviderView>,
}

/// The engine's view of a lookup.
#[derive(Debug, Clone)]
pub struct Explanation {
    /// The normalized image name: the repository, without tag or digest (or the registry host
    /// of a host lookup).
    pub image: String,
    pub sources: Vec<ExplainedSource>,
}

fn closest<'a>(
    patterns: impl IntoIterator<Item = &'a Pattern>,
    target: &Target<'_>,
) -> (bool, Option<String>, Option<Mismatch>) {
    let mut best: Option<(&Pattern, Mismatch)> = None;
    for p in patterns {
        match p.mismatch(target) {
            None => return (true, Some(p.as_str().to_owned()), None),
            Some(m) => {
                if best
                    .as_ref()
                    .is_none_or(|(_, b)| m.closeness() > b.closeness())
                {
                    best = Some((p, m));
                }
            }
        }
    }
    match best {
        Some((p, m)) => (false, Some(p.as_str().to_owned()), Some(m)),
        None => (false, None, None),
    }
}

impl Engine {
    /// Explains a lookup of `req.image` (an image, with an optional service account).
    pub fn explain(&self, req: &LookupRequest<'_>) -> Result<Explanation, LookupError> {
        let parts;
        let image;
        let (name, registry, target, default_registry) = if req.registry_host {
            parts = credgate_core::pattern::parse_schemeless(req.image)
                .map_err(|_| LookupError::InvalidHost(req.image.to_owned()))?;
            let default = matches!(
                req.image,
                "docker.io" | "index.docker.io" | "registry-1.docker.io"
            );
            (req.image, req.image, Target::from_parts(&parts), default)
        } else {
            image = credgate_core::reference::ImageRef::parse(req.image)?;
            let name = image.name();
            (
                name,
                image.registry(),
                Target::from_image_name(name),
                credgate_core::reference::is_default_registry(name),
            )
        };
        let (now, wall) = (self.clock().now(), self.clock().wall());
        let mut sources = Vec::new();
        for s in self.statics() {
            sources.push(docker_config_source(s, &target, default_registry));
        }
        for p in self.providers() {
            let cached_for = (name, registry);
            sources.push(provider_source(
                p,
                req.service_account,
                &target,
                cached_for,
                now,
                wall,
            ));
        }
        Ok(Explanation {
            image: name.to_owned(),
            sources,
        })
    }
}

/// A docker config: the key that matches the target, or the closest that does not.
fn docker_config_source(
    s: &StaticSource,
    target: &Target,
    default_registry: bool,
) -> ExplainedSource {
    let picked = keyring::select_target(target, default_registry, &[(0usize, &s.auth)]);
    let (matched, pattern, why) = match picked.first() {
        Some((_, auth)) => (true, Some(auth.key().to_owned()), None),
        None => {
            let keys: Vec<Pattern> = (0..s.auth.len())
                .filter_map(|i| s.auth.get(i))
                .filter_map(|a| Pattern::parse(a.key()).ok())
                .collect();
            closest(&keys, target)
        }
    };
    ExplainedSource {
        kind: SourceKind::DockerConfig,
        name: s.name.clone(),
        matched,
        pattern,
        closeness: why.as_ref().map_or(0, Mismatch::closeness),
        why_not: why.map(|m| m.to_string()),
        provider: None,
    }
}

/// A provider: its pattern that matches (or the closest), and if one matches, its cached
/// answer for `(name, registry)` and its state.
fn provider_source(
    p: &Provider,
    service_account: Option<&ServiceAccount>,
    target: &Target,
    (name, registry): (&str, &str),
    now: Instant,
    wall: SystemTime,
) -> ExplainedSource {
    let (matched, pattern, why) = closest(&p.spec.match_images, target);
    let provider = matched.then(|| {
        let mode = p.mode(service_account);
        let skipped = matches!(mode, Ok(Mode::Skip));
        let scope = mode.ok().and_then(|m| m.scope().cloned());
        let cached = p
            .cached(name, registry, scope.as_deref(), now)
            .map(|e| CachedView {
                key_type: e.key_type,
                expires: e.expires.map(|x| wall + (x - now)),
                age: now.saturating_duration_since(e.fetched),
                credentials: e.auth.len(),
            });
        ProviderView {
            cached,
            status: p.status(),
            backoff_until: p.backoff_until(),
            skipped_without_service_account: skipped,
        }
    });
    ExplainedSource {
        kind: SourceKind::Provider,
        name: p.spec.name.clone(),
        matched,
        pattern,
        closeness: why.as_ref().map_or(0, Mismatch::closeness),
        why_not: why.map(|m| m.to_string()),
        provider,
    }
}

fn rounded(d: Duration) -> credgate_core::duration::Rounded {
    credgate_core::duration::Rounded(d)
}

impl Explanation {
    /// A short reason per source for a lookup that found nothing: what was tried, and why each
    /// gave nothing.
    pub fn reasons(&self) -> Vec<String> {
        if self.sources.is_empty() {
            return vec!["no docker config and no provider config".into()];
        }
        self.sources
            .iter()
            .map(|s| {
                let what = match s.kind {
                    SourceKind::Provider => format!("provider {}", s.name),
                    SourceKind::DockerConfig => format!("docker config {}", s.name),
                };
                match (&s.provider, s.matched) {
                    (Some(v), true) if v.skipped_without_service_account => {
                        format!("{what} needs a service account")
                    }
                    (_, true) => format!(
                        "{what} matched ({}) and gave no credential for {}",
                        s.pattern.as_deref().unwrap_or("-"),
                        self.image
                    ),
                    (_, false) => match (&s.pattern, &s.why_not) {
                        (Some(p), Some(w)) => format!("{what}: {p} does not match ({w})"),
                        _ => format!("{what}: nothing matches"),
                    },
                }
            })
            .collect()
    }

    /// Of [`Explanation::reasons`], those of the sources that matched and gave nothing.
    pub fn matched_reasons(&self) -> Vec<String> {
        self.reasons()
            .into_iter()
            .zip(&self.sources)
            .filter(|(_, s)| s.matched)
            .map(|(r, _)| r)
            .collect()
    }

    /// One line: what a puller would get, or why it would get nothing.
    pub fn verdict(&self, now: SystemTime) -> String {
        let configs = self
            .sources
            .iter()
            .filter(|s| s.kind == SourceKind::DockerConfig && s.matched)
            .count();
        let mut parts = Vec::new();
        if configs > 0 {
            parts.push(format!("{configs} docker config(s) match"));
        }
        for s in self
            .sources
            .iter()
            .filter(|s| s.kind == SourceKind::Provider && s.matched)
        {
            let Some(v) = &s.provider else { continue };
            parts.push(provider_verdict(&s.name, v, now));
        }
        if !parts.is_empty() {
            return format!("{}: {}", self.image, parts.join("; "));
        }
        let registry = self.image.split('/').next().unwrap_or(&self.image);
        // The nearest miss (a port or a path before any host), not the first in config order.
        let closest = self
            .sources
            .iter()
            .filter(|s| s.kind == SourceKind::Provider && s.why_not.is_some())
            .rev()
            .max_by_key(|s| s.closeness);
        match closest {
            Some(s) => format!(
                "no credential source matches {registry}: provider {}'s pattern {} does not match ({})",
                s.name,
                s.pattern.as_deref().unwrap_or("-"),
                s.why_not.as_deref().unwrap_or("-")
            ),
            None if self.sources.is_empty() => {
                format!("no credential source at all: {registry} is pulled anonymously")
            }
            None => format!(
                "no credential source matches {registry}: it is pulled anonymously"
            ),
        }
    }
}

/// What a provider that matches would give: its cached credentials, or why nothing.
fn provider_verdict(name: &str, v: &ProviderView, now: SystemTime) -> String {
    if v.skipped_without_service_account {
        format!(
            "provider {} needs a service account and none was given",
            name
        )
    } else if v.cached.as_ref().is_some_and(|c| c.credentials == 0) {
        format!(
            "provider {} answered no credential: the pull goes anonymous",
            name
        )
    } else if let Some(c) = &v.cached {
        let left = c
            .expires
            .and_then(|e| e.duration_since(now).ok())
            .map(|d| format!(", valid {}", rounded(d)))
            .unwrap_or_default();
        format!(
            "{} credential(s) from provider {} (cached{left})",
            c.credentials, name
        )
    } else if let Some(until) = v.backoff_until {
        let left = until.duration_since(now).unwrap_or_default();
        format!(
            "provider {} is backing off for {} after {} failures: {}",
            name,
            rounded(left),
            v.status.consecutive_failures,
            v.status.last_error.as_deref().unwrap_or("-")
        )
    } else if let Some(e) = v
        .status
        .last_error
        .as_deref()
        .filter(|_| v.status.consecutive_failures > 0)
    {
        format!(
            "provider {} would run its plugin again; its last run failed: {e} (the plugin's stderr is in the agent's log at debug level)",
            name
        )
    } else if let Some((at, why)) = &v.status.last_dropped {
        let ago = now.duration_since(*at).unwrap_or_default();
        format!(
            "provider {} would run its plugin: its cached answer was dropped {} ago, {why}",
            name,
            rounded(ago)
        )
    } else {
        format!("provider {} would run its plugin (nothing cached)", name)
    }
}
