//! `Debug` for the messages that carry secrets: every field but the secret, which shows as
//! `<redacted>` (or `""` when empty, so a missing secret is still visible).

use std::fmt;

use crate::cri::AuthConfig;
use crate::v1::{Credential, SecretCredential, ServiceAccount};

fn secret(s: &str) -> &'static str {
    if s.is_empty() {
        "\"\""
    } else {
        "<redacted>"
    }
}

struct Raw(&'static str);

impl fmt::Debug for Raw {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credential")
            .field("source_kind", &self.source_kind)
            .field("source", &self.source)
            .field("pattern", &self.pattern)
            .field("username", &self.username)
            .field("password", &Raw(secret(&self.password)))
            .field("expires_at_unix_ms", &self.expires_at_unix_ms)
            .finish()
    }
}

impl fmt::Debug for ServiceAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceAccount")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("uid", &self.uid)
            .field("token", &Raw(secret(&self.token)))
            .field("annotations", &self.annotations)
            .finish()
    }
}

impl fmt::Debug for SecretCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretCredential")
            .field("secret", &self.secret)
            .field("username", &self.username)
            .field("password", &Raw(secret(&self.password)))
            .finish()
    }
}

impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthConfig")
            .field("username", &self.username)
            .field("password", &Raw(secret(&self.password)))
            .field("auth", &Raw(secret(&self.auth)))
            .field("server_address", &self.server_address)
            .field("identity_token", &Raw(secret(&self.identity_token)))
            .field("registry_token", &Raw(secret(&self.registry_token)))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use crate::cri::{AuthConfig, ImageSpec, PullImageRequest};
    use crate::v1::{Credential, LookupRequest, LookupResponse, ServiceAccount};

    #[test]
    fn cri_pull_requests_never_show_their_credential() {
        let request = PullImageRequest {
            image: Some(ImageSpec {
                image: "registry.example.com/team/app:v1".into(),
            }),
            auth: Some(AuthConfig {
                username: "alice".into(),
                password: "pw-secret-1".into(),
                auth: "YWxpY2U6cHctc2VjcmV0LTE=".into(),
                server_address: "registry.example.com".into(),
                identity_token: "id-secret-2".into(),
                registry_token: "reg-secret-3".into(),
            }),
            sandbox_config: None,
        };
        let shown = format!("{request:?} {request:#?} {:?}", request.auth);
        for secret in [
            "pw-secret-1",
            "YWxpY2U6cHctc2VjcmV0LTE=",
            "id-secret-2",
            "reg-secret-3",
        ] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("alice") && shown.contains("registry.example.com"));
        assert!(shown.contains("<redacted>"));
    }

    #[test]
    fn debug_never_shows_secrets() {
        let answer = LookupResponse {
            credentials: vec![Credential {
                username: "alice".into(),
                password: "hunter2-secret".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let shown = format!("{answer:?} {answer:#?}");
        assert!(!shown.contains("hunter2-secret"), "{shown}");
        assert!(shown.contains("alice") && shown.contains("<redacted>"));

        let request = LookupRequest {
            service_account: Some(ServiceAccount {
                namespace: "ns".into(),
                token: "sa-token-secret".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let shown = format!("{request:?}");
        assert!(
            !shown.contains("sa-token-secret") && shown.contains("ns"),
            "{shown}"
        );
    }
}
