//! The engine: every credential source of a node behind one lookup. Static sources (node-wide
//! docker config files) and the configured providers, each with its cache, merged into the
//! keyring's try-order.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use credgate_core::config::ProviderConfig;
use credgate_core::keyring::{self, AuthSet};
use credgate_core::pattern::{parse_schemeless, Target};
use credgate_core::reference::{is_default_registry, ImageRef, ReferenceError};
use secrecy::SecretString;
use smallvec::SmallVec;

use crate::cache::{CacheKey, Entry};
use crate::clock::{Clock, SystemClock};
use crate::error::ProviderError;
use crate::exec::{ExecRunner, OutputLimits, PluginCommand, PluginRunner};
use crate::memo::{Memo, Pick, PickSource, Resolved};
use crate::metrics::EngineMetrics;
use crate::provider::{
    Ask, BackoffPolicy, Mode, Provider, ProviderParts, ProviderStatus, ServiceAccount,
};

/// A static source: the auths of one docker config file.
#[derive(Debug, Clone)]
pub struct StaticSource {
    /// Shown as the credential's source (the file's path).
    pub name: String,
    pub auth: AuthSet,
}

/// Tunables of the engine.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Where plugin executables live (`--image-credential-provider-bin-dir`).
    pub plugin_dir: PathBuf,
    /// Plugin timeout unless overridden per provider.
    pub default_timeout: Duration,
    /// Per-provider timeouts, by provider name.
    pub timeouts: HashMap<String, Duration>,
    /// Per-provider minimum cache durations, by provider name: answers of `0s` or a few
    /// microseconds (real plugins give both) are kept at least this long, so that a burst
    /// cannot turn into one plugin run per lookup. Off unless set: the kubelet's semantics.
    pub min_cache_durations: HashMap<String, Duration>,
    pub limits: OutputLimits,
    /// Entries per provider cache.
    pub cache_capacity: usize,
    pub backoff: BackoffPolicy,
    /// Plugin runs of one provider in flight at once; more wait for a slot.
    pub max_runs_per_provider: usize,
    /// Plugin runs of all providers in flight at once.
    pub max_runs: usize,
    /// Per-provider limits on plugin runs a second (off unless set): runs wait for their turn.
    pub plugin_rates: HashMap<String, crate::rate::PluginRate>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            plugin_dir: PathBuf::new(),
            default_timeout: Duration::from_secs(60),
            timeouts: HashMap::new(),
            min_cache_durations: HashMap::new(),
            limits: OutputLimits::default(),
            cache_capacity: 4096,
            backoff: BackoffPolicy::default(),
            // High enough that a burst of 100 distinct images behind an `Image`-keyed plugin
            // runs at once, none waiting for a slot; low enough that no burst forks without
            // limit.
            max_runs_per_provider: 128,
            max_runs: 512,
            plugin_rates: HashMap::new(),
        }
    }
}

/// Why an engine could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("plugin binary {path} for provider {provider} does not exist")]
    PluginMissing { provider: String, path: PathBuf },
    #[error("plugin binary {path} for provider {provider} is not an executable file")]
    PluginNotExecutable { provider: String, path: PathBuf },
    /// The provider's plugin is credgate's own kubelet bridge (the kubelet's plugin directory
    /// given to the agent after the migration): the agent would ask itself, and every lookup
    /// would wait the plugin timeout and fail.
    #[error("plugin binary {path} for provider {provider} is credgate's kubelet bridge, which asks this agent: give the agent the real plugins' directory (--image-credential-provider-bin-dir) and config, not the kubelet's")]
    PluginIsTheBridge { provider: String, path: PathBuf },
    #[error("a timeout or minimum cache duration is set for provider {0}, which the config does not have")]
    UnknownProvider(String),
}

/// Why a lookup failed as a whole (per-provider failures are in [`Lookup::errors`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    /// The cause is in the message (and so not a `source`: a chain prints it once).
    #[error("invalid image reference: {0}")]
    InvalidReference(ReferenceError),
    #[error("invalid registry host {}: expected host[:port] without scheme or path", credgate_core::text::Quoted(.0))]
    InvalidHost(String),
}

impl From<ReferenceError> for LookupError {
    fn from(e: ReferenceError) -> Self {
        LookupError::InvalidReference(e)
    }
}

/// What a provider's cache holds for a lookup.
enum Probe {
    Hit(Arc<Entry>),
    /// Nothing fresh: the plugin must run, in `mode`, keyed by `scope`.
    Miss {
        mode: Mode,
        scope: Option<Arc<crate::cache::Scope>>,
    },
}

/// What a caller asks.
#[derive(Debug, Clone, Copy, Default)]
pub struct LookupRequest<'a> {
    pub image: &'a str,
    /// Only credentials that stay valid at least this long are served from cache; shorter-lived
    /// ones make the plugin run again.
    pub min_valid_for: Duration,
    pub service_account: Option<&'a ServiceAccount>,
    /// `image` is a registry `host[:port]` (what a docker credential helper is given), not an
    /// image: patterns match it as a host, and plugins are asked about the host itself.
    pub registry_host: bool,
    /// Only this provider, and no static source: what one provider entry of a kubelet's config
    /// asks when the kubelet runs the bridge in that provider's place.
    pub provider: Option<&'a str>,
    /// Who asks, for providers' rate limits (`--plugin-rate`): by default the agent itself.
    pub caller: crate::rate::Caller,
}

/// What is being looked up, parsed once.
struct Subject<'a> {
    image: Option<ImageRef<'a>>,
    host: &'a str,
}

impl<'a> Subject<'a> {
    fn parse(req: &LookupRequest<'a>) -> Result<Self, LookupError> {
        if !req.registry_host {
            return Ok(Subject {
                image: Some(ImageRef::parse(req.image)?),
                host: "",
            });
        }
        let host = req.image;
        // A DNS name is at most 253 characters; with a port, a few more.
        let valid = !host.is_empty()
            && host.len() <= 262
            && !host.contains(['/', '@', '?', '#'])
            && !host.bytes().any(|b| b.is_ascii_uppercase())
            && parse_schemeless(host).is_ok_and(|p| p.authority == host && p.path.is_empty());
        if !valid {
            return Err(LookupError::InvalidHost(host.to_owned()));
        }
        Ok(Subject { image: None, host })
    }

    /// The name matched against patterns and sent to plugins.
    fn name(&self) -> &str {
        self.image.as_ref().map_or(self.host, |i| i.name())
    }

    fn registry(&self) -> &str {
        self.image.as_ref().map_or(self.host, |i| i.registry())
    }

    /// Whether the Docker Hub fallback applies.
    fn default_registry(&self) -> bool {
        match &self.image {
            Some(i) => is_default_registry(i.name()),
            None => matches!(
                self.host,
                "docker.io" | "index.docker.io" | "registry-1.docker.io"
            ),
        }
    }
}

/// Which sources a lookup merges: all of them, or only the provider it names (no docker
/// config entry then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    AllSources,
    OneProvider,
}

impl Asked {
    fn of(req: &LookupRequest<'_>) -> Asked {
        if req.provider.is_some() {
            Asked::OneProvider
        } else {
            Asked::AllSources
        }
    }
}

/// Which cache entry answered a lookup, for callers that keep credentials fresh (renewal
/// groups refs by entry and renews each entry once).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EntryInfo {
    /// The provider's index in config order.
    pub provider: usize,
    pub key: CacheKey,
    /// When the plugin answered.
    pub fetched: Instant,
    /// `None` when the response was not cached (`cacheDuration: 0s`).
    pub expires: Option<Instant>,
}

impl EntryInfo {
    /// When the entry was fetched and when it expires, as the renewal policy reads them.
    pub fn times(&self) -> (Instant, Option<Instant>) {
        (self.fetched, self.expires)
    }
}

/// Where a credential came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A node-wide docker config file.
    DockerConfig(String),
    /// A configured provider, by name.
    Provider(String),
}

impl Source {
    pub fn name(&self) -> &str {
        match self {
            Source::DockerConfig(n) | Source::Provider(n) => n,
        }
    }

    pub fn kind(&self) -> SourceKind {
        match self {
            Source::DockerConfig(_) => SourceKind::DockerConfig,
            Source::Provider(_) => SourceKind::Provider,
        }
    }
}

/// One credential, in try-order.
#[derive(Debug, Clone)]
pub struct Credential {
    pub source: Source,
    /// The normalized auth key that matched.
    pub pattern: String,
    pub username: String,
    pub password: SecretString,
    /// `None` for static sources and responses that were not cached.
    pub expires_at: Option<SystemTime>,
}

/// A borrowed credential, for callers that must not allocate.
#[derive(Debug, Clone, Copy)]
pub struct CredentialRef<'a> {
    /// A provider's name or a docker config file's path (see `kind`).
    pub source: &'a str,
    pub kind: SourceKind,
    pub pattern: &'a str,
    pub username: &'a str,
    pub password: &'a SecretString,
    pub expires_at: Option<SystemTime>,
}

/// Which kind of source a borrowed credential came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    DockerConfig,
    Provider,
}

impl SourceKind {
    /// The label reports and the API use: `docker-config` or `provider`.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::DockerConfig => "docker-config",
            SourceKind::Provider => "provider",
        }
    }
}

impl Credential {
    /// The credential borrowed, as [`Engine::lookup_cached`] serves it.
    pub fn as_ref(&self) -> CredentialRef<'_> {
        CredentialRef {
            source: self.source.name(),
            kind: self.source.kind(),
            pattern: &self.pattern,
            username: &self.username,
            password: &self.password,
            expires_at: self.expires_at,
        }
    }
}

/// The answer to a lookup.
#[derive(Debug)]
pub struct Lookup {
    /// The normalized image name that was looked up.
    pub image: String,
    pub credentials: Vec<Credential>,
    /// Providers that matched but gave nothing, with why.
    pub errors: Vec<ProviderError>,
    /// The provider cache entries that answered.
    pub entries: Vec<EntryInfo>,
}

/// Assembles an [`Engine`].
pub struct EngineBuilder {
    config: Option<ProviderConfig>,
    options: EngineOptions,
    runner: Option<Arc<dyn PluginRunner>>,
    clock: Arc<dyn Clock>,
    statics: Vec<StaticSource>,
    metrics: EngineMetrics,
    check_binaries: bool,
}

impl EngineBuilder {
    pub fn config(mut self, config: ProviderConfig) -> Self {
        self.config = Some(config);
        self
    }

    pub fn options(mut self, options: EngineOptions) -> Self {
        self.options = options;
        self
    }

    /// Replaces the process runner (tests inject fakes); also skips the binary checks.
    pub fn runner(mut self, runner: Arc<dyn PluginRunner>) -> Self {
        self.runner = Some(runner);
        self.check_binaries = false;
        self
    }

    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    pub fn static_source(mut self, source: StaticSource) -> Self {
        self.statics.push(source);
        self
    }

    pub fn metrics(mut self, metrics: EngineMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Checks every plugin binary and builds the engine.
    pub fn build(self) -> Result<Engine, BuildError> {
        let opts = &self.options;
        let specs = self
            .config
            .as_ref()
            .map(|c| c.providers.clone())
            .unwrap_or_default();
        if let Some(name) = opts
            .timeouts
            .keys()
            .chain(opts.min_cache_durations.keys())
            .chain(opts.plugin_rates.keys())
            .find(|n| !specs.iter().any(|s| &s.name == *n))
        {
            return Err(BuildError::UnknownProvider(name.clone()));
        }
        let runner = self
            .runner
            .clone()
            .unwrap_or_else(|| Arc::new(ExecRunner::new(opts.limits)));
        let memo = Memo::new(opts.cache_capacity);
        let global_slots = Arc::new(tokio::sync::Semaphore::new(opts.max_runs.max(1)));
        let mut providers = Vec::with_capacity(specs.len());
        for spec in specs {
            let path = opts.plugin_dir.join(&spec.name);
            if self.check_binaries {
                check_binary(&spec.name, &path)?;
            }
            let command = PluginCommand::new(
                spec.name.clone(),
                path,
                spec.args.clone(),
                spec.env.clone(),
                opts.timeouts
                    .get(&spec.name)
                    .copied()
                    .unwrap_or(opts.default_timeout),
            );
            let min_cache = opts
                .min_cache_durations
                .get(&spec.name)
                .copied()
                .unwrap_or_default();
            let identity = crate::provider::identity(&spec, &opts.plugin_dir.join(&spec.name));
            let rate = opts.plugin_rates.get(&spec.name).copied();
            providers.push(Arc::new(Provider::new(ProviderParts {
                rate,
                identity,
                metrics: self.metrics.provider(&spec.name),
                spec,
                command,
                cache_capacity: opts.cache_capacity,
                runner: runner.clone(),
                clock: self.clock.clone(),
                backoff: opts.backoff,
                min_cache,
                generation: memo.generation.clone(),
                max_runs: opts.max_runs_per_provider,
                global_slots: global_slots.clone(),
            })));
        }
        Ok(Engine {
            inner: Arc::new(Inner {
                providers,
                memo,
                statics: self.statics,
                clock: self.clock,
                metrics: self.metrics,
                identity: self.config.map(|c| c.identity),
            }),
        })
    }
}

fn check_binary(provider: &str, path: &Path) -> Result<(), BuildError> {
    let meta = std::fs::metadata(path).map_err(|_| BuildError::PluginMissing {
        provider: provider.to_owned(),
        path: path.to_owned(),
    })?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(BuildError::PluginNotExecutable {
            provider: provider.to_owned(),
            path: path.to_owned(),
        });
    }
    if is_the_bridge(path, meta.len()) {
        return Err(BuildError::PluginIsTheBridge {
            provider: provider.to_owned(),
            path: path.to_owned(),
        });
    }
    Ok(())
}

/// The most of an executable searched for the bridge's mark: far above the bridge (about
/// 3 MB static); a larger plugin is no bridge.
const MARK_SEARCH_MAX: u64 = 256 << 20;

/// Whether the executable at `path` (of `len` bytes) is credgate's kubelet bridge: it holds
/// [`credgate_core::wire::bridge::BRIDGE_MARK`] whole. Read in chunks, never whole; a file that
/// cannot be read is left to the run to report.
fn is_the_bridge(path: &Path, len: u64) -> bool {
    use std::io::Read as _;
    if len > MARK_SEARCH_MAX {
        return false;
    }
    let mark = credgate_core::wire::bridge::BRIDGE_MARK.concat();
    let finder = memchr::memmem::Finder::new(mark.as_bytes());
    let Ok(mut file) = std::fs::File::open(path) else {
        return false;
    };
    let mut buf = vec![0u8; 64 << 10];
    // The last mark.len() - 1 bytes of a chunk are searched again with the next one.
    let mut kept = 0;
    loop {
        let n = match file.read(&mut buf[kept..]) {
            Ok(0) | Err(_) => return false,
            Ok(n) => n,
        };
        let filled = kept + n;
        if finder.find(&buf[..filled]).is_some() {
            return true;
        }
        kept = (mark.len() - 1).min(filled);
        buf.copy_within(filled - kept..filled, 0);
    }
}

struct Inner {
    providers: Vec<Arc<Provider>>,
    memo: Memo,
    statics: Vec<StaticSource>,
    clock: Arc<dyn Clock>,
    metrics: EngineMetrics,
    identity: Option<String>,
}

/// The credential engine. Cheap to clone; clones share caches.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl Engine {
    pub fn builder() -> EngineBuilder {
        EngineBuilder {
            config: None,
            options: EngineOptions::default(),
            runner: None,
            clock: Arc::new(SystemClock::new()),
            statics: Vec::new(),
            metrics: EngineMetrics::default(),
            check_binaries: true,
        }
    }

    /// Credentials for an image in the order a puller should try them, running plugins for
    /// cache misses (concurrent misses share runs).
    pub async fn lookup(&self, req: &LookupRequest<'_>) -> Result<Lookup, LookupError> {
        let generation = self.inner.memo.generation();
        if let Some(found) = self.remembered(req, generation, |r| self.owned(r)) {
            return Ok(found);
        }
        let subject = Subject::parse(req)?;
        let (name, registry) = (subject.name(), subject.registry());
        let target = Target::from_image_name(name);
        let fresh_until = self.fresh_until(req.min_valid_for);
        let mut entries: SmallVec<[(usize, Arc<Entry>); 2]> = SmallVec::new();
        let mut errors = Vec::new();
        for (i, probe) in self.probes(req, &target, name, registry, fresh_until) {
            let p = &self.inner.providers[i];
            let result = match probe {
                Ok(Probe::Hit(e)) => {
                    p.metrics.hits.inc();
                    Ok(e)
                }
                Ok(Probe::Miss { mode, scope }) => {
                    let ask = Ask {
                        image: name,
                        registry,
                        scope,
                        mode: &mode,
                        fresh_until,
                        caller: req.caller,
                    };
                    p.get(ask).await
                }
                Err(e) => {
                    p.metrics.error(e.reason());
                    Err(e)
                }
            };
            match result {
                Ok(e) => entries.push((i, e)),
                Err(e) => errors.push(e),
            }
        }
        let resolved = self.resolve(&subject, &target, entries, generation, Asked::of(req));
        if errors.is_empty() {
            self.remember(req, &resolved);
        }
        let mut found = self.owned(&resolved);
        found.errors = errors;
        Ok(found)
    }

    /// Serves a lookup from the caches alone, without allocating: `f` sees the credentials in
    /// try-order. `Ok(None)` when a matching provider has no fresh entry (use [`Engine::lookup`]).
    pub fn lookup_cached<R>(
        &self,
        req: &LookupRequest<'_>,
        f: impl FnOnce(&[CredentialRef<'_>]) -> R,
    ) -> Result<Option<R>, LookupError> {
        self.lookup_cached_named(req, |_, refs| f(refs))
    }

    /// Like [`Engine::lookup_cached`]; `f` also sees the normalized image name.
    pub fn lookup_cached_named<R>(
        &self,
        req: &LookupRequest<'_>,
        f: impl FnOnce(&str, &[CredentialRef<'_>]) -> R,
    ) -> Result<Option<R>, LookupError> {
        let generation = self.inner.memo.generation();
        let mut f = Some(f);
        let mut serve = |r: &Resolved| {
            let refs: SmallVec<[CredentialRef<'_>; 2]> =
                r.picks.iter().map(|p| self.credential_ref(r, *p)).collect();
            (f.take().expect("served once"))(&r.name, &refs)
        };
        if let Some(out) = self.remembered(req, generation, &mut serve) {
            return Ok(Some(out));
        }
        let subject = Subject::parse(req)?;
        let (name, registry) = (subject.name(), subject.registry());
        let target = Target::from_image_name(name);
        let fresh_until = self.fresh_until(req.min_valid_for);
        let mut entries: SmallVec<[(usize, Arc<Entry>); 2]> = SmallVec::new();
        for (i, probe) in self.probes(req, &target, name, registry, fresh_until) {
            match probe {
                Ok(Probe::Hit(e)) => entries.push((i, e)),
                Ok(Probe::Miss { .. }) | Err(_) => return Ok(None),
            }
        }
        for (i, _) in &entries {
            self.inner.providers[*i].metrics.hits.inc();
        }
        let resolved = self.resolve(&subject, &target, entries, generation, Asked::of(req));
        self.remember(req, &resolved);
        Ok(Some(serve(&resolved)))
    }

    /// The providers that apply to a lookup, each with what its cache holds: the one loop both
    /// lookups share. `lookup` runs the plugin of a miss; `lookup_cached` gives up on one.
    fn probes<'s, 'r: 's>(
        &'s self,
        req: &'s LookupRequest<'r>,
        target: &'s Target<'s>,
        name: &'s str,
        registry: &'s str,
        fresh_until: Instant,
    ) -> impl Iterator<Item = (usize, Result<Probe, ProviderError>)> + 's {
        self.inner
            .providers
            .iter()
            .enumerate()
            .filter_map(move |(i, p)| {
                if !p.applies(target) || req.provider.is_some_and(|only| only != p.spec.name) {
                    return None;
                }
                let mode = match p.mode(req.service_account) {
                    Ok(Mode::Skip) => return None,
                    Ok(mode) => mode,
                    Err(e) => return Some((i, Err(e))),
                };
                let scope = mode.scope().cloned();
                let probe = match p.cached(name, registry, scope.as_deref(), fresh_until) {
                    Some(e) => Probe::Hit(e),
                    None => Probe::Miss { mode, scope },
                };
                Some((i, Ok(probe)))
            })
    }

    /// Serves a fresh remembered resolution of the caller's exact image string.
    fn remembered<R>(
        &self,
        req: &LookupRequest<'_>,
        generation: u64,
        serve: impl FnOnce(&Resolved) -> R,
    ) -> Option<R> {
        if req.service_account.is_some() || req.registry_host || req.provider.is_some() {
            return None;
        }
        let fresh_until = self.fresh_until(req.min_valid_for);
        self.inner
            .memo
            .with(req.image, |r| {
                if !r.fresh(generation, fresh_until) {
                    return None;
                }
                for (i, _) in &r.entries {
                    self.inner.providers[*i].metrics.hits.inc();
                }
                Some(serve(r))
            })
            .flatten()
    }

    /// Remembers a resolution. Lookups with a service account are scoped to it and never
    /// remembered; nor is a resolution built while a cache changed (this very lookup's plugin
    /// run, usually): it could never be served, and the memo's copy-on-write insert would be
    /// wasted.
    fn remember(&self, req: &LookupRequest<'_>, resolved: &Arc<Resolved>) {
        if req.service_account.is_none()
            && !req.registry_host
            && req.provider.is_none()
            && self.inner.memo.generation() == resolved.generation
        {
            self.inner.memo.insert(req.image, resolved.clone());
        }
    }

    /// Until when a served credential must stay alive.
    fn fresh_until(&self, min_valid_for: Duration) -> Instant {
        let now = self.inner.clock.now();
        if min_valid_for.is_zero() {
            now
        } else {
            now + min_valid_for
        }
    }

    /// Orders the credentials of the static sources (unless one provider was asked) and the
    /// answering entries, for `subject` (whose registry decides the Docker Hub fallback).
    fn resolve(
        &self,
        subject: &Subject<'_>,
        target: &Target<'_>,
        entries: SmallVec<[(usize, Arc<Entry>); 2]>,
        generation: u64,
        asked: Asked,
    ) -> Arc<Resolved> {
        let (name, default_registry) = (subject.name(), subject.default_registry());
        let picks = {
            let statics = self
                .inner
                .statics
                .iter()
                .enumerate()
                .filter(|_| asked == Asked::AllSources)
                .map(|(j, s)| (PickSource::Static(j), &s.auth));
            let dynamic = entries
                .iter()
                .enumerate()
                .map(|(k, (_, e))| (PickSource::Entry(k), &e.auth));
            let sources: SmallVec<[(PickSource, &AuthSet); 8]> = statics.chain(dynamic).collect();
            let selection = keyring::select_target(target, default_registry, &sources);
            selection
                .iter()
                .map(|(source, auth)| {
                    let set = match *source {
                        PickSource::Static(j) => &self.inner.statics[j].auth,
                        PickSource::Entry(k) => &entries[k].1.auth,
                    };
                    let index = set.position(auth).expect("selected from this set");
                    Pick {
                        source: *source,
                        index,
                    }
                })
                .collect()
        };
        let valid_until = entries.iter().filter_map(|(_, e)| e.expires).min();
        Arc::new(Resolved {
            name: name.into(),
            generation,
            valid_until,
            entries,
            picks,
        })
    }

    fn credential_ref<'a>(&'a self, r: &'a Resolved, pick: Pick) -> CredentialRef<'a> {
        let (source, kind, set, expires_at) = match pick.source {
            PickSource::Static(j) => {
                let s = &self.inner.statics[j];
                (s.name.as_str(), SourceKind::DockerConfig, &s.auth, None)
            }
            PickSource::Entry(k) => {
                let (i, e) = &r.entries[k];
                (
                    self.inner.providers[*i].spec.name.as_str(),
                    SourceKind::Provider,
                    &e.auth,
                    e.expires_wall,
                )
            }
        };
        let auth = set.get(pick.index).expect("pick within its set");
        CredentialRef {
            source,
            kind,
            pattern: auth.key(),
            username: &auth.auth.username,
            password: &auth.auth.password,
            expires_at,
        }
    }

    fn owned(&self, r: &Resolved) -> Lookup {
        let credentials = r
            .picks
            .iter()
            .map(|p| {
                let c = self.credential_ref(r, *p);
                let source = match p.source {
                    PickSource::Static(_) => Source::DockerConfig(c.source.to_owned()),
                    PickSource::Entry(_) => Source::Provider(c.source.to_owned()),
                };
                Credential {
                    source,
                    pattern: c.pattern.to_owned(),
                    username: c.username.to_owned(),
                    password: c.password.clone(),
                    expires_at: c.expires_at,
                }
            })
            .collect();
        let entries = r
            .entries
            .iter()
            .map(|(i, e)| EntryInfo {
                provider: *i,
                key: e.key(),
                fetched: e.fetched,
                expires: e.expires,
            })
            .collect();
        Lookup {
            image: r.name.to_string(),
            credentials,
            errors: Vec::new(),
            entries,
        }
    }

    /// Whether the config has a provider of this name.
    pub fn has_provider(&self, name: &str) -> bool {
        self.inner.providers.iter().any(|p| p.spec.name == name)
    }

    /// Whether provider `name` is keyed by service account (its config entry has
    /// `tokenAttributes`): its answers belong to an identity, never to a pull without one.
    pub fn keyed_by_service_account(&self, name: &str) -> bool {
        self.inner
            .providers
            .iter()
            .any(|p| p.spec.name == name && p.spec.token_attributes.is_some())
    }

    /// Per-provider status, in config order.
    pub fn provider_status(&self) -> Vec<ProviderStatus> {
        self.inner.providers.iter().map(|p| p.status()).collect()
    }

    /// Plugin runs so far, all providers.
    pub fn total_runs(&self) -> u64 {
        self.inner
            .providers
            .iter()
            .map(|p| p.metrics.runs.get())
            .sum()
    }

    /// The metric families, to register with a Prometheus registry.
    pub fn metrics(&self) -> &EngineMetrics {
        &self.inner.metrics
    }

    /// The docker config files' sources, in try-order.
    pub(crate) fn statics(&self) -> &[StaticSource] {
        &self.inner.statics
    }

    pub(crate) fn providers(&self) -> &[Arc<Provider>] {
        &self.inner.providers
    }

    pub(crate) fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    pub(crate) fn generation_counter(&self) -> &Arc<std::sync::atomic::AtomicU64> {
        &self.inner.memo.generation
    }

    /// `sha256:` of the provider config bytes, when a config is loaded.
    pub fn config_identity(&self) -> Option<&str> {
        self.inner.identity.as_deref()
    }
}
