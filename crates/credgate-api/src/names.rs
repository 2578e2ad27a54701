//! The API's enums by name: the words the CLI prints and its JSON carries
//! (`"source_kind": "captured"`, `"decision": "ALLOW"`), never their numbers. build.rs names a
//! serializer of this module on each enum field.

use serde::Serializer;

use crate::v1::{
    AccessReason, CacheKeyType, Decision, FailureReason, PullAuth, PullPolicy, PullResult,
    RefusalOutcome, SourceKind, VerifyReason,
};

/// `word()` of each variant, spelled once.
macro_rules! words {
    ($ty:ident { $($variant:ident => $word:literal),* $(,)? }) => {
        impl $ty {
            pub fn word(self) -> &'static str {
                match self {
                    $($ty::$variant => $word,)*
                }
            }
        }
    };
}

words!(FailureReason {
    Unspecified => "unspecified",
    Spawn => "spawn",
    Timeout => "timeout",
    NonzeroExit => "nonzero_exit",
    OutputTooLarge => "output_too_large",
    Io => "io",
    MalformedResponse => "malformed_response",
    TokenEchoed => "token_echoed",
    Backoff => "backoff",
    MissingAnnotation => "missing_annotation",
    Abandoned => "abandoned",
    RateLimited => "rate_limited",
});

// As the kubelet spells them; no answer is the empty word.
words!(CacheKeyType {
    Unspecified => "",
    Image => "Image",
    Registry => "Registry",
    Global => "Global",
});

words!(AccessReason {
    Unspecified => "unspecified",
    PolicyNeverVerify => "policy_never_verify",
    Preloaded => "preloaded",
    Allowlisted => "allowlisted",
    NodeAccessible => "node_accessible",
    SecretMatch => "secret_match",
    SecretRotated => "secret_rotated",
    ServiceAccountMatch => "service_account_match",
    StoreUnreadable => "store_unreadable",
    NoRecord => "no_record",
    NoEntryForName => "no_entry_for_name",
    NoCredentialsRecorded => "no_credentials_recorded",
    NoMatchingCredential => "no_matching_credential",
    SecretTooOld => "secret_too_old",
    NotPresent => "not_present",
    PullPolicyAlways => "pull_policy_always",
    NotAvailable => "not_available",
});

words!(VerifyReason {
    Unspecified => "unspecified",
    Verified => "verified",
    Unauthorized => "unauthorized",
    DigestMismatch => "digest_mismatch",
    NotFound => "not_found",
    Refused => "refused",
    Unreachable => "unreachable",
    NoCredentials => "no_credentials",
});

impl SourceKind {
    pub fn word(self) -> &'static str {
        match self {
            SourceKind::Unspecified => "unspecified",
            SourceKind::Provider => "provider",
            SourceKind::DockerConfig => "docker-config",
            SourceKind::Captured => "captured",
        }
    }
}

impl PullAuth {
    pub fn word(self) -> &'static str {
        match self {
            PullAuth::Unspecified => "unspecified",
            PullAuth::None => "none",
            PullAuth::Given => "given",
            PullAuth::Filled => "filled",
            PullAuth::Unknown => "unknown",
        }
    }
}

impl PullResult {
    pub fn word(self) -> &'static str {
        match self {
            PullResult::Unspecified => "unspecified",
            PullResult::Ok => "ok",
            PullResult::Unauthorized => "unauthorized",
            PullResult::NotFound => "not_found",
            PullResult::Error => "error",
        }
    }
}

impl RefusalOutcome {
    pub fn word(self) -> &'static str {
        match self {
            RefusalOutcome::Unspecified => "unspecified",
            RefusalOutcome::Refused => "refused",
            RefusalOutcome::Accepted => "accepted",
            RefusalOutcome::Unchecked => "unchecked",
            RefusalOutcome::NotGiven => "not_given",
            RefusalOutcome::AlreadyRefused => "already_refused",
            RefusalOutcome::Unreachable => "unreachable",
        }
    }
}

impl Decision {
    pub fn word(self) -> &'static str {
        match self {
            Decision::Unspecified => "UNSPECIFIED",
            Decision::Allow => "ALLOW",
            Decision::MustAuthenticate => "MUST_AUTHENTICATE",
            Decision::Refuse => "REFUSE",
            Decision::Pull => "PULL",
        }
    }
}

impl PullPolicy {
    pub fn word(self) -> &'static str {
        self.as_str_name()
    }
}

macro_rules! serializers {
    ($($name:ident: $ty:ty),*) => {
        $(
            #[doc = concat!("Serializes a `", stringify!($ty), "` field by its word (`unspecified` for a number it does not know).")]
            pub fn $name<S: Serializer>(value: &i32, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(<$ty>::try_from(*value).map_or("unspecified", <$ty>::word))
            }
        )*
    };
}

serializers!(
    source_kind: SourceKind,
    pull_auth: PullAuth,
    pull_result: PullResult,
    refusal_outcome: RefusalOutcome,
    decision: Decision,
    pull_policy: PullPolicy,
    failure_reason: FailureReason,
    cache_key_type: CacheKeyType,
    access_reason: AccessReason,
    verify_reason: VerifyReason
);

#[cfg(test)]
mod tests {
    use crate::v1 as pb;

    #[test]
    fn json_names_enums_by_their_words() {
        let pull = pb::Pull {
            auth: pb::PullAuth::Filled as i32,
            result: pb::PullResult::Unauthorized as i32,
            source_kind: pb::SourceKind::Provider as i32,
            source: "team-p".into(),
            ..Default::default()
        };
        let v = serde_json::to_value(&pull).unwrap();
        assert_eq!(v["auth"], "filled");
        assert_eq!(v["result"], "unauthorized");
        assert_eq!(v["source_kind"], "provider");
        let answer = pb::CheckAccessResponse {
            decision: pb::Decision::MustAuthenticate as i32,
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&answer).unwrap()["decision"],
            "MUST_AUTHENTICATE"
        );
        let odd = pb::ReportRefusedResponse {
            outcome: 99,
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&odd).unwrap()["outcome"],
            "unspecified"
        );
    }
}
