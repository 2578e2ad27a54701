//! Reading sources from disk: the provider config (a file, or a directory of `.json`, `.yaml`
//! and `.yml` files read in sorted order) and node-wide docker config files.

use std::io;
use std::path::{Path, PathBuf};

use credgate_core::config::{ConfigError, Document, ProviderConfig};
use credgate_core::dockerconfig::{self, DockerConfigError};
use credgate_core::keyring::AuthSet;

use crate::engine::StaticSource;

/// Why a file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no .json, .yaml or .yml files in {0}")]
    EmptyDirectory(PathBuf),
    #[error("{path} is larger than {max} bytes")]
    TooLarge { path: PathBuf, max: u64 },
    #[error("{0} is not a regular file")]
    NotAFile(PathBuf),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: {error}")]
    DockerConfig {
        path: PathBuf,
        error: DockerConfigError,
    },
    /// A docker config (it holds credentials the agent hands out) that another user could
    /// write or replace.
    #[error(transparent)]
    Untrusted(#[from] credgate_trust::TrustError),
}

/// The largest config file read (a provider config file, a docker config): far above any real
/// one, so that a file that grows without end (`/dev/zero`, a log) is refused, not read.
pub const MAX_FILE: u64 = 4 << 20;

/// Reads a config file: a regular file (a FIFO or a device is refused without blocking on
/// it) of at most [`MAX_FILE`] bytes.
pub fn read(path: &Path) -> Result<Vec<u8>, LoadError> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let io = |source| LoadError::Read {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(io)?;
    if !file.metadata().map_err(io)?.is_file() {
        return Err(LoadError::NotAFile(path.to_owned()));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(LoadError::TooLarge {
            path: path.to_owned(),
            max: MAX_FILE,
        });
    }
    Ok(bytes)
}

/// The files a provider config path stands for, in the order they are read.
pub fn config_files(path: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let meta = std::fs::metadata(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })?;
    if !meta.is_dir() {
        return Ok(vec![path.to_owned()]);
    }
    let entries = std::fs::read_dir(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| LoadError::Read {
            path: path.to_owned(),
            source,
        })?;
        let p = entry.path();
        let ext_ok = matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("json" | "yaml" | "yml")
        );
        if ext_ok && std::fs::metadata(&p).is_ok_and(|m| m.is_file()) {
            files.push(p);
        }
    }
    if files.is_empty() {
        return Err(LoadError::EmptyDirectory(path.to_owned()));
    }
    files.sort();
    Ok(files)
}

/// Loads and validates a provider config from a file or a directory.
pub fn load_provider_config(path: &Path) -> Result<ProviderConfig, LoadError> {
    let files = config_files(path)?;
    let contents = files
        .iter()
        .map(|f| read(f))
        .collect::<Result<Vec<_>, _>>()?;
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    let docs: Vec<Document<'_>> = names
        .iter()
        .zip(&contents)
        .map(|(name, bytes)| Document { name, bytes })
        .collect();
    Ok(ProviderConfig::from_documents(&docs)?)
}

/// Loads a docker `config.json` as a static source; keys that do not parse are logged and left
/// out. The file, what it links to and every directory above them must be this user's or
/// root's and writable by nobody else (`credgate_trust::check_file_chain`).
pub fn load_docker_config(path: &Path) -> Result<StaticSource, LoadError> {
    match credgate_trust::check_file_chain(path) {
        // A missing file is read's to report, as it always was.
        Err(credgate_trust::TrustError::Io { error, .. })
            if error.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
        Ok(()) => {}
    }
    let bytes = read(path)?;
    let items = dockerconfig::parse(&bytes).map_err(|error| LoadError::DockerConfig {
        path: path.to_owned(),
        error,
    })?;
    let (auth, invalid) = AuthSet::new(items);
    for bad in invalid {
        tracing::warn!(path = %path.display(), key = %bad.key, error = %bad.error, "docker config key ignored");
    }
    Ok(StaticSource {
        name: path.display().to_string(),
        auth,
    })
}
