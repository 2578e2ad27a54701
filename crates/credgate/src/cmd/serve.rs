//! `credgate serve`: the node agent. Reads the sources (never running a plugin), binds the
//! socket, starts renewal and metrics in the background, and serves until SIGTERM or SIGINT;
//! SIGHUP reloads the provider config.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use credgate_agent::socket::{self, SocketAccess};

use credgate_agent::guard::registry::RegistryOptions;
use credgate_agent::guard::GuardOptions;
use credgate_agent::{metrics, server, Agent, AgentOptions, CallerAllowlist};
use credgate_core::guard::{Allowlist, Policy};
use credgate_core::renewal::RenewalPolicy;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use crate::opts::ServeArgs;
use crate::Outcome;

/// `/var/lib/credgate` as root, `$XDG_STATE_HOME/credgate` (or `~/.local/state/credgate`)
/// otherwise.
fn default_state_dir() -> PathBuf {
    if credgate_api::is_root() {
        return PathBuf::from("/var/lib/credgate");
    }
    if let Some(dir) = std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir).join("credgate");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".local/state/credgate")
}

pub async fn run(args: ServeArgs) -> Result<Outcome> {
    // No core dumps and no ptrace by other processes of the same user: the agent's memory
    // holds credentials.
    if let Err(e) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        tracing::warn!(error = %e, "cannot mark the agent not dumpable");
    }
    let sources = super::get::sources(&args.sources)?;
    let renewal = RenewalPolicy {
        margin: args.renew_before,
        recheck: args.recheck_interval,
        grace: args.untracked_grace,
        ..RenewalPolicy::default()
    };
    let policy: Policy = args
        .image_pull_credentials_verification_policy
        .parse()
        .context("invalid --image-pull-credentials-verification-policy")?;
    let allowlist = Allowlist::parse(
        args.preloaded_images_verification_allowlist
            .iter()
            .map(String::as_str),
    )
    .map_err(|errors| {
        let list: Vec<String> = errors.iter().map(ToString::to_string).collect();
        anyhow::anyhow!(
            "invalid --preloaded-images-verification-allowlist: {}",
            list.join("; ")
        )
    })?;
    let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
    // A state directory someone else owns or can write (or a link to one) could hold a planted
    // key and forged records: the agent does not start on it. One that merely cannot be created
    // yet (a read-only or full disk) does not stop the agent: the guard reports it, fails safe
    // and tries again, and credentials keep being served meanwhile.
    match credgate_agent::state::state_dir(&state_dir) {
        Ok(()) => {}
        Err(e @ credgate_api::trust::TrustError::Io { .. }) => {
            tracing::error!(dir = %state_dir.display(), error = %e, "cannot set up the state directory");
        }
        Err(e) => return Err(anyhow::Error::new(e).context("refusing the state directory")),
    }
    let limits = limits(&args);
    let mut callers = CallerAllowlist::default();
    for (service, uids) in &args.allow_uids {
        callers.allow(*service, uids.iter().copied());
    }
    let agent = Agent::new(AgentOptions {
        sources,
        renewal,
        clock: None,
        guard: Some(GuardOptions {
            policy,
            allowlist,
            max_age: args.pull_record_max_age,
            state_dir: state_dir.clone(),
            registry: RegistryOptions {
                timeout: args.registry_timeout,
                insecure: args.insecure_registry.clone(),
            },
        }),
        callers,
        watch_send_timeout: Some(args.watch_send_timeout),
        saved_cache: args.persist_cache.then(|| state_dir.clone()),
    })?;
    let socket_path = args
        .socket
        .clone()
        .unwrap_or_else(credgate_api::default_socket_path);
    let listener = socket::bind(
        &socket_path,
        &SocketAccess {
            group: args.socket_group.clone(),
        },
    )
    .await?;
    let bound = socket::identity(&socket_path);
    // Plugins of an agent that was killed (SIGKILL, OOM) outlive it; this one ends them.
    tokio::task::spawn_blocking(|| {
        let n = credgate_engine::sweep::orphans();
        if n > 0 {
            tracing::warn!(
                processes = n,
                "killed plugin processes left running by an agent that is gone"
            );
        }
    });

    let (stop_tx, stop_rx) = watch::channel(false);
    let renewal_task = agent.spawn_renewal(stop_rx.clone());
    let saver = agent.spawn_saver(stop_rx.clone());
    if let Some(addr) = args.metrics_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for metrics on {addr}"))?;
        tracing::info!(addr = %listener.local_addr()?, "serving metrics at /metrics");
        let scraped = agent.clone();
        let render: metrics::Render = Arc::new(move || {
            scraped.refresh_gauges();
            metrics::render(scraped.registry())
        });
        let stop = stop_rx.clone();
        let counters = agent.metrics().clone();
        tokio::spawn(metrics::serve(
            listener,
            render,
            metrics::MetricsLimits::default(),
            counters,
            stop,
        ));
    }
    let mut cri_proxy = None;
    if let Some(path) = &args.cri_proxy_socket {
        let listener = socket::bind(path, &SocketAccess { group: None })
            .await
            .with_context(|| format!("cannot serve the CRI proxy on {}", path.display()))?;
        let runtime = credgate_agent::cri::endpoint_path(&args.cri_runtime_endpoint);
        let captured = Arc::new(
            credgate_agent::captured::Captured::open(&state_dir, args.captured_credential_max_age)
                .context("cannot keep captured pull credentials")?
                .with_clock(agent.clock().clone()),
        );
        agent.set_captured(captured.clone());
        let guard = agent.guard().cloned();
        tracing::info!(socket = %path.display(), runtime = %runtime.display(), "serving the CRI image-service proxy");
        let stop = stop_rx.clone();
        let options = credgate_agent::cri::ProxyOptions {
            runtime,
            captured: Some(captured),
            guard,
            limits: credgate_agent::listener::ListenerLimits {
                shutdown_timeout: limits.shutdown_timeout,
                ..credgate_agent::cri::default_limits()
            },
            check_every: args.captured_check_interval,
            registry: RegistryOptions {
                timeout: args.registry_timeout,
                insecure: args.insecure_registry.clone(),
            },
            metrics: agent.metrics().clone(),
            agent: agent.clone(),
        };
        let listener = listener.into_std()?;
        // Its own thread and single-threaded runtime: a proxied call's tasks (the kubelet's
        // connection, the call, the runtime's connection) wake each other on one thread
        // instead of across workers.
        let thread = std::thread::Builder::new()
            .name("cri-proxy".into())
            .spawn(move || -> std::io::Result<()> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async move {
                    let listener = tokio::net::UnixListener::from_std(listener)?;
                    credgate_agent::cri::serve(listener, options, stop).await;
                    Ok(())
                })
            })
            .context("cannot start the CRI proxy's thread")?;
        cri_proxy = Some((path.clone(), socket::identity(path), thread));
    }
    tokio::spawn(signals(agent.clone(), stop_tx)?);
    tracing::info!(
        socket = %socket_path.display(),
        state_dir = %state_dir.display(),
        config = agent.engine().config_identity().unwrap_or("none"),
        policy = %policy,
        "credgate agent serving"
    );
    // On a worker, not in this `block_on`: a connection is then accepted by the worker that
    // the listener's readiness woke, instead of that worker waking this thread to accept.
    let served = tokio::spawn(server::serve_with(agent, listener, limits, stop_rx)).await;
    socket::remove_if_ours(&socket_path, bound);
    if let Some((path, id, thread)) = cri_proxy {
        match tokio::task::spawn_blocking(move || thread.join()).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::error!(error = %e, "the CRI proxy failed"),
            _ => tracing::error!("the CRI proxy's thread panicked"),
        }
        socket::remove_if_ours(&path, id);
    }
    renewal_task.abort();
    // The last save of the provider answers, fsynced before the agent exits.
    if saver.await.is_err() {
        tracing::error!("the provider cache's saver failed");
    }
    served.context("the API server failed")?;
    tracing::info!("credgate agent stopped");
    Ok(Outcome::Yes)
}

/// Descriptors the agent keeps for itself beyond its connections: plugin pipes, the store,
/// registry connections, the metrics listener's own connections.
const RESERVED_DESCRIPTORS: usize = 256;

/// The API server's limits from the flags, the connection budget kept within the open-file
/// limit (raised to its hard maximum first).
fn limits(args: &ServeArgs) -> server::Limits {
    let nofile = credgate_agent::conn::raise_nofile_limit();
    // Every listener has a budget of its own, and together they fit: the API's is what the
    // metrics port, the CRI proxy and the reserve leave.
    let proxy = if args.cri_proxy_socket.is_some() {
        credgate_agent::cri::default_limits().max_connections
    } else {
        0
    };
    let room = usize::try_from(nofile)
        .unwrap_or(usize::MAX)
        .saturating_sub(
            RESERVED_DESCRIPTORS + metrics::MetricsLimits::default().max_connections + proxy,
        );
    let mut max_connections = args.max_connections.max(1);
    if max_connections > room {
        tracing::warn!(
            wanted = max_connections,
            allowed = room.max(1),
            open_file_limit = nofile,
            "--max-connections lowered to fit the open-file limit"
        );
        max_connections = room.max(1);
    }
    server::Limits {
        max_connections,
        max_connections_per_uid: args.max_connections_per_uid.clamp(1, max_connections),
        idle_timeout: args.idle_timeout,
        shutdown_timeout: args.shutdown_timeout,
        ..server::Limits::default()
    }
}

/// SIGHUP reloads; SIGTERM and SIGINT start a graceful stop.
fn signals(
    agent: Agent,
    stop: watch::Sender<bool>,
) -> Result<impl std::future::Future<Output = ()>> {
    let mut hup = signal(SignalKind::hangup()).context("cannot handle SIGHUP")?;
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    Ok(async move {
        loop {
            tokio::select! {
                _ = hup.recv() => {
                    let agent = agent.clone();
                    match tokio::task::spawn_blocking(move || agent.reload()).await {
                        Ok(Ok(r)) => tracing::info!(config = r.identity.as_deref().unwrap_or("none"), changed = r.changed, "provider config reloaded"),
                        Ok(Err(e)) => tracing::error!(error = %server::error_chain(&e), "reload refused; the old config keeps serving"),
                        Err(_) => tracing::error!("reload task failed"),
                    }
                }
                _ = term.recv() => break,
                _ = int.recv() => break,
            }
        }
        tracing::info!("stopping: no new calls, finishing those in flight");
        let _ = stop.send(true);
    })
}
