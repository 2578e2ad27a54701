//! `tenant` (internal to the soak): one hostile tenant of the agent's socket, run as its own
//! process so that `scripts/soak --adversarial` can start it under uids other than the agent's
//! (a member of `--socket-group`, or any uid when the socket is world-writable). Parts, chosen
//! by `--attack`, each bounded by `--duration`:
//!
//! - `pings`: up to `--idle-connections` connections that send the preface and SETTINGS, then
//!   only a PING every 5 s (no request), reopened as the agent closes them;
//! - `tracked`: 60 consumers of 150 refs of about 340 bytes each (SetTracked; a request
//!   stays under the API's 64 KiB), past the agent's bound of refs per uid;
//! - `rate`: 16 concurrent lookups of distinct hosts behind the rate-limited provider
//!   (`*.limited.soak.test`), without pause;
//! - `names`: pulls of one image recorded under ever new names, anonymously.
//!
//! Prints one JSON object of counts when done.

use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use credgate_api::frame;
use credgate_api::v1::credentials_client::CredentialsClient;
use credgate_api::v1::image_access_client::ImageAccessClient;
use credgate_api::v1::{self as pb};
use serde_json::json;

use crate::probe::Phase;
use crate::Args;

pub fn tenant(args: &Args) -> Result<()> {
    let socket = args
        .socket
        .clone()
        .ok_or_else(|| anyhow::anyhow!("tenant needs --socket"))?;
    let until = Instant::now() + args.duration;
    let on = |part: &str| args.attack.iter().any(|a| a == part);
    let uid = own_uid();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let counts = rt.block_on(async {
        let pings = on("pings").then(|| {
            let (socket, n) = (socket.clone(), args.idle_connections);
            tokio::task::spawn_blocking(move || pings(&socket, n, until))
        });
        let tracked = on("tracked").then(|| tokio::spawn(tracked(socket.clone(), uid)));
        let rate = on("rate").then(|| tokio::spawn(rate(socket.clone(), uid, until)));
        let names = on("names").then(|| tokio::spawn(names(socket.clone(), uid, until)));
        let local = ["idle", "watch", "oversized", "verify"]
            .iter()
            .any(|p| on(p))
            .then(|| {
                let plan = crate::adversary::Plan {
                    idle: if on("idle") { 400 } else { 0 },
                    watch_connections: if on("watch") { 10 } else { 0 },
                    watch_streams: 32,
                    refs: (0..10)
                        .map(|i| format!("renew.soak.test/app-{i}:v1"))
                        .collect(),
                    oversized: if on("oversized") { 2 } else { 0 },
                    verifiers: if on("verify") { 2 } else { 0 },
                    limit: args.duration,
                };
                let socket = socket.clone();
                tokio::task::spawn_blocking(move || {
                    let attack = crate::adversary::start(&socket, &plan)?;
                    std::thread::sleep(until.saturating_duration_since(Instant::now()));
                    std::io::Result::Ok(attack.stop())
                })
            });
        let mut out = json!({"uid": uid});
        if let Some(t) = local {
            if let Ok(Ok(c)) = t.await {
                out["local"] = crate::adversary::counts_json(&c);
            }
        }
        if let Some(t) = pings {
            out["pings"] = t.await.unwrap_or_default();
        }
        if let Some(t) = tracked {
            out["tracked"] = t.await.unwrap_or_default();
        }
        if let Some(t) = rate {
            out["rate"] = t.await.unwrap_or_default();
        }
        if let Some(t) = names {
            out["names"] = t.await.unwrap_or_default();
        }
        out
    });
    println!("{counts}");
    Ok(())
}

/// The uid this process runs as.
pub fn own_uid() -> u32 {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid())
}

/// Connections that look alive to HTTP/2 (PINGs) but never make a request.
fn pings(socket: &Path, n: usize, until: Instant) -> serde_json::Value {
    let mut hello = frame::PREFACE.to_vec();
    frame::put(&mut hello, frame::SETTINGS, 0, 0, &[]);
    frame::put(&mut hello, frame::SETTINGS, frame::ACK, 0, &[]);
    let mut ping = Vec::new();
    frame::put(&mut ping, frame::PING, 0, 0, &[7; 8]);
    let (mut opened, mut refused, mut held_max) = (0u64, 0u64, 0usize);
    let mut held: Vec<UnixStream> = Vec::new();
    let mut last_ping = Instant::now();
    while Instant::now() < until {
        held.retain(|c| !crate::adversary::closed_by_peer(c));
        while held.len() < n {
            let Ok(mut c) = UnixStream::connect(socket) else {
                refused += 1;
                break;
            };
            if c.write_all(&hello).is_err() {
                refused += 1;
                break;
            }
            let _ = c.set_nonblocking(true);
            opened += 1;
            held.push(c);
        }
        if last_ping.elapsed() >= Duration::from_secs(5) {
            held.retain_mut(|c| c.write_all(&ping).is_ok());
            last_ping = Instant::now();
        }
        held_max = held_max.max(held.len());
        std::thread::sleep(Duration::from_millis(200));
    }
    json!({"opened": opened, "refused_or_closed_at_once": refused, "held_max": held_max})
}

async fn tracked(socket: PathBuf, uid: u32) -> serde_json::Value {
    let Ok(channel) = credgate_api::connect(&socket).await else {
        return json!({"error": "cannot connect"});
    };
    let mut creds = CredentialsClient::new(channel);
    let (mut accepted, mut refused, mut first_error) = (0u64, 0u64, String::new());
    // About 340 bytes a ref: a 200-byte path and a 100-byte tag (a repository name is at
    // most 255 bytes).
    let (path, tag) = ("p".repeat(200), "t".repeat(100));
    for c in 0..60 {
        let refs = (0..150)
            .map(|i| format!("renew.soak.test/{path}/t{uid}-{c}-{i}:{tag}"))
            .collect();
        let r = creds
            .set_tracked(pb::SetTrackedRequest {
                consumer: format!("tenant-{uid}-{c}"),
                refs,
            })
            .await;
        match r {
            Ok(_) => accepted += 1,
            Err(e) => {
                refused += 1;
                if first_error.is_empty() {
                    first_error = e.message().to_owned();
                }
            }
        }
    }
    json!({"consumers_accepted": accepted, "consumers_refused": refused, "first_error": first_error})
}

async fn rate(socket: PathBuf, uid: u32, until: Instant) -> serde_json::Value {
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (socket, ok, failed, next) = (socket.clone(), ok.clone(), failed.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let Ok(channel) = credgate_api::connect(&socket).await else {
                return;
            };
            let mut creds = CredentialsClient::new(channel);
            while Instant::now() < until {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let lookup = creds.lookup(pb::LookupRequest {
                    image: format!("t{uid}-{i}.limited.soak.test/app:v1"),
                    ..Default::default()
                });
                let left = until.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, lookup).await {
                    Ok(Ok(_)) => ok.fetch_add(1, Ordering::Relaxed),
                    Ok(Err(_)) => failed.fetch_add(1, Ordering::Relaxed),
                    Err(_) => break,
                };
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    json!({"ok": ok.load(Ordering::Relaxed), "failed": failed.load(Ordering::Relaxed)})
}

async fn names(socket: PathBuf, uid: u32, until: Instant) -> serde_json::Value {
    let Ok(channel) = credgate_api::connect(&socket).await else {
        return json!({"error": "cannot connect"});
    };
    let mut guard = ImageAccessClient::new(channel);
    let (mut recorded, mut failed, mut first_error) = (0u64, 0u64, String::new());
    let mut i = 0u64;
    while Instant::now() < until {
        i += 1;
        let image = format!("guard.soak.test/t{uid}/name-{i}:v1");
        let intent = guard
            .record_pull_intent(pb::RecordPullIntentRequest {
                image: image.clone(),
            })
            .await;
        let result = guard
            .record_pull_result(pb::RecordPullResultRequest {
                image,
                image_ref: format!("sha256:{:064x}", 0xfeed),
                success: true,
                credential: Some(pb::PullCredential::node_wide()),
            })
            .await;
        match intent.and(result) {
            Ok(_) => recorded += 1,
            Err(e) => {
                failed += 1;
                if first_error.is_empty() {
                    first_error = e.message().to_owned();
                }
            }
        }
    }
    json!({"recorded": recorded, "failed": failed, "first_error": first_error})
}

/// The tenants of an adversarial soak, started as their own processes: as root, four uids
/// (4301-4304, through setpriv, as a pod may pick its `runAsUser`) hold ping-only connections
/// and the first also tracks, floods the rate-limited provider and records names; otherwise
/// one process of this uid does all (and the agent's room for its own uid is not exercised).
pub struct Tenants(Vec<std::process::Child>);

impl Tenants {
    /// `classic`: the parts of [`crate::adversary`] to run as uid 4305 (root only).
    pub fn start(
        socket: &Path,
        duration: Duration,
        idle: usize,
        ours: bool,
        classic: &[&str],
    ) -> Result<Tenants> {
        use std::process::{Command, Stdio};
        let me = std::env::current_exe()?;
        let mut tenants: Vec<(Option<u32>, String)> = Vec::new();
        if own_uid() == 0 {
            if ours {
                tenants.push((Some(4301), "pings,tracked,rate,names".into()));
                tenants.extend((4302..=4304).map(|u| (Some(u), "pings".into())));
            }
            if !classic.is_empty() {
                tenants.push((Some(4305), classic.join(",")));
            }
        } else if ours {
            tenants.push((None, "pings,tracked,rate,names".into()));
        }
        let mut children = Vec::new();
        for (uid, parts) in tenants {
            let mut cmd = match uid {
                Some(uid) => {
                    let mut c = Command::new("setpriv");
                    c.args(["--reuid", &uid.to_string(), "--regid", &uid.to_string()])
                        .args(["--clear-groups", "--"])
                        .arg(&me);
                    c
                }
                None => Command::new(&me),
            };
            cmd.arg("tenant")
                .arg("--socket")
                .arg(socket)
                .arg("--duration")
                .arg(format!("{}ms", duration.as_millis()))
                .arg("--idle-connections")
                .arg(idle.to_string())
                .arg("--attack")
                .arg(parts)
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            children.push(cmd.spawn()?);
        }
        Ok(Tenants(children))
    }

    /// Waits for every tenant; what each printed.
    pub fn finish(self) -> Vec<serde_json::Value> {
        self.0
            .into_iter()
            .map(|c| {
                c.wait_with_output()
                    .ok()
                    .and_then(|o| serde_json::from_slice(&o.stdout).ok())
                    .unwrap_or_else(|| json!({"error": "the tenant printed nothing"}))
            })
            .collect()
    }
}

/// What this process (root or the agent's uid) sees during the soak, per phase (0: before the
/// attack, 1: during): Health on a new connection every 200 ms (5 s at most), and a lookup of
/// a new host behind the rate-limited provider every second (60 s at most, the kubelet's exec
/// deadline).
pub async fn probe(socket: PathBuf, half: Duration, until: Instant) -> [[Phase; 2]; 2] {
    let started = Instant::now();
    let phase = move || usize::from(started.elapsed() >= half);
    let health = tokio::spawn(crate::probe::health(
        socket.clone(),
        Duration::from_millis(200),
        phase,
        move || Instant::now() < until,
    ));
    let limited = tokio::spawn(async move {
        let mut seen: [Phase; 2] = Default::default();
        let Ok(channel) = credgate_api::connect(&socket).await else {
            seen[0].failed += 1;
            return seen;
        };
        let mut creds = CredentialsClient::new(channel);
        let mut i = 0;
        while Instant::now() < until {
            i += 1;
            let (at, t) = (phase(), Instant::now());
            let lookup = creds.lookup(pb::LookupRequest {
                image: format!("probe-{i}.limited.soak.test/app:v1"),
                ..Default::default()
            });
            match tokio::time::timeout(Duration::from_secs(60), lookup).await {
                Ok(Ok(_)) => seen[at].ok.push(t.elapsed()),
                _ => seen[at].failed += 1,
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        seen
    });
    [
        health.await.unwrap_or_default(),
        limited.await.unwrap_or_default(),
    ]
}

/// The state directory's files and their caps, in bytes (a cap of 0: none of its own).
pub fn state_files(dir: &Path) -> serde_json::Value {
    let size = |name: &str| std::fs::metadata(dir.join(name)).map_or(0, |m| m.len());
    json!({
        "cache_sealed": size("cache.sealed"),
        "cache_sealed_cap": credgate_agent::saved_cache::MAX_FILE,
        "captured_sealed": size("captured.sealed"),
        "captured_sealed_cap": credgate_agent::captured::MAX_FILE,
        "guard_db": size("guard.db") + size("guard.db-wal"),
    })
}
