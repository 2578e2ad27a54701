//! The fuzz check of credgate-api: HTTP/2 header blocks (HPACK) of the blocking client.

/// HPACK header blocks: decoding never panics, the dynamic table carries over to a second
/// block, and what was decoded, encoded again, decodes to the same fields.
pub fn hpack_block(data: &[u8]) {
    let mut decoder = credgate_api::hpack::HpackDecoder::new(4096);
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
    credgate_api::hpack::HpackDecoder::new(4096)
        .decode(&block, |n, v| again.push((n.to_vec(), v.to_vec())))
        .expect("our own encoding decodes");
    assert_eq!(again, fields);
}

/// The `:authority` rewriter on arbitrary client bytes (after a real preface): fed in pieces it
/// gives what it gives fed whole, and what it passes on is frames whose header blocks decode
/// with an empty table, hold only literals that are not indexed (every representation, not the
/// first), and carry no `:authority` but `localhost`.
pub fn authority_rewrite(data: &[u8]) {
    use credgate_api::authority::{Rewriter, AUTHORITY};
    use credgate_api::frame::{self, Head};
    let step = data.first().map_or(1, |&b| usize::from(b).max(1));
    let mut input = frame::PREFACE.to_vec();
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
    let mut decoder = credgate_api::hpack::HpackDecoder::new(4096);
    let (mut rest, mut block, mut open) = (&whole[frame::PREFACE.len()..], Vec::new(), false);
    while let Some(head) = Head::peek(rest) {
        let Some(payload) = rest.get(frame::HEAD_LEN..frame::HEAD_LEN + head.len) else {
            return; // a frame still arriving
        };
        // A CONTINUATION outside a block is passed on as it came, for the server to refuse.
        if head.kind == frame::HEADERS || (head.kind == frame::CONTINUATION && open) {
            assert!(head.len <= frame::MAX_FRAME);
            block.extend_from_slice(payload);
            open = head.flags & frame::END_HEADERS == 0;
            if !open {
                decoder
                    .decode(&block, |n, v| {
                        assert!(n != b":authority" || v == AUTHORITY);
                    })
                    .expect("a re-encoded block decodes");
                assert!(literals_only(&block), "a representation that indexes");
                block.clear();
            }
        }
        rest = &rest[frame::HEAD_LEN + head.len..];
    }
}

/// Whether every representation of `block` is a literal without indexing or never indexed
/// (RFC 7541 §6.2.2, §6.2.3), read without the decoder under test: a 4-bit-prefix name index,
/// then the strings.
pub fn literals_only(mut block: &[u8]) -> bool {
    fn integer(input: &mut &[u8], n: u8) -> Option<usize> {
        let (&first, rest) = input.split_first()?;
        *input = rest;
        let max = (1usize << n) - 1;
        let mut value = usize::from(first) & max;
        if value < max {
            return Some(value);
        }
        let mut shift = 0;
        loop {
            let (&b, rest) = input.split_first()?;
            *input = rest;
            value = value.checked_add(usize::from(b & 0x7f).checked_shl(shift)?)?;
            if b & 0x80 == 0 {
                return Some(value);
            }
            shift += 7;
            if shift > 28 {
                return None;
            }
        }
    }
    fn string(input: &mut &[u8]) -> Option<()> {
        let len = integer(input, 7)?;
        *input = input.get(len..)?;
        Some(())
    }
    while let Some(&first) = block.first() {
        if first & 0xe0 != 0 {
            return false; // indexed, incremental indexing or a table size update
        }
        let Some(index) = integer(&mut block, 4) else {
            return false;
        };
        if index == 0 && string(&mut block).is_none() {
            return false;
        }
        if string(&mut block).is_none() {
            return false;
        }
    }
    true
}
