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

/// Milliseconds since the Unix epoch; 0 for `None` or times before it.
pub fn unix_ms(t: Option<SystemTime>) -> i64 {
    t.map_or(0, crate::state::unix_ms)
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

use crate::listener::Peer;

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

/// The services, over one agent.
#[derive(Clone)]
pub struct Api {
    agent: Agent,
    shutdown: CancellationToken,
    watch_send_timeout: Duration,
}

/// Watch events queued for a client that is not reading, beyond the transport's own window.
pub const WATCH_BUFFER: usize = 16;

pub use crate::agent::WATCH_SEND_TIMEOUT;

impl Api {
    pub fn new(agent: Agent, shutdown: CancellationToken) -> Self {
        Api {
            watch_send_timeout: agent.watch_send_timeout(),
            agent,
            shutdown,
        }
    }

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
        self.agent
            .metrics()
            .rpc(method, code, elapsed.as_secs_f64());
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

    /// Refuses a caller of one service whose uid may not call `also` either: what a call
    /// shows or changes belongs to that service too (captured credentials are credentials).
    fn also_allowed(&self, peer: Peer, also: Service) -> Result<(), Status> {
        if self.agent.callers().allows(also, peer.uid) {
            return Ok(());
        }
        Err(refused(
            peer,
            also,
            "call refused: the caller's uid may not see or change what this call touches",
        ))
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
                .agent
                .callers()
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

    /// The validity a lookup asks for: its minimum, or longer to reach its deadline.
    fn min_valid_for(&self, req: &pb::LookupRequest) -> Duration {
        let min = Duration::from_millis(req.min_valid_for_ms);
        if req.valid_until_unix_ms <= 0 {
            return min;
        }
        let until =
            SystemTime::UNIX_EPOCH + Duration::from_millis(req.valid_until_unix_ms.unsigned_abs());
        let wanted = until
            .duration_since(self.agent.clock().wall())
            .unwrap_or_default();
        min.max(wanted)
    }

    /// A tracked ref's last good credentials, for when its providers fail: never one a
    /// registry refused since.
    fn last_known_good(&self, image: &str) -> Option<Vec<pb::Credential>> {
        let value = self.agent.renewer().last_good(image)?;
        let now = self.agent.clock().now();
        let refusals = self.agent.refusal().memory();
        let kept = value
            .credentials
            .iter()
            .filter(|c| {
                refusals
                    .known(&c.username, c.password.expose_secret(), now)
                    .is_none()
            })
            .map(credential)
            .collect();
        Some(kept)
    }

    /// Remembers the providers' credentials of an answer to the kubelet's bridge for as long
    /// as the kubelet may hold them: after a rotation, and after a restart, the CRI proxy still
    /// knows whose credential the kubelet's stale copy is ([`crate::memory`]).
    fn handed_out(&self, answer: &pb::LookupResponse) {
        let cache_for = std::time::Duration::from_millis(answer.cache_for_ms.max(0).unsigned_abs());
        let memory = self.agent.refusal().memory();
        let now = self.agent.clock().wall();
        for c in answer
            .credentials
            .iter()
            .filter(|c| c.source_kind == pb::SourceKind::Provider as i32)
        {
            memory.hand_out(&c.source, &c.username, &c.password, cache_for, now);
        }
    }

    async fn lookup_inner(
        &self,
        mut req: pb::LookupRequest,
        peer: Peer,
    ) -> Result<pb::LookupResponse, Status> {
        let caller =
            credgate_engine::rate::Caller::of(peer.uid, rustix::process::geteuid().as_raw());
        self.agent.metrics().lookup_by(&req.caller);
        let sa = req
            .service_account
            .take()
            .map(service_account)
            .transpose()?;
        let min_valid_for = self.min_valid_for(&req);
        if req.captured_only {
            return self.captured_only(&req);
        }
        let engine = self.agent.engine();
        if !req.provider.is_empty() {
            return self
                .provider_lookup(&engine, &req, sa.as_ref(), min_valid_for, caller)
                .await;
        }
        let request = LookupRequest {
            image: &req.image,
            min_valid_for,
            service_account: sa.as_ref(),
            registry_host: req.registry_host,
            provider: None,
            caller,
        };
        // A warm cache answers straight into the wire message.
        let served = engine
            .lookup_cached_named(&request, |image, creds| pb::LookupResponse {
                image: image.to_owned(),
                credentials: creds.iter().map(credential_ref).collect(),
                ..Default::default()
            })
            .map_err(ApiError::from)?;
        if let Some(mut answer) = served {
            self.with_captured(&mut answer, req.registry_host);
            if req.explain {
                with_reasons(&engine, &request, &mut answer);
            }
            return Ok(answer);
        }
        let lookup = engine.lookup(&request).await.map_err(ApiError::from)?;
        let failures: Vec<pb::ProviderFailure> = lookup.errors.iter().map(failure).collect();
        let fallback = (!failures.is_empty() && sa.is_none() && !req.registry_host)
            .then(|| self.last_known_good(&req.image))
            .flatten();
        let (credentials, last_known_good) = match fallback {
            Some(kept) => (kept, true),
            None => (lookup.credentials.iter().map(credential).collect(), false),
        };
        let mut answer = pb::LookupResponse {
            image: lookup.image,
            credentials,
            failures,
            last_known_good,
            ..Default::default()
        };
        self.with_captured(&mut answer, req.registry_host);
        if req.explain {
            with_reasons(&engine, &request, &mut answer);
        }
        Ok(answer)
    }

    /// Puts the pull credential the CRI proxy captured for the image's repository first, as
    /// the kubelet tries a pod's pull secrets before the node's credentials. A registry host
    /// (the docker helper's question) gets none: a pod's credential goes only to the
    /// repository it pulled (decision 0021).
    fn with_captured(&self, answer: &mut pb::LookupResponse, registry_host: bool) {
        let Some(captured) = self.agent.captured().filter(|_| !registry_host) else {
            return;
        };
        if let Some(c) = captured.for_repository(&answer.image) {
            let first = captured_credential(&answer.image, &c);
            answer.credentials.insert(0, first);
        }
    }

    /// The captured credential of the image's repository alone (`captured_only`), keyed as
    /// an `Image` answer not to be cached.
    fn captured_only(&self, req: &pb::LookupRequest) -> Result<pb::LookupResponse, Status> {
        if !req.provider.is_empty() || req.registry_host {
            return Err(status::invalid(
                "captured_only names an image, without provider or registry_host",
            ));
        }
        let image = credgate_core::reference::ImageRef::parse(&req.image)
            .map_err(|e| status::invalid(format!("invalid image: {e}")))?;
        let mut answer = pb::LookupResponse {
            image: image.name().to_owned(),
            cache_key_type: pb::CacheKeyType::Image as i32,
            ..Default::default()
        };
        self.with_captured(&mut answer, false);
        Ok(answer)
    }

    /// One provider's answer, as one provider entry of a kubelet's config asks for it through
    /// the bridge, with how long the kubelet may cache it: until the agent's renewal lead
    /// before the earliest expiry. An answer already within that lead is renewed first, so the
    /// kubelet, asking again at the lead, gets the renewed credential.
    async fn provider_lookup(
        &self,
        engine: &credgate_engine::Engine,
        req: &pb::LookupRequest,
        sa: Option<&ServiceAccount>,
        min_valid_for: Duration,
        caller: credgate_engine::rate::Caller,
    ) -> Result<pb::LookupResponse, Status> {
        let name = req.provider.as_str();
        if !engine.has_provider(name) {
            return Err(status::invalid(format!(
                "no provider {} in the agent's config",
                credgate_core::text::Quoted(name)
            )));
        }
        let policy = *self.agent.renewer().policy();
        let clock = self.agent.clock().clone();
        let mut request = LookupRequest {
            image: &req.image,
            min_valid_for,
            service_account: sa,
            registry_host: false,
            provider: Some(name),
            caller,
        };
        let mut lookup = engine.lookup(&request).await.map_err(ApiError::from)?;
        if let Some(lead) = policy.due_lead(clock.now(), lookup.entries.iter().map(|e| e.times())) {
            request.min_valid_for = min_valid_for.max(lead + Duration::from_millis(1));
            lookup = engine.lookup(&request).await.map_err(ApiError::from)?;
        }
        let mut answer = provider_answer(&lookup, &policy, clock.now());
        if req.include_captured {
            self.with_captured(&mut answer, false);
        }
        Ok(answer)
    }

    fn status_inner(&self) -> pb::StatusResponse {
        let engine = self.agent.engine();
        let statuses = engine.provider_status();
        let next = self
            .agent
            .renewer()
            .next_renewal_by_provider(statuses.len());
        let providers = statuses
            .into_iter()
            .zip(next)
            .map(|(s, next)| pb::ProviderStatus {
                name: s.name,
                runs: s.runs,
                errors: s.errors,
                refused_in_backoff: s.refused_in_backoff,
                cache_entries: s.cache_entries as u64,
                last_run_unix_ms: unix_ms(s.last_run),
                last_success_unix_ms: unix_ms(s.last_success),
                last_error: s.last_error.unwrap_or_default(),
                consecutive_failures: s.consecutive_failures,
                next_renewal_unix_ms: unix_ms(next),
                last_dropped_unix_ms: unix_ms(s.last_dropped.as_ref().map(|d| d.0)),
                last_dropped_reason: s.last_dropped.map(|d| d.1).unwrap_or_default(),
                answers_refused_since_unix_ms: unix_ms(s.answers_refused_since),
            })
            .collect();
        let sources = self.agent.sources();
        pb::StatusResponse {
            config_identity: engine.config_identity().unwrap_or_default().to_owned(),
            // As the agent reads it, whatever the operator typed.
            config_path: sources
                .provider_config
                .as_ref()
                .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            providers,
            docker_configs: sources
                .docker_configs
                .iter()
                .map(|p| p.display().to_string())
                .collect(),
            tracked_refs: u32::try_from(self.agent.renewer().len()).unwrap_or(u32::MAX),
            started_unix_ms: unix_ms(Some(self.agent.started())),
            loaded_unix_ms: unix_ms(Some(self.agent.loaded())),
            saved_cache: Some({
                let r = self.agent.saver().report();
                pb::SavedCacheStatus {
                    enabled: r.enabled,
                    restored: r.restored,
                    dropped: r
                        .dropped
                        .iter()
                        .map(|(why, n)| (why.as_str().to_owned(), *n))
                        .collect(),
                    consumers_restored: r.consumers_restored,
                    saved_entries: r.saved_entries,
                    last_saved_unix_ms: unix_ms(r.last_saved),
                }
            }),
            cri_proxy: self.agent.proxy_state(),
            node_images: self
                .agent
                .node_images()
                .list()
                .into_iter()
                .map(node_image)
                .collect(),
        }
    }

    /// `uid`: the caller's, whose refs (named consumers' and Watch streams' together) are
    /// bounded.
    fn watch_inner(&self, uid: Option<u32>, req: pb::WatchRequest) -> Result<WatchEvents, Status> {
        if req.refs.is_empty() {
            return Err(status::invalid("watch needs at least one ref"));
        }
        let mut sub = self
            .agent
            .renewer()
            .watch_as(uid, &req.refs)
            .map_err(ApiError::from)?;
        let mut streams = StreamMap::new();
        for (image, rx) in std::mem::take(&mut sub.receivers) {
            streams.insert(image, WatchStream::new(rx));
        }
        // Each ref's stream keeps only its latest value, and at most WATCH_BUFFER events wait
        // for the client: a client that stops reading costs a bounded amount of memory, and
        // one that has not taken an event for WATCH_SEND_TIMEOUT is dropped.
        let (tx, rx) = tokio::sync::mpsc::channel(WATCH_BUFFER);
        let shutdown = self.shutdown.clone();
        let metrics = self.agent.metrics().clone();
        let send_timeout = self.watch_send_timeout;
        self.agent.tasks().spawn(async move {
            // The subscription lives as long as the stream: dropping it releases the refs.
            let _sub = sub;
            loop {
                tokio::select! {
                    item = streams.next() => {
                        let Some((image, value)) = item else { break };
                        let Some(value) = value else { continue };
                        let event = pb::WatchEvent {
                            r#ref: image,
                            credentials: value
                                .captured
                                .iter()
                                .map(|(repository, c)| captured_credential(repository, c))
                                .chain(value.credentials.iter().map(credential))
                                .collect(),
                            revision: value.revision,
                        };
                        match tx.send_timeout(Ok(event), send_timeout).await {
                            Ok(()) => {}
                            Err(SendTimeoutError::Closed(_)) => break,
                            Err(SendTimeoutError::Timeout(_)) => {
                                metrics.watchers_dropped.inc();
                                tracing::warn!(
                                    timeout = ?send_timeout,
                                    "a Watch client has not read its stream; dropped it"
                                );
                                break;
                            }
                        }
                    }
                    _ = tx.closed() => break,
                    () = shutdown.cancelled() => break,
                }
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
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
    pub fn listener(&self) -> crate::listener::ListenerLimits {
        crate::listener::ListenerLimits {
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
    let api = Api::new(agent, shutdown.clone());
    let credentials =
        CredentialsServer::new(api.clone()).max_decoding_message_size(MAX_CREDENTIALS_MESSAGE);
    let admin = AdminServer::new(api.clone()).max_decoding_message_size(MAX_ADMIN_MESSAGE);
    let image_access =
        ImageAccessServer::new(api).max_decoding_message_size(MAX_IMAGE_ACCESS_MESSAGE);
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

/// What the keeper knows of a node image, as `Status` tells it.
fn node_image(s: crate::node_images::Seen) -> pb::NodeImageStatus {
    let pull = s.last_pull.as_ref();
    pb::NodeImageStatus {
        image: s.image.image,
        why: s.image.why.as_str().to_owned(),
        named_by: s.image.named_by,
        state: match s.present {
            Some(true) => "PRESENT",
            Some(false) => "ABSENT",
            None => "UNKNOWN",
        }
        .to_owned(),
        checked_unix_ms: unix_ms(s.checked),
        pulled_unix_ms: unix_ms(pull.map(|p| p.at)),
        pull_auth: pull.map(|p| p.auth.to_string()).unwrap_or_default(),
        pull_result: pull
            .map(|p| p.result.as_str().to_owned())
            .unwrap_or_default(),
        pull_message: pull.map(|p| p.message.clone()).unwrap_or_default(),
        failures: s.failures,
        retry_unix_ms: unix_ms(s.retry_at),
    }
}
