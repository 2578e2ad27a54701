//! Replays the fuzz corpus (`fuzz/corpus/<target>/`) through the fuzz targets' checks, so the
//! normal suite keeps every input the fuzzers have found interesting, without libFuzzer.
//! `scripts/fuzz` runs the fuzzers themselves.

#[path = "../../../fuzz/src/checks.rs"]
mod checks;

use std::path::PathBuf;

fn replay(target: &str, check: fn(&[u8])) {
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

#[test]
fn image_ref() {
    replay("image_ref", checks::image_ref);
}

#[test]
fn pattern() {
    replay("pattern", checks::pattern);
}

#[test]
fn provider_config() {
    replay("provider_config", checks::provider_config);
}

#[test]
fn plugin_response() {
    replay("plugin_response", checks::plugin_response);
}

#[test]
fn helper_stdin() {
    replay("helper_stdin", checks::helper_stdin);
}

#[test]
fn record_decode() {
    replay("record_decode", checks::record_decode);
}

#[test]
fn hpack_block() {
    replay("hpack_block", checks::hpack_block);
}
