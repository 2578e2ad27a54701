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

/// The check's own reader of representations refuses what indexes, and reads what the
/// encoder writes.
#[test]
fn literals_only_tells_indexing_representations_apart() {
    let ours = credgate_api::hpack::encode([(&b":path"[..], &b"/x"[..]), (b"a", b"b")]);
    assert!(checks_api::literals_only(&ours));
    assert!(checks_api::literals_only(b""));
    // Indexed (:method GET), incremental indexing, a table size update.
    for bad in [&b"\x82"[..], b"\x41\x01a", b"\x20"] {
        assert!(!checks_api::literals_only(bad), "{bad:?}");
    }
    // A literal whose value runs past the block.
    assert!(!checks_api::literals_only(b"\x00\x01a\x05b"));
    // After a good literal, an indexing one.
    let mut mixed = ours.clone();
    mixed.push(0x82);
    assert!(!checks_api::literals_only(&mixed));
}
