//! The kubelet's `CredentialProviderConfig`: strict decoding of the three config versions from
//! YAML or JSON, validation that reports every problem at once with its field path, and the
//! lints for patterns that can never match. Serialized shapes stay in the private `raw` module; callers get the
//! validated domain types of this module.

mod raw;
mod validate;

use std::fmt;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::pattern::{Pattern, PatternLint};

pub use validate::is_qualified_name;

/// One config document: a file's name (for messages) and its bytes.
#[derive(Clone, Copy)]
pub struct Document<'a> {
    pub name: &'a str,
    pub bytes: &'a [u8],
}

/// The wire version spoken with a plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireVersion {
    V1alpha1,
    V1beta1,
    V1,
}

impl WireVersion {
    pub const ALL: [WireVersion; 3] =
        [WireVersion::V1alpha1, WireVersion::V1beta1, WireVersion::V1];

    /// The `apiVersion` string.
    pub fn as_str(self) -> &'static str {
        match self {
            WireVersion::V1alpha1 => "credentialprovider.kubelet.k8s.io/v1alpha1",
            WireVersion::V1beta1 => "credentialprovider.kubelet.k8s.io/v1beta1",
            WireVersion::V1 => "credentialprovider.kubelet.k8s.io/v1",
        }
    }

    /// Reads an `apiVersion` string.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

/// How service-account-scoped responses are cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenCacheType {
    /// Keyed by the service account's coordinates and selected annotations.
    ServiceAccount,
    /// Also keyed by a hash of the token itself.
    Token,
}

/// `tokenAttributes` of a provider (KEP-4412).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenAttributes {
    pub service_account_token_audience: String,
    pub cache_type: TokenCacheType,
    pub require_service_account: bool,
    pub required_annotation_keys: Vec<String>,
    pub optional_annotation_keys: Vec<String>,
}

/// One validated provider.
#[derive(Clone, PartialEq, Eq)]
pub struct ProviderSpec {
    pub name: String,
    pub match_images: Vec<Pattern>,
    pub default_cache_duration: Duration,
    pub api_version: WireVersion,
    pub args: Vec<String>,
    /// Extra environment for the plugin; values may be secrets and are redacted in `Debug`.
    pub env: Vec<(String, String)>,
    pub token_attributes: Option<TokenAttributes>,
}

impl fmt::Debug for ProviderSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let env: Vec<String> = self
            .env
            .iter()
            .map(|(k, _)| format!("{k}=<redacted>"))
            .collect();
        f.debug_struct("ProviderSpec")
            .field("name", &self.name)
            .field(
                "match_images",
                &self
                    .match_images
                    .iter()
                    .map(Pattern::as_str)
                    .collect::<Vec<_>>(),
            )
            .field("default_cache_duration", &self.default_cache_duration)
            .field("api_version", &self.api_version)
            .field("args", &self.args)
            .field("env", &env)
            .field("token_attributes", &self.token_attributes)
            .finish()
    }
}

/// A validated provider config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderConfig {
    pub providers: Vec<ProviderSpec>,
    /// `sha256:<hex>` of the config bytes, in document order: the config's identity.
    pub identity: String,
    /// Patterns the kubelet accepts but that never match.
    pub lints: Vec<ConfigLint>,
}

/// One validation problem, naming its field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    pub document: String,
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.document, self.field, self.message)
    }
}

/// A warning about a pattern that can never match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigLint {
    pub document: String,
    pub field: String,
    pub pattern: String,
    pub lint: PatternLint,
}

impl fmt::Display for ConfigLint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}: pattern {:?} {}",
            self.document, self.field, self.pattern, self.lint
        )
    }
}

/// Why a config was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The document could not be decoded (syntax, unknown or duplicated field, wrong type).
    #[error("{document}: {field}: {message}")]
    Decode {
        document: String,
        field: String,
        message: String,
    },
    /// `kind` is not `CredentialProviderConfig`.
    #[error("{document}: kind: expected CredentialProviderConfig, got {kind:?}")]
    WrongKind { document: String, kind: String },
    /// `apiVersion` is not one of the kubelet's config versions.
    #[error("{document}: apiVersion: unsupported {api_version:?}, expected kubelet.config.k8s.io/v1alpha1, /v1beta1 or /v1")]
    WrongApiVersion {
        document: String,
        api_version: String,
    },
    /// No documents were given (an empty directory).
    #[error("no provider config files found")]
    NoDocuments,
    /// Every validation problem at once.
    #[error("invalid provider config: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<ConfigIssue>),
}

impl ConfigError {
    /// The problems one per line, as `check-config` prints them.
    pub fn lines(&self) -> Vec<String> {
        match self {
            ConfigError::Invalid(issues) => issues.iter().map(ToString::to_string).collect(),
            other => vec![other.to_string()],
        }
    }
}

impl ProviderConfig {
    /// Decodes and validates one or more documents (a file, or a directory's files in sorted
    /// order), concatenating their providers.
    pub fn from_documents(docs: &[Document<'_>]) -> Result<Self, ConfigError> {
        if docs.is_empty() {
            return Err(ConfigError::NoDocuments);
        }
        let mut decoded = Vec::with_capacity(docs.len());
        let mut hasher = Sha256::new();
        for doc in docs {
            decoded.push((doc.name, raw::decode(doc.name, doc.bytes)?));
            hasher.update(doc.bytes);
        }
        let (providers, lints) = validate::validate(&decoded)?;
        Ok(ProviderConfig {
            providers,
            identity: format!("sha256:{}", hex::encode(hasher.finalize())),
            lints,
        })
    }

    /// Decodes and validates a single document.
    pub fn from_slice(name: &str, bytes: &[u8]) -> Result<Self, ConfigError> {
        Self::from_documents(&[Document { name, bytes }])
    }
}

#[cfg(test)]
mod tests;
