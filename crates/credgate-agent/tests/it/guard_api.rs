//! The guard's records over the real socket: stored fields are bounded, and `ListRecords`
//! answers in pages that together hold every record and intent once, in order.

use credgate_agent::guard::GuardOptions;
use credgate_agent::socket::{self, SocketAccess};
use credgate_agent::{server, Agent, AgentOptions};
use credgate_api::v1::image_access_client::ImageAccessClient;
use credgate_api::v1::{self as pb};
use credgate_core::guard::{Allowlist, Policy};
use credgate_engine::clock::Clock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tonic::transport::Channel;

/// The system's clocks, moved forward by hand: time passes without a test sleeping.
#[derive(Default)]
struct Shifted {
    ahead_ms: AtomicU64,
}

impl Shifted {
    fn advance(&self, by: Duration) {
        self.ahead_ms
            .fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }

    fn ahead(&self) -> Duration {
        Duration::from_millis(self.ahead_ms.load(Ordering::SeqCst))
    }
}

impl Clock for Shifted {
    fn now(&self) -> Instant {
        Instant::now() + self.ahead()
    }

    fn wall(&self) -> SystemTime {
        SystemTime::now() + self.ahead()
    }
}

async fn start(dir: &std::path::Path) -> (ImageAccessClient<Channel>, tokio_util::sync::DropGuard) {
    start_with(dir, None, None).await
}

async fn start_with(
    dir: &std::path::Path,
    max_age: Option<Duration>,
    clock: Option<Arc<dyn Clock>>,
) -> (ImageAccessClient<Channel>, tokio_util::sync::DropGuard) {
    let agent = Agent::new(AgentOptions {
        guard: Some(GuardOptions {
            policy: Policy::AlwaysVerify,
            allowlist: Allowlist::default(),
            max_age,
            state_dir: dir.join("state"),
            registry: Default::default(),
        }),
        clock,
        ..Default::default()
    })
    .unwrap();
    let path = dir.join("credgate.sock");
    let listener = socket::bind(&path, &SocketAccess::default()).await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(server::serve(agent, listener, stop.clone()));
    let channel = credgate_api::connect(&path).await.unwrap();
    (ImageAccessClient::new(channel), stop.drop_guard())
}

fn node_wide() -> Option<pb::PullCredential> {
    Some(pb::PullCredential::node_wide())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_records_pages_through_everything_once_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (mut client, _stop) = start(dir.path()).await;
    let ids: Vec<String> = (0..250).map(|i| format!("sha256:{i:064x}")).collect();
    for id in &ids {
        client
            .record_pull_result(pb::RecordPullResultRequest {
                image: "reg.example.com/team/app:v1".into(),
                image_ref: id.clone(),
                success: true,
                credential: node_wide(),
            })
            .await
            .unwrap();
    }
    for i in 0..30 {
        client
            .record_pull_intent(pb::RecordPullIntentRequest {
                image: format!("reg.example.com/team/pending-{i:02}:v1"),
            })
            .await
            .unwrap();
    }
    let mut records = Vec::new();
    let mut intents = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = client
            .list_records(pb::ListRecordsRequest {
                page_size: 100,
                page_token: token,
            })
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        assert!(page.records.len() + page.intents.len() <= 100);
        records.extend(page.records.into_iter().map(|r| r.image_ref));
        intents.extend(page.intents.into_iter().map(|i| i.image));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
        assert!(pages < 10, "pagination does not end");
    }
    assert_eq!(pages, 3);
    assert_eq!(records, ids, "every record once, in order");
    let want: Vec<String> = (0..30)
        .map(|i| format!("reg.example.com/team/pending-{i:02}:v1"))
        .collect();
    assert_eq!(intents, want);
    // A token that is not one is refused.
    let e = client
        .list_records(pb::ListRecordsRequest {
            page_size: 10,
            page_token: "x".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_record_fields_are_refused_and_not_stored() {
    let dir = tempfile::tempdir().unwrap();
    let (mut client, _stop) = start(dir.path()).await;
    let e = client
        .record_pull_result(pb::RecordPullResultRequest {
            image: "reg.example.com/team/app:v1".into(),
            image_ref: "x".repeat(100_000),
            success: true,
            credential: node_wide(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().len() < 300, "{} bytes", e.message().len());
    let secret = |namespace: String| {
        let object = pb::ObjectRef {
            namespace,
            name: "pull".into(),
            uid: String::new(),
        };
        pb::PullCredential::secret(object, "u", "p")
    };
    let e = client
        .record_pull_result(pb::RecordPullResultRequest {
            image: "reg.example.com/team/app:v1".into(),
            image_ref: format!("sha256:{:064x}", 1),
            success: true,
            credential: Some(secret("n".repeat(64))),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    // A bad image of a megabyte is within no message limit: refused by size, not echoed.
    let e = client
        .record_pull_intent(pb::RecordPullIntentRequest {
            image: "Bad".repeat(20_000),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().len() < 300, "{} bytes", e.message().len());
    let all = client
        .list_records(pb::ListRecordsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(all.records.is_empty() && all.intents.is_empty());
}

/// A secret match whose recorded pull is older than `--pull-record-max-age` no longer allows;
/// the guard reads the agent's clock, which the test moves forward instead of sleeping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_match_expires_after_the_maximum_age() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(Shifted::default());
    let (mut client, _stop) = start_with(
        dir.path(),
        Some(Duration::from_secs(1)),
        Some(clock.clone()),
    )
    .await;
    let image = "registry.example.com/team-a/app:v1";
    let alice = || {
        let object = pb::ObjectRef {
            namespace: "team-a".into(),
            name: "pull".into(),
            uid: "uid-team-a".into(),
        };
        Some(pb::PullCredential::secret(object, "alice", "pw"))
    };
    client
        .record_pull_result(pb::RecordPullResultRequest {
            image: image.into(),
            image_ref: "sha256:a".into(),
            success: true,
            credential: alice(),
        })
        .await
        .unwrap();
    let check = || {
        let mut client = client.clone();
        async move {
            client
                .check_access(pb::CheckAccessRequest {
                    image: image.into(),
                    image_ref: "sha256:a".into(),
                    present: true,
                    credentials: alice().into_iter().collect(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
        }
    };
    let r = check().await;
    assert_eq!(r.reason().word(), "secret_match");
    clock.advance(Duration::from_millis(1300));
    let r = check().await;
    assert_eq!(
        (r.decision, r.reason().word()),
        (pb::Decision::MustAuthenticate as i32, "secret_too_old")
    );
}
