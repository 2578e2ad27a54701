//! `renewal-scale`: what the renewal loop costs for what it holds. `-n` refs (in-process
//! consumers of 4,000 refs each, as root's are: not bounded per uid) behind one provider whose
//! answers last an hour, all resolved once; then `--reps` wakes of the loop (a ref of another
//! registry tracked and untracked, as consumers come and go; 1 ms apart, so that each is a
//! wake of its own), with the process's CPU time a wake and its RSS. A loop that scans every
//! ref at each wake costs O(n) a wake; one that keeps its refs in time order costs what falls
//! due.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use arc_swap::ArcSwap;
use serde_json::json;

use crate::{emit, Args, TempDir};

/// The process's CPU time (user + system), from `/proc/self/stat` (in 10 ms ticks).
fn cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis: utime is the 12th, stime the 13th.
    let ticks: u64 = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|f| f.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

pub fn renewal_scale(args: &Args) -> Result<()> {
    let dir = TempDir::new("renewal-scale")?;
    let script = "cat >/dev/null\nprintf '{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"1h\",\"auth\":{\"reg.example.com\":{\"username\":\"u\",\"password\":\"p\"}}}'\n";
    let (bin, config) = crate::shell_provider(&dir.0, "scale", script, "reg.example.com", "1h")?;
    let sources = credgate_agent::Sources {
        provider_config: Some(config),
        bin_dir: Some(bin),
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let n = args.n.max(1);
    let reps = args.reps.max(1);
    let (setup, per_wake, cpu_per_wake, rss) = rt.block_on(async {
        let clock: Arc<dyn credgate_engine::clock::Clock> =
            Arc::new(credgate_engine::clock::SystemClock::new());
        let engine = Arc::new(ArcSwap::from_pointee(
            sources.build(None, Some(clock.clone()))?,
        ));
        let tasks = credgate_agent::tasks::Tasks::new();
        let renewer = credgate_agent::renewal::Renewer::new(
            engine,
            clock,
            credgate_core::renewal::RenewalPolicy::default(),
            credgate_agent::metrics::AgentMetrics::default(),
            tasks.clone(),
            None,
        );
        tasks.spawn(renewer.clone().run());
        let started = Instant::now();
        let refs: Vec<String> = (0..n)
            .map(|i| format!("reg.example.com/team/app-{i}:v1"))
            .collect();
        for (c, chunk) in refs.chunks(4000).enumerate() {
            renewer.track(&format!("bulk-{c}"), chunk)?;
        }
        // Every ref resolved once (one plugin run: one cache entry serves them all).
        while renewer.list(None).iter().any(|t| t.credentials == 0) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let setup = started.elapsed();
        let (t0, c0) = (Instant::now(), cpu());
        for i in 0..reps {
            let r = vec![format!("other.example.com/x/{i}:v1")];
            renewer.track("churn", &r)?;
            renewer.untrack("churn", &r)?;
            // Each wake is taken by the loop before the next comes (wakes given at once
            // are taken as one).
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Let the loop catch up with the wakes it was given.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let wall = t0.elapsed().saturating_sub(Duration::from_millis(200));
        let wall = wall.saturating_sub(Duration::from_millis(reps as u64));
        let spent = cpu().saturating_sub(c0);
        let rss = crate::rss_kib("self");
        tasks.stop();
        anyhow::Ok((setup, wall / reps as u32, spent / reps as u32, rss))
    })?;
    emit(
        args,
        json!({
            "scenario": "renewal-scale", "refs": n, "wakes": reps,
            "setup_ms": crate::ms(setup),
            "per_wake_us": per_wake.as_secs_f64() * 1e6,
            "cpu_per_wake_us": cpu_per_wake.as_secs_f64() * 1e6,
            "rss_kb": rss,
        }),
    );
    Ok(())
}
