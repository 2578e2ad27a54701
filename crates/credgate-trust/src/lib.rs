//! Whether a path may be trusted: a socket a client is about to send secrets to or take
//! credentials from, a directory the agent keeps its key and records in, a file it reads
//! credentials or instructions from (a docker config, containerd's config). A path is trusted
//! when it is not a symbolic link, its owner is one we trust, and nobody else can write it;
//! and, for a file the agent reads or writes, the same of every directory above it
//! ([`check_ancestors`]): whoever can write a directory can replace what is in it.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why a path is not trusted.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("{0} is a symbolic link; refusing to follow it")]
    Symlink(PathBuf),
    #[error("{path} is owned by uid {owner}, not by uid {uid}{or_root}; refusing to trust it", or_root = if *.root_too { " or root" } else { "" })]
    NotOwned {
        path: PathBuf,
        owner: u32,
        uid: u32,
        root_too: bool,
    },
    #[error("{path} can be written by other users (mode {mode:o}); refusing to trust it")]
    WritableByOthers { path: PathBuf, mode: u32 },
    #[error("{path} is not a {want}")]
    WrongKind { path: PathBuf, want: &'static str },
    /// Another name of the file lives elsewhere (perhaps where another user can swap it).
    #[error("{path} has {links} hard links; refusing to trust it")]
    HardLinked { path: PathBuf, links: u64 },
    /// The cause is in the message (and so not a `source`: a chain prints it once).
    #[error("cannot inspect {path}: {error}")]
    Io { path: PathBuf, error: io::Error },
}

/// Who may own a trusted path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// This process's effective uid only: the agent's state.
    Me,
    /// This process's effective uid or root: a socket a client talks to, its directory.
    MeOrRoot,
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Checks metadata already taken (with `symlink_metadata`, or of an open file).
pub fn check(path: &Path, meta: &std::fs::Metadata, owner: Owner) -> Result<(), TrustError> {
    if meta.file_type().is_symlink() {
        return Err(TrustError::Symlink(path.to_owned()));
    }
    owned(path, meta, owner)?;
    let mode = meta.permissions().mode() & 0o7777;
    // A sticky directory (`/tmp`) lets others add entries but not replace ours.
    let sticky_dir = meta.is_dir() && mode & 0o1000 != 0;
    if mode & 0o022 != 0 && !sticky_dir {
        return Err(TrustError::WritableByOthers {
            path: path.to_owned(),
            mode,
        });
    }
    Ok(())
}

fn metadata(path: &Path) -> Result<std::fs::Metadata, TrustError> {
    std::fs::symlink_metadata(path).map_err(|error| TrustError::Io {
        path: path.to_owned(),
        error,
    })
}

/// A directory: trusted as `owner` says, and a directory.
pub fn check_dir(path: &Path, owner: Owner) -> Result<(), TrustError> {
    let meta = metadata(path)?;
    check(path, &meta, owner)?;
    if !meta.is_dir() {
        return Err(TrustError::WrongKind {
            path: path.to_owned(),
            want: "directory",
        });
    }
    Ok(())
}

/// Every directory above `path`, up to `/`: owned by this uid or root and writable by nobody
/// else (a sticky directory such as `/tmp` passes: others may add entries there, not replace
/// ours). Checked along the path as written (a link on the way must be this uid's or root's,
/// in a directory that passes) and along the path the kernel resolves, so neither a link nor a
/// directory on the way can be swapped by another user.
pub fn check_ancestors(path: &Path) -> Result<(), TrustError> {
    let absolute = if path.is_absolute() {
        path.to_owned()
    } else {
        std::env::current_dir()
            .map_err(|error| TrustError::Io {
                path: path.to_owned(),
                error,
            })?
            .join(path)
    };
    let Some(parent) = absolute.parent() else {
        return Ok(());
    };
    for dir in parent.ancestors() {
        let meta = metadata(dir)?;
        if meta.file_type().is_symlink() {
            owned(dir, &meta, Owner::MeOrRoot)?;
        } else {
            check(dir, &meta, Owner::MeOrRoot)?;
        }
    }
    let resolved = parent.canonicalize().map_err(|error| TrustError::Io {
        path: parent.to_owned(),
        error,
    })?;
    if resolved != parent {
        for dir in resolved.ancestors() {
            check(dir, &metadata(dir)?, Owner::MeOrRoot)?;
        }
    }
    Ok(())
}

/// A file the agent reads credentials or instructions from, where it may be a link (a docker
/// config mounted from a Secret is one): the file it resolves to owned by this uid or root and
/// writable by nobody else, every directory above the path and above what it resolves to
/// likewise, and every link on the way this uid's or root's.
pub fn check_file_chain(path: &Path) -> Result<(), TrustError> {
    check_ancestors(path)?;
    let meta = metadata(path)?;
    if !meta.file_type().is_symlink() {
        return check(path, &meta, Owner::MeOrRoot);
    }
    owned(path, &meta, Owner::MeOrRoot)?;
    let resolved = path.canonicalize().map_err(|error| TrustError::Io {
        path: path.to_owned(),
        error,
    })?;
    check_ancestors(&resolved)?;
    check(&resolved, &metadata(&resolved)?, Owner::MeOrRoot)
}

fn owned(path: &Path, meta: &std::fs::Metadata, owner: Owner) -> Result<(), TrustError> {
    let uid = euid();
    let root_too = owner == Owner::MeOrRoot;
    if meta.uid() != uid && !(root_too && meta.uid() == 0) {
        return Err(TrustError::NotOwned {
            path: path.to_owned(),
            owner: meta.uid(),
            uid,
            root_too,
        });
    }
    Ok(())
}

/// The agent's socket as a client sees it: the socket and its directory owned by this uid or
/// root, neither writable by others (the socket's group may be granted access: that is how
/// the agent shares it).
pub fn check_socket(path: &Path) -> Result<(), TrustError> {
    use std::os::unix::fs::FileTypeExt;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        // No socket: connecting says so. Its directory, when there is one, must still be one
        // that nobody else could plant a socket in later.
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(dir) = dir.filter(|d| d.exists()) {
                check_dir(dir, Owner::MeOrRoot)?;
            }
            return Ok(());
        }
        Err(error) => {
            return Err(TrustError::Io {
                path: path.to_owned(),
                error,
            })
        }
    };
    if meta.file_type().is_symlink() {
        return Err(TrustError::Symlink(path.to_owned()));
    }
    if !meta.file_type().is_socket() {
        return Err(TrustError::WrongKind {
            path: path.to_owned(),
            want: "socket",
        });
    }
    let uid = euid();
    if meta.uid() != uid && meta.uid() != 0 {
        return Err(TrustError::NotOwned {
            path: path.to_owned(),
            owner: meta.uid(),
            uid,
            root_too: true,
        });
    }
    if let Some(dir) = dir {
        check_dir(dir, Owner::MeOrRoot)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    /// Each cause is printed once in a chain, for every error of this module and of the
    /// blocking client.
    #[test]
    fn every_error_prints_each_cause_once() {
        use credgate_core::text::repeated_cause;
        let io = || std::io::Error::other("disk on fire");
        let inspect = || TrustError::Io {
            path: "/x".into(),
            error: io(),
        };
        let errors: Vec<Box<dyn std::error::Error>> = vec![
            Box::new(inspect()),
            Box::new(TrustError::Symlink("/x".into())),
        ];
        for e in &errors {
            assert_eq!(repeated_cause(&**e), None, "{e}");
        }
    }
    use super::*;

    #[test]
    fn a_private_directory_is_trusted_and_a_shared_or_linked_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("state");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        check_dir(&d, Owner::Me).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o770)).unwrap();
        let e = check_dir(&d, Owner::Me).unwrap_err();
        assert!(matches!(e, TrustError::WritableByOthers { .. }), "{e}");
        assert!(e.to_string().contains("mode 770"), "{e}");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
        check_dir(&d, Owner::Me).expect("sticky directories keep entries to their owners");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        assert!(matches!(
            check_dir(&link, Owner::Me),
            Err(TrustError::Symlink(_))
        ));
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(matches!(
            check_dir(&file, Owner::Me),
            Err(TrustError::WrongKind { .. })
        ));
    }

    /// A file in a directory another user can write, or below one, is refused; a sticky
    /// directory on the way is not; a link is followed only when it and what it leads to pass.
    #[test]
    fn a_file_below_a_shared_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path().join("top");
        let sub = top.join("sub");
        std::fs::create_dir_all(&sub).unwrap();
        let file = sub.join("config.json");
        std::fs::write(&file, "{}").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        for d in [&top, &sub] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        check_file_chain(&file).unwrap();
        check_ancestors(&file).unwrap();
        // The file's own directory writable by others.
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_file_chain(&file).unwrap_err();
        assert!(
            matches!(&e, TrustError::WritableByOthers { path, .. } if path == &sub),
            "{e}"
        );
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o755)).unwrap();
        // A directory further up (whoever can rename `sub` can replace the file).
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o775)).unwrap();
        let e = check_ancestors(&file).unwrap_err();
        assert!(
            matches!(&e, TrustError::WritableByOthers { path, .. } if path == &top),
            "{e}"
        );
        // Sticky: others may add, not replace.
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o1777)).unwrap();
        check_file_chain(&file).unwrap();
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o755)).unwrap();
        // A link to a file in a shared directory is refused; to a trusted one, followed.
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let planted = shared.join("config.json");
        std::fs::write(&planted, "{}").unwrap();
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o600)).unwrap();
        let link = top.join("link.json");
        std::os::unix::fs::symlink(&planted, &link).unwrap();
        assert!(matches!(
            check_file_chain(&link),
            Err(TrustError::WritableByOthers { .. })
        ));
        std::fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink(&file, &link).unwrap();
        check_file_chain(&link).unwrap();
        // A file others can write is refused wherever it is.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(matches!(
            check_file_chain(&file),
            Err(TrustError::WritableByOthers { .. })
        ));
    }

    #[test]
    fn a_socket_must_be_a_socket_in_a_trusted_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().join("s.sock");
        let _l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        check_socket(&path).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(
            check_socket(&path),
            Err(TrustError::WritableByOthers { .. })
        ));
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "").unwrap();
        assert!(matches!(
            check_socket(&file),
            Err(TrustError::WrongKind { .. })
        ));
    }
}
