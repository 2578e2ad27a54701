//! Listening sockets a service manager hands over (systemd's socket activation: `LISTEN_FDS`,
//! `LISTEN_PID`, `LISTEN_FDNAMES`; `deploy/systemd/credgate-*.socket`), so that the sockets
//! outlive the process: while the agent restarts or is upgraded, the kubelet's and the
//! runtimes' connections wait in the sockets' backlog for the next process instead of failing.
//!
//! Two names are taken: `api` (`--socket`) and `cri` (`--cri-proxy-socket`). Each must be a
//! listening unix stream socket bound to the path its flag names, or the agent refuses to start
//! and says why; a name not handed over is bound as usual (and logged). The descriptors are
//! made close-on-exec (plugins never inherit them) and the variables removed, once, before any
//! thread starts.

use std::collections::BTreeMap;
use std::os::unix::net::UnixListener;
use std::path::Path;

/// The names credgate takes.
pub const NAMES: [&str; 2] = ["api", "cri"];

/// Why handed-over sockets were refused.
#[derive(Debug, thiserror::Error)]
pub enum ActivationError {
    #[error("the socket handed over as {name:?} (descriptor {fd}) is not a listening unix stream socket: {why}")]
    NotUnix {
        name: String,
        fd: usize,
        why: String,
    },
    #[error("the socket handed over as {name:?} is bound to {bound}, not to {wanted} ({flag})")]
    OtherPath {
        name: &'static str,
        bound: String,
        wanted: String,
        flag: &'static str,
    },
    #[error("{0} sockets were handed over without names: name them api and cri (systemd: FileDescriptorName=)")]
    Unnamed(usize),
    #[error("a socket was handed over as {0:?}: credgate takes api and cri")]
    UnknownName(String),
    #[error("LISTEN_FDNAMES names {names} sockets, LISTEN_FDS hands over {fds}")]
    Count { names: usize, fds: usize },
}

/// The sockets handed over, by name.
#[derive(Debug, Default)]
pub struct Handed {
    sockets: BTreeMap<&'static str, UnixListener>,
    /// Whether a service manager handed anything over at all.
    pub activated: bool,
}

impl Handed {
    /// Takes what the environment hands over. Call once, before any thread starts: it
    /// removes the variables.
    pub fn from_env() -> Result<Handed, ActivationError> {
        let mut fds = listenfd::ListenFd::from_env();
        let names = std::env::var("LISTEN_FDNAMES").ok();
        for var in ["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"] {
            // Edition 2021: safe, and no other thread runs yet.
            std::env::remove_var(var);
        }
        let count = fds.len();
        let mut handed = Handed {
            activated: count > 0,
            ..Handed::default()
        };
        if count == 0 {
            return Ok(handed);
        }
        let names: Vec<String> = match names {
            Some(n) => n.split(':').map(str::to_owned).collect(),
            None if count == 1 => vec!["api".into()],
            None => return Err(ActivationError::Unnamed(count)),
        };
        if names.len() != count {
            return Err(ActivationError::Count {
                names: names.len(),
                fds: count,
            });
        }
        for (index, name) in names.into_iter().enumerate() {
            let Some(known) = NAMES.into_iter().find(|n| *n == name) else {
                return Err(ActivationError::UnknownName(name));
            };
            let not_unix = |why: String| ActivationError::NotUnix {
                name: name.clone(),
                fd: 3 + index,
                why,
            };
            let listener = fds
                .take_unix_listener(index)
                .map_err(|e| not_unix(e.to_string()))?
                .ok_or_else(|| not_unix("taken already".into()))?;
            // A datagram socket or one that does not listen is no API.
            if !rustix::net::sockopt::socket_acceptconn(&listener)
                .map_err(|e| not_unix(e.to_string()))?
            {
                return Err(not_unix("it does not listen".into()));
            }
            rustix::io::fcntl_setfd(&listener, rustix::io::FdFlags::CLOEXEC)
                .map_err(|e| not_unix(e.to_string()))?;
            handed.sockets.insert(known, listener);
        }
        Ok(handed)
    }

    /// The socket handed over as `name`, checked to be bound to `path` (`flag` names it);
    /// `None` when none was, and the caller binds `path` itself.
    pub fn take(
        &mut self,
        name: &'static str,
        path: &Path,
        flag: &'static str,
    ) -> Result<Option<UnixListener>, ActivationError> {
        let Some(listener) = self.sockets.remove(name) else {
            if self.activated {
                tracing::info!(name, path = %path.display(), "no socket handed over by that name: binding it");
            }
            return Ok(None);
        };
        let bound = listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(Path::to_owned));
        if bound.as_deref() != Some(path) {
            return Err(ActivationError::OtherPath {
                name,
                bound: bound.map_or_else(|| "no path".into(), |b| b.display().to_string()),
                wanted: path.display().to_string(),
                flag,
            });
        }
        tracing::info!(name, path = %path.display(), "serving on the socket the service manager handed over");
        Ok(Some(listener))
    }

    /// The names handed over that no flag took (a `cri` socket without `--cri-proxy-socket`).
    pub fn left(&self) -> Vec<&'static str> {
        self.sockets.keys().copied().collect()
    }
}
