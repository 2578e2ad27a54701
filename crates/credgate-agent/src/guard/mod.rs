//! The image access guard at run time: durable records ([`store`]), the node's hashing key
//! ([`keys`]), verification against the registry ([`registry`]), and [`Guard`], which decides
//! and records.
//!
//! The guard never refuses to start: a store or key that cannot be opened is logged and every
//! decision that depends on them fails safe (must authenticate), so a damaged file cannot put
//! the agent into a crash loop, nor let a tenant in. Opening is retried, at most every
//! [`REOPEN_INTERVAL`], when the store or key is next needed, so a state directory that was
//! read-only or full at start is used as soon as it is writable again.

pub mod registry;
pub mod store;

use parking_lot::Mutex;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use credgate_core::guard::{
    self, AllowReason, Allowlist, AuthReason, Check, Coords, Policy, Presented, StoreView, Verdict,
};
use credgate_core::reference::{ImageRef, ReferenceError};
use credgate_engine::{Engine, LookupRequest};
use secrecy::{ExposeSecret, SecretString};

use crate::metrics::AgentMetrics;
use crate::state::key::{self as keys, NodeKey};
use store::{Done, Op, PresentImage, Pruned, Store, StoreError};

/// How the guard behaves.
#[derive(Debug, Clone, Default)]
pub struct GuardOptions {
    pub policy: Policy,
    pub allowlist: Allowlist,
    /// A secret match older than this no longer allows without re-authentication.
    pub max_age: Option<Duration>,
    /// Where `guard.db` and `node.key` live.
    pub state_dir: PathBuf,
    pub registry: registry::RegistryOptions,
}

/// A workload's pull policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PullPolicy {
    Always,
    #[default]
    IfNotPresent,
    Never,
}

/// A credential as a caller describes it. Secrets are hashed when needed and then dropped.
#[derive(Clone)]
pub enum CredentialIn {
    Secret {
        coords: Coords,
        username: String,
        password: SecretString,
    },
    ServiceAccount(Coords),
    NodeWide,
}

impl std::fmt::Debug for CredentialIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CredentialIn::Secret {
                coords, username, ..
            } => f
                .debug_struct("Secret")
                .field("coords", coords)
                .field("username", username)
                .field("password", &"<redacted>")
                .finish(),
            CredentialIn::ServiceAccount(c) => f.debug_tuple("ServiceAccount").field(c).finish(),
            CredentialIn::NodeWide => f.write_str("NodeWide"),
        }
    }
}

/// The guard's answer to `CheckAccess`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Pull,
    Allow,
    MustAuthenticate,
    Refuse,
}

impl Answer {
    pub fn as_str(self) -> &'static str {
        match self {
            Answer::Pull => "pull",
            Answer::Allow => "allow",
            Answer::MustAuthenticate => "must_authenticate",
            Answer::Refuse => "refuse",
        }
    }
}

/// Why the guard answered as it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckReason {
    /// Pull policy Never, and the workload may not use the image as it is.
    NotAvailable,
    /// Pull policy Always: the pull authenticates.
    PullPolicyAlways,
    /// The image is not on the node.
    NotPresent,
    Allow(guard::AllowReason),
    Authenticate(guard::AuthReason),
}

impl CheckReason {
    /// The API's stable, machine-readable reason.
    pub fn as_str(self) -> &'static str {
        match self {
            CheckReason::NotAvailable => "not_available",
            CheckReason::PullPolicyAlways => "pull_policy_always",
            CheckReason::NotPresent => "not_present",
            CheckReason::Allow(r) => r.as_str(),
            CheckReason::Authenticate(r) => r.as_str(),
        }
    }
}

/// Whether the image is on the node now, as the runtime says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    OnNode,
    Absent,
}

impl Presence {
    pub fn of(present: bool) -> Presence {
        if present {
            Presence::OnNode
        } else {
            Presence::Absent
        }
    }
}

/// An answer with its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckAnswer {
    pub answer: Answer,
    pub reason: CheckReason,
    pub message: String,
}

/// The longest runtime image ID stored (`sha256:` and 64 hex digits is 71).
pub const IMAGE_REF_MAX: usize = 512;

/// Why a guard call was refused.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("invalid image {}: {error}", credgate_core::text::Quoted(image))]
    InvalidImage {
        image: String,
        error: ReferenceError,
    },
    #[error("{0} is required")]
    Missing(&'static str),
    #[error("invalid image_ref {}: at most {IMAGE_REF_MAX} bytes, no control characters", credgate_core::text::Quoted(.0))]
    InvalidImageRef(String),
    /// Carries the whole cause (`read-only file system`, `database or disk is full`): it is
    /// what an operator needs to act, and never holds a secret.
    #[error("the guard's records are unavailable: {}", crate::error_chain(&**.0))]
    Unavailable(Arc<StoreError>),
    #[error("the guard's records could not be written: {}", crate::error_chain(.0))]
    Write(StoreError),
}

impl From<StoreError> for GuardError {
    fn from(e: StoreError) -> Self {
        GuardError::Write(e)
    }
}

/// What a pull reference normalizes to: the image name and the full reference
/// (`name:tag`, `name@digest`; `:latest` when the workload named neither).
pub fn normalize(image: &str) -> Result<(String, String), GuardError> {
    let r = ImageRef::parse(image).map_err(|error| GuardError::InvalidImage {
        image: image.to_owned(),
        error,
    })?;
    let name = r.name().to_owned();
    let reference = match (r.tag(), r.digest()) {
        (_, Some(d)) => format!("{name}@{d}"),
        (Some(t), None) => format!("{name}:{t}"),
        (None, None) => format!("{name}:latest"),
    };
    Ok((name, reference))
}

/// How a pull ended, as the guard records it.
#[derive(Debug, Clone, Copy)]
pub enum PullEnd<'a> {
    /// The runtime pulled the image as `image_ref` (its ID) with `used`.
    Pulled {
        image_ref: &'a str,
        used: &'a CredentialIn,
    },
    Failed,
}

impl<'a> PullEnd<'a> {
    /// The end a consumer reports (`RecordPullResult`): a success names the image ID and the
    /// credential used.
    pub fn reported(
        success: bool,
        image_ref: &'a str,
        used: Option<&'a CredentialIn>,
    ) -> Result<PullEnd<'a>, GuardError> {
        if !success {
            return Ok(PullEnd::Failed);
        }
        if image_ref.is_empty() {
            return Err(GuardError::Missing("image_ref of a successful pull"));
        }
        let used = used.ok_or(GuardError::Missing("the credential of a successful pull"))?;
        Ok(PullEnd::Pulled { image_ref, used })
    }
}

/// The guard.
#[derive(Clone)]
pub struct Guard {
    store: Arc<Retrying<Store, StoreError>>,
    key: Arc<Retrying<NodeKey, keys::KeyError>>,
    options: Arc<GuardOptions>,
    metrics: AgentMetrics,
    verifier: registry::Verifier,
    /// The agent's credential engine: what "node-wide credentials" are when verifying.
    engine: Option<Arc<ArcSwap<Engine>>>,
    /// Where decisions and recordings read the time (the agent's clock; tests pause it).
    clock: Arc<dyn credgate_engine::clock::Clock>,
    /// Where the writes of what decisions learned run (the agent's tasks).
    tasks: crate::tasks::Tasks,
}

impl Guard {
    /// Opens the store and the key under the state directory. Never fails: problems are logged
    /// and make decisions fail safe. `clock` times decisions, records and the retries of a
    /// store or key that could not be opened (the agent's; tests step it).
    pub fn open(
        options: GuardOptions,
        metrics: AgentMetrics,
        clock: Arc<dyn credgate_engine::clock::Clock>,
    ) -> Guard {
        let dir = options.state_dir.clone();
        let store = Arc::new(Retrying::new(
            "guard store unavailable; every present image requires authentication",
            clock.now(),
            move || Store::open(&dir),
        ));
        let dir = options.state_dir.clone();
        let key = Arc::new(Retrying::new(
            "node key unavailable; secrets cannot match records",
            clock.now(),
            move || keys::NodeKey::load_or_create(&dir),
        ));
        let verifier = registry::Verifier::new(options.registry.clone());
        let guard = Guard {
            store,
            key,
            options: Arc::new(options),
            metrics,
            verifier,
            engine: None,
            clock,
            tasks: crate::tasks::Tasks::new(),
        };
        guard.update_gauges();
        guard
    }

    /// Now, in milliseconds since the Unix epoch, by the guard's clock.
    fn now_ms(&self) -> i64 {
        credgate_engine::clock::unix_ms(self.clock.wall())
    }

    /// Writes what decisions learn as one of `tasks`.
    pub fn with_tasks(mut self, tasks: crate::tasks::Tasks) -> Guard {
        self.tasks = tasks;
        self
    }

    /// Verification tries the engine's credentials for a node-wide credential.
    pub fn with_engine(mut self, engine: Arc<ArcSwap<Engine>>) -> Guard {
        self.engine = Some(engine);
        self
    }

    /// The node's own credentials for `image`, in try-order (static sources and providers,
    /// without a service account).
    async fn node_credentials(&self, image: &str) -> Vec<(String, SecretString)> {
        let Some(engine) = &self.engine else {
            return Vec::new();
        };
        let engine = engine.load_full();
        let request = LookupRequest {
            image,
            ..Default::default()
        };
        match engine.lookup(&request).await {
            Ok(found) => found
                .credentials
                .into_iter()
                .map(|c| (c.username, c.password))
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    pub fn options(&self) -> &GuardOptions {
        &self.options
    }

    /// The store, or why it is unavailable.
    pub fn store(&self) -> Result<&Store, GuardError> {
        self.store
            .get(self.clock.now())
            .map_err(GuardError::Unavailable)
    }

    fn update_gauges(&self) {
        if let Ok(s) = self.store.get(self.clock.now()) {
            let (records, intents) = s.counts();
            self.metrics.guard_records.set(records as i64);
            self.metrics.guard_intents.set(intents as i64);
        }
    }

    fn presented(&self, credentials: &[CredentialIn]) -> Vec<Presented> {
        credentials
            .iter()
            .filter_map(|c| match c {
                CredentialIn::Secret {
                    coords,
                    username,
                    password,
                } => self
                    .key
                    .get(self.clock.now())
                    .ok()
                    .map(|k| Presented::Secret {
                        coords: coords.clone(),
                        hash: k.hash(username, password.expose_secret()),
                    }),
                CredentialIn::ServiceAccount(sa) => Some(Presented::ServiceAccount(sa.clone())),
                CredentialIn::NodeWide => Some(Presented::NodeWide),
            })
            .collect()
    }

    /// Must this consumer authenticate before using the image?
    pub fn check(
        &self,
        image: &str,
        image_ref: &str,
        presence: Presence,
        pull_policy: PullPolicy,
        credentials: &[CredentialIn],
    ) -> Result<CheckAnswer, GuardError> {
        let parsed = ImageRef::parse(image).map_err(|error| GuardError::InvalidImage {
            image: image.to_owned(),
            error,
        })?;
        let answer = self.decide(
            parsed.name(),
            image,
            image_ref,
            presence,
            pull_policy,
            credentials,
        );
        self.metrics.guard_decision(answer.answer.as_str());
        Ok(answer)
    }

    fn decide(
        &self,
        name: &str,
        image: &str,
        image_ref: &str,
        presence: Presence,
        pull_policy: PullPolicy,
        credentials: &[CredentialIn],
    ) -> CheckAnswer {
        let refuse = || CheckAnswer {
            answer: Answer::Refuse,
            reason: CheckReason::NotAvailable,
            message: format!(
                "image {image} is not available to this workload with pull policy Never"
            ),
        };
        if pull_policy == PullPolicy::Always {
            return CheckAnswer {
                answer: Answer::Pull,
                reason: CheckReason::PullPolicyAlways,
                message: "pull policy Always: the pull authenticates".into(),
            };
        }
        let store = self.store.get(self.clock.now());
        let (record, intent) = match &store {
            Ok(s) => s.view(image_ref, name),
            Err(_) => (None, false),
        };
        let view = match &store {
            Ok(_) => StoreView::Readable {
                record: record.as_deref(),
                intent,
            },
            Err(_) => StoreView::Unreadable,
        };
        let check = Check {
            name,
            present: presence == Presence::OnNode,
            policy: self.options.policy,
            allowlist: &self.options.allowlist,
            max_age_ms: self
                .options
                .max_age
                .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            now_ms: self.now_ms(),
        };
        let decision = guard::decide(&check, view, || self.presented(credentials));
        if let (Some(learned), Ok(store)) = (decision.update, store) {
            self.learn(store, image_ref, name, learned, check.now_ms);
        }
        match decision.verdict {
            Verdict::Pull if pull_policy == PullPolicy::Never => refuse(),
            Verdict::Pull => CheckAnswer {
                answer: Answer::Pull,
                reason: CheckReason::NotPresent,
                message: "the image is not on the node: pull it".into(),
            },
            Verdict::Allow(r) => CheckAnswer {
                answer: Answer::Allow,
                reason: CheckReason::Allow(r),
                message: allow_message(r).into(),
            },
            Verdict::Authenticate(_) if pull_policy == PullPolicy::Never => refuse(),
            Verdict::Authenticate(r) => CheckAnswer {
                answer: Answer::MustAuthenticate,
                reason: CheckReason::Authenticate(r),
                message: auth_message(r).into(),
            },
        }
    }

    /// Writes what a decision learned (new coordinates of a known secret, a rotation) in the
    /// background: the answer does not wait for it.
    fn learn(
        &self,
        store: &Store,
        image_ref: &str,
        name: &str,
        learned: guard::Learned,
        now_ms: i64,
    ) {
        let store = store.clone();
        let op = Op::Learn {
            image_ref: image_ref.to_owned(),
            name: name.to_owned(),
            learned,
        };
        self.tasks.spawn(async move {
            if let Err(e) = store.apply(op, now_ms).await {
                tracing::warn!(error = %e, "cannot store what a decision learned");
            }
        });
    }

    /// The name a credential no secret names is recorded under ([`NodeKey::name`]); `None`
    /// without the node key, when no secret can be recorded anyway.
    ///
    /// [`NodeKey::name`]: keys::NodeKey::name
    pub fn unnamed_secret(&self, username: &str, password: &SecretString) -> Option<String> {
        let key = self.key.get(self.clock.now()).ok()?;
        Some(key.name(username, password.expose_secret()))
    }

    /// A pull of `image` is about to start.
    pub async fn record_intent(&self, image: &str) -> Result<(), GuardError> {
        let (name, reference) = normalize(image)?;
        self.store()?
            .apply(
                Op::Intent {
                    image: reference,
                    name,
                },
                self.now_ms(),
            )
            .await?;
        self.update_gauges();
        Ok(())
    }

    /// A pull of `image` ended: a pulled image records the credential used for its ID, and
    /// either way the pull's intent is released.
    pub async fn record_result(&self, image: &str, end: PullEnd<'_>) -> Result<(), GuardError> {
        let (name, reference) = normalize(image)?;
        let (image_ref, used) = match end {
            PullEnd::Pulled { image_ref, used } => {
                if image_ref.len() > IMAGE_REF_MAX || image_ref.chars().any(char::is_control) {
                    return Err(GuardError::InvalidImageRef(image_ref.to_owned()));
                }
                match self.presented(std::slice::from_ref(used)).pop() {
                    Some(p) => (image_ref, Some(p)),
                    // Without the node key a secret cannot be recorded; the intent stays, so
                    // the image keeps requiring authentication.
                    None => return Err(GuardError::Missing("the node key")),
                }
            }
            PullEnd::Failed => ("", None),
        };
        let store = self.store()?;
        // Names a record holds beyond its bound are dropped, the oldest first: counted.
        let before = store.record(image_ref).map_or(0, |r| {
            r.names.len() + usize::from(!r.names.contains_key(&name))
        });
        store
            .apply(
                Op::PullResult {
                    image: reference,
                    name,
                    image_ref: image_ref.to_owned(),
                    used,
                },
                self.now_ms(),
            )
            .await?;
        if let Some(after) = store.record(image_ref) {
            let dropped = before.saturating_sub(after.names.len());
            if dropped > 0 {
                self.metrics.guard_names_dropped.inc_by(dropped as u64);
            }
        }
        self.update_gauges();
        Ok(())
    }

    /// Verifies credentials against the registry; the first accepted one is recorded.
    pub async fn verify(
        &self,
        image: &str,
        image_ref: &str,
        expected_digest: Option<&str>,
        credentials: &[CredentialIn],
    ) -> Result<registry::Verified, GuardError> {
        let parsed = ImageRef::parse(image).map_err(|error| GuardError::InvalidImage {
            image: image.to_owned(),
            error,
        })?;
        if image_ref.is_empty() {
            return Err(GuardError::Missing("image_ref"));
        }
        let target = registry::Target::of(&parsed);
        let node_wide = if credentials
            .iter()
            .any(|c| matches!(c, CredentialIn::NodeWide))
        {
            self.node_credentials(image).await
        } else {
            Vec::new()
        };
        let verified = self
            .verifier
            .verify(&target, expected_digest, credentials, &node_wide)
            .await;
        self.metrics.verification(verified.reason.as_str());
        if let Some(i) = verified.accepted {
            self.record_result(
                image,
                PullEnd::Pulled {
                    image_ref,
                    used: &credentials[i],
                },
            )
            .await?;
        }
        Ok(verified)
    }

    pub async fn prune(
        &self,
        present: Vec<PresentImage>,
        before_ms: i64,
    ) -> Result<Pruned, GuardError> {
        let present = present
            .into_iter()
            .map(|p| PresentImage {
                references: p
                    .references
                    .iter()
                    .filter_map(|r| normalize(r).ok().map(|(_, full)| full))
                    .collect(),
                image_ref: p.image_ref,
            })
            .collect();
        let done = self
            .store()?
            .apply(Op::Prune { present, before_ms }, self.now_ms())
            .await?;
        self.update_gauges();
        match done {
            Done::Pruned(p) => Ok(p),
            _ => Ok(Pruned::default()),
        }
    }

    pub async fn delete(&self, image_ref: &str) -> Result<bool, GuardError> {
        let done = self
            .store()?
            .apply(
                Op::Delete {
                    image_ref: image_ref.to_owned(),
                },
                self.now_ms(),
            )
            .await?;
        self.update_gauges();
        Ok(matches!(done, Done::Deleted(true)))
    }
}

fn allow_message(r: AllowReason) -> &'static str {
    match r {
        AllowReason::PolicyNeverVerify => "the policy is NeverVerify",
        AllowReason::Preloaded => "the node did not pull this image name itself (preloaded)",
        AllowReason::Allowlisted => "the image is on the verification allowlist",
        AllowReason::NodeAccessible => "pulled anonymously or with node-wide credentials",
        AllowReason::SecretMatch => "a presented secret pulled this image",
        AllowReason::SecretRotated => "a presented secret (rotated since) pulled this image",
        AllowReason::ServiceAccountMatch => "the presented service account pulled this image",
    }
}

fn auth_message(r: AuthReason) -> &'static str {
    match r {
        AuthReason::StoreUnreadable => "the pull records cannot be read",
        AuthReason::NoRecord => "no record of a pull of this image",
        AuthReason::NoEntryForName => "no record of a pull under this name",
        AuthReason::NoCredentialsRecorded => "the record holds no credentials",
        AuthReason::NoMatchingCredential => "no presented credential pulled this image",
        AuthReason::SecretTooOld => "the matching secret was last confirmed too long ago",
    }
}

/// How often a store or key that could not be opened is tried again, when next needed.
pub const REOPEN_INTERVAL: Duration = Duration::from_secs(2);

type Opener<T, E> = Box<dyn Fn() -> Result<T, E> + Send + Sync>;

/// Something opened once; while opening fails, the last error is kept and opening is retried
/// when it is next needed, at most every [`REOPEN_INTERVAL`].
struct Retrying<T, E> {
    value: OnceLock<T>,
    /// The last failure and when it happened; `None` once opened.
    failure: Mutex<Option<(Arc<E>, Instant)>>,
    what: &'static str,
    open: Opener<T, E>,
}

impl<T, E: std::error::Error + 'static> Retrying<T, E> {
    /// Opens it now (`now` by the guard's clock).
    fn new(
        what: &'static str,
        now: Instant,
        open: impl Fn() -> Result<T, E> + Send + Sync + 'static,
    ) -> Self {
        let value = OnceLock::new();
        let failure = match open() {
            Ok(v) => {
                let _ = value.set(v);
                None
            }
            Err(e) => {
                tracing::error!(error = %crate::error_chain(&e), "{what}");
                Some((Arc::new(e), now))
            }
        };
        Retrying {
            value,
            failure: Mutex::new(failure),
            what,
            open: Box::new(open),
        }
    }

    /// The value; while it could not be opened, opened again when [`REOPEN_INTERVAL`] has
    /// passed since the last try by `now`.
    fn get(&self, now: Instant) -> Result<&T, Arc<E>> {
        if let Some(v) = self.value.get() {
            return Ok(v);
        }
        let mut failure = self.failure.lock();
        if let Some((e, at)) = failure.as_ref() {
            if now.saturating_duration_since(*at) < REOPEN_INTERVAL {
                return Err(e.clone());
            }
        }
        if let Some(v) = self.value.get() {
            return Ok(v);
        }
        match (self.open)() {
            Ok(v) => {
                tracing::info!("{}: opened after all", self.what);
                *failure = None;
                Ok(self.value.get_or_init(|| v))
            }
            Err(e) => {
                let e = Arc::new(e);
                *failure = Some((e.clone(), now));
                Err(e)
            }
        }
    }
}
