//! The engine: every credential source of a node behind one lookup. Static sources (node-wide
//! docker config files) and the configured providers, each with its cache, merged into the
//! keyring's try-order.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use credgate_core::config::ProviderConfig;
use credgate_core::keyring::{self, AuthSet, KeyedAuth};
use credgate_core::pattern::Target;
use credgate_core::reference::{is_default_registry, ImageRef, ReferenceError};
use secrecy::SecretString;
use smallvec::SmallVec;

use crate::cache::Entry;
use crate::clock::{Clock, SystemClock};
use crate::error::ProviderError;
use crate::exec::{ExecRunner, OutputLimits, PluginCommand, PluginRunner};
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
    pub limits: OutputLimits,
    /// Entries per provider cache.
    pub cache_capacity: usize,
    pub backoff: BackoffPolicy,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            plugin_dir: PathBuf::new(),
            default_timeout: Duration::from_secs(60),
            timeouts: HashMap::new(),
            limits: OutputLimits::default(),
            cache_capacity: 4096,
            backoff: BackoffPolicy::default(),
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
    #[error("a timeout is set for provider {0}, which the config does not have")]
    UnknownProvider(String),
}

/// Why a lookup failed as a whole (per-provider failures are in [`Lookup::errors`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("invalid image reference: {0}")]
    InvalidReference(#[from] ReferenceError),
}

/// What a caller asks.
#[derive(Debug, Clone, Copy, Default)]
pub struct LookupRequest<'a> {
    pub image: &'a str,
    /// Only credentials that stay valid at least this long are served from cache; shorter-lived
    /// ones make the plugin run again.
    pub min_valid_for: Duration,
    pub service_account: Option<&'a ServiceAccount>,
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
    pub source: &'a str,
    pub pattern: &'a str,
    pub username: &'a str,
    pub password: &'a SecretString,
    pub expires_at: Option<SystemTime>,
}

/// The answer to a lookup.
#[derive(Debug)]
pub struct Lookup {
    /// The normalized image name that was looked up.
    pub image: String,
    pub credentials: Vec<Credential>,
    /// Providers that matched but gave nothing, with why.
    pub errors: Vec<ProviderError>,
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
            .find(|n| !specs.iter().any(|s| &s.name == *n))
        {
            return Err(BuildError::UnknownProvider(name.clone()));
        }
        let runner = self.runner.clone().unwrap_or_else(|| {
            Arc::new(ExecRunner {
                limits: opts.limits,
            })
        });
        let mut providers = Vec::with_capacity(specs.len());
        for spec in specs {
            let path = opts.plugin_dir.join(&spec.name);
            if self.check_binaries {
                check_binary(&spec.name, &path)?;
            }
            let command = PluginCommand {
                name: spec.name.clone(),
                path,
                args: spec.args.clone(),
                env: spec.env.clone(),
                timeout: opts
                    .timeouts
                    .get(&spec.name)
                    .copied()
                    .unwrap_or(opts.default_timeout),
            };
            providers.push(Arc::new(Provider::new(ProviderParts {
                metrics: self.metrics.provider(&spec.name),
                spec,
                command,
                cache_capacity: opts.cache_capacity,
                runner: runner.clone(),
                clock: self.clock.clone(),
                backoff: opts.backoff,
            })));
        }
        Ok(Engine {
            inner: Arc::new(Inner {
                providers,
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
    Ok(())
}

struct Inner {
    providers: Vec<Arc<Provider>>,
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

/// The tag of a source in a selection.
#[derive(Clone, Copy)]
enum Tag {
    Static(usize),
    Provider(usize, usize),
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
        let image = ImageRef::parse(req.image)?;
        let (name, registry) = (image.name(), image.registry());
        let target = Target::from_image_name(name);
        let fresh_until = self.inner.clock.now() + req.min_valid_for;
        let mut entries: SmallVec<[(usize, Arc<Entry>); 4]> = SmallVec::new();
        let mut errors = Vec::new();
        for (i, p) in self.inner.providers.iter().enumerate() {
            if !p.applies(&target) {
                continue;
            }
            let mode = match p.mode(req.service_account) {
                Ok(Mode::Skip) => continue,
                Ok(mode) => mode,
                Err(e) => {
                    p.metrics.error(e.reason());
                    errors.push(e);
                    continue;
                }
            };
            let scope = mode.scope().cloned();
            let hit = p
                .cache
                .load()
                .find(name, registry, scope.as_deref(), fresh_until)
                .cloned();
            let result = match hit {
                Some(e) => {
                    p.metrics.hits.inc();
                    Ok(e)
                }
                None => {
                    let ask = Ask {
                        image: name,
                        registry,
                        scope,
                        mode: &mode,
                        fresh_until,
                    };
                    p.get(ask).await
                }
            };
            match result {
                Ok(e) => entries.push((i, e)),
                Err(e) => errors.push(e),
            }
        }
        let credentials = self.assemble(&target, name, &entries);
        Ok(Lookup {
            image: name.to_owned(),
            credentials,
            errors,
        })
    }

    fn assemble(
        &self,
        target: &Target<'_>,
        name: &str,
        entries: &[(usize, Arc<Entry>)],
    ) -> Vec<Credential> {
        let sources = self.sources(entries.iter().map(|(i, e)| (*i, &**e)));
        let selection = keyring::select_target(target, is_default_registry(name), &sources);
        selection
            .iter()
            .map(|(tag, auth)| {
                let (source, expires_at) = match *tag {
                    Tag::Static(j) => (
                        Source::DockerConfig(self.inner.statics[j].name.clone()),
                        None,
                    ),
                    Tag::Provider(i, k) => (
                        Source::Provider(self.inner.providers[i].spec.name.clone()),
                        entries[k].1.expires_wall,
                    ),
                };
                Credential {
                    source,
                    pattern: auth.key().to_owned(),
                    username: auth.auth.username.clone(),
                    password: auth.auth.password.clone(),
                    expires_at,
                }
            })
            .collect()
    }

    fn sources<'a>(
        &'a self,
        entries: impl Iterator<Item = (usize, &'a Entry)>,
    ) -> SmallVec<[(Tag, &'a AuthSet); 8]> {
        let statics = self
            .inner
            .statics
            .iter()
            .enumerate()
            .map(|(j, s)| (Tag::Static(j), &s.auth));
        let providers = entries
            .enumerate()
            .map(|(k, (i, e))| (Tag::Provider(i, k), &e.auth));
        statics.chain(providers).collect()
    }

    /// Serves a lookup from the caches alone, without allocating: `f` sees the credentials in
    /// try-order. `Ok(None)` when a matching provider has no fresh entry (use [`Engine::lookup`]).
    pub fn lookup_cached<R>(
        &self,
        req: &LookupRequest<'_>,
        f: impl FnOnce(&[CredentialRef<'_>]) -> R,
    ) -> Result<Option<R>, LookupError> {
        let image = ImageRef::parse(req.image)?;
        let (name, registry) = (image.name(), image.registry());
        let target = Target::from_image_name(name);
        let fresh_until = self.inner.clock.now() + req.min_valid_for;
        let mut modes: SmallVec<[(usize, Mode); 4]> = SmallVec::new();
        for (i, p) in self.inner.providers.iter().enumerate() {
            if p.applies(&target) {
                match p.mode(req.service_account) {
                    Ok(Mode::Skip) => {}
                    Ok(mode) => modes.push((i, mode)),
                    Err(_) => return Ok(None),
                }
            }
        }
        let guards: SmallVec<[_; 4]> = modes
            .iter()
            .map(|(i, _)| self.inner.providers[*i].cache.load())
            .collect();
        let mut found: SmallVec<[(usize, &Entry); 4]> = SmallVec::new();
        for ((i, mode), guard) in modes.iter().zip(&guards) {
            let scope = mode.scope().map(|s| &**s);
            match guard.find(name, registry, scope, fresh_until) {
                Some(e) => found.push((*i, e)),
                None => return Ok(None),
            }
        }
        for (i, _) in &found {
            self.inner.providers[*i].metrics.hits.inc();
        }
        let sources = self.sources(found.iter().copied());
        let selection = keyring::select_target(&target, is_default_registry(name), &sources);
        let refs: SmallVec<[CredentialRef<'_>; 4]> = selection
            .iter()
            .map(|(tag, auth)| self.credential_ref(*tag, auth, &found))
            .collect();
        Ok(Some(f(&refs)))
    }

    fn credential_ref<'a>(
        &'a self,
        tag: Tag,
        auth: &'a KeyedAuth,
        found: &[(usize, &Entry)],
    ) -> CredentialRef<'a> {
        let (source, expires_at) = match tag {
            Tag::Static(j) => (self.inner.statics[j].name.as_str(), None),
            Tag::Provider(i, k) => (
                self.inner.providers[i].spec.name.as_str(),
                found[k].1.expires_wall,
            ),
        };
        CredentialRef {
            source,
            pattern: auth.key(),
            username: &auth.auth.username,
            password: &auth.auth.password,
            expires_at,
        }
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

    /// `sha256:` of the provider config bytes, when a config is loaded.
    pub fn config_identity(&self) -> Option<&str> {
        self.inner.identity.as_deref()
    }

    /// The names of the configured providers, in config order.
    pub fn provider_names(&self) -> Vec<&str> {
        self.inner
            .providers
            .iter()
            .map(|p| p.spec.name.as_str())
            .collect()
    }
}
