//! Test fixtures with real processes: the agent (`credgate serve`), and from
//! `credgate-testbed` Debian's `docker-registry` on 127.0.0.1 and a small OCI image. Each
//! fixture owns its child and stops exactly that PID when dropped.

#![allow(dead_code)]

pub mod foreign;
pub use credgate_testbed::stub_registry;
pub mod token;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub use credgate_testbed::secrets;

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub fn write_script(path: &Path, body: &str) {
    std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The directory holding the workspace's binaries (the docker credential helper included).
pub fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_credgate"))
        .parent()
        .unwrap()
        .to_owned()
}

/// PATH with the workspace's binaries first, so clients find `docker-credential-credgate`.
/// The kubelet bridge under test: this build's, or the one `CREDGATE_TEST_BRIDGE` names
/// (`scripts/test` runs the bridge tests again with the static build of `cargo build-bridge`).
pub fn bridge_bin() -> PathBuf {
    std::env::var_os("CREDGATE_TEST_BRIDGE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_credgate-credential-provider")))
}

/// The kubelet bridge linked statically, as `cargo build-bridge` links it: scripts/test builds
/// it (in the test profile) before the suite and names it in CREDGATE_TEST_STATIC_BRIDGE.
pub fn static_bridge() -> PathBuf {
    match std::env::var_os("CREDGATE_TEST_STATIC_BRIDGE") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "CREDGATE_TEST_STATIC_BRIDGE is unset: run scripts/test, which builds the static bridge first (cargo rustc -p credgate --bin credgate-credential-provider -- -C target-feature=+crt-static)"
        ),
    }
}

pub fn path_with_helper() -> String {
    format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

fn signal(child: &Child, sig: i32) {
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("a child's pid");
    let sig = rustix::process::Signal::from_named_raw(sig).expect("a named signal");
    let _ = rustix::process::kill_process(pid, sig);
}

/// `credgate serve` as a child process.
pub struct Agent {
    pub child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Agent {
    /// Starts the agent with `args` on a socket in `dir` and waits until it accepts calls.
    pub fn start(dir: &Path, args: &[&str]) -> Agent {
        Self::start_in(Command::new(env!("CARGO_BIN_EXE_credgate")), dir, args)
    }

    /// As [`Agent::start`], with an open-file limit of `nofile` (soft and hard; `prlimit(1)`
    /// sets it and runs the agent in its place).
    pub fn start_with_nofile(dir: &Path, nofile: u64, args: &[&str]) -> Agent {
        let mut command = Command::new("prlimit");
        command
            .arg(format!("--nofile={nofile}:{nofile}"))
            .arg("--")
            .arg(env!("CARGO_BIN_EXE_credgate"));
        Self::start_in(command, dir, args)
    }

    /// As [`Agent::start`], with `env` added to the agent's environment.
    pub fn start_with_env(dir: &Path, env: &[(&str, &Path)], args: &[&str]) -> Agent {
        let mut command = Command::new(env!("CARGO_BIN_EXE_credgate"));
        command.envs(env.iter().copied());
        Self::start_in(command, dir, args)
    }

    fn start_in(mut command: Command, dir: &Path, args: &[&str]) -> Agent {
        let socket = dir.join("credgate.sock");
        let log = dir.join("agent.log");
        let child = command
            .arg("serve")
            .args(["--socket", socket.to_str().unwrap()])
            .args(["--state-dir", dir.join("state").to_str().unwrap()])
            .args((!args.contains(&"--docker-config")).then_some("--no-docker-config"))
            .args(args)
            // Every line at every level, so that the tests' "no secret in the log" checks cover
            // trace output of credgate and of every library it uses.
            .env("CREDGATE_LOG", "trace")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("credgate serve starts");
        let mut agent = Agent { child, socket, log };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&agent.socket).is_err() {
            if let Some(status) = agent.child.try_wait().unwrap() {
                panic!("agent exited with {status}: {}", agent.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "agent did not come up: {}",
                agent.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        agent
    }

    /// A client of the agent's ImageAccess service on a fresh connection.
    pub async fn image_access(
        &self,
    ) -> credgate_api::v1::image_access_client::ImageAccessClient<tonic::transport::Channel> {
        let channel = credgate_api::connect(&self.socket).await.unwrap();
        credgate_api::v1::image_access_client::ImageAccessClient::new(channel)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, sig: i32) {
        signal(&self.child, sig);
    }

    /// `credgate ARGS` against this agent.
    pub fn credgate(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_credgate"))
            .args(args)
            .env("CREDGATE_SOCKET", &self.socket)
            .env_remove("CREDGATE_LOG")
            .output()
            .unwrap()
    }

    /// `docker-credential-credgate get` with `host` on stdin.
    pub fn helper_get(&self, host: &str) -> Output {
        helper_get(&self.socket, host)
    }

    /// SIGTERM, then the exit status.
    pub fn stop(mut self) -> std::process::ExitStatus {
        self.signal(libc::SIGTERM);
        let status = wait_for_exit(&mut self.child, Duration::from_secs(20));
        status.expect("agent stops on SIGTERM")
    }
}

impl Drop for Agent {
    /// Stops the agent, then fails the test if a secret it handed out is in the agent's log
    /// (every level: the agent runs with `CREDGATE_LOG=trace`).
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        secrets::check("the agent's log", &self.log_text());
    }
}

/// `credgate serve` with the CRI proxy on `dir/cri.sock` in front of the runtime at `runtime`
/// (and `more` flags), once the proxy's socket is there; the proxy's socket.
pub fn proxy_agent_with(dir: &Path, runtime: &Path, more: &[&str]) -> (Agent, PathBuf) {
    let proxy = dir.join("cri.sock");
    let runtime = format!("unix://{}", runtime.display());
    let mut args = vec![
        "--cri-proxy-socket",
        proxy.to_str().unwrap(),
        "--cri-runtime-endpoint",
        &runtime,
    ];
    args.extend_from_slice(more);
    let agent = Agent::start(dir, &args);
    // Accepting, not merely there: a socket left by an agent that was killed stays on disk
    // until the next one replaces it.
    credgate_testbed::eventually("the CRI proxy comes up", Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&proxy).is_ok()
    });
    (agent, proxy)
}

/// A fake container runtime answering as `answers` says, at `dir/fake-runtime.sock`, and
/// `credgate serve` with the CRI proxy in front of it (and `more` flags): the runtime (stopped
/// when dropped), the agent and the proxy's socket.
pub async fn fake_runtime_agent(
    dir: &Path,
    answers: credgate_testbed::fake_runtime::Answers,
    more: &[&str],
) -> (credgate_testbed::fake_runtime::FakeRuntime, Agent, PathBuf) {
    let runtime = dir.join("fake-runtime.sock");
    let fake = credgate_testbed::fake_runtime::start(&runtime, answers).await;
    let (agent, proxy) = proxy_agent_with(dir, &runtime, more);
    (fake, agent, proxy)
}

pub use credgate_testbed::docker_config;

/// A loopback registry whose one user is `user`:`password`, holding `team/app:v1`, and
/// containerd (a private root in `dir`) trusting it.
pub fn registry_and_containerd(
    dir: &Path,
    user: &str,
    password: &str,
) -> (Registry, credgate_testbed::Containerd) {
    let registry = Registry::start(dir, user, password);
    oci_image(dir);
    push(dir, &registry, "team/app", user, password);
    let containerd = credgate_testbed::Containerd::start(dir, &[registry.host()]);
    (registry, containerd)
}

/// A Watch stream of `refs` on the agent's socket.
pub async fn watch(
    socket: &Path,
    refs: &[String],
) -> tonic::Streaming<credgate_api::v1::WatchEvent> {
    let channel = credgate_api::connect(socket).await.unwrap();
    credgate_api::v1::credentials_client::CredentialsClient::new(channel)
        .watch(credgate_api::v1::WatchRequest {
            refs: refs.to_vec(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// The next event of a Watch stream, within 20 s.
pub async fn next_event(
    stream: &mut tonic::Streaming<credgate_api::v1::WatchEvent>,
) -> credgate_api::v1::WatchEvent {
    tokio::time::timeout(Duration::from_secs(20), stream.message())
        .await
        .expect("a Watch event in time")
        .expect("the stream stays up")
        .expect("an event")
}

pub fn proxy_agent(dir: &Path, runtime: &Path) -> (Agent, PathBuf) {
    proxy_agent_with(dir, runtime, &[])
}

pub fn helper_get(socket: &Path, input: impl AsRef<[u8]>) -> Output {
    output_with_stdin(
        Command::new(env!("CARGO_BIN_EXE_docker-credential-credgate"))
            .arg("get")
            .env("CREDGATE_SOCKET", socket)
            .stderr(Stdio::piped()),
        input.as_ref(),
    )
}

/// Runs `cmd` with `input` on its stdin and its stdout captured.
pub fn output_with_stdin(cmd: &mut Command, input: &[u8]) -> Output {
    use std::io::Write;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // The command may stop reading early (the helper does on oversized input): a broken pipe
    // here is its answer.
    let _ = child.stdin.take().unwrap().write_all(input);
    child.wait_with_output().unwrap()
}

#[allow(unused_imports)]
pub use credgate_testbed::{oci_image, push, require, wait_for_exit, Registry};

/// For tests of Debian's containerd (marked `#[ignore = "needs root"]`, which nextest reports
/// skipped): fail, never pass, when run without root or containerd.
pub fn needs_containerd() {
    if let Some(why) = credgate_testbed::Containerd::unavailable() {
        panic!("{why}: run as root with containerd installed, as scripts/test does");
    }
}

/// A registry in `dir` that trusts the tokens of `tokens`.
pub fn registry_with_tokens(dir: &Path, tokens: &token::TokenServer) -> Registry {
    Registry::with_auth(
        dir,
        &format!(
            "  token:\n    realm: {}\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
            tokens.realm(),
            token::SERVICE,
            token::ISSUER,
            tokens.cert.display()
        ),
    )
}

/// `skopeo inspect --raw` of `image` with `authfile`, helpers found on PATH.
pub fn skopeo_inspect(authfile: &Path, image: &str, socket: &Path) -> Output {
    Command::new("timeout")
        .args([
            "60",
            "skopeo",
            "inspect",
            "--tls-verify=false",
            "--authfile",
        ])
        .arg(authfile)
        .arg(format!("docker://{image}"))
        .env("PATH", path_with_helper())
        .env("CREDGATE_SOCKET", socket)
        .output()
        .unwrap()
}

/// A free loopback port (bound and released: a test's listener takes it right after).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Builds the credgate image (`scripts/image` with this build's binaries) as `tag` in a podman
/// storage of its own under `storage` (vfs; the machine's may hold another user's, another
/// driver's state), and returns the podman options that name that storage.
pub fn credgate_image(storage: &Path, tag: &str) -> Vec<String> {
    let options = vec![
        "--storage-driver".to_owned(),
        "vfs".to_owned(),
        "--root".to_owned(),
        storage.join("root").display().to_string(),
        "--runroot".to_owned(),
        storage.join("runroot").display().to_string(),
    ];
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let built = Command::new(repo.join("scripts/image"))
        .arg(bin_dir())
        .arg(tag)
        .env("BRIDGE", static_bridge())
        .env("PODMAN_OPTS", options.join(" "))
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "scripts/image: {}",
        text(&built.stderr)
    );
    options
}
