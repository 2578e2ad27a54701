//! The composition root: an agent with everything `credgate serve` runs around it (the API
//! socket, renewal, the saver of the provider cache, metrics, the CRI proxy and its thread, the
//! sweep of a dead agent's plugins), each task and thread owned here and stopped and joined by
//! [`Node::run`]; the guard's store is closed last. A binary parses its flags into
//! [`NodeOptions`], builds a [`Node`] and runs it until the stop signal it holds is sent.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::guard::registry::RegistryOptions;
use crate::socket::{self, SocketAccess, SocketError, SocketId};
use crate::{metrics, server, Agent, AgentOptions, SourceError};

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
}

/// How to run a node agent.
pub struct NodeOptions {
    pub agent: AgentOptions,
    /// The state directory (node key, guard records, sealed files).
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub socket_access: SocketAccess,
    pub limits: server::Limits,
    pub metrics_addr: Option<SocketAddr>,
    pub proxy: Option<ProxyConfig>,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
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
    stop: watch::Sender<bool>,
    stopped: watch::Receiver<bool>,
    api: (tokio::net::UnixListener, PathBuf, Option<SocketId>),
    limits: server::Limits,
    renewal: JoinHandle<()>,
    saver: JoinHandle<()>,
    sweep: JoinHandle<()>,
    metrics: Option<JoinHandle<()>>,
    proxy: Option<(
        PathBuf,
        Option<SocketId>,
        std::thread::JoinHandle<std::io::Result<()>>,
    )>,
}

impl Node {
    /// Builds the agent (never running a plugin), binds every socket and starts every task.
    pub async fn start(options: NodeOptions) -> Result<Node, NodeError> {
        if options.agent.saved_cache.is_none() {
            match crate::saved_cache::SavedCache::discard(&options.state_dir) {
                Ok(true) => tracing::info!("the provider cache is not kept (--persist-cache=false): the sealed cache of an earlier run was removed"),
                Ok(false) => {}
                Err(error) => {
                    return Err(NodeError::Discard {
                        path: options.state_dir.join("cache.sealed"),
                        error,
                    })
                }
            }
        }
        let agent = Agent::new(options.agent)?;
        let listener = socket::bind(&options.socket, &options.socket_access)
            .await
            .map_err(NodeError::Socket)?;
        let bound = socket::identity(&options.socket);
        // Plugins of an agent that was killed (SIGKILL, OOM) outlive it; this one ends them.
        let sweep = tokio::task::spawn_blocking(|| {
            let n = credgate_engine::sweep::orphans();
            if n > 0 {
                tracing::warn!(
                    processes = n,
                    "killed plugin processes left running by an agent that is gone"
                );
            }
        });
        let (stop, stopped) = watch::channel(false);
        let renewal = agent.spawn_renewal(stopped.clone());
        let saver = agent.spawn_saver(stopped.clone());
        let metrics = match options.metrics_addr {
            Some(addr) => Some(Self::metrics(&agent, addr, stopped.clone()).await?),
            None => None,
        };
        let proxy = match &options.proxy {
            Some(p) => Some(
                Self::proxy(
                    &agent,
                    p,
                    &options.state_dir,
                    &options.limits,
                    stopped.clone(),
                )
                .await?,
            ),
            None => None,
        };
        Ok(Node {
            agent,
            stop,
            stopped,
            api: (listener, options.socket, bound),
            limits: options.limits,
            renewal,
            saver,
            sweep,
            metrics,
            proxy,
        })
    }

    async fn metrics(
        agent: &Agent,
        addr: SocketAddr,
        stopped: watch::Receiver<bool>,
    ) -> Result<JoinHandle<()>, NodeError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|error| NodeError::Metrics { addr, error })?;
        let local = listener.local_addr().unwrap_or(addr);
        tracing::info!(addr = %local, "serving metrics at /metrics");
        let scraped = agent.clone();
        let render: metrics::Render = Arc::new(move || {
            scraped.refresh_gauges();
            metrics::render(scraped.registry())
        });
        Ok(tokio::spawn(metrics::serve(
            listener,
            render,
            metrics::MetricsLimits::default(),
            agent.metrics().clone(),
            stopped,
        )))
    }

    /// The CRI proxy on its own thread and single-threaded runtime: a proxied call's tasks
    /// (the kubelet's connection, the call, the runtime's connection) wake each other on one
    /// thread instead of across workers.
    async fn proxy(
        agent: &Agent,
        config: &ProxyConfig,
        state_dir: &std::path::Path,
        limits: &server::Limits,
        stopped: watch::Receiver<bool>,
    ) -> Result<
        (
            PathBuf,
            Option<SocketId>,
            std::thread::JoinHandle<std::io::Result<()>>,
        ),
        NodeError,
    > {
        let failed = |error: String| NodeError::Proxy {
            path: config.socket.clone(),
            error,
        };
        let listener = socket::bind(&config.socket, &SocketAccess { group: None })
            .await
            .map_err(|e| failed(e.to_string()))?;
        let runtime = crate::cri::endpoint_path(&config.runtime_endpoint);
        let captured = if config.capture {
            let captured = Arc::new(
                crate::captured::Captured::open(state_dir, config.captured_max_age)
                    .map_err(|e| failed(format!("cannot keep captured pull credentials: {e}")))?
                    .with_clock(agent.clock().clone()),
            );
            agent.set_captured(captured.clone());
            Some(captured)
        } else {
            match crate::captured::Captured::discard(state_dir) {
                Ok(true) => tracing::info!("capture is off: the captured pull credentials of an earlier run were removed"),
                Ok(false) => {}
                Err(e) => return Err(failed(format!("capture is off, but the captured pull credentials of an earlier run cannot be removed: {e}"))),
            }
            None
        };
        tracing::info!(socket = %config.socket.display(), runtime = %runtime.display(), "serving the CRI image-service proxy");
        agent.set_proxy_running();
        let options = crate::cri::ProxyOptions {
            runtime,
            captured,
            guard: agent.guard().cloned(),
            limits: crate::listener::ListenerLimits {
                shutdown_timeout: limits.shutdown_timeout,
                ..crate::cri::default_limits()
            },
            check_every: config.check_every,
            registry: config.registry.clone(),
            agent: agent.clone(),
        };
        let listener = listener.into_std().map_err(|e| failed(e.to_string()))?;
        let thread = std::thread::Builder::new()
            .name("cri-proxy".into())
            .spawn(move || -> std::io::Result<()> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async move {
                    let listener = tokio::net::UnixListener::from_std(listener)?;
                    crate::cri::serve(listener, options, stopped).await;
                    Ok(())
                })
            })
            .map_err(|e| failed(format!("cannot start its thread: {e}")))?;
        Ok((
            config.socket.clone(),
            socket::identity(&config.socket),
            thread,
        ))
    }

    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// What stops the node: send `true` (SIGTERM, SIGINT).
    pub fn stopper(&self) -> watch::Sender<bool> {
        self.stop.clone()
    }

    /// Serves until the stop is sent; then every part finishes within its deadline, in order:
    /// the API and the proxy stop accepting and finish their calls, renewal stops, the
    /// provider cache is saved a last time, metrics stop, the guard's store is closed. Sockets
    /// are removed when they are still the ones bound.
    pub async fn run(self) -> Result<(), tokio::task::JoinError> {
        let Node {
            agent,
            stop,
            stopped,
            api: (listener, socket_path, bound),
            limits,
            renewal,
            saver,
            sweep,
            metrics,
            proxy,
        } = self;
        let limits_shutdown = limits.shutdown_timeout;
        // On a worker, not in the caller's `block_on`: a connection is then accepted by the
        // worker that the listener's readiness woke.
        let served =
            tokio::spawn(server::serve_with(agent.clone(), listener, limits, stopped)).await;
        let _ = stop.send(true);
        socket::remove_if_ours(&socket_path, bound);
        if let Some((path, id, thread)) = proxy {
            match tokio::task::spawn_blocking(move || thread.join()).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::error!(error = %e, "the CRI proxy failed"),
                _ => tracing::error!("the CRI proxy's thread panicked"),
            }
            socket::remove_if_ours(&path, id);
        }
        // Renewal stops at its next step; a plugin run in flight is not waited for past the
        // shutdown deadline.
        let mut renewal = renewal;
        if tokio::time::timeout(limits_shutdown, &mut renewal)
            .await
            .is_err()
        {
            renewal.abort();
            let _ = renewal.await;
        }
        // The last save of the provider answers, fsynced before the agent exits.
        if saver.await.is_err() {
            tracing::error!("the provider cache's saver failed");
        }
        if let Some(m) = metrics {
            let _ = m.await;
        }
        let _ = sweep.await;
        if let Some(store) = agent.guard().and_then(|g| g.store().ok()) {
            store.close().await;
        }
        served
    }
}
