//! The soak's adversarial phase: what a hostile local client does to the agent, each part
//! bounded in count and time and aimed only at the agent's own socket and at a "registry" on
//! loopback that this program serves itself.
//!
//! - idle connections: silent connections held open up to a count, reopened when the agent
//!   closes them (its handshake deadline);
//! - oversized requests: `Lookup` calls with a 1 MiB image;
//! - non-reading watches: connections with many `Watch` streams that announce a huge window and
//!   never read;
//! - a token endpoint that streams without end, which `Verify` calls are pointed at.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use credgate_api::frame::{put as frame, DATA, END_HEADERS, END_STREAM, HEADERS};
use credgate_api::unary::{grpc_message, request_head};
use credgate_api::v1::{self as pb};
use prost::Message;

/// How hard to push.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Silent connections held open.
    pub idle: usize,
    /// Connections of non-reading Watch streams, and streams on each.
    pub watch_connections: usize,
    pub watch_streams: u32,
    /// Refs each Watch stream asks for.
    pub refs: Vec<String>,
    /// Threads sending oversized requests, and threads calling Verify.
    pub oversized: usize,
    pub verifiers: usize,
    /// No part runs past this, whatever happens.
    pub limit: Duration,
}

/// What the attack did.
#[derive(Debug, Default)]
pub struct Counts {
    pub idle_opened: AtomicU64,
    pub watch_connections_opened: AtomicU64,
    pub oversized_sent: AtomicU64,
    pub verify_calls: AtomicU64,
    pub token_bytes_served: AtomicU64,
}

/// The counts as JSON.
pub fn counts_json(c: &Counts) -> serde_json::Value {
    serde_json::json!({
        "idle_opened": c.idle_opened.load(Ordering::Relaxed),
        "watch_connections_opened": c.watch_connections_opened.load(Ordering::Relaxed),
        "oversized_sent": c.oversized_sent.load(Ordering::Relaxed),
        "verify_calls": c.verify_calls.load(Ordering::Relaxed),
        "token_bytes_served": c.token_bytes_served.load(Ordering::Relaxed),
    })
}

/// A running attack; stops and joins every thread on [`Attack::stop`] (or on drop).
pub struct Attack {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    pub counts: Arc<Counts>,
}

impl Attack {
    pub fn stop(mut self) -> Arc<Counts> {
        self.halt();
        self.counts.clone()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Attack {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Starts every part of the attack against the agent at `socket`.
pub fn start(socket: &Path, plan: &Plan) -> std::io::Result<Attack> {
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    let until = Instant::now() + plan.limit;
    let running = {
        let stop = stop.clone();
        move || !stop.load(Ordering::Relaxed) && Instant::now() < until
    };
    let mut threads = Vec::new();
    let spawn = |threads: &mut Vec<JoinHandle<()>>, name: &str, f: Box<dyn FnOnce() + Send>| {
        threads.push(
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .expect("a thread starts"),
        );
    };

    // Idle connections, reopened as the agent closes them.
    {
        let (socket, n, counts, running) = (
            socket.to_owned(),
            plan.idle,
            counts.clone(),
            running.clone(),
        );
        let idle = move || idle_loop(&socket, n, &counts, &running);
        spawn(&mut threads, "idle", Box::new(idle));
    }
    // Non-reading Watch streams.
    {
        let (socket, counts, running) = (socket.to_owned(), counts.clone(), running.clone());
        let (conns, streams) = (plan.watch_connections, plan.watch_streams);
        let watch = pb::WatchRequest {
            refs: plan.refs.clone(),
        };
        let watchers = move || watch_loop(&socket, &watch, (conns, streams), &counts, &running);
        spawn(&mut threads, "watchers", Box::new(watchers));
    }
    // Oversized requests.
    for i in 0..plan.oversized {
        let (socket, counts, running) = (socket.to_owned(), counts.clone(), running.clone());
        let oversized = move || oversized_loop(&socket, &counts, &running);
        spawn(&mut threads, &format!("oversized-{i}"), Box::new(oversized));
    }

    // A token endpoint that streams without end, and Verify calls pointed at it.
    if plan.verifiers > 0 {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        {
            let (counts, running) = (counts.clone(), running.clone());
            spawn(
                &mut threads,
                "registry",
                Box::new(move || endless_registry(&listener, port, &counts, &running)),
            );
        }
        for i in 0..plan.verifiers {
            let (socket, counts, running) = (socket.to_owned(), counts.clone(), running.clone());
            spawn(
                &mut threads,
                &format!("verify-{i}"),
                Box::new(move || verify_loop(&socket, port, &counts, &running)),
            );
        }
    }

    Ok(Attack {
        stop,
        threads,
        counts,
    })
}

/// Holds `n` silent connections, opening new ones as the agent closes them.
fn idle_loop(socket: &Path, n: usize, counts: &Counts, running: &dyn Fn() -> bool) {
    let mut held: Vec<UnixStream> = Vec::new();
    while running() {
        held.retain(|c| !closed_by_peer(c));
        while held.len() < n {
            match UnixStream::connect(socket) {
                Ok(c) => {
                    let _ = c.set_nonblocking(true);
                    counts.idle_opened.fetch_add(1, Ordering::Relaxed);
                    held.push(c);
                }
                Err(_) => break,
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Holds `conns` connections of `streams` Watch streams each that never read, opening new
/// ones as the agent closes them.
fn watch_loop(
    socket: &Path,
    watch: &pb::WatchRequest,
    (conns, streams): (usize, u32),
    counts: &Counts,
    running: &dyn Fn() -> bool,
) {
    let mut held: Vec<UnixStream> = Vec::new();
    while running() {
        held.retain(|c| !closed_by_peer_without_reading(c));
        while held.len() < conns {
            let Ok(mut c) = UnixStream::connect(socket) else {
                break;
            };
            if c.write_all(&watch_streams(watch, streams)).is_err() {
                break;
            }
            let _ = c.set_nonblocking(true);
            counts
                .watch_connections_opened
                .fetch_add(1, Ordering::Relaxed);
            held.push(c);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Sends a Lookup of over 1 MiB on a new connection every 20 ms.
fn oversized_loop(socket: &Path, counts: &Counts, running: &dyn Fn() -> bool) {
    let request = pb::LookupRequest {
        image: format!("soak.test/{}", "a".repeat(1 << 20)),
        ..Default::default()
    };
    let bytes = one_call(credgate_api::methods::LOOKUP, &request);
    while running() {
        if let Ok(mut c) = UnixStream::connect(socket) {
            let _ = c.set_write_timeout(Some(Duration::from_secs(2)));
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = c.write_all(&bytes);
            let _ = c.read(&mut [0u8; 4096]);
            counts.oversized_sent.fetch_add(1, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the agent closed `c` (reads reach the end); what it sent is read and dropped.
pub(crate) fn closed_by_peer(c: &UnixStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match (&*c).read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// Whether the agent closed `c`, without reading what it sent (the point of a non-reading
/// client): the socket's hang-up state, polled without waiting.
fn closed_by_peer_without_reading(c: &UnixStream) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(c, PollFlags::RDHUP)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&now)) {
        Ok(_) => fds[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR),
        Err(_) => true,
    }
}

fn verify_loop(socket: &Path, port: u16, counts: &Counts, running: &dyn Fn() -> bool) {
    let request = pb::VerifyRequest {
        image: format!("127.0.0.1:{port}/team/app:v1"),
        image_ref: format!("sha256:{:064x}", 1),
        credentials: vec![pb::PullCredential::secret(
            pb::ObjectRef {
                namespace: "attacker".into(),
                name: "pull".into(),
                uid: String::new(),
            },
            "u",
            "p",
        )],
        ..Default::default()
    };
    while running() {
        let _: Result<pb::VerifyResponse, _> = credgate_api::unary::call(
            socket,
            credgate_api::methods::VERIFY,
            &request,
            Duration::from_secs(15),
        );
        counts.verify_calls.fetch_add(1, Ordering::Relaxed);
    }
}

/// Answers `HEAD` of a manifest with a Bearer challenge and the token endpoint with a body
/// that never ends (each connection's body bounded to 1 GiB and each write to 5 s; the
/// attack's stop waits for them).
fn endless_registry(
    listener: &TcpListener,
    port: u16,
    counts: &Arc<Counts>,
    running: &(dyn Fn() -> bool + Send + Sync),
) {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    while running() {
        match listener.accept() {
            Ok((mut c, _)) => {
                let counts = counts.clone();
                let _ = c.set_nonblocking(false);
                let _ = c.set_write_timeout(Some(Duration::from_secs(5)));
                conns.push(std::thread::spawn(move || {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 << 10 {
                        if c.read(&mut byte).unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    if head.starts_with(b"HEAD") {
                        let _ = write!(c, "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"http://127.0.0.1:{port}/token\",service=\"soak\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                        return;
                    }
                    let _ = write!(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
                    let chunk = format!("4000\r\n{}\r\n", "a".repeat(0x4000));
                    for _ in 0..(1 << 16) {
                        if c.write_all(chunk.as_bytes()).is_err() {
                            return;
                        }
                        counts
                            .token_bytes_served
                            .fetch_add(0x4000, Ordering::Relaxed);
                    }
                }));
                conns.retain(|t| !t.is_finished());
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    for t in conns {
        let _ = t.join();
    }
}

/// The preface and SETTINGS announcing the largest window a client may choose.
fn greedy_preface(out: &mut Vec<u8>) {
    out.extend_from_slice(credgate_api::frame::PREFACE);
    let mut settings = Vec::new();
    settings.extend_from_slice(&credgate_api::frame::SETTINGS_INITIAL_WINDOW_SIZE.to_be_bytes());
    settings.extend_from_slice(&0x7fff_ffffu32.to_be_bytes());
    frame(out, credgate_api::frame::SETTINGS, 0, 0, &settings);
    // The connection's window.
    frame(
        out,
        credgate_api::frame::WINDOW_UPDATE,
        0,
        0,
        &0x7fff_0000u32.to_be_bytes(),
    );
}

/// One call on stream 1, as bytes (the body may be far over the agent's limits).
fn one_call(method: &str, message: &impl Message) -> Vec<u8> {
    let mut out = Vec::new();
    greedy_preface(&mut out);
    frame(&mut out, HEADERS, END_HEADERS, 1, &request_head(method));
    let body = grpc_message(message);
    let mut chunks = body.chunks(16_384).peekable();
    while let Some(c) = chunks.next() {
        let flags = if chunks.peek().is_none() { 0x1 } else { 0 };
        frame(&mut out, DATA, flags, 1, c);
    }
    out
}

/// `streams` Watch calls on one connection, as bytes.
fn watch_streams(watch: &pb::WatchRequest, streams: u32) -> Vec<u8> {
    let mut out = Vec::new();
    greedy_preface(&mut out);
    let head = request_head(credgate_api::methods::WATCH);
    let body = grpc_message(watch);
    for i in 0..streams {
        let id = 1 + 2 * i;
        frame(&mut out, HEADERS, END_HEADERS, id, &head);
        frame(&mut out, DATA, END_STREAM, id, &body);
    }
    out
}
