//! `credgate-credential-provider` as the kubelet runs it: a real agent (`credgate serve`) with
//! real plugin scripts, the bridge executed with a request on stdin, its stdout read as the
//! kubelet reads a plugin's.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::support::{output_with_stdin, text, write_script, Agent};

const SECRET: &str = "bridge-Pa55word-not-for-logs";
const V1: &str = "credentialprovider.kubelet.k8s.io/v1";
const VERSIONS: [&str; 3] = [
    "credentialprovider.kubelet.k8s.io/v1alpha1",
    "credentialprovider.kubelet.k8s.io/v1beta1",
    V1,
];

/// A plugin that records each request it gets and answers `user`/SECRET for `pattern`.
fn plugin(dir: &Path, name: &str, key: &str, pattern: &str, user: &str) {
    write_script(
        &dir.join("plugins").join(name),
        &format!(
            r#"req=$(cat)
echo "$req" >> '{runs}'
version=$(printf '%s' "$req" | sed -n 's/.*"apiVersion":"\([^"]*\)".*/\1/p')
printf '{{"kind":"CredentialProviderResponse","apiVersion":"%s","cacheKeyType":"{key}","cacheDuration":"10m","auth":{{"{pattern}":{{"username":"{user}","password":"{SECRET}"}}}}}}' "$version""#,
            runs = dir.join(format!("{name}.runs")).display(),
        ),
    );
}

fn runs(dir: &Path, name: &str) -> Vec<String> {
    std::fs::read_to_string(dir.join(format!("{name}.runs")))
        .map(|s| s.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// A provider config: `(name, matchImages, wire version, extra YAML)`.
fn config(dir: &Path, providers: &[(&str, &str, &str, &str)]) -> PathBuf {
    let mut yaml = String::from(
        "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n",
    );
    for (name, matches, version, extra) in providers {
        yaml.push_str(&format!(
            "- name: {name}\n  matchImages: [\"{matches}\"]\n  defaultCacheDuration: 10m\n  apiVersion: {version}\n{extra}"
        ));
    }
    let path = dir.join("providers.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

fn start(dir: &Path, providers: &[(&str, &str, &str, &str)]) -> Agent {
    std::fs::create_dir_all(dir.join("plugins")).unwrap();
    for (name, matches, _, _) in providers {
        plugin(dir, name, "Registry", matches, &format!("{name}-user"));
    }
    let config = config(dir, providers);
    Agent::start(
        dir,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            dir.join("plugins").to_str().unwrap(),
        ],
    )
}

fn request(version: &str, image: &str) -> String {
    format!(r#"{{"kind":"CredentialProviderRequest","apiVersion":"{version}","image":"{image}"}}"#)
}

fn bridge<S: AsRef<std::ffi::OsStr>>(socket: &Path, args: &[S], stdin: &str) -> Output {
    output_with_stdin(
        Command::new(crate::support::bridge_bin())
            .args(args)
            .env("CREDGATE_SOCKET", socket)
            .stderr(Stdio::piped()),
        stdin.as_bytes(),
    )
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn go_seconds(d: &str) -> f64 {
    // The bridge writes at most minutes and seconds (`8m59.987s`, `0s`).
    let (m, rest) = d.split_once('m').unwrap_or(("0", d));
    m.parse::<f64>().unwrap() * 60.0 + rest.trim_end_matches('s').parse::<f64>().unwrap_or(0.0)
}

#[test]
fn answers_in_the_requests_version_with_the_providers_key_and_a_duration_inside_expiry() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let agent = start(d, &[("reg", "reg.example.com", V1, "")]);
    for version in VERSIONS {
        let out = bridge(
            &agent.socket,
            &["--provider", "reg"],
            &request(version, "reg.example.com/team/app:v1"),
        );
        let v = json(&out);
        assert_eq!(v["kind"], "CredentialProviderResponse");
        assert_eq!(v["apiVersion"], version);
        assert_eq!(v["cacheKeyType"], "Registry");
        let auth = &v["auth"]["reg.example.com"];
        assert_eq!(
            (auth["username"].as_str(), auth["password"].as_str()),
            (Some("reg-user"), Some(SECRET))
        );
        // 10 minutes of life, a lead of 1 minute: the agent would let the kubelet keep it 9
        // minutes; the bridge caps that at 5 (--max-cache-duration), so that a rotated
        // credential leaves the kubelet's cache within it.
        assert_eq!(v["cacheDuration"], "5m0s");
        // With a longer cap, the agent's own figure.
        let longer = json(&bridge(
            &agent.socket,
            &["--provider", "reg", "--max-cache-duration", "1h"],
            &request(version, "reg.example.com/team/app:v1"),
        ));
        let secs = go_seconds(longer["cacheDuration"].as_str().unwrap());
        assert!(
            (500.0..=540.0).contains(&secs),
            "{}",
            longer["cacheDuration"]
        );
        assert!(!text(&out.stderr).contains(SECRET));
    }
    assert_eq!(
        runs(d, "reg").len(),
        1,
        "one plugin run, then the agent's cache"
    );
    // The provider may also be named by the program's file name (a link in the kubelet's
    // plugin directory).
    let link = d.join("reg");
    std::os::unix::fs::symlink(crate::support::bridge_bin(), &link).unwrap();
    let out = output_with_stdin(
        Command::new(&link)
            .env("CREDGATE_SOCKET", &agent.socket)
            .stderr(Stdio::piped()),
        request(V1, "reg.example.com/x:v1").as_bytes(),
    );
    assert_eq!(
        json(&out)["auth"]["reg.example.com"]["username"],
        "reg-user"
    );
}

#[test]
fn nothing_matching_is_an_empty_auth_and_exit_0() {
    let dir = tempfile::tempdir().unwrap();
    let agent = start(dir.path(), &[("reg", "reg.example.com", V1, "")]);
    let out = bridge(
        &agent.socket,
        &["--provider", "reg"],
        &request(V1, "other.example.com/app:v1"),
    );
    let v = json(&out);
    assert_eq!(v["auth"], serde_json::json!({}));
    assert_eq!(v["cacheDuration"], "0s");
    assert!(runs(dir.path(), "reg").is_empty());
}

#[test]
fn a_service_account_token_reaches_the_provider_as_the_kubelet_would_send_it() {
    use base64::Engine as _;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let attributes = "  tokenAttributes:\n    serviceAccountTokenAudience: registry.example.com\n    cacheType: Token\n    requireServiceAccount: true\n    requiredServiceAccountAnnotationKeys: [example.com/role]\n";
    let second = "  tokenAttributes:\n    serviceAccountTokenAudience: second-audience\n    cacheType: ServiceAccount\n    requireServiceAccount: true\n";
    let agent = start(
        d,
        &[
            ("sa", "reg.example.com", V1, attributes),
            ("sa2", "reg.example.com", V1, second),
        ],
    );
    let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let token = format!(
        "{}.{}.signature",
        b(r#"{"alg":"RS256"}"#),
        b(
            r#"{"aud":["registry.example.com"],"sub":"system:serviceaccount:team-a:puller","kubernetes.io":{"namespace":"team-a","serviceaccount":{"name":"puller","uid":"0b5e"}}}"#
        )
    );
    let req = format!(
        r#"{{"kind":"CredentialProviderRequest","apiVersion":"{V1}","image":"reg.example.com/team/app:v1","serviceAccountToken":"{token}","serviceAccountAnnotations":{{"example.com/role":"puller"}}}}"#
    );
    let out = bridge(&agent.socket, &["--provider", "sa"], &req);
    assert_eq!(json(&out)["auth"]["reg.example.com"]["username"], "sa-user");
    let seen = runs(d, "sa");
    assert_eq!(seen.len(), 1);
    let sent: serde_json::Value = serde_json::from_str(&seen[0]).unwrap();
    assert_eq!(sent["serviceAccountToken"], token.as_str());
    assert_eq!(
        sent["serviceAccountAnnotations"]["example.com/role"],
        "puller"
    );
    assert_eq!(sent["image"], "reg.example.com/team/app");
    assert!(!text(&out.stderr).contains(&token));
    // A second entry with another audience: the kubelet mints it another token, and that
    // provider, and only it, receives it.
    let token2 = format!(
        "{}.{}.signature",
        b(r#"{"alg":"RS256"}"#),
        b(r#"{"aud":["second-audience"],"sub":"system:serviceaccount:team-a:puller"}"#)
    );
    let req2 = format!(
        r#"{{"kind":"CredentialProviderRequest","apiVersion":"{V1}","image":"reg.example.com/team/app:v1","serviceAccountToken":"{token2}"}}"#
    );
    let out = bridge(&agent.socket, &["--provider", "sa2"], &req2);
    assert_eq!(
        json(&out)["auth"]["reg.example.com"]["username"],
        "sa2-user"
    );
    let seen2 = runs(d, "sa2");
    assert_eq!(seen2.len(), 1);
    let sent2: serde_json::Value = serde_json::from_str(&seen2[0]).unwrap();
    assert_eq!(sent2["serviceAccountToken"], token2.as_str());
    assert_eq!(
        runs(d, "sa").len(),
        1,
        "the first provider never saw the second token"
    );
    // Without a token the provider, which requires one, is not run.
    let out = bridge(
        &agent.socket,
        &["--provider", "sa"],
        &request(V1, "reg.example.com/team/app:v1"),
    );
    assert_eq!(json(&out)["auth"], serde_json::json!({}));
    assert_eq!(runs(d, "sa").len(), 1);
}

/// The bridge's arguments for provider `reg` with its in-process fallback from `config`.
fn fallback(config: &Path, d: &Path) -> Vec<String> {
    [
        "--provider",
        "reg",
        "--fallback-in-process",
        config.to_str().unwrap(),
        "--image-credential-provider-bin-dir",
        d.join("plugins").to_str().unwrap(),
    ]
    .map(str::to_owned)
    .to_vec()
}

#[test]
fn agent_down_is_one_line_on_stderr_or_the_fallback_runs_the_provider() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("plugins")).unwrap();
    plugin(d, "reg", "Registry", "reg.example.com", "reg-user");
    let config = config(d, &[("reg", "reg.example.com", V1, "")]);
    let nobody = d.join("nobody.sock");
    let out = bridge(
        &nobody,
        &["--provider", "reg"],
        &request(V1, "reg.example.com/app:v1"),
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("credgate-credential-provider: cannot reach the agent at "),
        "{err}"
    );
    assert!(out.stdout.is_empty());
    let out = bridge(
        &nobody,
        &fallback(&config, d),
        &request(V1, "reg.example.com/app:v1"),
    );
    let v = json(&out);
    assert_eq!(v["auth"]["reg.example.com"]["password"], SECRET);
    assert_eq!(v["cacheKeyType"], "Registry");
    assert_eq!(
        runs(d, "reg").len(),
        1,
        "the fallback ran the plugin itself"
    );
}

/// An agent that is there but refuses the bridge (every connection slot taken: it closes a
/// new connection at once) is one line on stderr, or the fallback's answer.
#[test]
fn an_agent_that_refuses_the_connection_gets_the_fallback_to_answer() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("plugins")).unwrap();
    plugin(d, "reg", "Registry", "reg.example.com", "reg-user");
    let config = config(d, &[("reg", "reg.example.com", V1, "")]);
    let full = d.join("full.sock");
    let listener = std::os::unix::net::UnixListener::bind(&full).unwrap();
    std::thread::spawn(move || {
        for c in listener.incoming() {
            drop(c);
        }
    });
    let out = bridge(
        &full,
        &["--provider", "reg"],
        &request(V1, "reg.example.com/app:v1"),
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("refused the call"), "{err}");
    let out = bridge(
        &full,
        &fallback(&config, d),
        &request(V1, "reg.example.com/app:v1"),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(json(&out)["auth"]["reg.example.com"]["password"], SECRET);
    assert_eq!(
        runs(d, "reg").len(),
        1,
        "the fallback ran the plugin itself"
    );
}

/// What the failing plugin writes on stderr.
const STDERR: &str = "diagnostics-of-the-bad-plugin";

#[test]
fn a_failing_provider_is_an_error_without_its_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let agent = start(d, &[("bad", "reg.example.com", V1, "")]);
    write_script(
        &d.join("plugins/bad"),
        &format!(
            "cat >/dev/null\necho '{{\"password\":\"{SECRET}\"}}'\necho '{STDERR}' >&2\nexit 3"
        ),
    );
    let out = bridge(
        &agent.socket,
        &["--provider", "bad"],
        &request(V1, "reg.example.com/app:v1"),
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("plugin bad"), "{err}");
    assert!(!err.contains(SECRET) && !text(&out.stdout).contains(SECRET));
    // stderr is diagnostics: the agent's debug log has it (SECURITY.md), no error does.
    assert!(!err.contains(STDERR), "{err}");
    assert!(agent.log_text().contains(STDERR));
    // A provider the agent does not have is refused with its name.
    let out = bridge(
        &agent.socket,
        &["--provider", "nope"],
        &request(V1, "reg.example.com/app:v1"),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no provider \"nope\""),
        "{}",
        text(&out.stderr)
    );
    // Garbage on stdin.
    let out = bridge(&agent.socket, &["--provider", "bad"], "{not json");
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("not a JSON object"));
}

/// The kubelet's burst: 100 bridge processes at once for 100 images of one registry, behind a
/// `Registry`-keyed plugin: one plugin run in the agent.
#[test]
fn a_burst_of_a_hundred_bridge_processes_costs_one_plugin_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let agent = start(d, &[("reg", "reg.example.com", V1, "")]);
    // A plugin slow enough that every bridge arrives while its run is pending.
    write_script(
        &d.join("plugins/reg"),
        &format!(
            r#"cat >/dev/null
echo run >> '{runs}'
sleep 0.5
printf '{{"kind":"CredentialProviderResponse","apiVersion":"{V1}","cacheKeyType":"Registry","cacheDuration":"10m","auth":{{"reg.example.com":{{"username":"u","password":"{SECRET}"}}}}}}'"#,
            runs = d.join("reg.runs").display()
        ),
    );
    let children: Vec<_> = (0..100)
        .map(|i| {
            let mut child = Command::new(crate::support::bridge_bin())
                .args(["--provider", "reg"])
                .env("CREDGATE_SOCKET", &agent.socket)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(request(V1, &format!("reg.example.com/team/app-{i}:v1")).as_bytes())
                .unwrap();
            child
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert_eq!(json(&out)["auth"]["reg.example.com"]["username"], "u");
    }
    assert_eq!(runs(d, "reg").len(), 1);
    let status = agent.credgate(&["ctl", "status", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["providers"][0]["runs"], 1);
}

/// The same config through the bridge (as a kubelet merges its provider entries' answers with
/// its own docker config) and through `credgate get` in-process gives the same credentials in
/// the same order, for a table of images over overlapping patterns.
#[test]
fn the_bridge_and_credgate_get_agree_on_order() {
    use credgate_core::keyring::{self, AuthSet};
    use credgate_core::pattern::{Pattern, Target};
    use credgate_core::reference::ImageRef;
    use credgate_core::wire::AuthConfig;
    use secrecy::{ExposeSecret, SecretString};

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("plugins")).unwrap();
    // (provider, matchImages, auth keys it answers with)
    let providers: [(&str, &str, &[&str]); 3] = [
        ("p1", "reg.example.com", &["reg.example.com"]),
        (
            "p2",
            "*.example.com",
            &["*.example.com", "reg.example.com/team"],
        ),
        (
            "p3",
            "reg.example.com/team",
            &["reg.example.com/team/app", "reg.example.com"],
        ),
    ];
    for (name, _, keys) in providers {
        let auth: Vec<String> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                format!(r#""{k}":{{"username":"{name}-{i}","password":"{name}-{i}-pw"}}"#)
            })
            .collect();
        write_script(
            &d.join("plugins").join(name),
            &format!(
                "cat >/dev/null\nprintf '%s' '{{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"{V1}\",\"cacheKeyType\":\"Image\",\"cacheDuration\":\"10m\",\"auth\":{{{}}}}}'",
                auth.join(",")
            ),
        );
    }
    let config = config(d, &providers.map(|(n, m, _)| (n, m, V1, "")));
    let docker = d.join("config.json");
    std::fs::write(
        &docker,
        r#"{"auths":{"reg.example.com":{"username":"docker-0","password":"docker-0-pw"},"https://x.example.com/v1/":{"username":"docker-1","password":"docker-1-pw"}}}"#,
    )
    .unwrap();
    let agent = Agent::start(
        d,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            d.join("plugins").to_str().unwrap(),
        ],
    );
    let images = [
        "reg.example.com/team/app:v1",
        "reg.example.com/team/db:v2",
        "reg.example.com/other:v1",
        "x.example.com/y:v1",
        "elsewhere.io/z:v1",
    ];
    let docker_set = {
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&docker).unwrap()).unwrap();
        let items = v["auths"].as_object().unwrap().iter().map(|(k, a)| {
            let key = keyring::normalize_key(k).unwrap();
            (
                key,
                AuthConfig {
                    username: a["username"].as_str().unwrap().to_owned(),
                    password: SecretString::from(a["password"].as_str().unwrap().to_owned()),
                },
            )
        });
        AuthSet::new(items).0
    };
    for image in images {
        // The kubelet: every entry whose matchImages match asks its plugin (here: the bridge).
        let name = ImageRef::parse(image).unwrap().name().to_owned();
        let target = Target::from_image_name(&name);
        let mut sets = vec![docker_set.clone()];
        for (provider, matches, _) in providers {
            if !Pattern::parse(matches).unwrap().matches(&target) {
                sets.push(AuthSet::new(Vec::new()).0);
                continue;
            }
            let out = bridge(
                &agent.socket,
                &["--provider", provider],
                &request(V1, &name),
            );
            let v = json(&out);
            let items = v["auth"].as_object().unwrap().iter().map(|(k, a)| {
                (
                    k.clone(),
                    AuthConfig {
                        username: a["username"].as_str().unwrap().to_owned(),
                        password: SecretString::from(a["password"].as_str().unwrap().to_owned()),
                    },
                )
            });
            sets.push(AuthSet::new(items).0);
        }
        let sources: Vec<(usize, &AuthSet)> = sets.iter().enumerate().collect();
        let kubelet: Vec<(String, String)> = keyring::select(&name, &sources)
            .iter()
            .map(|(_, e)| {
                (
                    e.auth.username.clone(),
                    e.auth.password.expose_secret().to_owned(),
                )
            })
            .collect();
        // credgate get, in-process, with the same docker config.
        let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
            .args(["get", "-o", "json", "--docker-config"])
            .arg(&docker)
            .arg("--image-credential-provider-config")
            .arg(&config)
            .arg("--image-credential-provider-bin-dir")
            .arg(d.join("plugins"))
            .arg(image)
            .env_remove("CREDGATE_SOCKET")
            .output()
            .unwrap();
        let got: Vec<(String, String)> = if out.stdout.is_empty() {
            Vec::new()
        } else {
            let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            rows["credentials"]
                .as_array()
                .or_else(|| rows.as_array())
                .unwrap()
                .iter()
                .map(|r| {
                    (
                        r["username"].as_str().unwrap().to_owned(),
                        r["password"].as_str().unwrap().to_owned(),
                    )
                })
                .collect()
        };
        assert_eq!(kubelet, got, "{image}");
        if image.starts_with("reg.example.com/team/app") {
            assert!(
                kubelet.len() >= 4,
                "the table exercises overlaps: {kubelet:?}"
            );
        }
    }
}

/// After README's migration the kubelet's plugin directory holds the bridge under each
/// provider's name: given that directory, the agent would run its own bridge as the plugin,
/// which asks the agent, which joins its own run, and every lookup would wait the plugin
/// timeout. The agent refuses such a provider at start and on reload (the old config keeps
/// serving), `check-config` reports it (and passes: in the kubelet's config it is right), and
/// `explain` in-process refuses it, whatever the bridge's file is called (a link or a copy).
#[test]
fn a_provider_whose_plugin_is_the_bridge_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let kubelet_dir = d.join("kubelet-plugins");
    std::fs::create_dir_all(&kubelet_dir).unwrap();
    std::fs::copy(
        crate::support::bridge_bin(),
        kubelet_dir.join("credgate-credential-provider"),
    )
    .unwrap();
    std::os::unix::fs::symlink(
        kubelet_dir.join("credgate-credential-provider"),
        kubelet_dir.join("p"),
    )
    .unwrap();
    let providers = [("p", "reg.example", V1, "")];
    std::fs::create_dir_all(d.join("plugins")).unwrap();
    plugin(d, "p", "Registry", "reg.example", "p-user");
    let config = config(d, &providers);
    let refused = |out: &Output| {
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("credgate's kubelet bridge"), "{err}");
    };
    let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(["serve", "--no-docker-config", "--socket"])
        .arg(d.join("loop.sock"))
        .arg("--state-dir")
        .arg(d.join("loop-state"))
        .arg("--image-credential-provider-config")
        .arg(&config)
        .arg("--image-credential-provider-bin-dir")
        .arg(&kubelet_dir)
        .output()
        .unwrap();
    refused(&out);
    let credgate = |args: &[&std::ffi::OsStr]| {
        Command::new(env!("CARGO_BIN_EXE_credgate"))
            .args(args)
            .env_remove("CREDGATE_SOCKET")
            .output()
            .unwrap()
    };
    // check-config reports it (the kubelet's config is rightly the bridge's), exit 0.
    let checked = credgate(&[
        "check-config".as_ref(),
        config.as_os_str(),
        "--image-credential-provider-bin-dir".as_ref(),
        kubelet_dir.as_os_str(),
    ]);
    assert!(checked.status.success(), "{}", text(&checked.stderr));
    assert!(
        text(&checked.stderr).contains("credgate's kubelet bridge")
            && text(&checked.stderr).contains("refused in the agent's"),
        "{}",
        text(&checked.stderr)
    );
    refused(&credgate(&[
        "explain".as_ref(),
        "reg.example/app".as_ref(),
        "--image-credential-provider-config".as_ref(),
        config.as_os_str(),
        "--image-credential-provider-bin-dir".as_ref(),
        kubelet_dir.as_os_str(),
    ]));
    // A copy under the provider's own name in the agent's directory, found on reload.
    let agent = start(d, &providers);
    std::fs::remove_file(d.join("plugins/p")).unwrap();
    std::fs::copy(crate::support::bridge_bin(), d.join("plugins/p")).unwrap();
    std::fs::write(
        &config,
        std::fs::read_to_string(&config).unwrap() + "# changed\n",
    )
    .unwrap();
    let out = agent.credgate(&["ctl", "reload"]);
    refused(&out);
    assert!(agent.log_text().contains("credgate's kubelet bridge"));
    assert!(agent.stop().success());
}

/// An answer that holds a pod's captured credential (`kubelet-config --captured-images`) is
/// keyed by image: nydus-snapshotter's own credential code (pkg/auth, v0.16.1, whose cache
/// is the kubelet's: image, then registry, then global keys, and matches auth keys by path
/// prefix), run on that config, hands the captured password to its repository's image only,
/// never to `app-evil`, `app/sub` or `application` of the same registry, which get the node's.
/// Needs root (containerd, for the capture).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn answers_with_a_captured_credential_are_keyed_by_image() {
    use credgate_testbed::cri::{call, pull_request, PullImageResponse, PULL_IMAGE};
    crate::support::needs_containerd();
    const POD_PASSWORD: &str = "pod-Pa55word-not-for-logs";
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (registry, containerd) =
        crate::support::registry_and_containerd(d, "pod-user", POD_PASSWORD);
    let host = registry.host();
    // The node's provider for the whole registry, keyed by registry.
    std::fs::create_dir_all(d.join("plugins")).unwrap();
    plugin(d, "node", "Registry", &host, "node-user");
    let config = config(d, &[("node", &host, V1, "")]);
    let (agent, proxy) = crate::support::proxy_agent_with(
        d,
        &containerd.socket,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            d.join("plugins").to_str().unwrap(),
        ],
    );
    let image = format!("{host}/team/app:v1");
    let _: PullImageResponse = call(
        &proxy,
        PULL_IMAGE,
        pull_request(&image, Some(("pod-user", POD_PASSWORD)), "team-a"),
    )
    .await
    .expect("the pod's pull succeeds and is captured");
    let snapshotter = d.join("nydus");
    let out = agent.credgate(&[
        "kubelet-config",
        "--image-credential-provider-config",
        config.to_str().unwrap(),
        "--image-credential-provider-bin-dir",
        d.join("plugins").to_str().unwrap(),
        "--captured-images",
        &host,
        "--bridge",
        crate::support::bridge_bin().to_str().unwrap(),
        "--link-dir",
        snapshotter.join("bin").to_str().unwrap(),
        "--output",
        snapshotter.join("config.yaml").to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // A config that answers with pods' secrets never calls itself the kubelet's.
    let written = std::fs::read_to_string(snapshotter.join("config.yaml")).unwrap();
    assert!(
        written.contains("never the kubelet's") && !written.contains("The kubelet"),
        "{written}"
    );
    let nydus = crate::support::foreign::built(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/kubelet-cache")
            .display()
            .to_string(),
    )
    .join("nydusauth");
    let refs = [
        image.clone(),
        format!("{host}/team/app-evil:v1"),
        format!("{host}/team/app/sub:v1"),
        format!("{host}/team/application:v1"),
        image.clone(),
    ];
    let out = Command::new(nydus)
        .arg(snapshotter.join("config.yaml"))
        .arg(snapshotter.join("bin"))
        .args(&refs)
        .env("CREDGATE_SOCKET", &agent.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let got: Vec<String> = text(&out.stdout).lines().map(str::to_owned).collect();
    let want: Vec<String> = refs
        .iter()
        .zip([
            "pod-user",
            "node-user",
            "node-user",
            "node-user",
            "pod-user",
        ])
        .map(|(r, u)| format!("{r} {u}"))
        .collect();
    assert_eq!(got, want, "{}", text(&out.stderr));
    let log = agent.log_text();
    assert!(!log.contains(POD_PASSWORD) && !log.contains(SECRET));
    assert!(agent.stop().success());
}
