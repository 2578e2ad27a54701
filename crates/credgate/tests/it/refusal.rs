//! A refusal is the registry's word: a pull through the CRI proxy that ends unauthorized drops
//! an agent-given credential only once the registry's auth endpoint refused that credential
//! itself (decision 0019). Against a fake runtime answering as containerd does and a stub
//! registry with Basic auth (no root), and against Debian's containerd with Debian's registry
//! behind a token server, the shape of Docker Hub (root).

use std::time::{Duration, Instant};

use credgate_testbed::cri::*;
use credgate_testbed::fake_runtime::Answers;

use crate::rotation::{looked_up, metric, report, Backend, USER};
use crate::support::stub_registry::StubRegistry;
use crate::support::text;

/// containerd's answer to a pull the registry answered 401.
fn unauthorized(image: &str, host: &str) -> (i32, String) {
    (
        2,
        format!(
            "failed to pull and unpack image \"{image}\": failed to resolve reference \"{image}\": pulling from host {host} failed with status code [manifests v1]: 401 Unauthorized"
        ),
    )
}

/// An agent with `backend`'s provider and metrics, its proxy in front of a fake runtime that
/// answers every pull with `answer`.
async fn with_provider(
    d: &std::path::Path,
    backend: &Backend,
    answer: (i32, String),
) -> (
    credgate_testbed::fake_runtime::FakeRuntime,
    crate::support::Agent,
    std::path::PathBuf,
) {
    crate::support::fake_runtime_agent(
        d,
        Answers {
            pull: Err(answer),
            ..Default::default()
        },
        &[
            "--image-credential-provider-config",
            backend.config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            backend.bin.to_str().unwrap(),
            "--metrics-addr",
            "127.0.0.1:0",
        ],
    )
    .await
}

fn refused_count(agent: &crate::support::Agent) -> u64 {
    refused_from(agent, "provider")
}

/// `credgate_credentials_refused_total` of `source`.
fn refused_from(agent: &crate::support::Agent, source: &str) -> u64 {
    let line = format!("credgate_credentials_refused_total{{source=\"{source}\"}}");
    metric(agent, &line)
        .and_then(|l| l[line.len()..].trim().parse().ok())
        .unwrap_or(0)
}

/// Requests to the stub's `/v2/` that carried a credential: confirmations.
fn confirmations(stub: &StubRegistry) -> usize {
    stub.seen()
        .iter()
        .filter(|(path, auth)| path == "/v2/" && *auth)
        .count()
}

async fn pull(
    proxy: &std::path::Path,
    request: PullImageRequest,
) -> Result<PullImageResponse, tonic::Status> {
    call::<_, PullImageResponse>(proxy, PULL_IMAGE, request).await
}

/// The registry accepts the provider's credential and refuses the repository (a typo, or one the
/// credential may not read): nothing is dropped, the plugin does not run, nothing is counted
/// refused, and the pull log, `explain` and a warning say what to check. Confirmations are
/// bounded: a burst of such pulls asks the registry once. A credential containerd did not send
/// (its `server_address` names another host), and a pull that ended NOT_FOUND whatever words
/// its image name holds, ask nothing and drop nothing. A consumer's report of the credential for
/// a repository it may not read is "accepted".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthorized_pull_drops_a_credential_only_when_the_registry_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let stub = StubRegistry::start(USER, "good-Pa55word");
    let host = stub.host();
    let backend = Backend::new(d, &host, "good-Pa55word");
    let typo = format!("{host}/team-a/aap:v1");
    let (fake, agent, proxy) = with_provider(d, &backend, unauthorized(&typo, &host)).await;
    assert_eq!(looked_up(&agent, &typo), "good-Pa55word");
    assert_eq!(backend.runs(), 1);

    // The typo'd image, with the provider's credential as the kubelet sends it.
    let request = || pull_request(&typo, Some((USER, "good-Pa55word")), "team-a");
    pull(&proxy, request()).await.unwrap_err();
    assert_eq!(confirmations(&stub), 1, "{:?}", stub.seen());
    assert_eq!(looked_up(&agent, &typo), "good-Pa55word");
    assert_eq!(backend.runs(), 1, "the provider's answer was not dropped");
    assert_eq!(refused_count(&agent), 0);
    let pulls = text(&agent.credgate(&["ctl", "pulls"]).stdout);
    assert!(
        pulls.contains("the credential itself is accepted: check the image name"),
        "{pulls}"
    );
    let explained = text(&agent.credgate(&["explain", &typo]).stdout);
    assert!(
        explained.contains("last unauthorized pull")
            && explained.contains("the credential itself is accepted"),
        "{explained}"
    );
    let status = text(&agent.credgate(&["ctl", "status"]).stdout);
    assert!(!status.contains("refused by the registry"), "{status}");
    let log = agent.log_text();
    assert!(
        log.contains("the credential itself is accepted")
            && !log.contains("the registry refused a credential of provider"),
        "{log}"
    );

    // A burst of the same pulls: the answer is remembered (or joined while in flight).
    let burst: Vec<_> = (0..12)
        .map(|_| {
            let proxy = proxy.clone();
            let req = request();
            tokio::spawn(async move { pull(&proxy, req).await })
        })
        .collect();
    for p in burst {
        p.await.unwrap().unwrap_err();
    }
    assert_eq!(confirmations(&stub), 1, "{:?}", stub.seen());
    assert_eq!(backend.runs(), 1);

    // Not sent: its server_address names another host.
    let mut elsewhere = request();
    elsewhere.auth.as_mut().unwrap().server_address = "https://mirror.example".into();
    let asked = stub.seen().len();
    pull(&proxy, elsewhere).await.unwrap_err();
    assert_eq!(stub.seen().len(), asked, "nothing was asked");
    let pulls = text(&agent.credgate(&["ctl", "pulls"]).stdout);
    assert!(
        pulls.contains("not refused by this pull: its server_address names mirror.example"),
        "{pulls}"
    );

    // A missing tag whose name holds the words of a refusal: NOT_FOUND.
    let gone = format!("{host}/team-a/app:gone-403");
    fake.answers.lock().pull = Err((
        5,
        format!("failed to pull and unpack image \"{gone}\": failed to resolve reference \"{gone}\": {gone}: not found (denied 401 unauthorized)"),
    ));
    pull(
        &proxy,
        pull_request(&gone, Some((USER, "good-Pa55word")), "team-a"),
    )
    .await
    .unwrap_err();
    assert_eq!(stub.seen().len(), asked, "nothing was asked");
    assert_eq!(backend.runs(), 1);

    // A consumer reports it refused for a repository it may not read: the registry accepts
    // the credential itself.
    assert_eq!(
        report(&agent, &format!("{host}/team-x/app:v1"), "good-Pa55word"),
        "accepted"
    );
    assert_eq!(looked_up(&agent, &typo), "good-Pa55word");
    assert_eq!(backend.runs(), 1);

    // A later refusal of the credential itself is acted on once this answer's 10 s are over
    // (`confirm::tests::answers_are_remembered_for_their_time_and_asked_again_after`), as a
    // first one is at once (`a_backend_that_lags_the_registry_is_followed_within_seconds`).
}

/// The provider's backend learns the new password after the registry: the plugin, asked again
/// at the refusal, answers the refused credential once more. That answer is kept seconds, not
/// its hour: the plugin is asked again with a short capped backoff while `ctl status` and the
/// pull log say it still answers a refused credential, and once the backend answers the new one
/// lookups give it within a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_lags_the_registry_is_followed_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let stub = StubRegistry::start(USER, "old-Pa55word");
    let host = stub.host();
    let image = format!("{host}/team/app:v1");
    let backend = Backend::new(d, &host, "old-Pa55word");
    let (_fake, agent, proxy) = with_provider(d, &backend, unauthorized(&image, &host)).await;
    assert_eq!(looked_up(&agent, &image), "old-Pa55word");
    // Rotated at the registry; the backend still answers the old password.
    stub.set_password(USER, "new-Pa55word");
    let kubelet_copy = || pull_request(&image, Some((USER, "old-Pa55word")), "ns");
    pull(&proxy, kubelet_copy()).await.unwrap_err();
    assert_eq!(refused_count(&agent), 1);
    // The kubelet retries with its copy: the proxy asks the provider for its answer of now,
    // which is still the refused one, kept seconds (1 s, 2 s, 4 s: the schedule is the
    // engine's, `cache::a_plugin_that_still_answers_a_refused_credential_is_asked_again_at_doubling_intervals`).
    let before = backend.runs();
    for _ in 0..6 {
        pull(&proxy, kubelet_copy()).await.unwrap_err();
    }
    let runs = backend.runs() - before;
    assert!(
        runs < 6,
        "{runs} plugin runs for 6 pulls: never one per pull"
    );
    let status = text(&agent.credgate(&["ctl", "status"]).stdout);
    assert!(
        status.contains("still answers the credential the registry refused"),
        "{status}"
    );
    let pulls = text(&agent.credgate(&["ctl", "pulls"]).stdout);
    assert!(
        pulls.contains("provider rotating still answers the credential the registry refused"),
        "{pulls}"
    );
    assert_eq!(refused_count(&agent), 1, "held off: refused once");

    // The backend catches up: followed within the backoff's cap, not the answer's hour.
    backend.answer("new-Pa55word");
    let caught_up = Instant::now();
    credgate_testbed::eventually(
        "the provider's new answer is served",
        Duration::from_secs(20),
        || looked_up(&agent, &image) == "new-Pa55word",
    );
    assert!(
        caught_up.elapsed() < Duration::from_secs(20),
        "{:?}",
        caught_up.elapsed()
    );
    let status = text(&agent.credgate(&["ctl", "status"]).stdout);
    assert!(
        !status.contains("still answers the credential the registry refused"),
        "{status}"
    );

    let log = agent.log_text();
    for secret in ["old-Pa55word", "new-Pa55word"] {
        assert!(!log.contains(secret), "a password reached the agent's log");
    }
}

/// Debian's registry behind the test token server (admin reads everything, alice `team-a/app`)
/// holding `repos`, containerd trusting it, the rotating provider answering alice's password,
/// and the agent with its proxy in front of containerd; dropped in that order (the agent first,
/// the directory last).
struct TokenNode {
    agent: crate::support::Agent,
    proxy: std::path::PathBuf,
    backend: Backend,
    containerd: credgate_testbed::Containerd,
    _registry: credgate_testbed::Registry,
    tokens: crate::support::token::TokenServer,
    host: String,
    /// `HOST/team-a/app:v1`, whose credential the agent handed out (the kubelet's copy).
    own: String,
    _dir: tempfile::TempDir,
}

fn token_node(repos: &[&str]) -> TokenNode {
    crate::support::needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tokens = crate::support::token::TokenServer::start(
        d,
        &[
            ("admin", "admin-pw", &["*"]),
            (USER, "alice-pw", &["team-a/app"]),
        ],
    );
    let registry = crate::support::registry_with_tokens(d, &tokens);
    crate::support::oci_image(d);
    for repo in repos {
        crate::support::push(d, &registry, repo, "admin", "admin-pw");
    }
    let containerd = credgate_testbed::Containerd::start(d, &[registry.host()]);
    let host = registry.host();
    let backend = Backend::new(d, &host, "alice-pw");
    let (agent, proxy) = backend.agent(&containerd.socket);
    let own = format!("{host}/team-a/app:v1");
    // The kubelet's copy: what the bridge handed it.
    assert_eq!(looked_up(&agent, &own), "alice-pw");
    TokenNode {
        agent,
        proxy,
        backend,
        containerd,
        _registry: registry,
        tokens,
        host,
        own,
        _dir: dir,
    }
}

/// Debian's containerd and Debian's registry behind a token server (Docker Hub's shape: the
/// token realm takes a valid credential for any scope, and the registry answers 401 for a
/// repository the token does not grant). The provider's credential pulling a repository it may
/// not read, or a typo'd one, drops nothing (grpc-go, dialing as the kubelet does, gets through
/// the proxy containerd's own answer). (That the registry's "accepted" is remembered 10 s, and
/// asked again after, is `confirm::tests::answers_are_remembered_for_their_time_and_asked_again_after`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn docker_hubs_answer_for_a_repository_is_not_a_refused_credential() {
    let node = token_node(&["team-a/app", "team-b/app"]);
    let TokenNode {
        agent,
        proxy,
        backend,
        containerd,
        host,
        own,
        ..
    } = &node;
    let with = |image: &str, password: &str| pull_request(image, Some((USER, password)), "ns");
    pull(proxy, with(own, "alice-pw"))
        .await
        .expect("the provider's credential pulls its own repository");
    // As the kubelet dials: grpc-go gets through the proxy the answer containerd gives.
    let go = crate::support::foreign::build_go();
    let not_hers = format!("{host}/team-b/app:v1");
    let request = prost::Message::encode_to_vec(&with(&not_hers, "alice-pw"));
    let call = |socket: &std::path::Path| {
        crate::support::foreign::go_call(
            &go,
            crate::support::foreign::Dial::Path,
            socket,
            PULL_IMAGE,
            &request,
            0,
        )
    };
    let (direct, proxied) = (call(&containerd.socket), call(proxy));
    assert_ne!(direct.code, 0, "{direct:?}");
    assert_eq!(
        (direct.code, &direct.message),
        (proxied.code, &proxied.message)
    );
    for other in [not_hers, format!("{host}/team-a/aap:v1")] {
        let refused = pull(proxy, with(&other, "alice-pw")).await.unwrap_err();
        let pulls = text(&agent.credgate(&["ctl", "pulls"]).stdout);
        assert!(
            pulls.contains("the credential itself is accepted"),
            "{}\n{pulls}",
            refused.message()
        );
    }
    assert_eq!(backend.runs(), 1, "nothing was dropped");
    assert_eq!(refused_count(agent), 0);
    pull(proxy, with(own, "alice-pw"))
        .await
        .expect("the provider's credential pulls its own repository");
}

/// The same registry behind its token server: the provider's credential, rotated at the token
/// server and in the backend, fails the pull with the kubelet's copy once inside the proxy, which
/// sends it again with the provider's answer of now: the caller sees it succeed, and so does the
/// next pull, with one more plugin run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_credential_rotated_at_a_token_server_is_replaced_in_the_pull() {
    let node = token_node(&["team-a/app"]);
    let TokenNode {
        agent,
        proxy,
        backend,
        tokens,
        own,
        ..
    } = &node;
    let with = |image: &str, password: &str| pull_request(image, Some((USER, password)), "ns");
    pull(proxy, with(own, "alice-pw"))
        .await
        .expect("the provider's credential pulls its own repository");
    tokens.set_password(USER, "alice-new");
    backend.answer("alice-new");
    // The token server refuses the old password; the proxy sends the same pull again with
    // the provider's answer of now: the caller sees it succeed, and so does the next pull.
    pull(proxy, with(own, "alice-pw"))
        .await
        .expect("the pull goes again with the provider's answer of now");
    assert_eq!(refused_count(agent), 1);
    let pulls = text(&agent.credgate(&["ctl", "pulls"]).stdout);
    let own_pulls: Vec<&str> = pulls
        .lines()
        .filter(|l| l.contains(own.as_str()))
        .take(2)
        .collect();
    assert!(
        own_pulls[0].contains("pulled") && own_pulls[1].contains("unauthorized"),
        "the refused attempt and its retry are both in the pull log: {pulls}"
    );
    pull(proxy, with(own, "alice-pw"))
        .await
        .expect("the next pull goes with the provider's answer of now");
    assert_eq!(backend.runs(), 2);
}

/// A registry that cannot be asked (nothing listens on its port): the pull is answered as the
/// runtime answered, and nothing is refused or reported. One that takes the connection and
/// never answers is given up at the confirmation's bound, the same way
/// (`confirm::tests::a_registry_that_never_answers_is_unknown_at_the_timeout`, on a paused
/// clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_that_does_not_answer_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let host = closed.local_addr().unwrap().to_string();
    drop(closed);
    let image = format!("{host}/team/app:v1");
    let docker_config = crate::support::docker_config(d, &host, "dc-user", "dc-Pa55word");
    let (_fake, agent, proxy) = crate::support::fake_runtime_agent(
        d,
        Answers {
            pull: Err(unauthorized(&image, &host)),
            ..Default::default()
        },
        &[
            "--docker-config",
            docker_config.to_str().unwrap(),
            "--metrics-addr",
            "127.0.0.1:0",
        ],
    )
    .await;
    pull(
        &proxy,
        pull_request(&image, Some(("dc-user", "dc-Pa55word")), "ns"),
    )
    .await
    .unwrap_err();
    assert_eq!(
        refused_from(&agent, "docker_config"),
        0,
        "nothing was refused"
    );
    let pulls = text(&agent.credgate(&["ctl", "pulls"]).stdout);
    assert!(
        pulls.contains("the registry could not confirm the refusal"),
        "{pulls}"
    );
    assert!(!agent.log_text().contains("credgate does not own that file"));
}

/// The kubelet's copy of a provider's credential that the bridge handed it, after a rotation
/// and a restart of the agent (issue 49): the provider has moved on to the new credential, the
/// agent restarted (SIGTERM, then SIGKILL), and the kubelet still sends the old one. The proxy
/// knows it for the provider's (the memory of what was handed out, and then of what the
/// registry refused, sealed in the state directory), has the registry confirm the refusal and
/// sends the provider's answer of now instead (before: `auth=unknown`, taken for a pod's own
/// secret, never confirmed nor replaced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_still_knows_the_credentials_it_handed_to_the_kubelet() {
    const OLD: &str = "old-Pa55word-not-for-logs";
    const NEW: &str = "new-Pa55word-not-for-logs";
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let stub = StubRegistry::start(USER, OLD);
    let host = stub.host();
    let backend = Backend::new(d, &host, OLD);
    let image = format!("{host}/team-p/app:v1");
    let (fake, agent, _) = with_provider(d, &backend, unauthorized(&image, &host)).await;
    // The kubelet asks the bridge, and keeps its answer.
    let request = format!(
        r#"{{"kind":"CredentialProviderRequest","apiVersion":"credentialprovider.kubelet.k8s.io/v1","image":"{image}"}}"#
    );
    let answered = crate::support::output_with_stdin(
        std::process::Command::new(crate::support::bridge_bin())
            .args(["--provider", "rotating"])
            .env("CREDGATE_SOCKET", &agent.socket),
        request.as_bytes(),
    );
    assert!(answered.status.success());
    assert!(text(&answered.stdout).contains(OLD));
    // Rotated at the registry and in the backend; the agent's cache moves on.
    stub.set_password(USER, NEW);
    backend.answer(NEW);
    assert!(agent.credgate(&["ctl", "flush"]).status.success());
    assert_eq!(looked_up(&agent, &image), NEW);
    // Restarted: what it handed out is on disk (the saver's last write at the stop).
    assert!(agent.stop().success());
    drop(fake);
    std::fs::remove_file(d.join("fake-runtime.sock")).unwrap();
    let (fake, agent, proxy) = with_provider(d, &backend, unauthorized(&image, &host)).await;
    let stale = || pull_request(&image, Some((USER, OLD)), "default");
    let before = confirmations(&stub);
    let _ = pull(&proxy, stale()).await;
    assert!(
        confirmations(&stub) > before,
        "the stale copy was confirmed with the registry: {:?}",
        stub.seen()
    );
    let pulls = text(&agent.credgate(&["ctl", "pulls"]).stdout);
    assert!(pulls.contains("provider:rotating"), "{pulls}");
    assert!(!pulls.contains("unknown"), "{pulls}");
    assert_eq!(refused_count(&agent), 1);
    // The provider's answer of now went to the runtime in its place.
    assert!(
        fake.pulled.lock().len() >= 2,
        "the pull was sent again with the provider's answer"
    );
    // Killed, and started again: the refusal itself is remembered, and the stale copy is
    // replaced before it reaches the runtime.
    agent.signal(libc::SIGKILL);
    drop(agent);
    drop(fake);
    std::fs::remove_file(d.join("fake-runtime.sock")).unwrap();
    let (_fake, agent, proxy) = with_provider(d, &backend, unauthorized(&image, &host)).await;
    let _ = pull(&proxy, stale()).await;
    // (The fake runtime refuses the new credential too; the registry accepts it: nothing more
    // is refused.)
    assert_eq!(refused_count(&agent), 0);
    let log = agent.log_text();
    assert!(
        log.contains("a pull carried a credential the registry refused"),
        "{log}"
    );
    assert!(!log.contains(OLD) && !log.contains(NEW));
    assert!(agent.stop().success());
}
