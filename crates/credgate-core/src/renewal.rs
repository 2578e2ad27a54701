//! When to renew a credential and when to retry a failed renewal: pure functions of the
//! credential's lifetime, the failure count and a jitter sample, so that the agent's renewal
//! loop can be driven by any clock and any source of randomness.
//!
//! A credential fetched at `f` that expires at `e` (lifetime `L = e - f`) is renewed at
//! `e - lead - jitter`, where `lead = max(margin, fraction * L)`, capped at `L / 2` so that a
//! short-lived credential is not renewed the moment it arrives, and `jitter` is up to
//! `jitter * lead`, drawn per credential, so that many credentials fetched together do not
//! renew together. A credential without a known expiry is re-checked every `recheck`
//! (shortened by up to `jitter` of it). A failed renewal is retried after `backoff_base *
//! 2^(n-1)` capped at `backoff_max`, with the same jitter.

use std::time::{Duration, Instant};

/// The renewal tunables.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RenewalPolicy {
    /// Renew at least this long before expiry.
    pub margin: Duration,
    /// Renew at least this fraction of the lifetime before expiry (0 to 0.5).
    pub fraction: f64,
    /// Spread each renewal earlier by up to this fraction of its lead (0 to 1).
    pub jitter: f64,
    /// Re-check interval for credentials without a known expiry.
    pub recheck: Duration,
    /// The first retry delay after a failed renewal.
    pub backoff_base: Duration,
    /// The longest retry delay.
    pub backoff_max: Duration,
    /// How long a ref that no consumer holds any more is kept (and renewed) before eviction.
    pub grace: Duration,
}

impl Default for RenewalPolicy {
    fn default() -> Self {
        RenewalPolicy {
            margin: Duration::from_secs(60),
            fraction: 0.1,
            jitter: 0.2,
            recheck: Duration::from_secs(300),
            backoff_base: Duration::from_secs(2),
            backoff_max: Duration::from_secs(300),
            grace: Duration::from_secs(600),
        }
    }
}

impl RenewalPolicy {
    /// How long before expiry a credential of lifetime `lifetime` is renewed (before jitter).
    pub fn lead(&self, lifetime: Duration) -> Duration {
        self.margin
            .max(lifetime.mul_f64(self.fraction.clamp(0.0, 0.5)))
            .min(lifetime / 2)
    }

    /// How long a client that asks again only when its copy runs out (the kubelet) may keep
    /// answers fetched and expiring as `entries` say: until the renewal lead before the
    /// earliest expiry, so that it never holds a credential past its expiry and asks again once
    /// the credential is due for renewal. An answer that was not cached (`None`): zero.
    pub fn client_cache_for(
        &self,
        now: Instant,
        entries: impl IntoIterator<Item = (Instant, Option<Instant>)>,
    ) -> Duration {
        entries
            .into_iter()
            .map(|(fetched, expires)| match expires {
                Some(x) => x
                    .saturating_duration_since(now)
                    .saturating_sub(self.lead(x.saturating_duration_since(fetched))),
                None => Duration::ZERO,
            })
            .min()
            .unwrap_or_default()
    }

    /// The largest renewal lead among `entries` that are within it at `now`: such answers
    /// are renewed before a client that asks at the lead is served.
    pub fn due_lead(
        &self,
        now: Instant,
        entries: impl IntoIterator<Item = (Instant, Option<Instant>)>,
    ) -> Option<Duration> {
        entries
            .into_iter()
            .filter_map(|(fetched, expires)| {
                let x = expires?;
                let lead = self.lead(x.saturating_duration_since(fetched));
                (x.saturating_duration_since(now) <= lead).then_some(lead)
            })
            .max()
    }

    /// When to renew a credential fetched at `fetched`. `sample` is a jitter draw in `[0, 1)`.
    pub fn renew_at(&self, fetched: Instant, expires: Option<Instant>, sample: f64) -> Instant {
        let sample = sample.clamp(0.0, 1.0);
        let jitter = self.jitter.clamp(0.0, 1.0);
        match expires {
            Some(expires) => {
                let lifetime = expires.saturating_duration_since(fetched);
                let lead = self.lead(lifetime);
                let spread = lead.mul_f64(jitter * sample);
                // Never earlier than half the lifetime: lead <= L/2 and spread <= lead would
                // allow renewing at fetch time, so the spread is bounded by the rest.
                let spread = spread.min((lifetime / 2).saturating_sub(lead));
                expires - lead - spread
            }
            None => fetched + self.recheck - self.recheck.mul_f64(jitter * sample),
        }
    }

    /// When to retry after `failures` (at least 1) consecutive failed renewals.
    pub fn retry_at(&self, now: Instant, failures: u32, sample: f64) -> Instant {
        let exp = failures.saturating_sub(1).min(20);
        let delay = self
            .backoff_base
            .saturating_mul(1u32 << exp)
            .min(self.backoff_max);
        let jitter = self.jitter.clamp(0.0, 1.0) * sample.clamp(0.0, 1.0);
        now + delay - delay.mul_f64(jitter / 2.0)
    }
}

/// A jitter sample in `[0, 1)` derived from a seed: the same credential always gets the same
/// sample, so every ref it serves falls due at the same moment (one renewal per credential).
pub fn sample(seed: u64) -> f64 {
    // splitmix64
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_caches_until_the_lead_before_the_earliest_expiry() {
        let p = RenewalPolicy::default();
        let t0 = Instant::now();
        let hour = Duration::from_secs(3600);
        // One hour of life: lead = max(1 min, 10%) = 6 min; at t0 the client keeps it 54 min.
        let one = [(t0, Some(t0 + hour))];
        assert_eq!(p.client_cache_for(t0, one), Duration::from_secs(54 * 60));
        assert_eq!(p.due_lead(t0, one), None);
        // Inside the lead it is due, and the client may not keep it.
        let late = t0 + Duration::from_secs(55 * 60);
        assert_eq!(p.client_cache_for(late, one), Duration::ZERO);
        assert_eq!(p.due_lead(late, one), Some(Duration::from_secs(360)));
        // The earliest of several wins; an uncached answer means zero; nothing means zero.
        let two = [
            (t0, Some(t0 + hour)),
            (t0, Some(t0 + Duration::from_secs(600))),
        ];
        assert_eq!(p.client_cache_for(t0, two), Duration::from_secs(540));
        assert_eq!(p.client_cache_for(t0, [(t0, None)]), Duration::ZERO);
        assert_eq!(p.client_cache_for(t0, []), Duration::ZERO);
        // Short lives are capped at half: 30 s of life is kept 15 s.
        let short = [(t0, Some(t0 + Duration::from_secs(30)))];
        assert_eq!(p.client_cache_for(t0, short), Duration::from_secs(15));
    }

    const MIN: Duration = Duration::from_secs(60);

    #[test]
    fn ten_minute_credential_renews_a_minute_or_so_early() {
        let p = RenewalPolicy::default();
        let t0 = Instant::now();
        let exp = t0 + 10 * MIN;
        assert_eq!(p.renew_at(t0, Some(exp), 0.0), exp - MIN);
        let latest_jitter = p.renew_at(t0, Some(exp), 0.999_999);
        assert!(latest_jitter < exp - MIN && latest_jitter >= exp - MIN - MIN / 5);
    }

    #[test]
    fn long_lived_credential_renews_by_fraction() {
        let p = RenewalPolicy::default();
        let t0 = Instant::now();
        let exp = t0 + 12 * 60 * MIN;
        assert_eq!(p.renew_at(t0, Some(exp), 0.0), exp - 72 * MIN);
    }

    #[test]
    fn short_lived_credential_renews_no_earlier_than_half_its_life() {
        let p = RenewalPolicy::default();
        let t0 = Instant::now();
        let exp = t0 + Duration::from_secs(30);
        for s in [0.0, 0.5, 0.99] {
            assert_eq!(
                p.renew_at(t0, Some(exp), s),
                t0 + Duration::from_secs(15),
                "{s}"
            );
        }
        assert_eq!(p.renew_at(t0, Some(t0), 0.3), t0);
    }

    #[test]
    fn unknown_expiry_is_rechecked() {
        let p = RenewalPolicy::default();
        let t0 = Instant::now();
        assert_eq!(p.renew_at(t0, None, 0.0), t0 + p.recheck);
        assert!(p.renew_at(t0, None, 0.9) < t0 + p.recheck);
    }

    #[test]
    fn retries_back_off_exponentially_up_to_the_cap() {
        let p = RenewalPolicy::default();
        let t0 = Instant::now();
        let delays: Vec<u64> = (1..=12)
            .map(|n| (p.retry_at(t0, n, 0.0) - t0).as_secs())
            .collect();
        assert_eq!(delays, [2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300, 300]);
        let jittered = p.retry_at(t0, 3, 0.999) - t0;
        assert!(jittered < Duration::from_secs(8) && jittered >= Duration::from_millis(7200));
    }

    #[test]
    fn samples_are_spread_and_stable() {
        let xs: Vec<f64> = (0..1000).map(sample).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((0.45..0.55).contains(&mean), "{mean}");
        assert_eq!(sample(42), sample(42));
    }
}
