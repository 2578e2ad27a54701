//! The sealed files of the state directory (`captured.sealed`, `cache.sealed`,
//! `memory.sealed`): a 16-byte header (an 8-byte magic, a version, the node key's id), a
//! 96-bit nonce, and ChaCha20-Poly1305 of the body under a key derived from the node key, with
//! the header as associated data: a file of another kind, version or node key never opens, and
//! a header changed on disk fails like a changed body. Read like every state file (no links, the
//! agent's own, size capped before reading) and replaced whole.

use std::path::{Path, PathBuf};

use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use zeroize::Zeroizing;

use super::key::NodeKey;

const HEADER: usize = 16;
const NONCE: usize = 12;
const TAG: usize = 16;

/// What a sealed file adds to its body.
pub const OVERHEAD: usize = HEADER + NONCE + TAG;

/// What a kind of sealed file is.
#[derive(Debug, Clone, Copy)]
pub struct Kind {
    /// Its name in the state directory.
    pub file: &'static str,
    pub magic: &'static [u8; 8],
    pub version: u32,
    /// What the node key is derived with for it.
    pub label: &'static [u8],
    /// The largest file the reader accepts, and so the writer writes.
    pub max: u64,
}

/// One sealed file of the state directory, with its key.
pub struct Sealed {
    dir: PathBuf,
    kind: Kind,
    key: Zeroizing<[u8; 32]>,
    key_id: u32,
}

/// What reading a sealed file found.
pub enum Read {
    /// There is none.
    Absent,
    /// Not one the agent may read (a link, not its own, too large...): why.
    Refused(String),
    /// Sealed under another node key, of another kind or an older version, or damaged.
    Unreadable,
    /// Written by a newer credgate (a later version of this kind: a rollback after an
    /// upgrade): moved aside to `kept`, neither read nor removed, so that nothing the newer
    /// version wrote is lost and this one starts as without a file.
    Newer { version: u32, kept: PathBuf },
    /// The body, in the clear.
    Body(Zeroizing<Vec<u8>>),
}

/// A body that would make a file larger than its reader accepts.
#[derive(Debug, thiserror::Error)]
#[error("{size} bytes would exceed the file's {max}-byte limit")]
pub struct TooLarge {
    pub size: usize,
    pub max: u64,
}

impl Sealed {
    pub fn new(dir: &Path, kind: Kind, node: &NodeKey) -> Sealed {
        Sealed {
            dir: dir.to_owned(),
            kind,
            key: node.derive(kind.label),
            key_id: node.id(),
        }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join(self.kind.file)
    }

    fn header(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[..8].copy_from_slice(self.kind.magic);
        h[8..12].copy_from_slice(&self.kind.version.to_be_bytes());
        h[12..].copy_from_slice(&self.key_id.to_be_bytes());
        h
    }

    /// The cipher of this file's key.
    fn cipher(&self) -> ChaCha20Poly1305 {
        ChaCha20Poly1305::new(Key::from_slice(&*self.key))
    }

    /// Reads and opens the file.
    pub fn read(&self) -> Read {
        match super::read_capped(&self.path(), self.kind.max) {
            Ok(None) => Read::Absent,
            Err(why) => Read::Refused(why.to_string()),
            Ok(Some(bytes)) => match self.newer(&bytes) {
                Some(version) => self.set_aside(version),
                None => match self.open(&bytes) {
                    Some(body) => Read::Body(body),
                    None => Read::Unreadable,
                },
            },
        }
    }

    /// The version of `bytes` when they are this kind's, of a later version than this one.
    fn newer(&self, bytes: &[u8]) -> Option<u32> {
        let version = u32::from_be_bytes(bytes.get(8..12)?.try_into().ok()?);
        (bytes.get(..8)? == self.kind.magic && version > self.kind.version).then_some(version)
    }

    /// Moves a newer version's file aside (`FILE.vN`, replacing an older one set aside).
    fn set_aside(&self, version: u32) -> Read {
        let kept = self.dir.join(format!("{}.v{version}", self.kind.file));
        match std::fs::rename(self.path(), &kept) {
            Ok(()) => Read::Newer { version, kept },
            Err(e) => Read::Refused(format!(
                "written by a newer credgate (format {version}) and it cannot be kept aside: {e}"
            )),
        }
    }

    /// The body of the file's `bytes`, when they are this kind's, sealed under this key.
    pub fn open(&self, bytes: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
        let (header, rest) = bytes.split_at_checked(HEADER)?;
        if header != self.header() {
            return None;
        }
        let (nonce, sealed) = rest.split_at_checked(NONCE)?;
        let payload = Payload {
            msg: sealed,
            aad: header,
        };
        self.cipher()
            .decrypt(Nonce::from_slice(nonce), payload)
            .ok()
            .map(Zeroizing::new)
    }

    /// Seals `body` and replaces the file: written, fsynced, renamed, the directory fsynced.
    /// A body that would pass the reader's limit is refused, and the old file stays.
    pub fn write(&self, body: &[u8]) -> Result<(), WriteError> {
        let size = body.len() + OVERHEAD;
        if size as u64 > self.kind.max {
            return Err(WriteError::TooLarge(TooLarge {
                size,
                max: self.kind.max,
            }));
        }
        let header = self.header();
        let nonce = ChaCha20Poly1305::generate_nonce(&mut OsRng);
        let payload = Payload {
            msg: body,
            aad: &header,
        };
        let sealed = self
            .cipher()
            .encrypt(&nonce, payload)
            .expect("sealing a buffer cannot fail");
        super::write_atomically(&self.dir, self.kind.file, &[&header, &nonce, &sealed])
            .map_err(WriteError::Io)
    }

    /// Removes the file; whether there was one.
    pub fn remove(&self) -> std::io::Result<bool> {
        super::discard(&self.dir, self.kind.file)
    }
}

/// Why a sealed file was not written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    TooLarge(TooLarge),
    #[error(transparent)]
    Io(std::io::Error),
}

impl From<WriteError> for std::io::Error {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::Io(e) => e,
            WriteError::TooLarge(t) => std::io::Error::other(t.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIND: Kind = Kind {
        file: "t.sealed",
        magic: b"CGTEST1\n",
        version: 1,
        label: b"test v1",
        max: 4096,
    };

    use crate::state::private_dir;

    #[test]
    fn a_body_round_trips_and_any_changed_byte_makes_the_file_unreadable() {
        let dir = private_dir();
        let sealed = Sealed::new(dir.path(), KIND, &NodeKey::from_bytes([1; 32]));
        assert!(matches!(sealed.read(), Read::Absent));
        sealed.write(b"the body, secret").unwrap();
        let bytes = std::fs::read(sealed.path()).unwrap();
        assert_eq!(bytes.len(), 16 + OVERHEAD);
        assert!(!bytes.windows(6).any(|w| w == b"secret"));
        match sealed.read() {
            Read::Body(b) => assert_eq!(&b[..], b"the body, secret"),
            _ => panic!("not read back"),
        }
        // Every byte is bound: the header (as associated data) as much as the body.
        for i in 0..bytes.len() {
            let mut changed = bytes.clone();
            changed[i] ^= 0x01;
            assert!(sealed.open(&changed).is_none(), "byte {i}");
        }
        // Another key, kind or version does not open it.
        let other_key = Sealed::new(dir.path(), KIND, &NodeKey::from_bytes([2; 32]));
        assert!(matches!(other_key.read(), Read::Unreadable));
        let v2 = Sealed::new(
            dir.path(),
            Kind { version: 2, ..KIND },
            &NodeKey::from_bytes([1; 32]),
        );
        assert!(matches!(v2.read(), Read::Unreadable));
    }

    /// A rollback: a file a newer credgate wrote (a later version of the kind) is moved aside
    /// whole, never read nor removed; the older agent then starts as without one.
    #[test]
    fn a_newer_versions_file_is_kept_aside_not_lost() {
        let dir = private_dir();
        let key = NodeKey::from_bytes([1; 32]);
        let newer = Sealed::new(dir.path(), Kind { version: 2, ..KIND }, &key);
        newer.write(b"what the newer version kept").unwrap();
        let bytes = std::fs::read(newer.path()).unwrap();
        let older = Sealed::new(dir.path(), KIND, &key);
        match older.read() {
            Read::Newer { version: 2, kept } => {
                assert_eq!(std::fs::read(&kept).unwrap(), bytes);
                assert_eq!(kept, dir.path().join("t.sealed.v2"));
            }
            _ => panic!("not set aside"),
        }
        assert!(matches!(older.read(), Read::Absent));
    }

    #[test]
    fn a_body_past_the_readers_limit_is_refused_and_the_old_file_stays() {
        let dir = private_dir();
        let sealed = Sealed::new(dir.path(), KIND, &NodeKey::from_bytes([1; 32]));
        sealed.write(b"old").unwrap();
        let fits = vec![7u8; 4096 - OVERHEAD];
        let over = vec![7u8; 4096 - OVERHEAD + 1];
        assert!(matches!(
            sealed.write(&over),
            Err(WriteError::TooLarge(TooLarge {
                size: 4097,
                max: 4096
            }))
        ));
        assert!(matches!(sealed.read(), Read::Body(b) if &b[..] == b"old"));
        sealed.write(&fits).unwrap();
        assert!(matches!(sealed.read(), Read::Body(b) if b.len() == fits.len()));
        assert!(sealed.remove().unwrap());
        assert!(!sealed.remove().unwrap());
    }
}
