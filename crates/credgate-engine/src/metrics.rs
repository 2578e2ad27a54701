//! The engine's Prometheus metrics: plugin runs, run durations, errors by reason, cache hits,
//! misses and entries, per provider. Counters on the lookup hot path are striped per thread so
//! that concurrent lookups never write the same cache line.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::{Atomic, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::FailureReason;

const STRIPES: usize = 16;

#[repr(align(128))]
#[derive(Default)]
struct Padded(AtomicU64);

/// A `u64` counter spread over cache-line-padded stripes, one picked per thread.
#[derive(Default)]
pub struct Striped {
    stripes: [Padded; STRIPES],
}

impl std::fmt::Debug for Striped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Striped({})", self.get())
    }
}

fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    SLOT.with(|s| *s)
}

impl Atomic<u64> for Striped {
    fn inc(&self) -> u64 {
        self.inc_by(1)
    }

    fn inc_by(&self, v: u64) -> u64 {
        self.stripes[stripe()].0.fetch_add(v, Ordering::Relaxed)
    }

    fn get(&self) -> u64 {
        self.stripes
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .sum()
    }
}

/// A hot-path counter.
pub type FastCounter = Counter<u64, Striped>;

/// The label of every per-provider family.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ProviderLabel {
    provider: String,
}

/// `credgate_plugin_errors_total`'s labels.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct FailureLabels {
    provider: String,
    reason: FailureReason,
}

/// A metric label's value is its `as_str`: for the label enums of every crate.
#[macro_export]
macro_rules! label_values {
    ($($label:ty),*) => {
        $(impl prometheus_client::encoding::EncodeLabelValue for $label {
            fn encode(
                &self,
                encoder: &mut prometheus_client::encoding::LabelValueEncoder,
            ) -> std::fmt::Result {
                std::fmt::Write::write_str(encoder, self.as_str())
            }
        })*
    };
}

label_values!(FailureReason);

/// Every metric family of the engine; providers hold handles into it.
#[derive(Clone)]
pub struct EngineMetrics {
    runs: Family<ProviderLabel, Counter>,
    delayed: Family<ProviderLabel, Counter>,
    run_seconds: Family<ProviderLabel, Histogram, fn() -> Histogram>,
    errors: Family<FailureLabels, Counter>,
    hits: Family<ProviderLabel, FastCounter>,
    misses: Family<ProviderLabel, Counter>,
    entries: Family<ProviderLabel, Gauge>,
}

fn run_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

impl Default for EngineMetrics {
    fn default() -> Self {
        EngineMetrics {
            runs: Family::default(),
            delayed: Family::default(),
            run_seconds: Family::new_with_constructor(run_histogram as fn() -> Histogram),
            errors: Family::default(),
            hits: Family::default(),
            misses: Family::default(),
            entries: Family::default(),
        }
    }
}

/// The processes sweepers killed, process-wide ([`crate::sweep::killed`]): read at each
/// scrape, so that the count survives reloads (which build new runners).
#[derive(Debug)]
struct Escapees;

impl prometheus_client::collector::Collector for Escapees {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric as _;
        let killed = prometheus_client::metrics::counter::ConstCounter::new(crate::sweep::killed());
        let metric = encoder.encode_descriptor(
            "plugin_escapees_killed",
            "Processes a plugin left behind (daemons that outlived their run) that credgate killed",
            None,
            killed.metric_type(),
        )?;
        killed.encode(metric)
    }
}

impl EngineMetrics {
    /// Registers every family under the `credgate_` prefix.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("credgate");
        r.register("plugin_runs", "Plugin executions", self.runs.clone());
        r.register(
            "plugin_runs_delayed",
            "Plugin runs that waited for their turn under --plugin-rate",
            self.delayed.clone(),
        );
        r.register(
            "plugin_run_duration_seconds",
            "Plugin execution time",
            self.run_seconds.clone(),
        );
        r.register(
            "plugin_errors",
            "Plugin failures by reason",
            self.errors.clone(),
        );
        r.register(
            "cache_hits",
            "Lookups served from a provider cache",
            self.hits.clone(),
        );
        r.register(
            "cache_misses",
            "Lookups that needed a plugin run",
            self.misses.clone(),
        );
        r.register(
            "cache_entries",
            "Live entries in a provider cache",
            self.entries.clone(),
        );
        r.register_collector(Box::new(Escapees));
    }

    /// The handles of one provider.
    pub fn provider(&self, name: &str) -> ProviderMetrics {
        let l = ProviderLabel {
            provider: name.to_owned(),
        };
        ProviderMetrics {
            name: name.to_owned(),
            runs: self.runs.get_or_create(&l).clone(),
            delayed: self.delayed.get_or_create(&l).clone(),
            run_seconds: self.run_seconds.get_or_create(&l).clone(),
            hits: self.hits.get_or_create(&l).clone(),
            misses: self.misses.get_or_create(&l).clone(),
            entries: self.entries.get_or_create(&l).clone(),
            errors: self.errors.clone(),
        }
    }
}

/// One provider's metric handles, resolved once so the hot path does no label lookups.
#[derive(Clone)]
pub struct ProviderMetrics {
    name: String,
    pub runs: Counter,
    /// Runs that waited for their turn under a rate limit.
    pub delayed: Counter,
    pub run_seconds: Histogram,
    pub hits: FastCounter,
    pub misses: Counter,
    pub entries: Gauge,
    errors: Family<FailureLabels, Counter>,
}

impl ProviderMetrics {
    fn failure(&self, reason: FailureReason) -> FailureLabels {
        FailureLabels {
            provider: self.name.clone(),
            reason,
        }
    }

    /// Counts a failure under its reason.
    pub fn error(&self, reason: FailureReason) {
        self.errors.get_or_create(&self.failure(reason)).inc();
    }

    /// Failures under one reason so far.
    pub fn reason_count(&self, reason: FailureReason) -> u64 {
        self.errors
            .get(&self.failure(reason))
            .map_or(0, |c| c.get())
    }

    /// Failures so far, all reasons but refusals during backoff (no plugin ran for those).
    pub fn error_count(&self) -> u64 {
        FailureReason::ALL
            .into_iter()
            .filter(|r| *r != FailureReason::Backoff)
            .map(|r| self.reason_count(r))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn striped_counts_across_threads() {
        let c = FastCounter::default();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    (0..1000).for_each(|_| {
                        c.inc();
                    })
                });
            }
        });
        assert_eq!(c.get(), 4000);
    }

    #[test]
    fn exposes_text_format() {
        let m = EngineMetrics::default();
        let p = m.provider("ecr");
        p.runs.inc();
        p.hits.inc();
        p.error(crate::FailureReason::Timeout);
        let mut reg = Registry::default();
        m.register(&mut reg);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        assert!(
            out.contains("credgate_plugin_runs_total{provider=\"ecr\"} 1"),
            "{out}"
        );
        assert!(
            out.contains("credgate_cache_hits_total{provider=\"ecr\"} 1"),
            "{out}"
        );
        assert!(
            out.contains("credgate_plugin_errors_total{provider=\"ecr\",reason=\"timeout\"} 1"),
            "{out}"
        );
        assert!(
            out.contains("# TYPE credgate_plugin_escapees_killed counter")
                && out.contains("credgate_plugin_escapees_killed_total "),
            "{out}"
        );
        assert_eq!(p.error_count(), 1);
    }
}
