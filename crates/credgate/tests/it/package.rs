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
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
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
    for page in [
        "credgate",
        "credgate-credential-provider",
        "docker-credential-credgate",
    ] {
        let (ok, _, _) = chroot(&["man", "-w", page]);
        assert!(ok, "man {page}");
    }
    for f in [
        "usr/share/credgate/prometheus-rules.yaml",
        "usr/share/credgate/prometheus-scrape.yaml",
        "usr/share/credgate/containerd/credgate-v2.toml",
        "usr/share/credgate/containerd/credgate-v3.toml",
        "usr/libexec/credgate/plugins",
        "etc/credgate",
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
    kubelet_drop_in(&chroot, &root);
    upgrade_over_a_running_agent(&chroot, &root, &deb, scratch.path());
    // Removal as on a booted node: the service and its sockets stop, and the kubelet, whose
    // drop-in went with the package, restarts onto containerd alone.
    let (ok, _, err) = chroot(&["dpkg", "-r", "credgate"]);
    assert!(ok, "dpkg -r: {err}");
    let calls = std::fs::read_to_string(root.join("tmp/systemctl.log")).unwrap();
    assert!(
        calls.contains("stop credgate.service credgate.socket")
            && calls.contains("try-restart kubelet.service"),
        "removal's systemctl calls: {calls}"
    );
    assert!(!root
        .join("usr/lib/systemd/system/kubelet.service.d/10-credgate.conf")
        .exists());
    let (ok, _, err) = chroot(&["dpkg", "--purge", "credgate"]);
    assert!(ok, "dpkg --purge: {err}");
    assert!(!root.join("var/lib/credgate").exists() && !root.join("etc/credgate").exists());
    for f in [
        "tmp/credgate.deb",
        "tmp/credgate-next.deb",
        "tmp/systemctl.log",
    ] {
        std::fs::remove_file(root.join(f)).unwrap();
    }
    for d in ["run/systemd/system", "usr/local/bin/systemctl"] {
        let _ = std::fs::remove_dir(root.join(d));
        let _ = std::fs::remove_file(root.join(d));
    }
    let after = files(&root);
    let left: Vec<&String> = after.difference(&before).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

type Chroot<'a> = &'a dyn Fn(&[&str]) -> (bool, String, String);

/// The kubelet's drop-in verifies against a kubelet unit that expands its flags (as an
/// operator's does), so its ordering and settings are what systemd reads.
fn kubelet_drop_in(chroot: Chroot, root: &Path) {
    let unit = root.join("etc/systemd/system/kubelet.service");
    std::fs::write(
        &unit,
        "[Unit]\nDescription=kubelet (a stand-in)\n[Service]\nExecStart=/bin/true $KUBELET_CREDGATE_ARGS $KUBELET_CREDGATE_PROVIDER_ARGS\n",
    )
    .unwrap();
    let (ok, out, err) = chroot(&[
        "systemd-analyze",
        "verify",
        "/etc/systemd/system/kubelet.service",
    ]);
    std::fs::remove_file(&unit).unwrap();
    assert!(
        ok && err.trim().is_empty(),
        "verify kubelet.service with the drop-in: {out}{err}"
    );
}

/// An upgrade over a running agent (issue 50): on a booted node (a `systemctl` that records its
/// calls stands in for systemd, which this machine does not run) dpkg restarts the service
/// alone, never its sockets, whose backlog holds the calls meanwhile; the state the running
/// agent keeps (its node key, sealed cache) is read by the next version's binary and, after a
/// rollback to the older package, by the older one.
fn upgrade_over_a_running_agent(chroot: Chroot, root: &Path, deb: &Path, scratch: &Path) {
    std::fs::create_dir_all(root.join("run/systemd/system")).unwrap();
    let fake = root.join("usr/local/bin/systemctl");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho \"$*\" >>/tmp/systemctl.log\ncase \"$*\" in *--version*) echo 'systemd 252 (252)';; *is-enabled*) echo enabled;; esac\nexit 0\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // The next version: the same package under a higher version, as a rebuild would be.
    let unpacked = scratch.join("next");
    let ok = Command::new("dpkg-deb")
        .arg("-R")
        .arg(deb)
        .arg(&unpacked)
        .status()
        .unwrap();
    assert!(ok.success());
    let control = unpacked.join("DEBIAN/control");
    let text_of = std::fs::read_to_string(&control).unwrap();
    let version = text_of
        .lines()
        .find_map(|l| l.strip_prefix("Version: "))
        .unwrap()
        .to_owned();
    std::fs::write(
        &control,
        text_of.replace(
            &format!("Version: {version}"),
            &format!("Version: {version}+next"),
        ),
    )
    .unwrap();
    let ok = Command::new("dpkg-deb")
        .arg("-b")
        .arg(&unpacked)
        .arg(root.join("tmp/credgate-next.deb"))
        .output()
        .unwrap();
    assert!(ok.status.success(), "dpkg-deb -b: {}", text(&ok.stderr));
    // The agent the package installed, running on its state directory (from outside the
    // chroot, whose root has no /proc; the state directory is the installed one).
    let state = root.join("var/lib/credgate");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    /// An agent stopped (SIGKILL) if the test ends before it stops it; its log checked.
    struct Running(Option<std::process::Child>, std::path::PathBuf);
    impl Drop for Running {
        fn drop(&mut self) {
            if let Some(mut child) = self.0.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            let log = std::fs::read_to_string(&self.1).unwrap_or_default();
            crate::support::secrets::check("the installed agent's log", &log);
        }
    }
    let start = |socket: &str| {
        let log = scratch.join(format!("{socket}.log"));
        let socket = scratch.join(socket);
        let running = Running(
            Some(
                Command::new(root.join("usr/bin/credgate"))
                    .args(["serve", "--no-docker-config", "--state-dir"])
                    .arg(&state)
                    .arg("--socket")
                    .arg(&socket)
                    .stderr(std::fs::File::create(&log).unwrap())
                    .spawn()
                    .unwrap(),
            ),
            log,
        );
        credgate_testbed::eventually(
            "the installed agent serves",
            std::time::Duration::from_secs(30),
            || {
                Command::new(root.join("usr/bin/credgate"))
                    .args(["ctl", "--socket"])
                    .arg(&socket)
                    .arg("health")
                    .output()
                    .unwrap()
                    .status
                    .success()
            },
        );
        running
    };
    let stop = |mut running: Running| {
        let mut child = running.0.take().unwrap();
        rustix::process::kill_process(
            rustix::process::Pid::from_child(&child),
            rustix::process::Signal::TERM,
        )
        .unwrap();
        assert!(child.wait().unwrap().success(), "SIGTERM: a clean exit");
    };
    let running = start("a.sock");
    let key = std::fs::read(state.join("node.key")).expect("the agent's node key");
    let _ = std::fs::remove_file(root.join("tmp/systemctl.log"));
    let (ok, _, err) = chroot(&["dpkg", "-i", "/tmp/credgate-next.deb"]);
    assert!(ok, "dpkg -i over the running agent: {err}");
    let calls = std::fs::read_to_string(root.join("tmp/systemctl.log")).unwrap_or_default();
    assert!(
        calls.contains("try-restart credgate.service") && !calls.contains("credgate.socket"),
        "an upgrade restarts the service only, never its sockets: {calls}"
    );
    // What systemd's try-restart does: SIGTERM, then the new binary on the same state.
    stop(running);
    let next = start("b.sock");
    assert_eq!(
        std::fs::read(state.join("node.key")).unwrap(),
        key,
        "the upgrade keeps the node key"
    );
    stop(next);
    // A rollback to the older package: the older binary reads what the newer left.
    let (ok, _, err) = chroot(&["dpkg", "-i", "/tmp/credgate.deb"]);
    assert!(ok, "dpkg -i of the older version: {err}");
    let older = start("c.sock");
    assert_eq!(
        std::fs::read(state.join("node.key")).unwrap(),
        key,
        "the rollback keeps the node key"
    );
    stop(older);
    let _ = std::fs::remove_file(root.join("tmp/systemctl.log"));
}
