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
//! runtime; with the pidfd that was most of `miss`'s cost over a bare spawn (see
//! docs/benchmark-notes.md). The thread's clock is [`std::time::Instant`]: plugin timeouts are real time,
//! also under tokio's paused clock.
//!
//! The invariant that makes the kills safe: a process group is signalled only while its
//! leader (the plugin) has not been reaped, so its id cannot have been reused. A run marks
//! itself [`Watch::done`] (under the same lock the watchdog signals under) before it reaps.

use parking_lot::{Condvar, Mutex, MutexGuard};
use std::sync::Arc;

use crate::owned_thread::OwnedThread;
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
        self.state.lock()
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
    /// The owner is gone: the thread ends.
    stop: bool,
}

struct Shared {
    runs: Mutex<Runs>,
    wake: Condvar,
}

impl Shared {
    fn runs(&self) -> MutexGuard<'_, Runs> {
        self.runs.lock()
    }
}

/// The watchdog thread's owner: the thread starts with the first run it watches and ends
/// when this is dropped (which the engine's runner does when the engine goes).
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    thread: OwnedThread,
}

impl Default for Watchdog {
    fn default() -> Self {
        Watchdog {
            shared: Arc::new(Shared {
                runs: Mutex::new(Runs {
                    entries: Vec::new(),
                    asleep: false,
                    stop: false,
                }),
                wake: Condvar::new(),
            }),
            thread: OwnedThread::default(),
        }
    }
}

impl Watchdog {
    /// Registers a run of the plugin `pid`.
    pub(crate) fn watch(
        &self,
        pid: i32,
        deadline: Instant,
        drain_grace: Duration,
    ) -> std::io::Result<Watch> {
        if !self.thread.start_once("credgate-watchdog", || {
            let shared = self.shared.clone();
            move || watch_runs(&shared)
        }) {
            return Err(std::io::Error::other(
                "the plugin watchdog thread could not be started",
            ));
        }
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
        let mut runs = self.shared.runs();
        runs.entries.push(entry.clone());
        let asleep = runs.asleep;
        drop(runs);
        if asleep {
            self.shared.wake.notify_one();
        }
        Ok(Watch { entry })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.runs().stop = true;
        self.shared.wake.notify_one();
        self.thread.join();
    }
}

/// The thread: looks at the runs every [`TICK`] while any is in flight, sleeps on the condvar
/// after [`LINGER`] without one, ends when its owner says stop.
fn watch_runs(shared: &Shared) {
    let mut idle_since: Option<Instant> = None;
    loop {
        let entries: Vec<Arc<Entry>> = {
            let mut runs = shared.runs();
            if runs.stop {
                return;
            }
            if !runs.entries.is_empty() {
                idle_since = None;
            } else if idle_since.get_or_insert_with(Instant::now).elapsed() >= LINGER {
                runs.asleep = true;
                while runs.entries.is_empty() && !runs.stop {
                    shared.wake.wait(&mut runs);
                }
                runs.asleep = false;
                idle_since = None;
                if runs.stop {
                    return;
                }
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
            shared.runs().entries.retain(|e| !e.state().done);
        }
        std::thread::sleep(TICK);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spawn::{self, Program};
    use std::path::Path;

    fn start(script: &str) -> spawn::Child {
        let program =
            Program::new(Path::new("/bin/sh"), &["-c".into(), script.into()], &[], "").unwrap();
        spawn::spawn(&program, c"CREDGATE_TEST=1").unwrap()
    }

    /// Waits (on the watchdog's news, at most 10 s) until `seen` says so.
    async fn until(watch: &Watch, seen: impl Fn(Seen) -> bool) -> Seen {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let notified = watch.news();
                let now = watch.seen();
                if seen(now) {
                    return now;
                }
                notified.await;
            }
        })
        .await
        .expect("the watchdog told in time")
    }

    #[tokio::test]
    async fn a_run_past_its_deadline_has_its_group_killed() {
        let dog = Watchdog::default();
        let child = start("sleep 30");
        let watch = dog
            .watch(child.pid, Instant::now(), Duration::from_secs(5))
            .unwrap();
        let seen = until(&watch, |s| s.timed_out).await;
        assert!(!seen.drained);
        // Killed: it exits by SIGKILL.
        let status = loop {
            if let Some(status) = spawn::reap(child.pid).unwrap() {
                break status;
            }
            tokio::task::yield_now().await;
        };
        assert_eq!(status.to_string(), "signal: 9 (SIGKILL)");
    }

    #[tokio::test]
    async fn an_exit_is_seen_and_held_pipes_are_given_up_after_the_grace() {
        let dog = Watchdog::default();
        // The plugin exits at once; a child that left its group (setsid) holds its pipes for
        // a second, then ends by itself.
        let child = start("setsid sleep 1 & exit 0");
        let grace = Duration::from_millis(50);
        let watch = dog
            .watch(child.pid, Instant::now() + Duration::from_secs(60), grace)
            .unwrap();
        let seen = until(&watch, |s| s.exited).await;
        assert!(!seen.timed_out);
        let seen = until(&watch, |s| s.drained).await;
        assert!(seen.exited && !seen.timed_out);
        watch.done();
        assert!(spawn::reap(child.pid).unwrap().is_some());
    }

    #[tokio::test]
    async fn a_run_marked_done_is_left_alone() {
        let dog = Watchdog::default();
        let child = start("sleep 30");
        let watch = dog
            .watch(
                child.pid,
                Instant::now() + Duration::from_millis(20),
                grace(),
            )
            .unwrap();
        watch.done();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(watch.seen(), Seen::default(), "nothing done after done()");
        assert!(spawn::peek(child.pid) == spawn::Peek::Running);
        spawn::kill_group(child.pid);
        while spawn::reap(child.pid).unwrap().is_none() {
            tokio::task::yield_now().await;
        }
    }

    fn grace() -> Duration {
        Duration::from_millis(10)
    }

    /// Dropping the owner ends the thread: the drop joins it, so a thread that did not stop
    /// would hang this test (and nextest's timeout would fail it). Asleep or ticking alike.
    #[tokio::test]
    async fn dropping_the_owner_stops_the_thread() {
        let ticking = Watchdog::default();
        let child = start("exit 0");
        let watch = ticking
            .watch(child.pid, Instant::now() + Duration::from_secs(60), grace())
            .unwrap();
        until(&watch, |s| s.exited).await;
        drop(watch);
        drop(ticking);
        while spawn::reap(child.pid).unwrap().is_none() {
            tokio::task::yield_now().await;
        }
        let never_started = Watchdog::default();
        drop(never_started);
    }
}
