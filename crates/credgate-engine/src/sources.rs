//! Where an engine's credentials come from: the kubelet's provider config and plugin directory,
//! and node-wide docker config files. Read at start and again on reload.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::metrics::EngineMetrics;
use crate::source::{load_docker_config, load_provider_config, LoadError};
use crate::{BuildError, Engine, EngineOptions};

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
    /// Per-provider minimum cache durations (exec-storm protection; none by default).
    pub min_cache_durations: HashMap<String, Duration>,
    /// Per-provider limits on plugin runs a second.
    pub plugin_rates: HashMap<String, crate::rate::PluginRate>,
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

    /// A digest of every byte the sources stand for (the provider config's files and the
    /// docker config files, with their paths), so that a reload of unchanged files keeps the
    /// running engine and its caches. `None` when a file cannot be read (a reload then
    /// rebuilds, and reports what is wrong).
    pub fn fingerprint(&self) -> Option<[u8; 32]> {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let mut add = |path: &std::path::Path| -> Option<()> {
            let bytes = crate::source::read(path).ok()?;
            h.update(path.as_os_str().as_encoded_bytes());
            h.update((bytes.len() as u64).to_be_bytes());
            h.update(&bytes);
            Some(())
        };
        if let Some(config) = &self.provider_config {
            for file in crate::source::config_files(config).ok()? {
                add(&file)?;
            }
        }
        for path in &self.docker_configs {
            add(path)?;
        }
        Some(h.finalize().into())
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
                min_cache_durations: self.min_cache_durations.clone(),
                plugin_rates: self.plugin_rates.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each cause is printed once along the chain that operators read.
    #[test]
    fn a_bad_docker_config_names_its_cause_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, "[1,2]").unwrap();
        let sources = Sources {
            docker_configs: vec![path],
            ..Default::default()
        };
        let Err(e) = sources.build(None, None) else {
            panic!("a bad docker config was accepted")
        };
        let chain = credgate_core::text::error_chain(&e);
        let parts: Vec<&str> = chain.split(": ").collect();
        let mut seen = std::collections::HashSet::new();
        assert!(parts.iter().all(|p| seen.insert(*p)), "{chain}");
        assert!(chain.contains("not a docker config.json"), "{chain}");
    }
}
