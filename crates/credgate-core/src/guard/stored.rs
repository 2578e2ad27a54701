//! How a pull record is stored (the guard store's `record_log.body`): a versioned JSON shape of
//! its own, so that the domain types ([`Record`], [`NameEntry`], ...) can change without
//! changing what is on disk, and a change of what is on disk is a new version here with its
//! decoder kept.
//!
//! Version 1 (the body of store schema version 2):
//! `{"image_ref", "names": {NAME: {"node_accessible", "secrets": [{"coords": {"namespace",
//! "name", "uid"}, "hash": "k<key id, 8 hex>:<64 hex>", "recorded_ms"}], "service_accounts":
//! [COORDS], "changed_ms"}}, "changed_ms"}`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Coords, CredentialHash, NameEntry, NameMap, Record, SecretRecord};

/// Why a stored body does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a stored pull record (version 1): {0}")]
pub struct StoredError(String);

#[derive(Serialize, Deserialize)]
struct RecordV1 {
    image_ref: String,
    names: BTreeMap<String, NameEntryV1>,
    changed_ms: i64,
}

#[derive(Serialize, Deserialize)]
struct NameEntryV1 {
    #[serde(default)]
    node_accessible: bool,
    #[serde(default)]
    secrets: Vec<SecretV1>,
    #[serde(default)]
    service_accounts: Vec<CoordsV1>,
    changed_ms: i64,
}

#[derive(Serialize, Deserialize)]
struct SecretV1 {
    coords: CoordsV1,
    hash: String,
    recorded_ms: i64,
}

#[derive(Serialize, Deserialize)]
struct CoordsV1 {
    namespace: String,
    name: String,
    uid: String,
}

impl From<&Coords> for CoordsV1 {
    fn from(c: &Coords) -> Self {
        CoordsV1 {
            namespace: c.namespace.clone(),
            name: c.name.clone(),
            uid: c.uid.clone(),
        }
    }
}

impl From<CoordsV1> for Coords {
    fn from(c: CoordsV1) -> Self {
        Coords {
            namespace: c.namespace,
            name: c.name,
            uid: c.uid,
        }
    }
}

fn hash_text(h: &CredentialHash) -> String {
    format!("k{:08x}:{}", h.key, hex::encode(h.mac))
}

fn hash_of(text: &str) -> Result<CredentialHash, StoredError> {
    let bad = || StoredError("a credential hash is k<key id>:<64 hex>".into());
    let (key, mac) = text
        .strip_prefix('k')
        .and_then(|rest| rest.split_once(':'))
        .ok_or_else(bad)?;
    let key = u32::from_str_radix(key, 16).map_err(|_| bad())?;
    let mac = hex::decode(mac).map_err(|_| bad())?;
    Ok(CredentialHash {
        key,
        mac: mac.try_into().map_err(|_| bad())?,
    })
}

/// The stored body of `record`.
pub fn encode(record: &Record) -> String {
    let stored = RecordV1 {
        image_ref: record.image_ref.clone(),
        names: record
            .names
            .iter()
            .map(|(name, e)| {
                let entry = NameEntryV1 {
                    node_accessible: e.node_accessible,
                    secrets: e
                        .secrets
                        .iter()
                        .map(|s| SecretV1 {
                            coords: (&s.coords).into(),
                            hash: hash_text(&s.hash),
                            recorded_ms: s.recorded_ms,
                        })
                        .collect(),
                    service_accounts: e.service_accounts.iter().map(Into::into).collect(),
                    changed_ms: e.changed_ms,
                };
                (name.clone(), entry)
            })
            .collect(),
        changed_ms: record.changed_ms,
    };
    serde_json::to_string(&stored).expect("a stored record serializes")
}

/// The record a stored body holds.
pub fn decode(body: &[u8]) -> Result<Record, StoredError> {
    let stored: RecordV1 = serde_json::from_slice(body).map_err(|e| StoredError(e.to_string()))?;
    let mut names = NameMap::default();
    for (name, e) in stored.names {
        let secrets = e
            .secrets
            .into_iter()
            .map(|s| {
                Ok(SecretRecord {
                    coords: s.coords.into(),
                    hash: hash_of(&s.hash)?,
                    recorded_ms: s.recorded_ms,
                })
            })
            .collect::<Result<Vec<_>, StoredError>>()?;
        let entry = NameEntry {
            node_accessible: e.node_accessible,
            secrets,
            service_accounts: e.service_accounts.into_iter().map(Into::into).collect(),
            changed_ms: e.changed_ms,
        };
        names.insert(name, entry);
    }
    Ok(Record {
        image_ref: stored.image_ref,
        names,
        changed_ms: stored.changed_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        let mut names = NameMap::default();
        names.insert(
            "docker.io/library/nginx".into(),
            NameEntry {
                node_accessible: true,
                secrets: vec![SecretRecord {
                    coords: Coords {
                        namespace: "team-a".into(),
                        name: "pull".into(),
                        uid: "u-1".into(),
                    },
                    hash: CredentialHash::new(0x0102_0304, [7; 32]),
                    recorded_ms: 1_700_000_000_000,
                }],
                service_accounts: vec![Coords {
                    namespace: "team-b".into(),
                    name: "builder".into(),
                    uid: "u-2".into(),
                }],
                changed_ms: 1_700_000_000_001,
            },
        );
        Record {
            image_ref: "sha256:abc".into(),
            names,
            changed_ms: 1_700_000_000_002,
        }
    }

    /// Version 1 as it is on disk: a body written before this module existed decodes.
    #[test]
    fn version_1_bodies_decode_and_encode_the_same() {
        let v1 = r#"{"image_ref":"sha256:abc","names":{"docker.io/library/nginx":{"node_accessible":true,"secrets":[{"coords":{"namespace":"team-a","name":"pull","uid":"u-1"},"hash":"k01020304:0707070707070707070707070707070707070707070707070707070707070707","recorded_ms":1700000000000}],"service_accounts":[{"namespace":"team-b","name":"builder","uid":"u-2"}],"changed_ms":1700000000001}},"changed_ms":1700000000002}"#;
        assert_eq!(decode(v1.as_bytes()).unwrap(), record());
        assert_eq!(encode(&record()), v1);
    }

    #[test]
    fn bad_bodies_are_errors() {
        for bad in [&b""[..], b"{}", b"[]", br#"{"image_ref":"x","names":{"n":{"secrets":[{"coords":{"namespace":"a","name":"b","uid":"c"},"hash":"zz","recorded_ms":1}],"changed_ms":1}},"changed_ms":1}"#] {
            assert!(decode(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
