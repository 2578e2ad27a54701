//! `credgate serve` as a process: start-up on the README's example, `get` and `ctl` through the
//! socket, SIGHUP reload (a bad config refused), SIGTERM exit 0, bad config at start exit 1.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::{text, Agent};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn example_args(config: &Path) -> Vec<String> {
    vec![
        "--image-credential-provider-config".into(),
        config.display().to_string(),
        "--image-credential-provider-bin-dir".into(),
        repo().join("examples/plugins").display().to_string(),
    ]
}

#[test]
fn serves_the_example_and_reloads_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("providers.yaml");
    std::fs::copy(repo().join("examples/provider-config.yaml"), &config).unwrap();
    let args = example_args(&config);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = Agent::start(dir.path(), &args);

    let out = agent.credgate(&["get", "-o", "json", "registry.example.com/team/app:v1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[0]["provider"], "credgate-example-plugin");

    let out = agent.credgate(&["ctl", "-o", "json", "status"]);
    assert!(out.status.success());
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let identity = status["config_identity"].as_str().unwrap().to_owned();
    assert!(identity.starts_with("sha256:"));
    // Every call is logged with the caller's credentials from the socket (SO_PEERCRED).
    let (uid, gid) = (
        rustix::process::getuid().as_raw(),
        rustix::process::getgid().as_raw(),
    );
    let log = agent.log_text();
    assert!(
        log.lines().any(|l| l.contains("api call")
            && l.contains("method=\"Status\"")
            && l.contains(&format!("uid={uid} gid={gid} pid="))),
        "{log}"
    );

    // A broken config on SIGHUP is refused; the old one keeps serving.
    std::fs::write(
        &config,
        "apiVersion: kubelet.config.k8s.io/v1\nkind: Nope\n",
    )
    .unwrap();
    agent.signal(libc::SIGHUP);
    credgate_testbed::eventually(
        "the broken config's reload is refused",
        std::time::Duration::from_secs(20),
        || agent.log_text().contains("reload refused"),
    );
    let out = agent.credgate(&["get", "registry.example.com/team/app:v1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    // A valid new config is taken.
    std::fs::write(
        &config,
        std::fs::read_to_string(repo().join("examples/provider-config.yaml"))
            .unwrap()
            .replace("registry.example.com", "other.example.com"),
    )
    .unwrap();
    agent.signal(libc::SIGHUP);
    credgate_testbed::eventually(
        "the new config is loaded",
        std::time::Duration::from_secs(20),
        || {
            let out = agent.credgate(&["ctl", "-o", "json", "status"]);
            let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            status["config_identity"]
                .as_str()
                .is_some_and(|now| now != identity)
        },
    );
    let out = agent.credgate(&["get", "registry.example.com/team/app:v1"]);
    assert_eq!(out.status.code(), Some(1), "no provider matches any more");

    let socket = agent.socket.clone();
    let status = agent.stop();
    assert_eq!(status.code(), Some(0));
    assert!(!socket.exists(), "socket removed on exit");
}

#[test]
fn bad_config_at_start_exits_1_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bad.yaml");
    std::fs::write(&config, "providers: [ {name: ").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(["serve", "--no-docker-config", "--socket"])
        .arg(dir.path().join("s.sock"))
        .arg("--image-credential-provider-config")
        .arg(&config)
        .arg("--image-credential-provider-bin-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.starts_with("error: invalid provider config"), "{err}");
    assert!(!dir.path().join("s.sock").exists());
}

#[test]
fn a_second_agent_on_the_same_socket_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(["serve", "--no-docker-config", "--socket"])
        .arg(&agent.socket)
        .arg("--state-dir")
        .arg(dir.path().join("state-of-its-own"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("another agent is serving on"),
        "{}",
        text(&out.stderr)
    );
    // The first agent still serves.
    let out = agent.credgate(&["ctl", "health"]);
    assert_eq!(text(&out.stdout).trim(), "SERVING");
}

/// Every file of `dir`, with its size and modification time.
fn listing(dir: &std::path::Path) -> Vec<(String, u64, std::time::SystemTime)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                m.len(),
                m.modified().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// One agent per state directory: a second `credgate serve` on the state directory of a
/// running agent (another socket: a forgotten unit beside a DaemonSet) exits at once with an
/// error naming the directory and the holder's PID, and writes nothing there; once the holder
/// is SIGKILLed, the kernel has released the lock and the next agent starts at once.
#[test]
fn a_second_agent_on_the_same_state_directory_exits_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let provider = dir.path().join("providers.yaml");
    let bin = dir.path().join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    crate::support::write_script(
        &bin.join("p"),
        r#"cat >/dev/null; printf '{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Registry","cacheDuration":"1h","auth":{"r.example":{"username":"u","password":"p-Pa55word"}}}'"#,
    );
    std::fs::write(
        &provider,
        "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: p\n  matchImages: [\"r.example\"]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
    )
    .unwrap();
    let args = [
        "--image-credential-provider-config",
        provider.to_str().unwrap(),
        "--image-credential-provider-bin-dir",
        bin.to_str().unwrap(),
    ];
    let mut agent = Agent::start(dir.path(), &args);
    let out = agent.credgate(&["get", "r.example/app:v1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let state = dir.path().join("state");
    // The saver writes the answer within a second or two.
    credgate_testbed::eventually("the answer is saved", Duration::from_secs(20), || {
        state.join("cache.sealed").exists()
    });
    let held = std::fs::read_to_string(state.join("agent.lock")).unwrap();
    assert_eq!(held.trim(), agent.child.id().to_string());
    let before = listing(&state);
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(["serve", "--no-docker-config", "--socket"])
        .arg(dir.path().join("second.sock"))
        .arg("--state-dir")
        .arg(&state)
        .args(args)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!(
            "another credgate agent (PID {})",
            agent.child.id()
        )) && err.contains(state.to_str().unwrap()),
        "{err}"
    );
    // At once: not after the 5 s its socket's or its store's waits would take.
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert!(!dir.path().join("second.sock").exists());
    assert_eq!(listing(&state), before, "the second agent wrote nothing");
    let out = agent.credgate(&["ctl", "health"]);
    assert_eq!(text(&out.stdout).trim(), "SERVING");

    // SIGKILLed: its successor takes the directory at once, and serves the saved answer.
    agent.signal(libc::SIGKILL);
    let _ = agent.child.wait();
    drop(agent);
    let agent = Agent::start(dir.path(), &args);
    let out = agent.credgate(&["ctl", "status"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        !agent.log_text().contains("provider_gone"),
        "{}",
        agent.log_text()
    );
}

/// Every flag the deployment files pass to `credgate serve` exists.
#[test]
fn deployment_files_use_real_flags() {
    let help = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = text(&help.stdout);
    let ctl_help = text(
        &Command::new(env!("CARGO_BIN_EXE_credgate"))
            .args(["ctl", "--help"])
            .output()
            .unwrap()
            .stdout,
    );
    for file in [
        "deploy/systemd/credgate.service",
        "deploy/systemd/credgate.default",
        "deploy/daemonset.yaml",
    ] {
        let body = std::fs::read_to_string(repo().join(file)).unwrap();
        let serve_args = if file.ends_with(".default") {
            body.as_str()
        } else {
            let marker = if file.ends_with(".yaml") {
                "- serve"
            } else {
                "credgate serve"
            };
            body.split(marker)
                .nth(1)
                .unwrap_or_else(|| panic!("{file} runs credgate serve"))
        };
        let flags: Vec<&str> = serve_args
            .split(|c: char| c.is_whitespace() || c == '=' || c == '"')
            .filter(|w| w.starts_with("--") && w.len() > 2)
            .collect();
        assert!(flags.len() >= 2, "{file}: {flags:?}");
        for flag in flags {
            assert!(
                help.contains(flag) || ctl_help.contains(flag),
                "{file} uses {flag}, which credgate does not have"
            );
        }
    }
}

/// `program` run by setpriv as `uid` (group `uid`, no supplementary groups).
/// An agent in `dir` (opened to other users) with `args`, whose socket every uid may open, so
/// that the agent's own rules (allowlists, budgets) are what decides: for calls as other uids.
pub(crate) fn agent_for_every_uid(dir: &Path, args: &[&str]) -> Agent {
    use std::os::unix::fs::PermissionsExt;
    credgate_testbed::require_root("calling as other uids");
    crate::support::require("setpriv");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let agent = Agent::start(dir, args);
    std::fs::set_permissions(&agent.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    agent
}

/// `credgate ARGS` as `uid` against `agent`.
pub(crate) fn credgate_as(uid: u32, agent: &Agent, args: &[&str]) -> std::process::Output {
    as_user(uid, env!("CARGO_BIN_EXE_credgate"))
        .args(args)
        .env("CREDGATE_SOCKET", &agent.socket)
        .env_remove("CREDGATE_LOG")
        .output()
        .unwrap()
}

pub(crate) fn as_user(uid: u32, program: &str) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid", &uid.to_string(), "--regid", &uid.to_string()])
        .args(["--clear-groups", "--"])
        .arg(program);
    cmd
}

/// `--allow-uids`: callers are told apart by the socket's peer credentials. Needs root to call
/// as other uids (CI runs as root); elsewhere it says so and returns.
#[test]
#[ignore = "needs root"]
fn per_service_uid_allowlists_refuse_other_callers() {
    let dir = tempfile::tempdir().unwrap();
    // Every uid may open the socket, so that the allowlist is what decides.
    let agent = agent_for_every_uid(
        dir.path(),
        &[
            "--allow-uids",
            "admin=4243",
            "--allow-uids",
            "image-access=4243,4244",
        ],
    );
    let as_uid = |uid: u32, args: &[&str]| credgate_as(uid, &agent, args);
    let out = as_uid(4242, &["ctl", "health"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("uid 4242 may not call the admin service"),
        "{err}"
    );
    let out = as_uid(4242, &["ctl", "list-records"]);
    assert!(
        text(&out.stderr).contains("uid 4242 may not call the image-access service"),
        "{}",
        text(&out.stderr)
    );
    // Credentials has no entry: open to whoever can open the socket.
    let out = as_uid(4242, &["ctl", "list-tracked"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Listed uids, and the agent's own, get through.
    let out = as_uid(4243, &["ctl", "health"]);
    assert_eq!(text(&out.stdout).trim(), "SERVING", "{}", text(&out.stderr));
    let out = as_uid(4244, &["ctl", "list-records"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = agent.credgate(&["ctl", "health"]);
    assert_eq!(text(&out.stdout).trim(), "SERVING");
    let log = agent.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("call refused") && l.contains("uid=4242")),
        "{log}"
    );

    // The docker credential helper meets the refusal as a gRPC status and says so.
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for_every_uid(dir.path(), &["--allow-uids", "credentials=4243"]);
    let helper_as = |uid: u32| {
        crate::support::output_with_stdin(
            as_user(uid, env!("CARGO_BIN_EXE_docker-credential-credgate"))
                .arg("get")
                .env("CREDGATE_SOCKET", &agent.socket),
            b"registry.example.com",
        )
    };
    let out = helper_as(4242);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stdout).trim(),
        "credgate: lookup failed: uid 4242 may not call the credentials service"
    );
    let out = helper_as(4243);
    assert_eq!(
        text(&out.stdout).trim(),
        "credentials not found in native keychain"
    );
    // Captured pull credentials are credentials: listing or forgetting them through Admin
    // (open here) is refused to a uid the credentials allowlist refuses.
    for args in [
        &["ctl", "captured"][..],
        &["ctl", "captured", "forget", "registry.example.com/team/app"][..],
    ] {
        let out = credgate_as(4242, &agent, args);
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("uid 4242 may not call the credentials service"),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// Processes whose environment carries a plugin-run marker of the engine with pid `agent`.
fn marked_by(agent: u32) -> Vec<i32> {
    let want = format!("{}={agent}-", credgate_engine::sweep::MARKER_ENV);
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if environ
            .split(|b| *b == 0)
            .any(|var| var.starts_with(want.as_bytes()))
        {
            found.push(pid);
        }
    }
    found
}

/// Kills what a failed run of the test below would otherwise leave sleeping for ten minutes.
struct KillMarked(u32);

impl Drop for KillMarked {
    fn drop(&mut self) {
        for pid in marked_by(self.0) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
}

/// Fault injection: the agent is SIGKILLed while a renewal's plugin runs (a slow plugin that has
/// also left a daemon outside its process group). Both outlive the agent, and the consumer's
/// Watch stream ends instead of hanging; the next agent kills them at start-up, comes up without
/// waiting on any plugin, and serves the consumer again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_during_renewal_leaves_no_plugin_behind() {
    use credgate_api::v1::credentials_client::CredentialsClient;
    use credgate_api::v1::{TrackRequest, WatchRequest};
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bin = d.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    crate::support::write_script(
        &bin.join("slow-token"),
        r#"cat >/dev/null
if [ -e "$0.slow" ]; then
  setsid sleep 600 </dev/null >/dev/null 2>&1 &
  sleep 600
fi
printf '{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Image","cacheDuration":"3s","auth":{"reg.example.com":{"username":"u","password":"pw-%s"}}}' "$(date +%s%N)""#,
    );
    let config = d.join("providers.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: slow-token\n  matchImages: [\"reg.example.com\"]\n  defaultCacheDuration: 1m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
    )
    .unwrap();
    let args = [
        "--image-credential-provider-config",
        config.to_str().unwrap(),
        "--image-credential-provider-bin-dir",
        bin.to_str().unwrap(),
        "--renew-before",
        "2s",
    ];
    let image = "reg.example.com/team/app:v1";
    let consume = |socket: std::path::PathBuf| async move {
        let channel = credgate_api::connect(&socket).await.unwrap();
        let mut creds = CredentialsClient::new(channel);
        creds
            .track(TrackRequest {
                consumer: "mirror".into(),
                refs: vec![image.into()],
            })
            .await
            .unwrap();
        let mut stream = creds
            .watch(WatchRequest {
                refs: vec![image.into()],
            })
            .await
            .unwrap()
            .into_inner();
        let first = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("the current credential arrives")
            .unwrap()
            .expect("an event");
        assert!(first.credentials[0].password.starts_with("pw-"));
        stream
    };

    let mut first = Agent::start(d, &args);
    let first_pid = first.child.id();
    let _cleanup = KillMarked(first_pid);
    let mut stream = consume(first.socket.clone()).await;

    // The next renewal hangs in the plugin: the plugin, its sleep and the setsid daemon.
    std::fs::write(bin.join("slow-token.slow"), "").unwrap();
    credgate_testbed::eventually_async(
        "renewal starts the slow plugin",
        Duration::from_secs(20),
        || std::future::ready(marked_by(first_pid).len() >= 3),
    )
    .await;
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("the Watch stream of a dead agent ends");
    assert!(!matches!(ended, Ok(Some(_))), "{ended:?}");
    let left = marked_by(first_pid);
    assert!(left.len() >= 3, "plugins outlive a killed agent: {left:?}");

    // A bystander marked by an engine that is alive (this test process) must be left alone.
    let _cleanup_bystander = KillMarked(std::process::id());
    let mut bystander = std::process::Command::new("sleep")
        .arg("600")
        .env(
            credgate_engine::sweep::MARKER_ENV,
            credgate_engine::sweep::marker(),
        )
        .spawn()
        .unwrap();

    // The next agent kills the orphans; it does not wait for any plugin to come up.
    std::fs::remove_file(bin.join("slow-token.slow")).unwrap();
    let second = Agent::start(d, &args);
    let up = Instant::now();
    credgate_testbed::eventually_async("the orphans killed", Duration::from_secs(10), || {
        std::future::ready(marked_by(first_pid).is_empty())
    })
    .await;
    eprintln!(
        "orphans gone {:?} after the agent accepted calls",
        up.elapsed()
    );
    assert!(
        second
            .log_text()
            .contains("killed plugin processes left running by an agent that is gone"),
        "{}",
        second.log_text()
    );
    assert!(
        bystander.try_wait().unwrap().is_none(),
        "a live engine's run"
    );
    bystander.kill().unwrap();
    bystander.wait().unwrap();
    // The consumer registers again (its tracked set lives in memory) and is served.
    drop(consume(second.socket.clone()).await);
    assert!(second.stop().success());
}

/// The agent is not dumpable: its /proc files (environ, mem) belong to root even when it runs
/// as another user, so other processes of that user cannot read its memory. Needs root to run
/// the agent as another user.
#[test]
#[ignore = "needs root"]
fn the_agent_is_not_dumpable() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::time::Duration;
    credgate_testbed::require_root("running the agent as another user");
    crate::support::require("setpriv");
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let home = dir.path().join("nobody");
    std::fs::create_dir(&home).unwrap();
    std::os::unix::fs::chown(&home, Some(65534), Some(65534)).unwrap();
    let socket = home.join("credgate.sock");
    let mut child = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_credgate"))
        .args(["serve", "--no-docker-config", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(home.join("state"))
        .stderr(std::fs::File::create(dir.path().join("agent.log")).unwrap())
        .spawn()
        .unwrap();
    credgate_testbed::eventually("the agent comes up", Duration::from_secs(20), || {
        assert!(child.try_wait().unwrap().is_none(), "the agent exited");
        socket.exists()
    });
    let environ = std::fs::metadata(format!("/proc/{}/environ", child.id())).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(dir.path().join("agent.log")).unwrap();
    crate::support::secrets::check("the agent's log", &log);
    assert_eq!(
        environ.uid(),
        0,
        "a non-dumpable process's /proc files are root's"
    );
}

/// A plugin that counts its runs and answers a 12 h credential for registry.example.com, and
/// a config naming it with `args`.
fn counting_provider(dir: &Path, args: &str) -> PathBuf {
    let bin = dir.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    crate::support::write_script(
        &bin.join("counted"),
        &format!(
            "cat >/dev/null\necho run >> '{}'\necho '{{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"12h\",\"auth\":{{\"registry.example.com\":{{\"username\":\"kept\",\"password\":\"kept-password-sealed\"}}}}}}'",
            dir.join("runs").display()
        ),
    );
    let config = dir.join("providers.yaml");
    std::fs::write(
        &config,
        format!("apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: counted\n  matchImages: [registry.example.com]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n  args: [{args}]\n"),
    )
    .unwrap();
    config
}

fn runs(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn saved_status(agent: &Agent) -> serde_json::Value {
    let out = agent.credgate(&["ctl", "-o", "json", "status"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["saved_cache"].clone()
}

/// Killed (SIGKILL) and started again, the agent answers a warm key from the sealed cache with
/// no plugin run, restores the tracked refs, and runs the plugin once for a key whose
/// provider's config changed. The file holds nothing in the clear.
#[test]
fn a_killed_agent_restarts_warm_from_the_sealed_cache() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = counting_provider(d, "--region, eu");
    let bin = d.join("plugins");
    let args = [
        "--image-credential-provider-config",
        config.to_str().unwrap(),
        "--image-credential-provider-bin-dir",
        bin.to_str().unwrap(),
    ];
    let image = "registry.example.com/team/app:v1";
    let agent = Agent::start(d, &args);
    let out = agent.credgate(&["get", image]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(runs(d), 1);
    let tracked = agent.credgate(&["ctl", "track", "nydus", image]);
    assert!(tracked.status.success(), "{}", text(&tracked.stderr));
    credgate_testbed::eventually(
        "the answer is saved",
        std::time::Duration::from_secs(20),
        || saved_status(&agent)["saved_entries"].as_u64() == Some(1),
    );
    agent.signal(libc::SIGKILL);
    drop(agent);
    let sealed = std::fs::read(d.join("state/cache.sealed")).unwrap();
    for clear in [
        "kept-password-sealed",
        "kept",
        "nydus",
        "registry.example.com",
    ] {
        assert!(
            !sealed.windows(clear.len()).any(|w| w == clear.as_bytes()),
            "{clear} in the clear"
        );
    }

    let agent = Agent::start(d, &args);
    let out = agent.credgate(&["get", "-o", "json", "registry.example.com/team/other:v2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("kept-password-sealed"));
    assert_eq!(runs(d), 1, "a warm key costs no plugin run after a restart");
    let status = saved_status(&agent);
    assert_eq!(status["restored"], 1, "{status}");
    assert_eq!(status["consumers_restored"], 1, "{status}");
    let list = agent.credgate(&["ctl", "list-tracked", "--consumer", "nydus"]);
    assert!(text(&list.stdout).contains(image), "{}", text(&list.stdout));
    let table = agent.credgate(&["ctl", "status"]);
    assert!(
        text(&table.stdout).contains("saved cache:    1 restored at start")
            && text(&table.stdout).contains("restored answers are served with no plugin run")
            && text(&table.stdout).contains("cri proxy:      off"),
        "{}",
        text(&table.stdout)
    );
    credgate_testbed::eventually(
        "the restored answer is saved again",
        std::time::Duration::from_secs(20),
        || saved_status(&agent)["saved_entries"].as_u64() == Some(1),
    );
    agent.signal(libc::SIGKILL);
    drop(agent);

    // The provider's args changed: its saved answer is dropped and the plugin runs once.
    counting_provider(d, "--region, us");
    let agent = Agent::start(d, &args);
    let status = saved_status(&agent);
    assert_eq!(status["restored"], 0, "{status}");
    assert_eq!(status["dropped"]["config_changed"], 1, "{status}");
    let out = agent.credgate(&["get", image]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(runs(d), 2);
    assert!(!agent.log_text().contains("kept-password-sealed"));
    drop(agent);

    // Off: nothing restored, nothing saved.
    let mut off = args.to_vec();
    off.push("--no-persist-cache");
    let agent = Agent::start(d, &off);
    assert_ne!(saved_status(&agent)["enabled"], true);
    assert!(
        !d.join("state/cache.sealed").exists(),
        "--no-persist-cache removes the file of an earlier run"
    );
    agent.credgate(&["get", image]);
    assert_eq!(runs(d), 3);
    drop(agent);
    // On again: nothing of two runs ago comes back, no stale consumer either.
    let agent = Agent::start(d, &args);
    let status = saved_status(&agent);
    assert_eq!(status["restored"], 0, "{status}");
    assert_eq!(status["consumers_restored"], 0, "{status}");
    assert!(
        status["dropped"].as_object().is_none_or(|m| m.is_empty()),
        "{status}"
    );
}

/// A provider answer with no credential is not kept: a restart neither restores nor drops it
/// (it was saved and then refused as invalid at every start).
#[test]
fn an_answer_with_no_credential_is_not_saved() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bin = d.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    crate::support::write_script(
        &bin.join("empty"),
        "cat >/dev/null\necho '{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"12h\",\"auth\":{}}'",
    );
    let config = d.join("providers.yaml");
    std::fs::write(&config, "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: empty\n  matchImages: [registry.example.com]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n").unwrap();
    let args = [
        "--image-credential-provider-config",
        config.to_str().unwrap(),
        "--image-credential-provider-bin-dir",
        bin.to_str().unwrap(),
    ];
    let agent = Agent::start(d, &args);
    agent.credgate(&["get", "registry.example.com/team/app:v1"]);
    agent.credgate(&["ctl", "track", "nydus", "registry.example.com/team/app:v1"]);
    credgate_testbed::eventually(
        "the consumer is saved",
        std::time::Duration::from_secs(20),
        || {
            saved_status(&agent)["last_saved_unix_ms"]
                .as_i64()
                .unwrap_or(0)
                > 0
        },
    );
    assert_eq!(
        saved_status(&agent)["saved_entries"].as_u64().unwrap_or(0),
        0
    );
    assert!(agent.stop().success());
    let agent = Agent::start(d, &args);
    let status = saved_status(&agent);
    assert_eq!(status["restored"].as_u64().unwrap_or(0), 0, "{status}");
    assert!(
        status["dropped"].as_object().is_none_or(|m| m.is_empty()),
        "{status}"
    );
}

/// `ctl flush` drops cached answers (of a provider, for an image, or all) and the next lookup
/// runs the plugin; an unknown provider is an error; nothing cached says so.
#[test]
fn flushed_answers_make_the_plugin_run_again() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = counting_provider(d, "--region, eu");
    let bin = d.join("plugins");
    let agent = Agent::start(
        d,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            bin.to_str().unwrap(),
        ],
    );
    let image = "registry.example.com/team/app:v1";
    let get = || {
        let out = agent.credgate(&["get", image]);
        assert!(out.status.success(), "{}", text(&out.stderr));
    };
    get();
    get();
    assert_eq!(runs(d), 1);
    let out = agent.credgate(&["ctl", "flush", "--provider", "counted"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(
        table.contains("dropped 1 cached answer(s)") && table.contains("registry.example.com"),
        "{table}"
    );
    get();
    assert_eq!(runs(d), 2);
    // By image: an answer keyed by registry answers it; another registry's image drops nothing.
    let other = agent.credgate(&["ctl", "flush", "quay.io/x/y:1"]);
    assert_eq!(text(&other.stdout), "nothing cached to drop\n");
    let out = agent.credgate(&[
        "ctl",
        "-o",
        "json",
        "flush",
        "registry.example.com/team/db:v3",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["dropped"][0]["provider"], "counted", "{v}");
    assert_eq!(v["dropped"][0]["cache_key_type"], "Registry", "{v}");
    get();
    assert_eq!(runs(d), 3);
    let status = text(&agent.credgate(&["ctl", "status"]).stdout);
    assert!(
        status.contains("dropped:        provider counted's cached answers")
            && status.contains("flushed by an operator"),
        "{status}"
    );
    let bad = agent.credgate(&["ctl", "flush", "--provider", "nope"]);
    assert!(!bad.status.success());
    assert!(
        text(&bad.stderr).contains("no provider \"nope\""),
        "{}",
        text(&bad.stderr)
    );
    assert!(!agent.log_text().contains("kept-password-sealed"));
}

/// A Python program run as `uid` that opens `n` connections to `socket`, sends each the
/// HTTP/2 preface, an empty SETTINGS and then a PING every 100 ms, and prints how many the
/// agent closed, once `secs` have passed.
fn hold_connections(uid: u32, socket: &Path, n: usize, secs: f64) -> std::process::Child {
    let script = format!(
        r#"
import socket, time
conns = []
for _ in range({n}):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect({socket:?})
    try:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    except OSError:
        pass  # a connection past the agent's bounds may be closed before the preface is sent
    s.setblocking(False)
    conns.append(s)
print("connected", flush=True)
closed = set()
end = time.time() + {secs}
while time.time() < end and len(closed) < len(conns):
    for i, s in enumerate(conns):
        if i in closed:
            continue
        try:
            s.sendall(b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"12345678")
            while True:
                if s.recv(65536) == b"":
                    closed.add(i)
                    break
        except BlockingIOError:
            pass
        except OSError:
            closed.add(i)
    time.sleep(0.1)
print(len(closed), flush=True)
"#,
        socket = socket.to_str().unwrap()
    );
    as_user(uid, "/usr/bin/python3")
        .args(["-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Socket-group members holding every connection they may (idle, a PING every 100 ms, each
/// until its connections are closed or 6 s) leave root the slots kept for it: `ctl health`
/// and the bridge's lookup get in; and connections that only PING are closed at the idle
/// deadline, as if silent.
#[test]
#[ignore = "needs root"]
fn other_uids_cannot_take_roots_slots_and_pings_are_no_activity() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for_every_uid(
        dir.path(),
        &[
            "--max-connections",
            "16",
            "--max-connections-per-uid",
            "4",
            "--idle-timeout",
            "2s",
        ],
    );
    // Each holder says when its connections are made, before root asks: the agent accepts
    // in order, so root's connection comes after the 14 it lets the holders have.
    let mut holders: Vec<_> = (4242..4246)
        .map(|uid| {
            use std::io::BufRead as _;
            let mut child = hold_connections(uid, &agent.socket, 4, 6.0);
            let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "connected", "uid {uid}");
            (child, out)
        })
        .collect();
    // 16 connections asked for, 14 held (2 kept for root and the agent's uid): root gets in.
    for _ in 0..2 {
        let out = agent.credgate(&["ctl", "health"]);
        assert_eq!(
            text(&out.stdout).trim(),
            "SERVING",
            "root is refused while other uids hold their connections: {}",
            text(&out.stderr)
        );
    }
    // Every held connection only PINGs: each is closed at the 2 s idle deadline.
    let mut closed = 0;
    for (child, out) in &mut holders {
        use std::io::Read as _;
        let mut rest = String::new();
        out.read_to_string(&mut rest).unwrap();
        child.wait().unwrap();
        closed += rest.trim().parse::<usize>().unwrap_or(0);
    }
    assert_eq!(closed, 16, "connections that only PING are idle");
}

/// `explain` and `ctl pulls` answer only what the caller's services show it: with
/// image-access and credentials restricted, another uid's explanation has neither the guard's
/// records nor the sources, and its `ctl pulls` is refused; a listed uid sees them.
#[test]
#[ignore = "needs root"]
fn explain_and_pulls_keep_to_the_callers_services() {
    let dir = tempfile::tempdir().unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let agent = agent_for_every_uid(
        dir.path(),
        &[
            "--allow-uids",
            "image-access=4243",
            "--allow-uids",
            "credentials=4243",
            "--image-credential-provider-config",
            examples.join("provider-config.yaml").to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            examples.join("plugins").to_str().unwrap(),
        ],
    );
    let image = "registry.example.com/team/app:v1";
    let id = format!("sha256:{}", "4b".repeat(32));
    let out = agent.credgate(&[
        "ctl",
        "record-result",
        image,
        "--image-ref",
        &id,
        "--secret",
        "team-a/regcred=alice:explain-secret",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let explain_as = |uid: u32| -> serde_json::Value {
        let out = credgate_as(uid, &agent, &["explain", "-o", "json", image]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let listed = explain_as(4243);
    assert!(
        listed["guard_records"]
            .as_array()
            .is_some_and(|r| !r.is_empty()),
        "{listed}"
    );
    assert!(listed["sources"].as_array().is_some_and(|s| !s.is_empty()));
    let other = explain_as(4242);
    assert!(
        other["guard_records"]
            .as_array()
            .is_none_or(|r| r.is_empty()),
        "{other}"
    );
    assert!(other["sources"].as_array().is_none_or(|s| s.is_empty()));
    assert!(
        other["guard_node_wide_decision"]
            .as_str()
            .is_some_and(|d| d.contains("may not call the image-access service")),
        "{other}"
    );
    let pulls = credgate_as(4242, &agent, &["ctl", "pulls"]);
    assert!(!pulls.status.success());
    assert!(
        text(&pulls.stderr).contains("may not call the image-access service"),
        "{}",
        text(&pulls.stderr)
    );
}

/// On an agent without the CRI proxy, `ctl pulls` and `ctl captured` say the proxy is off
/// (as `captured forget` does), instead of "no pulls yet" and "nothing captured".
#[test]
fn pulls_and_captured_say_when_the_proxy_is_off() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    for args in [
        &["ctl", "pulls"][..],
        &["ctl", "captured"],
        &["ctl", "captured", "forget", "registry.example.com/team/app"],
    ] {
        let out = agent.credgate(args);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            text(&out.stderr).contains("the CRI proxy does not run on this agent"),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    // And an empty list says so.
    let out = agent.credgate(&["ctl", "list-tracked"]);
    assert_eq!(text(&out.stdout), "nothing tracked\n");
}

/// `scripts/node-tools/socket-holder`, holding `sockets` (NAME=PATH) as systemd's socket
/// units do and running the agent of `args` on them again whenever it exits.
struct Held {
    holder: std::process::Child,
    pid_file: std::path::PathBuf,
    log: std::path::PathBuf,
}

impl Held {
    fn start(dir: &std::path::Path, args: &[&str], sockets: &[String]) -> Held {
        let args_file = dir.join("args");
        let mut lines = vec![env!("CARGO_BIN_EXE_credgate").to_owned()];
        lines.extend(args.iter().map(|a| (*a).to_owned()));
        std::fs::write(&args_file, lines.join("\n") + "\n").unwrap();
        let pid_file = dir.join("agent.pid");
        let holder = Command::new(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../scripts/node-tools/socket-holder"),
        )
        .arg(&pid_file)
        .arg(&args_file)
        .args(sockets)
        .env("CREDGATE_LOG", "trace")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("agent.log")).unwrap())
        .spawn()
        .unwrap();
        Held {
            holder,
            pid_file,
            log: dir.join("agent.log"),
        }
    }

    fn agent_pid(&self) -> Option<i32> {
        std::fs::read_to_string(&self.pid_file)
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.holder.id().to_string())
            .status();
        let _ = self.holder.wait();
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        crate::support::secrets::check("the held agent's log", &log);
    }
}

/// Socket activation (issue 50): the agent serves the socket a service manager handed over
/// as `api` and leaves it in place when it stops; a call made while it restarts waits in the
/// backlog and is answered by the next process (the holder starts it, as systemd's
/// Restart=always does). A TCP socket handed over where the API's unix socket is expected is
/// refused at start with the reason; a name not handed over is bound as usual, and logged.
#[test]
fn sockets_handed_over_outlive_the_agent_and_the_wrong_kind_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let socket = d.join("api.sock");
    let held = Held::start(
        d,
        &[
            "serve",
            "--no-docker-config",
            "--socket",
            socket.to_str().unwrap(),
            "--state-dir",
            d.join("state").to_str().unwrap(),
        ],
        &[format!("api={}", socket.display())],
    );
    let health = || {
        Command::new(env!("CARGO_BIN_EXE_credgate"))
            .args(["ctl", "--socket", socket.to_str().unwrap(), "health"])
            .output()
            .unwrap()
    };
    credgate_testbed::eventually(
        "the agent serves the handed-over socket",
        Duration::from_secs(20),
        || health().status.success(),
    );
    let log = || std::fs::read_to_string(d.join("agent.log")).unwrap_or_default();
    assert!(
        log().contains("serving on the socket the service manager handed over"),
        "{}",
        log()
    );
    for _ in 0..3 {
        let first = held.agent_pid().unwrap();
        assert!(Command::new("kill")
            .arg("-TERM")
            .arg(first.to_string())
            .status()
            .unwrap()
            .success());
        // Once it is gone and before the next one listens: the call waits in the backlog,
        // then the next process answers it.
        credgate_testbed::eventually("the agent stops", Duration::from_secs(20), || {
            !std::path::Path::new(&format!("/proc/{first}")).exists()
        });
        let out = health();
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(socket.exists(), "the socket stays");
        assert_ne!(held.agent_pid(), Some(first), "another process answered");
    }
    drop(held);

    // TCP where the API's unix socket is expected: refused at start, with the reason.
    let port = crate::support::free_port();
    let wrong = d.join("wrong");
    std::fs::create_dir_all(&wrong).unwrap();
    let held = Held::start(
        &wrong,
        &[
            "serve",
            "--no-docker-config",
            "--socket",
            wrong.join("api.sock").to_str().unwrap(),
            "--state-dir",
            wrong.join("state").to_str().unwrap(),
        ],
        &[format!("api=tcp:127.0.0.1:{port}")],
    );
    let log = || std::fs::read_to_string(wrong.join("agent.log")).unwrap_or_default();
    credgate_testbed::eventually(
        "the agent refuses the TCP socket",
        Duration::from_secs(20),
        || log().contains("is not a listening unix stream socket"),
    );
    assert!(!wrong.join("api.sock").exists());
    drop(held);

    // Only `cri` handed over: the proxy serves it (a handed-over socket is blocking: the
    // proxy's runtime must be given it non-blocking), the API's socket is bound.
    let proxied = d.join("proxied");
    std::fs::create_dir_all(&proxied).unwrap();
    let cri = proxied.join("cri.sock");
    let runtime = format!("unix://{}", proxied.join("no-runtime.sock").display());
    let held = Held::start(
        &proxied,
        &[
            "serve",
            "--no-docker-config",
            "--socket",
            proxied.join("api.sock").to_str().unwrap(),
            "--state-dir",
            proxied.join("state").to_str().unwrap(),
            "--cri-proxy-socket",
            cri.to_str().unwrap(),
            "--cri-runtime-endpoint",
            &runtime,
        ],
        &[format!("cri={}", cri.display())],
    );
    let log = || std::fs::read_to_string(proxied.join("agent.log")).unwrap_or_default();
    credgate_testbed::eventually(
        "the proxy serves the handed-over socket",
        Duration::from_secs(20),
        || log().contains("serving the CRI image-service proxy"),
    );
    let status = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args([
            "ctl",
            "--socket",
            proxied.join("api.sock").to_str().unwrap(),
            "status",
        ])
        .output()
        .unwrap();
    assert!(
        text(&status.stdout).contains("cri proxy:      serving"),
        "{}{}",
        text(&status.stdout),
        log()
    );
    assert!(!log().contains("panicked"), "{}", log());
    drop(held);

    // Only `cri` handed over, and no proxy: the API's socket is bound, and the unused one said.
    let other = d.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let held = Held::start(
        &other,
        &[
            "serve",
            "--no-docker-config",
            "--socket",
            other.join("api.sock").to_str().unwrap(),
            "--state-dir",
            other.join("state").to_str().unwrap(),
        ],
        &[format!("cri={}", other.join("cri.sock").display())],
    );
    let log = || std::fs::read_to_string(other.join("agent.log")).unwrap_or_default();
    credgate_testbed::eventually(
        "the agent binds its API socket",
        Duration::from_secs(20),
        || {
            Command::new(env!("CARGO_BIN_EXE_credgate"))
                .args([
                    "ctl",
                    "--socket",
                    other.join("api.sock").to_str().unwrap(),
                    "health",
                ])
                .output()
                .unwrap()
                .status
                .success()
        },
    );
    assert!(
        log().contains("no socket handed over for it: binding it"),
        "{}",
        log()
    );
    assert!(log().contains("no flag serves"), "{}", log());
    drop(held);
}

/// The harness's own check (issue 52): a secret the test handed out that is in an agent's log
/// fails the test when the agent is dropped, without the test asking.
#[test]
fn the_harness_fails_a_test_whose_agent_logged_a_secret() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(dir.path(), &[]);
    crate::support::secrets::secret("harness-check-secret");
    // Stopped first: the agent writes its log at its own offset, and a line of its written
    // after this one would overwrite it.
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&agent.log)
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"harness-check-secret\n"))
        .unwrap();
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(agent)));
    let message = dropped.expect_err("the drop fails the test");
    let message = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(message.contains("is in the agent's log"), "{message}");
    // A log without one passes.
    let clean = tempfile::tempdir().unwrap();
    drop(Agent::start(clean.path(), &[]));
}
