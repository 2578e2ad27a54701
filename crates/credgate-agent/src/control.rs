//! What an operator does to a running agent: reload its sources, flush cached answers. A handle
//! of its own, which the `Admin` service and the composition root's SIGHUP get instead of the
//! `Agent` (decision 0032): it reaches the engine, the renewer and the sealed cache's writer,
//! nothing else of the agent.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use credgate_engine::clock::Clock;
use credgate_engine::metrics::EngineMetrics;
use credgate_engine::sources::{SourceError, Sources};
use credgate_engine::Engine;

use crate::metrics::AgentMetrics;
use crate::renewal::Renewer;
use crate::saver::Saver;
use crate::tasks::Tasks;

/// Why a reload did not take.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The sources were refused (the old config keeps serving): the error chain.
    #[error("{0}")]
    Refused(String),
    #[error("reload task failed")]
    Task,
}

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    /// The provider config identity now loaded (`None` without a provider config).
    pub identity: Option<String>,
    pub changed: bool,
}

/// Flushes by uids other than root's and the agent's own: one per this, all together (a flush
/// costs a plugin run per key and a rewrite of `cache.sealed`).
pub const UNPRIVILEGED_FLUSH_EVERY: Duration = Duration::from_secs(5);

/// Reload and flush. Cheap to clone.
#[derive(Clone)]
pub struct Control {
    inner: Arc<Inner>,
}

struct Inner {
    sources: Sources,
    engine: Arc<ArcSwap<Engine>>,
    engine_metrics: EngineMetrics,
    metrics: AgentMetrics,
    clock: Arc<dyn Clock>,
    renewer: Renewer,
    saver: Saver,
    tasks: Tasks,
    /// When the config in use was loaded.
    loaded: Mutex<SystemTime>,
    /// Held during a reload; the fingerprint of the sources the running engine was built from.
    loaded_from: Mutex<Option<[u8; 32]>>,
    /// When a uid other than root's and the agent's own last flushed.
    unprivileged_flush: Mutex<Option<Instant>>,
}

/// The parts a [`Control`] acts on, as the agent built them.
pub(crate) struct Parts {
    pub sources: Sources,
    pub engine: Arc<ArcSwap<Engine>>,
    pub engine_metrics: EngineMetrics,
    pub metrics: AgentMetrics,
    pub clock: Arc<dyn Clock>,
    pub renewer: Renewer,
    pub saver: Saver,
    pub tasks: Tasks,
    /// The fingerprint of the sources the engine was built from (`None`: built from none).
    pub fingerprint: Option<[u8; 32]>,
    /// When the engine was built from them.
    pub loaded: SystemTime,
}

impl Control {
    pub(crate) fn new(parts: Parts) -> Control {
        Control {
            inner: Arc::new(Inner {
                sources: parts.sources,
                engine: parts.engine,
                engine_metrics: parts.engine_metrics,
                metrics: parts.metrics,
                clock: parts.clock,
                renewer: parts.renewer,
                saver: parts.saver,
                tasks: parts.tasks,
                loaded: Mutex::new(parts.loaded),
                loaded_from: Mutex::new(parts.fingerprint),
                unprivileged_flush: Mutex::new(None),
            }),
        }
    }

    /// The engine in use now.
    pub fn engine(&self) -> Arc<Engine> {
        self.inner.engine.load_full()
    }

    /// The sources a reload reads.
    pub fn sources(&self) -> &Sources {
        &self.inner.sources
    }

    /// When the config in use was loaded.
    pub fn loaded(&self) -> SystemTime {
        *self.inner.loaded.lock()
    }

    /// Re-reads every source. On error the engine in use keeps serving.
    pub fn reload(&self) -> Result<Reloaded, SourceError> {
        let inner = &self.inner;
        let mut loaded_from = inner.loaded_from.lock();
        // The same bytes as the running engine's: nothing to rebuild, and its caches stay.
        let fingerprint = inner.sources.fingerprint();
        if fingerprint.is_some() && fingerprint == *loaded_from {
            inner.metrics.reload(true);
            return Ok(Reloaded {
                identity: self.engine().config_identity().map(str::to_owned),
                changed: false,
            });
        }
        let built = inner.sources.build(
            Some(inner.engine_metrics.clone()),
            Some(inner.clock.clone()),
        );
        let engine = match built {
            Ok(e) => e,
            Err(e) => {
                inner.metrics.reload(false);
                return Err(e);
            }
        };
        let before = self.engine().config_identity().map(str::to_owned);
        let identity = engine.config_identity().map(str::to_owned);
        inner.engine.store(Arc::new(engine));
        inner.metrics.config_refused.set(0);
        *loaded_from = fingerprint;
        *inner.loaded.lock() = inner.clock.wall();
        inner.metrics.reload(true);
        inner.renewer.refresh_all();
        Ok(Reloaded {
            changed: before != identity,
            identity,
        })
    }

    /// [`Control::reload`] on a blocking thread, logged (SIGHUP and the Reload RPC).
    pub async fn reload_logged(&self) -> Result<Reloaded, ReloadError> {
        let control = self.clone();
        let reloaded = match self
            .inner
            .tasks
            .spawn_blocking(move || control.reload())
            .await
        {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                let msg = credgate_core::text::error_chain(&e);
                tracing::error!(error = %msg, "reload refused; the old config keeps serving");
                return Err(ReloadError::Refused(msg));
            }
            Err(_) => {
                tracing::error!("reload task failed");
                return Err(ReloadError::Task);
            }
        };
        tracing::info!(
            config = reloaded.identity.as_deref().unwrap_or("none"),
            changed = reloaded.changed,
            "provider config reloaded"
        );
        Ok(reloaded)
    }

    /// Drops cached provider answers (of `provider`, or all; for `images`, or all) in memory
    /// and in the sealed file, renews tracked refs at once (Watch streams get what changed).
    pub async fn flush(
        &self,
        provider: Option<&str>,
        images: &[String],
    ) -> Result<Vec<credgate_engine::Dropped>, credgate_engine::FlushError> {
        let dropped =
            self.engine()
                .flush(provider, images, "flushed by an operator (ctl flush)")?;
        self.inner
            .metrics
            .cache_flushed
            .inc_by(dropped.len() as u64);
        tracing::info!(
            provider = provider.unwrap_or("*"),
            images = images.len(),
            dropped = dropped.len(),
            "provider answers flushed"
        );
        // A flush that dropped nothing (the answers the last one dropped are not back yet)
        // adds nothing: no write, no renewal, no plugin run.
        if !dropped.is_empty() {
            self.inner.saver.save().await;
            self.inner.renewer.flushed(&dropped);
        }
        Ok(dropped)
    }

    /// Whether a flush by a uid other than root's and the agent's own may go now: one per
    /// `UNPRIVILEGED_FLUSH_EVERY` (5 s) for all of them together.
    pub fn may_flush_unprivileged(&self) -> bool {
        let now = self.inner.clock.now();
        let mut last = self.inner.unprivileged_flush.lock();
        if last.is_some_and(|t| now < t + UNPRIVILEGED_FLUSH_EVERY) {
            return false;
        }
        *last = Some(now);
        true
    }
}
