//! The guard in a running agent: crash safety (the agent is killed with SIGKILL at random
//! moments while many pulls are being recorded; after a restart every pull acknowledged before
//! the kill is there), a damaged database (a clear error and fail-safe answers, never a crash
//! loop), a lost node key, intent recovery, the maximum age, pull policy Never, and the
//! allowlist refused at start.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::Agent;
use credgate_api::v1::image_access_client::ImageAccessClient;
use credgate_api::v1::{self as pb};

fn node_wide() -> Option<pb::PullCredential> {
    Some(pb::PullCredential::node_wide())
}

/// A cheap, seedable source of "random" moments (no RNG dependency).
fn moments(seed: u64, n: usize) -> Vec<u64> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            40 + x % 260
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_pull_survives_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let acked: Arc<Mutex<HashSet<String>>> = Arc::default();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    for (round, kill_after_ms) in moments(seed, 4).into_iter().enumerate() {
        let agent = Agent::start(dir.path(), &[]);
        let channel = credgate_api::connect(&agent.socket).await.unwrap();
        let mut writers = Vec::new();
        let acked_now = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for w in 0..16 {
            let mut client = ImageAccessClient::new(channel.clone());
            let (acked, acked_now) = (acked.clone(), acked_now.clone());
            writers.push(tokio::spawn(async move {
                for i in 0.. {
                    let image = format!("registry.example.com/r{round}/w{w}:i{i}");
                    let image_ref = format!("sha256:r{round}w{w}i{i}");
                    let intent = client
                        .record_pull_intent(pb::RecordPullIntentRequest {
                            image: image.clone(),
                        })
                        .await;
                    if intent.is_err() {
                        return;
                    }
                    let result = client
                        .record_pull_result(pb::RecordPullResultRequest {
                            image,
                            image_ref: image_ref.clone(),
                            success: true,
                            credential: node_wide(),
                        })
                        .await;
                    match result {
                        Ok(_) => {
                            acked.lock().unwrap().insert(image_ref);
                            acked_now.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        Err(_) => return,
                    }
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(kill_after_ms)).await;
        // A slow disk (fsync under a busy test run) must not make the round vacuous: the kill
        // comes at the random moment or once 15 pulls are acknowledged, whichever is later.
        let patience = std::time::Instant::now() + Duration::from_secs(20);
        while acked_now.load(std::sync::atomic::Ordering::SeqCst) < 15
            && std::time::Instant::now() < patience
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        agent.signal(libc::SIGKILL);
        for w in writers {
            let _ = tokio::time::timeout(Duration::from_secs(10), w).await;
        }
        drop(agent);
    }
    // Restart and read everything back.
    let agent = Agent::start(dir.path(), &[]);
    let mut client = agent.image_access().await;
    let mut stored: HashSet<String> = HashSet::new();
    let mut token = String::new();
    loop {
        let page = client
            .list_records(pb::ListRecordsRequest {
                page_size: 1000,
                page_token: token,
            })
            .await
            .expect("the store opens after the kills")
            .into_inner();
        stored.extend(page.records.into_iter().map(|r| r.image_ref));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let acked = acked.lock().unwrap();
    assert!(
        acked.len() > 50,
        "only {} pulls recorded before the kills",
        acked.len()
    );
    let lost: Vec<&String> = acked.iter().filter(|r| !stored.contains(*r)).collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged pulls lost (seed {seed}): {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_store_fails_safe_without_a_crash_loop() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(
        state.join("guard.db"),
        b"this is not a database, it is garbage".repeat(200),
    )
    .unwrap();
    let agent = Agent::start(
        dir.path(),
        &[
            "--image-pull-credentials-verification-policy",
            "NeverVerify",
        ],
    );
    let log = agent.log_text();
    assert!(log.contains("guard store unavailable"), "{log}");
    assert!(log.contains("damaged"), "{log}");
    let mut client = agent.image_access().await;
    // Even NeverVerify does not allow when the records cannot be read.
    let r = client
        .check_access(pb::CheckAccessRequest {
            image: "registry.example.com/team-a/app:v1".into(),
            image_ref: "sha256:abc".into(),
            present: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.decision, pb::Decision::MustAuthenticate as i32);
    assert_eq!(r.reason().word(), "store_unreadable");
    let e = client
        .record_pull_intent(pb::RecordPullIntentRequest {
            image: "registry.example.com/team-a/app:v1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    // The agent keeps serving the rest of its API.
    let out = agent.credgate(&["ctl", "health"]);
    assert_eq!(crate::support::text(&out.stdout).trim(), "SERVING");
    // The damaged file is left for the operator, untouched.
    let bytes = std::fs::read(state.join("guard.db")).unwrap();
    assert!(bytes.starts_with(b"this is not a database"));
}

fn secret(user: &str, password: &str) -> Option<pb::PullCredential> {
    secret_of("team-a", user, password)
}

/// A secret of namespace `ns` (one secret object per namespace).
fn secret_of(ns: &str, user: &str, password: &str) -> Option<pb::PullCredential> {
    let object = pb::ObjectRef {
        namespace: ns.into(),
        name: "pull".into(),
        uid: format!("uid-{ns}"),
    };
    Some(pb::PullCredential::secret(object, user, password))
}

/// Alice's pull of `image` (as `sha256:a`) with her secret succeeded.
async fn record_alice(client: &mut ImageAccessClient<tonic::transport::Channel>, image: &str) {
    client
        .record_pull_result(pb::RecordPullResultRequest {
            image: image.into(),
            image_ref: "sha256:a".into(),
            success: true,
            credential: secret("alice", "pw"),
        })
        .await
        .unwrap();
}

async fn check(
    client: &mut ImageAccessClient<tonic::transport::Channel>,
    image: &str,
    image_ref: &str,
    cred: Option<pb::PullCredential>,
) -> pb::CheckAccessResponse {
    client
        .check_access(pb::CheckAccessRequest {
            image: image.into(),
            image_ref: image_ref.into(),
            present: true,
            credentials: cred.into_iter().collect(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leftover_intents_are_recovered_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    // The workload names `nginx:1.25`; the runtime knows the image as
    // `docker.io/library/nginx:1.25`. The agent dies before the pull's result is recorded.
    agent
        .image_access()
        .await
        .record_pull_intent(pb::RecordPullIntentRequest {
            image: "nginx:1.25".into(),
        })
        .await
        .unwrap();
    agent.signal(libc::SIGKILL);
    drop(agent);

    let agent = Agent::start(dir.path(), &[]);
    let mut client = agent.image_access().await;
    // The intent alone already marks the name as pulled by the node: not "preloaded".
    let r = check(&mut client, "nginx:1.25", "sha256:n", None).await;
    assert_eq!(
        (r.decision, r.reason().word()),
        (pb::Decision::MustAuthenticate as i32, "no_record")
    );
    let pruned = client
        .prune(pb::PruneRequest {
            present: vec![pb::PresentImage {
                image_ref: "sha256:n".into(),
                references: vec!["docker.io/library/nginx:1.25".into()],
            }],
            before_unix_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(pruned.intents_recovered, 1, "matched after normalization");
    let r = check(&mut client, "nginx:1.25", "sha256:n", None).await;
    assert_eq!(
        (r.decision, r.reason().word()),
        (
            pb::Decision::MustAuthenticate as i32,
            "no_credentials_recorded"
        )
    );
    let listed = client
        .list_records(pb::ListRecordsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.intents.is_empty());
    assert_eq!(listed.records[0].names[0].name, "docker.io/library/nginx");
}

#[test]
fn invalid_allowlist_entries_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(["serve", "--no-docker-config", "--socket"])
        .arg(dir.path().join("s.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args([
            "--image-pull-credentials-verification-policy",
            "NeverVerifyAllowlistedImages",
            "--preloaded-images-verification-allowlist",
            "registry.k8s.io/pause,nginx:1.25,quay.io/*/x",
        ])
        .output()
        .unwrap();
    // A bad flag value: a usage error.
    assert_eq!(out.status.code(), Some(2));
    let err = crate::support::text(&out.stderr);
    assert!(
        err.contains("invalid --preloaded-images-verification-allowlist"),
        "{err}"
    );
    assert!(
        err.contains("\"nginx:1.25\"") && err.contains("\"quay.io/*/x\""),
        "{err}"
    );
    assert!(!err.contains("\"registry.k8s.io/pause\""), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_node_key_means_reverification_not_access() {
    let dir = tempfile::tempdir().unwrap();
    let image = "registry.example.com/team-a/app:v1";
    {
        let agent = Agent::start(
            dir.path(),
            &[
                "--image-pull-credentials-verification-policy",
                "AlwaysVerify",
            ],
        );
        let mut client = agent.image_access().await;
        record_alice(&mut client, image).await;
        let r = check(&mut client, image, "sha256:a", secret("alice", "pw")).await;
        assert_eq!(r.reason().word(), "secret_match");
        assert!(agent.stop().success());
    }
    std::fs::remove_file(dir.path().join("state/node.key")).unwrap();
    let agent = Agent::start(
        dir.path(),
        &[
            "--image-pull-credentials-verification-policy",
            "AlwaysVerify",
        ],
    );
    let mut client = agent.image_access().await;
    let r = check(&mut client, image, "sha256:a", secret("alice", "pw")).await;
    assert_eq!(
        (r.decision, r.reason().word()),
        (
            pb::Decision::MustAuthenticate as i32,
            "no_matching_credential"
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_policy_never_does_not_reveal_whether_the_image_exists() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(
        dir.path(),
        &[
            "--image-pull-credentials-verification-policy",
            "AlwaysVerify",
        ],
    );
    let mut client = agent.image_access().await;
    let image = "registry.example.com/team-a/app:v1";
    record_alice(&mut client, image).await;
    let ask = |present: bool| pb::CheckAccessRequest {
        image: image.into(),
        image_ref: if present {
            "sha256:a".into()
        } else {
            String::new()
        },
        present,
        pull_policy: pb::PullPolicy::Never as i32,
        credentials: secret_of("team-b", "bob", "other").into_iter().collect(),
    };
    let there = client.check_access(ask(true)).await.unwrap().into_inner();
    let absent = client.check_access(ask(false)).await.unwrap().into_inner();
    assert_eq!(there.decision, pb::Decision::Refuse as i32);
    assert_eq!(
        (there.decision, &there.reason().word(), &there.message),
        (absent.decision, &absent.reason().word(), &absent.message)
    );
    // The owner is allowed, and Always means pull.
    let mut owner = ask(true);
    owner.credentials = secret("alice", "pw").into_iter().collect();
    let r = client
        .check_access(owner.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.decision, pb::Decision::Allow as i32);
    owner.pull_policy = pb::PullPolicy::Always as i32;
    let r = client.check_access(owner).await.unwrap().into_inner();
    assert_eq!(r.decision, pb::Decision::Pull as i32);
}
