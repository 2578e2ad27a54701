//! The agent's state directory and its files: the node key ([`key`]), the sealed files
//! ([`sealed`]), and the rules they all follow: the directory trusted only when it is the
//! agent's own, files opened without following links and refused unless they are the agent's
//! regular files, and the sealed files (`captured.sealed`, `cache.sealed`, `memory.sealed`)
//! read as the other state files are (no links, a regular file of the agent's uid that nobody
//! else can write, size capped before reading, never waited on) and replaced whole (written to a
//! private temporary file, fsynced, renamed into place, the directory fsynced), so that a crash
//! leaves the old file or the new one, never a mix.

pub mod key;
pub mod sealed;

use std::io::{Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

/// The file's bytes: `None` when there is none; an error (never a wait) when it is a link,
/// not a regular file, not the agent's own, writable by others, or larger than `max` bytes.
pub fn read_capped(path: &Path, max: u64) -> Result<Option<Vec<u8>>, ReadError> {
    let file = match open_trusted(path) {
        Ok(f) => f,
        Err(FileError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(FileError::Io(e)) => return Err(ReadError::Io(e)),
        Err(FileError::Untrusted(e)) => return Err(ReadError::Untrusted(e)),
    };
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(ReadError::TooLarge(max));
    }
    Ok(Some(bytes))
}

/// Why a state file was not read ([`read_capped`]).
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Untrusted(credgate_api::trust::TrustError),
    #[error("larger than {0} bytes")]
    TooLarge(u64),
}

/// Replaces `dir/file` with `parts`, written one after another: a 0600 temporary file (never
/// through a link, never waiting on a FIFO), fsynced, renamed into place, the directory
/// fsynced.
pub fn write_atomically(dir: &Path, file: &str, parts: &[&[u8]]) -> std::io::Result<()> {
    place(dir, file, parts, Place::Replace)
}

/// [`write_atomically`], but only as a new file: `AlreadyExists` when `dir/file` exists, even
/// one that appeared while this was written (the temporary file is linked, not renamed).
pub fn write_new(dir: &Path, file: &str, parts: &[&[u8]]) -> std::io::Result<()> {
    place(dir, file, parts, Place::New)
}

/// How a written file takes its name.
enum Place {
    Replace,
    New,
}

/// An unpredictable suffix for a temporary file's name.
fn random_suffix() -> String {
    use chacha20poly1305::aead::{KeyInit, OsRng};
    let key = chacha20poly1305::ChaCha20Poly1305::generate_key(&mut OsRng);
    hex::encode(&key[..8])
}

fn place(dir: &Path, file: &str, parts: &[&[u8]], how: Place) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let path = dir.join(file);
    // Created exclusively under a name nobody can guess: in a directory others can write, a
    // name planted in advance (or a link) is never opened, so the secret is never written into
    // someone else's file.
    let (mut f, tmp) = {
        let mut tries = 0;
        loop {
            let tmp = dir.join(format!(
                "{file}.{}.{}.tmp",
                std::process::id(),
                random_suffix()
            ));
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(&tmp)
            {
                Ok(f) => break (f, tmp),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 8 => tries += 1,
                Err(e) => return Err(e),
            }
        }
    };
    let mut write = || -> std::io::Result<()> {
        for part in parts {
            f.write_all(part)?;
        }
        f.sync_all()?;
        let ours = f.metadata()?;
        match how {
            Place::Replace => std::fs::rename(&tmp, &path)?,
            Place::New => {
                std::fs::hard_link(&tmp, &path)?;
                std::fs::remove_file(&tmp)?;
            }
        }
        // The name now holds the file written here, the agent's, readable by its owner alone;
        // anything else (replaced meanwhile in a directory others can write) is an error.
        let placed = std::fs::symlink_metadata(&path)?;
        if (placed.dev(), placed.ino()) != (ours.dev(), ours.ino())
            || placed.uid() != rustix::process::geteuid().as_raw()
            || placed.mode() & 0o077 != 0
        {
            return Err(std::io::Error::other(format!(
                "{} was replaced by another file while it was written",
                path.display()
            )));
        }
        std::fs::File::open(dir)?.sync_all()
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Removes `dir/file`, a sealed file an agent that keeps nothing must not leave behind;
/// whether there was one.
pub fn discard(dir: &Path, file: &str) -> std::io::Result<bool> {
    match std::fs::remove_file(dir.join(file)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// A temporary state directory as the agent keeps its own: 0700 (tests).
#[cfg(test)]
pub(crate) fn private_dir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

/// Milliseconds since the Unix epoch, by the system's clock (tests; the agent reads time
/// through its clock).
#[cfg(test)]
pub(crate) fn now_ms() -> i64 {
    credgate_engine::clock::unix_ms(std::time::SystemTime::now())
}

/// Creates the state directory (0700) when it is absent, and refuses it unless it is the
/// agent's own: not a link, owned by the agent's uid, writable by nobody else, and every
/// directory above it root's or the agent's and writable by nobody else.
pub fn state_dir(dir: &std::path::Path) -> Result<(), credgate_api::trust::TrustError> {
    use std::os::unix::fs::DirBuilderExt;
    if std::fs::symlink_metadata(dir).is_err() {
        let _ = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir);
    }
    credgate_api::trust::check_dir(dir, credgate_api::trust::Owner::Me)?;
    credgate_api::trust::check_ancestors(dir)
}

/// The file in the state directory whose lock the one agent that uses the directory holds;
/// it holds that agent's PID.
pub const LOCK_FILE: &str = "agent.lock";

/// A state directory's lock (`flock` on [`LOCK_FILE`]), held while the agent runs. The kernel
/// releases it when the holder exits, however it exits, so a SIGKILLed agent's successor
/// takes it at once.
#[derive(Debug)]
pub struct StateLock {
    _file: std::fs::File,
}

/// Why a state directory could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another credgate agent (PID {pid}) uses the state directory {}: stop it, or give this one a --state-dir of its own", .dir.display())]
    Held {
        dir: std::path::PathBuf,
        pid: String,
    },
    #[error("cannot lock {}", .path.display())]
    Io {
        path: std::path::PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("refusing the lock file")]
    Untrusted(#[source] credgate_api::trust::TrustError),
}

/// Locks the state directory `dir` for this process before anything in it is read or written;
/// [`LockError::Held`] at once, naming the holder's PID, when another agent holds it.
pub fn lock(dir: &std::path::Path) -> Result<StateLock, LockError> {
    use std::io::{Read as _, Write as _};
    let path = dir.join(LOCK_FILE);
    let io = |error| LockError::Io {
        path: path.clone(),
        error,
    };
    let mut file = match create_trusted(&path) {
        Ok(f) => f,
        Err(FileError::Io(e)) => return Err(io(e)),
        Err(FileError::Untrusted(e)) => return Err(LockError::Untrusted(e)),
    };
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut held = String::new();
            let _ = (&mut file).take(32).read_to_string(&mut held);
            let pid = held
                .trim()
                .parse::<u32>()
                .map_or_else(|_| "unknown".to_owned(), |p| p.to_string());
            return Err(LockError::Held {
                dir: dir.to_owned(),
                pid,
            });
        }
        Err(e) => return Err(io(e.into())),
    }
    file.set_len(0).map_err(io)?;
    writeln!(file, "{}", std::process::id()).map_err(io)?;
    Ok(StateLock { _file: file })
}

/// Why a state file could not be opened.
pub(crate) enum FileError {
    Io(std::io::Error),
    Untrusted(credgate_api::trust::TrustError),
}

/// Opens an existing file of the state directory: see [`create_trusted`].
pub(crate) fn open_trusted(path: &std::path::Path) -> Result<std::fs::File, FileError> {
    trusted_file(path, Open::Existing)
}

/// Opens a file of the state directory without following a link, creating it 0600 when
/// absent, and refuses it unless it is a regular file (a FIFO is refused without waiting for a
/// writer), the agent owns it and nobody else can write it.
pub(crate) fn create_trusted(path: &std::path::Path) -> Result<std::fs::File, FileError> {
    trusted_file(path, Open::OrCreate)
}

#[derive(PartialEq)]
enum Open {
    Existing,
    OrCreate,
}

fn trusted_file(path: &std::path::Path, how: Open) -> Result<std::fs::File, FileError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .append(how == Open::OrCreate)
        .create(how == Open::OrCreate)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                FileError::Untrusted(credgate_api::trust::TrustError::Symlink(path.to_owned()))
            } else {
                FileError::Io(e)
            }
        })?;
    let meta = file.metadata().map_err(FileError::Io)?;
    credgate_api::trust::check(path, &meta, credgate_api::trust::Owner::Me)
        .map_err(FileError::Untrusted)?;
    if !meta.is_file() {
        return Err(FileError::Untrusted(
            credgate_api::trust::TrustError::WrongKind {
                path: path.to_owned(),
                want: "regular file",
            },
        ));
    }
    // A second name could sit in a directory that is not the agent's.
    use std::os::unix::fs::MetadataExt as _;
    if meta.nlink() > 1 {
        return Err(FileError::Untrusted(
            credgate_api::trust::TrustError::HardLinked {
                path: path.to_owned(),
                links: meta.nlink(),
            },
        ));
    }
    Ok(file)
}
