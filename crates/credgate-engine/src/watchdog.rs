//! The watchdog: one thread that keeps the clock of every plugin run in flight, so that a
//! run's own task waits on nothing but its pipes.
//!
//! A run registers its plugin's pid, deadline and drain grace when it goes on past its inline
//! wait (a plugin that answers within the first few milliseconds is never registered: that
//! wait is bounded and ends before the deadline). While any run is in flight the
//! thread looks at them every [`TICK`]: past its deadline a run's process group is killed and
//! the run is told it timed out; a plugin that has exited while something still holds its
//! pipes has its group killed (which closes the pipes of everything that stayed in it), and
//! the run is told; if the pipes are still open a drain grace later (a `setsid` escapee holds
//! them), the run is told to stop reading.
//!
//! Why a thread and not a timer and a pidfd in each run: on a VM every `epoll_wait` with a
//! timeout arms a host timer, and a timer in the run's task puts one under every wait of the
//! runtime; with the pidfd that is 20 µs a run, most of `miss`'s budget over a bare spawn (see
//! BENCHMARKS.md). The thread's clock is [`std::time::Instant`]: plugin timeouts are real time,
//! also under tokio's paused clock.
//!
//! The invariant that makes the kills safe: a process group is signalled only while its
//! leader (the plugin) has not been reaped, so its id cannot have been reused. A run marks
//! itself [`Watch::done`] (under the same lock the watchdog signals under) before it reaps.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::spawn;

/// How often runs in flight are looked at: the precision of timeouts and drain graces, and
/// how late the exit of a plugin whose pipes stay open is noticed.
const TICK: Duration = Duration::from_millis(10);
/// How long the thread keeps ticking with no run in flight before it sleeps until the next
/// registration (which then has to wake it).
const LINGER: Duration = Duration::from_secs(2);

/// What the watchdog found out about a run.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    /// Its deadline passed; its group was killed.
    pub timed_out: bool,
    /// The plugin has exited; its group was killed.
    pub exited: bool,
    /// It exited a drain grace ago and its pipes are still open.
    pub drained: bool,
}

struct State {
    seen: Seen,
    exited_at: Option<Instant>,
    /// The run reaps (or has reaped) its plugin: hands off.
    done: bool,
}

struct Entry {
    pid: i32,
    deadline: Instant,
    drain_grace: Duration,
    state: Mutex<State>,
    news: Notify,
}

impl Entry {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One look; false once the run is done with.
    fn check(&self, now: Instant) -> bool {
        let mut state = self.state();
        if state.done {
            return false;
        }
        let before = state.seen;
        if !state.seen.timed_out && now >= self.deadline {
            state.seen.timed_out = true;
            spawn::kill_group(self.pid);
        } else if state.exited_at.is_none() {
            if spawn::peek(self.pid).exited() {
                state.exited_at = Some(now);
                state.seen.exited = true;
                spawn::kill_group(self.pid);
            }
        } else if let Some(at) = state.exited_at {
            if !state.seen.drained && now >= at + self.drain_grace {
                state.seen.drained = true;
            }
        }
        let changed = before != state.seen;
        drop(state);
        if changed {
            self.news.notify_one();
        }
        true
    }
}

/// A run's registration. Dropping it is [`Watch::done`].
pub(crate) struct Watch {
    entry: Arc<Entry>,
}

impl Watch {
    /// Registers a run of the plugin `pid`.
    pub(crate) fn new(
        pid: i32,
        deadline: Instant,
        drain_grace: Duration,
    ) -> std::io::Result<Watch> {
        let dog = watchdog()?;
        let entry = Arc::new(Entry {
            pid,
            deadline,
            drain_grace,
            state: Mutex::new(State {
                seen: Seen::default(),
                exited_at: None,
                done: false,
            }),
            news: Notify::new(),
        });
        let mut runs = dog.runs.lock().unwrap_or_else(|p| p.into_inner());
        runs.entries.push(entry.clone());
        let asleep = runs.asleep;
        drop(runs);
        if asleep {
            dog.wake.notify_one();
        }
        Ok(Watch { entry })
    }

    /// What the watchdog has found so far.
    pub(crate) fn seen(&self) -> Seen {
        self.entry.state().seen
    }

    /// Waits until the watchdog finds something new (it may have already).
    pub(crate) async fn news(&self) {
        self.entry.news.notified().await;
    }

    /// From here on the watchdog leaves the run's process alone: call it before reaping.
    pub(crate) fn done(&self) {
        self.entry.state().done = true;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.done();
    }
}

struct Runs {
    entries: Vec<Arc<Entry>>,
    /// The thread waits for a registration with no timeout.
    asleep: bool,
}

struct Watchdog {
    runs: Mutex<Runs>,
    wake: Condvar,
}

fn watchdog() -> std::io::Result<&'static Watchdog> {
    static DOG: OnceLock<Option<&'static Watchdog>> = OnceLock::new();
    let dog = DOG.get_or_init(|| {
        let dog: &'static Watchdog = Box::leak(Box::new(Watchdog {
            runs: Mutex::new(Runs {
                entries: Vec::new(),
                asleep: false,
            }),
            wake: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("credgate-watchdog".into())
            .spawn(move || watch_runs(dog))
            .map(|_| dog)
            .map_err(|e| tracing::error!(error = %e, "cannot start the plugin watchdog thread"))
            .ok()
    });
    dog.ok_or_else(|| std::io::Error::other("the plugin watchdog thread could not be started"))
}

fn watch_runs(dog: &'static Watchdog) {
    let mut idle_since: Option<Instant> = None;
    loop {
        let entries: Vec<Arc<Entry>> = {
            let mut runs = dog.runs.lock().unwrap_or_else(|p| p.into_inner());
            if !runs.entries.is_empty() {
                idle_since = None;
            } else if idle_since.get_or_insert_with(Instant::now).elapsed() >= LINGER {
                runs.asleep = true;
                while runs.entries.is_empty() {
                    runs = dog.wake.wait(runs).unwrap_or_else(|p| p.into_inner());
                }
                runs.asleep = false;
                idle_since = None;
            }
            runs.entries.clone()
        };
        let now = Instant::now();
        let mut any_done = false;
        for entry in &entries {
            any_done |= !entry.check(now);
        }
        drop(entries);
        if any_done {
            let mut runs = dog.runs.lock().unwrap_or_else(|p| p.into_inner());
            runs.entries.retain(|e| !e.state().done);
        }
        std::thread::sleep(TICK);
    }
}
