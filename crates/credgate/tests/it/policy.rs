//! The CRI proxy as the node's credential policy point, against Debian's containerd (its CRI
//! plugin) and docker-registry with htpasswd, called through the proxy by a grpc-go client
//! dialing as the kubelet does: pulls that come without credentials filled in for the
//! operator's patterns (`--cri-proxy-fill`), a pod credential's reach over hosts.toml mirrors
//! (`--cri-proxy-scope-credentials`, `--cri-proxy-trusted-mirror`), and `credgate import
//! containerd`. Needs root (containerd).

use std::path::Path;

use credgate_testbed::cri::*;
use credgate_testbed::{oci_image, push, Containerd, Registry};
use prost::Message as _;

use crate::support::foreign::{build_go, go_call, Answer, Dial};
use crate::support::{needs_containerd, proxy_agent_with, text, write_script, Agent};

const USER: &str = "node-user";
const PASSWORD: &str = "node-Pa55word-not-for-logs";
const POD_USER: &str = "pod-user";
const POD_PASSWORD: &str = "pod-Pa55word-not-for-logs";

/// A PullImage through `socket` by grpc-go (as the kubelet dials), in pod namespace team-a.
fn pull(go: &Path, socket: &Path, image: &str, credential: Option<(&str, &str)>) -> Answer {
    let request = pull_request(image, credential, "team-a").encode_to_vec();
    go_call(go, Dial::Localhost, socket, PULL_IMAGE, &request, 0)
}

/// Removes `image` from containerd (called directly), so that the next pull fetches it.
fn remove(go: &Path, containerd: &Containerd, image: &str) {
    let request = RemoveImageRequest {
        image: Some(ImageSpec {
            image: image.to_owned(),
        }),
    }
    .encode_to_vec();
    let _ = go_call(
        go,
        Dial::Localhost,
        &containerd.socket,
        REMOVE_IMAGE,
        &request,
        0,
    );
}

/// Providers `node` (matching `HOST/team` and `HOST/other`) and `keyed` (`HOST/sa`, keyed by
/// service account but not requiring one, so that it runs for a lookup without one): both
/// answer `USER`:`PASSWORD` for the registry. The agent's source flags.
pub(crate) fn providers(dir: &Path, host: &str) -> Vec<String> {
    let bin = dir.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    for name in ["node", "keyed"] {
        write_script(
            &bin.join(name),
            &format!(
                r#"cat >/dev/null
printf '{{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Registry","cacheDuration":"1h","auth":{{"{host}":{{"username":"{USER}","password":"{PASSWORD}"}}}}}}'"#
            ),
        );
    }
    let config = dir.join("providers.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: node\n  matchImages: [\"{host}/team\", \"{host}/other\"]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n- name: keyed\n  matchImages: [\"{host}/sa\"]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n  tokenAttributes:\n    serviceAccountTokenAudience: registry\n    cacheType: ServiceAccount\n    requireServiceAccount: false\n"
        ),
    )
    .unwrap();
    vec![
        "--image-credential-provider-config".into(),
        config.display().to_string(),
        "--image-credential-provider-bin-dir".into(),
        bin.display().to_string(),
    ]
}

fn agent_in(dir: &Path, runtime: &Path, args: &[String]) -> (Agent, std::path::PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    proxy_agent_with(dir, runtime, &args)
}

#[test]
#[ignore = "needs root"]
fn pulls_without_credentials_are_filled_for_the_operators_patterns_only() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let registry = Registry::start(d, USER, PASSWORD);
    oci_image(d);
    for repo in ["team/app", "other/app", "sa/app"] {
        push(d, &registry, repo, USER, PASSWORD);
    }
    let containerd = Containerd::start(d, &[registry.host()]);
    let host = registry.host();
    let go = build_go();
    let image = |repo: &str| format!("{host}/{repo}:v1");
    let sources = providers(d, &host);

    // Off: the pull goes as it came, and the registry refuses it.
    let (agent, proxy) = agent_in(&d.join("off"), &containerd.socket, &sources);
    let off = pull(&go, &proxy, &image("team/app"), None);
    assert_eq!(off.code, 2, "{off:?}");
    assert!(off.message.contains("401 Unauthorized"), "{off:?}");
    let explained = text(&agent.credgate(&["explain", &image("team/app")]).stdout);
    assert!(
        explained.contains("fill: not filled: --cri-proxy-fill is not set"),
        "{explained}"
    );
    agent.stop();

    let mut on = sources.clone();
    for p in ["team", "sa"] {
        on.extend(["--cri-proxy-fill".into(), format!("{host}/{p}")]);
    }
    let (agent, proxy) = agent_in(&d.join("on"), &containerd.socket, &on);
    let from = registry.settled_log().len();
    let filled = pull(&go, &proxy, &image("team/app"), None);
    assert_eq!(filled.code, 0, "{filled:?}");
    assert!(
        registry.saw_user(USER, from),
        "the registry saw the provider's credential"
    );
    let pulls = text(&agent.credgate(&["ctl", "pulls"]).stdout);
    assert!(pulls.contains(" filled:provider:node "), "{pulls}");
    // Recorded as the kubelet records a credential provider's pull: node-wide.
    let explained = text(
        &agent
            .credgate(&["explain", "-o", "json", &image("team/app")])
            .stdout,
    );
    let json: serde_json::Value = serde_json::from_str(&explained).unwrap();
    assert!(
        json["cri_fill"].as_str().unwrap().starts_with("filled:"),
        "{json}"
    );
    assert_eq!(
        json["guard_record_summaries"][0]["node_wide"], true,
        "{json}"
    );

    // A credential the caller sent is never replaced, even a wrong one.
    remove(&go, &containerd, &image("team/app"));
    let wrong = pull(&go, &proxy, &image("team/app"), Some((USER, "wrong")));
    assert_eq!(wrong.code, 2, "{wrong:?}");
    // An image outside the patterns is not filled, though a provider matches it.
    let other = pull(&go, &proxy, &image("other/app"), None);
    assert_eq!(other.code, 2, "{other:?}");
    assert!(
        text(&agent.credgate(&["explain", &image("other/app")]).stdout)
            .contains("not filled: no --cri-proxy-fill pattern names the image")
    );
    // A provider keyed by service account never fills, though its plugin answers.
    let keyed = pull(&go, &proxy, &image("sa/app"), None);
    assert_eq!(keyed.code, 2, "{keyed:?}");
    let pulls = text(&agent.credgate(&["ctl", "pulls", "-o", "json"]).stdout);
    assert_eq!(pulls.matches("\"filled\"").count(), 1, "{pulls}");
    // explain says so: a fill pattern names the image, but only a keyed provider matches.
    let explained = text(&agent.credgate(&["explain", &image("sa/app")]).stdout);
    assert!(
        explained.contains("not filled: ")
            && explained.contains("no source above has a credential"),
        "{explained}"
    );
    let log = agent.log_text();
    assert!(!log.contains(PASSWORD), "a secret reached the log");
    agent.stop();
}

/// What one pull of a pod's credential did: whether it succeeded, and whether the mirror and
/// the registry received the credential.
#[derive(Debug, PartialEq, Eq)]
struct Reach {
    pulled: bool,
    mirror: bool,
    registry: bool,
}

#[test]
#[ignore = "needs root"]
fn mirror_trust_decides_which_hosts_receive_a_pods_credential() {
    needs_containerd();
    mirror_trust_on(std::path::Path::new("containerd"));
}

/// The same against containerd 2.4 (built from scripts/node-tools by scripts/test).
#[test]
#[ignore = "needs root"]
fn mirror_trust_decides_which_hosts_receive_a_pods_credential_on_containerd_2() {
    needs_containerd();
    let binary = Containerd::v2_binary().unwrap_or_else(|why| panic!("{why}"));
    mirror_trust_on(&binary);
}

/// Every spelling of Docker Hub's name and of hosts.toml's keys, against Debian's containerd
/// (1.6, go-toml v1) and containerd 2.4 (go-toml v2): a pod's credential reaches a mirror only
/// where the directory containerd reads names trusted mirrors alone.
#[test]
#[ignore = "needs root"]
fn every_spelling_of_a_host_and_of_hosts_toml_reaches_only_trusted_mirrors() {
    needs_containerd();
    spellings_on(std::path::Path::new("containerd"));
}

#[test]
#[ignore = "needs root"]
fn every_spelling_of_a_host_and_of_hosts_toml_reaches_only_trusted_mirrors_on_containerd_2() {
    needs_containerd();
    let binary = Containerd::v2_binary().unwrap_or_else(|why| panic!("{why}"));
    spellings_on(&binary);
}

/// `docker.io/` names only the trusted mirror T, `_default/` an untrusted logging mirror M;
/// registry R's own hosts.toml names M as its `server` or a `host` in other cases.
fn spellings_on(binary: &std::path::Path) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let [untrusted, trusted, own] = ["m", "t", "r"].map(|n| {
        let rd = d.join(n);
        std::fs::create_dir_all(&rd).unwrap();
        Registry::start(&rd, POD_USER, POD_PASSWORD)
    });
    oci_image(d);
    for r in [&untrusted, &trusted, &own] {
        push(d, r, "library/busybox", POD_USER, POD_PASSWORD);
    }
    let containerd = Containerd::start_binary(binary, d, &[]);
    let hosts = |sub: &str, body: String| {
        let at = containerd.certs.join(sub);
        std::fs::create_dir_all(&at).unwrap();
        std::fs::write(at.join("hosts.toml"), body).unwrap();
    };
    let host_table = |m: &Registry| {
        format!(
            "[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            m.host()
        )
    };
    hosts("docker.io", host_table(&trusted));
    hosts("_default", host_table(&untrusted));
    let go = build_go();
    let certs = containerd.certs.display().to_string();
    let reached = |name: &str, image: &str, trust: &str| {
        remove(&go, &containerd, image);
        let flags = [
            "--cri-proxy-trusted-mirror".to_owned(),
            trust.to_owned(),
            "--cri-proxy-hosts-dir".into(),
            certs.clone(),
            "--no-cri-proxy-capture".into(),
        ];
        let (agent, proxy) = agent_in(&d.join(name), &containerd.socket, &flags);
        let (m, t) = (untrusted.settled_log().len(), trusted.settled_log().len());
        let answer = pull(&go, &proxy, image, Some((POD_USER, POD_PASSWORD)));
        let explained = text(&agent.credgate(&["explain", image]).stdout);
        let log = agent.log_text();
        agent.stop();
        assert!(!log.contains(POD_PASSWORD), "a secret reached the log");
        (
            untrusted.saw_user(POD_USER, m),
            trusted.saw_user(POD_USER, t),
            format!("{image}: {explained}\n{}", answer.message),
        )
    };
    let hub = "docker.io=".to_owned() + &trusted.host();
    // containerd reads docker.io/ for these: the trusted mirror receives the credential.
    for (n, image) in [
        "docker.io/library/busybox:v1",
        "index.docker.io/library/busybox:v1",
    ]
    .iter()
    .enumerate()
    {
        let (to_m, to_t, said) = reached(&format!("hub-{n}"), image, &hub);
        assert!(!to_m && to_t, "{said}");
    }
    // And registry-1.docker.io/ then _default/ for these, with and without a port: the
    // untrusted mirror never receives it.
    for (n, image) in [
        "registry-1.docker.io/library/busybox:v1",
        "registry-1.docker.io:443/library/busybox:v1",
        "docker.io:443/library/busybox:v1",
    ]
    .iter()
    .enumerate()
    {
        let (to_m, _, said) = reached(&format!("alias-{n}"), image, &hub);
        assert!(
            !to_m,
            "the untrusted mirror received the pod's credential: {said}"
        );
        // Trust of docker.io's mirrors covers registry-1.docker.io: explain names the one
        // _default/ adds. (With a port, no trust applies and the registry keeps it anyway.)
        assert!(
            n > 0 || said.contains(&untrusted.host()),
            "explain names it: {said}"
        );
    }
    // R's hosts.toml naming M in keys of any case: M never receives the credential.
    let image = format!("{}/library/busybox:v1", own.host());
    let trust_r = format!("{}={}", own.host(), trusted.host());
    for (n, body) in [
        format!("SERVER = \"http://{}\"\n", untrusted.host()),
        format!("Server = \"http://{}\"\n", untrusted.host()),
        format!(
            "server = \"http://{}\"\n[HOST.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            own.host(),
            untrusted.host()
        ),
    ]
    .into_iter()
    .enumerate()
    {
        hosts(&own.host(), body.clone());
        let (to_m, _, said) = reached(&format!("keys-{n}"), &image, &trust_r);
        assert!(!to_m, "{body}: the untrusted mirror received the pod's credential: {said}");
        assert!(said.contains(&untrusted.host()), "{body}: explain names it: {said}");
    }
}

/// Which hosts receive a pod's credential through the proxy, with each policy, in front of
/// the containerd at `binary`.
fn mirror_trust_on(binary: &std::path::Path) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (rd, md) = (d.join("registry"), d.join("mirror"));
    std::fs::create_dir_all(&rd).unwrap();
    std::fs::create_dir_all(&md).unwrap();
    let registry = Registry::start(&rd, POD_USER, POD_PASSWORD);
    let mirror = Registry::start(&md, POD_USER, POD_PASSWORD);
    oci_image(d);
    push(d, &registry, "team/app", POD_USER, POD_PASSWORD);
    push(d, &mirror, "team/app", POD_USER, POD_PASSWORD);
    let containerd = Containerd::start_binary(binary, d, &[registry.host(), mirror.host()]);
    containerd.set_mirror(&registry.host(), &mirror.host());
    let go = build_go();
    let image = format!("{}/team/app:v1", registry.host());
    let certs = containerd.certs.display().to_string();

    let reach = |name: &str, flags: &[String]| {
        remove(&go, &containerd, &image);
        // Without capture, whose confirmation asks the image's registry itself: what reaches
        // each host is containerd's doing alone.
        let mut flags = flags.to_vec();
        flags.push("--no-cri-proxy-capture".into());
        let (agent, proxy) = agent_in(&d.join(name), &containerd.socket, &flags);
        let (m, r) = (mirror.settled_log().len(), registry.settled_log().len());
        let answer = pull(&go, &proxy, &image, Some((POD_USER, POD_PASSWORD)));
        let explained = text(&agent.credgate(&["explain", &image]).stdout);
        let log = agent.log_text();
        agent.stop();
        assert!(!log.contains(POD_PASSWORD), "a secret reached the log");
        (
            Reach {
                pulled: answer.code == 0,
                mirror: mirror.saw_user(POD_USER, m),
                registry: registry.saw_user(POD_USER, r),
            },
            // The runtime's answer too, for a failure's message.
            format!("{explained}\n{}", answer.message),
        )
    };

    // Off: containerd's own behaviour, which gives the pod's credential to the mirror.
    let (off, said) = reach("off", &[]);
    assert_eq!(
        off,
        Reach {
            pulled: true,
            mirror: true,
            registry: false
        },
        "{said}"
    );
    // On, the mirror not trusted: it never receives the credential; the registry serves.
    let (scoped, explained) = reach("scoped", &["--cri-proxy-scope-credentials".into()]);
    assert_eq!(
        scoped,
        Reach {
            pulled: true,
            mirror: false,
            registry: true
        }
    );
    assert!(
        explained.contains("only the registry receives"),
        "{explained}"
    );
    // Trusted (every mirror its hosts.toml names): the mirror receives it and serves.
    let trust = format!("{}={}", registry.host(), mirror.host());
    let (trusted, explained) = reach(
        "trusted",
        &[
            "--cri-proxy-trusted-mirror".into(),
            trust.clone(),
            "--cri-proxy-hosts-dir".into(),
            certs.clone(),
        ],
    );
    assert_eq!(
        trusted,
        Reach {
            pulled: true,
            mirror: true,
            registry: false
        }
    );
    assert!(explained.contains("trusted mirrors"), "{explained}");
    // Trust of another mirror than the one hosts.toml names gives this one nothing.
    let elsewhere_flags = [
        "--cri-proxy-trusted-mirror".into(),
        format!("{}=127.0.0.2:1", registry.host()),
        "--cri-proxy-hosts-dir".into(),
        certs,
    ];
    let (elsewhere, explained) = reach("elsewhere", &elsewhere_flags);
    assert_eq!(
        elsewhere,
        Reach {
            pulled: true,
            mirror: false,
            registry: true
        }
    );
    assert!(explained.contains("not trusted"), "{explained}");

    // Where containerd finds the hosts, credgate looks too. The registry's own directory gone,
    // containerd's catch-all `_default` names the (untrusted) mirror: the credential is kept
    // with the registry, and the mirror never receives it.
    let own = containerd.certs.join(registry.host());
    let kept = containerd.certs.join("kept-aside");
    std::fs::rename(&own, &kept).unwrap();
    let hosts = format!(
        "[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
        mirror.host()
    );
    std::fs::create_dir_all(containerd.certs.join("_default")).unwrap();
    std::fs::write(containerd.certs.join("_default/hosts.toml"), &hosts).unwrap();
    let (catch_all, explained) = reach("catch-all", &elsewhere_flags);
    assert!(!catch_all.mirror, "{catch_all:?}\n{explained}");
    assert!(explained.contains(&mirror.host()), "{explained}");
    std::fs::remove_dir_all(containerd.certs.join("_default")).unwrap();
    // HOST_PORT_ comes before HOST:PORT, which names no mirror here.
    std::fs::rename(&kept, &own).unwrap();
    std::fs::write(
        own.join("hosts.toml"),
        format!("server = \"http://{}\"\n", registry.host()),
    )
    .unwrap();
    let (host, port) = registry
        .host()
        .rsplit_once(':')
        .map(|(h, p)| (h.to_owned(), p.to_owned()))
        .unwrap();
    let underscored = containerd.certs.join(format!("{host}_{port}_"));
    std::fs::create_dir_all(&underscored).unwrap();
    std::fs::write(underscored.join("hosts.toml"), &hosts).unwrap();
    let (first_dir, explained) = reach("host-port", &elsewhere_flags);
    assert!(!first_dir.mirror, "{first_dir:?}\n{explained}");
    assert!(explained.contains(&mirror.host()), "{explained}");
}

#[test]
#[ignore = "needs root"]
fn containerds_auth_config_imported_serves_the_same_pulls() {
    needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let registry = Registry::start(d, USER, PASSWORD);
    oci_image(d);
    push(d, &registry, "team/app", USER, PASSWORD);
    let containerd = Containerd::start(d, &[registry.host()]);
    let host = registry.host();
    let go = build_go();
    let image = format!("{host}/team/app:v1");
    let credgate = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_credgate"))
            .args(args)
            .output()
            .unwrap()
    };
    let configs = [
        (
            "v2",
            format!("version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".registry.configs.\"{host}\".auth]\n  username = \"{USER}\"\n  password = \"{PASSWORD}\"\n"),
        ),
        (
            "v3",
            {
                use base64::Engine as _;
                let auth = base64::engine::general_purpose::STANDARD
                    .encode(format!("{USER}:{PASSWORD}"));
                format!("version = 3\n[plugins.\"io.containerd.cri.v1.images\".registry.configs.\"{host}\".auth]\n  auth = \"{auth}\"\n")
            },
        ),
    ];
    for (version, config) in configs {
        let file = d.join(format!("containerd-{version}.toml"));
        std::fs::write(&file, config).unwrap();
        let out = d.join(format!("docker-{version}.json"));
        let imported = credgate(&[
            "import",
            "containerd",
            file.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ]);
        assert!(imported.status.success(), "{imported:?}");
        let said = text(&imported.stdout);
        assert!(!said.contains(PASSWORD), "a secret on stdout");
        assert!(said.contains(&format!("--cri-proxy-fill {host}")), "{said}");
        // Not replaced without --force.
        let again = credgate(&[
            "import",
            "containerd",
            file.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ]);
        assert_eq!(again.status.code(), Some(1), "{again:?}");
        assert!(text(&again.stderr).contains("--force"));

        remove(&go, &containerd, &image);
        let (agent, proxy) = agent_in(
            &d.join(format!("agent-{version}")),
            &containerd.socket,
            &[
                "--docker-config".into(),
                out.display().to_string(),
                "--cri-proxy-fill".into(),
                host.clone(),
            ],
        );
        let answer = pull(&go, &proxy, &image, None);
        assert_eq!(answer.code, 0, "{version}: {answer:?}");
        let pulls = text(&agent.credgate(&["ctl", "pulls"]).stdout);
        assert!(pulls.contains(" filled:docker-config "), "{pulls}");
        agent.stop();
    }

    // Bad input: a clear error, nothing written.
    let out = d.join("never.json");
    let bad = [
        ("missing.toml", None, "cannot read containerd's config"),
        (
            "huge.toml",
            Some("#".repeat((1 << 20) + 1)),
            "over 1048576 bytes",
        ),
        ("noauth.toml", Some("version = 2\n[plugins]\n".into()), "no registry auth"),
        (
            "badauth.toml",
            Some(format!("[plugins.\"io.containerd.grpc.v1.cri\".registry.configs.\"{host}\".auth]\n  auth = \"not base64 of anything\"\n")),
            "is not base64 of user:password",
        ),
    ];
    for (name, content, why) in bad {
        let file = d.join(name);
        if let Some(c) = content {
            std::fs::write(&file, c).unwrap();
        }
        let refused = credgate(&[
            "import",
            "containerd",
            file.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ]);
        assert_eq!(refused.status.code(), Some(1), "{name}: {refused:?}");
        assert!(text(&refused.stderr).contains(why), "{name}: {refused:?}");
        assert!(!out.exists(), "{name}: something was written");
    }
}

/// containerd's hosts directories are read when they change, not on each pull (issue 52): an
/// untrusted mirror written into the registry's hosts.toml while the agent runs is what the
/// next pull's scope (and `explain`, which reads the same view) sees, and so is its removal.
#[tokio::test]
async fn a_hosts_toml_changed_while_the_proxy_runs_is_what_the_next_pull_sees() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let certs = d.join("certs.d");
    std::fs::create_dir_all(certs.join("r.example")).unwrap();
    let (_fake, agent, _proxy) = crate::support::fake_runtime_agent(
        d,
        credgate_testbed::fake_runtime::Answers::default(),
        &[
            "--cri-proxy-trusted-mirror",
            "r.example=m.example",
            "--cri-proxy-hosts-dir",
            certs.to_str().unwrap(),
        ],
    )
    .await;
    let trust = || {
        let out = agent.credgate(&["explain", "-o", "json", "r.example/team/app:v1"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["cri_mirror_trust"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    assert!(trust().contains("no mirror is configured"), "{}", trust());
    std::fs::write(
        certs.join("r.example/hosts.toml"),
        "[host.\"https://evil.example\"]\n",
    )
    .unwrap();
    credgate_testbed::eventually(
        "the untrusted mirror is seen",
        std::time::Duration::from_secs(20),
        || trust().contains("not trusted with its pods' credentials: evil.example"),
    );
    std::fs::write(
        certs.join("r.example/hosts.toml"),
        "[host.\"https://m.example\"]\n",
    )
    .unwrap();
    credgate_testbed::eventually(
        "the trusted mirror is seen",
        std::time::Duration::from_secs(20),
        || trust().contains("trusted mirrors (m.example)"),
    );
}
