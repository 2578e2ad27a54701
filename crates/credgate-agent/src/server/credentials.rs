//! The `Credentials` service: lookups, tracked refs, Watch streams.

use credgate_api::v1::credentials_server::Credentials;
use credgate_api::v1::{self as pb};
use secrecy::SecretString;
use tonic::{Request, Response, Status};

use super::*;
use crate::status::ApiError;

#[tonic::async_trait]
impl Credentials for CredentialsApi {
    async fn report_refused(
        &self,
        request: Request<pb::ReportRefusedRequest>,
    ) -> Result<Response<pb::ReportRefusedResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "ReportRefused", async {
                let password = SecretString::from(req.password);
                let first = credgate_engine::rate::Caller::of(
                    peer.uid,
                    rustix::process::geteuid().as_raw(),
                )
                .privileged;
                let report = self
                    .refusal
                    .report(&req.image, &req.username, &password, first)
                    .await
                    .map_err(ApiError::from)?;
                let message = report.describe(&req.image);
                Ok(Response::new(pb::ReportRefusedResponse {
                    outcome: report.wire() as i32,
                    message,
                }))
            })
            .await
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let peer = peer(&request);
        let request = request.into_inner();
        let bridge = request.caller == "kubelet";
        self.calls
            .observed(peer, "Lookup", async {
                self.calls
                    .may_claim_identity(peer, request.service_account.as_ref())?;
                let answer = self.lookup_inner(request, peer).await?;
                if bridge {
                    self.handed_out(&answer);
                }
                Ok(answer)
            })
            .await
            .map(Response::new)
    }

    async fn track(
        &self,
        request: Request<pb::TrackRequest>,
    ) -> Result<Response<pb::TrackResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "Track", async {
                let n = self
                    .renewer
                    .track_as(peer.uid, &req.consumer, &req.refs)
                    .map_err(ApiError::from)?;
                Ok(Response::new(pb::TrackResponse { tracked: count(n) }))
            })
            .await
    }

    async fn untrack(
        &self,
        request: Request<pb::UntrackRequest>,
    ) -> Result<Response<pb::UntrackResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "Untrack", async {
                let n = self
                    .renewer
                    .untrack(&req.consumer, &req.refs)
                    .map_err(ApiError::from)?;
                Ok(Response::new(pb::UntrackResponse { tracked: count(n) }))
            })
            .await
    }

    async fn set_tracked(
        &self,
        request: Request<pb::SetTrackedRequest>,
    ) -> Result<Response<pb::SetTrackedResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "SetTracked", async {
                let change = self
                    .renewer
                    .set_tracked_as(peer.uid, &req.consumer, &req.refs)
                    .map_err(ApiError::from)?;
                Ok(Response::new(pb::SetTrackedResponse {
                    added: count(change.added.len()),
                    removed: count(change.removed.len()),
                }))
            })
            .await
    }

    async fn list_tracked(
        &self,
        request: Request<pb::ListTrackedRequest>,
    ) -> Result<Response<pb::ListTrackedResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "ListTracked", async {
                let consumer = (!req.consumer.is_empty()).then_some(req.consumer.as_str());
                let refs = self
                    .renewer
                    .list(consumer)
                    .into_iter()
                    .map(|t| pb::TrackedRef {
                        r#ref: t.image,
                        consumers: t.consumers,
                        last_success_unix_ms: unix_ms(t.last_success),
                        last_error: t.last_error.unwrap_or_default(),
                        next_attempt_unix_ms: unix_ms(t.next_attempt),
                        consecutive_failures: t.consecutive_failures,
                        credentials: count(t.credentials),
                        expires_at_unix_ms: unix_ms(t.expires_at),
                        flushed: t.flushed,
                    })
                    .collect();
                Ok(Response::new(pb::ListTrackedResponse { refs }))
            })
            .await
    }

    type WatchStream = WatchEvents;

    async fn watch(
        &self,
        request: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "Watch", async {
                self.watch_inner(peer.uid, req).map(Response::new)
            })
            .await
    }
}

/// The service's bodies.
impl CredentialsApi {
    /// The validity a lookup asks for: its minimum, or longer to reach its deadline.
    fn min_valid_for(&self, req: &pb::LookupRequest) -> Duration {
        let min = Duration::from_millis(req.min_valid_for_ms);
        if req.valid_until_unix_ms <= 0 {
            return min;
        }
        let until =
            SystemTime::UNIX_EPOCH + Duration::from_millis(req.valid_until_unix_ms.unsigned_abs());
        let wanted = until.duration_since(self.clock.wall()).unwrap_or_default();
        min.max(wanted)
    }

    /// A tracked ref's last good credentials, for when its providers fail: never one a
    /// registry refused since.
    fn last_known_good(&self, image: &str) -> Option<Vec<pb::Credential>> {
        let value = self.renewer.last_good(image)?;
        let now = self.clock.now();
        let refusals = self.refusal.memory();
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
        let memory = self.refusal.memory();
        let now = self.clock.wall();
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
        self.calls.metrics.lookup_by(&req.caller);
        let sa = req
            .service_account
            .take()
            .map(service_account)
            .transpose()?;
        let min_valid_for = self.min_valid_for(&req);
        if req.captured_only {
            return self.captured_only(&req);
        }
        let engine = self.engine.load_full();
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
        let Some(captured) = self.captured.as_ref().filter(|_| !registry_host) else {
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
        let policy = *self.renewer.policy();
        let clock = self.clock.clone();
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

    /// `uid`: the caller's, whose refs (named consumers' and Watch streams' together) are
    /// bounded.
    fn watch_inner(&self, uid: Option<u32>, req: pb::WatchRequest) -> Result<WatchEvents, Status> {
        if req.refs.is_empty() {
            return Err(status::invalid("watch needs at least one ref"));
        }
        let mut sub = self
            .renewer
            .watch_as(uid, &req.refs)
            .map_err(ApiError::from)?;
        let mut streams = StreamMap::new();
        for (image, rx) in std::mem::take(&mut sub.receivers) {
            streams.insert(image, WatchStream::new(rx));
        }
        // Each ref's stream keeps only its latest value, and at most WATCH_BUFFER events wait
        // for the client: a client that stops reading costs a bounded amount of memory, and
        // one that has not taken an event within the send timeout (the agent's option,
        // WATCH_SEND_TIMEOUT by default) is dropped.
        let (tx, rx) = tokio::sync::mpsc::channel(WATCH_BUFFER);
        let shutdown = self.calls.shutdown.clone();
        let metrics = self.calls.metrics.clone();
        let send_timeout = self.watch_send_timeout;
        self.tasks.spawn(async move {
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
