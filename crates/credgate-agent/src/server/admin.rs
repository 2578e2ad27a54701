//! The `Admin` service: health, status, reload, captured credentials, explain, pulls.

use credgate_api::v1::admin_server::Admin;
use credgate_api::v1::{self as pb};
use tonic::{Request, Response, Status};

use super::*;
use crate::agent::Service;
use crate::status::{self, ApiError};

use crate::ReloadError;

/// What calls about the CRI proxy answer on an agent that does not run it.
const PROXY_OFF: &str = "the CRI proxy does not run on this agent (--cri-proxy-socket)";

/// Images one flush may name.
const MAX_FLUSH_IMAGES: usize = 1024;

impl AdminApi {
    /// Leaves out of an explanation what the caller could not learn from the services it may
    /// call: the guard's records without image-access, the sources, their cache and the
    /// captured credential without credentials (`--allow-uids`).
    fn only_what_the_caller_may_see(&self, peer: Peer, answer: &mut pb::ExplainResponse) {
        let callers = &self.calls.callers;
        if !callers.allows(Service::ImageAccess, peer.uid) {
            answer.guard_records.clear();
            answer.guard_record_summaries.clear();
            answer.guard_node_wide_decision = not_for(peer, Service::ImageAccess).message();
        }
        if !callers.allows(Service::Credentials, peer.uid) {
            answer.sources.clear();
            answer.captured = false;
            answer.captured_namespace.clear();
            answer.captured_unix_ms = 0;
            answer.verdict = not_for(peer, Service::Credentials).message();
        }
    }
}

#[tonic::async_trait]
impl Admin for AdminApi {
    async fn flush(
        &self,
        request: Request<pb::FlushRequest>,
    ) -> Result<Response<pb::FlushResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls.observed(peer, "Flush", async {
            if req.images.len() > MAX_FLUSH_IMAGES {
                return Err(status::invalid(format!(
                    "at most {MAX_FLUSH_IMAGES} images per flush"
                )));
            }
            let privileged =
                credgate_engine::rate::Caller::of(peer.uid, rustix::process::geteuid().as_raw())
                    .privileged;
            if !privileged && !self.control.may_flush_unprivileged() {
                return Err(ApiError::Limited(format!(
                    "flushes by uids other than root and the agent's own are limited to one per {}s in all",
                    crate::control::UNPRIVILEGED_FLUSH_EVERY.as_secs()
                ))
                .into());
            }
            let provider = Some(req.provider.as_str()).filter(|p| !p.is_empty());
            let dropped = self
                .control
                .flush(provider, &req.images)
                .await
                .map_err(ApiError::from)?;
            let dropped = dropped
                .into_iter()
                .map(|d| pb::DroppedAnswer {
                    provider: d.provider,
                    cache_key_type: super::wire::cache_key_type(d.key_type),
                    key: d.key,
                    expires_unix_ms: unix_ms(d.expires),
                    service_account: d.scoped,
                })
                .collect();
            Ok(Response::new(pb::FlushResponse { dropped }))
        })
        .await
    }

    async fn health(
        &self,
        request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        self.calls
            .observed(peer(&request), "Health", async {
                Ok(Response::new(pb::HealthResponse {
                    status: "SERVING".to_owned(),
                }))
            })
            .await
    }

    async fn version(
        &self,
        request: Request<pb::VersionRequest>,
    ) -> Result<Response<pb::VersionResponse>, Status> {
        self.calls
            .observed(peer(&request), "Version", async {
                Ok(Response::new(pb::VersionResponse {
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                    api: credgate_api::API.to_owned(),
                }))
            })
            .await
    }

    async fn status(
        &self,
        request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        self.calls
            .observed(peer(&request), "Status", async {
                Ok(Response::new(self.status_inner()))
            })
            .await
    }

    async fn reload(
        &self,
        request: Request<pb::ReloadRequest>,
    ) -> Result<Response<pb::ReloadResponse>, Status> {
        self.calls
            .observed(peer(&request), "Reload", async {
                let reloaded = self.control.reload_logged().await.map_err(|e| match e {
                    ReloadError::Refused(msg) => ApiError::Reload(msg),
                    ReloadError::Task => ApiError::Internal("reload task failed"),
                })?;
                Ok(Response::new(pb::ReloadResponse {
                    config_identity: reloaded.identity.unwrap_or_default(),
                    changed: reloaded.changed,
                }))
            })
            .await
    }

    async fn ping(
        &self,
        _: Request<pb::PingRequest>,
    ) -> Result<Response<pb::PingResponse>, Status> {
        Ok(Response::new(pb::PingResponse {}))
    }

    async fn list_captured(
        &self,
        request: Request<pb::ListCapturedRequest>,
    ) -> Result<Response<pb::ListCapturedResponse>, Status> {
        let peer = peer(&request);
        self.calls
            .observed(peer, "ListCaptured", async {
                // Captured pull credentials are credentials: the Credentials allowlist applies.
                self.calls.also_allowed(peer, Service::Credentials)?;
                let Some(captured) = &self.captured else {
                    return Err(ApiError::NotEnabled(if self.proxy.serving().is_some() {
                    "the CRI proxy keeps no pull credentials on this agent (--no-cri-proxy-capture)"
                } else {
                    PROXY_OFF
                })
                .into());
                };
                let age = captured
                    .max_age()
                    .map(|a| i64::try_from(a.as_millis()).unwrap_or(i64::MAX));
                let list = captured
                    .list()
                    .into_iter()
                    .map(|(repository, c)| pb::CapturedCredential {
                        repository,
                        namespace: c.namespace,
                        username: c.username,
                        captured_unix_ms: c.captured_ms,
                        expires_unix_ms: age.map_or(0, |a| c.captured_ms.saturating_add(a)),
                    })
                    .collect();
                Ok(Response::new(pb::ListCapturedResponse { captured: list }))
            })
            .await
    }

    async fn explain(
        &self,
        request: Request<pb::ExplainRequest>,
    ) -> Result<Response<pb::ExplainResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "Explain", async {
                self.calls
                    .may_claim_identity(peer, req.service_account.as_ref())?;
                let sa = req.service_account.map(service_account).transpose()?;
                let mut answer = self
                    .explainer
                    .explain(&req.image, sa.as_ref())
                    .map_err(ApiError::from)?;
                self.only_what_the_caller_may_see(peer, &mut answer);
                Ok(Response::new(answer))
            })
            .await
    }

    async fn list_pulls(
        &self,
        request: Request<pb::ListPullsRequest>,
    ) -> Result<Response<pb::ListPullsResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "ListPulls", async {
                // Pulls name pods and images: what the image-access service is restricted for.
                if !self.calls.callers.allows(Service::ImageAccess, peer.uid) {
                    return Err(not_for(peer, Service::ImageAccess).into());
                }
                let Some(proxy) = self.proxy.serving() else {
                    return Err(ApiError::NotEnabled(PROXY_OFF).into());
                };
                let repository = if req.image.is_empty() {
                    None
                } else {
                    Some(repository_of("image", &req.image)?)
                };
                let pulls = proxy.pulls(repository.as_deref());
                Ok(Response::new(pb::ListPullsResponse { pulls }))
            })
            .await
    }

    async fn forget_captured(
        &self,
        request: Request<pb::ForgetCapturedRequest>,
    ) -> Result<Response<pb::ForgetCapturedResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "ForgetCaptured", async {
                self.calls.also_allowed(peer, Service::Credentials)?;
                let Some(captured) = &self.captured else {
                    return Err(ApiError::NotEnabled(PROXY_OFF).into());
                };
                let repository = repository_of("repository", &req.repository)?;
                let forgotten = captured.forget(&repository).map_err(ApiError::from)?;
                Ok(Response::new(pb::ForgetCapturedResponse { forgotten }))
            })
            .await
    }
}

/// The normalized repository of a request's `field` (`image`, `repository`); INVALID_ARGUMENT
/// quoting what was sent when it does not parse.
fn repository_of(field: &str, text: &str) -> Result<String, Status> {
    credgate_core::reference::ImageRef::parse(text)
        .map(|r| r.name().to_owned())
        .map_err(|e| {
            status::invalid(format!(
                "invalid {field} {}: {e}",
                credgate_core::text::Quoted(text)
            ))
        })
}

/// `Status`.
impl AdminApi {
    fn status_inner(&self) -> pb::StatusResponse {
        let engine = self.control.engine();
        let statuses = engine.provider_status();
        let next = self.renewer.next_renewal_by_provider(statuses.len());
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
        let sources = self.control.sources();
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
            tracked_refs: u32::try_from(self.renewer.len()).unwrap_or(u32::MAX),
            started_unix_ms: unix_ms(Some(self.started)),
            loaded_unix_ms: unix_ms(Some(self.control.loaded())),
            saved_cache: Some({
                let r = self.saver.report();
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
            cri_proxy: self.proxy.state(),
            node_images: self
                .proxy
                .view()
                .map(|view| view.node_images())
                .unwrap_or_default(),
        }
    }
}
