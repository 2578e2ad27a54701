//! `cri-proxy`: the CRI image-service proxy (`credgate serve --cri-proxy-socket`) beside
//! Debian's containerd, its runtime, called straight. `ImageStatus` p50/p99 on one connection
//! each, in alternating blocks; then `PullImage` of a small image from a loopback
//! `docker-registry` with htpasswd (the image removed before each pull), alternating direct
//! and proxied pulls. The proxied pull includes what the proxy adds: the guard's records
//! before and after, and the captured credential sealed and fsynced before the answer.
//!
//! Needs root (containerd), and containerd, docker-registry, htpasswd and skopeo installed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use credgate_testbed::cri::{
    call_on, pull_request, Empty, ImageSpec, ImageStatusRequest, ImageStatusResponse,
    PullImageResponse, RemoveImageRequest, IMAGE_STATUS, PULL_IMAGE, REMOVE_IMAGE,
};
use credgate_testbed::{oci_image, push, Containerd, Registry};
use serde_json::json;
use tonic::transport::Channel;

use crate::{emit, ms, percentile, Args, TempDir};

pub(crate) const USER: &str = "bench";
pub(crate) const PASSWORD: &str = "bench-password";

/// `credgate serve` with the CRI proxy, killed on drop.
pub(crate) struct Proxy(pub(crate) Child);

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn start_proxy(
    dir: &Path,
    runtime: &Path,
    more: &[&std::ffi::OsStr],
) -> Result<(Proxy, PathBuf)> {
    let credgate = crate::sibling("credgate")?;
    let socket = dir.join("cri.sock");
    let child = Command::new(&credgate)
        .arg("serve")
        .arg("--socket")
        .arg(dir.join("credgate.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--no-docker-config")
        .arg("--cri-proxy-socket")
        .arg(&socket)
        .arg("--cri-runtime-endpoint")
        .arg(format!("unix://{}", runtime.display()))
        .args(more)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("agent.log"))?)
        .spawn()
        .with_context(|| format!("cannot start {}", credgate.display()))?;
    let proxy = Proxy(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        ensure!(Instant::now() < deadline, "the CRI proxy did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((proxy, socket))
}

fn us(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e7).round() / 10.0
}

fn ratio(a: Duration, b: Duration) -> f64 {
    ((a.as_secs_f64() / b.as_secs_f64()) * 1000.0).round() / 1000.0
}

/// A node for the CRI scenarios: a loopback registry with htpasswd holding `team/app:v1`,
/// containerd trusting it, and the agent's proxy in front of containerd; all stopped and
/// removed on drop (the fields drop in order: the agent, containerd, the registry, the
/// directory).
pub(crate) struct Node {
    pub(crate) proxy: Proxy,
    pub(crate) proxy_socket: PathBuf,
    pub(crate) containerd: Containerd,
    pub(crate) registry: Registry,
    pub(crate) dir: TempDir,
}

impl Node {
    /// `scenario` names the temporary directory; fails when containerd cannot run here.
    pub(crate) fn start(scenario: &str) -> Result<Node> {
        if let Some(why) = Containerd::unavailable() {
            bail!("{scenario} cannot run here: {why}");
        }
        let dir = TempDir::new(scenario)?;
        let d = &dir.0;
        let registry = Registry::start(d, USER, PASSWORD);
        oci_image(d);
        push(d, &registry, "team/app", USER, PASSWORD);
        let containerd = Containerd::start(d, &[registry.host()]);
        let (proxy, proxy_socket) = start_proxy(d, &containerd.socket, &[])?;
        Ok(Node {
            proxy,
            proxy_socket,
            containerd,
            registry,
            dir,
        })
    }

    /// The image pushed to the registry.
    pub(crate) fn image(&self) -> String {
        format!("{}/team/app:v1", self.registry.host())
    }
}

pub fn cri_proxy(args: &Args) -> Result<()> {
    let node = Node::start("cri-proxy")?;
    let (containerd, proxy_socket) = (&node.containerd, &node.proxy_socket);
    let image = node.image();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let direct = credgate_api::connect(&containerd.socket).await?;
        let proxied = credgate_api::connect(proxy_socket).await?;
        pull(&direct, &image).await.context("the first pull")?;
        image_status_part(args, &direct, &proxied, &image).await?;
        // `--reps 0` leaves the pulls out.
        if args.reps > 0 {
            pull_part(args, &direct, &proxied, &image).await?;
        }
        anyhow::Ok(())
    })
}

fn pull(
    channel: &Channel,
    image: &str,
) -> impl std::future::Future<Output = Result<PullImageResponse, tonic::Status>> {
    call_on::<_, PullImageResponse>(
        channel.clone(),
        PULL_IMAGE,
        pull_request(image, Some((USER, PASSWORD)), "bench"),
    )
}

fn spec(image: &str) -> Option<ImageSpec> {
    Some(ImageSpec {
        image: image.to_owned(),
    })
}

/// ImageStatus: 10 blocks of each side, alternating, after a warm-up block of each.
async fn image_status_part(
    args: &Args,
    direct: &Channel,
    proxied: &Channel,
    image: &str,
) -> Result<()> {
    let block = args.n.div_ceil(10);
    let mut samples = [Vec::new(), Vec::new()];
    for round in 0..11 {
        for (side, channel) in [direct, proxied].into_iter().enumerate() {
            for _ in 0..block {
                let started = Instant::now();
                let answer = call_on::<_, ImageStatusResponse>(
                    channel.clone(),
                    IMAGE_STATUS,
                    ImageStatusRequest { image: spec(image) },
                )
                .await?;
                let took = started.elapsed();
                ensure!(answer.image.is_some(), "ImageStatus found no image");
                if round > 0 {
                    samples[side].push(took);
                }
            }
        }
    }
    let [mut d, mut p] = samples;
    let (d50, d99) = (percentile(&mut d, 0.5), percentile(&mut d, 0.99));
    let (p50, p99) = (percentile(&mut p, 0.5), percentile(&mut p, 0.99));
    emit(
        args,
        json!({
            "scenario": "cri-proxy", "part": "image-status", "n": d.len(),
            "direct_p50_us": us(d50), "direct_p99_us": us(d99),
            "proxy_p50_us": us(p50), "proxy_p99_us": us(p99),
            "p50_ratio": ratio(p50, d50), "p99_ratio": ratio(p99, d99),
            "p50_added_us": us(p50.saturating_sub(d50)),
        }),
    );
    Ok(())
}

/// PullImage: the image removed before each pull, direct and proxied alternating.
async fn pull_part(args: &Args, direct: &Channel, proxied: &Channel, image: &str) -> Result<()> {
    let mut pulls = [Vec::new(), Vec::new()];
    for _ in 0..args.reps {
        for (side, channel) in [direct, proxied].into_iter().enumerate() {
            call_on::<_, Empty>(
                direct.clone(),
                REMOVE_IMAGE,
                RemoveImageRequest { image: spec(image) },
            )
            .await?;
            let started = Instant::now();
            let pulled = pull(channel, image).await?;
            pulls[side].push(started.elapsed());
            ensure!(pulled.image_ref.starts_with("sha256:"), "no image ref");
        }
    }
    let [mut d, mut p] = pulls;
    let (d50, p50) = (percentile(&mut d, 0.5), percentile(&mut p, 0.5));
    emit(
        args,
        json!({
            "scenario": "cri-proxy", "part": "pull", "n": d.len(),
            "direct_p50_ms": ms(d50), "proxy_p50_ms": ms(p50),
            "direct_max_ms": ms(*d.iter().max().unwrap_or(&Duration::ZERO)),
            "proxy_max_ms": ms(*p.iter().max().unwrap_or(&Duration::ZERO)),
            "p50_added_ms": ms(p50.saturating_sub(d50)),
            "p50_ratio": ratio(p50, d50),
        }),
    );
    Ok(())
}
