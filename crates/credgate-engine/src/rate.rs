//! A per-provider limit on plugin runs (`--plugin-rate PROVIDER=N/s[,burst=M]`): a token
//! bucket. A run that finds no token waits for one: lookups of the same key keep joining the
//! waiting run, so a flood of misses becomes at most N runs a second against the registry's
//! token service (ECR's GetAuthorizationToken allows 20 a second per account and region, burst
//! 200). Root's and the agent's own runs wait first; any other caller may have
//! [`MAX_WAITING_PER_CALLER`] runs waiting, and a run whose turn would come after [`MAX_WAIT`]
//! is refused at once (`rate_limited`), so no caller can make the node's lookups wait behind
//! its own.

use parking_lot::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Runs a second, and how many may start at once after a quiet spell.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PluginRate {
    pub per_second: f64,
    pub burst: u32,
}

impl PluginRate {
    /// Parses `N/s[,burst=M]` (burst defaults to N, at least 1).
    pub fn parse(s: &str) -> Result<PluginRate, RateError> {
        let (rate, burst) = match s.split_once(',') {
            Some((rate, burst)) => {
                let b = burst
                    .strip_prefix("burst=")
                    .ok_or_else(|| RateError::Burst(burst.to_owned()))?;
                let b: u32 = b.parse().map_err(|_| RateError::NotWhole(b.to_owned()))?;
                (rate, Some(b))
            }
            None => (s, None),
        };
        let n = rate
            .strip_suffix("/s")
            .ok_or_else(|| RateError::PerSecond(rate.to_owned()))?;
        let per_second: f64 = n.parse().map_err(|_| RateError::NotANumber(n.to_owned()))?;
        if !(per_second > 0.0 && per_second.is_finite()) {
            return Err(RateError::NotAbove0(n.to_owned()));
        }
        let burst = burst.unwrap_or(per_second.ceil() as u32).max(1);
        Ok(PluginRate { per_second, burst })
    }
}

/// Why a `--plugin-rate` value does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateError {
    #[error("{0:?}: expected burst=M")]
    Burst(String),
    #[error("{0:?}: not a whole number")]
    NotWhole(String),
    #[error("{0:?}: expected N/s")]
    PerSecond(String),
    #[error("{0:?}: not a number")]
    NotANumber(String),
    #[error("{0:?}: must be above 0")]
    NotAbove0(String),
}

/// Who a lookup is for, as a provider's rate limit sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// The caller's uid (`None`: unknown).
    pub uid: Option<u32>,
    /// Root, the agent's own uid, and the agent itself (renewal): served before the others,
    /// never bounded per caller.
    pub privileged: bool,
}

impl Default for Caller {
    /// The agent itself.
    fn default() -> Self {
        Caller {
            uid: None,
            privileged: true,
        }
    }
}

impl Caller {
    /// A caller of `uid`, privileged when it is root or `own`.
    pub fn of(uid: Option<u32>, own: u32) -> Caller {
        Caller {
            uid,
            privileged: uid.is_some_and(|u| u == 0 || u == own),
        }
    }
}

/// Runs one caller that is not privileged may have waiting for a provider's turn at once.
pub const MAX_WAITING_PER_CALLER: usize = 8;
/// The longest a run may expect to wait for its turn: below the kubelet's one-minute deadline
/// for a plugin, so that a lookup that would wait past it fails at once instead.
pub const MAX_WAIT: Duration = Duration::from_secs(50);

/// Why a run was not given a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The caller already has this many runs waiting.
    CallerWaiting(usize),
    /// The turn would come only after this long.
    TooLong(Duration),
}

struct Ticket {
    id: u64,
    privileged: bool,
    /// Counted against this caller (not privileged).
    counted: Option<u32>,
}

struct State {
    tokens: f64,
    at: Instant,
    /// Runs waiting for a token, in the order they get one: privileged ones first.
    queue: std::collections::VecDeque<Ticket>,
    next_id: u64,
    waiting: std::collections::HashMap<u32, usize>,
}

impl State {
    fn refill(&mut self, rate: PluginRate) {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * rate.per_second;
        self.tokens = (self.tokens + refill).min(f64::from(rate.burst));
        self.at = now;
    }

    fn remove(&mut self, id: u64) {
        if let Some(i) = self.queue.iter().position(|t| t.id == id) {
            if let Some(t) = self.queue.remove(i) {
                if let Some(uid) = t.counted {
                    if let Some(n) = self.waiting.get_mut(&uid) {
                        *n -= 1;
                        if *n == 0 {
                            self.waiting.remove(&uid);
                        }
                    }
                }
            }
        }
    }
}

/// The bucket of one provider, with the queue of runs waiting for a token: privileged callers
/// are served first, every other caller may have [`MAX_WAITING_PER_CALLER`] runs waiting, and a
/// run whose turn would come after [`MAX_WAIT`] is refused at once.
pub struct Bucket {
    rate: PluginRate,
    state: Mutex<State>,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bucket").field("rate", &self.rate).finish()
    }
}

/// Takes a waiting run out of the queue however its wait ends (a cancelled lookup included).
struct Queued<'a> {
    bucket: &'a Bucket,
    id: u64,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.bucket.lock().remove(self.id);
    }
}

impl Bucket {
    pub fn new(rate: PluginRate) -> Self {
        Bucket {
            rate,
            state: Mutex::new(State {
                tokens: f64::from(rate.burst),
                at: Instant::now(),
                queue: std::collections::VecDeque::new(),
                next_id: 0,
                waiting: std::collections::HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, State> {
        self.state.lock()
    }

    /// The rate, for messages.
    pub fn rate(&self) -> PluginRate {
        self.rate
    }

    /// Takes a token for `caller`, waiting its turn when there is none; whether it had to
    /// wait. Refused at once when the caller has too many runs waiting or its turn would come
    /// too late.
    pub async fn take(&self, caller: Caller) -> Result<bool, Refusal> {
        let id = {
            let mut s = self.lock();
            s.refill(self.rate);
            if s.queue.is_empty() && s.tokens >= 1.0 {
                s.tokens -= 1.0;
                return Ok(false);
            }
            let counted = (!caller.privileged).then(|| caller.uid.unwrap_or(u32::MAX));
            if let Some(uid) = counted {
                let n = s.waiting.get(&uid).copied().unwrap_or(0);
                if n >= MAX_WAITING_PER_CALLER {
                    return Err(Refusal::CallerWaiting(n));
                }
            }
            let ahead = if caller.privileged {
                s.queue.iter().take_while(|t| t.privileged).count()
            } else {
                s.queue.len()
            };
            let expected = Duration::from_secs_f64(
                ((ahead as f64) + 1.0 - s.tokens).max(0.0) / self.rate.per_second,
            );
            if expected > MAX_WAIT {
                return Err(Refusal::TooLong(expected));
            }
            let id = s.next_id;
            s.next_id += 1;
            let ticket = Ticket {
                id,
                privileged: caller.privileged,
                counted,
            };
            s.queue.insert(ahead, ticket);
            if let Some(uid) = counted {
                *s.waiting.entry(uid).or_default() += 1;
            }
            id
        };
        let _queued = Queued { bucket: self, id };
        loop {
            let wait = {
                let mut s = self.lock();
                s.refill(self.rate);
                let at = s.queue.iter().position(|t| t.id == id).unwrap_or(0);
                if at == 0 && s.tokens >= 1.0 {
                    s.tokens -= 1.0;
                    return Ok(true);
                }
                Duration::from_secs_f64(
                    ((at as f64) + 1.0 - s.tokens).max(0.001) / self.rate.per_second,
                )
            };
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse() {
        assert_eq!(
            PluginRate::parse("20/s,burst=200"),
            Ok(PluginRate {
                per_second: 20.0,
                burst: 200
            })
        );
        assert_eq!(PluginRate::parse("0.5/s").unwrap().burst, 1);
        for bad in [
            "20",
            "0/s",
            "-1/s",
            "x/s",
            "5/s,burst",
            "5/s,burst=x",
            "5/s,b=2",
        ] {
            assert!(PluginRate::parse(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_bucket_lets_the_burst_through_then_the_rate() {
        let b = Bucket::new(PluginRate {
            per_second: 2.0,
            burst: 3,
        });
        let start = Instant::now();
        let me = Caller::default();
        for _ in 0..3 {
            assert!(!b.take(me).await.unwrap(), "the burst does not wait");
        }
        assert!(b.take(me).await.unwrap(), "the fourth waits");
        assert!(b.take(me).await.unwrap());
        // Two more tokens at 2/s: about a second.
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(990) && took < Duration::from_millis(1100),
            "{took:?}"
        );
    }

    /// A caller with runs waiting cannot hold back root: root's run is served before them,
    /// the caller may have only so many waiting, and one whose turn would come too late is
    /// refused at once.
    #[tokio::test(start_paused = true)]
    async fn privileged_runs_go_first_and_each_caller_waits_a_bounded_amount() {
        let b = std::sync::Arc::new(Bucket::new(PluginRate {
            per_second: 1.0,
            burst: 1,
        }));
        assert!(!b.take(Caller::default()).await.unwrap(), "the burst");
        let tenant = Caller {
            uid: Some(1000),
            privileged: false,
        };
        let order = std::sync::Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..MAX_WAITING_PER_CALLER {
            let (b, order) = (b.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                b.take(tenant).await.unwrap();
                order.lock().push(format!("tenant-{i}"));
            }));
            tokio::task::yield_now().await;
        }
        assert_eq!(
            b.take(tenant).await,
            Err(Refusal::CallerWaiting(MAX_WAITING_PER_CALLER))
        );
        let started = Instant::now();
        assert!(b.take(Caller::of(Some(0), 4242)).await.unwrap());
        order.lock().push("root".into());
        assert!(
            started.elapsed() <= Duration::from_millis(1100),
            "root waited {:?} behind the tenant's runs",
            started.elapsed()
        );
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(order.lock()[0], "root");
        // Another caller's turn would come after the wait limit: refused at once.
        let slow = Bucket::new(PluginRate {
            per_second: 0.1,
            burst: 1,
        });
        assert!(!slow.take(tenant).await.unwrap());
        let other = Caller {
            uid: Some(2000),
            privileged: false,
        };
        assert!(matches!(slow.take(other).await, Ok(true)));
        let started = Instant::now();
        let mut waiting = Vec::new();
        let slow = std::sync::Arc::new(slow);
        for uid in 3000..3005 {
            let slow = slow.clone();
            waiting.push(tokio::spawn(async move {
                slow.take(Caller {
                    uid: Some(uid),
                    privileged: false,
                })
                .await
            }));
            tokio::task::yield_now().await;
        }
        let refused = slow
            .take(Caller {
                uid: Some(4000),
                privileged: false,
            })
            .await;
        assert!(matches!(refused, Err(Refusal::TooLong(_))), "{refused:?}");
        assert!(
            started.elapsed() < Duration::from_millis(10),
            "refused at once"
        );
        for w in waiting {
            w.abort();
        }
    }
}
