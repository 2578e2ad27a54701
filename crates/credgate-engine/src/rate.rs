//! A per-provider limit on plugin runs (`--plugin-rate PROVIDER=N/s[,burst=M]`): a token
//! bucket. A run that finds no token waits for one (it is not refused): lookups of the same key
//! keep joining the waiting run, so a flood of misses becomes at most N runs a second against
//! the registry's token service (ECR's GetAuthorizationToken allows 20 a second per account and
//! region, burst 200).

use std::sync::Mutex;
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
    pub fn parse(s: &str) -> Result<PluginRate, String> {
        let (rate, burst) = match s.split_once(',') {
            Some((rate, burst)) => {
                let b = burst
                    .strip_prefix("burst=")
                    .ok_or_else(|| format!("{burst:?}: expected burst=M"))?;
                let b: u32 = b
                    .parse()
                    .map_err(|_| format!("{b:?}: not a whole number"))?;
                (rate, Some(b))
            }
            None => (s, None),
        };
        let n = rate
            .strip_suffix("/s")
            .ok_or_else(|| format!("{rate:?}: expected N/s"))?;
        let per_second: f64 = n.parse().map_err(|_| format!("{n:?}: not a number"))?;
        if !(per_second > 0.0 && per_second.is_finite()) {
            return Err(format!("{n:?}: must be above 0"));
        }
        let burst = burst.unwrap_or(per_second.ceil() as u32).max(1);
        Ok(PluginRate { per_second, burst })
    }
}

/// The bucket of one provider.
#[derive(Debug)]
pub struct Bucket {
    rate: PluginRate,
    state: Mutex<(f64, Instant)>,
}

impl Bucket {
    pub fn new(rate: PluginRate) -> Self {
        Bucket {
            rate,
            state: Mutex::new((f64::from(rate.burst), Instant::now())),
        }
    }

    /// Takes a token, waiting for one when there is none; whether it had to wait.
    pub async fn take(&self) -> bool {
        let mut waited = false;
        loop {
            let wait = {
                let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                let refill = now.duration_since(s.1).as_secs_f64() * self.rate.per_second;
                s.0 = (s.0 + refill).min(f64::from(self.rate.burst));
                s.1 = now;
                if s.0 >= 1.0 {
                    s.0 -= 1.0;
                    return waited;
                }
                Duration::from_secs_f64((1.0 - s.0) / self.rate.per_second)
            };
            waited = true;
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
        for _ in 0..3 {
            assert!(!b.take().await, "the burst does not wait");
        }
        assert!(b.take().await, "the fourth waits");
        assert!(b.take().await);
        // Two more tokens at 2/s: about a second.
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(990) && took < Duration::from_millis(1100),
            "{took:?}"
        );
    }
}
