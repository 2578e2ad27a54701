//! The proxy's behaviour, run in this process against the testbed's fake runtime: no
//! `credgate` binary, no root, no containerd. What a maintainer of the proxy iterates on with
//! `cargo nextest run -p credgate-cri`; the proxy against a real kubelet and containerd is
//! the `credgate` crate's suite.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use credgate_agent::{Agent, AgentOptions};
use credgate_cri::metrics::ProxyMetrics;
use credgate_cri::outcome::{PullAuth, PullResult};
use credgate_cri::{Context, ProxyOptions};
use credgate_testbed::cri::*;
use credgate_testbed::fake_runtime::{self, Answers};
use tokio_util::sync::CancellationToken;

/// The proxy on its own thread, serving `socket`, over an agent with no sources; stopped and
/// joined when dropped.
struct Proxy {
    socket: PathBuf,
    context: Context,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl Proxy {
    async fn start(dir: &Path, runtime: &Path) -> Proxy {
        Self::start_with(dir, runtime, credgate_cri::default_limits()).await
    }

    async fn start_with(
        dir: &Path,
        runtime: &Path,
        limits: credgate_listener::ListenerLimits,
    ) -> Proxy {
        Self::launch(dir, runtime, limits, None, credgate_cri::CAPTURE_WAIT).await
    }

    /// The proxy capturing pull credentials into a store in `dir/state`, a pull's answer
    /// waiting at most `wait` for its capture; a stop does not wait for captures in flight.
    async fn start_capturing(
        dir: &Path,
        runtime: &Path,
        wait: Duration,
    ) -> (Proxy, Arc<credgate_agent::captured::Captured>) {
        let state = dir.join("state");
        std::fs::create_dir(&state).unwrap();
        std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .unwrap();
        let captured = Arc::new(credgate_agent::captured::Captured::open(&state, None).unwrap());
        let limits = credgate_listener::ListenerLimits {
            shutdown_timeout: Duration::from_millis(100),
            ..credgate_cri::default_limits()
        };
        let proxy = Self::launch(dir, runtime, limits, Some(captured.clone()), wait).await;
        (proxy, captured)
    }

    async fn launch(
        dir: &Path,
        runtime: &Path,
        limits: credgate_listener::ListenerLimits,
        captured: Option<Arc<credgate_agent::captured::Captured>>,
        capture_wait: Duration,
    ) -> Proxy {
        let agent = Agent::new(AgentOptions::default()).unwrap();
        let context = Context {
            clock: agent.clock().clone(),
            metrics: ProxyMetrics::default(),
            connections: Default::default(),
            engine: agent.engine_handle(),
            refusal: agent.refusal().clone(),
            pulls: Arc::default(),
            node_images: Arc::default(),
            policy: Default::default(),
        };
        let socket = dir.join("proxy.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        listener.set_nonblocking(true).unwrap();
        let options = ProxyOptions {
            runtime: runtime.to_owned(),
            captured,
            guard: None,
            limits,
            check_every: Duration::from_secs(3600),
            registry: Default::default(),
            context: context.clone(),
            node_images: Vec::new(),
            keep_every: Duration::from_secs(3600),
            list_limit: credgate_cri::MAX_LIST_MESSAGE,
            capture_wait,
        };
        let stop = CancellationToken::new();
        let thread = credgate_cri::start(listener, options, stop.clone())
            .await
            .unwrap();
        Proxy {
            socket,
            context,
            stop,
            thread: Some(thread),
        }
    }

    /// The proxy's families as `/metrics` shows them.
    fn metrics(&self) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        self.context.metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_that_cannot_be_reached_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(dir.path(), &dir.path().join("no-runtime.sock")).await;
    let e = call::<_, ListImagesResponse>(&proxy.socket, LIST_IMAGES, ListImagesRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(
        e.message().contains("cannot reach the container runtime"),
        "{}",
        e.message()
    );
    assert!(
        proxy
            .metrics()
            .contains("credgate_cri_runtime_unreachable_total 1"),
        "{}",
        proxy.metrics()
    );
}

/// A failed pull's answer reaches the caller as the runtime sent it; each pull is recorded
/// with the credential it went with and the runtime's answer, and counted in the proxy's own
/// families.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_is_answered_as_the_runtime_answered_recorded_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("fake-runtime.sock");
    let fake = fake_runtime::start(
        &runtime,
        Answers {
            pull: Err((2, "failed to resolve reference: 401 Unauthorized".into())),
            ..Default::default()
        },
    )
    .await;
    let proxy = Proxy::start(dir.path(), &runtime).await;
    let image = "registry.example.com/team/app:v1";
    let e =
        call::<_, PullImageResponse>(&proxy.socket, PULL_IMAGE, pull_request(image, None, "ns-a"))
            .await
            .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            tonic::Code::Unknown,
            "failed to resolve reference: 401 Unauthorized"
        )
    );
    fake.answers.lock().pull = Ok("sha256:feed".into());
    let pulled: PullImageResponse = call(
        &proxy.socket,
        PULL_IMAGE,
        pull_request(image, Some(("someone", "a-pods-Pa55word")), "ns-b"),
    )
    .await
    .unwrap();
    assert_eq!(pulled.image_ref, "sha256:feed");

    let pulls = proxy.context.pulls.list(None);
    assert_eq!(pulls.len(), 2);
    // Newest first: the pod's own secret, which no source of the agent gave.
    assert_eq!(
        (&pulls[0].image, &pulls[0].pod_namespace, &pulls[0].auth),
        (&image.to_owned(), &"ns-b".to_owned(), &PullAuth::Unknown)
    );
    assert_eq!(pulls[0].code, 0);
    assert_eq!(
        (
            &pulls[1].auth,
            PullResult::of(pulls[1].code, &pulls[1].message)
        ),
        (&PullAuth::None, PullResult::Unauthorized)
    );
    let listed = proxy
        .context
        .list_pulls(Some("registry.example.com/team/app"));
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().all(|p| !p.message.contains("Pa55word")));
    let text = proxy.metrics();
    for line in [
        r#"credgate_cri_pulls_total{auth="none",result="unauthorized"} 1"#,
        r#"credgate_cri_pulls_total{auth="unknown",result="ok"} 1"#,
        r#"credgate_cri_calls_total{method="PullImage"} 2"#,
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    assert!(!text.contains("Pa55word"));
}

/// v1alpha2's pulls are seen as v1's are (its messages have v1's fields).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1alpha2_pulls_are_seen_as_v1_pulls_are() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("fake-runtime.sock");
    let _fake = fake_runtime::start(&runtime, Answers::default()).await;
    let proxy = Proxy::start(dir.path(), &runtime).await;
    let pulled: PullImageResponse = call(
        &proxy.socket,
        PULL_IMAGE_V1ALPHA2,
        pull_request("registry.example.com/team/old-api:v1", None, "ns-a"),
    )
    .await
    .unwrap();
    assert!(pulled.image_ref.starts_with("sha256:"));
    let pulls = proxy.context.pulls.list(None);
    assert_eq!(pulls[0].image, "registry.example.com/team/old-api:v1");
    assert!(proxy
        .metrics()
        .contains(r#"credgate_cri_calls_total{method="PullImage"} 1"#));
}

/// The proxy's listener bounds its connections: those beyond its budget (128 in all) are
/// closed as they arrive while the others stay; silent ones are closed at its handshake
/// deadline (5 s as shipped; 300 ms on a second proxy here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_bounds_connections_and_closes_silent_ones() {
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(dir.path(), &dir.path().join("no-runtime.sock")).await;
    let socket = proxy.socket.clone();
    let (closed, open) = tokio::task::spawn_blocking(move || {
        let held: Vec<_> = (0..160)
            .map(|_| {
                let c = std::os::unix::net::UnixStream::connect(&socket).unwrap();
                c.set_nonblocking(true).unwrap();
                c
            })
            .collect();
        // Until the 32 beyond the budget are closed (long before the handshake deadline).
        let deadline = std::time::Instant::now() + Duration::from_secs(4);
        loop {
            let states: Vec<_> = held.iter().map(state).collect();
            let closed = states.iter().filter(|s| **s == Conn::Closed).count();
            if closed >= 32 || std::time::Instant::now() > deadline {
                let open = states.iter().filter(|s| **s == Conn::Open).count();
                return (closed, open);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    })
    .await
    .unwrap();
    assert_eq!((closed, open), (32, 128), "(closed at once, kept)");
    drop(proxy);

    let quick = tempfile::tempdir().unwrap();
    let limits = credgate_listener::ListenerLimits {
        handshake_timeout: Duration::from_millis(300),
        ..credgate_cri::default_limits()
    };
    let proxy =
        Proxy::start_with(quick.path(), &quick.path().join("no-runtime.sock"), limits).await;
    let socket = proxy.socket.clone();
    let silent_closed = tokio::task::spawn_blocking(move || {
        let c = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        use std::io::Read as _;
        // Its SETTINGS, then the end.
        let mut seen = Vec::new();
        (&c).read_to_end(&mut seen).is_ok()
    })
    .await
    .unwrap();
    assert!(
        silent_closed,
        "a silent connection is closed at the handshake deadline"
    );
}

#[derive(Debug, PartialEq)]
enum Conn {
    Open,
    Closed,
}

/// Whether the other end closed a non-blocking connection that was sent nothing (what the
/// server sent, its SETTINGS, is read and dropped).
fn state(c: &std::os::unix::net::UnixStream) -> Conn {
    use std::io::Read as _;
    loop {
        match (&*c).read(&mut [0u8; 256]) {
            Ok(0) => return Conn::Closed,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Conn::Open,
            Err(_) => return Conn::Closed,
        }
    }
}

/// A caller that leaves large answers unread holds back only its own calls: each caller has
/// its own connection to the runtime, so another caller's calls go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_does_not_read_holds_back_only_its_own_calls() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("fake-runtime.sock");
    let _fake = fake_runtime::start(
        &runtime,
        Answers {
            list_bytes: 2_700_000,
            ..Default::default()
        },
    )
    .await;
    let proxy = Proxy::start(dir.path(), &runtime).await;
    // The greedy caller: three ListImages of 2.7 MB each, never read.
    let mut greedy = credgate_testbed::h2::connect(&proxy.socket, 65_535).await;
    let mut unread = Vec::new();
    for _ in 0..3 {
        greedy.ready().await.unwrap();
        let answer = greedy
            .send_request(credgate_testbed::h2::request(
                LIST_IMAGES,
                credgate_testbed::h2::message(vec![0, 0, 0, 0, 0]),
            ))
            .await
            .unwrap();
        unread.push(answer);
    }
    // Another caller: its calls are answered as usual.
    let mut other = credgate_testbed::h2::connect(&proxy.socket, 1 << 20).await;
    for _ in 0..20 {
        other.ready().await.unwrap();
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            other.send_request(credgate_testbed::h2::request(
                IMAGE_STATUS,
                credgate_testbed::h2::message(vec![0, 0, 0, 0, 0]),
            )),
        )
        .await
        .expect("another caller's call is not held back")
        .unwrap();
        let status = tokio::time::timeout(
            Duration::from_secs(10),
            credgate_testbed::h2::status(answer),
        )
        .await
        .expect("its answer arrives");
        assert_eq!(status.map(|s| s.0), Some(0));
    }
    drop(unread);
}

/// A `PullImage` with padding in a field credgate has no code for (the pod's annotations are
/// such: large by nature, up to 256 KiB in Kubernetes).
#[derive(Clone, PartialEq, prost::Message)]
struct PaddedPull {
    #[prost(message, optional, tag = "1")]
    image: Option<ImageSpec>,
    #[prost(bytes = "vec", tag = "15")]
    pad: Vec<u8>,
}

/// One tenant's slow pulls cannot block the next pull on the kubelet's connection: twelve
/// pulls of 400 KiB each (4.8 MB, more than the connection's 4 MiB budget), started one after
/// the other and held by a registry that stalls, and the next pull (another tenant's) is
/// still forwarded; a pull request above 512 KiB is refused at once, as no real one is that
/// large.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_large_pulls_leave_room_for_the_next_pull() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("fake-runtime.sock");
    let stalled = "registry.example.com/tenant-a/app:v1";
    let registry = Arc::new(tokio::sync::Semaphore::new(0));
    let fake = fake_runtime::start(
        &runtime,
        Answers {
            held_image: Some((stalled.into(), registry.clone())),
            ..Default::default()
        },
    )
    .await;
    let proxy = Proxy::start(dir.path(), &runtime).await;
    let kubelet = credgate_api::connect(&proxy.socket).await.unwrap();
    let padded = |n: usize| PaddedPull {
        image: Some(ImageSpec {
            image: stalled.into(),
        }),
        pad: vec![b'a'; n],
    };
    // One after the other, as a kubelet starts pulls: each is read whole and forwarded
    // before the next is sent (read at once, they would share the budget while read).
    let mut slow = Vec::new();
    for i in 0..12 {
        let channel = kubelet.clone();
        let req = padded(400 << 10);
        slow.push(tokio::spawn(async move {
            call_on::<_, PullImageResponse>(channel, PULL_IMAGE, req).await
        }));
        credgate_testbed::eventually_async(
            "the pull reaches the runtime",
            Duration::from_secs(20),
            || std::future::ready(fake.pulled.lock().len() == i + 1),
        )
        .await;
    }
    let next = call_on::<_, PullImageResponse>(
        kubelet.clone(),
        PULL_IMAGE,
        pull_request(
            "registry.example.com/tenant-b/app:v1",
            Some(("b", "b-secret")),
            "tenant-b",
        ),
    )
    .await;
    assert!(next.is_ok(), "the next tenant's pull: {next:?}");
    assert!(
        slow.iter().all(|p| !p.is_finished()),
        "the registry still holds them"
    );
    registry.add_permits(12);
    for pull in slow {
        let answer = pull.await.unwrap();
        assert!(answer.is_ok(), "a slow pull: {answer:?}");
    }
    let too_large = call_on::<_, PullImageResponse>(kubelet, PULL_IMAGE, padded(600 << 10))
        .await
        .unwrap_err();
    assert_eq!(too_large.code(), tonic::Code::ResourceExhausted);
    assert!(
        too_large.message().contains("larger than 512 KiB"),
        "{}",
        too_large.message()
    );
}

/// A tenant whose pulls' registries never answer the capture's confirmation (12 pulls with new
/// secrets, from four namespaces, against eight such registries) holds back its own captures
/// only: another tenant's pull with a new secret, for a registry that answers, is captured and
/// on disk when its pull is answered (at the proxy's own capture wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalling_registry_holds_back_only_its_own_tenants_captures() {
    use credgate_testbed::stub_registry::StubRegistry;
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("fake-runtime.sock");
    let _fake = fake_runtime::start(&runtime, Answers::default()).await;
    let (proxy, captured) =
        Proxy::start_capturing(dir.path(), &runtime, credgate_cri::CAPTURE_WAIT).await;
    let stalling: Vec<StubRegistry> = (0..8).map(|_| StubRegistry::silent()).collect();
    let mut held = Vec::new();
    for i in 0..12 {
        let image = format!("{}/evil/app:v1", stalling[i % stalling.len()].host());
        let request = pull_request(
            &image,
            Some(("evil", &format!("secret-{i}"))),
            &format!("evil-{}", i % 4),
        );
        let socket = proxy.socket.clone();
        held.push(tokio::spawn(async move {
            call::<_, PullImageResponse>(&socket, PULL_IMAGE, request).await
        }));
    }
    // Their confirmations are under way (the pulls are answered after the capture wait).
    credgate_testbed::eventually_async(
        "the stalling registries are asked to confirm",
        Duration::from_secs(20),
        || std::future::ready(stalling.iter().map(StubRegistry::held).sum::<usize>() > 0),
    )
    .await;
    let good = StubRegistry::serving("bob", "bob-Pa55word");
    let image = format!("{}/team-b/app:v1", good.host());
    call::<_, PullImageResponse>(
        &proxy.socket,
        PULL_IMAGE,
        pull_request(&image, Some(("bob", "bob-Pa55word")), "team-b"),
    )
    .await
    .expect("the fake runtime pulls");
    let listed = captured.list();
    assert!(
        listed
            .iter()
            .any(|(repository, c)| repository.ends_with("team-b/app") && c.namespace == "team-b"),
        "the other tenant's capture was on disk when its pull was answered: {:?}",
        listed.iter().map(|(r, _)| r).collect::<Vec<_>>()
    );
    // The held pulls are answered at the wait; what that shows is the next test.
    for h in held {
        h.abort();
    }
}

/// A pull whose registry never confirms its credential is answered at the capture wait (here
/// 50 ms), counted late, and nothing is captured; without the wait it would be answered only
/// when the confirmation gives up (10 s), and not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_is_answered_at_the_capture_wait_when_its_registry_never_confirms() {
    use credgate_testbed::stub_registry::StubRegistry;
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("fake-runtime.sock");
    let _fake = fake_runtime::start(&runtime, Answers::default()).await;
    let (proxy, captured) =
        Proxy::start_capturing(dir.path(), &runtime, Duration::from_millis(50)).await;
    let silent = StubRegistry::silent();
    let image = format!("{}/team/app:v1", silent.host());
    call::<_, PullImageResponse>(
        &proxy.socket,
        PULL_IMAGE,
        pull_request(&image, Some(("alice", "alice-Pa55word")), "team"),
    )
    .await
    .expect("the fake runtime pulls");
    credgate_testbed::eventually_async(
        "the registry is asked to confirm",
        Duration::from_secs(20),
        || std::future::ready(silent.held() > 0),
    )
    .await;
    let metrics = proxy.metrics();
    assert!(
        metrics.contains("credgate_cri_captures_late_total 1"),
        "{metrics}"
    );
    assert!(captured.list().is_empty());
}
