//! Captured credentials follow the runtime's images: a repository of which the runtime has no
//! image left loses its captured credential, whether the image went through the proxy
//! (`RemoveImage`) or not (`crictl rmi`, the runtime's garbage collection: the image list is
//! checked periodically).

use std::collections::HashSet;

use std::time::Duration;

use credgate_api::cri as wire;
use http_body_util::BodyExt as _;
use hyper::body::{Bytes, Incoming};

use super::runtime::{
    self, ask, ask_bytes, exchange, grpc_code, grpc_message, grpc_message_of, read_whole,
    CallerConn,
};
use super::{Body, MAX_LIST_MESSAGE, MAX_PULL_MESSAGE};
use tokio_util::sync::CancellationToken;

/// The repositories an image is known by (from its tags and digests).
pub(super) fn repositories(image: &wire::Image) -> Vec<String> {
    let mut out: Vec<String> = image
        .repo_tags
        .iter()
        .chain(&image.repo_digests)
        .filter_map(|r| credgate_core::reference::ImageRef::parse(r).ok())
        .map(|r| r.name().to_owned())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// A `RemoveImage`: the image's repositories are read first (the request may name it by ID);
/// when the runtime removed it, a repository of which it has no image left loses its
/// captured credential.
pub(super) async fn remove(
    caller: &CallerConn,
    view: &ImageView,
    captured: &std::sync::Arc<credgate_agent::captured::Captured>,
    request: hyper::Request<Incoming>,
) -> hyper::Response<Body> {
    use prost::Message as _;
    let (parts, bytes, _taken) =
        match read_whole(caller, request, "RemoveImage", MAX_PULL_MESSAGE).await {
            Ok(read) => read,
            Err(refused) => return refused,
        };
    let named = grpc_message(&bytes)
        .and_then(|m| wire::RemoveImageRequest::decode(m).ok())
        .and_then(|r| r.image);
    let before: Vec<String> = match named {
        Some(spec) => ask::<_, wire::ImageStatusResponse>(
            caller,
            wire::IMAGE_STATUS,
            &wire::ImageStatusRequest { image: Some(spec) },
            MAX_PULL_MESSAGE,
        )
        .await
        .ok()
        .and_then(|s| s.image)
        .map(|i| repositories(&i))
        .unwrap_or_default(),
        None => Vec::new(),
    };
    let whole = match exchange(caller, parts, bytes, MAX_PULL_MESSAGE).await {
        Ok(whole) => whole,
        Err(refused) => return refused,
    };
    if whole.code() == Some(0) && !before.is_empty() {
        // The runtime's image list is read from the proxy's own budget, not the caller's.
        view.forget_absent(captured, before).await;
    }
    whole.into_response()
}

/// The proxy's own view of the runtime's images: read through `StreamImages` where the runtime
/// serves it, `ListImages` where it does not, on the proxy's own runtime connection: a
/// `ListImages` answer of at most `limit` bytes, each `StreamImages` batch at most
/// [`MAX_LIST_MESSAGE`], the whole list within [`LIST_TIMEOUT`]. A list that cannot
/// be read whole is never acted on: the check says so (a warning and
/// `credgate_cri_image_list_incomplete_total`) and drops nothing.
///
/// A reading keeps only which of its candidates (the repositories it asks about: a removed
/// image's, the captured ones) the list names, never the list: the images are decoded one at a
/// time from the answer's bytes. One reading at a time, whoever asks (a removal, the periodic
/// check), so all readers together hold at most one answer (`limit` bytes) or one batch.
pub(super) struct ImageView {
    pub(super) own: std::sync::Arc<CallerConn>,
    pub(super) limit: usize,
    pub(super) metrics: crate::metrics::ProxyMetrics,
    pub(super) reading: tokio::sync::Mutex<()>,
}

/// The longest reading the runtime's image list may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(60);
/// Why the runtime's image list was not read whole (and nothing is acted on).
#[derive(Debug, thiserror::Error)]
pub(super) enum Unlisted {
    #[error("the runtime did not list its images within {0:?}")]
    Timeout(Duration),
    #[error("the request could not be built")]
    Unbuilt,
    #[error("cannot reach the runtime")]
    Unreachable(#[source] std::io::Error),
    #[error("the runtime's connection failed")]
    Connection(#[source] hyper::Error),
    #[error("the stream ended without a status")]
    NoStatus,
    #[error("the stream broke")]
    Broken(#[source] hyper::Error),
    #[error("the stream ended inside a message")]
    Cut,
    #[error("StreamImages ended with code {code}: {message}")]
    Status { code: i32, message: String },
    #[error("a compressed StreamImages message")]
    Compressed,
    #[error(
        "a StreamImages message of {0} bytes, more than the {MAX_LIST_MESSAGE} the proxy reads"
    )]
    TooLarge(usize),
    #[error("a StreamImages message that does not decode")]
    Undecodable(#[source] ListError),
    #[error("ListImages (the runtime serves no StreamImages; at most {limit} bytes are read)")]
    List {
        limit: usize,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// What a `StreamImages` call gave.
enum Streamed {
    /// The candidates the list names.
    All(HashSet<String>),
    /// The runtime does not serve it (containerd before 2.4): `ListImages` instead.
    Unimplemented,
    Incomplete(Unlisted),
}

impl ImageView {
    /// Which of `candidates` the runtime has an image of; why not, when its list could not be
    /// read whole.
    pub(super) async fn present(
        &self,
        candidates: &HashSet<String>,
    ) -> Result<HashSet<String>, Unlisted> {
        let _one_at_a_time = self.reading.lock().await;
        let read = async {
            match self.stream(candidates).await {
                Streamed::All(found) => Ok(found),
                Streamed::Unimplemented => self.unary(candidates).await,
                Streamed::Incomplete(why) => Err(why),
            }
        };
        tokio::time::timeout(LIST_TIMEOUT, read)
            .await
            .unwrap_or(Err(Unlisted::Timeout(LIST_TIMEOUT)))
    }

    /// `StreamImages`, read batch by batch.
    async fn stream(&self, candidates: &HashSet<String>) -> Streamed {
        let runtime = &self.own.runtime;
        let frame = credgate_api::unary::grpc_message(&wire::StreamImagesRequest {});
        let Some(parts) = runtime::own_call(wire::STREAM_IMAGES, Some(LIST_TIMEOUT)) else {
            return Streamed::Incomplete(Unlisted::Unbuilt);
        };
        let request = hyper::Request::from_parts(
            parts,
            http_body_util::Full::new(Bytes::from(frame))
                .map_err(|never| match never {})
                .boxed_unsync(),
        );
        let answer = match runtime.sender().await {
            Ok(mut sender) => sender.send_request(request).await,
            Err(e) => return Streamed::Incomplete(Unlisted::Unreachable(e)),
        };
        let (parts, mut body) = match answer {
            Ok(answer) => answer.into_parts(),
            Err(e) => return Streamed::Incomplete(Unlisted::Connection(e)),
        };
        if let Some(code) = grpc_code(&parts.headers) {
            // A trailers-only answer: no image, or an error.
            return ended(code, &parts.headers, HashSet::new(), false);
        }
        let mut buffer = Vec::new();
        let mut found = HashSet::new();
        let mut received = false;
        loop {
            let frame = match body.frame().await {
                None => return Streamed::Incomplete(Unlisted::NoStatus),
                Some(Err(e)) => return Streamed::Incomplete(Unlisted::Broken(e)),
                Some(Ok(frame)) => frame,
            };
            let data = match frame.into_data() {
                Ok(data) => data,
                Err(frame) => {
                    let trailers = frame.into_trailers().unwrap_or_default();
                    let code = grpc_code(&trailers).unwrap_or(2);
                    if !buffer.is_empty() {
                        return Streamed::Incomplete(Unlisted::Cut);
                    }
                    return ended(code, &trailers, found, received);
                }
            };
            buffer.extend_from_slice(&data);
            match take_batches(&mut buffer, candidates, &mut found) {
                Ok(0) => {}
                Ok(_) => received = true,
                Err(why) => return Streamed::Incomplete(why),
            }
        }
    }

    /// `ListImages`, read whole within the limit, its images decoded one at a time.
    async fn unary(&self, candidates: &HashSet<String>) -> Result<HashSet<String>, Unlisted> {
        let why = |source: Box<dyn std::error::Error + Send + Sync>| Unlisted::List {
            limit: self.limit,
            source,
        };
        let list = ask_bytes(
            &self.own,
            wire::LIST_IMAGES,
            &wire::ListImagesRequest {},
            self.limit,
        )
        .await
        .map_err(|e| why(Box::new(e)))?;
        let mut found = HashSet::new();
        each_image(&list, |image| named(&image, candidates, &mut found))
            .map_err(|e| why(Box::new(e)))?;
        Ok(found)
    }

    /// Drops the captured credentials of those `candidates` the runtime has no image of any
    /// more; when its image list cannot be read whole, nothing.
    pub(super) async fn forget_absent(
        &self,
        captured: &std::sync::Arc<credgate_agent::captured::Captured>,
        candidates: Vec<String>,
    ) {
        let asked: HashSet<String> = candidates.iter().cloned().collect();
        let remaining = match self.present(&asked).await {
            Ok(remaining) => remaining,
            Err(why) => {
                self.metrics.image_list_incomplete.inc();
                tracing::warn!(why = %credgate_core::text::error_chain(&why), "the runtime's image list could not be read whole: no captured credential is dropped on a part of it");
                return;
            }
        };
        let gone: Vec<String> = candidates
            .into_iter()
            .filter(|r| !remaining.contains(r))
            .collect();
        if gone.is_empty() {
            return;
        }
        // The sealed file is rewritten and fsynced: on a blocking thread, never on the ones
        // that forward calls.
        let captured = captured.clone();
        let _ = tokio::task::spawn_blocking(move || {
            for repo in gone {
                match captured.forget(&repo) {
                    Ok(true) => {
                        tracing::info!(repository = %repo, "captured pull credentials dropped: the runtime has no image of the repository")
                    }
                    Ok(false) => {}
                    Err(e) => tracing::error!(error = %e, "cannot drop captured pull credentials"),
                }
            }
        })
        .await;
    }
}

/// Adds to `found` those of `candidates` that `image` is known by.
fn named(image: &wire::Image, candidates: &HashSet<String>, found: &mut HashSet<String>) {
    for repo in repositories(image) {
        if candidates.contains(&repo) {
            found.insert(repo);
        }
    }
}

/// Calls `f` with each `Image` of a `ListImagesResponse` or `StreamImagesResponse` (both
/// `repeated Image images = 1`), decoded one at a time from the message's bytes: a list of a
/// million images is never held decoded. Other fields are skipped as protobuf skips them.
fn each_image(mut buf: &[u8], mut f: impl FnMut(wire::Image)) -> Result<(), ListError> {
    use prost::Message as _;
    fn varint(buf: &mut &[u8]) -> Result<u64, ListError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = buf.split_first().ok_or(ListError::Truncated)?;
            *buf = rest;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(ListError::Varint)
    }
    fn take<'a>(buf: &mut &'a [u8], len: u64) -> Result<&'a [u8], ListError> {
        let len = usize::try_from(len).map_err(|_| ListError::TooLong)?;
        if len > buf.len() {
            return Err(ListError::Truncated);
        }
        let (field, rest) = buf.split_at(len);
        *buf = rest;
        Ok(field)
    }
    while !buf.is_empty() {
        let key = varint(&mut buf)?;
        match (key >> 3, key & 7) {
            (1, 2) => {
                let len = varint(&mut buf)?;
                let bytes = take(&mut buf, len)?;
                f(wire::Image::decode(bytes).map_err(|_| ListError::Image)?);
            }
            (_, 0) => {
                varint(&mut buf)?;
            }
            (_, 1) => {
                take(&mut buf, 8)?;
            }
            (_, 2) => {
                let len = varint(&mut buf)?;
                take(&mut buf, len)?;
            }
            (_, 5) => {
                take(&mut buf, 4)?;
            }
            _ => return Err(ListError::WireType),
        }
    }
    Ok(())
}

/// Why the runtime's image list does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum ListError {
    #[error("a truncated image list")]
    Truncated,
    #[error("an image list with a malformed varint")]
    Varint,
    #[error("a field too long")]
    TooLong,
    #[error("an image that does not decode")]
    Image,
    #[error("an image list with an unknown wire type")]
    WireType,
}

/// Takes the whole `StreamImagesResponse` messages at the start of `buffer`, adding to `found`
/// those of `candidates` their images are known by; how many it took, or why the stream cannot
/// be read whole.
fn take_batches(
    buffer: &mut Vec<u8>,
    candidates: &HashSet<String>,
    found: &mut HashSet<String>,
) -> Result<usize, Unlisted> {
    let mut taken = 0;
    while let Some(len) = next_message(buffer) {
        if buffer.first().is_some_and(|&flag| flag != 0) {
            return Err(Unlisted::Compressed);
        }
        if len > MAX_LIST_MESSAGE {
            return Err(Unlisted::TooLarge(len));
        }
        if buffer.len() < 5 + len {
            break;
        }
        each_image(&buffer[5..5 + len], |image| {
            named(&image, candidates, found)
        })
        .map_err(Unlisted::Undecodable)?;
        buffer.drain(..5 + len);
        taken += 1;
    }
    Ok(taken)
}

/// The length of the gRPC message `buffer` starts with, once its 5-byte prefix is in.
fn next_message(buffer: &[u8]) -> Option<usize> {
    let prefix: [u8; 4] = buffer.get(1..5)?.try_into().ok()?;
    usize::try_from(u32::from_be_bytes(prefix)).ok()
}

/// What a stream that ended with `code` gave.
fn ended(
    code: i32,
    headers: &hyper::HeaderMap,
    found: HashSet<String>,
    received: bool,
) -> Streamed {
    match code {
        0 => Streamed::All(found),
        // UNIMPLEMENTED before any batch: a runtime without StreamImages.
        12 if !received => Streamed::Unimplemented,
        _ => Streamed::Incomplete(Unlisted::Status {
            code,
            message: grpc_message_of(headers),
        }),
    }
}

/// Every `period` until `stop`: drops expired captures and those of repositories the runtime
/// has no image of any more.
pub(super) async fn every(
    period: Duration,
    view: std::sync::Arc<ImageView>,
    captured: std::sync::Arc<credgate_agent::captured::Captured>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            () = stop.cancelled() => return,
        }
        let expiring = captured.clone();
        let _ = tokio::task::spawn_blocking(move || expiring.expire()).await;
        let held = captured.list().into_iter().map(|(repo, _)| repo).collect();
        view.forget_absent(&captured, held).await;
    }
}

#[cfg(test)]
mod tests {
    use super::{each_image, take_batches, wire, MAX_LIST_MESSAGE};
    use std::collections::HashSet;

    fn frame(tags: &[&str]) -> Vec<u8> {
        use prost::Message as _;
        let message = wire::StreamImagesResponse {
            images: vec![wire::Image {
                id: "sha256:1".into(),
                repo_tags: tags.iter().map(|t| (*t).to_owned()).collect(),
                repo_digests: Vec::new(),
            }],
        }
        .encode_to_vec();
        let mut out = vec![0];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(&message);
        out
    }

    fn set(names: &[&str]) -> HashSet<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    /// Batches split anywhere are taken whole once they are in, and only the candidates they
    /// name are kept; a compressed or oversized one ends the reading with why.
    #[test]
    fn batches_are_taken_whole_and_bad_ones_refused() {
        let mut stream = frame(&["r.io/a:v1", "r.io/a:v2"]);
        stream.extend(frame(&["r.io/b:v1"]));
        let candidates = set(&["r.io/a", "r.io/b", "r.io/gone"]);
        let mut found = HashSet::new();
        let mut buffer = Vec::new();
        let mut taken = 0;
        for chunk in stream.chunks(7) {
            buffer.extend_from_slice(chunk);
            taken += take_batches(&mut buffer, &candidates, &mut found).unwrap();
        }
        assert_eq!((taken, buffer.len()), (2, 0));
        assert_eq!(found, set(&["r.io/a", "r.io/b"]));
        let mut compressed = frame(&["r.io/c:v1"]);
        compressed[0] = 1;
        assert!(take_batches(&mut compressed, &candidates, &mut found)
            .unwrap_err()
            .to_string()
            .contains("compressed"));
        let mut huge = vec![0];
        huge.extend_from_slice(&(MAX_LIST_MESSAGE as u32 + 1).to_be_bytes());
        assert!(take_batches(&mut huge, &candidates, &mut found)
            .unwrap_err()
            .to_string()
            .contains("more than"));
        let mut garbage = vec![0, 0, 0, 0, 2, 0xff, 0xff];
        assert!(take_batches(&mut garbage, &candidates, &mut found).is_err());
    }

    /// A list of a million names (16 MiB and more as encoded) is read keeping only the
    /// candidates it names: what a reading holds does not grow with the list (before, every
    /// reader built a set of the whole list: 844 MB for three readers of such a list).
    #[test]
    fn a_million_name_list_keeps_only_the_candidates() {
        use prost::Message as _;
        let images: Vec<wire::Image> = (0..1_000_000)
            .map(|i| wire::Image {
                id: format!("sha256:{i:064}"),
                repo_tags: vec![format!("r.io/team-{}/app-{i}:v1", i % 1000)],
                repo_digests: Vec::new(),
            })
            .collect();
        let list = wire::ListImagesResponse { images }.encode_to_vec();
        let candidates = set(&["r.io/team-7/app-7", "r.io/team-7/app-999999", "r.io/gone"]);
        let mut found = HashSet::new();
        let mut seen = 0;
        each_image(&list, |image| {
            seen += 1;
            super::named(&image, &candidates, &mut found);
        })
        .unwrap();
        assert_eq!(seen, 1_000_000);
        assert_eq!(found, set(&["r.io/team-7/app-7"]));
        assert!(found.capacity() <= 2 * candidates.len() + 4);
        // Unknown fields are skipped as protobuf skips them; a cut list is an error.
        let small = wire::ListImagesResponse {
            images: vec![wire::Image {
                id: "sha256:1".into(),
                repo_tags: vec!["r.io/gone:v1".into()],
                repo_digests: Vec::new(),
            }],
        }
        .encode_to_vec();
        // Field 2 (varint), field 3 (bytes), field 4 (fixed64), field 5 (fixed32), then the list.
        let mut with_unknown = vec![0x10, 0x05, 0x1a, 0x01, 0x00, 0x21, 1, 2, 3, 4, 5, 6, 7, 8];
        with_unknown.extend_from_slice(&[0x2d, 1, 2, 3, 4]);
        with_unknown.extend_from_slice(&small);
        let mut found = HashSet::new();
        each_image(&with_unknown, |image| {
            super::named(&image, &candidates, &mut found)
        })
        .unwrap();
        assert_eq!(found, set(&["r.io/gone"]));
        assert!(each_image(&list[..list.len() - 3], |_| {}).is_err());
    }
}
