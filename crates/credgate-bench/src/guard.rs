//! Scenarios of the image access guard: `guard-check` (decisions per second on a warm store of
//! `--records` records), `guard-record` (durable recordings per second, one caller and
//! `--clients` concurrent callers), `guard-open` (time from start to serving and resident
//! memory with `--records` records, measured in a fresh process).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Context as _, Result};
use credgate_agent::guard::{
    Answer, CredentialIn, Guard, GuardOptions, Presence, PullEnd, PullPolicy,
};
use credgate_agent::metrics::AgentMetrics;
use credgate_core::guard::{Coords, Policy};
use secrecy::SecretString;
use serde_json::json;

use crate::{emit, Args, TempDir};

fn coords(i: usize) -> Coords {
    Coords {
        namespace: format!("ns-{}", i % 100),
        name: "pull".into(),
        uid: format!("uid-{i}"),
    }
}

fn secret(i: usize) -> CredentialIn {
    CredentialIn::Secret {
        coords: coords(i),
        username: format!("user-{i}"),
        password: SecretString::from(format!("password-{i}")),
    }
}

fn guard(dir: &Path) -> Guard {
    Guard::open(
        GuardOptions {
            policy: Policy::AlwaysVerify,
            state_dir: dir.to_owned(),
            ..Default::default()
        },
        AgentMetrics::default(),
        std::sync::Arc::new(credgate_engine::clock::SystemClock::new()),
    )
}

fn runtime(workers: usize) -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()?)
}

/// Fills `dir` with `n` records (image `i`: one name, pulled by secret `i`).
pub fn populate(dir: &Path, n: usize) -> Result<()> {
    let rt = runtime(2)?;
    let g = guard(dir);
    rt.block_on(async {
        let mut tasks = Vec::new();
        for chunk in 0..64 {
            let g = g.clone();
            tasks.push(tokio::spawn(async move {
                let mut i = chunk;
                while i < n {
                    g.record_result(
                        &format!("registry.example.com/team/app-{i}:v1"),
                        PullEnd::Pulled {
                            image_ref: &format!("sha256:{i:064x}"),
                            used: &secret(i),
                        },
                    )
                    .await?;
                    i += 64;
                }
                anyhow::Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        anyhow::Ok(())
    })?;
    rt.block_on(g.store()?.close());
    Ok(())
}

pub fn check(args: &Args) -> Result<()> {
    let dir = TempDir::new("check")?;
    populate(&dir.0, args.records)?;
    let g = guard(&dir.0);
    let (records, _) = g.store()?.counts();
    ensure!(records == args.records, "store holds {records} records");
    let rt = runtime(2)?;
    let _enter = rt.enter();
    for &threads in &args.threads {
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        // Inputs are built before timing: the figure is the decision alone.
        let inputs: Arc<Vec<(String, String, Vec<CredentialIn>)>> = Arc::new(
            (0..4096)
                .map(|k| {
                    let i = (k * 7919) % records;
                    (
                        format!("registry.example.com/team/app-{i}:v1"),
                        format!("sha256:{i:064x}"),
                        vec![secret(i)],
                    )
                })
                .collect(),
        );
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let g = g.clone();
                let stop = stop.clone();
                let ops = ops.clone();
                let inputs = inputs.clone();
                let handle = rt.handle().clone();
                std::thread::spawn(move || {
                    let _enter = handle.enter();
                    let mut n = 0u64;
                    let mut k = t * 1021;
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..256 {
                            k = (k + 1) % inputs.len();
                            let (image, image_ref, creds) = &inputs[k];
                            let a = g
                                .check(
                                    image,
                                    image_ref,
                                    Presence::OnNode,
                                    PullPolicy::IfNotPresent,
                                    creds,
                                )
                                .expect("valid input");
                            assert_eq!(a.answer, Answer::Allow);
                            n += 1;
                        }
                    }
                    ops.fetch_add(n, Ordering::Relaxed);
                })
            })
            .collect();
        std::thread::sleep(args.duration);
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            h.join().expect("bench thread");
        }
        let total = ops.load(Ordering::Relaxed) as f64;
        let secs = args.duration.as_secs_f64();
        emit(
            args,
            json!({
                "scenario": "guard-check", "threads": threads, "records": records,
                "decisions_per_s": (total / secs).round(),
                "us_per_decision_per_thread": ((secs * threads as f64 / total) * 1e9).round() / 1e3,
            }),
        );
    }
    Ok(())
}

pub fn record(args: &Args) -> Result<()> {
    let rt = runtime(2)?;
    for &callers in &[1usize, args.clients] {
        let dir = TempDir::new(&format!("record-{callers}"))?;
        let g = guard(&dir.0);
        let per_caller = (args.n / callers).max(1);
        let started = Instant::now();
        let commits_before = g.store()?.commits();
        rt.block_on(async {
            let mut tasks = Vec::new();
            for c in 0..callers {
                let g = g.clone();
                tasks.push(tokio::spawn(async move {
                    for i in 0..per_caller {
                        let k = c * per_caller + i;
                        g.record_result(
                            &format!("registry.example.com/team/app-{k}:v1"),
                            PullEnd::Pulled {
                                image_ref: &format!("sha256:{k:064x}"),
                                used: &secret(k),
                            },
                        )
                        .await?;
                    }
                    anyhow::Ok(())
                }));
            }
            for t in tasks {
                t.await??;
            }
            anyhow::Ok(())
        })?;
        let took = started.elapsed();
        let total = per_caller * callers;
        let commits = g.store()?.commits() - commits_before;
        emit(
            args,
            json!({
                "scenario": "guard-record", "callers": callers, "recordings": total,
                "recordings_per_s": (total as f64 / took.as_secs_f64()).round(),
                "transactions": commits,
                "ms": (took.as_secs_f64() * 1e4).round() / 10.0,
            }),
        );
        rt.block_on(g.store()?.close());
    }
    Ok(())
}

pub fn open(args: &Args) -> Result<()> {
    let dir = TempDir::new("open")?;
    // Filled by another process, so this one starts cold.
    let status = std::process::Command::new(std::env::current_exe()?)
        .args([
            "guard-populate",
            "--records",
            &args.records.to_string(),
            "--state-dir",
        ])
        .arg(&dir.0)
        .status()
        .context("populating the store")?;
    ensure!(status.success(), "populating the store failed");
    let before = crate::rss_kib("self");
    let started = Instant::now();
    let g = guard(&dir.0);
    let (records, _) = g.store()?.counts();
    let took = started.elapsed();
    let after = crate::rss_kib("self");
    ensure!(records == args.records, "opened {records} records");
    let db = std::fs::metadata(dir.0.join("guard.db"))?.len();
    emit(
        args,
        json!({
            "scenario": "guard-open", "records": records,
            "open_ms": (took.as_secs_f64() * 1e4).round() / 10.0,
            "rss_before_mib": before / 1024, "rss_after_mib": after / 1024,
            "rss_growth_mib": (after.saturating_sub(before)) / 1024,
            "db_mib": db / (1024 * 1024),
        }),
    );
    Ok(())
}

pub fn populate_cmd(args: &Args) -> Result<()> {
    let dir = args
        .state_dir
        .clone()
        .context("guard-populate needs --state-dir")?;
    populate(&dir, args.records)
}
