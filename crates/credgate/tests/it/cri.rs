//! The CRI image-service proxy against Debian's containerd (its CRI plugin, the native
//! snapshotter, a private root, state and socket in a temporary directory) and Debian's
//! docker-registry with htpasswd: calls through `credgate serve --cri-proxy-socket` get the
//! runtime's own answers and status codes. Needs root (containerd) and containerd installed
//! (`scripts/test` installs it).

use std::process::Command;

use std::time::Duration;

use crate::support::{
    needs_containerd, oci_image, proxy_agent, proxy_agent_with, push, Agent, Registry,
};
use credgate_testbed::cri::*;
use credgate_testbed::Containerd;

const USER: &str = "cri-user";
const PASSWORD: &str = "cri-Pa55word-not-for-logs";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn image_service_calls_pass_through_with_the_runtimes_answers() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let containerd = Containerd::start(dir.path(), &[]);
    let (agent, proxy) = proxy_agent(dir.path(), &containerd.socket);
    for socket in [&containerd.socket, &proxy] {
        let list: ListImagesResponse = call(socket, LIST_IMAGES, ListImagesRequest {})
            .await
            .expect("ListImages");
        assert!(list.images.is_empty());
        let status: ImageStatusResponse = call(
            socket,
            IMAGE_STATUS,
            ImageStatusRequest {
                image: Some(ImageSpec {
                    image: "docker.io/library/absent:1".into(),
                }),
            },
        )
        .await
        .expect("ImageStatus");
        assert!(status.image.is_none());
        let fs: ImageFsInfoResponse = call(socket, IMAGE_FS_INFO, Empty {})
            .await
            .expect("ImageFsInfo");
        assert!(!fs.image_filesystems.is_empty());
    }
    // A method credgate has no code for: the runtime's own answer, not credgate's.
    let direct = call::<Empty, Empty>(
        &containerd.socket,
        "/runtime.v1.ImageService/NoSuchMethod",
        Empty {},
    )
    .await
    .unwrap_err();
    let proxied = call::<Empty, Empty>(&proxy, "/runtime.v1.ImageService/NoSuchMethod", Empty {})
        .await
        .unwrap_err();
    assert_eq!(direct.code(), tonic::Code::Unimplemented);
    assert_eq!(
        (proxied.code(), proxied.message()),
        (direct.code(), direct.message())
    );
    // So does a status error: a pull of an image that does not exist.
    let missing = || PullImageRequest {
        image: Some(ImageSpec {
            image: "127.0.0.1:1/nothing/here:v1".into(),
        }),
        ..Default::default()
    };
    let direct =
        call::<PullImageRequest, PullImageResponse>(&containerd.socket, PULL_IMAGE, missing())
            .await
            .unwrap_err();
    let proxied = call::<PullImageRequest, PullImageResponse>(&proxy, PULL_IMAGE, missing())
        .await
        .unwrap_err();
    assert_eq!(proxied.code(), direct.code(), "{proxied:?} vs {direct:?}");
    assert!(agent.stop().success());
    assert!(!proxy.exists(), "the proxy's socket is removed at stop");
}

/// A pull with the registry's credentials through the proxy: containerd has the image; with
/// wrong ones or none the pull fails with the runtime's own error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn pulls_through_the_proxy_reach_the_registry_with_their_credentials() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let registry = Registry::start(d, USER, PASSWORD);
    oci_image(d);
    push(d, &registry, "team/app", USER, PASSWORD);
    let containerd = Containerd::start(d, &[registry.host()]);
    let (agent, proxy) = proxy_agent(d, &containerd.socket);
    let image = format!("{}/team/app:v1", registry.host());
    let pull = |password: Option<&str>| pull_request(&image, password.map(|p| (USER, p)), "team-a");
    for bad in [None, Some("wrong-password")] {
        let e = call::<_, PullImageResponse>(&proxy, PULL_IMAGE, pull(bad))
            .await
            .unwrap_err();
        assert_ne!(e.code(), tonic::Code::Ok);
        assert!(
            !e.message().contains("credgate"),
            "the runtime's error: {}",
            e.message()
        );
    }
    let empty = agent.credgate(&["ctl", "captured"]);
    assert_eq!(crate::support::text(&empty.stdout), "nothing captured\n");
    let pulled: PullImageResponse = call(&proxy, PULL_IMAGE, pull(Some(PASSWORD)))
        .await
        .expect("the pull with the right credentials succeeds");
    assert!(
        pulled.image_ref.starts_with("sha256:"),
        "{}",
        pulled.image_ref
    );
    let list: ListImagesResponse = call(&containerd.socket, LIST_IMAGES, ListImagesRequest {})
        .await
        .unwrap();
    assert!(
        list.images.iter().any(|i| i.repo_tags.contains(&image)),
        "{list:?}"
    );
    let log = agent.log_text();
    assert!(
        !log.contains(PASSWORD),
        "the password reached the agent's log"
    );

    // The credential of the pull is served for another tag of the repository, to `Lookup`,
    // first in the list; never to the docker helper, told only a host (decision 0021).
    let other_tag = format!("{}/team/app:v2", registry.host());
    let captured = |agent: &Agent| -> serde_json::Value {
        let out = agent.credgate(&["ctl", "lookup", "-o", "json", &other_tag]);
        // Exit 1 (and the JSON answer) when there is no credential at all.
        assert!(
            matches!(out.status.code(), Some(0 | 1)),
            "{}{}",
            crate::support::text(&out.stdout),
            crate::support::text(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_default()
    };
    // Captured once the registry has confirmed the credential: before the pull's answer, or
    // after it when the confirmation outlasts the capture wait.
    credgate_testbed::eventually(
        "the pull's credential is captured",
        Duration::from_secs(20),
        || captured(&agent)["credentials"][0]["source_kind"] == "captured",
    );
    let v = captured(&agent);
    let first = &v["credentials"][0];
    assert_eq!(first["source_kind"], "captured", "{v}");
    assert_eq!(first["source"], "team-a");
    assert_eq!(
        (first["username"].as_str(), first["password"].as_str()),
        (Some(USER), Some(PASSWORD))
    );
    // `credgate get` names the source of a captured credential in its PROVIDER cell.
    let table = agent.credgate(&["get", &other_tag]);
    let text = crate::support::text(&table.stdout);
    assert!(
        text.lines()
            .nth(1)
            .is_some_and(|l| l.contains("captured (team-a)")),
        "{text}"
    );
    let helper = agent.helper_get(&registry.host());
    assert_eq!(
        crate::support::text(&helper.stdout).trim(),
        "credentials not found in native keychain",
        "a pod's credential goes only to its repository"
    );
    // `ctl captured` lists it, never its secret; `forget` of another repository drops nothing.
    let listed = agent.credgate(&["ctl", "captured", "-o", "json"]);
    let text = crate::support::text(&listed.stdout);
    assert!(
        listed.status.success(),
        "{}",
        crate::support::text(&listed.stderr)
    );
    assert!(
        text.contains(&format!("{}/team/app", registry.host())) && text.contains("team-a"),
        "{text}"
    );
    assert!(!text.contains(PASSWORD));
    let none = agent.credgate(&[
        "ctl",
        "captured",
        "forget",
        &format!("{}/team/other", registry.host()),
    ]);
    assert!(
        crate::support::text(&none.stdout).contains("nothing captured"),
        "{}",
        crate::support::text(&none.stdout)
    );
    // The image access guard recorded the pull: another namespace's different secret must
    // authenticate; the same secret content under another name is allowed.
    let check = |secret: &str| {
        agent.credgate(&[
            "ctl",
            "check-access",
            &image,
            "--image-ref",
            &pulled.image_ref,
            "--secret",
            secret,
        ])
    };
    let other = check(&format!("team-b/regcred/77aa={USER}:some-other-password"));
    assert_eq!(
        other.status.code(),
        Some(1),
        "{}",
        crate::support::text(&other.stdout)
    );
    assert!(
        crate::support::text(&other.stdout).contains("MUST_AUTHENTICATE"),
        "{}",
        crate::support::text(&other.stdout)
    );
    let same = check(&format!("team-b/copy/88bb={USER}:{PASSWORD}"));
    assert!(
        same.status.success(),
        "{}{}",
        crate::support::text(&same.stdout),
        crate::support::text(&same.stderr)
    );
    let records = agent.credgate(&["ctl", "list-records", "-o", "json"]);
    let listed = crate::support::text(&records.stdout);
    assert!(
        listed.contains("team-a") && listed.contains("cri-pull-"),
        "{listed}"
    );
    assert!(!listed.contains(PASSWORD));
    // Sealed on disk: no password in the clear.
    let sealed = std::fs::read(d.join("state/captured.sealed")).unwrap();
    assert!(!sealed
        .windows(PASSWORD.len())
        .any(|w| w == PASSWORD.as_bytes()));
    // SIGKILL right after the acknowledged pull, then a restart: still served, with no pull.
    let args = [
        "--cri-proxy-socket".to_owned(),
        proxy.display().to_string(),
        "--cri-runtime-endpoint".to_owned(),
        format!("unix://{}", containerd.socket.display()),
        "--captured-check-interval".to_owned(),
        "200ms".to_owned(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    drop(agent);
    let agent = Agent::start(d, &args);
    let v = captured(&agent);
    assert_eq!(v["credentials"][0]["password"], PASSWORD, "{v}");
    // A replaced node key: the sealed credentials are dropped with a warning, never served.
    drop(agent);
    std::fs::write(d.join("state/node.key"), [7u8; 32]).unwrap();
    let agent = Agent::start(d, &args);
    let v = captured(&agent);
    assert!(
        v["credentials"]
            .as_array()
            .is_none_or(|c| c.iter().all(|c| c["source_kind"] != "captured")),
        "{v}"
    );
    assert!(
        agent.log_text().contains("discarded"),
        "{}",
        agent.log_text()
    );

    // Pulled again, then removed by its ID: no image of the repository is left, so its
    // captured credential goes.
    let again: PullImageResponse = call(&proxy, PULL_IMAGE, pull(Some(PASSWORD)))
        .await
        .expect("pull");
    // Captured once the registry has confirmed the credential: before the pull's answer, or
    // after it when the confirmation outlasts the capture wait.
    credgate_testbed::eventually(
        "the pull's credential is captured again",
        Duration::from_secs(20),
        || captured(&agent)["credentials"][0]["source_kind"] == "captured",
    );
    let _: Empty = call(
        &proxy,
        REMOVE_IMAGE,
        RemoveImageRequest {
            image: Some(ImageSpec {
                image: again.image_ref.clone(),
            }),
        },
    )
    .await
    .expect("RemoveImage");
    let v = captured(&agent);
    assert!(
        v["credentials"]
            .as_array()
            .is_none_or(|c| c.iter().all(|c| c["source_kind"] != "captured")),
        "{v}"
    );

    // A removal that bypasses the proxy (straight to the runtime) is found by the periodic
    // check of the runtime's images.
    let third: PullImageResponse = call(&proxy, PULL_IMAGE, pull(Some(PASSWORD)))
        .await
        .expect("pull");
    // Captured once the registry has confirmed the credential: before the pull's answer, or
    // after it when the confirmation outlasts the capture wait.
    credgate_testbed::eventually(
        "the pull's credential is captured again",
        Duration::from_secs(20),
        || captured(&agent)["credentials"][0]["source_kind"] == "captured",
    );
    let _: Empty = call(
        &containerd.socket,
        REMOVE_IMAGE,
        RemoveImageRequest {
            image: Some(ImageSpec {
                image: third.image_ref.clone(),
            }),
        },
    )
    .await
    .expect("RemoveImage straight to containerd");
    credgate_testbed::eventually_async("the capture dropped", Duration::from_secs(20), || {
        std::future::ready(
            captured(&agent)["credentials"]
                .as_array()
                .is_none_or(|c| c.iter().all(|c| c["source_kind"] != "captured")),
        )
    })
    .await;
}

/// A consumer watching an image of a repository sees the proxy capture its pull credential,
/// the next pull's other credential replace it (rotation) and the removal of the repository's
/// last image drop it, each as a new revision; a failed pull changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn captures_and_rotations_are_pushed_to_watchers() {
    use credgate_api::v1::WatchEvent;

    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut registry = Registry::start(d, USER, PASSWORD);
    const OTHER: (&str, &str) = ("cri-rotated", "rotated-Pa55word-not-for-logs");
    registry.add_user(OTHER.0, OTHER.1);
    oci_image(d);
    push(d, &registry, "team/app", USER, PASSWORD);
    let containerd = Containerd::start(d, &[registry.host()]);
    // A provider for the registry that has no credential of its own, for the kubelet bridge.
    let bin = d.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    crate::support::write_script(
        &bin.join("nothing"),
        r#"cat >/dev/null
printf '{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Registry","cacheDuration":"1m","auth":{}}'"#,
    );
    let config = d.join("providers.yaml");
    std::fs::write(
        &config,
        format!("apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: nothing\n  matchImages: [\"{}\"]\n  defaultCacheDuration: 1m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n", registry.host()),
    )
    .unwrap();
    let (agent, proxy) = proxy_agent_with(
        d,
        &containerd.socket,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            bin.to_str().unwrap(),
        ],
    );
    let image = format!("{}/team/app:v1", registry.host());
    let pull = |user: &str, password: &str| pull_request(&image, Some((user, password)), "team-a");

    let watched = format!("{}/team/app:v2", registry.host());
    let mut stream = crate::support::watch(&agent.socket, std::slice::from_ref(&watched)).await;
    let captured = |e: &WatchEvent| {
        e.credentials
            .iter()
            .find(|c| c.source_kind() == credgate_api::v1::SourceKind::Captured)
            .map(|c| (c.username.clone(), c.password.clone(), c.source.clone()))
    };
    let first = crate::support::next_event(&mut stream).await;
    assert_eq!(first.r#ref, watched);
    assert_eq!(captured(&first), None, "{first:?}");

    let _: PullImageResponse = call(&proxy, PULL_IMAGE, pull(USER, PASSWORD))
        .await
        .expect("the pull succeeds");
    let second = crate::support::next_event(&mut stream).await;
    assert_eq!(
        captured(&second),
        Some((USER.into(), PASSWORD.into(), "team-a".into()))
    );
    assert_eq!(
        second.credentials[0].source_kind(),
        credgate_api::v1::SourceKind::Captured
    );
    assert!(second.revision > first.revision);

    // The kubelet bridge serves it to a snapshotter that asks (`--captured`), keyed by the
    // repository, and never to the kubelet.
    let bridge = |more: &[&str]| -> serde_json::Value {
        let out = crate::support::output_with_stdin(
            Command::new(crate::support::bridge_bin())
                .args(["--provider", "nothing"])
                .args(more)
                .env("CREDGATE_SOCKET", &agent.socket),
            format!(r#"{{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderRequest","image":"{watched}"}}"#).as_bytes(),
        );
        assert!(
            out.status.success(),
            "{}",
            crate::support::text(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let repository = format!("{}/team/app", registry.host());
    let snapshotter = bridge(&["--captured"]);
    assert_eq!(
        snapshotter["auth"][&repository]["username"], USER,
        "{snapshotter}"
    );
    assert_eq!(snapshotter["auth"][&repository]["password"], PASSWORD);
    let kubelet = bridge(&[]);
    assert!(
        kubelet["auth"].as_object().is_none_or(|a| a.is_empty()),
        "{kubelet}"
    );

    // A failed pull replaces nothing; the next successful one with other credentials does.
    call::<_, PullImageResponse>(&proxy, PULL_IMAGE, pull(OTHER.0, "wrong-password"))
        .await
        .unwrap_err();
    let _: PullImageResponse = call(&proxy, PULL_IMAGE, pull(OTHER.0, OTHER.1))
        .await
        .expect("the pull with the rotated credential succeeds");
    let third = crate::support::next_event(&mut stream).await;
    assert_eq!(
        captured(&third),
        Some((OTHER.0.into(), OTHER.1.into(), "team-a".into())),
        "the failed pull in between must not have been pushed"
    );
    assert_eq!(third.revision, second.revision + 1);

    let _: Empty = call(
        &proxy,
        REMOVE_IMAGE,
        RemoveImageRequest {
            image: Some(ImageSpec {
                image: image.clone(),
            }),
        },
    )
    .await
    .expect("RemoveImage");
    let fourth = crate::support::next_event(&mut stream).await;
    assert_eq!(captured(&fourth), None, "{fourth:?}");
    assert_eq!(fourth.revision, third.revision + 1);
    let log = agent.log_text();
    assert!(!log.contains(PASSWORD) && !log.contains(OTHER.1));
    // SIGTERM stops the proxy's thread with the rest, and its socket goes.
    assert!(agent.stop().success());
    assert!(!proxy.exists());
}

/// What a pod author controls cannot make credgate serve a credential the registry never
/// accepted: a credential for another registry (`server_address`) used on an image that can be
/// pulled anonymously, or garbage on an anonymously readable repository, succeeds as a pull
/// and is captured by no one; the right credential for the image's own registry is captured
/// once the registry has confirmed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn only_credentials_the_images_registry_checked_and_accepted_are_captured() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (locked_dir, open_dir) = (d.join("locked"), d.join("open"));
    std::fs::create_dir_all(&locked_dir).unwrap();
    std::fs::create_dir_all(&open_dir).unwrap();
    let locked = Registry::start(&locked_dir, USER, PASSWORD);
    let open = Registry::with_auth(&open_dir, "");
    oci_image(d);
    push(d, &locked, "team/app", USER, PASSWORD);
    push(d, &open, "public/app", "anyone", "anything");
    let containerd = Containerd::start(d, &[locked.host(), open.host()]);
    let (agent, proxy) = proxy_agent(d, &containerd.socket);
    let public = format!("{}/public/app:v1", open.host());
    let mut request = pull_request(&public, Some(("mallory", "GARBAGE-not-for-logs")), "team-m");
    let _: PullImageResponse = call(&proxy, PULL_IMAGE, request.clone())
        .await
        .expect("an anonymous registry serves the pull whatever the credential");
    request.auth = Some(AuthConfig {
        username: USER.into(),
        password: PASSWORD.into(),
        server_address: locked.host(),
        ..Default::default()
    });
    let _: PullImageResponse = call(&proxy, PULL_IMAGE, request)
        .await
        .expect("the credential of another registry is not used: anonymous");
    credgate_testbed::eventually("both refusals are logged", Duration::from_secs(20), || {
        let log = agent.log_text();
        log.contains("the registry did not check them")
            && log.contains("their server address names another registry")
    });
    let lookup = agent.credgate(&["ctl", "lookup", "-o", "json", &public]);
    let text = crate::support::text(&lookup.stdout);
    assert!(!text.contains("captured"), "{text}");
    assert!(
        !text.contains("GARBAGE") && !text.contains(PASSWORD),
        "{text}"
    );
    let helper = agent.helper_get(&open.host());
    assert!(!crate::support::text(&helper.stdout).contains(PASSWORD));
    assert_eq!(
        crate::support::text(&agent.credgate(&["ctl", "captured"]).stdout),
        "nothing captured\n"
    );
    // The right credential for the locked registry, naming it: captured once confirmed.
    let private = format!("{}/team/app:v1", locked.host());
    let mut request = pull_request(&private, Some((USER, PASSWORD)), "team-a");
    request.auth.as_mut().unwrap().server_address = format!("https://{}/v2/", locked.host());
    let _: PullImageResponse = call(&proxy, PULL_IMAGE, request).await.expect("pull");
    credgate_testbed::eventually(
        "the confirmed credential is captured",
        Duration::from_secs(20),
        || {
            crate::support::text(&agent.credgate(&["ctl", "captured"]).stdout)
                .contains(&format!("{}/team/app", locked.host()))
        },
    );
    let log = agent.log_text();
    assert!(!log.contains("GARBAGE-not-for-logs") && !log.contains(PASSWORD));
}

/// PullImage bodies sent up to just under their limit and never finished: what the proxy
/// holds is bounded per connection and in all (the rest are refused with RESOURCE_EXHAUSTED),
/// by the agent's own account (`credgate_cri_held_bytes`) and in its RSS, and the budget is
/// given back when the callers leave. How fast the allocator then returns pages to the kernel
/// is not the agent's property: `scripts/soak --cri` reports the RSS after (BENCHMARKS.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_pulls_hold_a_bounded_amount_and_let_go() {
    let dir = tempfile::tempdir().unwrap();
    let (agent, proxy) = crate::support::proxy_agent_with(
        dir.path(),
        &dir.path().join("no-runtime.sock"),
        &["--metrics-addr", "127.0.0.1:0"],
    );
    let held = || {
        metrics_text(&agent)
            .lines()
            .find_map(|l| l.strip_prefix("credgate_cri_held_bytes "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .expect("credgate_cri_held_bytes is exported")
    };
    assert_eq!(held(), 0);
    let pid = agent.child.id();
    let before = credgate_testbed::h2::rss(pid);
    let mut bodies = Vec::new();
    let mut answers = Vec::new();
    for _ in 0..4 {
        let mut sender = credgate_testbed::h2::connect(&proxy, 1 << 20).await;
        for _ in 0..60 {
            // A frame prefix announcing a message just under a PullImage's limit (512 KiB),
            // and most of it.
            let mut first = vec![0u8];
            first.extend_from_slice(&((1u32 << 19) - 64).to_be_bytes());
            first.resize((1 << 19) - 1024, b'x');
            let (body, keep) = credgate_testbed::h2::unfinished(first);
            bodies.push(keep);
            sender.ready().await.unwrap();
            answers.push(tokio::spawn(
                sender.send_request(credgate_testbed::h2::request(PULL_IMAGE, body)),
            ));
        }
    }
    let exhausted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut waiting = tokio::task::JoinSet::new();
    for answer in answers {
        let exhausted = exhausted.clone();
        waiting.spawn(async move {
            if let Ok(Ok(answer)) = answer.await {
                if let Some((8, message)) = credgate_testbed::h2::status(answer).await {
                    assert!(message.contains("too%20many"), "{message}");
                    exhausted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
    }
    let count = || exhausted.load(std::sync::atomic::Ordering::Relaxed);
    credgate_testbed::eventually_async("4 × 51 pulls refused", Duration::from_secs(20), || {
        std::future::ready(count() >= 4 * 51)
    })
    .await;
    let exhausted = count();
    // 4 MiB a connection: at most 8 of each connection's 60 are held, the rest refused.
    assert!(exhausted >= 4 * 51, "{exhausted} refused");
    let holding = held();
    assert!(
        holding > 0 && holding <= 4 * (4 << 20),
        "the proxy holds {holding} bytes for 4 connections of at most 4 MiB each"
    );
    let during = credgate_testbed::h2::rss(pid);
    assert!(
        during < before + (48 << 20),
        "RSS went from {before} to {during} bytes"
    );
    drop(bodies);
    waiting.abort_all();
    credgate_testbed::eventually(
        "the proxy gives back what the callers held once they leave",
        Duration::from_secs(20),
        || held() == 0,
    );
    let health = agent.credgate(&["ctl", "health"]);
    assert_eq!(crate::support::text(&health.stdout).trim(), "SERVING");
}

/// The agent's metrics page (the agent started with `--metrics-addr 127.0.0.1:0`).
pub(crate) fn metrics_text(agent: &Agent) -> String {
    use std::io::{Read as _, Write as _};
    let log = agent.log_text();
    // Text (`addr=HOST:PORT`) or JSON (`"addr":"HOST:PORT"`) logs.
    let addr = log
        .split("addr=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .or_else(|| {
            log.split("\"addr\":\"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
        })
        .expect("the metrics address is logged")
        .to_owned();
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    c.read_to_string(&mut text).unwrap();
    text
}

/// "Why was this pull anonymous?": pulls through the proxy are logged with whether the kubelet
/// sent credentials and what the runtime answered, counted, listed by `ctl pulls`; a pull
/// without credentials that fails as unauthorized while a provider matches the image gets a
/// warning saying what to check; `credgate explain` names a provider whose pattern misses by
/// the port, as text and as JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn pulls_are_logged_and_explained() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let registry = Registry::start(d, USER, PASSWORD);
    oci_image(d);
    push(d, &registry, "team/app", USER, PASSWORD);
    let containerd = Containerd::start(d, &[registry.host()]);
    // Two providers: one for the registry's host and port (its plugin answers the right
    // credential), one for the host alone, which misses by the port.
    let bin = d.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    let answer = format!(
        "{{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"1h\",\"auth\":{{\"{}\":{{\"username\":\"{USER}\",\"password\":\"{PASSWORD}\"}}}}}}",
        registry.host()
    );
    for name in ["right", "portless"] {
        crate::support::write_script(&bin.join(name), &format!("cat >/dev/null\necho '{answer}'"));
    }
    let config = d.join("providers.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: right\n  matchImages: [\"{}\"]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n- name: portless\n  matchImages: [\"127.0.0.1\"]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
            registry.host()
        ),
    )
    .unwrap();
    let (agent, proxy) = proxy_agent_with(
        d,
        &containerd.socket,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            bin.to_str().unwrap(),
            "--metrics-addr",
            "127.0.0.1:0",
        ],
    );
    let image = format!("{}/team/app:v1", registry.host());
    // The kubelet pulls without credentials (its provider config does not name the agent):
    // unauthorized, twice; one warning.
    for _ in 0..2 {
        let e =
            call::<_, PullImageResponse>(&proxy, PULL_IMAGE, pull_request(&image, None, "team-a"))
                .await
                .unwrap_err();
        assert_ne!(e.code(), tonic::Code::Ok);
    }
    let pulled: PullImageResponse = call(
        &proxy,
        PULL_IMAGE,
        pull_request(&image, Some((USER, PASSWORD)), "team-a"),
    )
    .await
    .expect("with credentials");
    assert!(pulled.image_ref.starts_with("sha256:"));
    let log = agent.log_text();
    let pull_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" pull ") || l.contains("\"pull\""))
        .collect();
    assert!(
        pull_lines
            .iter()
            .filter(
                |l| l.contains("auth=none") && l.contains("result=\"unauthorized\"")
                    || l.contains("auth=none") && l.contains("result=unauthorized")
            )
            .count()
            >= 2,
        "{log}"
    );
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("a pull without credentials failed as unauthorized"))
        .collect();
    assert_eq!(warnings.len(), 1, "once per image: {log}");
    assert!(warnings[0].contains("provider right"), "{}", warnings[0]);
    assert!(!log.contains(PASSWORD), "the password reached the log");
    // The ring, newest first; the metric by auth and result.
    let pulls = agent.credgate(&["ctl", "pulls"]);
    let text = crate::support::text(&pulls.stdout);
    let rows: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(rows.len(), 3, "{text}");
    assert!(
        rows[0].contains("pulled") && rows[0].contains("team-a/app-0"),
        "{text}"
    );
    // The classification the log has, and the end of the runtime's message, where
    // containerd puts the registry's answer.
    assert!(
        rows[1].contains("none")
            && rows[1].contains("unauthorized")
            && rows[1].contains("401 Unauthorized"),
        "{text}"
    );
    let json = agent.credgate(&["ctl", "-o", "json", "pulls", &image]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["pulls"].as_array().unwrap().len(), 3);
    assert_eq!(v["pulls"][1]["result"], "unauthorized", "{v}");
    assert!(
        v["pulls"][1]["message"]
            .as_str()
            .unwrap()
            .contains("401 Unauthorized"),
        "{v}"
    );
    assert_eq!(
        v["pulls"][0]["auth"], "unknown",
        "a credential of no source the agent holds"
    );
    assert!(!crate::support::text(&json.stdout).contains(PASSWORD));
    let metrics = metrics_text(&agent);
    assert!(
        metrics.contains("credgate_cri_pulls_total{auth=\"none\",result=\"unauthorized\"} 2"),
        "{metrics}"
    );
    // `explain`: the right provider matches (its answer is not cached yet: the kubelet never
    // asked), the portless one misses by the port; text and JSON.
    let out = agent.credgate(&["explain", &image]);
    let text = crate::support::text(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        crate::support::text(&out.stderr)
    );
    assert!(text.contains("provider right: matches"), "{text}");
    assert!(
        text.contains("provider portless: does not match (closest: 127.0.0.1: the pattern has no port and does not match a host with a port"),
        "{text}"
    );
    assert!(text.contains("verdict: "), "{text}");
    // The guard recorded the pulls: the image's ID, pulled with a secret of team-a, not
    // node-wide; a workload with node-wide credentials only must authenticate.
    assert!(
        text.contains(&format!(
            "{}: node-wide no; 1 secret(s) of team-a",
            pulled.image_ref
        )),
        "{text}"
    );
    assert!(
        text.contains("a workload with node-wide credentials only: must_authenticate"),
        "{text}"
    );
    let out = agent.credgate(&["explain", "-o", "json", &image]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["sources"][0]["name"], "right");
    assert_eq!(v["sources"][0]["matched"], true);
    assert_eq!(v["sources"][1]["matched"], false);
    assert!(v["sources"][1]["why_not"]
        .as_str()
        .unwrap()
        .contains("port"));
    assert!(!crate::support::text(&out.stdout).contains(PASSWORD));
}

/// The proxy's pull logic against a fake runtime (no root, no containerd): a failed pull's
/// trailers-only answer reaches the caller as it was sent, the pull is logged and counted, the
/// warning names the provider that matches, and a pull with the credential a provider gives is
/// attributed to that provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pull_decision_log_against_a_fake_runtime() {
    use credgate_testbed::fake_runtime::{self, Answers};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let runtime_socket = d.join("fake-runtime.sock");
    let fake = fake_runtime::start(
        &runtime_socket,
        Answers {
            pull: Err((2, "failed to resolve reference: 401 Unauthorized".into())),
            ..Default::default()
        },
    )
    .await;
    let bin = d.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    crate::support::write_script(
        &bin.join("p"),
        "cat >/dev/null\necho '{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"1h\",\"auth\":{\"registry.example.com\":{\"username\":\"puller\",\"password\":\"fake-runtime-secret\"}}}'",
    );
    let config = d.join("providers.yaml");
    std::fs::write(&config, "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: p\n  matchImages: [registry.example.com]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n").unwrap();
    let (agent, proxy) = proxy_agent_with(
        d,
        &runtime_socket,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            bin.to_str().unwrap(),
        ],
    );
    let image = "registry.example.com/team/app:v1";
    let e = call::<_, PullImageResponse>(&proxy, PULL_IMAGE, pull_request(image, None, "ns-a"))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            tonic::Code::Unknown,
            "failed to resolve reference: 401 Unauthorized"
        )
    );
    credgate_testbed::eventually("the warning", Duration::from_secs(20), || {
        agent
            .log_text()
            .contains("a pull without credentials failed as unauthorized")
    });
    // The provider's credential, once the agent holds it, is attributed to the provider.
    let out = agent.credgate(&["get", image]);
    assert!(
        out.status.success(),
        "{}",
        crate::support::text(&out.stderr)
    );
    fake.answers.lock().pull = Ok("sha256:feed".into());
    let pulled: PullImageResponse = call(
        &proxy,
        PULL_IMAGE,
        pull_request(image, Some(("puller", "fake-runtime-secret")), "ns-a"),
    )
    .await
    .unwrap();
    assert_eq!(pulled.image_ref, "sha256:feed");
    let v: serde_json::Value =
        serde_json::from_slice(&agent.credgate(&["ctl", "-o", "json", "pulls"]).stdout).unwrap();
    assert_eq!(v["pulls"][0]["auth"], "given", "{v}");
    assert_eq!(
        (&v["pulls"][0]["source_kind"], &v["pulls"][0]["source"]),
        (&"provider".into(), &"p".into()),
        "{v}"
    );
    assert_eq!(v["pulls"][0]["code"], 0);
    assert_eq!(v["pulls"][1]["auth"], "none");
    assert_eq!(v["pulls"][1]["code"], 2);
    assert!(!agent.log_text().contains("fake-runtime-secret"));
}

/// The guard's records and the pull log do not depend on capture: with
/// `--no-cri-proxy-capture` a pull with a pod's credential is recorded (another secret must
/// authenticate, the same content is allowed), logged, and nothing is kept: no captured
/// credential is listed or served, and a sealed file of an earlier run is removed at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_capture_pulls_are_still_recorded_and_logged() {
    const SECRET: &str = "not-kept-secret";
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let runtime = d.join("fake-runtime.sock");
    let fake = credgate_testbed::fake_runtime::start(&runtime, Default::default()).await;
    let state = d.join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    std::fs::write(state.join("captured.sealed"), b"left by an earlier run").unwrap();
    let (agent, proxy) = proxy_agent_with(d, &runtime, &["--no-cri-proxy-capture"]);
    credgate_testbed::eventually(
        "the earlier captures removed",
        Duration::from_secs(20),
        || !state.join("captured.sealed").exists(),
    );
    let image = "registry.example.com/team/app:v1";
    let pulled: PullImageResponse = call(
        &proxy,
        PULL_IMAGE,
        pull_request(image, Some(("puller", SECRET)), "ns-a"),
    )
    .await
    .unwrap();
    let image_ref = fake.answers.lock().pull.clone().unwrap();
    assert_eq!(pulled.image_ref, image_ref);
    let check = |secret: &str| {
        agent.credgate(&[
            "ctl",
            "check-access",
            image,
            "--image-ref",
            &image_ref,
            "--secret",
            secret,
        ])
    };
    let other = check("ns-b/regcred/1=puller:another-password");
    assert_eq!(
        other.status.code(),
        Some(1),
        "{}{}",
        crate::support::text(&other.stdout),
        crate::support::text(&other.stderr)
    );
    let same = check(&format!("ns-b/copy/2=puller:{SECRET}"));
    assert!(
        same.status.success(),
        "{}{}",
        crate::support::text(&same.stdout),
        crate::support::text(&same.stderr)
    );
    let records = crate::support::text(
        &agent
            .credgate(&["ctl", "list-records", "-o", "json"])
            .stdout,
    );
    assert!(
        records.contains("ns-a") && records.contains("cri-pull-"),
        "{records}"
    );
    let pulls: serde_json::Value =
        serde_json::from_slice(&agent.credgate(&["ctl", "-o", "json", "pulls"]).stdout).unwrap();
    assert_eq!(pulls["pulls"][0]["code"], 0, "{pulls}");
    // Capture is off: said so, not "nothing captured".
    let captured = agent.credgate(&["ctl", "captured"]);
    assert!(!captured.status.success());
    assert!(
        crate::support::text(&captured.stderr).contains("keeps no pull credentials"),
        "{}",
        crate::support::text(&captured.stderr)
    );
    assert!(!state.join("captured.sealed").exists());
    assert!(!agent.log_text().contains(SECRET));
}

/// A registry's error body reaches the runtime's message, and a pod name is the pod author's:
/// neither can forge a line of the agent's text log (their control characters are escaped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_text_cannot_forge_log_lines() {
    use credgate_testbed::fake_runtime::Answers;
    const FORGED: &str =
        "2026-01-01T00:00:00.000000Z  INFO credgate_cri::decision: pull image=forged";
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_fake, agent, proxy) = crate::support::fake_runtime_agent(
        d,
        Answers {
            pull: Err((
                2,
                format!("failed to resolve: 401 {{\"errors\":\"x\"}}\n{FORGED}"),
            )),
            ..Default::default()
        },
        &[],
    )
    .await;
    let mut request = pull_request("registry.example.com/team/app:v1", None, "ns");
    if let Some(m) = request
        .sandbox_config
        .as_mut()
        .and_then(|s| s.metadata.as_mut())
    {
        m.name = format!("pod\r\n{FORGED}");
    }
    call::<_, PullImageResponse>(&proxy, PULL_IMAGE, request)
        .await
        .unwrap_err();
    credgate_testbed::eventually("the pull is logged", Duration::from_secs(20), || {
        agent.log_text().contains("pull image=registry.example.com")
    });
    let log = agent.log_text();
    assert!(
        !log.lines().any(|l| l.starts_with("2026-01-01T00:00:00")),
        "a forged line:\n{log}"
    );
    assert!(log.contains(&format!("\\n{FORGED}")), "{log}");
    assert!(log.contains(&format!("pod\\r\\n{FORGED}")), "{log}");
}

/// A pull without credentials refused as unauthorized is counted as missed only when a
/// matching source had a credential to give; otherwise the warning names the case (a plugin
/// that failed, one that answered nothing, a docker config the kubelet does not read). In JSON
/// logs the runtime's message has a key of its own; a reference that does not parse is logged
/// and listed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unauthorized_warning_names_the_real_cause() {
    use credgate_testbed::fake_runtime::Answers;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bin = d.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    let answer = |host: &str, auth: &str| {
        format!("cat >/dev/null\necho '{{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"1h\",\"auth\":{{{auth}}}}}'\n# {host}")
    };
    crate::support::write_script(
        &bin.join("failing"),
        "cat >/dev/null\necho broken >&2\nexit 3",
    );
    crate::support::write_script(&bin.join("empty"), &answer("empty.example.com", ""));
    crate::support::write_script(&bin.join("never"), &answer("never.example.com", ""));
    crate::support::write_script(
        &bin.join("works"),
        &answer(
            "works.example.com",
            "\"works.example.com\":{\"username\":\"u\",\"password\":\"works-secret\"}",
        ),
    );
    let config = d.join("providers.yaml");
    let entry = |name: &str| {
        format!("- name: {name}\n  matchImages: [{name}.example.com]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n")
    };
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n{}{}{}{}",
            entry("failing"),
            entry("empty"),
            entry("works"),
            entry("never")
        ),
    )
    .unwrap();
    let docker_config = crate::support::docker_config(d, "dc.example.com", "dc", "dc-secret");
    let (_fake, agent, proxy) = crate::support::fake_runtime_agent(
        d,
        Answers {
            pull: Err((2, "failed to resolve reference: 401 Unauthorized".into())),
            ..Default::default()
        },
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            bin.to_str().unwrap(),
            "--docker-config",
            docker_config.to_str().unwrap(),
            "--metrics-addr",
            "127.0.0.1:0",
            "--log-format",
            "json",
        ],
    )
    .await;
    for host in ["failing", "empty", "works", "dc", "never"] {
        let image = format!("{host}.example.com/team/app:v1");
        // Provider `never` is never asked: the kubelet did not ask the agent.
        if host != "never" {
            agent.credgate(&["get", &image]);
        }
        call::<_, PullImageResponse>(&proxy, PULL_IMAGE, pull_request(&image, None, "ns"))
            .await
            .unwrap_err();
    }
    call::<_, PullImageResponse>(&proxy, PULL_IMAGE, pull_request("BAD::ref", None, "ns"))
        .await
        .unwrap_err();
    let lines: Vec<serde_json::Value> = agent
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let warning = |host: &str| -> String {
        lines
            .iter()
            .find(|l| {
                l["level"] == "WARN"
                    && l["fields"]["image"]
                        .as_str()
                        .is_some_and(|i| i.starts_with(host))
            })
            .map(|l| l["fields"].to_string())
            .unwrap_or_else(|| panic!("no warning for {host}"))
    };
    assert!(
        warning("failing").contains("last run failed"),
        "{}",
        warning("failing")
    );
    assert!(
        warning("empty").contains("answered no credential"),
        "{}",
        warning("empty")
    );
    assert!(
        warning("dc").contains("reads its own config.json"),
        "{}",
        warning("dc")
    );
    assert!(
        warning("works").contains("the agent has a credential for the image"),
        "{}",
        warning("works")
    );
    let missed = metrics_text(&agent)
        .lines()
        .find(|l| l.starts_with("credgate_cri_pulls_missed_total "))
        .map(str::to_owned);
    assert!(
        warning("never").contains("has not run on this node"),
        "{}",
        warning("never")
    );
    // `works` (a credential the kubelet did not ask for) and `never` (a provider the kubelet
    // never asked): the kubelet did not ask the agent; the others are causes of their own.
    assert_eq!(missed.as_deref(), Some("credgate_cri_pulls_missed_total 2"));
    // The pull line: the event and the runtime's message under their own keys.
    let pull = lines
        .iter()
        .find(|l| l["fields"]["message"] == "pull")
        .expect("a pull line");
    assert!(
        pull["fields"]["runtime_message"]
            .as_str()
            .is_some_and(|m| m.contains("401 Unauthorized")),
        "{pull}"
    );
    // Every pull is logged and listed, a reference that does not parse too.
    assert!(lines
        .iter()
        .any(|l| l["fields"]["message"] == "pull" && l["fields"]["image"] == "BAD::ref"));
    let listed = crate::support::text(&agent.credgate(&["ctl", "pulls"]).stdout);
    assert!(listed.contains("BAD::ref"), "{listed}");
    assert!(!agent.log_text().contains("works-secret"));
}
