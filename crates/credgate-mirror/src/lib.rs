//! The node's registry mirror (issue 51, decision 0029): an OCI distribution endpoint on
//! loopback that forwards each read of a registry the operator named to that registry with the
//! credential the agent holds now for the repository (the pod credentials captured for it,
//! every namespace's, newest first, and those of its pulls under way; then the providers' and
//! docker configs' in try-order; then none), so that a consumer that reads long
//! after its pull (a lazy-pull snapshotter, containerd) never holds a credential that can go
//! stale: rotation, expiry and restarts are the agent's concern.
//!
//! Only callers the kernel names as root, the agent's own uid or a uid `--allow-uids
//! registry-mirror=` admits get a credential added; anyone else gets 403 and nothing is sent
//! upstream. A credential the registry refuses goes through the agent's confirmed-refusal path
//! ([`credgate_agent::refusal::Refuser::confirm_and_refuse`]) and the next source is tried.

mod peer;
pub mod route;
mod upstream;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::TryStreamExt as _;
use http_body_util::{combinators::BoxBody, BodyExt as _, Full, StreamBody};
use hyper::body::{Bytes, Frame};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use secrecy::ExposeSecret as _;

use credgate_agent::captured::Captured;
use credgate_agent::guard::registry::RegistryOptions;
use credgate_agent::metrics::AgentMetrics;
use credgate_agent::refusal::Refuser;
use credgate_agent::tasks::CancellationToken;
use credgate_agent::{CallerAllowlist, Service};
use credgate_engine::Engine;
use credgate_listener::conn::Throttle;
use credgate_listener::{Accept, Listener, ListenerLimits, Peer};

use route::{NotRoute, Route};
use upstream::{Credential, Upstream};

/// What the mirror uses of the agent, and nothing else.
#[derive(Clone)]
pub struct Context {
    pub engine: Arc<ArcSwap<Engine>>,
    pub captured: Option<Arc<Captured>>,
    pub refusal: Arc<Refuser>,
    pub metrics: AgentMetrics,
    pub callers: CallerAllowlist,
    pub clock: Arc<dyn credgate_engine::clock::Clock>,
}

/// How the mirror serves.
#[derive(Debug, Clone)]
pub struct MirrorOptions {
    pub registry: RegistryOptions,
    pub limits: ListenerLimits,
}

/// The mirror's listener limits: as many connections as a node's consumers open, and each
/// request head within 10 s of the connection or of the last answer. That one deadline (hyper's
/// header timeout, `handshake_timeout` here) also closes a keep-alive connection idle for 10 s
/// between reads; `idle_timeout`, which the listener applies to HTTP/2 connections only, says
/// the same.
pub fn default_limits() -> ListenerLimits {
    ListenerLimits {
        max_connections: 512,
        max_connections_per_uid: 256,
        exempt: Vec::new(),
        handshake_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(10),
        shutdown_timeout: Duration::from_secs(5),
    }
}

/// A loopback TCP listener whose callers are named by the kernel's socket table.
struct Loopback(tokio::net::TcpListener);

impl Accept for Loopback {
    type Stream = tokio::net::TcpStream;
    /// Cancel-safe, as the listener's loop needs (it drops this future when a connection task
    /// ends first): nothing is awaited once a connection is taken, so a connection is never
    /// accepted and then dropped unanswered. The kernel's lookup of its owner is one netlink
    /// round trip, made here.
    async fn accept(&self) -> std::io::Result<(Self::Stream, Peer)> {
        let (stream, peer) = self.0.accept().await?;
        // Responses go out as they are written: Nagle's wait on the last small segment of a
        // response, with the client's delayed ACK, cost a Range read tens of milliseconds.
        stream.set_nodelay(true)?;
        let uid = peer::uid_of(peer, stream.local_addr()?);
        Ok((
            stream,
            Peer {
                uid,
                ..Peer::default()
            },
        ))
    }
}

/// Why the mirror cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum MirrorError {
    #[error("{0} is not a loopback address: the mirror adds node credentials to what it forwards, so only this node may reach it")]
    NotLoopback(SocketAddr),
    #[error("no registry to serve: name at least one with --registry-mirror-upstream")]
    NoRegistry,
    #[error("cannot listen on {addr}: {error}")]
    Bind {
        addr: SocketAddr,
        error: std::io::Error,
    },
}

/// Binds `addr` (loopback only).
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, MirrorError> {
    if !addr.ip().is_loopback() {
        return Err(MirrorError::NotLoopback(addr));
    }
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|error| MirrorError::Bind { addr, error })
}

type Body = BoxBody<Bytes, std::io::Error>;

/// Serves the mirror on each listener until `shutdown`, each with the registries it serves (the
/// first answers reads that name none, no `ns`); one upstream side (client, challenges, tokens)
/// and one set of log throttles for all of them. Every connection's task is this call's.
pub async fn serve(
    listeners: Vec<(tokio::net::TcpListener, Vec<String>)>,
    context: Context,
    options: MirrorOptions,
    shutdown: CancellationToken,
) -> Result<(), MirrorError> {
    if listeners
        .iter()
        .any(|(_, registries)| registries.is_empty())
    {
        return Err(MirrorError::NoRegistry);
    }
    let shared = Arc::new(Shared {
        upstream: Upstream::new(options.registry.clone()),
        context,
        refused_log: Throttle::new(Duration::from_secs(10)),
        unreachable_log: Throttle::new(Duration::from_secs(10)),
    });
    futures_util::future::join_all(listeners.into_iter().map(|(listener, registries)| {
        accept_loop(
            listener,
            Arc::new(registries),
            shared.clone(),
            &options,
            &shutdown,
        )
    }))
    .await;
    Ok(())
}

/// One listener's connections, each answered with `registries`, until `shutdown`.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    registries: Arc<Vec<String>>,
    shared: Arc<Shared>,
    options: &MirrorOptions,
    shutdown: &CancellationToken,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(options.limits.handshake_timeout)
        .max_buf_size(64 << 10);
    let mut listener = Listener::new(
        "registry-mirror",
        Loopback(listener),
        options.limits.clone(),
        shared.context.metrics.connections.clone(),
    );
    while let Some(accepted) = listener.next(shutdown).await {
        let (shared, registries) = (shared.clone(), registries.clone());
        let uid = accepted.peer.uid;
        let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let (shared, registries) = (shared.clone(), registries.clone());
            async move { Ok::<_, Infallible>(shared.answer(req, uid, &registries).await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(accepted.stream), service)
            .with_upgrades();
        let held = accepted.held;
        let stop = shutdown.clone();
        listener.spawn(async move {
            // A connection lives while it reads; an idle one is closed by the header timeout.
            // At the shutdown an idle keep-alive connection closes at once and one that reads
            // ends after its response (within the listener's shutdown deadline), so that a
            // restart is not held up by consumers' idle connections.
            let _held = held;
            let mut conn = std::pin::pin!(conn);
            let ended = tokio::select! {
                ended = conn.as_mut() => ended,
                () = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "registry mirror connection ended");
            }
        });
    }
    listener.drain().await;
}

struct Shared {
    upstream: Upstream,
    context: Context,
    /// At most one warning per 10 s for each: a local client cannot flood the log.
    refused_log: Throttle,
    unreachable_log: Throttle,
}

fn plain(status: StatusCode, text: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(
            Full::new(Bytes::from(format!(
                "{{\"errors\":[{{\"code\":\"{}\",\"message\":{}}}]}}\n",
                match status {
                    StatusCode::FORBIDDEN => "DENIED",
                    StatusCode::NOT_FOUND => "NAME_UNKNOWN",
                    StatusCode::METHOD_NOT_ALLOWED => "UNSUPPORTED",
                    _ => "UNAVAILABLE",
                },
                serde_json::Value::from(text)
            )))
            .map_err(|never| match never {})
            .boxed(),
        )
        .expect("static response parts are valid")
}

impl Shared {
    /// The answer to one request on a listener serving `registries`.
    async fn answer(
        &self,
        req: Request<hyper::body::Incoming>,
        uid: Option<u32>,
        registries: &[String],
    ) -> Response<Body> {
        let metrics = &self.context.metrics;
        let method = match *req.method() {
            Method::GET => reqwest::Method::GET,
            Method::HEAD => reqwest::Method::HEAD,
            _ => {
                metrics.mirror_request("not_a_read", "none");
                return plain(StatusCode::METHOD_NOT_ALLOWED, "the mirror only reads");
            }
        };
        if !self.context.callers.allows(Service::RegistryMirror, uid) {
            metrics.mirror_request("caller_refused", "none");
            if let Some(held) = self.refused_log.check() {
                tracing::warn!(uid = ?uid, repeated = held, "registry mirror: a caller that is not admitted was refused (403, nothing forwarded)");
            }
            return plain(
                StatusCode::FORBIDDEN,
                "this caller may not read through credgate's mirror (--allow-uids registry-mirror=)",
            );
        }
        let route = match route::route(req.uri().path(), req.uri().query(), registries) {
            Ok(r) => r,
            Err(NotRoute::Ping) => {
                return Response::builder()
                    .header("docker-distribution-api-version", "registry/2.0")
                    .header("content-type", "application/json")
                    .body(
                        Full::new(Bytes::from_static(b"{}"))
                            .map_err(|n| match n {})
                            .boxed(),
                    )
                    .expect("static response parts are valid");
            }
            Err(NotRoute::NotARead) => {
                metrics.mirror_request("not_a_read", "none");
                return plain(StatusCode::NOT_FOUND, "not a registry read");
            }
            Err(NotRoute::NotServed(ns)) => {
                metrics.mirror_request("not_served", "none");
                tracing::debug!(ns = ?ns, "registry mirror: a registry it does not serve");
                return plain(
                    StatusCode::NOT_FOUND,
                    "a registry this mirror does not serve",
                );
            }
        };
        let candidates = self.credentials(&route).await;
        for (source, credential) in candidates
            .iter()
            .map(|(s, c)| (*s, Some(c)))
            .chain(std::iter::once(("anonymous", None)))
        {
            let response = match self
                .upstream
                .read(&method, &route, req.headers(), credential)
                .await
            {
                Ok(r) => r,
                Err(why) => {
                    metrics.mirror_request("upstream_unreachable", source);
                    if let Some(held) = self.unreachable_log.check() {
                        tracing::warn!(registry = ?route.registry, error = %why, repeated = held, "registry mirror: the registry could not be reached");
                    }
                    return plain(StatusCode::BAD_GATEWAY, "the registry could not be reached");
                }
            };
            let refused = matches!(
                response.status(),
                reqwest::StatusCode::UNAUTHORIZED | reqwest::StatusCode::FORBIDDEN
            );
            match credential {
                Some(c) if refused => {
                    drop(response);
                    self.refused(&route, c).await;
                    continue;
                }
                _ => {
                    metrics
                        .mirror_request(if refused { "unauthorized" } else { "forwarded" }, source);
                    return stream(response);
                }
            }
        }
        plain(
            StatusCode::UNAUTHORIZED,
            "no credential the registry accepts",
        )
    }

    /// The credentials of the repository in try-order, each once, with their source's name
    /// for the metrics: every namespace's captured pod credential, newest first (one that is
    /// refused or revoked leaves the others', decision 0030), those of the pulls of it under
    /// way (a snapshotter prepares layers during the pull), then the providers' and docker
    /// configs'.
    async fn credentials(&self, route: &Route) -> Vec<(&'static str, Credential)> {
        let captured = self
            .context
            .captured
            .as_ref()
            .map(|c| {
                let mut held = c.all_for_repository(&route.image);
                held.extend(c.pulling_for(&route.image));
                held
            })
            .unwrap_or_default()
            .into_iter()
            .map(|held| ("captured", held.username, held.password));
        let engine = self.context.engine.load_full();
        let lookup = engine
            .lookup(&credgate_engine::LookupRequest {
                image: &route.image,
                // Still valid when the registry sees the request (it checks a credential
                // when a read starts, never during its body): a provider whose credentials
                // live a minute is not run again for every read.
                min_valid_for: Duration::from_secs(5),
                ..Default::default()
            })
            .await;
        let node = lookup
            .map(|l| l.credentials)
            .unwrap_or_default()
            .into_iter()
            .map(|c| {
                let source = match c.source {
                    credgate_engine::Source::DockerConfig(_) => "docker_config",
                    credgate_engine::Source::Provider(_) => "provider",
                };
                (source, c.username, c.password)
            });
        // A credential a registry refused (confirmed) is not tried again while the agent
        // remembers it: a docker config entry stays stale until someone edits it.
        let now = self.context.clock.now();
        let memory = self.context.refusal.memory();
        let mut out: Vec<(&'static str, Credential)> = Vec::new();
        for (source, username, password) in captured.chain(node) {
            let seen = out.iter().any(|(_, o)| {
                o.username == username && o.password.expose_secret() == password.expose_secret()
            });
            if !seen
                && memory
                    .known(&username, password.expose_secret(), now)
                    .is_none()
            {
                out.push((source, Credential { username, password }));
            }
        }
        out
    }

    /// The registry refused a credential the agent gave: confirmed with the registry's auth
    /// endpoint and acted on by the agent (dropped, forgotten, reported), never guessed.
    async fn refused(&self, route: &Route, c: &Credential) {
        let Ok(parsed) = credgate_core::reference::ImageRef::parse(&route.image) else {
            return;
        };
        let refusal = &self.context.refusal;
        let given = refusal.given_by(
            &route.image,
            parsed.name(),
            &c.username,
            c.password.expose_secret(),
        );
        let outcome = refusal
            .confirm_and_refuse(
                &route.image,
                &parsed,
                &c.username,
                &c.password,
                &given,
                "the registry mirror",
                true,
            )
            .await;
        tracing::info!(image = ?route.image, outcome = ?outcome.wire(), "registry mirror: the registry refused a credential; the next source is tried");
    }
}

/// The upstream's answer, streamed: its status and headers (but hop-by-hop ones), its body as
/// it arrives.
fn stream(response: reqwest::Response) -> Response<Body> {
    let mut out = Response::builder().status(response.status().as_u16());
    for (name, value) in response.headers() {
        if !matches!(
            name.as_str(),
            "connection"
                | "keep-alive"
                | "transfer-encoding"
                | "te"
                | "trailer"
                | "upgrade"
                | "proxy-authenticate"
                | "proxy-connection"
        ) {
            out = out.header(name.as_str(), value.as_bytes());
        }
    }
    let body = StreamBody::new(
        response
            .bytes_stream()
            .map_ok(Frame::data)
            .map_err(|e| std::io::Error::other(credgate_agent::guard::registry::describe(&e))),
    );
    out.body(body.boxed()).unwrap_or_else(|_| {
        plain(
            StatusCode::BAD_GATEWAY,
            "the registry's answer is malformed",
        )
    })
}
