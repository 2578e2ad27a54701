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
    /// Does a matchImages/auth pattern match an image? Prints true or false.
    #[command(
        after_help = "Examples:\n  credgate match '*.dkr.ecr.*.amazonaws.com' 123456789012.dkr.ecr.us-east-1.amazonaws.com/app:v1\n  credgate match docker.io nginx:1.25\n  credgate match 'registry.io:5000/team' registry.io:5000/teams/app"
    )]
    Match(MatchArgs),
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
    #[arg(long, value_name = "[NAME=]DURATION")]
    pub plugin_timeout: Vec<String>,
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
    #[command(flatten)]
    pub sources: SourceArgs,
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

/// Parses a Go duration string that must not be negative.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = GoDuration::parse(s).map_err(|e| e.to_string())?;
    d.to_std()
        .ok_or_else(|| format!("duration {s:?} must not be negative"))
}
