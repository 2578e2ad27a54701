//! Failures of one provider during a lookup. Shared by every waiter of a coalesced run, so they
//! are cheap to clone; none carries plugin output or a credential.

use std::sync::Arc;
use std::time::Duration;

use credgate_core::wire::ResponseError;

use crate::exec::RunError;

/// Why a provider gave no credentials for a lookup.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProviderError {
    #[error(transparent)]
    Run(Arc<RunError>),
    #[error("plugin {plugin}: {error}")]
    Response {
        plugin: String,
        error: ResponseError,
    },
    #[error("plugin {plugin}: a response password equals the service account token, but cacheType is not Token")]
    TokenEchoed { plugin: String },
    #[error("plugin {plugin}: backing off after {failures} consecutive failures, next run allowed in {}; last error: {last_error}", credgate_core::duration::Rounded(*retry_in))]
    Backoff {
        plugin: String,
        failures: u32,
        retry_in: Duration,
        /// The last run's error, as it was reported (never plugin output or a secret).
        last_error: String,
    },
    #[error("plugin {plugin}: the service account lacks the required annotation {key:?}")]
    MissingAnnotation { plugin: String, key: String },
    #[error("plugin {plugin}: the run ended without an answer")]
    Abandoned { plugin: String },
    /// The provider's `--plugin-rate` would not give this caller a turn soon enough.
    #[error("plugin {plugin}: {why} (its --plugin-rate is {per_second}/s); try again later")]
    RateLimited {
        plugin: String,
        per_second: f64,
        why: String,
    },
}

impl ProviderError {
    /// The provider (plugin) that failed.
    pub fn plugin(&self) -> &str {
        match self {
            ProviderError::Run(e) => match &**e {
                RunError::Spawn { plugin, .. }
                | RunError::Timeout { plugin, .. }
                | RunError::NonZeroExit { plugin, .. }
                | RunError::OutputTooLarge { plugin, .. }
                | RunError::Io { plugin, .. } => plugin,
            },
            ProviderError::Response { plugin, .. }
            | ProviderError::TokenEchoed { plugin }
            | ProviderError::Backoff { plugin, .. }
            | ProviderError::MissingAnnotation { plugin, .. }
            | ProviderError::Abandoned { plugin }
            | ProviderError::RateLimited { plugin, .. } => plugin,
        }
    }

    /// Why it failed (metrics, logs, the API).
    pub fn reason(&self) -> FailureReason {
        match self {
            ProviderError::Run(e) => match **e {
                RunError::Spawn { .. } => FailureReason::Spawn,
                RunError::Timeout { .. } => FailureReason::Timeout,
                RunError::NonZeroExit { .. } => FailureReason::NonZeroExit,
                RunError::OutputTooLarge { .. } => FailureReason::OutputTooLarge,
                RunError::Io { .. } => FailureReason::Io,
            },
            ProviderError::Response { .. } => FailureReason::MalformedResponse,
            ProviderError::TokenEchoed { .. } => FailureReason::TokenEchoed,
            ProviderError::Backoff { .. } => FailureReason::Backoff,
            ProviderError::MissingAnnotation { .. } => FailureReason::MissingAnnotation,
            ProviderError::Abandoned { .. } => FailureReason::Abandoned,
            ProviderError::RateLimited { .. } => FailureReason::RateLimited,
        }
    }
}

/// Why a provider gave no credentials, as metrics, logs and the API name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureReason {
    Spawn,
    Timeout,
    NonZeroExit,
    OutputTooLarge,
    Io,
    MalformedResponse,
    TokenEchoed,
    Backoff,
    MissingAnnotation,
    Abandoned,
    RateLimited,
}

impl FailureReason {
    /// Every reason.
    pub const ALL: [FailureReason; 11] = [
        FailureReason::Spawn,
        FailureReason::Timeout,
        FailureReason::NonZeroExit,
        FailureReason::OutputTooLarge,
        FailureReason::Io,
        FailureReason::MalformedResponse,
        FailureReason::TokenEchoed,
        FailureReason::Backoff,
        FailureReason::MissingAnnotation,
        FailureReason::Abandoned,
        FailureReason::RateLimited,
    ];

    /// The stable word (`credgate_plugin_errors_total{reason}`, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Spawn => "spawn",
            FailureReason::Timeout => "timeout",
            FailureReason::NonZeroExit => "nonzero_exit",
            FailureReason::OutputTooLarge => "output_too_large",
            FailureReason::Io => "io",
            FailureReason::MalformedResponse => "malformed_response",
            FailureReason::TokenEchoed => "token_echoed",
            FailureReason::Backoff => "backoff",
            FailureReason::MissingAnnotation => "missing_annotation",
            FailureReason::Abandoned => "abandoned",
            FailureReason::RateLimited => "rate_limited",
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error;
    use std::io;
    use std::path::PathBuf;

    use credgate_core::reference::ImageRef;
    use credgate_core::text::repeated_cause;

    use super::*;
    use crate::engine::{BuildError, LookupError};
    use crate::source::{load_provider_config, LoadError};

    /// Every error type of the engine, each variant with a cause: a chain (`outer: inner`)
    /// prints each cause once.
    #[test]
    fn every_error_prints_each_cause_once() {
        let io = || io::Error::other("disk on fire");
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "kind: Nope\n").unwrap();
        let run = || RunError::Io {
            plugin: "p".into(),
            source: io(),
        };
        let errors: Vec<Box<dyn Error>> = vec![
            Box::new(LookupError::from(
                ImageRef::parse("no spaces allowed").unwrap_err(),
            )),
            Box::new(LookupError::InvalidHost("a/b".into())),
            Box::new(BuildError::UnknownProvider("p".into())),
            Box::new(RunError::Spawn {
                plugin: "p".into(),
                path: PathBuf::from("/x"),
                source: io(),
            }),
            Box::new(run()),
            Box::new(ProviderError::Run(Arc::new(run()))),
            Box::new(LoadError::Read {
                path: PathBuf::from("/x"),
                source: io(),
            }),
            Box::new(load_provider_config(&bad).unwrap_err()),
            Box::new(load_provider_config(&dir.path().join("missing.yaml")).unwrap_err()),
        ];
        for e in &errors {
            assert_eq!(repeated_cause(&**e), None, "{e}");
        }
    }
}
