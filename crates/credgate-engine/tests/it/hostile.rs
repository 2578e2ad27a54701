//! Hostile plugins at scale: real scripts that hang, flood, close stdin, stall mid-JSON, leave
//! children behind (in their group and escaped with setsid) or exit unread, all looked up at
//! once, round after round. Counted from /proc: plugin processes in flight stay within the
//! bound, nothing a plugin started outlives the test, descriptors and memory return to where
//! they were.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use credgate_engine::exec::{OutputLimits, RunError};
use credgate_engine::sweep::MARKER_ENV;
use credgate_engine::BackoffPolicy;
use credgate_engine::{LookupRequest, ProviderError};

use crate::common::*;

const OK: &str = "ok";

/// (provider, script body, what every lookup must end in)
fn kinds(body: &str) -> Vec<(&'static str, String, &'static str)> {
    vec![
        ("hang", "sleep 60 &\nwait".into(), "timeout"),
        ("flood", "cat >/dev/null\nexec yes credgate".into(), "too_large"),
        (
            "closes-stdin",
            format!("exec 0<&-\nsleep 0.1\ncat <<'EOF'\n{body}\nEOF"),
            OK,
        ),
        (
            "half-json",
            "cat >/dev/null\nprintf '{\"kind\":\"CredentialProviderResponse\",\"auth\":{'\nsleep 60"
                .into(),
            "timeout",
        ),
        (
            "escapee",
            format!("cat >/dev/null\nsetsid sleep 60 </dev/null >/dev/null 2>&1 &\nsleep 0.2\ncat <<'EOF'\n{body}\nEOF"),
            OK,
        ),
        (
            "escapee-holding-stdout",
            format!("cat >/dev/null\ncat <<'EOF'\n{body}\nEOF\nsetsid sleep 60 &\nsleep 0.2\nexit 0"),
            OK,
        ),
        ("exits-unread", "exit 3".into(), "exit"),
        ("good", format!("cat >/dev/null\ncat <<'EOF'\n{body}\nEOF"), OK),
        // Slow but fine, with `Image` keys: once the key type is known, distinct images run
        // side by side, up to the per-provider and total bounds.
        ("slow-a", format!("cat >/dev/null\nsleep 1\ncat <<'EOF'\n{body}\nEOF"), OK),
        ("slow-b", format!("cat >/dev/null\nsleep 1\ncat <<'EOF'\n{body}\nEOF"), OK),
    ]
}

fn outcome(result: &credgate_engine::Lookup) -> &'static str {
    if !result.credentials.is_empty() {
        return OK;
    }
    let Some(err) = result.errors.first() else {
        return "nothing";
    };
    let ProviderError::Run(run) = err else {
        panic!("unexpected error: {err}");
    };
    match **run {
        RunError::Timeout { .. } => "timeout",
        RunError::OutputTooLarge { .. } => "too_large",
        RunError::NonZeroExit { .. } => "exit",
        _ => panic!("unexpected error: {err}"),
    }
}

/// What /proc says about this test process and the plugins it started.
#[derive(Debug, Default, Clone, Copy)]
struct Census {
    /// Direct children: plugin processes in flight (see [`in_flight`]).
    children: usize,
    /// Every process carrying this process's run marker (plugins, their children, escapees).
    marked: usize,
    fds: usize,
    rss_kb: usize,
}

fn census() -> Census {
    let me = std::process::id();
    let prefix = format!("{MARKER_ENV}={me}-");
    let mut c = Census::default();
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        if let Some(fields) = stat_fields(pid) {
            if fields.get(1) == Some(&me.to_string()) {
                children.push(pid);
            }
            if fields.first().map(String::as_str) == Some("Z") {
                continue;
            }
        }
        if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) {
            if env
                .split(|b| *b == 0)
                .any(|v| v.starts_with(prefix.as_bytes()))
            {
                c.marked += 1;
            }
        }
    }
    // The scan is not a snapshot: a plugin read before its kill and one started after it
    // would both count. Only those still in flight once the scan is over count.
    c.children = children
        .into_iter()
        .filter(|pid| in_flight(*pid, me))
        .count();
    c.fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    c.rss_kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    c
}

/// The fields of /proc/PID/stat after the parenthesized command name: state, ppid, ...
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
    Some(after.split_whitespace().map(str::to_owned).collect())
}

/// Whether `pid` is a child of `me` that has not exited and is not dying.
fn in_flight(pid: u32, me: u32) -> bool {
    stat_fields(pid).is_some_and(|fields| {
        fields.get(1) == Some(&me.to_string())
            && fields.first().map(String::as_str) != Some("Z")
            && !dying(pid, &fields)
    })
}

/// A plugin the engine killed and released its slot for: SIGKILL pending, or the kernel
/// already tearing it down (PF_EXITING). It runs no more plugin code, so it is not in flight;
/// counting it would measure how fast the kernel frees a process, not the engine's bound.
/// It still counts as `marked` until it is gone, so `settle` waits for it.
fn dying(pid: u32, stat_fields: &[String]) -> bool {
    const PF_EXITING: u64 = 0x4;
    const SIGKILL_BIT: u64 = 1 << (9 - 1);
    // Field 9 of /proc/PID/stat, the 7th after the command name.
    let flags = stat_fields.get(6).and_then(|f| f.parse::<u64>().ok());
    if flags.is_some_and(|f| f & PF_EXITING != 0) {
        return true;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status.lines().any(|l| {
        let pending = l
            .strip_prefix("SigPnd:")
            .or_else(|| l.strip_prefix("ShdPnd:"));
        pending
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .is_some_and(|mask| mask & SIGKILL_BIT != 0)
    })
}

fn settle(limit: Duration) -> Census {
    let until = Instant::now() + limit;
    loop {
        let c = census();
        if (c.marked == 0 && c.children == 0) || Instant::now() > until {
            return c;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

const PER_PROVIDER: usize = 6;
const IN_TOTAL: usize = 10;
const LOOKUPS_PER_KIND: usize = 18;
const TIMEOUT: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_plugins_under_load_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    // One answer serves every kind: `*.example` matches each provider's `<kind>.example`.
    let body = response(WIRE_V1, "Image", None, &[("*.example", "u", "p")]);
    let kinds = kinds(&body);
    let mut expected = HashMap::new();
    let mut names = Vec::new();
    for (name, script_body, want) in &kinds {
        script(dir.path(), name, script_body);
        names.push((*name, format!("{name}.example")));
        expected.insert(*name, *want);
    }
    let hosts: Vec<[&str; 1]> = names.iter().map(|(_, host)| [host.as_str()]).collect();
    let providers: Vec<(&str, &[&str], &str, &str)> = names
        .iter()
        .zip(&hosts)
        .map(|((name, _), hosts)| (*name, hosts.as_slice(), "10m", WIRE_V1))
        .collect();
    let engine = Arc::new(engine_opts(config(&providers), dir.path(), |o| {
        o.default_timeout = TIMEOUT;
        o.max_runs_per_provider = PER_PROVIDER;
        o.max_runs = IN_TOTAL;
        o.backoff = BackoffPolicy {
            base: Duration::ZERO,
            max: Duration::ZERO,
        };
        o.limits = OutputLimits {
            drain_grace: Duration::from_millis(300),
            ..OutputLimits::default()
        };
    }));

    // Sample /proc while the rounds run.
    let stop = Arc::new(AtomicBool::new(false));
    let peak_children = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak_children.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(census().children, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let mut baseline = None;
    let started = Instant::now();
    for round in 0..3 {
        let round_started = Instant::now();
        let mut tasks = Vec::new();
        for (name, host) in &names {
            for i in 0..LOOKUPS_PER_KIND {
                let engine = engine.clone();
                let image = format!("{host}/r{round}/app{i}:v1");
                let name = *name;
                tasks.push(tokio::spawn(async move {
                    let req = LookupRequest {
                        image: &image,
                        ..Default::default()
                    };
                    let got = engine.lookup(&req).await.unwrap();
                    (name, outcome(&got))
                }));
            }
        }
        for t in tasks {
            let (name, got) = t.await.unwrap();
            assert_eq!(got, expected[name], "{name} in round {round}");
        }
        // Hanging kinds need ceil(18 / 6) = 3 waves of the 2 s timeout; a hang past the
        // timeout would show as a round far longer than that.
        let took = round_started.elapsed();
        eprintln!("round {round}: {took:?}");
        assert!(
            took < Duration::from_secs(20),
            "round {round} took {took:?}"
        );
        let after = settle(Duration::from_secs(10));
        assert_eq!(
            after.marked, 0,
            "processes left behind after round {round}: {after:?}"
        );
        assert_eq!(after.children, 0, "{after:?}");
        if round == 0 {
            baseline = Some(after);
        }
    }
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let end = census();
    let baseline = baseline.unwrap();
    let peak = peak_children.load(Ordering::Relaxed);
    eprintln!(
        "{} lookups in {:?}; peak plugin processes {peak} (bound {IN_TOTAL}); baseline {baseline:?}; end {end:?}; sweeper killed {}",
        3 * LOOKUPS_PER_KIND * names.len(),
        started.elapsed(),
        credgate_engine::sweep::killed()
    );
    assert!(
        peak <= IN_TOTAL,
        "{peak} plugins ran at once, over the bound of {IN_TOTAL}"
    );
    assert!(peak >= IN_TOTAL - 2, "the load reached the bound: {peak}");
    assert!(
        credgate_engine::sweep::killed() >= 2 * LOOKUPS_PER_KIND as u64,
        "escapees were killed by the sweeper"
    );
    assert!(
        end.fds <= baseline.fds + 4,
        "descriptors leaked: {baseline:?} -> {end:?}"
    );
    assert!(
        end.rss_kb <= baseline.rss_kb + 32 * 1024,
        "memory grew: {baseline:?} -> {end:?}"
    );
}
