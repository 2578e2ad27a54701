//! `capture-burst`: what a burst of captures writes. A `captured.sealed` holding 1000
//! captures of ~11 KiB (the store at ~12 MB, as issue 38 measured it), then `-n` new captures
//! (default 100) made one after another (each waits for the one before: a write each, what
//! every capture cost before group commit) and then from 32 threads at once (the capture
//! task's concurrency): the file's writes and the bytes written each way, and the time.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use credgate_agent::captured::{Captured, PodCredential};
use secrecy::SecretString;
use serde_json::json;

use crate::{emit, Args, TempDir};

fn credential(i: usize) -> PodCredential {
    PodCredential {
        namespace: format!("ns-{}", i % 200),
        username: format!("user-{i}"),
        password: SecretString::from("p".repeat(11 << 10)),
        captured_ms: i as i64,
    }
}

/// The file's writes for `n` captures from `threads` threads, and the seconds they took.
fn burst(c: &Arc<Captured>, n: usize, threads: usize, from: usize) -> (u64, f64) {
    let changes = c.changes();
    let before = *changes.borrow();
    let started = Instant::now();
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        for t in 0..threads {
            let c = c.clone();
            s.spawn(move || {
                for i in (t * per)..((t + 1) * per).min(n) {
                    c.capture(
                        &format!("reg.io/burst/app-{}", from + i),
                        credential(from + i),
                    )
                    .expect("captured");
                }
            });
        }
    });
    let writes = *changes.borrow() - before;
    (writes, started.elapsed().as_secs_f64())
}

pub fn capture_burst(args: &Args) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = TempDir::new("capture-burst")?;
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o700))?;
    let c = Arc::new(Captured::open(&dir.0, None)?);
    for i in 0..1000 {
        c.capture(&format!("reg.io/held/app-{i}"), credential(i))?;
    }
    let size = std::fs::metadata(dir.0.join("captured.sealed"))?.len();
    let n = args.n.max(1);
    let (seq_writes, seq_s) = burst(&c, n, 1, 10_000);
    let (par_writes, par_s) = burst(&c, n, 32, 20_000);
    emit(
        args,
        json!({
            "scenario": "capture-burst", "captures": n, "store_bytes": size,
            "one_at_a_time_writes": seq_writes,
            "one_at_a_time_mb_written": (seq_writes * size) as f64 / 1e6,
            "one_at_a_time_s": seq_s,
            "burst_of_32_writes": par_writes,
            "burst_of_32_mb_written": (par_writes * size) as f64 / 1e6,
            "burst_of_32_s": par_s,
        }),
    );
    Ok(())
}
