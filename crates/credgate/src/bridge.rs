//! `credgate-credential-provider`: a kubelet credential provider plugin answered by the agent.
//!
//! The kubelet executes it in a provider's place (`<bin-dir>/<provider name>`, with
//! `--provider NAME` in the entry's `args`, or the provider's name as the file name of a link
//! to it), writes one `CredentialProviderRequest` on stdin and reads the response on stdout,
//! in the request's version. The bridge asks the agent for that provider's credentials for the
//! image, with the service account the token's claims name (KEP-4412), and answers with every
//! credential keyed by the pattern it matched, the provider's `cacheKeyType`, and a
//! `cacheDuration` that ends the agent's renewal lead before the earliest expiry, and never
//! later than `--max-cache-duration` (5 minutes): a rotated or refused credential leaves the
//! kubelet's cache within it.
//!
//! Nothing matches: an empty `auth`, exit 0. The agent unreachable or the provider failed: one
//! line on stderr, exit 1; with `--fallback-in-process CONFIG --image-credential-provider-bin-dir
//! DIR` the bridge runs the provider itself with the same engine instead, so a node keeps
//! pulling while the agent restarts or refuses it (a full connection budget, an unavailable
//! answer). A secret never reaches stderr.

use std::io::{Read, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use cli::{Args, NAME};
use credgate_api::unary::{self, CallError};
use credgate_api::v1::{self as pb};
use credgate_core::wire::bridge::{self, AuthEntry, KubeletRequest};
use credgate_core::wire::CacheKeyType;
use secrecy::ExposeSecret;
use zeroize::Zeroizing;

use credgate_api::methods::LOOKUP;

#[path = "bridge_cli.rs"]
mod cli;
/// Longer than a plugin's default timeout (1 minute): a miss runs one. The kubelet's own
/// deadline for a plugin is also one minute, so it gives up first.
const TIMEOUT: Duration = Duration::from_secs(90);

/// The bridge's mark ([`bridge::BRIDGE_MARK`] whole), kept in the binary so that the agent can
/// tell the bridge from a plugin and refuse to run it as one.
#[used]
static MARK: [u8; 48] = *b"credgate-kubelet-bridge:executable-mark:2f9c41e7";

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(answer) => {
            let mut out = std::io::stdout().lock();
            if out.write_all(&answer).and_then(|()| out.flush()).is_err() {
                return ExitCode::from(1);
            }
            ExitCode::SUCCESS
        }
        Err(why) => {
            eprintln!("{NAME}: {why}");
            ExitCode::from(1)
        }
    }
}

/// The provider this process stands for.
fn provider(args: &Args) -> Result<String, String> {
    if let Some(p) = args.provider.as_ref().filter(|p| !p.is_empty()) {
        return Ok(p.clone());
    }
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let file = Path::new(&argv0)
        .file_name()
        .and_then(|f| f.to_str())
        .unwrap_or_default()
        .to_owned();
    if file.is_empty() || file == NAME {
        return Err("no provider: pass --provider NAME in the kubelet config entry's args, or run this program through a link named after the provider".into());
    }
    Ok(file)
}

fn run(args: &Args) -> Result<Zeroizing<Vec<u8>>, String> {
    let provider = if args.captured_only {
        String::new()
    } else {
        provider(args)?
    };
    let mut input = Zeroizing::new(Vec::new());
    std::io::stdin()
        .take(bridge::MAX_REQUEST as u64 + 1)
        .read_to_end(&mut input)
        .map_err(|e| format!("cannot read the request: {e}"))?;
    let request = bridge::decode_request(&input).map_err(|e| e.to_string())?;
    let (who, service_account) = service_account(&request)?;
    let lookup = pb::LookupRequest {
        image: request.image.clone(),
        service_account,
        provider: provider.clone(),
        caller: "kubelet".into(),
        include_captured: args.captured,
        captured_only: args.captured_only,
        ..Default::default()
    };
    let socket = credgate_api::socket_path(args.socket.as_deref());
    let answer = match unary::call::<_, pb::LookupResponse>(&socket, LOOKUP, &lookup, TIMEOUT) {
        Ok(answer) => answer,
        // The agent away, or there but refusing the connection (every slot taken: it closes
        // it at once) or the call (UNAVAILABLE, RESOURCE_EXHAUSTED): the fallback answers.
        Err(
            e @ (CallError::Connect(_)
            | CallError::Untrusted(_)
            | CallError::Io(_)
            | CallError::Protocol(_)
            | CallError::Status { code: 8 | 14, .. }),
        ) => return fall_back(args, &provider, &request, who, &socket, e),
        Err(CallError::Deadline(limit)) => {
            return Err(format!(
                "the agent at {} did not answer within {limit:?}",
                socket.display()
            ))
        }
        Err(CallError::Status { message, .. }) => return Err(format!("lookup failed: {message}")),
    };
    respond(&request, &answer, args.max_cache_duration)
}

/// The account a request's token names, as the identity the fallback keys its cache by and as
/// the API's `ServiceAccount`. The kubelet sends no other identity than the token: its claims
/// name the account.
fn service_account(
    request: &KubeletRequest,
) -> Result<(Option<bridge::TokenSubject>, Option<pb::ServiceAccount>), String> {
    let Some(token) = request.service_account_token.as_ref() else {
        return Ok((None, None));
    };
    let who = bridge::token_subject(token)
        .ok_or("the service account token names no namespace and name in its claims")?;
    let account = pb::ServiceAccount {
        namespace: who.namespace.clone(),
        name: who.name.clone(),
        uid: who.uid.clone(),
        token: token.expose_secret().to_owned(),
        annotations: request
            .service_account_annotations
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    };
    Ok((Some(who), Some(account)))
}

/// The agent could not take the call: the in-process fallback answers when it is configured,
/// else the error says whether the agent was unreachable or refused.
fn fall_back(
    args: &Args,
    provider: &str,
    request: &KubeletRequest,
    who: Option<bridge::TokenSubject>,
    socket: &Path,
    e: CallError,
) -> Result<Zeroizing<Vec<u8>>, String> {
    match (
        &args.fallback_in_process,
        &args.image_credential_provider_bin_dir,
    ) {
        (Some(config), Some(dir)) => {
            fallback::answer(config, dir, provider, request, who, args.max_cache_duration)
        }
        _ if matches!(e, CallError::Connect(_) | CallError::Untrusted(_)) => Err(format!(
            "cannot reach the agent at {}: {e}",
            socket.display()
        )),
        _ => Err(format!(
            "the agent at {} refused the call: {e}",
            socket.display()
        )),
    }
}

/// The agent's answer as the kubelet's response; a provider failure with nothing to serve is
/// an error, as the plugin's own failure would be.
fn respond(
    request: &KubeletRequest,
    answer: &pb::LookupResponse,
    max_cache: Duration,
) -> Result<Zeroizing<Vec<u8>>, String> {
    let auth: Vec<AuthEntry<'_>> = answer
        .credentials
        .iter()
        .map(|c| AuthEntry {
            pattern: &c.pattern,
            username: &c.username,
            password: &c.password,
        })
        .collect();
    // A pod's captured credential is its repository's alone: an answer that holds one is kept
    // for this image only. Under the provider's Registry or Global key the kubelet's cache (and
    // nydus-snapshotter's, which is the kubelet's) would hand it to other images of the
    // registry whose paths its key prefixes (`app-evil`, `app/sub`, `application`).
    let captured = answer
        .credentials
        .iter()
        .any(|c| c.source_kind == pb::SourceKind::Captured as i32);
    let key_type = if captured {
        CacheKeyType::Image
    } else {
        match pb::CacheKeyType::try_from(answer.cache_key_type) {
            Ok(pb::CacheKeyType::Registry) => CacheKeyType::Registry,
            Ok(pb::CacheKeyType::Global) => CacheKeyType::Global,
            _ => CacheKeyType::Image,
        }
    };
    kubelet_response(
        request,
        answer.failures.first().map(|f| f.message.clone()),
        &auth,
        key_type,
        Duration::from_millis(answer.cache_for_ms.max(0).unsigned_abs()).min(max_cache),
    )
}

/// The kubelet's response with `auth` (a provider's failure instead, when it gave nothing).
fn kubelet_response(
    request: &KubeletRequest,
    failure: Option<String>,
    auth: &[AuthEntry<'_>],
    key_type: CacheKeyType,
    cache_for: Duration,
) -> Result<Zeroizing<Vec<u8>>, String> {
    if let (true, Some(failure)) = (auth.is_empty(), failure) {
        return Err(failure);
    }
    Ok(Zeroizing::new(bridge::encode_response(
        request.api_version,
        key_type,
        cache_for,
        auth,
    )))
}

/// The provider run in this process, with the same engine, when the agent is away.
mod fallback {
    use std::path::Path;
    use std::time::Duration;

    use credgate_core::renewal::RenewalPolicy;
    use credgate_core::wire::bridge::{self, AuthEntry, KubeletRequest};
    use credgate_core::wire::CacheKeyType;
    use credgate_engine::{LookupRequest, ServiceAccount, Sources};
    use secrecy::{ExposeSecret, SecretString};
    use zeroize::Zeroizing;

    use super::kubelet_response;

    pub fn answer(
        config: &Path,
        dir: &Path,
        provider: &str,
        request: &KubeletRequest,
        who: Option<bridge::TokenSubject>,
        max_cache: Duration,
    ) -> Result<Zeroizing<Vec<u8>>, String> {
        let sources = Sources {
            provider_config: Some(config.to_owned()),
            bin_dir: Some(dir.to_owned()),
            ..Default::default()
        };
        let engine = sources.build(None, None).map_err(|e| {
            format!(
                "the agent is unreachable and the fallback config failed: {}",
                credgate_core::text::error_chain(&e)
            )
        })?;
        if !engine.has_provider(provider) {
            return Err(format!("no provider {provider:?} in {}", config.display()));
        }
        let sa = who
            .zip(request.service_account_token.as_ref())
            .map(|(who, token)| ServiceAccount {
                namespace: who.namespace,
                name: who.name,
                uid: who.uid,
                token: SecretString::from(token.expose_secret().to_owned()),
                annotations: request.service_account_annotations.clone(),
            });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start: {e}"))?;
        let lookup = runtime
            .block_on(engine.lookup(&LookupRequest {
                image: &request.image,
                service_account: sa.as_ref(),
                provider: Some(provider),
                ..Default::default()
            }))
            .map_err(|e| e.to_string())?;
        // The engine's answer as the kubelet's response, as the agent would give it (the
        // agent is not linked into the bridge: it stays as small as a plugin).
        let auth: Vec<AuthEntry<'_>> = lookup
            .credentials
            .iter()
            .map(|c| AuthEntry {
                pattern: &c.pattern,
                username: &c.username,
                password: c.password.expose_secret(),
            })
            .collect();
        kubelet_response(
            request,
            lookup.errors.first().map(ToString::to_string),
            &auth,
            lookup
                .entries
                .first()
                .map_or(CacheKeyType::Image, |e| e.key.kind()),
            RenewalPolicy::default()
                .client_cache_for(
                    std::time::Instant::now(),
                    lookup.entries.iter().map(|e| e.times()),
                )
                .min(max_cache),
        )
    }
}
