//! containerd's config as containerd itself reads it (`--cri-runtime-config`): the file and its
//! `imports` (relative to the importing file's directory, `*` patterns globbed in the last
//! component), each read at its own `version` (1 migrated as containerd migrates it: its
//! `plugins.cri` is `plugins."io.containerd.grpc.v1.cri"`; under a version 3 config, a version
//! 2 file's CRI section is where containerd 2.x moves it), and merged as containerd merges
//! them: a later file's plugin section replaces the earlier one whole, never key by key.
//!
//! Every file is refused unless it is a regular file (never a link: it is opened with
//! `O_NOFOLLOW`), root's or this user's, writable by nobody else, below directories that are
//! the same (`credgate_trust::check_ancestors`), and at most [`MAX_FILE`] bytes; at most
//! [`MAX_FILES`] files are read.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

/// Largest file read.
pub const MAX_FILE: u64 = 1 << 20;
/// Most files read, the config and its imports together.
pub const MAX_FILES: usize = 64;

/// The plugin of containerd 2.x (config version 3) that holds the image settings.
const IMAGES_V3: &str = "io.containerd.cri.v1.images";
/// The CRI plugin of containerd 1.x (config version 2).
const CRI_V2: &str = "io.containerd.grpc.v1.cri";

/// containerd's config, its imports merged.
#[derive(Debug)]
pub struct RuntimeConfig {
    /// The version of the file named (3: containerd 2.x; 2 or 1: containerd 1.x, whose
    /// settings containerd 2.x migrates to the same values).
    pub version: i64,
    /// The files read, in containerd's order (the config first).
    pub files: Vec<PathBuf>,
    /// The merged plugin sections, by plugin name, after migration.
    plugins: BTreeMap<String, toml::Value>,
}

impl RuntimeConfig {
    /// Reads `path` and everything it imports.
    pub fn load(path: &Path) -> Result<Self> {
        let mut pending = vec![path.to_owned()];
        let mut files: Vec<PathBuf> = Vec::new();
        let mut version = None;
        let mut plugins = BTreeMap::new();
        let mut next = 0;
        while next < pending.len() {
            let file = pending[next].clone();
            next += 1;
            if files.contains(&file) {
                continue;
            }
            if files.len() == MAX_FILES {
                anyhow::bail!(
                    "containerd's config {} imports more than {MAX_FILES} files",
                    path.display()
                );
            }
            let text = read_config(&file)?;
            let doc: toml::Table = text
                .parse()
                .map_err(|e: toml::de::Error| {
                    anyhow::anyhow!("{}", e.message().lines().next().unwrap_or_default())
                })
                .with_context(|| format!("containerd's config {} is not TOML", file.display()))?;
            let file_version = match doc.get("version") {
                None => 1,
                Some(toml::Value::Integer(v)) if (0..=3).contains(v) => (*v).max(1),
                Some(_) => anyhow::bail!(
                    "containerd's config {}: its version is not one containerd reads (1, 2 or 3)",
                    file.display()
                ),
            };
            let main_version = *version.get_or_insert(file_version);
            if file_version == 3 && main_version < 3 {
                anyhow::bail!(
                    "containerd's config {} is version 3 but is imported by a version {main_version} config: containerd 1.x does not read it",
                    file.display()
                );
            }
            for (name, section) in migrate(&doc, file_version, main_version) {
                plugins.insert(name, section);
            }
            pending.extend(imports(&file, &doc)?);
            files.push(file);
        }
        Ok(RuntimeConfig {
            version: version.unwrap_or(1),
            files,
            plugins,
        })
    }

    /// The sandbox (pause) image the merged config names, and the setting that names it; `None`
    /// when it names none (containerd then pulls its built-in default, a public image).
    pub fn sandbox_image(&self) -> Result<Option<(String, &'static str)>> {
        let (value, setting) = if self.version >= 3 {
            (
                self.plugins
                    .get(IMAGES_V3)
                    .and_then(|p| p.get("pinned_images"))
                    .and_then(|p| p.get("sandbox")),
                "plugins.\"io.containerd.cri.v1.images\".pinned_images.sandbox",
            )
        } else {
            (
                self.plugins
                    .get(CRI_V2)
                    .and_then(|p| p.get("sandbox_image")),
                "plugins.\"io.containerd.grpc.v1.cri\".sandbox_image",
            )
        };
        match value {
            None => Ok(None),
            Some(toml::Value::String(s)) if s.is_empty() => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some((s.clone(), setting))),
            Some(_) => anyhow::bail!("{setting} is not a string"),
        }
    }
}

/// A file's plugin sections as containerd has them after migrating the file to the config's
/// generation: version 1's `cri` is version 2's CRI plugin; under a version 3 config, a version
/// 2 file's CRI plugin gives its `sandbox_image` and `registry` to the images plugin.
fn migrate(doc: &toml::Table, version: i64, main_version: i64) -> Vec<(String, toml::Value)> {
    let Some(plugins) = doc.get("plugins").and_then(|p| p.as_table()) else {
        return Vec::new();
    };
    let mut out: Vec<(String, toml::Value)> = plugins
        .iter()
        .map(|(name, section)| {
            let name = if version == 1 && name == "cri" {
                CRI_V2
            } else {
                name.as_str()
            };
            (name.to_owned(), section.clone())
        })
        .collect();
    if version < 3 && main_version >= 3 {
        if let Some(cri) = out
            .iter()
            .find(|(n, _)| n == CRI_V2)
            .and_then(|(_, s)| s.as_table())
        {
            let mut images = toml::Table::new();
            if let Some(sandbox) = cri.get("sandbox_image") {
                let mut pinned = toml::Table::new();
                pinned.insert("sandbox".into(), sandbox.clone());
                images.insert("pinned_images".into(), pinned.into());
            }
            if let Some(registry) = cri.get("registry") {
                images.insert("registry".into(), registry.clone());
            }
            out.push((IMAGES_V3.to_owned(), images.into()));
        }
    }
    out
}

/// The files `file`'s `imports` name, as containerd resolves them: relative to `file`'s
/// directory, a `*` pattern globbed (in the last component only: a pattern in a directory name
/// is refused rather than guessed at).
fn imports(file: &Path, doc: &toml::Table) -> Result<Vec<PathBuf>> {
    let Some(list) = doc.get("imports") else {
        return Ok(Vec::new());
    };
    let list = list
        .as_array()
        .with_context(|| format!("{}: imports is not a list", file.display()))?;
    let base = file.parent().unwrap_or(Path::new("/"));
    let mut out = Vec::new();
    for item in list {
        let named = item
            .as_str()
            .with_context(|| format!("{}: an import is not a string", file.display()))?;
        let path = base.join(named);
        if !named.contains('*') {
            out.push(path);
            continue;
        }
        let (Some(dir), Some(pattern)) = (path.parent(), path.file_name().and_then(|f| f.to_str()))
        else {
            anyhow::bail!("{}: import {named:?} names no file", file.display());
        };
        if dir.to_string_lossy().contains(['*', '?', '[']) {
            anyhow::bail!(
                "{}: import {named:?} has a pattern in a directory name, which credgate does not resolve",
                file.display()
            );
        }
        if !credgate_core::pattern::glob_valid(pattern) {
            anyhow::bail!(
                "{}: import {named:?} is not a valid pattern",
                file.display()
            );
        }
        let mut matched: Vec<PathBuf> = match std::fs::read_dir(dir) {
            Ok(entries) => entries
                .filter_map(|e| e.ok())
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| credgate_core::pattern::glob_match(pattern, n))
                })
                .map(|e| e.path())
                .take(MAX_FILES + 1)
                .collect(),
            // As Go's filepath.Glob: a directory that cannot be read matches nothing.
            Err(_) => Vec::new(),
        };
        matched.sort();
        out.extend(matched);
    }
    Ok(out)
}

/// One of containerd's config files: a regular file, not a link, of at most [`MAX_FILE`]
/// bytes, that root or this user owns and nobody else can write, below directories that are
/// the same (it names what the agent pulls with the node's credentials, and may hold them).
pub fn read_config(path: &Path) -> Result<String> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let what = || format!("containerd's config {}", path.display());
    credgate_api::trust::check_ancestors(path).with_context(what)?;
    // Never follows a link, never waits on a FIFO or a device: opened without following or
    // blocking, read only if regular.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                anyhow::anyhow!(
                    "{} is a symbolic link; refusing to follow it",
                    path.display()
                )
            } else {
                anyhow::Error::new(e).context(format!("cannot read {}", what()))
            }
        })?;
    let meta = file
        .metadata()
        .with_context(|| format!("cannot read {}", what()))?;
    if !meta.is_file() {
        anyhow::bail!("{} is not a regular file", what());
    }
    credgate_api::trust::check(path, &meta, credgate_api::trust::Owner::MeOrRoot)
        .with_context(what)?;
    let mut text = String::new();
    file.take(MAX_FILE + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("cannot read {}", what()))?;
    if text.len() as u64 > MAX_FILE {
        anyhow::bail!(
            "{} is over {MAX_FILE} bytes: not a containerd config",
            what()
        );
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&p, text).unwrap();
        p
    }

    fn sandbox(path: &Path) -> Option<String> {
        RuntimeConfig::load(path)
            .unwrap()
            .sandbox_image()
            .unwrap()
            .map(|(i, _)| i)
    }

    /// A version 3 config is searched for version 3's setting only: a stale version 2
    /// `sandbox_image` left in it is not the node's sandbox image (containerd 2.x ignores it).
    #[test]
    fn each_version_is_read_at_its_own_keys() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let stale = write(
            d,
            "v3-stale.toml",
            "version = 3\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"r.example/stale/pause:3.1\"\n",
        );
        assert_eq!(sandbox(&stale), None);
        let v3 = write(
            d,
            "v3.toml",
            "version = 3\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"r.example/stale:1\"\n[plugins.\"io.containerd.cri.v1.images\".pinned_images]\n  sandbox = \"r.example/pause:3.10\"\n",
        );
        assert_eq!(sandbox(&v3).as_deref(), Some("r.example/pause:3.10"));
        let v2 = write(
            d,
            "v2.toml",
            "version = 2\n[plugins.\"io.containerd.cri.v1.images\".pinned_images]\n  sandbox = \"r.example/not-read-by-1.x:1\"\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"r.example/pause:3.6\"\n",
        );
        assert_eq!(sandbox(&v2).as_deref(), Some("r.example/pause:3.6"));
        let v1 = write(
            d,
            "v1.toml",
            "[plugins.cri]\n  sandbox_image = \"r.example/pause:3.1\"\n",
        );
        assert_eq!(sandbox(&v1).as_deref(), Some("r.example/pause:3.1"));
        let bad = write(d, "bad.toml", "version = 7\n");
        assert!(RuntimeConfig::load(&bad).is_err());
    }

    /// Imports are followed, relative to the importing file and globbed; a later file's plugin
    /// section replaces the earlier one whole (a drop-in that configures the CRI plugin without
    /// a sandbox image leaves containerd's default); a version 2 drop-in under a version 3
    /// config gives its sandbox image where containerd 2.x migrates it.
    #[test]
    fn imports_are_followed_and_merged_as_containerd_merges_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let main = write(
            d,
            "config.toml",
            "version = 3\nimports = [\"conf.d/*.toml\"]\n[plugins.\"io.containerd.cri.v1.images\".pinned_images]\n  sandbox = \"r.example/main/pause:1\"\n",
        );
        assert_eq!(sandbox(&main).as_deref(), Some("r.example/main/pause:1"));
        write(
            d,
            "conf.d/10-mirror.toml",
            "version = 3\n[plugins.\"io.containerd.cri.v1.images\".pinned_images]\n  sandbox = \"r.example/mirror/pause:2\"\n",
        );
        write(d, "conf.d/README", "not toml, not matched");
        let loaded = RuntimeConfig::load(&main).unwrap();
        assert_eq!(loaded.files.len(), 2);
        assert_eq!(sandbox(&main).as_deref(), Some("r.example/mirror/pause:2"));
        write(
            d,
            "conf.d/20-other.toml",
            "version = 3\n[plugins.\"io.containerd.cri.v1.images\"]\n  snapshotter = \"overlayfs\"\n",
        );
        assert_eq!(sandbox(&main), None, "the section is replaced whole");
        std::fs::remove_file(d.join("conf.d/20-other.toml")).unwrap();
        write(
            d,
            "conf.d/30-v2.toml",
            "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"r.example/v2/pause:3\"\n",
        );
        assert_eq!(sandbox(&main).as_deref(), Some("r.example/v2/pause:3"));
        // A named import that is missing is an error, as containerd fails to start on it; an
        // import of itself is read once.
        let named = write(
            d,
            "named.toml",
            "version = 3\nimports = [\"missing.toml\", \"named.toml\"]\n",
        );
        assert!(RuntimeConfig::load(&named).is_err());
        let cycle = write(d, "cycle.toml", "version = 3\nimports = [\"cycle.toml\"]\n");
        assert_eq!(RuntimeConfig::load(&cycle).unwrap().files.len(), 1);
    }

    /// A link is refused (the file and an import), so is a file in a directory others can
    /// write; a FIFO is refused without waiting for a writer.
    #[test]
    fn links_shared_directories_and_fifos_are_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let real = write(d, "real.toml", "version = 3\n");
        let link = d.join("link.toml");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = RuntimeConfig::load(&link).unwrap_err();
        assert!(format!("{e:#}").contains("symbolic link"), "{e:#}");
        let importer = write(
            d,
            "importer.toml",
            "version = 3\nimports = [\"link.toml\"]\n",
        );
        let e = RuntimeConfig::load(&importer).unwrap_err();
        assert!(format!("{e:#}").contains("symbolic link"), "{e:#}");
        let shared = d.join("shared");
        std::fs::create_dir(&shared).unwrap();
        let inside = write(&shared, "config.toml", "version = 3\n");
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = RuntimeConfig::load(&inside).unwrap_err();
        assert!(
            format!("{e:#}").contains("can be written by other users"),
            "{e:#}"
        );
        let fifo = d.join("fifo.toml");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let e = RuntimeConfig::load(&fifo).unwrap_err();
        assert!(format!("{e:#}").contains("not a regular file"), "{e:#}");
    }
}
