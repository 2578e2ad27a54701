//! A fake container runtime on a unix socket, for the CRI proxy's tests that run without root
//! and containerd (a fake for one component: the proxy's logic around the runtime's answers).
//! `ListImages` is answered with a message of a chosen size, `PullImage` with an image ID or a
//! trailers-only error (as containerd answers a failed pull), every other method with an empty
//! message.

use parking_lot::Mutex;
use std::path::Path;
use std::sync::Arc;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::UnixListener;

/// How the fake answers; change it while it runs.
#[derive(Debug, Clone)]
pub struct Answers {
    /// The size of a `ListImages` answer.
    pub list_bytes: usize,
    /// `PullImage`: the image ID, or a gRPC code and message.
    pub pull: Result<String, (i32, String)>,
    /// A `PullImage` of this image is answered only when it takes a permit of the semaphore
    /// (a registry that stalls until the test says, or for good).
    pub held_image: Option<(String, Arc<tokio::sync::Semaphore>)>,
}

impl Default for Answers {
    fn default() -> Self {
        Answers {
            list_bytes: 16,
            pull: Ok(format!("sha256:{}", "0123456789abcdef".repeat(4))),
            held_image: None,
        }
    }
}

/// A running fake; stops when dropped.
pub struct FakeRuntime {
    pub answers: Arc<Mutex<Answers>>,
    /// The image of every `PullImage` it was asked, in order (`ImageStatus` always answers
    /// that it has no image).
    pub pulled: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeRuntime {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn grpc_frame(message: &[u8]) -> Bytes {
    let mut frame = vec![0u8];
    let len = u32::try_from(message.len()).expect("a test message fits a gRPC frame");
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(message);
    Bytes::from(frame)
}

/// A `ListImagesResponse` of at most `size` bytes (images with 1000-byte ids, 1006 bytes
/// each as encoded).
fn list(size: usize) -> Bytes {
    use prost::Message as _;
    let image = credgate_api::cri::Image {
        id: "a".repeat(1000),
        ..Default::default()
    };
    let each = credgate_api::cri::ListImagesResponse {
        images: vec![image.clone()],
    }
    .encoded_len();
    let response = credgate_api::cri::ListImagesResponse {
        images: vec![image; size / each],
    };
    grpc_frame(&response.encode_to_vec())
}

type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

fn answer(path: &str, answers: &Answers) -> hyper::Response<Body> {
    let ok = |data: Bytes| {
        let mut trailers = hyper::HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        hyper::Response::builder()
            .header("content-type", "application/grpc")
            .body(
                Full::new(data)
                    .map_err(|never| -> std::io::Error { match never {} })
                    .with_trailers(async move { Some(Ok(trailers)) })
                    .boxed_unsync(),
            )
            .unwrap()
    };
    if path.ends_with("/ListImages") {
        return ok(list(answers.list_bytes));
    }
    if path.ends_with("/PullImage") {
        return match &answers.pull {
            Ok(id) => {
                use prost::Message as _;
                let msg = credgate_api::cri::PullImageResponse {
                    image_ref: id.clone(),
                }
                .encode_to_vec();
                ok(grpc_frame(&msg))
            }
            Err((code, message)) => hyper::Response::builder()
                .header("content-type", "application/grpc")
                .header("grpc-status", code.to_string())
                .header("grpc-message", credgate_api::unary::encode_message(message))
                .body(
                    http_body_util::Empty::new()
                        .map_err(|never| -> std::io::Error { match never {} })
                        .boxed_unsync(),
                )
                .unwrap(),
        };
    }
    ok(grpc_frame(&[]))
}

/// Serves on `socket` until dropped.
pub async fn start(socket: &Path, answers: Answers) -> FakeRuntime {
    let listener = UnixListener::bind(socket).unwrap();
    let answers = Arc::new(Mutex::new(answers));
    let pulled = Arc::new(Mutex::new(Vec::new()));
    let (shared, record) = (answers.clone(), pulled.clone());
    let task = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        while let Ok((stream, _)) = listener.accept().await {
            let (answers, record) = (shared.clone(), record.clone());
            connections.spawn(async move {
                let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                    let (answers, record) = (answers.clone(), record.clone());
                    async move {
                        use prost::Message as _;
                        let path = req.uri().path().to_owned();
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        let now = answers.lock().clone();
                        if path.ends_with("/PullImage") {
                            let image = body
                                .get(5..)
                                .and_then(|m| credgate_api::cri::PullImageRequest::decode(m).ok())
                                .and_then(|r| r.image)
                                .map(|i| i.image)
                                .unwrap_or_default();
                            record.lock().push(image.clone());
                            if let Some((held, gate)) = &now.held_image {
                                if *held == image {
                                    if let Ok(permit) = gate.acquire().await {
                                        permit.forget();
                                    }
                                }
                            }
                        }
                        Ok::<_, std::convert::Infallible>(answer(&path, &now))
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .timer(TokioTimer::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    FakeRuntime {
        answers,
        pulled,
        task,
    }
}
