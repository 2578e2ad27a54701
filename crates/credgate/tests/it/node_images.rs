//! The pulls the CRI proxy makes on the node's own behalf (issue 41, decision 0022) and its own
//! view of the runtime's images, against containerd 2.4 (`CREDGATE_TEST_CONTAINERD2`, its CRI
//! plugin) and Debian's containerd 1.6, with Debian's docker-registry and htpasswd: the
//! sandbox image named in containerd's config and the operator's kept images are pulled through
//! the runtime with the credential a provider gives, logged, counted, recorded by the guard as
//! the node's and pulled again after a removal; an image no source has a credential for fails,
//! backs off and is reported; the image check reads a list larger than the unary cap through
//! `StreamImages`, and where the runtime has no stream it says so and drops nothing. Needs
//! root (containerd).

use std::path::Path;
use std::time::Duration;

use credgate_testbed::cri::*;
use credgate_testbed::{eventually, oci_image_saying, push, Containerd, Registry};
use prost::Message as _;

use crate::node::metric_sum as metric;
use crate::support::foreign::{build_go, go_call, Dial};
use crate::support::{needs_containerd, proxy_agent_with, text, Agent};

const USER: &str = "node-user";
const PASSWORD: &str = "node-Pa55word-not-for-logs";

/// An image of its own (its own ID) pushed to `registry` as `repo:v1`.
fn push_own(dir: &Path, registry: &Registry, repo: &str) {
    let sub = dir.join("images").join(repo);
    oci_image_saying(&sub, repo);
    push(&sub, registry, repo, USER, PASSWORD);
}

/// Whether containerd (called directly) has `image`.
fn has(go: &Path, containerd: &Containerd, image: &str) -> bool {
    let request = ImageStatusRequest {
        image: Some(ImageSpec {
            image: image.to_owned(),
        }),
    }
    .encode_to_vec();
    let answer = go_call(
        go,
        Dial::Localhost,
        &containerd.socket,
        IMAGE_STATUS,
        &request,
        0,
    );
    answer.decode::<ImageStatusResponse>().image.is_some()
}

/// `RemoveImage` of `image` on `socket` (containerd, or the proxy), which must succeed: the
/// runtime removes every name of the image's ID.
fn remove(go: &Path, socket: &Path, image: &str) {
    let request = RemoveImageRequest {
        image: Some(ImageSpec {
            image: image.to_owned(),
        }),
    }
    .encode_to_vec();
    let answer = go_call(go, Dial::Localhost, socket, REMOVE_IMAGE, &request, 0);
    assert_eq!(answer.code, 0, "{image}: {answer:?}");
}

fn ctl(agent: &Agent, args: &[&str]) -> String {
    let out = agent.credgate(args);
    assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

/// The sandbox image containerd's config names and a kept image are pulled through the runtime
/// with the provider's credential at start, recorded as the node's and pulled again after a
/// removal through the proxy and one behind its back; an image no source has a credential for
/// fails as unauthorized, is tried again with a backoff and reported. No secret in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn the_nodes_own_images_are_pulled_with_its_credentials_and_kept() {
    needs_containerd();
    let binary = Containerd::v2_binary().unwrap_or_else(|why| panic!("{why}"));
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let registry = Registry::start(d, USER, PASSWORD);
    for repo in ["team/pause", "team/app", "nosource/app"] {
        push_own(d, &registry, repo);
    }
    let host = registry.host();
    let containerd = Containerd::start_binary(&binary, d, std::slice::from_ref(&host));
    let go = build_go();
    let (sandbox, kept, unserved) = (
        format!("{host}/team/pause:v1"),
        format!("{host}/team/app:v1"),
        format!("{host}/nosource/app:v1"),
    );
    // containerd's config as an operator's names the sandbox image (version 3, containerd
    // 2.x); the agent reads it from there.
    let config = d.join("containerd-config.toml");
    std::fs::write(
        &config,
        format!("version = 3\n[plugins.\"io.containerd.cri.v1.images\".pinned_images]\n  sandbox = \"{sandbox}\"\n"),
    )
    .unwrap();
    let agent_dir = d.join("agent");
    std::fs::create_dir_all(&agent_dir).unwrap();
    let mut args = crate::policy::providers(&agent_dir, &host);
    args.extend(
        [
            "--cri-runtime-config",
            config.to_str().unwrap(),
            "--cri-proxy-keep-image",
            &kept,
            "--cri-proxy-keep-image",
            &unserved,
            "--cri-proxy-keep-interval",
            "2s",
            "--metrics-addr",
            "127.0.0.1:0",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let started = std::time::Instant::now();
    let (agent, proxy) = proxy_agent_with(&agent_dir, &containerd.socket, &args);
    eventually(
        "the node's images are pulled",
        Duration::from_secs(60),
        || has(&go, &containerd, &sandbox) && has(&go, &containerd, &kept),
    );
    assert!(!has(&go, &containerd, &unserved));

    // What the operator sees: the state of each, how it was pulled, why one failed.
    eventually(
        "the failed pull is reported",
        Duration::from_secs(30),
        || ctl(&agent, &["ctl", "status"]).contains("ABSENT"),
    );
    let status = ctl(&agent, &["ctl", "status"]);
    let row = |image: &str| {
        status
            .lines()
            .find(|l| l.starts_with(image))
            .unwrap_or_else(|| panic!("no row for {image}: {status}"))
            .to_owned()
    };
    assert!(status.contains("cri proxy:      serving"), "{status}");
    let (s, k, u) = (row(&sandbox), row(&kept), row(&unserved));
    assert!(
        s.contains("sandbox") && s.contains("PRESENT") && s.contains("filled:provider:node"),
        "{s}"
    );
    assert!(s.contains("pinned_images.sandbox in"), "{s}");
    assert!(
        k.contains("kept") && k.contains("PRESENT") && k.contains("ok at"),
        "{k}"
    );
    assert!(
        u.contains("ABSENT") && u.contains("unauthorized") && u.contains("(failure "),
        "{u}"
    );
    let pulls = ctl(&agent, &["ctl", "pulls"]);
    assert!(
        pulls.contains("filled:provider:node (node: sandbox)"),
        "{pulls}"
    );
    assert!(pulls.contains("none (node: kept)"), "{pulls}");
    let explained = ctl(&agent, &["explain", &sandbox]);
    assert!(
        explained.contains("node image:")
            && explained.contains("the runtime's sandbox image")
            && explained.contains("the agent pulled it with filled:provider:node"),
        "{explained}"
    );
    // The guard holds the pull as the node's own (node-wide credentials).
    assert!(explained.contains("node-wide yes"), "{explained}");
    let metrics = crate::cri::metrics_text(&agent);
    assert_eq!(
        metric(
            &metrics,
            "credgate_cri_node_image_pulls_total{why=\"sandbox\",result=\"ok\"}"
        ),
        1.0,
        "{metrics}"
    );
    assert!(
        metric(
            &metrics,
            "credgate_cri_node_image_pulls_total{why=\"kept\",result=\"unauthorized\"}"
        ) >= 1.0
    );
    assert_eq!(metric(&metrics, "credgate_cri_node_images_absent "), 1.0);

    // Removed through the proxy: pulled again at once (well before the check period would).
    remove(&go, &proxy, &kept);
    eventually(
        "the kept image is pulled again",
        Duration::from_secs(30),
        || has(&go, &containerd, &kept),
    );
    // Removed behind the proxy's back (crictl rmi, the runtime's GC): at the next check.
    remove(&go, &containerd.socket, &sandbox);
    eventually(
        "the sandbox image is pulled again",
        Duration::from_secs(30),
        || has(&go, &containerd, &sandbox),
    );
    // The runtime has the image a moment before the agent has counted its pull.
    let counted = |why: &str| {
        metric(
            &crate::cri::metrics_text(&agent),
            &format!("credgate_cri_node_image_pulls_total{{why=\"{why}\",result=\"ok\"}}"),
        )
    };
    eventually(
        "both pulls again are counted",
        Duration::from_secs(10),
        || counted("sandbox") == 2.0 && counted("kept") == 2.0,
    );
    let metrics = crate::cri::metrics_text(&agent);
    // The failing one is not tried at every check (2 s): its backoff doubles from 5 s, so n
    // failures take at least 5 * (2^(n-1) - 1) seconds, however slow the machine.
    let failures = metric(
        &metrics,
        "credgate_cri_node_image_pulls_total{why=\"kept\",result=\"unauthorized\"}",
    );
    let elapsed = started.elapsed().as_secs_f64();
    let most = 1.0 + (elapsed / 5.0 + 1.0).log2().floor();
    assert!(
        failures <= most,
        "{failures} failed pulls in {elapsed:.0} s: at most {most} with the backoff"
    );
    let log = agent.log_text();
    assert!(!log.contains(PASSWORD), "the password reached the log");
    assert!(
        log.contains("the node's own pull of an image it keeps failed"),
        "the failure is logged"
    );
    assert!(agent.stop().success());
}

/// `ctr images tag` of `image` as `n` more names of about 330 bytes each, in one call.
fn tag_many(containerd: &Containerd, image: &str, n: usize) {
    let (repo, _) = image.rsplit_once(':').unwrap();
    let long = "x".repeat(180);
    let names: Vec<String> = (0..n)
        .map(|i| format!("{repo}-{long}:t{i:0>120}"))
        .collect();
    let mut args = vec!["images", "tag", image];
    args.extend(names.iter().map(String::as_str));
    containerd.ctr(&args);
}

/// A node whose image list is larger than a `ListImages` answer the proxy reads (the cap is
/// lowered to 64 KiB here; 16 MiB on a node): through containerd 2.4's `StreamImages` the
/// check still reads it and drops the capture of an image removed behind the proxy's back;
/// containerd 1.6 has no stream, and there the check says so (a warning, a metric) and drops
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn the_image_check_streams_past_the_unary_cap_and_never_acts_on_half_a_list() {
    needs_containerd();
    let v2 = Containerd::v2_binary().unwrap_or_else(|why| panic!("{why}"));
    let dir = tempfile::tempdir().unwrap();
    let go = build_go();
    for (runtime, binary, streams) in [
        ("containerd-2.4", v2.as_path(), true),
        ("containerd-1.6", Path::new("containerd"), false),
    ] {
        let d = dir.path().join(runtime);
        std::fs::create_dir_all(&d).unwrap();
        let registry = Registry::start(&d, USER, PASSWORD);
        let host = registry.host();
        for repo in ["team/app", "team/gone"] {
            push_own(&d, &registry, repo);
        }
        let containerd = Containerd::start_binary(binary, &d, std::slice::from_ref(&host));
        let (agent, proxy) = proxy_agent_with(
            &d,
            &containerd.socket,
            &[
                "--cri-proxy-list-limit",
                "65536",
                "--captured-check-interval",
                "1s",
                "--metrics-addr",
                "127.0.0.1:0",
            ],
        );
        // Two pod pulls through the proxy: both credentials captured.
        for repo in ["team/app", "team/gone"] {
            let image = format!("{host}/{repo}:v1");
            let request = pull_request(&image, Some((USER, PASSWORD)), "team-a").encode_to_vec();
            let answer = go_call(&go, Dial::Localhost, &proxy, PULL_IMAGE, &request, 0);
            assert_eq!(answer.code, 0, "{runtime}: {answer:?}");
        }
        let captured = || ctl(&agent, &["ctl", "captured"]);
        eventually("both captured", Duration::from_secs(20), || {
            let c = captured();
            c.contains("team/app") && c.contains("team/gone")
        });
        // More than the cap in names, then one image removed behind the proxy's back.
        tag_many(&containerd, &format!("{host}/team/app:v1"), 250);
        // The CRI's image list follows containerd's image events: the new names arrive a
        // moment after ctr returns.
        eventually("the list is over the cap", Duration::from_secs(20), || {
            let list = go_call(
                &go,
                Dial::Localhost,
                &containerd.socket,
                LIST_IMAGES,
                &ListImagesRequest {}.encode_to_vec(),
                0,
            );
            list.code == 0 && list.responses[0].len() > 65536
        });
        // Removed behind the proxy's back, every name of it (tag and digest).
        remove(&go, &containerd.socket, &format!("{host}/team/gone:v1"));
        let incomplete = "credgate_cri_image_list_incomplete_total ";
        if streams {
            eventually(
                "the removed image's capture is dropped",
                Duration::from_secs(20),
                || !captured().contains("team/gone"),
            );
            assert!(captured().contains("team/app"), "{runtime}");
            let metrics = crate::cri::metrics_text(&agent);
            assert_eq!(metric(&metrics, incomplete), 0.0, "{runtime}");
        } else {
            eventually(
                "the check says it cannot read the list",
                Duration::from_secs(20),
                || metric(&crate::cri::metrics_text(&agent), incomplete) >= 2.0,
            );
            assert!(
                captured().contains("team/gone"),
                "{runtime}: a capture was dropped on a list not read whole"
            );
            let log = agent.log_text();
            assert!(
                log.contains("could not be read whole") && log.contains("StreamImages"),
                "{runtime}: the warning says why"
            );
        }
        assert!(agent.stop().success());
    }
}

/// Pulls of `image` the fake runtime was asked for.
fn pulls_of(fake: &credgate_testbed::fake_runtime::FakeRuntime, image: &str) -> usize {
    fake.pulled.lock().iter().filter(|i| *i == image).count()
}

/// A removal storm costs a bounded number of pulls (decision 0022): 30 `RemoveImage`s of a
/// kept image through the proxy, against a runtime that never has it, make a re-pull wait as a
/// failure does (5 s, 5 s, 10 s, ... 5 minutes), not one pull each (before: 30 pulls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_storm_of_a_kept_image_costs_a_bounded_number_of_pulls() {
    let dir = tempfile::tempdir().unwrap();
    let kept = "registry.example/team/app:v1";
    let (fake, agent, proxy) = crate::support::fake_runtime_agent(
        dir.path(),
        Default::default(),
        &[
            "--cri-proxy-keep-image",
            kept,
            "--cri-proxy-keep-interval",
            "1h",
        ],
    )
    .await;
    eventually(
        "the kept image is pulled at start",
        Duration::from_secs(20),
        || pulls_of(&fake, kept) == 1,
    );
    let started = std::time::Instant::now();
    for _ in 0..30 {
        let _: Result<Empty, _> = call(
            &proxy,
            REMOVE_IMAGE,
            RemoveImageRequest {
                image: Some(ImageSpec { image: kept.into() }),
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    let pulls = pulls_of(&fake, kept);
    // n re-pulls in a row wait at least 5 + 5 + 10 + ... seconds: however slow the machine,
    // no more fit in the time the storm took (plus one under way as it ended).
    let mut most = 1;
    let mut waited = Duration::ZERO;
    while waited <= elapsed {
        waited += credgate_cri::node_images::backoff(most as u32 - 1);
        most += 1;
    }
    assert!(
        pulls <= most,
        "{pulls} pulls for 30 removals in {elapsed:?}: at most {most} with the hold-off"
    );
    let status = text(&agent.credgate(&["ctl", "status"]).stdout);
    assert!(status.contains("re-pulls held off"), "{status}");
    assert!(agent.stop().success());
}

/// One registry's slowness delays only its own image: a kept image whose pull never ends
/// (the runtime holds it for good) does not keep the sandbox image, nor another kept
/// image, from being pulled (before: one pull at a time, the others waited behind it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_kept_image_does_not_hold_the_others() {
    use credgate_testbed::fake_runtime::Answers;
    let dir = tempfile::tempdir().unwrap();
    let (slow, other, sandbox) = (
        "slow.example/team/big:v1",
        "registry.example/team/app:v1",
        "registry.example/pause:3.10",
    );
    let (fake, agent, _proxy) = crate::support::fake_runtime_agent(
        dir.path(),
        Answers {
            // Never released: the registry never answers.
            held_image: Some((
                slow.into(),
                std::sync::Arc::new(tokio::sync::Semaphore::new(0)),
            )),
            ..Default::default()
        },
        &[
            "--cri-sandbox-image",
            sandbox,
            "--cri-proxy-keep-image",
            slow,
            "--cri-proxy-keep-image",
            other,
        ],
    )
    .await;
    // Each image's loop starts on its own: the slow pull may reach the runtime before the
    // others or after them, so wait for all three (one pull at a time never pulls `other`).
    eventually(
        "the sandbox image and the other kept image are pulled while the slow one is",
        Duration::from_secs(30),
        || {
            pulls_of(&fake, sandbox) >= 1
                && pulls_of(&fake, other) >= 1
                && pulls_of(&fake, slow) >= 1
        },
    );
    assert_eq!(pulls_of(&fake, slow), 1, "the slow pull is still under way");
    assert!(agent.stop().success());
}
