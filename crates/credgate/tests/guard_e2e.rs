//! The image access guard end to end: Debian's docker-registry with token auth and
//! per-repository access (a token endpoint written for the tests), `credgate serve`, tenants A
//! and B talking to the agent's ImageAccess API.

mod support;

use credgate_api::v1::image_access_client::ImageAccessClient;
use credgate_api::v1::pull_credential::Kind;
use credgate_api::v1::{self as pb};
use support::token::TokenServer;
use support::{oci_image, push, text, Agent, Registry};

const ADMIN: (&str, &str) = ("admin", "admin-pw");

fn secret(ns: &str, name: &str, user: &str, password: &str) -> pb::PullCredential {
    pb::PullCredential {
        kind: Some(Kind::Secret(pb::SecretCredential {
            secret: Some(pb::ObjectRef {
                namespace: ns.into(),
                name: name.into(),
                uid: format!("uid-{ns}-{name}"),
            }),
            username: user.into(),
            password: password.into(),
        })),
    }
}

fn anonymous() -> pb::PullCredential {
    pb::PullCredential {
        kind: Some(Kind::NodeWide(pb::NodeWide {})),
    }
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
        (pb::Decision::try_from(r.decision).unwrap(), r.reason)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_b_cannot_use_tenant_a_private_image() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tokens = TokenServer::start(
        d,
        &[
            (ADMIN.0, ADMIN.1, &["*"]),
            ("alice", "alice-pw", &["team-a/app"]),
            ("bob", "bob-pw", &["team-b/app"]),
        ],
    );
    let mut registry = Registry::start_with_tokens(d, &tokens);
    oci_image(d);
    push(d, &registry, "team-a/app", ADMIN.0, ADMIN.1);
    push(d, &registry, "team-b/app", ADMIN.0, ADMIN.1);
    let digest = digest_of(&registry, "team-a/app");

    let agent = Agent::start(
        d,
        &[
            "--image-pull-credentials-verification-policy",
            "NeverVerifyPreloadedImages",
        ],
    );
    let channel = credgate_api::connect(&agent.socket).await.unwrap();
    let image = format!("{}/team-a/app:v1", registry.host());
    let mut t = Tenants {
        client: ImageAccessClient::new(channel),
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
    assert_eq!(
        (v.reason.as_str(), v.credential_index),
        ("verified", 0),
        "A's own credentials work: {}",
        v.message
    );
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
            matches!(v.reason.as_str(), "unauthorized" | "no_credentials"),
            "{}: {}",
            v.reason,
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
    assert_eq!(
        (v.reason.as_str(), v.credential_index),
        ("verified", 1),
        "{}",
        v.message
    );
    // The wrong digest is not accepted.
    let v = t
        .verify(
            vec![rotated()],
            "sha256:0000000000000000000000000000000000000000000000000000000000000000",
        )
        .await;
    assert_eq!(v.reason, "digest_mismatch", "{}", v.message);

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
    assert_eq!(v.reason, "unreachable", "{}", v.message);
    assert_eq!(
        t.check(vec![stranger()]).await.0,
        pb::Decision::MustAuthenticate
    );

    // The records never show a secret, and neither does the agent's log. The coordinates of
    // B's copy were learned by a decision and are written in the background.
    let mut shown = String::new();
    for _ in 0..100 {
        let listed = t
            .client
            .list_records(pb::ListRecordsRequest {})
            .await
            .unwrap()
            .into_inner();
        shown = format!("{listed:?}");
        if shown.contains("team-b") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
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
    let registry = Registry::start_with_tokens(d, &tokens);
    oci_image(d);
    push(d, &registry, "team-a/app", ADMIN.0, ADMIN.1);
    let digest = digest_of(&registry, "team-a/app");
    let bin = d.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    support::write_script(
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
    let channel = credgate_api::connect(&agent.socket).await.unwrap();
    let mut t = Tenants {
        client: ImageAccessClient::new(channel),
        image: format!("{}/team-a/app:v1", registry.host()),
        image_ref: digest.clone(),
    };
    assert_eq!(t.check(vec![]).await.0, pb::Decision::MustAuthenticate);
    let v = t.verify(vec![anonymous()], &digest).await;
    assert_eq!(
        (v.reason.as_str(), v.credential_index),
        ("verified", 0),
        "{}",
        v.message
    );
    // Recorded as node accessible: any consumer may use it now.
    let (decision, reason) = t.check(vec![]).await;
    assert_eq!(
        (decision, reason.as_str()),
        (pb::Decision::Allow, "node_accessible")
    );
}
