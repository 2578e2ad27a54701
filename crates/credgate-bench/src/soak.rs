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

/// Latencies and error counts per call of [`KINDS`].
type Tally = (Vec<Vec<Duration>>, Vec<u64>);

/// What the adversarial phase left: when it began, the mix's rate before and during it, and
/// what the attackers, tenants and root's probes saw.
struct Attacked {
    at: Duration,
    rate_before: f64,
    rate_during: f64,
    counts: Arc<crate::adversary::Counts>,
    tenants: Vec<serde_json::Value>,
    probed: Option<[[crate::probe::Phase; 2]; 2]>,
    files: Option<serde_json::Value>,
}

type AttackTask = tokio::task::JoinHandle<(
    (Duration, u64),
    crate::adversary::Attack,
    crate::tenant::Tenants,
)>;

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
    let watcher = watch(&mut creds, &tracked, watched.clone()).await?;
    let samples = Arc::new(Mutex::new(vec![sample(pid, started)]));
    let sampler = sampler(samples.clone(), pid, started, args.sample_every);

    let budget = Arc::new(AtomicU64::new(args.max_requests));
    let done = Arc::new(AtomicU64::new(0));
    // The adversarial phase: the second half of the run, beside the mix.
    let attack = args
        .adversarial
        .then(|| start_attack(args, socket, &tracked, started, done.clone()));
    let probe = args.adversarial.then(|| {
        let half = args.duration / 2;
        tokio::spawn(crate::tenant::probe(socket.to_owned(), half, deadline))
    });
    let mut clients = Vec::new();
    for c in 0..args.clients {
        let channel = credgate_api::connect(socket).await?;
        clients.push(tokio::spawn(mix(
            channel,
            c as u64,
            deadline,
            budget.clone(),
            done.clone(),
        )));
    }
    let (mut lat, errors) = gather(clients).await?;
    let elapsed = started.elapsed();
    let total_done = done.load(Ordering::Relaxed);
    let attacked = match attack {
        Some(task) => Some(end_attack(task, probe, args, elapsed, total_done).await?),
        None => None,
    };
    sampler.abort();
    watcher.abort();
    let status = credgate_api::v1::admin_client::AdminClient::new(channel)
        .status(pb::StatusRequest {})
        .await?
        .into_inner();
    let mut samples = samples.lock().unwrap().clone();
    samples.push(sample(pid, started));
    let adversarial = attacked.map(|a| a.report(&samples));
    let holds = adversarial.as_ref().map(|a| holds(a, &errors));
    let result = report(
        args,
        &status,
        (&mut lat, &errors),
        &samples,
        elapsed,
        watched.load(Ordering::Relaxed),
        (adversarial, holds.clone()),
    );
    if args.output == crate::Format::Json {
        println!("{result}");
    } else {
        print!("{}", text(&result, &samples));
    }
    if let Some(h) = &holds {
        anyhow::ensure!(
            h.as_object().is_some_and(|h| h.values().all(|v| v == true)),
            "a bound did not hold under the attack: {h}"
        );
    }
    Ok(())
}

/// A Watch of the first ten tracked refs, counting its events.
async fn watch(
    creds: &mut CredentialsClient<tonic::transport::Channel>,
    tracked: &[String],
    watched: Arc<AtomicU64>,
) -> Result<tokio::task::JoinHandle<()>> {
    let mut stream = creds
        .watch(pb::WatchRequest {
            refs: tracked.iter().take(10).cloned().collect(),
        })
        .await?
        .into_inner();
    Ok(tokio::spawn(async move {
        while let Some(Ok(_)) = stream.next().await {
            watched.fetch_add(1, Ordering::Relaxed);
        }
    }))
}

/// Samples the agent process every `every` into `samples`.
fn sampler(
    samples: Arc<Mutex<Vec<Sample>>>,
    pid: u32,
    started: Instant,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            samples.lock().unwrap().push(sample(pid, started));
        }
    })
}

/// Starts the attackers and tenants at half time, noting the time and the mix's count then.
fn start_attack(
    args: &Args,
    socket: &Path,
    tracked: &[String],
    started: Instant,
    done: Arc<AtomicU64>,
) -> AttackTask {
    let socket = socket.to_owned();
    let refs: Vec<String> = tracked.iter().take(10).cloned().collect();
    let half = args.duration / 2;
    let on = |part: &str| args.attack.iter().any(|a| a == part);
    let tenants = on("tenants");
    // As root, the local user's attacks run as another uid too: root's own connections
    // are the ones the agent keeps room for. Not root, they run here, as the same uid.
    let as_root = crate::tenant::own_uid() == 0;
    let here = |part: &str, n: usize| if on(part) && !as_root { n } else { 0 };
    let plan = crate::adversary::Plan {
        idle: here("idle", args.idle_connections),
        watch_connections: here("watch", 10),
        // The agent's stream limit per connection: more are refused at once.
        watch_streams: 32,
        refs,
        oversized: here("oversized", 2),
        verifiers: here("verify", 2),
        limit: half + Duration::from_secs(30),
    };
    let classic: Vec<&'static str> = ["idle", "watch", "oversized", "verify"]
        .into_iter()
        .filter(|p| on(p) && as_root)
        .collect();
    tokio::spawn(async move {
        tokio::time::sleep(half).await;
        let boundary = (started.elapsed(), done.load(Ordering::Relaxed));
        let attack = crate::adversary::start(&socket, &plan).expect("the attack starts");
        let tenants = crate::tenant::Tenants::start(&socket, half, 200, tenants, &classic)
            .expect("the tenants start");
        (boundary, attack, tenants)
    })
}

/// Stops the attack and gathers what it, the tenants and the probes saw.
async fn end_attack(
    task: AttackTask,
    probe: Option<tokio::task::JoinHandle<[[crate::probe::Phase; 2]; 2]>>,
    args: &Args,
    elapsed: Duration,
    total_done: u64,
) -> Result<Attacked> {
    let ((at, before), attack, tenants) = task.await?;
    let counts = tokio::task::spawn_blocking(move || attack.stop()).await?;
    let tenants = tokio::task::spawn_blocking(move || tenants.finish()).await?;
    let probed = match probe {
        Some(p) => Some(p.await?),
        None => None,
    };
    Ok(Attacked {
        at,
        rate_before: before as f64 / at.as_secs_f64(),
        rate_during: (total_done - before) as f64 / (elapsed - at).as_secs_f64().max(1e-9),
        counts,
        tenants,
        probed,
        files: args.state_dir.as_deref().map(crate::tenant::state_files),
    })
}

/// One client of the mix: 60% lookups, 15% guard checks, 10% pull recordings, 15% lookups of
/// a flaky provider, until the deadline or the shared budget runs out.
async fn mix(
    channel: tonic::transport::Channel,
    client: u64,
    deadline: Instant,
    budget: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
) -> Tally {
    let mut creds = CredentialsClient::new(channel.clone());
    let mut guard = ImageAccessClient::new(channel);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (client + 1));
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
        let (kind, ok) = one_call(&mut creds, &mut guard, roll, n).await;
        lat[kind].push(t.elapsed());
        done.fetch_add(1, Ordering::Relaxed);
        if !ok {
            errors[kind] += 1;
        }
    }
    (lat, errors)
}

/// One call of the mix, by its roll: which of [`KINDS`] it was, and whether it succeeded.
async fn one_call(
    creds: &mut CredentialsClient<tonic::transport::Channel>,
    guard: &mut ImageAccessClient<tonic::transport::Channel>,
    roll: u64,
    n: u64,
) -> (usize, bool) {
    match roll {
        0..=59 => (
            0,
            lookup(creds, format!("soak.test/app-{}:v1", n % 500)).await,
        ),
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
        _ => (
            3,
            lookup(creds, format!("flaky.soak.test/app-{}:v1", n % 50)).await,
        ),
    }
}

/// A Lookup of `image`: whether it succeeded.
async fn lookup(creds: &mut CredentialsClient<tonic::transport::Channel>, image: String) -> bool {
    creds
        .lookup(pb::LookupRequest {
            image,
            ..Default::default()
        })
        .await
        .is_ok()
}

/// The clients' tallies, summed.
async fn gather(clients: Vec<tokio::task::JoinHandle<Tally>>) -> Result<Tally> {
    let mut lat: Vec<Vec<Duration>> = vec![Vec::new(); KINDS.len()];
    let mut errors = vec![0u64; KINDS.len()];
    for c in clients {
        let (l, e) = c.await?;
        for k in 0..KINDS.len() {
            lat[k].extend(&l[k]);
            errors[k] += e[k];
        }
    }
    Ok((lat, errors))
}

impl Attacked {
    /// The phase's figures, with the agent's peaks before and during it.
    fn report(self, samples: &[Sample]) -> serde_json::Value {
        let at = self.at.as_secs();
        let [mut health, mut limited] = self.probed.unwrap_or_default();
        let peak = |during: bool, f: fn(&Sample) -> u64| {
            samples
                .iter()
                .filter(|s| (s.at_s >= at) == during)
                .map(f)
                .max()
                .unwrap_or(0)
        };
        let c = &self.counts;
        json!({
            "started_at_s": self.at.as_secs_f64(),
            "mix_per_s_before": self.rate_before,
            "mix_per_s_during": self.rate_during,
            "throughput_ratio": self.rate_during / self.rate_before,
            "rss_kb_max_before": peak(false, |s| s.rss_kb),
            "rss_kb_max_during": peak(true, |s| s.rss_kb),
            "fds_max_before": peak(false, |s| s.fds as u64),
            "fds_max_during": peak(true, |s| s.fds as u64),
            "idle_connections_opened": c.idle_opened.load(Ordering::Relaxed),
            "watch_connections_opened": c.watch_connections_opened.load(Ordering::Relaxed),
            "oversized_requests": c.oversized_sent.load(Ordering::Relaxed),
            "verify_calls": c.verify_calls.load(Ordering::Relaxed),
            "token_bytes_served": c.token_bytes_served.load(Ordering::Relaxed),
            "health_before": health[0].summary(),
            "health_during": health[1].summary(),
            "limited_lookup_before": limited[0].summary(),
            "limited_lookup_during": limited[1].summary(),
            "tenants": self.tenants,
            "state_files": self.files,
        })
    }
}

/// The bounds the adversarial phase must hold.
fn holds(a: &serde_json::Value, errors: &[u64]) -> serde_json::Value {
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
}

/// The run's result: the mix per call, plugin runs, the agent's samples and the adversarial
/// phase with the bounds it held.
fn report(
    args: &Args,
    status: &pb::StatusResponse,
    (lat, errors): (&mut [Vec<Duration>], &[u64]),
    samples: &[Sample],
    elapsed: Duration,
    watch_events: u64,
    (adversarial, holds): (Option<serde_json::Value>, Option<serde_json::Value>),
) -> serde_json::Value {
    let plugin_runs: u64 = status.providers.iter().map(|p| p.runs).sum();
    let providers: Vec<serde_json::Value> = status
        .providers
        .iter()
        .map(|p| json!({"name": p.name, "runs": p.runs, "errors": p.errors}))
        .collect();
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
    json!({
        "scenario": "soak",
        "holds": holds,
        "adversarial": adversarial,
        "seconds": elapsed.as_secs_f64(),
        "requests": total,
        "requests_per_s": total as f64 / elapsed.as_secs_f64(),
        "calls": per_kind,
        "watch_events": watch_events,
        "plugin_runs": plugin_runs,
        "providers": providers,
        "rss_kb_after_warmup": warm.rss_kb,
        "rss_kb_end": end.rss_kb,
        "fds_after_warmup": warm.fds,
        "fds_end": end.fds,
        "children_end": end.children,
        "samples": series,
    })
}

/// The result for a person.
fn text(result: &serde_json::Value, samples: &[Sample]) -> String {
    let r = result;
    let mut text = format!(
        "soak: {} requests in {:.0} s ({:.0}/s), {} plugin runs, {} watch events\n",
        r["requests"],
        r["seconds"].as_f64().unwrap_or(0.0),
        r["requests_per_s"].as_f64().unwrap_or(0.0),
        r["plugin_runs"],
        r["watch_events"]
    );
    for c in r["calls"].as_array().into_iter().flatten() {
        text.push_str(&format!(
            "  {:<13} {:>8} calls {:>5} errors  p50 {:>6} us  p99 {:>6} us  p99.9 {:>6} us\n",
            c["call"].as_str().unwrap_or_default(),
            c["count"],
            c["errors"],
            c["p50_us"],
            c["p99_us"],
            c["p999_us"]
        ));
    }
    for p in r["providers"].as_array().into_iter().flatten() {
        text.push_str(&format!(
            "  provider {:<8} {:>6} runs {:>5} failed\n",
            p["name"].as_str().unwrap_or_default(),
            p["runs"],
            p["errors"]
        ));
    }
    if let Some(a) = r["adversarial"].as_object() {
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
    for s in samples {
        text.push_str(&format!(
            " [{}s {} kB {} fds {} ch]",
            s.at_s, s.rss_kb, s.fds, s.children
        ));
    }
    text.push('\n');
    if !r["holds"].is_null() {
        text.push_str(&format!("  holds: {}\n", r["holds"]));
    }
    text
}
