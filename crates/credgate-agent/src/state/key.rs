//! The node's secret key for credential hashes: 32 random bytes in `node.key` under the state
//! directory (0600), created at first start. Hashes are HMAC-SHA-256 under this key, never plain
//! hashes, so the records cannot be used to test password guesses offline or to see which
//! tenants share a credential. Losing the key only means every record needs re-verification.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use credgate_core::guard::CredentialHash;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Why the key could not be read or created.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read or create the node key {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the node key {path} is damaged (expected 32 bytes, found {len}); remove it to start over (every record will need re-verification)")]
    Damaged { path: PathBuf, len: usize },
    #[error(transparent)]
    Untrusted(#[from] credgate_api::trust::TrustError),
    #[error("the node key {path} can be read by other users (mode {mode:o}); refusing to use it")]
    Exposed { path: PathBuf, mode: u32 },
}

/// The node's hashing key, kept as an HMAC already keyed (cloning it skips the key schedule).
#[derive(Clone)]
pub struct NodeKey {
    mac: Hmac<Sha256>,
    id: u32,
}

impl std::fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeKey(<redacted>)")
    }
}

impl NodeKey {
    /// Reads `dir/node.key`, creating it when absent. The directory, and the key, must be the
    /// agent's own (not links, owned by its uid, writable by nobody else); the key must be
    /// readable by nobody else.
    pub fn load_or_create(dir: &Path) -> Result<NodeKey, KeyError> {
        use std::os::unix::fs::PermissionsExt;
        crate::state::state_dir(dir)?;
        let path = dir.join("node.key");
        let io = |source| KeyError::Io {
            path: path.clone(),
            source,
        };
        let opened = crate::state::open_trusted(&path).and_then(|f| {
            let mode = f
                .metadata()
                .map_err(crate::state::FileError::Io)?
                .permissions()
                .mode()
                & 0o777;
            Ok((f, mode))
        });
        match opened {
            Err(crate::state::FileError::Untrusted(e)) => Err(e.into()),
            Ok((_, mode)) if mode & 0o077 != 0 => Err(KeyError::Exposed {
                path: path.clone(),
                mode,
            }),
            Ok((mut f, _)) => {
                let mut buf = Vec::new();
                f.read_to_end(&mut buf).map_err(io)?;
                let key: [u8; 32] = buf.as_slice().try_into().map_err(|_| KeyError::Damaged {
                    path: path.clone(),
                    len: buf.len(),
                })?;
                Ok(NodeKey::from_bytes(key))
            }
            Err(crate::state::FileError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut key = [0u8; 32];
                std::fs::File::open("/dev/urandom")
                    .and_then(|mut r| r.read_exact(&mut key))
                    .map_err(io)?;
                let tmp = dir.join(format!("node.key.{}.tmp", std::process::id()));
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&tmp)
                    .map_err(io)?;
                f.write_all(&key).and_then(|_| f.sync_all()).map_err(io)?;
                // Never replace a key another process created meanwhile.
                match std::fs::hard_link(&tmp, &path) {
                    Ok(()) => {
                        let _ = std::fs::remove_file(&tmp);
                        if let Ok(d) = std::fs::File::open(dir) {
                            let _ = d.sync_all();
                        }
                        Ok(NodeKey::from_bytes(key))
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        let _ = std::fs::remove_file(&tmp);
                        Self::load_or_create(dir)
                    }
                    Err(e) => {
                        let _ = std::fs::remove_file(&tmp);
                        Err(io(e))
                    }
                }
            }
            Err(crate::state::FileError::Io(e)) => Err(io(e)),
        }
    }

    /// A key for tests.
    pub fn from_bytes(key: [u8; 32]) -> NodeKey {
        let mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes any key length");
        // The key's public id: a MAC of a fixed label, so it reveals nothing of the key.
        let mut label = mac.clone();
        label.update(b"credgate node key id");
        let tag = label.finalize().into_bytes();
        let id = u32::from_be_bytes([tag[0], tag[1], tag[2], tag[3]]);
        NodeKey { mac, id }
    }

    /// The key's id, stored with every hash it makes.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// A 32-byte key for another purpose, derived from this one under `label` (so that losing
    /// or replacing the node key makes what it sealed unreadable too).
    pub fn derive(&self, label: &[u8]) -> zeroize::Zeroizing<[u8; 32]> {
        let mut mac = self.mac.clone();
        mac.update(b"credgate derived key\0");
        mac.update(label);
        zeroize::Zeroizing::new(mac.finalize().into_bytes().into())
    }

    /// The guard's name for a credential whose caller names no secret (a pull through the CRI
    /// proxy: `PullImage` carries none): `cri-pull-` and a MAC of its content, stable for the
    /// same content on this node, and no help in testing password guesses without the key.
    pub fn name(&self, username: &str, password: &str) -> String {
        let tag = self.content_mac(b"guard record name\0", username, password);
        format!("cri-pull-{}", hex::encode(&tag[..6]))
    }

    /// The keyed hash of a registry credential's content.
    pub fn hash(&self, username: &str, password: &str) -> CredentialHash {
        CredentialHash::new(self.id, self.content_mac(b"", username, password))
    }

    /// The MAC of `label` and a credential's content, length-prefixed so that ("ab", "c") and
    /// ("a", "bc") differ.
    fn content_mac(&self, label: &[u8], username: &str, password: &str) -> [u8; 32] {
        let mut mac = self.mac.clone();
        mac.update(label);
        mac.update(&(username.len() as u64).to_be_bytes());
        mac.update(username.as_bytes());
        mac.update(&(password.len() as u64).to_be_bytes());
        mac.update(password.as_bytes());
        mac.finalize().into_bytes().into()
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn created_once_private_and_stable() {
        let dir = tempfile::tempdir().unwrap();
        let a = NodeKey::load_or_create(dir.path()).unwrap();
        let b = NodeKey::load_or_create(dir.path()).unwrap();
        assert_eq!(a.hash("u", "p"), b.hash("u", "p"));
        let mode = std::fs::metadata(dir.path().join("node.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let raw = std::fs::read(dir.path().join("node.key")).unwrap();
        assert!(!format!("{a:?}").contains(&hex::encode(&raw)));
    }

    #[test]
    fn keyed_and_unambiguous() {
        let k1 = NodeKey::from_bytes([1; 32]);
        let k2 = NodeKey::from_bytes([2; 32]);
        assert_ne!(
            k1.hash("u", "p"),
            k2.hash("u", "p"),
            "another node, another hash"
        );
        assert_ne!(k1.hash("ab", "c"), k1.hash("a", "bc"));
        let plain: [u8; 32] = <Sha256 as sha2::Digest>::digest(b"up").into();
        assert_ne!(k1.hash("u", "p").mac, plain);
        assert_ne!(k1.id(), k2.id());
        assert_eq!(k1.hash("u", "p").key, k1.id());
    }

    #[test]
    fn a_damaged_key_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.key");
        std::fs::write(&path, b"short").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = NodeKey::load_or_create(dir.path()).unwrap_err();
        assert!(e.to_string().contains("damaged"), "{e}");
    }

    #[test]
    fn a_key_others_can_read_or_a_linked_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.key");
        std::fs::write(&path, [7u8; 32]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = NodeKey::load_or_create(dir.path()).unwrap_err();
        assert!(matches!(e, KeyError::Exposed { .. }), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        NodeKey::load_or_create(dir.path()).expect("a private key is used");
        // A planted link to a key elsewhere is not followed.
        let other = tempfile::tempdir().unwrap();
        let linked = other.path().join("state");
        std::fs::create_dir(&linked).unwrap();
        std::fs::set_permissions(&linked, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&path, linked.join("node.key")).unwrap();
        let e = NodeKey::load_or_create(&linked).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        // A state directory others can write is refused before anything in it is read.
        std::fs::set_permissions(&linked, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = NodeKey::load_or_create(&linked).unwrap_err();
        assert!(
            e.to_string().contains("can be written by other users"),
            "{e}"
        );
    }
}
