//! The kubelet's side of the plugin protocol, for `credgate-credential-provider`: the bridge
//! reads the `CredentialProviderRequest` the kubelet writes and answers with a
//! `CredentialProviderResponse` of the same version, as a plugin would.
//!
//! Nothing here quotes a token, a password or the request's bytes in an error.

use std::collections::BTreeMap;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use super::{CacheKeyType, REQUEST_KIND, RESPONSE_KIND};
use crate::config::WireVersion;
use crate::duration::GoDuration;

/// What marks credgate's kubelet bridge executable, in two halves: the bridge keeps the whole
/// (a `#[used]` static, contiguous in its binary, whatever its name or however it was copied),
/// and the agent joins the halves only at run time to look for it in a provider's executable,
/// so that no other credgate binary holds the whole. A provider whose plugin is the bridge
/// would make the agent ask itself: every lookup would wait its plugin timeout and fail.
pub const BRIDGE_MARK: [&str; 2] = ["credgate-kubelet-bridge:", "executable-mark:2f9c41e7"];

/// The most the bridge reads from stdin: an image, a service-account token and annotations.
pub const MAX_REQUEST: usize = 256 << 10;

/// What the kubelet asks.
pub struct KubeletRequest {
    /// The version the kubelet speaks; the answer uses the same.
    pub api_version: WireVersion,
    pub image: String,
    /// KEP-4412: the token the kubelet minted for this provider entry's audience.
    pub service_account_token: Option<SecretString>,
    pub service_account_annotations: BTreeMap<String, String>,
}

impl std::fmt::Debug for KubeletRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeletRequest")
            .field("api_version", &self.api_version)
            .field("image", &self.image)
            .field(
                "service_account_token",
                &self.service_account_token.as_ref().map(|_| "<redacted>"),
            )
            .field(
                "service_account_annotations",
                &self.service_account_annotations,
            )
            .finish()
    }
}

/// Why the kubelet's request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("the request on stdin is larger than {MAX_REQUEST} bytes")]
    TooLarge,
    #[error("the request on stdin is not a JSON object (line {line}, column {column})")]
    Malformed { line: usize, column: usize },
    #[error("the request's kind is not {REQUEST_KIND}")]
    WrongKind,
    #[error("the request's apiVersion is not one of credentialprovider.kubelet.k8s.io/v1alpha1, v1beta1, v1")]
    UnknownVersion,
    #[error("the request has no image")]
    NoImage,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawRequest {
    #[serde(default)]
    kind: String,
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    image: String,
    #[serde(default)]
    service_account_token: Option<String>,
    #[serde(default)]
    service_account_annotations: Option<BTreeMap<String, String>>,
}

/// Reads the kubelet's request (one JSON object) from what it wrote on stdin.
pub fn decode_request(input: &[u8]) -> Result<KubeletRequest, RequestError> {
    if input.len() > MAX_REQUEST {
        return Err(RequestError::TooLarge);
    }
    let raw: RawRequest = serde_json::from_slice(input).map_err(|e| RequestError::Malformed {
        line: e.line(),
        column: e.column(),
    })?;
    if raw.kind != REQUEST_KIND {
        return Err(RequestError::WrongKind);
    }
    let api_version = WireVersion::parse(&raw.api_version).ok_or(RequestError::UnknownVersion)?;
    if raw.image.is_empty() {
        return Err(RequestError::NoImage);
    }
    Ok(KubeletRequest {
        api_version,
        image: raw.image,
        service_account_token: raw
            .service_account_token
            .filter(|t| !t.is_empty())
            .map(SecretString::from),
        service_account_annotations: raw.service_account_annotations.unwrap_or_default(),
    })
}

/// A service account as its token's claims name it: the kubelet sends no other identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSubject {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// The namespace, name and uid a Kubernetes service-account token's claims carry
/// (`kubernetes.io.namespace`, `kubernetes.io.serviceaccount.{name,uid}`, or `sub` as
/// `system:serviceaccount:NS:NAME`). The signature is not checked: the provider that receives
/// the token does that; these only key the agent's cache.
pub fn token_subject(token: &SecretString) -> Option<TokenSubject> {
    use base64::Engine as _;
    let payload = token.expose_secret().split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    #[derive(Deserialize)]
    struct Claims {
        sub: Option<String>,
        #[serde(rename = "kubernetes.io")]
        kubernetes: Option<K8s>,
    }
    #[derive(Deserialize)]
    struct K8s {
        namespace: Option<String>,
        serviceaccount: Option<Sa>,
    }
    #[derive(Deserialize)]
    struct Sa {
        name: Option<String>,
        uid: Option<String>,
    }
    let claims: Claims = serde_json::from_slice(&bytes).ok()?;
    let from_sub = claims.sub.as_deref().and_then(|s| {
        let rest = s.strip_prefix("system:serviceaccount:")?;
        let (ns, name) = rest.split_once(':')?;
        Some((ns.to_owned(), name.to_owned()))
    });
    let k8s = claims.kubernetes;
    let namespace = k8s
        .as_ref()
        .and_then(|k| k.namespace.clone())
        .or_else(|| from_sub.as_ref().map(|s| s.0.clone()))?;
    let sa = k8s.and_then(|k| k.serviceaccount);
    let name = sa
        .as_ref()
        .and_then(|s| s.name.clone())
        .or_else(|| from_sub.map(|s| s.1))?;
    let uid = sa.and_then(|s| s.uid).unwrap_or_default();
    if namespace.is_empty() || name.is_empty() {
        return None;
    }
    Some(TokenSubject {
        namespace,
        name,
        uid,
    })
}

/// One credential of the answer.
pub struct AuthEntry<'a> {
    pub pattern: &'a str,
    pub username: &'a str,
    pub password: &'a str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RawResponse<'a> {
    kind: &'static str,
    api_version: &'static str,
    cache_key_type: &'static str,
    cache_duration: String,
    auth: BTreeMap<&'a str, RawAuth<'a>>,
}

#[derive(Serialize)]
struct RawAuth<'a> {
    username: &'a str,
    password: &'a str,
}

/// The answer, as one JSON object and a newline. The first credential of a pattern wins (the
/// protocol's `auth` is a map; credgate's try-order decides which one it keeps).
pub fn encode_response(
    version: WireVersion,
    key_type: CacheKeyType,
    cache_for: Duration,
    auth: &[AuthEntry<'_>],
) -> Vec<u8> {
    let mut map = BTreeMap::new();
    for a in auth {
        map.entry(a.pattern).or_insert(RawAuth {
            username: a.username,
            password: a.password,
        });
    }
    // Go durations: whole milliseconds are enough for a cache.
    let ms = i64::try_from(cache_for.as_millis()).unwrap_or(i64::MAX / 1_000_000);
    let raw = RawResponse {
        kind: RESPONSE_KIND,
        api_version: version.as_str(),
        cache_key_type: key_type.as_str(),
        cache_duration: GoDuration(ms.saturating_mul(1_000_000)).to_string(),
        auth: map,
    };
    let mut out = serde_json::to_vec(&raw).expect("a response serializes");
    out.push(b'\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_of_every_version_decode_and_bad_ones_say_why() {
        for v in WireVersion::ALL {
            let input = format!(
                r#"{{"kind":"CredentialProviderRequest","apiVersion":"{}","image":"reg.io/app:v1"}}"#,
                v.as_str()
            );
            let r = decode_request(input.as_bytes()).unwrap();
            assert_eq!((r.api_version, r.image.as_str()), (v, "reg.io/app:v1"));
            assert!(r.service_account_token.is_none());
        }
        let bad: [(&[u8], RequestError); 4] = [
            (b"{", RequestError::Malformed { line: 1, column: 1 }),
            (
                br#"{"kind":"X","apiVersion":"credentialprovider.kubelet.k8s.io/v1","image":"a"}"#,
                RequestError::WrongKind,
            ),
            (
                br#"{"kind":"CredentialProviderRequest","apiVersion":"v9","image":"a"}"#,
                RequestError::UnknownVersion,
            ),
            (
                br#"{"kind":"CredentialProviderRequest","apiVersion":"credentialprovider.kubelet.k8s.io/v1"}"#,
                RequestError::NoImage,
            ),
        ];
        for (input, want) in bad {
            assert_eq!(decode_request(input).unwrap_err(), want);
        }
        assert_eq!(
            decode_request(&vec![b' '; MAX_REQUEST + 1]).unwrap_err(),
            RequestError::TooLarge
        );
    }

    #[test]
    fn a_token_request_keeps_its_token_secret() {
        let input = br#"{"kind":"CredentialProviderRequest","apiVersion":"credentialprovider.kubelet.k8s.io/v1","image":"a.io/x","serviceAccountToken":"tok-secret","serviceAccountAnnotations":{"example.com/role":"puller"}}"#;
        let r = decode_request(input).unwrap();
        assert_eq!(
            r.service_account_token.as_ref().unwrap().expose_secret(),
            "tok-secret"
        );
        assert_eq!(r.service_account_annotations["example.com/role"], "puller");
        assert!(!format!("{r:?}").contains("tok-secret"));
    }

    fn jwt(claims: &str) -> SecretString {
        use base64::Engine as _;
        let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        SecretString::from(format!("{}.{}.sig", b(r#"{"alg":"RS256"}"#), b(claims)))
    }

    #[test]
    fn the_service_account_comes_from_the_tokens_claims() {
        let t = jwt(
            r#"{"sub":"system:serviceaccount:team-a:puller","kubernetes.io":{"namespace":"team-a","serviceaccount":{"name":"puller","uid":"0b5e"}}}"#,
        );
        assert_eq!(
            token_subject(&t),
            Some(TokenSubject {
                namespace: "team-a".into(),
                name: "puller".into(),
                uid: "0b5e".into()
            })
        );
        let only_sub = jwt(r#"{"sub":"system:serviceaccount:ns:sa"}"#);
        assert_eq!(token_subject(&only_sub).unwrap().name, "sa");
        assert_eq!(token_subject(&jwt(r#"{"sub":"someone"}"#)), None);
        assert_eq!(token_subject(&SecretString::from("not-a-jwt")), None);
    }

    #[test]
    fn responses_answer_in_the_requests_version() {
        let out = encode_response(
            WireVersion::V1beta1,
            CacheKeyType::Registry,
            Duration::from_millis(90_500),
            &[
                AuthEntry {
                    pattern: "reg.io",
                    username: "u1",
                    password: "p1",
                },
                AuthEntry {
                    pattern: "reg.io",
                    username: "u2",
                    password: "p2",
                },
            ],
        );
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["apiVersion"], "credentialprovider.kubelet.k8s.io/v1beta1");
        assert_eq!(v["kind"], "CredentialProviderResponse");
        assert_eq!(v["cacheKeyType"], "Registry");
        assert_eq!(v["cacheDuration"], "1m30.5s");
        assert_eq!(
            v["auth"]["reg.io"]["username"], "u1",
            "the first in try-order"
        );
        let decoded = crate::wire::decode_response(&out, WireVersion::V1beta1).unwrap();
        assert_eq!(decoded.cache_duration, Some(Duration::from_millis(90_500)));
        let empty = encode_response(WireVersion::V1, CacheKeyType::Image, Duration::ZERO, &[]);
        let v: serde_json::Value = serde_json::from_slice(&empty).unwrap();
        assert_eq!(v["cacheDuration"], "0s");
        assert_eq!(v["auth"], serde_json::json!({}));
    }
}
