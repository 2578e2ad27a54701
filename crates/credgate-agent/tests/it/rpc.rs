//! The API against the real server on a temporary unix socket, with real plugin executables.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use credgate_agent::socket::{self, SocketAccess, SocketError};
use credgate_agent::{server, Agent, AgentOptions, Sources};
use credgate_api::v1::admin_client::AdminClient;
use credgate_api::v1::credentials_client::CredentialsClient;
use credgate_api::v1::{self as pb};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

const SECRET: &str = "s3cr3t-pa55word";

fn script(dir: &Path, name: &str, body: &str) {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn answer(user: &str, password: &str, key: &str) -> String {
    format!(
        r#"cat >/dev/null
echo run >> "$0.runs"
cat <<'EOF'
{{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"{key}","cacheDuration":"10m","auth":{{"reg.example.com":{{"username":"{user}","password":"{password}"}}}}}}
EOF"#
    )
}

fn config(dir: &Path, providers: &[&str]) -> PathBuf {
    let mut yaml = String::from(
        "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n",
    );
    for p in providers {
        yaml.push_str(&format!("- name: {p}\n  matchImages: [reg.example.com]\n  defaultCacheDuration: 10m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n"));
    }
    let path = dir.join("config.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

struct Server {
    dir: tempfile::TempDir,
    socket: PathBuf,
    stop: tokio_util::sync::CancellationToken,
    task: JoinHandle<()>,
    agent: Agent,
}

impl Server {
    async fn start(setup: impl FnOnce(&Path) -> PathBuf) -> Server {
        Server::start_with(setup, |_| {}).await
    }

    async fn start_with(
        setup: impl FnOnce(&Path) -> PathBuf,
        tune: impl FnOnce(&mut AgentOptions),
    ) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let config = setup(dir.path());
        let mut options = AgentOptions {
            sources: Sources {
                provider_config: Some(config),
                bin_dir: Some(dir.path().to_owned()),
                ..Default::default()
            },
            ..Default::default()
        };
        tune(&mut options);
        let agent = Agent::new(options).unwrap();
        let socket = dir.path().join("run/credgate.sock");
        let listener = socket::bind(&socket, &SocketAccess::default())
            .await
            .unwrap();
        let stop = agent.tasks().token().clone();
        agent.spawn_renewal();
        let task = tokio::spawn(server::serve(agent.clone(), listener, stop.clone()));
        Server {
            dir,
            socket,
            stop,
            task,
            agent,
        }
    }

    async fn channel(&self) -> Channel {
        credgate_api::connect(&self.socket).await.unwrap()
    }

    fn runs(&self, plugin: &str) -> usize {
        std::fs::read_to_string(self.dir.path().join(format!("{plugin}.runs")))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }
}

fn lookup(image: &str) -> pb::LookupRequest {
    pb::LookupRequest {
        image: image.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn lookup_serves_credentials_and_reports_failures_without_secrets() {
    let s = Server::start(|d| {
        script(d, "good", &answer("alice", SECRET, "Registry"));
        script(
            d,
            "bad",
            &format!(
                "cat >/dev/null\necho '{{\"password\":\"{SECRET}\"}}'\necho '{SECRET}' >&2\nexit 3"
            ),
        );
        config(d, &["bad", "good"])
    })
    .await;
    let mut client = CredentialsClient::new(s.channel().await);
    let r = client
        .lookup(lookup("reg.example.com/team/app:v1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.image, "reg.example.com/team/app");
    assert_eq!(r.credentials.len(), 1);
    let c = &r.credentials[0];
    assert_eq!(
        (
            c.source.as_str(),
            c.source_kind().word(),
            c.username.as_str(),
            c.password.as_str()
        ),
        ("good", "provider", "alice", SECRET)
    );
    assert!(c.expires_at_unix_ms > 0);
    assert_eq!(r.failures.len(), 1);
    assert_eq!(r.failures[0].provider, "bad");
    assert_eq!(r.failures[0].reason().word(), "nonzero_exit");
    assert!(!format!("{:?}", r.failures).contains(SECRET));

    // Served from cache: no second run.
    client
        .lookup(lookup("reg.example.com/team/other:v2"))
        .await
        .unwrap();
    assert_eq!(s.runs("good"), 1);

    // A registry host, as the docker credential helper asks.
    let r = client
        .lookup(pb::LookupRequest {
            image: "reg.example.com".into(),
            registry_host: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.credentials[0].username, "alice");

    // Malformed input: INVALID_ARGUMENT, nothing secret in the status.
    let e = client.lookup(lookup("Not A/Ref")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let e = client
        .lookup(pb::LookupRequest {
            image: "reg.example.com/app".into(),
            service_account: Some(pb::ServiceAccount {
                token: SECRET.into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(!e.message().contains(SECRET), "{}", e.message());
    let e = client
        .track(pb::TrackRequest {
            consumer: String::new(),
            refs: vec!["reg.example.com/app".into()],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);

    // Nothing secret in the metrics either.
    let text = credgate_agent::metrics::render(s.agent.registry());
    assert!(
        text.contains("credgate_rpc_requests_total{method=\"Lookup\",code=\"OK\"} 3"),
        "{text}"
    );
    assert!(text.contains("code=\"INVALID_ARGUMENT\""));
    assert!(!text.contains(SECRET));

    // captured_only (the bridge's credgate-captured entry): the captured credential alone,
    // nothing captured here, so nothing, and no plugin run; never with a provider.
    let r = client
        .lookup(pb::LookupRequest {
            image: "reg.example.com/team/app:v1".into(),
            captured_only: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.credentials.is_empty(), "{r:?}");
    assert_eq!((r.cache_key_type().word(), r.cache_for_ms), ("Image", 0));
    assert_eq!(r.image, "reg.example.com/team/app");
    assert_eq!(s.runs("good"), 1);
    let e = client
        .lookup(pb::LookupRequest {
            image: "reg.example.com/team/app:v1".into(),
            captured_only: true,
            provider: "good".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn socket_is_owner_only_unless_a_group_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.sock");
    let _l = socket::bind(&path, &SocketAccess::default()).await.unwrap();
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o600);

    let gid = std::fs::metadata(dir.path()).unwrap().gid();
    let path = dir.path().join("b.sock");
    let _l = socket::bind(
        &path,
        &SocketAccess {
            group: Some(gid.to_string()),
        },
    )
    .await
    .unwrap();
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, gid));

    let err = socket::bind(
        &dir.path().join("c.sock"),
        &SocketAccess {
            group: Some("no-such-group-credgate".into()),
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, SocketError::UnknownGroup(_)), "{err}");
}

#[tokio::test]
async fn stale_socket_is_replaced_but_a_live_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("credgate.sock");
    // A crashed run leaves its socket file behind.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let live = socket::bind(&path, &SocketAccess::default()).await.unwrap();

    let err = socket::bind(&path, &SocketAccess::default())
        .await
        .unwrap_err();
    assert!(matches!(err, SocketError::InUse(_)), "{err}");
    assert_eq!(
        err.to_string(),
        format!("another agent is serving on {}", path.display())
    );
    // The live agent still has its socket: a client reaches it.
    let _client = tokio::net::UnixStream::connect(&path).await.unwrap();
    let (_server_side, _) = live.accept().await.unwrap(); // the refused bind's probe

    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, "data").unwrap();
    let err = socket::bind(&file, &SocketAccess::default())
        .await
        .unwrap_err();
    assert!(matches!(err, SocketError::NotASocket(_)));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "data");
}

#[tokio::test]
async fn shutdown_finishes_the_call_in_flight_and_ends_watch_streams() {
    let s = Server::start(|d| {
        script(
            d,
            "slow",
            &format!(
                "req=$(cat)\ncase \"$req\" in *team/app*) touch \"$0.started\";; esac\nsleep 1\n{}",
                answer("alice", SECRET, "Image")
            ),
        );
        config(d, &["slow"])
    })
    .await;
    let channel = s.channel().await;
    let mut watcher = CredentialsClient::new(channel.clone())
        .watch(pb::WatchRequest {
            refs: vec!["reg.example.com/team/watched:v1".into()],
        })
        .await
        .unwrap()
        .into_inner();
    let mut client = CredentialsClient::new(channel);
    let in_flight =
        tokio::spawn(async move { client.lookup(lookup("reg.example.com/team/app:v1")).await });
    let started = s.dir.path().join("slow.started");
    credgate_testbed::eventually_async("the lookup's plugin runs", Duration::from_secs(20), || {
        std::future::ready(started.exists())
    })
    .await;
    s.stop.cancel();
    let answer = in_flight
        .await
        .unwrap()
        .expect("the call in flight completes");
    assert_eq!(answer.into_inner().credentials[0].username, "alice");
    // The watch stream ends instead of holding the shutdown forever.
    let drained = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(_event) = watcher.next().await {}
    })
    .await;
    assert!(drained.is_ok(), "watch stream ended");
    tokio::time::timeout(Duration::from_secs(5), s.task)
        .await
        .expect("server stopped")
        .unwrap();
}

#[tokio::test]
async fn track_watch_and_status_over_the_socket() {
    let s = Server::start(|d| {
        script(d, "tokens", &answer("alice", SECRET, "Registry"));
        config(d, &["tokens"])
    })
    .await;
    let channel = s.channel().await;
    let mut creds = CredentialsClient::new(channel.clone());
    let refs: Vec<String> = vec![
        "reg.example.com/team/a:v1".into(),
        "reg.example.com/team/b:v1".into(),
    ];
    let r = creds
        .set_tracked(pb::SetTrackedRequest {
            consumer: "nydus".into(),
            refs: refs.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((r.added, r.removed), (2, 0));
    let mut stream = creds
        .watch(pb::WatchRequest { refs: refs.clone() })
        .await
        .unwrap()
        .into_inner();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let e = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("current values arrive")
            .unwrap()
            .unwrap();
        assert_eq!(e.credentials[0].password, SECRET);
        seen.push(e.r#ref);
    }
    seen.sort();
    assert_eq!(seen, refs);
    assert_eq!(s.runs("tokens"), 1, "one run for two refs of one registry");

    let listed = creds
        .list_tracked(pb::ListTrackedRequest {
            consumer: "nydus".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.refs.len(), 2);
    assert!(listed
        .refs
        .iter()
        .all(|t| t.consumers.contains(&"nydus".to_owned())
            && t.next_attempt_unix_ms > 0
            && t.credentials == 1));

    let mut admin = AdminClient::new(channel);
    let status = admin
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(status.config_identity.starts_with("sha256:"));
    assert_eq!(status.providers[0].name, "tokens");
    assert_eq!(status.providers[0].runs, 1);
    assert!(status.providers[0].next_renewal_unix_ms > 0);
    assert_eq!(status.tracked_refs, 2);
    let health = admin
        .health(pb::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(health.status, "SERVING");
    assert_eq!(
        admin
            .version(pb::VersionRequest {})
            .await
            .unwrap()
            .into_inner()
            .api,
        "credgate.v1"
    );
}

#[tokio::test]
async fn reload_refuses_a_bad_config_and_keeps_serving_the_old_one() {
    let s = Server::start(|d| {
        script(d, "one", &answer("alice", SECRET, "Registry"));
        script(d, "two", &answer("bob", SECRET, "Registry"));
        config(d, &["one"])
    })
    .await;
    let channel = s.channel().await;
    let mut admin = AdminClient::new(channel.clone());
    let mut creds = CredentialsClient::new(channel);
    let before = admin
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();

    std::fs::write(s.dir.path().join("config.yaml"), "providers: [ {name: ").unwrap();
    let e = admin.reload(pb::ReloadRequest {}).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        e.message().contains("invalid provider config"),
        "{}",
        e.message()
    );
    let r = creds
        .lookup(lookup("reg.example.com/app"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.credentials[0].username, "alice",
        "old config still serves"
    );

    config(s.dir.path(), &["two"]);
    let r = admin
        .reload(pb::ReloadRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(r.changed);
    assert_ne!(r.config_identity, before.config_identity);
    let r = creds
        .lookup(lookup("reg.example.com/app"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.credentials[0].username, "bob");
}

#[tokio::test]
async fn a_tracked_ref_is_served_its_last_good_credential_when_the_plugin_fails() {
    let s = Server::start(|d| {
        let body = answer("alice", SECRET, "Image");
        script(
            d,
            "flaky",
            &format!("if [ -e \"$0.broken\" ]; then cat >/dev/null; exit 1; fi\n{body}"),
        );
        config(d, &["flaky"])
    })
    .await;
    let image = "reg.example.com/team/app:v1";
    let mut creds = CredentialsClient::new(s.channel().await);
    creds
        .track(pb::TrackRequest {
            consumer: "mirror".into(),
            refs: vec![image.into()],
        })
        .await
        .unwrap();
    let mut watch = creds
        .watch(pb::WatchRequest {
            refs: vec![image.into()],
        })
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.credentials[0].password, SECRET);

    std::fs::write(s.dir.path().join("flaky.broken"), "").unwrap();
    // Asked for longer than the cached answer's 10 minutes: the plugin runs again, and fails.
    let r = creds
        .lookup(pb::LookupRequest {
            min_valid_for_ms: 3_600_000,
            ..lookup(image)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.failures.len(), 1, "the plugin failed just now");
    assert!(r.last_known_good);
    assert_eq!(r.credentials[0].password, SECRET);

    // An untracked image gets no such fallback.
    let r = creds
        .lookup(lookup("reg.example.com/team/untracked:v1"))
        .await
        .unwrap()
        .into_inner();
    assert!(r.credentials.is_empty() && !r.last_known_good);
}

/// A flushed answer's expiry is not shown for a tracked ref that still holds it: until its
/// renewal succeeds, ListTracked says it was flushed (and `ctl list-tracked` prints so).
#[tokio::test]
async fn a_tracked_ref_whose_answer_was_flushed_says_so_until_it_is_renewed() {
    let s = Server::start(|d| {
        script(
            d,
            "flaky",
            &format!(
                "if [ -e \"$0.broken\" ]; then cat >/dev/null; exit 1; fi\n{}",
                answer("alice", SECRET, "Image")
            ),
        );
        config(d, &["flaky"])
    })
    .await;
    let image = "reg.example.com/team/app:v1";
    let channel = s.channel().await;
    let mut creds = CredentialsClient::new(channel.clone());
    let mut admin = AdminClient::new(channel);
    creds
        .track(pb::TrackRequest {
            consumer: "mirror".into(),
            refs: vec![image.into()],
        })
        .await
        .unwrap();
    let tracked = |mut creds: CredentialsClient<tonic::transport::Channel>| async move {
        creds
            .list_tracked(pb::ListTrackedRequest::default())
            .await
            .unwrap()
            .into_inner()
            .refs
            .remove(0)
    };
    credgate_testbed::eventually_async("the ref is resolved", Duration::from_secs(10), || {
        let creds = creds.clone();
        async move { tracked(creds).await.credentials == 1 }
    })
    .await;
    let before = tracked(creds.clone()).await;
    assert!(
        before.expires_at_unix_ms > 0 && !before.flushed,
        "{before:?}"
    );

    // The plugin fails from now on: the renewal the flush starts cannot replace the answer.
    std::fs::write(s.dir.path().join("flaky.broken"), "").unwrap();
    let dropped = admin
        .flush(pb::FlushRequest {
            provider: "flaky".into(),
            images: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .dropped;
    assert_eq!(dropped.len(), 1);
    let after = tracked(creds.clone()).await;
    assert!(after.flushed, "{after:?}");
    assert_eq!(after.expires_at_unix_ms, 0, "{after:?}");
    assert_eq!(after.credentials, 1, "last-known-good is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_client_that_never_reads_is_dropped_and_others_carry_on() {
    // Every run answers a new 3 KB password valid for 2 s: renewal changes each of the 20
    // refs about once a second, so a client that does not read falls behind fast.
    let s = Server::start_with(
        |d| {
            script(
                d,
                "big",
                r#"cat >/dev/null
n=$(date +%s%N)
pw=$(head -c 3000 /dev/zero | tr '\0' x)$n
printf '{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Image","cacheDuration":"2s","auth":{"reg.example.com":{"username":"u","password":"%s"}}}' "$pw""#,
            );
            config(d, &["big"])
        },
        |o| o.watch_send_timeout = Some(Duration::from_secs(1)),
    )
    .await;
    let refs: Vec<String> = (0..20)
        .map(|i| format!("reg.example.com/team/app{i}:v1"))
        .collect();
    // The stuck client: a 1 KiB stream window, and it never reads.
    let stuck_channel = credgate_api::connect_with(
        &s.socket,
        tonic::transport::Endpoint::from_static("http://credgate.sock")
            .initial_stream_window_size(Some(1024)),
    )
    .await
    .unwrap();
    let _stuck = CredentialsClient::new(stuck_channel)
        .watch(pb::WatchRequest { refs: refs.clone() })
        .await
        .unwrap()
        .into_inner();
    let mut good = CredentialsClient::new(s.channel().await)
        .watch(pb::WatchRequest { refs: refs.clone() })
        .await
        .unwrap()
        .into_inner();
    let metrics = s.agent.metrics().clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut events = 0;
    while metrics.watchers_dropped.get() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stuck client was never dropped"
        );
        let e = tokio::time::timeout(Duration::from_secs(5), good.next())
            .await
            .expect("the reading client keeps getting events")
            .unwrap()
            .unwrap();
        assert_eq!(e.credentials.len(), 1);
        events += 1;
    }
    // The drop is counted just before the stuck stream's subscription is released.
    credgate_testbed::eventually_async(
        "only the reading client is left",
        Duration::from_secs(10),
        || std::future::ready(metrics.watchers.get() == 1),
    )
    .await;
    // The reading client is unaffected: changes keep coming.
    let mut after = 0;
    while after < 20 {
        let e = tokio::time::timeout(Duration::from_secs(5), good.next())
            .await
            .expect("events after the drop")
            .unwrap()
            .unwrap();
        assert!(e.credentials[0].password.len() > 3000);
        after += 1;
    }
    assert_eq!(metrics.watchers_dropped.get(), 1);
    assert!(events >= 20, "{events}");
}

/// A socket directory another user made first (`/tmp/credgate-$UID` without
/// `XDG_RUNTIME_DIR`) is refused by the agent, and a socket there by clients. Needs root to
/// give the directory to another user.
#[tokio::test]
#[ignore = "needs root"]
async fn a_socket_directory_another_user_owns_is_refused_by_agent_and_clients() {
    credgate_testbed::require_root("giving a directory to another user");
    let dir = tempfile::tempdir().unwrap();
    let theirs = dir.path().join("credgate-0");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = theirs.join("credgate.sock");
    // Their socket, planted before ours.
    let _planted = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
    let err = socket::bind(&path, &SocketAccess::default())
        .await
        .unwrap_err();
    assert!(matches!(err, SocketError::Untrusted(_)), "{err}");
    assert!(err.to_string().contains("owned by uid 65534"), "{err}");
    let err = credgate_api::connect(&path).await.unwrap_err();
    let chain = format!("{:?}", err);
    assert!(chain.contains("owner: 65534"), "{chain}");
    let unary: Result<pb::PingResponse, _> = credgate_api::unary::call(
        &path,
        credgate_api::methods::PING,
        &pb::PingRequest {},
        Duration::from_secs(5),
    );
    assert!(
        matches!(unary, Err(credgate_api::unary::CallError::Untrusted(_))),
        "{unary:?}"
    );
}

/// An agent that stops after a newer one has replaced its (stale) socket leaves the newer
/// socket in place.
#[tokio::test]
async fn a_stopping_agent_removes_only_its_own_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("credgate.sock");
    let old = socket::bind(&path, &SocketAccess::default()).await.unwrap();
    let old_id = socket::identity(&path);
    // The old agent stops accepting; a new one starts meanwhile and replaces the socket.
    drop(old);
    let new = socket::bind(&path, &SocketAccess::default()).await.unwrap();
    let new_id = socket::identity(&path);
    assert_ne!(old_id, new_id);
    socket::remove_if_ours(&path, old_id);
    assert!(path.exists(), "the new agent's socket stays");
    let _client = tokio::net::UnixStream::connect(&path).await.unwrap();
    let _ = new.accept().await.unwrap();
    socket::remove_if_ours(&path, new_id);
    assert!(!path.exists());
}

/// A reload of unchanged files keeps the running engine and its caches: a hundred SIGHUPs
/// cost no plugin run; a real change still takes effect.
#[tokio::test]
async fn reloading_identical_files_keeps_the_caches() {
    let s = Server::start(|d| {
        script(d, "one", &answer("alice", SECRET, "Registry"));
        config(d, &["one"])
    })
    .await;
    let channel = s.channel().await;
    let mut admin = AdminClient::new(channel.clone());
    let mut creds = CredentialsClient::new(channel);
    creds.lookup(lookup("reg.example.com/app")).await.unwrap();
    assert_eq!(s.runs("one"), 1);
    for _ in 0..100 {
        let r = admin
            .reload(pb::ReloadRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(!r.changed);
    }
    creds.lookup(lookup("reg.example.com/app")).await.unwrap();
    assert_eq!(s.runs("one"), 1, "the cache survived the reloads");
    // The same provider with another cache duration is a change: rebuilt, cache gone.
    let path = s.dir.path().join("config.yaml");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("defaultCacheDuration: 10m", "defaultCacheDuration: 11m");
    std::fs::write(&path, text).unwrap();
    let r = admin
        .reload(pb::ReloadRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(r.changed);
    creds.lookup(lookup("reg.example.com/app")).await.unwrap();
    assert_eq!(s.runs("one"), 2);
}

/// Lookups are counted by who asks: the kubelet bridge, the docker helper, other API clients.
#[tokio::test]
async fn lookups_are_counted_by_caller_kind() {
    let s = Server::start(|d| {
        script(d, "one", &answer("alice", SECRET, "Registry"));
        config(d, &["one"])
    })
    .await;
    let mut creds = CredentialsClient::new(s.channel().await);
    for (caller, n) in [
        ("kubelet", 3),
        ("docker-helper", 2),
        ("", 1),
        ("something-else", 1),
    ] {
        for _ in 0..n {
            creds
                .lookup(pb::LookupRequest {
                    image: "reg.example.com/app".into(),
                    caller: caller.into(),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
    }
    let text = credgate_agent::metrics::render(s.agent.registry());
    for (caller, n) in [("kubelet", 3), ("docker-helper", 2), ("api", 2)] {
        let line = format!("credgate_lookups_total{{caller=\"{caller}\"}} {n}");
        assert!(text.contains(&line), "{line} in\n{text}");
    }
    assert!(!text.contains(SECRET));
}
