//! `credgate serve`: the node agent. Parses the flags into a node
//! ([`crate::node`]), which reads the sources (never running a plugin), binds the
//! sockets, starts renewal and metrics, and serves until SIGTERM or SIGINT; SIGHUP reloads the
//! provider config.

use std::path::PathBuf;

use anyhow::{Context, Result};
use credgate_agent::socket::SocketAccess;

use crate::node::{Node, NodeError, NodeOptions, ProxyConfig};
use credgate_agent::guard::registry::RegistryOptions;
use credgate_agent::guard::GuardOptions;
use credgate_agent::{server, AgentOptions, CallerAllowlist};
use credgate_core::guard::{Allowlist, Policy};
use credgate_core::renewal::RenewalPolicy;

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

pub async fn run(args: ServeArgs, handed: crate::activation::Handed) -> Result<Outcome> {
    // No core dumps and no ptrace by other processes of the same user: the agent's memory
    // holds credentials.
    if let Err(e) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        tracing::warn!(error = %e, "cannot mark the agent not dumpable");
    }
    let mut options = node_options(&args)?;
    options.handed = handed;
    let (socket, state_dir) = (options.socket.clone(), options.state_dir.clone());
    let node = Node::start(options).await.map_err(|e| match e {
        // A bad config reads as it always did: the config's own error, not "cannot build".
        NodeError::Agent(e) => anyhow::Error::new(e),
        e => anyhow::Error::new(e),
    })?;
    tracing::info!(
        socket = %socket.display(),
        state_dir = %state_dir.display(),
        config = node.agent().engine().config_identity().unwrap_or("none"),
        policy = %args.image_pull_credentials_verification_policy,
        "credgate agent serving"
    );
    node.run_until_signalled()
        .await
        .context("cannot handle SIGHUP, SIGTERM and SIGINT")?;
    tracing::info!("credgate agent stopped");
    Ok(Outcome::Yes)
}

/// The node the flags describe; a flag that does not parse is a usage error.
fn node_options(args: &ServeArgs) -> Result<NodeOptions> {
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
    let pull_policy = credgate_cri::policy::ProxyPolicy::new(
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
    let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
    let registry = RegistryOptions {
        timeout: args.registry_timeout,
        insecure: args.insecure_registry.clone(),
    };
    let node_images = node_images(args)?;
    let mut callers = CallerAllowlist::default();
    for (service, uids) in &args.allow_uids {
        callers.allow(*service, uids.iter().copied());
    }
    Ok(NodeOptions {
        agent: AgentOptions {
            sources,
            renewal,
            clock: None,
            guard: Some(guard_options(args, &state_dir, &registry)?),
            callers,
            watch_send_timeout: Some(args.watch_send_timeout),
            saved_cache: (!args.no_persist_cache).then(|| state_dir.clone()),
            captured: None,
            // With the CRI proxy the node's image calls pass through the agent: a provider
            // config it refuses at start must not stop the pods that need nothing from it.
            serve_without_refused_sources: args.cri_proxy_socket.is_some(),
            // The node registers the CRI proxy's families (`node.rs`).
            also_register: None,
        },
        state_dir,
        socket: args
            .socket
            .clone()
            .unwrap_or_else(credgate_api::default_socket_path),
        socket_access: SocketAccess {
            group: args.socket_group.clone(),
        },
        limits: server::Limits {
            max_connections: args.max_connections,
            max_connections_per_uid: args.max_connections_per_uid,
            idle_timeout: args.idle_timeout,
            shutdown_timeout: args.shutdown_timeout,
            ..server::Limits::default()
        },
        metrics_addr: args.metrics_addr,
        mirror: args
            .registry_mirror_addr
            .map(|addr| crate::node::MirrorConfig {
                addr,
                registries: args
                    .registry_mirror_upstream
                    .iter()
                    .map(|(r, _)| r.clone())
                    .collect(),
                own: args
                    .registry_mirror_upstream
                    .iter()
                    .filter_map(|(r, a)| a.map(|a| (r.clone(), a)))
                    .collect(),
                registry: registry.clone(),
            }),
        handed: crate::activation::Handed::default(),
        proxy: args.cri_proxy_socket.clone().map(|socket| ProxyConfig {
            socket,
            runtime_endpoint: args.cri_runtime_endpoint.clone(),
            capture: !args.no_cri_proxy_capture,
            captured_max_age: args.captured_credential_max_age,
            check_every: args.captured_check_interval,
            registry,
            node_images: node_images.clone(),
            keep_every: args.cri_proxy_keep_interval,
            list_limit: args.cri_proxy_list_limit,
            policy: pull_policy.clone(),
        }),
    })
}

/// The images the node keeps present: the sandbox image (named, or read from containerd's
/// config), then the kept ones.
fn node_images(args: &ServeArgs) -> Result<Vec<credgate_cri::node_images::NodeImage>> {
    let sandbox = match (&args.cri_sandbox_image, &args.cri_runtime_config) {
        (Some(image), _) => Some((image.clone(), "--cri-sandbox-image".to_owned())),
        (None, Some(path)) => {
            let config = crate::runtime_config::RuntimeConfig::load(path)?;
            let named = config
                .sandbox_image()
                .with_context(|| format!("cannot read the sandbox image of {}", path.display()))?;
            if named.is_none() {
                tracing::info!(config = %path.display(), files = config.files.len(), "containerd's config and its imports name no sandbox image: containerd pulls its default, a public image, itself");
            }
            named.map(|(image, setting)| (image, format!("{setting} in {}", path.display())))
        }
        (None, None) => None,
    };
    credgate_cri::node_images::named(sandbox, &args.cri_proxy_keep_image).map_err(|e| {
        crate::usage(format!(
            "invalid node image: {}",
            credgate_core::text::error_chain(&e)
        ))
    })
}

/// The image access guard the flags describe.
fn guard_options(
    args: &ServeArgs,
    state_dir: &std::path::Path,
    registry: &RegistryOptions,
) -> Result<GuardOptions> {
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
    Ok(GuardOptions {
        policy,
        allowlist,
        max_age: args.pull_record_max_age,
        state_dir: state_dir.to_owned(),
        registry: registry.clone(),
    })
}
