//! The image access guard's rules, without IO: verification policies, the allowlist, pull
//! records and how a pull merges into them, and the decision "must this consumer authenticate
//! before using the image already on the node?".
//!
//! Fixed against the kubelet's version: "pulled by the node" is judged per image name (a
//! preloaded name keeps working after the same content is pulled under another name with a
//! secret); allowlist entries and images are normalized on both sides; an optional maximum age
//! makes an old secret match require re-authentication; credentials are compared by a keyed
//! hash computed by the caller (see [`CredentialHash`]).

use std::fmt;
use std::str::FromStr;

use crate::reference::ImageRef;

/// At most this many secrets are remembered per image name.
pub const MAX_SECRETS_PER_NAME: usize = 100;
/// The most image names one record keeps (one image content pulled under many names, by a
/// tenant who names it at will): beyond it the name changed longest ago is dropped. A dropped
/// name's next consumer authenticates, as for an image never pulled under it.
pub const MAX_NAMES_PER_RECORD: usize = 64;

/// When a consumer must authenticate again before using a present image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Never: any consumer may use any present image.
    NeverVerify,
    /// Images the node did not pull itself (preloaded) are trusted; the default.
    #[default]
    NeverVerifyPreloadedImages,
    /// Images on the allowlist are trusted.
    NeverVerifyAllowlistedImages,
    /// Every image the consumer's credentials are not recorded for.
    AlwaysVerify,
}

impl Policy {
    pub const NAMES: [&'static str; 4] = [
        "NeverVerify",
        "NeverVerifyPreloadedImages",
        "NeverVerifyAllowlistedImages",
        "AlwaysVerify",
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::NeverVerify => Self::NAMES[0],
            Policy::NeverVerifyPreloadedImages => Self::NAMES[1],
            Policy::NeverVerifyAllowlistedImages => Self::NAMES[2],
            Policy::AlwaysVerify => Self::NAMES[3],
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown policy name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown verification policy {0:?}; expected one of NeverVerify, NeverVerifyPreloadedImages, NeverVerifyAllowlistedImages, AlwaysVerify")]
pub struct UnknownPolicy(pub String);

impl FromStr for Policy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "NeverVerify" => Ok(Policy::NeverVerify),
            "NeverVerifyPreloadedImages" => Ok(Policy::NeverVerifyPreloadedImages),
            "NeverVerifyAllowlistedImages" => Ok(Policy::NeverVerifyAllowlistedImages),
            "AlwaysVerify" => Ok(Policy::AlwaysVerify),
            other => Err(UnknownPolicy(other.to_owned())),
        }
    }
}

/// Why an allowlist entry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allowlist entry {entry:?}: {reason}")]
pub struct AllowlistError {
    pub entry: String,
    pub reason: String,
}

/// Image names exempt from verification under `NeverVerifyAllowlistedImages`: full names (no tag
/// or digest) or prefixes ending in `/*`, both normalized (`nginx` is
/// `docker.io/library/nginx`; `registry.k8s.io/*` covers every image of that registry).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    names: Vec<String>,
    prefixes: Vec<String>,
}

impl Allowlist {
    /// Parses the entries; every bad one is reported.
    pub fn parse<'a>(
        entries: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, Vec<AllowlistError>> {
        let mut list = Allowlist::default();
        let mut errors = Vec::new();
        for raw in entries {
            let entry = raw;
            let bad = |reason: String| AllowlistError {
                entry: entry.to_owned(),
                reason,
            };
            // As the kubelet's: an empty entry or one with surrounding white space is an error,
            // not something to skip or trim.
            if entry.is_empty() {
                errors.push(bad("an entry must not be empty".into()));
                continue;
            }
            if entry.trim() != entry {
                errors.push(bad("an entry must not have surrounding white space".into()));
                continue;
            }
            if let Some(prefix) = entry.strip_suffix("/*") {
                // Normalize the prefix as the name of an image inside it.
                let probe = format!("{prefix}/x");
                match ImageRef::parse(&probe) {
                    Ok(r) if r.tag().is_none() && r.digest().is_none() => {
                        let name = r.name();
                        list.prefixes.push(name[..name.len() - 1].to_owned());
                    }
                    Ok(_) => errors.push(bad("a prefix must not have a tag or digest".into())),
                    Err(e) => errors.push(bad(e.to_string())),
                }
                continue;
            }
            if entry.contains('*') {
                errors.push(bad(
                    "a wildcard is only allowed as a final `/*` (prefix entry)".into(),
                ));
                continue;
            }
            match ImageRef::parse(entry) {
                Ok(r) if r.tag().is_some() || r.digest().is_some() => errors.push(bad(
                    "name an image without tag or digest (every tag of it is covered)".into(),
                )),
                Ok(r) => list.names.push(r.name().to_owned()),
                Err(e) => errors.push(bad(e.to_string())),
            }
        }
        if errors.is_empty() {
            Ok(list)
        } else {
            Err(errors)
        }
    }

    /// Whether a normalized image name is on the list.
    pub fn allows(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name) || self.prefixes.iter().any(|p| name.starts_with(p))
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty() && self.prefixes.is_empty()
    }
}

/// A keyed hash of a credential's content (HMAC-SHA-256 with the node's key), never the
/// credential itself, tagged with the id of the key that made it: hashes made under another key
/// (a lost and recreated key) never match, and their secrets cannot be taken for rotated.
/// Stored as `k<key id>:<hex>` ([`stored`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CredentialHash {
    pub key: u32,
    pub mac: [u8; 32],
}

impl CredentialHash {
    pub fn new(key: u32, mac: [u8; 32]) -> Self {
        CredentialHash { key, mac }
    }
}

impl fmt::Debug for CredentialHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CredentialHash(k{:08x}:{}..)",
            self.key,
            hex::encode(&self.mac[..4])
        )
    }
}

/// Kubernetes object coordinates of a secret or service account.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Coords {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// A secret that pulled an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRecord {
    pub coords: Coords,
    pub hash: CredentialHash,
    /// When a pull with this credential content last succeeded (Unix ms).
    pub recorded_ms: i64,
}

/// What is known of one image name of a record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NameEntry {
    /// Pulled anonymously or with node-wide credentials: every consumer may use it.
    pub node_accessible: bool,
    pub secrets: Vec<SecretRecord>,
    pub service_accounts: Vec<Coords>,
    pub changed_ms: i64,
}

/// Name entries of a record, by normalized image name. A record has one name or a few, so a
/// sorted vector (one allocation) stands in for a map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NameMap(Vec<(String, NameEntry)>);

impl NameMap {
    fn position(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(n, _)| n.as_str().cmp(name))
    }

    pub fn get(&self, name: &str) -> Option<&NameEntry> {
        self.position(name).ok().map(|i| &self.0[i].1)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.position(name).is_ok()
    }

    /// Inserts or replaces.
    pub fn insert(&mut self, name: String, entry: NameEntry) {
        match self.position(&name) {
            Ok(i) => self.0[i].1 = entry,
            Err(i) => self.0.insert(i, (name, entry)),
        }
    }

    /// The entry of `name`, created empty when absent.
    pub fn get_or_default(&mut self, name: &str) -> &mut NameEntry {
        let i = match self.position(name) {
            Ok(i) => i,
            Err(i) => {
                self.0.insert(i, (name.to_owned(), NameEntry::default()));
                i
            }
        };
        &mut self.0[i].1
    }

    /// In name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &NameEntry)> {
        self.0.iter().map(|(n, e)| (n, e))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Drops the names changed longest ago, but `keep`, until at most `max` are left; how
    /// many were dropped.
    pub fn bound(&mut self, keep: &str, max: usize) -> usize {
        let mut dropped = 0;
        while self.0.len() > max.max(1) {
            let Some(oldest) = self
                .0
                .iter()
                .enumerate()
                .filter(|(_, (n, _))| n != keep)
                .min_by_key(|(_, (_, e))| e.changed_ms)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.0.remove(oldest);
            dropped += 1;
        }
        dropped
    }
}

impl std::ops::Index<&str> for NameMap {
    type Output = NameEntry;

    fn index(&self, name: &str) -> &NameEntry {
        self.get(name).expect("no entry for this name")
    }
}

/// The pull record of one image content (the runtime's image ID).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    pub image_ref: String,
    /// By normalized image name.
    pub names: NameMap,
    pub changed_ms: i64,
}

/// A credential a consumer presents (or that a pull used).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Presented {
    /// A pull secret: coordinates and the keyed hash of its content.
    Secret {
        coords: Coords,
        hash: CredentialHash,
    },
    /// A service account, for token-based plugins.
    ServiceAccount(Coords),
    /// Anonymous or node-wide credentials.
    NodeWide,
}

/// Why a consumer may use the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllowReason {
    PolicyNeverVerify,
    Preloaded,
    Allowlisted,
    NodeAccessible,
    SecretMatch,
    SecretRotated,
    ServiceAccountMatch,
}

/// Why a consumer must authenticate first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthReason {
    StoreUnreadable,
    NoRecord,
    NoEntryForName,
    NoCredentialsRecorded,
    NoMatchingCredential,
    SecretTooOld,
}

macro_rules! reason_strings {
    ($ty:ty { $($variant:ident => $s:literal),* $(,)? }) => {
        impl $ty {
            /// A stable, machine-readable reason.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $s),* }
            }
        }
    };
}

reason_strings!(AllowReason {
    PolicyNeverVerify => "policy_never_verify",
    Preloaded => "preloaded",
    Allowlisted => "allowlisted",
    NodeAccessible => "node_accessible",
    SecretMatch => "secret_match",
    SecretRotated => "secret_rotated",
    ServiceAccountMatch => "service_account_match",
});

reason_strings!(AuthReason {
    StoreUnreadable => "store_unreadable",
    NoRecord => "no_record",
    NoEntryForName => "no_entry_for_name",
    NoCredentialsRecorded => "no_credentials_recorded",
    NoMatchingCredential => "no_matching_credential",
    SecretTooOld => "secret_too_old",
});

/// The answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The image is not present: pull it (the pull authenticates).
    Pull,
    Allow(AllowReason),
    Authenticate(AuthReason),
}

/// What the store knows about the image, or that it cannot be read.
#[derive(Debug, Clone, Copy)]
pub enum StoreView<'a> {
    Unreadable,
    Readable {
        /// The record of the image ID, if any.
        record: Option<&'a Record>,
        /// Whether a pull intent exists for this image name.
        intent: bool,
    },
}

/// The question.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// Normalized image name.
    pub name: &'a str,
    pub present: bool,
    pub policy: Policy,
    pub allowlist: &'a Allowlist,
    /// A secret match older than this (ms) no longer allows.
    pub max_age_ms: Option<i64>,
    pub now_ms: i64,
}

/// What a decision learned about a name's secrets, to be applied to the record as it is when
/// written (not as it was when decided: two decisions learning at once must not undo each
/// other).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Learned {
    /// Known content under new coordinates (a copy of the secret in another namespace).
    NewCoordinates {
        coords: Coords,
        hash: CredentialHash,
        /// The recorded time of the content it matched.
        recorded_ms: i64,
    },
    /// The same secret object with new content.
    Rotated {
        coords: Coords,
        hash: CredentialHash,
    },
}

/// Applies what a decision learned to `name` of `record`; `None` when it changes nothing (the
/// name is gone, became node accessible, the list is full, or it is already known).
pub fn learn(record: &Record, name: &str, learned: &Learned, now_ms: i64) -> Option<Record> {
    let mut r = record.clone();
    let entry = r.names.get(name)?;
    if entry.node_accessible {
        return None;
    }
    let mut entry = entry.clone();
    match learned {
        Learned::NewCoordinates {
            coords,
            hash,
            recorded_ms,
        } => {
            if entry.secrets.iter().any(|s| &s.coords == coords)
                || entry.secrets.len() >= MAX_SECRETS_PER_NAME
            {
                return None;
            }
            entry.secrets.push(SecretRecord {
                coords: coords.clone(),
                hash: *hash,
                recorded_ms: *recorded_ms,
            });
        }
        Learned::Rotated { coords, hash } => {
            let s = entry.secrets.iter_mut().find(|s| &s.coords == coords)?;
            if s.hash == *hash {
                return None;
            }
            s.hash = *hash;
        }
    }
    entry.changed_ms = now_ms;
    r.names.insert(name.to_owned(), entry);
    r.changed_ms = now_ms;
    Some(r)
}

/// A decision, and what it learned (to be stored with [`learn`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub verdict: Verdict,
    pub update: Option<Learned>,
}

impl Decision {
    fn just(verdict: Verdict) -> Self {
        Decision {
            verdict,
            update: None,
        }
    }
}

/// Decides; `credentials` is called only at the step that needs them (looking them up may run
/// plugins).
pub fn decide(
    check: &Check<'_>,
    store: StoreView<'_>,
    credentials: impl FnOnce() -> Vec<Presented>,
) -> Decision {
    use Verdict::{Allow, Authenticate};
    if !check.present {
        return Decision::just(Verdict::Pull);
    }
    let (record, intent) = match store {
        StoreView::Unreadable => return Decision::just(Authenticate(AuthReason::StoreUnreadable)),
        StoreView::Readable { record, intent } => (record, intent),
    };
    let entry = record.and_then(|r| r.names.get(check.name));
    // Judged per name: another name of the same content says nothing about this one.
    let pulled_by_node = entry.is_some() || intent;
    match check.policy {
        Policy::NeverVerify => return Decision::just(Allow(AllowReason::PolicyNeverVerify)),
        Policy::NeverVerifyPreloadedImages if !pulled_by_node => {
            return Decision::just(Allow(AllowReason::Preloaded))
        }
        Policy::NeverVerifyAllowlistedImages if check.allowlist.allows(check.name) => {
            return Decision::just(Allow(AllowReason::Allowlisted))
        }
        _ => {}
    }
    if record.is_none() {
        return Decision::just(Authenticate(AuthReason::NoRecord));
    }
    let Some(entry) = entry else {
        return Decision::just(Authenticate(AuthReason::NoEntryForName));
    };
    if entry.node_accessible {
        return Decision::just(Allow(AllowReason::NodeAccessible));
    }
    if entry.secrets.is_empty() && entry.service_accounts.is_empty() {
        return Decision::just(Authenticate(AuthReason::NoCredentialsRecorded));
    }
    let fresh = |s: &SecretRecord| {
        check
            .max_age_ms
            .is_none_or(|max| check.now_ms.saturating_sub(s.recorded_ms) <= max)
    };
    let mut too_old = false;
    for presented in credentials() {
        match presented {
            Presented::Secret { coords, hash } => match secret_step(entry, coords, hash, &fresh) {
                SecretStep::Decided(decision) => return decision,
                SecretStep::TooOld => too_old = true,
                SecretStep::NoMatch => {}
            },
            Presented::ServiceAccount(sa) => {
                if entry.service_accounts.contains(&sa) {
                    return Decision::just(Allow(AllowReason::ServiceAccountMatch));
                }
            }
            Presented::NodeWide => {}
        }
    }
    Decision::just(Authenticate(if too_old {
        AuthReason::SecretTooOld
    } else {
        AuthReason::NoMatchingCredential
    }))
}

/// What one presented secret says of a name's entry.
enum SecretStep {
    Decided(Decision),
    /// It matches a recorded secret older than the policy's horizon.
    TooOld,
    NoMatch,
}

/// A presented secret against the secrets recorded for the name: the same content (under new
/// coordinates, learned when there is room), or the same secret object rotated in place.
fn secret_step(
    entry: &NameEntry,
    coords: Coords,
    hash: CredentialHash,
    fresh: &impl Fn(&SecretRecord) -> bool,
) -> SecretStep {
    use Verdict::Allow;
    if let Some(known) = entry.secrets.iter().find(|s| s.hash == hash) {
        if !fresh(known) {
            return SecretStep::TooOld;
        }
        let new_coords = !entry.secrets.iter().any(|s| s.coords == coords);
        let room = entry.secrets.len() < MAX_SECRETS_PER_NAME;
        let update = (new_coords && room).then_some(Learned::NewCoordinates {
            coords,
            hash,
            recorded_ms: known.recorded_ms,
        });
        return SecretStep::Decided(Decision {
            verdict: Allow(AllowReason::SecretMatch),
            update,
        });
    }
    let Some(i) = entry.secrets.iter().position(|s| s.coords == coords) else {
        return SecretStep::NoMatch;
    };
    // The same secret object with new content: rotated in place. A record hashed under
    // another node key cannot tell a rotation from a guess.
    if entry.secrets[i].hash.key != hash.key {
        return SecretStep::NoMatch;
    }
    if !fresh(&entry.secrets[i]) {
        return SecretStep::TooOld;
    }
    // As a new secret would, a rotation counts against the name's limit.
    if entry.secrets.len() >= MAX_SECRETS_PER_NAME {
        return SecretStep::NoMatch;
    }
    SecretStep::Decided(Decision {
        verdict: Allow(AllowReason::SecretRotated),
        update: Some(Learned::Rotated { coords, hash }),
    })
}

/// Merges a successful pull of `name` with `used` into `record` (created when `None`).
///
/// Node-wide or anonymous: the name becomes node accessible, which dominates and clears the
/// lists. A secret: union by coordinates, the new hash wins, recorded now; at the limit the
/// longest-unconfirmed secret makes room (the new one has just been accepted by the registry).
/// A service account: union.
pub fn merge(
    record: Option<&Record>,
    image_ref: &str,
    name: &str,
    used: &Presented,
    now_ms: i64,
) -> Record {
    let mut r = record.cloned().unwrap_or_else(|| Record {
        image_ref: image_ref.to_owned(),
        ..Default::default()
    });
    let entry = r.names.get_or_default(name);
    match used {
        Presented::NodeWide => {
            entry.node_accessible = true;
            entry.secrets.clear();
            entry.service_accounts.clear();
        }
        _ if entry.node_accessible => {}
        Presented::Secret { coords, hash } => {
            entry.secrets.retain(|s| &s.coords != coords);
            if entry.secrets.len() >= MAX_SECRETS_PER_NAME {
                if let Some(oldest) = entry
                    .secrets
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, s)| s.recorded_ms)
                    .map(|(i, _)| i)
                {
                    entry.secrets.remove(oldest);
                }
            }
            entry.secrets.push(SecretRecord {
                coords: coords.clone(),
                hash: *hash,
                recorded_ms: now_ms,
            });
        }
        Presented::ServiceAccount(sa) => {
            if !entry.service_accounts.contains(sa) {
                entry.service_accounts.push(sa.clone());
            }
        }
    }
    entry.changed_ms = now_ms;
    r.changed_ms = now_ms;
    r.names.bound(name, MAX_NAMES_PER_RECORD);
    r
}

/// A record with no credentials for `name`: what a leftover intent becomes at start-up when
/// its image is present (the next consumer must authenticate).
pub fn recovered(record: Option<&Record>, image_ref: &str, name: &str, now_ms: i64) -> Record {
    let mut r = record.cloned().unwrap_or_else(|| Record {
        image_ref: image_ref.to_owned(),
        ..Default::default()
    });
    if !r.names.contains_key(name) {
        r.names.insert(
            name.to_owned(),
            NameEntry {
                changed_ms: now_ms,
                ..Default::default()
            },
        );
        r.changed_ms = now_ms;
        r.names.bound(name, MAX_NAMES_PER_RECORD);
    }
    r
}

pub mod stored;

#[cfg(test)]
mod tests;
