//! `credgate-bench`: the benchmarks BENCHMARKS.md cites. The engine's scenarios drive the
//! credgate engine (not the CLI) with any provider config and plugin directory, and report
//! plugin runs from the engine's own counters.
//!
//! Scenarios (`credgate-bench --help` lists each): of the engine, `hit` (warm-cache lookups
//! from G threads), `burst` (K concurrent cold lookups), `miss` (sequential lookups that each
//! run the plugin) and `rawexec` (the plugin spawned with no credgate code around it: the
//! floor for `miss`); over the agent's socket `rpc-hit`, `helper` and `bridge` (see
//! [`agent`]); beside containerd `cri-proxy`, `cri-soak` and `rotation` (see [`cri`],
//! [`cri_soak`], [`rotation`]); of the guard `guard-check`, `guard-record` and `guard-open`
//! (see [`guard`]); and `rollout`, `soak`, `renewal-scale` and `capture-burst`, each in the
//! module of its name.

mod adversary;
mod agent;
mod capture_burst;
mod cri;
mod cri_soak;
mod guard;
mod hostile_registry;
mod probe;
mod renewal_scale;
mod rollout;
mod rotation;
mod soak;
mod tenant;

use std::future::Future;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use clap::{Parser, ValueEnum};
use credgate_core::config::ProviderSpec;
use credgate_core::reference::ImageRef;
use credgate_core::wire;
use credgate_engine::source::load_provider_config;
use credgate_engine::{Engine, EngineOptions, LookupRequest};
use serde_json::{json, Value};

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Scenario {
    Hit,
    Burst,
    Miss,
    Rawexec,
    RpcHit,
    Helper,
    /// credgate-credential-provider (the kubelet bridge) beside a do-nothing run, and a burst
    /// of 100 bridge processes for 100 images of one registry.
    Bridge,
    /// The CRI image-service proxy beside containerd called straight: ImageStatus p50/p99
    /// and PullImage of a small image (needs root, containerd, docker-registry, skopeo).
    CriProxy,
    /// The CRI proxy under a hostile caller while a kubelet pulls through it (needs root,
    /// containerd, docker-registry, skopeo).
    CriSoak,
    /// A fleet-wide restart: -n agents restarted in --reps waves, plugin runs per wave and
    /// the time to a first answer, with and without the sealed provider cache.
    Rollout,
    /// From a credential rotation to the first successful pull through the CRI proxy, with a
    /// kubelet-like client caching the bridge's answers: failed pulls and extra plugin runs
    /// per rotation, time to recovery (needs root, containerd, docker-registry, skopeo).
    Rotation,
    GuardCheck,
    GuardRecord,
    GuardOpen,
    /// A long realistic mix against a running agent (see scripts/soak).
    Soak,
    /// What a wake of the renewal loop costs with -n refs tracked (--reps wakes).
    RenewalScale,
    /// What -n captures write to a 12 MB captured.sealed, one at a time and 32 at once.
    CaptureBurst,
    #[value(hide = true)]
    GuardPopulate,
    /// One hostile tenant of a soak's agent (internal; see tenant.rs).
    #[value(hide = true)]
    Tenant,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Format {
    Text,
    Json,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum BurstMode {
    Distinct,
    Same,
    Both,
}

#[derive(Parser, Clone)]
#[command(
    name = "credgate-bench",
    version,
    about = "Benchmarks of the credgate engine and agent"
)]
pub struct Args {
    scenario: Scenario,
    #[arg(long, default_value = "bench/hit.yaml")]
    image_credential_provider_config: PathBuf,
    /// Defaults to the directory of this program (where cargo builds credgate-static-plugin).
    #[arg(long)]
    image_credential_provider_bin_dir: Option<PathBuf>,
    #[arg(long, default_value = "registry.example.com/team/app-0:v1")]
    image: String,
    /// `{i}` is replaced by the request's index (burst).
    #[arg(long, default_value = "registry.example.com/team/app-{i}:v1")]
    image_template: String,
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    threads: Vec<usize>,
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    duration: Duration,
    #[arg(short = 'k', default_value_t = 100)]
    k: usize,
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[arg(short = 'n', default_value_t = 200)]
    n: usize,
    #[arg(long, value_enum, default_value_t = BurstMode::Both)]
    mode: BurstMode,
    /// The provider whose plugin `rawexec` spawns (default: the first).
    #[arg(long)]
    plugin: Option<String>,
    #[arg(short = 'o', long, value_enum, default_value_t = Format::Text)]
    output: Format,
    /// Concurrent clients (rpc-hit), one connection each.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// The docker credential helper binary (helper); default: beside this program.
    #[arg(long)]
    helper: Option<PathBuf>,
    /// The kubelet bridge binary (bridge); default: beside this program. The static build
    /// (`cargo build-bridge`) is at target/static/release/credgate-credential-provider.
    #[arg(long)]
    bridge: Option<PathBuf>,
    /// Records in the guard's store (guard-check, guard-open).
    #[arg(long, default_value_t = 100_000)]
    records: usize,
    /// The state directory to fill (guard-populate, internal); the agent's (soak: its files'
    /// sizes are reported).
    #[arg(long, hide = true)]
    state_dir: Option<PathBuf>,
    /// The agent's socket (soak; helper: a running agent instead of one in this process).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// The agent's pid, sampled from /proc (soak).
    #[arg(long)]
    agent_pid: Option<u32>,
    /// Refs tracked for renewal (soak).
    #[arg(long, default_value_t = 100)]
    tracked: usize,
    /// Stop after this many requests even before --duration (soak).
    #[arg(long, default_value_t = 5_000_000)]
    max_requests: u64,
    /// Soak in two halves: the mix alone, then the mix beside a hostile local client (idle
    /// connections, oversized requests, non-reading watches, an endless token endpoint).
    #[arg(long)]
    adversarial: bool,
    /// The parts of the adversarial phase to run (idle, watch, oversized, verify, tenants;
    /// a tenant's own: pings, tracked, rate, names).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "idle,watch,oversized,verify,tenants"
    )]
    attack: Vec<String>,
    /// Silent connections the adversarial phase holds open.
    #[arg(long, default_value_t = 400)]
    idle_connections: usize,
    /// How often the agent's RSS, descriptors and children are sampled (soak).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    sample_every: Duration,
    /// How long after the registry the provider's backend learns a rotated password
    /// (rotation; 0: at once). With a lag the kubelet-like client retries once a second.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    backend_lag: Duration,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    credgate_core::duration::GoDuration::parse(s)
        .map_err(|e| e.to_string())?
        .to_std()
        .ok_or_else(|| "negative duration".to_owned())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    match args.scenario {
        Scenario::Hit => hit(&args, &rt),
        Scenario::Burst => burst(&args, &rt),
        Scenario::Miss => miss(&args, &rt),
        Scenario::Rawexec => rawexec(&args),
        Scenario::RpcHit => agent::rpc_hit(&args),
        Scenario::Helper => agent::helper(&args),
        Scenario::Bridge => agent::bridge(&args),
        Scenario::CriProxy => cri::cri_proxy(&args),
        Scenario::CriSoak => cri_soak::cri_soak(&args),
        Scenario::Rollout => rollout::rollout(&args),
        Scenario::Rotation => rotation::rotation(&args),
        Scenario::GuardCheck => guard::check(&args),
        Scenario::GuardRecord => guard::record(&args),
        Scenario::GuardOpen => guard::open(&args),
        Scenario::GuardPopulate => guard::populate_cmd(&args),
        Scenario::Soak => soak::soak(&args),
        Scenario::RenewalScale => renewal_scale::renewal_scale(&args),
        Scenario::CaptureBurst => capture_burst::capture_burst(&args),
        Scenario::Tenant => tenant::tenant(&args),
    }
}

/// One provider whose plugin is a shell script: `script` (after `#!/bin/sh`) as
/// `dir/plugins/NAME`, and `dir/providers.yaml` matching `pattern` with `default_cache`.
/// Returns (the plugin directory, the config).
pub(crate) fn shell_provider(
    dir: &std::path::Path,
    name: &str,
    script: &str,
    pattern: &str,
    default_cache: &str,
) -> Result<(PathBuf, PathBuf)> {
    use std::os::unix::fs::PermissionsExt as _;
    let bin = dir.join("plugins");
    std::fs::create_dir_all(&bin)?;
    let plugin = bin.join(name);
    std::fs::write(&plugin, format!("#!/bin/sh\n{script}"))?;
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755))?;
    let config = dir.join("providers.yaml");
    std::fs::write(
        &config,
        format!("apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: {name}\n  matchImages: [\"{pattern}\"]\n  defaultCacheDuration: {default_cache}\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n"),
    )?;
    Ok((bin, config))
}

/// A scenario's directory under the temp dir (`credgate-bench-TAG-PID`), made empty and
/// removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> Result<TempDir> {
        let dir = std::env::temp_dir().join(format!("credgate-bench-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A program built beside this one (`credgate`, the bridge), which must exist.
pub fn sibling(name: &str) -> Result<PathBuf> {
    let path = std::env::current_exe()?
        .parent()
        .context("program has a directory")?
        .join(name);
    anyhow::ensure!(
        path.is_file(),
        "{} not found: build it first (cargo build --release --bins)",
        path.display()
    );
    Ok(path)
}

pub fn bin_dir(args: &Args) -> Result<PathBuf> {
    match &args.image_credential_provider_bin_dir {
        Some(d) => Ok(d.clone()),
        None => Ok(std::env::current_exe()?
            .parent()
            .context("program has a directory")?
            .to_owned()),
    }
}

fn engine(args: &Args) -> Result<Engine> {
    let config = load_provider_config(&args.image_credential_provider_config)?;
    let options = EngineOptions {
        plugin_dir: bin_dir(args)?,
        ..Default::default()
    };
    Ok(Engine::builder().config(config).options(options).build()?)
}

pub fn emit(args: &Args, v: Value) {
    match args.output {
        Format::Json => println!("{v}"),
        Format::Text => {
            let obj = v.as_object().expect("results are objects");
            let parts: Vec<String> = obj.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!("{}", parts.join(" "));
        }
    }
}

/// Polls a future that is expected to complete without waiting (a cache hit) on this thread;
/// falls back to the runtime when it does wait.
fn poll_now<F: Future>(rt: &tokio::runtime::Runtime, fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => rt.block_on(fut),
    }
}

fn hit(args: &Args, rt: &tokio::runtime::Runtime) -> Result<()> {
    let engine = engine(args)?;
    let req = LookupRequest {
        image: &args.image,
        ..Default::default()
    };
    let first = rt.block_on(engine.lookup(&req))?;
    ensure!(
        first.errors.is_empty(),
        "first lookup failed: {}",
        first.errors[0]
    );
    ensure!(
        !first.credentials.is_empty(),
        "the plugin gave no credentials for {}",
        args.image
    );
    for api in ["cached", "owned"] {
        for &threads in &args.threads {
            let (ops, wall) = hit_run(&engine, rt, &req, threads, args.duration, api == "cached");
            emit(
                args,
                json!({
                    "scenario": "hit", "api": api, "threads": threads,
                    "ops_per_s": (ops as f64 / wall.as_secs_f64()).round(),
                    "ns_per_op": ((wall.as_nanos() as f64 / ops as f64) * 10.0).round() / 10.0,
                    "runs": engine.total_runs(),
                }),
            );
        }
    }
    ensure!(
        engine.total_runs() == 1,
        "expected exactly one plugin run, saw {}",
        engine.total_runs()
    );
    Ok(())
}

fn hit_run(
    engine: &Engine,
    rt: &tokio::runtime::Runtime,
    req: &LookupRequest<'_>,
    threads: usize,
    duration: Duration,
    cached: bool,
) -> (u64, Duration) {
    let measuring = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    let one = || -> usize {
        if cached {
            engine
                .lookup_cached(req, |c| c.len())
                .ok()
                .flatten()
                .unwrap_or(0)
        } else {
            poll_now(rt, engine.lookup(req))
                .map(|l| l.credentials.len())
                .unwrap_or(0)
        }
    };
    let mut wall = Duration::ZERO;
    let total: u64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut n = 0u64;
                    while !measuring.load(Ordering::Relaxed) {
                        std::hint::black_box(one());
                    }
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::black_box(one());
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        measuring.store(true, Ordering::Relaxed);
        std::thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
        wall = started.elapsed();
        workers.into_iter().map(|w| w.join().expect("worker")).sum()
    });
    (total, wall)
}

fn burst(args: &Args, rt: &tokio::runtime::Runtime) -> Result<()> {
    let modes: &[&str] = match args.mode {
        BurstMode::Distinct => &["distinct"],
        BurstMode::Same => &["same"],
        BurstMode::Both => &["distinct", "same"],
    };
    for mode in modes {
        for rep in 1..=args.reps {
            let engine = engine(args)?;
            let images: Vec<String> = (0..args.k)
                .map(|i| {
                    args.image_template
                        .replace("{i}", &if *mode == "same" { 0 } else { i }.to_string())
                })
                .collect();
            let barrier = Arc::new(tokio::sync::Barrier::new(args.k));
            let started = Instant::now();
            let errors = rt.block_on(async {
                let tasks: Vec<_> = images
                    .into_iter()
                    .map(|image| {
                        let (engine, barrier) = (engine.clone(), barrier.clone());
                        tokio::spawn(async move {
                            barrier.wait().await;
                            let req = LookupRequest {
                                image: &image,
                                ..Default::default()
                            };
                            engine
                                .lookup(&req)
                                .await
                                .map(|l| l.errors.len())
                                .unwrap_or(1)
                        })
                    })
                    .collect();
                let mut errors = 0;
                for t in tasks {
                    errors += t.await.unwrap_or(1);
                }
                errors
            });
            let wall = started.elapsed();
            emit(
                args,
                json!({
                    "scenario": "burst", "mode": mode, "rep": rep, "k": args.k,
                    "runs": engine.total_runs(), "errors": errors,
                    "wall_ms": (wall.as_secs_f64() * 1e4).round() / 10.0,
                }),
            );
        }
    }
    Ok(())
}

/// The resident set of a process (`self` or a pid), in KiB, from /proc; 0 when unreadable.
pub fn rss_kib(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Milliseconds, to the microsecond.
pub(crate) fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// The `p` quantile (nearest rank) of `samples`, which it sorts.
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    samples[((samples.len() as f64 * p).ceil() as usize)
        .saturating_sub(1)
        .min(samples.len() - 1)]
}

fn stats(args: &Args, scenario: &str, mut samples: Vec<Duration>, runs: u64) {
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    let n = samples.len();
    let mut pct = |p: f64| percentile(&mut samples, p);
    emit(
        args,
        json!({
            "scenario": scenario, "n": n, "runs": runs,
            "mean_ms": ms(mean), "p50_ms": ms(pct(0.50)), "p99_ms": ms(pct(0.99)),
        }),
    );
}

fn miss(args: &Args, rt: &tokio::runtime::Runtime) -> Result<()> {
    let engine = engine(args)?;
    let req = LookupRequest {
        image: &args.image,
        ..Default::default()
    };
    let samples = rt.block_on(async {
        let mut samples = Vec::with_capacity(args.n);
        for i in 0..10 + args.n {
            let started = Instant::now();
            let got = engine.lookup(&req).await?;
            let took = started.elapsed();
            ensure!(got.errors.is_empty(), "lookup failed: {}", got.errors[0]);
            if i >= 10 {
                samples.push(took);
            }
        }
        Ok(samples)
    })?;
    let runs = engine.total_runs();
    ensure!(
        runs as usize == 10 + args.n,
        "every lookup must run the plugin (cacheDuration 0s); saw {runs} runs"
    );
    stats(args, "miss", samples, runs);
    Ok(())
}

fn rawexec(args: &Args) -> Result<()> {
    let config = load_provider_config(&args.image_credential_provider_config)?;
    let spec: &ProviderSpec = match &args.plugin {
        Some(name) => config
            .providers
            .iter()
            .find(|p| &p.name == name)
            .context("no such provider")?,
        None => config
            .providers
            .first()
            .context("config has no providers")?,
    };
    let image = ImageRef::parse(&args.image)?;
    let request = wire::Request {
        api_version: spec.api_version,
        image: image.name(),
        service_account_token: None,
        service_account_annotations: None,
    }
    .encode();
    let path = bin_dir(args)?.join(&spec.name);
    let mut samples = Vec::with_capacity(args.n);
    for i in 0..10 + args.n {
        let started = Instant::now();
        let mut child = Command::new(&path)
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run {}", path.display()))?;
        child.stdin.take().context("stdin")?.write_all(&request)?;
        let out = child.wait_with_output()?;
        let took = started.elapsed();
        if !out.status.success() || out.stdout.is_empty() {
            bail!("plugin failed: {}", out.status);
        }
        if i >= 10 {
            samples.push(took);
        }
    }
    stats(args, "rawexec", samples, (10 + args.n) as u64);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_is_answered() {
        let e = match Args::try_parse_from(["credgate-bench", "--version"]) {
            Err(e) => e,
            Ok(_) => panic!("--version is not a scenario"),
        };
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayVersion);
    }
}
