//! What the proxy does with a `PullImage`: reads the image and the credential it carries,
//! lets the policy fill or replace the credential ([`super::fill`]), forwards it, then logs
//! the decision, records it for the guard and hands the credential to capture.

use std::time::Duration;

use credgate_api::cri as wire;
use hyper::body::{Bytes, Incoming};
use secrecy::ExposeSecret as _;

use super::capture::Capturer;
use super::fill::{apply_policy, refreshed};
use super::pull_request::{pull_of, redacted, Pull};
use super::runtime::{self, exchange, grpc_message, read_whole, CallerConn};
use super::{decision, policy, Body, MAX_PULL_MESSAGE, MAX_PULL_REQUEST};
use credgate_agent::guard::PullEnd;

/// Whose a pull's credential is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Whose {
    /// The node's: a provider or a docker config of the agent gives it now (the kubelet got
    /// it through the bridge, or the proxy filled it in). Never captured as a pod's.
    Node,
    /// A pod's own secret, or no credential at all.
    Caller,
}

/// Which of the agent's sources gave the pull's credential (or, when none does now, the one a
/// refusal of it remembers), found once for the log, a refusal and capture; and whose it is.
pub(super) fn sources_of(
    ctx: &super::Context,
    pull: &Pull,
) -> (Vec<credgate_agent::refusal::Given>, Whose) {
    let Some(c) = &pull.credential else {
        return (Vec::new(), Whose::Caller);
    };
    let password = c.password.expose_secret();
    let now = ctx
        .refusal
        .given_now(&pull.image, &pull.repository, &c.username, password);
    let whose = if now
        .iter()
        .any(|g| !matches!(g, credgate_agent::refusal::Given::Captured(_)))
    {
        Whose::Node
    } else {
        Whose::Caller
    };
    (ctx.refusal.or_known(now, &c.username, password), whose)
}

/// What an unauthorized pull's credential came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Nothing was asked: the pull was not unauthorized, carried no credential of the agent's
    /// sources, or named no image.
    NotAsked,
    /// Not asked: containerd did not send the credential to the image's registry (why).
    NotSent(String),
    /// The registry was asked: what it said, for the pull log; `provider_refused`: it refused
    /// a provider's credential (the pull goes again with the provider's answer of now).
    Asked {
        said: String,
        provider_refused: bool,
    },
}

impl Refusal {
    /// For the pull log: empty when nothing was asked.
    pub(super) fn said(&self) -> String {
        match self {
            Refusal::NotAsked => String::new(),
            Refusal::NotSent(why) => format!("not refused by this pull: {why}"),
            Refusal::Asked { said, .. } => said.clone(),
        }
    }

    pub(super) fn provider_refused(&self) -> bool {
        matches!(
            self,
            Refusal::Asked {
                provider_refused: true,
                ..
            }
        )
    }
}

/// The runtime answered the pull unauthorized. When the credential it carried is one of the
/// agent's sources' (`given`) and containerd sent it to the image's registry, the registry is
/// asked whether it refuses that credential itself, and only then is it refused
/// ([`credgate_agent::refusal::Refuser::confirm_and_refuse`]); a pod's own secret changes nothing and asks
/// nothing.
pub(super) async fn refused(
    ctx: &super::Context,
    pull: &Pull,
    given: &[credgate_agent::refusal::Given],
) -> Refusal {
    use credgate_agent::refusal::Report;
    let Some(c) = &pull.credential else {
        return Refusal::NotAsked;
    };
    if given.is_empty() {
        return Refusal::NotAsked;
    }
    let Ok(parsed) = credgate_core::reference::ImageRef::parse(&pull.image) else {
        return Refusal::NotAsked;
    };
    if let policy::Sent::No(why) = policy::sent_to_registry(&pull.server_address, parsed.registry())
    {
        return Refusal::NotSent(why);
    }
    let report = ctx
        .refusal
        .confirm_and_refuse(
            &pull.image,
            &parsed,
            &c.username,
            &c.password,
            given,
            "a pull through the CRI proxy",
            false,
        )
        .await;
    let said = report.describe(&pull.image);
    if report == Report::Accepted && ctx.pulls.may_warn(&pull.image, ctx.clock.now()) {
        tracing::warn!(
            image = %pull.image,
            pod_namespace = %pull.pod_namespace,
            pod = %pull.pod_name,
            "{said}"
        );
    }
    let provider_refused = matches!(report, Report::Refused(_) | Report::Recently)
        && given
            .iter()
            .any(|g| matches!(g, credgate_agent::refusal::Given::Provider(_)));
    Refusal::Asked {
        said,
        provider_refused,
    }
}

/// How the image access guard records a pull, as the kubelet records its own (KEP-2535): a
/// pull with a pod's credential as a secret of the pod's namespace named after its content
/// (`PullImage` carries no secret name; the guard matches by content across names anyway);
/// one without, or with the node's own credential (filled by the proxy, or one a provider or
/// docker config gave the kubelet: [`Whose::Node`]), as node-wide; one with a credential a KEP-4412
/// provider gave for service accounts of the pod's namespace (`accounts`), as those service
/// accounts. A pull with a credential but no pod is never recorded as node-wide: its result
/// is not recorded at all, and the intent keeps the image requiring authentication.
pub(super) fn recorded_as(
    pull: &Pull,
    whose: Whose,
    accounts: &[(String, String, String)],
    guard: &credgate_agent::guard::Guard,
) -> Vec<credgate_agent::guard::CredentialIn> {
    use credgate_agent::guard::CredentialIn;
    use credgate_core::guard::Coords;
    match &pull.credential {
        None => vec![CredentialIn::NodeWide],
        Some(_) if pull.filled.is_some() => vec![CredentialIn::NodeWide],
        Some(_) if !pull.in_pod || pull.other_registry => Vec::new(),
        Some(_) if whose == Whose::Node && !accounts.is_empty() => accounts
            .iter()
            .filter(|(namespace, ..)| *namespace == pull.pod_namespace)
            .map(|(namespace, name, uid)| {
                CredentialIn::ServiceAccount(Coords {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    uid: uid.clone(),
                })
            })
            .collect(),
        Some(_) if whose == Whose::Node => vec![CredentialIn::NodeWide],
        Some(c) => vec![CredentialIn::Secret {
            coords: Coords {
                namespace: c.namespace.clone(),
                // Without the node key no name, and `record_result` refuses the record for
                // the missing key, as it does any secret then.
                name: guard
                    .unnamed_secret(&c.username, &c.password)
                    .unwrap_or_default(),
                uid: String::new(),
            },
            username: c.username.clone(),
            password: c.password.clone(),
        }],
    }
}

/// A `PullImage`: read whole (bounded), forwarded, its answer read whole, then logged
/// ([`decision`]), recorded by the guard (when it is on) and, when the runtime says it
/// succeeded, the credential it carried for the image's registry offered for capture (when
/// capture is on; confirmed with the registry and written before the answer goes back, or
/// after it once the capture wait ([`crate::CAPTURE_WAIT`] as shipped) has passed: [`settle`]).
pub(super) async fn pull(
    caller: &CallerConn,
    pulls: &Pulls,
    request: hyper::Request<Incoming>,
) -> hyper::Response<Body> {
    let (mut parts, mut bytes, taken) =
        match read_whole(caller, request, "PullImage", MAX_PULL_REQUEST).await {
            Ok(read) => read,
            Err(refused) => return refused,
        };
    let now_ms = credgate_engine::clock::unix_ms(pulls.ctx.clock.wall());
    let mut asked = grpc_message(&bytes).and_then(|m| pull_of(m, now_ms));
    if let Some(pull) = asked.as_mut().filter(|p| p.valid) {
        if let Some(frame) = refreshed(&pulls.ctx, pull, &bytes).await {
            parts.headers.remove(hyper::header::CONTENT_LENGTH);
            bytes = frame;
        }
        if let Some(frame) = apply_policy(&pulls.ctx, pull, &bytes).await {
            parts.headers.remove(hyper::header::CONTENT_LENGTH);
            bytes = frame;
        }
    }
    // The intent is on disk before the runtime starts pulling.
    if let (Some(guard), Some(pull)) = (&pulls.guard, asked.as_ref().filter(|p| p.valid)) {
        if let Err(e) = guard.record_intent(&pull.image).await {
            tracing::error!(error = %credgate_core::text::error_chain(&e), "pull intent not recorded");
        }
    }
    // The request goes to the runtime as soon as the pull is forwarded: what it held of the
    // caller's budget is given back now, not when the pull ends (a registry that stalls would
    // otherwise let a few slow pulls hold the connection's whole budget).
    drop(taken);
    // Lent to the registry mirror while the runtime pulls (decision 0030): a lazy-pull
    // snapshotter prepares the layers during the pull, before the credential can be
    // confirmed and captured. Withdrawn when this pull is answered (by then captured, or not).
    let _lent = match (&pulls.capture, asked.as_ref()) {
        (Some(capture), Some(p)) if p.valid && !p.other_registry => p
            .credential
            .clone()
            .and_then(|c| capture.captured.pulling(&p.repository, c)),
        _ => None,
    };
    // Kept for one retry of the same pull (see below).
    let head: Head = (
        parts.method.clone(),
        parts.uri.clone(),
        parts.version,
        parts.headers.clone(),
    );
    let started = std::time::Instant::now();
    let whole = match exchange(caller, parts, bytes.clone(), MAX_PULL_MESSAGE).await {
        Ok(whole) => whole,
        Err(refused) => return refused,
    };
    let Some(mut pull) = asked else {
        return whole.into_response();
    };
    let whose = match answered(pulls, &pull, &whole, started).await {
        Answered::Settle(whose) => {
            settle(pulls, pull, whose, &whole).await;
            return whole.into_response();
        }
        Answered::Refused(whose) => whose,
        Answered::Done => return whole.into_response(),
    };
    // The registry refused, itself, a credential one of the agent's providers gave (the
    // kubelet's copy of an answer the provider has since renewed, or the answer the proxy put
    // in its place): the same pull goes again, once, with the provider's answer of now, so the
    // caller sees the rotation succeed instead of failing once and backing off. Only when the
    // provider answers another credential.
    if let Some(frame) = refreshed(&pulls.ctx, &mut pull, &bytes).await {
        return again(caller, pulls, pull, head, frame).await;
    }
    settle(pulls, pull, whose, &whole).await;
    whole.into_response()
}

/// A request's head, kept to send its pull again.
type Head = (hyper::Method, hyper::Uri, hyper::Version, hyper::HeaderMap);

/// The pull sent again with `frame` (its credential replaced): logged, settled and answered
/// as the runtime answers it, whatever that is (never a third attempt).
async fn again(
    caller: &CallerConn,
    pulls: &Pulls,
    pull: Pull,
    (method, uri, version, headers): Head,
    frame: Bytes,
) -> hyper::Response<Body> {
    let mut request = hyper::Request::new(());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = version;
    *request.headers_mut() = headers;
    request.headers_mut().remove(hyper::header::CONTENT_LENGTH);
    let (parts, ()) = request.into_parts();
    let started = std::time::Instant::now();
    let whole = match exchange(caller, parts, frame, MAX_PULL_MESSAGE).await {
        Ok(whole) => whole,
        Err(refused) => return refused,
    };
    if let Answered::Settle(whose) | Answered::Refused(whose) =
        answered(pulls, &pull, &whole, started).await
    {
        settle(pulls, pull, whose, &whole).await;
    }
    whole.into_response()
}

/// What a pull's answer leaves to do once it is logged.
pub(super) enum Answered {
    /// Record and capture it, as whose credential it is.
    Settle(Whose),
    /// The registry refused the credential itself, one of the agent's providers gave: the
    /// pull may go again, once, with the provider's answer of now (then it is settled).
    Refused(Whose),
    /// Nothing more (an invalid pull).
    Done,
}

/// Logs a pull's answer ([`decision`]) and, when it ended unauthorized with a credential of
/// the agent's, asks the registry whether it refuses the credential itself ([`refused`]).
pub(super) async fn answered(
    pulls: &Pulls,
    pull: &Pull,
    whole: &runtime::Whole,
    started: std::time::Instant,
) -> Answered {
    let code = whole.code().unwrap_or(2);
    // What the caller sent is its own: the message keeps none of it past this point.
    let message = redacted(&whole.message(), &pull.carried);
    let (given, whose) = sources_of(&pulls.ctx, pull);
    let took = started.elapsed();
    let result = crate::outcome::PullResult::of(code, &message);
    let refusal = if pull.valid && result == crate::outcome::PullResult::Unauthorized {
        refused(&pulls.ctx, pull, &given).await
    } else {
        Refusal::NotAsked
    };
    let provider_refused = refusal.provider_refused();
    decision::log(
        &pulls.ctx,
        pull,
        &given,
        (code, result),
        &message,
        took,
        refusal.said(),
    );
    match (pull.valid, provider_refused) {
        (false, _) => Answered::Done,
        (true, true) => Answered::Refused(whose),
        (true, false) => Answered::Settle(whose),
    }
}

/// What a forwarded pull leaves once the runtime answered: the guard's record of its result
/// (with the guard), its credential's capture when it succeeded (with capture), on disk before
/// the answer goes back (bounded by the proxy's capture wait, [`crate::CAPTURE_WAIT`]).
/// A [`Whose::Node`] credential is never captured as a pod's.
pub(super) async fn settle(pulls: &Pulls, pull: Pull, whose: Whose, whole: &runtime::Whole) {
    use prost::Message as _;
    let image_ref = (whole.code() == Some(0))
        .then(|| grpc_message(&whole.data))
        .flatten()
        .and_then(|m| wire::PullImageResponse::decode(m).ok())
        .map(|r| r.image_ref)
        .filter(|r| !r.is_empty());
    if let Some(guard) = &pulls.guard {
        let accounts = match &pull.credential {
            Some(c) if whose == Whose::Node => pulls.ctx.engine().service_accounts_given(
                &pull.image,
                &c.username,
                c.password.expose_secret(),
            ),
            _ => Vec::new(),
        };
        let used = recorded_as(&pull, whose, &accounts, guard);
        let ends: Vec<PullEnd> = match &image_ref {
            Some(image_ref) => used
                .iter()
                .map(|used| PullEnd::Pulled { image_ref, used })
                .collect(),
            None => vec![PullEnd::Failed],
        };
        for end in ends {
            if let Err(e) = guard.record_result(&pull.image, end).await {
                tracing::error!(error = %credgate_core::text::error_chain(&e), "pull result not recorded");
            }
        }
    }
    let (Some(_), Some(credential), Some(capture)) = (&image_ref, pull.credential, &pulls.capture)
    else {
        return;
    };
    if pull.other_registry {
        pulls
            .ctx
            .metrics
            .capture(crate::metrics::CaptureResult::OtherRegistry);
        tracing::warn!(repository = %pull.repository, "pull credentials not captured: their server address names another registry");
        return;
    }
    if whose == Whose::Node {
        // The node's own credential (the kubelet got it from a provider through the bridge,
        // or from a docker config): not a pod's secret, and a copy would outlive the
        // provider's rotation of it.
        pulls
            .ctx
            .metrics
            .capture(crate::metrics::CaptureResult::OwnSource);
        return;
    }
    let repository = pull.repository.clone();
    if let Some(settled) = capture
        .capturer
        .offer(pull.image, pull.repository, credential)
    {
        // Acknowledged means kept: a crash right after the answer loses no confirmed capture.
        // A registry slow to confirm holds the answer only so long.
        if tokio::time::timeout(capture.wait, settled).await.is_err() {
            pulls.ctx.metrics.captures_late.inc();
            tracing::warn!(repository = %repository, wait = ?capture.wait, "the pull is answered before its credential's capture is confirmed: the registry did not confirm it in time; the capture goes on");
        }
    }
}

/// What the proxy does with pulls besides forwarding them, each part independent of the
/// others: the decision log (always), the guard's records (with the guard), capture (with
/// captured credentials).
pub(super) struct Pulls {
    /// Its metrics, and for the pull decision log its engine, clock and pull ring.
    pub(super) ctx: super::Context,
    pub(super) guard: Option<credgate_agent::guard::Guard>,
    pub(super) capture: Option<Capture>,
    /// Counts the `RemoveImage`s the runtime answered: each of the node's kept images is
    /// checked again (every image's loop sees each change, even one made while it pulled).
    pub(super) removed: tokio::sync::watch::Sender<u64>,
}

/// What the proxy captures with: where captures are kept, the task that confirms and writes
/// them.
pub(super) struct Capture {
    pub(super) captured: std::sync::Arc<credgate_agent::captured::Captured>,
    pub(super) capturer: Capturer,
    /// How long a pull's answer waits for its capture.
    pub(super) wait: Duration,
    /// The proxy's own view of the runtime's images, on a budget of its own.
    pub(super) view: std::sync::Arc<super::check::ImageView>,
}

impl Capture {
    /// Capture into `captured`, confirmed with the image's registry, its image checks on the
    /// proxy's `own` runtime connection; and the task that confirms and writes, which ends
    /// once the last `Capture` is gone.
    pub(super) fn start(
        captured: std::sync::Arc<credgate_agent::captured::Captured>,
        registry: credgate_agent::guard::registry::RegistryOptions,
        view: &std::sync::Arc<super::check::ImageView>,
        metrics: &crate::metrics::ProxyMetrics,
        wait: Duration,
    ) -> (Capture, tokio::task::JoinHandle<()>) {
        let verifier = credgate_agent::guard::registry::Verifier::new(registry);
        let (capturer, task) = Capturer::start(captured.clone(), verifier, metrics.clone());
        let capture = Capture {
            captured,
            capturer,
            wait,
            view: view.clone(),
        };
        (capture, task)
    }
}
