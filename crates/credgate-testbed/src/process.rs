//! Child processes: required tools, commands that must succeed, and containerd.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Panics with the package to install when `tool` is not on PATH.
pub fn require(tool: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        found,
        "{tool} is required: apt-get install -y docker-registry skopeo apache2-utils containerd (scripts/test does this as root)"
    );
}

/// Runs `cmd`; panics with its output when it fails.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Sends `signal` to our own child.
pub(crate) fn signal(child: &Child, signal: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// Waits for a child with a deadline; kills it when the deadline passes.
pub fn wait_for_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Debian's containerd with its CRI plugin, in `dir/containerd`.
pub struct Containerd {
    child: Child,
    /// Its CRI (and containerd) socket.
    pub socket: PathBuf,
    /// Its registry `config_path` (a `hosts.toml` per registry).
    pub certs: PathBuf,
    /// Its `ctr` (beside the binary, or on PATH for Debian's).
    ctr: PathBuf,
}

impl Containerd {
    /// Why containerd cannot run here (not root, not installed), when it cannot.
    pub fn unavailable() -> Option<&'static str> {
        if !rustix::process::geteuid().is_root() {
            return Some("containerd needs root");
        }
        if Command::new("containerd")
            .arg("--version")
            .output()
            .is_err()
        {
            return Some("containerd is not installed (apt-get install containerd)");
        }
        None
    }

    /// Starts containerd in `dir/containerd`; `registry_hosts` are plain-HTTP registries
    /// (`127.0.0.1:PORT`) it may pull from.
    pub fn start(dir: &Path, registry_hosts: &[String]) -> Containerd {
        Self::start_binary(Path::new("containerd"), dir, registry_hosts)
    }

    /// containerd 2.x at `CREDGATE_TEST_CONTAINERD2` (scripts/test builds containerd 2.4 from the
    /// module in scripts/node-tools and sets it), or why it cannot run.
    pub fn v2_binary() -> Result<PathBuf, String> {
        let path = std::env::var_os("CREDGATE_TEST_CONTAINERD2").map(PathBuf::from).ok_or_else(|| {
            "CREDGATE_TEST_CONTAINERD2 is not set: scripts/test builds containerd 2.4 (scripts/node-tools/build containerd) and sets it".to_owned()
        })?;
        if !path.is_file() {
            return Err(format!(
                "CREDGATE_TEST_CONTAINERD2={} is not a file",
                path.display()
            ));
        }
        Ok(path)
    }

    /// The containerd at `binary` (1.x or 2.x: its config is written in the version it
    /// reads), in `dir`, trusting `registry_hosts` over plain HTTP.
    pub fn start_binary(binary: &Path, dir: &Path, registry_hosts: &[String]) -> Containerd {
        let base = dir.join("containerd");
        let certs = base.join("certs.d");
        std::fs::create_dir_all(&certs).unwrap();
        for host in registry_hosts {
            std::fs::create_dir_all(certs.join(host)).unwrap();
            std::fs::write(
                certs.join(host).join("hosts.toml"),
                format!("server = \"http://{host}\"\n[host.\"http://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"),
            )
            .unwrap();
        }
        let socket = base.join("containerd.sock");
        let config = base.join("config.toml");
        let v2 = Command::new(binary)
            .arg("--version")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(" 2."));
        let text = if v2 {
            // containerd 2.x reads version 3: the CRI's image service is a plugin of its own.
            format!(
                "version = 3\nroot = \"{b}/root\"\nstate = \"{b}/state\"\n[grpc]\n  address = \"{s}\"\n[plugins.\"io.containerd.cri.v1.images\"]\n  snapshotter = \"native\"\n[plugins.\"io.containerd.cri.v1.images\".registry]\n  config_path = \"{c}\"\n[plugins.\"io.containerd.cri.v1.runtime\".cni]\n  bin_dirs = [\"{b}/cni\"]\n  conf_dir = \"{b}/cni.d\"\n[[plugins.\"io.containerd.transfer.v1.local\".unpack_config]]\n  platform = \"linux/{arch}\"\n  snapshotter = \"native\"\n",
                b = base.display(),
                s = socket.display(),
                c = certs.display(),
                // The CRI pulls through the transfer service, which unpacks only for the
                // platforms and snapshotters it is given.
                arch = match std::env::consts::ARCH {
                    "x86_64" => "amd64",
                    "aarch64" => "arm64",
                    other => other,
                },
            )
        } else {
            format!(
                "version = 2\nroot = \"{b}/root\"\nstate = \"{b}/state\"\n[grpc]\n  address = \"{s}\"\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"native\"\n[plugins.\"io.containerd.grpc.v1.cri\".registry]\n  config_path = \"{c}\"\n[plugins.\"io.containerd.grpc.v1.cri\".cni]\n  bin_dir = \"{b}/cni\"\n  conf_dir = \"{b}/cni.d\"\n",
                b = base.display(),
                s = socket.display(),
                c = certs.display(),
            )
        };
        std::fs::write(&config, text).unwrap();
        let child = Command::new(binary)
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(base.join("log")).unwrap())
            .spawn()
            .expect("containerd starts");
        eventually("containerd comes up", Duration::from_secs(30), || {
            socket.exists()
        });
        let ctr = binary
            .parent()
            .map(|d| d.join("ctr"))
            .filter(|c| c.is_file())
            .unwrap_or_else(|| PathBuf::from("ctr"));
        Containerd {
            child,
            socket,
            certs,
            ctr,
        }
    }

    /// `ctr -n k8s.io ARGS` on this containerd (what an operator does behind the CRI's back).
    pub fn ctr(&self, args: &[&str]) -> Output {
        run(Command::new(&self.ctr)
            .arg("--address")
            .arg(&self.socket)
            .args(["-n", "k8s.io"])
            .args(args))
    }

    /// Makes containerd try `mirror` (a plain-HTTP `127.0.0.1:PORT`) before `registry` itself
    /// for images of `registry`, as an operator's hosts.toml does; containerd reads the file
    /// at each pull.
    pub fn set_mirror(&self, registry: &str, mirror: &str) {
        std::fs::write(
            self.certs.join(registry).join("hosts.toml"),
            format!("server = \"http://{registry}\"\n[host.\"http://{mirror}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"),
        )
        .unwrap();
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// For a test marked `#[ignore = "needs root"]`: panics unless this process is root, so that
/// running ignored tests elsewhere fails loudly instead of passing. `scripts/test` runs them
/// (`--run-ignored all`) when it runs as root; otherwise nextest reports them skipped.
pub fn require_root(why: &str) {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test needs root ({why}): run it as root, as scripts/test does"
    );
}

/// Polls `done` every few milliseconds until it holds; panics naming `what` if it does not
/// within `limit`. For waiting on another process or thread instead of sleeping a guess.
pub fn eventually(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// [`eventually`] for async tests, with a condition that may await (a call to the agent, say;
/// `|| std::future::ready(cond())` for one that does not). Time is tokio's, for the deadline
/// as for the pauses, so that a test on a paused clock advances to it instead of spinning.
pub async fn eventually_async<F, Fut>(what: &str, limit: Duration, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
