//! Time, injected: the engine reads monotonic time for cache liveness and wall time only to
//! report expiry. Tests use [`TokioClock`] under a paused runtime to move through hours of cache
//! lifetimes in milliseconds.

use std::time::{Instant, SystemTime};

/// A source of time.
pub trait Clock: Send + Sync + 'static {
    /// Monotonic now.
    fn now(&self) -> Instant;
    /// Wall-clock now, for reporting expiry times.
    fn wall(&self) -> SystemTime;
}

/// The operating system's clocks.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn wall(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// Tokio's clock, which a test can pause and advance; wall time moves with it.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    base: tokio::time::Instant,
    base_wall: SystemTime,
}

impl TokioClock {
    /// Starts at the runtime's current time and the system's wall time.
    pub fn new() -> Self {
        TokioClock {
            base: tokio::time::Instant::now(),
            base_wall: SystemTime::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn wall(&self) -> SystemTime {
        self.base_wall + (tokio::time::Instant::now() - self.base)
    }
}
