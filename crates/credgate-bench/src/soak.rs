//! `soak`: a long, realistic mix against a running agent process (`scripts/soak` starts it):
//! lookups (plugins that answer, fail at random, short TTLs), tracked refs renewing, a Watch
//! reading along, guard checks and pull recordings. Reports throughput, latency percentiles
//! per call, and the agent's RSS, descriptors and child processes sampled from /proc.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use credgate_api::v1 as pb;
use credgate_api::v1::credentials_client::CredentialsClient;
use credgate_api::v1::image_access_client::ImageAccessClient;
use serde_json::json;
use tokio_stream::StreamExt;

use crate::{percentile, Args};

const KINDS: [&str; 4] = ["lookup", "check_access", "record_pull", "lookup_flaky"];

/// One sample of the agent process.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at_s: u64,
    rss_kb: u64,
    fds: usize,
    children: usize,
}

fn sample(pid: u32, started: Instant) -> Sample {
    let rss_kb = crate::rss_kib(&pid.to_string());
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .map_or(0, |c| c.split_whitespace().count());
    Sample {
        at_s: started.elapsed().as_secs(),
        rss_kb,
        fds,
        children,
    }
}

fn secret(team: u64) -> pb::PullCredential {
    let object = pb::ObjectRef {
        namespace: format!("team-{team}"),
        name: "pull".into(),
        uid: format!("uid-{team}"),
    };
    pb::PullCredential::secret(
        object,
        format!("user-{team}"),
        format!("soak-password-{team}"),
    )
}

/// A small deterministic generator per client.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

pub fn soak(args: &Args) -> Result<()> {
    let socket = args.socket.clone().context("soak needs --socket")?;
    let pid = args.agent_pid.context("soak needs --agent-pid")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(args, &socket, pid))
}

async fn run(args: &Args, socket: &Path, pid: u32) -> Result<()> {
    let started = Instant::now();
    let deadline = started + args.duration;
    let channel = credgate_api::connect(socket).await?;
    let mut creds = CredentialsClient::new(channel.clone());
    let tracked: Vec<String> = (0..args.tracked)
        .map(|i| format!("renew.soak.test/app-{i}:v1"))
        .collect();
    creds
        .set_tracked(pb::SetTrackedRequest {
            consumer: "soak".into(),
            refs: tracked.clone(),
        })
        .await?;
    let watched = Arc::new(AtomicU64::new(0));
    let watcher = {
        let watched = watched.clone();
        let mut stream = creds
            .watch(pb::WatchRequest {
                refs: tracked.iter().take(10).cloned().collect(),
            })
            .await?
            .into_inner();
        tokio::spawn(async move {
            while let Some(Ok(_)) = stream.next().await {
                watched.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    let samples = Arc::new(Mutex::new(vec![sample(pid, started)]));
    let sampler = {
        let samples = samples.clone();
        let every = args.sample_every;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                samples.lock().unwrap().push(sample(pid, started));
            }
        })
    };

    let budget = Arc::new(AtomicU64::new(args.max_requests));
    let done = Arc::new(AtomicU64::new(0));
    // The adversarial phase: the second half of the run, beside the mix.
    let attack = args.adversarial.then(|| {
        let (done, socket, refs) = (done.clone(), socket.to_owned(), tracked.clone());
        let half = args.duration / 2;
        let on = |part: &str| args.attack.iter().any(|a| a == part);
        let idle = if on("idle") { args.idle_connections } else { 0 };
        let watch_connections = if on("watch") { 10 } else { 0 };
        let oversized = if on("oversized") { 2 } else { 0 };
        let verifiers = if on("verify") { 2 } else { 0 };
        let tenants = on("tenants");
        // As root, the local user's attacks run as another uid too: root's own connections
        // are the ones the agent keeps room for.
        let classic: Vec<&'static str> = ["idle", "watch", "oversized", "verify"]
            .into_iter()
            .filter(|p| on(p))
            .collect();
        let as_root = crate::tenant::own_uid() == 0;
        let (idle, watch_connections, oversized, verifiers) = if as_root {
            (0, 0, 0, 0)
        } else {
            (idle, watch_connections, oversized, verifiers)
        };
        let classic = if as_root { classic } else { Vec::new() };
        tokio::spawn(async move {
            tokio::time::sleep(half).await;
            let boundary = (started.elapsed(), done.load(Ordering::Relaxed));
            let plan = crate::adversary::Plan {
                idle,
                watch_connections,
                // The agent's stream limit per connection: more are refused at once.
                watch_streams: 32,
                refs: refs.into_iter().take(10).collect(),
                oversized,
                verifiers,
                limit: half + Duration::from_secs(30),
            };
            let attack = crate::adversary::start(&socket, &plan).expect("the attack starts");
            let tenants = crate::tenant::Tenants::start(&socket, half, 200, tenants, &classic)
                .expect("the tenants start");
            (boundary, attack, tenants)
        })
    });
    let probe = args.adversarial.then(|| {
        let half = args.duration / 2;
        tokio::spawn(crate::tenant::probe(socket.to_owned(), half, deadline))
    });
    let mut clients = Vec::new();
    for c in 0..args.clients {
        let channel = credgate_api::connect(socket).await?;
        let budget = budget.clone();
        let done = done.clone();
        clients.push(tokio::spawn(async move {
            let mut creds = CredentialsClient::new(channel.clone());
            let mut guard = ImageAccessClient::new(channel);
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (c as u64 + 1));
            let mut lat: Vec<Vec<Duration>> = vec![Vec::new(); KINDS.len()];
            let mut errors = vec![0u64; KINDS.len()];
            while Instant::now() < deadline
                && budget
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| b.checked_sub(1))
                    .is_ok()
            {
                let roll = rng.next() % 100;
                let n = rng.next();
                let t = Instant::now();
                let (kind, ok) = match roll {
                    0..=59 => {
                        let image = format!("soak.test/app-{}:v1", n % 500);
                        let r = creds
                            .lookup(pb::LookupRequest {
                                image,
                                ..Default::default()
                            })
                            .await;
                        (0, r.is_ok())
                    }
                    60..=74 => {
                        let i = n % 200;
                        let r = guard
                            .check_access(pb::CheckAccessRequest {
                                image: format!("guard.soak.test/app-{i}:v1"),
                                image_ref: format!("sha256:{i:064x}"),
                                present: true,
                                pull_policy: 0,
                                credentials: vec![secret(n % 7)],
                            })
                            .await;
                        (1, r.is_ok())
                    }
                    75..=84 => {
                        let i = n % 200;
                        let image = format!("guard.soak.test/app-{i}:v1");
                        let a = guard
                            .record_pull_intent(pb::RecordPullIntentRequest {
                                image: image.clone(),
                            })
                            .await;
                        let b = guard
                            .record_pull_result(pb::RecordPullResultRequest {
                                image,
                                image_ref: format!("sha256:{i:064x}"),
                                success: true,
                                credential: Some(secret(i % 5)),
                            })
                            .await;
                        (2, a.is_ok() && b.is_ok())
                    }
                    _ => {
                        let image = format!("flaky.soak.test/app-{}:v1", n % 50);
                        let r = creds
                            .lookup(pb::LookupRequest {
                                image,
                                ..Default::default()
                            })
                            .await;
                        (3, r.is_ok())
                    }
                };
                lat[kind].push(t.elapsed());
                done.fetch_add(1, Ordering::Relaxed);
                if !ok {
                    errors[kind] += 1;
                }
            }
            (lat, errors)
        }));
    }
    let mut lat: Vec<Vec<Duration>> = vec![Vec::new(); KINDS.len()];
    let mut errors = vec![0u64; KINDS.len()];
    for c in clients {
        let (l, e) = c.await?;
        for k in 0..KINDS.len() {
            lat[k].extend(&l[k]);
            errors[k] += e[k];
        }
    }
    let elapsed = started.elapsed();
    let total_done = done.load(Ordering::Relaxed);
    let adversarial = match attack {
        Some(task) => {
            let ((at, before), attack, tenants) = task.await?;
            let counts = tokio::task::spawn_blocking(move || attack.stop()).await?;
            let tenants = tokio::task::spawn_blocking(move || tenants.finish()).await?;
            let probed = match probe {
                Some(p) => Some(p.await?),
                None => None,
            };
            let files = args.state_dir.as_deref().map(crate::tenant::state_files);
            let base_rate = before as f64 / at.as_secs_f64();
            let attacked_rate =
                (total_done - before) as f64 / (elapsed - at).as_secs_f64().max(1e-9);
            Some((
                at,
                base_rate,
                attacked_rate,
                counts,
                (tenants, probed, files),
            ))
        }
        None => None,
    };
    sampler.abort();
    watcher.abort();
    let status = credgate_api::v1::admin_client::AdminClient::new(channel)
        .status(pb::StatusRequest {})
        .await?
        .into_inner();
    let plugin_runs: u64 = status.providers.iter().map(|p| p.runs).sum();
    let providers: Vec<serde_json::Value> = status
        .providers
        .iter()
        .map(|p| json!({"name": p.name, "runs": p.runs, "errors": p.errors}))
        .collect();
    let mut samples = samples.lock().unwrap().clone();
    samples.push(sample(pid, started));
    let total: usize = lat.iter().map(Vec::len).sum();
    let per_kind: Vec<serde_json::Value> = KINDS
        .iter()
        .enumerate()
        .map(|(k, name)| {
            let v = &mut lat[k];
            let mut p = |q: f64| {
                if v.is_empty() {
                    0
                } else {
                    percentile(v, q).as_micros() as u64
                }
            };
            let (p50, p99, p999) = (p(0.50), p(0.99), p(0.999));
            json!({
                "call": name,
                "count": v.len(),
                "errors": errors[k],
                "p50_us": p50,
                "p99_us": p99,
                "p999_us": p999,
            })
        })
        .collect();
    let series: Vec<serde_json::Value> = samples
        .iter()
        .map(|s| json!({"t_s": s.at_s, "rss_kb": s.rss_kb, "fds": s.fds, "children": s.children}))
        .collect();
    let end = samples.last().copied().unwrap();
    let warm = samples
        .iter()
        .find(|s| s.at_s >= args.duration.as_secs() / 5)
        .copied()
        .unwrap_or(end);
    let adversarial = adversarial.map(|(at, base, attacked, counts, (tenants, probed, files))| {
        let [mut health, mut limited] = probed.unwrap_or_default();
        let during = |f: fn(&Sample) -> u64| {
            samples
                .iter()
                .filter(|s| s.at_s >= at.as_secs())
                .map(f)
                .max()
                .unwrap_or(0)
        };
        let before = |f: fn(&Sample) -> u64| {
            samples
                .iter()
                .filter(|s| s.at_s < at.as_secs())
                .map(f)
                .max()
                .unwrap_or(0)
        };
        json!({
            "started_at_s": at.as_secs_f64(),
            "mix_per_s_before": base,
            "mix_per_s_during": attacked,
            "throughput_ratio": attacked / base,
            "rss_kb_max_before": before(|s| s.rss_kb),
            "rss_kb_max_during": during(|s| s.rss_kb),
            "fds_max_before": before(|s| s.fds as u64),
            "fds_max_during": during(|s| s.fds as u64),
            "idle_connections_opened": counts.idle_opened.load(Ordering::Relaxed),
            "watch_connections_opened": counts.watch_connections_opened.load(Ordering::Relaxed),
            "oversized_requests": counts.oversized_sent.load(Ordering::Relaxed),
            "verify_calls": counts.verify_calls.load(Ordering::Relaxed),
            "token_bytes_served": counts.token_bytes_served.load(Ordering::Relaxed),
            "health_before": health[0].summary(),
            "health_during": health[1].summary(),
            "limited_lookup_before": limited[0].summary(),
            "limited_lookup_during": limited[1].summary(),
            "tenants": tenants,
            "state_files": files,
        })
    });
    let holds = adversarial.as_ref().map(|a| {
        let under = |name: &str, cap: &str| {
            a["state_files"][name].as_u64().unwrap_or(0)
                <= a["state_files"][cap].as_u64().unwrap_or(u64::MAX)
        };
        json!({
            "health_within_1s": a["health_during"]["failed"] == 0
                && a["health_during"]["max_ms"].as_f64().unwrap_or(f64::MAX) < 1000.0,
            "rate_limited_lookup_within_60s": a["limited_lookup_during"]["failed"] == 0
                && a["limited_lookup_during"]["ok"].as_u64().unwrap_or(0) > 0,
            "mix_without_errors": errors.iter().sum::<u64>() == 0,
            "cache_sealed_under_cap": under("cache_sealed", "cache_sealed_cap"),
            "rss_under_256_mib": a["rss_kb_max_during"].as_u64().unwrap_or(u64::MAX) < 256 << 10,
        })
    });
    let result = json!({
        "scenario": "soak",
        "holds": holds,
        "adversarial": adversarial,
        "seconds": elapsed.as_secs_f64(),
        "requests": total,
        "requests_per_s": total as f64 / elapsed.as_secs_f64(),
        "calls": per_kind,
        "watch_events": watched.load(Ordering::Relaxed),
        "plugin_runs": plugin_runs,
        "providers": providers,
        "rss_kb_after_warmup": warm.rss_kb,
        "rss_kb_end": end.rss_kb,
        "fds_after_warmup": warm.fds,
        "fds_end": end.fds,
        "children_end": end.children,
        "samples": series,
    });
    if args.output == crate::Format::Json {
        println!("{result}");
    } else {
        let mut text = format!(
            "soak: {total} requests in {:.0} s ({:.0}/s), {} plugin runs, {} watch events\n",
            elapsed.as_secs_f64(),
            total as f64 / elapsed.as_secs_f64(),
            plugin_runs,
            watched.load(Ordering::Relaxed)
        );
        for c in &per_kind {
            text.push_str(&format!(
                "  {:<13} {:>8} calls {:>5} errors  p50 {:>6} us  p99 {:>6} us  p99.9 {:>6} us\n",
                c["call"].as_str().unwrap(),
                c["count"],
                c["errors"],
                c["p50_us"],
                c["p99_us"],
                c["p999_us"]
            ));
        }
        for p in &providers {
            text.push_str(&format!(
                "  provider {:<8} {:>6} runs {:>5} failed\n",
                p["name"].as_str().unwrap_or_default(),
                p["runs"],
                p["errors"]
            ));
        }
        if let Some(a) = &result["adversarial"].as_object() {
            text.push_str(&format!(
                "  adversarial phase from {:.0} s: mix {:.0}/s before, {:.0}/s during (ratio {:.2}); RSS max {} kB before, {} kB during; fds max {} before, {} during\n  attack: {} idle connections opened, {} watch connections, {} oversized requests, {} verify calls, {} token bytes served\n",
                a["started_at_s"].as_f64().unwrap_or(0.0),
                a["mix_per_s_before"].as_f64().unwrap_or(0.0),
                a["mix_per_s_during"].as_f64().unwrap_or(0.0),
                a["throughput_ratio"].as_f64().unwrap_or(0.0),
                a["rss_kb_max_before"],
                a["rss_kb_max_during"],
                a["fds_max_before"],
                a["fds_max_during"],
                a["idle_connections_opened"],
                a["watch_connections_opened"],
                a["oversized_requests"],
                a["verify_calls"],
                a["token_bytes_served"],
            ));
            text.push_str(&format!(
                "  health (new connection) before {}, during {}\n  rate-limited lookup before {}, during {}\n  tenants: {}\n  state files: {}\n",
                a["health_before"],
                a["health_during"],
                a["limited_lookup_before"],
                a["limited_lookup_during"],
                a["tenants"],
                a["state_files"],
            ));
        }
        text.push_str("  agent RSS/fds/children over time:");
        for s in &samples {
            text.push_str(&format!(
                " [{}s {} kB {} fds {} ch]",
                s.at_s, s.rss_kb, s.fds, s.children
            ));
        }
        text.push('\n');
        if let Some(h) = &holds {
            text.push_str(&format!("  holds: {h}\n"));
        }
        print!("{text}");
    }
    if let Some(h) = &holds {
        anyhow::ensure!(
            h.as_object().is_some_and(|h| h.values().all(|v| v == true)),
            "a bound did not hold under the attack: {h}"
        );
    }
    Ok(())
}
