//! gRPC clients credgate did not write: a grpc-go program (`tests/clients/grpccall.go`, built
//! from Debian's golang-go and golang-google-grpc-dev in GOPATH mode, offline) and a Python
//! grpcio script (`tests/clients/grpccall.py`, grpcio from PyPI). Both make one call with raw
//! protobuf bytes and print the status code, message and responses; `scripts/test` installs
//! what they need, and a test that uses them fails (never passes) when it is missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use std::io::Write;

/// How the grpc-go client dials, as the kubelet does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dial {
    /// The socket's path as the target, with a context dialer: `:authority` is the path
    /// (the kubelet and crictl up to 1.30).
    Path,
    /// The same with `grpc.WithAuthority("localhost")` (1.31 and later).
    Localhost,
}

impl Dial {
    pub const ALL: [Dial; 2] = [Dial::Path, Dial::Localhost];
    fn flag(self) -> &'static str {
        match self {
            Dial::Path => "path",
            Dial::Localhost => "localhost",
        }
    }
}

/// What a client got back from one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The gRPC status code (0 when the call succeeded).
    pub code: u32,
    pub message: String,
    /// Each response message's bytes.
    pub responses: Vec<Vec<u8>>,
}

impl Answer {
    /// The first response, decoded.
    pub fn decode<M: prost::Message + Default>(&self) -> M {
        assert_eq!(self.code, 0, "{self:?}");
        M::decode(&self.responses[0][..]).expect("a response of the expected type")
    }
}

fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients")
}

/// Builds the grpc-go client into `dir` (Go's build cache under the target directory makes a
/// second build a link).
pub fn build_go(dir: &Path) -> PathBuf {
    build_go_program(dir, "grpccall")
}

/// Builds `tests/clients/NAME.go` into `dir/NAME` against Debian's Go packages.
pub fn build_go_program(dir: &Path, name: &str) -> PathBuf {
    credgate_testbed::require("go");
    let gopath = Path::new("/usr/share/gocode");
    assert!(
        gopath.join("src/google.golang.org/grpc").is_dir(),
        "grpc-go is required: apt-get install -y golang-go golang-google-grpc-dev (scripts/test does this as root)"
    );
    let out = dir.join(name);
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("go-build-cache");
    credgate_testbed::run(
        Command::new("go")
            .args(["build", "-o"])
            .arg(&out)
            .arg(clients_dir().join(format!("{name}.go")))
            .env("GOPATH", gopath)
            .env("GO111MODULE", "off")
            .env("GOFLAGS", "")
            .env("GOCACHE", &cache)
            .env("GOPROXY", "off")
            .current_dir(dir),
    );
    out
}

/// Calls `method` on `socket` with grpc-go: unary, or reading `stream` messages.
pub fn go_call(
    go: &Path,
    dial: Dial,
    socket: &Path,
    method: &str,
    request: &[u8],
    stream: usize,
) -> Answer {
    let mut cmd = Command::new(go);
    cmd.arg("-socket")
        .arg(socket)
        .args(["-dial", dial.flag(), "-method", method, "-timeout", "60"])
        .args(["-stream", &stream.to_string()]);
    run_client(cmd, request)
}

/// Calls `method` on `socket` with Python grpcio's default channel: unary, or reading `stream`
/// messages within `timeout` seconds.
pub fn python_call(
    socket: &Path,
    method: &str,
    request: &[u8],
    stream: usize,
    timeout: u32,
) -> Answer {
    let found = Command::new("python3")
        .args(["-c", "import grpc"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "Python grpcio is required: pip install grpcio (scripts/test does this)"
    );
    let mut cmd = Command::new("python3");
    cmd.arg(clients_dir().join("grpccall.py"))
        .arg(socket)
        .arg(method)
        .args([
            "--stream",
            &stream.to_string(),
            "--timeout",
            &timeout.to_string(),
        ]);
    run_client(cmd, request)
}

pub fn run_client(mut cmd: Command, request: &[u8]) -> Answer {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(request).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    Answer {
        code: v["code"].as_u64().unwrap() as u32,
        message: v["message"].as_str().unwrap().to_owned(),
        responses: v["responses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| hex::decode(r.as_str().unwrap()).unwrap())
            .collect(),
    }
}
