//! What a hostile local client can hold of the API server: connections in all and per uid,
//! silent and idle connections, slow calls, oversized messages, and a stop that does not wait
//! for ever. Against the real server on a temporary unix socket.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream as StdStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use credgate_agent::server::Limits;
use credgate_agent::socket::{self, SocketAccess};
use credgate_agent::{server, Agent, AgentOptions, CallerAllowlist, Service, Sources};
use credgate_api::v1::admin_client::AdminClient;
use credgate_api::v1::credentials_client::CredentialsClient;
use credgate_api::v1::{self as pb};
use tokio::task::JoinHandle;

/// The HTTP/2 client preface and an empty SETTINGS frame.
fn preface() -> Vec<u8> {
    use credgate_api::frame;
    let mut out = frame::PREFACE.to_vec();
    frame::put(&mut out, frame::SETTINGS, 0, 0, &[]);
    out
}

struct Server {
    dir: tempfile::TempDir,
    socket: PathBuf,
    stop: tokio_util::sync::CancellationToken,
    task: JoinHandle<()>,
}

/// A plugin that answers once `release` exists in its directory.
fn gated_plugin(dir: &Path) -> PathBuf {
    let plugin = dir.join("gated");
    std::fs::write(
        &plugin,
        r#"#!/bin/sh
cat >/dev/null
touch "$(dirname "$0")/started"
while [ ! -e "$(dirname "$0")/release" ]; do sleep 0.02; done
echo '{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Registry","cacheDuration":"10m","auth":{"reg.example.com":{"username":"u","password":"p"}}}'
"#,
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: gated\n  matchImages: [reg.example.com]\n  defaultCacheDuration: 10m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
    )
    .unwrap();
    config
}

impl Server {
    async fn start(limits: Limits, callers: CallerAllowlist) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let config = gated_plugin(dir.path());
        let agent = Agent::new(AgentOptions {
            sources: Sources {
                provider_config: Some(config),
                bin_dir: Some(dir.path().to_owned()),
                ..Default::default()
            },
            callers,
            ..Default::default()
        })
        .unwrap();
        let socket = dir.path().join("credgate.sock");
        let listener = socket::bind(&socket, &SocketAccess::default())
            .await
            .unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(server::serve_with(agent, listener, limits, stop.clone()));
        Server {
            dir,
            socket,
            stop,
            task,
        }
    }

    /// Waits until the gated plugin runs (a call is in flight inside it).
    async fn until_started(&self) {
        let started = self.dir.path().join("started");
        credgate_testbed::eventually_async(
            "the gated plugin starts",
            Duration::from_secs(20),
            || std::future::ready(started.exists()),
        )
        .await;
    }

    fn release(&self) {
        std::fs::write(self.dir.path().join("release"), "").unwrap();
    }

    fn raw(&self) -> StdStream {
        let s = StdStream::connect(&self.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s
    }

    async fn ping(&self) -> Result<(), tonic::Status> {
        let channel = credgate_api::connect(&self.socket)
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        AdminClient::new(channel)
            .ping(pb::PingRequest {})
            .await
            .map(drop)
    }
}

/// Whether the agent has closed `s` (reads reach end of file, or a reset), reading whatever
/// it sent first (a GOAWAY).
fn closed_by_agent(s: &mut StdStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// Whether the agent still holds `s` open: nothing to read within `wait`.
fn still_open(s: &mut StdStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 4096];
    let open = loop {
        match s.read(&mut buf) {
            Ok(0) => break false,
            Ok(_) => continue, // SETTINGS and their ack
            Err(e) => {
                break matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                )
            }
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    open
}

/// A lookup on `channel` that waits for the gated plugin, as a task.
fn gated_lookup(
    channel: &tonic::transport::Channel,
) -> JoinHandle<Result<tonic::Response<pb::LookupResponse>, tonic::Status>> {
    let mut client = CredentialsClient::new(channel.clone());
    tokio::spawn(async move {
        client
            .lookup(pb::LookupRequest {
                image: "reg.example.com/app:v1".into(),
                ..Default::default()
            })
            .await
    })
}

fn limits() -> Limits {
    Limits {
        handshake_timeout: Duration::from_secs(60),
        idle_timeout: Duration::from_secs(60),
        ..Limits::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_are_closed_at_once_and_slots_come_back() {
    let s = Server::start(
        Limits {
            max_connections: 4,
            ..limits()
        },
        CallerAllowlist::default(),
    )
    .await;
    let mut held: Vec<StdStream> = (0..4).map(|_| s.raw()).collect();
    for c in &mut held {
        c.write_all(&preface()).unwrap();
    }
    // The agent answers each with its SETTINGS: all four are accepted and counted.
    for c in &mut held {
        let mut head = [0u8; 9];
        c.read_exact(&mut head).unwrap();
    }
    let mut fifth = s.raw();
    let closed = tokio::task::spawn_blocking(move || closed_by_agent(&mut fifth))
        .await
        .unwrap();
    assert!(closed, "a connection over the limit is closed");
    assert!(
        s.ping().await.is_err(),
        "no slot while four are held (the budget counts every uid)"
    );
    drop(held.pop());
    // The freed slot is taken back once the agent sees the close.
    credgate_testbed::eventually_async("the slot comes back", Duration::from_secs(10), || async {
        s.ping().await.is_ok()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_sends_no_preface_is_closed_at_the_handshake_deadline() {
    let s = Server::start(
        Limits {
            handshake_timeout: Duration::from_millis(200),
            ..limits()
        },
        CallerAllowlist::default(),
    )
    .await;
    let mut silent = s.raw();
    let mut talking = s.raw();
    talking.write_all(&preface()).unwrap();
    let closed = tokio::task::spawn_blocking(move || {
        let closed = closed_by_agent(&mut silent);
        let open = still_open(&mut talking, Duration::from_millis(600));
        (closed, open)
    })
    .await
    .unwrap();
    assert_eq!(
        closed,
        (true, true),
        "(silent closed, one that sent its preface kept)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_with_no_stream_that_stays_quiet_is_closed_at_the_idle_deadline() {
    let s = Server::start(
        Limits {
            idle_timeout: Duration::from_millis(300),
            ..limits()
        },
        CallerAllowlist::default(),
    )
    .await;
    let mut idle = s.raw();
    idle.write_all(&preface()).unwrap();
    let closed = tokio::task::spawn_blocking(move || closed_by_agent(&mut idle))
        .await
        .unwrap();
    // That a call in flight keeps its connection however long it takes is the listener's
    // (`cargo nextest run -p credgate-listener --test idle`, on a paused clock).
    assert!(closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_miss_does_not_stall_a_ping_on_the_same_connection() {
    let s = Server::start(limits(), CallerAllowlist::default()).await;
    let channel = credgate_api::connect(&s.socket).await.unwrap();
    let lookup = gated_lookup(&channel);
    // The plugin waits for `release`; the Ping on the same connection must not.
    s.until_started().await;
    AdminClient::new(channel)
        .ping(pb::PingRequest {})
        .await
        .expect("ping answered");
    assert!(
        !lookup.is_finished(),
        "the lookup was still waiting on its plugin when the ping was answered"
    );
    s.release();
    lookup.await.unwrap().expect("lookup answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_the_request_timeout_ends_with_deadline_exceeded() {
    let s = Server::start(
        Limits {
            request_timeout: Duration::from_millis(300),
            ..limits()
        },
        CallerAllowlist::default(),
    )
    .await;
    let channel = credgate_api::connect(&s.socket).await.unwrap();
    let e = CredentialsClient::new(channel)
        .lookup(pb::LookupRequest {
            image: "reg.example.com/app:v1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e}");
    assert!(e.message().contains("300ms"), "{}", e.message());
    s.release();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_request_is_refused_without_being_echoed() {
    let s = Server::start(limits(), CallerAllowlist::default()).await;
    let channel = credgate_api::connect(&s.socket).await.unwrap();
    let huge = format!(
        "reg.example.com/{}",
        "a".repeat(server::MAX_CREDENTIALS_MESSAGE)
    );
    let e = CredentialsClient::new(channel.clone())
        .lookup(pb::LookupRequest {
            image: huge,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_ne!(e.code(), tonic::Code::Ok);
    assert!(e.message().len() < 300, "{} bytes", e.message().len());
    // The connection still serves.
    AdminClient::new(channel)
        .ping(pb::PingRequest {})
        .await
        .expect("ping after the refusal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_closes_calls_still_running_at_the_shutdown_deadline() {
    let s = Server::start(
        Limits {
            shutdown_timeout: Duration::from_millis(300),
            ..limits()
        },
        CallerAllowlist::default(),
    )
    .await;
    let channel = credgate_api::connect(&s.socket).await.unwrap();
    let call = gated_lookup(&channel);
    s.until_started().await;
    s.stop.cancel();
    // The plugin never answers; the server returns anyway.
    let Server { dir, task, .. } = s;
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the server stopped at its deadline")
        .unwrap();
    assert!(call.await.unwrap().is_err());
    std::fs::write(dir.path().join("release"), "").unwrap();
}

/// Runs `f` on a thread whose uids are `uid` (the process stays root), so that connections it
/// opens carry `uid` in their peer credentials.
fn as_uid<T: Send + 'static>(uid: u32, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        let id = rustix::process::Uid::from_raw(uid);
        rustix::thread::set_thread_res_uid(id, id, id).expect("setresuid on this thread");
        f()
    })
    .join()
    .unwrap()
}

/// Another local user holding silent connections cannot starve root: the user gets its share,
/// root still gets in. Needs root to connect as another uid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn another_users_silent_connections_do_not_starve_root() {
    credgate_testbed::require_root("connecting as another uid");
    let s = Server::start(
        Limits {
            max_connections: 16,
            max_connections_per_uid: 4,
            ..limits()
        },
        CallerAllowlist::default(),
    )
    .await;
    std::fs::set_permissions(&s.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let socket = s.socket.clone();
    let (kept, closed) = tokio::task::spawn_blocking(move || {
        as_uid(65534, move || {
            let mut conns: Vec<StdStream> = (0..12)
                .map(|_| StdStream::connect(&socket).unwrap())
                .collect();
            let mut closed = 0;
            let mut kept = Vec::new();
            for mut c in conns.drain(..) {
                if still_open(&mut c, Duration::from_millis(150)) {
                    kept.push(c);
                } else {
                    closed += 1;
                }
            }
            (kept, closed)
        })
    })
    .await
    .unwrap();
    assert_eq!((kept.len(), closed), (4, 8), "(kept, closed)");
    s.ping().await.expect("root is served beside them");
}

/// A uid that no service admits is closed as soon as it connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_uid_no_service_admits_is_closed_at_once() {
    credgate_testbed::require_root("connecting as another uid");
    let mut callers = CallerAllowlist::default();
    for service in Service::ALL {
        callers.allow(service, [4321]);
    }
    let s = Server::start(limits(), callers).await;
    std::fs::set_permissions(&s.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let socket = s.socket.clone();
    let closed = tokio::task::spawn_blocking(move || {
        as_uid(65534, move || {
            let mut c = StdStream::connect(&socket).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            closed_by_agent(&mut c)
        })
    })
    .await
    .unwrap();
    assert!(closed);
    s.ping().await.expect("the agent's own uid is served");
}

/// The metrics listener: connections beyond its limit are closed at once, connections that
/// send no request head are closed at the header deadline, and a scrape still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_listener_bounds_idle_connections() {
    use credgate_agent::scrape::{self, MetricsLimits};
    use std::net::TcpStream;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let counters = credgate_agent::metrics::AgentMetrics::default();
    let served = tokio::spawn(scrape::serve(
        listener,
        std::sync::Arc::new(|| "# EOF\n".to_owned()),
        MetricsLimits {
            max_connections: 3,
            header_timeout: Duration::from_millis(300),
            max_age: Duration::from_secs(60),
        },
        counters.clone(),
        stop.clone(),
    ));
    let held = counters.connections.open("metrics");
    let outcome = tokio::task::spawn_blocking(move || {
        let read_to_end = |s: &mut TcpStream| -> (bool, Vec<u8>) {
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut got = Vec::new();
            let closed = s.read_to_end(&mut got).is_ok();
            (closed, got)
        };
        let mut idle: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        credgate_testbed::eventually(
            "the three idle connections held",
            Duration::from_secs(10),
            || held.get() == 3,
        );
        let mut fourth = TcpStream::connect(addr).unwrap();
        let (fourth_closed, fourth_got) = read_to_end(&mut fourth);
        // The idle ones are closed at the header deadline (hyper may answer 408 first).
        let idle_closed = idle.iter_mut().all(|s| read_to_end(s).0);
        let mut scrape = TcpStream::connect(addr).unwrap();
        scrape
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let (_, body) = read_to_end(&mut scrape);
        (
            fourth_closed && fourth_got.is_empty(),
            idle_closed,
            String::from_utf8_lossy(&body).into_owned(),
        )
    })
    .await
    .unwrap();
    assert!(
        outcome.0,
        "the connection over the limit was closed at once"
    );
    assert!(outcome.1, "idle connections closed at the header deadline");
    assert!(outcome.2.starts_with("HTTP/1.1 200"), "{}", outcome.2);
    let text = credgate_agent::metrics::render(&{
        let mut r = prometheus_client::registry::Registry::default();
        counters.register(&mut r);
        r
    });
    assert!(
        text.contains(r#"credgate_connections_closed_total{listener="metrics",reason="limit"} 1"#),
        "{text}"
    );
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), served)
        .await
        .expect("stopped")
        .unwrap();
}

/// A message that does not decode (a string field that is not UTF-8) is INVALID_ARGUMENT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_does_not_decode_is_invalid_argument() {
    #[derive(Clone, PartialEq, prost::Message)]
    struct NotUtf8 {
        #[prost(bytes = "vec", tag = "1")]
        image: Vec<u8>,
    }
    let s = Server::start(limits(), CallerAllowlist::default()).await;
    let socket = s.socket.clone();
    let r = tokio::task::spawn_blocking(move || {
        credgate_api::unary::call::<_, pb::LookupResponse>(
            &socket,
            credgate_api::methods::LOOKUP,
            &NotUtf8 {
                image: vec![0xff, 0xfe, 0xfd],
            },
            Duration::from_secs(10),
        )
    })
    .await
    .unwrap();
    match r {
        Err(credgate_api::unary::CallError::Status { code, message }) => {
            assert_eq!(code, tonic::Code::InvalidArgument as i32, "{message}");
        }
        other => panic!("{other:?}"),
    }
}

/// A bad reference just under the message limit is INVALID_ARGUMENT with a short message, on
/// every RPC that takes one, never an echo of the input.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_quoted_short_on_every_rpc_that_takes_a_reference() {
    let s = Server::start(limits(), CallerAllowlist::default()).await;
    let channel = credgate_api::connect(&s.socket).await.unwrap();
    let mut creds = CredentialsClient::new(channel);
    let bad = format!("Reg.Example.com/{}", "A".repeat(60_000));
    let check = |r: Result<(), tonic::Status>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{what}: {e}");
        assert!(
            e.message().len() < 300,
            "{what}: {} bytes",
            e.message().len()
        );
    };
    let lookup = pb::LookupRequest {
        image: bad.clone(),
        ..Default::default()
    };
    check(creds.lookup(lookup).await.map(drop), "Lookup");
    let host = pb::LookupRequest {
        image: format!("{}:99", "h".repeat(60_000)),
        registry_host: true,
        ..Default::default()
    };
    check(creds.lookup(host).await.map(drop), "Lookup of a host");
    let refs = vec![bad.clone()];
    check(
        creds
            .track(pb::TrackRequest {
                consumer: "c".into(),
                refs: refs.clone(),
            })
            .await
            .map(drop),
        "Track",
    );
    check(
        creds
            .set_tracked(pb::SetTrackedRequest {
                consumer: "c".into(),
                refs: refs.clone(),
            })
            .await
            .map(drop),
        "SetTracked",
    );
    check(
        creds.watch(pb::WatchRequest { refs }).await.map(drop),
        "Watch",
    );
}
