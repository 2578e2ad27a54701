//! What the proxy uses of the agent, and nothing else: the handles the composition root
//! gives it (`credgate`'s `node.rs`), beside the proxy's own (its metrics, its pull log, its
//! node images). The proxy never holds the agent itself; what it tells the agent's `Admin`
//! service (`explain`, the pulls, the node images) it says in the API's words, here.

use std::sync::Arc;

use arc_swap::ArcSwap;
use credgate_engine::clock::Clock;
use credgate_engine::Engine;

use credgate_agent::refusal::Refuser;
use credgate_api::v1 as pb;

use crate::metrics::ProxyMetrics;
use crate::node_images::NodeImages;
use crate::policy::ProxyPolicy;
use crate::pull_log::PullLog;

/// The proxy's handles on the agent.
#[derive(Clone)]
pub struct Context {
    pub clock: Arc<dyn Clock>,
    /// The proxy's own families.
    pub metrics: ProxyMetrics,
    /// The connection families every listener of the node counts into.
    pub connections: credgate_listener::ConnectionMetrics,
    /// The engine in use at each moment (a reload swaps it).
    pub engine: Arc<ArcSwap<Engine>>,
    /// Finds who gave a credential, confirms a refusal with the registry and acts on it.
    pub refusal: Arc<Refuser>,
    /// The pull decision log (the proxy's).
    pub pulls: Arc<PullLog>,
    /// What the proxy knows of the images the node keeps.
    pub node_images: Arc<NodeImages>,
    /// What the proxy may change in a pull (fill, credential scope).
    pub policy: ProxyPolicy,
}

impl Context {
    /// The engine in use now.
    pub fn engine(&self) -> Arc<Engine> {
        self.engine.load_full()
    }

    /// What the CRI proxy's policy would do with a pull of `image` (a normalized name): the
    /// answer's `cri_*` fields.
    pub fn explain(&self, image: &str, answer: &mut pb::ExplainResponse) {
        let policy = &self.policy;
        // A source that can give a credential: a docker config entry, or a provider not
        // keyed by service account whose cached answer (if any) holds one.
        let can_fill = answer.sources.iter().any(|s| {
            s.matched
                && (s.kind == credgate_engine::SourceKind::DockerConfig.as_str()
                    || (!self.engine().keyed_by_service_account(&s.name)
                        && (!s.cached || s.cached_credentials > 0)))
        });
        answer.cri_fill = match policy.fill_pattern(image) {
            Some(pattern) if can_fill => format!(
                "filled: a pull through the CRI proxy that comes without a credential gets the first credential the sources above give ({pattern} of --cri-proxy-fill); never a service-account-keyed provider's or a captured one"
            ),
            Some(pattern) => format!(
                "not filled: {pattern} of --cri-proxy-fill names the image, but no source above has a credential to fill it with (none matches, or what matches is keyed by service account or answered none); a pull without a credential goes as it came"
            ),
            None if policy.fills() => {
                "not filled: no --cri-proxy-fill pattern names the image; a pull without a credential goes as it came".into()
            }
            None => "not filled: --cri-proxy-fill is not set".into(),
        };
        let registry = credgate_core::reference::ImageRef::parse(image)
            .map(|r| r.registry().to_owned())
            .unwrap_or_default();
        answer.cri_mirror_trust = policy.scope(&registry).describe();
        if let Some(last) = self
            .pulls
            .list(Some(image))
            .into_iter()
            .find(|p| !p.refusal.is_empty())
        {
            let ago = self
                .clock
                .wall()
                .duration_since(last.at)
                .unwrap_or_default();
            answer.cri_last_unauthorized =
                format!("{} ({}s ago): {}", last.image, ago.as_secs(), last.refusal);
        }
        answer.cri_node_image = self
            .node_images
            .list()
            .iter()
            .filter(|s| {
                credgate_core::reference::ImageRef::parse(&s.image.image)
                    .is_ok_and(|r| r.name() == image)
            })
            .map(crate::node_images::describe)
            .collect::<Vec<_>>()
            .join("; ");
    }

    /// The recent pulls as `ListPulls` answers them, newest first; of one repository (a
    /// normalized name) when given.
    pub fn list_pulls(&self, repository: Option<&str>) -> Vec<pb::Pull> {
        self.pulls
            .list(repository)
            .into_iter()
            .map(|p| {
                let (auth, source_kind, source) = p.auth.wire();
                pb::Pull {
                    at_unix_ms: credgate_engine::clock::unix_ms(p.at),
                    result: crate::outcome::PullResult::of(p.code, &p.message).wire() as i32,
                    image: p.image,
                    pod_namespace: p.pod_namespace,
                    pod_name: p.pod_name,
                    auth: auth as i32,
                    source_kind: source_kind as i32,
                    source,
                    code: p.code,
                    message: p.message,
                    duration_ms: u64::try_from(p.duration.as_millis()).unwrap_or(u64::MAX),
                    refusal: p.refusal,
                    node_image: p
                        .node_image
                        .map(|w| w.as_str().to_owned())
                        .unwrap_or_default(),
                }
            })
            .collect()
    }

    /// What the keeper knows of each node image, as `Status` tells it.
    pub fn node_images_status(&self) -> Vec<pb::NodeImageStatus> {
        self.node_images
            .list()
            .into_iter()
            .map(crate::node_images::status)
            .collect()
    }
}
