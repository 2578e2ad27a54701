//! `credgate explain IMAGE`: why a pull gets the credentials it gets, or none. Asks the running
//! agent (its view: caches, last runs, backoff, captured credentials) when there is one, else
//! computes the same from the flags in-process (no captured credentials there).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use credgate_api::v1::admin_client::AdminClient;
use credgate_api::v1::{self as pb};

use super::get::{agent_socket, build_engine};
use super::print::rfc3339;
use super::print::{answer, json, plain};
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
        println!("view:    {}", plain(&view));
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
        plain(&e.image),
        plain(&e.verdict)
    );
    if e.captured {
        out.push_str(&format!(
            "  captured pod credential: namespace {}, captured {}\n",
            if e.captured_namespace.is_empty() {
                "-".into()
            } else {
                plain(&e.captured_namespace)
            },
            at(e.captured_unix_ms)
        ));
    }
    if e.sources.is_empty() {
        out.push_str("  none: no docker config and no provider config\n");
    }
    for s in &e.sources {
        source(&mut out, s);
    }
    if !e.guard_records.is_empty() {
        out.push_str("\nimage access guard:\n");
        for r in &e.guard_records {
            out.push_str(&format!("  {}\n", plain(r)));
        }
        if !e.guard_node_wide_decision.is_empty() {
            out.push_str(&format!(
                "  a workload with node-wide credentials only: {}\n",
                plain(&e.guard_node_wide_decision)
            ));
        }
    }
    if !e.cri_fill.is_empty() || !e.cri_mirror_trust.is_empty() {
        out.push_str(&format!(
            "\nCRI proxy:\n  fill: {}\n  mirrors: {}\n",
            plain(&e.cri_fill),
            plain(&e.cri_mirror_trust)
        ));
        if !e.cri_last_unauthorized.is_empty() {
            out.push_str(&format!(
                "  last unauthorized pull: {}\n",
                plain(&e.cri_last_unauthorized)
            ));
        }
        if !e.cri_node_image.is_empty() {
            out.push_str(&format!("  node image: {}\n", plain(&e.cri_node_image)));
        }
    }
    out
}

/// One source's lines: whether it matches and, for a provider, its cache, runs and last error.
fn source(out: &mut String, s: &pb::ExplainedSource) {
    let head = format!("  {} {}", plain(&s.kind), plain(&s.name));
    if !s.matched {
        out.push_str(&format!(
            "{head}: does not match{}\n",
            if s.pattern.is_empty() {
                String::new()
            } else {
                format!(" (closest: {}: {})", plain(&s.pattern), plain(&s.why_not))
            }
        ));
        return;
    }
    out.push_str(&format!("{head}: matches {}\n", plain(&s.pattern)));
    if s.dropped_unix_ms > 0 {
        let what = if s.kind == "provider" {
            "cached answers dropped"
        } else {
            "refused"
        };
        out.push_str(&format!(
            "      {what} {}: {}\n",
            at(s.dropped_unix_ms),
            plain(&s.dropped_reason)
        ));
    }
    if s.kind != "provider" {
        return;
    }
    if s.skipped_without_service_account {
        out.push_str("      needs a service account (--service-account): not run without one\n");
    }
    if s.cached {
        out.push_str(&format!(
            "      cache: {} credential(s), key {}, expires {}, fetched {} ago\n",
            s.cached_credentials,
            pb::CacheKeyType::try_from(s.cache_key_type)
                .map_or("unspecified", pb::CacheKeyType::word),
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
            plain(&s.last_error)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every section of the text, in its order: the CLI's explain tests read parts of it
    /// through a real agent, this pins all of it.
    #[test]
    fn the_text_names_each_source_guard_record_and_proxy_rule() {
        let day = 1_764_115_200_000; // 2025-11-26T00:00:00Z
        let e = pb::ExplainResponse {
            image: "registry.example/team/app".into(),
            verdict: "from provider p1".into(),
            captured: true,
            captured_namespace: String::new(),
            captured_unix_ms: day,
            sources: vec![
                pb::ExplainedSource {
                    kind: "docker-config".into(),
                    name: "/etc/d.json".into(),
                    matched: false,
                    pattern: "other.example".into(),
                    why_not: "host differs".into(),
                    ..Default::default()
                },
                pb::ExplainedSource {
                    kind: "docker-config".into(),
                    name: "/etc/e.json".into(),
                    matched: true,
                    pattern: "registry.example".into(),
                    dropped_unix_ms: day,
                    dropped_reason: "refused for team/app".into(),
                    ..Default::default()
                },
                pb::ExplainedSource {
                    kind: "provider".into(),
                    name: "p1".into(),
                    matched: true,
                    pattern: "*.example".into(),
                    cached: true,
                    cache_key_type: pb::CacheKeyType::Registry as i32,
                    cache_expires_unix_ms: day + 3_600_000,
                    cache_age_ms: 90_000,
                    cached_credentials: 1,
                    runs: 2,
                    last_run_unix_ms: day,
                    last_success_unix_ms: day,
                    ..Default::default()
                },
                pb::ExplainedSource {
                    kind: "provider".into(),
                    name: "p2".into(),
                    matched: true,
                    pattern: "registry.example".into(),
                    skipped_without_service_account: true,
                    backoff_until_unix_ms: day + 60_000,
                    consecutive_failures: 3,
                    last_error: "exit status 1".into(),
                    ..Default::default()
                },
            ],
            guard_records: vec!["sha256:ab… node-wide".into()],
            guard_node_wide_decision: "allowed".into(),
            cri_fill: "filled by registry.example".into(),
            cri_mirror_trust: "none".into(),
            ..Default::default()
        };
        let expected = "\
image:   registry.example/team/app
verdict: from provider p1

sources, in try-order:
  captured pod credential: namespace -, captured 2025-11-26T00:00:00Z
  docker-config /etc/d.json: does not match (closest: other.example: host differs)
  docker-config /etc/e.json: matches registry.example
      refused 2025-11-26T00:00:00Z: refused for team/app
  provider p1: matches *.example
      cache: 1 credential(s), key Registry, expires 2025-11-26T01:00:00Z, fetched 1m30s ago
      runs: 2, last run 2025-11-26T00:00:00Z, last success 2025-11-26T00:00:00Z
  provider p2: matches registry.example
      needs a service account (--service-account): not run without one
      cache: nothing for this image; a lookup is refused without a run until 2025-11-26T00:01:00Z
      runs: 0, last run -, last success -
      backing off until 2025-11-26T00:01:00Z after 3 failures
      last error: exit status 1 (the plugin's stderr is in the agent's log at debug level: CREDGATE_LOG=debug)

image access guard:
  sha256:ab… node-wide
  a workload with node-wide credentials only: allowed

CRI proxy:
  fill: filled by registry.example
  mirrors: none
";
        assert_eq!(text(&e), expected);
    }

    /// Outside text in the answer (a runtime's message, a plugin's error, a registry's refusal)
    /// cannot end a line, forge another or reach the terminal as an escape sequence.
    #[test]
    fn outside_text_is_printed_escaped() {
        let forged = "401\n2026-01-01T00:00:00Z  INFO forged\u{1b}]0;owned\u{7}\u{1b}[2J";
        let e = pb::ExplainResponse {
            image: "registry.example/team/app".into(),
            verdict: forged.into(),
            sources: vec![pb::ExplainedSource {
                kind: "provider".into(),
                name: "p".into(),
                matched: true,
                pattern: "registry.example".into(),
                dropped_unix_ms: 1,
                dropped_reason: forged.into(),
                last_error: forged.into(),
                ..Default::default()
            }],
            cri_fill: forged.into(),
            cri_last_unauthorized: forged.into(),
            cri_node_image: forged.into(),
            guard_records: vec![forged.into()],
            ..Default::default()
        };
        let out = text(&e);
        assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out:?}");
        assert!(!out.lines().any(|l| l.starts_with("2026")), "{out}");
        assert_eq!(out.matches("401\\n2026").count(), 7, "{out}");
    }
}
