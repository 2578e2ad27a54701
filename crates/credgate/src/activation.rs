//! Listening sockets a service manager hands over (systemd's socket activation: `LISTEN_FDS`,
//! `LISTEN_PID`, `LISTEN_FDNAMES`; `deploy/systemd/credgate.socket`), so that the sockets
//! outlive the process: while the agent restarts or is upgraded, the kubelet's and the
//! runtimes' connections wait in the sockets' backlog for the next process instead of failing.
//!
//! Each socket handed over must be a listening unix stream socket, or the agent refuses to start
//! and says why. A flag's socket (`--socket`, `--cri-proxy-socket`) is the one named for it
//! (`api`, `cri`: `FileDescriptorName=`), which must be bound to the flag's path, or else the one
//! bound to that path (one `credgate.socket` unit with two `ListenStream=` hands both over under
//! the unit's name); a flag's socket not handed over is bound as usual (and logged). The
//! descriptors are made close-on-exec (plugins never inherit them) and non-blocking (as tokio
//! takes them), and the variables removed, once, before any thread starts.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

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
    #[error("LISTEN_FDNAMES names {names} sockets, LISTEN_FDS hands over {fds}")]
    Count { names: usize, fds: usize },
}

/// The sockets handed over: name, the path each is bound to, the socket.
#[derive(Debug, Default)]
pub struct Handed {
    sockets: Vec<(String, Option<PathBuf>, UnixListener)>,
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
            None => vec!["unknown".into(); count],
        };
        if names.len() != count {
            return Err(ActivationError::Count {
                names: names.len(),
                fds: count,
            });
        }
        for (index, name) in names.into_iter().enumerate() {
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
            // Made close-on-exec by listenfd; non-blocking here, as tokio takes a listener.
            listener
                .set_nonblocking(true)
                .map_err(|e| not_unix(e.to_string()))?;
            let bound = listener
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(Path::to_owned));
            handed.sockets.push((name, bound, listener));
        }
        Ok(handed)
    }

    /// The socket handed over for `path` (`flag` names it): the one named `name`, which must be
    /// bound to `path`, else the one bound to `path`; `None` when none was, and the caller
    /// binds `path` itself.
    pub fn take(
        &mut self,
        name: &'static str,
        path: &Path,
        flag: &'static str,
    ) -> Result<Option<UnixListener>, ActivationError> {
        let at = match self.sockets.iter().position(|(n, _, _)| n == name) {
            Some(at) => Some(at),
            None => self
                .sockets
                .iter()
                .position(|(_, bound, _)| bound.as_deref() == Some(path)),
        };
        if let Some(at) = at {
            // Taken by its name, it must be at the flag's path (by its path, it is).
            let (_, bound, listener) = self.sockets.remove(at);
            if bound.as_deref() != Some(path) {
                return Err(ActivationError::OtherPath {
                    name,
                    bound: bound.map_or_else(|| "no path".into(), |b| b.display().to_string()),
                    wanted: path.display().to_string(),
                    flag,
                });
            }
            tracing::info!(name, path = %path.display(), "serving on the socket the service manager handed over");
            return Ok(Some(listener));
        }
        if self.activated {
            tracing::info!(name, path = %path.display(), "no socket handed over for it: binding it");
        }
        Ok(None)
    }

    /// The sockets handed over that no flag took (a `cri` socket without
    /// `--cri-proxy-socket`), by name and path.
    pub fn left(&self) -> Vec<String> {
        self.sockets
            .iter()
            .map(|(n, b, _)| {
                format!(
                    "{n} ({})",
                    b.as_deref()
                        .map_or("no path".into(), |b| b.display().to_string())
                )
            })
            .collect()
    }
}
