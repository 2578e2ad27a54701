//! `credgate serve`: the node agent. Reads the sources (never running a plugin), binds the
//! socket, starts renewal and metrics in the background, and serves until SIGTERM or SIGINT;
//! SIGHUP reloads the provider config.

use std::path::PathBuf;

use anyhow::{Context, Result};
use credgate_agent::socket::SocketAccess;

use credgate_agent::guard::registry::RegistryOptions;
use credgate_agent::guard::GuardOptions;
use credgate_agent::node::{Node, NodeError, NodeOptions, ProxyConfig};
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
    // Only unix sockets are the runtime's (containerd, CRI-O): a TCP endpoint would carry
    // pull secrets in the clear.
    if let Some((scheme, _)) = args
        .cri_runtime_endpoint
        .split_once("://")
        .filter(|(scheme, _)| *scheme != "unix")
    {
        return Err(crate::usage(format!(
            "invalid --cri-runtime-endpoint: {scheme}:// is not supported; give unix:///PATH or a path"
        )));
    }
    let sources = super::get::sources(&args.sources)?;
    let pull_policy = credgate_agent::cri::policy::PullPolicy::new(
        &args.cri_proxy_fill,
        args.cri_proxy_scope_credentials,
        &args.cri_proxy_trusted_mirror,
        args.cri_proxy_hosts_dir.clone(),
    )
    .map_err(|e| crate::usage(format!("invalid {}", credgate_core::text::error_chain(&e))))?;
    let renewal = RenewalPolicy {
        margin: args.renew_before,
        recheck: args.recheck_interval,
        grace: args.untracked_grace,
        ..RenewalPolicy::default()
    };
    let policy: Policy = args
        .image_pull_credentials_verification_policy
        .parse()
        .map_err(|e| {
            crate::usage(format!(
                "invalid --image-pull-credentials-verification-policy: {e}"
            ))
        })?;
    let allowlist = Allowlist::parse(
        args.preloaded_images_verification_allowlist
            .iter()
            .map(String::as_str),
    )
    .map_err(|errors| {
        let list: Vec<String> = errors.iter().map(ToString::to_string).collect();
        crate::usage(format!(
            "invalid --preloaded-images-verification-allowlist: {}",
            list.join("; ")
        ))
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
    let registry = RegistryOptions {
        timeout: args.registry_timeout,
        insecure: args.insecure_registry.clone(),
    };
    let mut callers = CallerAllowlist::default();
    for (service, uids) in &args.allow_uids {
        callers.allow(*service, uids.iter().copied());
    }
    let options = NodeOptions {
        agent: AgentOptions {
            sources,
            renewal,
            clock: None,
            guard: Some(GuardOptions {
                policy,
                allowlist,
                max_age: args.pull_record_max_age,
                state_dir: state_dir.clone(),
                registry: registry.clone(),
            }),
            callers,
            watch_send_timeout: Some(args.watch_send_timeout),
            saved_cache: args.persist_cache.then(|| state_dir.clone()),
            pull_policy,
        },
        state_dir: state_dir.clone(),
        socket: args
            .socket
            .clone()
            .unwrap_or_else(credgate_api::default_socket_path),
        socket_access: SocketAccess {
            group: args.socket_group.clone(),
        },
        limits,
        metrics_addr: args.metrics_addr,
        proxy: args.cri_proxy_socket.clone().map(|socket| ProxyConfig {
            socket,
            runtime_endpoint: args.cri_runtime_endpoint.clone(),
            capture: args.cri_proxy_capture,
            captured_max_age: args.captured_credential_max_age,
            check_every: args.captured_check_interval,
            registry,
        }),
    };
    let socket_path = options.socket.clone();
    let node = Node::start(options).await.map_err(|e| match e {
        // A bad config reads as it always did: the config's own error, not "cannot build".
        NodeError::Agent(e) => anyhow::Error::new(e),
        e => anyhow::Error::new(e),
    })?;
    let agent = node.agent().clone();
    let signals = tokio::spawn(signals(agent.clone(), node.stopper())?);
    tracing::info!(
        socket = %socket_path.display(),
        state_dir = %state_dir.display(),
        config = agent.engine().config_identity().unwrap_or("none"),
        policy = %policy,
        "credgate agent serving"
    );
    let served = node.run().await;
    signals.abort();
    let _ = signals.await;
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
