//! One configured provider at run time: its cache, its pending plugin runs and how concurrent
//! misses join them, its failure backoff and its status.
//!
//! Coalescing: a miss first joins a pending run for the same image (that run answers it
//! whatever its key type). Otherwise, unless the provider's last answer was `Image`-keyed, it
//! waits once for a pending run that would cover it if the answer is `Registry`- or
//! `Global`-keyed (same registry first, then any); if the answer does not cover it, it starts
//! its own run. So a burst behind a `Registry` or `Global` plugin costs one run, and no request
//! waits longer than two runs.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use credgate_core::config::{ProviderSpec, TokenCacheType};
use credgate_core::keyring::AuthSet;
use credgate_core::pattern::Target;
use credgate_core::wire::{self, CacheKeyType};
use secrecy::{ExposeSecret, SecretString};
use sha2::{Digest, Sha256};
use tokio::sync::{watch, Semaphore};

use crate::cache::{Cache, Entry, Scope};
use crate::clock::Clock;
use crate::error::ProviderError;
use crate::exec::{PluginCommand, PluginRunner, RunError};
use crate::metrics::ProviderMetrics;

/// The result every waiter of a run receives.
pub type RunResult = Result<Arc<Entry>, ProviderError>;

/// A provider's identity: everything of its config entry and plugin binary that could change
/// its answers (name, patterns, cache duration, wire version, args, env, token attributes, the
/// plugin's path, size, modification and change times, inode and device).
pub(crate) fn identity(spec: &ProviderSpec, plugin: &std::path::Path) -> String {
    let mut h = Sha256::new();
    let mut put = |part: &[u8]| {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    };
    put(spec.name.as_bytes());
    for p in &spec.match_images {
        put(p.as_str().as_bytes());
    }
    put(&spec.default_cache_duration.as_nanos().to_be_bytes());
    put(format!("{:?}", spec.api_version).as_bytes());
    for a in &spec.args {
        put(a.as_bytes());
    }
    for (k, v) in &spec.env {
        put(k.as_bytes());
        put(v.as_bytes());
    }
    put(format!("{:?}", spec.token_attributes).as_bytes());
    put(plugin.as_os_str().as_encoded_bytes());
    if let Ok(meta) = std::fs::metadata(plugin) {
        use std::os::unix::fs::MetadataExt;
        put(&meta.len().to_be_bytes());
        put(&meta.mtime().to_be_bytes());
        put(&meta.mtime_nsec().to_be_bytes());
        // A plugin rewritten in place with its size and mtime set back still changes its
        // ctime, which no one can set.
        put(&meta.ctime().to_be_bytes());
        put(&meta.ctime_nsec().to_be_bytes());
        put(&meta.ino().to_be_bytes());
        put(&meta.dev().to_be_bytes());
    }
    format!("sha256:{}", hex::encode(h.finalize()))
}

/// A pod's service account, for providers with `tokenAttributes` (KEP-4412).
#[derive(Clone)]
pub struct ServiceAccount {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// A token for the provider's audience, minted by the caller.
    pub token: SecretString,
    pub annotations: BTreeMap<String, String>,
}

impl std::fmt::Debug for ServiceAccount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceAccount")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("uid", &self.uid)
            .field("token", &"<redacted>")
            .field("annotations", &self.annotations)
            .finish()
    }
}

/// How failures slow down the next run.
#[derive(Debug, Clone, Copy)]
pub struct BackoffPolicy {
    /// The wait after the second consecutive failure; it doubles with each further one.
    pub base: Duration,
    pub max: Duration,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy {
            base: Duration::from_millis(500),
            max: Duration::from_secs(30),
        }
    }
}

/// What operators see of a provider.
#[derive(Debug, Clone, Default)]
pub struct ProviderStatus {
    pub name: String,
    pub runs: u64,
    /// Failed lookups, refusals during backoff excluded.
    pub errors: u64,
    /// Lookups refused without a run during backoff.
    pub refused_in_backoff: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub cache_entries: usize,
    pub last_run: Option<SystemTime>,
    pub last_success: Option<SystemTime>,
    pub last_error: Option<String>,
    pub consecutive_failures: u32,
    /// When cached answers were last dropped before their expiry, and why (the registry
    /// refused a credential of them, or an operator flushed them).
    pub last_dropped: Option<(SystemTime, String)>,
    /// Since when the plugin, asked again after a registry refused its credential, still
    /// answers that credential.
    pub answers_refused_since: Option<SystemTime>,
}

/// Credentials of a provider's answers a registry refused, remembered so that the plugin's
/// next answers can be told apart (at most this many).
const REFUSED_REMEMBERED: usize = 8;
/// How long a refused credential is remembered by its provider.
const REFUSED_MEMORY: Duration = Duration::from_secs(3600);
/// An answer that holds a refused credential is kept this long at first, doubling with each
/// such answer in a row up to [`FOLLOW_MAX`]: the plugin is asked again in seconds, so a
/// backend that learns the new credential after the registry is followed within a few
/// seconds, without a run per lookup.
pub const FOLLOW_FIRST: Duration = Duration::from_secs(1);
pub const FOLLOW_MAX: Duration = Duration::from_secs(4);
/// The longest an answer keyed `Global` (it serves every registry) is kept when it holds a
/// credential some registry refused: one registry's refusal, which may be a hostile
/// registry's (decision 0025), costs the others at most a plugin run a minute, never answers
/// of seconds. An answer for another registry's images keeps its own duration.
pub const FOLLOW_SHARED: Duration = Duration::from_secs(60);

#[derive(Default)]
struct RunState {
    consecutive_failures: u32,
    next_allowed: Option<Instant>,
    last_run: Option<SystemTime>,
    last_success: Option<SystemTime>,
    last_error: Option<String>,
    last_dropped: Option<(SystemTime, String)>,
    /// Refused credentials: the registry that refused it, user name, password, remembered
    /// until.
    refused: Vec<(String, String, SecretString, Instant)>,
    /// Answers holding a refused credential in a row, and since when.
    answering_refused: Option<(u32, SystemTime)>,
}

/// A run driven by the request that started it, so that a miss costs no hand-off to another
/// task. Dropped before the run ends (its request was cancelled), it hands the rest of the run
/// to a task of the current runtime, so the run still completes for its other waiters and the
/// cache. Outside a runtime, or when the run itself panicked, the rest is dropped: the plugin
/// is killed and waiters see the run abandoned.
struct Lead(Option<Pin<Box<dyn Future<Output = RunResult> + Send>>>);

impl Future for Lead {
    type Output = RunResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<RunResult> {
        let run = self
            .0
            .as_mut()
            .expect("a lead is not polled after it completed");
        let result = std::task::ready!(run.as_mut().poll(cx));
        self.0 = None;
        Poll::Ready(result)
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        let Some(rest) = self.0.take() else { return };
        // A future that panicked while polled must not be polled again.
        if std::thread::panicking() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(rest);
        }
    }
}

struct Pending {
    image: Arc<str>,
    registry: Arc<str>,
    scope: Option<Arc<Scope>>,
    rx: watch::Receiver<Option<RunResult>>,
}

#[derive(Default)]
struct Inflight {
    pending: Vec<Arc<Pending>>,
    /// The key type of the provider's last answer.
    hint: Option<CacheKeyType>,
}

impl Inflight {
    fn exact(&self, ask: &Ask<'_>) -> Option<Arc<Pending>> {
        self.pending
            .iter()
            .find(|p| p.scope == ask.scope && *p.image == *ask.image)
            .cloned()
    }

    fn cover(&self, ask: &Ask<'_>) -> Option<Arc<Pending>> {
        let same_scope = |p: &&Arc<Pending>| p.scope == ask.scope;
        let same_registry = |p: &&Arc<Pending>| same_scope(p) && *p.registry == *ask.registry;
        let found = match self.hint {
            Some(CacheKeyType::Image) => None,
            Some(CacheKeyType::Registry) => self.pending.iter().find(same_registry),
            Some(CacheKeyType::Global) => self.pending.iter().find(same_scope),
            None => self
                .pending
                .iter()
                .find(same_registry)
                .or_else(|| self.pending.iter().find(same_scope)),
        };
        found.cloned()
    }
}

/// How a provider takes part in one lookup.
pub enum Mode {
    /// No service account involved.
    Plain,
    /// Keyed and run with a service account.
    Scoped {
        scope: Arc<Scope>,
        token: SecretString,
        annotations: BTreeMap<String, String>,
    },
    /// Requires a service account and has none: not run.
    Skip,
}

impl Mode {
    pub fn scope(&self) -> Option<&Arc<Scope>> {
        match self {
            Mode::Scoped { scope, .. } => Some(scope),
            _ => None,
        }
    }
}

/// One request for a provider's credentials.
pub struct Ask<'a> {
    pub image: &'a str,
    pub registry: &'a str,
    pub scope: Option<Arc<Scope>>,
    pub mode: &'a Mode,
    pub fresh_until: Instant,
    /// Who asks, for the provider's rate limit.
    pub caller: crate::rate::Caller,
}

enum Join {
    Exact,
    Speculative,
}

/// A provider at run time.
pub struct Provider {
    pub spec: ProviderSpec,
    pub identity: String,
    rate: Option<crate::rate::Bucket>,
    command: PluginCommand,
    pub cache: Cache,
    inflight: Mutex<Inflight>,
    state: Mutex<RunState>,
    pub metrics: ProviderMetrics,
    runner: Arc<dyn PluginRunner>,
    clock: Arc<dyn Clock>,
    backoff: BackoffPolicy,
    /// Answers are kept at least this long, whatever their `cacheDuration` says.
    min_cache: Duration,
    generation: Arc<AtomicU64>,
    /// Runs of this provider at once.
    slots: Arc<Semaphore>,
    /// Runs of all providers at once.
    global_slots: Arc<Semaphore>,
}

/// What a provider is built from.
pub struct ProviderParts {
    pub spec: ProviderSpec,
    /// What decides whether a saved answer of this provider may be served again.
    pub identity: String,
    /// The most runs a second, when limited.
    pub rate: Option<crate::rate::PluginRate>,
    pub command: PluginCommand,
    pub cache_capacity: usize,
    pub metrics: ProviderMetrics,
    pub runner: Arc<dyn PluginRunner>,
    pub clock: Arc<dyn Clock>,
    pub backoff: BackoffPolicy,
    /// Exec-storm protection: answers are kept at least this long (zero: as they say).
    pub min_cache: Duration,
    /// Bumped after every cache write, so remembered resolutions are recomputed.
    pub generation: Arc<AtomicU64>,
    /// How many runs of this provider may be in flight at once.
    pub max_runs: usize,
    /// Shared by every provider of an engine: runs in flight in all.
    pub global_slots: Arc<Semaphore>,
}

impl Provider {
    pub fn new(parts: ProviderParts) -> Self {
        Provider {
            spec: parts.spec,
            identity: parts.identity,
            rate: parts.rate.map(crate::rate::Bucket::new),
            command: parts.command,
            cache: Cache::new(parts.cache_capacity),
            inflight: Mutex::default(),
            state: Mutex::default(),
            metrics: parts.metrics,
            runner: parts.runner,
            clock: parts.clock,
            backoff: parts.backoff,
            min_cache: parts.min_cache,
            generation: parts.generation,
            slots: Arc::new(Semaphore::new(parts.max_runs.max(1))),
            global_slots: parts.global_slots,
        }
    }

    /// Whether any `matchImages` pattern matches the image.
    pub fn applies(&self, target: &Target<'_>) -> bool {
        self.spec.match_images.iter().any(|p| p.matches(target))
    }

    /// A live cache entry for the request, if any; lock-free.
    pub fn cached(
        &self,
        image: &str,
        registry: &str,
        scope: Option<&Scope>,
        fresh_until: Instant,
    ) -> Option<Arc<Entry>> {
        self.cache
            .load()
            .find(image, registry, scope, fresh_until)
            .cloned()
    }

    /// How this provider takes part given the caller's service account.
    pub fn mode(&self, sa: Option<&ServiceAccount>) -> Result<Mode, ProviderError> {
        let Some(ta) = &self.spec.token_attributes else {
            return Ok(Mode::Plain);
        };
        let Some(sa) = sa else {
            return Ok(if ta.require_service_account {
                Mode::Skip
            } else {
                Mode::Plain
            });
        };
        let mut annotations = BTreeMap::new();
        for key in &ta.required_annotation_keys {
            let value =
                sa.annotations
                    .get(key)
                    .ok_or_else(|| ProviderError::MissingAnnotation {
                        plugin: self.spec.name.clone(),
                        key: key.clone(),
                    })?;
            annotations.insert(key.clone(), value.clone());
        }
        for key in &ta.optional_annotation_keys {
            if let Some(value) = sa.annotations.get(key) {
                annotations.insert(key.clone(), value.clone());
            }
        }
        let token_sha256 = (ta.cache_type == TokenCacheType::Token)
            .then(|| Sha256::digest(sa.token.expose_secret().as_bytes()).into());
        let scope = Scope {
            namespace: sa.namespace.clone(),
            name: sa.name.clone(),
            uid: sa.uid.clone(),
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            token_sha256,
        };
        Ok(Mode::Scoped {
            scope: Arc::new(scope),
            token: sa.token.clone(),
            annotations,
        })
    }

    /// Credentials for a cache miss: joins a pending run that covers the request or starts
    /// one.
    pub async fn get(self: &Arc<Self>, ask: Ask<'_>) -> RunResult {
        let mut speculated = false;
        let mut counted = false;
        loop {
            let (pending, join, lead) = {
                let mut inflight = self.inflight.lock();
                let snapshot = self.cache.load();
                if let Some(e) = snapshot.find(
                    ask.image,
                    ask.registry,
                    ask.scope.as_deref(),
                    ask.fresh_until,
                ) {
                    self.metrics.hits.inc();
                    return Ok(e.clone());
                }
                if !counted {
                    self.metrics.misses.inc();
                    counted = true;
                }
                if let Some(p) = inflight.exact(&ask) {
                    (p, Join::Exact, None)
                } else if let Some(p) = (!speculated).then(|| inflight.cover(&ask)).flatten() {
                    (p, Join::Speculative, None)
                } else {
                    self.check_backoff()?;
                    let (p, lead) = self.start(&ask, &mut inflight);
                    (p, Join::Exact, Some(lead))
                }
            };
            let result = match lead {
                Some(lead) => lead.await,
                None => self.wait(&pending).await,
            };
            match (join, result) {
                (Join::Speculative, Ok(e))
                    if !e.covers(ask.image, ask.registry, ask.scope.as_deref()) =>
                {
                    speculated = true;
                }
                (_, r) => return r,
            }
        }
    }

    async fn wait(&self, pending: &Pending) -> RunResult {
        let mut rx = pending.rx.clone();
        let abandoned = || ProviderError::Abandoned {
            plugin: self.spec.name.clone(),
        };
        let value = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| abandoned())?;
        value.clone().ok_or_else(abandoned)?
    }

    fn check_backoff(&self) -> Result<(), ProviderError> {
        let state = self.state.lock();
        let now = self.clock.now();
        match state.next_allowed {
            Some(t) if now < t => {
                self.metrics.error(crate::FailureReason::Backoff);
                Err(ProviderError::Backoff {
                    plugin: self.spec.name.clone(),
                    failures: state.consecutive_failures,
                    retry_in: t - now,
                    last_error: state.last_error.clone().unwrap_or_default(),
                })
            }
            _ => Ok(()),
        }
    }

    /// Registers a pending run, which the caller drives; the run completes even if every
    /// waiter goes away (see [`Lead`]).
    fn start(self: &Arc<Self>, ask: &Ask<'_>, inflight: &mut Inflight) -> (Arc<Pending>, Lead) {
        let (tx, rx) = watch::channel(None);
        let pending = Arc::new(Pending {
            image: ask.image.into(),
            registry: ask.registry.into(),
            scope: ask.scope.clone(),
            rx,
        });
        inflight.pending.push(pending.clone());
        let (token, annotations) = match ask.mode {
            Mode::Scoped {
                token, annotations, ..
            } => (Some(token.clone()), Some(annotations.clone())),
            _ => (None, None),
        };
        let request = wire::Request {
            api_version: self.spec.api_version,
            image: ask.image,
            service_account_token: token.as_ref(),
            service_account_annotations: annotations.as_ref(),
        }
        .encode();
        let this = self.clone();
        let job = pending.clone();
        let caller = ask.caller;
        let run = async move {
            let result = this.run(&job, request, token, caller).await;
            if let Ok(entry) = &result {
                let n = this.cache.insert(entry.clone(), this.clock.now());
                this.generation.fetch_add(1, Ordering::Release);
                this.metrics
                    .entries
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            {
                let mut inflight = this.inflight.lock();
                inflight.pending.retain(|p| !Arc::ptr_eq(p, &job));
                if let Ok(entry) = &result {
                    inflight.hint = Some(entry.key_type);
                }
            }
            let _ = tx.send(Some(result.clone()));
            result
        };
        (pending, Lead(Some(Box::pin(run))))
    }

    #[tracing::instrument(name = "plugin_run", skip_all, fields(plugin = %self.spec.name, image = %job.image))]
    async fn run(
        &self,
        job: &Pending,
        request: Vec<u8>,
        token: Option<SecretString>,
        caller: crate::rate::Caller,
    ) -> RunResult {
        // The provider's rate first, fairly between callers (a run waiting for its turn holds
        // no slot); a refusal is no failure of the plugin and starts no backoff.
        if let Some(rate) = &self.rate {
            match rate.take(caller).await {
                Ok(true) => {
                    self.metrics.delayed.inc();
                }
                Ok(false) => {}
                Err(refusal) => {
                    self.metrics.error(crate::FailureReason::RateLimited);
                    let why = match refusal {
                        crate::rate::Refusal::CallerWaiting(n) => format!(
                            "this caller already has {n} lookups waiting for the provider's turn"
                        ),
                        crate::rate::Refusal::TooLong(wait) => format!(
                            "this lookup's turn would come in {}, past the {} a lookup may wait",
                            credgate_core::duration::Rounded(wait),
                            credgate_core::duration::Rounded(crate::rate::MAX_WAIT)
                        ),
                    };
                    return Err(ProviderError::RateLimited {
                        plugin: self.spec.name.clone(),
                        per_second: rate.rate().per_second,
                        why,
                    });
                }
            }
        }
        // Bounded concurrency: a burst of distinct images behind an `Image`-keyed plugin, or
        // many providers at once, cannot fork without limit. Waiting for a slot is not part
        // of the plugin's timeout.
        let _slot = self.slots.acquire().await;
        let _global = self.global_slots.acquire().await;
        let started = Instant::now();
        self.metrics.runs.inc();
        self.state.lock().last_run = Some(self.clock.wall());
        // The answer is decoded as soon as it may be whole, while the plugin exits; that
        // decode counts if the output did not grow after it.
        let mut early: Option<(usize, RunResult)> = None;
        let mut decode_early = |stdout: &[u8]| {
            early = Some((stdout.len(), self.decode(job, stdout, token.as_ref())));
        };
        let output = self
            .runner
            .run_early(&self.command, request, &mut decode_early)
            .await;
        self.metrics
            .run_seconds
            .observe(started.elapsed().as_secs_f64());
        let result = output
            .map_err(|e| ProviderError::Run(Arc::new(e)))
            .and_then(|stdout| match early {
                Some((seen, decoded)) if seen == stdout.len() => decoded,
                _ => self.decode(job, &stdout, token.as_ref()),
            });
        self.record(&result);
        result
    }

    fn decode(&self, job: &Pending, stdout: &[u8], token: Option<&SecretString>) -> RunResult {
        let plugin = || self.spec.name.clone();
        let response = wire::decode_response(stdout, self.spec.api_version).map_err(|error| {
            ProviderError::Response {
                plugin: plugin(),
                error,
            }
        })?;
        let token_keyed = self
            .spec
            .token_attributes
            .as_ref()
            .is_some_and(|t| t.cache_type == TokenCacheType::Token);
        if let (Some(token), false) = (token, token_keyed) {
            let echoed = response
                .auth
                .iter()
                .any(|(_, a)| a.password.expose_secret() == token.expose_secret());
            if echoed {
                return Err(ProviderError::TokenEchoed { plugin: plugin() });
            }
        }
        let (auth, invalid) = AuthSet::new(response.auth);
        for bad in invalid {
            tracing::warn!(plugin = %self.spec.name, key = %bad.key, error = %bad.error, "auth key of plugin response ignored");
        }
        let ttl = response
            .cache_duration
            .unwrap_or(self.spec.default_cache_duration)
            .max(self.min_cache);
        let ttl = self
            .follow_refused(&auth, &job.registry, response.cache_key_type)
            .map_or(ttl, |short| short.min(ttl));
        let (now, wall) = (self.clock.now(), self.clock.wall());
        let cached = !ttl.is_zero();
        Ok(Arc::new(Entry {
            auth,
            key_type: response.cache_key_type,
            image: job.image.clone(),
            registry: job.registry.clone(),
            scope: job.scope.clone(),
            expires: cached.then(|| now + ttl),
            expires_wall: cached.then(|| wall + ttl),
            fetched: now,
        }))
    }

    fn record(&self, result: &RunResult) {
        let mut state = self.state.lock();
        match result {
            Ok(_) => {
                state.consecutive_failures = 0;
                state.next_allowed = None;
                state.last_success = Some(self.clock.wall());
            }
            Err(e) => {
                self.metrics.error(e.reason());
                tracing::warn!(plugin = %self.spec.name, error = %e, reason = e.reason().as_str(), "plugin run failed");
                if let ProviderError::Run(run) = e {
                    if let RunError::NonZeroExit { stderr, .. } = &**run {
                        if !stderr.is_empty() {
                            tracing::debug!(plugin = %self.spec.name, stderr = %stderr, "plugin stderr (tail)");
                        }
                    }
                }
                state.consecutive_failures += 1;
                state.last_error = Some(e.to_string());
                if state.consecutive_failures >= 2 {
                    let exp = (state.consecutive_failures - 2).min(16);
                    let delay = self
                        .backoff
                        .base
                        .saturating_mul(1 << exp)
                        .min(self.backoff.max);
                    state.next_allowed = Some(self.clock.now() + delay);
                }
            }
        }
    }

    /// Drops the cached answers `pick` chooses before their expiry, because of `why` (said
    /// by `ctl status` and `explain`); the next lookup they would have answered runs the
    /// plugin again (coalesced, under backoff and the provider's rate). The removed ones.
    pub fn drop_entries(&self, pick: impl Fn(&Entry) -> bool, why: &str) -> Vec<Arc<Entry>> {
        let removed = self.cache.remove(pick, self.clock.now());
        if !removed.is_empty() {
            self.generation.fetch_add(1, Ordering::Release);
            let left = self.cache.load().len();
            self.metrics
                .entries
                .set(i64::try_from(left).unwrap_or(i64::MAX));
            self.state.lock().last_dropped = Some((self.clock.wall(), why.to_owned()));
        }
        removed
    }

    /// Registry `registry` refused `username`:`password`, which an answer of this provider held:
    /// its next answers that hold it, for that registry's images, are kept seconds only
    /// ([`FOLLOW_FIRST`]); keyed `Global` (they serve every registry), a minute at most
    /// ([`FOLLOW_SHARED`]); for another registry's images, their whole duration.
    pub fn remember_refused(&self, registry: &str, username: &str, password: &str) {
        let now = self.clock.now();
        let mut state = self.state.lock();
        state.refused.retain(|(_, _, _, until)| now < *until);
        if state
            .refused
            .iter()
            .any(|(r, u, p, _)| r == registry && u == username && p.expose_secret() == password)
        {
            return;
        }
        if state.refused.len() >= REFUSED_REMEMBERED {
            state.refused.remove(0);
        }
        state.refused.push((
            registry.to_owned(),
            username.to_owned(),
            SecretString::from(password.to_owned()),
            now + REFUSED_MEMORY,
        ));
    }

    /// How long at most to keep an answer of `auth` fetched for an image of `registry` and
    /// keyed `key_type`, when it holds a credential a registry refused: keyed `Global`,
    /// [`FOLLOW_SHARED`]; else, if `registry` refused it, seconds (doubling per such answer in
    /// a row, up to [`FOLLOW_MAX`]), and if only others did, its own duration (`None`). `None`,
    /// and the provider no longer counts as answering a refused credential, when it holds none.
    fn follow_refused(
        &self,
        auth: &AuthSet,
        registry: &str,
        key_type: credgate_core::wire::CacheKeyType,
    ) -> Option<Duration> {
        let now = self.clock.now();
        let mut state = self.state.lock();
        state.refused.retain(|(_, _, _, until)| now < *until);
        let mut refused_here = false;
        let holds = (0..auth.len()).filter_map(|i| auth.get(i)).any(|a| {
            state.refused.iter().any(|(r, u, p, _)| {
                let same =
                    a.auth.username == *u && a.auth.password.expose_secret() == p.expose_secret();
                refused_here |= same && r == registry;
                same
            })
        });
        if !holds {
            if state.answering_refused.take().is_some() {
                tracing::info!(plugin = %self.spec.name, "the plugin answers a new credential again");
            }
            return None;
        }
        let global = key_type == credgate_core::wire::CacheKeyType::Global;
        if !refused_here && !global {
            // Another registry's refusal is not this one's: its answer keeps its duration.
            return None;
        }
        let wall = self.clock.wall();
        let (streak, _) = state.answering_refused.get_or_insert((0, wall));
        *streak += 1;
        if global {
            tracing::warn!(
                plugin = %self.spec.name,
                keep_seconds = FOLLOW_SHARED.as_secs(),
                "the plugin still answers a credential one registry refused: its answer for others is kept a minute at most"
            );
            return Some(FOLLOW_SHARED);
        }
        let keep = FOLLOW_FIRST
            .saturating_mul(1 << (*streak - 1).min(8))
            .min(FOLLOW_MAX);
        tracing::warn!(
            plugin = %self.spec.name,
            answers_in_a_row = *streak,
            keep_seconds = keep.as_secs(),
            "the plugin still answers the credential the registry refused: its answer is kept only seconds and the plugin is asked again"
        );
        Some(keep)
    }

    /// Since when the plugin, asked again after a refusal, still answers a refused credential.
    pub fn answers_refused_since(&self) -> Option<SystemTime> {
        self.state.lock().answering_refused.map(|(_, since)| since)
    }

    /// Until when the provider is backing off (a lookup now is refused without a run).
    pub fn backoff_until(&self) -> Option<SystemTime> {
        let state = self.state.lock();
        let now = self.clock.now();
        state
            .next_allowed
            .filter(|t| *t > now)
            .map(|t| self.clock.wall() + (t - now))
    }

    pub fn status(&self) -> ProviderStatus {
        let state = self.state.lock();
        ProviderStatus {
            name: self.spec.name.clone(),
            runs: self.metrics.runs.get(),
            errors: self.metrics.error_count(),
            refused_in_backoff: self.metrics.reason_count(crate::FailureReason::Backoff),
            cache_hits: self.metrics.hits.get(),
            cache_misses: self.metrics.misses.get(),
            cache_entries: self.cache.load().live(self.clock.now()),
            last_run: state.last_run,
            last_success: state.last_success,
            last_error: state.last_error.clone(),
            consecutive_failures: state.consecutive_failures,
            last_dropped: state.last_dropped.clone(),
            answers_refused_since: state.answering_refused.map(|(_, since)| since),
        }
    }
}
