//! Clients credgate did not write, on both of its gRPC sockets: grpc-go dialing as the kubelet
//! up to 1.30 (`:authority` is the socket's path) and from 1.31 (`localhost`), and Python
//! grpcio with its default channel (the percent-encoded path). On the API socket they get what
//! credgate's own client gets; through the CRI proxy they get exactly what the same call made
//! directly to Debian's containerd gets: the same status code and message (a trailers-only
//! error stays one) and the same response bytes. The proxy tests need root (containerd).

use std::path::Path;

use crate::support::foreign::{build_go, go_call, python_call, Answer, Dial};
use crate::support::{needs_containerd, oci_image, proxy_agent, push, Agent, Registry};
use credgate_api::v1::{HealthResponse, LookupRequest, LookupResponse, WatchEvent, WatchRequest};
use credgate_testbed::cri::*;
use credgate_testbed::Containerd;
use prost::Message;

const IMAGE: &str = "registry.example.com/team/app:v1";
const USER: &str = "go-user";
const PASSWORD: &str = "go-Pa55word-not-for-logs";

fn example_agent(dir: &Path) -> Agent {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let config = repo.join("examples/provider-config.yaml");
    let bin = repo.join("examples/plugins");
    Agent::start(
        dir,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            bin.to_str().unwrap(),
        ],
    )
}

fn lookup_request() -> Vec<u8> {
    LookupRequest {
        image: IMAGE.into(),
        ..Default::default()
    }
    .encode_to_vec()
}

/// The credentials' (username, password) pairs of a Lookup answer.
fn pairs(answer: &LookupResponse) -> Vec<(String, String)> {
    answer
        .credentials
        .iter()
        .map(|c| (c.username.clone(), c.password.clone()))
        .collect()
}

/// What credgate's own client gets for the same Lookup: the reference to compare with.
async fn own_lookup(agent: &Agent) -> LookupResponse {
    let channel = credgate_api::connect(&agent.socket).await.unwrap();
    let answer = credgate_api::v1::credentials_client::CredentialsClient::new(channel)
        .lookup(LookupRequest {
            image: IMAGE.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!answer.credentials.is_empty(), "{answer:?}");
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_go_dialing_as_the_kubelet_does_is_served_on_the_api_socket() {
    let dir = tempfile::tempdir().unwrap();
    let go = build_go();
    let agent = example_agent(dir.path());
    let own = own_lookup(&agent).await;
    for dial in Dial::ALL {
        let health = go_call(
            &go,
            dial,
            &agent.socket,
            credgate_api::methods::HEALTH,
            &[],
            0,
        );
        assert_eq!(
            health.decode::<HealthResponse>().status,
            "SERVING",
            "{dial:?}"
        );
        let lookup = go_call(
            &go,
            dial,
            &agent.socket,
            credgate_api::methods::LOOKUP,
            &lookup_request(),
            0,
        );
        assert_eq!(pairs(&lookup.decode()), pairs(&own), "{dial:?}");
        let watch = go_call(
            &go,
            dial,
            &agent.socket,
            credgate_api::methods::WATCH,
            &WatchRequest {
                refs: vec![IMAGE.into()],
            }
            .encode_to_vec(),
            1,
        );
        let event: WatchEvent = watch.decode();
        assert_eq!(event.r#ref, IMAGE, "{dial:?}");
        let unknown = go_call(&go, dial, &agent.socket, "/credgate.v1.Admin/Nope", &[], 0);
        assert_eq!(
            unknown.code,
            tonic::Code::Unimplemented as u32,
            "{unknown:?}"
        );
        // The message grpc-go servers give.
        assert_eq!(
            unknown.message, "unknown method Nope for service credgate.v1.Admin",
            "{unknown:?}"
        );
        let service = go_call(&go, dial, &agent.socket, "/other.v1.Svc/Call", &[], 0);
        assert_eq!(
            service.message, "unknown service other.v1.Svc",
            "{service:?}"
        );
    }
    let log = agent.log_text();
    assert!(!log.contains("malformed"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_with_default_options_is_served_on_the_api_socket() {
    let dir = tempfile::tempdir().unwrap();
    let agent = example_agent(dir.path());
    let own = own_lookup(&agent).await;
    let health = python_call(&agent.socket, credgate_api::methods::HEALTH, &[], 0, 30);
    assert_eq!(health.decode::<HealthResponse>().status, "SERVING");
    let lookup = python_call(
        &agent.socket,
        credgate_api::methods::LOOKUP,
        &lookup_request(),
        0,
        30,
    );
    assert_eq!(pairs(&lookup.decode()), pairs(&own));
    let watch = python_call(
        &agent.socket,
        credgate_api::methods::WATCH,
        &WatchRequest {
            refs: vec![IMAGE.into()],
        }
        .encode_to_vec(),
        1,
        30,
    );
    let event: WatchEvent = watch.decode();
    assert_eq!(event.r#ref, IMAGE);
    assert!(!event.credentials.is_empty(), "{event:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_own_errors_reach_grpc_go_and_grpcio_whole() {
    let dir = tempfile::tempdir().unwrap();
    let go = build_go();
    let (_agent, proxy) = proxy_agent(dir.path(), &dir.path().join("no-runtime.sock"));
    let request = pull_request("registry.example.com/team/app:v1", None, "team-a").encode_to_vec();
    let mut answers: Vec<Answer> = Dial::ALL
        .iter()
        .flat_map(|&dial| {
            [
                go_call(&go, dial, &proxy, PULL_IMAGE, &request, 0),
                go_call(&go, dial, &proxy, LIST_IMAGES, &[], 0),
            ]
        })
        .collect();
    answers.push(python_call(&proxy, PULL_IMAGE, &request, 0, 30));
    for answer in answers {
        assert_eq!(answer.code, tonic::Code::Unavailable as u32, "{answer:?}");
        assert!(
            answer
                .message
                .contains("cannot reach the container runtime"),
            "{answer:?}"
        );
    }
}

/// A registry with htpasswd holding `team/app:v1`, containerd trusting it, and the agent's
/// proxy in front of containerd.
struct Node {
    registry: Registry,
    containerd: Containerd,
    agent: Agent,
    proxy: std::path::PathBuf,
}

fn node(dir: &Path) -> Node {
    let registry = Registry::start(dir, USER, PASSWORD);
    oci_image(dir);
    push(dir, &registry, "team/app", USER, PASSWORD);
    let containerd = Containerd::start(dir, &[registry.host()]);
    let (agent, proxy) = proxy_agent(dir, &containerd.socket);
    Node {
        registry,
        containerd,
        agent,
        proxy,
    }
}

/// The calls a kubelet makes, in an order where each has something to act on, with the
/// method: PullImage without, with wrong and with right credentials, of an unknown
/// repository and of a malformed reference, ImageStatus, ListImages, ImageFsInfo,
/// RemoveImage, a method the runtime does not have.
fn kubelet_calls(host: &str) -> Vec<(&'static str, Vec<u8>)> {
    let image = format!("{host}/team/app:v1");
    let pull = |image: &str, credential| pull_request(image, credential, "team-a").encode_to_vec();
    let spec = || {
        Some(ImageSpec {
            image: image.clone(),
        })
    };
    vec![
        (PULL_IMAGE, pull(&image, None)),
        (PULL_IMAGE, pull(&image, Some((USER, "wrong-password")))),
        (
            PULL_IMAGE,
            pull(&format!("{host}/team/absent:v1"), Some((USER, PASSWORD))),
        ),
        (PULL_IMAGE, pull("Not//A Reference", None)),
        (PULL_IMAGE, pull(&image, Some((USER, PASSWORD)))),
        (
            IMAGE_STATUS,
            ImageStatusRequest { image: spec() }.encode_to_vec(),
        ),
        (LIST_IMAGES, ListImagesRequest {}.encode_to_vec()),
        (IMAGE_FS_INFO, Empty {}.encode_to_vec()),
        (
            REMOVE_IMAGE,
            RemoveImageRequest { image: spec() }.encode_to_vec(),
        ),
        (
            IMAGE_STATUS,
            ImageStatusRequest { image: spec() }.encode_to_vec(),
        ),
        ("/runtime.v1.ImageService/NoSuchMethod", Vec::new()),
    ]
}

/// Whether two answers are the same call's: the same code and message, and the same bytes,
/// except ImageFsInfo's, whose usage figures move with every pull.
fn same(method: &str, direct: &Answer, proxied: &Answer) -> bool {
    (direct.code, &direct.message) == (proxied.code, &proxied.message)
        && (method == IMAGE_FS_INFO || direct.responses == proxied.responses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn grpc_go_gets_through_the_proxy_what_containerd_answers_directly() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let go = build_go();
    let node = node(dir.path());
    for dial in Dial::ALL {
        for (method, request) in kubelet_calls(&node.registry.host()) {
            let direct = go_call(&go, dial, &node.containerd.socket, method, &request, 0);
            let proxied = go_call(&go, dial, &node.proxy, method, &request, 0);
            assert!(
                same(method, &direct, &proxied),
                "{dial:?} {method}: directly {direct:?}, through the proxy {proxied:?}"
            );
        }
    }
    // The failures are the runtime's own words, not a transport error of the proxy.
    let failed = go_call(
        &go,
        Dial::Path,
        &node.proxy,
        PULL_IMAGE,
        &pull_request(
            &format!("{}/team/app:v1", node.registry.host()),
            Some((USER, "wrong-password")),
            "team-a",
        )
        .encode_to_vec(),
        0,
    );
    assert_ne!(failed.code, 0);
    assert!(
        !failed.message.contains("without sending trailers") && !failed.message.is_empty(),
        "{failed:?}"
    );
    let log = node.agent.log_text();
    assert!(!log.contains(PASSWORD), "the password reached the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn python_grpcio_gets_through_the_proxy_what_containerd_answers_directly() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let node = node(dir.path());
    for (method, request) in kubelet_calls(&node.registry.host()) {
        let direct = python_call(&node.containerd.socket, method, &request, 0, 60);
        let proxied = python_call(&node.proxy, method, &request, 0, 60);
        assert!(
            same(method, &direct, &proxied),
            "{method}: directly {direct:?}, through the proxy {proxied:?}"
        );
    }
}

/// A `Lookup` that names a service account is answered from that account's cache entries, and
/// the agent cannot check the token: only root, its own uid and the uids of
/// `--allow-uids service-account-identity=UID` may make the claim. Another uid that can open
/// the socket gets PERMISSION_DENIED (and nothing from the cache); its lookups without a claim
/// still work. Called with grpc-go as other uids (needs root).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn only_trusted_uids_may_claim_a_service_account_identity() {
    use std::os::unix::fs::PermissionsExt;
    credgate_testbed::require_root("calling as other uids");
    credgate_testbed::require("setpriv");
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let go = build_go();
    let agent = Agent::start(
        dir.path(),
        &["--allow-uids", "service-account-identity=4243"],
    );
    std::fs::set_permissions(&agent.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let claim = LookupRequest {
        image: IMAGE.into(),
        service_account: Some(credgate_api::v1::ServiceAccount {
            namespace: "team-a".into(),
            name: "builder".into(),
            uid: "0f6c7a8e".into(),
            token: "forged-token-not-for-logs".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec();
    let as_uid = |uid: u32, request: &[u8]| {
        let mut cmd = std::process::Command::new("setpriv");
        cmd.args(["--reuid", &uid.to_string(), "--regid", &uid.to_string()])
            .args(["--clear-groups", "--"])
            .arg(&go)
            .arg("-socket")
            .arg(&agent.socket)
            .args(["-method", credgate_api::methods::LOOKUP, "-timeout", "30"]);
        crate::support::foreign::run_client(cmd, request)
    };
    let refused = as_uid(4242, &claim);
    assert_eq!(
        refused.code,
        tonic::Code::PermissionDenied as u32,
        "{refused:?}"
    );
    assert!(
        refused
            .message
            .contains("uid 4242 may not look up credentials for a service account"),
        "{refused:?}"
    );
    assert!(refused.responses.is_empty());
    let plain = as_uid(4242, &lookup_request());
    assert_eq!(plain.code, 0, "{plain:?}");
    let trusted = as_uid(4243, &claim);
    assert_eq!(trusted.code, 0, "{trusted:?}");
    let own = go_call(
        &go,
        Dial::Path,
        &agent.socket,
        credgate_api::methods::LOOKUP,
        &claim,
        0,
    );
    assert_eq!(own.code, 0, "{own:?}");
    let log = agent.log_text();
    assert!(
        log.contains("lookup refused") && log.contains("uid=4242"),
        "{log}"
    );
    assert!(!log.contains("forged-token-not-for-logs"));
}
