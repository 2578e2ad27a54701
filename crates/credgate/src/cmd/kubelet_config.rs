//! `credgate kubelet-config`: the kubelet `CredentialProviderConfig` that routes the kubelet
//! through `credgate-credential-provider` for everything the agent's config serves.
//!
//! One entry per agent provider, with the same name, `matchImages`, `defaultCacheDuration`,
//! wire version and `tokenAttributes` (the kubelet mints one token per entry, for that entry's
//! audience), and `args: [--provider, NAME]`. The kubelet executes `<its bin dir>/<NAME>`, so
//! its plugin directory needs one link per provider to the bridge: `--link-dir` makes them, and
//! the output says which are needed either way. The plugins themselves stay in the agent's
//! directory, run by the agent alone.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use credgate_core::config::{ProviderConfig, TokenCacheType};
use credgate_core::pattern::Pattern;
use credgate_engine::source::load_provider_config;

use crate::opts::KubeletConfigArgs;
use crate::Outcome;

/// A YAML scalar: JSON's quoting is valid YAML.
fn q(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// The entry `--captured-images` adds: the bridge with `--captured-only`.
pub const CAPTURED_ENTRY: &str = "credgate-captured";

/// The kubelet config for `config`; with `captured` patterns, a snapshotter's copy instead:
/// every entry with `--captured`, and the `credgate-captured` entry for those patterns.
pub fn render(
    config: &ProviderConfig,
    socket: Option<&Path>,
    max_cache: Option<std::time::Duration>,
    captured: &[Pattern],
) -> String {
    let mut out = String::from(
        "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n",
    );
    let snapshotter = !captured.is_empty();
    // Where the agent is, for every entry's bridge.
    let socket_args: Vec<String> = socket
        .map(|s| vec![q("--socket"), q(&s.display().to_string())])
        .unwrap_or_default();
    for p in &config.providers {
        let mut args = vec![q("--provider"), q(&p.name)];
        if snapshotter {
            args.push(q("--captured"));
        }
        args.extend(socket_args.iter().cloned());
        if let Some(d) = max_cache {
            let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 1_000_000);
            args.push(q("--max-cache-duration"));
            args.push(q(&credgate_core::duration::GoDuration(
                ms.saturating_mul(1_000_000),
            )
            .to_string()));
        }
        let ms =
            i64::try_from(p.default_cache_duration.as_millis()).unwrap_or(i64::MAX / 1_000_000);
        let duration = credgate_core::duration::GoDuration(ms.saturating_mul(1_000_000));
        entry(
            &mut out,
            &p.name,
            &p.match_images,
            &duration.to_string(),
            p.api_version.as_str(),
            &args,
        );
        if let Some(t) = &p.token_attributes {
            let keys = |k: &[String]| k.iter().map(|x| q(x)).collect::<Vec<_>>().join(", ");
            let cache = match t.cache_type {
                TokenCacheType::ServiceAccount => "ServiceAccount",
                TokenCacheType::Token => "Token",
            };
            let _ = write!(
                out,
                "    tokenAttributes:\n      serviceAccountTokenAudience: {}\n      cacheType: {}\n      requireServiceAccount: {}\n",
                q(&t.service_account_token_audience),
                q(cache),
                t.require_service_account,
            );
            if !t.required_annotation_keys.is_empty() {
                let _ = writeln!(
                    out,
                    "      requiredServiceAccountAnnotationKeys: [{}]",
                    keys(&t.required_annotation_keys)
                );
            }
            if !t.optional_annotation_keys.is_empty() {
                let _ = writeln!(
                    out,
                    "      optionalServiceAccountAnnotationKeys: [{}]",
                    keys(&t.optional_annotation_keys)
                );
            }
        }
    }
    if snapshotter {
        let mut args = vec![q("--captured-only")];
        args.extend(socket_args);
        entry(
            &mut out,
            CAPTURED_ENTRY,
            captured,
            "0s",
            "credentialprovider.kubelet.k8s.io/v1",
            &args,
        );
    }
    out
}

/// An entry's first lines: its name, patterns, default cache duration, wire version and
/// `args` (already quoted).
fn entry(
    out: &mut String,
    name: &str,
    match_images: &[Pattern],
    duration: &str,
    api_version: &str,
    args: &[String],
) {
    let patterns: Vec<String> = match_images.iter().map(|m| q(m.as_str())).collect();
    let _ = write!(
        out,
        "  - name: {}\n    matchImages: [{}]\n    defaultCacheDuration: {}\n    apiVersion: {}\n    args: [{}]\n",
        q(name),
        patterns.join(", "),
        q(duration),
        q(api_version),
        args.join(", "),
    );
}

/// The names of the links the plugin directory needs.
fn entries<'a>(config: &'a ProviderConfig, captured: &[Pattern]) -> Vec<&'a str> {
    let mut names: Vec<&str> = config.providers.iter().map(|p| p.name.as_str()).collect();
    if !captured.is_empty() {
        names.push(CAPTURED_ENTRY);
    }
    names
}

/// The bridge beside this program, where `cargo build` and the packages put it.
fn default_bridge() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("credgate-credential-provider")))
        .unwrap_or_else(|| PathBuf::from("credgate-credential-provider"))
}

pub fn run(args: KubeletConfigArgs) -> Result<Outcome> {
    let config =
        load_provider_config(&args.image_credential_provider_config).with_context(|| {
            format!(
                "invalid provider config {}",
                args.image_credential_provider_config.display()
            )
        })?;
    if let Some(dir) = &args.image_credential_provider_bin_dir {
        for p in &config.providers {
            let plugin = dir.join(&p.name);
            if !plugin.is_file() {
                anyhow::bail!(
                    "plugin binary {} for provider {} does not exist",
                    plugin.display(),
                    p.name
                );
            }
        }
    }
    if config.providers.iter().any(|p| p.name == CAPTURED_ENTRY) && !args.captured_images.is_empty()
    {
        anyhow::bail!("a provider is named {CAPTURED_ENTRY}, the entry --captured-images adds");
    }
    let names = entries(&config, &args.captured_images);
    // With pods' captured credentials the config is a lazy-pull snapshotter's, never the
    // kubelet's (it would hand one pod's secret to another's pull).
    let (consumer, bin_dir) = if args.captured_images.is_empty() {
        (
            "The kubelet (--image-credential-provider-bin-dir)",
            "KUBELET_BIN_DIR",
        )
    } else {
        (
            "The snapshotter (nydus-snapshotter's credential_provider_bin_dir; never the kubelet's)",
            "SNAPSHOTTER_BIN_DIR",
        )
    };
    let mut bridge = args.bridge.clone().unwrap_or_else(default_bridge);
    // A link to a missing bridge would fail only when the kubelet runs it; a relative path
    // would be read from the link's directory.
    if !bridge.is_file() {
        anyhow::bail!("the bridge {} does not exist", bridge.display());
    }
    bridge = std::path::absolute(&bridge)
        .with_context(|| format!("cannot make {} absolute", bridge.display()))?;
    let mut text = render(
        &config,
        args.socket.as_deref(),
        args.max_cache_duration,
        &args.captured_images,
    );
    match &args.link_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            if args.install {
                let copy = dir.join("credgate-credential-provider");
                write_atomically(
                    &copy,
                    &std::fs::read(&bridge)
                        .with_context(|| format!("cannot read {}", bridge.display()))?,
                    0o755,
                )?;
                // Links relative to their directory: valid wherever the directory is mounted.
                bridge = PathBuf::from("credgate-credential-provider");
            }
            for name in &names {
                let link = dir.join(name);
                if std::fs::symlink_metadata(&link).is_ok() {
                    std::fs::remove_file(&link)
                        .with_context(|| format!("cannot replace {}", link.display()))?;
                }
                std::os::unix::fs::symlink(&bridge, &link)
                    .with_context(|| format!("cannot link {}", link.display()))?;
            }
            let _ = writeln!(
                text,
                "# {}'s plugin directory is {}: one link per provider to {}.",
                consumer,
                dir.display(),
                bridge.display()
            );
        }
        None => {
            let _ = writeln!(
                text,
                "# {consumer}'s plugin directory needs one link per provider:"
            );
            for name in &names {
                let _ = writeln!(text, "#   ln -sf {} {bin_dir}/{name}", bridge.display());
            }
        }
    }
    match &args.output {
        Some(file) => write_atomically(file, text.as_bytes(), 0o644)?,
        None => print!("{text}"),
    }
    Ok(Outcome::Yes)
}

/// Writes `bytes` to a temporary file beside `path` and renames it into place.
fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot replace {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_provider_becomes_an_entry_of_the_bridge() {
        let yaml = br#"
apiVersion: kubelet.config.k8s.io/v1
kind: CredentialProviderConfig
providers:
- name: ecr
  matchImages: ["*.dkr.ecr.*.amazonaws.com", "public.ecr.aws"]
  defaultCacheDuration: 12h
  apiVersion: credentialprovider.kubelet.k8s.io/v1
  args: [get-credentials]
  env: [{name: AWS_PROFILE, value: node}]
- name: acr
  matchImages: ["*.azurecr.io"]
  defaultCacheDuration: 10m
  apiVersion: credentialprovider.kubelet.k8s.io/v1
  tokenAttributes:
    serviceAccountTokenAudience: api://AzureADTokenExchange
    cacheType: ServiceAccount
    requireServiceAccount: true
    requiredServiceAccountAnnotationKeys: [azure.workload.identity/client-id]
"#;
        let config = ProviderConfig::from_slice("in.yaml", yaml).unwrap();
        let out = render(&config, None, None, &[]);
        let back = ProviderConfig::from_slice("out.yaml", out.as_bytes()).unwrap();
        assert_eq!(back.providers.len(), 2);
        for (a, b) in config.providers.iter().zip(&back.providers) {
            assert_eq!(a.name, b.name);
            assert_eq!(a.match_images, b.match_images);
            assert_eq!(a.default_cache_duration, b.default_cache_duration);
            assert_eq!(a.api_version, b.api_version);
            assert_eq!(a.token_attributes, b.token_attributes);
            assert_eq!(b.args, ["--provider", a.name.as_str()]);
            assert!(
                b.env.is_empty(),
                "the plugin's environment stays with the agent"
            );
        }
        // A snapshotter's copy: every entry with --captured, and the captured-only entry.
        let captured = [Pattern::parse("registry.example.com").unwrap()];
        let out = render(&config, None, None, &captured);
        let back = ProviderConfig::from_slice("out.yaml", out.as_bytes()).unwrap();
        assert_eq!(back.providers.len(), 3);
        assert_eq!(back.providers[0].args, ["--provider", "ecr", "--captured"]);
        let last = &back.providers[2];
        assert_eq!(last.name, CAPTURED_ENTRY);
        assert_eq!(last.match_images, captured);
        assert_eq!(last.args, ["--captured-only"]);
        assert!(last.default_cache_duration.is_zero());
    }
}
