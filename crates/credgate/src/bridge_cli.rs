//! The kubelet bridge's command line, in a file of its own so that `credgate man` writes its
//! page from the same definition (`credgate-credential-provider(1)`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

pub const NAME: &str = "credgate-credential-provider";

#[derive(Parser)]
#[command(
    name = NAME,
    version,
    about = "A kubelet credential provider plugin answered by the credgate agent",
    after_help = "The kubelet runs it, as any credential provider plugin: its CredentialProviderConfig names an\nentry whose name is the program in --image-credential-provider-bin-dir (a link to this bridge,\nwhich `credgate kubelet-config --link-dir DIR` makes), with `args: [--provider, NAME]`, writes a\nCredentialProviderRequest on stdin and reads the response on stdout.\n\nExample:\n  printf '{\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"kind\":\"CredentialProviderRequest\",\"image\":\"registry.example.com/team/app:v1\"}' \\\n      | credgate-credential-provider --provider credgate-example-plugin"
)]
pub struct Args {
    /// The agent's provider this entry stands for (default: this program's file name, when it
    /// is not credgate-credential-provider).
    #[arg(long, value_name = "NAME")]
    pub provider: Option<String>,
    /// The agent's socket (default: CREDGATE_SOCKET, else the default socket).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// When the agent cannot be reached, run the provider in this process from this provider
    /// config instead.
    #[arg(
        long,
        value_name = "CONFIG",
        requires = "image_credential_provider_bin_dir"
    )]
    pub fallback_in_process: Option<PathBuf>,
    /// The plugin directory of the fallback's config.
    #[arg(long, value_name = "DIR")]
    pub image_credential_provider_bin_dir: Option<PathBuf>,
    /// Also answer with the pull credential the CRI proxy captured for the image's repository:
    /// for a lazy-pull snapshotter that runs this bridge (nydus-snapshotter). Never for the
    /// kubelet: it would pull one pod's image with another pod's secret.
    #[arg(long)]
    pub captured: bool,
    /// Answer with that captured credential alone, for any image (no provider: the entry
    /// `credgate kubelet-config --captured-images` adds for images no provider matches). For a
    /// snapshotter's config only, never the kubelet's.
    #[arg(long, conflicts_with_all = ["captured", "provider", "fallback_in_process"])]
    pub captured_only: bool,
    /// The longest the kubelet may keep an answer (its cacheDuration is the agent's, capped at
    /// this): after a credential is rotated or refused, the kubelet asks again within it.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration)]
    pub max_cache_duration: Duration,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    credgate_core::duration::GoDuration::parse(s)
        .map_err(|e| e.to_string())?
        .to_std()
        .ok_or_else(|| format!("duration {s:?} must not be negative"))
}
