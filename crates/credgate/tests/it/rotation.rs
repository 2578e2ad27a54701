//! Credential rotation takes effect at the next pull: against Debian's docker-registry with
//! htpasswd (a password changed in the file, which the registry reads again) and Debian's
//! containerd behind the CRI proxy, with a provider plugin whose backend starts answering the
//! new password at the same time, and a kubelet-like client that keeps what the bridge gave it
//! for the cacheDuration it got. Needs root (containerd).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use credgate_testbed::cri::*;

use crate::support::{needs_containerd, proxy_agent_with, text, Agent};

pub(crate) const USER: &str = "alice";
const OLD: &str = "old-Pa55word-not-for-logs";
const NEW: &str = "new-Pa55word-not-for-logs";
const NEWER: &str = "newer-Pa55word-not-for-logs";
const FOURTH: &str = "fourth-Pa55word-not-for-logs";

/// A provider `rotating` for the registry whose plugin answers `USER` with the password in
/// `dir/backend` (keyed by registry, for an hour) and counts its runs in `dir/runs`.
pub(crate) struct Backend {
    dir: PathBuf,
    pub(crate) config: PathBuf,
    pub(crate) bin: PathBuf,
}

impl Backend {
    pub(crate) fn new(dir: &Path, host: &str, password: &str) -> Backend {
        let bin = dir.join("plugins");
        std::fs::create_dir_all(&bin).unwrap();
        let backend = Backend {
            dir: dir.to_owned(),
            config: dir.join("providers.yaml"),
            bin,
        };
        backend.answer(password);
        crate::support::write_script(
            &backend.bin.join("rotating"),
            &format!(
                r#"cat >/dev/null
echo run >> {runs}
[ -e {fail} ] && exit 3
printf '{{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Registry","cacheDuration":"1h","auth":{{"{host}":{{"username":"{USER}","password":"%s"}}}}}}' "$(cat {file})""#,
                runs = dir.join("runs").display(),
                fail = dir.join("fail").display(),
                file = dir.join("backend").display(),
            ),
        );
        std::fs::write(
            &backend.config,
            format!("apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: rotating\n  matchImages: [\"{host}\"]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n"),
        )
        .unwrap();
        backend
    }

    /// The backend answers `password` from now on.
    pub(crate) fn answer(&self, password: &str) {
        crate::support::secrets::login(USER, password);
        std::fs::write(self.dir.join("backend"), password).unwrap();
    }

    /// The plugin fails (exit 3) while `failing`.
    pub(crate) fn failing(&self, failing: bool) {
        let path = self.dir.join("fail");
        if failing {
            std::fs::write(path, "").unwrap();
        } else {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Plugin runs so far.
    pub(crate) fn runs(&self) -> usize {
        std::fs::read_to_string(self.dir.join("runs"))
            .unwrap_or_default()
            .lines()
            .count()
    }

    pub(crate) fn agent(&self, runtime: &Path) -> (Agent, PathBuf) {
        proxy_agent_with(
            &self.dir,
            runtime,
            &[
                "--image-credential-provider-config",
                self.config.to_str().unwrap(),
                "--image-credential-provider-bin-dir",
                self.bin.to_str().unwrap(),
                "--metrics-addr",
                "127.0.0.1:0",
            ],
        )
    }
}

/// The kubelet's exec of the bridge for `image`: the password it answers and the cacheDuration
/// the kubelet would keep it for.
pub(crate) fn kubelet_asks(agent: &Agent, image: &str) -> (String, String) {
    let out = crate::support::output_with_stdin(
        Command::new(crate::support::bridge_bin())
            .args(["--provider", "rotating"])
            .env("CREDGATE_SOCKET", &agent.socket),
        format!(r#"{{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderRequest","image":"{image}"}}"#).as_bytes(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let password = v["auth"]
        .as_object()
        .and_then(|a| a.values().next())
        .and_then(|e| e["password"].as_str())
        .unwrap_or_default()
        .to_owned();
    (
        password,
        v["cacheDuration"].as_str().unwrap_or("").to_owned(),
    )
}

/// Whether `agent` saved its sealed cache after provider `rotating` last answered
/// (`ctl status`: the save's time against the provider's last success).
fn saved_after_last_answer(agent: &Agent) -> bool {
    let out = agent.credgate(&["ctl", "-o", "json", "status"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let answered = v["providers"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "rotating"))
        .and_then(|p| p["last_success_unix_ms"].as_i64())
        .unwrap_or(i64::MAX);
    let saved = v["saved_cache"]["last_saved_unix_ms"].as_i64().unwrap_or(0);
    answered > 0 && saved >= answered
}

/// Plugin runs of provider `rotating` by `agent` (`ctl status`).
fn agent_runs(agent: &Agent) -> u64 {
    let out = agent.credgate(&["ctl", "-o", "json", "status"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["providers"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "rotating"))
        .and_then(|p| {
            p["runs"]
                .as_str()
                .and_then(|r| r.parse().ok())
                .or(p["runs"].as_u64())
        })
        .unwrap_or(u64::MAX)
}

/// `credgate ctl report-refused IMAGE --username USER` with `password` on stdin: its outcome.
pub(crate) fn report(agent: &Agent, image: &str, password: &str) -> String {
    let out = crate::support::output_with_stdin(
        Command::new(env!("CARGO_BIN_EXE_credgate"))
            .args([
                "ctl",
                "-o",
                "json",
                "report-refused",
                image,
                "--username",
                USER,
            ])
            .env("CREDGATE_SOCKET", &agent.socket)
            .stderr(std::process::Stdio::piped()),
        format!("{password}\n").as_bytes(),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", text(&out.stderr)));
    let outcome = v["outcome"].as_str().unwrap().to_owned();
    // Exit 0 exactly when the credential is refused now.
    let refused = matches!(outcome.as_str(), "refused" | "already_refused");
    assert_eq!(
        out.status.code(),
        Some(if refused { 0 } else { 1 }),
        "{outcome}"
    );
    outcome
}

/// What `ctl lookup` gives for `image`: the first password.
pub(crate) fn looked_up(agent: &Agent, image: &str) -> String {
    let out = agent.credgate(&["ctl", "lookup", "-o", "json", image]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["credentials"][0]["password"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

pub(crate) fn metric(agent: &Agent, line: &str) -> Option<String> {
    crate::cri::metrics_text(agent)
        .lines()
        .find(|l| l.starts_with(line))
        .map(str::to_owned)
}

/// A provider's credential rotated at the registry and in the plugin's backend: the pull with
/// the kubelet's cached copy is refused by the registry, and the proxy sends the same pull
/// again with the provider's answer of now (the plugin run once more): the caller sees it
/// succeed, and so does the next pull with the same copy; a Watch stream gets the new credential, the
/// bridge answers it, and a pod's own wrong secret changes nothing. A refused answer is gone
/// from the sealed cache too (SIGKILL, restart: the plugin runs, the old answer is not served).
/// A consumer's report of a working credential changes nothing; of a refused one, the plugin
/// runs once, and a second report within the hold-off runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_rotated_provider_credential_takes_effect_at_the_next_pull() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (mut registry, containerd) = crate::support::registry_and_containerd(d, USER, OLD);
    let backend = Backend::new(d, &registry.host(), OLD);
    let (agent, proxy) = backend.agent(&containerd.socket);
    let image = format!("{}/team/app:v1", registry.host());
    let pull = |password: &str| pull_request(&image, Some((USER, password)), "team-a");

    // The kubelet asks the bridge and keeps the answer; never longer than 5 minutes.
    let (kubelet_copy, keep_for) = kubelet_asks(&agent, &image);
    assert_eq!(kubelet_copy, OLD);
    assert_eq!(
        keep_for, "5m0s",
        "the bridge caps the kubelet's cacheDuration"
    );
    assert_eq!(backend.runs(), 1);
    let mut stream = crate::support::watch(&agent.socket, std::slice::from_ref(&image)).await;
    let first = crate::support::next_event(&mut stream).await;
    assert_eq!(first.credentials[0].password, OLD);
    let _: PullImageResponse = call(&proxy, PULL_IMAGE, pull(&kubelet_copy))
        .await
        .expect("the pull with the provider's credential succeeds");

    // A pod's own wrong secret, refused: nothing of the agent's changes.
    call::<_, PullImageResponse>(&proxy, PULL_IMAGE, pull("a-pods-own-wrong-secret"))
        .await
        .unwrap_err();
    assert_eq!(looked_up(&agent, &image), OLD);
    assert_eq!(backend.runs(), 1);

    // Rotation: the registry and the plugin's backend move to the new password.
    registry.set_password(USER, NEW);
    backend.answer(NEW);
    // The registry refuses the old password; the proxy sends the same pull again with the
    // provider's answer of now, for which the plugin runs once: the caller sees it succeed.
    let _: PullImageResponse = call(&proxy, PULL_IMAGE, pull(&kubelet_copy))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the pull succeeds with no manual step: {e:?}\n{}",
                agent
                    .log_text()
                    .lines()
                    .filter(|l| l.contains("credgate") && !l.contains("TRACE"))
                    .collect::<Vec<_>>()
                    .join("\n")
            )
        });
    // A failure says what the agent did (the pull log, its refusal notes): this test failed
    // once in ten full runs under load, and its message is what the next look needs.
    let what_happened = |agent: &Agent| {
        format!(
            "{}\n{}",
            text(&agent.credgate(&["ctl", "pulls"]).stdout),
            agent
                .log_text()
                .lines()
                .filter(|l| l.contains("WARN") || l.contains("refus") || l.contains("plugin"))
                .collect::<Vec<_>>()
                .join("\n")
        )
    };
    assert_eq!(
        backend.runs(),
        2,
        "one plugin run for the rotation\n{}",
        what_happened(&agent)
    );
    let _: PullImageResponse = call(&proxy, PULL_IMAGE, pull(&kubelet_copy))
        .await
        .expect("and the one after");
    assert_eq!(
        backend.runs(),
        2,
        "no further run\n{}",
        what_happened(&agent)
    );
    let pushed = crate::support::next_event(&mut stream).await;
    assert_eq!(
        pushed.credentials[0].password,
        NEW,
        "{pushed:?}\n{}",
        what_happened(&agent)
    );
    assert_eq!(kubelet_asks(&agent, &image).0, NEW);
    let status = text(&agent.credgate(&["ctl", "status"]).stdout);
    assert!(
        status.contains("dropped:") && status.contains("refused by the registry"),
        "{status}"
    );
    let explained = text(&agent.credgate(&["explain", &image]).stdout);
    assert!(explained.contains("refused by the registry"), "{explained}");
    assert_eq!(
        metric(
            &agent,
            "credgate_credentials_refused_total{source=\"provider\"}"
        )
        .as_deref(),
        Some("credgate_credentials_refused_total{source=\"provider\"} 1")
    );
    let log = agent.log_text();
    for secret in [OLD, NEW] {
        assert!(!log.contains(secret), "a password reached the agent's log");
    }

    // A second rotation, and the agent killed right after the refusal: the refused answer is
    // not in the sealed cache any more, so the restarted agent runs the plugin. (The plugin
    // fails meanwhile, so that no renewal puts a newer answer in the file first; the saver,
    // which writes every second, keeps NEW before it is refused.)
    backend.failing(true);
    credgate_testbed::eventually_async(
        "the sealed cache holds the provider's last answer",
        Duration::from_secs(20),
        || std::future::ready(saved_after_last_answer(&agent)),
    )
    .await;
    registry.set_password(USER, NEWER);
    backend.answer(NEWER);
    call::<_, PullImageResponse>(&proxy, PULL_IMAGE, pull(NEW))
        .await
        .expect_err("the registry refuses the rotated-away password");
    agent.signal(libc::SIGKILL);
    drop(stream);
    drop(agent);
    backend.failing(false);
    let (agent, _proxy) = backend.agent(&containerd.socket);
    assert_eq!(
        looked_up(&agent, &image),
        NEWER,
        "the refused answer is not restored"
    );
    // Counted by the restarted agent: a renewal the killed one had started may still write
    // its line to the backend's count as its process ends.
    assert_eq!(
        agent_runs(&agent),
        1,
        "the restarted agent ran the plugin once"
    );
    let runs = backend.runs();

    // Consumers' reports: a credential the agent never gave changes nothing; a refused one
    // runs the plugin once, and again within the hold-off nothing; a working one changes
    // nothing (the registry accepts it).
    assert_eq!(report(&agent, &image, "never-given"), "not_given");
    assert_eq!(looked_up(&agent, &image), NEWER);
    assert_eq!(backend.runs(), runs);
    registry.set_password(USER, FOURTH);
    backend.answer(FOURTH);
    assert_eq!(report(&agent, &image, NEWER), "refused");
    assert_eq!(looked_up(&agent, &image), FOURTH);
    assert_eq!(backend.runs(), runs + 1);
    assert_eq!(report(&agent, &image, NEWER), "already_refused");
    assert_eq!(looked_up(&agent, &image), FOURTH);
    assert_eq!(backend.runs(), runs + 1);
    assert_eq!(report(&agent, &image, FOURTH), "accepted");
    assert_eq!(report(&agent, &image, FOURTH), "accepted");
    assert_eq!(looked_up(&agent, &image), FOURTH);
    assert_eq!(backend.runs(), runs + 1);
    let log = agent.log_text();
    for secret in [NEWER, FOURTH] {
        assert!(!log.contains(secret), "a password reached the agent's log");
    }
}

/// A pod's pull secret captured by the proxy is on disk when the pull is answered (SIGKILL
/// right after the answer loses nothing), and once its password is changed at the registry,
/// its next refused pull drops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_captured_credential_is_durable_and_dropped_once_refused() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (mut registry, containerd) = crate::support::registry_and_containerd(d, USER, OLD);
    let (agent, proxy) = proxy_agent_with(d, &containerd.socket, &[]);
    let image = format!("{}/team/app:v1", registry.host());
    let pull = |password: &str| pull_request(&image, Some((USER, password)), "team-b");
    let _: PullImageResponse = call(&proxy, PULL_IMAGE, pull(OLD))
        .await
        .expect("the pull succeeds");
    // Killed right after the acknowledged pull: nothing waited for.
    agent.signal(libc::SIGKILL);
    drop(agent);
    let (agent, proxy) = proxy_agent_with(d, &containerd.socket, &[]);
    let listed = text(&agent.credgate(&["ctl", "captured"]).stdout);
    assert!(
        listed.contains("team/app") && listed.contains("team-b"),
        "the acknowledged capture survives SIGKILL: {listed}"
    );
    assert_eq!(looked_up(&agent, &image), OLD);
    // explain says that the kubelet never gets it.
    let explained = text(&agent.credgate(&["explain", &image]).stdout);
    assert!(explained.contains("never for the kubelet"), "{explained}");

    registry.set_password(USER, NEW);
    call::<_, PullImageResponse>(&proxy, PULL_IMAGE, pull(OLD))
        .await
        .expect_err("the registry refuses the changed password");
    let listed = text(&agent.credgate(&["ctl", "captured"]).stdout);
    assert_eq!(listed, "nothing captured\n", "{listed}");
    assert_eq!(looked_up(&agent, &image), "");
    let log = agent.log_text();
    assert!(!log.contains(OLD) && !log.contains(NEW));
}

/// Against a fake runtime that answers every pull as containerd answers a 401, and a registry
/// (a stub) that refuses the entry's credential itself: a refused credential of a docker
/// config (which credgate does not own) is reported (log, metric, explain) and still served; a
/// pod's own secret changes nothing and is not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_docker_config_entry_is_reported_not_changed() {
    use credgate_testbed::fake_runtime::Answers;
    const SECRET: &str = "dc-Pa55word-not-for-logs";
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let stub = crate::support::stub_registry::StubRegistry::start("someone-else", "x");
    let host = stub.host();
    let docker_config = crate::support::docker_config(d, &host, "dc-user", SECRET);
    let (_fake, agent, proxy) = crate::support::fake_runtime_agent(
        d,
        Answers {
            pull: Err((2, "failed to resolve reference: 401 Unauthorized".into())),
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
    let image = &format!("{host}/team/app:v1");
    let refused = |user: &str, password: &str| {
        call::<_, PullImageResponse>(
            &proxy,
            PULL_IMAGE,
            pull_request(image, Some((user, password)), "ns-a"),
        )
    };
    let counted = || {
        let line = "credgate_credentials_refused_total{source=\"docker_config\"}";
        metric(&agent, line)
            .and_then(|l| l[line.len()..].trim().parse::<u64>().ok())
            .unwrap_or(u64::MAX)
    };
    refused("pod-user", "a-pods-own-secret").await.unwrap_err();
    assert_eq!(
        counted(),
        0,
        "a pod's own secret is not the agent's to refuse"
    );
    refused("dc-user", SECRET).await.unwrap_err();
    assert_eq!(counted(), 1);
    assert!(agent.log_text().contains("credgate does not own that file"));
    let explained = text(&agent.credgate(&["explain", image]).stdout);
    assert!(
        explained.contains("refused") && explained.contains(docker_config.to_str().unwrap()),
        "{explained}"
    );
    // Within the hold-off, the same refusal is not counted again.
    refused("dc-user", SECRET).await.unwrap_err();
    assert_eq!(counted(), 1);
    // The file is not credgate's: its entry is still served.
    let out = agent.credgate(&["ctl", "-o", "json", "lookup", image]);
    assert!(
        text(&out.stdout).contains("dc-user"),
        "{}",
        text(&out.stdout)
    );
    let log = agent.log_text();
    assert!(!log.contains(SECRET) && !log.contains("a-pods-own-secret"));
}
