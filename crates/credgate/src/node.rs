//! The composition root: an agent with everything `credgate serve` runs around it (the API
//! socket, renewal, the saver of the provider cache, metrics, the CRI proxy of `credgate-cri`
//! and the registry mirror of `credgate-mirror`, each given its handles on the agent, the sweep
//! of a dead agent's plugins, signals). Every task is the agent's ([`credgate_agent::tasks`]),
//! stopped by its one token and waited for by [`Node::run`] under the shutdown deadline; the
//! guard's store is closed last. A binary parses its flags into [`NodeOptions`], builds a
//! [`Node`] and runs it until SIGTERM or SIGINT ([`Node::run_until_signalled`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use credgate_agent::captured::Captured;
use credgate_agent::guard::registry::RegistryOptions;
use credgate_agent::socket::{self, SocketAccess, SocketError, SocketId};
use credgate_agent::{metrics, scrape, server, Agent, AgentOptions, SourceError};

/// The CRI image-service proxy, when it runs.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub socket: PathBuf,
    /// `unix:///run/containerd/containerd.sock` or a bare path.
    pub runtime_endpoint: String,
    /// Keep the pull credentials the proxy sees (captured credentials); the guard's records
    /// and the pull log do not depend on it.
    pub capture: bool,
    pub captured_max_age: Option<Duration>,
    pub check_every: Duration,
    pub registry: RegistryOptions,
    /// The images the node keeps present, pulled on its own behalf (the runtime's sandbox
    /// image, the operator's kept images: decision 0022), and how often they are checked.
    pub node_images: Vec<credgate_cri::node_images::NodeImage>,
    pub keep_every: Duration,
    /// The most of a `ListImages` answer the proxy reads for itself
    /// ([`credgate_cri::MAX_LIST_MESSAGE`] unless a test lowers it).
    pub list_limit: usize,
    /// What the proxy may change in a pull (fill, credential scope); off by default.
    pub policy: credgate_cri::policy::ProxyPolicy,
}

/// The node's registry mirror (`credgate-mirror`), when it runs.
#[derive(Debug, Clone)]
pub struct MirrorConfig {
    /// A loopback address.
    pub addr: SocketAddr,
    pub registries: Vec<String>,
    /// Registries served on an address of their own too, where a read that names no registry
    /// is that registry's.
    pub own: Vec<(String, SocketAddr)>,
    pub registry: RegistryOptions,
}

/// How to run a node agent.
pub struct NodeOptions {
    pub agent: AgentOptions,
    /// The state directory (node key, guard records, sealed files).
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub socket_access: SocketAccess,
    /// The API's limits; its connection budget is lowered to what the open-file limit leaves.
    pub limits: server::Limits,
    pub metrics_addr: Option<SocketAddr>,
    pub proxy: Option<ProxyConfig>,
    /// The node's registry mirror, when it runs.
    pub mirror: Option<MirrorConfig>,
    /// The sockets a service manager handed over (none: each is bound).
    pub handed: crate::activation::Handed,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("refusing the state directory")]
    StateDir(#[source] credgate_api::trust::TrustError),
    #[error("the state directory is in use")]
    Locked(#[source] credgate_agent::state::LockError),
    #[error("cannot build the agent")]
    Agent(#[from] SourceError),
    #[error("cannot serve the API")]
    Socket(#[source] SocketError),
    #[error("cannot listen for metrics on {addr}: {error}")]
    Metrics {
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error("cannot serve the CRI proxy on {path}: {error}")]
    Proxy { path: PathBuf, error: String },
    #[error("cannot serve the registry mirror")]
    Mirror(#[source] credgate_mirror::MirrorError),
    #[error("refusing the sockets the service manager handed over")]
    Handed(#[source] crate::activation::ActivationError),
    #[error(
        "the sealed provider cache is off, but {path} of an earlier run cannot be removed: {error}"
    )]
    Discard {
        path: PathBuf,
        error: std::io::Error,
    },
}

/// A running node agent.
pub struct Node {
    agent: Agent,
    api: (tokio::net::UnixListener, PathBuf, Option<SocketId>),
    limits: server::Limits,
    proxy: Option<(PathBuf, Option<SocketId>)>,
    /// Held until the node has stopped (the guard's store closed last): no second agent
    /// uses the state directory meanwhile.
    lock: Option<credgate_agent::state::StateLock>,
}

/// Descriptors the agent keeps for itself beyond its listeners' connections: plugin pipes, the
/// store, the guard's and the confirmations' registry connections.
const RESERVED_DESCRIPTORS: usize = 256;

/// Descriptors the other listeners may hold: the metrics listener's connections, the proxy's
/// (each caller connection with its own to the runtime) and the mirror's on each of its
/// addresses (each with one to the registry it reads from).
fn others_descriptors(proxy: bool, mirror: Option<&MirrorConfig>) -> usize {
    let proxy = match proxy {
        true => 2 * credgate_cri::default_limits().max_connections,
        false => 0,
    };
    let mirror = mirror.map_or(0, |m| {
        (1 + m.own.len()) * 2 * credgate_mirror::default_limits().max_connections
    });
    scrape::MetricsLimits::default().max_connections + proxy + mirror
}

/// `limits` with the API's connection budget fitting the open-file limit (raised to its hard
/// maximum first): every listener has a budget of its own, and together they fit.
fn fit_open_files(mut limits: server::Limits, others: usize) -> server::Limits {
    let nofile = credgate_listener::conn::raise_nofile_limit();
    let room = usize::try_from(nofile)
        .unwrap_or(usize::MAX)
        .saturating_sub(RESERVED_DESCRIPTORS + others);
    let wanted = limits.max_connections.max(1);
    if wanted > room {
        tracing::warn!(
            wanted,
            allowed = room.max(1),
            open_file_limit = nofile,
            "--max-connections lowered to fit the open-file limit"
        );
    }
    limits.max_connections = wanted.min(room.max(1));
    limits.max_connections_per_uid = limits
        .max_connections_per_uid
        .clamp(1, limits.max_connections);
    limits
}

/// Creates the state directory when it is absent. One someone else owns or can write (or a
/// link to one) could hold a planted key and forged records: the node does not start on it.
/// One that merely cannot be created yet (a read-only or full disk) does not stop it: the
/// guard reports it, fails safe and tries again, and credentials keep being served meanwhile.
/// The directory is then locked for this agent before anything in it is read or written: a
/// second agent on it (a forgotten unit beside a DaemonSet) stops here, writing nothing.
fn check_state_dir(dir: &Path) -> Result<Option<credgate_agent::state::StateLock>, NodeError> {
    match credgate_agent::state::state_dir(dir) {
        Ok(()) => {}
        Err(e @ credgate_api::trust::TrustError::Io { .. }) => {
            tracing::error!(dir = %dir.display(), error = %e, "cannot set up the state directory");
            return Ok(None);
        }
        Err(e) => return Err(NodeError::StateDir(e)),
    }
    match credgate_agent::state::lock(dir) {
        Ok(lock) => Ok(Some(lock)),
        Err(e @ credgate_agent::state::LockError::Io { .. }) => {
            tracing::error!(dir = %dir.display(), error = %credgate_core::text::error_chain(&e), "cannot lock the state directory");
            Ok(None)
        }
        Err(e) => Err(NodeError::Locked(e)),
    }
}

/// The captured pull credentials when the proxy keeps them; otherwise those of an earlier run
/// are removed.
fn open_captured(
    proxy: Option<&ProxyConfig>,
    state_dir: &Path,
    clock: &Arc<dyn credgate_engine::clock::Clock>,
) -> Result<Option<Arc<Captured>>, NodeError> {
    let Some(config) = proxy else {
        return Ok(None);
    };
    let failed = |error: String| NodeError::Proxy {
        path: config.socket.clone(),
        error,
    };
    if config.capture {
        let captured = Captured::open(state_dir, config.captured_max_age)
            .map_err(|e| failed(format!("cannot keep captured pull credentials: {e}")))?
            .with_clock(clock.clone());
        return Ok(Some(Arc::new(captured)));
    }
    match Captured::discard(state_dir) {
        Ok(true) => tracing::info!(
            "capture is off: the captured pull credentials of an earlier run were removed"
        ),
        Ok(false) => {}
        Err(e) => return Err(failed(format!("capture is off, but the captured pull credentials of an earlier run cannot be removed: {e}"))),
    }
    Ok(None)
}

/// What the proxy tells the agent's `Admin` service: the seam between the two crates is
/// crossed here, in the composition root, and nowhere else.
struct ProxyView(credgate_cri::Context);

impl credgate_agent::explain::ProxyView for ProxyView {
    fn explain(&self, image: &str, answer: &mut credgate_api::v1::ExplainResponse) {
        self.0.explain(image, answer);
    }

    fn pulls(&self, repository: Option<&str>) -> Vec<credgate_api::v1::Pull> {
        self.0.list_pulls(repository)
    }

    fn node_images(&self) -> Vec<credgate_api::v1::NodeImageStatus> {
        self.0.node_images_status()
    }
}

impl Node {
    /// Builds the agent (never running a plugin), binds every socket and starts every task;
    /// returns once the CRI proxy, when configured, serves.
    pub async fn start(mut options: NodeOptions) -> Result<Node, NodeError> {
        let lock = check_state_dir(&options.state_dir)?;
        if options.agent.saved_cache.is_none() {
            let _ = credgate_agent::memory::MemoryFile::discard(&options.state_dir);
            match credgate_agent::saved_cache::SavedCache::discard(&options.state_dir) {
                Ok(true) => tracing::info!("the provider cache is not kept (--no-persist-cache): the sealed cache of an earlier run was removed"),
                Ok(false) => {}
                Err(error) => {
                    return Err(NodeError::Discard {
                        path: options.state_dir.join("cache.sealed"),
                        error,
                    })
                }
            }
        }
        let clock = options
            .agent
            .clock
            .get_or_insert_with(|| Arc::new(credgate_engine::clock::SystemClock::new()))
            .clone();
        options.agent.captured = open_captured(options.proxy.as_ref(), &options.state_dir, &clock)?;
        let limits = fit_open_files(
            options.limits,
            others_descriptors(options.proxy.is_some(), options.mirror.as_ref()),
        );
        // The proxy's families are registered beside the agent's whether it runs or not: the
        // alert rules and the dashboard read them.
        let proxy_metrics = credgate_cri::metrics::ProxyMetrics::default();
        options.agent.also_register = Some(Arc::new({
            let m = proxy_metrics.clone();
            move |r| m.register(r)
        }));
        let agent = Agent::new(options.agent)?;
        let mut handed = options.handed;
        let (listener, bound) = match handed
            .take("api", &options.socket, "--socket")
            .map_err(NodeError::Handed)?
        {
            // The service manager's: it stays when this process goes, never removed.
            Some(inherited) => (
                tokio::net::UnixListener::from_std(inherited).map_err(|source| {
                    NodeError::Socket(SocketError::Io {
                        path: options.socket.clone(),
                        source,
                    })
                })?,
                None,
            ),
            None => {
                let listener = socket::bind(&options.socket, &options.socket_access)
                    .await
                    .map_err(NodeError::Socket)?;
                (listener, socket::identity(&options.socket))
            }
        };
        // Plugins of an agent that was killed (SIGKILL, OOM) outlive it; this one ends them.
        agent.tasks().spawn_blocking(|| {
            let n = credgate_engine::sweep::orphans();
            if n > 0 {
                tracing::warn!(
                    processes = n,
                    "killed plugin processes left running by an agent that is gone"
                );
            }
        });
        agent.spawn_renewal();
        agent.saver().spawn();
        if let Some(addr) = options.metrics_addr {
            Self::metrics(&agent, addr).await?;
        }
        let proxy = match &options.proxy {
            Some(p) => {
                let inherited = handed
                    .take("cri", &p.socket, "--cri-proxy-socket")
                    .map_err(NodeError::Handed)?;
                Some(Self::proxy(&agent, proxy_metrics, p, &limits, inherited).await?)
            }
            None => None,
        };
        if let Some(m) = &options.mirror {
            Self::mirror(&agent, m).await?;
        }
        for socket in handed.left() {
            tracing::warn!(socket = %socket, "a socket was handed over that no flag serves (the CRI proxy's needs --cri-proxy-socket): left unserved");
        }
        Ok(Node {
            agent,
            api: (listener, options.socket, bound),
            limits,
            proxy,
            lock,
        })
    }

    async fn metrics(agent: &Agent, addr: SocketAddr) -> Result<(), NodeError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|error| NodeError::Metrics { addr, error })?;
        let local = listener.local_addr().unwrap_or(addr);
        tracing::info!(addr = %local, "serving metrics at /metrics");
        let scraped = agent.clone();
        let render: scrape::Render = Arc::new(move || {
            scraped.refresh_gauges();
            metrics::render(scraped.registry())
        });
        agent.tasks().spawn(scrape::serve(
            listener,
            render,
            scrape::MetricsLimits::default(),
            agent.metrics().clone(),
            agent.tasks().token().clone(),
        ));
        Ok(())
    }

    /// The registry mirror ([`credgate_mirror::serve`]) on its address and on each registry's
    /// own: tasks of the agent's. Every address is bound before any serves.
    async fn mirror(agent: &Agent, config: &MirrorConfig) -> Result<(), NodeError> {
        let mut listeners = vec![(config.addr, config.registries.clone())];
        for (registry, addr) in &config.own {
            // Its own first: the default of a read that names none.
            let mut registries = vec![registry.clone()];
            registries.extend(config.registries.iter().filter(|r| *r != registry).cloned());
            listeners.push((*addr, registries));
        }
        let mut bound = Vec::with_capacity(listeners.len());
        for (addr, registries) in listeners {
            let listener = credgate_mirror::bind(addr)
                .await
                .map_err(NodeError::Mirror)?;
            bound.push((listener, registries));
        }
        let context = credgate_mirror::Context {
            engine: agent.engine_handle(),
            captured: agent.captured().cloned(),
            refusal: agent.refusal().clone(),
            metrics: agent.metrics().clone(),
            callers: agent.callers().clone(),
            clock: agent.clock().clone(),
        };
        for (listener, registries) in &bound {
            let local = listener.local_addr().unwrap_or(config.addr);
            tracing::info!(addr = %local, registries = ?registries, "serving the registry mirror");
        }
        let options = credgate_mirror::MirrorOptions {
            registry: config.registry.clone(),
            limits: credgate_mirror::default_limits(),
        };
        let stop = agent.tasks().token().clone();
        agent.tasks().spawn(async move {
            if let Err(e) = credgate_mirror::serve(bound, context, options, stop).await {
                tracing::error!(error = %e, "the registry mirror stopped");
            }
        });
        Ok(())
    }

    /// The CRI proxy ([`credgate_cri::start`]). Returns once it serves; a task of the agent's
    /// waits for its thread and logs when it ends early.
    async fn proxy(
        agent: &Agent,
        metrics: credgate_cri::metrics::ProxyMetrics,
        config: &ProxyConfig,
        limits: &server::Limits,
        inherited: Option<std::os::unix::net::UnixListener>,
    ) -> Result<(PathBuf, Option<SocketId>), NodeError> {
        let failed = |error: String| NodeError::Proxy {
            path: config.socket.clone(),
            error,
        };
        let (listener, id) = match inherited {
            Some(l) => (l, None),
            None => {
                let l = socket::bind(&config.socket, &SocketAccess { group: None })
                    .await
                    .map_err(|e| failed(e.to_string()))?;
                let l = l.into_std().map_err(|e| failed(e.to_string()))?;
                (l, socket::identity(&config.socket))
            }
        };
        let runtime = credgate_cri::endpoint_path(&config.runtime_endpoint);
        tracing::info!(socket = %config.socket.display(), runtime = %runtime.display(), "serving the CRI image-service proxy");
        let context = credgate_cri::Context {
            clock: agent.clock().clone(),
            metrics,
            connections: agent.metrics().connections.clone(),
            engine: agent.engine_handle(),
            refusal: agent.refusal().clone(),
            pulls: Arc::default(),
            node_images: Arc::default(),
            policy: config.policy.clone(),
        };
        let options = credgate_cri::ProxyOptions {
            runtime,
            captured: agent.captured().cloned(),
            guard: agent.guard().cloned(),
            limits: credgate_listener::ListenerLimits {
                shutdown_timeout: limits.shutdown_timeout,
                ..credgate_cri::default_limits()
            },
            check_every: config.check_every,
            registry: config.registry.clone(),
            context: context.clone(),
            node_images: config.node_images.clone(),
            keep_every: config.keep_every,
            list_limit: config.list_limit,
            capture_wait: credgate_cri::CAPTURE_WAIT,
        };
        let thread = credgate_cri::start(listener, options, agent.tasks().token().clone())
            .await
            .map_err(|e| failed(credgate_core::text::error_chain(&e)))?;
        agent.proxy().set_running(Arc::new(ProxyView(context)));
        let stopping = agent.tasks().token().clone();
        let watched = agent.proxy().clone();
        agent.tasks().spawn_blocking(move || {
            let ended = thread.join();
            let why = match ended {
                Ok(Ok(())) if stopping.is_cancelled() => return,
                Ok(Ok(())) => "it stopped while the agent serves".to_owned(),
                Ok(Err(e)) => format!("it failed: {e}"),
                Err(_) => "its thread panicked".to_owned(),
            };
            tracing::error!(why = %why, "the CRI proxy ended: the kubelet's image calls fail until the agent is restarted");
            watched.set_ended(why);
        });
        Ok((config.socket.clone(), id))
    }

    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// [`Node::run`] until SIGTERM or SIGINT; SIGHUP reloads the provider config meanwhile.
    pub async fn run_until_signalled(self) -> std::io::Result<()> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = signal(SignalKind::hangup())?;
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let agent = self.agent.clone();
        let stop = agent.tasks().token().clone();
        self.agent.tasks().spawn(async move {
            loop {
                tokio::select! {
                    _ = hup.recv() => { let _ = agent.control().reload_logged().await; }
                    _ = term.recv() => break,
                    _ = int.recv() => break,
                    () = stop.cancelled() => return,
                }
            }
            tracing::info!("stopping: no new calls, finishing those in flight");
            agent.tasks().stop();
        });
        self.run().await;
        Ok(())
    }

    /// Serves until the agent's tasks are told to stop; then every part finishes within the
    /// shutdown deadline: the API and the proxy stop accepting and finish their calls, renewal
    /// stops (a plugin run in flight is not waited for past the deadline), the provider cache
    /// is saved a last time, metrics stop, the guard's store is closed. Sockets are removed
    /// when they are still the ones bound.
    pub async fn run(self) {
        let Node {
            agent,
            api: (listener, socket_path, bound),
            limits,
            proxy,
            lock,
        } = self;
        let deadline = limits.shutdown_timeout;
        // On a worker, not in the caller's `block_on`: a connection is then accepted by the
        // worker that the listener's readiness woke.
        let stop = agent.tasks().token().clone();
        let _ = agent
            .tasks()
            .spawn(server::serve_with(agent.clone(), listener, limits, stop))
            .await;
        // The API ends on the stop, or on a panic: either way everything else stops too.
        agent.tasks().stop();
        if bound.is_some() {
            socket::remove_if_ours(&socket_path, bound);
        }
        // The saver's last write runs after the API drained; the deadline bounds the rest.
        if !agent.tasks().wait(deadline + Duration::from_secs(1)).await {
            // Not ended here: they are dropped with the runtime, which the process shuts down
            // with a deadline of its own (a blocking one, a plugin's run, is not waited for).
            tracing::warn!(
                tasks = agent.tasks().len(),
                "tasks still running at the shutdown deadline: the process exits without waiting for them"
            );
        }
        // A socket the service manager handed over (no id) stays: the next process serves it.
        if let Some((path, id @ Some(_))) = proxy {
            socket::remove_if_ours(&path, id);
        }
        if let Some(store) = agent.guard().and_then(|g| g.store().ok()) {
            store.close().await;
        }
        drop(lock);
    }
}

#[cfg(test)]
mod tests {
    use super::NodeError;
    use credgate_agent::socket::SocketError;
    use credgate_agent::SourceError;

    /// A node's error says what failed and leaves the why to its source: printed as a chain,
    /// nothing is said twice.
    #[test]
    fn node_errors_never_repeat_their_cause() {
        let untrusted = credgate_api::trust::TrustError::Io {
            path: "/x".into(),
            error: std::io::Error::other("disk on fire"),
        };
        let errors: Vec<Box<dyn std::error::Error>> = vec![
            Box::new(NodeError::Socket(SocketError::Untrusted(untrusted))),
            Box::new(NodeError::Agent(SourceError::NoBinDir)),
        ];
        for e in &errors {
            assert_eq!(credgate_core::text::repeated_cause(&**e), None, "{e}");
        }
    }
}
