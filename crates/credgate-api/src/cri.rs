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
/// The image list as a stream of batches (cri-api 1.36, KEP-5825 `CRIListStreaming`;
/// containerd 2.4 serves it).
pub const STREAM_IMAGES: &str = "/runtime.v1.ImageService/StreamImages";
pub const IMAGE_FS_INFO: &str = "/runtime.v1.ImageService/ImageFsInfo";
/// The same two calls of the CRI's earlier version (containerd 1.6 and 1.7 serve it), whose
/// messages have the same fields.
pub const PULL_IMAGE_V1ALPHA2: &str = "/runtime.v1alpha2.ImageService/PullImage";
pub const REMOVE_IMAGE_V1ALPHA2: &str = "/runtime.v1alpha2.ImageService/RemoveImage";

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

/// Its `filter` (field 1) is never set by credgate: every image.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamImagesRequest {}
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamImagesResponse {
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

/// The `auth` field's number in `PullImageRequest`.
const PULL_AUTH_FIELD: u64 = 2;

/// A `PullImageRequest` message with its `auth` replaced by `auth` and every other byte
/// kept as the caller sent it (fields credgate has no code for included, which decoding and
/// encoding again would lose). `None` when the message is not well-formed protobuf.
pub fn with_pull_auth(message: &[u8], auth: &AuthConfig) -> Option<Vec<u8>> {
    use prost::encoding::{decode_varint, encode_key, encode_varint, WireType};
    use prost::Message as _;
    let mut out = Vec::with_capacity(message.len() + auth.encoded_len() + 8);
    let mut rest = message;
    while !rest.is_empty() {
        let start = rest;
        let key = decode_varint(&mut rest).ok()?;
        let len = match key & 7 {
            0 => {
                decode_varint(&mut rest).ok()?;
                0
            }
            1 => 8,
            2 => usize::try_from(decode_varint(&mut rest).ok()?).ok()?,
            5 => 4,
            _ => return None,
        };
        if rest.len() < len {
            return None;
        }
        rest = &rest[len..];
        let field = &start[..start.len() - rest.len()];
        if key >> 3 != PULL_AUTH_FIELD {
            out.extend_from_slice(field);
        }
    }
    encode_key(PULL_AUTH_FIELD as u32, WireType::LengthDelimited, &mut out);
    encode_varint(auth.encoded_len() as u64, &mut out);
    auth.encode_raw(&mut out);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn replacing_the_auth_keeps_every_other_field() {
        let req = PullImageRequest {
            image: Some(ImageSpec {
                image: "r.io/a:v1".into(),
            }),
            auth: Some(AuthConfig {
                username: "old".into(),
                password: "old-secret".into(),
                auth: "b2xkOm9sZA==".into(),
                server_address: "r.io".into(),
                identity_token: "id".into(),
                registry_token: String::new(),
            }),
            sandbox_config: Some(PodSandboxConfig {
                metadata: Some(PodSandboxMetadata {
                    name: "pod".into(),
                    uid: "u".into(),
                    namespace: "ns".into(),
                }),
            }),
        };
        let mut bytes = req.encode_to_vec();
        // A field credgate has no code for (an annotation map entry, number 9).
        bytes.extend_from_slice(&[0x4a, 0x03, b'a', b'b', b'c']);
        let new = AuthConfig {
            username: "new".into(),
            password: "new-secret".into(),
            server_address: "r.io".into(),
            ..Default::default()
        };
        let out = with_pull_auth(&bytes, &new).unwrap();
        let decoded = PullImageRequest::decode(&*out).unwrap();
        assert_eq!(decoded.auth.as_ref(), Some(&new));
        assert_eq!(decoded.image, req.image);
        assert_eq!(decoded.sandbox_config, req.sandbox_config);
        assert!(out.windows(5).any(|w| w == [0x4a, 0x03, b'a', b'b', b'c']));
        assert!(!out.windows(10).any(|w| w == b"old-secret"));
        // Not protobuf: refused, never passed on half-changed.
        assert!(with_pull_auth(&[0x12, 0x7f, 0x01], &new).is_none());
        assert!(with_pull_auth(&[0x0b], &new).is_none());
    }
}
