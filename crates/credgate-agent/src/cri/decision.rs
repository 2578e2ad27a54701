//! The pull decision log: for each `PullImage` through the proxy, one line at info (the image,
//! the pod, whether the kubelet sent credentials and which source they match, the runtime's
//! code and message), `credgate_cri_pulls_total{auth,result}`, a record in the agent's ring
//! (`credgate ctl pulls`), and, for a pull that went without credentials and failed as
//! unauthorized while a provider or docker config would have answered, a warning that says so
//! and what to check (once per image per interval).

use std::time::Duration;

use secrecy::ExposeSecret;

use super::Pull;
use crate::pulls::{result_of, PullRecord};

/// Which source the credential the kubelet sent matches: `captured`, `provider:NAME`,
/// `docker-config` or `unknown` (a pod's own pull secret the proxy has not captured).
fn source_of(
    agent: &crate::Agent,
    pull: &Pull,
    credential: &crate::captured::Credential,
) -> String {
    crate::refusal::given_by(
        agent,
        &pull.image,
        &pull.repository,
        &credential.username,
        credential.password.expose_secret(),
    )
    .first()
    .map_or_else(|| "unknown".into(), crate::refusal::Given::auth)
}

/// The metric's label for an `auth` value.
fn auth_label(auth: &str) -> &'static str {
    match auth {
        "none" => "none",
        "captured" => "captured",
        "docker-config" => "docker_config",
        a if a.starts_with("provider:") => "provider",
        _ => "unknown",
    }
}

pub(super) fn log(agent: &crate::Agent, pull: &Pull, code: i32, message: &str, took: Duration) {
    let auth = match &pull.credential {
        None => "none".to_owned(),
        Some(c) => source_of(agent, pull, c),
    };
    let result = result_of(code, message);
    agent.metrics().cri_pull(auth_label(&auth), result);
    tracing::info!(
        image = %pull.image,
        pod_namespace = %pull.pod_namespace,
        pod = %pull.pod_name,
        auth = %auth,
        replaced_refused = pull.replaced.is_some(),
        code,
        result,
        message = %message,
        millis = u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
        "pull"
    );
    if auth == "none" && result == "unauthorized" {
        warn_if_a_source_would_have_answered(agent, pull);
    }
    agent.pulls().push(PullRecord {
        at: agent.clock().wall(),
        image: pull.image.clone(),
        repository: pull.repository.clone(),
        pod_namespace: pull.pod_namespace.clone(),
        pod_name: pull.pod_name.clone(),
        auth,
        code,
        message: message.to_owned(),
        duration: took,
    });
}

/// The kubelet pulled without credentials and the registry said unauthorized, although a
/// provider or a docker config matches the image: the kubelet did not ask (its config or bin
/// dir), or asked and got nothing.
fn warn_if_a_source_would_have_answered(agent: &crate::Agent, pull: &Pull) {
    let Ok(explained) = agent.engine().explain(&credgate_engine::LookupRequest {
        image: &pull.image,
        ..Default::default()
    }) else {
        return;
    };
    let matching: Vec<String> = explained
        .sources
        .iter()
        .filter(|s| s.matched)
        .map(|s| match s.kind {
            credgate_engine::SourceKind::Provider => {
                format!(
                    "provider {} ({})",
                    s.name,
                    s.pattern.as_deref().unwrap_or("-")
                )
            }
            credgate_engine::SourceKind::DockerConfig => format!("docker config {}", s.name),
        })
        .collect();
    if matching.is_empty() {
        return;
    }
    agent.metrics().cri_pulls_missed.inc();
    if !agent.pulls().may_warn(&pull.image) {
        return;
    }
    tracing::warn!(
        image = %pull.image,
        pod_namespace = %pull.pod_namespace,
        pod = %pull.pod_name,
        sources = %matching.join(", "),
        "a pull without credentials failed as unauthorized, but the agent has a source for the image: check the kubelet's --image-credential-provider-config and --image-credential-provider-bin-dir (credgate kubelet-config), and the entry's matchImages; `credgate explain IMAGE` shows the agent's view"
    );
}
