//! The idle deadline of an HTTP/2 connection, on tokio's paused clock (it moves only when
//! every task waits, so three deadlines pass at once): the listener counts each request as an
//! open stream until its answer ends, and a connection with one is never idle.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use credgate_listener::{ConnectionMetrics, Listener, ListenerLimits};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

const IDLE: Duration = Duration::from_secs(1);

/// Connections the listener closed for `reason`, from its metrics as they are scraped.
fn closed(metrics: &ConnectionMetrics, reason: &str) -> u64 {
    let mut registry = prometheus_client::registry::Registry::with_prefix("credgate");
    metrics.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let series =
        format!("credgate_connections_closed_total{{listener=\"test\",reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0, |n| n.parse().unwrap())
}

#[tokio::test(start_paused = true)]
async fn a_call_in_flight_keeps_its_connection_past_the_idle_deadline_and_none_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("test.sock");
    let socket = tokio::net::UnixListener::bind(&path).unwrap();
    let limits = ListenerLimits {
        max_connections: 4,
        max_connections_per_uid: 4,
        exempt: Vec::new(),
        handshake_timeout: IDLE * 10,
        idle_timeout: IDLE,
        shutdown_timeout: IDLE,
    };
    let metrics = ConnectionMetrics::default();
    let shutdown = CancellationToken::new();
    // Each call waits for a permit before it is answered.
    let gate = Arc::new(Semaphore::new(0));
    let server = tokio::spawn({
        let (metrics, shutdown, gate) = (metrics.clone(), shutdown.clone(), gate.clone());
        async move {
            let mut listener = Listener::new("test", socket, limits, metrics);
            let http2 = listener.http2(8, 16 << 10);
            while let Some(accepted) = listener.next(&shutdown).await {
                let gate = gate.clone();
                let service = hyper::service::service_fn(move |_: hyper::Request<Incoming>| {
                    let gate = gate.clone();
                    async move {
                        gate.acquire().await.unwrap().forget();
                        Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(
                            b"answered",
                        ))))
                    }
                });
                listener.serve_http2(accepted, &http2, service, shutdown.clone());
            }
            listener.drain().await;
        }
    });

    let stream = tokio::net::UnixStream::connect(&path).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    let connection = tokio::spawn(connection);
    let request = hyper::Request::builder()
        .uri("http://localhost/slow")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let call = tokio::spawn(sender.send_request(request));

    // Three idle deadlines pass with the call in flight: the connection stays.
    tokio::time::sleep(IDLE * 3).await;
    assert!(!connection.is_finished(), "closed with a call in flight");
    assert!(!call.is_finished());
    assert_eq!(closed(&metrics, "idle_timeout"), 0);
    gate.add_permits(1);
    let answer = call.await.unwrap().expect("the slow call was answered");
    let body = answer.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"answered");

    // Answered and quiet: closed at the idle deadline, and counted.
    let asked = tokio::time::Instant::now();
    tokio::time::timeout(IDLE * 3, connection)
        .await
        .expect("the idle connection was closed")
        .unwrap()
        .ok();
    assert!(
        asked.elapsed() >= IDLE,
        "closed after {:?}",
        asked.elapsed()
    );
    assert_eq!(closed(&metrics, "idle_timeout"), 1);

    shutdown.cancel();
    server.await.unwrap();
}
