//! `cri-soak`: the CRI proxy under attack while a kubelet pulls through it. Debian's
//! containerd behind the proxy, a loopback docker-registry with htpasswd, and three loops for
//! `--duration`: a "kubelet" (remove the image, pull it through the proxy with credentials,
//! ImageStatus), a bridge-like caller of the API (`Health` on a new connection every 100 ms)
//! and a sampler of the agent's RSS. The second half adds a hostile caller of the proxy
//! (silent connections held open and reopened as they are closed, connections of 60
//! PullImage streams each sent to just under a PullImage's 512 KiB and never finished,
//! connections that ask for ListImages and never read) and a pod author's pulls
//! ([`tenant_pulls`]: slow pulls with large secrets against a registry that never answers,
//! a registry whose errors carry forged log lines, captures from a registry that accepts any
//! credential). Reported: the kubelet's pulls and the API's answers before and during the
//! attack, the agent's RSS before, during and after, `captured.sealed`'s size, whether the
//! kubelet's capture is kept and whether any log line was forged; and whether each bound held
//! (the run fails when one did not).
//!
//! Needs root (containerd), and containerd, docker-registry, htpasswd and skopeo installed.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use credgate_testbed::cri::{
    call_on, pull_request, Empty, ImageSpec, ImageStatusRequest, ImageStatusResponse,
    PullImageResponse, RemoveImageRequest, IMAGE_STATUS, LIST_IMAGES, PULL_IMAGE, REMOVE_IMAGE,
};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;

use crate::cri::{Node, PASSWORD, USER};
use crate::probe::Phase;
use crate::{emit, Args};

type Body = UnsyncBoxBody<Bytes, std::io::Error>;

pub fn cri_soak(args: &Args) -> Result<()> {
    let node = Node::start("cri-soak")?;
    let (containerd, proxy_socket) = (&node.containerd, &node.proxy_socket);
    let pid = node.proxy.0.id();
    let api_socket = node.dir.0.join("credgate.sock");
    let image = node.image();
    let half = args.duration / 2;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let started = Instant::now();
        let attacking = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let phase = |attacking: &AtomicBool| usize::from(attacking.load(Ordering::Relaxed));

        // The kubelet: remove, pull through the proxy, status.
        let kubelet = tokio::spawn(kubelet(
            credgate_api::connect(&containerd.socket).await?,
            credgate_api::connect(proxy_socket).await?,
            image.clone(),
            attacking.clone(),
            stop.clone(),
        ));

        // A bridge-like caller of the API: Health on a new connection every 100 ms.
        let api = {
            let (attacking, stop) = (attacking.clone(), stop.clone());
            tokio::spawn(crate::probe::health(
                api_socket.clone(),
                Duration::from_millis(100),
                move || phase(&attacking),
                move || !stop.load(Ordering::Relaxed),
            ))
        };

        // RSS, by phase.
        let rss = Arc::new(Mutex::new([0u64; 2]));
        let sampler = tokio::spawn(sample_rss(
            pid,
            rss.clone(),
            attacking.clone(),
            stop.clone(),
        ));

        tokio::time::sleep(half).await;
        attacking.store(true, Ordering::Relaxed);
        let remaining = args.duration.saturating_sub(started.elapsed());
        let (counts, tenant_counts) = attacked_half(&node, remaining).await?;
        stop.store(true, Ordering::Relaxed);
        let mut pulls = kubelet.await?;
        let mut health = api.await?;
        sampler.await?;
        // After: the callers are gone; what is left of the agent's memory.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let after = crate::rss_kib(&pid.to_string());
        let rss = *rss.lock().unwrap();
        let kept = kubelet_capture_kept(&api_socket).await;
        let held = report(
            args,
            &node,
            (&mut pulls, &mut health),
            (rss, after),
            kept,
            (counts, tenant_counts),
        );
        anyhow::ensure!(
            held,
            "a bound did not hold under the attack (see \"holds\")"
        );
        anyhow::Ok(())
    })?;
    drop(node);
    Ok(())
}

/// The second half: the hostile caller and a pod author's pulls for `remaining`, then what
/// each did.
async fn attacked_half(
    node: &Node,
    remaining: Duration,
) -> Result<(serde_json::Value, serde_json::Value)> {
    let stop = Arc::new(AtomicBool::new(false));
    let attack = tokio::spawn(attack(node.proxy_socket.clone(), stop.clone()));
    let tenants = tokio::spawn(tenant_pulls(
        node.proxy_socket.clone(),
        node.containerd.certs.clone(),
        node.registry.host(),
        stop.clone(),
    ));
    tokio::time::sleep(remaining).await;
    stop.store(true, Ordering::Relaxed);
    let counts = attack.await.context("the attack")?;
    let tenant_counts = tenants.await.context("the tenants' pulls")?;
    Ok((counts, tenant_counts))
}

/// The kubelet's loop until `stop`: remove the image, pull it through the proxy with
/// credentials, ImageStatus; each round counted in the phase it began in.
async fn kubelet(
    direct: tonic::transport::Channel,
    proxied: tonic::transport::Channel,
    image: String,
    attacking: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) -> [Phase; 2] {
    let mut phases = [Phase::default(), Phase::default()];
    let spec = || {
        Some(ImageSpec {
            image: image.clone(),
        })
    };
    while !stop.load(Ordering::Relaxed) {
        let _ = call_on::<_, Empty>(
            direct.clone(),
            REMOVE_IMAGE,
            RemoveImageRequest { image: spec() },
        )
        .await;
        let at = usize::from(attacking.load(Ordering::Relaxed));
        let t = Instant::now();
        let pulled = tokio::time::timeout(
            Duration::from_secs(30),
            call_on::<_, PullImageResponse>(
                proxied.clone(),
                PULL_IMAGE,
                pull_request(&image, Some((USER, PASSWORD)), "soak"),
            ),
        )
        .await;
        let status = call_on::<_, ImageStatusResponse>(
            proxied.clone(),
            IMAGE_STATUS,
            ImageStatusRequest { image: spec() },
        )
        .await;
        match (pulled, status) {
            (Ok(Ok(_)), Ok(s)) if s.image.is_some() => phases[at].ok.push(t.elapsed()),
            _ => phases[at].failed += 1,
        }
    }
    phases
}

/// The agent's peak RSS in each phase (0: before the attack, 1: during), every 250 ms until
/// `stop`.
async fn sample_rss(
    pid: u32,
    rss: Arc<Mutex<[u64; 2]>>,
    attacking: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        let at = usize::from(attacking.load(Ordering::Relaxed));
        let kb = crate::rss_kib(&pid.to_string());
        {
            let mut r = rss.lock().unwrap();
            r[at] = r[at].max(kb);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Emits the run's figures and the bounds they held; true when every bound held.
fn report(
    args: &Args,
    node: &Node,
    (pulls, health): (&mut [Phase; 2], &mut [Phase; 2]),
    (rss, after): ([u64; 2], u64),
    kept: bool,
    (counts, tenant_counts): (serde_json::Value, serde_json::Value),
) -> bool {
    let log = std::fs::read_to_string(node.dir.0.join("agent.log")).unwrap_or_default();
    let forged_lines = log
        .lines()
        .filter(|l| l.trim_start().starts_with("FORGED-LINE"))
        .count();
    let forged_text = log.matches("FORGED-LINE").count();
    let captured_size =
        std::fs::metadata(node.dir.0.join("state/captured.sealed")).map_or(0, |m| m.len());
    let (health_during, pulls_during) = (health[1].summary(), pulls[1].summary());
    let holds = json!({
        "health_within_1s": health_during["failed"] == 0
            && health_during["max_ms"].as_f64().unwrap_or(f64::MAX) < 1000.0,
        "kubelet_pulls_work": pulls_during["failed"] == 0
            && pulls_during["ok"].as_u64().unwrap_or(0) > 0,
        "kubelet_capture_kept": kept,
        "no_forged_line": forged_lines == 0,
        "captured_sealed_under_cap": captured_size <= credgate_agent::captured::MAX_FILE,
        "rss_under_256_mib": rss[1].max(after) < 256 << 10,
    });
    let held = holds
        .as_object()
        .is_some_and(|h| h.values().all(|v| v == true));
    emit(
        args,
        json!({
            "scenario": "cri-soak",
            "holds": holds, "seconds": args.duration.as_secs(),
            "pulls_before": pulls[0].summary(), "pulls_during": pulls_during,
            "health_before": health[0].summary(), "health_during": health_during,
            "rss_kb_before": rss[0], "rss_kb_during": rss[1], "rss_kb_after": after,
            "attack": counts,
            "tenants": tenant_counts,
            "kubelet_capture_kept": kept,
            "log_lines_forged": forged_lines,
            "log_forged_text_escaped": forged_text,
            "captured_sealed_bytes": captured_size,
            "captured_sealed_cap": credgate_agent::captured::MAX_FILE,
        }),
    );
    held
}

/// Whether the kubelet's pulls' credential (namespace `soak`, `team/app`) is still captured.
async fn kubelet_capture_kept(api: &Path) -> bool {
    let Ok(channel) = credgate_api::connect(api).await else {
        return false;
    };
    credgate_api::v1::admin_client::AdminClient::new(channel)
        .list_captured(credgate_api::v1::ListCapturedRequest {})
        .await
        .is_ok_and(|r| {
            r.into_inner()
                .captured
                .iter()
                .any(|c| c.namespace == "soak" && c.repository.ends_with("/team/app"))
        })
}

/// What a pod author does with pulls, until `stop` (its images and secrets reach the
/// runtime through the kubelet's connection):
/// - 4 pulls at a time of an image on a registry that never answers, each carrying a 400 KiB
///   secret (under a pull's 512 KiB), and pulls carrying a 1 MiB secret (refused at once);
/// - pulls of an image whose registry answers with forged log lines in its error body;
/// - pulls of ever new repositories on a registry that accepts any credential, each with a
///   credential of 1300 control characters, all from one namespace (`attacker`).
async fn tenant_pulls(
    socket: PathBuf,
    certs: PathBuf,
    upstream: String,
    stop: Arc<AtomicBool>,
) -> serde_json::Value {
    use crate::hostile_registry::{start, Kind};
    use base64::Engine as _;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"));
    let (Ok(stalling), Ok(forging), Ok(accepting)) = (
        start(Kind::Stalling),
        start(Kind::Forging),
        start(Kind::Accepting { upstream, basic }),
    ) else {
        return json!({"error": "cannot start the hostile registries"});
    };
    // containerd speaks plain HTTP to these two (read at each pull).
    plain_http(&certs, &[&forging.host, &accepting.host]);
    let Ok(channel) = credgate_api::connect(&socket).await else {
        return json!({"error": "cannot connect"});
    };
    let mut tasks = tokio::task::JoinSet::new();
    let pulls = |label: &'static str,
                 image: String,
                 (user, password): (String, String),
                 every: Duration| {
        let plan = TenantPulls {
            label,
            image,
            user,
            password,
            every,
            limit: Duration::from_secs(20),
        };
        tenant_pull_loop(channel.clone(), stop.clone(), plan)
    };
    let stalled = format!("{}/tenant/app:v1", stalling.host);
    for _ in 0..4 {
        let secret = ("t".into(), "s".repeat(400 << 10));
        tasks.spawn(pulls(
            "stalled_400KiB_secret",
            stalled.clone(),
            secret,
            Duration::ZERO,
        ));
    }
    let secret = ("t".into(), "s".repeat(1 << 20));
    let every = Duration::from_secs(1);
    tasks.spawn(pulls("stalled_1MiB_secret", stalled, secret, every));
    let forged = format!("{}/tenant/app:v1", forging.host);
    let secret = ("t".into(), "p".into());
    tasks.spawn(pulls("forging", forged, secret, Duration::from_secs(2)));
    let captured = format!("{}/attacker-{{i}}/app:v1", accepting.host);
    let secret = ("\u{1}".repeat(100), "\u{1}".repeat(1200));
    tasks.spawn(pulls(
        "accept_any_captures",
        captured,
        secret,
        Duration::ZERO,
    ));
    let mut out = tally(tasks).await;
    out.insert(
        "stalling_requests".into(),
        json!(stalling.requests.load(Ordering::Relaxed)),
    );
    out.insert(
        "forging_requests".into(),
        json!(forging.requests.load(Ordering::Relaxed)),
    );
    out.insert(
        "accepting_requests".into(),
        json!(accepting.requests.load(Ordering::Relaxed)),
    );
    serde_json::Value::Object(out)
}

/// Tells containerd to speak plain HTTP to `hosts` (it reads `hosts.toml` at each pull).
fn plain_http(certs: &Path, hosts: &[&String]) {
    for host in hosts {
        let dir = certs.join(host);
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::write(
            dir.join("hosts.toml"),
            format!("server = \"http://{host}\"\n[host.\"http://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"),
        );
    }
}

/// The pull loops' counts, summed by label.
async fn tally(
    mut tasks: tokio::task::JoinSet<(&'static str, std::collections::BTreeMap<&'static str, u64>)>,
) -> serde_json::Map<String, serde_json::Value> {
    let mut out = serde_json::Map::new();
    while let Some(done) = tasks.join_next().await {
        if let Ok((label, seen)) = done {
            let entry = out.entry(label).or_insert_with(|| json!({}));
            for (k, v) in seen {
                let now = entry[k].as_u64().unwrap_or(0);
                entry[k] = json!(now + v);
            }
        }
    }
    out
}

/// One kind of a pod author's pulls: `image` (`{i}` is replaced by the pull's number) with
/// a secret, one every `every`, each given up after `limit`.
struct TenantPulls {
    label: &'static str,
    image: String,
    user: String,
    password: String,
    every: Duration,
    limit: Duration,
}

/// Pulls as `plan` says until `stop`: how many ended each way (ok, refused, failed,
/// timed_out).
async fn tenant_pull_loop(
    channel: tonic::transport::Channel,
    stop: Arc<AtomicBool>,
    plan: TenantPulls,
) -> (&'static str, std::collections::BTreeMap<&'static str, u64>) {
    let mut seen: std::collections::BTreeMap<&'static str, u64> = Default::default();
    while !stop.load(Ordering::Relaxed) {
        let image = plan
            .image
            .replace("{i}", &seen.values().sum::<u64>().to_string());
        let r = tokio::time::timeout(
            plan.limit,
            call_on::<_, PullImageResponse>(
                channel.clone(),
                PULL_IMAGE,
                pull_request(&image, Some((&plan.user, &plan.password)), "attacker"),
            ),
        )
        .await;
        let outcome = match r {
            Ok(Ok(_)) => "ok",
            Ok(Err(s)) if s.code() == tonic::Code::ResourceExhausted => "refused",
            Ok(Err(_)) => "failed",
            Err(_) => "timed_out",
        };
        *seen.entry(outcome).or_default() += 1;
        tokio::time::sleep(plan.every).await;
    }
    (plan.label, seen)
}

/// The hostile caller, until `stop`: what it did.
async fn attack(socket: PathBuf, stop: Arc<AtomicBool>) -> serde_json::Value {
    let idle = {
        let (socket, stop) = (socket.clone(), stop.clone());
        tokio::task::spawn_blocking(move || idle(&socket, &stop))
    };
    let mut rounds = 0u64;
    let mut refused = 0u64;
    while !stop.load(Ordering::Relaxed) {
        rounds += 1;
        let mut held = Vec::new();
        let mut answers = Vec::new();
        // Half-sent pulls: 4 connections of 60 streams, just under 512 KiB each, never ended.
        for _ in 0..4 {
            let Some(mut sender) = connect(&socket, 1 << 20).await else {
                continue;
            };
            for _ in 0..60 {
                let mut first = vec![0u8];
                first.extend_from_slice(&((1u32 << 19) - 64).to_be_bytes());
                first.resize((1 << 19) - 1024, b'x');
                let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
                let _ = tx.try_send(Bytes::from(first));
                held.push(tx);
                let body = StreamBody::new(tokio_stream::StreamExt::map(
                    tokio_stream::wrappers::ReceiverStream::new(rx),
                    |b| Ok::<_, std::io::Error>(Frame::data(b)),
                ))
                .boxed_unsync();
                if sender.ready().await.is_err() {
                    break;
                }
                answers.push(sender.send_request(request(PULL_IMAGE, body)));
            }
        }
        // Non-reading ListImages: 3 connections of 3 streams, answers never read.
        let mut unread = Vec::new();
        for _ in 0..3 {
            let Some(mut sender) = connect(&socket, 65_535).await else {
                continue;
            };
            for _ in 0..3 {
                if sender.ready().await.is_err() {
                    break;
                }
                let body = Full::new(Bytes::from_static(&[0, 0, 0, 0, 0]))
                    .map_err(|never| match never {})
                    .boxed_unsync();
                unread.push(sender.send_request(request(LIST_IMAGES, body)));
            }
        }
        // The refused ones are answered at once; the held ones never are.
        let mut waiting = tokio::task::JoinSet::new();
        for a in answers {
            waiting.spawn(async move {
                matches!(
                    tokio::time::timeout(Duration::from_secs(3), a).await,
                    Ok(Ok(a)) if a.headers().get("grpc-status").is_some_and(|s| s == "8")
                )
            });
        }
        while let Some(r) = waiting.join_next().await {
            refused += u64::from(r.unwrap_or(false));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop((held, unread));
    }
    let idle_opened = idle.await.unwrap_or(0);
    json!({"rounds": rounds, "pulls_refused": refused, "idle_opened": idle_opened})
}

/// Silent connections, 300 held and reopened as the agent closes them: how many were opened.
fn idle(socket: &Path, stop: &AtomicBool) -> u64 {
    use std::io::Read as _;
    let mut held: Vec<std::os::unix::net::UnixStream> = Vec::new();
    let mut opened = 0;
    while !stop.load(Ordering::Relaxed) {
        held.retain_mut(|c| !matches!(c.read(&mut [0u8; 64]), Ok(0)));
        while held.len() < 300 {
            let Ok(c) = std::os::unix::net::UnixStream::connect(socket) else {
                break;
            };
            let _ = c.set_nonblocking(true);
            opened += 1;
            held.push(c);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    opened
}

async fn connect(
    socket: &Path,
    window: u32,
) -> Option<hyper::client::conn::http2::SendRequest<Body>> {
    let stream = tokio::net::UnixStream::connect(socket).await.ok()?;
    let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(window)
        .handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Some(sender)
}

fn request(method: &str, body: Body) -> hyper::Request<Body> {
    hyper::Request::post(format!("http://localhost{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .expect("a request")
}
