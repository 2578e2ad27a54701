//! `rollout`: a fleet-wide restart of the agent, simulated on one machine. `-n` agents (each
//! its own state directory and socket) behind one provider whose plugin counts its runs and
//! answers a 12 h credential; each answers one lookup, then they are restarted (SIGTERM, as a
//! DaemonSet rollout stops them) in `--reps` waves, and each restarted agent is asked again.
//! Figures, with the sealed provider cache and without it (`--no-persist-cache`): plugin
//! runs per wave (what a registry's token service sees), and the time from an agent's start to
//! its first answered lookup.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use credgate_api::unary;
use credgate_api::v1::{LookupRequest, LookupResponse};
use serde_json::json;

use crate::TempDir;
use crate::{emit, ms, percentile, Args};

use credgate_api::methods::LOOKUP;
const IMAGE: &str = "rollout.example.com/team/app:v1";

struct Node {
    dir: PathBuf,
    child: Option<Child>,
}

impl Node {
    fn socket(&self) -> PathBuf {
        self.dir.join("s.sock")
    }

    fn start(&mut self, credgate: &Path, config: &Path, bin: &Path, persist: bool) -> Result<()> {
        let child = Command::new(credgate)
            .arg("serve")
            .arg("--socket")
            .arg(self.socket())
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .arg("--no-docker-config")
            .arg("--image-credential-provider-config")
            .arg(config)
            .arg("--image-credential-provider-bin-dir")
            .arg(bin)
            .args((!persist).then_some("--no-persist-cache"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start credgate serve")?;
        self.child = Some(child);
        Ok(())
    }

    /// Polls until a lookup is answered with a credential; how long that took.
    fn first_answer(&self, started: Instant) -> Result<Duration> {
        let request = LookupRequest {
            image: IMAGE.into(),
            ..Default::default()
        };
        let deadline = started + Duration::from_secs(60);
        loop {
            if let Ok(answer) = unary::call::<_, LookupResponse>(
                &self.socket(),
                LOOKUP,
                &request,
                Duration::from_secs(30),
            ) {
                ensure!(
                    !answer.credentials.is_empty(),
                    "no credential: {:?}",
                    answer.failures
                );
                return Ok(started.elapsed());
            }
            ensure!(
                Instant::now() < deadline,
                "an agent did not answer within 60 s"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// SIGTERM, and the exit (its last save included).
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let _ = credgate_testbed::wait_for_exit(&mut child, Duration::from_secs(20));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn runs(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

pub fn rollout(args: &Args) -> Result<()> {
    let credgate = crate::sibling("credgate")?;
    let agents = args.n.max(1);
    let waves = args.reps.clamp(1, agents);
    for persist in [true, false] {
        let dir = TempDir::new(&format!("rollout-{persist}"))?;
        let d = &dir.0;
        let script = format!(
            "cat >/dev/null\necho run >> '{}'\necho '{{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"12h\",\"auth\":{{\"rollout.example.com\":{{\"username\":\"u\",\"password\":\"rollout-secret\"}}}}}}'\n",
            d.join("runs").display()
        );
        let (bin, config) =
            crate::shell_provider(d, "counted", &script, "rollout.example.com", "1h")?;
        use std::os::unix::fs::PermissionsExt;
        let mut nodes: Vec<Node> = (0..agents)
            .map(|i| {
                let dir = d.join(format!("a{i}"));
                std::fs::create_dir_all(&dir)?;
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
                Ok(Node { dir, child: None })
            })
            .collect::<Result<_>>()?;
        for n in &mut nodes {
            n.start(&credgate, &config, &bin, persist)?;
        }
        for n in &nodes {
            n.first_answer(Instant::now())?;
        }
        let initial = runs(d);
        // Let the savers write (every second).
        std::thread::sleep(Duration::from_millis(1500));
        let mut per_wave = Vec::new();
        let mut first = Vec::new();
        for wave in nodes.chunks_mut(agents.div_ceil(waves)) {
            let before = runs(d);
            for n in wave.iter_mut() {
                n.stop();
            }
            let mut starts = Vec::new();
            for n in wave.iter_mut() {
                starts.push(Instant::now());
                n.start(&credgate, &config, &bin, persist)?;
            }
            for (n, started) in wave.iter().zip(starts) {
                first.push(n.first_answer(started)?);
            }
            per_wave.push(runs(d) - before);
        }
        for n in &mut nodes {
            n.stop();
        }
        let (p50, max) = (
            percentile(&mut first, 0.5),
            *first.iter().max().unwrap_or(&Duration::ZERO),
        );
        emit(
            args,
            json!({
                "scenario": "rollout", "persist_cache": persist, "agents": agents,
                "waves": per_wave.len(), "initial_runs": initial,
                "runs_per_wave": per_wave,
                "runs_in_waves": per_wave.iter().sum::<usize>(),
                "first_answer_p50_ms": ms(p50), "first_answer_max_ms": ms(max),
            }),
        );
    }
    Ok(())
}
