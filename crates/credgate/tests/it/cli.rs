//! The `credgate` binary end to end: the README's example, JSON and table output, exit codes
//! of `get`, `check-config` and `match`, and secrets kept off stderr.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn credgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(args)
        .current_dir(repo())
        .env_remove("CREDGATE_LOG")
        .env_remove("CREDGATE_SOCKET")
        .output()
        .expect("credgate runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

const EXAMPLE: [&str; 4] = [
    "--image-credential-provider-config",
    "examples/provider-config.yaml",
    "--image-credential-provider-bin-dir",
    "examples/plugins",
];

#[test]
fn readme_example_get_table() {
    let mut args = vec!["get", "--no-docker-config"];
    args.extend(EXAMPLE);
    args.push("registry.example.com/team/app:v1");
    let out = credgate(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("credgate-example-plugin") && stdout.contains("demo"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("demo-password"),
        "table hides passwords: {stdout}"
    );
}

#[test]
fn get_json_in_try_order() {
    let dir = tempfile::tempdir().unwrap();
    let docker = dir.path().join("config.json");
    std::fs::write(&docker, r#"{"auths":{"*.registry.example.com":{"username":"wild","password":"w"},"registry.example.com":{"username":"static","password":"s"}}}"#).unwrap();
    let mut args = vec![
        "get",
        "-o",
        "json",
        "--min-valid-for",
        "5m",
        "--docker-config",
        docker.to_str().unwrap(),
    ];
    args.extend(EXAMPLE);
    args.push("registry.example.com/team/app@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef");
    let out = credgate(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0]["provider"], docker.to_str().unwrap());
    assert_eq!(rows[0]["source"], "docker-config");
    assert_eq!(rows[0]["expires_at"], serde_json::Value::Null);
    assert_eq!(rows[1]["provider"], "credgate-example-plugin");
    assert_eq!(rows[1]["pattern"], "registry.example.com");
    assert_eq!(rows[1]["username"], "demo");
    assert_eq!(rows[1]["password"], "demo-password");
    let expires = rows[1]["expires_at"].as_str().unwrap();
    assert!(expires.ends_with('Z') && expires.contains('T'), "{expires}");
}

#[test]
fn get_without_credentials_exits_1() {
    let mut args = vec!["get", "--no-docker-config"];
    args.extend(EXAMPLE);
    args.push("quay.io/team/app");
    let out = credgate(&args);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("no credentials for quay.io/team/app"));
}

#[test]
fn get_with_a_failing_plugin_warns_without_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = dir.path().join("bad");
    std::fs::write(
        &plugin,
        "#!/bin/sh\ncat >/dev/null\necho '{\"password\":\"leaked-secret\"}'\nexit 4\n",
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let config = dir.path().join("c.yaml");
    std::fs::write(&config, "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: bad\n  matchImages: [reg.io]\n  defaultCacheDuration: 1m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n").unwrap();
    let out = credgate(&[
        "get",
        "-vvv",
        "--no-docker-config",
        "--image-credential-provider-config",
        config.to_str().unwrap(),
        "--image-credential-provider-bin-dir",
        dir.path().to_str().unwrap(),
        "reg.io/app",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("warning: plugin bad: exited with exit status: 4"),
        "{stderr}"
    );
    assert!(!stderr.contains("leaked-secret") && !text(&out.stdout).contains("leaked-secret"));
    // `ctl lookup` through an agent says the same, not an empty table.
    let agent = crate::support::Agent::start(
        dir.path(),
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            dir.path().to_str().unwrap(),
        ],
    );
    let out = agent.credgate(&["ctl", "lookup", "reg.io/app"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("warning: plugin bad: exited with exit status: 4")
            && stderr.contains("no credentials for reg.io/app"),
        "{stderr}"
    );
    assert!(!stderr.contains("leaked-secret") && !text(&out.stdout).contains("leaked-secret"));
}

/// Usage errors exit 2 (as clap's own do), with the reason; a config that cannot be read exits
/// 1 with its reason, for `get` as for `serve`.
#[test]
fn bad_input_exits_2_and_unreadable_files_exit_1_with_their_reason() {
    let out = credgate(&["get", "--no-docker-config", "Bad/Image"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).starts_with("error: invalid image reference \"Bad/Image\""),
        "{}",
        text(&out.stderr)
    );
    for flag in [
        ["--plugin-timeout", "banana"],
        ["--min-cache-duration", "5s"],
    ] {
        for command in ["get", "serve"] {
            let mut args = vec![command];
            args.extend(flag);
            if command == "get" {
                args.push("x.io/a");
            }
            let out = credgate(&args);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{args:?}: {}",
                text(&out.stderr)
            );
            assert!(text(&out.stderr).contains(flag[0]), "{}", text(&out.stderr));
        }
    }
    let out = credgate(&[
        "ctl",
        "check-access",
        "x.io/a",
        "--secret",
        "no-equals-sign",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--secret: expected"),
        "{}",
        text(&out.stderr)
    );
    let out = credgate(&[
        "get",
        "--image-credential-provider-config",
        "nope.yaml",
        "--image-credential-provider-bin-dir",
        ".",
        "x.io/a",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("nope.yaml"));
    // A docker config named on the command line must exist, as `serve` requires.
    let out = credgate(&["get", "--docker-config", "missing-config.json", "x.io/a"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot read missing-config.json: No such file or directory"),
        "{err}"
    );
    let out = credgate(&["check-config", "missing-providers.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(
        err.trim_end(),
        "error: cannot read missing-providers.yaml: No such file or directory (os error 2)"
    );
}

/// An agent that is not there: the cause once, not repeated by every layer.
#[test]
fn an_unreachable_agent_is_named_with_its_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody.sock");
    let out = credgate(&["ctl", "--socket", socket.to_str().unwrap(), "status"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("cannot reach the agent at"), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

#[test]
fn check_config_lists_every_problem() {
    let out = credgate(&[
        "check-config",
        "examples/provider-config.yaml",
        "--image-credential-provider-bin-dir",
        "examples/plugins",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("ok: 1 provider(s), config sha256:"));
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: a/b\n  matchImages: [\"https://x.io\", \"x:y\"]\n  apiVersion: nope\n").unwrap();
    let out = credgate(&["check-config", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let lines: Vec<String> = text(&out.stderr).lines().map(String::from).collect();
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert!(
        lines[0].ends_with("providers[0].name: provider name \"a/b\" cannot contain '/'"),
        "{lines:?}"
    );
    let missing = credgate(&[
        "check-config",
        "examples/provider-config.yaml",
        "--image-credential-provider-bin-dir",
        "/nonexistent",
    ]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(text(&missing.stderr).contains("does not exist"));
}

#[test]
fn check_config_warns_about_patterns_that_never_match() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("lint.yaml");
    std::fs::write(&cfg, "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: p\n  matchImages: [\"https://x.io\", \"x.io/*\"]\n  defaultCacheDuration: 1m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n").unwrap();
    let out = credgate(&["check-config", cfg.to_str().unwrap()]);
    assert!(out.status.success());
    let stderr = text(&out.stderr);
    assert_eq!(stderr.matches("warning:").count(), 2, "{stderr}");
}

#[test]
fn match_exit_codes() {
    for (pattern, image, code, out) in [
        (
            "*.dkr.ecr.*.amazonaws.com",
            "123456789012.dkr.ecr.us-east-1.amazonaws.com/app:v1",
            0,
            "true",
        ),
        ("docker.io", "nginx:1.25", 0, "true"),
        ("k*.io", "quay.io/x", 1, "false"),
        ("127.0.0.1:5000", "127.0.0.1:5000", 0, "true"),
        ("reg.io:abc", "reg.io/x", 2, ""),
    ] {
        let got = credgate(&["match", pattern, image]);
        assert_eq!(
            got.status.code(),
            Some(code),
            "{pattern} {image}: {}",
            text(&got.stderr)
        );
        assert_eq!(text(&got.stdout).trim(), out);
    }
    assert_eq!(credgate(&["match", "only-one-arg"]).status.code(), Some(2));
}

/// `credgate get` with no agent running and nothing to read says so, instead of "no
/// credentials".
#[test]
fn get_without_an_agent_or_a_config_says_so() {
    let runtime = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(["get", "--no-docker-config", "nginx:1.25"])
        .env_remove("CREDGATE_SOCKET")
        .env("XDG_RUNTIME_DIR", runtime.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("no agent at"), "{err}");
    assert!(err.contains("credgate serve"), "{err}");
}

/// `credgate serve` does not start on a state directory others can write, or on a link.
#[test]
fn serve_refuses_an_untrusted_state_directory() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&shared, &link).unwrap();
    for (state, want) in [
        (&shared, "can be written by other users"),
        (&link, "symbolic link"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
            .args(["serve", "--no-docker-config", "--socket"])
            .arg(dir.path().join("s.sock"))
            .arg("--state-dir")
            .arg(state)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = text(&out.stderr);
        assert!(err.contains("refusing the state directory"), "{err}");
        assert!(err.contains(want), "{err}");
    }
}

/// `credgate kubelet-config` prints a config `check-config` accepts, with one link per
/// provider to the bridge in the kubelet's plugin directory, and generating from its own output
/// gives the same entries and patterns.
#[test]
fn kubelet_config_is_valid_and_links_every_provider_to_the_bridge() {
    let dir = tempfile::tempdir().unwrap();
    let links = dir.path().join("kubelet-plugins");
    let out = credgate(&[
        "kubelet-config",
        "--image-credential-provider-config",
        "examples/provider-config.yaml",
        "--image-credential-provider-bin-dir",
        "examples/plugins",
        "--link-dir",
        links.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let generated = dir.path().join("kubelet.yaml");
    std::fs::write(&generated, &out.stdout).unwrap();
    let check = credgate(&[
        "check-config",
        generated.to_str().unwrap(),
        "--image-credential-provider-bin-dir",
        links.to_str().unwrap(),
    ]);
    assert!(
        check.status.success(),
        "{}{}",
        text(&check.stdout),
        text(&check.stderr)
    );
    let link = links.join("credgate-example-plugin");
    let target = std::fs::read_link(&link).unwrap();
    assert_eq!(
        target.file_name().unwrap(),
        "credgate-credential-provider",
        "{}",
        target.display()
    );
    // Same entries, same patterns: what the agent's config matches, the kubelet's does.
    let original = text(
        &credgate(&[
            "kubelet-config",
            "--image-credential-provider-config",
            generated.to_str().unwrap(),
        ])
        .stdout,
    );
    let lines = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| l.contains("matchImages") || l.contains("- name"))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(lines(&original), lines(&text(&out.stdout)), "a fixed point");
    // A relative --bridge is linked by its absolute path (a relative link would be read from
    // the link's directory); a missing one is refused before any link is made.
    let bridge = std::path::Path::new(env!("CARGO_BIN_EXE_credgate-credential-provider"));
    let relative = dir.path().join("relative");
    let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .current_dir(bridge.parent().unwrap())
        .args(["kubelet-config", "--image-credential-provider-config"])
        .arg(repo().join("examples/provider-config.yaml"))
        .args(["--bridge", "credgate-credential-provider", "--link-dir"])
        .arg(&relative)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let target = std::fs::read_link(relative.join("credgate-example-plugin")).unwrap();
    assert_eq!(target, bridge, "{}", target.display());
    let missing = credgate(&[
        "kubelet-config",
        "--image-credential-provider-config",
        "examples/provider-config.yaml",
        "--bridge",
        "no-such-bridge",
        "--link-dir",
        dir.path().join("never").to_str().unwrap(),
    ]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        text(&missing.stderr).contains("the bridge no-such-bridge does not exist"),
        "{}",
        text(&missing.stderr)
    );
    assert!(!dir.path().join("never").exists());
}

/// `kubelet-config --max-cache-duration` passes the cap to every entry's bridge, and the
/// bridge takes it.
#[test]
fn kubelet_config_passes_the_cache_cap_to_the_bridge() {
    let out = credgate(&[
        "kubelet-config",
        "--image-credential-provider-config",
        "examples/provider-config.yaml",
        "--max-cache-duration",
        "2m",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let config = text(&out.stdout);
    assert!(
        config.contains(r#""--max-cache-duration", "2m0s""#),
        "{config}"
    );
    let bridge = std::process::Command::new(crate::support::bridge_bin())
        .args(["--max-cache-duration", "2m0s", "--help"])
        .output()
        .unwrap();
    assert!(bridge.status.success(), "{}", text(&bridge.stderr));
}

/// `explain` says whose view it prints, and without an agent and without a source to read it
/// refuses as `get` does instead of calling every image anonymous.
#[test]
fn explain_says_whose_view_and_refuses_to_explain_from_nothing() {
    let home = tempfile::tempdir().unwrap();
    let nothing = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(["explain", "registry.example.com/team/app:v1"])
        .current_dir(repo())
        .env("HOME", home.path())
        .env_remove("CREDGATE_LOG")
        .env_remove("CREDGATE_SOCKET")
        .env_remove("XDG_RUNTIME_DIR")
        .output()
        .unwrap();
    assert!(!nothing.status.success());
    let err = text(&nothing.stderr);
    assert!(err.contains("no agent at"), "{err}");
    let out = credgate(&[
        "explain",
        "registry.example.com/team/app:v1",
        "--image-credential-provider-config",
        "examples/provider-config.yaml",
        "--image-credential-provider-bin-dir",
        "examples/plugins",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let first = text(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned();
    assert!(
        first.starts_with("view:    this process, from examples/provider-config.yaml"),
        "{first}"
    );
}

/// Usage errors exit 2 everywhere, checked before anything is started or connected: a bad
/// verification policy, an image reference that does not parse, an image ID that is not what
/// runtimes report (a help example's `sha256:4b1d...` once wrote a record).
#[test]
fn usage_errors_exit_2_before_connecting() {
    for args in [
        &[
            "serve",
            "--image-pull-credentials-verification-policy",
            "Bogus",
        ][..],
        &[
            "ctl",
            "--socket",
            "/nonexistent.sock",
            "pulls",
            "UPPER/Case:!!",
        ],
        &[
            "ctl",
            "--socket",
            "/nonexistent.sock",
            "record-result",
            "registry.example.com/team/app:v1",
            "--image-ref",
            "sha256:4b1d...",
        ],
        &[
            "ctl",
            "--socket",
            "/nonexistent.sock",
            "get-record",
            "sha256:abc",
        ],
        &[
            "ctl",
            "--socket",
            "/nonexistent.sock",
            "get-record",
            "sha256:0000000000000000000000000000000000000000000000000000000000000000",
        ],
        &["ctl", "--socket", "/nonexistent.sock", "flush", "Bad::Ref"],
    ] {
        let out = credgate(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            !text(&out.stderr).contains("cannot reach"),
            "{args:?}: checked before connecting: {}",
            text(&out.stderr)
        );
    }
}

/// The docker helper's `--help` answers (exit 0) with how clients call it and an example; the
/// bridge's says how the kubelet runs it.
#[test]
fn the_helper_and_the_bridge_explain_themselves() {
    let helper = Command::new(env!("CARGO_BIN_EXE_docker-credential-credgate"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(helper.status.success());
    let help = text(&helper.stdout);
    assert!(
        help.contains("credHelpers") && help.contains("Example:"),
        "{help}"
    );
    let bridge = Command::new(crate::support::bridge_bin())
        .arg("--help")
        .output()
        .unwrap();
    let help = text(&bridge.stdout);
    assert!(
        help.contains("The kubelet runs it") && help.contains("Example:"),
        "{help}"
    );
}

/// `serve` takes only a unix socket as the runtime's endpoint (a usage error otherwise), and
/// the helper calls a port out of range invalid, not "not found".
#[test]
fn a_tcp_runtime_endpoint_and_a_port_out_of_range_are_refused() {
    let out = credgate(&[
        "serve",
        "--cri-proxy-socket",
        "/nonexistent/cri.sock",
        "--cri-runtime-endpoint",
        "tcp://127.0.0.1:1234",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("tcp:// is not supported"));
    let helper = crate::support::output_with_stdin(
        Command::new(env!("CARGO_BIN_EXE_docker-credential-credgate"))
            .arg("get")
            .env("CREDGATE_SOCKET", "/nonexistent.sock"),
        b"registry.example.com:411610",
    );
    assert!(
        text(&helper.stdout).contains("not a port"),
        "{}",
        text(&helper.stdout)
    );
}

/// `-o json` is for programs: the guard's decision by name, not by number.
#[test]
fn json_output_names_enums() {
    let dir = tempfile::tempdir().unwrap();
    let agent = crate::support::Agent::start(dir.path(), &[]);
    let out = agent.credgate(&[
        "ctl",
        "-o",
        "json",
        "check-access",
        "registry.example.com/team/app:v1",
        "--absent",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["decision"], "PULL", "{v}");
    // explain's guard records, structured.
    let id = format!("sha256:{}", "4b1d".repeat(16));
    let recorded = agent.credgate(&[
        "ctl",
        "record-result",
        "registry.example.com/team/app:v1",
        "--image-ref",
        &id,
        "--secret",
        "team-a/regcred=alice:json-secret",
    ]);
    assert!(recorded.status.success(), "{}", text(&recorded.stderr));
    let out = agent.credgate(&["explain", "-o", "json", "registry.example.com/team/app:v1"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let record = &v["guard_record_summaries"][0];
    assert_eq!(record["image_ref"], id.as_str(), "{v}");
    assert_eq!(record["secrets"], 1, "{v}");
    assert_eq!(record["secret_namespaces"][0], "team-a", "{v}");
    assert!(!text(&out.stdout).contains("json-secret"));
}

/// docs/cri-proxy.md's "When a pull is unauthorized" examples run as written against the example
/// agent: each `sh` block's commands give the output block that follows it (the agent's socket
/// path aside).
#[test]
fn the_readmes_debugging_examples_run_as_written() {
    let readme = std::fs::read_to_string(repo().join("docs/cri-proxy.md")).unwrap();
    let start = readme.find("## When a pull is unauthorized").unwrap();
    let section = &readme[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let dir = tempfile::tempdir().unwrap();
    let examples = repo().join("examples");
    let agent = crate::support::Agent::start(
        dir.path(),
        &[
            "--image-credential-provider-config",
            examples.join("provider-config.yaml").to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            examples.join("plugins").to_str().unwrap(),
        ],
    );
    let blocks: Vec<&str> = section.split("```").collect();
    let mut checked = 0;
    // Blocks alternate with prose: ["prose", "sh\n...", "prose", "\n...", ...].
    for pair in blocks.windows(3) {
        let (Some(commands), Some(expected)) =
            (pair[0].strip_prefix("sh\n"), pair[2].strip_prefix('\n'))
        else {
            continue;
        };
        if pair[1].trim() != "" {
            continue;
        }
        let mut got = String::new();
        for line in commands.lines().filter(|l| !l.trim().is_empty()) {
            let out = Command::new("sh")
                .args(["-c", line])
                .env("PATH", crate::support::path_with_helper())
                .env("CREDGATE_SOCKET", &agent.socket)
                .env_remove("CREDGATE_LOG")
                .output()
                .unwrap();
            got.push_str(&text(&out.stdout));
        }
        let got = got.replace(
            &agent.socket.display().to_string(),
            "/run/credgate/credgate.sock",
        );
        assert_eq!(got, expected, "for:\n{commands}");
        checked += 1;
    }
    assert_eq!(checked, 2, "the section's examples with their output");
}

/// docs/guard.md's image access guard example runs as written against a scratch agent: each
/// command exits as its comment says (0 unless it says `exit 1`). `ctl verify` asks
/// registry.example.com itself, which a test machine cannot reach: it only has to be no usage
/// error.
#[test]
fn the_readmes_guard_example_runs_as_written() {
    let readme = std::fs::read_to_string(repo().join("docs/guard.md")).unwrap();
    let start = readme
        .find("```sh\ncredgate ctl record-intent")
        .expect("the guard example");
    let block = &readme[start + 6..];
    let block = &block[..block.find("```").unwrap()];
    let dir = tempfile::tempdir().unwrap();
    let agent = crate::support::Agent::start(dir.path(), &[]);
    let mut ran = 0;
    for command in block
        .replace("\\\n", " ")
        .lines()
        .filter(|l| !l.trim().is_empty())
    {
        let out = Command::new("sh")
            .args(["-c", command])
            .env("PATH", crate::support::path_with_helper())
            .env("CREDGATE_SOCKET", &agent.socket)
            .env_remove("CREDGATE_LOG")
            .output()
            .unwrap();
        let said = format!("{command}: {}{}", text(&out.stdout), text(&out.stderr));
        if command.contains("ctl verify") {
            assert_ne!(out.status.code(), Some(2), "{said}");
        } else if command.contains("exit 1") {
            assert_eq!(out.status.code(), Some(1), "{said}");
            assert!(text(&out.stdout).contains("MUST_AUTHENTICATE"), "{said}");
        } else {
            assert_eq!(out.status.code(), Some(0), "{said}");
        }
        ran += 1;
    }
    assert_eq!(ran, 5, "{block}");
}

/// Every example of every `--help` (as the programs print them) runs as written against a
/// scratch agent (the example providers, a CRI proxy in front of a fake runtime): none is a
/// usage error or fails to reach the agent. Skipped, and why: `serve` (it starts an agent),
/// examples that name the node's own files (/etc, /usr: not on a scratch machine), and a
/// `watch` without `--count` (it streams until interrupted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_help_example_runs_against_a_scratch_agent() {
    let dir = tempfile::tempdir().unwrap();
    let examples = repo().join("examples");
    let (_fake, agent, _proxy) = crate::support::fake_runtime_agent(
        dir.path(),
        credgate_testbed::fake_runtime::Answers::default(),
        &[
            "--image-credential-provider-config",
            examples.join("provider-config.yaml").to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            examples.join("plugins").to_str().unwrap(),
        ],
    )
    .await;
    let mut found = Vec::new();
    help_examples(&mut Vec::new(), &mut found);
    assert!(found.len() > 30, "{found:#?}");
    let mut ran = 0;
    for example in found {
        let skipped = example.starts_with("credgate serve")
            || example.contains(" /etc/")
            || example.contains(" /usr/")
            || (example.contains("ctl watch") && !example.contains("--count"));
        if skipped {
            continue;
        }
        let out = Command::new("sh")
            .args(["-c", &example])
            .current_dir(repo())
            .env("PATH", crate::support::path_with_helper())
            .env("CREDGATE_SOCKET", &agent.socket)
            .env("PASSWORD", "example-password")
            .env_remove("CREDGATE_LOG")
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert!(
            matches!(out.status.code(), Some(0 | 1)) && !err.contains("cannot reach the agent"),
            "{example}: {:?}\n{err}",
            out.status
        );
        ran += 1;
    }
    assert!(ran > 25, "{ran} examples ran");
}

/// The examples of `credgate PATH --help` and of every subcommand below it, continuation lines
/// joined.
fn help_examples(path: &mut Vec<String>, found: &mut Vec<String>) {
    let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(path.iter())
        .arg("--help")
        .output()
        .unwrap();
    let help = text(&out.stdout).replace("\\\n", " ");
    let mut in_examples = false;
    let mut in_commands = false;
    let mut subcommands = Vec::new();
    for line in help.lines() {
        if line.starts_with("Example") {
            in_examples = true;
            continue;
        }
        if line.starts_with("Commands:") {
            in_commands = true;
            continue;
        }
        if line.trim().is_empty() {
            in_examples = false;
            in_commands = false;
            continue;
        }
        let trimmed = line.trim();
        if in_examples && (trimmed.starts_with("credgate ") || trimmed.starts_with("printf ")) {
            let example = trimmed.split_whitespace().collect::<Vec<_>>().join(" ");
            if !found.contains(&example) {
                found.push(example);
            }
        }
        if in_commands && line.starts_with("  ") && !line.starts_with("   ") {
            if let Some(name) = trimmed.split_whitespace().next().filter(|n| *n != "help") {
                subcommands.push(name.to_owned());
            }
        }
    }
    for sub in subcommands {
        path.push(sub);
        help_examples(path, found);
        path.pop();
    }
}

/// A failing plugin: `explain` says where its stderr is, and once the provider backs off, that a
/// lookup is refused without a run (not that it runs the plugin).
#[test]
fn explain_says_where_a_failing_plugins_stderr_is_and_when_it_backs_off() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bin = d.join("plugins");
    std::fs::create_dir_all(&bin).unwrap();
    crate::support::write_script(
        &bin.join("failing"),
        "cat >/dev/null\necho broken >&2\nexit 3",
    );
    let config = d.join("providers.yaml");
    std::fs::write(&config, "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: failing\n  matchImages: [registry.example.com]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n").unwrap();
    let agent = crate::support::Agent::start(
        d,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            bin.to_str().unwrap(),
        ],
    );
    let image = "registry.example.com/team/app:v1";
    agent.credgate(&["get", image]);
    let once = text(&agent.credgate(&["explain", image]).stdout);
    assert!(
        once.contains("the plugin's stderr is in the agent's log at debug level"),
        "{once}"
    );
    agent.credgate(&["get", image]);
    let backing_off = text(&agent.credgate(&["explain", image]).stdout);
    assert!(
        backing_off.contains("a lookup is refused without a run until")
            && !backing_off.contains("a lookup runs the plugin"),
        "{backing_off}"
    );
    // A tracked ref that never had a credential: its renewal's warning does not claim to keep
    // any.
    agent.credgate(&["ctl", "track", "nydus", image]);
    credgate_testbed::eventually(
        "the renewal fails",
        std::time::Duration::from_secs(20),
        || agent.log_text().contains("renewal failed"),
    );
    let log = agent.log_text();
    assert!(log.contains("the ref has no credentials yet"), "{log}");
    assert!(!log.contains("keeping the last good credentials"), "{log}");
}

/// `ctl status` shows the provider config's path as the agent reads it (absolute), whatever
/// the operator typed.
#[test]
fn status_shows_the_config_path_absolute() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(["serve", "--no-docker-config", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args([
            "--image-credential-provider-config",
            "examples/provider-config.yaml",
            "--image-credential-provider-bin-dir",
            "examples/plugins",
        ])
        .current_dir(repo())
        .env_remove("CREDGATE_LOG")
        .stderr(std::fs::File::create(dir.path().join("agent.log")).unwrap())
        .spawn()
        .unwrap();
    credgate_testbed::eventually(
        "the agent serves",
        std::time::Duration::from_secs(20),
        || std::os::unix::net::UnixStream::connect(&socket).is_ok(),
    );
    let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(["ctl", "status"])
        .env("CREDGATE_SOCKET", &socket)
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(dir.path().join("agent.log")).unwrap();
    crate::support::secrets::check("the agent's log", &log);
    let status = text(&out.stdout);
    let want = std::path::absolute(repo().join("examples/provider-config.yaml")).unwrap();
    assert!(
        status.lines().any(|l| l.starts_with("config:")
            && l.ends_with("/examples/provider-config.yaml")
            && l.contains(" /")),
        "{status} (want {})",
        want.display()
    );
}

/// One bad image reference, one answer (issue 52): every subcommand that takes an image
/// reference refuses `BAD::ref` as a usage error (exit 2) with the same words, before it
/// connects to anything.
#[test]
fn a_bad_image_reference_is_the_same_usage_error_everywhere() {
    let id = format!("sha256:{}", "ab".repeat(32));
    let commands: Vec<Vec<&str>> = vec![
        vec!["get"],
        vec!["explain"],
        vec!["ctl", "lookup"],
        vec!["ctl", "track", "consumer"],
        vec!["ctl", "untrack", "consumer"],
        vec!["ctl", "set-tracked", "consumer"],
        vec!["ctl", "watch"],
        vec!["ctl", "check-access"],
        vec!["ctl", "record-intent"],
        vec!["ctl", "record-result", "--image-ref", &id],
        vec!["ctl", "verify", "--image-ref", &id],
        vec!["ctl", "report-refused", "--username", "u"],
        vec!["ctl", "pulls"],
        vec!["ctl", "flush"],
        vec!["ctl", "captured", "forget"],
    ];
    for command in commands {
        let mut args = command.clone();
        args.push("BAD::ref");
        let out = Command::new(env!("CARGO_BIN_EXE_credgate"))
            .args(&args)
            .env("CREDGATE_SOCKET", "/nonexistent/credgate.sock")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "credgate {args:?}: {err}");
        assert!(
            err.starts_with("error: invalid image reference \"BAD::ref\": "),
            "credgate {args:?}: {err}"
        );
    }
}
