//! Raw HTTP/2 for the proxy's hardening tests: a hyper client whose request bodies the test
//! controls (sent in part, never ended) and whose answers it may leave unread (against
//! [`crate::fake_runtime`]).

use std::path::Path;

use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::UnixStream;

pub type Body = UnsyncBoxBody<Bytes, std::io::Error>;
pub type Sender = hyper::client::conn::http2::SendRequest<Body>;

/// An HTTP/2 connection to `socket` announcing `window` bytes per stream (small: a client that
/// stops reading fills it soon); its driver runs until the connection ends.
pub async fn connect(socket: &Path, window: u32) -> Sender {
    let stream = UnixStream::connect(socket).await.unwrap();
    let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .initial_stream_window_size(window)
        .initial_connection_window_size(window.max(65_535) * 4)
        .handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    sender
}

/// A gRPC request to `method` with `body`.
pub fn request(method: &str, body: Body) -> hyper::Request<Body> {
    hyper::Request::post(format!("http://localhost{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .unwrap()
}

/// A whole gRPC message as a body.
pub fn message(bytes: Vec<u8>) -> Body {
    Full::new(Bytes::from(bytes))
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A body that sends `first` and then never ends while the returned sender lives.
pub fn unfinished(first: Vec<u8>) -> (Body, tokio::sync::mpsc::Sender<Bytes>) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
    tx.try_send(Bytes::from(first)).unwrap();
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx)
        .map(|b| Ok::<_, std::io::Error>(Frame::data(b)));
    (StreamBody::new(stream).boxed_unsync(), tx)
}

use tokio_stream::StreamExt as _;

/// The gRPC status of an answer: in its head (trailers-only), or in its trailers once read.
pub async fn status(answer: hyper::Response<Incoming>) -> Option<(u32, String)> {
    let from = |h: &hyper::HeaderMap| {
        let code = h.get("grpc-status")?.to_str().ok()?.parse().ok()?;
        let message = h
            .get("grpc-message")
            .and_then(|m| m.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        Some((code, message))
    };
    if let Some(s) = from(answer.headers()) {
        return Some(s);
    }
    let collected = answer.into_body().collect().await.ok()?;
    from(collected.trailers()?)
}

/// The resident set of process `pid`, in bytes.
pub fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}
