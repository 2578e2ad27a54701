//! The CRI image-service messages (`runtime.v1`) a kubelet sends, as far as credgate's tests
//! and benchmarks read them, and a unary call to any method over a unix socket.

use std::path::Path;

#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageSpec {
    #[prost(string, tag = "1")]
    pub image: String,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthConfig {
    #[prost(string, tag = "1")]
    pub username: String,
    #[prost(string, tag = "2")]
    pub password: String,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodSandboxMetadata {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "3")]
    pub namespace: String,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodSandboxConfig {
    #[prost(message, optional, tag = "1")]
    pub metadata: Option<PodSandboxMetadata>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct PullImageRequest {
    #[prost(message, optional, tag = "1")]
    pub image: Option<ImageSpec>,
    #[prost(message, optional, tag = "2")]
    pub auth: Option<AuthConfig>,
    #[prost(message, optional, tag = "3")]
    pub sandbox_config: Option<PodSandboxConfig>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct PullImageResponse {
    #[prost(string, tag = "1")]
    pub image_ref: String,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct Image {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, repeated, tag = "2")]
    pub repo_tags: Vec<String>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListImagesRequest {}
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListImagesResponse {
    #[prost(message, repeated, tag = "1")]
    pub images: Vec<Image>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageStatusRequest {
    #[prost(message, optional, tag = "1")]
    pub image: Option<ImageSpec>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageStatusResponse {
    #[prost(message, optional, tag = "1")]
    pub image: Option<Image>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}
#[derive(Clone, PartialEq, prost::Message)]
pub struct RemoveImageRequest {
    #[prost(message, optional, tag = "1")]
    pub image: Option<ImageSpec>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct FilesystemUsage {
    #[prost(int64, tag = "1")]
    pub timestamp: i64,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageFsInfoResponse {
    #[prost(message, repeated, tag = "1")]
    pub image_filesystems: Vec<FilesystemUsage>,
}

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
