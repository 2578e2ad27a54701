//! Scenarios over the agent's socket: `rpc-hit` (G clients doing `Lookup` on a warm entry,
//! beside `Ping`, the transport's floor), `helper` (runs of `docker-credential-credgate get`
//! against a warm agent, beside runs of the same binary doing nothing) and `bridge` (runs of
//! the kubelet bridge, likewise, and a burst of them on a cold agent).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use credgate_agent::socket::{self, SocketAccess};
use credgate_agent::{server, Agent, AgentOptions, Sources};
use credgate_api::v1::admin_client::AdminClient;
use credgate_api::v1::credentials_client::CredentialsClient;
use credgate_api::v1::{LookupRequest, PingRequest};
use serde_json::json;

use crate::{bin_dir, emit, ms, percentile, Args, TempDir};

/// An agent served in this process, on its own runtime, on a socket in a temporary directory.
pub struct Served {
    pub socket: PathBuf,
    pub agent: Agent,
    _runtime: tokio::runtime::Runtime,
    _dir: TempDir,
}

pub fn serve(args: &Args) -> Result<Served> {
    let dir = TempDir::new("serve")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let agent = Agent::new(AgentOptions {
        sources: Sources {
            provider_config: Some(args.image_credential_provider_config.clone()),
            bin_dir: Some(bin_dir(args)?),
            ..Default::default()
        },
        ..Default::default()
    })?;
    let socket = dir.0.join("credgate.sock");
    let listener = runtime.block_on(socket::bind(&socket, &SocketAccess::default()))?;
    let stop = agent.tasks().token().clone();
    runtime.spawn(server::serve(agent.clone(), listener, stop));
    Ok(Served {
        socket,
        agent,
        _runtime: runtime,
        _dir: dir,
    })
}

#[derive(Clone, Copy)]
enum Call {
    Lookup,
    Ping,
}

/// G client tasks, one connection each, calling for `duration`; returns (ops/s, latencies).
fn drive(args: &Args, socket: &Path, call: Call, image: &str) -> Result<(f64, Vec<Duration>)> {
    let clients = args.clients;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let image = Arc::<str>::from(image);
    rt.block_on(async {
        let mut channels = Vec::new();
        for _ in 0..clients {
            channels.push(credgate_api::connect(socket).await?);
        }
        let deadline = Instant::now() + args.duration;
        let mut tasks = Vec::new();
        for channel in channels {
            let image = image.clone();
            tasks.push(tokio::spawn(async move {
                let mut creds = CredentialsClient::new(channel.clone());
                let mut admin = AdminClient::new(channel);
                let mut samples = Vec::with_capacity(100_000);
                while Instant::now() < deadline {
                    let started = Instant::now();
                    match call {
                        Call::Lookup => {
                            let r = creds
                                .lookup(LookupRequest {
                                    image: image.to_string(),
                                    ..Default::default()
                                })
                                .await?
                                .into_inner();
                            anyhow::ensure!(r.credentials.len() == 1, "no credential");
                        }
                        Call::Ping => {
                            admin.ping(PingRequest {}).await?;
                        }
                    }
                    samples.push(started.elapsed());
                }
                anyhow::Ok(samples)
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await??);
        }
        let ops = all.len() as f64 / args.duration.as_secs_f64();
        Ok((ops, all))
    })
}

pub fn rpc_hit(args: &Args) -> Result<()> {
    let served = serve(args)?;
    // Warm the entry.
    let (_, warm) = drive(
        &Args {
            duration: Duration::from_millis(200),
            ..args.clone()
        },
        &served.socket,
        Call::Lookup,
        &args.image,
    )?;
    ensure!(!warm.is_empty(), "warm-up made no calls");
    let runs_before = served.agent.engine().total_runs();
    let mut rows = Vec::new();
    for rep in 0..args.reps {
        let (ping_ops, mut ping) = drive(args, &served.socket, Call::Ping, &args.image)?;
        let (hit_ops, mut hit) = drive(args, &served.socket, Call::Lookup, &args.image)?;
        let us = |d: Duration| (d.as_secs_f64() * 1e7).round() / 10.0;
        let row = json!({
            "scenario": "rpc-hit", "rep": rep, "clients": args.clients,
            "ping_ops_per_s": ping_ops.round(), "lookup_ops_per_s": hit_ops.round(),
            "ping_p50_us": us(percentile(&mut ping, 0.50)), "ping_p99_us": us(percentile(&mut ping, 0.99)),
            "lookup_p50_us": us(percentile(&mut hit, 0.50)), "lookup_p99_us": us(percentile(&mut hit, 0.99)),
            "throughput_ratio": (ping_ops / hit_ops * 1000.0).round() / 1000.0,
        });
        rows.push(row.clone());
        emit(args, row);
    }
    let runs = served.agent.engine().total_runs() - runs_before;
    ensure!(runs == 0, "warm lookups ran the plugin {runs} times");
    Ok(())
}

/// A process, `stdin` written to it, timed to its exit; its stdout when it succeeded.
fn timed(cmd: &mut Command, stdin: &[u8]) -> Result<(Duration, Vec<u8>)> {
    let started = Instant::now();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child.stdin.take().context("stdin")?.write_all(stdin)?;
    let out = child.wait_with_output()?;
    let took = started.elapsed();
    ensure!(
        out.status.success(),
        "{:?} failed: {}",
        cmd.get_program(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((took, out.stdout))
}

/// A static C plugin, built with gcc in a temporary directory (removed when the first is
/// dropped); `None` without gcc.
fn c_plugin() -> Result<Option<(TempDir, PathBuf)>> {
    let dir = TempDir::new("c")?;
    let src = dir.0.join("plugin.c");
    std::fs::write(
        &src,
        r#"#include <stdio.h>
#include <unistd.h>
int main(void) {
    char buf[4096];
    while (read(0, buf, sizeof buf) > 0) {}
    fputs("{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"1h\",\"auth\":{\"registry.example.com\":{\"username\":\"u\",\"password\":\"p\"}}}", stdout);
    return 0;
}
"#,
    )?;
    let bin = dir.0.join("plugin");
    match Command::new("gcc")
        .args(["-O2", "-static", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
    {
        Ok(s) if s.success() => Ok(Some((dir, bin))),
        _ => Ok(None),
    }
}

fn kubelet_request(image: &str) -> Vec<u8> {
    format!(r#"{{"kind":"CredentialProviderRequest","apiVersion":"credentialprovider.kubelet.k8s.io/v1","image":"{image}"}}"#).into_bytes()
}

/// `credgate-credential-provider`: one exec against the warm agent beside a do-nothing run of
/// the same binary; then, on a cold agent, 100 bridge processes at once for 100 images of one
/// registry beside 100 do-nothing processes at once.
pub fn bridge(args: &Args) -> Result<()> {
    let bridge = match &args.bridge {
        Some(path) => {
            ensure!(path.is_file(), "{} not found", path.display());
            path.clone()
        }
        None => crate::sibling("credgate-credential-provider")?,
    };
    let e50 = bridge_exec(args, &bridge)?;
    bridge_burst(args, &bridge, e50)
}

/// The provider the bridge asks for: the agent's static test plugin.
const BRIDGE_PROVIDER: &str = "credgate-static-plugin";

/// One exec of the bridge against a warm agent, beside a do-nothing run of the same binary and
/// a minimal C plugin; returns the bridge's median.
fn bridge_exec(args: &Args, bridge: &Path) -> Result<Duration> {
    let run = |socket: &Path, image: &str| {
        timed(
            Command::new(bridge)
                .args(["--provider", BRIDGE_PROVIDER])
                .env("CREDGATE_SOCKET", socket),
            &kubelet_request(image),
        )
    };
    let nothing = || timed(Command::new(bridge).arg("--version"), b"");
    // A plugin as small as one gets: C, statically linked, reading the request and printing a
    // fixed answer (compiled here with gcc; without gcc the comparison is left out).
    let c_plugin = c_plugin()?;
    let served = serve(args)?;
    let mut exec = Vec::with_capacity(args.n);
    let mut idle = Vec::with_capacity(args.n);
    let mut c_runs = Vec::with_capacity(args.n);
    for i in 0..10 + args.n {
        let (b, out) = run(&served.socket, &args.image)?;
        let answer: serde_json::Value = serde_json::from_slice(&out)?;
        ensure!(
            answer["auth"].as_object().is_some_and(|a| !a.is_empty()),
            "the bridge answered no credential"
        );
        let (n, _) = nothing()?;
        let c = match &c_plugin {
            Some((_, path)) => {
                Some(timed(&mut Command::new(path), &kubelet_request(&args.image))?.0)
            }
            None => None,
        };
        if i >= 10 {
            exec.push(b);
            idle.push(n);
            c_runs.extend(c);
        }
    }
    let (e50, n50) = (percentile(&mut exec, 0.5), percentile(&mut idle, 0.5));
    let c50 = (!c_runs.is_empty()).then(|| percentile(&mut c_runs, 0.5));
    let size = std::fs::metadata(bridge).map_or(0, |m| m.len());
    emit(
        args,
        json!({
            "scenario": "bridge", "part": "exec", "n": args.n,
            "bridge_p50_ms": ms(e50), "bridge_p99_ms": ms(percentile(&mut exec, 0.99)),
            "nothing_p50_ms": ms(n50), "nothing_p99_ms": ms(percentile(&mut idle, 0.99)),
            "p50_ratio": ((e50.as_secs_f64() / n50.as_secs_f64()) * 1000.0).round() / 1000.0,
            "c_plugin_p50_ms": c50.map(ms),
            "ratio_to_c_plugin": c50.map(|c| ((e50.as_secs_f64() / c.as_secs_f64()) * 1000.0).round() / 1000.0),
            "bridge_bytes": size,
        }),
    );
    Ok(e50)
}

/// On a cold agent each time, 100 bridge processes at once for 100 images of one registry,
/// beside 100 do-nothing processes at once.
fn bridge_burst(args: &Args, bridge: &Path, e50: Duration) -> Result<()> {
    for rep in 0..args.reps {
        let cold = serve(args)?;
        let burst = |spawn: &dyn Fn(usize) -> Result<std::process::Child>| -> Result<Duration> {
            let started = Instant::now();
            let children = (0..100).map(spawn).collect::<Result<Vec<_>>>()?;
            for c in children {
                let out = c.wait_with_output()?;
                ensure!(
                    out.status.success(),
                    "a burst process failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(started.elapsed())
        };
        let spawn_bridge = |i: usize| -> Result<std::process::Child> {
            let mut child = Command::new(bridge)
                .args(["--provider", BRIDGE_PROVIDER])
                .env("CREDGATE_SOCKET", &cold.socket)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?;
            let image = args.image_template.replace("{i}", &i.to_string());
            child
                .stdin
                .take()
                .context("stdin")?
                .write_all(&kubelet_request(&image))?;
            Ok(child)
        };
        let spawn_nothing = |_: usize| -> Result<std::process::Child> {
            Ok(Command::new(bridge)
                .arg("--version")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?)
        };
        let starts = burst(&spawn_nothing)?;
        let wall = burst(&spawn_bridge)?;
        let runs = cold.agent.engine().total_runs();
        let budget = e50 + starts;
        emit(
            args,
            json!({
                "scenario": "bridge", "part": "burst", "rep": rep, "processes": 100,
                "plugin_runs": runs, "wall_ms": ms(wall), "hundred_starts_ms": ms(starts),
                "single_exec_p50_ms": ms(e50),
                "ratio_to_exec_plus_starts": ((wall.as_secs_f64() / budget.as_secs_f64()) * 1000.0).round() / 1000.0,
            }),
        );
    }
    Ok(())
}

fn helper_path(args: &Args) -> Result<PathBuf> {
    let path = match &args.helper {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("program has a directory")?
            .join("docker-credential-credgate"),
    };
    ensure!(
        path.is_file(),
        "{} not found: build it first (cargo build --release --bin docker-credential-credgate) or pass --helper",
        path.display()
    );
    Ok(path)
}

fn run_helper(helper: &Path, socket: &Path, verb: &str, stdin: &[u8]) -> Result<Duration> {
    let (took, _) = timed(
        Command::new(helper)
            .arg(verb)
            .env("CREDGATE_SOCKET", socket),
        stdin,
    )?;
    Ok(took)
}

pub fn helper(args: &Args) -> Result<()> {
    let helper = helper_path(args)?;
    // A running agent (`credgate serve`) when its socket is given, else one in this process.
    let served = match args.socket {
        Some(_) => None,
        None => Some(serve(args)?),
    };
    let socket = match (&args.socket, &served) {
        (Some(s), _) => s.clone(),
        (None, served) => served.as_ref().context("agent served")?.socket.clone(),
    };
    let host = args
        .image
        .split('/')
        .next()
        .context("image has a registry")?
        .to_owned();
    let mut get = Vec::with_capacity(args.n);
    let mut nothing = Vec::with_capacity(args.n);
    for i in 0..10 + args.n {
        // Interleaved, so that both see the same machine state.
        let g = run_helper(&helper, &socket, "get", host.as_bytes())?;
        let v = run_helper(&helper, &socket, "version", b"")?;
        if i >= 10 {
            get.push(g);
            nothing.push(v);
        }
    }
    let mean = |s: &[Duration]| s.iter().sum::<Duration>() / s.len() as u32;
    let (gm, nm) = (mean(&get), mean(&nothing));
    let (g50, n50) = (percentile(&mut get, 0.5), percentile(&mut nothing, 0.5));
    emit(
        args,
        json!({
            "scenario": "helper", "n": args.n, "host": host,
            "get_mean_ms": ms(gm), "get_p50_ms": ms(g50), "get_p99_ms": ms(percentile(&mut get, 0.99)),
            "nothing_mean_ms": ms(nm), "nothing_p50_ms": ms(n50), "nothing_p99_ms": ms(percentile(&mut nothing, 0.99)),
            "p50_ratio": ((g50.as_secs_f64() / n50.as_secs_f64()) * 1000.0).round() / 1000.0,
            "plugin_runs": served.as_ref().map(|s| s.agent.engine().total_runs()),
        }),
    );
    Ok(())
}
