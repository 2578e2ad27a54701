//! The proxy's client of the runtime: one HTTP/2 connection per caller connection (made on
//! first use, again after it fails), calls whose request and answer are read whole within the
//! caller's budgets, and the proxy's own unary calls.

use std::path::PathBuf;

use http_body_util::BodyExt;
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::UnixStream;
use tokio::sync::Mutex;
use tokio::task::JoinSet;

use super::budget::{self, Budgets, Taken, Unread};
use super::Body;
use credgate_listener::Guarded;

/// One HTTP/2 connection to the runtime, made on first use and again after it fails.
pub(super) struct Runtime {
    pub(super) path: PathBuf,
    /// `credgate_cri_runtime_unreachable_total`: calls not forwarded for want of the runtime.
    pub(super) unreachable: prometheus_client::metrics::counter::Counter,
    pub(super) sender: Mutex<Option<hyper::client::conn::http2::SendRequest<Body>>>,
    pub(super) tasks: parking_lot::Mutex<JoinSet<()>>,
}

impl Runtime {
    pub(super) fn new(
        path: PathBuf,
        unreachable: prometheus_client::metrics::counter::Counter,
    ) -> Runtime {
        Runtime {
            path,
            unreachable,
            sender: Mutex::new(None),
            tasks: parking_lot::Mutex::new(JoinSet::new()),
        }
    }

    pub(super) async fn sender(
        &self,
    ) -> std::io::Result<hyper::client::conn::http2::SendRequest<Body>> {
        let mut slot = self.sender.lock().await;
        if let Some(s) = slot.as_ref().filter(|s| !s.is_closed()) {
            return Ok(s.clone());
        }
        let stream = UnixStream::connect(&self.path).await?;
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .handshake(TokioIo::new(stream))
            .await
            .map_err(std::io::Error::other)?;
        let mut tasks = self.tasks.lock();
        // Connections that ended are reaped here, so the set holds the live one only.
        while tasks.try_join_next().is_some() {}
        tasks.spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "runtime connection ended");
            }
        });
        drop(tasks);
        *slot = Some(sender.clone());
        Ok(sender)
    }
}

/// One caller connection's side of the proxy: a connection to the runtime of its own, so that
/// a caller that stops reading its answers fills only its own flow-control windows and holds
/// back only its own calls, and its share of what the proxy may buffer. Dropped with the
/// caller's connection, which closes its runtime connection.
pub(super) struct CallerConn {
    pub(super) runtime: std::sync::Arc<Runtime>,
    pub(super) budgets: Budgets,
}

/// Why the proxy answered a call itself: every status of its own comes from here.
#[derive(Debug)]
pub(super) enum ProxyError {
    /// The caller's deadline passed.
    Deadline(String),
    /// A message larger than the proxy reads, or than its budget holds now.
    TooLarge(String),
    /// The container runtime cannot be reached or broke off.
    Runtime(String),
    /// The caller gave up on its call (its request ended early).
    Cancelled(String),
}

impl From<ProxyError> for tonic::Status {
    fn from(e: ProxyError) -> tonic::Status {
        use tonic::Code;
        let (code, message) = match e {
            ProxyError::Deadline(m) => (Code::DeadlineExceeded, m),
            ProxyError::TooLarge(m) => (Code::ResourceExhausted, m),
            ProxyError::Runtime(m) => (Code::Unavailable, m),
            ProxyError::Cancelled(m) => (Code::Cancelled, m),
        };
        tonic::Status::new(code, message)
    }
}

/// The proxy's own error as a trailers-only answer.
pub(super) fn status(e: ProxyError) -> hyper::Response<Body> {
    tonic::Status::from(e)
        .into_http::<tonic::body::Body>()
        .map(|b| b.map_err(|e| Box::new(e) as _).boxed_unsync())
}

/// The head of a call of the proxy's own to the runtime: `:authority` `localhost`, as the
/// kubelet sends it (grpc-go's server refuses a request without one: `no host or :authority
/// header present`), and the deadline the runtime should keep, when there is one.
pub(super) fn own_call(
    method: &str,
    deadline: Option<std::time::Duration>,
) -> Option<hyper::http::request::Parts> {
    let mut request = hyper::Request::post(format!("http://localhost{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(d) = deadline {
        request = request.header("grpc-timeout", format!("{}S", d.as_secs().max(1)));
    }
    Some(request.body(()).ok()?.into_parts().0)
}

/// Why a call of the proxy's own to the runtime gave no answer to use.
#[derive(Debug, thiserror::Error)]
pub(super) enum AskError {
    #[error("the request could not be built")]
    Unbuilt,
    /// The proxy's own refusal (its budget, the runtime unreachable): the status message.
    #[error("{0}")]
    Refused(String),
    #[error("code {code}: {message}")]
    Status { code: i32, message: String },
    #[error("an answer that does not decode")]
    Undecodable,
}

/// One unary call of our own to the runtime: its answer's message when it succeeded and fit
/// in `limit` bytes; why not, otherwise.
pub(super) async fn ask<M: prost::Message, R: prost::Message + Default>(
    caller: &CallerConn,
    method: &str,
    message: &M,
    limit: usize,
) -> Result<R, AskError> {
    let answer = ask_bytes(caller, method, message, limit).await?;
    R::decode(answer).map_err(|_| AskError::Undecodable)
}

/// [`ask`], the answer's message left as bytes (for a reader that decodes it in parts).
pub(super) async fn ask_bytes<M: prost::Message>(
    caller: &CallerConn,
    method: &str,
    message: &M,
    limit: usize,
) -> Result<Bytes, AskError> {
    let frame = credgate_api::unary::grpc_message(message);
    let head = own_call(method, None).ok_or(AskError::Unbuilt)?;
    let whole = exchange(caller, head, Bytes::from(frame), limit)
        .await
        .map_err(|refused| AskError::Refused(grpc_message_of(refused.headers())))?;
    if whole.code() != Some(0) {
        tracing::debug!(method, code = ?whole.code(), message = %whole.message(), "the runtime refused the proxy's own call");
        return Err(AskError::Status {
            code: whole.code().unwrap_or(2),
            message: whole.message(),
        });
    }
    let message = grpc_message(&whole.data).ok_or(AskError::Undecodable)?;
    Ok(whole.data.slice_ref(message))
}

/// `grpc-status` of a head or trailers.
pub(super) fn grpc_code(headers: &hyper::HeaderMap) -> Option<i32> {
    headers.get("grpc-status").and_then(code_value)
}

/// `grpc-message` of a head or trailers, percent-decoded (empty when there is none).
pub(super) fn grpc_message_of(headers: &hyper::HeaderMap) -> String {
    message_value(headers.get("grpc-message"))
}

fn code_value(v: &hyper::header::HeaderValue) -> Option<i32> {
    v.to_str().ok()?.parse().ok()
}

fn message_value(v: Option<&hyper::header::HeaderValue>) -> String {
    v.map(|v| credgate_api::unary::decode_message(v.as_bytes()))
        .unwrap_or_default()
}

/// An answer read whole: its head, its message bytes, its trailers.
pub(super) struct Whole {
    pub(super) parts: hyper::http::response::Parts,
    pub(super) data: Bytes,
    pub(super) trailers: Option<hyper::HeaderMap>,
    /// What the answer takes of the budgets, until its body is sent or dropped.
    pub(super) taken: Taken,
}

impl Whole {
    /// The gRPC status code (in the trailers, or in the head of a trailers-only answer).
    pub(super) fn code(&self) -> Option<i32> {
        self.header("grpc-status").and_then(code_value)
    }

    /// The gRPC status message, percent-decoded.
    pub(super) fn message(&self) -> String {
        message_value(self.header("grpc-message"))
    }

    /// A status header: in the trailers, or in the head of a trailers-only answer.
    fn header(&self, name: &str) -> Option<&hyper::header::HeaderValue> {
        self.trailers
            .as_ref()
            .and_then(|t| t.get(name))
            .or_else(|| self.parts.headers.get(name))
    }

    /// The answer as the runtime gave it, in the same shape: a trailers-only answer (the
    /// status in the head, which ended the stream) goes back as one, since grpc-go reads a
    /// status in a head that does not end the stream as `server closed the stream without
    /// sending trailers`.
    pub(super) fn into_response(self) -> hyper::Response<Body> {
        if self.data.is_empty() && self.trailers.is_none() {
            let body = http_body_util::Empty::new()
                .map_err(|never| match never {})
                .boxed_unsync();
            return hyper::Response::from_parts(self.parts, body);
        }
        let trailers = self.trailers;
        let body = Guarded::new(
            http_body_util::Full::new(self.data)
                .map_err(|never| match never {})
                .with_trailers(async move { trailers.map(Ok) })
                .boxed_unsync(),
            self.taken,
        )
        .boxed_unsync();
        hyper::Response::from_parts(self.parts, body)
    }
}

/// A request body read whole, within the bound and the caller's budgets; an answer to give
/// instead when it is over.
pub(super) async fn read_whole(
    caller: &CallerConn,
    request: hyper::Request<Incoming>,
    what: &str,
    limit: usize,
) -> Result<(hyper::http::request::Parts, Bytes, Taken), hyper::Response<Body>> {
    let (parts, body) = request.into_parts();
    match budget::collect(body, limit, &caller.budgets).await {
        Ok(c) => Ok((parts, c.data, c.taken)),
        Err(Unread::TooLarge) => Err(status(ProxyError::TooLarge(format!(
            "credgate: a {what} request larger than {} KiB",
            limit >> 10
        )))),
        Err(Unread::Exhausted) => Err(status(ProxyError::TooLarge(format!(
            "credgate: too many unfinished requests held for this connection or for all callers; {what} refused"
        )))),
        Err(Unread::Broken) => Err(status(ProxyError::Cancelled(format!(
            "credgate: the {what} request ended before its message did"
        )))),
    }
}

/// Forwards a call whose request was read whole and reads its answer whole (at most `limit`
/// bytes); an answer to give instead when the runtime cannot be reached or its answer is too
/// large.
pub(super) async fn exchange(
    caller: &CallerConn,
    parts: hyper::http::request::Parts,
    bytes: Bytes,
    limit: usize,
) -> Result<Whole, hyper::Response<Body>> {
    let runtime = &caller.runtime;
    let outbound = hyper::Request::from_parts(
        parts,
        http_body_util::Full::new(bytes)
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    let mut sender = runtime
        .sender()
        .await
        .map_err(|e| unreachable_runtime(runtime, &e))?;
    let answer = sender
        .send_request(outbound)
        .await
        .map_err(|e| broken_runtime(runtime, &e))?;
    let (parts, body) = answer.into_parts();
    let collected =
        match budget::collect(body, limit, &caller.budgets).await {
            Ok(c) => c,
            Err(Unread::Exhausted) => return Err(status(ProxyError::TooLarge(
                "credgate: too many unfinished answers held for this connection or for all callers"
                    .into(),
            ))),
            Err(Unread::TooLarge | Unread::Broken) => {
                return Err(status(ProxyError::Runtime(
                    "credgate: the runtime's answer was cut short or too large".into(),
                )))
            }
        };
    Ok(Whole {
        parts,
        data: collected.data,
        trailers: collected.trailers,
        taken: collected.taken,
    })
}

/// The message of an uncompressed gRPC frame.
pub(super) fn grpc_message(frame: &[u8]) -> Option<&[u8]> {
    let (&flag, rest) = frame.split_first()?;
    if flag != 0 {
        return None;
    }
    let (len, msg) = rest.split_at_checked(4)?;
    let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
    msg.get(..len)
}

/// `message` as an uncompressed gRPC frame (the inverse of [`grpc_message`]).
pub(super) fn framed(message: &[u8]) -> Option<Bytes> {
    let mut out = Vec::with_capacity(message.len() + 5);
    out.push(0);
    out.extend_from_slice(&u32::try_from(message.len()).ok()?.to_be_bytes());
    out.extend_from_slice(message);
    Some(Bytes::from(out))
}

pub(super) fn unreachable_runtime(runtime: &Runtime, e: &std::io::Error) -> hyper::Response<Body> {
    runtime.unreachable.inc();
    status(ProxyError::Runtime(format!(
        "credgate: cannot reach the container runtime at {}: {e}",
        runtime.path.display()
    )))
}

pub(super) fn broken_runtime(runtime: &Runtime, e: &hyper::Error) -> hyper::Response<Body> {
    runtime.unreachable.inc();
    status(ProxyError::Runtime(format!(
        "credgate: the container runtime's connection failed: {e}"
    )))
}
