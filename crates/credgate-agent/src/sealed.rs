//! The agent's sealed state files (`captured.sealed`, `cache.sealed`): read as the other state
//! files are (no links, a regular file of the agent's uid that nobody else can write, size
//! capped before reading, never waited on) and replaced whole (written to a private temporary
//! file, fsynced, renamed into place, the directory fsynced), so that a crash leaves the old
//! file or the new one, never a mix.

use std::io::{Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

/// The file's bytes: `None` when there is none; an error (never a wait) when it is a link,
/// not a regular file, not the agent's own, writable by others, or larger than `max` bytes.
pub fn read_capped(path: &Path, max: u64) -> Result<Option<Vec<u8>>, String> {
    let file = match crate::guard::trusted_file(path, false) {
        Ok(f) => f,
        Err(crate::guard::FileError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None)
        }
        Err(crate::guard::FileError::Io(e)) => return Err(e.to_string()),
        Err(crate::guard::FileError::Untrusted(e)) => return Err(e.to_string()),
    };
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > max {
        return Err(format!("larger than {max} bytes"));
    }
    Ok(Some(bytes))
}

/// Replaces `dir/file` with `parts`, written one after another: a 0600 temporary file (never
/// through a link, never waiting on a FIFO), fsynced, renamed into place, the directory
/// fsynced.
pub fn write_atomically(dir: &Path, file: &str, parts: &[&[u8]]) -> std::io::Result<()> {
    let path = dir.join(file);
    let tmp = dir.join(format!("{file}.{}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&tmp)?;
        for part in parts {
            f.write_all(part)?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(dir)?.sync_all()
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}
