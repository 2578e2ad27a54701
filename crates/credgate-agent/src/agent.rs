//! The agent's state: the engine in use (swapped whole on reload), the renewal service, and
//! the metric registry.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;
use credgate_core::renewal::RenewalPolicy;
use credgate_engine::clock::{Clock, SystemClock};
use credgate_engine::metrics::EngineMetrics;
use credgate_engine::Engine;
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;

use crate::guard::{Guard, GuardOptions};
use crate::metrics::AgentMetrics;
use crate::renewal::Renewer;
use credgate_engine::sources::{SourceError, Sources};

/// Registers a part's metric families in the agent's registry.
pub type Register = Arc<dyn Fn(&mut Registry) + Send + Sync>;

/// How to run an agent.
#[derive(Clone, Default)]
pub struct AgentOptions {
    pub sources: Sources,
    pub renewal: RenewalPolicy,
    /// The clock; the system's when `None` (tests pass a paused one).
    pub clock: Option<Arc<dyn Clock>>,
    /// The image access guard; off when `None` (its RPCs then fail with FAILED_PRECONDITION).
    pub guard: Option<GuardOptions>,
    /// Which callers may use each API service.
    pub callers: CallerAllowlist,
    /// How long a Watch event may wait for a client that does not read before the client is
    /// dropped; [`WATCH_SEND_TIMEOUT`] when `None`.
    pub watch_send_timeout: Option<std::time::Duration>,
    /// Keep the providers' answers and the tracked refs sealed in this state directory across
    /// restarts (unless `--no-persist-cache`); off when `None`.
    pub saved_cache: Option<std::path::PathBuf>,
    /// The pull credentials the CRI proxy captures, opened by the caller (it runs the proxy).
    pub captured: Option<Arc<crate::captured::Captured>>,
    /// Sources it cannot build at start are served as none (no provider, no docker config)
    /// until a reload builds them, instead of an error: with the CRI proxy every image call of
    /// the node passes through the agent, and pods that need nothing from it must still start
    /// (issue 50, decision 0028).
    pub serve_without_refused_sources: bool,
    /// Families of the parts composed beside the agent (the CRI proxy's), registered after
    /// the agent's own in the one registry `/metrics` serves.
    pub also_register: Option<Register>,
}

/// How long a Watch event may wait for room before its client is dropped.
pub const WATCH_SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The API's services, for per-service caller allowlists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Service {
    Credentials,
    Admin,
    ImageAccess,
    /// Not a service but a claim: a `Lookup` that names a service account (the kubelet's
    /// bridge, for KEP-4412 providers) is answered from that account's cache entries. Only
    /// root, the agent's own uid and the uids named for it may make the claim; a service
    /// account token is not verified by the agent, so the caller's uid is what is trusted.
    ServiceAccountIdentity,
    /// Not an API service: the node's registry mirror (`credgate-mirror`) adds credentials only
    /// for root, the agent's own uid and the uids named for it.
    RegistryMirror,
}

impl Service {
    /// The API's services.
    pub const ALL: [Service; 3] = [Service::Credentials, Service::Admin, Service::ImageAccess];
    /// Everything `--allow-uids` names.
    const NAMED: [Service; 5] = [
        Service::Credentials,
        Service::Admin,
        Service::ImageAccess,
        Service::ServiceAccountIdentity,
        Service::RegistryMirror,
    ];

    /// The name used on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Service::Credentials => "credentials",
            Service::Admin => "admin",
            Service::ImageAccess => "image-access",
            Service::ServiceAccountIdentity => "service-account-identity",
            Service::RegistryMirror => "registry-mirror",
        }
    }
}

/// Which uids (from the socket's peer credentials) may call each service. A service with no
/// entry is open to everyone who can open the socket; the agent's own uid is always allowed.
#[derive(Debug, Clone, Default)]
pub struct CallerAllowlist {
    uids: std::collections::HashMap<Service, Vec<u32>>,
}

impl CallerAllowlist {
    /// Allows `uids` to call `service` (added to any earlier entry).
    pub fn allow(&mut self, service: Service, uids: impl IntoIterator<Item = u32>) {
        self.uids.entry(service).or_default().extend(uids);
    }

    /// Parses `SERVICE=UID[,UID...]`, as `--allow-uids` takes it.
    pub fn parse_entry(s: &str) -> Result<(Service, Vec<u32>), AllowUidsError> {
        let (service, uids) = s
            .split_once('=')
            .ok_or_else(|| AllowUidsError::Form(s.to_owned()))?;
        let service = Service::NAMED
            .into_iter()
            .find(|x| x.as_str() == service)
            .ok_or_else(|| AllowUidsError::Service(service.to_owned()))?;
        let uids = uids
            .split(',')
            .map(|u| {
                u.trim()
                    .parse::<u32>()
                    .map_err(|_| AllowUidsError::Uid(u.to_owned()))
            })
            .collect::<Result<Vec<u32>, _>>()?;
        Ok((service, uids))
    }

    /// Whether `uid` may call at least one service: a connection of a caller that may call
    /// none is closed as soon as it is accepted.
    pub fn admits_any(&self, uid: Option<u32>) -> bool {
        Service::ALL.into_iter().any(|s| self.allows(s, uid))
    }

    /// Whether `uid` may call `service`; an unknown caller may only call open services.
    /// [`Service::ServiceAccountIdentity`] and [`Service::RegistryMirror`] are never open:
    /// root and the agent's own uid may, and the uids named for them.
    pub fn allows(&self, service: Service, uid: Option<u32>) -> bool {
        match (service, self.uids.get(&service)) {
            (Service::ServiceAccountIdentity | Service::RegistryMirror, list) => uid
                .is_some_and(|u| u == 0 || u == own_uid() || list.is_some_and(|l| l.contains(&u))),
            (_, None) => true,
            (_, Some(list)) => uid.is_some_and(|u| u == own_uid() || list.contains(&u)),
        }
    }
}

fn own_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Why [`Agent::reload_logged`] changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The sources were refused (the old config keeps serving): the error chain.
    #[error("{0}")]
    Refused(String),
    #[error("reload task failed")]
    Task,
}

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    /// The provider config identity now loaded (`None` without a provider config).
    pub identity: Option<String>,
    pub changed: bool,
}

struct Inner {
    sources: Sources,
    engine: Arc<ArcSwap<Engine>>,
    engine_metrics: EngineMetrics,
    metrics: AgentMetrics,
    registry: Registry,
    renewer: Renewer,
    guard: Option<Guard>,
    clock: Arc<dyn Clock>,
    callers: CallerAllowlist,
    watch_send_timeout: std::time::Duration,
    started: SystemTime,
    loaded: Mutex<SystemTime>,
    /// Pull credentials captured by the CRI proxy, when it runs.
    captured: Option<Arc<crate::captured::Captured>>,
    /// Every task the agent starts.
    tasks: crate::tasks::Tasks,
    /// Held during a reload; the fingerprint of the sources the running engine was built from.
    reload: Mutex<Option<[u8; 32]>>,
    /// The sealed provider cache's writer.
    saver: crate::saver::Saver,
    /// Credentials registries refused: found, confirmed and acted on.
    refusal: Arc<crate::refusal::Refuser>,
    /// The CRI proxy's state: off until it serves; why it ended, when it ended early.
    proxy: Mutex<ProxyState>,
    /// When a uid other than root's and the agent's own last flushed.
    unprivileged_flush: Mutex<Option<std::time::Instant>>,
}

/// The CRI proxy's state: off until it serves; its view stays when it ends early.
#[derive(Default)]
struct ProxyState {
    view: Option<Arc<dyn crate::explain::ProxyView>>,
    /// Why it stopped while the agent serves.
    ended: Option<String>,
}

/// Flushes by uids other than root's and the agent's own: one per this, all together (a flush
/// costs a plugin run per key and a rewrite of `cache.sealed`).
pub const UNPRIVILEGED_FLUSH_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// A running agent's shared state. Cheap to clone.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

impl Agent {
    /// Reads the sources and builds the engine. Never runs a plugin.
    pub fn new(options: AgentOptions) -> Result<Agent, SourceError> {
        let clock = options
            .clock
            .unwrap_or_else(|| Arc::new(SystemClock::new()));
        let engine_metrics = EngineMetrics::default();
        let mut fingerprint = options.sources.fingerprint();
        let metrics = AgentMetrics::default();
        let engine = match options
            .sources
            .build(Some(engine_metrics.clone()), Some(clock.clone()))
        {
            Ok(engine) => engine,
            Err(e) if options.serve_without_refused_sources => {
                tracing::error!(
                    error = %credgate_core::text::error_chain(&e),
                    "the provider config is refused: serving without providers or docker configs until a reload takes a valid one; pulls that bring their own credentials pass through"
                );
                metrics.config_refused.set(1);
                // Nothing was built from those bytes: the next reload builds them again.
                fingerprint = None;
                Sources::default().build(Some(engine_metrics.clone()), Some(clock.clone()))?
            }
            Err(e) => return Err(e),
        };
        let engine = Arc::new(ArcSwap::from_pointee(engine));
        let mut registry = Registry::default();
        engine_metrics.register(&mut registry);
        metrics.register(&mut registry);
        if let Some(register) = &options.also_register {
            register(&mut registry);
        }
        let tasks = crate::tasks::Tasks::new();
        let renewer = Renewer::new(
            engine.clone(),
            clock.clone(),
            options.renewal,
            metrics.clone(),
            tasks.clone(),
            options.captured.clone(),
        );
        let verifier = crate::guard::registry::Verifier::new(
            options
                .guard
                .as_ref()
                .map(|g| g.registry.clone())
                .unwrap_or_default(),
        );
        let guard = options.guard.map(|g| {
            Guard::open(g, metrics.clone(), clock.clone())
                .with_tasks(tasks.clone())
                .with_engine(engine.clone())
        });
        // What was refused and handed out, keyed by the node key and kept beside the provider
        // cache, so that a restart still knows the kubelet's stale copies (issue 49).
        let (memory, memory_file) = match options
            .saved_cache
            .as_deref()
            .and_then(|dir| crate::memory::MemoryFile::open(dir, clock.now(), clock.wall()))
        {
            Some((file, memory)) => (Arc::new(memory), Some(file)),
            None => (Arc::new(crate::memory::Refusals::default()), None),
        };
        let saver = crate::saver::Saver::open(
            options.saved_cache.as_deref(),
            (memory.clone(), memory_file),
            engine.clone(),
            renewer.clone(),
            metrics.clone(),
            clock.clone(),
            tasks.clone(),
        );
        let refusal = Arc::new(crate::refusal::Refuser::new(
            memory,
            verifier,
            engine.clone(),
            options.captured.clone(),
            renewer.clone(),
            saver.clone(),
            metrics.clone(),
            clock.clone(),
        ));
        let now = clock.wall();
        Ok(Agent {
            inner: Arc::new(Inner {
                saver,
                refusal,
                proxy: Mutex::default(),
                unprivileged_flush: Mutex::new(None),
                sources: options.sources,
                engine,
                engine_metrics,
                metrics,
                registry,
                renewer,
                guard,
                clock,
                started: now,
                loaded: Mutex::new(now),
                reload: Mutex::new(fingerprint),
                captured: options.captured,
                tasks,
                callers: options.callers,
                watch_send_timeout: options.watch_send_timeout.unwrap_or(WATCH_SEND_TIMEOUT),
            }),
        })
    }

    /// The CRI proxy serves from now on; the `Admin` service asks `view` what it would do
    /// with a pull, its recent pulls and the node's images.
    pub fn set_proxy_running(&self, view: Arc<dyn crate::explain::ProxyView>) {
        *self.inner.proxy.lock() = ProxyState {
            view: Some(view),
            ended: None,
        };
    }

    /// The CRI proxy ended while the agent serves (`why`): `Status` says so from now on.
    pub fn set_proxy_ended(&self, why: String) {
        self.inner.proxy.lock().ended = Some(why);
    }

    /// The CRI proxy's state for `Status`: `serving`, `off` (not configured), or
    /// `ended: WHY`.
    pub fn proxy_state(&self) -> String {
        let state = self.inner.proxy.lock();
        match (&state.ended, &state.view) {
            (Some(why), _) => format!("ended: {why}"),
            (None, Some(_)) => "serving".to_owned(),
            (None, None) => "off".to_owned(),
        }
    }

    /// What the CRI proxy tells the `Admin` service, once it served.
    pub fn proxy_view(&self) -> Option<Arc<dyn crate::explain::ProxyView>> {
        self.inner.proxy.lock().view.clone()
    }

    /// What the CRI proxy tells the `Admin` service, while it serves (`None` when it is off
    /// or ended).
    pub fn serving_proxy(&self) -> Option<Arc<dyn crate::explain::ProxyView>> {
        let state = self.inner.proxy.lock();
        state.view.clone().filter(|_| state.ended.is_none())
    }

    /// Whether the CRI proxy runs on this agent.
    pub fn proxy_running(&self) -> bool {
        self.serving_proxy().is_some()
    }

    /// Credentials registries refused: the service that finds, confirms and acts on them.
    pub fn refusal(&self) -> &Arc<crate::refusal::Refuser> {
        &self.inner.refusal
    }

    /// The sealed provider cache's writer (it writes nothing when the cache is off).
    pub fn saver(&self) -> &crate::saver::Saver {
        &self.inner.saver
    }

    /// Drops cached provider answers (of `provider`, or all; for `images`, or all) in memory
    /// and in the sealed file, renews tracked refs at once (Watch streams get what changed).
    pub async fn flush(
        &self,
        provider: Option<&str>,
        images: &[String],
    ) -> Result<Vec<credgate_engine::Dropped>, credgate_engine::FlushError> {
        let dropped =
            self.engine()
                .flush(provider, images, "flushed by an operator (ctl flush)")?;
        self.inner
            .metrics
            .cache_flushed
            .inc_by(dropped.len() as u64);
        tracing::info!(
            provider = provider.unwrap_or("*"),
            images = images.len(),
            dropped = dropped.len(),
            "provider answers flushed"
        );
        // A flush that dropped nothing (the answers the last one dropped are not back yet)
        // adds nothing: no write, no renewal, no plugin run.
        if !dropped.is_empty() {
            self.inner.saver.save().await;
            self.inner.renewer.flushed(&dropped);
        }
        Ok(dropped)
    }

    /// Whether a flush by a uid other than root's and the agent's own may go now: one per
    /// `UNPRIVILEGED_FLUSH_EVERY` (5 s) for all of them together.
    pub fn may_flush_unprivileged(&self) -> bool {
        let now = self.inner.clock.now();
        let mut last = self.inner.unprivileged_flush.lock();
        if last.is_some_and(|t| now < t + UNPRIVILEGED_FLUSH_EVERY) {
            return false;
        }
        *last = Some(now);
        true
    }

    /// Explains a lookup of `image` (no plugin run): the engine's sources, the captured pod
    /// credential of its repository, and a verdict.
    pub fn explain(
        &self,
        image: &str,
        service_account: Option<&credgate_engine::ServiceAccount>,
    ) -> Result<credgate_api::v1::ExplainResponse, credgate_engine::LookupError> {
        let engine = self.engine();
        let explained = engine.explain(&credgate_engine::LookupRequest {
            image,
            service_account,
            ..Default::default()
        })?;
        let now = self.inner.clock.wall();
        let mut answer = crate::explain::to_wire(&explained, now);
        for source in answer
            .sources
            .iter_mut()
            .filter(|s| s.kind == credgate_engine::SourceKind::DockerConfig.as_str())
        {
            if let Some(r) = self.inner.refusal.memory().docker_report(&source.name) {
                source.dropped_unix_ms = credgate_engine::clock::unix_ms(r.at);
                source.dropped_reason = format!(
                    "a registry refused an entry of it at a pull of {}: credgate does not change that file; update it",
                    r.image
                );
                answer.verdict.push_str(&format!(
                    "; docker config {} has an entry a registry refused ({})",
                    source.name, r.image
                ));
            }
        }
        if let Some(guard) = self.guard() {
            self.explain_guard(guard, image, &mut answer);
        }
        if let Some(proxy) = self.serving_proxy() {
            proxy.explain(&explained.image, &mut answer);
        }
        if let Some(c) = self
            .captured()
            .and_then(|c| c.for_repository(&explained.image))
        {
            answer.captured = true;
            answer.captured_namespace = c.namespace.clone();
            answer.captured_unix_ms = c.captured_ms;
            let prefix = format!("{}: ", explained.image);
            let rest = answer
                .verdict
                .strip_prefix(&prefix)
                .unwrap_or(&answer.verdict)
                .to_owned();
            answer.verdict = format!(
                "{}the pod credential the CRI proxy captured for the repository (namespace {}) comes first for the API and snapshotters, for this repository only, never for the kubelet or a registry host's docker helper (other namespaces' pods still pull with what the providers give); then {rest}",
                prefix,
                if c.namespace.is_empty() { "-" } else { &c.namespace },
            );
        }
        Ok(answer)
    }

    /// The guard's records of `image` and its decision for node-wide credentials.
    fn explain_guard(
        &self,
        guard: &Guard,
        image: &str,
        answer: &mut credgate_api::v1::ExplainResponse,
    ) {
        let Ok((name, _)) = crate::guard::normalize(image) else {
            return;
        };
        let Ok(store) = guard.store() else {
            answer.guard_node_wide_decision = "the guard's store cannot be read".into();
            return;
        };
        let mut first_ref = None;
        for record in store.records() {
            let Some(entry) = record.names.get(&name) else {
                continue;
            };
            first_ref.get_or_insert_with(|| record.image_ref.clone());
            let mut namespaces: Vec<&str> = entry
                .secrets
                .iter()
                .map(|s| s.coords.namespace.as_str())
                .collect();
            namespaces.sort_unstable();
            namespaces.dedup();
            answer
                .guard_record_summaries
                .push(credgate_api::v1::GuardRecordSummary {
                    image_ref: record.image_ref.clone(),
                    node_wide: entry.node_accessible,
                    secrets: u32::try_from(entry.secrets.len()).unwrap_or(u32::MAX),
                    secret_namespaces: namespaces.iter().map(|n| (*n).to_owned()).collect(),
                    service_accounts: u32::try_from(entry.service_accounts.len())
                        .unwrap_or(u32::MAX),
                });
            answer.guard_records.push(format!(
                "{}: node-wide {}; {} secret(s){}; {} service account(s)",
                record.image_ref,
                if entry.node_accessible { "yes" } else { "no" },
                entry.secrets.len(),
                if namespaces.is_empty() {
                    String::new()
                } else {
                    format!(" of {}", namespaces.join(", "))
                },
                entry.service_accounts.len()
            ));
        }
        if let Some(image_ref) = first_ref {
            if let Ok(c) = guard.check(
                image,
                &image_ref,
                crate::guard::Presence::OnNode,
                crate::guard::PullPolicy::IfNotPresent,
                &[crate::guard::CredentialIn::NodeWide],
            ) {
                answer.guard_node_wide_decision = format!(
                    "{} ({}): {}",
                    c.answer.as_str(),
                    c.reason.as_str(),
                    c.message
                );
            }
        }
    }

    /// The engine in use now.
    pub fn engine(&self) -> Arc<Engine> {
        self.inner.engine.load_full()
    }

    /// The engine in use at each moment: a reload swaps what it holds.
    pub fn engine_handle(&self) -> Arc<ArcSwap<Engine>> {
        self.inner.engine.clone()
    }

    pub fn renewer(&self) -> &Renewer {
        &self.inner.renewer
    }

    /// The image access guard, when enabled.
    pub fn guard(&self) -> Option<&Guard> {
        self.inner.guard.as_ref()
    }

    pub fn metrics(&self) -> &AgentMetrics {
        &self.inner.metrics
    }

    /// Which callers may use each service.
    pub fn callers(&self) -> &CallerAllowlist {
        &self.inner.callers
    }

    pub fn watch_send_timeout(&self) -> std::time::Duration {
        self.inner.watch_send_timeout
    }

    /// Every metric family, the engine's included.
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// The captured pull credentials, when the CRI proxy runs.
    pub fn captured(&self) -> Option<&Arc<crate::captured::Captured>> {
        self.inner.captured.as_ref()
    }

    /// Every task the agent starts, and their stop.
    pub fn tasks(&self) -> &crate::tasks::Tasks {
        &self.inner.tasks
    }

    /// Sets the gauges computed on demand (late renewals, the guard store's availability);
    /// called before each scrape.
    pub fn refresh_gauges(&self) {
        let m = &self.inner.metrics;
        m.tracked_refs_due
            .set(i64::try_from(self.inner.renewer.due_count()).unwrap_or(i64::MAX));
        let available = self.inner.guard.as_ref().is_none_or(|g| g.store().is_ok());
        m.guard_store_available.set(i64::from(available));
    }

    pub fn sources(&self) -> &Sources {
        &self.inner.sources
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    pub fn started(&self) -> SystemTime {
        self.inner.started
    }

    /// When the config in use was loaded.
    pub fn loaded(&self) -> SystemTime {
        *self.inner.loaded.lock()
    }

    /// Re-reads every source. On error the engine in use keeps serving.
    pub fn reload(&self) -> Result<Reloaded, SourceError> {
        let mut loaded_from = self.inner.reload.lock();
        // The same bytes as the running engine's: nothing to rebuild, and its caches stay.
        let fingerprint = self.inner.sources.fingerprint();
        if fingerprint.is_some() && fingerprint == *loaded_from {
            self.inner.metrics.reload(true);
            return Ok(Reloaded {
                identity: self.engine().config_identity().map(str::to_owned),
                changed: false,
            });
        }
        let built = self.inner.sources.build(
            Some(self.inner.engine_metrics.clone()),
            Some(self.inner.clock.clone()),
        );
        let engine = match built {
            Ok(e) => e,
            Err(e) => {
                self.inner.metrics.reload(false);
                return Err(e);
            }
        };
        let before = self.engine().config_identity().map(str::to_owned);
        let identity = engine.config_identity().map(str::to_owned);
        self.inner.engine.store(Arc::new(engine));
        self.inner.metrics.config_refused.set(0);
        *loaded_from = fingerprint;
        *self.inner.loaded.lock() = self.inner.clock.wall();
        self.inner.metrics.reload(true);
        self.inner.renewer.refresh_all();
        Ok(Reloaded {
            changed: before != identity,
            identity,
        })
    }

    /// [`Agent::reload`] on a blocking thread, logged (SIGHUP and the Reload RPC).
    pub async fn reload_logged(&self) -> Result<Reloaded, ReloadError> {
        let agent = self.clone();
        let reloaded = match self.tasks().spawn_blocking(move || agent.reload()).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                let msg = credgate_core::text::error_chain(&e);
                tracing::error!(error = %msg, "reload refused; the old config keeps serving");
                return Err(ReloadError::Refused(msg));
            }
            Err(_) => {
                tracing::error!("reload task failed");
                return Err(ReloadError::Task);
            }
        };
        tracing::info!(
            config = reloaded.identity.as_deref().unwrap_or("none"),
            changed = reloaded.changed,
            "provider config reloaded"
        );
        Ok(reloaded)
    }

    /// Starts the renewal loop, until the agent's tasks stop.
    pub fn spawn_renewal(&self) -> JoinHandle<()> {
        self.tasks().spawn(self.inner.renewer.clone().run())
    }
}
/// Why an `--allow-uids` value does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllowUidsError {
    #[error("{0:?}: expected SERVICE=UID[,UID...]")]
    Form(String),
    #[error("{0:?}: not a service (credentials, admin, image-access, service-account-identity, registry-mirror)")]
    Service(String),
    #[error("{0:?}: not a numeric uid")]
    Uid(String),
}
