//! Where an engine's credentials come from: the kubelet's provider config and plugin directory,
//! and node-wide docker config files. Read at start and again on reload.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use credgate_engine::clock::Clock;
use credgate_engine::metrics::EngineMetrics;
use credgate_engine::source::{load_docker_config, load_provider_config, LoadError};
use credgate_engine::{BuildError, Engine, EngineOptions};

/// Why an engine could not be built from its sources.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("invalid provider config {path}")]
    ProviderConfig {
        path: PathBuf,
        #[source]
        source: LoadError,
    },
    #[error(
        "--image-credential-provider-bin-dir is required with --image-credential-provider-config"
    )]
    NoBinDir,
    #[error("invalid docker config")]
    DockerConfig(#[source] LoadError),
    #[error("cannot start the credential engine")]
    Build(#[source] BuildError),
}

/// The sources of an engine, as flags give them.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// `--image-credential-provider-config`: a file or a directory.
    pub provider_config: Option<PathBuf>,
    /// `--image-credential-provider-bin-dir`.
    pub bin_dir: Option<PathBuf>,
    /// Docker config files, read in this order before the plugins.
    pub docker_configs: Vec<PathBuf>,
    /// Plugin timeout unless overridden.
    pub default_timeout: Option<Duration>,
    /// Per-provider plugin timeouts.
    pub timeouts: HashMap<String, Duration>,
}

impl Sources {
    /// The kubelet's default docker config locations: the first that exists of
    /// `/var/lib/kubelet/config.json`, `$HOME/.docker/config.json`, `/.docker/config.json`.
    pub fn default_docker_configs() -> Vec<PathBuf> {
        let mut candidates = vec![PathBuf::from("/var/lib/kubelet/config.json")];
        if let Some(home) = std::env::var_os("HOME") {
            candidates.push(PathBuf::from(home).join(".docker/config.json"));
        }
        candidates.push(PathBuf::from("/.docker/config.json"));
        candidates
            .into_iter()
            .find(|p| p.is_file())
            .into_iter()
            .collect()
    }

    /// Reads every source and builds an engine. Never runs a plugin.
    pub fn build(
        &self,
        metrics: Option<EngineMetrics>,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<Engine, SourceError> {
        let mut builder = Engine::builder();
        if let Some(path) = &self.provider_config {
            let config =
                load_provider_config(path).map_err(|source| SourceError::ProviderConfig {
                    path: path.clone(),
                    source,
                })?;
            let dir = self.bin_dir.clone().ok_or(SourceError::NoBinDir)?;
            let defaults = EngineOptions::default();
            builder = builder.config(config).options(EngineOptions {
                plugin_dir: dir,
                default_timeout: self.default_timeout.unwrap_or(defaults.default_timeout),
                timeouts: self.timeouts.clone(),
                ..defaults
            });
        }
        for path in &self.docker_configs {
            let source = load_docker_config(path).map_err(SourceError::DockerConfig)?;
            builder = builder.static_source(source);
        }
        if let Some(m) = metrics {
            builder = builder.metrics(m);
        }
        if let Some(c) = clock {
            builder = builder.clock(c);
        }
        builder.build().map_err(SourceError::Build)
    }
}
