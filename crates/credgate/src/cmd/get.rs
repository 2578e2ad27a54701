//! `credgate get IMAGE`: the credentials a puller would try, in order, with their source,
//! pattern and expiry, computed in-process from the kubelet's config and plugins.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};
use credgate_engine::source::{load_docker_config, load_provider_config};
use credgate_engine::{Credential, Engine, EngineOptions, LookupRequest, Source};
use secrecy::ExposeSecret;
use serde::Serialize;

use crate::opts::{parse_duration, GetArgs, Output, SourceArgs};
use crate::Outcome;

pub async fn run(args: GetArgs) -> Result<Outcome> {
    let engine = build_engine(&args.sources)?;
    let request = LookupRequest {
        image: &args.image,
        min_valid_for: args.min_valid_for.unwrap_or_default(),
        service_account: None,
    };
    let lookup = engine.lookup(&request).await.context("lookup failed")?;
    for e in &lookup.errors {
        eprintln!("warning: {e}");
    }
    match args.output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&json_rows(&lookup.credentials))?
        ),
        Output::Table => print_table(&lookup.credentials),
    }
    if lookup.credentials.is_empty() {
        eprintln!("no credentials for {}", lookup.image);
        return Ok(Outcome::No);
    }
    Ok(Outcome::Yes)
}

/// Builds an in-process engine from the flags.
pub fn build_engine(args: &SourceArgs) -> Result<Engine> {
    let mut builder = Engine::builder();
    if let Some(path) = &args.image_credential_provider_config {
        let config = load_provider_config(path)
            .with_context(|| format!("invalid provider config {}", path.display()))?;
        let Some(dir) = args.image_credential_provider_bin_dir.clone() else {
            bail!("--image-credential-provider-bin-dir is required with --image-credential-provider-config");
        };
        let (default_timeout, timeouts) = timeouts(&args.plugin_timeout)?;
        builder = builder.config(config).options(EngineOptions {
            plugin_dir: dir,
            default_timeout,
            timeouts,
            ..Default::default()
        });
    }
    for path in docker_configs(args) {
        let source = load_docker_config(&path).context("invalid docker config")?;
        builder = builder.static_source(source);
    }
    builder
        .build()
        .context("cannot start the credential engine")
}

fn docker_configs(args: &SourceArgs) -> Vec<PathBuf> {
    if args.no_docker_config {
        return Vec::new();
    }
    if !args.docker_config.is_empty() {
        return args.docker_config.clone();
    }
    let mut candidates = vec![PathBuf::from("/var/lib/kubelet/config.json")];
    if let Some(home) = std::env::var_os("HOME") {
        candidates.push(PathBuf::from(home).join(".docker/config.json"));
    }
    candidates.push(PathBuf::from("/.docker/config.json"));
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .into_iter()
        .collect()
}

fn timeouts(flags: &[String]) -> Result<(Duration, HashMap<String, Duration>)> {
    let mut default = Duration::from_secs(60);
    let mut per = HashMap::new();
    for flag in flags {
        match flag.split_once('=') {
            Some((name, d)) => {
                per.insert(
                    name.to_owned(),
                    parse_duration(d).map_err(anyhow::Error::msg)?,
                );
            }
            None => default = parse_duration(flag).map_err(anyhow::Error::msg)?,
        }
    }
    Ok((default, per))
}

#[derive(Serialize)]
struct Row<'a> {
    provider: &'a str,
    source: &'static str,
    pattern: &'a str,
    username: &'a str,
    password: &'a str,
    expires_at: Option<String>,
}

fn source_kind(c: &Credential) -> &'static str {
    match c.source {
        Source::DockerConfig(_) => "docker-config",
        Source::Provider(_) => "provider",
    }
}

fn rfc3339(t: SystemTime) -> String {
    time::OffsetDateTime::from(t)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

fn json_rows(creds: &[Credential]) -> Vec<Row<'_>> {
    creds
        .iter()
        .map(|c| Row {
            provider: c.source.name(),
            source: source_kind(c),
            pattern: &c.pattern,
            username: &c.username,
            password: c.password.expose_secret(),
            expires_at: c.expires_at.map(rfc3339),
        })
        .collect()
}

fn print_table(creds: &[Credential]) {
    if creds.is_empty() {
        return;
    }
    let rows: Vec<[String; 5]> = creds
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let whole_seconds = |t: SystemTime| {
                let secs = t
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
            };
            let expires = c
                .expires_at
                .map(whole_seconds)
                .unwrap_or_else(|| "-".into());
            [
                (i + 1).to_string(),
                c.source.name().to_owned(),
                c.pattern.clone(),
                c.username.clone(),
                expires,
            ]
        })
        .collect();
    let header = ["#", "PROVIDER", "PATTERN", "USERNAME", "EXPIRES"].map(String::from);
    let mut widths = [0usize; 5];
    for row in std::iter::once(&header).chain(&rows) {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", cells.join("  ").trim_end());
    }
}
