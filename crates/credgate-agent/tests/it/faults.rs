//! Fault injection on the guard's state directory: a small tmpfs is mounted for it (this needs
//! root, as CI has; elsewhere the tests say so and return), then filled to ENOSPC while pulls
//! are recorded, and in another test mounted read-only before the agent's guard opens it.
//! Wanted: clear errors, decisions that fail safe (must authenticate), recovery without a
//! restart once space or write access returns, and nothing that was acknowledged lost.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use credgate_agent::guard::{Answer, CredentialIn, Guard, GuardOptions, Presence, PullPolicy};
use credgate_agent::metrics::AgentMetrics;
use credgate_core::guard::{Coords, Policy};
use credgate_engine::clock::ManualClock;
use secrecy::SecretString;

/// A tmpfs mounted on a temp dir, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(options: &str) -> Option<Tmpfs> {
        credgate_testbed::require_root("mounting a tmpfs for fault injection");
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "credgate-faults"])
            .arg(dir.path())
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount -t tmpfs failed although running as root");
        Some(Tmpfs { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn remount(&self, options: &str) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,{options}")])
            .arg(self.path())
            .status()
            .unwrap()
            .success();
        assert!(ok, "remount {options}");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

fn guard(state: &Path) -> Guard {
    guard_with(state, Arc::new(ManualClock::default()))
}

fn guard_with(state: &Path, clock: Arc<ManualClock>) -> Guard {
    Guard::open(
        GuardOptions {
            policy: Policy::AlwaysVerify,
            state_dir: state.to_owned(),
            ..Default::default()
        },
        AgentMetrics::default(),
        clock,
    )
}

fn secret(team: &str) -> CredentialIn {
    CredentialIn::Secret {
        coords: Coords {
            namespace: team.into(),
            name: "pull".into(),
            uid: format!("uid-{team}"),
        },
        username: team.into(),
        password: SecretString::from(format!("password-of-{team}")),
    }
}

fn image(i: usize) -> String {
    format!("registry.example/team-a/app{i}:v1")
}

fn image_ref(i: usize) -> String {
    format!("sha256:{i:064x}")
}

/// Records one pull of image `i` by team A; Ok only when acknowledged.
async fn pull(g: &Guard, i: usize) -> Result<(), String> {
    g.record_intent(&image(i))
        .await
        .map_err(|e| e.to_string())?;
    let used = secret("team-a");
    let end = credgate_agent::guard::PullEnd::Pulled {
        image_ref: &image_ref(i),
        used: &used,
    };
    g.record_result(&image(i), end)
        .await
        .map_err(|e| e.to_string())
}

fn answer(g: &Guard, i: usize, team: &str) -> Answer {
    g.check(
        &image(i),
        &image_ref(i),
        Presence::OnNode,
        PullPolicy::IfNotPresent,
        &[secret(team)],
    )
    .unwrap()
    .answer
}

/// Writes filler until the file system is full.
fn fill(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let chunk = vec![0x5au8; 64 * 1024];
    loop {
        if let Err(e) = f.write_all(&chunk) {
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
            break;
        }
    }
    // Single bytes, so that not even a page is left.
    while f.write_all(&[0]).is_ok() {}
    path
}

#[tokio::test]
#[ignore = "needs root"]
async fn a_full_state_directory_fails_safe_and_recovers() {
    let Some(fs) = Tmpfs::mount("size=4m,mode=0700") else {
        return;
    };
    let state = fs.path().join("state");
    let g = guard(&state);
    let mut acknowledged = Vec::new();
    for i in 0..20 {
        pull(&g, i).await.expect("room to record");
        acknowledged.push(i);
    }

    let filler = fill(fs.path());
    let mut refused = Vec::new();
    for i in 20..60 {
        match pull(&g, i).await {
            Ok(()) => acknowledged.push(i),
            Err(e) => {
                assert!(
                    e.contains("could not be written") && e.contains("full"),
                    "a clear error: {e}"
                );
                refused.push(i);
            }
        }
    }
    assert!(
        refused.len() >= 30,
        "the disk was full for most of them: {refused:?}"
    );
    for &i in &refused {
        // Not recorded: even the team that pulled it must authenticate.
        assert_eq!(answer(&g, i, "team-a"), Answer::MustAuthenticate, "{i}");
    }
    for &i in &acknowledged {
        assert_eq!(answer(&g, i, "team-a"), Answer::Allow, "{i}");
        assert_eq!(answer(&g, i, "team-b"), Answer::MustAuthenticate, "{i}");
    }

    // Space returns: recording works again without a restart.
    std::fs::remove_file(filler).unwrap();
    for &i in &refused {
        pull(&g, i)
            .await
            .expect("recording resumes when space returns");
        acknowledged.push(i);
    }
    g.store().unwrap().close().await;
    drop(g);

    let g = guard(&state);
    for &i in &acknowledged {
        assert_eq!(answer(&g, i, "team-a"), Answer::Allow, "{i} survived");
        assert_eq!(answer(&g, i, "team-b"), Answer::MustAuthenticate, "{i}");
    }
    assert_eq!(acknowledged.len(), 60);
    g.store().unwrap().close().await;
}

#[tokio::test]
#[ignore = "needs root"]
async fn a_read_only_state_directory_fails_safe_until_writable() {
    let Some(fs) = Tmpfs::mount("size=4m,mode=0700") else {
        return;
    };
    let state = fs.path().join("state");
    // Records from an earlier run, then the file system turns read-only before the agent
    // starts (an ext4 remounted read-only after an error, a misconfigured volume).
    {
        let g = guard(&state);
        pull(&g, 1).await.unwrap();
        g.store().unwrap().close().await;
    }
    fs.remount("ro");
    let clock = Arc::new(ManualClock::default());
    let g = guard_with(&state, clock.clone());
    let err = g.store().err().expect("unavailable").to_string();
    assert!(
        err.starts_with("the guard's records are unavailable"),
        "{err}"
    );
    assert!(
        err.to_lowercase().contains("read-only"),
        "a clear error: {err}"
    );
    // Fail safe: even the owner of a recorded image must authenticate while records are
    // unreadable; recording is refused with the same clear error.
    assert_eq!(answer(&g, 1, "team-a"), Answer::MustAuthenticate);
    let refused = pull(&g, 2).await.unwrap_err();
    assert!(refused.to_lowercase().contains("read-only"), "{refused}");

    // Writable again: within the retry interval nothing is tried; the next call after it
    // opens the store, no restart.
    fs.remount("rw");
    assert_eq!(answer(&g, 1, "team-a"), Answer::MustAuthenticate);
    clock.advance(credgate_agent::guard::REOPEN_INTERVAL);
    assert_eq!(answer(&g, 1, "team-a"), Answer::Allow);
    assert_eq!(answer(&g, 1, "team-b"), Answer::MustAuthenticate);
    pull(&g, 2).await.expect("recording after recovery");
    assert_eq!(answer(&g, 2, "team-a"), Answer::Allow);
    g.store().unwrap().close().await;
}
