//! `credgate ctl`: one subcommand per RPC of the agent, table output by default, the messages
//! themselves with `-o json`.

use anyhow::{Context, Result};
use credgate_api::v1::admin_client::AdminClient;
use credgate_api::v1::credentials_client::CredentialsClient;
use credgate_api::v1::{self as pb};
use serde::Serialize;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use super::get::{print_rows, print_table, time_ms, Row};
use crate::opts::{CtlArgs, CtlCall, Output};
use crate::Outcome;

/// Prints a response: the message as JSON with `-o json`, else `text` of it.
pub fn show<T: Serialize>(out: Output, value: &T, text: impl FnOnce(&T) -> String) -> Result<()> {
    if out == Output::Json {
        json(value)
    } else {
        println!("{}", text(value));
        Ok(())
    }
}

pub fn json(value: &impl Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

pub fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!(
        "{}: {}",
        credgate_agent::metrics::code_name(s.code()).to_lowercase(),
        s.message()
    )
}

/// The answer of a call, or its status as an error.
pub async fn answer<T>(
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T> {
    call.await
        .map(tonic::Response::into_inner)
        .map_err(status_error)
}

pub async fn run(args: CtlArgs) -> Result<Outcome> {
    super::ctl_guard::check_args(&args.call)?;
    let socket = credgate_api::socket_path(args.socket.as_deref());
    let channel = credgate_api::connect(&socket)
        .await
        .with_context(|| format!("cannot reach the agent at {}", socket.display()))?;
    call(channel, args.call, args.output).await
}

async fn call(channel: Channel, call: CtlCall, out: Output) -> Result<Outcome> {
    let mut creds = CredentialsClient::new(channel.clone());
    let mut admin = AdminClient::new(channel.clone());
    match call {
        CtlCall::Lookup {
            image,
            min_valid_for,
            registry_host,
        } => {
            let r =
                answer(
                    creds.lookup(pb::LookupRequest {
                        image,
                        min_valid_for_ms: min_valid_for
                            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                        registry_host,
                        ..Default::default()
                    }),
                )
                .await?;
            if out == Output::Json {
                json(&r)?;
            } else {
                let rows: Vec<Row> = r.credentials.iter().map(Row::from_wire).collect();
                print_rows(&rows, out)?;
                for f in &r.failures {
                    eprintln!("warning: {}", f.message);
                }
            }
            return Ok(if r.credentials.is_empty() {
                Outcome::No
            } else {
                Outcome::Yes
            });
        }
        CtlCall::Track { consumer, refs } => {
            let r = answer(creds.track(pb::TrackRequest { consumer, refs })).await?;
            show(out, &r, |r| format!("tracked: {}", r.tracked))?;
        }
        CtlCall::Untrack { consumer, refs } => {
            let r = answer(creds.untrack(pb::UntrackRequest { consumer, refs })).await?;
            show(out, &r, |r| format!("tracked: {}", r.tracked))?;
        }
        CtlCall::SetTracked { consumer, refs } => {
            let r = answer(creds.set_tracked(pb::SetTrackedRequest { consumer, refs })).await?;
            show(out, &r, |r| {
                format!("added: {}, removed: {}", r.added, r.removed)
            })?;
        }
        CtlCall::ListTracked { consumer } => {
            let r = answer(creds.list_tracked(pb::ListTrackedRequest {
                consumer: consumer.unwrap_or_default(),
            }))
            .await?;
            if out == Output::Json {
                json(&r)?;
            } else {
                let rows: Vec<Vec<String>> = r
                    .refs
                    .iter()
                    .map(|t| {
                        vec![
                            t.r#ref.clone(),
                            if t.consumers.is_empty() {
                                "(grace)".into()
                            } else {
                                t.consumers.join(",")
                            },
                            t.credentials.to_string(),
                            time_ms(t.expires_at_unix_ms),
                            time_ms(t.next_attempt_unix_ms),
                            t.consecutive_failures.to_string(),
                            if t.last_error.is_empty() {
                                "-".into()
                            } else {
                                t.last_error.clone()
                            },
                        ]
                    })
                    .collect();
                print_table(
                    &[
                        "REF",
                        "CONSUMERS",
                        "CREDS",
                        "EXPIRES",
                        "NEXT RENEWAL",
                        "FAILURES",
                        "LAST ERROR",
                    ],
                    &rows,
                );
            }
        }
        CtlCall::Watch { refs, count } => {
            let mut stream = answer(creds.watch(pb::WatchRequest { refs })).await?;
            let mut seen = 0u64;
            while let Some(event) = stream.next().await {
                let event = event.map_err(status_error)?;
                if out == Output::Json {
                    println!("{}", serde_json::to_string(&event)?);
                } else {
                    let users: Vec<String> = event
                        .credentials
                        .iter()
                        .map(|c| format!("{}@{}", c.username, c.source))
                        .collect();
                    println!(
                        "{} revision {}: {}",
                        event.r#ref,
                        event.revision,
                        users.join(", ")
                    );
                }
                seen += 1;
                if count.is_some_and(|n| seen >= n) {
                    break;
                }
            }
        }
        CtlCall::Health => {
            let r = answer(admin.health(pb::HealthRequest {})).await?;
            show(out, &r, |r| r.status.clone())?;
        }
        CtlCall::Version => {
            let r = answer(admin.version(pb::VersionRequest {})).await?;
            show(out, &r, |r| format!("credgate {} ({})", r.version, r.api))?;
        }
        CtlCall::Status => {
            let r = answer(admin.status(pb::StatusRequest {})).await?;
            if out == Output::Json {
                json(&r)?;
            } else {
                let or_none = |s: &str| {
                    if s.is_empty() {
                        "none".to_owned()
                    } else {
                        s.to_owned()
                    }
                };
                println!("config:         {}", or_none(&r.config_path));
                println!("identity:       {}", or_none(&r.config_identity));
                println!("docker configs: {}", or_none(&r.docker_configs.join(", ")));
                println!("tracked refs:   {}", r.tracked_refs);
                println!("started:        {}", time_ms(r.started_unix_ms));
                println!("loaded:         {}", time_ms(r.loaded_unix_ms));
                match &r.saved_cache {
                    Some(c) if c.enabled => {
                        let dropped: Vec<String> =
                            c.dropped.iter().map(|(k, v)| format!("{v} {k}")).collect();
                        println!(
                            "saved cache:    {} restored at start, {} dropped{}; {} consumers restored; {} saved {}",
                            c.restored,
                            c.dropped.values().sum::<u64>(),
                            if dropped.is_empty() {
                                String::new()
                            } else {
                                format!(" ({})", dropped.join(", "))
                            },
                            c.consumers_restored,
                            c.saved_entries,
                            time_ms(c.last_saved_unix_ms)
                        );
                    }
                    _ => println!("saved cache:    off"),
                }
                let rows: Vec<Vec<String>> = r
                    .providers
                    .iter()
                    .map(|p| {
                        vec![
                            p.name.clone(),
                            p.runs.to_string(),
                            p.errors.to_string(),
                            p.refused_in_backoff.to_string(),
                            p.cache_entries.to_string(),
                            time_ms(p.last_run_unix_ms),
                            time_ms(p.next_renewal_unix_ms),
                            if p.last_error.is_empty() {
                                "-".into()
                            } else {
                                p.last_error.clone()
                            },
                        ]
                    })
                    .collect();
                println!();
                print_table(
                    &[
                        "PROVIDER",
                        "RUNS",
                        "ERRORS",
                        "BACKOFF REFUSALS",
                        "ENTRIES",
                        "LAST RUN",
                        "NEXT RENEWAL",
                        "LAST ERROR",
                    ],
                    &rows,
                );
            }
        }
        CtlCall::Reload => {
            let r = answer(admin.reload(pb::ReloadRequest {})).await?;
            if out == Output::Json {
                json(&r)?;
            } else {
                let id = if r.config_identity.is_empty() {
                    "none"
                } else {
                    &r.config_identity
                };
                println!(
                    "reloaded: {id}{}",
                    if r.changed {
                        " (changed)"
                    } else {
                        " (unchanged)"
                    }
                );
            }
        }
        guard_call @ (CtlCall::CheckAccess { .. }
        | CtlCall::RecordIntent { .. }
        | CtlCall::RecordResult { .. }
        | CtlCall::Verify { .. }
        | CtlCall::Prune { .. }
        | CtlCall::ListRecords
        | CtlCall::GetRecord { .. }
        | CtlCall::DeleteRecord { .. }) => {
            return super::ctl_guard::call(channel, guard_call, out).await;
        }
        CtlCall::Ping => {
            let r = answer(admin.ping(pb::PingRequest {})).await?;
            show(out, &r, |_| "pong".to_owned())?;
        }
        CtlCall::Pulls { image } => {
            let r = answer(admin.list_pulls(pb::ListPullsRequest {
                image: image.unwrap_or_default(),
            }))
            .await?;
            if out == Output::Json {
                json(&r)?;
            } else if r.pulls.is_empty() {
                println!("no pulls through the CRI proxy yet");
            } else {
                let rows: Vec<Vec<String>> = r
                    .pulls
                    .iter()
                    .map(|p| {
                        vec![
                            time_ms(p.at_unix_ms),
                            p.image.clone(),
                            format!("{}/{}", p.pod_namespace, p.pod_name),
                            p.auth.clone(),
                            if p.code == 0 {
                                "pulled".into()
                            } else {
                                format!("{}: {}", p.code, p.message)
                            },
                        ]
                    })
                    .collect();
                print_table(&["AT", "IMAGE", "POD", "AUTH", "RESULT"], &rows);
            }
        }
        CtlCall::Captured { action: None } => {
            let r = answer(admin.list_captured(pb::ListCapturedRequest {})).await?;
            if out == Output::Json {
                json(&r)?;
            } else if r.captured.is_empty() {
                println!("nothing captured");
            } else {
                let rows: Vec<Vec<String>> = r
                    .captured
                    .iter()
                    .map(|c| {
                        vec![
                            c.repository.clone(),
                            if c.namespace.is_empty() {
                                "-".into()
                            } else {
                                c.namespace.clone()
                            },
                            c.username.clone(),
                            time_ms(c.captured_unix_ms),
                            time_ms(c.expires_unix_ms),
                        ]
                    })
                    .collect();
                print_table(
                    &["REPOSITORY", "NAMESPACE", "USERNAME", "CAPTURED", "EXPIRES"],
                    &rows,
                );
            }
        }
        CtlCall::Captured {
            action: Some(crate::opts::CapturedAction::Forget { repository }),
        } => {
            let r = answer(admin.forget_captured(pb::ForgetCapturedRequest { repository })).await?;
            show(out, &r, |r| {
                if r.forgotten {
                    "forgotten"
                } else {
                    "nothing captured for it"
                }
                .to_owned()
            })?;
        }
    }
    Ok(Outcome::Yes)
}
