//! gRPC clients credgate did not write: grpc-go (`tests/clients/grpccall`), the kubelet's own
//! CRI client k8s.io/cri-client (`tests/clients/criclient`), both Go programs of one module
//! whose go.mod/go.sum pin today's versions, built by `scripts/node-tools/build` (Go 1.26
//! from the module proxy, cached outside the repository); and a Python grpcio script
//! (`tests/clients/grpccall.py`, grpcio from PyPI). They print the status code, message and
//! responses as JSON; `scripts/test` builds and installs what they need, and a test that uses
//! them fails (never passes) when it is missing.

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

/// The grpc-go client.
pub fn build_go() -> PathBuf {
    build_go_program("grpccall")
}

/// The program `tests/clients/NAME` at the versions the module pins: built once by
/// `scripts/node-tools/build` (a second call finds it in the cache).
pub fn build_go_program(name: &str) -> PathBuf {
    built(&clients_dir().display().to_string()).join(name)
}

/// The directory of a module's programs built by `scripts/node-tools/build MODULE` (a name
/// under scripts/node-tools, or a path), built once and cached outside the repository.
pub fn built(module: &str) -> PathBuf {
    let build = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/node-tools/build");
    let out = Command::new(build)
        .arg(module)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{module} did not build (Go 1.26 and the Go module proxy are required): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = String::from_utf8(out.stdout).unwrap();
    PathBuf::from(dir.trim())
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
