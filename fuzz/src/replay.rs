//! Replays a fuzz target's corpus through its check; included by the crates' corpus tests.

use std::path::PathBuf;

pub fn replay(target: &str, check: fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let outcome = std::panic::catch_unwind(|| check(&data));
        assert!(outcome.is_ok(), "{target}: {} fails", path.display());
        n += 1;
    }
    assert!(n > 0, "{target}: empty corpus in {}", dir.display());
}
