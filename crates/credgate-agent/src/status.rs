//! Every error the agent answers a gRPC call with becomes a status here and nowhere else: the
//! API services and the API server's own deadline (the CRI proxy maps its own few in
//! `credgate-cri`'s `runtime.rs`). A message is
//! the error's `Display`, which never carries a secret (each error type's tests say so).

use tonic::{Code, Status};

use crate::captured::CaptureError;
use crate::guard::GuardError;
use crate::renewal::TrackError;

/// Why a call failed, as the agent knows it; its status is [`From`] below.
#[derive(Debug)]
pub enum ApiError {
    /// The request is malformed or out of bounds.
    Invalid(String),
    Lookup(credgate_engine::LookupError),
    Track(TrackError),
    Guard(GuardError),
    Capture(CaptureError),
    /// A reload was refused (the whole cause chain); the old config keeps serving.
    Reload(String),
    /// The caller's uid may not call the service.
    Denied(String),
    /// The call needs a part this agent does not run (the guard, the CRI proxy).
    NotEnabled(&'static str),
    NotFound(String),
    /// A task of the agent failed (a panic).
    Internal(&'static str),
    /// The call took longer than its deadline.
    Deadline(String),
    /// A request larger than the agent reads.
    TooLarge(String),
    /// The caller called more often than it may.
    Limited(String),
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        let (code, message) = match e {
            ApiError::Invalid(m) => (Code::InvalidArgument, m),
            ApiError::Lookup(e) => (Code::InvalidArgument, e.to_string()),
            ApiError::Track(e) => (Code::InvalidArgument, e.to_string()),
            ApiError::Guard(e) => match e {
                GuardError::InvalidImage { .. }
                | GuardError::InvalidImageRef(_)
                | GuardError::Missing(_) => (Code::InvalidArgument, e.to_string()),
                GuardError::Unavailable(_) => (Code::FailedPrecondition, e.to_string()),
                GuardError::Write(_) => (Code::Unavailable, e.to_string()),
            },
            ApiError::Capture(e) => (Code::Unavailable, e.to_string()),
            ApiError::Reload(m) => (Code::FailedPrecondition, m),
            ApiError::Denied(m) => (Code::PermissionDenied, m),
            ApiError::NotEnabled(m) => (Code::FailedPrecondition, m.to_owned()),
            ApiError::NotFound(m) => (Code::NotFound, m),
            ApiError::Internal(m) => (Code::Internal, m.to_owned()),
            ApiError::Deadline(m) => (Code::DeadlineExceeded, m),
            ApiError::TooLarge(m) => (Code::ResourceExhausted, m),
            ApiError::Limited(m) => (Code::ResourceExhausted, m),
        };
        Status::new(code, message)
    }
}

impl From<credgate_engine::LookupError> for ApiError {
    fn from(e: credgate_engine::LookupError) -> Self {
        ApiError::Lookup(e)
    }
}

impl From<credgate_engine::FlushError> for ApiError {
    fn from(e: credgate_engine::FlushError) -> Self {
        match e {
            credgate_engine::FlushError::Lookup(e) => ApiError::Lookup(e),
            e => ApiError::Invalid(e.to_string()),
        }
    }
}

impl From<credgate_core::reference::ReferenceError> for ApiError {
    fn from(e: credgate_core::reference::ReferenceError) -> Self {
        ApiError::Lookup(e.into())
    }
}

impl From<TrackError> for ApiError {
    fn from(e: TrackError) -> Self {
        ApiError::Track(e)
    }
}

impl From<GuardError> for ApiError {
    fn from(e: GuardError) -> Self {
        ApiError::Guard(e)
    }
}

impl From<CaptureError> for ApiError {
    fn from(e: CaptureError) -> Self {
        ApiError::Capture(e)
    }
}

impl ApiError {
    /// The message the caller is given.
    pub fn message(self) -> String {
        Status::from(self).message().to_owned()
    }
}

/// INVALID_ARGUMENT with `message`.
pub fn invalid(message: impl Into<String>) -> Status {
    ApiError::Invalid(message.into()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_code() {
        let cases = [
            (ApiError::Invalid("x".into()), Code::InvalidArgument),
            (
                ApiError::Track(TrackError::NoConsumer),
                Code::InvalidArgument,
            ),
            (
                ApiError::Guard(GuardError::Missing("image")),
                Code::InvalidArgument,
            ),
            (ApiError::Reload("bad".into()), Code::FailedPrecondition),
            (ApiError::Denied("uid 7".into()), Code::PermissionDenied),
            (ApiError::NotEnabled("off"), Code::FailedPrecondition),
            (ApiError::NotFound("none".into()), Code::NotFound),
            (ApiError::Internal("panic"), Code::Internal),
            (ApiError::Deadline("late".into()), Code::DeadlineExceeded),
            (ApiError::TooLarge("big".into()), Code::ResourceExhausted),
        ];
        for (e, code) in cases {
            let shown = format!("{e:?}");
            assert_eq!(Status::from(e).code(), code, "{shown}");
        }
    }

    /// Every error type of the agent, each variant with a cause: a chain (`outer: inner`)
    /// prints each cause once.
    #[test]
    fn every_error_prints_each_cause_once() {
        use crate::guard::store::StoreError;
        use crate::socket::SocketError;
        use crate::state::key::KeyError;
        use credgate_core::text::repeated_cause;
        use credgate_engine::sources::SourceError;
        use std::sync::Arc;
        let io = || std::io::Error::other("disk on fire");
        let trust = || credgate_api::trust::TrustError::Io {
            path: "/x".into(),
            error: io(),
        };
        let store_io = || StoreError::Io {
            path: "/x".into(),
            source: io(),
        };
        let load = || credgate_engine::source::LoadError::Read {
            path: "/x".into(),
            source: io(),
        };
        let errors: Vec<Box<dyn std::error::Error>> = vec![
            Box::new(CaptureError::Write {
                path: "/x".into(),
                error: io(),
            }),
            Box::new(KeyError::Io {
                path: "/x".into(),
                source: io(),
            }),
            Box::new(KeyError::Untrusted(trust())),
            Box::new(StoreError::Open {
                path: "/x".into(),
                source: rusqlite::Error::InvalidQuery,
            }),
            Box::new(StoreError::Untrusted(trust())),
            Box::new(store_io()),
            Box::new(GuardError::Unavailable(Arc::new(store_io()))),
            Box::new(GuardError::Write(store_io())),
            Box::new(SocketError::Io {
                path: "/x".into(),
                source: io(),
            }),
            Box::new(SocketError::Untrusted(trust())),
            Box::new(SourceError::DockerConfig(load())),
            Box::new(SourceError::ProviderConfig {
                path: "/x".into(),
                source: load(),
            }),
            Box::new(TrackError::NoConsumer),
            Box::new(crate::saved_cache::SavedError::Write {
                path: "/x".into(),
                error: io(),
            }),
        ];
        for e in &errors {
            assert_eq!(repeated_cause(&**e), None, "{e}");
        }
    }
}
