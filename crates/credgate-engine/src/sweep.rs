//! The escapee sweeper: processes a plugin left behind outside its process group (a `setsid`
//! daemon, say) are found by a marker in their environment and killed.
//!
//! Every plugin run gets `CREDGATE_PLUGIN_RUN=<pid>-<start>-<run>` in its environment (the
//! engine's process id and start time, then a run counter), which its descendants inherit.
//! When a run ends, its process group is killed at once (see `exec`); its marker and its
//! plugin, if not reaped yet, are handed to one background thread, which waits a moment (so
//! that a daemon that forks late is still caught), reaps each such plugin, scans `/proc` once
//! for every pending marker, and kills what it finds through a pidfd, so a recycled pid is
//! never signalled. A marker is kept for a few scans
//! and then forgotten. A plugin that scrubs its environment escapes this; the threat model in
//! SECURITY.md says so.
//!
//! A process that dies (SIGKILL, OOM) takes its sweeper with it, and plugins running at that
//! moment live on as orphans. [`orphans`], which `credgate serve` runs at start-up, kills every
//! marked process whose engine is gone: its pid no longer exists or belongs to a process that
//! started at another time (a recycled pid). Plugins of engines still running, and processes
//! of other pid namespaces (where the marker's pid means another process), are left alone.

use parking_lot::{Condvar, Mutex, MutexGuard};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::owned_thread::OwnedThread;
use crate::spawn;

/// The environment variable that marks a plugin run's processes.
pub const MARKER_ENV: &str = "CREDGATE_PLUGIN_RUN";

/// Scans a marker takes part in before it is forgotten.
const SCANS: u8 = 3;
/// Wait between a run's end (or the previous scan) and a scan.
const PAUSE: Duration = Duration::from_millis(200);

struct Shared {
    pending: Mutex<Pending>,
    wake: Condvar,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock()
    }
}

#[derive(Default)]
struct Pending {
    /// Marker values (each run's own) with their scans left; only ever walked whole, so a
    /// list: a run's hand-over hashes nothing.
    markers: Vec<(String, u8)>,
    /// Plugins not reaped yet: killed ones (a SIGKILL takes effect asynchronously), and ones
    /// that exited and whose status their run read without reaping them.
    zombies: Vec<i32>,
    /// The owner is gone: one last round for what is pending, then the thread ends.
    stop: bool,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.markers.is_empty() && self.zombies.is_empty()
    }
}

/// Processes killed by sweepers, in this process.
static KILLED: AtomicU64 = AtomicU64::new(0);

/// The sweeper thread's owner: the thread starts with the first run handed over and ends when
/// this is dropped (which the engine's runner does when the engine goes), after one last
/// round for the runs still pending.
pub(crate) struct Sweeper {
    shared: Arc<Shared>,
    thread: OwnedThread,
}

impl Default for Sweeper {
    fn default() -> Self {
        Sweeper {
            shared: Arc::new(Shared {
                pending: Mutex::new(Pending::default()),
                wake: Condvar::new(),
            }),
            thread: OwnedThread::default(),
        }
    }
}

impl Sweeper {
    /// Hands the marker of a finished run to the sweeper, with the plugin's pid if it is not
    /// reaped yet (killed, or exited and left as a zombie): the sweeper reaps it on its next
    /// round.
    pub(crate) fn finished(&self, marker: String, unreaped: Option<i32>) {
        self.thread.start_once("credgate-sweeper", || {
            let shared = self.shared.clone();
            move || sweeper(&shared)
        });
        let mut pending = self.shared.pending();
        // The sweeper waits only while nothing is pending; otherwise it will see this marker
        // on its next scan, and a wake-up would be a wasted system call on every run.
        let idle = pending.is_empty();
        pending.markers.push((marker, SCANS));
        pending.zombies.extend(unreaped);
        drop(pending);
        if idle {
            self.shared.wake.notify_one();
        }
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.shared.pending().stop = true;
        self.shared.wake.notify_one();
        self.thread.join();
    }
}

/// A fresh marker value for one run.
pub fn marker() -> String {
    static RUNS: AtomicU64 = AtomicU64::new(0);
    static ME: OnceLock<String> = OnceLock::new();
    let me = ME.get_or_init(|| {
        let pid = std::process::id();
        let start = start_time(pid as i32).unwrap_or(0);
        format!("{pid}-{start}")
    });
    format!("{me}-{}", RUNS.fetch_add(1, Ordering::Relaxed))
}

/// Kills every marked process whose engine is gone (see the module docs); returns how many.
/// Reads `/proc`; takes a few milliseconds per thousand processes.
pub fn orphans() -> u64 {
    let Ok(own_ns) = std::fs::read_link("/proc/self/ns/pid") else {
        return 0;
    };
    let n = scan(|pid, marker| {
        let Some((engine, start)) = engine_of(marker) else {
            return false;
        };
        // The pid in a marker means something only in the namespace it was taken in: a
        // process of another pid namespace (a container's credgate, say) is left alone.
        let same_ns =
            std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|ns| ns == own_ns);
        same_ns && start_time(engine) != Some(start)
    });
    if n > 0 {
        KILLED.fetch_add(n, Ordering::Relaxed);
    }
    n
}

/// The engine (pid, start time) a marker value names.
fn engine_of(marker: &[u8]) -> Option<(i32, u64)> {
    let text = std::str::from_utf8(marker).ok()?;
    let mut parts = text.splitn(3, '-');
    let pid = parts.next()?.parse().ok()?;
    let start = parts.next()?.parse().ok()?;
    parts.next()?.parse::<u64>().ok()?;
    Some((pid, start))
}

/// A process's start time in clock ticks since boot (`/proc/PID/stat`, field 22).
fn start_time(pid: i32) -> Option<u64> {
    parse_start_time(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn parse_start_time(stat: &str) -> Option<u64> {
    // The command name (field 2) is in parentheses and may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Processes killed by sweepers so far, in this process.
pub fn killed() -> u64 {
    KILLED.load(Ordering::Relaxed)
}

/// The thread: waits for pending runs; a [`PAUSE`] after one arrives (so that a daemon that
/// forks late is still caught) reaps the zombies and scans `/proc` for every pending marker.
/// Told to stop, it does one last round at once for what is pending and ends.
fn sweeper(s: &Shared) {
    loop {
        let stopping = {
            let mut pending = s.pending();
            while pending.is_empty() && !pending.stop {
                s.wake.wait(&mut pending);
            }
            if pending.is_empty() {
                return;
            }
            if !pending.stop {
                s.wake.wait_while_for(&mut pending, |p| !p.stop, PAUSE);
            }
            pending.stop
        };
        let markers: Vec<String> = {
            let mut pending = s.pending();
            // A child that is not reaped yet stays for the next round; one that is gone
            // already (ECHILD) is dropped.
            pending
                .zombies
                .retain(|&pid| matches!(spawn::reap(pid), Ok(None)));
            let now: Vec<String> = pending.markers.iter().map(|(m, _)| m.clone()).collect();
            pending.markers.retain_mut(|(_, left)| {
                *left -= 1;
                *left > 0
            });
            now
        };
        let n = scan(|_, value| markers.iter().any(|m| m.as_bytes() == value));
        if n > 0 {
            KILLED.fetch_add(n, Ordering::Relaxed);
            tracing::warn!(
                processes = n,
                "killed processes that plugins left running outside their process group"
            );
        }
        if stopping {
            return;
        }
    }
}

/// Kills every process whose (pid, marker value) `doomed` accepts; returns how many.
fn scan(doomed: impl Fn(i32, &[u8]) -> bool) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let me = std::process::id();
    let mut killed = 0;
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if pid as u32 == me {
            continue;
        }
        if let Ok(fd) = spawn::pidfd(pid) {
            // Read through the pid only after holding its pidfd: if the environment matches,
            // the signal reaches this process, not a later one with a recycled pid.
            if marker_of(pid).is_some_and(|m| doomed(pid, &m)) && spawn::kill_pidfd(&fd) {
                killed += 1;
            }
        }
    }
    killed
}

/// The marker value in a process's environment, if it has one.
fn marker_of(pid: i32) -> Option<Vec<u8>> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{MARKER_ENV}=");
    environ
        .split(|b| *b == 0)
        .find_map(|var| var.strip_prefix(prefix.as_bytes()))
        .map(<[u8]>::to_vec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_name_this_process_and_its_start() {
        let m = marker();
        let (pid, start) = engine_of(m.as_bytes()).unwrap();
        assert_eq!(pid as u32, std::process::id());
        assert_eq!(start_time(pid), Some(start));
        assert_ne!(marker(), m);
    }

    #[test]
    fn foreign_or_malformed_markers_name_no_engine() {
        assert_eq!(engine_of(b"12-34-5"), Some((12, 34)));
        for bad in [&b"12-34"[..], b"x-1-2", b"1-2-x", b"", b"\xff-1-2"] {
            assert_eq!(engine_of(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn start_time_survives_odd_command_names() {
        let fields = "S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 424242 20 21";
        assert_eq!(parse_start_time(&format!("7 (sh) {fields}")), Some(424242));
        assert_eq!(
            parse_start_time(&format!("7 (a) b (c d) {fields}")),
            Some(424242)
        );
        assert_eq!(parse_start_time("7 (sh) S 1 2"), None);
        assert_eq!(parse_start_time("garbage"), None);
        assert_eq!(start_time(i32::MAX), None, "no such process");
    }
}
