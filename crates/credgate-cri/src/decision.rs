//! The pull decision log: for each `PullImage` through the proxy, one line at info (the image,
//! the pod, whether the kubelet sent credentials and which source they match, the runtime's
//! code and message), `credgate_cri_pulls_total{auth,result}`, a record in the agent's ring
//! (`credgate ctl pulls`), and, for a pull that went without credentials and failed as
//! unauthorized while a provider or docker config would have answered, a warning that says so
//! and what to check (once per image per interval).

use std::time::Duration;

use super::pull_request::Pull;
use crate::outcome::{PullAuth, PullResult};
use crate::pull_log::PullRecord;

/// `(code, result)`: the runtime's gRPC code and what it means ([`PullResult::of`]); `given`:
/// the sources that gave the pull's credential (`unknown` when it carried one none
/// gave: a pod's own pull secret the proxy has not captured); `refusal`: what became of that
/// credential when the pull ended unauthorized (empty otherwise).
pub(super) fn log(
    ctx: &super::Context,
    pull: &Pull,
    given: &[credgate_agent::refusal::Given],
    (code, result): (i32, PullResult),
    message: &str,
    took: Duration,
    mut refusal: String,
) {
    let auth = match (&pull.filled, &pull.credential, given.first()) {
        (Some(source), _, _) => PullAuth::Filled(source.clone()),
        (None, None, _) if !pull.sent_auth() => PullAuth::None,
        // It carried something that does not decode: the caller's own.
        (None, None, _) => PullAuth::Unknown,
        (None, Some(_), Some(g)) => PullAuth::Given(g.clone()),
        (None, Some(_), None) => PullAuth::Unknown,
    };
    ctx.metrics.pull(auth.label(), result);
    if result == PullResult::Unauthorized {
        if let Some(still) = still_answers_refused(ctx, given) {
            if !refusal.is_empty() {
                refusal.push_str("; ");
            }
            refusal.push_str(&still);
        }
    }
    // The runtime's message is logged within the pull ring's bound (the pull's own fields
    // were cut when it was read).
    use crate::pull_log::{capped, MESSAGE};
    tracing::info!(
        image = %pull.image,
        pod_namespace = %pull.pod_namespace,
        pod = %pull.pod_name,
        auth = %auth,
        replaced_refused = pull.replaced.is_some(),
        scope = pull.scope.as_str(),
        code,
        result = result.as_str(),
        runtime_message = %capped(message, MESSAGE),
        refusal = %capped(&refusal, MESSAGE),
        node_image = pull.node_image.map_or("", |w| w.as_str()),
        millis = u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
        "pull"
    );
    if auth == PullAuth::None && result == PullResult::Unauthorized {
        warn_if_a_source_would_have_answered(ctx, pull);
    }
    ctx.pulls.push(PullRecord {
        at: ctx.clock.wall(),
        image: pull.image.clone(),
        repository: pull.repository.clone(),
        pod_namespace: pull.pod_namespace.clone(),
        pod_name: pull.pod_name.clone(),
        auth,
        code,
        message: message.to_owned(),
        duration: took,
        refusal,
        node_image: pull.node_image,
    });
}

/// When a provider that gave the pull's credential still answers a credential a registry
/// refused (its backend has not caught up): says so.
fn still_answers_refused(
    ctx: &super::Context,
    given: &[credgate_agent::refusal::Given],
) -> Option<String> {
    given.iter().find_map(|g| match g {
        credgate_agent::refusal::Given::Provider(name) => ctx
            .engine()
            .answers_refused_since(name)
            .map(|_| format!("provider {name} still answers the credential the registry refused: it is asked again every few seconds until its backend answers another")),
        _ => None,
    })
}

/// What a source that matches a pull's image could have given it.
enum Had {
    /// A credential (cached, or its last run succeeded): the kubelet should have asked.
    Credential(String),
    /// Nothing the kubelet could have used: why, and what to do.
    Nothing(String),
    /// A provider that matches has never run on this node: the kubelet never asked the agent
    /// (the case the missed-pull counter exists for), though nothing says it would answer.
    NeverAsked(String),
}

/// Each source of the agent that matches `image`, and what it had for it.
fn matching_sources(ctx: &super::Context, image: &str) -> Vec<Had> {
    use credgate_engine::SourceKind;
    let Ok(explained) = ctx.engine().explain(&credgate_engine::LookupRequest {
        image,
        ..Default::default()
    }) else {
        return Vec::new();
    };
    explained
        .sources
        .iter()
        .filter(|s| s.matched)
        .map(|s| match (s.kind, &s.provider) {
            (SourceKind::DockerConfig, _) => Had::Nothing(format!(
                "docker config {} has an entry for it: the kubelet reads its own config.json, not the agent's; put the entry in the kubelet's (/var/lib/kubelet/config.json)",
                s.name
            )),
            (SourceKind::Provider, None) => Had::Nothing(format!("provider {} matches", s.name)),
            (SourceKind::Provider, Some(v)) => {
                let pattern = s.pattern.as_deref().unwrap_or("-");
                match &v.cached {
                    Some(c) if c.credentials > 0 => {
                        Had::Credential(format!("provider {} ({pattern})", s.name))
                    }
                    Some(_) => Had::Nothing(format!(
                        "provider {} answered no credential: the pull goes anonymous; check what its plugin answers (`credgate get IMAGE`)",
                        s.name
                    )),
                    None if v.status.consecutive_failures > 0 => Had::Nothing(format!(
                        "provider {} matches but its last run failed: {}; the plugin's stderr is in the agent's log at debug level",
                        s.name,
                        v.status.last_error.as_deref().unwrap_or("-")
                    )),
                    None if v.status.last_success.is_some() => {
                        Had::Credential(format!("provider {} ({pattern})", s.name))
                    }
                    None => Had::NeverAsked(format!(
                        "provider {} matches but has not run on this node: the kubelet did not ask the agent; check the kubelet's --image-credential-provider-config and --image-credential-provider-bin-dir (credgate kubelet-config) and the entry's matchImages",
                        s.name
                    )),
                }
            }
        })
        .collect()
}

/// The kubelet pulled without credentials and the registry said unauthorized. When a source of
/// the agent that matches the image had a credential to give, the kubelet did not ask for it
/// (its config or bin dir, or its copy of matchImages): warned once per image per interval and
/// counted. Otherwise the warning says which case it is (a plugin that failed or answered
/// nothing, a docker config the kubelet does not read), and nothing is counted.
fn warn_if_a_source_would_have_answered(ctx: &super::Context, pull: &Pull) {
    let sources = matching_sources(ctx, &pull.image);
    if sources.is_empty() {
        return;
    }
    let (mut had, mut causes): (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
    let mut never_asked = false;
    for h in &sources {
        match h {
            Had::Credential(s) => had.push(s),
            Had::Nothing(s) => causes.push(s),
            Had::NeverAsked(s) => {
                never_asked = true;
                causes.push(s);
            }
        }
    }
    // The kubelet did not ask the agent: it would have answered, or it was never asked.
    if !had.is_empty() || never_asked {
        ctx.metrics.pulls_missed.inc();
    }
    if !ctx.pulls.may_warn(&pull.image, ctx.clock.now()) {
        return;
    }
    if had.is_empty() {
        tracing::warn!(
            image = %pull.image,
            pod_namespace = %pull.pod_namespace,
            pod = %pull.pod_name,
            cause = %causes.join("; "),
            "a pull without credentials failed as unauthorized, and no source of the agent has a credential for it"
        );
        return;
    }
    tracing::warn!(
        image = %pull.image,
        pod_namespace = %pull.pod_namespace,
        pod = %pull.pod_name,
        sources = %had.join(", "),
        "a pull without credentials failed as unauthorized, but the agent has a credential for the image: check the kubelet's --image-credential-provider-config and --image-credential-provider-bin-dir (credgate kubelet-config), and the entry's matchImages; `credgate explain IMAGE` shows the agent's view"
    );
}
