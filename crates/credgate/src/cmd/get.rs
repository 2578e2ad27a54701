//! `credgate get IMAGE`: the credentials a puller would try, in order, with their source,
//! pattern and expiry: from the running agent when there is one, else computed in-process from
//! the kubelet's config and plugins.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use credgate_api::v1::credentials_client::CredentialsClient;
use credgate_api::v1::LookupRequest as WireLookup;
use credgate_engine::Sources;
use credgate_engine::{Credential, Engine, LookupRequest};
use secrecy::ExposeSecret;
use serde::Serialize;

use super::print::{print_table, rfc3339, whole_seconds};
use crate::opts::{GetArgs, Output, PerProvider, SourceArgs};
use crate::{usage, Outcome};

/// One credential as `get` and `ctl lookup` print it.
#[derive(Serialize)]
pub struct Row {
    pub provider: String,
    pub source: String,
    pub pattern: String,
    pub username: String,
    pub password: String,
    pub expires_at: Option<String>,
}

impl Row {
    fn from_engine(c: &Credential) -> Row {
        Row {
            provider: c.source.name().to_owned(),
            source: c.source.kind().as_str().to_owned(),
            pattern: c.pattern.clone(),
            username: c.username.clone(),
            password: c.password.expose_secret().to_owned(),
            expires_at: c.expires_at.map(rfc3339),
        }
    }

    /// The PROVIDER cell of a table: a captured pod credential names its namespace.
    fn provider_cell(&self) -> String {
        if self.source == "captured" {
            format!("captured ({})", self.provider)
        } else {
            self.provider.clone()
        }
    }

    pub fn from_wire(c: &credgate_api::v1::Credential) -> Row {
        Row {
            provider: c.source.clone(),
            source: credgate_api::v1::SourceKind::try_from(c.source_kind)
                .map_or("unspecified", credgate_api::v1::SourceKind::word)
                .to_owned(),
            pattern: c.pattern.clone(),
            username: c.username.clone(),
            password: c.password.clone(),
            expires_at: (c.expires_at_unix_ms > 0).then(|| {
                rfc3339(
                    SystemTime::UNIX_EPOCH
                        + Duration::from_millis(c.expires_at_unix_ms.unsigned_abs()),
                )
            }),
        }
    }
}

/// Which agent `get` (and `explain`) should ask, if any.
pub fn agent_socket(socket: Option<&PathBuf>, sources: &SourceArgs) -> Option<PathBuf> {
    if let Some(p) = socket {
        return Some(p.clone());
    }
    if std::env::var_os(credgate_api::SOCKET_ENV).is_some_and(|v| !v.is_empty()) {
        return Some(credgate_api::socket_path(None));
    }
    if sources.image_credential_provider_config.is_some() {
        return None;
    }
    let default = credgate_api::default_socket_path();
    default.exists().then_some(default)
}

/// Without an agent, this process reads the flags' sources: refused when there is none at all
/// (explicit docker configs are read, a missing one an error as in serve; the default ones
/// only when they exist), with a warning when only docker configs are.
pub fn require_a_source(args: &crate::opts::SourceArgs) -> Result<()> {
    let defaults = args.docker_config.is_empty();
    if defaults && args.image_credential_provider_config.is_none() {
        let read = sources(args)?
            .docker_configs
            .into_iter()
            .filter(|p| p.exists())
            .count();
        let socket = credgate_api::default_socket_path();
        if read == 0 {
            anyhow::bail!(
                "no agent at {} and no --image-credential-provider-config or docker config to read: start `credgate serve`, or pass --socket or a provider config",
                socket.display()
            );
        }
        eprintln!(
            "warning: no agent at {} and no --image-credential-provider-config: only docker config files were read",
            socket.display()
        );
    }
    Ok(())
}

pub async fn run(args: GetArgs) -> Result<Outcome> {
    // An invalid reference is a usage error, whatever else is missing.
    if let Err(e) = credgate_core::reference::ImageRef::parse(&args.image) {
        return Err(usage(format!(
            "invalid image reference {:?}: {e}",
            args.image
        )));
    }
    let min_valid_for = args.min_valid_for.unwrap_or_default();
    let (image, rows, warnings) = match agent_socket(args.socket.as_ref(), &args.sources) {
        Some(socket) => remote(&socket, &args.image, min_valid_for).await?,
        None => {
            require_a_source(&args.sources)?;
            let engine = build_engine(&args.sources)?;
            let request = LookupRequest {
                image: &args.image,
                min_valid_for,
                ..Default::default()
            };
            let lookup = engine.lookup(&request).await.context("lookup failed")?;
            let rows = lookup.credentials.iter().map(Row::from_engine).collect();
            let warnings = lookup.errors.iter().map(ToString::to_string).collect();
            (lookup.image, rows, warnings)
        }
    };
    for w in &warnings {
        eprintln!("warning: {}", super::print::plain(w));
    }
    print_rows(&rows, args.output)?;
    if rows.is_empty() {
        eprintln!("no credentials for {}", super::print::plain(&image));
        return Ok(Outcome::No);
    }
    Ok(Outcome::Yes)
}

async fn remote(
    socket: &Path,
    image: &str,
    min_valid_for: Duration,
) -> Result<(String, Vec<Row>, Vec<String>)> {
    let channel = credgate_api::connect(socket)
        .await
        .with_context(|| format!("cannot reach the agent at {}", socket.display()))?;
    let answer = CredentialsClient::new(channel)
        .lookup(WireLookup {
            image: image.to_owned(),
            min_valid_for_ms: u64::try_from(min_valid_for.as_millis()).unwrap_or(u64::MAX),
            ..Default::default()
        })
        .await
        .map_err(|s| anyhow::anyhow!("lookup failed: {}", s.message()))?
        .into_inner();
    let rows = answer.credentials.iter().map(Row::from_wire).collect();
    let mut warnings: Vec<String> = answer.failures.iter().map(|f| f.message.clone()).collect();
    if answer.last_known_good {
        warnings.push("serving the last known good credentials of a tracked ref".into());
    }
    Ok((answer.image, rows, warnings))
}

/// The engine's sources, from the flags.
pub fn sources(args: &SourceArgs) -> Result<Sources> {
    let (default_timeout, timeouts) = timeouts(&args.plugin_timeout);
    let docker_configs = if args.no_docker_config {
        Vec::new()
    } else if !args.docker_config.is_empty() {
        args.docker_config.clone()
    } else {
        Sources::default_docker_configs()
    };
    Ok(Sources {
        provider_config: args.image_credential_provider_config.clone(),
        bin_dir: args.image_credential_provider_bin_dir.clone(),
        docker_configs,
        default_timeout: Some(default_timeout),
        timeouts,
        min_cache_durations: args
            .min_cache_duration
            .iter()
            .filter_map(|f| Some((f.name.clone()?, f.duration)))
            .collect(),
        plugin_rates: args.plugin_rate.iter().cloned().collect(),
    })
}

/// Builds an in-process engine from the flags.
pub fn build_engine(args: &SourceArgs) -> Result<Engine> {
    Ok(sources(args)?.build(None, None)?)
}

/// `--plugin-timeout`: the default (the last one without a name) and the per-provider ones.
fn timeouts(flags: &[PerProvider]) -> (Duration, HashMap<String, Duration>) {
    let mut default = Duration::from_secs(60);
    let mut per = HashMap::new();
    for flag in flags {
        match &flag.name {
            Some(name) => {
                per.insert(name.clone(), flag.duration);
            }
            None => default = flag.duration,
        }
    }
    (default, per)
}

/// Prints credentials: JSON with passwords, or a table without them.
pub fn print_rows(rows: &[Row], output: Output) -> Result<()> {
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(rows)?),
        Output::Table => {
            let cells: Vec<Vec<String>> = rows
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    vec![
                        (i + 1).to_string(),
                        r.provider_cell(),
                        r.pattern.clone(),
                        r.username.clone(),
                        r.expires_at
                            .as_deref()
                            .map(whole_seconds)
                            .unwrap_or_else(|| "-".into()),
                    ]
                })
                .collect();
            print_table(&["#", "PROVIDER", "PATTERN", "USERNAME", "EXPIRES"], &cells);
        }
    }
    Ok(())
}
