//! The fuzz check of credgate-api: HTTP/2 header blocks (HPACK) of the blocking client.

/// HPACK header blocks: decoding never panics, the dynamic table carries over to a second
/// block, and what was decoded, encoded again, decodes to the same fields.
pub fn hpack_block(data: &[u8]) {
    let mut decoder = credgate_api::hpack::Decoder::new(4096);
    let mid = data.first().map_or(0, |&b| usize::from(b)).min(data.len());
    let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    for block in [&data[..mid], &data[mid..]] {
        let mut these = Vec::new();
        if decoder
            .decode(block, |n, v| these.push((n.to_vec(), v.to_vec())))
            .is_err()
        {
            return;
        }
        fields.extend(these);
    }
    let block = credgate_api::hpack::encode(fields.iter().map(|(n, v)| (&n[..], &v[..])));
    let mut again = Vec::new();
    credgate_api::hpack::Decoder::new(4096)
        .decode(&block, |n, v| again.push((n.to_vec(), v.to_vec())))
        .expect("our own encoding decodes");
    assert_eq!(again, fields);
}

/// The `:authority` rewriter on arbitrary client bytes (after a real preface): fed in pieces it
/// gives what it gives fed whole, and what it passes on is frames whose header blocks decode
/// with an empty table, add nothing to it, and carry no `:authority` but `localhost`.
pub fn authority_rewrite(data: &[u8]) {
    use credgate_api::authority::{Rewriter, AUTHORITY};
    let step = data.first().map_or(1, |&b| usize::from(b).max(1));
    let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    input.extend_from_slice(data);
    let (mut whole, mut pieces) = (Vec::new(), Vec::new());
    let whole_result = Rewriter::new(1 << 16).feed(&input, &mut whole);
    let mut r = Rewriter::new(1 << 16);
    let mut pieces_result = Ok(());
    for chunk in input.chunks(step) {
        pieces_result = r.feed(chunk, &mut pieces);
        if pieces_result.is_err() {
            break;
        }
    }
    assert_eq!(whole_result, pieces_result);
    assert_eq!(whole, pieces);
    if whole_result.is_err() {
        return;
    }
    let mut decoder = credgate_api::hpack::Decoder::new(4096);
    let (mut rest, mut block, mut open) = (&whole[24..], Vec::new(), false);
    while rest.len() >= 9 {
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        let (kind, flags) = (rest[3], rest[4]);
        let Some(payload) = rest.get(9..9 + len) else {
            return; // a frame still arriving
        };
        // A CONTINUATION outside a block is passed on as it came, for the server to refuse.
        if kind == 0x1 || (kind == 0x9 && open) {
            block.extend_from_slice(payload);
            open = flags & 0x4 == 0;
            if !open {
                decoder
                    .decode(&block, |n, v| {
                        assert!(n != b":authority" || v == AUTHORITY);
                    })
                    .expect("a re-encoded block decodes");
                assert!(
                    block
                        .iter()
                        .take(1)
                        .all(|b| b & 0xc0 != 0x40 && b & 0x80 == 0),
                    "a literal that is not indexed"
                );
                block.clear();
            }
        }
        rest = &rest[9 + len..];
    }
}
