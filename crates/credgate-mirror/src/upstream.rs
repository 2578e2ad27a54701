//! One read forwarded upstream with a credential: the registry's challenge answered (Basic, or
//! a bearer token from its realm, cached per scope and credential until it expires), the
//! consumer's own `Authorization` never sent, redirects followed without credentials to
//! another host (reqwest drops them), the answer streamed back as it arrives.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use reqwest::header::{HeaderMap, HeaderName, WWW_AUTHENTICATE};
use reqwest::StatusCode;
use secrecy::{ExposeSecret, SecretString};
use sha2::{Digest, Sha256};

use credgate_agent::guard::registry::{
    client, fetch_token, parse_challenge, RegistryError, RegistryOptions,
};

use crate::route::Route;

/// The consumer's request headers that go upstream; every other one (its `Authorization`,
/// cookies, hop-by-hop headers) stays here.
const FORWARDED: [&str; 7] = [
    "accept",
    "accept-encoding",
    "range",
    "if-range",
    "if-none-match",
    "if-modified-since",
    "user-agent",
];

/// A credential to read with.
pub struct Credential {
    pub username: String,
    pub password: SecretString,
}

/// How a registry asks for credentials, learnt from its first challenge.
#[derive(Clone)]
enum Scheme {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
    },
}

/// The upstream side: one HTTP client, the schemes registries asked for, their tokens.
pub struct Upstream {
    client: reqwest::Client,
    options: RegistryOptions,
    schemes: Mutex<HashMap<String, Scheme>>,
    tokens: Mutex<HashMap<[u8; 32], (SecretString, Instant)>>,
}

/// Tokens kept at most: a node reads a bounded set of repositories; past it the cache starts
/// again (a token costs one request to fetch).
const MAX_TOKENS: usize = 4096;

impl Upstream {
    pub fn new(options: RegistryOptions) -> Upstream {
        let client = client(|| {
            reqwest::Client::builder()
                .connect_timeout(options.timeout)
                // A large blob streams for as long as it takes; a stall does not.
                .read_timeout(Duration::from_secs(60))
                .redirect(reqwest::redirect::Policy::limited(5))
        });
        Upstream {
            client,
            options,
            schemes: Mutex::default(),
            tokens: Mutex::default(),
        }
    }

    fn url(&self, route: &Route) -> String {
        let base = self.options.base(&route.registry);
        match route.query.is_empty() {
            true => format!("{base}/v2/{}", route.path),
            false => format!("{base}/v2/{}?{}", route.path, route.query),
        }
    }

    /// The read, with `credential` (none: anonymous, as the registry lets it).
    pub async fn read(
        &self,
        method: &reqwest::Method,
        route: &Route,
        headers: &hyper::HeaderMap,
        credential: Option<&Credential>,
    ) -> Result<reqwest::Response, RegistryError> {
        let url = self.url(route);
        let known = self.schemes.lock().get(&route.registry).cloned();
        let scope = format!("repository:{}:pull", repository(route));
        // What the registry asked for before, answered at once; else anonymous first.
        let first = match (&known, credential) {
            (Some(Scheme::Basic), Some(c)) => Auth::Basic(c),
            (Some(Scheme::Bearer { realm, service }), c) => {
                match self.token(realm, service.as_deref(), &scope, c).await? {
                    Some(t) => Auth::Bearer(t),
                    None => Auth::None,
                }
            }
            _ => Auth::None,
        };
        let response = self.send(method, &url, headers, &first).await?;
        if response.status() != StatusCode::UNAUTHORIZED {
            return Ok(response);
        }
        // Challenged: learn how, answer once (a fresh token for the scope the challenge names).
        let (scheme, params) = parse_challenge(
            response
                .headers()
                .get(WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or(""),
        );
        let param = |k: &str| params.iter().find(|(p, _)| p == k).map(|(_, v)| v.clone());
        let learnt = match (scheme.as_str(), param("realm")) {
            ("basic", _) => Scheme::Basic,
            ("bearer", Some(realm)) => Scheme::Bearer {
                realm,
                service: param("service"),
            },
            _ => return Ok(response),
        };
        self.schemes
            .lock()
            .insert(route.registry.clone(), learnt.clone());
        let again = match (learnt, credential) {
            (Scheme::Basic, Some(c)) => Auth::Basic(c),
            (Scheme::Basic, None) => return Ok(response),
            (Scheme::Bearer { realm, service }, c) => {
                let scope = param("scope").unwrap_or(scope);
                self.forget_token(&realm, &scope, c);
                match self.token(&realm, service.as_deref(), &scope, c).await? {
                    Some(t) => Auth::Bearer(t),
                    None => return Ok(response),
                }
            }
        };
        if matches!((&first, &again), (Auth::Basic(_), Auth::Basic(_))) {
            return Ok(response);
        }
        drop(response);
        self.send(method, &url, headers, &again).await
    }

    async fn send(
        &self,
        method: &reqwest::Method,
        url: &str,
        headers: &hyper::HeaderMap,
        auth: &Auth<'_>,
    ) -> Result<reqwest::Response, RegistryError> {
        let mut out = HeaderMap::new();
        for name in FORWARDED {
            for value in headers.get_all(name) {
                out.append(HeaderName::from_static(name), value.clone());
            }
        }
        let req = self.client.request(method.clone(), url).headers(out);
        let req = match auth {
            Auth::None => req,
            Auth::Basic(c) => req.basic_auth(&c.username, Some(c.password.expose_secret())),
            Auth::Bearer(t) => req.bearer_auth(t.expose_secret()),
        };
        Ok(req.send().await?)
    }

    fn token_key(realm: &str, scope: &str, credential: Option<&Credential>) -> [u8; 32] {
        let mut h = Sha256::new();
        for part in [realm, scope] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        if let Some(c) = credential {
            h.update(c.username.as_bytes());
            h.update([0]);
            h.update(c.password.expose_secret().as_bytes());
        }
        h.finalize().into()
    }

    fn forget_token(&self, realm: &str, scope: &str, credential: Option<&Credential>) {
        self.tokens
            .lock()
            .remove(&Self::token_key(realm, scope, credential));
    }

    /// A bearer token for `scope` from `realm`, with `credential` (none: anonymous), cached
    /// until shortly before it expires; `None` when the realm refuses.
    async fn token(
        &self,
        realm: &str,
        service: Option<&str>,
        scope: &str,
        credential: Option<&Credential>,
    ) -> Result<Option<SecretString>, RegistryError> {
        let key = Self::token_key(realm, scope, credential);
        if let Some((token, until)) = self.tokens.lock().get(&key) {
            if Instant::now() < *until {
                return Ok(Some(token.clone()));
            }
        }
        let basic = credential.map(|c| (c.username.as_str(), c.password.expose_secret()));
        let Some(answer) = fetch_token(&self.client, realm, service, scope, basic).await? else {
            return Ok(None);
        };
        let token = answer.token;
        // The spec's default lifetime is 60 s; kept for nine tenths of what the realm says.
        let lifetime = Duration::from_secs(answer.expires_in.unwrap_or(60).min(86_400)) * 9 / 10;
        let token = SecretString::from(token);
        let mut tokens = self.tokens.lock();
        if tokens.len() >= MAX_TOKENS {
            tokens.clear();
        }
        tokens.insert(key, (token.clone(), Instant::now() + lifetime));
        Ok(Some(token))
    }
}

enum Auth<'a> {
    None,
    Basic(&'a Credential),
    Bearer(SecretString),
}

/// The repository part of the route's path (before `/manifests/`, `/blobs/`, ...).
fn repository(route: &Route) -> &str {
    route
        .image
        .split_once('/')
        .map_or(route.image.as_str(), |(_, r)| r)
}
