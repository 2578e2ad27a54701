//! The gRPC services on the unix socket. Errors become statuses in `status.rs`, once;
//! statuses carry messages built from typed errors, none of which holds a secret.

use crate::tasks::CancellationToken;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant, SystemTime};

use crate::status::{self, ApiError};
use credgate_api::v1::admin_server::AdminServer;
use credgate_api::v1::credentials_server::CredentialsServer;
use credgate_api::v1::image_access_server::ImageAccessServer;
use credgate_api::v1::{self as pb};
use credgate_engine::{Credential, CredentialRef, LookupRequest, ServiceAccount};
use secrecy::{ExposeSecret, SecretString};
use tokio::net::UnixListener;
use tokio::sync::mpsc::error::SendTimeoutError;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::{Stream, StreamExt, StreamMap};
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Status};

mod admin;
mod credentials;
mod http;
mod image_access;
pub(crate) mod wire;

use crate::agent::{Agent, CallerAllowlist, Service};
use crate::captured::Captured;
use crate::control::Control;
use crate::explain::{Explainer, ProxySlot};
use crate::guard::Guard;
use crate::metrics::AgentMetrics;
use crate::refusal::Refuser;
use crate::renewal::Renewer;
use crate::saver::Saver;
use crate::tasks::Tasks;
use arc_swap::ArcSwap;
use credgate_engine::clock::Clock;
use credgate_engine::Engine;
use std::sync::Arc;

/// Milliseconds since the Unix epoch; 0 for `None` or times before it.
pub fn unix_ms(t: Option<SystemTime>) -> i64 {
    t.map_or(0, credgate_engine::clock::unix_ms)
}

/// The wire form of a credential.
pub fn credential(c: &Credential) -> pb::Credential {
    credential_ref(&c.as_ref())
}

/// The wire form of a borrowed credential.
pub fn credential_ref(c: &CredentialRef<'_>) -> pb::Credential {
    pb::Credential {
        source_kind: match c.kind {
            credgate_engine::SourceKind::Provider => pb::SourceKind::Provider,
            credgate_engine::SourceKind::DockerConfig => pb::SourceKind::DockerConfig,
        } as i32,
        source: c.source.to_owned(),
        pattern: c.pattern.to_owned(),
        username: c.username.to_owned(),
        password: c.password.expose_secret().to_owned(),
        expires_at_unix_ms: unix_ms(c.expires_at),
    }
}

/// The wire form of a pull credential the CRI proxy captured for `repository`: source kind
/// `captured`, the pod's namespace as its source.
fn captured_credential(repository: &str, c: &crate::captured::PodCredential) -> pb::Credential {
    pb::Credential {
        source_kind: pb::SourceKind::Captured as i32,
        source: c.namespace.clone(),
        pattern: repository.to_owned(),
        username: c.username.clone(),
        password: c.password.expose_secret().to_owned(),
        expires_at_unix_ms: 0,
    }
}

/// The wire form of a provider's failure.
pub fn failure(e: &credgate_engine::ProviderError) -> pb::ProviderFailure {
    pb::ProviderFailure {
        provider: e.plugin().to_owned(),
        reason: wire::failure_reason(e.reason()),
        message: e.to_string(),
    }
}

/// One provider's answer for the kubelet bridge: its credentials and failures, how its answer
/// may be reused, and how long a client may keep it at `now` (until the renewal lead before
/// the earliest expiry).
pub fn provider_answer(
    lookup: &credgate_engine::Lookup,
    policy: &credgate_core::renewal::RenewalPolicy,
    now: std::time::Instant,
) -> pb::LookupResponse {
    let cache_for = policy.client_cache_for(now, lookup.entries.iter().map(|e| e.times()));
    pb::LookupResponse {
        image: lookup.image.clone(),
        credentials: lookup.credentials.iter().map(credential).collect(),
        failures: lookup.errors.iter().map(failure).collect(),
        last_known_good: false,
        cache_key_type: lookup
            .entries
            .first()
            .map(|e| wire::cache_key_type(e.key.kind()))
            .unwrap_or_default(),
        cache_for_ms: i64::try_from(cache_for.as_millis()).unwrap_or(i64::MAX),
        ..Default::default()
    }
}

fn service_account(sa: pb::ServiceAccount) -> Result<ServiceAccount, Status> {
    if sa.namespace.is_empty() || sa.name.is_empty() {
        return Err(status::invalid("service_account needs namespace and name"));
    }
    Ok(ServiceAccount {
        namespace: sa.namespace,
        name: sa.name,
        uid: sa.uid,
        token: SecretString::from(sa.token),
        annotations: sa.annotations.into_iter().collect::<BTreeMap<_, _>>(),
    })
}

use credgate_listener::Peer;

/// An answer with no credential and no failure says why, source by source (`explain`).
fn with_reasons(
    engine: &credgate_engine::Engine,
    request: &LookupRequest<'_>,
    answer: &mut pb::LookupResponse,
) {
    if answer.credentials.is_empty() && answer.failures.is_empty() {
        if let Ok(e) = engine.explain(request) {
            answer.reasons = e.reasons();
            answer.matched_reasons = e.matched_reasons();
        }
    }
}

/// The caller of a request, as the kernel reports it for the socket.
pub fn peer<T>(request: &Request<T>) -> Peer {
    request
        .extensions()
        .get::<Peer>()
        .copied()
        .unwrap_or_default()
}

/// Refuses callers whose uid the allowlist does not admit to `service`.
fn admit(
    callers: &CallerAllowlist,
    service: Service,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    let callers = callers.clone();
    move |request: Request<()>| {
        let who = peer(&request);
        if callers.allows(service, who.uid) {
            return Ok(request);
        }
        Err(refused(
            who,
            service,
            "call refused: the caller's uid is not allowed",
        ))
    }
}

/// A caller refused for `service`: warned (`why`) and answered PERMISSION_DENIED.
fn refused(who: Peer, service: Service, why: &'static str) -> Status {
    tracing::warn!(
        service = service.as_str(),
        uid = who.uid,
        gid = who.gid,
        pid = who.pid,
        "{why}"
    );
    not_for(who, service).into()
}

/// The refusal of a caller whose uid may not call `service` (or see what it guards).
fn not_for(peer: Peer, service: Service) -> ApiError {
    let uid = peer.uid.map_or("unknown".into(), |u| u.to_string());
    ApiError::Denied(format!(
        "uid {uid} may not call the {} service",
        service.as_str()
    ))
}

/// What every service shares: the callers it admits, its call counter, the stop signal.
#[derive(Clone)]
pub(crate) struct Calls {
    metrics: AgentMetrics,
    callers: CallerAllowlist,
    shutdown: CancellationToken,
}

/// The `Credentials` service's handles: the engine, the renewer, the refusal service, the
/// captures; never the agent.
#[derive(Clone)]
pub(crate) struct CredentialsApi {
    calls: Calls,
    engine: Arc<ArcSwap<Engine>>,
    renewer: Renewer,
    refusal: Arc<Refuser>,
    captured: Option<Arc<Captured>>,
    clock: Arc<dyn Clock>,
    tasks: Tasks,
    watch_send_timeout: Duration,
}

/// The `ImageAccess` service's handles: the guard.
#[derive(Clone)]
pub(crate) struct ImageAccessApi {
    calls: Calls,
    guard: Option<Guard>,
}

/// The `Admin` service's handles: reload and flush, what `Explain` reads, the CRI proxy's
/// state, the captures, and what `Status` reports; never the agent.
#[derive(Clone)]
pub(crate) struct AdminApi {
    calls: Calls,
    control: Control,
    explainer: Explainer,
    proxy: ProxySlot,
    captured: Option<Arc<Captured>>,
    renewer: Renewer,
    saver: Saver,
    started: SystemTime,
}

/// Watch events queued for a client that is not reading, beyond the transport's own window.
pub const WATCH_BUFFER: usize = 16;

pub use crate::agent::WATCH_SEND_TIMEOUT;

impl Calls {
    /// Times a call, counts it by method and code, and logs who made it (debug level).
    async fn observed<T>(
        &self,
        peer: Peer,
        method: &'static str,
        call: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        let started = Instant::now();
        let result = call.await;
        let code = result
            .as_ref()
            .map_or_else(Status::code, |_| tonic::Code::Ok);
        let elapsed = started.elapsed();
        self.metrics.rpc(method, code, elapsed.as_secs_f64());
        tracing::debug!(
            method,
            code = crate::metrics::code_name(code),
            uid = peer.uid,
            gid = peer.gid,
            pid = peer.pid,
            micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
            "api call"
        );
        result
    }

    /// A `Lookup` that names a service account is answered from that account's cache
    /// entries, so only callers trusted to claim an identity may name one
    /// ([`Service::ServiceAccountIdentity`]).
    fn may_claim_identity(
        &self,
        peer: Peer,
        claim: Option<&pb::ServiceAccount>,
    ) -> Result<(), Status> {
        if claim.is_none()
            || self
                .callers
                .allows(Service::ServiceAccountIdentity, peer.uid)
        {
            return Ok(());
        }
        tracing::warn!(
            uid = peer.uid,
            pid = peer.pid,
            "lookup refused: the caller may not claim a service account identity"
        );
        let uid = peer.uid.map_or("unknown".into(), |u| u.to_string());
        Err(ApiError::Denied(format!(
            "uid {uid} may not look up credentials for a service account (the agent trusts root, its own uid and --allow-uids service-account-identity=UID to name one)"
        ))
        .into())
    }

    /// Refuses a caller of one service whose uid may not call `also` either: what a call
    /// shows or changes belongs to that service too (captured credentials are credentials).
    fn also_allowed(&self, peer: Peer, also: Service) -> Result<(), Status> {
        if self.callers.allows(also, peer.uid) {
            return Ok(());
        }
        Err(refused(
            peer,
            also,
            "call refused: the caller's uid may not see or change what this call touches",
        ))
    }
}

type WatchEvents = Pin<Box<dyn Stream<Item = Result<pb::WatchEvent, Status>> + Send + 'static>>;

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// What one client may hold of the agent, and how long anything may take.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections open at once, in all.
    pub max_connections: usize,
    /// Connections open at once for one uid other than root and the agent's own.
    pub max_connections_per_uid: usize,
    /// Streams (calls, Watch streams) open at once on one connection.
    pub max_streams: u32,
    /// A new connection that has not sent the HTTP/2 preface by then is closed.
    pub handshake_timeout: Duration,
    /// A connection with no stream open that has sent nothing for this long is closed.
    pub idle_timeout: Duration,
    /// A call (a Watch stream's head) not answered by then ends with DEADLINE_EXCEEDED.
    pub request_timeout: Duration,
    /// How often the agent pings a client, and how long it waits for the answer before it
    /// closes the connection (a client that no longer reads).
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// How long a stop waits for calls in flight before it closes their connections.
    pub shutdown_timeout: Duration,
}

impl Limits {
    /// The listener's part of the limits (root and the agent's own uid exempt from the
    /// per-uid share).
    pub fn listener(&self) -> credgate_listener::ListenerLimits {
        credgate_listener::ListenerLimits {
            max_connections: self.max_connections,
            max_connections_per_uid: self.max_connections_per_uid,
            exempt: Vec::new(),
            handshake_timeout: self.handshake_timeout,
            idle_timeout: self.idle_timeout,
            shutdown_timeout: self.shutdown_timeout,
        }
        .root_and_own_exempt()
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_uid: DEFAULT_MAX_CONNECTIONS / 4,
            max_streams: 32,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            request_timeout: Duration::from_secs(120),
            keepalive_interval: Duration::from_secs(60),
            keepalive_timeout: Duration::from_secs(20),
            shutdown_timeout: Duration::from_secs(10),
        }
    }
}

/// The default of `--max-connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;

/// The largest request message each service decodes: an image reference is not megabytes.
pub const MAX_CREDENTIALS_MESSAGE: usize = 64 << 10;
pub const MAX_ADMIN_MESSAGE: usize = 4 << 10;
pub const MAX_IMAGE_ACCESS_MESSAGE: usize = 128 << 10;

/// Serves the API on `listener` with the default [`Limits`]; see [`serve_with`].
pub async fn serve(agent: Agent, listener: UnixListener, shutdown: CancellationToken) {
    serve_with(agent, listener, Limits::default(), shutdown).await;
}

/// Serves the API on `listener` until `shutdown` is cancelled, then stops accepting and lets the
/// calls in flight finish (Watch streams end) for at most `limits.shutdown_timeout`.
pub async fn serve_with(
    agent: Agent,
    listener: UnixListener,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let callers = agent.callers().clone();
    let metrics = agent.metrics().clone();
    let calls = Calls {
        metrics: metrics.clone(),
        callers: callers.clone(),
        shutdown: shutdown.clone(),
    };
    let credentials = CredentialsServer::new(CredentialsApi {
        calls: calls.clone(),
        engine: agent.engine_handle(),
        renewer: agent.renewer().clone(),
        refusal: agent.refusal().clone(),
        captured: agent.captured().cloned(),
        clock: agent.clock().clone(),
        tasks: agent.tasks().clone(),
        watch_send_timeout: agent.watch_send_timeout(),
    })
    .max_decoding_message_size(MAX_CREDENTIALS_MESSAGE);
    let image_access = ImageAccessServer::new(ImageAccessApi {
        calls: calls.clone(),
        guard: agent.guard().cloned(),
    })
    .max_decoding_message_size(MAX_IMAGE_ACCESS_MESSAGE);
    let admin = AdminServer::new(AdminApi {
        calls,
        control: agent.control().clone(),
        explainer: agent.explainer(),
        proxy: agent.proxy().clone(),
        captured: agent.captured().cloned(),
        renewer: agent.renewer().clone(),
        saver: agent.saver().clone(),
        started: agent.started(),
    })
    .max_decoding_message_size(MAX_ADMIN_MESSAGE);
    let routes = tonic::service::Routes::new(InterceptedService::new(
        credentials,
        admit(&callers, Service::Credentials),
    ))
    .add_service(InterceptedService::new(
        admin,
        admit(&callers, Service::Admin),
    ))
    .add_service(InterceptedService::new(
        image_access,
        admit(&callers, Service::ImageAccess),
    ))
    .prepare();
    http::serve(routes, listener, callers, limits, metrics, shutdown).await;
}
