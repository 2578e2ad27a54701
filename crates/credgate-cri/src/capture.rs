//! What the proxy captures, decided and written off the path that forwards calls.
//!
//! A pull the runtime says succeeded offers its credential here ([`Capturer::offer`], which
//! never waits: a full queue drops the offer and counts it). A task owned by the proxy takes
//! the offers, at most [`CONCURRENT`] at a time, [`PER_REGISTRY`] per registry and
//! [`PER_NAMESPACE`] per pod namespace (so a registry that stalls, or a tenant that pulls from
//! many that do, holds back its own captures, not other tenants'): a credential already captured for the
//! repository is left as it is; any other is kept only once the registry has shown that it
//! checked it and accepted it ([`Verifier::authenticates`]: the registry challenged an
//! anonymous request and took the credential), then sealed and written on a blocking thread.
//! So a credential for an anonymously readable repository, or garbage the registry never
//! looked at, is never served.

use std::sync::Arc;

use credgate_core::reference::ImageRef;
use secrecy::ExposeSecret;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::metrics::ProxyMetrics;
use credgate_agent::captured::{CaptureError, Captured, PodCredential};
use credgate_agent::guard::registry::{Target, Verifier};

/// Offers that may wait for the task.
pub const QUEUE: usize = 64;
/// Offers taken and waiting for room (their registry's or namespace's confirmations busy).
pub const PENDING: usize = 256;
/// Confirmations that may run at once (each bounded by the registry client's timeout).
pub const CONCURRENT: usize = 32;
/// Confirmations one registry may have running at once.
pub const PER_REGISTRY: usize = 2;
/// Confirmations one pod namespace may have running at once.
pub const PER_NAMESPACE: usize = 4;

/// A successful pull's credential, offered for capture.
pub struct Offer {
    /// The image as pulled (its registry, repository and tag or digest are asked about).
    pub image: String,
    /// The normalized repository it is kept for.
    pub repository: String,
    pub credential: PodCredential,
    /// Told when the offer is settled (captured and fsynced, or not kept), whatever became
    /// of it.
    pub settled: Option<tokio::sync::oneshot::Sender<()>>,
}

/// The proxy's side of the capture task. Dropping it ends the task once the offers taken are
/// done.
pub struct Capturer {
    tx: mpsc::Sender<Offer>,
    metrics: ProxyMetrics,
}

impl Capturer {
    /// Starts the task; its handle is the caller's to await after dropping the capturer.
    pub fn start(
        captured: Arc<Captured>,
        verifier: Verifier,
        metrics: ProxyMetrics,
    ) -> (Capturer, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let task = tokio::spawn(run(rx, captured, verifier, metrics.clone()));
        (Capturer { tx, metrics }, task)
    }

    /// Offers a credential; never waits. The receiver is told when the offer is settled;
    /// `None` when it was not taken (too many waiting).
    pub fn offer(
        &self,
        image: String,
        repository: String,
        credential: PodCredential,
    ) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let offer = Offer {
            image,
            repository,
            credential,
            settled: Some(tx),
        };
        if self.tx.try_send(offer).is_err() {
            self.metrics.capture(crate::metrics::CaptureResult::Busy);
            tracing::warn!("pull credentials not captured: too many captures waiting");
            return None;
        }
        Some(rx)
    }
}

/// Who an offer's confirmation counts against: its registry and its pod's namespace.
type Slot = (String, String);

fn slot_of(offer: &Offer) -> Slot {
    let registry = ImageRef::parse(&offer.image)
        .map(|r| r.registry().to_owned())
        .unwrap_or_default();
    (registry, offer.credential.namespace.clone())
}

/// What runs, by registry and by namespace.
#[derive(Default)]
struct Busy {
    registries: std::collections::HashMap<String, usize>,
    namespaces: std::collections::HashMap<String, usize>,
    total: usize,
}

impl Busy {
    fn has_room(&self, (registry, namespace): &Slot) -> bool {
        self.total < CONCURRENT
            && self.registries.get(registry).copied().unwrap_or(0) < PER_REGISTRY
            && self.namespaces.get(namespace).copied().unwrap_or(0) < PER_NAMESPACE
    }

    fn take(&mut self, (registry, namespace): &Slot) {
        self.total += 1;
        *self.registries.entry(registry.clone()).or_default() += 1;
        *self.namespaces.entry(namespace.clone()).or_default() += 1;
    }

    fn give_back(&mut self, (registry, namespace): &Slot) {
        self.total -= 1;
        for (map, key) in [
            (&mut self.registries, registry),
            (&mut self.namespaces, namespace),
        ] {
            if let Some(n) = map.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    map.remove(key);
                }
            }
        }
    }
}

async fn run(
    mut rx: mpsc::Receiver<Offer>,
    captured: Arc<Captured>,
    verifier: Verifier,
    metrics: ProxyMetrics,
) {
    let mut running: JoinSet<()> = JoinSet::new();
    // Each running task's slot, by task id: given back however the task ends.
    let mut slots: std::collections::HashMap<tokio::task::Id, Slot> = Default::default();
    let mut pending: std::collections::VecDeque<(Slot, Offer)> = Default::default();
    let mut busy = Busy::default();
    let mut open = true;
    while open || !running.is_empty() {
        tokio::select! {
            Some(done) = running.join_next_with_id(), if !running.is_empty() => {
                let id = match done {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                };
                if let Some(slot) = slots.remove(&id) {
                    busy.give_back(&slot);
                }
            }
            offer = rx.recv(), if open => match offer {
                Some(offer) if pending.len() < PENDING => {
                    pending.push_back((slot_of(&offer), offer));
                }
                Some(_) => {
                    metrics.capture(crate::metrics::CaptureResult::Busy);
                    tracing::warn!("pull credentials not captured: too many captures waiting");
                }
                None => open = false,
            },
        }
        // Oldest first, each as soon as its registry and namespace have room.
        let mut i = 0;
        while i < pending.len() {
            if busy.has_room(&pending[i].0) {
                let (slot, offer) = pending.remove(i).expect("in range");
                busy.take(&slot);
                let (c, v, m) = (captured.clone(), verifier.clone(), metrics.clone());
                let id = running.spawn(handle(offer, c, v, m)).id();
                slots.insert(id, slot);
            } else {
                i += 1;
            }
        }
    }
}

async fn handle(offer: Offer, captured: Arc<Captured>, verifier: Verifier, metrics: ProxyMetrics) {
    let Offer {
        image,
        repository,
        credential,
        settled,
    } = offer;
    // Dropped (told) however the capture ends.
    let _settled = settled;
    if let Err(e) = credgate_agent::captured::fits(&repository, &credential) {
        metrics.capture(crate::metrics::CaptureResult::TooLarge);
        tracing::warn!(repository = %repository, error = %e, "pull credentials not captured");
        return;
    }
    if captured
        .for_namespace(&repository, &credential.namespace)
        .is_some_and(|held| held.same(&credential))
    {
        metrics.capture(crate::metrics::CaptureResult::Unchanged);
        return;
    }
    let Ok(parsed) = ImageRef::parse(&image) else {
        metrics.capture(crate::metrics::CaptureResult::Failed);
        return;
    };
    let target = Target::of(&parsed);
    match verifier
        .authenticates(
            &target,
            &credential.username,
            credential.password.expose_secret(),
        )
        .await
    {
        Ok(true) => {}
        Ok(false) => {
            metrics.capture(crate::metrics::CaptureResult::Unconfirmed);
            tracing::info!(repository = %repository, "pull credentials not captured: the registry did not check them (it serves the image anonymously) or refused them");
            return;
        }
        Err(why) => {
            metrics.capture(crate::metrics::CaptureResult::Unreachable);
            tracing::warn!(repository = %repository, error = %why, "pull credentials not captured: the registry could not be asked to confirm them");
            return;
        }
    }
    let written = {
        let repository = repository.clone();
        tokio::task::spawn_blocking(move || captured.capture(&repository, credential)).await
    };
    match written {
        Ok(Ok(dropped)) => {
            metrics.capture(crate::metrics::CaptureResult::Captured);
            metrics.captured_dropped.inc_by(dropped as u64);
            tracing::info!(repository = %repository, dropped, "pull credentials captured");
        }
        Ok(Err(e @ CaptureError::TooLarge(_))) => {
            metrics.capture(crate::metrics::CaptureResult::TooLarge);
            tracing::warn!(repository = %repository, error = %e, "pull credentials not captured");
        }
        Ok(Err(e)) => {
            metrics.capture(crate::metrics::CaptureResult::Failed);
            tracing::error!(repository = %repository, error = %e, "pull credentials not captured");
        }
        Err(e) => {
            metrics.capture(crate::metrics::CaptureResult::Failed);
            tracing::error!(repository = %repository, error = %e, "pull credentials not captured");
        }
    }
}
