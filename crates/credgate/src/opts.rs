//! Command-line flags. Names follow the kubelet's where the kubelet has one.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use credgate_core::duration::GoDuration;

#[derive(Parser)]
#[command(
    name = "credgate",
    version,
    about = "Registry credentials for a node, kubelet-compatible"
)]
pub struct Cli {
    /// More log output on stderr (-v info, -vv debug, -vvv trace); CREDGATE_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the node agent: the gRPC API on a unix socket, renewal, metrics.
    #[command(
        after_help = "Examples:\n  credgate serve --image-credential-provider-config examples/provider-config.yaml \\\n      --image-credential-provider-bin-dir examples/plugins --socket /tmp/credgate.sock\n  credgate serve --image-credential-provider-config /etc/kubernetes/credential-provider-config.yaml \\\n      --image-credential-provider-bin-dir /usr/libexec/kubernetes/kubelet-plugins/credential-provider/exec \\\n      --metrics-addr 127.0.0.1:9464 --log-format json\n\nSignals: SIGHUP reloads the provider config (an invalid one is refused, the old one keeps\nserving); SIGTERM and SIGINT stop accepting calls, finish those in flight and exit 0."
    )]
    Serve(Box<ServeArgs>),
    /// A thin client for every RPC of the agent (crictl-like).
    #[command(
        after_help = "Examples:\n  credgate ctl status\n  credgate ctl lookup -o json registry.example.com/team/app:v1\n  credgate ctl set-tracked nydus registry.example.com/team/app:v1 registry.example.com/team/db:v3\n  credgate ctl watch registry.example.com/team/app:v1"
    )]
    Ctl(CtlArgs),
    /// Credentials for one image, in the order a puller should try them.
    #[command(
        after_help = "Examples:\n  credgate get --image-credential-provider-config examples/provider-config.yaml \\\n      --image-credential-provider-bin-dir examples/plugins registry.example.com/team/app:v1\n  credgate get -o json --min-valid-for 30m 123456789012.dkr.ecr.us-east-1.amazonaws.com/app:v2"
    )]
    Get(GetArgs),
    /// Validate a provider config exactly as the agent would.
    #[command(
        after_help = "Examples:\n  credgate check-config /etc/kubernetes/credential-provider-config.yaml\n  credgate check-config --image-credential-provider-bin-dir /usr/libexec/kubernetes/kubelet-plugins/credential-provider/exec /etc/kubernetes/credential-providers.d"
    )]
    CheckConfig(CheckArgs),
    /// Print the kubelet CredentialProviderConfig that routes the kubelet through the agent
    /// (credgate-credential-provider), one entry per provider of the agent's config.
    #[command(after_help = "Examples:
  credgate kubelet-config --image-credential-provider-config /etc/credgate/providers.yaml \
      --image-credential-provider-bin-dir /usr/libexec/credgate/plugins \
      --link-dir /usr/libexec/kubernetes/kubelet-plugins/credential-provider/exec \
      > /etc/kubernetes/credential-provider-config.yaml")]
    KubeletConfig(KubeletConfigArgs),
    /// Why a pull of an image gets the credentials it gets, or none: each source in try-order,
    /// whether it matches and why not, each matching provider's cache, last run and backoff,
    /// the captured pod credential, and a verdict. Runs no plugin; never prints a secret.
    #[command(
        after_help = "Examples:\n  credgate explain registry.example.com:5000/team/app:v1\n  credgate explain -o json --service-account team-a/builder 123456789012.dkr.ecr.us-east-1.amazonaws.com/app:v2\n  credgate explain --image-credential-provider-config examples/provider-config.yaml \\\n      --image-credential-provider-bin-dir examples/plugins registry.example.com/team/app:v1"
    )]
    Explain(ExplainArgs),
    /// Does a matchImages/auth pattern match an image? Prints true or false.
    #[command(
        after_help = "Examples:\n  credgate match '*.dkr.ecr.*.amazonaws.com' 123456789012.dkr.ecr.us-east-1.amazonaws.com/app:v1\n  credgate match docker.io nginx:1.25\n  credgate match 'registry.io:5000/team' registry.io:5000/teams/app"
    )]
    Match(MatchArgs),
    /// Write the manual pages (credgate(1) and one a subcommand) into a directory: what the
    /// package installs.
    #[command(hide = true, after_help = "Examples:\n  credgate man target/man")]
    Man(ManArgs),
    /// Move registry credentials from another program's config into a docker config the
    /// agent reads.
    #[command(
        subcommand,
        after_help = "Examples:\n  credgate import containerd --output /etc/credgate/docker-config.json"
    )]
    Import(ImportCommand),
}

/// What `credgate import` reads.
#[derive(Subcommand)]
pub enum ImportCommand {
    /// containerd's CRI registry auth (`registry.configs."HOST".auth` of config version 1, 2
    /// or 3) into a docker config (mode 0600) for `credgate serve --docker-config`; prints what
    /// to remove from containerd's config and the `--cri-proxy-fill` patterns that keep CRI
    /// pulls without credentials working as before. Never prints a secret.
    #[command(after_help = "Examples:
  credgate import containerd --output /etc/credgate/docker-config.json
  credgate import containerd /etc/containerd/config.toml --output /etc/credgate/docker-config.json --force")]
    Containerd(ImportContainerdArgs),
}

#[derive(Args)]
pub struct ImportContainerdArgs {
    /// containerd's config file.
    #[arg(value_name = "CONFIG", default_value = "/etc/containerd/config.toml")]
    pub config: PathBuf,
    /// The docker config to write (mode 0600).
    #[arg(long, short = 'o', value_name = "FILE")]
    pub output: PathBuf,
    /// Replace --output if it exists.
    #[arg(long)]
    pub force: bool,
}

/// Where providers and static sources come from.
#[derive(Args, Clone)]
pub struct SourceArgs {
    /// Provider config: a file, or a directory of .json/.yaml/.yml files (kubelet flag).
    #[arg(long, value_name = "PATH")]
    pub image_credential_provider_config: Option<PathBuf>,
    /// Directory holding the plugin executables (kubelet flag).
    #[arg(long, value_name = "DIR")]
    pub image_credential_provider_bin_dir: Option<PathBuf>,
    /// Node-wide docker config.json to read before the plugins (repeatable). Default: the first
    /// of /var/lib/kubelet/config.json, $HOME/.docker/config.json, /.docker/config.json.
    #[arg(long, value_name = "PATH")]
    pub docker_config: Vec<PathBuf>,
    /// Read no docker config.json at all.
    #[arg(long, conflicts_with = "docker_config")]
    pub no_docker_config: bool,
    /// Plugin timeout, for all (`30s`) or one provider (`ecr=30s`); repeatable. Default 1m.
    #[arg(long, value_name = "[NAME=]DURATION", value_parser = parse_per_provider)]
    pub plugin_timeout: Vec<PerProvider>,
    /// Keep a provider's answers at least this long whatever their cacheDuration (`gcr=30s`):
    /// protection against plugins that answer 0s or microseconds. Repeatable; off by default.
    #[arg(long, value_name = "NAME=DURATION", value_parser = parse_named_duration)]
    pub min_cache_duration: Vec<PerProvider>,
    /// At most N plugin runs a second for a provider (`ecr=20/s,burst=200`): runs beyond it
    /// wait for their turn (lookups of the same key join them) instead of failing. Repeatable;
    /// off by default.
    #[arg(long, value_name = "NAME=N/s[,burst=M]", value_parser = parse_plugin_rate)]
    pub plugin_rate: Vec<(String, credgate_engine::rate::PluginRate)>,
}

fn parse_plugin_rate(s: &str) -> Result<(String, credgate_engine::rate::PluginRate), String> {
    let (name, rate) = s
        .split_once('=')
        .ok_or_else(|| "expected PROVIDER=N/s[,burst=M]".to_owned())?;
    Ok((
        name.to_owned(),
        credgate_engine::rate::PluginRate::parse(rate).map_err(|e| e.to_string())?,
    ))
}

#[derive(Args)]
pub struct KubeletConfigArgs {
    /// The agent's provider config (a file or a directory).
    #[arg(long, value_name = "PATH")]
    pub image_credential_provider_config: PathBuf,
    /// The agent's plugin directory: checked to hold every provider's plugin.
    #[arg(long, value_name = "DIR")]
    pub image_credential_provider_bin_dir: Option<PathBuf>,
    /// Make the links the kubelet needs here (its --image-credential-provider-bin-dir): one per
    /// provider, named after it, to the bridge.
    #[arg(long, value_name = "DIR")]
    pub link_dir: Option<PathBuf>,
    /// The bridge the links point to (default: credgate-credential-provider beside this program).
    #[arg(long, value_name = "PATH")]
    pub bridge: Option<PathBuf>,
    /// The agent's socket, when the kubelet should not use the default.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// The longest the kubelet keeps a bridge answer (the bridge's --max-cache-duration,
    /// default 5m): after a credential is rotated or refused, the kubelet asks again within it.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub max_cache_duration: Option<Duration>,
    /// With --link-dir: copy the bridge there first (as credgate-credential-provider) and link
    /// to that copy (what a DaemonSet's init container does: the host needs its own copy).
    #[arg(long, requires = "link_dir")]
    pub install: bool,
    /// For a lazy-pull snapshotter's copy of the config (nydus-snapshotter), never the
    /// kubelet's: every entry also answers with the pod pull credential the CRI proxy captured
    /// for the image's repository (the bridge's --captured), and one more entry,
    /// credgate-captured, matching these patterns (repeatable), answers with that credential
    /// alone (--captured-only) for images no provider matches.
    #[arg(long, value_name = "PATTERN", value_parser = parse_pattern)]
    pub captured_images: Vec<credgate_core::pattern::Pattern>,
    /// Write the config to this file (atomically) instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Output {
    Table,
    Json,
}

#[derive(Args)]
pub struct GetArgs {
    /// The image, as a pod spec names it (`nginx:1.25`, `registry.io:5000/team/app@sha256:...`).
    pub image: String,
    /// Only credentials valid at least this long (Go duration: 30m, 1h30m); shorter-lived cached
    /// ones make the plugin run again.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub min_valid_for: Option<Duration>,
    /// Output format; table hides passwords, json shows them.
    #[arg(short, long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// Ask the agent on this socket (default: CREDGATE_SOCKET, else the default socket when it
    /// exists and no --image-credential-provider-config is given).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    #[command(flatten)]
    pub sources: SourceArgs,
}

#[derive(Args)]
pub struct ExplainArgs {
    /// The image, as a pod spec names it.
    pub image: String,
    /// The pod's service account, `NAMESPACE/NAME[/UID]` (for providers with tokenAttributes).
    #[arg(long, value_name = "SA")]
    pub service_account: Option<String>,
    /// Output format: table for people, json (enum names, every field) for programs.
    #[arg(short, long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// Ask the agent on this socket (default: as `get` decides).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    #[command(flatten)]
    pub sources: SourceArgs,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Args)]
pub struct ServeArgs {
    #[command(next_help_heading = "Credential sources (docs/kubelet.md)")]
    #[command(flatten)]
    pub sources: SourceArgs,
    /// The API socket. Default: /run/credgate/credgate.sock as root; otherwise
    /// $XDG_RUNTIME_DIR/credgate.sock, else /run/user/UID/credgate.sock when that directory is
    /// yours, else /tmp/credgate-UID/credgate.sock.
    #[arg(long, value_name = "PATH")]
    #[arg(help_heading = "API socket and state (docs/operations.md)")]
    pub socket: Option<PathBuf>,
    /// Open the socket to this group too (mode 0660 instead of 0600).
    #[arg(long, value_name = "GROUP")]
    #[arg(help_heading = "API socket and state (docs/operations.md)")]
    pub socket_group: Option<String>,
    /// Embedded state. Default: /var/lib/credgate as root, $XDG_STATE_HOME/credgate otherwise.
    #[arg(long, value_name = "DIR")]
    #[arg(help_heading = "API socket and state (docs/operations.md)")]
    pub state_dir: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics (off unless given).
    #[arg(long, value_name = "ADDR")]
    #[arg(help_heading = "Metrics and logs (docs/operations.md)")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    #[arg(help_heading = "Metrics and logs (docs/operations.md)")]
    pub log_format: LogFormat,
    /// Renew tracked credentials at least this long before they expire.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "1m")]
    #[arg(help_heading = "Renewal (docs/snapshotters.md)")]
    pub renew_before: Duration,
    /// Re-check tracked credentials without a known expiry this often.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "5m")]
    #[arg(help_heading = "Renewal (docs/snapshotters.md)")]
    pub recheck_interval: Duration,
    /// Keep refs no consumer tracks any more for this long before forgetting them.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "10m")]
    #[arg(help_heading = "Renewal (docs/snapshotters.md)")]
    pub untracked_grace: Duration,
    /// When a consumer must authenticate before using an image already on the node (kubelet
    /// flag): NeverVerify, NeverVerifyPreloadedImages, NeverVerifyAllowlistedImages,
    /// AlwaysVerify.
    #[arg(
        long,
        value_name = "POLICY",
        default_value = "NeverVerifyPreloadedImages"
    )]
    #[arg(help_heading = "Image access guard (docs/guard.md)")]
    pub image_pull_credentials_verification_policy: String,
    /// Images exempt under NeverVerifyAllowlistedImages (kubelet flag): names without tag or
    /// digest, or prefixes ending in `/*`; comma-separated, repeatable.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    #[arg(help_heading = "Image access guard (docs/guard.md)")]
    pub preloaded_images_verification_allowlist: Vec<String>,
    /// A secret that last pulled an image longer ago than this no longer allows it without
    /// re-authentication (off unless given).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    #[arg(help_heading = "Image access guard (docs/guard.md)")]
    pub pull_record_max_age: Option<Duration>,
    /// Reach this registry (`host[:port]`) over plain HTTP when verifying (loopback registries
    /// always are); repeatable.
    #[arg(long, value_name = "HOST")]
    #[arg(help_heading = "Image access guard (docs/guard.md)")]
    pub insecure_registry: Vec<String>,
    /// Timeout of each request to a registry when verifying.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "10s")]
    #[arg(help_heading = "Image access guard (docs/guard.md)")]
    pub registry_timeout: Duration,
    /// Keep no provider answers across restarts: without it the providers' answers, the
    /// tracked refs and the memory of refused and handed-out credentials are kept sealed in
    /// the state directory, so that a restart serves them with no plugin run while they are
    /// valid; with it their files of an earlier run are removed (captured pull credentials
    /// are --no-cri-proxy-capture's).
    #[arg(long)]
    #[arg(help_heading = "API socket and state (docs/operations.md)")]
    pub no_persist_cache: bool,
    /// Only these uids (and the agent's own) may call SERVICE (credentials, admin or
    /// image-access), checked against the socket's peer credentials; repeatable. Services
    /// without an entry are open to whoever can open the socket. `service-account-identity`
    /// names the uids, besides root and the agent's own, that may look up credentials for a
    /// service account (a claim the agent cannot check otherwise); `registry-mirror` the uids
    /// whose reads through --registry-mirror-addr get credentials (root and the agent's own
    /// always; anyone else gets 403).
    #[arg(long, value_name = "SERVICE=UID[,UID...]", value_parser = parse_allow_uids)]
    #[arg(help_heading = "API socket and state (docs/operations.md)")]
    pub allow_uids: Vec<(credgate_agent::Service, Vec<u32>)>,
    /// A Watch client that has not read its stream for this long is dropped.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "30s")]
    #[arg(help_heading = "API socket and state (docs/operations.md)")]
    pub watch_send_timeout: Duration,
    /// API connections open at once; more are closed as they arrive. Kept below the open-file
    /// limit with descriptors in reserve for plugins, the store and metrics.
    #[arg(long, value_name = "N", default_value_t = credgate_agent::server::DEFAULT_MAX_CONNECTIONS)]
    #[arg(help_heading = "API socket and state (docs/operations.md)")]
    pub max_connections: usize,
    /// API connections open at once for one uid other than root and the agent's own.
    #[arg(long, value_name = "N", default_value_t = credgate_agent::server::DEFAULT_MAX_CONNECTIONS / 4)]
    #[arg(help_heading = "API socket and state (docs/operations.md)")]
    pub max_connections_per_uid: usize,
    /// An API connection with no call open that has sent nothing for this long is closed.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "5m")]
    #[arg(help_heading = "API socket and state (docs/operations.md)")]
    pub idle_timeout: Duration,
    /// Serve a CRI image-service proxy here (the kubelet's --image-service-endpoint): every
    /// call is forwarded to --cri-runtime-endpoint and its answer returned unchanged. Off
    /// unless given.
    #[arg(long, value_name = "PATH")]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_proxy_socket: Option<PathBuf>,
    /// Keep none of the pull credentials the CRI proxy sees: without it they are kept, sealed,
    /// for lazy-pull snapshotters and the mirror (served per repository); the guard and the
    /// pull log still see every pull either way.
    #[arg(long, requires = "cri_proxy_socket")]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub no_cri_proxy_capture: bool,
    /// Drop a captured pull credential this long after its capture (off unless given).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub captured_credential_max_age: Option<Duration>,
    /// How often the CRI proxy checks the runtime's images and drops captured credentials of
    /// repositories it has no image of any more (removals that bypass the proxy).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "5m")]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub captured_check_interval: Duration,
    /// A pull through the CRI proxy that comes without a credential, for an image this
    /// pattern names (as a provider's matchImages, but its path in whole segments), gets the
    /// credential the agent's sources
    /// give for it (providers, docker config; never a service-account-keyed provider's or a
    /// captured pod credential). A credential the caller sent is never replaced. Repeatable.
    #[arg(long, value_name = "PATTERN", requires = "cri_proxy_socket")]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_proxy_fill: Vec<String>,
    /// Scope each pull's credential to its image's registry (its `server_address`), so that
    /// containerd gives it to no mirror hosts.toml names, unless --cri-proxy-trusted-mirror
    /// trusts every mirror of that registry.
    #[arg(long, requires = "cri_proxy_socket")]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_proxy_scope_credentials: bool,
    /// `REGISTRY=MIRROR[,MIRROR...]`: mirrors trusted with the credentials of pulls from
    /// REGISTRY; a pull's credential then goes to the registry and these mirrors. Implies
    /// --cri-proxy-scope-credentials. Repeatable.
    /// Needs --cri-proxy-hosts-dir: without containerd's hosts.toml the proxy cannot tell
    /// whether a mirror it was not told to trust would receive the credential too.
    #[arg(long, value_name = "REGISTRY=MIRRORS", requires_all = ["cri_proxy_socket", "cri_proxy_hosts_dir"])]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_proxy_trusted_mirror: Vec<String>,
    /// containerd's registry `config_path` (its hosts.toml files; a `:`-separated list): a
    /// registry's credentials reach its mirrors only if every mirror its hosts.toml names is
    /// trusted; the hosts.toml is found as containerd finds it (HOST_PORT_, HOST:PORT, then
    /// _default).
    #[arg(long, value_name = "DIR", requires = "cri_proxy_socket")]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_proxy_hosts_dir: Option<PathBuf>,
    /// The runtime's sandbox (pause) image, which containerd pulls itself, with no credential,
    /// when a pod starts: the CRI proxy pulls it through the runtime with the credential the
    /// agent's sources give for it (providers, docker config; never a pod's), at start and
    /// whenever the runtime has it no more, so that it is there before a pod needs it.
    #[arg(
        long,
        value_name = "IMAGE",
        requires = "cri_proxy_socket",
        conflicts_with = "cri_runtime_config"
    )]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_sandbox_image: Option<String>,
    /// containerd's config (`/etc/containerd/config.toml`): the sandbox image it names
    /// (`pinned_images.sandbox` in 2.x, `sandbox_image` in 1.x) is kept as
    /// --cri-sandbox-image keeps one. Read at start; one that names none leaves containerd's
    /// public default to containerd.
    #[arg(long, value_name = "PATH", requires = "cri_proxy_socket")]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_runtime_config: Option<PathBuf>,
    /// An image the node keeps present (a pre-pull at boot): pulled through the runtime as
    /// the sandbox image is, at start and after it is removed; failures are tried again with
    /// a backoff and reported (`ctl status`). Repeatable, at most 32 images in all.
    #[arg(long, value_name = "IMAGE", requires = "cri_proxy_socket")]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_proxy_keep_image: Vec<String>,
    /// How often the runtime is asked whether it still has the sandbox image and the kept
    /// images (and at once after each RemoveImage through the proxy).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "1m")]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_proxy_keep_interval: Duration,
    /// The most of a ListImages answer the proxy reads for itself (a runtime without
    /// StreamImages). For tests, which stand for a node whose list is larger than 16 MiB.
    #[arg(long, value_name = "BYTES", hide = true, default_value_t = credgate_cri::MAX_LIST_MESSAGE)]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_proxy_list_limit: usize,
    /// The container runtime the CRI proxy forwards to.
    #[arg(
        long,
        value_name = "ENDPOINT",
        default_value = "unix:///run/containerd/containerd.sock"
    )]
    #[arg(help_heading = "CRI proxy (docs/cri-proxy.md)")]
    pub cri_runtime_endpoint: String,
    /// A stop (SIGTERM, SIGINT) waits this long for calls in flight, then closes their
    /// connections and exits.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "10s")]
    #[arg(help_heading = "API socket and state (docs/operations.md)")]
    pub shutdown_timeout: Duration,
    /// Serve the node's registry mirror on this loopback address (`127.0.0.1:5005`): reads of
    /// the --registry-mirror-upstream registries forwarded with the credential the agent holds
    /// now for each repository (captured pod credential, providers, docker configs), for
    /// consumers that read long after their pull (lazy-pull snapshotters, containerd's
    /// hosts.toml mirrors).
    #[arg(long, value_name = "ADDR", requires = "registry_mirror_upstream")]
    #[arg(help_heading = "Registry mirror (docs/snapshotters.md)")]
    pub registry_mirror_addr: Option<std::net::SocketAddr>,
    /// A registry the mirror serves (`registry.example.com`, `docker.io`); repeatable. A read
    /// names its registry with the `ns` query parameter (containerd and soci add it); one that
    /// names none goes to the first. `REGISTRY=ADDR` also serves REGISTRY on a loopback address
    /// of its own, where a read that names none goes to REGISTRY: for consumers that never add
    /// `ns` (nydus-snapshotter hands nydusd the mirror as the registry's host).
    #[arg(
        long,
        value_name = "REGISTRY[=ADDR]",
        requires = "registry_mirror_addr"
    )]
    #[arg(value_parser = parse_mirror_upstream)]
    #[arg(help_heading = "Registry mirror (docs/snapshotters.md)")]
    pub registry_mirror_upstream: Vec<(String, Option<std::net::SocketAddr>)>,
}

/// Credentials a consumer presents (`ctl check-access`, `verify`, `record-result`).
#[derive(Args, Clone, Default)]
pub struct CredentialArgs {
    /// A pull secret: `NAMESPACE/NAME[/UID]=USERNAME:PASSWORD` (repeatable; for testing: the
    /// password is visible to other users of the machine in the process list).
    #[arg(long, value_name = "SECRET")]
    pub secret: Vec<String>,
    /// A service account: `NAMESPACE/NAME[/UID]` (repeatable). Verify skips service accounts:
    /// a registry is asked with secrets and node-wide credentials only.
    #[arg(long, value_name = "SA")]
    pub service_account: Vec<String>,
    /// Anonymous or node-wide credentials.
    #[arg(long)]
    pub node_wide: bool,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum PullPolicyArg {
    Always,
    IfNotPresent,
    Never,
}

#[derive(Args)]
pub struct CtlArgs {
    /// The agent's socket (default: CREDGATE_SOCKET, else the default socket).
    #[arg(long, value_name = "PATH", global = true)]
    pub socket: Option<PathBuf>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = Output::Table, global = true)]
    pub output: Output,
    #[command(subcommand)]
    pub call: CtlCall,
}

#[derive(Subcommand)]
pub enum CtlCall {
    /// Credentials.Lookup: credentials for an image (passwords only with -o json).
    #[command(
        after_help = "Examples:\n  credgate ctl lookup registry.example.com/team/app:v1\n  credgate ctl lookup -o json --min-valid-for 30m registry.example.com/team/app:v1\n  credgate ctl lookup --registry-host registry.example.com"
    )]
    Lookup {
        /// The image, as a pod spec names it (or a registry host with --registry-host).
        image: String,
        /// Only credentials valid at least this long (Go duration: 30m); shorter-lived cached
        /// ones make the plugin run again.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        min_valid_for: Option<Duration>,
        /// IMAGE is a registry `host[:port]`, as a docker credential helper receives it.
        #[arg(long)]
        registry_host: bool,
    },
    /// Credentials.Track: add refs to what CONSUMER depends on.
    #[command(
        after_help = "Example:\n  credgate ctl track nydus registry.example.com/team/app:v1"
    )]
    Track {
        /// Who depends on the refs: a stable name per consumer (`nydus-snapshotter`).
        consumer: String,
        /// Image references, as for lookup.
        refs: Vec<String>,
    },
    /// Credentials.Untrack: remove refs from what CONSUMER depends on.
    #[command(
        after_help = "Example:\n  credgate ctl untrack nydus registry.example.com/team/app:v1"
    )]
    Untrack {
        /// Who depends on the refs: a stable name per consumer (`nydus-snapshotter`).
        consumer: String,
        /// Image references, as for lookup.
        refs: Vec<String>,
    },
    /// Credentials.SetTracked: make REFS all that CONSUMER depends on.
    #[command(
        after_help = "Example:\n  credgate ctl set-tracked nydus registry.example.com/team/app:v1 registry.example.com/team/db:v3"
    )]
    SetTracked {
        /// Who depends on the refs: a stable name per consumer (`nydus-snapshotter`).
        consumer: String,
        /// Image references, as for lookup.
        refs: Vec<String>,
    },
    /// Credentials.ListTracked: tracked refs and their renewal state.
    #[command(after_help = "Example:\n  credgate ctl list-tracked --consumer nydus")]
    ListTracked {
        /// Only the refs this consumer holds.
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Credentials.Watch: print each change of the refs' credentials (Ctrl-C to stop).
    #[command(
        after_help = "Example:\n  credgate ctl watch --count 1 registry.example.com/team/app:v1"
    )]
    Watch {
        /// Image references to watch.
        #[arg(required = true)]
        refs: Vec<String>,
        /// Stop after this many events.
        #[arg(long)]
        count: Option<u64>,
    },
    /// ImageAccess.CheckAccess: may these credentials use the image on the node?
    #[command(
        after_help = "Example:\n  credgate ctl check-access registry.example.com/team/app:v1 --image-ref sha256:f4ca02b8471e2ff50a0736c6227c3d1d44afee519cc84dab5be18b5556032bfb \\\n      --secret \"team-a/regcred=alice:$PASSWORD\""
    )]
    CheckAccess {
        /// The image, as a pod spec names it (`registry.example.com/team/app:v1`).
        image: String,
        /// The runtime's image ID of the local copy (64 hex digits, with `sha256:` as containerd reports it or without as CRI-O does).
        #[arg(long, value_name = "ID")]
        image_ref: Option<String>,
        /// The image is not on the node.
        #[arg(long)]
        absent: bool,
        /// The container's imagePullPolicy.
        #[arg(long, value_enum, default_value_t = PullPolicyArg::IfNotPresent)]
        pull_policy: PullPolicyArg,
        #[command(flatten)]
        credentials: CredentialArgs,
    },
    /// ImageAccess.RecordPullIntent: a pull of IMAGE is about to start.
    #[command(
        after_help = "Example:\n  credgate ctl record-intent registry.example.com/team/app:v1"
    )]
    RecordIntent {
        /// The image, as a pod spec names it (`registry.example.com/team/app:v1`).
        image: String,
    },
    /// ImageAccess.RecordPullResult: a pull of IMAGE ended.
    #[command(
        after_help = "Example:\n  credgate ctl record-result registry.example.com/team/app:v1 --image-ref sha256:f4ca02b8471e2ff50a0736c6227c3d1d44afee519cc84dab5be18b5556032bfb \\\n      --secret \"team-a/regcred=alice:$PASSWORD\""
    )]
    RecordResult {
        /// The image, as a pod spec names it (`registry.example.com/team/app:v1`).
        image: String,
        /// The runtime's image ID of the local copy (64 hex digits, with `sha256:` as containerd reports it or without as CRI-O does).
        #[arg(long, value_name = "ID")]
        image_ref: Option<String>,
        /// The pull failed.
        #[arg(long)]
        failed: bool,
        #[command(flatten)]
        credentials: CredentialArgs,
    },
    /// ImageAccess.Verify: ask the registry with each credential in order.
    #[command(
        after_help = "Example (the ID as `crictl inspecti` reports it, the secret's password in $PASSWORD):\n  credgate ctl verify registry.example.com/team/app:v1 --image-ref sha256:f4ca02b8471e2ff50a0736c6227c3d1d44afee519cc84dab5be18b5556032bfb \\\n      --secret \"team-a/regcred=alice:$PASSWORD\""
    )]
    Verify {
        /// The image, as a pod spec names it (`registry.example.com/team/app:v1`).
        image: String,
        /// The runtime's image ID of the local copy (64 hex digits, with `sha256:` as containerd reports it or without as CRI-O does).
        #[arg(long, value_name = "ID")]
        image_ref: String,
        /// The manifest digest held locally.
        #[arg(long, value_name = "DIGEST")]
        expected_digest: Option<String>,
        #[command(flatten)]
        credentials: CredentialArgs,
    },
    /// ImageAccess.Prune: recover intents of present images, drop state of absent ones.
    #[command(
        after_help = "Example:\n  credgate ctl prune --present 'sha256:f4ca02b8471e2ff50a0736c6227c3d1d44afee519cc84dab5be18b5556032bfb=registry.example.com/team/app:v1' --older-than 1h"
    )]
    Prune {
        /// A present image: `IMAGE_ID=REFERENCE[,REFERENCE...]` (repeatable).
        #[arg(long, value_name = "PRESENT")]
        present: Vec<String>,
        /// Only state unchanged for this long is dropped.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "0s")]
        older_than: Duration,
    },
    /// ImageAccess.ListRecords: every pull record and intent.
    #[command(after_help = "Example:\n  credgate ctl -o json list-records")]
    ListRecords,
    /// ImageAccess.GetRecord.
    #[command(
        after_help = "Example:\n  credgate ctl get-record sha256:f4ca02b8471e2ff50a0736c6227c3d1d44afee519cc84dab5be18b5556032bfb"
    )]
    GetRecord {
        /// The runtime's image ID (64 hex digits, with `sha256:` as containerd reports it or without as CRI-O does).
        image_ref: String,
    },
    /// ImageAccess.DeleteRecord.
    #[command(
        after_help = "Example:\n  credgate ctl delete-record sha256:f4ca02b8471e2ff50a0736c6227c3d1d44afee519cc84dab5be18b5556032bfb"
    )]
    DeleteRecord {
        /// The runtime's image ID (64 hex digits, with `sha256:` as containerd reports it or without as CRI-O does).
        image_ref: String,
    },
    /// Admin.Health.
    #[command(after_help = "Example:\n  credgate ctl health")]
    Health,
    /// Admin.Version.
    #[command(after_help = "Example:\n  credgate ctl version")]
    Version,
    /// Admin.Status: config identity and per-provider status.
    #[command(after_help = "Example:\n  credgate ctl -o json status")]
    Status,
    /// Admin.Reload: re-read the provider config.
    #[command(after_help = "Example:\n  credgate ctl reload")]
    Reload,
    /// Admin.Ping: an empty call.
    #[command(after_help = "Example:\n  credgate ctl ping")]
    Ping,
    /// Admin.ListPulls: the CRI proxy's recent pulls (newest first): pod, whether the kubelet
    /// sent credentials and which source they match, the runtime's answer. Never a secret.
    #[command(
        after_help = "Examples:\n  credgate ctl pulls\n  credgate ctl pulls registry.example.com/team/app"
    )]
    Pulls {
        /// Only the pulls of this image's repository (any tag).
        image: Option<String>,
    },
    /// Admin.Flush: drop providers' cached answers (memory and sealed cache) so that the next
    /// lookup runs the plugin; tracked refs are renewed at once.
    #[command(
        after_help = "Examples:\n  credgate ctl flush\n  credgate ctl flush --provider credgate-example-plugin registry.example.com/team/app:v1"
    )]
    Flush {
        /// Only this provider's answers (default: every provider's).
        #[arg(long, value_name = "NAME")]
        provider: Option<String>,
        /// Only the answers for these images (default: all).
        #[arg(value_name = "IMAGE")]
        images: Vec<String>,
    },
    /// Credentials.ReportRefused: a registry refused a credential the agent gave for IMAGE.
    /// The agent asks the registry itself before it drops anything. The password is read
    /// from standard input (one line). Exits 0 when the credential is refused now (refused,
    /// already_refused), 1 for every other outcome (accepted, unchecked, not_given,
    /// unreachable).
    #[command(
        after_help = "Example:\n  printf '%s\\n' \"$PASSWORD\" | credgate ctl report-refused registry.example.com/team/app:v1 --username alice"
    )]
    ReportRefused {
        /// The image the registry refused the credential for.
        image: String,
        /// The credential's user name, as the agent gave it.
        #[arg(long, value_name = "USER")]
        username: String,
    },
    /// Admin.ListCaptured / ForgetCaptured: the pull credentials the CRI proxy captured
    /// (never their secrets); `captured forget REPO` drops one.
    #[command(
        after_help = "Examples:\n  credgate ctl captured\n  credgate ctl captured forget registry.example.com/team/app"
    )]
    Captured {
        #[command(subcommand)]
        action: Option<CapturedAction>,
    },
}

#[derive(Subcommand)]
pub enum CapturedAction {
    /// Drop the captured credential of a repository (or of any image of it).
    #[command(
        after_help = "Example:\n  credgate ctl captured forget registry.example.com/team/app"
    )]
    Forget {
        /// The repository (`registry.example.com/team/app`), or any image of it.
        repository: String,
    },
}

#[derive(Args)]
pub struct CheckArgs {
    /// Provider config file or directory.
    pub path: PathBuf,
    /// Also check that every provider's executable is there and executable.
    #[arg(long, value_name = "DIR")]
    pub image_credential_provider_bin_dir: Option<PathBuf>,
}

#[derive(Args)]
pub struct MatchArgs {
    /// A matchImages entry or auth key.
    pub pattern: String,
    /// An image reference (normalized as the kubelet does: `nginx` is docker.io/library/nginx),
    /// or a bare registry `host[:port]` such as `registry.io:5000` or `localhost:5000`.
    pub image: String,
}

fn parse_allow_uids(s: &str) -> Result<(credgate_agent::Service, Vec<u32>), String> {
    credgate_agent::CallerAllowlist::parse_entry(s).map_err(|e| e.to_string())
}

/// `[NAME=]DURATION`: a duration for one provider, or for all.
#[derive(Debug, Clone)]
pub struct PerProvider {
    pub name: Option<String>,
    pub duration: Duration,
}

fn parse_per_provider(s: &str) -> Result<PerProvider, String> {
    let (name, d) = match s.split_once('=') {
        Some((name, d)) => (Some(name.to_owned()), d),
        None => (None, s),
    };
    Ok(PerProvider {
        name,
        duration: parse_duration(d)?,
    })
}

/// `NAME=DURATION`: a duration for one provider.
fn parse_named_duration(s: &str) -> Result<PerProvider, String> {
    if !s.contains('=') {
        return Err("expected PROVIDER=DURATION".into());
    }
    parse_per_provider(s)
}

/// A `matchImages` pattern.
fn parse_pattern(s: &str) -> Result<credgate_core::pattern::Pattern, String> {
    credgate_core::pattern::Pattern::parse(s).map_err(|e| format!("{s:?}: {e}"))
}

/// Parses a Go duration string that must not be negative.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = GoDuration::parse(s).map_err(|e| e.to_string())?;
    d.to_std()
        .ok_or_else(|| format!("duration {s:?} must not be negative"))
}

/// `credgate man DIR`.
#[derive(Args)]
pub struct ManArgs {
    /// Where the pages are written (created when missing).
    pub dir: PathBuf,
}

/// `REGISTRY[=ADDR]` of --registry-mirror-upstream.
fn parse_mirror_upstream(s: &str) -> Result<(String, Option<std::net::SocketAddr>), String> {
    match s.split_once('=') {
        None => Ok((s.to_owned(), None)),
        Some((registry, addr)) => {
            let addr = addr
                .parse()
                .map_err(|e| format!("{addr:?} is not an address (127.0.0.1:PORT): {e}"))?;
            Ok((registry.to_owned(), Some(addr)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// The `credgate ...` lines of a help text's examples, continuation lines joined and
    /// single quotes honoured, as a shell would split them.
    fn examples(help: &str) -> Vec<Vec<String>> {
        let joined = help.replace("\\\n", " ");
        let mut out = Vec::new();
        for line in joined.lines().map(str::trim) {
            // What a pipe feeds is the shell's: the command is after it.
            let line = line.rsplit("| ").next().unwrap_or(line);
            let Some(rest) = line.strip_prefix("credgate ") else {
                continue;
            };
            // A redirection is the shell's, not the command's.
            let rest = rest.split(" > ").next().unwrap_or(rest);
            let mut words = vec!["credgate".to_owned()];
            for (i, part) in rest.split('\'').enumerate() {
                if i % 2 == 1 {
                    words.push(part.to_owned());
                } else {
                    words.extend(part.split_whitespace().map(str::to_owned));
                }
            }
            out.push(words);
        }
        out
    }

    /// Every subcommand (and `ctl`'s, down to `captured forget`) shows an example in its
    /// `--help`, and every example parses.
    #[test]
    fn every_command_has_an_example_that_parses() {
        fn walk(cmd: &mut clap::Command, path: &str, found: &mut Vec<String>) {
            let name = format!("{path} {}", cmd.get_name());
            let help = cmd.render_long_help().to_string();
            let lines = examples(&help);
            if cmd.get_name() != "credgate" {
                assert!(!lines.is_empty(), "{name} --help has no example:\n{help}");
            }
            for words in lines {
                match Cli::try_parse_from(&words) {
                    Err(e) => panic!("{name}: example {words:?} does not parse: {e}"),
                    // What is checked before connecting passes too.
                    Ok(Cli {
                        command: Command::Ctl(args),
                        ..
                    }) => {
                        if let Err(e) = crate::cmd::ctl_guard::check_args(&args.call) {
                            panic!("{name}: example {words:?} is refused: {e}");
                        }
                    }
                    Ok(_) => {}
                }
                found.push(words.join(" "));
            }
            for sub in cmd.get_subcommands_mut() {
                if sub.get_name() != "help" {
                    walk(sub, &name, found);
                }
            }
        }
        let mut found = Vec::new();
        walk(&mut Cli::command(), "", &mut found);
        assert!(found.len() > 25, "{found:?}");
    }

    /// Every argument and option of every command says what it is in `--help`.
    #[test]
    fn every_argument_has_a_description() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            let name = format!("{path} {}", cmd.get_name());
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{name}: {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.get_name() != "help" {
                    walk(sub, &name, missing);
                }
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "", &mut missing);
        assert!(missing.is_empty(), "without a description: {missing:#?}");
    }

    /// `serve --help` groups its flags as the documents do, each heading naming its page.
    #[test]
    fn serve_flags_are_grouped_as_the_documents_group_them() {
        use clap::CommandFactory as _;
        let mut cli = Cli::command();
        let help = cli
            .find_subcommand_mut("serve")
            .unwrap()
            .render_long_help()
            .to_string();
        let headings: Vec<&str> = help
            .lines()
            .filter(|l| l.ends_with("):") && !l.starts_with(' '))
            .collect();
        assert_eq!(
            headings,
            [
                "Credential sources (docs/kubelet.md):",
                "API socket and state (docs/operations.md):",
                "Metrics and logs (docs/operations.md):",
                "Renewal (docs/snapshotters.md):",
                "Image access guard (docs/guard.md):",
                "CRI proxy (docs/cri-proxy.md):",
                "Registry mirror (docs/snapshotters.md):",
            ],
            "{help}"
        );
        for flag in [
            "--socket ",
            "--cri-proxy-socket ",
            "--renew-before ",
            "--metrics-addr ",
        ] {
            assert!(help.contains(flag), "{flag}");
        }
    }
}
