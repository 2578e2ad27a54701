//! Verification against the registry: `HEAD` of the image's manifest with the OCI and Docker
//! manifest types, following the registry's `Basic` or `Bearer` challenge, once per candidate
//! credential in order. Bounded by a timeout per request; a registry that cannot be reached
//! stops the attempt (deny, nothing recorded).

use std::time::Duration;

use reqwest::header::{HeaderMap, ACCEPT, WWW_AUTHENTICATE};
use reqwest::StatusCode;
use secrecy::{ExposeSecret, SecretString};

use super::CredentialIn;

/// The manifest types a verifier accepts, as a pull does.
pub const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.v2+json, application/vnd.docker.distribution.manifest.list.v2+json";

/// How to reach registries.
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// Per request.
    pub timeout: Duration,
    /// Registries reached over plain HTTP (`host[:port]`); loopback hosts always are.
    pub insecure: Vec<String>,
}

impl RegistryOptions {
    /// `SCHEME://HOST` of `registry`: Docker Hub's API host for `docker.io`, plain HTTP for a
    /// loopback or `insecure` one.
    pub fn base(&self, registry: &str) -> String {
        let host = match registry {
            "docker.io" | "index.docker.io" => "registry-1.docker.io",
            other => other,
        };
        let plain = is_loopback(host) || self.insecure.iter().any(|h| h == host);
        format!("{}://{host}", if plain { "http" } else { "https" })
    }
}

/// An HTTP client for registries from `builder`, trusting the node's own roots (the system's
/// store, or `SSL_CERT_FILE`/`SSL_CERT_DIR`, as containerd does, so that a registry under a
/// private CA is reached) besides the built-in public ones. A store with no certificate that
/// parses is left out, never a reason not to start.
pub fn client(builder: impl Fn() -> reqwest::ClientBuilder) -> reqwest::Client {
    builder().build().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "the system's root certificates are left out");
        builder()
            .tls_built_in_native_certs(false)
            .build()
            .expect("a TLS client with built-in roots builds")
    })
}

impl Default for RegistryOptions {
    fn default() -> Self {
        RegistryOptions {
            timeout: Duration::from_secs(10),
            insecure: Vec::new(),
        }
    }
}

/// What to verify.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host[:port]` as in the image name (`docker.io` for Docker Hub).
    pub registry: String,
    pub repository: String,
    /// A tag or a digest.
    pub reference: String,
}

impl Target {
    /// The manifest an image reference names: its registry, repository and digest, else tag,
    /// else `latest`.
    pub fn of(image: &credgate_core::reference::ImageRef<'_>) -> Target {
        Target {
            registry: image.registry().to_owned(),
            repository: image.path().to_owned(),
            reference: image
                .digest()
                .or(image.tag())
                .unwrap_or("latest")
                .to_owned(),
        }
    }
}

/// Why a verification ended as it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyReason {
    /// A credential was accepted (and the digest, when one was expected, matched).
    Verified,
    Unauthorized,
    DigestMismatch,
    NotFound,
    /// The registry answered with another status.
    Refused,
    Unreachable,
    /// No credential that can be verified was given.
    NoCredentials,
}

impl VerifyReason {
    /// As the API and `credgate_guard_verifications_total{result}` name it.
    pub fn as_str(self) -> &'static str {
        match self {
            VerifyReason::Verified => "verified",
            VerifyReason::Unauthorized => "unauthorized",
            VerifyReason::DigestMismatch => "digest_mismatch",
            VerifyReason::NotFound => "not_found",
            VerifyReason::Refused => "refused",
            VerifyReason::Unreachable => "unreachable",
            VerifyReason::NoCredentials => "no_credentials",
        }
    }
}

/// The outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Index of the accepted credential.
    pub accepted: Option<usize>,
    pub reason: VerifyReason,
    pub message: String,
    pub digest: Option<String>,
}

enum Attempt {
    Ok(String),
    Unauthorized,
    NotFound,
    Refused(StatusCode),
    Unreachable(RegistryError),
}

/// Verifies credentials against registries.
#[derive(Clone)]
pub struct Verifier {
    client: reqwest::Client,
    options: RegistryOptions,
}

/// Whether `host` (`HOST[:PORT]`) is this machine: such registries are asked over plain HTTP.
fn is_loopback(host: &str) -> bool {
    let h = host
        .rsplit_once(':')
        .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
        .map_or(host, |(h, _)| h);
    let h = h.trim_start_matches('[').trim_end_matches(']');
    h == "localhost"
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// `Bearer realm="...",service="...",scope="..."` → scheme and parameters.
pub fn parse_challenge(header: &str) -> (String, Vec<(String, String)>) {
    let header = header.trim();
    let (scheme, rest) = header.split_once(' ').unwrap_or((header, ""));
    let mut params = Vec::new();
    let mut rest = rest.trim();
    while !rest.is_empty() {
        let Some((key, after)) = rest.split_once('=') else {
            break;
        };
        let key = key.trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (value, remaining) = if let Some(q) = after.strip_prefix('"') {
            let mut value = String::new();
            let mut chars = q.char_indices();
            let mut end = q.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, n)) = chars.next() {
                            value.push(n);
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    c => value.push(c),
                }
            }
            (value, &q[end.min(q.len())..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim().to_owned(), &after[end..])
        };
        params.push((key, value));
        rest = remaining.trim_start().trim_start_matches(',').trim_start();
    }
    (scheme.to_ascii_lowercase(), params)
}

impl Verifier {
    pub fn new(options: RegistryOptions) -> Self {
        let client = client(|| {
            reqwest::Client::builder()
                .timeout(options.timeout)
                .connect_timeout(options.timeout)
                .redirect(reqwest::redirect::Policy::limited(5))
        });
        Verifier { client, options }
    }

    /// The target's manifest.
    fn manifest_url(&self, target: &Target) -> String {
        format!(
            "{}/v2/{}/manifests/{}",
            self.base(&target.registry),
            target.repository,
            target.reference
        )
    }

    fn base(&self, registry: &str) -> String {
        self.options.base(registry)
    }

    /// Tries each credential in order; the first accepted (with the expected digest) wins. A
    /// node-wide credential stands for `node_wide` (the node's own credentials for the image,
    /// in try-order) and then anonymous access.
    pub async fn verify(
        &self,
        target: &Target,
        expected_digest: Option<&str>,
        credentials: &[CredentialIn],
        node_wide: &[(String, SecretString)],
    ) -> Verified {
        let url = self.manifest_url(target);
        let mut last: Option<Verified> = None;
        for (i, c) in credentials.iter().enumerate() {
            // Node-wide: the node's own credentials for the image, then anonymous access.
            let candidates: Vec<Option<(&str, &str)>> = match c {
                CredentialIn::Secret {
                    username, password, ..
                } => vec![Some((username.as_str(), password.expose_secret()))],
                CredentialIn::NodeWide => node_wide
                    .iter()
                    .map(|(u, p)| Some((u.as_str(), p.expose_secret())))
                    .chain(std::iter::once(None))
                    .collect(),
                CredentialIn::ServiceAccount(_) => continue,
            };
            for basic in candidates {
                let attempt = self.attempt(&url, target, basic).await.0;
                match step(attempt, i, target, expected_digest) {
                    Step::Accepted(v) | Step::Stop(v) => return v,
                    Step::Denied(v) => last = Some(v),
                }
            }
        }
        last.unwrap_or(Verified {
            accepted: None,
            reason: VerifyReason::NoCredentials,
            message: "no credential that can be verified against a registry was given".into(),
            digest: None,
        })
    }

    /// Whether the registry checked `username` and `password` and accepted them for the
    /// target: it challenged an anonymous `HEAD` of the manifest, and with the credential (as
    /// Basic, or through the challenge's token realm) the `HEAD` succeeded. A registry that
    /// lets the manifest be read anonymously checks nothing: `Ok(false)`. `Err` when it cannot
    /// be reached.
    pub async fn authenticates(
        &self,
        target: &Target,
        username: &str,
        password: &str,
    ) -> Result<bool, RegistryError> {
        let url = self.manifest_url(target);
        match self.attempt(&url, target, Some((username, password))).await {
            (Attempt::Ok(_), challenged) => Ok(challenged),
            (Attempt::Unreachable(why), _) => Err(why),
            _ => Ok(false),
        }
    }

    /// What the registry's auth endpoint says of the credential itself, whatever it lets the
    /// credential read (decision 0019): the challenge of an anonymous `GET /v2/` says where to
    /// ask; `Basic`: `GET /v2/` with it; `Bearer`: the token realm with the credential, for the
    /// repository's pull scope and, when that is refused, for no scope (as `docker login`
    /// asks). [`CredentialCheck::Refused`] only when the endpoint refused it (401 or 403) both
    /// ways. A registry that does not challenge, or answers anything else:
    /// [`CredentialCheck::Unchecked`]. `Err` when it cannot be reached or answers malformed.
    pub async fn check_credential(
        &self,
        registry: &str,
        repository: &str,
        username: &str,
        password: &str,
    ) -> Result<CredentialCheck, RegistryError> {
        let v2 = format!("{}/v2/", self.base(registry));
        let first = self.client.get(&v2).send().await?;
        if first.status() != StatusCode::UNAUTHORIZED {
            return Ok(CredentialCheck::Unchecked);
        }
        let (scheme, params) = challenge_of(&first);
        drop(first);
        let status = match scheme.as_str() {
            "basic" => {
                let req = self.client.get(&v2).basic_auth(username, Some(password));
                req.send().await?.status()
            }
            "bearer" => {
                let scope = format!("repository:{repository}:pull");
                let scoped = self
                    .realm_status(&params, Some(&scope), username, password)
                    .await?;
                match scoped {
                    Some(s) if refused_status(s) => self
                        .realm_status(&params, None, username, password)
                        .await?
                        .unwrap_or(s),
                    Some(s) => s,
                    None => return Ok(CredentialCheck::Unchecked),
                }
            }
            _ => return Ok(CredentialCheck::Unchecked),
        };
        Ok(if status.is_success() {
            CredentialCheck::Accepted
        } else if refused_status(status) {
            CredentialCheck::Refused
        } else {
            CredentialCheck::Unchecked
        })
    }

    /// The status of the challenge's token realm asked with the credential, for `scope` (or
    /// none); `None` when the challenge names no realm.
    async fn realm_status(
        &self,
        params: &[(String, String)],
        scope: Option<&str>,
        username: &str,
        password: &str,
    ) -> Result<Option<StatusCode>, RegistryError> {
        let get = |k: &str| param(params, k);
        let Some(realm) = get("realm") else {
            return Ok(None);
        };
        let mut query: Vec<(&str, &str)> = Vec::new();
        if let Some(scope) = scope {
            query.push(("scope", scope));
        } else {
            query.push(("account", username));
        }
        if let Some(service) = get("service") {
            query.push(("service", service));
        }
        let response = self
            .client
            .get(realm)
            .query(&query)
            .basic_auth(username, Some(password))
            .send()
            .await?;
        let status = response.status();
        // Read (bounded) so that the connection can be reused; the token is not needed.
        if status.is_success() {
            capped_body(response, MAX_TOKEN_BODY).await?;
        }
        Ok(Some(status))
    }

    /// One `HEAD` of the manifest, answering the registry's challenge with `basic` when it
    /// challenges; whether it did.
    async fn attempt(
        &self,
        url: &str,
        target: &Target,
        basic: Option<(&str, &str)>,
    ) -> (Attempt, bool) {
        let mut challenged = false;
        let attempt = self
            .attempt_inner(url, target, basic, &mut challenged)
            .await;
        (attempt, challenged)
    }

    async fn attempt_inner(
        &self,
        url: &str,
        target: &Target,
        basic: Option<(&str, &str)>,
        challenged: &mut bool,
    ) -> Attempt {
        // reqwest's own helpers mark the Authorization header sensitive (kept out of its
        // Debug output and HPACK tables).
        let head = |auth: Auth<'_>| {
            let req = self.client.head(url).header(ACCEPT, MANIFEST_ACCEPT);
            match auth {
                Auth::Anonymous => req,
                Auth::Basic(u, p) => req.basic_auth(u, Some(p)),
                Auth::Bearer(token) => req.bearer_auth(token),
            }
            .send()
        };
        let first = match head(Auth::Anonymous).await {
            Ok(r) => r,
            Err(e) => return Attempt::Unreachable(RegistryError::from(e)),
        };
        let response = if first.status() == StatusCode::UNAUTHORIZED {
            *challenged = true;
            let (scheme, params) = challenge_of(&first);
            let auth = match scheme.as_str() {
                "basic" => match basic {
                    Some((u, p)) => Auth::Basic(u, p),
                    None => return Attempt::Unauthorized,
                },
                "bearer" => match self.token(&params, target, basic).await {
                    Ok(Some(token)) => Auth::Bearer(token),
                    Ok(None) => return Attempt::Unauthorized,
                    Err(why) => return Attempt::Unreachable(why),
                },
                _ => return Attempt::Unauthorized,
            };
            match head(auth).await {
                Ok(r) => r,
                Err(e) => return Attempt::Unreachable(RegistryError::from(e)),
            }
        } else {
            first
        };
        match response.status() {
            s if s.is_success() => match digest(response.headers()) {
                Some(d) => Attempt::Ok(d),
                None => Attempt::Refused(s),
            },
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => Attempt::Unauthorized,
            StatusCode::NOT_FOUND => Attempt::NotFound,
            s => Attempt::Refused(s),
        }
    }

    /// A bearer token from the challenge's realm; `None` when the realm refuses.
    async fn token(
        &self,
        params: &[(String, String)],
        target: &Target,
        basic: Option<(&str, &str)>,
    ) -> Result<Option<String>, RegistryError> {
        let get = |k: &str| param(params, k);
        let Some(realm) = get("realm") else {
            return Ok(None);
        };
        let scope = get("scope")
            .map(str::to_owned)
            .unwrap_or_else(|| format!("repository:{}:pull", target.repository));
        Ok(
            fetch_token(&self.client, realm, get("service"), &scope, basic)
                .await?
                .map(|t| t.token),
        )
    }
}

/// A registry's bearer token and the lifetime its realm gave it (`expires_in`, seconds).
pub struct BearerToken {
    pub token: String,
    pub expires_in: Option<u64>,
}

/// A bearer token for `scope` from the challenge's `realm` (and `service`), asked with `basic`
/// (none: anonymously); `None` when the realm refuses or answers no token. The answer is read
/// within [`MAX_TOKEN_BODY`].
pub async fn fetch_token(
    client: &reqwest::Client,
    realm: &str,
    service: Option<&str>,
    scope: &str,
    basic: Option<(&str, &str)>,
) -> Result<Option<BearerToken>, RegistryError> {
    let mut query: Vec<(&str, &str)> = vec![("scope", scope)];
    if let Some(service) = service {
        query.push(("service", service));
    }
    let mut req = client.get(realm).query(&query);
    if let Some((u, p)) = basic {
        req = req.basic_auth(u, Some(p));
    }
    let response = req.send().await?;
    if !response.status().is_success() {
        return Ok(None);
    }
    #[derive(serde::Deserialize)]
    struct Answer {
        token: Option<String>,
        access_token: Option<String>,
        expires_in: Option<u64>,
    }
    let bytes = capped_body(response, MAX_TOKEN_BODY).await?;
    let body: Answer = serde_json::from_slice(&bytes).map_err(|_| RegistryError::MalformedToken)?;
    Ok(body.token.or(body.access_token).map(|token| BearerToken {
        token,
        expires_in: body.expires_in,
    }))
}

/// What a registry's auth endpoint said of a credential itself ([`Verifier::check_credential`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialCheck {
    /// It took the credential (whatever the credential may read).
    Accepted,
    /// It refused the credential (401 or 403, with the repository's scope and without).
    Refused,
    /// It does not check credentials, or answered something that says neither.
    Unchecked,
}

/// The scheme and parameters of a response's `WWW-Authenticate` challenge.
fn challenge_of(response: &reqwest::Response) -> (String, Vec<(String, String)>) {
    parse_challenge(
        response
            .headers()
            .get(WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(""),
    )
}

/// A challenge's parameter `key`.
fn param<'a>(params: &'a [(String, String)], key: &str) -> Option<&'a str> {
    params
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// 401 or 403.
fn refused_status(s: StatusCode) -> bool {
    s == StatusCode::UNAUTHORIZED || s == StatusCode::FORBIDDEN
}

/// The most of a token endpoint's answer the agent reads: the registry's host comes from an
/// image name a tenant chooses, so its answers are hostile until proven otherwise. Response
/// heads are bounded by the HTTP client (100 headers, a 400 KiB head); manifests are only
/// asked for with `HEAD`, which has no body.
pub const MAX_TOKEN_BODY: usize = 64 << 10;

/// A response body read in chunks, refused as soon as it passes `max` bytes.
async fn capped_body(
    mut response: reqwest::Response,
    max: usize,
) -> Result<Vec<u8>, RegistryError> {
    if response.content_length().is_some_and(|n| n > max as u64) {
        return Err(RegistryError::TokenTooLarge(max));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > max {
            return Err(RegistryError::TokenTooLarge(max));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// How a manifest request authenticates.
enum Auth<'a> {
    Anonymous,
    Basic(&'a str, &'a str),
    Bearer(String),
}

fn digest(headers: &HeaderMap) -> Option<String> {
    headers
        .get("docker-content-digest")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// A transport error without its URL's query (which could carry a scope) or any header.
pub fn describe(e: &reqwest::Error) -> String {
    RegistryError::from(e).to_string()
}

/// Why a registry gave nothing to go on, in the agent's words. It holds no source: a request
/// error's text names the URL, whose host and token realm a tenant's image name or a hostile
/// registry chose, and errors reach logs and gRPC statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("timed out")]
    Timeout,
    #[error("connection failed")]
    Connect,
    /// The registry's TLS certificate was refused (no root the node trusts signs it, or it
    /// does not name the host).
    #[error("certificate not trusted")]
    Certificate,
    #[error("too many redirects")]
    Redirects,
    #[error("request failed")]
    Request,
    #[error("malformed token response")]
    MalformedToken,
    #[error("token response larger than {} KiB", .0 >> 10)]
    TokenTooLarge(usize),
}

impl From<&reqwest::Error> for RegistryError {
    fn from(e: &reqwest::Error) -> RegistryError {
        if e.is_timeout() {
            RegistryError::Timeout
        } else if e.is_connect() && refused_certificate(e) {
            RegistryError::Certificate
        } else if e.is_connect() {
            RegistryError::Connect
        } else if e.is_redirect() {
            RegistryError::Redirects
        } else if e.is_decode() {
            RegistryError::MalformedToken
        } else {
            RegistryError::Request
        }
    }
}

/// Whether rustls refused the peer's certificate somewhere in `e`'s sources (an
/// `io::Error`'s own `source` skips the error it wraps: that one is looked at too).
fn refused_certificate(e: &reqwest::Error) -> bool {
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(cause) = next {
        if let Some(rustls::Error::InvalidCertificate(_)) = cause.downcast_ref() {
            return true;
        }
        next = match cause.downcast_ref::<std::io::Error>() {
            Some(io) => io.get_ref().map(|inner| inner as _),
            None => cause.source(),
        };
    }
    false
}

impl From<reqwest::Error> for RegistryError {
    fn from(e: reqwest::Error) -> RegistryError {
        RegistryError::from(&e)
    }
}

/// What one attempt means for a verification.
enum Step {
    /// A credential was accepted: the verification ends.
    Accepted(Verified),
    /// Refused: the denial stands unless a later attempt is accepted.
    Denied(Verified),
    /// The registry cannot be reached: no later attempt will do better.
    Stop(Verified),
}

/// The step of `attempt`, made with credential `i`.
fn step(attempt: Attempt, i: usize, target: &Target, expected_digest: Option<&str>) -> Step {
    let deny = |reason, message: String| Verified {
        accepted: None,
        reason,
        message,
        digest: None,
    };
    match attempt {
        Attempt::Ok(digest) => {
            if let Some(want) = expected_digest.filter(|w| !w.is_empty()) {
                if want != digest {
                    return Step::Denied(Verified {
                        digest: Some(digest.clone()),
                        ..deny(
                            VerifyReason::DigestMismatch,
                            format!("the registry serves {digest} for this reference, not {want}"),
                        )
                    });
                }
            }
            Step::Accepted(Verified {
                accepted: Some(i),
                reason: VerifyReason::Verified,
                message: format!("credential {i} accepted by {}", target.registry),
                digest: Some(digest),
            })
        }
        Attempt::Unauthorized => Step::Denied(deny(
            VerifyReason::Unauthorized,
            format!("{} refused the credentials", target.registry),
        )),
        Attempt::NotFound => Step::Denied(deny(
            VerifyReason::NotFound,
            format!(
                "{} has no manifest {}:{} for these credentials",
                target.registry, target.repository, target.reference
            ),
        )),
        Attempt::Refused(status) => Step::Denied(deny(
            VerifyReason::Refused,
            format!("{} answered {status}", target.registry),
        )),
        Attempt::Unreachable(why) => Step::Stop(deny(
            VerifyReason::Unreachable,
            format!("cannot reach {}: {why}", target.registry),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_parse() {
        let (s, p) = parse_challenge(
            r#"Bearer realm="http://127.0.0.1:5001/token",service="registry,test",scope="repository:team-a/app:pull""#,
        );
        assert_eq!(s, "bearer");
        assert_eq!(
            p,
            [
                ("realm".into(), "http://127.0.0.1:5001/token".into()),
                ("service".into(), "registry,test".into()),
                ("scope".into(), "repository:team-a/app:pull".into()),
            ]
        );
        let (s, p) = parse_challenge(r#"Basic realm="credgate-test""#);
        assert_eq!((s.as_str(), p.len()), ("basic", 1));
        let (s, p) = parse_challenge("Basic");
        assert_eq!((s.as_str(), p.len()), ("basic", 0));
    }

    /// A "registry" on loopback whose token endpoint streams without end: verification stops
    /// reading at the cap and reports it, instead of buffering what the stream sends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_token_endpoint_that_streams_for_ever_is_cut_at_the_cap() {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = sent.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().take(4) {
                let Ok(mut conn) = conn else { return };
                let counter = counter.clone();
                std::thread::spawn(move || {
                    let mut line = String::new();
                    let mut reader = BufReader::new(conn.try_clone().unwrap());
                    reader.read_line(&mut line).unwrap();
                    loop {
                        let mut h = String::new();
                        if reader.read_line(&mut h).unwrap() <= 2 {
                            break;
                        }
                    }
                    if line.starts_with("HEAD") {
                        let _ = write!(conn, "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"http://127.0.0.1:{port}/token\",service=\"t\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                        return;
                    }
                    let _ = write!(
                        conn,
                        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    );
                    let chunk = format!("{:x}\r\n{}\r\n", 16384, "a".repeat(16384));
                    // Bounded for the test's sake: 64 MiB, far past the cap.
                    for _ in 0..4096 {
                        if conn.write_all(chunk.as_bytes()).is_err() {
                            return;
                        }
                        counter.fetch_add(16384, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        });
        let v = Verifier::new(RegistryOptions::default());
        let target = Target {
            registry: format!("127.0.0.1:{port}"),
            repository: "team/app".into(),
            reference: "v1".into(),
        };
        let creds = [CredentialIn::Secret {
            coords: credgate_core::guard::Coords {
                namespace: "ns".into(),
                name: "s".into(),
                uid: String::new(),
            },
            username: "u".into(),
            password: SecretString::from("p"),
        }];
        let got = v.verify(&target, None, &creds, &[]).await;
        assert_eq!(got.reason, VerifyReason::Unreachable, "{got:?}");
        assert!(
            got.message.contains("larger than 64 KiB"),
            "{}",
            got.message
        );
        assert!(
            sent.load(std::sync::atomic::Ordering::Relaxed) < 32 << 20,
            "the agent stopped reading long before the stream's end"
        );
    }

    #[test]
    fn loopback_registries_use_plain_http() {
        let v = Verifier::new(RegistryOptions {
            insecure: vec!["mirror.internal:5000".into()],
            ..Default::default()
        });
        assert_eq!(v.base("127.0.0.1:5000"), "http://127.0.0.1:5000");
        assert_eq!(v.base("localhost:5000"), "http://localhost:5000");
        assert_eq!(v.base("[::1]:5000"), "http://[::1]:5000");
        assert_eq!(
            v.base("mirror.internal:5000"),
            "http://mirror.internal:5000"
        );
        assert_eq!(v.base("quay.io"), "https://quay.io");
        assert_eq!(v.base("docker.io"), "https://registry-1.docker.io");
    }
}
