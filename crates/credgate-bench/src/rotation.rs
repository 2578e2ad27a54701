//! `rotation`: from a credential rotation to the first successful pull through the CRI proxy.
//!
//! A loopback `docker-registry` with htpasswd, Debian's containerd behind the agent's proxy,
//! and a provider plugin whose backend answers the registry's current password. A kubelet-like
//! client asks the bridge (`credgate-credential-provider`) for a credential, keeps it for the
//! `cacheDuration` it gets, and pulls through the proxy with it; a failed pull is retried
//! after `RETRY` (the kubelet's first back-off is 10 s; the figure that matters is the count,
//! not the wait). Each of `--reps` rotations changes the password at the registry and in the
//! backend, then pulls until one succeeds: failed pulls per rotation (target at most 1), extra
//! plugin runs per rotation for the one cache key (target at most 1), and the time from the
//! rotation to the first successful pull, also as a multiple of a plain pull's time measured
//! in the same run (the retry wait included).
//!
//! `--backend-lag 5s`: the backend learns each new password that long after the registry (a
//! token service behind its registry), and the client retries once a second (the adversarial
//! pass's rate). Then the figures are failed pulls and plugin runs per rotation, and the time
//! from the backend knowing the password to the first successful pull (target: a few
//! seconds; failed pulls bounded by the lag).
//!
//! Needs root (containerd), and containerd, docker-registry, htpasswd and skopeo installed.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use credgate_testbed::cri::{call_on, pull_request, PullImageResponse, PULL_IMAGE};
use credgate_testbed::{oci_image, push, Containerd, Registry};
use serde_json::json;

use crate::cri::start_proxy;
use crate::TempDir;
use crate::{emit, ms, percentile, Args};

const USER: &str = "rotated";
/// The wait before a kubelet-like retry.
const RETRY: Duration = Duration::from_millis(100);
/// The wait before a retry while the backend lags.
const LAGGING_RETRY: Duration = Duration::from_secs(1);

/// The kubelet's cache of bridge answers: image -> (password, until).
#[derive(Default)]
struct KubeletCache(HashMap<String, (String, Instant)>);

impl KubeletCache {
    /// The cached password for `image`, or the bridge's answer (kept for its cacheDuration).
    fn credential(&mut self, bridge: &Path, socket: &Path, image: &str) -> Result<String> {
        if let Some((password, until)) = self.0.get(image) {
            if Instant::now() < *until {
                return Ok(password.clone());
            }
        }
        let mut child = Command::new(bridge)
            .args(["--provider", "rotating"])
            .env("CREDGATE_SOCKET", socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        use std::io::Write as _;
        child.stdin.take().context("stdin")?.write_all(
            format!(r#"{{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderRequest","image":"{image}"}}"#).as_bytes(),
        )?;
        let out = child.wait_with_output()?;
        ensure!(out.status.success(), "the bridge failed");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let password = v["auth"]
            .as_object()
            .and_then(|a| a.values().next())
            .and_then(|e| e["password"].as_str())
            .context("the bridge answered no credential")?
            .to_owned();
        let keep =
            credgate_core::duration::GoDuration::parse(v["cacheDuration"].as_str().unwrap_or("0s"))
                .ok()
                .and_then(|d| d.to_std())
                .unwrap_or_default();
        self.0
            .insert(image.to_owned(), (password.clone(), Instant::now() + keep));
        Ok(password)
    }
}

fn runs(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

pub fn rotation(args: &Args) -> Result<()> {
    if let Some(why) = Containerd::unavailable() {
        bail!("rotation cannot run here: {why}");
    }
    let dir = TempDir::new("rotation")?;
    let d = &dir.0;
    let mut password = "rotation-0".to_owned();
    let mut registry = Registry::start(d, USER, &password);
    oci_image(d);
    push(d, &registry, "team/app", USER, &password);
    let containerd = Containerd::start(d, &[registry.host()]);
    std::fs::write(d.join("backend"), &password)?;
    let (bin, config) = provider_files(d, &registry.host())?;
    let (_proxy, proxy_socket) = start_proxy(
        d,
        &containerd.socket,
        &[
            "--image-credential-provider-config".as_ref(),
            config.as_os_str(),
            "--image-credential-provider-bin-dir".as_ref(),
            bin.as_os_str(),
        ],
    )?;
    let socket = d.join("credgate.sock");
    let bridge = args
        .bridge
        .clone()
        .map_or_else(|| crate::sibling("credgate-credential-provider"), Ok)?;
    let image = format!("{}/team/app:v1", registry.host());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut kubelet = KubeletCache::default();
    let (mut failed, mut extra_runs, mut recovery) = (Vec::new(), Vec::new(), Vec::new());
    let mut plain = Vec::new();
    let lag = args.backend_lag;
    let retry = if lag.is_zero() { RETRY } else { LAGGING_RETRY };
    rt.block_on(async {
        let channel = credgate_api::connect(&proxy_socket).await?;
        let pull = |password: String| {
            call_on::<_, PullImageResponse>(
                channel.clone(),
                PULL_IMAGE,
                pull_request(&image, Some((USER, &password)), "bench"),
            )
        };
        let first = kubelet.credential(&bridge, &socket, &image)?;
        pull(first.clone()).await.context("the first pull")?;
        // The baseline of this run: a pull with a credential that works.
        for _ in 0..5 {
            let started = Instant::now();
            pull(first.clone()).await?;
            plain.push(started.elapsed());
        }
        for rep in 1..=args.reps.max(1) {
            password = format!("rotation-{rep}");
            let before = runs(d);
            registry.set_password(USER, &password);
            let rotated = Instant::now();
            let mut backend_knows = lag
                .is_zero()
                .then(|| std::fs::write(d.join("backend"), &password));
            let mut failures = 0usize;
            loop {
                if backend_knows.is_none() && rotated.elapsed() >= lag {
                    backend_knows = Some(std::fs::write(d.join("backend"), &password));
                }
                let credential = kubelet.credential(&bridge, &socket, &image)?;
                match pull(credential).await {
                    Ok(_) => break,
                    Err(e) => {
                        failures += 1;
                        ensure!(failures <= 50, "no successful pull after 50 tries: {e}");
                        tokio::time::sleep(retry).await;
                    }
                }
            }
            backend_knows.context("the backend was told")??;
            // From the backend knowing the new password.
            recovery.push(rotated.elapsed().saturating_sub(lag));
            failed.push(failures);
            extra_runs.push(runs(d) - before);
        }
        anyhow::Ok(())
    })?;
    report(args, retry, &failed, &extra_runs, &mut recovery, &mut plain);
    Ok(())
}

/// The rotating plugin (it answers the backend file's password and notes each run) and the
/// provider config that names it: (the plugin directory, the config).
fn provider_files(d: &Path, host: &str) -> Result<(std::path::PathBuf, std::path::PathBuf)> {
    let script = format!(
        "cat >/dev/null\necho run >> {runs}\nprintf '{{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"12h\",\"auth\":{{\"{host}\":{{\"username\":\"{USER}\",\"password\":\"%s\"}}}}}}' \"$(cat {backend})\"\n",
        runs = d.join("runs").display(),
        backend = d.join("backend").display(),
    );
    crate::shell_provider(d, "rotating", &script, host, "12h")
}

/// Failed pulls and extra plugin runs per rotation, and the time to the first good pull (from
/// the backend knowing the password).
fn report(
    args: &Args,
    retry: Duration,
    failed: &[usize],
    extra_runs: &[usize],
    recovery: &mut [Duration],
    plain: &mut [Duration],
) {
    let n = failed.len();
    let max_failed = failed.iter().copied().max().unwrap_or(0);
    let max_runs = extra_runs.iter().copied().max().unwrap_or(0);
    let p50 = percentile(recovery, 0.5);
    let plain_p50 = percentile(plain, 0.5);
    let max = recovery.iter().copied().max().unwrap_or_default();
    emit(
        args,
        json!({
            "scenario": "rotation", "rotations": n,
            "backend_lag_ms": ms(args.backend_lag),
            "failed_pulls_per_rotation_max": max_failed,
            "failed_pulls_total": failed.iter().sum::<usize>(),
            "extra_plugin_runs_per_rotation_max": max_runs,
            "recovery_p50_ms": ms(p50), "recovery_max_ms": ms(max),
            "pull_p50_ms": ms(plain_p50),
            "recovery_in_pulls": ((p50.as_secs_f64() / plain_p50.as_secs_f64()) * 100.0).round() / 100.0,
            "retry_wait_ms": ms(retry),
        }),
    );
}
