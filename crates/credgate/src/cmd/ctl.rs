//! `credgate ctl`: one subcommand per RPC of the agent, table output by default, the messages
//! themselves with `-o json`.

use anyhow::{Context, Result};
use credgate_api::v1::admin_client::AdminClient;
use credgate_api::v1::credentials_client::CredentialsClient;
use credgate_api::v1::{self as pb};
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use super::get::{print_rows, Row};
use super::print::{answer, json, plain, print_table, show, status_error, time_ms};
use crate::opts::{CtlArgs, CtlCall, Output};
use crate::Outcome;

pub async fn run(args: CtlArgs) -> Result<Outcome> {
    super::ctl_guard::check_args(&args.call)?;
    let socket = credgate_api::socket_path(args.socket.as_deref());
    let channel = credgate_api::connect(&socket)
        .await
        .with_context(|| format!("cannot reach the agent at {}", socket.display()))?;
    call(channel, args.call, args.output).await
}

/// One RPC: each command's printing is its own function (here for the credentials service,
/// in `ctl_admin` for the admin service, in `ctl_guard` for the image access guard's).
async fn call(channel: Channel, call: CtlCall, out: Output) -> Result<Outcome> {
    let mut creds = CredentialsClient::new(channel.clone());
    let mut admin = AdminClient::new(channel.clone());
    match call {
        CtlCall::Lookup {
            image,
            min_valid_for,
            registry_host,
        } => return lookup(&mut creds, image, min_valid_for, registry_host, out).await,
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
        CtlCall::ListTracked { consumer } => return list_tracked(&mut creds, consumer, out).await,
        CtlCall::Watch { refs, count } => return watch(&mut creds, refs, count, out).await,
        CtlCall::Health => {
            let r = answer(admin.health(pb::HealthRequest {})).await?;
            show(out, &r, |r| r.status.clone())?;
        }
        CtlCall::Version => {
            let r = answer(admin.version(pb::VersionRequest {})).await?;
            show(out, &r, |r| format!("credgate {} ({})", r.version, r.api))?;
        }
        CtlCall::Status => return super::ctl_admin::status(&mut admin, out).await,
        CtlCall::Reload => reload(&mut admin, out).await?,
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
        CtlCall::Pulls { image } => return super::ctl_admin::pulls(&mut admin, image, out).await,
        CtlCall::Flush { provider, images } => {
            return super::ctl_admin::flush(&mut admin, provider, images, out).await
        }
        CtlCall::ReportRefused { image, username } => {
            return report_refused(&mut creds, image, username, out).await
        }
        CtlCall::Captured { action: None } => {
            return super::ctl_admin::captured(&mut admin, out).await
        }
        CtlCall::Captured {
            action: Some(crate::opts::CapturedAction::Forget { repository }),
        } => forget_captured(&mut admin, repository, out).await?,
    }
    Ok(Outcome::Yes)
}

async fn lookup(
    creds: &mut CredentialsClient<Channel>,
    image: String,
    min_valid_for: Option<std::time::Duration>,
    registry_host: bool,
    out: Output,
) -> Result<Outcome> {
    let r = answer(creds.lookup(pb::LookupRequest {
        image,
        min_valid_for_ms:
            min_valid_for.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        registry_host,
        ..Default::default()
    }))
    .await?;
    if out == Output::Json {
        json(&r)?;
    } else {
        let rows: Vec<Row> = r.credentials.iter().map(Row::from_wire).collect();
        for f in &r.failures {
            eprintln!("warning: {}", plain(&f.message));
        }
        if r.last_known_good {
            eprintln!("warning: serving the last known good credentials of a tracked ref");
        }
        print_rows(&rows, out)?;
        if rows.is_empty() {
            // As `get` says it: an empty table alone reads as a hang or a crash.
            eprintln!("no credentials for {}", plain(&r.image));
        }
    }
    Ok(if r.credentials.is_empty() {
        Outcome::No
    } else {
        Outcome::Yes
    })
}

async fn reload(admin: &mut AdminClient<Channel>, out: Output) -> Result<()> {
    let r = answer(admin.reload(pb::ReloadRequest {})).await?;
    if out == Output::Json {
        return json(&r);
    }
    let id = if r.config_identity.is_empty() {
        "none"
    } else {
        &r.config_identity
    };
    let changed = if r.changed { "changed" } else { "unchanged" };
    println!("reloaded: {id} ({changed})");
    Ok(())
}

async fn report_refused(
    creds: &mut CredentialsClient<Channel>,
    image: String,
    username: String,
    out: Output,
) -> Result<Outcome> {
    let password = read_password()?;
    let r = answer(creds.report_refused(pb::ReportRefusedRequest {
        image,
        username,
        password: password.to_string(),
    }))
    .await?;
    let outcome = pb::RefusalOutcome::try_from(r.outcome).unwrap_or_default();
    show(out, &r, |r| {
        format!("{}: {}", outcome.word(), plain(&r.message))
    })?;
    // Exit 0 only when the credential is refused now (by this report or an earlier one): a
    // script that reports a refusal learns whether the agent will stop serving it.
    Ok(match outcome {
        pb::RefusalOutcome::Refused | pb::RefusalOutcome::AlreadyRefused => Outcome::Yes,
        _ => Outcome::No,
    })
}

async fn forget_captured(
    admin: &mut AdminClient<Channel>,
    repository: String,
    out: Output,
) -> Result<()> {
    let r = answer(admin.forget_captured(pb::ForgetCapturedRequest { repository })).await?;
    show(out, &r, |r| {
        if r.forgotten {
            "forgotten"
        } else {
            "nothing captured for it"
        }
        .to_owned()
    })
}

/// One line of standard input, without its line ending: a password, never an argument that
/// `ps` shows.
fn read_password() -> Result<zeroize::Zeroizing<String>> {
    use std::io::Read as _;
    let mut line = zeroize::Zeroizing::new(String::new());
    std::io::stdin()
        .take(64 << 10)
        .read_to_string(&mut line)
        .context("cannot read the password from standard input")?;
    let trimmed = line.trim_end_matches(['\n', '\r']);
    if trimmed.is_empty() || trimmed.contains('\n') {
        anyhow::bail!("expected the password as one line on standard input");
    }
    Ok(zeroize::Zeroizing::new(trimmed.to_owned()))
}

pub(super) async fn list_tracked(
    creds: &mut CredentialsClient<Channel>,
    consumer: Option<String>,
    out: Output,
) -> Result<Outcome> {
    let r = answer(creds.list_tracked(pb::ListTrackedRequest {
        consumer: consumer.unwrap_or_default(),
    }))
    .await?;
    if out == Output::Json {
        json(&r)?;
    } else if r.refs.is_empty() {
        println!("nothing tracked");
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
                    if t.flushed {
                        "flushed".into()
                    } else {
                        time_ms(t.expires_at_unix_ms)
                    },
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
                "NEXT_RENEWAL",
                "FAILURES",
                "LAST_ERROR",
            ],
            &rows,
        );
    }
    Ok(Outcome::Yes)
}

pub(super) async fn watch(
    creds: &mut CredentialsClient<Channel>,
    refs: Vec<String>,
    count: Option<u64>,
    out: Output,
) -> Result<Outcome> {
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
                .map(|c| format!("{}@{}", plain(&c.username), plain(&c.source)))
                .collect();
            println!(
                "{} revision {}: {}",
                plain(&event.r#ref),
                event.revision,
                users.join(", ")
            );
        }
        seen += 1;
        if count.is_some_and(|n| seen >= n) {
            break;
        }
    }
    Ok(Outcome::Yes)
}
