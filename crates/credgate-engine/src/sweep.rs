//! The escapee sweeper: processes a plugin left behind outside its process group (a `setsid`
//! daemon, say) are found by a marker in their environment and killed.
//!
//! Every plugin run gets `CREDGATE_PLUGIN_RUN=<agent pid>-<run>` in its environment, which its
//! descendants inherit. When a run ends, its process group is killed at once (see `exec`); its
//! marker is then handed to one background thread, which waits a moment (so that a daemon that
//! forks late is still caught), scans `/proc` once for every pending marker, and kills what it
//! finds through a pidfd, so a recycled pid is never signalled. A marker is kept for a few scans
//! and then forgotten. A plugin that scrubs its environment escapes this; the threat model in
//! SECURITY.md says so.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

/// The environment variable that marks a plugin run's processes.
pub const MARKER_ENV: &str = "CREDGATE_PLUGIN_RUN";

/// Scans a marker takes part in before it is forgotten.
const SCANS: u8 = 3;
/// Wait between a run's end (or the previous scan) and a scan.
const PAUSE: Duration = Duration::from_millis(200);

struct Shared {
    /// Marker value → scans left.
    pending: Mutex<HashMap<String, u8>>,
    wake: Condvar,
    killed: AtomicU64,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<&'static Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let s: &'static Shared = Box::leak(Box::new(Shared {
            pending: Mutex::new(HashMap::new()),
            wake: Condvar::new(),
            killed: AtomicU64::new(0),
        }));
        let spawned = std::thread::Builder::new()
            .name("credgate-sweeper".into())
            .spawn(move || sweeper(s));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the plugin escapee sweeper");
        }
        s
    })
}

/// A fresh marker value for one run.
pub fn marker() -> String {
    static RUNS: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    )
}

/// Hands the marker of a finished run to the sweeper.
pub fn finished(marker: String) {
    let s = shared();
    s.pending
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(marker, SCANS);
    s.wake.notify_one();
}

/// Processes killed by the sweeper so far, in this process.
pub fn killed() -> u64 {
    shared().killed.load(Ordering::Relaxed)
}

fn sweeper(s: &'static Shared) {
    loop {
        {
            let mut pending = s.pending.lock().unwrap_or_else(|p| p.into_inner());
            while pending.is_empty() {
                pending = s.wake.wait(pending).unwrap_or_else(|p| p.into_inner());
            }
        }
        std::thread::sleep(PAUSE);
        let markers: Vec<String> = {
            let mut pending = s.pending.lock().unwrap_or_else(|p| p.into_inner());
            let now: Vec<String> = pending.keys().cloned().collect();
            pending.retain(|_, left| {
                *left -= 1;
                *left > 0
            });
            now
        };
        let n = scan(&markers);
        if n > 0 {
            s.killed.fetch_add(n, Ordering::Relaxed);
            tracing::warn!(
                processes = n,
                "killed processes that plugins left running outside their process group"
            );
        }
    }
}

/// Kills every process whose environment carries one of `markers`; returns how many.
fn scan(markers: &[String]) -> u64 {
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
        if let Some(fd) = Pidfd::open(pid) {
            // Read through the pid only after holding its pidfd: if the environment matches,
            // the signal reaches this process, not a later one with a recycled pid.
            if carries_marker(pid, markers) && fd.kill() {
                killed += 1;
            }
        }
    }
    killed
}

fn carries_marker(pid: i32, markers: &[String]) -> bool {
    let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    let prefix = format!("{MARKER_ENV}=");
    environ.split(|b| *b == 0).any(|var| {
        var.strip_prefix(prefix.as_bytes())
            .is_some_and(|value| markers.iter().any(|m| m.as_bytes() == value))
    })
}

struct Pidfd(i32);

impl Pidfd {
    fn open(pid: i32) -> Option<Pidfd> {
        // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        (fd >= 0).then(|| Pidfd(fd as i32))
    }

    fn kill(&self) -> bool {
        // SAFETY: pidfd_send_signal(2) on a descriptor we own, with no siginfo.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0,
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        r == 0
    }
}

impl Drop for Pidfd {
    fn drop(&mut self) {
        // SAFETY: closing a descriptor this value owns, once.
        unsafe {
            libc::close(self.0);
        }
    }
}
