//! The serialized shape of `CredentialProviderConfig` and its strict decoder.

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::ConfigError;

const GROUP: &str = "kubelet.config.k8s.io";
const KIND: &str = "CredentialProviderConfig";

/// The config versions; only `V1` has `tokenAttributes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ConfigVersion {
    V1alpha1,
    V1beta1,
    V1,
}

#[derive(Deserialize)]
struct Header {
    #[serde(rename = "apiVersion")]
    api_version: Option<String>,
    kind: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawConfig<P> {
    #[allow(dead_code)]
    api_version: String,
    #[allow(dead_code)]
    kind: String,
    #[serde(default = "Vec::new")]
    providers: Vec<P>,
}

/// A provider; `T` is the `tokenAttributes` type of the config version.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawProvider<T = RawTokenAttributes> {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub match_images: Vec<String>,
    pub default_cache_duration: Option<String>,
    #[serde(default)]
    pub api_version: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<RawEnv>,
    pub token_attributes: Option<T>,
}

/// `tokenAttributes` under v1alpha1/v1beta1 configs: the field does not exist there.
struct NotInThisVersion;

impl<'de> Deserialize<'de> for NotInThisVersion {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Err(serde::de::Error::custom(
            "unknown field in this config version",
        ))
    }
}

impl From<RawProvider<NotInThisVersion>> for RawProvider {
    fn from(p: RawProvider<NotInThisVersion>) -> Self {
        RawProvider {
            name: p.name,
            match_images: p.match_images,
            default_cache_duration: p.default_cache_duration,
            api_version: p.api_version,
            args: p.args,
            env: p.env,
            token_attributes: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEnv {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub value: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawTokenAttributes {
    #[serde(default)]
    pub service_account_token_audience: String,
    #[serde(default)]
    pub cache_type: String,
    pub require_service_account: Option<bool>,
    #[serde(default)]
    pub required_service_account_annotation_keys: Vec<String>,
    #[serde(default)]
    pub optional_service_account_annotation_keys: Vec<String>,
}

/// A decoded document: its version and its providers.
pub(super) struct Decoded {
    pub providers: Vec<RawProvider>,
}

/// Strictly decodes one document: JSON when it starts with `{`, YAML otherwise.
pub(super) fn decode(document: &str, bytes: &[u8]) -> Result<Decoded, ConfigError> {
    let header: Header = from_bytes(document, bytes)?;
    let version = check_header(document, header)?;
    let providers = match version {
        ConfigVersion::V1 => from_bytes::<RawConfig<RawProvider>>(document, bytes)?.providers,
        ConfigVersion::V1alpha1 | ConfigVersion::V1beta1 => {
            from_bytes::<RawConfig<RawProvider<NotInThisVersion>>>(document, bytes)?
                .providers
                .into_iter()
                .map(RawProvider::from)
                .collect()
        }
    };
    Ok(Decoded { providers })
}

fn check_header(document: &str, header: Header) -> Result<ConfigVersion, ConfigError> {
    let api_version = header.api_version.unwrap_or_default();
    let version = match api_version.split_once('/') {
        Some((GROUP, "v1alpha1")) => ConfigVersion::V1alpha1,
        Some((GROUP, "v1beta1")) => ConfigVersion::V1beta1,
        Some((GROUP, "v1")) => ConfigVersion::V1,
        _ => {
            return Err(ConfigError::WrongApiVersion {
                document: document.to_owned(),
                api_version,
            })
        }
    };
    match header.kind.as_deref() {
        Some(KIND) => Ok(version),
        other => Err(ConfigError::WrongKind {
            document: document.to_owned(),
            kind: other.unwrap_or_default().to_owned(),
        }),
    }
}

fn is_json(bytes: &[u8]) -> bool {
    bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

fn from_bytes<T: DeserializeOwned>(document: &str, bytes: &[u8]) -> Result<T, ConfigError> {
    let result = if is_json(bytes) {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().clone();
            let inner = e.into_inner();
            let at = format!(" at line {} column {}", inner.line(), inner.column());
            (path, strip_location(&inner.to_string()) + &at)
        })
    } else {
        let de = serde_norway::Deserializer::from_slice(bytes);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().clone();
            let inner = e.into_inner();
            let at = inner
                .location()
                .map(|l| format!(" at line {} column {}", l.line(), l.column()))
                .unwrap_or_default();
            let text = strip_location(&inner.to_string());
            let text = match text.split_once(": ") {
                Some((prefix, rest)) if prefix == field_path(&path) => rest.to_owned(),
                _ => text,
            };
            (path, text + &at)
        })
    };
    result.map_err(|(path, message)| decode_error(document, &path, &message))
}

fn strip_location(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_owned(),
        None => message.to_owned(),
    }
}

/// Builds a decode error that names the field, and never repeats a value from the document
/// (an `env` value may be a secret).
fn decode_error(document: &str, path: &serde_path_to_error::Path, message: &str) -> ConfigError {
    let mut field = field_path(path);
    let (message, at) = match message.rfind(" at line ") {
        Some(i) => message.split_at(i),
        None => (message, ""),
    };
    let mut message = redact_values(message);
    for prefix in ["unknown field `", "duplicate field `"] {
        if let Some(rest) = message.strip_prefix(prefix) {
            if let Some(end) = rest.find('`') {
                let name = &rest[..end];
                if field.is_empty() {
                    field = name.to_owned();
                } else if !field.ends_with(&format!(".{name}")) && field != name {
                    field = format!("{field}.{name}");
                }
                message = prefix.trim_end_matches(" `").to_owned();
                break;
            }
        }
    }
    if field.is_empty() {
        field = "(document)".to_owned();
    }
    ConfigError::Decode {
        document: document.to_owned(),
        field,
        message: message + at,
    }
}

fn field_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for seg in path.iter() {
        match seg {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Unknown => {}
        }
    }
    out
}

/// `invalid type: string "hunter2", expected a boolean` loses the value it quotes.
fn redact_values(message: &str) -> String {
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some(rest) = message.strip_prefix(prefix) {
            if let Some(i) = rest.find(", expected ") {
                let what = rest[..i].split([' ', '`', '"']).next().unwrap_or_default();
                return format!("{prefix}{what}{}", &rest[i..]);
            }
        }
    }
    message.to_owned()
}
