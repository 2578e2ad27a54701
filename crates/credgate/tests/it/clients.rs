//! Clients credgate did not write, on both of its gRPC sockets: grpc-go 1.85 dialing as the
//! kubelet up to 1.30 (`:authority` is the socket's path) and from 1.31 (`localhost`), Python
//! grpcio with its default channel (the percent-encoded path), the kubelet's own CRI client
//! (k8s.io/cri-client 0.37.2) and crictl 1.37.0. On the API socket they get what credgate's own
//! client gets; through the CRI proxy they get exactly what the same call made directly to
//! containerd gets, Debian's 1.6 and 2.4 alike: the same status code and message (a
//! trailers-only error stays one) and the same response bytes. The proxy tests need root
//! (containerd).

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

/// A registry with htpasswd holding `team/app:v1`, containerd (the one at `binary`) trusting
/// it, and the agent's proxy in front of containerd.
struct Node {
    registry: Registry,
    containerd: Containerd,
    agent: Agent,
    proxy: std::path::PathBuf,
}

fn node(dir: &Path, binary: &Path) -> Node {
    let registry = Registry::start(dir, USER, PASSWORD);
    oci_image(dir);
    push(dir, &registry, "team/app", USER, PASSWORD);
    let containerd = Containerd::start_binary(binary, dir, &[registry.host()]);
    let (agent, proxy) = proxy_agent(dir, &containerd.socket);
    Node {
        registry,
        containerd,
        agent,
        proxy,
    }
}

/// The runtimes the proxy's answers are compared with, each with a directory of its own under
/// `dir`: Debian's containerd 1.6 and containerd 2.4 (`CREDGATE_TEST_CONTAINERD2`, which
/// `scripts/test` builds).
fn runtimes(dir: &Path) -> Vec<(&'static str, std::path::PathBuf, std::path::PathBuf)> {
    let v2 = Containerd::v2_binary().unwrap_or_else(|why| panic!("{why}"));
    [
        ("containerd-1.6", std::path::PathBuf::from("containerd")),
        ("containerd-2.4", v2),
    ]
    .into_iter()
    .map(|(name, binary)| {
        let sub = dir.join(name);
        std::fs::create_dir_all(&sub).unwrap();
        (name, binary, sub)
    })
    .collect()
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
    for (runtime, binary, sub) in runtimes(dir.path()) {
        let node = node(&sub, &binary);
        for dial in Dial::ALL {
            for (method, request) in kubelet_calls(&node.registry.host()) {
                let direct = go_call(&go, dial, &node.containerd.socket, method, &request, 0);
                let proxied = go_call(&go, dial, &node.proxy, method, &request, 0);
                assert!(
                    same(method, &direct, &proxied),
                    "{runtime} {dial:?} {method}: directly {direct:?}, through the proxy {proxied:?}"
                );
            }
        }
    }
    let again = dir.path().join("again");
    std::fs::create_dir_all(&again).unwrap();
    let node = node(&again, Path::new("containerd"));
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
    for (runtime, binary, sub) in runtimes(dir.path()) {
        let node = node(&sub, &binary);
        for (method, request) in kubelet_calls(&node.registry.host()) {
            let direct = python_call(&node.containerd.socket, method, &request, 0, 60);
            let proxied = python_call(&node.proxy, method, &request, 0, 60);
            assert!(
                same(method, &direct, &proxied),
                "{runtime} {method}: directly {direct:?}, through the proxy {proxied:?}"
            );
        }
    }
}

/// A username and password.
type Credential = (&'static str, &'static str);

/// The kubelet's calls, made with the kubelet's own CRI client (k8s.io/cri-client 0.37.2,
/// built and dialed as the kubelet builds it), as criclient arguments and the credential it
/// reads on stdin.
fn cri_client_calls(host: &str) -> Vec<(Vec<String>, Option<Credential>)> {
    let image = format!("{host}/team/app:v1");
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let pod = "team-a/app-0/4c1d2e3f";
    vec![
        (args(&["pull", &image, "-pod", pod]), None),
        (
            args(&["pull", &image, "-pod", pod, "-auth"]),
            Some((USER, "wrong-password")),
        ),
        (
            args(&[
                "pull",
                &format!("{host}/team/absent:v1"),
                "-pod",
                pod,
                "-auth",
            ]),
            Some((USER, PASSWORD)),
        ),
        (args(&["pull", "Not//A Reference"]), None),
        (
            args(&["pull", &image, "-pod", pod, "-auth"]),
            Some((USER, PASSWORD)),
        ),
        (args(&["status", &image]), None),
        (args(&["list"]), None),
        (args(&["-streaming", "list"]), None),
        (args(&["remove", &image]), None),
        (args(&["status", &image]), None),
        (args(&["-streaming", "list"]), None),
    ]
}

fn cri_client(
    program: &Path,
    socket: &Path,
    args: &[String],
    auth: Option<(&str, &str)>,
) -> String {
    let (flags, rest): (Vec<&String>, Vec<&String>) =
        args.iter().partition(|a| a.as_str() == "-streaming");
    let mut cmd = std::process::Command::new(program);
    cmd.arg("-endpoint")
        .arg(format!("unix://{}", socket.display()))
        .args(flags)
        .args(rest);
    let input = auth
        .map(|(username, password)| {
            serde_json::json!({"username": username, "password": password}).to_string()
        })
        .unwrap_or_default();
    let out = crate::support::output_with_stdin(&mut cmd, input.as_bytes());
    assert!(
        out.status.success(),
        "criclient {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn the_kubelets_cri_client_gets_through_the_proxy_what_containerd_answers_directly() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let program = crate::support::foreign::build_go_program("criclient");
    for (runtime, binary, sub) in runtimes(dir.path()) {
        let node = node(&sub, &binary);
        let mut answers = Vec::new();
        for (args, auth) in cri_client_calls(&node.registry.host()) {
            let direct = cri_client(&program, &node.containerd.socket, &args, auth);
            let proxied = cri_client(&program, &node.proxy, &args, auth);
            assert_eq!(direct, proxied, "{runtime} {args:?}");
            answers.push(direct);
        }
        // The calls did what they say: the right credential pulled, the wrong one did not,
        // and the streaming list (containerd 2.4's StreamImages, 1.6's fallback) saw it.
        let code = |a: &str| serde_json::from_str::<serde_json::Value>(a).unwrap()["code"].clone();
        assert_ne!(code(&answers[1]), 0, "{runtime}: {}", answers[1]);
        assert_eq!(code(&answers[4]), 0, "{runtime}: {}", answers[4]);
        assert!(
            answers[7].contains("team/app:v1"),
            "{runtime}: {}",
            answers[7]
        );
        assert!(
            !answers[10].contains("team/app:v1"),
            "{runtime}: {}",
            answers[10]
        );
        let log = node.agent.log_text();
        assert!(!log.contains(PASSWORD), "the password reached the log");
    }
}

/// crictl's output without its timestamps and process IDs (logrus's `time="..."`, klog's
/// `E1127 22:57:12.732370    8806 file.go:334]` header).
fn crictl_said(out: &std::process::Output) -> (Option<i32>, String, String) {
    let strip = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .lines()
            .map(|l| match l.find("time=\"") {
                Some(at) => {
                    let rest = &l[at + 6..];
                    let end = rest.find('"').map_or(rest.len(), |e| e + 1);
                    format!("{}{}", &l[..at], &rest[end..])
                }
                None if l.starts_with(['I', 'W', 'E', 'F'])
                    && l.as_bytes().get(1).is_some_and(u8::is_ascii_digit) =>
                {
                    let body = l.split_once("] ").map_or("", |(_, body)| body);
                    format!("{} {body}", &l[..1])
                }
                None => l.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    (out.status.code(), strip(&out.stdout), strip(&out.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn crictl_gets_through_the_proxy_what_containerd_answers_directly() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let crictl = crate::support::foreign::built("cri-tools").join("crictl");
    for (runtime, binary, sub) in runtimes(dir.path()) {
        let node = node(&sub, &binary);
        let image = format!("{}/team/app:v1", node.registry.host());
        let wrong = format!("{USER}:wrong-password");
        let right = format!("{USER}:{PASSWORD}");
        let calls: Vec<Vec<&str>> = vec![
            vec!["pull", &image],
            vec!["pull", "--creds", &wrong, &image],
            vec!["pull", "--creds", &right, &image],
            vec!["inspecti", "-o", "json", &image],
            vec!["images", "-o", "json"],
            vec!["rmi", &image],
            vec!["inspecti", &image],
        ];
        // The whole sequence directly, then through the proxy: each ends with the image
        // removed, where it started.
        let run = |socket: &Path| {
            calls
                .iter()
                .map(|args| {
                    let out = std::process::Command::new(&crictl)
                        .arg("--runtime-endpoint")
                        .arg(format!("unix://{}", node.containerd.socket.display()))
                        .arg("--image-endpoint")
                        .arg(format!("unix://{}", socket.display()))
                        .args(args)
                        .output()
                        .unwrap();
                    let (code, stdout, stderr) = crictl_said(&out);
                    let stderr = stderr.replace(
                        &socket.display().to_string(),
                        &node.containerd.socket.display().to_string(),
                    );
                    (args.join(" "), code, stdout, stderr)
                })
                .collect::<Vec<_>>()
        };
        let direct = run(&node.containerd.socket);
        let proxied = run(&node.proxy);
        for (d, p) in direct.iter().zip(&proxied) {
            assert_eq!(d, p, "{runtime}");
        }
        let codes: Vec<Option<i32>> = direct.iter().map(|d| d.1).collect();
        assert_eq!(
            codes,
            [
                Some(1),
                Some(1),
                Some(0),
                Some(0),
                Some(0),
                Some(0),
                Some(1)
            ],
            "{runtime}: {direct:?}"
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
