//! The fields of the CRI image-service messages (`runtime.v1`, field numbers of its
//! `api.proto`) that credgate reads or writes: the CRI proxy reads `PullImage`,
//! `RemoveImage` and `ListImages`; the tests and benchmarks call a runtime with them. Every
//! other field passes through the proxy untouched.
#![allow(missing_docs)]

/// The image service's methods credgate calls or reads, as gRPC paths.
pub const PULL_IMAGE: &str = "/runtime.v1.ImageService/PullImage";
pub const REMOVE_IMAGE: &str = "/runtime.v1.ImageService/RemoveImage";
pub const IMAGE_STATUS: &str = "/runtime.v1.ImageService/ImageStatus";
pub const LIST_IMAGES: &str = "/runtime.v1.ImageService/ListImages";
pub const IMAGE_FS_INFO: &str = "/runtime.v1.ImageService/ImageFsInfo";

#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageSpec {
    #[prost(string, tag = "1")]
    pub image: String,
}
/// A pull's credential. Its `Debug` shows every secret field as `<redacted>` (so does that of
/// the `PullImageRequest` holding it).
#[derive(Clone, PartialEq, prost::Message)]
#[prost(skip_debug)]
pub struct AuthConfig {
    #[prost(string, tag = "1")]
    pub username: String,
    #[prost(string, tag = "2")]
    pub password: String,
    #[prost(string, tag = "3")]
    pub auth: String,
    #[prost(string, tag = "4")]
    pub server_address: String,
    #[prost(string, tag = "5")]
    pub identity_token: String,
    #[prost(string, tag = "6")]
    pub registry_token: String,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodSandboxMetadata {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub uid: String,
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
pub struct RemoveImageRequest {
    #[prost(message, optional, tag = "1")]
    pub image: Option<ImageSpec>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageStatusRequest {
    #[prost(message, optional, tag = "1")]
    pub image: Option<ImageSpec>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct Image {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, repeated, tag = "2")]
    pub repo_tags: Vec<String>,
    #[prost(string, repeated, tag = "3")]
    pub repo_digests: Vec<String>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageStatusResponse {
    #[prost(message, optional, tag = "1")]
    pub image: Option<Image>,
}
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListImagesRequest {}
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListImagesResponse {
    #[prost(message, repeated, tag = "1")]
    pub images: Vec<Image>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}
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
