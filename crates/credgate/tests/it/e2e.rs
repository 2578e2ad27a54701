//! End to end with real parts: Debian's `docker-registry` on 127.0.0.1 with htpasswd auth, a
//! test image pushed by skopeo, `credgate serve` with a plugin script that returns the
//! registry's credentials, and real `skopeo inspect` calling `docker-credential-credgate`
//! through an auth file's `credHelpers`.

use std::path::Path;

use crate::support::{
    helper_get, oci_image, push, skopeo_inspect, text, write_script, Agent, Registry,
};

const USER: &str = "alice";
const PASSWORD: &str = "e2e-Pa55word-not-for-logs";

fn plugin_runs(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// A provider whose plugin answers with the password currently in `dir/password`.
fn provider(dir: &Path, registry: &Registry) -> std::path::PathBuf {
    let bin = dir.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    let host = registry.host();
    write_script(
        &bin.join("registry-login"),
        &format!(
            r#"cat >/dev/null
echo run >> '{runs}'
password=$(cat '{pw}')
printf '{{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Registry","cacheDuration":"10m","auth":{{"{host}":{{"username":"{USER}","password":"%s"}}}}}}' "$password""#,
            runs = dir.join("runs").display(),
            pw = dir.join("password").display(),
        ),
    );
    let config = dir.join("providers.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: registry-login\n  matchImages: [\"{host}\"]\n  defaultCacheDuration: 10m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n"
        ),
    )
    .unwrap();
    config
}

#[test]
fn skopeo_pulls_through_the_docker_credential_helper() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let registry = Registry::start(d, USER, PASSWORD);
    oci_image(d);
    push(d, &registry, "team-a/app", USER, PASSWORD);

    std::fs::write(d.join("password"), PASSWORD).unwrap();
    let config = provider(d, &registry);
    let agent = Agent::start(
        d,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            d.join("plugins").to_str().unwrap(),
        ],
    );
    let image = format!("{}/team-a/app:v1", registry.host());
    let authfile = d.join("auth.json");
    std::fs::write(
        &authfile,
        format!(
            r#"{{"credHelpers": {{"{}": "credgate"}}}}"#,
            registry.host()
        ),
    )
    .unwrap();

    // The right credentials: skopeo reads the manifest.
    let out = skopeo_inspect(&authfile, &image, &agent.socket);
    assert!(out.status.success(), "skopeo failed: {}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("\"Digest\": \"sha256:"),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(plugin_runs(d), 1);

    // Repeated pulls within the TTL do not rerun the plugin.
    for _ in 0..3 {
        let out = skopeo_inspect(&authfile, &image, &agent.socket);
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    assert_eq!(plugin_runs(d), 1, "served from the agent's cache");

    // The helper's own answer.
    let out = agent.helper_get(&registry.host());
    assert!(out.status.success());
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["Username"], USER);
    assert_eq!(answer["Secret"], PASSWORD);
    assert_eq!(answer["ServerURL"], registry.host());

    // The plugin now returns a wrong password; a reload of a changed config starts with empty
    // caches (one of unchanged files keeps them).
    std::fs::write(d.join("password"), "wrong-password").unwrap();
    let out = agent.credgate(&["ctl", "reload"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = skopeo_inspect(&authfile, &image, &agent.socket);
    assert!(out.status.success(), "unchanged config: cache kept");
    assert_eq!(plugin_runs(d), 1);
    let mut yaml = std::fs::read_to_string(&config).unwrap();
    yaml.push_str("# changed\n");
    std::fs::write(&config, yaml).unwrap();
    let out = agent.credgate(&["ctl", "reload"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = skopeo_inspect(&authfile, &image, &agent.socket);
    assert!(!out.status.success());
    let err = text(&out.stderr).to_lowercase();
    assert!(err.contains("unauthorized"), "{err}");
    assert_eq!(plugin_runs(d), 2);

    // No provider matches this host: the helper says so, and skopeo goes on anonymously (and
    // is refused by the registry, which needs auth).
    let other = format!("localhost:{}", registry.port);
    let out = agent.helper_get(&other);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stdout).trim(),
        "credentials not found in native keychain"
    );
    std::fs::write(
        &authfile,
        format!(r#"{{"credHelpers": {{"{other}": "credgate"}}}}"#),
    )
    .unwrap();
    let out = skopeo_inspect(&authfile, &format!("{other}/team-a/app:v1"), &agent.socket);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    // The helper's "not found" is no error: skopeo goes on anonymously. No source matched the
    // host, so the helper writes nothing that skopeo would show like an error...
    assert!(
        !err.contains("lookup failed") && !err.contains("cannot reach"),
        "the helper's answer is not an error: {err}"
    );
    assert!(
        !err.contains("credgate: no credentials for"),
        "a mismatch of every source is no news on an anonymous pull: {err}"
    );
    // ... unless asked, then it says which providers it tried.
    let asked = crate::support::output_with_stdin(
        std::process::Command::new(env!("CARGO_BIN_EXE_docker-credential-credgate"))
            .arg("get")
            .env("CREDGATE_SOCKET", &agent.socket)
            .env("CREDGATE_HELPER_EXPLAIN", "1")
            .stderr(std::process::Stdio::piped()),
        other.as_bytes(),
    );
    let told = text(&asked.stderr);
    assert!(
        told.contains("credgate: no credentials for localhost:")
            && told.contains("provider registry-login: 127.0.0.1:")
            && told.contains("does not match"),
        "the helper says which providers it tried: {told}"
    );
    assert!(
        err.to_lowercase().contains("unauthorized") || err.contains("authentication required"),
        "{err}"
    );

    // Secrets never reach the agent's log.
    let status = agent.stop();
    assert!(status.success(), "agent exit: {status}");
    let log = std::fs::read_to_string(d.join("agent.log")).unwrap();
    assert!(!log.contains(PASSWORD), "{log}");
}

#[test]
fn helper_without_an_agent_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody-here.sock");
    let out = helper_get(&socket, "127.0.0.1:5000");
    assert_eq!(out.status.code(), Some(1));
    let msg = text(&out.stdout);
    assert!(
        msg.starts_with("credgate: cannot reach the agent at ") && msg.contains("nobody-here.sock"),
        "{msg}"
    );
    // The docker CLI hides the helper's stdout: the reason is on stderr too.
    assert_eq!(text(&out.stderr), msg);
}

/// Docker Hub as the docker CLI and SDK ask for it (`https://index.docker.io/v1/`) is served by
/// a provider that matches `docker.io`.
#[test]
fn docker_hubs_server_names_are_docker_io() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bin = d.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    write_script(
        &bin.join("hub"),
        r#"cat >/dev/null
echo '{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Registry","cacheDuration":"10m","auth":{"docker.io":{"username":"hubuser","password":"hub-Pa55"}}}'"#,
    );
    let config = d.join("providers.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: hub\n  matchImages: [docker.io]\n  defaultCacheDuration: 10m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
    )
    .unwrap();
    let agent = Agent::start(
        d,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            bin.to_str().unwrap(),
        ],
    );
    for server in [
        "https://index.docker.io/v1/",
        "index.docker.io",
        "registry-1.docker.io",
        "docker.io",
    ] {
        let out = agent.helper_get(server);
        assert!(out.status.success(), "{server}: {}", text(&out.stdout));
        let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(answer["Username"], "hubuser", "{server}");
        assert_eq!(answer["ServerURL"], server, "echoed as sent");
    }
    assert!(agent.stop().success());
}

#[test]
fn erase_is_refused_unless_opted_out_and_store_reads_a_bounded_input() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody-here.sock");
    let helper = |verb: &str, ignore: bool, input: &[u8]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_docker-credential-credgate"));
        cmd.arg(verb)
            .env("CREDGATE_SOCKET", &socket)
            .env_remove("CREDGATE_HELPER_ERASE")
            .stderr(std::process::Stdio::piped());
        if ignore {
            cmd.env("CREDGATE_HELPER_ERASE", "ignore");
        }
        crate::support::output_with_stdin(&mut cmd, input)
    };
    let out = helper("erase", false, b"https://index.docker.io/v1/");
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).contains("read-only"));
    assert!(text(&out.stderr).contains("read-only"));
    let out = helper("erase", true, b"https://index.docker.io/v1/");
    assert!(out.status.success(), "{}", text(&out.stdout));
    assert!(out.stdout.is_empty());
    // Other spellings of yes are understood; anything else is said to be ignored.
    for (value, ok) in [
        ("IGNORE", true),
        ("true", true),
        ("1", true),
        ("maybe", false),
    ] {
        let out = crate::support::output_with_stdin(
            std::process::Command::new(env!("CARGO_BIN_EXE_docker-credential-credgate"))
                .arg("erase")
                .env("CREDGATE_SOCKET", &socket)
                .env("CREDGATE_HELPER_ERASE", value)
                .stderr(std::process::Stdio::piped()),
            b"https://index.docker.io/v1/",
        );
        assert_eq!(out.status.success(), ok, "{value}");
        if !ok {
            assert!(text(&out.stderr).contains("is not understood"), "{value}");
        }
    }
    // store stays refused whatever the setting; a huge input is not read whole.
    let huge = vec![b'{'; 32 << 20];
    let out = helper("store", true, &huge);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).contains("read-only"));
}

#[test]
fn helper_refuses_bad_input_before_calling_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody-here.sock");
    let cases: [(&[u8], &str); 4] = [
        (b"\n", "credgate: no server URL on stdin"),
        (
            b"\xff\xfe",
            "credgate: the server URL on stdin is not UTF-8",
        ),
        (
            b"reg.example:port",
            "credgate: the server URL on stdin is not a registry host",
        ),
        (
            &[b'a'; 100_000],
            "credgate: the server URL on stdin is longer than 8192 bytes",
        ),
    ];
    for (input, want) in cases {
        let out = helper_get(&socket, input);
        assert_eq!(out.status.code(), Some(1));
        let msg = text(&out.stdout);
        assert!(msg.starts_with(want), "{msg}");
    }
}

/// A reader that goes away before the answer (a closed pipe on stdout, and on stderr too) is a
/// clean exit 1 with a line on stderr where there is one, never a panic (exit 101). The read
/// ends are closed before the helper starts, so every write meets the broken pipe.
#[test]
fn a_closed_pipe_is_a_clean_exit() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody-here.sock");
    for (verb, input) in [
        ("version", &b""[..]),
        ("list", b""),
        ("--help", b""),
        ("get", b"registry.example.com"),
        ("erase", b"registry.example.com"),
    ] {
        for stderr_closed in [false, true] {
            let (closed_read, closed_write) = rustix::pipe::pipe().unwrap();
            drop(closed_read);
            let mut cmd =
                std::process::Command::new(env!("CARGO_BIN_EXE_docker-credential-credgate"));
            cmd.arg(verb)
                .env("CREDGATE_SOCKET", &socket)
                .env_remove("CREDGATE_HELPER_ERASE")
                .stdout(std::process::Stdio::from(closed_write.try_clone().unwrap()));
            if stderr_closed {
                cmd.stderr(std::process::Stdio::from(closed_write));
            } else {
                cmd.stderr(std::process::Stdio::piped());
            }
            let mut child = cmd.stdin(std::process::Stdio::piped()).spawn().unwrap();
            {
                use std::io::Write;
                let _ = child.stdin.take().unwrap().write_all(input);
            }
            let out = child.wait_with_output().unwrap();
            assert_eq!(out.status.code(), Some(1), "{verb}: {}", text(&out.stderr));
            if !stderr_closed {
                assert!(
                    text(&out.stderr).contains("cannot write the answer to stdout"),
                    "{verb}: {}",
                    text(&out.stderr)
                );
            }
        }
    }
}
