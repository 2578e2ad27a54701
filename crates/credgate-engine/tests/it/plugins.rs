//! Real plugin executables: every wire version, key types, durations, hostile output, hangs,
//! floods, children that keep pipes open, missing binaries.

use std::time::{Duration, Instant, SystemTime};

use credgate_core::config::WireVersion;
use credgate_engine::exec::RunError;
use credgate_engine::{BuildError, Engine, EngineOptions, LookupRequest, ProviderError};
use secrecy::ExposeSecret;

use crate::common::*;

const IMG: &str = "registry.example.com/team/app:v1";

fn req(image: &str) -> LookupRequest<'_> {
    LookupRequest {
        image,
        ..Default::default()
    }
}

/// A config with the one provider `p` for `registry.example.com`.
fn one_provider() -> credgate_core::config::ProviderConfig {
    config(&[("p", &["registry.example.com"], "10m", WIRE_V1)])
}

/// A response with one credential for `registry.example.com`.
fn ok_body() -> String {
    response(
        WIRE_V1,
        "Registry",
        None,
        &[("registry.example.com", "u", "p")],
    )
}

fn run_error(err: &ProviderError) -> &RunError {
    match err {
        ProviderError::Run(e) => e,
        other => panic!("expected a run error, got {other}"),
    }
}

async fn succeeds_in_every_wire_version() {
    for wire in WireVersion::ALL {
        let dir = tempfile::tempdir().unwrap();
        let body = response(
            wire.as_str(),
            "Registry",
            Some("1h"),
            &[("registry.example.com", "u", "p")],
        );
        counting_plugin(dir.path(), "p", &body);
        let e = engine(
            config(&[("p", &["registry.example.com"], "10m", wire.as_str())]),
            dir.path(),
        );
        let got = e.lookup(&req(IMG)).await.unwrap();
        assert!(got.errors.is_empty(), "{:?}", got.errors);
        assert_eq!(got.credentials.len(), 1);
        assert_eq!(got.credentials[0].username, "u");
        assert_eq!(got.credentials[0].password.expose_secret(), "p");
        let request = std::fs::read_to_string(dir.path().join("p.request")).unwrap();
        assert_eq!(
            request,
            format!(
                "{{\"kind\":\"CredentialProviderRequest\",\"apiVersion\":\"{}\",\"image\":\"registry.example.com/team/app\"}}\n",
                wire.as_str()
            )
        );
    }
}

#[tokio::test]
async fn image_registry_and_global_keys() {
    let cases = [("Image", 3), ("Registry", 2), ("Global", 1)];
    for (key_type, want_runs) in cases {
        let dir = tempfile::tempdir().unwrap();
        let body = response(
            WIRE_V1,
            key_type,
            Some("1h"),
            &[("*.example.com", "u", "p"), ("*.example.org", "u", "p")],
        );
        counting_plugin(dir.path(), "p", &body);
        let e = engine(
            config(&[("p", &["*.example.com", "*.example.org"], "10m", WIRE_V1)]),
            dir.path(),
        );
        for image in [
            "a.example.com/x",
            "a.example.com/y",
            "b.example.org/z",
            "a.example.com/x",
        ] {
            let got = e.lookup(&req(image)).await.unwrap();
            assert_eq!(got.credentials.len(), 1, "{key_type} {image}");
        }
        assert_eq!(runs_of(dir.path(), "p"), want_runs, "{key_type}");
        assert_eq!(e.total_runs() as usize, want_runs);
    }
}

#[tokio::test]
async fn durations_absent_zero_and_positive() {
    for (duration, default, cached, expiry) in [
        (None, "10m", true, Some(600)),
        (Some("0s"), "10m", false, None),
        (Some("2h"), "10m", true, Some(7200)),
        (None, "0s", false, None),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let body = response(
            WIRE_V1,
            "Registry",
            duration,
            &[("registry.example.com", "u", "p")],
        );
        counting_plugin(dir.path(), "p", &body);
        let e = engine(
            config(&[("p", &["registry.example.com"], default, WIRE_V1)]),
            dir.path(),
        );
        let before = SystemTime::now();
        let first = e.lookup(&req(IMG)).await.unwrap();
        e.lookup(&req(IMG)).await.unwrap();
        let want_runs = if cached { 1 } else { 2 };
        assert_eq!(
            runs_of(dir.path(), "p"),
            want_runs,
            "{duration:?}/{default}"
        );
        let got = first.credentials[0]
            .expires_at
            .map(|t| t.duration_since(before).unwrap().as_secs());
        match (got, expiry) {
            (Some(g), Some(w)) => assert!(g.abs_diff(w) <= 2, "{g} vs {w}"),
            (g, w) => assert_eq!(g, w),
        }
    }
}

#[tokio::test]
async fn empty_auth_with_duration_is_cached() {
    let dir = tempfile::tempdir().unwrap();
    counting_plugin(
        dir.path(),
        "p",
        &response(WIRE_V1, "Registry", Some("1h"), &[]),
    );
    let e = engine(one_provider(), dir.path());
    for _ in 0..3 {
        let got = e.lookup(&req(IMG)).await.unwrap();
        assert!(got.credentials.is_empty() && got.errors.is_empty());
    }
    assert_eq!(runs_of(dir.path(), "p"), 1);
}

#[tokio::test]
async fn bad_responses_are_errors_and_never_cached() {
    let wrong_version = response(
        "credentialprovider.kubelet.k8s.io/v1beta1",
        "Image",
        None,
        &[],
    );
    let wrong_kind =
        response(WIRE_V1, "Image", None, &[]).replace("CredentialProviderResponse", "Nope");
    let bad_key = response(WIRE_V1, "Repository", None, &[]);
    let cases = [
        (bad_key.as_str(), "cacheKeyType"),
        (wrong_version.as_str(), "apiVersion"),
        (wrong_kind.as_str(), "kind"),
        (
            "{\"kind\": \"CredentialProviderResponse\", ",
            "not a JSON object",
        ),
        ("", "not a JSON object"),
    ];
    for (body, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        counting_plugin(dir.path(), "p", body);
        let e = engine(one_provider(), dir.path());
        let got = e.lookup(&req(IMG)).await.unwrap();
        assert!(got.credentials.is_empty());
        let err = got.errors[0].to_string();
        assert!(
            matches!(got.errors[0], ProviderError::Response { .. }),
            "{err}"
        );
        assert!(err.contains(want) && err.contains("plugin p"), "{err}");
        e.lookup(&req(IMG)).await.unwrap();
        assert_eq!(runs_of(dir.path(), "p"), 2, "errors are not cached: {want}");
    }
}

async fn failure_with_secret_on_stdout_never_leaks() {
    let logs = LogCapture::start();
    let dir = tempfile::tempdir().unwrap();
    let secret = "hunter2-very-secret";
    script(
        dir.path(),
        "p",
        &format!("cat >/dev/null\necho '{{\"auth\":{{\"x\":{{\"password\":\"{secret}\"}}}}}}'\necho 'boom: cannot reach metadata service' >&2\nexit 3"),
    );
    let e = engine(one_provider(), dir.path());
    let got = e.lookup(&req(IMG)).await.unwrap();
    let err = &got.errors[0];
    assert!(matches!(run_error(err), RunError::NonZeroExit { .. }));
    let text = format!("{err} {err:?} {got:?}");
    assert!(
        text.contains("exit status: 3") && text.contains("boom: cannot reach"),
        "{text}"
    );
    assert!(!text.contains(secret), "{text}");
    let status = &e.provider_status()[0];
    assert!(status
        .last_error
        .as_ref()
        .is_some_and(|l| !l.contains(secret)));
    assert!(logs.text().contains("plugin run failed"), "{}", logs.text());
    assert!(!logs.text().contains(secret));
}

async fn malformed_output_with_secret_never_leaks() {
    let logs = LogCapture::start();
    let dir = tempfile::tempdir().unwrap();
    let secret = "s3cr3t-in-broken-json";
    script(
        dir.path(),
        "p",
        &format!("cat >/dev/null\necho '{{\"password\": \"{secret}\" oops'"),
    );
    let e = engine(one_provider(), dir.path());
    let got = e.lookup(&req(IMG)).await.unwrap();
    let text = format!("{} {:?}", got.errors[0], got.errors[0]);
    assert!(
        !text.contains(secret) && !logs.text().contains(secret),
        "{text}"
    );
}

fn pid_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

fn wait_gone(pid_file: &std::path::Path) {
    let pid: i32 = std::fs::read_to_string(pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    credgate_testbed::eventually(
        &format!("process {pid} gone with its plugin"),
        Duration::from_secs(5),
        || pid_gone(pid),
    );
}

fn short_timeout(o: &mut EngineOptions) {
    o.default_timeout = Duration::from_millis(400);
}

async fn hang_is_killed_at_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let pid = dir.path().join("child.pid");
    script(
        dir.path(),
        "p",
        &format!("sleep 60 &\necho $! > '{}'\nwait", pid.display()),
    );
    let e = engine_opts(one_provider(), dir.path(), short_timeout);
    let started = Instant::now();
    let got = e.lookup(&req(IMG)).await.unwrap();
    assert!(
        matches!(run_error(&got.errors[0]), RunError::Timeout { .. }),
        "{}",
        got.errors[0]
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    wait_gone(&pid);
}

async fn child_holding_stdout_does_not_hang_a_finished_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let pid = dir.path().join("child.pid");
    let body = ok_body();
    script(
        dir.path(),
        "p",
        &format!(
            "cat >/dev/null\nsleep 60 &\necho $! > '{}'\ncat <<'EOF'\n{body}\nEOF",
            pid.display()
        ),
    );
    let e = engine_opts(one_provider(), dir.path(), |o| {
        o.default_timeout = Duration::from_secs(30)
    });
    let started = Instant::now();
    let got = e.lookup(&req(IMG)).await.unwrap();
    assert_eq!(got.credentials.len(), 1, "{:?}", got.errors);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    wait_gone(&pid);
}

/// One lookup through a fresh engine whose one plugin runs `body`.
async fn lookup_through(body: &str) -> credgate_engine::Lookup {
    let dir = tempfile::tempdir().unwrap();
    script(dir.path(), "p", body);
    engine(one_provider(), dir.path())
        .lookup(&req(IMG))
        .await
        .unwrap()
}

/// An answer decoded early (it looked whole before the plugin exited) counts only if nothing
/// followed it: a plugin that writes a whole answer, pauses, then writes more has its whole
/// output judged, here as malformed; one that writes its answer in pieces is decoded whole.
async fn an_early_decode_counts_only_for_the_whole_output() {
    let body = ok_body();
    let got = lookup_through(&format!(
        "cat >/dev/null\nprintf '%s' '{body}'\nsleep 0.05\nprintf ' trailing'"
    ))
    .await;
    assert!(got.credentials.is_empty());
    assert!(
        matches!(got.errors[0], ProviderError::Response { .. }),
        "{}",
        got.errors[0]
    );
    // Halves that each end in `}`: the first offer is no answer, the whole is.
    let (first, second) = body.split_at(body.find("}}").unwrap() + 1);
    let got = lookup_through(&format!(
        "cat >/dev/null\nprintf '%s' '{first}'\nsleep 0.05\nprintf '%s' '{second}'"
    ))
    .await;
    assert_eq!(got.credentials.len(), 1, "{:?}", got.errors);
}

/// A plugin that answers and exits leaving a child in its group (pipes closed): the child is
/// killed with the group when the run ends, and the sweeper reaps the plugin soon after.
async fn child_left_in_the_group_is_killed_and_the_plugin_reaped_after_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let child = dir.path().join("child.pid");
    let plugin = dir.path().join("plugin.pid");
    let body = ok_body();
    script(
        dir.path(),
        "p",
        &format!(
            "cat >/dev/null\necho $$ > '{}'\nsleep 60 </dev/null >/dev/null 2>&1 &\necho $! > '{}'\ncat <<'EOF'\n{body}\nEOF",
            plugin.display(),
            child.display()
        ),
    );
    let e = engine_opts(one_provider(), dir.path(), |o| {
        o.default_timeout = Duration::from_secs(30)
    });
    let started = Instant::now();
    let got = e.lookup(&req(IMG)).await.unwrap();
    assert_eq!(got.credentials.len(), 1, "{:?}", got.errors);
    assert!(started.elapsed() < Duration::from_secs(5));
    wait_gone(&child);
    let pid: i32 = std::fs::read_to_string(&plugin)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // Reaped: not even a zombie is left.
    credgate_testbed::eventually(
        &format!("plugin {pid} reaped"),
        Duration::from_secs(5),
        || !std::path::Path::new(&format!("/proc/{pid}")).exists(),
    );
}

async fn escaped_child_holding_stdout_is_drained_with_a_bound() {
    let dir = tempfile::tempdir().unwrap();
    let body = ok_body();
    script(
        dir.path(),
        "p",
        &format!("cat >/dev/null\ncat <<'EOF'\n{body}\nEOF\nsetsid sleep 3 &\nexit 0"),
    );
    let e = engine_opts(one_provider(), dir.path(), |o| {
        o.default_timeout = Duration::from_secs(30)
    });
    let started = Instant::now();
    let got = e.lookup(&req(IMG)).await.unwrap();
    assert_eq!(got.credentials.len(), 1, "{:?}", got.errors);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
}

async fn output_flood_hits_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    script(dir.path(), "p", "cat >/dev/null\nexec yes credgate");
    let e = engine_opts(one_provider(), dir.path(), |o| o.limits.stdout = 64 * 1024);
    let got = e.lookup(&req(IMG)).await.unwrap();
    assert!(
        matches!(
            run_error(&got.errors[0]),
            RunError::OutputTooLarge { cap: 65536, .. }
        ),
        "{}",
        got.errors[0]
    );
}

async fn stderr_flood_is_truncated_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let body = ok_body();
    script(
        dir.path(),
        "p",
        &format!(
            "cat >/dev/null\nhead -c 3000000 /dev/zero | tr '\\0' e >&2\ncat <<'EOF'\n{body}\nEOF"
        ),
    );
    let e = engine(one_provider(), dir.path());
    let got = e.lookup(&req(IMG)).await.unwrap();
    assert_eq!(got.credentials.len(), 1, "{:?}", got.errors);
}

async fn plugin_that_ignores_stdin_still_works() {
    let body = ok_body();
    let got = lookup_through(&format!("exec 0<&-\ncat <<'EOF'\n{body}\nEOF")).await;
    assert_eq!(got.credentials.len(), 1, "{:?}", got.errors);
}

#[tokio::test]
async fn missing_or_not_executable_binary_is_a_build_error() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = one_provider();
    let options = EngineOptions {
        plugin_dir: dir.path().to_owned(),
        ..Default::default()
    };
    let err = Engine::builder()
        .config(cfg.clone())
        .options(options.clone())
        .build()
        .err()
        .unwrap();
    assert!(matches!(err, BuildError::PluginMissing { .. }));
    assert!(err
        .to_string()
        .contains(&dir.path().join("p").display().to_string()));
    std::fs::write(dir.path().join("p"), "#!/bin/sh\n").unwrap();
    let err = Engine::builder()
        .config(cfg.clone())
        .options(options.clone())
        .build()
        .err()
        .unwrap();
    assert!(
        matches!(err, BuildError::PluginNotExecutable { .. }),
        "{err}"
    );
    std::fs::create_dir(dir.path().join("q")).unwrap();
    let cfg = config(&[("q", &["registry.example.com"], "10m", WIRE_V1)]);
    let err = Engine::builder()
        .config(cfg)
        .options(options)
        .build()
        .err()
        .unwrap();
    assert!(
        matches!(err, BuildError::PluginNotExecutable { .. }),
        "{err}"
    );
}

#[tokio::test]
async fn binary_removed_after_start_is_a_spawn_error() {
    let dir = tempfile::tempdir().unwrap();
    counting_plugin(dir.path(), "p", "{}");
    let e = engine(one_provider(), dir.path());
    std::fs::remove_file(dir.path().join("p")).unwrap();
    let got = e.lookup(&req(IMG)).await.unwrap();
    assert!(matches!(run_error(&got.errors[0]), RunError::Spawn { .. }));
}

/// A plugin whose answer's username is the shell expression `user`.
fn echo_user_plugin(dir: &std::path::Path, user: &str) {
    script(
        dir,
        "p",
        &format!(
            "cat >/dev/null\nprintf '{{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"%s\",\"cacheKeyType\":\"Registry\",\"auth\":{{\"registry.example.com\":{{\"username\":\"%s\",\"password\":\"p\"}}}}}}' '{WIRE_V1}' \"{user}\""
        ),
    );
}

#[tokio::test]
async fn environment_is_merged_config_wins() {
    let dir = tempfile::tempdir().unwrap();
    echo_user_plugin(dir.path(), "$HOME+$CREDGATE_EXTRA+$PATH");
    let cfg = config_with(
        &[("p", &["registry.example.com"], "10m", WIRE_V1)],
        "  env:\n  - name: HOME\n    value: /from-config\n  - name: CREDGATE_EXTRA\n    value: x\n",
    );
    let got = engine(cfg, dir.path()).lookup(&req(IMG)).await.unwrap();
    let user = &got.credentials[0].username;
    let path = std::env::var("PATH").unwrap();
    assert_eq!(
        user,
        &format!("/from-config+x+{path}"),
        "config wins, the agent's env is passed"
    );
}

#[tokio::test]
async fn args_are_passed() {
    let dir = tempfile::tempdir().unwrap();
    echo_user_plugin(dir.path(), "$1+$2");
    let cfg = config_with(
        &[("p", &["registry.example.com"], "10m", WIRE_V1)],
        "  args: [get-credentials, --v=2]\n",
    );
    let got = engine(cfg, dir.path()).lookup(&req(IMG)).await.unwrap();
    assert_eq!(got.credentials[0].username, "get-credentials+--v=2");
}

#[tokio::test]
async fn repeated_failures_back_off() {
    let dir = tempfile::tempdir().unwrap();
    script(
        dir.path(),
        "p",
        &format!(
            "cat >/dev/null\necho run >> '{}'\nexit 1",
            dir.path().join("p.runs").display()
        ),
    );
    let e = engine_opts(one_provider(), dir.path(), |o| {
        o.backoff.base = Duration::from_secs(3600);
    });
    for _ in 0..5 {
        e.lookup(&req(IMG)).await.unwrap();
    }
    assert_eq!(
        runs_of(dir.path(), "p"),
        2,
        "a failing plugin is not run in a tight loop"
    );
    let got = e.lookup(&req(IMG)).await.unwrap();
    assert!(
        matches!(got.errors[0], ProviderError::Backoff { failures: 2, .. }),
        "{}",
        got.errors[0]
    );
    let status = &e.provider_status()[0];
    assert_eq!(status.consecutive_failures, 2);
    assert!(status.last_error.is_some());
    // Two runs failed; the four lookups after them were refused without a run.
    assert_eq!((status.errors, status.refused_in_backoff), (2, 4));
    // The message says when, rounded as people write it.
    let msg = got.errors[0].to_string();
    // And what went wrong last, so that a client sees the cause, not only the backoff.
    let (msg, last) = msg.split_once("; last error: ").expect("the last error");
    assert!(last.contains("exit"), "{last}");
    let when = msg.rsplit("next run allowed in ").next().unwrap();
    assert!(when.ends_with('m') || when.ends_with('s'), "{msg}");
    // At most milliseconds: never `29.999996s`.
    let decimals = when.split_once('.').map_or(0, |(_, f)| {
        f.chars().take_while(char::is_ascii_digit).count()
    });
    assert!(decimals <= 3, "{msg}");
}

/// Exec-storm protection: a plugin answering `0s` runs for every lookup unless the provider
/// has a minimum cache duration; concurrent lookups share one run either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minimum_cache_duration_stops_an_exec_storm_and_bursts_share_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let body = response(
        WIRE_V1,
        "Registry",
        Some("0s"),
        &[("registry.example.com", "u", "p")],
    );
    counting_plugin(dir.path(), "p", &body);
    let plain = engine(one_provider(), dir.path());
    for _ in 0..5 {
        assert_eq!(plain.lookup(&req(IMG)).await.unwrap().credentials.len(), 1);
    }
    assert_eq!(
        runs_of(dir.path(), "p"),
        5,
        "0s means no cache: the kubelet's semantics"
    );
    let protected = engine_opts(one_provider(), dir.path(), |o| {
        o.min_cache_durations
            .insert("p".into(), Duration::from_secs(30));
    });
    for _ in 0..5 {
        assert_eq!(
            protected.lookup(&req(IMG)).await.unwrap().credentials.len(),
            1
        );
    }
    assert_eq!(runs_of(dir.path(), "p"), 6, "one run, then 30 s of cache");
    // A burst of the same key shares one run whatever the duration.
    script(
        dir.path(),
        "p",
        &format!(
            "cat >/dev/null\necho run >> '{}'\nsleep 0.3\ncat <<'EOF'\n{body}\nEOF",
            dir.path().join("p.runs").display()
        ),
    );
    let fresh = std::sync::Arc::new(engine(one_provider(), dir.path()));
    let lookups: Vec<_> = (0..20)
        .map(|_| {
            let e = fresh.clone();
            tokio::spawn(async move { e.lookup(&req(IMG)).await.unwrap().credentials.len() })
        })
        .collect();
    for l in lookups {
        assert_eq!(l.await.unwrap(), 1);
    }
    assert_eq!(runs_of(dir.path(), "p"), 7);
    // An unknown provider is a build error.
    let e = Engine::builder()
        .config(one_provider())
        .options(EngineOptions {
            plugin_dir: dir.path().to_owned(),
            min_cache_durations: [("nope".to_owned(), Duration::from_secs(1))].into(),
            ..Default::default()
        })
        .build()
        .err()
        .expect("refused");
    assert!(e.to_string().contains("nope"), "{e}");
}

on_both_runtimes!(
    succeeds_in_every_wire_version,
    failure_with_secret_on_stdout_never_leaks,
    malformed_output_with_secret_never_leaks,
    hang_is_killed_at_the_timeout,
    child_holding_stdout_does_not_hang_a_finished_plugin,
    child_left_in_the_group_is_killed_and_the_plugin_reaped_after_the_run,
    an_early_decode_counts_only_for_the_whole_output,
    escaped_child_holding_stdout_is_drained_with_a_bound,
    output_flood_hits_the_cap,
    stderr_flood_is_truncated_not_fatal,
    plugin_that_ignores_stdin_still_works,
);

/// The threads of this process named `name` (as /proc shows it: at most 15 bytes).
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .count()
}

/// An engine owns the threads its runs need: a slow run (past the inline wait: the watchdog)
/// and a finished one (the sweeper) start them, and dropping the engine stops them. nextest
/// runs each test in a process of its own, so no other engine's threads are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_engine_leaves_no_thread_behind() {
    let (watchdog, sweeper) = ("credgate-watchd", "credgate-sweepe");
    let before = (threads_named(watchdog), threads_named(sweeper));
    let dir = tempfile::tempdir().unwrap();
    script(
        dir.path(),
        "p",
        &format!("cat >/dev/null\nsleep 0.1\nprintf '%s' '{}'", ok_body()),
    );
    let e = engine(one_provider(), dir.path());
    let got = e.lookup(&req(IMG)).await.unwrap();
    assert!(got.errors.is_empty(), "{:?}", got.errors);
    // A new thread names itself once it runs: until then it shows its parent's name.
    let started = (before.0 + 1, before.1 + 1);
    credgate_testbed::eventually("a slow run starts both", Duration::from_secs(10), || {
        (threads_named(watchdog), threads_named(sweeper)) == started
    });
    drop(got);
    drop(e);
    assert_eq!(
        (threads_named(watchdog), threads_named(sweeper)),
        before,
        "dropping the engine joined them"
    );
}
