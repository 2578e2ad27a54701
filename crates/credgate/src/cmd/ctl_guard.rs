//! `credgate ctl` commands of the `ImageAccess` service.

use std::time::{Duration, SystemTime};

use anyhow::Result;
use credgate_api::v1::image_access_client::ImageAccessClient;
use credgate_api::v1::pull_credential::Kind;
use credgate_api::v1::{self as pb};
use tonic::transport::Channel;

use super::print::{answer, decision_name, json, plain, print_table, show, time_ms};
use crate::opts::{CredentialArgs, CtlCall, Output, PullPolicyArg};
use crate::{usage, Outcome};

/// `NAMESPACE/NAME[/UID]` of flag `what`.
pub(super) fn object(s: &str, what: &str) -> Result<pb::ObjectRef> {
    let parts: Vec<&str> = s.split('/').collect();
    match parts.as_slice() {
        [ns, name] | [ns, name, ""] => Ok(pb::ObjectRef {
            namespace: (*ns).into(),
            name: (*name).into(),
            uid: String::new(),
        }),
        [ns, name, uid] => Ok(pb::ObjectRef {
            namespace: (*ns).into(),
            name: (*name).into(),
            uid: (*uid).into(),
        }),
        _ => Err(usage(format!(
            "{what} {s:?}: expected NAMESPACE/NAME[/UID]"
        ))),
    }
}

/// The credentials of the flags: secrets, then service accounts, then node-wide.
pub fn credentials(args: &CredentialArgs) -> Result<Vec<pb::PullCredential>> {
    let mut out = Vec::new();
    for s in &args.secret {
        let Some((who, cred)) = s.split_once('=') else {
            return Err(usage(
                "--secret: expected NAMESPACE/NAME[/UID]=USERNAME:PASSWORD",
            ));
        };
        let Some((username, password)) = cred.split_once(':') else {
            return Err(usage(
                "--secret: expected NAMESPACE/NAME[/UID]=USERNAME:PASSWORD",
            ));
        };
        out.push(pb::PullCredential::secret(
            object(who, "--secret")?,
            username,
            password,
        ));
    }
    for sa in &args.service_account {
        out.push(pb::PullCredential {
            kind: Some(Kind::ServiceAccount(object(sa, "--service-account")?)),
        });
    }
    if args.node_wide {
        out.push(pb::PullCredential::node_wide());
    }
    Ok(out)
}

/// `--present IMAGE_ID=REFERENCE[,REFERENCE...]`, repeatable.
fn present_images(present: &[String]) -> Result<Vec<pb::PresentImage>> {
    present
        .iter()
        .map(|p| {
            let (id, refs) = p.split_once('=').ok_or_else(|| {
                usage(format!(
                    "--present {p:?}: expected IMAGE_ID=REFERENCE[,REFERENCE...]"
                ))
            })?;
            Ok(pb::PresentImage {
                image_ref: id.into(),
                references: refs.split(',').map(str::to_owned).collect(),
            })
        })
        .collect()
}

/// Checks the flags' syntax before anything is asked of the agent, so that a usage error is
/// reported as one (exit 2) even when the agent cannot be reached. Its messages never repeat
/// a `--secret` value.
pub fn check_args(call: &CtlCall) -> Result<()> {
    // Images and image IDs are checked here, before connecting: a usage error (exit 2), as
    // clap's own.
    let images: Vec<&String> = match call {
        CtlCall::CheckAccess { image, .. }
        | CtlCall::RecordIntent { image }
        | CtlCall::RecordResult { image, .. }
        | CtlCall::Verify { image, .. }
        | CtlCall::ReportRefused { image, .. }
        | CtlCall::Pulls { image: Some(image) }
        | CtlCall::Lookup {
            image,
            registry_host: false,
            ..
        } => vec![image],
        CtlCall::Flush { images, .. } => images.iter().collect(),
        CtlCall::Track { refs, .. }
        | CtlCall::Untrack { refs, .. }
        | CtlCall::SetTracked { refs, .. }
        | CtlCall::Watch { refs, .. } => refs.iter().collect(),
        CtlCall::Captured {
            action: Some(crate::opts::CapturedAction::Forget { repository }),
        } => vec![repository],
        _ => Vec::new(),
    };
    for image in images {
        if let Err(e) = credgate_core::reference::ImageRef::parse(image) {
            return Err(crate::usage(format!(
                "invalid image reference {}: {e}",
                credgate_core::text::Quoted(image)
            )));
        }
    }
    let ids: Vec<&String> = match call {
        CtlCall::CheckAccess {
            image_ref: Some(id),
            ..
        }
        | CtlCall::RecordResult {
            image_ref: Some(id),
            ..
        }
        | CtlCall::Verify { image_ref: id, .. }
        | CtlCall::GetRecord { image_ref: id }
        | CtlCall::DeleteRecord { image_ref: id } => vec![id],
        _ => Vec::new(),
    };
    for id in ids {
        image_id(id)?;
    }
    match call {
        CtlCall::CheckAccess { credentials: c, .. }
        | CtlCall::RecordResult { credentials: c, .. }
        | CtlCall::Verify { credentials: c, .. } => credentials(c).map(drop),
        CtlCall::Prune { present, .. } => present_images(present).map(drop),
        _ => Ok(()),
    }
}

/// A runtime's image ID as the runtimes give it: 64 lowercase hex digits, after `sha256:`
/// (containerd) or alone (CRI-O's ImageStatus). One digit repeated 64 times is a placeholder,
/// not an ID.
fn image_id(id: &str) -> Result<()> {
    let hex = id.strip_prefix("sha256:").unwrap_or(id);
    let digits = hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let placeholder = hex.bytes().all(|b| Some(b) == hex.bytes().next());
    if !digits || placeholder {
        return Err(crate::usage(format!(
            "invalid image ID {}: expected 64 hex digits, with or without sha256:, as the runtime reports it (crictl images --digests, crictl inspecti)",
            credgate_core::text::Quoted(id)
        )));
    }
    Ok(())
}

/// `ALLOW (secret_match): ...`: a decision, its reason and its message on one line.
fn decision_line(decision: i32, reason: &str, message: &str) -> String {
    format!(
        "{} ({}): {}",
        decision_name(decision),
        plain(reason),
        plain(message)
    )
}

fn print_record(r: &pb::PullRecord) {
    let rows: Vec<Vec<String>> = r
        .names
        .iter()
        .map(|n| {
            let mut who: Vec<String> = n
                .secrets
                .iter()
                .filter_map(|s| s.secret.as_ref())
                .map(|o| format!("secret {}/{}", o.namespace, o.name))
                .collect();
            who.extend(
                n.service_accounts
                    .iter()
                    .map(|o| format!("sa {}/{}", o.namespace, o.name)),
            );
            if n.node_accessible {
                who.push("node-wide".into());
            }
            vec![
                r.image_ref.clone(),
                n.name.clone(),
                if who.is_empty() {
                    "(none)".into()
                } else {
                    who.join(", ")
                },
                time_ms(n.changed_unix_ms),
            ]
        })
        .collect();
    print_table(&["IMAGE_ID", "NAME", "PULLED_BY", "CHANGED"], &rows);
}

type Client = ImageAccessClient<Channel>;

/// One `ImageAccess` RPC; the longer ones print in their own functions below.
pub async fn call(channel: Channel, call: CtlCall, out: Output) -> Result<Outcome> {
    let mut guard = ImageAccessClient::new(channel);
    match call {
        CtlCall::CheckAccess {
            image,
            image_ref,
            absent,
            pull_policy,
            credentials: creds,
        } => {
            return check_access(
                &mut guard,
                image,
                image_ref,
                absent,
                pull_policy,
                creds,
                out,
            )
            .await
        }
        CtlCall::RecordIntent { image } => {
            answer(guard.record_pull_intent(pb::RecordPullIntentRequest { image })).await?;
            if out == Output::Json {
                json(&serde_json::json!({}))?;
            } else {
                println!("intent recorded");
            }
        }
        CtlCall::RecordResult {
            image,
            image_ref,
            failed,
            credentials: creds,
        } => return record_result(&mut guard, image, image_ref, failed, creds, out).await,
        CtlCall::Verify {
            image,
            image_ref,
            expected_digest,
            credentials: creds,
        } => return verify(&mut guard, image, image_ref, expected_digest, creds, out).await,
        CtlCall::Prune {
            present,
            older_than,
        } => return prune(&mut guard, present, older_than, out).await,
        CtlCall::ListRecords => return list_records(&mut guard, out).await,
        CtlCall::GetRecord { image_ref } => {
            let r = answer(guard.get_record(pb::GetRecordRequest { image_ref })).await?;
            if out == Output::Json {
                json(&r)?;
            } else if let Some(rec) = &r.record {
                print_record(rec);
            }
        }
        CtlCall::DeleteRecord { image_ref } => {
            let r = answer(guard.delete_record(pb::DeleteRecordRequest {
                image_ref: image_ref.clone(),
            }))
            .await?;
            if out == Output::Json {
                json(&r)?;
            } else if r.deleted {
                println!("deleted");
            } else {
                // A failure, said where failures go (as get-record says it).
                eprintln!("error: no record of {image_ref}");
            }
            return Ok(if r.deleted { Outcome::Yes } else { Outcome::No });
        }
        _ => unreachable!("only ImageAccess calls are routed here"),
    }
    Ok(Outcome::Yes)
}

async fn verify(
    guard: &mut Client,
    image: String,
    image_ref: String,
    expected_digest: Option<String>,
    creds: CredentialArgs,
    out: Output,
) -> Result<Outcome> {
    let r = answer(guard.verify(pb::VerifyRequest {
        image,
        image_ref,
        expected_digest: expected_digest.unwrap_or_default(),
        credentials: credentials(&creds)?,
    }))
    .await?;
    show(out, &r, |r| {
        decision_line(
            r.decision,
            pb::VerifyReason::try_from(r.reason).map_or("unspecified", pb::VerifyReason::word),
            &r.message,
        )
    })?;
    Ok(if r.credential_index >= 0 {
        Outcome::Yes
    } else {
        Outcome::No
    })
}

async fn check_access(
    guard: &mut Client,
    image: String,
    image_ref: Option<String>,
    absent: bool,
    pull_policy: PullPolicyArg,
    creds: CredentialArgs,
    out: Output,
) -> Result<Outcome> {
    let policy = match pull_policy {
        PullPolicyArg::Always => pb::PullPolicy::Always,
        PullPolicyArg::IfNotPresent => pb::PullPolicy::IfNotPresent,
        PullPolicyArg::Never => pb::PullPolicy::Never,
    };
    let r = answer(guard.check_access(pb::CheckAccessRequest {
        image,
        image_ref: image_ref.unwrap_or_default(),
        present: !absent,
        pull_policy: policy as i32,
        credentials: credentials(&creds)?,
    }))
    .await?;
    show(out, &r, |r| {
        decision_line(
            r.decision,
            pb::AccessReason::try_from(r.reason).map_or("unspecified", pb::AccessReason::word),
            &r.message,
        )
    })?;
    let allowed = matches!(
        pb::Decision::try_from(r.decision),
        Ok(pb::Decision::Allow | pb::Decision::Pull)
    );
    Ok(if allowed { Outcome::Yes } else { Outcome::No })
}

async fn record_result(
    guard: &mut Client,
    image: String,
    image_ref: Option<String>,
    failed: bool,
    creds: CredentialArgs,
    out: Output,
) -> Result<Outcome> {
    let mut list = credentials(&creds)?;
    if list.len() > 1 {
        return Err(usage(
            "a pull used one credential: give one --secret, --service-account or --node-wide",
        ));
    }
    answer(guard.record_pull_result(pb::RecordPullResultRequest {
        image,
        image_ref: image_ref.unwrap_or_default(),
        success: !failed,
        credential: list.pop(),
    }))
    .await?;
    if out == Output::Json {
        json(&serde_json::json!({}))?;
    } else {
        println!(
            "{}",
            if failed {
                "failed pull recorded"
            } else {
                "pull recorded"
            }
        );
    }
    Ok(Outcome::Yes)
}

async fn prune(
    guard: &mut Client,
    present: Vec<String>,
    older_than: Duration,
    out: Output,
) -> Result<Outcome> {
    let images = present_images(&present)?;
    let before = SystemTime::now()
        .checked_sub(older_than)
        .unwrap_or(SystemTime::UNIX_EPOCH)
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    let r = answer(guard.prune(pb::PruneRequest {
        present: images,
        before_unix_ms: i64::try_from(before.as_millis()).unwrap_or(i64::MAX),
    }))
    .await?;
    show(out, &r, |r| {
        format!(
            "records deleted: {}, intents recovered: {}, intents dropped: {}",
            r.records_deleted, r.intents_recovered, r.intents_dropped
        )
    })?;
    Ok(Outcome::Yes)
}

async fn list_records(guard: &mut Client, out: Output) -> Result<Outcome> {
    // Every page, one after another: one answer never holds them all.
    let mut r = pb::ListRecordsResponse::default();
    let mut token = String::new();
    loop {
        let page = answer(guard.list_records(pb::ListRecordsRequest {
            page_size: 0,
            page_token: std::mem::take(&mut token),
        }))
        .await?;
        r.records.extend(page.records);
        r.intents.extend(page.intents);
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    if out == Output::Json {
        json(&r)?;
    } else {
        for rec in &r.records {
            print_record(rec);
        }
        for i in &r.intents {
            println!(
                "intent: {} (x{}) since {}",
                plain(&i.image),
                i.count,
                time_ms(i.created_unix_ms)
            );
        }
    }
    Ok(Outcome::Yes)
}

#[cfg(test)]
mod tests {
    use super::image_id;

    /// containerd's IDs and CRI-O's (no `sha256:`) are taken; short, upper-case and
    /// placeholder ones are refused.
    #[test]
    fn every_id_a_runtime_reports_is_taken_and_placeholders_are_not() {
        let hex = "f4ca02b8471e2ff50a0736c6227c3d1d44afee519cc84dab5be18b5556032bfb";
        assert!(image_id(&format!("sha256:{hex}")).is_ok());
        assert!(image_id(hex).is_ok());
        for bad in [
            "sha256:0123".to_owned(),
            format!("sha256:{}", hex.to_uppercase()),
            format!("sha512:{hex}"),
            "0".repeat(64),
            format!("sha256:{}", "f".repeat(64)),
        ] {
            assert!(image_id(&bad).is_err(), "{bad}");
        }
    }
}
