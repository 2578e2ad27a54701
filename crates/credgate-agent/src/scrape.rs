//! The `/metrics` endpoint (Prometheus text exposition) and `/healthz`, on a TCP listener
//! within limits of its own: it is reachable by anyone who can reach its address.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::metrics::AgentMetrics;
use crate::tasks::CancellationToken;
use credgate_listener::{Listener, ListenerLimits};

/// Renders the current exposition text.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// What the metrics listener allows: it is reachable by anyone who can reach its address.
#[derive(Debug, Clone)]
pub struct MetricsLimits {
    /// Connections open at once; more are closed as they arrive.
    pub max_connections: usize,
    /// A request's head must arrive within this (also while a kept-alive connection waits for
    /// its next request).
    pub header_timeout: Duration,
    /// No connection lives longer than this, whatever it does.
    pub max_age: Duration,
}

impl Default for MetricsLimits {
    fn default() -> Self {
        MetricsLimits {
            max_connections: 64,
            header_timeout: Duration::from_secs(5),
            max_age: Duration::from_secs(60),
        }
    }
}

/// Serves `GET /metrics` (and `GET /healthz`) on `listener` until `shutdown` is cancelled, within
/// `limits`. The connections' tasks belong to this call: they end when it returns.
pub async fn serve(
    listener: TcpListener,
    render: Render,
    limits: MetricsLimits,
    metrics: AgentMetrics,
    shutdown: CancellationToken,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(16 << 10);
    let listener_limits = ListenerLimits {
        max_connections: limits.max_connections,
        max_connections_per_uid: usize::MAX,
        exempt: Vec::new(),
        handshake_timeout: limits.header_timeout,
        idle_timeout: limits.max_age,
        // A scrape in flight is not waited for.
        shutdown_timeout: Duration::ZERO,
    };
    let mut listener = Listener::new("metrics", listener, listener_limits, metrics.connections);
    while let Some(accepted) = listener.next(&shutdown).await {
        let render = render.clone();
        let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let render = render.clone();
            async move { Ok::<_, std::convert::Infallible>(respond(&req, &*render)) }
        });
        let conn = builder.serve_connection(TokioIo::new(accepted.stream), service);
        let max_age = limits.max_age;
        let held = accepted.held;
        listener.spawn(async move {
            match tokio::time::timeout(max_age, conn).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(error = %e, "metrics connection ended"),
                Err(_) => held.closed("max_age"),
            }
        });
    }
    listener.drain().await;
}

fn respond<B>(
    req: &Request<B>,
    render: &(dyn Fn() -> String + Send + Sync),
) -> Response<Full<Bytes>> {
    let (status, body, content_type) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            render(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
        (&Method::GET, "/healthz") => (StatusCode::OK, "ok\n".to_owned(), "text/plain"),
        _ => (
            StatusCode::NOT_FOUND,
            "not found: try /metrics\n".to_owned(),
            "text/plain",
        ),
    };
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}
