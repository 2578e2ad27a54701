//! Test fixtures with real processes: the agent (`credgate serve`) and Debian's
//! `docker-registry` on 127.0.0.1 with htpasswd auth. Each fixture owns its child and stops
//! exactly that PID when dropped.

#![allow(dead_code)]

pub mod token;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

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
pub fn path_with_helper() -> String {
    format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's PID.
    unsafe {
        libc::kill(child.id() as i32, sig);
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

/// `credgate serve` as a child process.
pub struct Agent {
    pub child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Agent {
    /// Starts the agent with `args` on a socket in `dir` and waits until it accepts calls.
    pub fn start(dir: &Path, args: &[&str]) -> Agent {
        let socket = dir.join("credgate.sock");
        let log = dir.join("agent.log");
        let child = Command::new(env!("CARGO_BIN_EXE_credgate"))
            .arg("serve")
            .args(["--socket", socket.to_str().unwrap()])
            .args(["--state-dir", dir.join("state").to_str().unwrap()])
            .arg("--no-docker-config")
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
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
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

/// Debian's `docker-registry` (distribution 2.8) on 127.0.0.1 with htpasswd auth.
pub struct Registry {
    child: Child,
    config: PathBuf,
    pub port: u16,
}

pub fn require(tool: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        found,
        "{tool} is required by the end-to-end tests: apt-get install -y docker-registry skopeo apache2-utils (scripts/test does this as root)"
    );
}

impl Registry {
    /// Starts a registry in `dir` that trusts the tokens of `tokens`.
    pub fn start_with_tokens(dir: &Path, tokens: &token::TokenServer) -> Registry {
        require("docker-registry");
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:0\nauth:\n  token:\n    realm: {}\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
                dir.join("data").display(),
                tokens.realm(),
                token::SERVICE,
                token::ISSUER,
                tokens.cert.display()
            ),
        )
        .unwrap();
        Self::spawn(&config)
    }

    /// Starts a registry in `dir` whose only user is `user`:`password`.
    pub fn start(dir: &Path, user: &str, password: &str) -> Registry {
        require("docker-registry");
        require("htpasswd");
        let htpasswd = dir.join("htpasswd");
        let status = Command::new("htpasswd")
            .args(["-cbB", "-C", "4"])
            .arg(&htpasswd)
            .args([user, password])
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:0\nauth:\n  htpasswd:\n    realm: credgate-test\n    path: {}\n",
                dir.join("data").display(),
                htpasswd.display()
            ),
        )
        .unwrap();
        Self::spawn(&config)
    }

    fn spawn(config: &Path) -> Registry {
        let mut child = Command::new("docker-registry")
            .arg("serve")
            .arg(config)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("docker-registry starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(i) = line.find("listening on 127.0.0.1:") {
                    let rest = &line[i + "listening on 127.0.0.1:".len()..];
                    let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(port.parse::<u16>().unwrap());
                    }
                }
            }
        });
        let port = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("registry reports its port");
        Registry {
            child,
            config: config.to_path_buf(),
            port,
        }
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Stops the registry now (SIGTERM, waited for).
    pub fn stop(&mut self) {
        signal(&self.child, libc::SIGTERM);
        let _ = wait_for_exit(&mut self.child, Duration::from_secs(5));
    }

    /// Kills the registry outright (SIGKILL, waited for): connections die mid-request.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the registry again on the same port with the same storage and auth.
    pub fn restart(&mut self) {
        let config = std::fs::read_to_string(&self.config).unwrap().replace(
            "addr: 127.0.0.1:0\n",
            &format!("addr: 127.0.0.1:{}\n", self.port),
        );
        std::fs::write(&self.config, config).unwrap();
        let again = Self::spawn(&self.config);
        assert_eq!(again.port, self.port);
        *self = again;
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        signal(&self.child, libc::SIGTERM);
        if wait_for_exit(&mut self.child, Duration::from_secs(5)).is_none() {
            let _ = self.child.kill();
        }
    }
}

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// Writes a one-layer OCI image layout at `dir` (tag `v1`), deterministic bytes.
pub fn oci_image(dir: &Path) {
    let rootfs = dir.join("rootfs");
    std::fs::create_dir_all(&rootfs).unwrap();
    std::fs::write(rootfs.join("hello.txt"), "hello from credgate\n").unwrap();
    let blobs = dir.join("layout/blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let tar = dir.join("layer.tar");
    run(Command::new("tar")
        .args([
            "--sort=name",
            "--mtime=@0",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "-cf",
        ])
        .arg(&tar)
        .arg("-C")
        .arg(&rootfs)
        .arg("."));
    let tar_bytes = std::fs::read(&tar).unwrap();
    let gz = run(Command::new("gzip").args(["-n", "-c"]).arg(&tar)).stdout;
    let put = |bytes: &[u8]| {
        let hex = sha256_hex(bytes);
        std::fs::write(blobs.join(&hex), bytes).unwrap();
        (format!("sha256:{hex}"), bytes.len())
    };
    let (layer, layer_size) = put(&gz);
    let config = format!(
        r#"{{"architecture":"amd64","os":"linux","config":{{}},"rootfs":{{"type":"layers","diff_ids":["sha256:{}"]}}}}"#,
        sha256_hex(&tar_bytes)
    );
    let (config_digest, config_size) = put(config.as_bytes());
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config_digest}","size":{config_size}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{layer}","size":{layer_size}}}]}}"#
    );
    let (manifest_digest, manifest_size) = put(manifest.as_bytes());
    std::fs::write(
        dir.join("layout/index.json"),
        format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{manifest_digest}","size":{manifest_size},"annotations":{{"org.opencontainers.image.ref.name":"v1"}}}}]}}"#
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("layout/oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
}

/// Pushes the layout at `dir/layout` to `registry` as `repo:v1` with skopeo.
pub fn push(dir: &Path, registry: &Registry, repo: &str, user: &str, password: &str) {
    require("skopeo");
    run(Command::new("skopeo")
        .args(["copy", "--dest-tls-verify=false", "--dest-creds"])
        .arg(format!("{user}:{password}"))
        .arg(format!("oci:{}:v1", dir.join("layout").display()))
        .arg(format!("docker://{}/{repo}:v1", registry.host())));
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
