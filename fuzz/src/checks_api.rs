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
