//! The image access guard end to end: Debian's docker-registry with token auth and
//! per-repository access (a token endpoint written for the tests), `credgate serve`, tenants A
//! and B talking to the agent's ImageAccess API.

use crate::support::token::TokenServer;
use crate::support::{oci_image, push, text, Agent, Registry};
use credgate_api::v1::image_access_client::ImageAccessClient;
use credgate_api::v1::{self as pb};

const ADMIN: (&str, &str) = ("admin", "admin-pw");

fn secret(ns: &str, name: &str, user: &str, password: &str) -> pb::PullCredential {
    let object = pb::ObjectRef {
        namespace: ns.into(),
        name: name.into(),
        uid: format!("uid-{ns}-{name}"),
    };
    pb::PullCredential::secret(object, user, password)
}

fn anonymous() -> pb::PullCredential {
    pb::PullCredential::node_wide()
}

fn digest_of(registry: &Registry, repo: &str) -> String {
    let out = std::process::Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false", "--creds"])
        .arg(format!("{}:{}", ADMIN.0, ADMIN.1))
        .arg(format!("docker://{}/{repo}:v1", registry.host()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    use sha2::Digest;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(&out.stdout)))
}

/// The token server (admin, alice for team-a, bob for team-b), Debian's registry trusting it,
/// team-a/app and team-b/app pushed; returns them with team-a/app's digest.
fn private_registry(d: &std::path::Path) -> (TokenServer, Registry, String) {
    let tokens = TokenServer::start(
        d,
        &[
            (ADMIN.0, ADMIN.1, &["*"]),
            ("alice", "alice-pw", &["team-a/app"]),
            ("bob", "bob-pw", &["team-b/app"]),
        ],
    );
    let registry = crate::support::registry_with_tokens(d, &tokens);
    oci_image(d);
    push(d, &registry, "team-a/app", ADMIN.0, ADMIN.1);
    push(d, &registry, "team-b/app", ADMIN.0, ADMIN.1);
    let digest = digest_of(&registry, "team-a/app");
    (tokens, registry, digest)
}

struct Tenants {
    client: ImageAccessClient<tonic::transport::Channel>,
    image: String,
    image_ref: String,
}

impl Tenants {
    async fn check(&mut self, creds: Vec<pb::PullCredential>) -> (pb::Decision, String) {
        let r = self
            .client
            .check_access(pb::CheckAccessRequest {
                image: self.image.clone(),
                image_ref: self.image_ref.clone(),
                present: true,
                pull_policy: pb::PullPolicy::IfNotPresent as i32,
                credentials: creds,
            })
            .await
            .unwrap()
            .into_inner();
        (
            pb::Decision::try_from(r.decision).unwrap(),
            r.reason().word().to_owned(),
        )
    }

    async fn records(&mut self) -> pb::ListRecordsResponse {
        self.client
            .list_records(pb::ListRecordsRequest::default())
            .await
            .unwrap()
            .into_inner()
    }

    async fn verify(&mut self, creds: Vec<pb::PullCredential>, digest: &str) -> pb::VerifyResponse {
        self.client
            .verify(pb::VerifyRequest {
                image: self.image.clone(),
                image_ref: self.image_ref.clone(),
                expected_digest: digest.into(),
                credentials: creds,
            })
            .await
            .unwrap()
            .into_inner()
    }
}

/// Asserts that the registry verified the pull with the credential at `index`.
fn assert_verified_by(v: &pb::VerifyResponse, index: i32, context: &str) {
    assert_eq!(
        (v.reason().word(), v.credential_index),
        ("verified", index),
        "{context}: {}",
        v.message
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_b_cannot_use_tenant_a_private_image() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tokens, mut registry, digest) = private_registry(d);

    let agent = Agent::start(
        d,
        &[
            "--image-pull-credentials-verification-policy",
            "NeverVerifyPreloadedImages",
        ],
    );
    let image = format!("{}/team-a/app:v1", registry.host());
    let mut t = Tenants {
        client: agent.image_access().await,
        image: image.clone(),
        image_ref: digest.clone(),
    };
    let a = || secret("team-a", "pull", "alice", "alice-pw");

    // Tenant A pulls with its secret; the runtime records intent and result.
    t.client
        .record_pull_intent(pb::RecordPullIntentRequest {
            image: image.clone(),
        })
        .await
        .unwrap();
    let v = t.verify(vec![a()], &digest).await;
    assert_verified_by(&v, 0, "A's own credentials work");
    t.client
        .record_pull_result(pb::RecordPullResultRequest {
            image: image.clone(),
            image_ref: digest.clone(),
            success: true,
            credential: Some(a()),
        })
        .await
        .unwrap();
    assert_eq!(t.check(vec![a()]).await.0, pb::Decision::Allow);

    // B with no credentials, wrong ones, or its own valid ones for team-b only: authenticate,
    // and the registry refuses every one of them.
    for creds in [
        vec![],
        vec![anonymous()],
        vec![secret("team-b", "pull", "bob", "wrong")],
        vec![secret("team-b", "pull", "bob", "bob-pw")],
    ] {
        let (decision, reason) = t.check(creds.clone()).await;
        assert_eq!(decision, pb::Decision::MustAuthenticate, "{reason}");
        let v = t.verify(creds.clone(), &digest).await;
        assert_eq!(
            v.decision,
            pb::Decision::MustAuthenticate as i32,
            "{creds:?}: {}",
            v.message
        );
        assert!(
            matches!(v.reason().word(), "unauthorized" | "no_credentials"),
            "{}: {}",
            v.reason().word(),
            v.message
        );
        assert_eq!(v.credential_index, -1);
    }
    // Nothing was recorded for B.
    let (decision, _) = t
        .check(vec![secret("team-b", "pull", "bob", "bob-pw")])
        .await;
    assert_eq!(decision, pb::Decision::MustAuthenticate);

    // B holding A's secret content under another name is allowed by hash.
    let (decision, reason) = t
        .check(vec![secret("team-b", "copied", "alice", "alice-pw")])
        .await;
    assert_eq!(
        (decision, reason.as_str()),
        (pb::Decision::Allow, "secret_match")
    );

    // A rotates its password: the secret object keeps its coordinates, new content.
    tokens.set_password("alice", "alice-pw-2");
    let rotated = || secret("team-a", "pull", "alice", "alice-pw-2");
    let (decision, reason) = t.check(vec![rotated()]).await;
    assert_eq!(
        (decision, reason.as_str()),
        (pb::Decision::Allow, "secret_rotated")
    );
    let v = t
        .verify(
            vec![secret("team-a", "pull", "alice", "alice-pw"), rotated()],
            &digest,
        )
        .await;
    assert_verified_by(&v, 1, "the rotated secret, second in the list");
    // The wrong digest is not accepted.
    let v = t
        .verify(
            vec![rotated()],
            "sha256:0000000000000000000000000000000000000000000000000000000000000000",
        )
        .await;
    assert_eq!(v.reason().word(), "digest_mismatch", "{}", v.message);

    // The registry goes away: a known tenant is still allowed from the records, an unknown
    // one is denied by Verify (unreachable) and nothing is recorded.
    registry.stop();
    assert_eq!(t.check(vec![rotated()]).await.0, pb::Decision::Allow);
    let stranger = || secret("team-c", "pull", "carol", "carol-pw");
    assert_eq!(
        t.check(vec![stranger()]).await.0,
        pb::Decision::MustAuthenticate
    );
    let v = t.verify(vec![stranger()], &digest).await;
    assert_eq!(v.reason().word(), "unreachable", "{}", v.message);
    assert_eq!(
        t.check(vec![stranger()]).await.0,
        pb::Decision::MustAuthenticate
    );

    // The records never show a secret, and neither does the agent's log. The coordinates of
    // B's copy were learned by a decision and are written in the background.
    let client = t.client.clone();
    credgate_testbed::eventually_async(
        "B's coordinates recorded",
        std::time::Duration::from_secs(5),
        || {
            let mut client = client.clone();
            async move {
                let records = client.list_records(pb::ListRecordsRequest::default()).await;
                format!("{:?}", records.unwrap().into_inner()).contains("team-b")
            }
        },
    )
    .await;
    let listed = t.records().await;
    let shown = format!("{listed:?}");
    assert!(
        shown.contains("team-a") && shown.contains("team-b"),
        "{shown}"
    );
    for s in ["alice-pw", "bob-pw", "carol-pw"] {
        assert!(!shown.contains(s));
    }
    let status = agent.stop();
    assert!(status.success());
    let log = std::fs::read_to_string(d.join("agent.log")).unwrap();
    for s in ["alice-pw", "bob-pw", "carol-pw"] {
        assert!(!log.contains(s), "{log}");
    }
}

/// Node-wide credentials are the node's own: `Verify` with `node_wide` tries what the agent's
/// providers give for the image (here a plugin with the node's registry login), then anonymous.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_wide_verification_uses_the_nodes_providers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tokens = TokenServer::start(
        d,
        &[
            (ADMIN.0, ADMIN.1, &["*"]),
            ("node", "node-pw", &["team-a/app"]),
        ],
    );
    let registry = crate::support::registry_with_tokens(d, &tokens);
    oci_image(d);
    push(d, &registry, "team-a/app", ADMIN.0, ADMIN.1);
    let digest = digest_of(&registry, "team-a/app");
    let bin = d.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    crate::support::write_script(
        &bin.join("node-login"),
        &format!(
            r#"cat >/dev/null
printf '{{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Registry","cacheDuration":"10m","auth":{{"{host}":{{"username":"node","password":"node-pw"}}}}}}'"#,
            host = registry.host()
        ),
    );
    let config = d.join("providers.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: node-login\n  matchImages: [\"{}\"]\n  defaultCacheDuration: 10m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
            registry.host()
        ),
    )
    .unwrap();
    let agent = Agent::start(
        d,
        &[
            "--image-pull-credentials-verification-policy",
            "AlwaysVerify",
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            bin.to_str().unwrap(),
        ],
    );
    let mut t = Tenants {
        client: agent.image_access().await,
        image: format!("{}/team-a/app:v1", registry.host()),
        image_ref: digest.clone(),
    };
    assert_eq!(t.check(vec![]).await.0, pb::Decision::MustAuthenticate);
    let v = t.verify(vec![anonymous()], &digest).await;
    assert_verified_by(&v, 0, "a node-wide pull, verified with the node's provider");
    // Recorded as node accessible: any consumer may use it now.
    let (decision, reason) = t.check(vec![]).await;
    assert_eq!(
        (decision, reason.as_str()),
        (pb::Decision::Allow, "node_accessible")
    );
}

/// Fault injection: the registry is killed (SIGKILL, requests in flight) while tenants verify,
/// then started again on the same port. Every verification returns in bounded time; during the
/// outage it says `unreachable` and denies; nobody is allowed or recorded because of an error;
/// once the registry is back, verification works again with no restart of the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_killed_and_restarted_during_verifications() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_tokens, mut registry, digest) = private_registry(d);
    let agent = Agent::start(d, &[]);
    let channel = credgate_api::connect(&agent.socket).await.unwrap();
    let image = format!("{}/team-a/app:v1", registry.host());
    let tenants = |channel| Tenants {
        client: ImageAccessClient::new(channel),
        image: image.clone(),
        image_ref: digest.clone(),
    };
    let a = || secret("team-a", "pull", "alice", "alice-pw");
    let b = || secret("team-b", "pull", "bob", "bob-pw");
    let mut t = tenants(channel.clone());
    assert_eq!(
        t.verify(vec![a()], &digest).await.reason().word(),
        "verified"
    );

    // Four clients verify A and B in turns, without pause, through the whole fault.
    const BOUND: Duration = Duration::from_secs(30);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Each phase lasts until the workers have made this many more verifications.
    let phase = |what: &'static str| {
        let done = done.clone();
        let from = done.load(Ordering::Relaxed);
        credgate_testbed::eventually_async(what, BOUND, move || {
            std::future::ready(done.load(Ordering::Relaxed) >= from + 16)
        })
    };
    let mut workers = Vec::new();
    for w in 0..4 {
        let mut t = tenants(channel.clone());
        let stop = stop.clone();
        let done = done.clone();
        let digest = digest.clone();
        workers.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut turn = w;
            while !stop.load(Ordering::Relaxed) {
                let is_a = turn % 2 == 0;
                turn += 1;
                let creds = if is_a { vec![a()] } else { vec![b()] };
                let v = tokio::time::timeout(BOUND, t.verify(creds, &digest))
                    .await
                    .expect("a verification returns within the bound");
                seen.push((is_a, v));
                done.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            seen
        }));
    }
    phase("verifications before the fault").await;
    registry.kill();
    // Down: a verification denies and says why; the records still answer for A, not for B.
    let v = t.verify(vec![a()], &digest).await;
    assert_eq!(
        (v.reason().word(), v.decision),
        ("unreachable", pb::Decision::MustAuthenticate as i32),
        "{}",
        v.message
    );
    assert!(v.message.contains("cannot reach"), "{}", v.message);
    assert_eq!(t.check(vec![a()]).await.0, pb::Decision::Allow);
    assert_eq!(t.check(vec![b()]).await.0, pb::Decision::MustAuthenticate);
    phase("verifications while the registry is down").await;
    registry.restart();
    // Back: the next verification reaches it; no restart of the agent, no stale connection.
    let v = t.verify(vec![a()], &digest).await;
    assert_verified_by(&v, 0, "the registry is back");
    phase("verifications after the registry is back").await;
    stop.store(true, Ordering::Relaxed);

    let mut outcomes = std::collections::BTreeMap::<(bool, String), usize>::new();
    for worker in workers {
        let seen = worker.await.unwrap();
        for (is_a, v) in &seen {
            *outcomes
                .entry((*is_a, v.reason().word().to_owned()))
                .or_default() += 1;
            for s in ["alice-pw", "bob-pw"] {
                assert!(!v.message.contains(s), "{}", v.message);
            }
            if *is_a {
                assert!(
                    matches!(v.reason().word(), "verified" | "unreachable"),
                    "A: {} {}",
                    v.reason().word(),
                    v.message
                );
            } else {
                // B is never let in: refused by the registry, or unreachable.
                assert_eq!(v.decision, pb::Decision::MustAuthenticate as i32);
                assert!(
                    matches!(v.reason().word(), "unauthorized" | "unreachable"),
                    "B: {} {}",
                    v.reason().word(),
                    v.message
                );
            }
            let allowed = v.decision == pb::Decision::Allow as i32;
            assert_eq!(allowed, v.reason().word() == "verified", "{v:?}");
        }
        // Each client ends on a working registry: its last answers are real ones again.
        let last: Vec<&str> = seen
            .iter()
            .rev()
            .take(2)
            .map(|(_, v)| v.reason().word())
            .collect();
        assert!(
            last.iter()
                .all(|r| matches!(*r, "verified" | "unauthorized")),
            "{last:?}"
        );
    }
    eprintln!("outcomes: {outcomes:?}");
    for (who, reason) in [
        (true, "verified"),
        (true, "unreachable"),
        (false, "unauthorized"),
        (false, "unreachable"),
    ] {
        assert!(
            outcomes
                .get(&(who, reason.to_owned()))
                .copied()
                .unwrap_or(0)
                > 0,
            "the fault was not crossed: {outcomes:?}"
        );
    }
    // B was never recorded, by an error or otherwise.
    assert_eq!(t.check(vec![b()]).await.0, pb::Decision::MustAuthenticate);
    let listed = t.records().await;
    assert!(!format!("{listed:?}").contains("team-b"), "{listed:?}");
    assert!(agent.stop().success());
}
