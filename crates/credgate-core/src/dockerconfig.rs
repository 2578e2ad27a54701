//! Node-wide docker `config.json` files (the `auths` map that `docker login` writes), a static
//! credential source read before the plugins.

use base64::Engine as _;
use secrecy::SecretString;
use serde::Deserialize;
use std::collections::BTreeMap;

use crate::wire::AuthConfig;

/// Why a docker config file was refused. Never carries credential content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DockerConfigError {
    #[error("not a docker config.json (line {line}, column {column})")]
    Malformed { line: usize, column: usize },
    #[error("auths[{key:?}].auth must be base64(username:password)")]
    InvalidAuth { key: String },
}

#[derive(Deserialize)]
struct RawFile {
    #[serde(default)]
    auths: BTreeMap<String, RawEntry>,
}

#[derive(Deserialize)]
struct RawEntry {
    #[serde(default)]
    auth: String,
    #[serde(default)]
    username: String,
    #[serde(default)]
    password: String,
}

/// Reads the `auths` of a docker config file; other sections (`credHelpers`, `credsStore`) are
/// ignored.
pub fn parse(bytes: &[u8]) -> Result<Vec<(String, AuthConfig)>, DockerConfigError> {
    let raw: RawFile = serde_json::from_slice(bytes).map_err(|e| DockerConfigError::Malformed {
        line: e.line(),
        column: e.column(),
    })?;
    raw.auths
        .into_iter()
        .map(|(key, entry)| {
            let (username, password) = if entry.auth.is_empty() {
                (entry.username, SecretString::from(entry.password))
            } else {
                decode_auth(&entry.auth)
                    .ok_or_else(|| DockerConfigError::InvalidAuth { key: key.clone() })?
            };
            Ok((key, AuthConfig { username, password }))
        })
        .collect()
}

/// `base64(username:password)`, as docker config files, containerd's config and CRI
/// `AuthConfig.auth` hold it (surrounding whitespace ignored). The decoded bytes are wiped.
pub fn decode_auth(auth: &str) -> Option<(String, SecretString)> {
    use secrecy::zeroize::Zeroizing;
    let bytes = Zeroizing::new(
        base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .ok()?,
    );
    let text = std::str::from_utf8(&bytes).ok()?;
    let (user, pass) = text.split_once(':')?;
    Some((user.to_owned(), SecretString::from(pass.to_owned())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::ExposeSecret;

    #[test]
    fn reads_auth_and_plain_fields() {
        let json = r#"{"auths":{
            "https://index.docker.io/v1/":{"auth":"dXNlcjpwYTpzcw=="},
            "reg.io":{"username":"bob","password":"pw"}},
            "credHelpers":{"x.io":"ecr"}}"#;
        let got = parse(json.as_bytes()).unwrap();
        assert_eq!(got[0].0, "https://index.docker.io/v1/");
        assert_eq!(got[0].1.username, "user");
        assert_eq!(got[0].1.password.expose_secret(), "pa:ss");
        assert_eq!(got[1].1.username, "bob");
        assert_eq!(got[1].1.password.expose_secret(), "pw");
        assert!(parse(b"{}").unwrap().is_empty());
    }

    #[test]
    fn bad_files_name_no_secret() {
        let err = parse(br#"{"auths":{"reg.io":{"auth":"bm9jb2xvbg=="}}}"#).unwrap_err();
        assert_eq!(
            err,
            DockerConfigError::InvalidAuth {
                key: "reg.io".into()
            }
        );
        let err = parse(br#"{"auths":{"reg.io":{"auth":"!!!"}}}"#).unwrap_err();
        assert!(matches!(err, DockerConfigError::InvalidAuth { .. }));
        let err = parse(br#"{"auths":{"reg.io":{"password":12345678}}}"#).unwrap_err();
        assert!(!err.to_string().contains("12345678"));
        assert!(matches!(
            parse(b"garbage"),
            Err(DockerConfigError::Malformed { .. })
        ));
    }
}
