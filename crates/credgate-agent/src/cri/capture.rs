//! What the proxy captures, decided and written off the path that forwards calls.
//!
//! A pull the runtime says succeeded offers its credential here ([`Capturer::offer`], which
//! never waits: a full queue drops the offer and counts it). A task owned by the proxy takes
//! the offers, at most [`CONCURRENT`] at a time: a credential already captured for the
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

use crate::captured::{CaptureError, Captured, Credential};
use crate::guard::registry::{Target, Verifier};
use crate::metrics::AgentMetrics;

/// Offers that may wait for the task.
pub const QUEUE: usize = 64;
/// Confirmations that may run at once (each bounded by the registry client's timeout).
pub const CONCURRENT: usize = 8;

/// A successful pull's credential, offered for capture.
pub struct Offer {
    /// The image as pulled (its registry, repository and tag or digest are asked about).
    pub image: String,
    /// The normalized repository it is kept for.
    pub repository: String,
    pub credential: Credential,
    /// Told when the offer is settled (captured and fsynced, or not kept), whatever became
    /// of it.
    pub settled: Option<tokio::sync::oneshot::Sender<()>>,
}

/// The proxy's side of the capture task. Dropping it ends the task once the offers taken are
/// done.
pub struct Capturer {
    tx: mpsc::Sender<Offer>,
    metrics: AgentMetrics,
}

impl Capturer {
    /// Starts the task; its handle is the caller's to await after dropping the capturer.
    pub fn start(
        captured: Arc<Captured>,
        verifier: Verifier,
        metrics: AgentMetrics,
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
        credential: Credential,
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

async fn run(
    mut rx: mpsc::Receiver<Offer>,
    captured: Arc<Captured>,
    verifier: Verifier,
    metrics: AgentMetrics,
) {
    let mut running = JoinSet::new();
    loop {
        // Room for one more before taking it: the queue, not this set, holds what waits.
        while running.len() >= CONCURRENT {
            running.join_next().await;
        }
        tokio::select! {
            Some(_) = running.join_next(), if !running.is_empty() => {}
            offer = rx.recv() => match offer {
                Some(offer) => {
                    running.spawn(handle(offer, captured.clone(), verifier.clone(), metrics.clone()));
                }
                None => break,
            },
        }
    }
    while running.join_next().await.is_some() {}
}

async fn handle(offer: Offer, captured: Arc<Captured>, verifier: Verifier, metrics: AgentMetrics) {
    let Offer {
        image,
        repository,
        credential,
        settled,
    } = offer;
    // Dropped (told) however the capture ends.
    let _settled = settled;
    if let Err(e) = crate::captured::fits(&repository, &credential) {
        metrics.capture(crate::metrics::CaptureResult::TooLarge);
        tracing::warn!(repository = %repository, error = %e, "pull credentials not captured");
        return;
    }
    if captured
        .for_repository(&repository)
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
