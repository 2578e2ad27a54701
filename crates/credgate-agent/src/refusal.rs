//! Credentials a registry refused: never served again.
//!
//! A refusal is seen at the CRI proxy (a `PullImage` that carried a credential one of the
//! agent's sources gave, answered unauthorized by the runtime) or reported by a consumer
//! (`ReportRefused`). Either way it acts only once the registry's auth endpoint has refused
//! that very credential to the agent (`confirm.rs`): "unauthorized" for one image is
//! also what a typo'd repository, or one the credential may not read, gets. What it does depends on the source
//! that gave the credential ([`Given`]): a provider's cached answers holding it are dropped
//! (memory and sealed file; the plugin runs again at the next lookup, coalesced and under its
//! backoff and rate), tracked refs lose it and are renewed at once (Watch streams get the new
//! answer); a captured pod credential is forgotten; a docker config entry, which credgate does
//! not own, is reported (log, metric, `explain`).
//!
//! The agent remembers each refused credential (a keyed fingerprint, never the secret, kept
//! across restarts sealed in `memory.sealed`: module `memory`) until the answer it came from
//! would have expired: a second refusal of it within [`HOLDOFF`] does nothing, so no caller
//! can make a plugin run more than once per key per interval, and the proxy knows a client's
//! stale copy (the kubelet caches what the bridge gave it) for what it is
//! ([`Refusals::known`]).

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};

use crate::captured::Captured;
pub use crate::memory::{DockerRefusal, Refusals, HOLDOFF};
use crate::metrics::AgentMetrics;
use crate::renewal::Renewer;
use crate::saver::Saver;
use arc_swap::ArcSwap;
use credgate_engine::clock::Clock;
use credgate_engine::Engine;
use std::sync::Arc;

/// The source that gave a credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Given {
    /// A provider's cached answer (by provider name).
    Provider(String),
    /// A node-wide docker config file (by path).
    DockerConfig(String),
    /// The pull credential the CRI proxy captured for the repository (the pod's namespace).
    Captured(String),
}

impl From<credgate_engine::Source> for Given {
    fn from(source: credgate_engine::Source) -> Given {
        match source {
            credgate_engine::Source::Provider(name) => Given::Provider(name),
            credgate_engine::Source::DockerConfig(file) => Given::DockerConfig(file),
        }
    }
}

impl Given {
    /// The API's kind of source and its name (provider, docker config path, namespace).
    pub fn wire(&self) -> (credgate_api::v1::SourceKind, String) {
        use credgate_api::v1::SourceKind;
        match self {
            Given::Provider(name) => (SourceKind::Provider, name.clone()),
            Given::DockerConfig(file) => (SourceKind::DockerConfig, file.clone()),
            Given::Captured(namespace) => (SourceKind::Captured, namespace.clone()),
        }
    }

    /// Its kind, as metrics label it.
    pub fn label(&self) -> SourceLabel {
        match self {
            Given::Provider(_) => SourceLabel::Provider,
            Given::DockerConfig(_) => SourceLabel::DockerConfig,
            Given::Captured(_) => SourceLabel::Captured,
        }
    }
}

impl std::fmt::Display for Given {
    /// As the pull log names it: `provider:NAME`, `docker-config`, `captured`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Given::Provider(name) => write!(f, "provider:{name}"),
            Given::DockerConfig(_) => f.write_str("docker-config"),
            Given::Captured(_) => f.write_str("captured"),
        }
    }
}

/// The kind of a source, as a metric's `source` (or `auth`) label: `provider`,
/// `docker_config`, `captured`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceLabel {
    Provider,
    Captured,
    DockerConfig,
}

impl SourceLabel {
    pub const ALL: [SourceLabel; 3] = [
        SourceLabel::Provider,
        SourceLabel::Captured,
        SourceLabel::DockerConfig,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SourceLabel::Provider => "provider",
            SourceLabel::Captured => "captured",
            SourceLabel::DockerConfig => "docker_config",
        }
    }
}

credgate_engine::label_values!(SourceLabel);

/// What a refusal did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// A provider's answers holding it were dropped (how many).
    Dropped(usize),
    /// The captured credential was forgotten.
    Forgotten,
    /// A docker config entry: reported only.
    Reported,
    /// Refused within [`HOLDOFF`] already: nothing more.
    Recently,
    /// No source of the agent gave it: nothing.
    NotGiven,
}

impl Refused {
    pub fn as_str(&self) -> &'static str {
        match self {
            Refused::Dropped(_) => "dropped",
            Refused::Forgotten => "forgotten",
            Refused::Reported => "reported",
            Refused::Recently => "already_refused",
            Refused::NotGiven => "not_given",
        }
    }
}

/// How long a refused credential is remembered when its answer's expiry is unknown.
const DEFAULT_MEMORY: Duration = Duration::from_secs(3600);

/// Refusals as a service: what it holds to find who gave a credential, confirm a refusal
/// with the registry and act on it in each source. Cheap to share (`Arc`).
pub struct Refuser {
    memory: Arc<Refusals>,
    confirmations: crate::confirm::Confirmations,
    engine: Arc<ArcSwap<Engine>>,
    captured: Option<Arc<Captured>>,
    renewer: Renewer,
    saver: Saver,
    metrics: AgentMetrics,
    clock: Arc<dyn Clock>,
}

impl Refuser {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        memory: Arc<Refusals>,
        verifier: crate::guard::registry::Verifier,
        engine: Arc<ArcSwap<Engine>>,
        captured: Option<Arc<Captured>>,
        renewer: Renewer,
        saver: Saver,
        metrics: AgentMetrics,
        clock: Arc<dyn Clock>,
    ) -> Refuser {
        Refuser {
            memory,
            confirmations: crate::confirm::Confirmations::new(verifier),
            engine,
            captured,
            renewer,
            saver,
            metrics,
            clock,
        }
    }

    /// The credentials registries refused, remembered.
    pub fn memory(&self) -> &Refusals {
        &self.memory
    }

    /// Which of the agent's sources give `username`:`password` for `image` (of `repository`) now,
    /// in try-order: the captured credential of the repository, docker config entries, providers'
    /// cached answers. Empty: a credential none of them gives.
    pub fn given_now(
        &self,
        image: &str,
        repository: &str,
        username: &str,
        password: &str,
    ) -> Vec<Given> {
        let mut out = Vec::new();
        if let Some(captured) = self.captured.as_ref() {
            out.extend(
                captured
                    .all_for_repository(repository)
                    .into_iter()
                    .filter(|c| c.username == username && c.password.expose_secret() == password)
                    .map(|held| Given::Captured(held.namespace)),
            );
        }
        out.extend(
            self.engine
                .load()
                .given_by(image, username, password)
                .into_iter()
                .map(Given::from),
        );
        out
    }

    /// The sources that gave `username`:`password`: [`Refuser::given_now`], or, when none does any more,
    /// the source that gave it before a registry refused it ([`Refusals::known`]). Empty: a
    /// credential the agent never gave (a pod's own pull secret).
    pub fn given_by(
        &self,
        image: &str,
        repository: &str,
        username: &str,
        password: &str,
    ) -> Vec<Given> {
        self.or_known(
            self.given_now(image, repository, username, password),
            username,
            password,
        )
    }

    /// `now`, or when it is empty the source a refusal of `username`:`password` remembers, or
    /// the provider that handed it to the kubelet's bridge while the kubelet may hold it (the
    /// provider has another answer since: a rotation).
    pub fn or_known(&self, now: Vec<Given>, username: &str, password: &str) -> Vec<Given> {
        if !now.is_empty() {
            return now;
        }
        self.memory
            .known(username, password, self.clock.now())
            .or_else(|| self.memory.handed(username, password, self.clock.wall()))
            .into_iter()
            .collect()
    }

    /// The registry refused `username`:`password` for `image` (of `repository`), which the
    /// sources `given` gave; `seen` says where (for the log and `explain`). Drops, forgets or
    /// reports it in each, once per [`HOLDOFF`].
    pub async fn refuse(
        &self,
        image: &str,
        repository: &str,
        username: &str,
        password: &SecretString,
        given: &[Given],
        seen: &str,
    ) -> Refused {
        let refusals = &self.memory;
        let now = self.clock.now();
        let fp = refusals.fingerprint(username, password.expose_secret());
        // Remembered under the provider that gave it, when one did: its answer of now replaces a
        // client's stale copy.
        let Some(primary) = given
            .iter()
            .find(|g| matches!(g, Given::Provider(_)))
            .or(given.first())
        else {
            return Refused::NotGiven;
        };
        // Nothing is dropped again within the hold-off: a plugin that answers the same refused
        // credential once more is not run again for every pull that carries it.
        if refusals.recently_refused(&fp, now) {
            return Refused::Recently;
        }
        let why = format!("refused by the registry ({seen} of {image})");
        let mut dropped = Vec::new();
        for g in given {
            if let Given::Provider(name) = g {
                dropped.extend(
                    self.engine
                        .load()
                        .refuse(name, image, username, password.expose_secret(), &why)
                        .unwrap_or_default(),
                );
            }
        }
        let until = dropped
            .iter()
            .filter_map(|d| d.expires)
            .max()
            .and_then(|t| t.duration_since(self.clock.wall()).ok())
            .map_or(now + DEFAULT_MEMORY, |left| now + left);
        if !refusals.note(fp, primary, now, until, self.clock.wall()) {
            return Refused::Recently;
        }
        for g in given {
            self.metrics.refused(g.label());
            self.act_on(g, image, repository, username, password, seen)
                .await;
        }
        let by_provider = given.iter().any(|g| matches!(g, Given::Provider(_)));
        let outcome = if by_provider {
            Refused::Dropped(dropped.len())
        } else if given.iter().any(|g| matches!(g, Given::Captured(_))) {
            Refused::Forgotten
        } else {
            Refused::Reported
        };
        if by_provider {
            self.renewer.refused(username, password.expose_secret());
            // The sealed file loses the answer now, not at the saver's next tick.
            self.saver.save().await;
        }
        outcome
    }

    /// What a refusal does to one source that gave the credential (a provider's answers were
    /// dropped already): logs it, forgets a captured credential, reports a docker config entry.
    async fn act_on(
        &self,
        given: &Given,
        image: &str,
        repository: &str,
        username: &str,
        password: &SecretString,
        seen: &str,
    ) {
        match given {
            Given::Provider(name) => {
                tracing::warn!(
                    provider = %name,
                    image = %image,
                    seen = %seen,
                    "the registry refused a credential of provider {name}: its cached answers holding it are dropped and its plugin runs again at the next lookup"
                );
            }
            Given::Captured(namespace) => {
                self.forget_captured(repository, username, password, namespace, seen)
                    .await;
            }
            Given::DockerConfig(file) => {
                self.memory.report_docker(
                    file,
                    DockerRefusal {
                        at: self.clock.wall(),
                        image: image.to_owned(),
                    },
                );
                tracing::warn!(
                    docker_config = %file,
                    image = %image,
                    seen = %seen,
                    "the registry refused a credential of docker config {file}: credgate does not own that file; update or remove its entry"
                );
            }
        }
    }

    /// Drops the captured credential of `repository` if it still is the refused one.
    async fn forget_captured(
        &self,
        repository: &str,
        username: &str,
        password: &SecretString,
        namespace: &str,
        seen: &str,
    ) {
        let Some(captured) = self.captured.clone() else {
            return;
        };
        let (repo, user, pass) = (
            repository.to_owned(),
            username.to_owned(),
            SecretString::from(password.expose_secret().to_owned()),
        );
        let forgot = tokio::task::spawn_blocking(move || {
            captured.forget_refused(&repo, &user, pass.expose_secret())
        })
        .await;
        match forgot {
            Ok(Ok(true)) => {
                tracing::warn!(repository = %repository, namespace = %namespace, seen = %seen, "the registry refused the captured pull credential: it is dropped");
            }
            Ok(Ok(false)) | Err(_) => {}
            Ok(Err(e)) => {
                tracing::error!(repository = %repository, error = %e, "the refused captured pull credential cannot be dropped");
            }
        }
    }

    /// Someone saw the registry refuse `username`:`password` for `image` (of `repository`), which
    /// the sources `given` gave (empty: a pod's own secret, nothing is asked or done); `seen`
    /// says where. Acts ([`Refuser::refuse`]) only once the registry's auth endpoint has refused that very
    /// credential to the agent (`confirm.rs`); within [`HOLDOFF`] of the last refusal of it,
    /// nothing is asked again. `first`: root's or the agent's own (its confirmation goes first).
    #[allow(clippy::too_many_arguments)]
    pub async fn confirm_and_refuse(
        &self,
        image: &str,
        parsed: &credgate_core::reference::ImageRef<'_>,
        username: &str,
        password: &SecretString,
        given: &[Given],
        seen: &str,
        first: bool,
    ) -> Report {
        if given.is_empty() {
            return Report::NotGiven;
        }
        let refusals = &self.memory;
        let fp = refusals.fingerprint(username, password.expose_secret());
        if refusals.recently_refused(&fp, self.clock.now()) {
            return Report::Recently;
        }
        let confirmed = self
            .confirmations
            .confirm(
                parsed.registry(),
                parsed.path(),
                fp,
                username,
                password.expose_secret(),
                self.clock.now(),
                first,
            )
            .await;
        self.metrics.refusal_confirmation(confirmed.as_str());
        match confirmed {
            crate::confirm::Confirmed::Refused => Report::Refused(
                self.refuse(image, parsed.name(), username, password, given, seen)
                    .await,
            ),
            crate::confirm::Confirmed::Accepted => Report::Accepted,
            crate::confirm::Confirmed::Unchecked => Report::Unchecked,
            crate::confirm::Confirmed::Unknown(why) => Report::Unreachable(why),
        }
    }

    /// A consumer says the registry refused `username`:`password` for `image`. Acts only on a
    /// credential the agent gives for the image, and only once the registry has shown, to the
    /// agent itself, that it refuses the credential ([`Refuser::confirm_and_refuse`]). `first`: the caller
    /// is root or the agent's own uid.
    pub async fn report(
        &self,
        image: &str,
        username: &str,
        password: &SecretString,
        first: bool,
    ) -> Result<Report, credgate_core::reference::ReferenceError> {
        let parsed = credgate_core::reference::ImageRef::parse(image)?;
        let given = self.given_by(image, parsed.name(), username, password.expose_secret());
        let outcome = self
            .confirm_and_refuse(
                image,
                &parsed,
                username,
                password,
                &given,
                "a consumer's report",
                first,
            )
            .await;
        self.metrics.refusal_report(outcome.as_str());
        Ok(outcome)
    }
}

/// What became of a refusal someone saw: a consumer's report, or a pull through the proxy
/// answered unauthorized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// The registry refused it: dropped, forgotten or reported.
    Refused(Refused),
    /// The registry's auth endpoint accepted the credential itself: what it refused was the
    /// credential's access to the image (or the image does not exist). Nothing changes.
    Accepted,
    /// The registry does not check credentials, or its answer says neither: nothing changes.
    Unchecked,
    /// Not a credential the agent gives for the image: nothing changes.
    NotGiven,
    /// Refused already within [`HOLDOFF`].
    Recently,
    /// The registry could not be asked, or did not answer in time: nothing changes.
    Unreachable(String),
}

impl Report {
    /// The API's outcome.
    pub fn wire(&self) -> credgate_api::v1::RefusalOutcome {
        use credgate_api::v1::RefusalOutcome as Wire;
        match self {
            Report::Refused(_) => Wire::Refused,
            Report::Accepted => Wire::Accepted,
            Report::Unchecked => Wire::Unchecked,
            Report::NotGiven => Wire::NotGiven,
            Report::Recently => Wire::AlreadyRefused,
            Report::Unreachable(_) => Wire::Unreachable,
        }
    }

    /// The metric label (the API's outcome's word).
    pub fn as_str(&self) -> &'static str {
        self.wire().word()
    }

    /// One sentence for the pull log, `explain` and the API; never a secret.
    pub fn describe(&self, image: &str) -> String {
        match self {
            Report::Refused(Refused::Dropped(n)) => format!(
                "the registry refuses the credential itself: {n} cached provider answer(s) holding it dropped; the next lookup runs the plugin"
            ),
            Report::Refused(Refused::Forgotten) => {
                "the registry refuses the credential itself: the captured pull credential is dropped".into()
            }
            Report::Refused(Refused::Reported) => {
                "the registry refuses the credential itself: it comes from a docker config file, which credgate does not change; update that file".into()
            }
            Report::Refused(Refused::Recently) | Report::Recently => {
                "refused already; Lookup gives the source's new answer".into()
            }
            Report::Refused(Refused::NotGiven) | Report::NotGiven => {
                "not a credential the agent gives for this image: nothing changes".into()
            }
            Report::Accepted => format!(
                "the registry answered unauthorized for {image}; the credential itself is accepted: check the image name and the credential's access"
            ),
            Report::Unchecked => {
                "the registry does not check credentials at its auth endpoint: nothing changes".into()
            }
            Report::Unreachable(why) => {
                format!("the registry could not confirm the refusal ({why}): nothing changes")
            }
        }
    }
}
