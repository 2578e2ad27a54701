//! The node's own pulls: the images the node keeps present (the runtime's sandbox image, which
//! containerd pulls with no credential when a pod starts; the operator's
//! `--cri-proxy-keep-image`s) are checked with `ImageStatus` at start, every check period and
//! after each `RemoveImage` through the proxy, and an absent one is pulled through the
//! runtime's CRI with the credential the agent's sources give for it (never a pod's captured
//! one), logged, counted and recorded by the guard as the node's. Each image has its own loop,
//! so a slow registry delays only its own image. A failed pull is tried again after a backoff,
//! and so is a re-pull soon after the last one (a removal storm costs a bounded number of
//! pulls). Only images the operator configured or the runtime's config names are ever pulled so
//! (decision 0022).

use std::sync::Arc;
use std::time::Duration;

use credgate_api::cri::{self as wire, PULL_IMAGE};

use secrecy::ExposeSecret as _;

use super::fill::fill;
use super::pull_request::{pull_of, redacted};
use super::pulls::{answered, settle, Answered, Pulls, Whose};
use super::runtime::{self, ask, exchange, framed, CallerConn};
use super::MAX_PULL_MESSAGE;
use crate::node_images::{backoff, NodeImage, OwnPull};
use crate::outcome::{PullAuth, PullResult};
use tokio_util::sync::CancellationToken;

/// The longest one of the node's own pulls may take (a sandbox image is small; a kept image
/// may not be).
const PULL_TIMEOUT: Duration = Duration::from_secs(600);

/// A successful pull within this long of the previous successful pull of the same image is a
/// re-pull in a row (a removal storm): the next waits [`backoff`] of their count.
const REPULL_WINDOW: Duration = Duration::from_secs(600);

/// Runs `loops` together in the calling task until every one has ended (each ends at the
/// stop): a hand-written `join_all`, since the loops borrow the keeper.
async fn all<F: std::future::Future<Output = ()> + Unpin>(mut loops: Vec<F>) {
    std::future::poll_fn(|cx| {
        loops.retain_mut(|f| std::pin::Pin::new(f).poll(cx).is_pending());
        if loops.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
}

/// What the keeper works with.
pub(super) struct Keeper {
    pub(super) images: Vec<NodeImage>,
    pub(super) pulls: Arc<Pulls>,
    /// The proxy's own runtime connection.
    pub(super) own: Arc<CallerConn>,
    pub(super) every: Duration,
}

impl Keeper {
    /// Keeps the images present until `stop`: one loop an image, all in this task, so that one
    /// registry's slowness (a pull may take 10 minutes) holds only its own image, never the
    /// sandbox image's (the first) nor another kept image's.
    pub(super) async fn run(self, stop: CancellationToken) {
        self.pulls.ctx.node_images.set(&self.images);
        let loops: Vec<_> = (0..self.images.len())
            .map(|index| Box::pin(self.keep(index, &stop)))
            .collect();
        all(loops).await;
    }

    /// The loop of the `index`-th image: checked at start, every period and after each
    /// removal through the proxy; pulled when absent, unless its hold-off (after a failure, or
    /// after re-pulls in a row) has not passed.
    async fn keep(&self, index: usize, stop: &CancellationToken) {
        let ctx = &self.pulls.ctx;
        let state = &ctx.node_images;
        let image = &self.images[index];
        let mut removed = self.pulls.removed.subscribe();
        loop {
            let now = ctx.clock.wall();
            let held = state
                .list()
                .get(index)
                .and_then(|s| s.retry_at)
                .and_then(|at| at.duration_since(now).ok())
                .filter(|left| !left.is_zero());
            // Held off: asked whether it is there (for status), not pulled. A pull under way
            // is given up at the stop (the runtime goes on with its own).
            let checked = tokio::select! {
                hold = self.check(index, image, held.is_none()) => hold,
                () = stop.cancelled() => return,
            };
            let wait = held
                .or(checked)
                .map_or(self.every, |left| left.min(self.every));
            ctx.metrics
                .node_images_absent
                .set(i64::try_from(state.absent()).unwrap_or(i64::MAX));
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                // After each RemoveImage through the proxy.
                changed = removed.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = stop.cancelled() => return,
            }
            if stop.is_cancelled() {
                return;
            }
        }
    }

    /// Asks the runtime whether it has `image` and, when it does not and `may_pull`, pulls it;
    /// the time until it may be pulled again when the pull failed or was a re-pull.
    async fn check(&self, index: usize, image: &NodeImage, may_pull: bool) -> Option<Duration> {
        let ctx = &self.pulls.ctx;
        let state = &ctx.node_images;
        let status = ask::<_, wire::ImageStatusResponse>(
            &self.own,
            wire::IMAGE_STATUS,
            &wire::ImageStatusRequest {
                image: Some(wire::ImageSpec {
                    image: image.image.clone(),
                }),
            },
            MAX_PULL_MESSAGE,
        )
        .await;
        let present = status.ok().map(|s| s.image.is_some());
        let now = ctx.clock.wall();
        state.update(index, |s| {
            s.present = present;
            s.checked = Some(now);
            if present == Some(true) && s.failures > 0 {
                s.failures = 0;
                s.retry_at = None;
            }
        });
        if present != Some(false) || !may_pull {
            return None;
        }
        let done = self.pull(image).await;
        let ok = done.result == PullResult::Ok;
        let mut hold = None;
        state.update(index, |s| {
            s.present = Some(ok);
            if ok {
                s.failures = 0;
                // A re-pull soon after the last one (a removal storm, the image GC taking it
                // again and again) holds the next off as failures do: 5 s, 10 s, ... 5 min.
                let in_a_row = s
                    .last_pull
                    .as_ref()
                    .filter(|p| p.result == PullResult::Ok)
                    .and_then(|p| done.at.duration_since(p.at).ok())
                    .is_some_and(|since| since < REPULL_WINDOW);
                s.repulls = if in_a_row {
                    s.repulls.saturating_add(1)
                } else {
                    0
                };
                let after = backoff(s.repulls);
                s.retry_at = Some(done.at + after);
                hold = Some(after);
            } else {
                s.failures = s.failures.saturating_add(1);
                let after = backoff(s.failures);
                s.retry_at = Some(done.at + after);
                hold = Some(after);
            }
            s.last_pull = Some(done);
        });
        hold
    }

    /// One pull of `image` through the runtime's CRI, with the first credential the agent's
    /// sources give for it, as a `PullImage` through the proxy is logged, refused and
    /// recorded.
    async fn pull(&self, image: &NodeImage) -> OwnPull {
        let pulls = &self.pulls;
        let ctx = &pulls.ctx;
        let at = ctx.clock.wall();
        let failed = |auth: PullAuth, message: String| OwnPull {
            at,
            auth,
            result: PullResult::Error,
            message,
        };
        let (message, filled) = self.request(image).await;
        let Some(mut pull) = pull_of(&message, credgate_engine::clock::unix_ms(at)) else {
            return failed(PullAuth::None, "the pull could not be encoded".into());
        };
        pull.filled = filled;
        pull.node_image = Some(image.why);
        let auth = pull.filled.clone().map_or(PullAuth::None, PullAuth::Filled);
        if let Some(guard) = &pulls.guard {
            if let Err(e) = guard.record_intent(&pull.image).await {
                tracing::error!(error = %credgate_core::text::error_chain(&e), "pull intent not recorded");
            }
        }
        let started = std::time::Instant::now();
        let Some(whole) = self.exchange(&message).await else {
            let said = "the container runtime could not be reached, or did not answer in time";
            tracing::warn!(image = %image.image, why = image.why.as_str(), "{said}");
            return failed(auth, said.into());
        };
        let said = redacted(&whole.message(), &pull.carried);
        let result = PullResult::of(whole.code().unwrap_or(2), &said);
        let said = crate::pull_log::capped(&said, crate::pull_log::MESSAGE);
        ctx.metrics
            .node_image_pulls
            .get_or_create(&crate::metrics::NodeImagePullLabels {
                why: image.why,
                result,
            })
            .inc();
        if result != PullResult::Ok {
            tracing::warn!(image = %image.image, why = image.why.as_str(), named_by = %image.named_by, auth = %auth, runtime_message = %said, "the node's own pull of an image it keeps failed: tried again after a backoff");
        }
        if let Answered::Settle(_) | Answered::Refused(_) =
            answered(pulls, &pull, &whole, started).await
        {
            settle(pulls, pull, Whose::Node, &whole).await;
        }
        let message = if result == PullResult::Ok {
            String::new()
        } else {
            said
        };
        OwnPull {
            at,
            auth,
            result,
            message,
        }
    }

    /// The `PullImage` message of `image`, with the credential the agent's sources give for it
    /// (scoped as a pod's pull is), and the source that gave it.
    async fn request(
        &self,
        image: &NodeImage,
    ) -> (Vec<u8>, Option<credgate_agent::refusal::Given>) {
        use prost::Message as _;
        let ctx = &self.pulls.ctx;
        let filled = fill(ctx, &image.image).await;
        let registry = credgate_core::reference::ImageRef::parse(&image.image)
            .map(|r| r.registry().to_owned())
            .unwrap_or_default();
        let auth = filled.as_ref().map(|(_, c)| wire::AuthConfig {
            username: c.username.clone(),
            password: c.password.expose_secret().to_owned(),
            server_address: ctx.policy.scope(&registry).server_address(""),
            ..Default::default()
        });
        let message = wire::PullImageRequest {
            image: Some(wire::ImageSpec {
                image: image.image.clone(),
            }),
            auth,
            sandbox_config: None,
        }
        .encode_to_vec();
        (message, filled.map(|(source, _)| source))
    }

    /// The `PullImage` of `message` on the proxy's own runtime connection, its answer read
    /// whole; `None` when the runtime cannot be reached or does not answer in time.
    async fn exchange(&self, message: &[u8]) -> Option<runtime::Whole> {
        let frame = framed(message)?;
        let parts = runtime::own_call(PULL_IMAGE, Some(PULL_TIMEOUT))?;
        let call = exchange(&self.own, parts, frame, MAX_PULL_MESSAGE);
        tokio::time::timeout(PULL_TIMEOUT, call).await.ok()?.ok()
    }
}
