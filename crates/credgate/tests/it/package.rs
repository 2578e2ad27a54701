//! The Debian package as an operator installs it (issue 50): `scripts/package` builds it, dpkg
//! installs it into a clean Debian 12 root (debootstrap, minbase with systemd and man-db,
//! cached outside the repository), where `credgate --version` runs, `man credgate` reads its
//! page, `systemd-analyze verify` accepts the installed units and `systemd-analyze security`
//! rates the service; then dpkg purges it and nothing it brought is left. Needs root (chroot).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::text;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A clean Debian 12 root, made once with debootstrap into the cache the node's parts use,
/// under a lock (tests may ask at once).
fn debian_root() -> PathBuf {
    let cache = std::env::var_os("CREDGATE_NODE_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|c| PathBuf::from(c).join("credgate-node"))
        })
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/credgate-node")
        });
    std::fs::create_dir_all(&cache).unwrap();
    let root = cache.join("debian-bookworm-minbase-systemd-man-db");
    let lock = std::fs::File::create(cache.join("debian-root.lock")).unwrap();
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
    if !root.join("usr/bin/dpkg").exists() {
        let tmp = cache.join("debian-root.tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        let out = Command::new("debootstrap")
            .args(["--variant=minbase", "--include=systemd,man-db", "bookworm"])
            .arg(&tmp)
            .arg("http://deb.debian.org/debian")
            .output()
            .unwrap_or_else(|e| {
                panic!("debootstrap cannot run ({e}): scripts/test installs it as root")
            });
        assert!(out.status.success(), "debootstrap: {}", text(&out.stderr));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::rename(&tmp, &root).unwrap();
    }
    root
}

/// Every path under `root` but those the package manager and man-db keep for themselves.
fn files(root: &Path) -> BTreeSet<String> {
    let out = Command::new("find")
        .arg(root)
        .arg("-xdev")
        .output()
        .unwrap();
    text(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix(root.to_str().unwrap()))
        .filter(|p| {
            ![
                "/var/lib/dpkg",
                "/var/log",
                "/var/cache/man",
                "/var/cache/debconf",
                "/tmp",
                // systemd-analyze's; a tmpfs on a booted system.
                "/run",
            ]
            .iter()
            .any(|skip| p.starts_with(skip))
        })
        .map(str::to_owned)
        .collect()
}

#[test]
#[ignore = "needs root"]
fn the_package_installs_runs_verifies_and_purges_clean() {
    credgate_testbed::require_root("installing a package into a chroot");
    let built = Command::new(repo().join("scripts/package"))
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "scripts/package: {}",
        text(&built.stderr)
    );
    let deb = PathBuf::from(text(&built.stdout).trim());
    let scratch = tempfile::tempdir().unwrap();
    let root = scratch.path().join("root");
    let copied = Command::new("cp")
        .arg("-a")
        .arg(debian_root())
        .arg(&root)
        .status()
        .unwrap();
    assert!(copied.success());
    let before = files(&root);
    std::fs::copy(&deb, root.join("tmp/credgate.deb")).unwrap();
    let chroot = |args: &[&str]| {
        let out = Command::new("chroot")
            .arg(&root)
            .args(args)
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("SYSTEMD_OFFLINE", "1")
            .output()
            .unwrap();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    let (ok, _, err) = chroot(&["dpkg", "-i", "/tmp/credgate.deb"]);
    assert!(ok, "dpkg -i: {err}");
    let (ok, version, err) = chroot(&["credgate", "--version"]);
    assert!(ok, "{err}");
    assert_eq!(
        version.trim(),
        concat!("credgate ", env!("CARGO_PKG_VERSION"))
    );
    let (ok, _, err) = chroot(&["credgate-credential-provider", "--version"]);
    assert!(ok, "the static bridge runs: {err}");
    let (ok, page, err) = chroot(&["man", "-P", "cat", "credgate-serve"]);
    assert!(
        ok && page.contains("--cri-proxy-socket"),
        "man credgate-serve: {err}{page}"
    );
    let (ok, _, _) = chroot(&["man", "-w", "credgate"]);
    assert!(ok, "man credgate");
    for f in [
        "usr/share/credgate/prometheus-rules.yaml",
        "usr/share/credgate/grafana-dashboard.json",
        "usr/lib/systemd/system/kubelet.service.d/10-credgate.conf",
        "etc/default/credgate",
    ] {
        assert!(root.join(f).exists(), "{f} is installed");
    }
    let units = [
        "/usr/lib/systemd/system/credgate.service",
        "/usr/lib/systemd/system/credgate.socket",
    ];
    let mut verify = vec!["systemd-analyze", "verify"];
    verify.extend(units);
    let (ok, out, err) = chroot(&verify);
    assert!(
        ok && err.trim().is_empty(),
        "systemd-analyze verify: {out}{err}"
    );
    let (_, rating, err) = chroot(&[
        "systemd-analyze",
        "security",
        "--offline=yes",
        "--no-pager",
        "/usr/lib/systemd/system/credgate.service",
    ]);
    let exposure: f64 = rating
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("→ Overall exposure level for credgate.service: ")
        })
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level: {rating}{err}"));
    eprintln!("systemd-analyze security credgate.service: {exposure}");
    assert!(exposure <= 4.5, "{rating}");
    let (ok, _, err) = chroot(&["dpkg", "--purge", "credgate"]);
    assert!(ok, "dpkg --purge: {err}");
    std::fs::remove_file(root.join("tmp/credgate.deb")).unwrap();
    let after = files(&root);
    let left: Vec<&String> = after.difference(&before).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
