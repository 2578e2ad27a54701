//! Who owns the agent's tasks. Every task the agent starts (a listener, a Watch forwarder, a
//! renewal, a write of what the guard learned) is spawned through one [`Tasks`]: one token
//! tells them all to stop, and the node waits for them under its shutdown deadline. Nothing is
//! spawned detached.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;
pub use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The agent's tasks and their stop signal. Cheap to clone; clones share both.
#[derive(Debug, Clone, Default)]
pub struct Tasks {
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl Tasks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `task` on the runtime as one of the agent's tasks.
    pub fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(task)
    }

    /// Runs `work` on a blocking thread as one of the agent's tasks.
    pub fn spawn_blocking<F, T>(&self, work: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        self.tracker.spawn_blocking(work)
    }

    /// The signal every task stops on.
    pub fn token(&self) -> &CancellationToken {
        &self.stop
    }

    /// Tells every task to stop.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Whether the stop was given.
    pub fn stopping(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Waits for every task to end, at most `deadline`; whether they all did. No task can be
    /// added afterwards without being waited for by a later call.
    pub async fn wait(&self, deadline: Duration) -> bool {
        self.tracker.close();
        let ended = tokio::time::timeout(deadline, self.tracker.wait())
            .await
            .is_ok();
        self.tracker.reopen();
        ended
    }

    /// How many tasks are running.
    pub fn len(&self) -> usize {
        self.tracker.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn wait_ends_when_every_task_saw_the_stop() {
        let tasks = Tasks::new();
        for _ in 0..3 {
            let stop = tasks.token().clone();
            tasks.spawn(async move { stop.cancelled().await });
        }
        assert_eq!(tasks.len(), 3);
        assert!(
            !tasks.wait(Duration::from_secs(1)).await,
            "nothing stopped them yet"
        );
        tasks.stop();
        assert!(tasks.wait(Duration::from_secs(1)).await);
        assert!(tasks.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_ignores_the_stop_is_not_waited_for_past_the_deadline() {
        let tasks = Tasks::new();
        tasks.spawn(std::future::pending::<()>());
        tasks.stop();
        let started = tokio::time::Instant::now();
        assert!(!tasks.wait(Duration::from_secs(2)).await);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }
}
