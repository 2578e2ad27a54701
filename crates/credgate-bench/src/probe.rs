//! What the soaks' probes saw, phase by phase: shared by the CRI soak and the API soak.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use credgate_api::v1 as pb;
use serde_json::json;

use crate::{ms, percentile};

/// What one loop saw in one phase (the CRI soak's loops, the API soak's probes).
#[derive(Default)]
pub(crate) struct Phase {
    pub(crate) ok: Vec<Duration>,
    pub(crate) failed: u64,
}

impl Phase {
    pub(crate) fn summary(&mut self) -> serde_json::Value {
        let n = self.ok.len();
        let (p50, max) = if n == 0 {
            (Duration::ZERO, Duration::ZERO)
        } else {
            let max = *self.ok.iter().max().unwrap_or(&Duration::ZERO);
            (percentile(&mut self.ok, 0.5), max)
        };
        json!({"ok": n, "failed": self.failed, "p50_ms": ms(p50), "max_ms": ms(max)})
    }
}

/// `Health` on a new connection every `every` (5 s at most each) while `running`, by the phase
/// `phase` names (0 or 1): what the node's own callers see of the agent.
pub(crate) async fn health(
    socket: PathBuf,
    every: Duration,
    phase: impl Fn() -> usize,
    running: impl Fn() -> bool,
) -> [Phase; 2] {
    let mut seen: [Phase; 2] = Default::default();
    while running() {
        let (at, t) = (phase(), Instant::now());
        let answer = tokio::time::timeout(Duration::from_secs(5), async {
            let channel = credgate_api::connect(&socket).await.ok()?;
            credgate_api::v1::admin_client::AdminClient::new(channel)
                .health(pb::HealthRequest {})
                .await
                .ok()
        })
        .await;
        match answer {
            Ok(Some(_)) => seen[at].ok.push(t.elapsed()),
            _ => seen[at].failed += 1,
        }
        tokio::time::sleep(every).await;
    }
    seen
}
