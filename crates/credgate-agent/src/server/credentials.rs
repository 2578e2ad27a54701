//! The `Credentials` service: lookups, tracked refs, Watch streams.

use credgate_api::v1::credentials_server::Credentials;
use credgate_api::v1::{self as pb};
use secrecy::SecretString;
use tonic::{Request, Response, Status};

use super::{count, peer, unix_ms, Api, WatchEvents};
use crate::status::ApiError;

#[tonic::async_trait]
impl Credentials for Api {
    async fn report_refused(
        &self,
        request: Request<pb::ReportRefusedRequest>,
    ) -> Result<Response<pb::ReportRefusedResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.observed(peer, "ReportRefused", async {
            let password = SecretString::from(req.password);
            let first =
                credgate_engine::rate::Caller::of(peer.uid, rustix::process::geteuid().as_raw())
                    .privileged;
            let report = self
                .agent
                .refusal()
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
        self.observed(peer, "Lookup", async {
            self.may_claim_identity(peer, request.service_account.as_ref())?;
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
        self.observed(peer, "Track", async {
            let n = self
                .agent
                .renewer()
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
        self.observed(peer, "Untrack", async {
            let n = self
                .agent
                .renewer()
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
        self.observed(peer, "SetTracked", async {
            let change = self
                .agent
                .renewer()
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
        self.observed(peer, "ListTracked", async {
            let consumer = (!req.consumer.is_empty()).then_some(req.consumer.as_str());
            let refs = self
                .agent
                .renewer()
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
        self.observed(peer, "Watch", async {
            self.watch_inner(peer.uid, req).map(Response::new)
        })
        .await
    }
}
