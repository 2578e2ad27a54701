//! The CRI image-service messages (`credgate_api::cri`), and a unary call to any method over a
//! unix socket.

use std::path::Path;

pub use credgate_api::cri::*;

/// Calls `method` (`/runtime.v1.ImageService/PullImage`) on the gRPC server at `socket`, on
/// a new connection.
pub async fn call<Req, Resp>(
    socket: &Path,
    method: &'static str,
    req: Req,
) -> Result<Resp, tonic::Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let channel = credgate_api::connect(socket)
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    call_on(channel, method, req).await
}

/// Calls `method` on `channel`.
pub async fn call_on<Req, Resp>(
    channel: tonic::transport::Channel,
    method: &'static str,
    req: Req,
) -> Result<Resp, tonic::Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    grpc.unary(
        tonic::Request::new(req),
        tonic::codegen::http::uri::PathAndQuery::from_static(method),
        tonic_prost::ProstCodec::default(),
    )
    .await
    .map(tonic::Response::into_inner)
}

/// A kubelet's `PullImage` of `image` for a pod `app-0` of `namespace`, with `credential`
/// (username, password) when given.
pub fn pull_request(
    image: &str,
    credential: Option<(&str, &str)>,
    namespace: &str,
) -> PullImageRequest {
    PullImageRequest {
        image: Some(ImageSpec {
            image: image.to_owned(),
        }),
        auth: credential.map(|(username, password)| {
            crate::secrets::login(username, password);
            AuthConfig {
                username: username.to_owned(),
                password: password.to_owned(),
                ..Default::default()
            }
        }),
        sandbox_config: Some(PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: "app-0".into(),
                namespace: namespace.to_owned(),
                ..Default::default()
            }),
        }),
    }
}
