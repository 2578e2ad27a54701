//! The agent's outcomes as the API's enums, each spelled once: the compiler holds both sides
//! (a new reason on either is a match arm missing here, not a word a client does not know).

use credgate_api::v1 as pb;
use credgate_core::guard::{AllowReason, AuthReason};
use credgate_core::wire::CacheKeyType;
use credgate_engine::FailureReason;

use crate::guard::registry::VerifyReason;
use crate::guard::CheckReason;

pub fn cache_key_type(t: CacheKeyType) -> i32 {
    (match t {
        CacheKeyType::Image => pb::CacheKeyType::Image,
        CacheKeyType::Registry => pb::CacheKeyType::Registry,
        CacheKeyType::Global => pb::CacheKeyType::Global,
    }) as i32
}

pub fn failure_reason(r: FailureReason) -> i32 {
    (match r {
        FailureReason::Spawn => pb::FailureReason::Spawn,
        FailureReason::Timeout => pb::FailureReason::Timeout,
        FailureReason::NonZeroExit => pb::FailureReason::NonzeroExit,
        FailureReason::OutputTooLarge => pb::FailureReason::OutputTooLarge,
        FailureReason::Io => pb::FailureReason::Io,
        FailureReason::MalformedResponse => pb::FailureReason::MalformedResponse,
        FailureReason::TokenEchoed => pb::FailureReason::TokenEchoed,
        FailureReason::Backoff => pb::FailureReason::Backoff,
        FailureReason::MissingAnnotation => pb::FailureReason::MissingAnnotation,
        FailureReason::Abandoned => pb::FailureReason::Abandoned,
        FailureReason::RateLimited => pb::FailureReason::RateLimited,
    }) as i32
}

pub fn access_reason(r: CheckReason) -> i32 {
    use pb::AccessReason as A;
    (match r {
        CheckReason::NotAvailable => A::NotAvailable,
        CheckReason::PullPolicyAlways => A::PullPolicyAlways,
        CheckReason::NotPresent => A::NotPresent,
        CheckReason::Allow(a) => match a {
            AllowReason::PolicyNeverVerify => A::PolicyNeverVerify,
            AllowReason::Preloaded => A::Preloaded,
            AllowReason::Allowlisted => A::Allowlisted,
            AllowReason::NodeAccessible => A::NodeAccessible,
            AllowReason::SecretMatch => A::SecretMatch,
            AllowReason::SecretRotated => A::SecretRotated,
            AllowReason::ServiceAccountMatch => A::ServiceAccountMatch,
        },
        CheckReason::Authenticate(a) => match a {
            AuthReason::StoreUnreadable => A::StoreUnreadable,
            AuthReason::NoRecord => A::NoRecord,
            AuthReason::NoEntryForName => A::NoEntryForName,
            AuthReason::NoCredentialsRecorded => A::NoCredentialsRecorded,
            AuthReason::NoMatchingCredential => A::NoMatchingCredential,
            AuthReason::SecretTooOld => A::SecretTooOld,
        },
    }) as i32
}

pub fn verify_reason(r: VerifyReason) -> i32 {
    (match r {
        VerifyReason::Verified => pb::VerifyReason::Verified,
        VerifyReason::Unauthorized => pb::VerifyReason::Unauthorized,
        VerifyReason::DigestMismatch => pb::VerifyReason::DigestMismatch,
        VerifyReason::NotFound => pb::VerifyReason::NotFound,
        VerifyReason::Refused => pb::VerifyReason::Refused,
        VerifyReason::Unreachable => pb::VerifyReason::Unreachable,
        VerifyReason::NoCredentials => pb::VerifyReason::NoCredentials,
    }) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The API's word for each outcome is the word the agent's metrics and logs use.
    #[test]
    fn every_outcome_has_the_same_word_on_the_wire() {
        for t in CacheKeyType::ALL {
            let wire = pb::CacheKeyType::try_from(cache_key_type(t)).unwrap();
            assert_eq!(wire.word(), t.as_str());
        }
        for r in [
            VerifyReason::Verified,
            VerifyReason::Unauthorized,
            VerifyReason::DigestMismatch,
            VerifyReason::NotFound,
            VerifyReason::Refused,
            VerifyReason::Unreachable,
            VerifyReason::NoCredentials,
        ] {
            let wire = pb::VerifyReason::try_from(verify_reason(r)).unwrap();
            assert_eq!(wire.word(), r.as_str());
        }
        for r in [
            CheckReason::NotAvailable,
            CheckReason::PullPolicyAlways,
            CheckReason::NotPresent,
            CheckReason::Allow(AllowReason::SecretRotated),
            CheckReason::Authenticate(AuthReason::SecretTooOld),
        ] {
            let wire = pb::AccessReason::try_from(access_reason(r)).unwrap();
            assert_eq!(wire.word(), r.as_str());
        }
        for r in FailureReason::ALL {
            let wire = pb::FailureReason::try_from(failure_reason(r)).unwrap();
            assert_eq!(wire.word(), r.as_str());
        }
    }
}
