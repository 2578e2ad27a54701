//! The credential a pull carries to the runtime, as the operator's policy has it: filled from
//! the agent's sources when the kubelet sent none, replaced by a fresher one, scoped to the
//! registries it was given for ([`super::policy`] decides, this module does the IO).

use credgate_api::cri as wire;
use hyper::body::Bytes;
use secrecy::ExposeSecret as _;

use super::policy;
use super::pull_request::Pull;
use super::runtime::{framed, grpc_message};

/// A pull that carries a credential its registry refused, from a provider of the agent (the
/// kubelet keeps what the bridge gave it for the `cacheDuration` it got): the same request
/// with that provider's answer of now instead (its plugin runs when its refused answer was
/// dropped), as a gRPC frame. `None`, and the request goes as it came, for any other pull, or
/// when the provider has no other credential for the image.
pub(super) async fn refreshed(
    ctx: &super::Context,
    pull: &mut Pull,
    frame: &[u8],
) -> Option<Bytes> {
    let sent = pull.credential.as_ref()?;
    let now = ctx.clock.now();
    let credgate_agent::refusal::Given::Provider(provider) =
        ctx.refusal
            .memory()
            .known(&sent.username, sent.password.expose_secret(), now)?
    else {
        return None;
    };
    let lookup = ctx
        .engine()
        .lookup(&credgate_engine::LookupRequest {
            image: &pull.image,
            provider: Some(&provider),
            ..Default::default()
        })
        .await
        .ok()?;
    let fresh = lookup.credentials.into_iter().find(|c| {
        !(c.username == sent.username
            && c.password.expose_secret() == sent.password.expose_secret())
    })?;
    let replaced = wire::with_pull_auth(
        grpc_message(frame)?,
        &wire::AuthConfig {
            username: fresh.username.clone(),
            password: fresh.password.expose_secret().to_owned(),
            server_address: pull.server_address.clone(),
            ..Default::default()
        },
    )?;
    let frame = framed(&replaced)?;
    tracing::info!(image = %pull.image, provider = %provider, "a pull carried a credential the registry refused: provider {provider}'s answer of now is sent instead");
    if let Some(c) = pull.credential.as_mut() {
        c.username = fresh.username;
        c.password = fresh.password;
    }
    pull.replaced = Some(provider);
    Some(frame)
}

/// The operator's policy ([`policy`]) applied to a pull: one that came without a credential,
/// for an image a fill pattern names, gets the first credential the agent's sources give for
/// it (never a service-account-keyed provider's, never a captured pod credential); the
/// credential's `server_address` is scoped. `None`, and the request goes as it is, when the
/// policy changes nothing.
pub(super) async fn apply_policy(
    ctx: &super::Context,
    pull: &mut Pull,
    frame: &[u8],
) -> Option<Bytes> {
    use prost::Message as _;
    let policy = &ctx.policy;
    if policy.is_off() || pull.other_registry {
        // A credential named for another registry is not the image's: the runtime does not
        // use it, and the policy does not make it usable.
        return None;
    }
    let parsed = credgate_core::reference::ImageRef::parse(&pull.image).ok()?;
    // Decoded from the frame as it is now: a refused credential may have been replaced.
    let message = grpc_message(frame)?;
    let sent = wire::PullImageRequest::decode(message).ok()?.auth;
    let mut auth = match (&pull.credential, sent) {
        (Some(_), Some(auth)) => auth,
        (Some(_), None) => return None,
        // The caller sent something that does not decode (a malformed `auth`): it is the
        // caller's, and the runtime answers it as it is; never the node's instead.
        (None, _) if pull.sent_auth() => return None,
        (None, _) => {
            let pattern = policy.fill_pattern(parsed.name())?;
            let Some((source, credential)) = fill(ctx, &pull.image).await else {
                tracing::info!(image = %pull.image, pattern, "a pull without credentials is not filled: no source of the agent gives a credential for it");
                return None;
            };
            let auth = wire::AuthConfig {
                username: credential.username.clone(),
                password: credential.password.expose_secret().to_owned(),
                ..Default::default()
            };
            pull.credential = Some(credgate_agent::captured::PodCredential {
                namespace: pull.pod_namespace.clone(),
                username: credential.username,
                password: credential.password,
                captured_ms: 0,
            });
            pull.filled = Some(source);
            auth
        }
    };
    pull.scope = policy.scope(parsed.registry());
    let address = pull.scope.server_address(&auth.server_address);
    if pull.filled.is_none() && address == auth.server_address {
        return None;
    }
    if let policy::Scoped::Registry { why, .. } = &pull.scope {
        tracing::debug!(image = %pull.image, why = %why, "the pull's credential is scoped to its registry");
    }
    auth.server_address = address;
    framed(&wire::with_pull_auth(message, &auth)?)
}

/// The credential a pull without one is filled with: the first the agent's sources give for
/// `image` in their try-order (the same cache and runs as a Lookup), but none of a provider
/// keyed by service account (the CRI carries no identity to ask with). With the source's
/// name for the log.
pub(super) async fn fill(
    ctx: &super::Context,
    image: &str,
) -> Option<(credgate_agent::refusal::Given, credgate_engine::Credential)> {
    let engine = ctx.engine();
    let lookup = engine
        .lookup(&credgate_engine::LookupRequest {
            image,
            ..Default::default()
        })
        .await
        .ok()?;
    let credential = lookup.credentials.into_iter().find(|c| match &c.source {
        credgate_engine::Source::Provider(name) => !engine.keyed_by_service_account(name),
        credgate_engine::Source::DockerConfig(_) => true,
    })?;
    let source = credgate_agent::refusal::Given::from(credential.source.clone());
    Some((source, credential))
}
