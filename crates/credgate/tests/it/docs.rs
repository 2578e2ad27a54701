//! The documents the tests hold (issue 52): every test or function, flag, metric and RPC or
//! type that README.md, ARCHITECTURE.md, SECURITY.md, BENCHMARKS.md and the reference under
//! `docs/` cite exists in this checkout. A renamed test, a removed flag or a metric that was
//! never registered fails here, not in a reader's terminal; so does a relative link to a file or
//! heading that is not there. The decision records are history and are not held to today's
//! names.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::text;

/// The documents held: the four at the root, and every page of the reference (`docs/*.md`;
/// not the decision records nor the notes for upstream projects, below it), each named by its
/// path from the root. A page added to `docs/` is held without being listed here.
fn documents() -> Vec<String> {
    let mut pages: Vec<String> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    pages.sort();
    let mut all: Vec<String> = [
        "README.md",
        "ARCHITECTURE.md",
        "SECURITY.md",
        "BENCHMARKS.md",
    ]
    .map(String::from)
    .to_vec();
    all.extend(pages);
    all
}

/// Names the documents cite (beside those the scripts and shipped files hold) that belong to programs credgate did not write (the kubelet,
/// kubectl, containerd, cargo, apt): each is named here on purpose, so that a new one is a
/// decision and a typo of ours is not taken for one.
const FOREIGN_FLAGS: &[&str] = &[
    // cargo and cargo-nextest
    "--bin",
    "--release",
    "--run-ignored",
    // kubectl
    "--docker-password",
    "--docker-server",
    "--docker-username",
    "--for",
    "--image",
    "--overrides",
    "--timeout",
    // apt-get and dpkg
    "--install",
    "--purge",
    // the kubelet
    "--image-credential-provider-bin-dir",
    "--image-credential-provider-config",
    // kill(1)
    "--kill",
    // cargo fmt, cargo bench and cargo-nextest
    "--check",
    "--bench",
    "--no-capture",
    // systemctl
    "--now",
    // skopeo and podman
    "--authfile",
];
const FOREIGN_NAMES: &[&str] = &[
    // Kubernetes and the kubelet
    "CredentialProviderConfig",
    "DaemonSet",
    "TokenReview",
    "NetworkPolicy",
    "PullSecrets",
    // systemd
    "KillMode",
    // tokio
    "block_in_place",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every file under `dir` whose name ends with one of `exts`, recursively.
fn files(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if !matches!(
                path.file_name().and_then(|n| n.to_str()),
                Some("target" | ".git")
            ) {
                files(&path, exts, out);
            }
        } else if exts.iter().any(|e| path.to_string_lossy().ends_with(e)) {
            out.push(path);
        }
    }
}

/// The workspace's Rust and proto sources, and its scripts and deployment files, as one text.
fn sources() -> (String, String) {
    let root = repo();
    let mut code = Vec::new();
    files(&root.join("crates"), &[".rs"], &mut code);
    files(&root.join("fuzz"), &[".rs"], &mut code);
    files(&root.join("proto"), &[".proto"], &mut code);
    let mut shipped = Vec::new();
    files(&root.join("scripts"), &[""], &mut shipped);
    files(&root.join("deploy"), &[""], &mut shipped);
    let read = |paths: Vec<PathBuf>| {
        paths
            .iter()
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .collect::<Vec<_>>()
            .join("\n")
    };
    (read(code), read(shipped))
}

/// The inline code spans of a Markdown text and the lines of its fenced blocks.
fn code_of(doc: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in doc.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            out.push(line.to_owned());
            continue;
        }
        out.extend(
            line.split('`')
                .enumerate()
                .filter(|(i, _)| i % 2 == 1)
                .map(|(_, s)| s.to_owned()),
        );
    }
    out
}

fn words(s: &str) -> impl Iterator<Item = &str> {
    s.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '-'))
        .map(|w| w.trim_matches(':'))
        .filter(|w| !w.is_empty())
}

/// `credgate`'s help, and that of each subcommand, recursively.
fn credgate_help(args: &mut Vec<String>, out: &mut String) {
    let help = Command::new(env!("CARGO_BIN_EXE_credgate"))
        .args(args.iter())
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success(), "credgate {args:?} --help");
    let help = text(&help.stdout);
    out.push_str(&help);
    let commands: Vec<String> = help
        .split("Commands:\n")
        .nth(1)
        .map(|rest| rest.split("\n\n").next().unwrap_or(""))
        .unwrap_or("")
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect();
    for command in commands {
        args.push(command);
        credgate_help(args, out);
        args.pop();
    }
}

/// A flag of `credgate-bench`, whose arguments are clap fields of its `main.rs`
/// (`threads: Vec<usize>` is `--threads`).
fn bench_flag(bench: &str, flag: &str) -> bool {
    let field = flag.trim_start_matches('-').replace('-', "_");
    bench.contains(&format!("    {field}: "))
}

/// A field of a message in the proto (`uint64 min_valid_for_ms = 2;`).
fn proto_field(code: &str, name: &str) -> bool {
    code.lines().any(|l| {
        let mut w = l.split_whitespace();
        w.nth(1) == Some(name) && w.next() == Some("=")
    })
}

#[test]
fn every_name_the_documents_cite_exists() {
    let (code, shipped) = sources();
    let bench = std::fs::read_to_string(repo().join("crates/credgate-bench/src/main.rs")).unwrap();
    let mut help = String::new();
    credgate_help(&mut Vec::new(), &mut help);
    for bin in [
        env!("CARGO_BIN_EXE_credgate-credential-provider"),
        env!("CARGO_BIN_EXE_docker-credential-credgate"),
    ] {
        let out = Command::new(bin).arg("--help").output().unwrap();
        help.push_str(&text(&out.stdout));
        help.push_str(&text(&out.stderr));
    }
    let metrics = crate::deploy::exported();
    let crates: BTreeSet<String> = std::fs::read_dir(repo().join("crates"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().replace('-', "_"))
        .collect();
    let defines_fn =
        |name: &str| code.contains(&format!("fn {name}(")) || code.contains(&format!("fn {name}<"));
    let whole_word = |hay: &str, w: &str| {
        hay.match_indices(w).any(|(i, _)| {
            let before = hay[..i].chars().next_back();
            let after = hay[i + w.len()..].chars().next();
            let edge = |c: Option<char>| !c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            edge(before) && edge(after)
        })
    };

    let mut missing = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let doc = doc.as_str();
        let body = std::fs::read_to_string(repo().join(doc)).unwrap();
        // Flags, anywhere in the text: credgate's, the scripts' and the shipped files', or a
        // foreign program's named above.
        for flag in words(&body).filter(|w| w.starts_with("--") && w.len() > 3) {
            let flag = flag.trim_end_matches('-');
            checked += 1;
            let known = help.contains(flag)
                || shipped.contains(flag)
                || bench_flag(&bench, flag)
                || FOREIGN_FLAGS.contains(&flag);
            if !known {
                missing.push(format!("{doc}: flag {flag}"));
            }
        }
        // Metrics, anywhere in the text (crate names share the prefix).
        for metric in words(&body).filter(|w| w.starts_with("credgate_") && w.len() > 9) {
            if crates.contains(metric) || metric.contains("::") {
                continue;
            }
            checked += 1;
            if !metrics.contains(metric) {
                missing.push(format!("{doc}: metric {metric}"));
            }
        }
        for span in code_of(&body) {
            for word in words(&span) {
                let last = word.rsplit("::").next().unwrap_or(word);
                // A test or a function: three words or more in snake case.
                let snake = last.split('_').count() >= 3
                    && last
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                    && !last.starts_with("credgate_");
                if snake && !FOREIGN_NAMES.contains(&last) {
                    checked += 1;
                    if !defines_fn(last)
                        && !shipped.contains(last)
                        && !code.contains(&format!("\"{last}\""))
                        && !proto_field(&code, last)
                    {
                        missing.push(format!("{doc}: function or test {word}"));
                    }
                }
                // An RPC, a message or a type: CamelCase of two words or more.
                let camel = last.len() > 3
                    && last.chars().next().is_some_and(|c| c.is_ascii_uppercase())
                    && last.chars().all(|c| c.is_ascii_alphanumeric())
                    && last.chars().skip(1).any(|c| c.is_ascii_uppercase())
                    && last.chars().any(|c| c.is_ascii_lowercase());
                if camel && !FOREIGN_NAMES.contains(&last) {
                    checked += 1;
                    if !whole_word(&code, last) && !whole_word(&shipped, last) {
                        missing.push(format!("{doc}: RPC or type {word}"));
                    }
                }
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(
        checked > 100,
        "only {checked} names found: is the parsing right?"
    );
    assert!(
        missing.is_empty(),
        "cited but not in this checkout:\n  {}",
        missing.join("\n  ")
    );
}

/// A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every relative link of the documents names a file of this checkout, and a heading of it
/// when it names one (`page.md#a-heading`).
#[test]
fn every_link_the_documents_make_reaches_its_target() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let doc = doc.as_str();
        let path = repo().join(doc);
        let body = std::fs::read_to_string(&path).unwrap();
        let base = path.parent().unwrap();
        for (at, _) in body.match_indices("](") {
            let rest = &body[at + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = &rest[..end];
            if target.contains("://") || target.starts_with("mailto:") || target.contains(' ') {
                continue;
            }
            checked += 1;
            let (file, fragment) = target.split_once('#').unwrap_or((target, ""));
            let resolved = if file.is_empty() {
                path.clone()
            } else {
                base.join(file)
            };
            if !resolved.exists() {
                broken.push(format!("{doc}: {target} (no such file)"));
                continue;
            }
            if !fragment.is_empty() && resolved.extension().is_some_and(|e| e == "md") {
                let text = std::fs::read_to_string(&resolved).unwrap();
                let found = text
                    .lines()
                    .filter_map(|l| l.strip_prefix('#'))
                    .any(|h| anchor(h.trim_start_matches('#')) == fragment);
                if !found {
                    broken.push(format!("{doc}: {target} (no such heading)"));
                }
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} links found: is the parsing right?"
    );
    assert!(
        broken.is_empty(),
        "links that reach nothing:\n  {}",
        broken.join("\n  ")
    );
}
