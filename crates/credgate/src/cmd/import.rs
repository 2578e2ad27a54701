//! `credgate import containerd`: containerd's CRI registry auth (deprecated, removed in
//! containerd 2.7) into a docker config the agent reads, with the `--cri-proxy-fill` patterns
//! that keep CRI pulls without credentials working as containerd's static auth made them.
//!
//! Where containerd keeps it, by config version: `plugins.cri.registry` (1),
//! `plugins."io.containerd.grpc.v1.cri".registry` (2: containerd 1.x), and
//! `plugins."io.containerd.cri.v1.images".registry` (3: containerd 2.x); in each,
//! `configs."HOST".auth` (`username`/`password`, `auth` = base64 of user:password,
//! `identitytoken`) and the older `auths."URL"` of the same fields. All are read.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context as _, Result};
use secrecy::{ExposeSecret as _, SecretString};

use crate::opts::ImportContainerdArgs;
use crate::Outcome;

/// Why a containerd config gave nothing to import. Never carries credential content.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImportError {
    #[error("not a TOML file (line {line}): {message}")]
    Toml { line: usize, message: String },
    #[error("no registry auth in it: nothing to import (looked for registry.configs.\"HOST\".auth and registry.auths under plugins.\"io.containerd.grpc.v1.cri\", plugins.\"io.containerd.cri.v1.images\" and plugins.cri)")]
    NoAuth,
    #[error("{table}: `auth` is not base64 of user:password")]
    BadAuth { table: String },
    #[error("{table}: an identitytoken cannot go into a docker config the agent reads; keep this registry in containerd's config, or serve it with a credential provider")]
    IdentityToken { table: String },
    #[error("{table}: neither username and password nor auth")]
    Empty { table: String },
    #[error("{table}: not a table")]
    NotATable { table: String },
    #[error("{table}: `{field}` is not a string")]
    NotAString { table: String, field: String },
    #[error("registry {}: not a registry host[:port]", credgate_core::text::Quoted(.0))]
    BadHost(String),
}

/// One registry's credential, and the table it came from.
pub struct Entry {
    pub host: String,
    pub table: String,
    pub username: String,
    pub password: SecretString,
}

/// Where each config version keeps the CRI registry settings.
const PLUGINS: [&str; 3] = [
    "io.containerd.grpc.v1.cri",
    "io.containerd.cri.v1.images",
    "cri",
];

/// The registry credentials of a containerd config, by host; when tables name one host twice,
/// the first read wins (version 2's plugin before 3's and 1's, `configs` before `auths`).
pub fn parse(text: &str) -> Result<Vec<Entry>, ImportError> {
    let doc = table(text)?;
    let mut out: BTreeMap<String, Entry> = BTreeMap::new();
    let plugins = doc.get("plugins").and_then(|p| p.as_table());
    for plugin in PLUGINS {
        let Some(registry) = plugins
            .and_then(|p| p.get(plugin))
            .and_then(|p| p.as_table())
            .and_then(|p| p.get("registry"))
            .and_then(|r| r.as_table())
        else {
            continue;
        };
        let prefix = format!("plugins.\"{plugin}\".registry");
        if let Some(configs) = registry.get("configs").and_then(|c| c.as_table()) {
            for (host, config) in configs {
                let Some(auth) = config.as_table().and_then(|c| c.get("auth")) else {
                    continue;
                };
                let table = format!("{prefix}.configs.\"{host}\".auth");
                let entry = entry(host, table, auth)?;
                out.entry(entry.host.clone()).or_insert(entry);
            }
        }
        if let Some(auths) = registry.get("auths").and_then(|a| a.as_table()) {
            for (url, auth) in auths {
                let table = format!("{prefix}.auths.\"{url}\"");
                let host = url.split_once("://").map_or(url.as_str(), |(_, h)| h);
                let host = host.trim_end_matches('/');
                let entry = entry(host, table, auth)?;
                out.entry(entry.host.clone()).or_insert(entry);
            }
        }
    }
    if out.is_empty() {
        return Err(ImportError::NoAuth);
    }
    Ok(out.into_values().collect())
}

/// A containerd config as TOML.
fn table(text: &str) -> Result<toml::Table, ImportError> {
    text.parse()
        .map_err(|e: toml::de::Error| ImportError::Toml {
            line: e.span().map_or(0, |s| {
                text[..s.start.min(text.len())].lines().count().max(1)
            }),
            message: e.message().lines().next().unwrap_or_default().to_owned(),
        })
}

/// A registry `host[:port]`: letters, digits, `.`, `-`, `_`, and a port, or an IPv6 literal in
/// brackets. Anything else (a newline, a quote, a space) is no
/// registry, and would be printed into the suggested command.
fn valid_host(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 255
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._:[]".contains(&b))
}

fn entry(host: &str, table: String, auth: &toml::Value) -> Result<Entry, ImportError> {
    if !valid_host(host) {
        return Err(ImportError::BadHost(host.to_owned()));
    }
    let Some(auth) = auth.as_table() else {
        return Err(ImportError::NotATable { table });
    };
    for (name, value) in auth {
        if !value.is_str() {
            return Err(ImportError::NotAString {
                table,
                field: name.clone(),
            });
        }
    }
    let field = |name: &str| {
        auth.get(name)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let (username, password) = (field("username"), field("password"));
    let (username, password) = if !username.is_empty() || !password.is_empty() {
        (username, SecretString::from(password))
    } else if !field("auth").is_empty() {
        credgate_core::dockerconfig::decode_auth(&field("auth")).ok_or_else(|| {
            ImportError::BadAuth {
                table: table.clone(),
            }
        })?
    } else if !field("identitytoken").is_empty() {
        return Err(ImportError::IdentityToken { table });
    } else {
        return Err(ImportError::Empty { table });
    };
    Ok(Entry {
        host: host.to_owned(),
        table,
        username,
        password,
    })
}

/// The docker config of `entries`.
pub fn docker_config(entries: &[Entry]) -> String {
    use base64::Engine as _;
    let auths: serde_json::Map<String, serde_json::Value> = entries
        .iter()
        .map(|e| {
            let auth = base64::engine::general_purpose::STANDARD.encode(format!(
                "{}:{}",
                e.username,
                e.password.expose_secret()
            ));
            (e.host.clone(), serde_json::json!({ "auth": auth }))
        })
        .collect();
    let mut text = serde_json::to_string_pretty(&serde_json::json!({ "auths": auths }))
        .expect("JSON of strings");
    text.push('\n');
    text
}

pub fn containerd(args: ImportContainerdArgs) -> Result<Outcome> {
    let path = &args.config;
    let text = crate::runtime_config::read_config(path)?;
    let entries =
        parse(&text).with_context(|| format!("nothing imported from {}", path.display()))?;
    write_secret(&args.output, docker_config(&entries).as_bytes(), args.force)?;
    // The printed command runs from anywhere: paths as absolute ones.
    let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_owned());
    let socket = grpc_address(&text);
    print!(
        "{}",
        summary(&absolute(path), &absolute(&args.output), &socket, &entries)
    );
    Ok(Outcome::Yes)
}

/// The socket containerd's config serves its CRI on (`[grpc] address`), or containerd's
/// default.
fn grpc_address(text: &str) -> String {
    table(text)
        .ok()
        .and_then(|doc| {
            doc.get("grpc")?
                .get("address")?
                .as_str()
                .filter(|a| !a.is_empty())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "/run/containerd/containerd.sock".to_owned())
}

/// What was done and what is left to do (no secret).
fn summary(config: &Path, output: &Path, socket: &str, entries: &[Entry]) -> String {
    let mut out = format!(
        "imported {} registr{} from {} into {} (mode 0600):\n",
        entries.len(),
        if entries.len() == 1 { "y" } else { "ies" },
        config.display(),
        output.display()
    );
    for e in entries {
        out.push_str(&format!("  {}\n", e.host));
    }
    out.push_str(&format!(
        "\nRemove these tables from {} (then restart containerd):\n",
        config.display()
    ));
    for e in entries {
        out.push_str(&format!("  [{}]\n", e.table));
    }
    out.push_str("\nServe them through the agent's CRI proxy, for pulls that come without credentials as containerd did:\n");
    out.push_str(&format!(
        "  credgate serve --docker-config {} \\\n      --cri-proxy-socket /run/credgate/cri.sock \\\n      --cri-runtime-endpoint unix://{socket} \\\n      --cri-runtime-config {}",
        output.display(),
        config.display()
    ));
    for e in entries {
        out.push_str(&format!(" \\\n      --cri-proxy-fill {}", e.host));
    }
    out.push_str("\nand point the kubelet's --image-service-endpoint (and crictl's) at /run/credgate/cri.sock.\n");
    out
}

/// Writes `bytes` to `path`, mode 0600 from its creation, atomically and fsynced (the
/// agent's own state-file writer); an existing `path` is replaced only with `force`.
fn write_secret(path: &Path, bytes: &[u8], force: bool) -> Result<()> {
    use credgate_agent::state::{write_atomically, write_new};
    let file = path
        .file_name()
        .and_then(|f| f.to_str())
        .with_context(|| format!("{} names no file", path.display()))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    // Another user who can write the directory, or one above it, could replace the file the
    // agent then reads credentials from.
    credgate_api::trust::check_dir(dir, credgate_api::trust::Owner::MeOrRoot)
        .and_then(|()| credgate_api::trust::check_ancestors(path))
        .with_context(|| format!("not writing {}", path.display()))?;
    let written = if force {
        write_atomically(dir, file, &[bytes])
    } else {
        write_new(dir, file, &[bytes])
    };
    match written {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => anyhow::bail!(
            "{} exists: not replaced (--force replaces it)",
            path.display()
        ),
        other => other.with_context(|| format!("cannot write {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V2: &str = r#"
version = 2
[plugins."io.containerd.grpc.v1.cri".registry.configs."registry.example.com".auth]
  username = "team"
  password = "s3cret-v2"
[plugins."io.containerd.grpc.v1.cri".registry.configs."registry.example.com".tls]
  insecure_skip_verify = true
[plugins."io.containerd.grpc.v1.cri".registry.configs."127.0.0.1:5000".auth]
  auth = "Ym90OnBhOnNz"
[plugins."io.containerd.grpc.v1.cri".registry.auths."https://gcr.io"]
  username = "_json_key"
  password = "k"
"#;

    #[test]
    fn version_2_configs_and_auths_are_read() {
        let got = parse(V2).unwrap();
        let hosts: Vec<&str> = got.iter().map(|e| e.host.as_str()).collect();
        assert_eq!(hosts, ["127.0.0.1:5000", "gcr.io", "registry.example.com"]);
        assert_eq!(got[0].username, "bot");
        assert_eq!(got[0].password.expose_secret(), "pa:ss");
        assert_eq!(got[2].password.expose_secret(), "s3cret-v2");
        assert_eq!(
            got[2].table,
            r#"plugins."io.containerd.grpc.v1.cri".registry.configs."registry.example.com".auth"#
        );
        let config = docker_config(&got);
        let parsed = credgate_core::dockerconfig::parse(config.as_bytes()).unwrap();
        assert_eq!(parsed.len(), 3);
        assert_eq!(parsed[2].1.password.expose_secret(), "s3cret-v2");
    }

    #[test]
    fn version_3_is_read() {
        let v3 = r#"
version = 3
[plugins."io.containerd.cri.v1.images".registry.configs."r.example:5000".auth]
  username = "u"
  password = "p3"
"#;
        let got = parse(v3).unwrap();
        assert_eq!(got[0].host, "r.example:5000");
        assert_eq!(got[0].password.expose_secret(), "p3");
    }

    #[test]
    fn bad_configs_are_refused_without_a_secret() {
        assert_eq!(
            parse("version = 2\n[plugins]\n").err(),
            Some(ImportError::NoAuth)
        );
        let bad = "[plugins.\"io.containerd.grpc.v1.cri\".registry.configs.\"r\".auth]\nauth = \"bm9jb2xvbg==\"\n";
        let e = parse(bad).err().unwrap();
        assert!(matches!(e, ImportError::BadAuth { .. }), "{e}");
        let token = "[plugins.\"io.containerd.grpc.v1.cri\".registry.configs.\"r\".auth]\nidentitytoken = \"tok-secret\"\n";
        let e = parse(token).err().unwrap();
        assert!(matches!(e, ImportError::IdentityToken { .. }));
        assert!(!e.to_string().contains("tok-secret"));
        let broken = "[plugins]\npassword = \"leaked-secret\nx";
        let e = parse(broken).err().unwrap();
        assert!(matches!(e, ImportError::Toml { .. }), "{e}");
        assert!(!e.to_string().contains("leaked-secret"), "{e}");
    }

    #[test]
    fn the_summary_names_no_secret_and_every_pattern() {
        let got = parse(V2).unwrap();
        let text = summary(
            Path::new("/etc/c.toml"),
            Path::new("/etc/out.json"),
            &grpc_address("[grpc]\n  address = \"/run/k3s/containerd.sock\"\n"),
            &got,
        );
        assert!(!text.contains("s3cret") && !text.contains("Ym90"), "{text}");
        assert!(
            text.contains("--cri-runtime-endpoint unix:///run/k3s/containerd.sock")
                && text.contains("--cri-runtime-config /etc/c.toml"),
            "{text}"
        );
        assert_eq!(grpc_address(V2), "/run/containerd/containerd.sock");
        assert!(
            text.contains("--cri-proxy-fill registry.example.com"),
            "{text}"
        );
        assert!(text
            .contains("[plugins.\"io.containerd.grpc.v1.cri\".registry.auths.\"https://gcr.io\"]"));
    }

    #[test]
    fn the_output_is_private_and_not_replaced_without_force() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("config.json");
        write_secret(&out, b"{}", false).unwrap();
        let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(write_secret(&out, b"{\"x\":1}", false).is_err());
        assert_eq!(std::fs::read(&out).unwrap(), b"{}");
        write_secret(&out, b"{\"x\":1}", true).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"{\"x\":1}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// The output is refused in a directory others can write, or below one.
    #[test]
    fn the_output_is_refused_in_a_shared_directory() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let shared = dir.path().join("shared");
        let below = shared.join("below");
        std::fs::create_dir_all(&below).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        for out in [shared.join("config.json"), below.join("config.json")] {
            let e = write_secret(&out, b"{}", true).unwrap_err();
            assert!(
                format!("{e:#}").contains("can be written by other users"),
                "{e:#}"
            );
            assert!(!out.exists());
        }
    }

    /// In a sticky directory everyone can add to (`/tmp`), the name a writer would once have
    /// used (the output's name, its PID, `.tmp`), planted in advance as a file open to all,
    /// receives nothing: the output is a new 0600 file of its own.
    #[test]
    fn planted_temporary_names_receive_nothing() {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        let planted = dir
            .path()
            .join(format!("config.json.{}.tmp", std::process::id()));
        std::fs::write(&planted, "theirs").unwrap();
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o666)).unwrap();
        let out = dir.path().join("config.json");
        write_secret(&out, b"{\"secret\":1}", true).unwrap();
        assert_eq!(std::fs::read_to_string(&planted).unwrap(), "theirs");
        let meta = std::fs::symlink_metadata(&out).unwrap();
        assert!(meta.is_file());
        assert_ne!(meta.ino(), std::fs::metadata(&planted).unwrap().ino());
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(meta.uid(), rustix::process::geteuid().as_raw());
    }

    /// What import prints and reads is what it says: a host with a newline is refused (it
    /// would forge a line of the suggested command), a password that is not a string is an
    /// error, not an empty password, and a FIFO is refused without waiting for a writer.
    #[test]
    fn hosts_fields_and_files_are_what_import_says() {
        let forged = "[plugins.\"io.containerd.grpc.v1.cri\".registry.configs.\"r.example\\n      --cri-proxy-fill *\".auth]\nusername = \"u\"\npassword = \"p\"\n";
        let e = parse(forged).err().unwrap();
        assert!(matches!(e, ImportError::BadHost(_)), "{e}");
        assert!(!e.to_string().contains('\n'), "{e}");
        let array = "[plugins.\"io.containerd.grpc.v1.cri\".registry.configs.\"r.example\".auth]\nusername = \"u\"\npassword = [\"p\"]\n";
        let e = parse(array).err().unwrap();
        assert!(
            matches!(&e, ImportError::NotAString { field, .. } if field == "password"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("config.toml");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let e = containerd(ImportContainerdArgs {
            config: fifo,
            output: dir.path().join("out.json"),
            force: false,
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
}
