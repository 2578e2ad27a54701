//! `credgate check-config`: validate a provider config as the agent would, listing every
//! problem, then warn about patterns that can never match.

use anyhow::Result;
use credgate_engine::source::{load_provider_config, LoadError};
use credgate_engine::{Engine, EngineOptions};

use crate::opts::CheckArgs;
use crate::Outcome;

pub fn run(args: CheckArgs) -> Result<Outcome> {
    let config = match load_provider_config(&args.path) {
        Ok(c) => c,
        Err(LoadError::Config(e)) => {
            for line in e.lines() {
                eprintln!("{line}");
            }
            return Ok(Outcome::No);
        }
        // `cannot read PATH: why`, printed whole by main.
        Err(e) => return Err(e.into()),
    };
    for lint in &config.lints {
        eprintln!("warning: {lint}");
    }
    let (count, identity) = (config.providers.len(), config.identity.clone());
    if let Some(dir) = args.image_credential_provider_bin_dir {
        let options = EngineOptions {
            plugin_dir: dir,
            ..Default::default()
        };
        match Engine::builder().config(config).options(options).build() {
            // Right for the kubelet's config (its plugins are the bridge), never for the
            // agent's, which refuses it: said, not failed.
            Err(e @ credgate_engine::BuildError::PluginIsTheBridge { .. }) => {
                eprintln!("note: {e} (right in the kubelet's config, refused in the agent's)");
            }
            Err(e) => {
                eprintln!("{e}");
                return Ok(Outcome::No);
            }
            Ok(_) => {}
        }
    }
    println!("ok: {count} provider(s), config {identity}");
    Ok(Outcome::Yes)
}
