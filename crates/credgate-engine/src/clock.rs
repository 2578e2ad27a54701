//! Time, injected: the engine reads monotonic time for cache liveness and wall time only to
//! report expiry. Tests use [`TokioClock`] under a paused runtime to move through hours of cache
//! lifetimes in milliseconds.

use std::time::{Duration, Instant, SystemTime};

/// Milliseconds since the Unix epoch (0 before it), as the API and the state files write times.
pub fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A source of time.
pub trait Clock: Send + Sync + 'static {
    /// Monotonic now.
    fn now(&self) -> Instant;
    /// Wall-clock now, for reporting expiry times.
    fn wall(&self) -> SystemTime;
}

/// The operating system's clocks. Monotonic time comes from `CLOCK_MONOTONIC_COARSE`, which
/// costs a few nanoseconds where `Instant::now` costs tens on a VM; it is shifted forward by
/// the clock's resolution so that it is never behind the true time: an entry may be taken for
/// dead a few milliseconds early, never served late.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    base: Instant,
    base_coarse: Duration,
}

/// Reads `CLOCK_MONOTONIC_COARSE`, or its resolution.
fn coarse_clock(resolution: bool) -> Duration {
    use rustix::time::ClockId;
    let ts = if resolution {
        rustix::time::clock_getres(ClockId::MonotonicCoarse)
    } else {
        rustix::time::clock_gettime(ClockId::MonotonicCoarse)
    };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

impl SystemClock {
    pub fn new() -> Self {
        let base_coarse = coarse_clock(false);
        SystemClock {
            base: Instant::now() + coarse_clock(true),
            base_coarse,
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        self.base + coarse_clock(false).saturating_sub(self.base_coarse)
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

/// A clock that moves only when told ([`ManualClock::advance`]): for tests of what waits on
/// time (a retry interval, a throttle) without waiting, outside a paused tokio runtime.
#[derive(Debug)]
pub struct ManualClock {
    origin: (Instant, SystemTime),
    passed: std::sync::Mutex<Duration>,
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock {
            origin: (Instant::now(), SystemTime::now()),
            passed: std::sync::Mutex::new(Duration::ZERO),
        }
    }
}

impl ManualClock {
    /// Moves the clock `by` forward.
    pub fn advance(&self, by: Duration) {
        *self
            .passed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) += by;
    }

    fn passed(&self) -> Duration {
        *self
            .passed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.origin.0 + self.passed()
    }

    fn wall(&self) -> SystemTime {
        self.origin.1 + self.passed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_clock_is_never_behind() {
        let clock = SystemClock::new();
        for _ in 0..1000 {
            let before = Instant::now();
            let now = clock.now();
            assert!(now >= before, "{now:?} < {before:?}");
        }
        let a = clock.now();
        std::thread::sleep(Duration::from_millis(30));
        assert!(clock.now() >= a + Duration::from_millis(20));
    }
}
