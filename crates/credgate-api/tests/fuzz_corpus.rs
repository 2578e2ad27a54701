//! Replays the fuzz corpora of credgate-api's targets (`fuzz/corpus/hpack_block/`,
//! `fuzz/corpus/authority_rewrite/`) through their checks, so the normal suite keeps every input the fuzzer has found interesting.

#[path = "../../../fuzz/src/checks_api.rs"]
mod checks_api;
#[path = "../../../fuzz/src/replay.rs"]
mod replay;

#[test]
fn hpack_block() {
    replay::replay("hpack_block", checks_api::hpack_block);
}

#[test]
fn authority_rewrite() {
    replay::replay("authority_rewrite", checks_api::authority_rewrite);
}
