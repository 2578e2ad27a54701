//! Captured credentials follow the runtime's images: a repository of which the runtime has no
//! image left loses its captured credential, whether the image went through the proxy
//! (`RemoveImage`) or not (`crictl rmi`, the runtime's garbage collection: the image list is
//! checked periodically).

use hyper::body::Incoming;

use super::*;

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
    caller: &Caller,
    capture: &Capture,
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
        forget_absent(&capture.own, &capture.captured, before).await;
    }
    whole.into_response()
}

/// Drops the captured credentials of those `repositories` the runtime has no image of any
/// more; when its image list cannot be read, nothing.
pub(super) async fn forget_absent(
    caller: &Caller,
    captured: &std::sync::Arc<crate::captured::Captured>,
    candidates: Vec<String>,
) {
    let Some(left) = ask::<_, wire::ListImagesResponse>(
        caller,
        wire::LIST_IMAGES,
        &wire::ListImagesRequest {},
        MAX_LIST_MESSAGE,
    )
    .await
    else {
        return;
    };
    let remaining: Vec<String> = left.images.iter().flat_map(repositories).collect();
    let gone: Vec<String> = candidates
        .into_iter()
        .filter(|r| !remaining.contains(r))
        .collect();
    if gone.is_empty() {
        return;
    }
    // The sealed file is rewritten and fsynced: on a blocking thread, never on the ones that
    // forward calls.
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

/// Every `period` until `stop`: drops expired captures and those of repositories the runtime
/// has no image of any more.
pub(super) async fn every(
    period: Duration,
    own: std::sync::Arc<Caller>,
    captured: std::sync::Arc<crate::captured::Captured>,
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
        forget_absent(&own, &captured, held).await;
    }
}
