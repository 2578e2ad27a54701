//! Replays the fuzz corpus (`fuzz/corpus/<target>/`) through the fuzz targets' checks, so the
//! normal suite keeps every input the fuzzers have found interesting, without libFuzzer.
//! `scripts/fuzz` runs the fuzzers themselves.

#[path = "../../../../fuzz/src/checks.rs"]
mod checks;

#[path = "../../../../fuzz/src/replay.rs"]
mod replay;

use replay::replay;

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
