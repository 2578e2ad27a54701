//! The CRI proxy's pull decision log: the recent pulls (a bounded ring, never a secret), for
//! `credgate ctl pulls`, and the throttle of the "unauthorized without credentials" warning.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime};

use crate::outcome::PullAuth;

/// Pulls kept.
pub const RING: usize = 256;
/// The longest runtime message kept with a pull.
pub const MESSAGE: usize = 512;
/// The longest image reference kept (a valid one is at most 1024 bytes).
pub const IMAGE: usize = 1024;
/// The longest namespace kept (Kubernetes: 63).
pub const NAMESPACE: usize = 63;
/// The longest pod name kept (Kubernetes: 253).
pub const POD_NAME: usize = 253;

/// `s` as the pull log keeps and logs a field of at most `max` bytes, cut on a character boundary and marked with `…`.
pub fn capped(s: &str, max: usize) -> String {
    let mut s = s
        .get(..s.len().min(max + 4))
        .map_or_else(|| s.chars().take(max).collect::<String>(), str::to_owned);
    cut(&mut s, max);
    s
}

/// `s` cut to at most `max` bytes (on a character boundary), marked with `…` when cut.
fn cut(s: &mut String, max: usize) {
    if s.len() > max {
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
        s.push('…');
    }
}
/// A warning about one image at most this often.
pub const WARN_EVERY: Duration = Duration::from_secs(600);
/// Images remembered for the warning's throttle.
const WARNED: usize = 1024;

/// One pull through the proxy.
#[derive(Debug, Clone)]
pub struct PullRecord {
    pub at: SystemTime,
    pub image: String,
    /// The image's normalized repository, for `ctl pulls IMAGE`.
    pub repository: String,
    pub pod_namespace: String,
    pub pod_name: String,
    pub auth: PullAuth,
    /// The runtime's gRPC code (0: pulled) and message.
    pub code: i32,
    pub message: String,
    pub duration: Duration,
    /// For a pull that ended unauthorized with a credential one of the agent's sources gave:
    /// what became of it ([`credgate_agent::refusal::Report::describe`], or why it was not sent).
    pub refusal: String,
    /// A pull the agent made itself, on the node's behalf, and why (no caller asked for it).
    pub node_image: Option<crate::outcome::Why>,
}

/// The ring and the warning's throttle.
#[derive(Default)]
pub struct PullLog {
    ring: Mutex<VecDeque<PullRecord>>,
    warned: Mutex<HashMap<String, Instant>>,
}

impl PullLog {
    pub fn push(&self, mut record: PullRecord) {
        // Every string is a caller's: each kept to what a real one needs.
        cut(&mut record.message, MESSAGE);
        cut(&mut record.refusal, MESSAGE);
        cut(&mut record.image, IMAGE);
        cut(&mut record.repository, IMAGE);
        cut(&mut record.pod_namespace, NAMESPACE);
        cut(&mut record.pod_name, POD_NAME);
        let mut ring = self.ring.lock();
        if ring.len() == RING {
            ring.pop_front();
        }
        ring.push_back(record);
    }

    /// The recent pulls, newest first; of `repository` (a normalized name) only when given.
    pub fn list(&self, repository: Option<&str>) -> Vec<PullRecord> {
        let ring = self.ring.lock();
        ring.iter()
            .rev()
            .filter(|r| repository.is_none_or(|want| r.repository == want))
            .cloned()
            .collect()
    }

    /// Whether a warning about `image` may be logged at `now` (by the agent's clock; once per
    /// [`WARN_EVERY`]).
    pub fn may_warn(&self, image: &str, now: Instant) -> bool {
        let mut warned = self.warned.lock();
        if let Some(at) = warned.get(image) {
            if now.saturating_duration_since(*at) < WARN_EVERY {
                return false;
            }
        }
        if warned.len() >= WARNED {
            warned.retain(|_, at| now.saturating_duration_since(*at) < WARN_EVERY);
            if warned.len() >= WARNED {
                return false;
            }
        }
        warned.insert(image.to_owned(), now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(image: &str, message: &str) -> PullRecord {
        PullRecord {
            at: SystemTime::now(),
            image: image.into(),
            repository: image.split(':').next().unwrap_or(image).into(),
            pod_namespace: "ns".into(),
            pod_name: "pod".into(),
            auth: PullAuth::None,
            code: 2,
            message: message.into(),
            duration: Duration::from_millis(3),
            refusal: String::new(),
            node_image: None,
        }
    }

    /// The classes real runtimes' answers fall in, by code and by the registry's status in the
    /// message; the image name a caller chose (quoted by the runtime, and in URLs) never
    /// decides.
    #[test]
    fn the_ring_is_bounded_newest_first_and_filtered_by_repository() {
        let log = PullLog::default();
        for i in 0..RING + 10 {
            log.push(record(
                &format!("reg.io/app-{}:v1", i % 3),
                &"x".repeat(2000),
            ));
        }
        let all = log.list(None);
        assert_eq!(all.len(), RING);
        assert!(all[0].message.chars().count() <= MESSAGE + 1);
        let one = log.list(Some("reg.io/app-1"));
        assert!(!one.is_empty() && one.iter().all(|r| r.image.starts_with("reg.io/app-1:")));
        let now = Instant::now();
        assert!(log.may_warn("reg.io/app-1:v1", now));
        assert!(!log.may_warn("reg.io/app-1:v1", now + WARN_EVERY / 2));
        assert!(log.may_warn("reg.io/app-2:v1", now + WARN_EVERY / 2));
        assert!(log.may_warn("reg.io/app-1:v1", now + WARN_EVERY));
    }

    /// Pod names, namespaces and images are the caller's: 300 pulls with 1 MB pod names keep
    /// at most what real ones need.
    #[test]
    fn every_kept_string_is_bounded() {
        let log = PullLog::default();
        for _ in 0..300 {
            let mut r = record("reg.io/app:v1", "m");
            r.pod_name = "p".repeat(1 << 20);
            r.pod_namespace = "n".repeat(1 << 20);
            r.image = "ü".repeat(1 << 19);
            log.push(r);
        }
        let kept = log.list(None);
        let bytes: usize = kept
            .iter()
            .map(|r| r.pod_name.len() + r.pod_namespace.len() + r.image.len())
            .sum();
        assert!(bytes < RING * 2 * 1024, "{bytes} bytes kept");
        assert!(kept[0].pod_name.ends_with('…'));
        assert!(kept[0].image.len() <= IMAGE + '…'.len_utf8());
    }
}
