//! The images the node keeps present on its own behalf: the runtime's sandbox (pause) image and
//! the images the operator names (`--cri-proxy-keep-image`). The keeper (`keep.rs`) checks
//! and pulls them; this is what it knows of each, for `Status`, `explain`, the pull log and
//! metrics (decision 0022).

use std::time::{Duration, SystemTime};

use parking_lot::Mutex;

pub use crate::outcome::Why;
use crate::outcome::{PullAuth, PullResult};

/// Images the node keeps at most (the sandbox image and the operator's).
pub const MAX_NODE_IMAGES: usize = 32;

/// An image the node keeps, and where its name came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeImage {
    pub image: String,
    pub why: Why,
    /// Where the agent read the name: `--cri-sandbox-image`,
    /// `pinned_images.sandbox in /etc/containerd/config.toml`, `--cri-proxy-keep-image`.
    pub named_by: String,
}

/// A pull the agent made of a node image.
#[derive(Debug, Clone)]
pub struct OwnPull {
    pub at: SystemTime,
    /// The credential it went with (`none`, or `filled:SOURCE`).
    pub auth: PullAuth,
    pub result: PullResult,
    /// The runtime's message when it failed (never a secret: see the pull log).
    pub message: String,
}

/// What the keeper knows of one node image.
#[derive(Debug, Clone)]
pub struct Seen {
    pub image: NodeImage,
    /// Whether the runtime has it; `None` until it was asked (or when it could not be).
    pub present: Option<bool>,
    pub checked: Option<SystemTime>,
    /// The last pull the agent made of it.
    pub last_pull: Option<OwnPull>,
    /// Pulls that failed in a row; the next is not tried before `retry_at`.
    pub failures: u32,
    /// Successful pulls in a row, each soon after the last (the image removed again and again):
    /// the next is not tried before `retry_at` either.
    pub repulls: u32,
    pub retry_at: Option<SystemTime>,
}

/// The first retry after a failed pull; each failure in a row doubles it, up to
/// [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_secs(5);
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// How long after its `failures`-th failure in a row a pull is tried again.
pub fn backoff(failures: u32) -> Duration {
    let doubled = FIRST_BACKOFF.saturating_mul(1u32 << failures.saturating_sub(1).min(16));
    doubled.min(MAX_BACKOFF)
}

/// The node images and what the keeper knows of each (empty without the CRI proxy).
#[derive(Default)]
pub struct NodeImages {
    seen: Mutex<Vec<Seen>>,
}

impl NodeImages {
    /// The images the node keeps from now on (the proxy sets them when it starts).
    pub fn set(&self, images: &[NodeImage]) {
        *self.seen.lock() = images
            .iter()
            .map(|image| Seen {
                image: image.clone(),
                present: None,
                checked: None,
                last_pull: None,
                failures: 0,
                repulls: 0,
                retry_at: None,
            })
            .collect();
    }

    /// Everything known, in the order the images were named.
    pub fn list(&self) -> Vec<Seen> {
        self.seen.lock().clone()
    }

    /// Changes what is known of the `index`-th image.
    pub fn update(&self, index: usize, change: impl FnOnce(&mut Seen)) {
        if let Some(seen) = self.seen.lock().get_mut(index) {
            change(seen);
        }
    }

    /// Node images the runtime was found not to have (and failed to be given).
    pub fn absent(&self) -> usize {
        self.seen
            .lock()
            .iter()
            .filter(|s| s.present == Some(false))
            .count()
    }
}

/// What the keeper knows of a node image, as `Status` tells it.
pub fn status(s: Seen) -> credgate_api::v1::NodeImageStatus {
    let pull = s.last_pull.as_ref();
    let ms = |t: Option<SystemTime>| t.map_or(0, credgate_engine::clock::unix_ms);
    credgate_api::v1::NodeImageStatus {
        image: s.image.image,
        why: s.image.why.as_str().to_owned(),
        named_by: s.image.named_by,
        state: match s.present {
            Some(true) => "PRESENT",
            Some(false) => "ABSENT",
            None => "UNKNOWN",
        }
        .to_owned(),
        checked_unix_ms: ms(s.checked),
        pulled_unix_ms: ms(pull.map(|p| p.at)),
        pull_auth: pull.map(|p| p.auth.to_string()).unwrap_or_default(),
        pull_result: pull
            .map(|p| p.result.as_str().to_owned())
            .unwrap_or_default(),
        pull_message: pull.map(|p| p.message.clone()).unwrap_or_default(),
        failures: s.failures,
        retry_unix_ms: ms(s.retry_at),
    }
}

/// One line on a node image, for `explain`: why the node keeps it, whether the runtime has it,
/// and how the agent last pulled it.
pub fn describe(s: &Seen) -> String {
    let state = match s.present {
        Some(true) => "the runtime has it",
        Some(false) => "the runtime does not have it",
        None => "not checked yet",
    };
    let pulled = match &s.last_pull {
        None => "the agent has not pulled it (it was there)".to_owned(),
        Some(p) if p.result == PullResult::Ok => format!("the agent pulled it with {}", p.auth),
        Some(p) => format!(
            "the agent's last pull with {} ended {}: {}{}",
            p.auth,
            p.result.as_str(),
            p.message,
            if s.failures > 0 {
                format!(" ({} in a row; tried again with a backoff)", s.failures)
            } else {
                String::new()
            }
        ),
    };
    let why = match s.image.why {
        Why::Sandbox => "the runtime's sandbox image",
        Why::Kept => "kept on the node",
    };
    format!(
        "{}: {why} (named by {}); {state}; {pulled}",
        s.image.image, s.image.named_by
    )
}

/// The node images a configuration names: the sandbox image first, then the kept ones, each
/// once; an image that does not parse, or more than [`MAX_NODE_IMAGES`], is an error.
pub fn named(
    sandbox: Option<(String, String)>,
    kept: &[String],
) -> Result<Vec<NodeImage>, NodeImageError> {
    let mut out: Vec<NodeImage> = Vec::new();
    let sandbox = sandbox.map(|(image, named_by)| (image, Why::Sandbox, named_by));
    let kept = kept
        .iter()
        .map(|i| (i.clone(), Why::Kept, "--cri-proxy-keep-image".to_owned()));
    for (image, why, named_by) in sandbox.into_iter().chain(kept) {
        if let Err(source) = credgate_core::reference::ImageRef::parse(&image) {
            return Err(NodeImageError::Reference {
                named_by,
                image,
                source,
            });
        }
        if out.iter().any(|o| o.image == image) {
            continue;
        }
        if out.len() == MAX_NODE_IMAGES {
            return Err(NodeImageError::TooMany);
        }
        out.push(NodeImage {
            image,
            why,
            named_by,
        });
    }
    Ok(out)
}

/// Why the node images a configuration names are refused ([`named`]).
#[derive(Debug, thiserror::Error)]
pub enum NodeImageError {
    #[error("{named_by}: {} is not an image reference", credgate_core::text::Quoted(.image))]
    Reference {
        named_by: String,
        image: String,
        #[source]
        source: credgate_core::reference::ReferenceError,
    },
    #[error("more than {MAX_NODE_IMAGES} images to keep on the node")]
    TooMany,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_five_seconds_to_five_minutes() {
        let got: Vec<u64> = (1..=9).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(got, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
    }

    #[test]
    fn named_images_are_checked_deduplicated_and_bounded() {
        let sandbox = Some((
            "reg.example/mirror/pause:3.10".to_owned(),
            "--cri-sandbox-image".to_owned(),
        ));
        let kept = vec![
            "reg.example/mirror/pause:3.10".to_owned(),
            "reg.example/agent:v1".to_owned(),
        ];
        let got = named(sandbox, &kept).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].why, Why::Sandbox);
        assert_eq!(got[1].why, Why::Kept);
        let e = named(None, &["UPPER/Case:1".to_owned()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--cri-proxy-keep-image") && e.contains("not an image"),
            "{e}"
        );
        let many: Vec<String> = (0..=MAX_NODE_IMAGES)
            .map(|i| format!("r.io/a{i}:v1"))
            .collect();
        assert!(named(None, &many)
            .unwrap_err()
            .to_string()
            .contains("more than 32"));
    }
}
