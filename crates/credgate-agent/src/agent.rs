//! The agent's state: the engine in use (swapped whole on reload), the renewal service, and
//! the metric registry.

use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;
use credgate_core::renewal::RenewalPolicy;
use credgate_engine::clock::{Clock, SystemClock};
use credgate_engine::metrics::EngineMetrics;
use credgate_engine::Engine;
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;

use crate::control::Control;
use crate::explain::{Explainer, ProxySlot};
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

struct Inner {
    engine: Arc<ArcSwap<Engine>>,
    metrics: AgentMetrics,
    registry: Registry,
    renewer: Renewer,
    guard: Option<Guard>,
    clock: Arc<dyn Clock>,
    callers: CallerAllowlist,
    watch_send_timeout: std::time::Duration,
    started: SystemTime,
    /// Pull credentials captured by the CRI proxy, when it runs.
    captured: Option<Arc<crate::captured::Captured>>,
    /// Every task the agent starts.
    tasks: crate::tasks::Tasks,
    /// The sealed provider cache's writer.
    saver: crate::saver::Saver,
    /// Credentials registries refused: found, confirmed and acted on.
    refusal: Arc<crate::refusal::Refuser>,
    /// Reload and flush.
    control: Control,
    /// The CRI proxy's state: off until it serves; why it ended, when it ended early.
    proxy: ProxySlot,
}

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
        let control = Control::new(crate::control::Parts {
            sources: options.sources,
            engine: engine.clone(),
            engine_metrics,
            metrics: metrics.clone(),
            clock: clock.clone(),
            renewer: renewer.clone(),
            saver: saver.clone(),
            tasks: tasks.clone(),
            fingerprint,
            loaded: now,
        });
        Ok(Agent {
            inner: Arc::new(Inner {
                saver,
                refusal,
                control,
                proxy: ProxySlot::default(),
                engine,
                metrics,
                registry,
                renewer,
                guard,
                clock,
                started: now,
                captured: options.captured,
                tasks,
                callers: options.callers,
                watch_send_timeout: options.watch_send_timeout.unwrap_or(WATCH_SEND_TIMEOUT),
            }),
        })
    }

    /// Credentials registries refused: the service that finds, confirms and acts on them.
    pub fn refusal(&self) -> &Arc<crate::refusal::Refuser> {
        &self.inner.refusal
    }

    /// The sealed provider cache's writer (it writes nothing when the cache is off).
    pub fn saver(&self) -> &crate::saver::Saver {
        &self.inner.saver
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

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    pub fn started(&self) -> SystemTime {
        self.inner.started
    }

    /// Reload and flush: the operator's operations, a handle of their own.
    pub fn control(&self) -> &Control {
        &self.inner.control
    }

    /// The CRI proxy's state, which the composition root sets.
    pub fn proxy(&self) -> &ProxySlot {
        &self.inner.proxy
    }

    /// What `Explain` reads, as a handle of its own.
    pub fn explainer(&self) -> Explainer {
        Explainer {
            engine: self.inner.engine.clone(),
            clock: self.inner.clock.clone(),
            refusal: self.inner.refusal.clone(),
            guard: self.inner.guard.clone(),
            captured: self.inner.captured.clone(),
            proxy: self.inner.proxy.clone(),
        }
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
