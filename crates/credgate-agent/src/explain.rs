//! The engine's explanation of a lookup as the API's `ExplainResponse` (shared by the agent's
//! RPC and `credgate explain` without an agent).

use std::time::SystemTime;

use credgate_api::v1 as pb;
use credgate_engine::explain::Explanation;

/// What the CRI proxy tells the `Admin` service while it runs, in the API's words: what it
/// would do with a pull (`Explain`), its recent pulls (`ListPulls`) and the images it keeps
/// (`Status`). The composition root gives it to the agent ([`crate::Agent::set_proxy_running`]);
/// the proxy's crate never names this trait, nor the agent its types.
pub trait ProxyView: Send + Sync {
    /// Fills the answer's `cri_*` fields for `image` (a normalized name).
    fn explain(&self, image: &str, answer: &mut pb::ExplainResponse);
    /// The recent pulls, newest first; of one repository (a normalized name) when given.
    fn pulls(&self, repository: Option<&str>) -> Vec<pb::Pull>;
    /// What the proxy knows of each image the node keeps.
    fn node_images(&self) -> Vec<pb::NodeImageStatus>;
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
