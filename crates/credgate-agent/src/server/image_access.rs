//! The `ImageAccess` service: the guard's decisions, recordings and verification.

use credgate_api::v1::image_access_server::ImageAccess;
use credgate_api::v1::{self as pb};
use credgate_core::guard::{Coords, Record};
use secrecy::SecretString;
use tonic::{Request, Response, Status};

use super::{peer, ImageAccessApi};
use crate::guard::store::PresentImage;
use crate::guard::{Answer, CredentialIn, Guard, Presence, PullEnd, PullPolicy};
use crate::status::{self, ApiError};

/// Records and intents on a `ListRecords` page by default, and at most.
const DEFAULT_PAGE: usize = 100;
const MAX_PAGE: usize = 1000;

/// The longest namespace, object name and uid stored (Kubernetes allows 63, 253 and a UUID).
const NAMESPACE_MAX: usize = 63;
const OBJECT_NAME_MAX: usize = 253;
const UID_MAX: usize = 128;

fn coords(o: Option<pb::ObjectRef>, what: &str) -> Result<Coords, Status> {
    let o = o.ok_or_else(|| status::invalid(format!("{what} needs its object")))?;
    if o.namespace.is_empty() || o.name.is_empty() {
        return Err(status::invalid(format!("{what} needs namespace and name")));
    }
    if o.namespace.len() > NAMESPACE_MAX || o.name.len() > OBJECT_NAME_MAX || o.uid.len() > UID_MAX
    {
        return Err(status::invalid(format!(
            "{what}: namespace, name or uid longer than Kubernetes allows ({NAMESPACE_MAX}, {OBJECT_NAME_MAX}, {UID_MAX})"
        )));
    }
    Ok(Coords {
        namespace: o.namespace,
        name: o.name,
        uid: o.uid,
    })
}

fn credential(c: pb::PullCredential) -> Result<CredentialIn, Status> {
    use pb::pull_credential::Kind;
    match c.kind {
        Some(Kind::Secret(s)) => Ok(CredentialIn::Secret {
            coords: coords(s.secret, "a secret credential")?,
            username: s.username,
            password: SecretString::from(s.password),
        }),
        Some(Kind::ServiceAccount(sa)) => Ok(CredentialIn::ServiceAccount(coords(
            Some(sa),
            "a service account",
        )?)),
        Some(Kind::NodeWide(_)) => Ok(CredentialIn::NodeWide),
        None => Err(status::invalid(
            "a credential must be a secret, a service account or node_wide",
        )),
    }
}

fn credentials(list: Vec<pb::PullCredential>) -> Result<Vec<CredentialIn>, Status> {
    list.into_iter().map(credential).collect()
}

fn object(c: &Coords) -> pb::ObjectRef {
    pb::ObjectRef {
        namespace: c.namespace.clone(),
        name: c.name.clone(),
        uid: c.uid.clone(),
    }
}

/// The wire form of a record; hashes stay in the agent.
pub fn record(r: &Record) -> pb::PullRecord {
    pb::PullRecord {
        image_ref: r.image_ref.clone(),
        names: r
            .names
            .iter()
            .map(|(name, e)| pb::NameRecord {
                name: name.clone(),
                node_accessible: e.node_accessible,
                secrets: e
                    .secrets
                    .iter()
                    .map(|s| pb::RecordedSecret {
                        secret: Some(object(&s.coords)),
                        recorded_unix_ms: s.recorded_ms,
                    })
                    .collect(),
                service_accounts: e.service_accounts.iter().map(object).collect(),
                changed_unix_ms: e.changed_ms,
            })
            .collect(),
        changed_unix_ms: r.changed_ms,
    }
}

fn decision(a: Answer) -> i32 {
    let d = match a {
        Answer::Allow => pb::Decision::Allow,
        Answer::MustAuthenticate => pb::Decision::MustAuthenticate,
        Answer::Refuse => pb::Decision::Refuse,
        Answer::Pull => pb::Decision::Pull,
    };
    d as i32
}

impl ImageAccessApi {
    fn guard(&self) -> Result<&Guard, Status> {
        self.guard.as_ref().ok_or_else(|| {
            ApiError::NotEnabled("the image access guard is not enabled on this agent").into()
        })
    }
}

#[tonic::async_trait]
impl ImageAccess for ImageAccessApi {
    async fn check_access(
        &self,
        request: Request<pb::CheckAccessRequest>,
    ) -> Result<Response<pb::CheckAccessResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "CheckAccess", async {
                let guard = self.guard()?;
                let policy = match pb::PullPolicy::try_from(req.pull_policy) {
                    Ok(pb::PullPolicy::Always) => PullPolicy::Always,
                    Ok(pb::PullPolicy::Never) => PullPolicy::Never,
                    Ok(_) => PullPolicy::IfNotPresent,
                    Err(_) => return Err(status::invalid("unknown pull_policy")),
                };
                if req.present && req.image_ref.is_empty() {
                    return Err(status::invalid("a present image needs its image_ref"));
                }
                let creds = credentials(req.credentials)?;
                let a = guard
                    .check(
                        &req.image,
                        &req.image_ref,
                        Presence::of(req.present),
                        policy,
                        &creds,
                    )
                    .map_err(ApiError::from)?;
                Ok(Response::new(pb::CheckAccessResponse {
                    decision: decision(a.answer),
                    reason: super::wire::access_reason(a.reason),
                    message: a.message,
                }))
            })
            .await
    }

    async fn record_pull_intent(
        &self,
        request: Request<pb::RecordPullIntentRequest>,
    ) -> Result<Response<pb::RecordPullIntentResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "RecordPullIntent", async {
                self.guard()?
                    .record_intent(&req.image)
                    .await
                    .map_err(ApiError::from)?;
                Ok(Response::new(pb::RecordPullIntentResponse {}))
            })
            .await
    }

    async fn record_pull_result(
        &self,
        request: Request<pb::RecordPullResultRequest>,
    ) -> Result<Response<pb::RecordPullResultResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "RecordPullResult", async {
                let used = req.credential.map(credential).transpose()?;
                let end = PullEnd::reported(req.success, &req.image_ref, used.as_ref())
                    .map_err(ApiError::from)?;
                self.guard()?
                    .record_result(&req.image, end)
                    .await
                    .map_err(ApiError::from)?;
                Ok(Response::new(pb::RecordPullResultResponse {}))
            })
            .await
    }

    async fn verify(
        &self,
        request: Request<pb::VerifyRequest>,
    ) -> Result<Response<pb::VerifyResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "Verify", async {
                let creds = credentials(req.credentials)?;
                let expected =
                    (!req.expected_digest.is_empty()).then_some(req.expected_digest.as_str());
                // Registry round trips: on the call's own task.
                let v = self
                    .guard()?
                    .verify(&req.image, &req.image_ref, expected, &creds)
                    .await
                    .map_err(ApiError::from)?;
                let decision = if v.accepted.is_some() {
                    pb::Decision::Allow
                } else {
                    pb::Decision::MustAuthenticate
                };
                Ok(Response::new(pb::VerifyResponse {
                    decision: decision as i32,
                    reason: super::wire::verify_reason(v.reason),
                    message: v.message,
                    credential_index: v.accepted.map_or(-1, |i| i32::try_from(i).unwrap_or(-1)),
                    digest: v.digest.unwrap_or_default(),
                }))
            })
            .await
    }

    async fn prune(
        &self,
        request: Request<pb::PruneRequest>,
    ) -> Result<Response<pb::PruneResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "Prune", async {
                let present = req
                    .present
                    .into_iter()
                    .map(|p| PresentImage {
                        image_ref: p.image_ref,
                        references: p.references,
                    })
                    .collect();
                let p = self
                    .guard()?
                    .prune(present, req.before_unix_ms)
                    .await
                    .map_err(ApiError::from)?;
                let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
                Ok(Response::new(pb::PruneResponse {
                    records_deleted: n(p.records_deleted),
                    intents_recovered: n(p.intents_recovered),
                    intents_dropped: n(p.intents_dropped),
                }))
            })
            .await
    }

    async fn list_records(
        &self,
        request: Request<pb::ListRecordsRequest>,
    ) -> Result<Response<pb::ListRecordsResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "ListRecords", async {
                let store = self.guard()?.store().map_err(ApiError::from)?;
                let size = match req.page_size {
                    0 => DEFAULT_PAGE,
                    n => (n as usize).min(MAX_PAGE),
                };
                // Records then intents, each sorted: an item's key is `r<image ID>` or `i<image>`,
                // which sort in that same order, and a token is the key of a page's last item.
                let records = store.records();
                let intents = store.intents();
                let keyed = records
                    .iter()
                    .map(|r| (format!("r{}", r.image_ref), Some(r), None))
                    .chain(
                        intents
                            .into_iter()
                            .map(|i| (format!("i{}", i.0), None, Some(i))),
                    );
                let token = req.page_token;
                if !(token.is_empty() || token.starts_with('r') || token.starts_with('i')) {
                    return Err(status::invalid("invalid page_token"));
                }
                let after = |key: &String| {
                    token.is_empty()
                        || (key.as_bytes()[0] == token.as_bytes()[0] && *key > token)
                        || (key.starts_with('i') && token.starts_with('r'))
                };
                let mut answer = pb::ListRecordsResponse::default();
                let mut last = String::new();
                for (n, (key, rec, intent)) in keyed.filter(|(k, _, _)| after(k)).enumerate() {
                    if n == size {
                        answer.next_page_token = last;
                        break;
                    }
                    if let Some(r) = rec {
                        answer.records.push(record(r));
                    }
                    if let Some((image, i)) = intent {
                        answer.intents.push(pb::PullIntent {
                            image,
                            name: i.name,
                            count: i.count,
                            created_unix_ms: i.created_ms,
                        });
                    }
                    last = key;
                }
                Ok(Response::new(answer))
            })
            .await
    }

    async fn get_record(
        &self,
        request: Request<pb::GetRecordRequest>,
    ) -> Result<Response<pb::GetRecordResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "GetRecord", async {
                let store = self.guard()?.store().map_err(ApiError::from)?;
                let r = store.record(&req.image_ref).ok_or_else(|| {
                    Status::from(ApiError::NotFound(format!(
                        "no record of {}",
                        credgate_core::text::Quoted(&req.image_ref)
                    )))
                })?;
                Ok(Response::new(pb::GetRecordResponse {
                    record: Some(record(&r)),
                }))
            })
            .await
    }

    async fn delete_record(
        &self,
        request: Request<pb::DeleteRecordRequest>,
    ) -> Result<Response<pb::DeleteRecordResponse>, Status> {
        let peer = peer(&request);
        let req = request.into_inner();
        self.calls
            .observed(peer, "DeleteRecord", async {
                let deleted = self
                    .guard()?
                    .delete(&req.image_ref)
                    .await
                    .map_err(ApiError::from)?;
                Ok(Response::new(pb::DeleteRecordResponse { deleted }))
            })
            .await
    }
}
