//! What `Explain` answers: the engine's explanation of a lookup as the API's `ExplainResponse`
//! (shared by the agent's RPC and `credgate explain` without an agent), with what the agent
//! adds to it ([`Explainer`]); and the CRI proxy's state and view ([`ProxySlot`],
//! [`ProxyView`]), which the composition root sets and the `Admin` service reads.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;
use credgate_api::v1 as pb;
use credgate_engine::clock::Clock;
use credgate_engine::explain::Explanation;
use credgate_engine::Engine;

use crate::captured::Captured;
use crate::guard::Guard;
use crate::refusal::Refuser;

/// What the CRI proxy tells the `Admin` service while it runs, in the API's words: what it
/// would do with a pull (`Explain`), its recent pulls (`ListPulls`) and the images it keeps
/// (`Status`). The composition root gives it to the agent ([`ProxySlot::set_running`]);
/// the proxy's crate never names this trait, nor the agent its types.
pub trait ProxyView: Send + Sync {
    /// Fills the answer's `cri_*` fields for `image` (a normalized name).
    fn explain(&self, image: &str, answer: &mut pb::ExplainResponse);
    /// The recent pulls, newest first; of one repository (a normalized name) when given.
    fn pulls(&self, repository: Option<&str>) -> Vec<pb::Pull>;
    /// What the proxy knows of each image the node keeps.
    fn node_images(&self) -> Vec<pb::NodeImageStatus>;
}

/// The CRI proxy's state, shared by the composition root (which sets it) and the `Admin`
/// service (which reads it): off until it serves; its view stays when it ends early.
#[derive(Clone, Default)]
pub struct ProxySlot(Arc<Mutex<ProxyState>>);

#[derive(Default)]
struct ProxyState {
    view: Option<Arc<dyn ProxyView>>,
    /// Why it stopped while the agent serves.
    ended: Option<String>,
}

impl ProxySlot {
    /// The CRI proxy serves from now on; the `Admin` service asks `view` what it would do
    /// with a pull, its recent pulls and the node's images.
    pub fn set_running(&self, view: Arc<dyn ProxyView>) {
        *self.0.lock() = ProxyState {
            view: Some(view),
            ended: None,
        };
    }

    /// The CRI proxy ended while the agent serves (`why`): `Status` says so from now on.
    pub fn set_ended(&self, why: String) {
        self.0.lock().ended = Some(why);
    }

    /// The CRI proxy's state for `Status`: `serving`, `off` (not configured), or
    /// `ended: WHY`.
    pub fn state(&self) -> String {
        let state = self.0.lock();
        match (&state.ended, &state.view) {
            (Some(why), _) => format!("ended: {why}"),
            (None, Some(_)) => "serving".to_owned(),
            (None, None) => "off".to_owned(),
        }
    }

    /// What the CRI proxy tells the `Admin` service, once it served.
    pub fn view(&self) -> Option<Arc<dyn ProxyView>> {
        self.0.lock().view.clone()
    }

    /// What the CRI proxy tells the `Admin` service, while it serves (`None` when it is off
    /// or ended).
    pub fn serving(&self) -> Option<Arc<dyn ProxyView>> {
        let state = self.0.lock();
        state.view.clone().filter(|_| state.ended.is_none())
    }
}

/// What `Explain` reads: the engine in use, the refusal service's memory of docker config
/// entries, the guard's records, the captures and the CRI proxy's view.
#[derive(Clone)]
pub struct Explainer {
    pub(crate) engine: Arc<ArcSwap<Engine>>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) refusal: Arc<Refuser>,
    pub(crate) guard: Option<Guard>,
    pub(crate) captured: Option<Arc<Captured>>,
    pub(crate) proxy: ProxySlot,
}

impl Explainer {
    /// Explains a lookup of `image` (no plugin run): the engine's sources, the captured pod
    /// credential of its repository, and a verdict.
    pub fn explain(
        &self,
        image: &str,
        service_account: Option<&credgate_engine::ServiceAccount>,
    ) -> Result<pb::ExplainResponse, credgate_engine::LookupError> {
        let engine = self.engine.load_full();
        let explained = engine.explain(&credgate_engine::LookupRequest {
            image,
            service_account,
            ..Default::default()
        })?;
        let now = self.clock.wall();
        let mut answer = to_wire(&explained, now);
        for source in answer
            .sources
            .iter_mut()
            .filter(|s| s.kind == credgate_engine::SourceKind::DockerConfig.as_str())
        {
            if let Some(r) = self.refusal.memory().docker_report(&source.name) {
                source.dropped_unix_ms = credgate_engine::clock::unix_ms(r.at);
                source.dropped_reason = format!(
                    "a registry refused an entry of it at a pull of {}: credgate does not change that file; update it",
                    r.image
                );
                answer.verdict.push_str(&format!(
                    "; docker config {} has an entry a registry refused ({})",
                    source.name, r.image
                ));
            }
        }
        if let Some(guard) = &self.guard {
            self.explain_guard(guard, image, &mut answer);
        }
        if let Some(proxy) = self.proxy.serving() {
            proxy.explain(&explained.image, &mut answer);
        }
        if let Some(c) = self
            .captured
            .as_ref()
            .and_then(|c| c.for_repository(&explained.image))
        {
            answer.captured = true;
            answer.captured_namespace = c.namespace.clone();
            answer.captured_unix_ms = c.captured_ms;
            let prefix = format!("{}: ", explained.image);
            let rest = answer
                .verdict
                .strip_prefix(&prefix)
                .unwrap_or(&answer.verdict)
                .to_owned();
            answer.verdict = format!(
                "{}the pod credential the CRI proxy captured for the repository (namespace {}) comes first for the API and snapshotters, for this repository only, never for the kubelet or a registry host's docker helper (other namespaces' pods still pull with what the providers give); then {rest}",
                prefix,
                if c.namespace.is_empty() { "-" } else { &c.namespace },
            );
        }
        Ok(answer)
    }

    /// The guard's records of `image` and its decision for node-wide credentials.
    fn explain_guard(&self, guard: &Guard, image: &str, answer: &mut pb::ExplainResponse) {
        let Ok((name, _)) = crate::guard::normalize(image) else {
            return;
        };
        let Ok(store) = guard.store() else {
            answer.guard_node_wide_decision = "the guard's store cannot be read".into();
            return;
        };
        let mut first_ref = None;
        for record in store.records() {
            let Some(entry) = record.names.get(&name) else {
                continue;
            };
            first_ref.get_or_insert_with(|| record.image_ref.clone());
            let mut namespaces: Vec<&str> = entry
                .secrets
                .iter()
                .map(|s| s.coords.namespace.as_str())
                .collect();
            namespaces.sort_unstable();
            namespaces.dedup();
            answer.guard_record_summaries.push(pb::GuardRecordSummary {
                image_ref: record.image_ref.clone(),
                node_wide: entry.node_accessible,
                secrets: u32::try_from(entry.secrets.len()).unwrap_or(u32::MAX),
                secret_namespaces: namespaces.iter().map(|n| (*n).to_owned()).collect(),
                service_accounts: u32::try_from(entry.service_accounts.len()).unwrap_or(u32::MAX),
            });
            answer.guard_records.push(format!(
                "{}: node-wide {}; {} secret(s){}; {} service account(s)",
                record.image_ref,
                if entry.node_accessible { "yes" } else { "no" },
                entry.secrets.len(),
                if namespaces.is_empty() {
                    String::new()
                } else {
                    format!(" of {}", namespaces.join(", "))
                },
                entry.service_accounts.len()
            ));
        }
        if let Some(image_ref) = first_ref {
            if let Ok(c) = guard.check(
                image,
                &image_ref,
                crate::guard::Presence::OnNode,
                crate::guard::PullPolicy::IfNotPresent,
                &[crate::guard::CredentialIn::NodeWide],
            ) {
                answer.guard_node_wide_decision = format!(
                    "{} ({}): {}",
                    c.answer.as_str(),
                    c.reason.as_str(),
                    c.message
                );
            }
        }
    }
}

fn ms(t: Option<SystemTime>) -> i64 {
    t.map_or(0, credgate_engine::clock::unix_ms)
}

/// The explanation, with its verdict at `now`.
pub fn to_wire(e: &Explanation, now: SystemTime) -> pb::ExplainResponse {
    let sources = e
        .sources
        .iter()
        .map(|s| {
            let mut out = pb::ExplainedSource {
                kind: s.kind.as_str().into(),
                name: s.name.clone(),
                matched: s.matched,
                pattern: s.pattern.clone().unwrap_or_default(),
                why_not: s.why_not.clone().unwrap_or_default(),
                ..Default::default()
            };
            if let Some(v) = &s.provider {
                if let Some(c) = &v.cached {
                    out.cached = true;
                    out.cache_key_type = crate::server::wire::cache_key_type(c.key_type);
                    out.cache_expires_unix_ms = ms(c.expires);
                    out.cache_age_ms = u64::try_from(c.age.as_millis()).unwrap_or(u64::MAX);
                    out.cached_credentials = u32::try_from(c.credentials).unwrap_or(u32::MAX);
                }
                out.runs = v.status.runs;
                out.last_run_unix_ms = ms(v.status.last_run);
                out.last_success_unix_ms = ms(v.status.last_success);
                out.last_error = v.status.last_error.clone().unwrap_or_default();
                out.consecutive_failures = v.status.consecutive_failures;
                out.backoff_until_unix_ms = ms(v.backoff_until);
                out.skipped_without_service_account = v.skipped_without_service_account;
                if let Some((at, why)) = &v.status.last_dropped {
                    out.dropped_unix_ms = ms(Some(*at));
                    out.dropped_reason = why.clone();
                }
            }
            out
        })
        .collect();
    pb::ExplainResponse {
        image: e.image.clone(),
        sources,
        verdict: e.verdict(now),
        ..Default::default()
    }
}
