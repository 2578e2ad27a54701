//! The saver of the sealed provider cache (unless `--no-persist-cache`): restores the providers'
//! answers and the named consumers' refs at start, writes them when they change (off the
//! lookup path, fsynced before they count as kept) and at once after a flush or a refusal.

use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;
use credgate_engine::clock::Clock;
use credgate_engine::Engine;
use parking_lot::Mutex;
use tokio::task::JoinHandle;

use crate::metrics::AgentMetrics;
use crate::renewal::Renewer;
use crate::saved_cache::{DropReason, SavedCache};
use crate::tasks::Tasks;

/// What the sealed provider cache did: restored at start, dropped (by reason), saved since.
#[derive(Debug, Clone, Default)]
pub struct SavedCacheReport {
    pub enabled: bool,
    pub restored: u64,
    pub dropped: std::collections::BTreeMap<DropReason, u64>,
    pub consumers_restored: u64,
    /// Entries in the last save, and when it was fsynced.
    pub saved_entries: u64,
    pub last_saved: Option<SystemTime>,
}

/// Opens the sealed provider cache in `dir` and puts back what may be served again: the
/// answers into the engine's caches, the named consumers' refs into the renewer (which renews
/// at once what became due meanwhile). Runs no plugin.
fn restore(
    dir: Option<&std::path::Path>,
    engine: &Engine,
    renewer: &Renewer,
    metrics: &AgentMetrics,
) -> (Option<crate::saved_cache::SavedCache>, SavedCacheReport) {
    let mut report = SavedCacheReport::default();
    let Some(dir) = dir else {
        return (None, report);
    };
    let cache = match crate::saved_cache::SavedCache::open(dir) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "provider answers are not kept across restarts");
            return (None, report);
        }
    };
    report.enabled = true;
    let loaded = cache.load();
    report.dropped = loaded.dropped;
    let restored = engine.restore(loaded.entries);
    report.restored = restored.restored;
    for (why, n) in restored.dropped {
        *report.dropped.entry(why.into()).or_default() += n;
    }
    for (consumer, refs) in loaded.consumers {
        match renewer.restore(&consumer, &refs) {
            Ok(_) => report.consumers_restored += 1,
            Err(e) => {
                tracing::warn!(consumer = %consumer, error = %e, "a saved consumer's refs not restored");
                *report
                    .dropped
                    .entry(DropReason::ConsumerInvalid)
                    .or_default() += 1;
            }
        }
    }
    metrics.cache_restored.inc_by(report.restored);
    for (why, n) in &report.dropped {
        metrics.cache_dropped(*why, *n);
    }
    if report.restored > 0 || !report.dropped.is_empty() {
        tracing::info!(
            restored = report.restored,
            dropped = ?report.dropped,
            consumers = report.consumers_restored,
            "provider answers restored from the sealed cache"
        );
    }
    (Some(cache), report)
}

/// Writes the sealed provider cache. Cheap to clone.
#[derive(Clone)]
pub struct Saver {
    inner: Arc<Inner>,
}

struct Inner {
    /// `None`: the sealed cache is off, and nothing is written.
    cache: Option<SavedCache>,
    /// The credential memory and its file (kept with the cache: off when it is off).
    memory: Arc<crate::memory::Refusals>,
    memory_file: Option<crate::memory::MemoryFile>,
    report: Mutex<SavedCacheReport>,
    engine: Arc<ArcSwap<Engine>>,
    renewer: Renewer,
    metrics: AgentMetrics,
    clock: Arc<dyn Clock>,
    tasks: Tasks,
}

impl Saver {
    /// Opens the sealed cache in `dir` (none: off) and restores what may be served again
    /// into the engine in use and the renewer. Runs no plugin.
    pub fn open(
        dir: Option<&std::path::Path>,
        memory: (
            Arc<crate::memory::Refusals>,
            Option<crate::memory::MemoryFile>,
        ),
        engine: Arc<ArcSwap<Engine>>,
        renewer: Renewer,
        metrics: AgentMetrics,
        clock: Arc<dyn Clock>,
        tasks: Tasks,
    ) -> Saver {
        let (cache, report) = restore(dir, &engine.load(), &renewer, &metrics);
        Saver {
            inner: Arc::new(Inner {
                cache,
                memory: memory.0,
                memory_file: memory.1,
                report: Mutex::new(report),
                engine,
                renewer,
                metrics,
                clock,
                tasks,
            }),
        }
    }

    /// What the sealed provider cache did.
    pub fn report(&self) -> SavedCacheReport {
        self.inner.report.lock().clone()
    }

    /// Keeps the providers' answers, the tracked refs and the credential memory sealed on
    /// disk, off the lookup path: checks every second whether any changed and writes them on a
    /// blocking thread (fsynced before they count as kept); a last write when the agent's tasks
    /// stop. Nothing when the sealed cache is off. The caller awaits it at shutdown.
    pub fn spawn(&self) -> JoinHandle<()> {
        let saver = self.clone();
        let shutdown = self.inner.tasks.token().clone();
        self.inner.tasks.spawn(async move {
            if saver.inner.cache.is_none() {
                return;
            }
            let mut last = None;
            loop {
                let stopping = tokio::select! {
                    () = tokio::time::sleep(std::time::Duration::from_secs(1)) => false,
                    () = shutdown.cancelled() => true,
                };
                let engine = saver.inner.engine.load_full();
                let now = (
                    Arc::as_ptr(&engine) as usize,
                    engine.generation(),
                    saver.inner.renewer.version(),
                    saver.inner.memory.version(),
                );
                if last != Some(now) && saver.save().await {
                    last = Some(now);
                }
                if stopping {
                    return;
                }
            }
        })
    }

    /// [`Saver::save_now`] on a blocking thread, off the threads that serve calls.
    pub async fn save(&self) -> bool {
        let saver = self.clone();
        self.inner
            .tasks
            .spawn_blocking(move || saver.save_now())
            .await
            .unwrap_or(false)
    }

    /// Writes the sealed provider cache and the credential memory now (blocking); whether both
    /// were written.
    pub fn save_now(&self) -> bool {
        let Some(cache) = &self.inner.cache else {
            return false;
        };
        if let Some(file) = &self.inner.memory_file {
            if let Err(e) = file.save(&self.inner.memory, self.inner.clock.wall()) {
                tracing::warn!(error = %e, "refused and handed-out credentials not saved");
                return false;
            }
        }
        let entries = self.inner.engine.load().saved_entries();
        let consumers = self.inner.renewer.named_consumers();
        match cache.save(entries, consumers) {
            Ok(n) => {
                self.inner.metrics.cache_persisted.inc_by(n as u64);
                let mut report = self.inner.report.lock();
                report.saved_entries = n as u64;
                report.last_saved = Some(self.inner.clock.wall());
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "provider answers not saved");
                false
            }
        }
    }
}
