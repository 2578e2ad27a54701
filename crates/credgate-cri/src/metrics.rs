//! The proxy's own metric families (`credgate_cri_*`, `credgate_captured_dropped`): made by the
//! composition root, registered beside the agent's, and counted by the proxy alone.
//! Labels never carry credentials or image names.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::outcome::{AuthLabel, PullResult, Why};

/// The labels of `credgate_cri_pulls_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PullLabels {
    pub auth: AuthLabel,
    pub result: PullResult,
}

/// An image-service method called through the proxy (`credgate_cri_calls_total{method}`):
/// each of `runtime.v1` and `v1alpha2` by its name, anything else as `other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    ListImages,
    StreamImages,
    ImageStatus,
    PullImage,
    RemoveImage,
    ImageFsInfo,
    Other,
}

impl Method {
    /// The method of a gRPC path.
    pub fn of(path: &str) -> Method {
        let name = match path
            .strip_prefix("/runtime.v1.ImageService/")
            .or_else(|| path.strip_prefix("/runtime.v1alpha2.ImageService/"))
        {
            Some(name) => name,
            None => return Method::Other,
        };
        match name {
            "ListImages" => Method::ListImages,
            "StreamImages" => Method::StreamImages,
            "ImageStatus" => Method::ImageStatus,
            "PullImage" => Method::PullImage,
            "RemoveImage" => Method::RemoveImage,
            "ImageFsInfo" => Method::ImageFsInfo,
            _ => Method::Other,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Method::ListImages => "ListImages",
            Method::StreamImages => "StreamImages",
            Method::ImageStatus => "ImageStatus",
            Method::PullImage => "PullImage",
            Method::RemoveImage => "RemoveImage",
            Method::ImageFsInfo => "ImageFsInfo",
            Method::Other => "other",
        }
    }
}

/// The labels of `credgate_cri_calls_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CallLabels {
    pub method: Method,
}

/// The labels of `credgate_cri_node_image_pulls_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct NodeImagePullLabels {
    pub why: Why,
    pub result: PullResult,
}

/// What became of a credential offered for capture (`credgate_cri_captures_total{result}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureResult {
    Captured,
    /// The same credential was kept already.
    Unchanged,
    /// It was sent for another registry than the image's.
    OtherRegistry,
    /// It is one of the agent's own sources' (never a pod's).
    OwnSource,
    /// The registry did not confirm it.
    Unconfirmed,
    Unreachable,
    TooLarge,
    /// The capture queue was full.
    Busy,
    Failed,
}

impl CaptureResult {
    pub const ALL: [CaptureResult; 9] = [
        CaptureResult::Captured,
        CaptureResult::Unchanged,
        CaptureResult::OtherRegistry,
        CaptureResult::OwnSource,
        CaptureResult::Unconfirmed,
        CaptureResult::Unreachable,
        CaptureResult::TooLarge,
        CaptureResult::Busy,
        CaptureResult::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CaptureResult::Captured => "captured",
            CaptureResult::Unchanged => "unchanged",
            CaptureResult::OtherRegistry => "other_registry",
            CaptureResult::OwnSource => "own_source",
            CaptureResult::Unconfirmed => "unconfirmed",
            CaptureResult::Unreachable => "unreachable",
            CaptureResult::TooLarge => "too_large",
            CaptureResult::Busy => "busy",
            CaptureResult::Failed => "failed",
        }
    }
}

credgate_engine::label_values!(Method, CaptureResult);

/// The labels of `credgate_cri_captures_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CaptureLabels {
    pub result: CaptureResult,
}

/// The proxy's families. Cheap to clone; clones count into the same families.
#[derive(Clone)]
pub struct ProxyMetrics {
    /// Pull credentials offered for capture, by what became of them.
    pub captures: Family<CaptureLabels, Counter>,
    /// Captured credentials dropped to stay within the store's limits (in all and a namespace).
    pub captured_dropped: Counter,
    /// Pulls through the proxy by the credentials the kubelet sent and the result.
    pub pulls: Family<PullLabels, Counter>,
    /// Pulls without credentials that failed as unauthorized while a provider of the agent that
    /// matches the image had a credential for it.
    pub pulls_missed: Counter,
    /// Pull answers released before their capture was confirmed and on disk (the registry
    /// did not confirm within the wait); the capture went on.
    pub captures_late: Counter,
    /// Bytes of callers' messages the proxy holds now (read whole, not yet answered).
    pub held_bytes: Gauge,
    /// Calls through the proxy, by method.
    pub calls: Family<CallLabels, Counter>,
    /// Pulls the proxy made on the node's behalf, by why and result.
    pub node_image_pulls: Family<NodeImagePullLabels, Counter>,
    /// Node images the runtime does not have now.
    pub node_images_absent: Gauge,
    /// Checks of the runtime's image list that could not read it whole (and acted on nothing).
    pub image_list_incomplete: Counter,
    /// Calls the proxy could not forward: the container runtime could not be reached or its
    /// connection failed.
    pub runtime_unreachable: Counter,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        let captures = Family::default();
        for result in CaptureResult::ALL {
            let _ = captures.get_or_create(&CaptureLabels { result });
        }
        ProxyMetrics {
            captures,
            captured_dropped: Counter::default(),
            pulls: Family::default(),
            pulls_missed: Counter::default(),
            captures_late: Counter::default(),
            held_bytes: Gauge::default(),
            calls: Family::default(),
            node_image_pulls: Family::default(),
            node_images_absent: Gauge::default(),
            image_list_incomplete: Counter::default(),
            runtime_unreachable: Counter::default(),
        }
    }
}

impl ProxyMetrics {
    /// Registers every family under the `credgate_` prefix (the agent's registry).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("credgate");
        r.register(
            "cri_captures",
            "Pull credentials the CRI proxy offered for capture, by result (captured, unchanged, other_registry, own_source, unconfirmed, unreachable, too_large, busy, failed)",
            self.captures.clone(),
        );
        r.register(
            "cri_pulls",
            "Pulls through the CRI proxy by auth (none, captured, provider, docker_config, filled, unknown) and result (ok, unauthorized, not_found, error)",
            self.pulls.clone(),
        );
        r.register(
            "cri_pulls_missed",
            "Pulls through the CRI proxy without credentials that failed as unauthorized while a provider of the agent that matches the image had a credential for it (cached, or its last run succeeded) or had never run on the node: the kubelet did not ask the agent",
            self.pulls_missed.clone(),
        );
        r.register(
            "cri_held_bytes",
            "Bytes of callers' messages the CRI proxy holds now (PullImage and RemoveImage requests and answers read whole); at most 64 MiB in all, 4 MiB a connection",
            self.held_bytes.clone(),
        );
        r.register(
            "cri_captures_late",
            "PullImage answers released before their capture was confirmed and fsynced (the capture went on)",
            self.captures_late.clone(),
        );
        r.register(
            "captured_dropped",
            "Captured pull credentials dropped to stay within the store's limits (the oldest of the namespace over its share, or of the one holding the most)",
            self.captured_dropped.clone(),
        );
        r.register(
            "cri_calls",
            "Calls through the CRI proxy by image-service method (ListImages, StreamImages, ImageStatus, PullImage, RemoveImage, ImageFsInfo, other)",
            self.calls.clone(),
        );
        r.register(
            "cri_node_image_pulls",
            "Pulls the CRI proxy made on the node's behalf (no caller asked), by why (sandbox: the runtime's sandbox image; kept: --cri-proxy-keep-image) and result (ok, unauthorized, not_found, error)",
            self.node_image_pulls.clone(),
        );
        r.register(
            "cri_runtime_unreachable",
            "Calls the CRI proxy could not forward because the container runtime could not be reached or its connection failed",
            self.runtime_unreachable.clone(),
        );
        r.register(
            "cri_node_images_absent",
            "Images the node keeps (sandbox, kept) that the runtime did not have at the last check and could not be given",
            self.node_images_absent.clone(),
        );
        r.register(
            "cri_image_list_incomplete",
            "Checks of the runtime's image list that could not read it whole (too large for ListImages, a broken stream): no captured credential was dropped on them",
            self.image_list_incomplete.clone(),
        );
    }

    /// Counts a pull through the proxy.
    pub fn pull(&self, auth: AuthLabel, result: PullResult) {
        self.pulls.get_or_create(&PullLabels { auth, result }).inc();
    }

    /// Counts what became of a credential offered for capture.
    pub fn capture(&self, result: CaptureResult) {
        self.captures.get_or_create(&CaptureLabels { result }).inc();
    }
}
