//! Replays the fuzz corpus of credgate-api's target (`fuzz/corpus/hpack_block/`) through its
//! check, so the normal suite keeps every input the fuzzer has found interesting.

#[path = "../../../fuzz/src/checks_api.rs"]
mod checks_api;
#[path = "../../../fuzz/src/replay.rs"]
mod replay;

#[test]
fn hpack_block() {
    replay::replay("hpack_block", checks_api::hpack_block);
}
