//! The plugin wire format: `CredentialProviderRequest` written to a plugin's stdin and
//! `CredentialProviderResponse` read from its stdout, identical in the three versions.
//!
//! The decoder never lets plugin output reach an error: stdout may hold secrets, so errors name
//! only the field that was wrong, never its value.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Serialize;
use serde_json::Value;

use crate::config::WireVersion;
use crate::duration::GoDuration;

const REQUEST_KIND: &str = "CredentialProviderRequest";
const RESPONSE_KIND: &str = "CredentialProviderResponse";

/// What a plugin is asked.
pub struct Request<'a> {
    pub api_version: WireVersion,
    /// The normalized image name, without tag or digest.
    pub image: &'a str,
    /// Only for `/v1` providers with token attributes.
    pub service_account_token: Option<&'a SecretString>,
    /// Only the configured annotation keys the account has.
    pub service_account_annotations: Option<&'a BTreeMap<String, String>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RawRequest<'a> {
    kind: &'static str,
    api_version: &'static str,
    image: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    service_account_token: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    service_account_annotations: Option<&'a BTreeMap<String, String>>,
}

impl Request<'_> {
    /// The compact JSON object and newline written to the plugin's stdin.
    pub fn encode(&self) -> Vec<u8> {
        let raw = RawRequest {
            kind: REQUEST_KIND,
            api_version: self.api_version.as_str(),
            image: self.image,
            service_account_token: self.service_account_token.map(|t| t.expose_secret()),
            service_account_annotations: self.service_account_annotations,
        };
        let mut out = serde_json::to_vec(&raw).expect("request serializes");
        out.push(b'\n');
        out
    }
}

/// How a response may be reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheKeyType {
    Image,
    Registry,
    Global,
}

impl CacheKeyType {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheKeyType::Image => "Image",
            CacheKeyType::Registry => "Registry",
            CacheKeyType::Global => "Global",
        }
    }
}

/// One credential of a response.
#[derive(Clone)]
pub struct AuthConfig {
    pub username: String,
    pub password: SecretString,
}

impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthConfig")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// A decoded, checked response.
#[derive(Debug, Clone)]
pub struct Response {
    pub cache_key_type: CacheKeyType,
    /// `None`: use the provider's default; `Some(0)`: do not cache.
    pub cache_duration: Option<Duration>,
    /// Pattern to credential, in key order.
    pub auth: Vec<(String, AuthConfig)>,
}

/// Why a plugin's output was refused. Never carries the output itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResponseError {
    #[error("response is not a JSON object (line {line}, column {column})")]
    MalformedJson { line: usize, column: usize },
    #[error("response kind is not CredentialProviderResponse")]
    WrongKind,
    #[error("response apiVersion does not equal the configured {expected}")]
    WrongApiVersion { expected: &'static str },
    #[error("response cacheKeyType is missing or not one of Image, Registry, Global")]
    InvalidCacheKeyType,
    #[error("response cacheDuration is not a Go duration string")]
    InvalidCacheDuration,
    #[error("response field {0} has the wrong type")]
    WrongType(&'static str),
}

/// Decodes and checks a plugin's stdout against the provider's configured version.
pub fn decode_response(stdout: &[u8], expected: WireVersion) -> Result<Response, ResponseError> {
    let value: Value =
        serde_json::from_slice(stdout).map_err(|e| ResponseError::MalformedJson {
            line: e.line(),
            column: e.column(),
        })?;
    let Value::Object(obj) = value else {
        return Err(ResponseError::MalformedJson { line: 1, column: 1 });
    };
    if obj.get("kind").and_then(Value::as_str) != Some(RESPONSE_KIND) {
        return Err(ResponseError::WrongKind);
    }
    if obj.get("apiVersion").and_then(Value::as_str) != Some(expected.as_str()) {
        return Err(ResponseError::WrongApiVersion {
            expected: expected.as_str(),
        });
    }
    let cache_key_type = match obj.get("cacheKeyType").and_then(Value::as_str) {
        Some("Image") => CacheKeyType::Image,
        Some("Registry") => CacheKeyType::Registry,
        Some("Global") => CacheKeyType::Global,
        _ => return Err(ResponseError::InvalidCacheKeyType),
    };
    let cache_duration = match obj.get("cacheDuration") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => {
            let d = GoDuration::parse(s).map_err(|_| ResponseError::InvalidCacheDuration)?;
            Some(d.to_std().unwrap_or(Duration::ZERO))
        }
        Some(_) => return Err(ResponseError::InvalidCacheDuration),
    };
    Ok(Response {
        cache_key_type,
        cache_duration,
        auth: decode_auth(obj.get("auth"))?,
    })
}

fn decode_auth(auth: Option<&Value>) -> Result<Vec<(String, AuthConfig)>, ResponseError> {
    let map = match auth {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(_) => return Err(ResponseError::WrongType("auth")),
    };
    let field = |entry: &serde_json::Map<String, Value>, name: &'static str| match entry.get(name) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(ResponseError::WrongType(name)),
    };
    map.iter()
        .map(|(key, entry)| {
            let Value::Object(entry) = entry else {
                return Err(ResponseError::WrongType("auth"));
            };
            let username = field(entry, "username")?;
            let password = SecretString::from(field(entry, "password")?);
            Ok((key.clone(), AuthConfig { username, password }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: &str = "credentialprovider.kubelet.k8s.io/v1";

    fn ok(json: &str) -> Response {
        decode_response(json.as_bytes(), WireVersion::V1).unwrap()
    }

    #[test]
    fn request_shapes() {
        let req = Request {
            api_version: WireVersion::V1alpha1,
            image: "docker.io/library/nginx",
            service_account_token: None,
            service_account_annotations: None,
        };
        assert_eq!(
            String::from_utf8(req.encode()).unwrap(),
            "{\"kind\":\"CredentialProviderRequest\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1alpha1\",\"image\":\"docker.io/library/nginx\"}\n"
        );
        let token = SecretString::from("tok");
        let ann = BTreeMap::from([("a.io/x".to_owned(), "1".to_owned())]);
        let req = Request {
            api_version: WireVersion::V1,
            image: "a.io/x",
            service_account_token: Some(&token),
            service_account_annotations: Some(&ann),
        };
        let v: Value = serde_json::from_slice(&req.encode()).unwrap();
        assert_eq!(v["serviceAccountToken"], "tok");
        assert_eq!(v["serviceAccountAnnotations"]["a.io/x"], "1");
    }

    #[test]
    fn decodes_each_key_type_and_duration() {
        for (kt, want) in [
            ("Image", CacheKeyType::Image),
            ("Registry", CacheKeyType::Registry),
            ("Global", CacheKeyType::Global),
        ] {
            let r = ok(&format!(
                r#"{{"kind":"CredentialProviderResponse","apiVersion":"{V1}","cacheKeyType":"{kt}","auth":{{"a.io":{{"username":"u","password":"p"}}}}}}"#
            ));
            assert_eq!(r.cache_key_type, want);
            assert_eq!(r.cache_duration, None);
            assert_eq!(r.auth[0].0, "a.io");
            assert_eq!(r.auth[0].1.username, "u");
            assert_eq!(r.auth[0].1.password.expose_secret(), "p");
        }
        let base = format!(
            r#""kind":"CredentialProviderResponse","apiVersion":"{V1}","cacheKeyType":"Image""#
        );
        assert_eq!(
            ok(&format!("{{{base},\"cacheDuration\":\"0s\"}}")).cache_duration,
            Some(Duration::ZERO)
        );
        assert_eq!(
            ok(&format!("{{{base},\"cacheDuration\":\"5m\"}}")).cache_duration,
            Some(Duration::from_secs(300))
        );
        assert_eq!(
            ok(&format!("{{{base},\"cacheDuration\":\"-5m\"}}")).cache_duration,
            Some(Duration::ZERO)
        );
        assert!(ok(&format!("{{{base}}}")).auth.is_empty());
        let empty = ok(&format!(
            "{{{base},\"auth\":{{\"a.io\":{{}}}},\"extra\":1}}"
        ));
        assert_eq!(empty.auth[0].1.username, "");
    }

    #[test]
    fn refuses_bad_responses() {
        let cases: Vec<(String, ResponseError)> = vec![
            ("not json".into(), ResponseError::MalformedJson { line: 1, column: 2 }),
            ("[1]".into(), ResponseError::MalformedJson { line: 1, column: 1 }),
            (format!(r#"{{"kind":"Other","apiVersion":"{V1}","cacheKeyType":"Image"}}"#), ResponseError::WrongKind),
            (
                r#"{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1beta1","cacheKeyType":"Image"}"#.into(),
                ResponseError::WrongApiVersion { expected: V1 },
            ),
            (format!(r#"{{"kind":"CredentialProviderResponse","apiVersion":"{V1}","cacheKeyType":"image"}}"#), ResponseError::InvalidCacheKeyType),
            (format!(r#"{{"kind":"CredentialProviderResponse","apiVersion":"{V1}"}}"#), ResponseError::InvalidCacheKeyType),
            (
                format!(r#"{{"kind":"CredentialProviderResponse","apiVersion":"{V1}","cacheKeyType":"Image","cacheDuration":"soon"}}"#),
                ResponseError::InvalidCacheDuration,
            ),
            (
                format!(r#"{{"kind":"CredentialProviderResponse","apiVersion":"{V1}","cacheKeyType":"Image","auth":{{"a.io":{{"password":7}}}}}}"#),
                ResponseError::WrongType("password"),
            ),
        ];
        for (json, want) in cases {
            assert_eq!(
                decode_response(json.as_bytes(), WireVersion::V1).unwrap_err(),
                want,
                "{json}"
            );
        }
    }

    #[test]
    fn errors_never_echo_output() {
        let secret = "s3cr3t-value";
        for json in [
            format!(r#"{{"kind":"{secret}"}}"#),
            format!(
                r#"{{"kind":"CredentialProviderResponse","apiVersion":"{V1}","cacheKeyType":"{secret}"}}"#
            ),
            format!(r#"{{"auth":{{"a":{{"password":"{secret}"}}}} trailing"#),
            format!(
                r#"{{"kind":"CredentialProviderResponse","apiVersion":"{V1}","cacheKeyType":"Image","cacheDuration":"{secret}"}}"#
            ),
        ] {
            let err = decode_response(json.as_bytes(), WireVersion::V1).unwrap_err();
            assert!(!err.to_string().contains(secret));
            assert!(!format!("{err:?}").contains(secret));
        }
        let r = ok(&format!(
            r#"{{"kind":"CredentialProviderResponse","apiVersion":"{V1}","cacheKeyType":"Image","auth":{{"a":{{"password":"{secret}"}}}}}}"#
        ));
        assert!(!format!("{r:?}").contains(secret));
    }
}
