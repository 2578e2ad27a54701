//! Registries on loopback that a pod author controls, for the CRI soak: one that never
//! answers, one whose error bodies carry forged log lines, and one that accepts any
//! credential (a front of the real registry that serves its one image under every name).
//! Each serves until `stop`, a thread per connection, every read bounded.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// What a forged line starts with: a line of the agent's log that begins with it was forged.
pub const FORGED: &str = "FORGED-LINE level=INFO msg=pull image=registry.example.com/ok";

/// How a registry answers.
#[derive(Clone)]
pub enum Kind {
    /// Reads the request and never answers.
    Stalling,
    /// `HEAD`: the manifest exists; `GET`: 403 with an error whose message holds a newline and
    /// a forged log line.
    Forging,
    /// Challenges a request without `Authorization` (Basic); forwards one with any credential
    /// to `upstream` with the real credential, every repository mapped to `team/app`.
    Accepting { upstream: String, basic: String },
}

/// A running registry; stops and joins its threads on drop.
pub struct Hostile {
    pub host: String,
    pub requests: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Hostile {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn start(kind: Kind) -> std::io::Result<Hostile> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let host = listener.local_addr()?.to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let requests = Arc::new(AtomicU64::new(0));
    let thread = {
        let (stop, requests) = (stop.clone(), requests.clone());
        std::thread::Builder::new()
            .name("hostile-registry".into())
            .spawn(move || serve(&listener, &kind, &stop, &requests))?
    };
    Ok(Hostile {
        host,
        requests,
        stop,
        thread: Some(thread),
    })
}

fn serve(listener: &TcpListener, kind: &Kind, stop: &Arc<AtomicBool>, requests: &Arc<AtomicU64>) {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((c, _)) if conns.len() < 256 => {
                let (kind, stop, requests) = (kind.clone(), stop.clone(), requests.clone());
                conns.push(std::thread::spawn(move || {
                    let _ = c.set_nonblocking(false);
                    let _ = c.set_read_timeout(Some(Duration::from_millis(500)));
                    let _ = c.set_write_timeout(Some(Duration::from_secs(5)));
                    connection(c, &kind, &stop, &requests);
                }));
            }
            Ok(_) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
        conns.retain(|t| !t.is_finished());
    }
    for t in conns {
        let _ = t.join();
    }
}

/// One request's head (at most 16 KiB), or `None` once the peer is gone or `stop` is set.
fn head(c: &mut TcpStream, stop: &AtomicBool) -> Option<String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if stop.load(Ordering::Relaxed) || buf.len() > 16 << 10 {
            return None;
        }
        match c.read(&mut byte) {
            Ok(0) => return None,
            Ok(_) => buf.push(byte[0]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return None,
        }
    }
    String::from_utf8(buf).ok()
}

fn connection(mut c: TcpStream, kind: &Kind, stop: &AtomicBool, requests: &AtomicU64) {
    while let Some(head) = head(&mut c, stop) {
        requests.fetch_add(1, Ordering::Relaxed);
        let ok = match kind {
            Kind::Stalling => {
                // Held, unanswered, until the client gives up or the soak ends.
                while !stop.load(Ordering::Relaxed) {
                    match c.read(&mut [0u8; 512]) {
                        Ok(0) => return,
                        Ok(_) => {}
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) => {}
                        Err(_) => return,
                    }
                }
                return;
            }
            Kind::Forging => forge(&mut c, &head),
            Kind::Accepting { upstream, basic } => accept(&mut c, &head, upstream, basic),
        };
        if !ok {
            return;
        }
    }
}

fn forge(c: &mut TcpStream, head: &str) -> bool {
    if head.starts_with("HEAD ") {
        // The reference resolves, so that the client fetches the manifest and reads the
        // error's body (containerd puts its message into the pull's error).
        let digest = format!("sha256:{:064x}", 0xf0f0_u32);
        return write!(
            c,
            "HTTP/1.1 200 OK\r\nDocker-Content-Digest: {digest}\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\nContent-Length: 100\r\n\r\n"
        )
        .is_ok();
    }
    let body = serde_json::json!({"errors": [{"code": "DENIED", "message": format!("denied\n{FORGED}\n"), "detail": format!("\r\n{FORGED}")}]})
        .to_string();
    write!(
        c,
        "HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .is_ok()
}

/// Answers one request as a registry that takes any credential; `false` when the connection
/// is done.
fn accept(c: &mut TcpStream, head: &str, upstream: &str, basic: &str) -> bool {
    let mut lines = head.split("\r\n");
    let request = lines.next().unwrap_or_default();
    let mut parts = request.split(' ');
    let (method, path) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let authorized = lines.any(|l| l.to_ascii_lowercase().starts_with("authorization:"));
    if !authorized {
        return c
            .write_all(b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"soak\"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            .is_ok();
    }
    // /v2/<any name>/(manifests|blobs)/<ref>: the real registry's one image.
    let path = path
        .rfind("/manifests/")
        .or_else(|| path.rfind("/blobs/"))
        .map_or_else(
            || path.to_owned(),
            |i| format!("/v2/team/app{}", &path[i..]),
        );
    let Ok(mut up) = TcpStream::connect(upstream) else {
        return false;
    };
    let _ = up.set_read_timeout(Some(Duration::from_secs(10)));
    let forwarded = format!(
        "{method} {path} HTTP/1.1\r\nHost: {upstream}\r\nAuthorization: Basic {basic}\r\nAccept: application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.v2+json, application/vnd.docker.distribution.manifest.list.v2+json, */*\r\nConnection: close\r\n\r\n"
    );
    if up.write_all(forwarded.as_bytes()).is_err() {
        return false;
    }
    // The answer as it comes, bounded; the client's connection closes after it.
    let _ = std::io::copy(&mut (&mut up).take(64 << 20), c);
    false
}
