//! `credgate explain IMAGE`: why a pull gets the credentials it gets, or none. Asks the running
//! agent (its view: caches, last runs, backoff, captured credentials) when there is one, else
//! computes the same from the flags in-process (no captured credentials there).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use credgate_api::v1::admin_client::AdminClient;
use credgate_api::v1::{self as pb};

use super::get::{agent_socket, build_engine};
use super::print::rfc3339;
use super::print::{answer, json};
use crate::opts::{ExplainArgs, Output};
use crate::{usage, Outcome};

fn service_account(s: &str) -> Result<pb::ServiceAccount> {
    let o = super::ctl_guard::object(s, "--service-account")?;
    Ok(pb::ServiceAccount {
        namespace: o.namespace,
        name: o.name,
        uid: o.uid,
        ..Default::default()
    })
}

pub async fn run(args: ExplainArgs) -> Result<Outcome> {
    if let Err(e) = credgate_core::reference::ImageRef::parse(&args.image) {
        return Err(usage(format!(
            "invalid image reference {:?}: {e}",
            args.image
        )));
    }
    let sa = args
        .service_account
        .as_deref()
        .map(service_account)
        .transpose()?;
    let (view, explained) = match agent_socket(args.socket.as_ref(), &args.sources) {
        Some(socket) => {
            let channel = credgate_api::connect(&socket)
                .await
                .with_context(|| format!("cannot reach the agent at {}", socket.display()))?;
            let answer = answer(AdminClient::new(channel).explain(pb::ExplainRequest {
                image: args.image.clone(),
                service_account: sa,
            }))
            .await?;
            (format!("the agent at {}", socket.display()), answer)
        }
        None => {
            super::get::require_a_source(&args.sources)?;
            let engine = build_engine(&args.sources)?;
            let sa = sa.map(|s| credgate_engine::ServiceAccount {
                namespace: s.namespace,
                name: s.name,
                uid: s.uid,
                token: secrecy::SecretString::from(String::new()),
                annotations: Default::default(),
            });
            let e = engine.explain(&credgate_engine::LookupRequest {
                image: &args.image,
                service_account: sa.as_ref(),
                ..Default::default()
            })?;
            let mut files: Vec<String> = Vec::new();
            if let Some(c) = &args.sources.image_credential_provider_config {
                files.push(c.display().to_string());
            }
            files.extend(
                e.sources
                    .iter()
                    .filter(|s| s.kind == credgate_engine::SourceKind::DockerConfig)
                    .map(|s| s.name.clone()),
            );
            files.dedup();
            (
                format!(
                    "this process, from {} (no agent at {}: no cache, runs or captured credentials)",
                    files.join(", "),
                    credgate_api::default_socket_path().display()
                ),
                credgate_agent::explain::to_wire(&e, SystemTime::now()),
            )
        }
    };
    if args.output == Output::Json {
        json(&explained)?;
    } else {
        println!("view:    {view}");
        print!("{}", text(&explained));
    }
    Ok(Outcome::Yes)
}

fn at(ms: i64) -> String {
    if ms <= 0 {
        return "-".into();
    }
    rfc3339(UNIX_EPOCH + Duration::from_millis(ms.unsigned_abs()))
}

/// The explanation for a person: the verdict first, then each source.
fn text(e: &pb::ExplainResponse) -> String {
    let mut out = format!(
        "image:   {}\nverdict: {}\n\nsources, in try-order:\n",
        e.image, e.verdict
    );
    if e.captured {
        out.push_str(&format!(
            "  captured pod credential: namespace {}, captured {}\n",
            if e.captured_namespace.is_empty() {
                "-"
            } else {
                &e.captured_namespace
            },
            at(e.captured_unix_ms)
        ));
    }
    if e.sources.is_empty() {
        out.push_str("  none: no docker config and no provider config\n");
    }
    for s in &e.sources {
        let head = format!("  {} {}", s.kind, s.name);
        if !s.matched {
            out.push_str(&format!(
                "{head}: does not match{}\n",
                if s.pattern.is_empty() {
                    String::new()
                } else {
                    format!(" (closest: {}: {})", s.pattern, s.why_not)
                }
            ));
            continue;
        }
        out.push_str(&format!("{head}: matches {}\n", s.pattern));
        if s.dropped_unix_ms > 0 {
            let what = if s.kind == "provider" {
                "cached answers dropped"
            } else {
                "refused"
            };
            out.push_str(&format!(
                "      {what} {}: {}\n",
                at(s.dropped_unix_ms),
                s.dropped_reason
            ));
        }
        if s.kind != "provider" {
            continue;
        }
        if s.skipped_without_service_account {
            out.push_str(
                "      needs a service account (--service-account): not run without one\n",
            );
        }
        if s.cached {
            out.push_str(&format!(
                "      cache: {} credential(s), key {}, expires {}, fetched {} ago\n",
                s.cached_credentials,
                s.cache_key_type,
                at(s.cache_expires_unix_ms),
                credgate_core::duration::Rounded(Duration::from_millis(s.cache_age_ms))
            ));
        } else if s.backoff_until_unix_ms > 0 {
            out.push_str(&format!(
                "      cache: nothing for this image; a lookup is refused without a run until {}\n",
                at(s.backoff_until_unix_ms)
            ));
        } else {
            out.push_str("      cache: nothing for this image: a lookup runs the plugin\n");
        }
        out.push_str(&format!(
            "      runs: {}, last run {}, last success {}\n",
            s.runs,
            at(s.last_run_unix_ms),
            at(s.last_success_unix_ms)
        ));
        if s.backoff_until_unix_ms > 0 {
            out.push_str(&format!(
                "      backing off until {} after {} failures\n",
                at(s.backoff_until_unix_ms),
                s.consecutive_failures
            ));
        }
        if !s.last_error.is_empty() {
            out.push_str(&format!(
                "      last error: {} (the plugin's stderr is in the agent's log at debug level: CREDGATE_LOG=debug)\n",
                s.last_error
            ));
        }
    }
    if !e.guard_records.is_empty() {
        out.push_str("\nimage access guard:\n");
        for r in &e.guard_records {
            out.push_str(&format!("  {r}\n"));
        }
        if !e.guard_node_wide_decision.is_empty() {
            out.push_str(&format!(
                "  a workload with node-wide credentials only: {}\n",
                e.guard_node_wide_decision
            ));
        }
    }
    if !e.cri_fill.is_empty() || !e.cri_mirror_trust.is_empty() {
        out.push_str(
            "
CRI proxy:
",
        );
        out.push_str(&format!(
            "  fill: {}
",
            e.cri_fill
        ));
        out.push_str(&format!(
            "  mirrors: {}
",
            e.cri_mirror_trust
        ));
    }
    out
}
