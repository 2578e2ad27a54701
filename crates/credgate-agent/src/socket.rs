//! The agent's unix socket: created with its final permissions before anyone can connect, never
//! taken over from a live agent, and replaced when a crashed run left it behind.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;

/// Why the socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("another agent is serving on {0}")]
    InUse(PathBuf),
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("unknown group {0:?}")]
    UnknownGroup(String),
    #[error("refusing the socket's directory: {0}")]
    Untrusted(credgate_api::trust::TrustError),
    #[error("cannot set up socket {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Who may connect.
#[derive(Debug, Clone, Default)]
pub struct SocketAccess {
    /// A group whose members may connect too (mode 0660); owner only (0600) when `None`.
    pub group: Option<String>,
}

/// Binds the agent's socket at `path`. Its directory is created (0755) when absent and refused
/// unless this uid or root owns it and nobody else can write it.
///
/// The socket is bound under a temporary name in the same directory, given its mode and group,
/// then renamed into place, so it never exists at `path` with looser permissions. An existing
/// socket at `path` that accepts connections belongs to a live agent: that is an error. One that
/// refuses them is stale and is replaced.
pub async fn bind(path: &Path, access: &SocketAccess) -> Result<UnixListener, SocketError> {
    let io_err = |source| SocketError::Io {
        path: path.to_owned(),
        source,
    };
    let gid = access.group.as_deref().map(group_id).transpose()?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(io_err)?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
                .map_err(io_err)?;
        }
        // A directory another user owns or can write (`/tmp/credgate-$UID` made first by
        // someone else) would let that user replace the socket with one of their own.
        credgate_api::trust::check_dir(dir, credgate_api::trust::Owner::MeOrRoot)
            .map_err(SocketError::Untrusted)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if tokio::net::UnixStream::connect(path).await.is_ok() {
                return Err(SocketError::InUse(path.to_owned()));
            }
            tracing::info!(path = %path.display(), "replacing a stale socket");
        }
        Ok(_) => return Err(SocketError::NotASocket(path.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(e)),
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(io_err)?;
    let mode = if gid.is_some() { 0o660 } else { 0o600 };
    let setup = (|| {
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
        if let Some(gid) = gid {
            std::os::unix::fs::chown(&tmp, None, Some(gid))?;
        }
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = setup {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(e));
    }
    Ok(listener)
}

/// Which file a socket path names (device and inode), to tell later whether it is still the
/// socket this process bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketId {
    dev: u64,
    ino: u64,
}

/// The identity of the socket at `path` now.
pub fn identity(path: &Path) -> Option<SocketId> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| SocketId {
        dev: m.dev(),
        ino: m.ino(),
    })
}

/// Removes the socket at shutdown, if `path` still names the socket this process bound
/// (`bound`): a newer agent that has bound the path since keeps its socket.
pub fn remove_if_ours(path: &Path, bound: Option<SocketId>) {
    if bound.is_none() || identity(path) != bound {
        tracing::info!(path = %path.display(), "the socket was replaced by another agent; left in place");
        return;
    }
    remove(path);
}

/// Removes the socket at shutdown.
pub fn remove(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove socket");
        }
    }
}

fn group_id(name: &str) -> Result<u32, SocketError> {
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(gid);
    }
    credgate_engine::sys::group_id(name).ok_or_else(|| SocketError::UnknownGroup(name.to_owned()))
}
