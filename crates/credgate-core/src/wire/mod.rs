//! The kubelet's plugin protocol, both directions. Here, the plugin's side as credgate runs
//! plugins: `CredentialProviderRequest` written to a plugin's stdin and
//! `CredentialProviderResponse` read from its stdout, identical in the three versions;
//! [`bridge`], the other side, as the bridge answers the kubelet.
//!
//! The decoder never lets plugin output reach an error: stdout may hold secrets, so errors name
//! only the field that was wrong, never its value.

pub mod bridge;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use crate::config::WireVersion;
use crate::duration::GoDuration;

/// The `kind` of a request and of a response.
pub(crate) const REQUEST_KIND: &str = "CredentialProviderRequest";
pub(crate) const RESPONSE_KIND: &str = "CredentialProviderResponse";

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
    pub const ALL: [CacheKeyType; 3] = [
        CacheKeyType::Image,
        CacheKeyType::Registry,
        CacheKeyType::Global,
    ];

    /// Its name on the wire (`cacheKeyType`), in the agent's API and in saved caches.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheKeyType::Image => "Image",
            CacheKeyType::Registry => "Registry",
            CacheKeyType::Global => "Global",
        }
    }
}

/// A name that is not a cache key type (they are case-sensitive).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a cache key type (Image, Registry or Global)")]
pub struct UnknownCacheKeyType;

impl std::str::FromStr for CacheKeyType {
    type Err = UnknownCacheKeyType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CacheKeyType::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or(UnknownCacheKeyType)
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
///
/// A repeated key counts with its last value, and `auth` comes out in key order, as a JSON
/// object decoded into a map would.
pub fn decode_response(stdout: &[u8], expected: WireVersion) -> Result<Response, ResponseError> {
    let value: Loose<'_> =
        serde_json::from_slice(stdout).map_err(|e| ResponseError::MalformedJson {
            line: e.line(),
            column: e.column(),
        })?;
    let Loose::Object(fields) = value else {
        return Err(ResponseError::MalformedJson { line: 1, column: 1 });
    };
    let (mut kind, mut api_version, mut key_type, mut duration, mut auth) =
        (None, None, None, None, None);
    for (name, value) in fields {
        let slot = match &*name {
            "kind" => &mut kind,
            "apiVersion" => &mut api_version,
            "cacheKeyType" => &mut key_type,
            "cacheDuration" => &mut duration,
            "auth" => &mut auth,
            _ => continue,
        };
        *slot = Some(value);
    }
    if kind.as_ref().and_then(Loose::as_str) != Some(RESPONSE_KIND) {
        return Err(ResponseError::WrongKind);
    }
    if api_version.as_ref().and_then(Loose::as_str) != Some(expected.as_str()) {
        return Err(ResponseError::WrongApiVersion {
            expected: expected.as_str(),
        });
    }
    let cache_key_type = key_type
        .as_ref()
        .and_then(Loose::as_str)
        .and_then(|s| s.parse().ok())
        .ok_or(ResponseError::InvalidCacheKeyType)?;
    let cache_duration = match duration {
        None | Some(Loose::Null) => None,
        Some(Loose::Str(s)) => {
            let d = GoDuration::parse(&s).map_err(|_| ResponseError::InvalidCacheDuration)?;
            Some(d.to_std().unwrap_or(Duration::ZERO))
        }
        Some(_) => return Err(ResponseError::InvalidCacheDuration),
    };
    Ok(Response {
        cache_key_type,
        cache_duration,
        auth: decode_auth(auth)?,
    })
}

fn decode_auth(auth: Option<Loose<'_>>) -> Result<Vec<(String, AuthConfig)>, ResponseError> {
    let entries = match auth {
        None | Some(Loose::Null) => return Ok(Vec::new()),
        Some(Loose::Object(entries)) => entries,
        Some(_) => return Err(ResponseError::WrongType("auth")),
    };
    let field = |value: Option<Loose<'_>>, name: &'static str| match value {
        None | Some(Loose::Null) => Ok(String::new()),
        Some(Loose::Str(s)) => Ok(s.into_owned()),
        Some(_) => Err(ResponseError::WrongType(name)),
    };
    let mut by_key = Vec::with_capacity(entries.len());
    for (key, entry) in entries {
        let Loose::Object(fields) = entry else {
            return Err(ResponseError::WrongType("auth"));
        };
        let (mut username, mut password) = (None, None);
        for (name, value) in fields {
            match &*name {
                "username" => username = Some(value),
                "password" => password = Some(value),
                _ => {}
            }
        }
        let username = field(username, "username")?;
        let password = SecretString::from(field(password, "password")?);
        by_key.push((key.into_owned(), AuthConfig { username, password }));
    }
    // Sorted by key; of a key given twice the last counts, as when JSON is read into a map.
    // (Stable sort: equal keys keep input order; reversing first makes dedup keep the last.)
    by_key.reverse();
    by_key.sort_by(|a, b| a.0.cmp(&b.0));
    by_key.dedup_by(|later, earlier| later.0 == earlier.0);
    Ok(by_key)
}

/// A JSON value kept only as far as a response needs it: strings (borrowed from the input
/// when they hold no escape), null, objects as their members in input order, and anything
/// else as `Other`. Cheaper than `serde_json::Value`, which copies every string and builds a
/// map per object.
enum Loose<'a> {
    Null,
    Str(Cow<'a, str>),
    Object(Vec<(Cow<'a, str>, Loose<'a>)>),
    Other,
}

impl Loose<'_> {
    fn as_str(&self) -> Option<&str> {
        match self {
            Loose::Str(s) => Some(s),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for Loose<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(LooseVisitor)
    }
}

/// A member name, borrowed when it holds no escape.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match d.deserialize_str(LooseVisitor)? {
            Loose::Str(s) => Ok(Key(s)),
            _ => Err(de::Error::custom("an object key is not a string")),
        }
    }
}

struct LooseVisitor;

impl<'de> Visitor<'de> for LooseVisitor {
    type Value = Loose<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Loose::Str(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Loose::Str(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Loose::Str(Cow::Owned(v)))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Loose::Null)
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(Loose::Null)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Loose::Other)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Loose::Other)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Loose::Other)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Loose::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Loose::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut members = Vec::with_capacity(map.size_hint().unwrap_or(0).min(16));
        while let Some((Key(k), v)) = map.next_entry::<Key<'de>, Loose<'de>>()? {
            members.push((k, v));
        }
        Ok(Loose::Object(members))
    }
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
        let v: serde_json::Value = serde_json::from_slice(&req.encode()).unwrap();
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
    fn decodes_as_a_map_would_escapes_repeats_and_ignored_members() {
        // Escaped strings, a repeated key (the last counts), members of every other JSON type
        // that the response ignores, and auth keys out of order (they come out sorted).
        let r = ok(&format!(
            r#"{{"kind":"Other","kind":"Credential\u0050roviderResponse","apiVersion":"{V1}",
                "extra":[1,{{"x":[true,null]}},2.5],"n":-3,"b":false,"o":{{"k":"v"}},
                "cacheKeyType":"Registry","auth":{{
                  "z.io":{{"username":"z","password":"p\"q\\r","other":[1]}},
                  "a.io":{{"username":"first","password":"1"}},
                  "a.io":{{"username":"second","password":null}}}}}}"#
        ));
        assert_eq!(r.cache_key_type, CacheKeyType::Registry);
        let keys: Vec<&str> = r.auth.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["a.io", "z.io"]);
        assert_eq!(r.auth[0].1.username, "second");
        assert_eq!(r.auth[0].1.password.expose_secret(), "");
        assert_eq!(r.auth[1].1.password.expose_secret(), "p\"q\\r");
        // A wrongly typed member that a later repeat replaces is no error, as in a map.
        let repeated = ok(&format!(
            r#"{{"kind":"CredentialProviderResponse","apiVersion":"{V1}","cacheKeyType":7,"cacheKeyType":"Image"}}"#
        ));
        assert_eq!(repeated.cache_key_type, CacheKeyType::Image);
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

    #[test]
    fn cache_key_types_parse_as_they_print_and_only_so() {
        for k in CacheKeyType::ALL {
            assert_eq!(k.as_str().parse::<CacheKeyType>(), Ok(k));
        }
        for bad in ["image", "GLOBAL", "", "Image "] {
            assert_eq!(bad.parse::<CacheKeyType>(), Err(UnknownCacheKeyType));
        }
    }
}
