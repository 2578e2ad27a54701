//! `credgate ctl` commands of the `Admin` service whose answers need more than a line.

use anyhow::Result;
use credgate_api::v1::admin_client::AdminClient;
use credgate_api::v1::{self as pb};
use tonic::transport::Channel;

use super::print::{answer, json, plain, print_table, render_table, time_ms};
use crate::opts::Output;
use crate::Outcome;

pub(super) async fn status(admin: &mut AdminClient<Channel>, out: Output) -> Result<Outcome> {
    let r = answer(admin.status(pb::StatusRequest {})).await?;
    if out == Output::Json {
        json(&r)?;
    } else {
        let or_none = |s: &str| {
            if s.is_empty() {
                "none".to_owned()
            } else {
                plain(s).into_owned()
            }
        };
        println!("config:         {}", or_none(&r.config_path));
        println!("identity:       {}", or_none(&r.config_identity));
        println!("docker configs: {}", or_none(&r.docker_configs.join(", ")));
        println!("tracked refs:   {}", r.tracked_refs);
        println!("started:        {}", time_ms(r.started_unix_ms));
        println!("loaded:         {}", time_ms(r.loaded_unix_ms));
        println!("cri proxy:      {}", or_none(&r.cri_proxy));
        print_saved_cache(r.saved_cache.as_ref());
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
        for p in r.providers.iter().filter(|p| p.last_dropped_unix_ms != 0) {
            println!(
                "dropped:        provider {}'s cached answers at {}: {}",
                plain(&p.name),
                time_ms(p.last_dropped_unix_ms),
                plain(&p.last_dropped_reason)
            );
        }
        for p in r
            .providers
            .iter()
            .filter(|p| p.answers_refused_since_unix_ms != 0)
        {
            println!(
                "refused:        provider {} still answers the credential the registry refused (since {}): asked again every few seconds until its backend answers another",
                plain(&p.name),
                time_ms(p.answers_refused_since_unix_ms)
            );
        }
        println!();
        print_table(
            &[
                "PROVIDER",
                "RUNS",
                "ERRORS",
                "BACKOFF_REFUSALS",
                "ENTRIES",
                "LAST_RUN",
                "NEXT_RENEWAL",
                "LAST_ERROR",
            ],
            &rows,
        );
        print_node_images(&r.node_images);
    }
    Ok(Outcome::Yes)
}

/// The images the node keeps, below the providers: whether each is there, and how the agent
/// last pulled it.
fn print_node_images(images: &[pb::NodeImageStatus]) {
    print!("{}", node_images_text(images));
}

fn node_images_text(images: &[pb::NodeImageStatus]) -> String {
    if images.is_empty() {
        return String::new();
    }
    let rows: Vec<Vec<String>> = images
        .iter()
        .map(|i| {
            let pull = if i.pulled_unix_ms == 0 {
                "-".to_owned()
            } else {
                format!(
                    "{} at {} with {}",
                    i.pull_result,
                    time_ms(i.pulled_unix_ms),
                    i.pull_auth
                )
            };
            let retry = if i.retry_unix_ms == 0 {
                "-".to_owned()
            } else if i.failures == 0 {
                // Pulled, and held off before another pull: it was removed again soon.
                format!("{} (re-pulls held off)", time_ms(i.retry_unix_ms))
            } else {
                format!("{} (failure {})", time_ms(i.retry_unix_ms), i.failures)
            };
            vec![
                i.image.clone(),
                i.why.clone(),
                i.state.clone(),
                pull,
                retry,
                i.named_by.clone(),
            ]
        })
        .collect();
    let mut out = String::from("\n");
    out.push_str(&render_table(
        &[
            "NODE_IMAGE",
            "WHY",
            "STATE",
            "LAST_PULL",
            "RETRY",
            "NAMED_BY",
        ],
        &rows,
    ));
    // The runtime's message quotes the registry's body: outside text, one escaped line each.
    for i in images.iter().filter(|i| !i.pull_message.is_empty()) {
        out.push_str(&format!(
            "{}: {}\n",
            plain(&i.image),
            plain(&i.pull_message)
        ));
    }
    out
}

fn print_saved_cache(cache: Option<&pb::SavedCacheStatus>) {
    let Some(c) = cache.filter(|c| c.enabled) else {
        println!("saved cache:    off");
        return;
    };
    let dropped: Vec<String> = c.dropped.iter().map(|(k, v)| format!("{v} {k}")).collect();
    println!(
        "saved cache:    {} restored at start, {} dropped{}; {} consumer{} restored; {} saved {}",
        c.restored,
        c.dropped.values().sum::<u64>(),
        if dropped.is_empty() {
            String::new()
        } else {
            format!(" ({})", dropped.join(", "))
        },
        c.consumers_restored,
        if c.consumers_restored == 1 { "" } else { "s" },
        c.saved_entries,
        time_ms(c.last_saved_unix_ms)
    );
    if c.restored > 0 {
        println!(
            "                (restored answers are served with no plugin run: a provider's ENTRIES count them before its first RUN)"
        );
    }
}

pub(super) async fn flush(
    admin: &mut AdminClient<Channel>,
    provider: Option<String>,
    images: Vec<String>,
    out: Output,
) -> Result<Outcome> {
    let r = answer(admin.flush(pb::FlushRequest {
        provider: provider.unwrap_or_default(),
        images,
    }))
    .await?;
    if out == Output::Json {
        json(&r)?;
    } else if r.dropped.is_empty() {
        println!("nothing cached to drop");
    } else {
        let rows: Vec<Vec<String>> = r
            .dropped
            .iter()
            .map(|d| {
                vec![
                    d.provider.clone(),
                    pb::CacheKeyType::try_from(d.cache_key_type)
                        .map_or("unspecified", pb::CacheKeyType::word)
                        .to_owned(),
                    if d.key.is_empty() {
                        "*".into()
                    } else {
                        d.key.clone()
                    },
                    time_ms(d.expires_unix_ms),
                ]
            })
            .collect();
        println!(
            "dropped {} cached answer(s); the next lookup runs the plugin",
            rows.len()
        );
        print_table(
            &["PROVIDER", "KEY_TYPE", "KEY", "WOULD_HAVE_EXPIRED"],
            &rows,
        );
    }
    Ok(Outcome::Yes)
}

/// The last `max` characters of `message`, marked when cut: containerd puts what the registry
/// answered (`401 Unauthorized`) at the end of its messages.
fn tail(message: &str, max: usize) -> String {
    let n = message.chars().count();
    if n <= max {
        return message.to_owned();
    }
    let kept: String = message.chars().skip(n - (max - 1)).collect();
    format!("\u{2026}{kept}")
}

pub(super) async fn pulls(
    admin: &mut AdminClient<Channel>,
    image: Option<String>,
    out: Output,
) -> Result<Outcome> {
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
                    if p.pod_namespace.is_empty() && p.pod_name.is_empty() {
                        "-".into()
                    } else {
                        format!("{}/{}", p.pod_namespace, p.pod_name)
                    },
                    if p.node_image.is_empty() {
                        pull_auth(p)
                    } else {
                        // The agent pulled it itself, on the node's behalf.
                        format!("{} (node: {})", pull_auth(p), p.node_image)
                    },
                    if p.code == 0 {
                        "pulled".into()
                    } else {
                        pb::PullResult::try_from(p.result)
                            .map_or("unspecified", pb::PullResult::word)
                            .into()
                    },
                    tail(&p.message, 72),
                ]
            })
            .collect();
        print_table(&["AT", "IMAGE", "POD", "AUTH", "RESULT", "MESSAGE"], &rows);
        // What became of the credential of a pull that ended unauthorized, below the table.
        for p in r.pulls.iter().filter(|p| !p.refusal.is_empty()) {
            println!("{} {}: {}", time_ms(p.at_unix_ms), p.image, p.refusal);
        }
    }
    Ok(Outcome::Yes)
}

/// A pull's credential as the table names it: `none`, `unknown`, the source that gave it
/// (`provider:NAME`, `docker-config`, `captured`), `filled:` and the source the proxy filled in.
fn pull_auth(p: &pb::Pull) -> String {
    let source = match pb::SourceKind::try_from(p.source_kind) {
        Ok(pb::SourceKind::Provider) => format!("provider:{}", p.source),
        Ok(kind) => kind.word().to_owned(),
        Err(_) => "unspecified".to_owned(),
    };
    match pb::PullAuth::try_from(p.auth) {
        Ok(pb::PullAuth::Given) => source,
        Ok(pb::PullAuth::Filled) => format!("filled:{source}"),
        Ok(other) => other.word().to_owned(),
        Err(_) => "unspecified".to_owned(),
    }
}

pub(super) async fn captured(admin: &mut AdminClient<Channel>, out: Output) -> Result<Outcome> {
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
    Ok(Outcome::Yes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runtime's message that quotes a hostile registry's body (newlines, a forged log line,
    /// a window title and a clear screen) reaches the terminal as one escaped line.
    #[test]
    fn a_runtimes_message_is_printed_escaped() {
        let images = [pb::NodeImageStatus {
            image: "registry.example/pause:3.10".into(),
            why: "sandbox".into(),
            state: "ABSENT".into(),
            pulled_unix_ms: 1,
            pull_message:
                "401 Unauthorized\n2026-01-01T00:00:00Z  INFO forged\u{1b}]0;owned\u{7}\u{1b}[2J\r"
                    .into(),
            ..Default::default()
        }];
        let text = node_images_text(&images);
        assert!(
            !text.contains('\u{1b}') && !text.contains('\r') && !text.contains('\u{7}'),
            "{text:?}"
        );
        let last = text.lines().last().unwrap();
        assert!(
            last.starts_with("registry.example/pause:3.10: 401 Unauthorized\\n2026"),
            "{text}"
        );
        assert!(!text.lines().any(|l| l.starts_with("2026")), "{text}");
    }
}
