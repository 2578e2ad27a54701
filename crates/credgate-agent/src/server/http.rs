//! The HTTP/2 side of the API server: accepting on the unix socket within the connection
//! budget, one hyper connection per client with the caller's kernel credentials attached to
//! every request, the deadlines of a connection (handshake, idle, per request), and graceful
//! shutdown with a deadline of its own.
//!
//! Every call runs as a task of its own (the listener's [`credgate_listener::Streams`], ended
//! when it drains), so a slow call never holds up the other calls of its connection.

use crate::tasks::CancellationToken;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use hyper::body::Incoming;
use tokio::net::UnixListener;
use tonic::codegen::Service;
use tonic::service::Routes;

use super::{Limits, Peer};
use crate::agent::CallerAllowlist;
use crate::metrics::AgentMetrics;
use credgate_listener::Listener;

/// The largest header block a client may send.
pub const MAX_HEADER_LIST: u32 = 16 << 10;

/// Serves `routes` on `listener` until `shutdown` is cancelled; then stops accepting, asks every
/// connection to finish (HTTP/2 GOAWAY: calls in flight complete, no new ones start), waits for
/// them at most `limits.shutdown_timeout` and closes what is left.
pub(super) async fn serve(
    routes: Routes,
    listener: UnixListener,
    callers: CallerAllowlist,
    limits: Limits,
    metrics: AgentMetrics,
    shutdown: CancellationToken,
) {
    // Root and the agent's own uid count only against the total, so that another local user
    // can never take every connection from them; a caller that no service admits has nothing
    // to do here and is closed at once, holding nothing.
    let mut listener = Listener::new("api", listener, limits.listener(), metrics.connections)
        .admit(move |uid| callers.admits_any(uid));
    let mut http2 = listener.http2(limits.max_streams, MAX_HEADER_LIST);
    http2
        .builder
        .keep_alive_interval(Some(limits.keepalive_interval))
        .keep_alive_timeout(limits.keepalive_timeout);
    while let Some(accepted) = listener.next(&shutdown).await {
        let service = CallService {
            routes: routes.clone(),
            peer: accepted.peer,
            timeout: limits.request_timeout,
        };
        listener.serve_http2(accepted, &http2, service, shutdown.clone());
    }
    // Connections saw the same shutdown signal and are finishing their calls.
    listener.drain().await;
}

/// An UNIMPLEMENTED answer without a message (tonic's for a method or service it does not
/// have) gets the one grpc-go servers give: `unknown method M for service S`, or `unknown
/// service S`.
fn unknown_method_message<B>(path: &str, response: &mut hyper::Response<B>) {
    let headers = response.headers_mut();
    let unimplemented = headers
        .get("grpc-status")
        .is_some_and(|v| v.as_bytes() == b"12");
    if !unimplemented || headers.contains_key("grpc-message") {
        return;
    }
    let known = [
        "credgate.v1.Credentials",
        "credgate.v1.Admin",
        "credgate.v1.ImageAccess",
    ];
    let (service, method) = path
        .trim_start_matches('/')
        .split_once('/')
        .unwrap_or((path.trim_start_matches('/'), ""));
    let service: String = service.chars().take(128).collect();
    let method: String = method.chars().take(128).collect();
    let message = if known.contains(&service.as_str()) {
        format!("unknown method {method} for service {service}")
    } else {
        format!("unknown service {service}")
    };
    let encoded = credgate_api::unary::encode_message(&message);
    if let Ok(value) = hyper::header::HeaderValue::from_str(&encoded) {
        headers.insert("grpc-message", value);
    }
}

/// The per-request side: the caller's credentials on the request, a deadline for its answer
/// (the head of a Watch stream: the stream itself may last).
#[derive(Clone)]
struct CallService {
    routes: Routes,
    peer: Peer,
    timeout: Duration,
}

type Answer = hyper::Response<tonic::body::Body>;

impl hyper::service::Service<hyper::Request<Incoming>> for CallService {
    type Response = Answer;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Answer, Self::Error>> + Send>>;

    fn call(&self, mut request: hyper::Request<Incoming>) -> Self::Future {
        request.extensions_mut().insert(self.peer);
        let path = request.uri().path().to_owned();
        let call = self.routes.clone().call(request);
        let timeout = self.timeout;
        Box::pin(async move {
            let mut response = match tokio::time::timeout(timeout, call).await {
                Ok(Ok(response)) => response,
                Ok(Err(never)) => match never {},
                Err(_) => tonic::Status::from(crate::status::ApiError::Deadline(format!(
                    "the call took longer than the agent's request timeout ({})",
                    credgate_core::duration::Rounded(timeout)
                )))
                .into_http(),
            };
            unknown_method_message(&path, &mut response);
            Ok(response)
        })
    }
}
