//! The deployment files: the Prometheus rules pass `promtool check rules`, and every metric
//! the rules and the Grafana dashboard name is one the agent really exports; the image builds
//! with podman and runs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::text;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The sample names the agent exposes, from a running agent's `/metrics`.
pub(crate) fn exported() -> BTreeSet<String> {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("plugins")).unwrap();
    crate::support::write_script(
        &d.join("plugins/p"),
        r#"cat >/dev/null; echo '{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Image","cacheDuration":"1m","auth":{"reg.io":{"username":"u","password":"p"}}}'"#,
    );
    let config = d.join("p.yaml");
    std::fs::write(&config, "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: p\n  matchImages: [reg.io]\n  defaultCacheDuration: 1m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n").unwrap();
    let addr = format!("127.0.0.1:{}", crate::support::free_port());
    let agent = crate::support::Agent::start(
        d,
        &[
            "--image-credential-provider-config",
            config.to_str().unwrap(),
            "--image-credential-provider-bin-dir",
            d.join("plugins").to_str().unwrap(),
            "--metrics-addr",
            &addr,
        ],
    );
    assert!(agent.credgate(&["get", "reg.io/app"]).status.success());
    let body = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    let mut names = BTreeSet::new();
    for line in body.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
        match kind {
            "counter" => {
                names.insert(format!("{name}_total"));
            }
            "histogram" => {
                names.insert(name.to_owned());
                for s in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{s}"));
                }
            }
            _ => {
                names.insert(name.to_owned());
            }
        }
    }
    assert!(names.contains("credgate_lookups_total"), "{body}");
    names
}

/// The `credgate_*` names a file uses.
fn used(path: &Path) -> BTreeSet<String> {
    let content = std::fs::read_to_string(path).unwrap();
    let mut out = BTreeSet::new();
    let bytes = content.as_bytes();
    let mut i = 0;
    while let Some(at) = content[i..].find("credgate_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        out.insert(content[start..end].to_owned());
        i = end;
    }
    out
}

#[test]
fn alerting_rules_and_the_dashboard_name_metrics_the_agent_exports() {
    let exported = exported();
    for file in [
        "deploy/prometheus-rules.yaml",
        "deploy/grafana-dashboard.json",
    ] {
        let names = used(&repo().join(file));
        assert!(names.len() >= 5, "{file}: {names:?}");
        let unknown: Vec<&String> = names.iter().filter(|n| !exported.contains(*n)).collect();
        assert!(
            unknown.is_empty(),
            "{file} names {unknown:?}, not exported: {exported:?}"
        );
    }
    let dashboard: serde_json::Value = serde_json::from_slice(
        &std::fs::read(repo().join("deploy/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    assert!(dashboard["panels"].as_array().unwrap().len() >= 8);
    match Command::new("promtool")
        .args(["check", "rules"])
        .arg(repo().join("deploy/prometheus-rules.yaml"))
        .output()
    {
        Ok(out) => assert!(
            out.status.success(),
            "{}{}",
            text(&out.stdout),
            text(&out.stderr)
        ),
        Err(e) => panic!(
            "promtool cannot run ({e}): apt-get install prometheus (scripts/test does as root)"
        ),
    }
}

/// The dashboard's first row says at a glance whether this node's pulls are healthy: the share
/// of pulls failing, refused credentials, the runtime unreachable, plugin errors; each a stat
/// with thresholds. The agent says which version runs (`credgate_build_info`).
#[test]
fn the_dashboards_first_row_says_whether_pulls_are_healthy() {
    let dashboard: serde_json::Value = serde_json::from_slice(
        &std::fs::read(repo().join("deploy/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let first: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["gridPos"]["y"] == 0)
        .collect();
    let exprs: Vec<String> = first
        .iter()
        .map(|p| {
            assert_eq!(p["type"], "stat", "{p}");
            let steps = p["fieldConfig"]["defaults"]["thresholds"]["steps"]
                .as_array()
                .map_or(0, Vec::len);
            assert!(steps >= 2, "{} has no thresholds", p["title"]);
            p["targets"][0]["expr"].as_str().unwrap().to_owned()
        })
        .collect();
    for metric in [
        "credgate_cri_pulls_total",
        "credgate_credentials_refused_total",
        "credgate_cri_runtime_unreachable_total",
        "credgate_plugin_errors_total",
    ] {
        assert!(
            exprs.iter().any(|e| e.contains(metric)),
            "{metric}: {exprs:?}"
        );
    }
    assert!(exported().contains("credgate_build_info"));
}

/// Every alert the shipped rules define is shown by `promtool test rules` to fire on the
/// series that should raise it and to stay quiet on those that should not
/// (`deploy/tests/prometheus-rules.test.yaml`, which operators can run as well).
#[test]
fn every_alert_fires_and_stays_quiet_under_promtool() {
    let rules = std::fs::read_to_string(repo().join("deploy/prometheus-rules.yaml")).unwrap();
    let alerts: BTreeSet<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 8, "{alerts:?}");
    let tests_file = repo().join("deploy/tests/prometheus-rules.test.yaml");
    let tests = std::fs::read_to_string(&tests_file).unwrap();
    // Each `alertname:` line and whether its `exp_alerts` expects none.
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    for (i, l) in lines.iter().enumerate() {
        let Some(name) = l.strip_prefix("alertname: ") else {
            continue;
        };
        match lines.get(i + 1) {
            Some(&"exp_alerts: []") => quiet.insert(name),
            Some(&"exp_alerts:") => fires.insert(name),
            other => panic!("{name}: exp_alerts expected after alertname, got {other:?}"),
        };
    }
    for alert in &alerts {
        assert!(fires.contains(alert), "no case where {alert} fires");
        assert!(quiet.contains(alert), "no case where {alert} stays quiet");
    }
    let out = match Command::new("promtool")
        .args(["test", "rules"])
        .arg(&tests_file)
        .output()
    {
        Ok(out) => out,
        Err(e) => panic!(
            "promtool cannot run ({e}): apt-get install prometheus (scripts/test does as root)"
        ),
    };
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// The DaemonSet advertises a scrape of its pod's address (the node's, with hostNetwork), so
/// its agent's metrics must listen there and not on loopback alone; so does the unit's.
#[test]
fn the_daemonsets_scrape_annotation_reaches_its_metrics_listener() {
    let ds = std::fs::read_to_string(repo().join("deploy/daemonset.yaml")).unwrap();
    assert!(ds.contains("prometheus.io/scrape: \"true\""), "{ds}");
    let port = ds
        .lines()
        .find_map(|l| l.trim().strip_prefix("prometheus.io/port: "))
        .expect("a prometheus.io/port annotation")
        .trim_matches('"');
    let addr = ds
        .lines()
        .find_map(|l| l.trim().strip_prefix("- --metrics-addr="))
        .expect("--metrics-addr in the agent's args");
    assert_eq!(
        addr,
        format!("$(POD_IP):{port}"),
        "the agent listens where the annotation says"
    );
    assert!(ds.contains("hostNetwork: true") && ds.contains("fieldPath: status.podIP"));
    // The unit's agent too: on the node's addresses, where a scrape from Prometheus arrives.
    let unit = std::fs::read_to_string(repo().join("deploy/systemd/credgate.service")).unwrap();
    assert!(unit.contains("--metrics-addr=0.0.0.0:9464"), "{unit}");
}

/// One host layout: the unit (its /etc/default/credgate) and the DaemonSet start the agent on the same provider config and
/// plugin directory, the DaemonSet's init container writes the kubelet's config where the
/// migration (docs/kubelet.md) does, and the migration names them all; neither gives the agent the kubelet's
/// plugin directory, which holds the bridge.
#[test]
fn the_unit_the_daemonset_and_readme_share_one_layout() {
    let read = |f: &str| std::fs::read_to_string(repo().join(f)).unwrap();
    // The unit takes the providers' flags from /etc/default/credgate, whose example names them.
    let unit = read("deploy/systemd/credgate.default")
        .lines()
        .find_map(|l| l.strip_prefix("#CREDGATE_ARGS=\""))
        .expect("credgate.default's example of the providers' flags")
        .trim_end_matches('"')
        .replace(' ', "\n");
    let (ds, readme) = (read("deploy/daemonset.yaml"), read("docs/kubelet.md"));
    let flag = |text: &str, name: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| {
                let l = l.trim().trim_start_matches("- ").trim_end_matches(" \\");
                l.strip_prefix(&format!("--{name}=")).map(str::to_owned)
            })
            .collect()
    };
    let config = flag(&unit, "image-credential-provider-config");
    let bin_dir = flag(&unit, "image-credential-provider-bin-dir");
    assert_eq!(config, ["/etc/credgate/providers.yaml"], "{unit}");
    assert_eq!(bin_dir, ["/usr/libexec/credgate/plugins"], "{unit}");
    // The init container and the agent, both on the same two.
    assert_eq!(
        flag(&ds, "image-credential-provider-config"),
        [config[0].as_str(); 2]
    );
    assert_eq!(
        flag(&ds, "image-credential-provider-bin-dir"),
        [bin_dir[0].as_str(); 2]
    );
    let kubelet_config = flag(&ds, "output");
    assert_eq!(kubelet_config, ["/etc/credgate/kubelet-providers.yaml"]);
    let kubelet_dir = "/usr/libexec/kubernetes/kubelet-plugins/credential-provider/exec";
    assert!(ds.contains(&format!("path: {kubelet_dir}")), "{ds}");
    let start = readme
        .find("Migrating a kubelet")
        .expect("README's migration");
    let migration = &readme[start..start + readme[start..].find("\n```\n\n").unwrap()];
    for path in [&config[0], &bin_dir[0], &kubelet_config[0]] {
        assert!(
            migration.contains(path.as_str()),
            "README's migration lacks {path}"
        );
    }
    assert!(
        migration.contains(&format!("--link-dir {kubelet_dir}")),
        "{migration}"
    );
    assert!(migration.contains(&format!(
        "--image-credential-provider-config={}",
        kubelet_config[0]
    )));
    assert!(!unit.contains(kubelet_dir) && !config.contains(&kubelet_dir.to_owned()));
}

/// The image (deploy/Containerfile through scripts/image) builds with Debian's podman from the
/// test build's binaries and holds everything they need to run: `podman run IMAGE --version`,
/// or, where the sandbox's container runtime cannot start a container (crun refused to set
/// rlimits on the machine this was written on), the same commands chrooted into the image's
/// mounted root file system. Needs root and podman.
#[test]
#[ignore = "needs root"]
fn the_image_builds_and_its_binaries_run() {
    credgate_testbed::require_root("building images with podman (rootful, vfs)");
    crate::support::require("podman");
    let tag = format!("localhost/credgate-test:{}", std::process::id());
    let storage = tempfile::tempdir().unwrap();
    let options = crate::support::credgate_image(storage.path(), &tag);
    let podman = |args: &[&str]| {
        Command::new("podman")
            .args(&options)
            .args(args)
            .output()
            .unwrap()
    };
    let run = podman(&["run", "--rm", "--network", "none", &tag, "--version"]);
    let version = if run.status.success() {
        text(&run.stdout)
    } else {
        let why = text(&run.stderr);
        eprintln!(
            "podman run refused here ({}); checking the image's root file system through chroot",
            why.trim()
        );
        let mounted = podman(&["image", "mount", &tag]);
        assert!(mounted.status.success(), "{}", text(&mounted.stderr));
        let root = text(&mounted.stdout).trim().to_owned();
        let chrooted = |args: &[&str]| {
            let out = Command::new("chroot")
                .arg(&root)
                .args(args)
                .output()
                .unwrap();
            assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
            text(&out.stdout)
        };
        let v = chrooted(&["/usr/local/bin/credgate", "--version"]);
        assert!(
            chrooted(&["/usr/local/bin/credgate-credential-provider", "--version"])
                .starts_with("credgate-credential-provider ")
        );
        assert!(
            chrooted(&["/usr/local/bin/docker-credential-credgate", "version"])
                .starts_with("docker-credential-credgate ")
        );
        let _ = podman(&["image", "unmount", &tag]);
        v
    };
    // The bridge the DaemonSet copies onto the host needs no loader and no shared library:
    // it starts whatever the host's glibc.
    let mounted = podman(&["image", "mount", &tag]);
    assert!(mounted.status.success(), "{}", text(&mounted.stderr));
    let bridge =
        Path::new(text(&mounted.stdout).trim()).join("usr/local/bin/credgate-credential-provider");
    for (flag, dynamic) in [("-l", "INTERP"), ("-d", "NEEDED")] {
        let elf = Command::new("readelf")
            .arg(flag)
            .arg(&bridge)
            .output()
            .unwrap();
        assert!(
            elf.status.success(),
            "readelf {flag}: {}",
            text(&elf.stderr)
        );
        assert!(
            !text(&elf.stdout).contains(dynamic),
            "the image's bridge is dynamically linked ({dynamic}): {}",
            text(&elf.stdout)
        );
    }
    let _ = podman(&["image", "unmount", &tag]);
    let _ = podman(&["rmi", "-f", &tag]);
    assert_eq!(
        version.trim(),
        concat!("credgate ", env!("CARGO_PKG_VERSION"))
    );
}

/// The containerd pieces the package ships (`deploy/containerd/`): imported by a containerd
/// config, each makes the runtime read its registry hosts from `/etc/containerd/certs.d`, the
/// directory the docs give `--cri-proxy-hosts-dir`, on Debian's containerd 1.6 (version 2)
/// and containerd 2.4 (version 3, and the version 2 piece migrated).
#[test]
fn the_containerd_pieces_set_the_hosts_directory_the_proxy_reads() {
    let mut runtimes = vec![(PathBuf::from("containerd"), vec!["credgate-v2.toml"])];
    let v2 = credgate_testbed::Containerd::v2_binary().unwrap_or_else(|why| panic!("{why}"));
    runtimes.push((v2, vec!["credgate-v3.toml", "credgate-v2.toml"]));
    let dir = tempfile::tempdir().unwrap();
    let docs = std::fs::read_to_string(repo().join("docs/cri-proxy.md")).unwrap();
    assert!(docs.contains("--cri-proxy-hosts-dir=/etc/containerd/certs.d"));
    for (binary, pieces) in runtimes {
        for piece in pieces {
            let path = repo().join("deploy/containerd").join(piece);
            let version = if piece.ends_with("v3.toml") { 3 } else { 2 };
            let main = dir.path().join(format!("{piece}.main.toml"));
            std::fs::write(
                &main,
                format!("version = {version}\nimports = [\"{}\"]\n", path.display()),
            )
            .unwrap();
            let out = Command::new(&binary)
                .arg("--config")
                .arg(&main)
                .args(["config", "dump"])
                .output()
                .unwrap_or_else(|e| panic!("{} cannot run ({e})", binary.display()));
            let dump = text(&out.stdout);
            assert!(out.status.success(), "{}", text(&out.stderr));
            let registry = dump
                .lines()
                .skip_while(|l| !(l.contains("cri") && l.trim_end().ends_with(".registry]")))
                .take_while(|l| !l.trim().is_empty())
                .collect::<Vec<_>>()
                .join("\n");
            assert!(
                registry.contains("config_path = '/etc/containerd/certs.d'")
                    || registry.contains("config_path = \"/etc/containerd/certs.d\""),
                "{} with {piece}: {registry}\n{dump}",
                binary.display()
            );
        }
    }
}

/// The shipped scrape jobs (`deploy/prometheus-scrape.yaml`) load as a current Prometheus reads
/// them (upstream promtool, built from the module scripts/node-tools/prometheus pins: Debian's
/// is built without Kubernetes discovery), find the unit's agent on each node's port 9464 and
/// the DaemonSet's by the annotations it carries, and label both job "credgate", the job the
/// alert rules select.
#[test]
fn the_scrape_jobs_load_in_prometheus_and_feed_the_alerts() {
    let promtool = crate::support::foreign::built("prometheus").join("promtool");
    let file = repo().join("deploy/prometheus-scrape.yaml");
    let out = Command::new(&promtool)
        .args(["check", "config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check config: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let scrape = std::fs::read_to_string(&file).unwrap();
    let rules = std::fs::read_to_string(repo().join("deploy/prometheus-rules.yaml")).unwrap();
    assert!(rules.contains("up{job=\"credgate\"}"), "{rules}");
    assert_eq!(
        scrape.matches("replacement: credgate\n").count(),
        2,
        "both jobs relabel to job credgate: {scrape}"
    );
    let unit = std::fs::read_to_string(repo().join("deploy/systemd/credgate.service")).unwrap();
    assert!(unit.contains("--metrics-addr=0.0.0.0:9464") && scrape.contains("${1}:9464"));
    let ds = std::fs::read_to_string(repo().join("deploy/daemonset.yaml")).unwrap();
    for (annotation, meta) in [
        (
            "prometheus.io/scrape",
            "__meta_kubernetes_pod_annotation_prometheus_io_scrape",
        ),
        (
            "prometheus.io/port",
            "__meta_kubernetes_pod_annotation_prometheus_io_port",
        ),
        (
            "app.kubernetes.io/name: credgate",
            "label: app.kubernetes.io/name=credgate",
        ),
    ] {
        assert!(
            ds.contains(annotation) && scrape.contains(meta),
            "{annotation}"
        );
    }
}
