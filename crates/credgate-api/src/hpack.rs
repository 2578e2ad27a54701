//! HPACK (RFC 7541), as much as the blocking unary client needs: a decoder with the static and
//! dynamic tables and Huffman-coded strings, and an encoder that writes plain literals.
//!
//! The Huffman code of RFC 7541 Appendix B is canonical: a code is fully given by the length
//! of each symbol's code, codes of one length being consecutive in symbol order. It is stored
//! here as the symbols of each length (`BY_LENGTH`), and decoded bit by bit against the first
//! code and the count of each length, with nothing built at run time: a short-lived process
//! (the docker credential helper) decodes a handful of strings and exits.

use std::collections::VecDeque;

/// Why a header block could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HpackError {
    /// The block ended inside a representation.
    #[error("truncated header block")]
    Truncated,
    /// An integer did not fit.
    #[error("integer overflow")]
    Overflow,
    /// An index outside the static and dynamic tables, or index 0.
    #[error("header index {0} out of range")]
    Index(usize),
    /// A Huffman string with a bad code, padding or the end-of-string symbol.
    #[error("bad Huffman string")]
    Huffman,
    /// A table size update above the allowed size, or after a header field.
    #[error("bad dynamic table size update")]
    SizeUpdate,
}

/// The static table (RFC 7541 Appendix A); index 1 is the first entry.
pub(crate) const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// The symbols whose Huffman code has each length (index: length in bits), in symbol order;
/// 256 is the end-of-string symbol.
const BY_LENGTH: [&[u16]; 31] = [
    &[],
    &[],
    &[],
    &[],
    &[],
    &[48, 49, 50, 97, 99, 101, 105, 111, 115, 116],
    &[
        32, 37, 45, 46, 47, 51, 52, 53, 54, 55, 56, 57, 61, 65, 95, 98, 100, 102, 103, 104, 108,
        109, 110, 112, 114, 117,
    ],
    &[
        58, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87,
        89, 106, 107, 113, 118, 119, 120, 121, 122,
    ],
    &[38, 42, 44, 59, 88, 90],
    &[],
    &[33, 34, 40, 41, 63],
    &[39, 43, 124],
    &[35, 62],
    &[0, 36, 64, 91, 93, 126],
    &[94, 125],
    &[60, 96, 123],
    &[],
    &[],
    &[],
    &[92, 195, 208],
    &[128, 130, 131, 162, 184, 194, 224, 226],
    &[
        153, 161, 167, 172, 176, 177, 179, 209, 216, 217, 227, 229, 230,
    ],
    &[
        129, 132, 133, 134, 136, 146, 154, 156, 160, 163, 164, 169, 170, 173, 178, 181, 185, 186,
        187, 189, 190, 196, 198, 228, 232, 233,
    ],
    &[
        1, 135, 137, 138, 139, 140, 141, 143, 147, 149, 150, 151, 152, 155, 157, 158, 165, 166,
        168, 174, 175, 180, 182, 183, 188, 191, 197, 231, 239,
    ],
    &[9, 142, 144, 145, 148, 159, 171, 206, 215, 225, 236, 237],
    &[199, 207, 234, 235],
    &[
        192, 193, 200, 201, 202, 205, 210, 213, 218, 219, 238, 240, 242, 243, 255,
    ],
    &[
        203, 204, 211, 212, 214, 221, 222, 223, 241, 244, 245, 246, 247, 248, 250, 251, 252, 253,
        254,
    ],
    &[
        2, 3, 4, 5, 6, 7, 8, 11, 12, 14, 15, 16, 17, 18, 19, 20, 21, 23, 24, 25, 26, 27, 28, 29,
        30, 31, 127, 220, 249,
    ],
    &[],
    &[10, 13, 22, 256],
];

const EOS: u16 = 256;

/// The first canonical code of each length.
const FIRST: [u32; 31] = first_codes();

const fn first_codes() -> [u32; 31] {
    let mut first = [0u32; 31];
    let mut code = 0u32;
    let mut len = 1;
    while len < 31 {
        code <<= 1;
        first[len] = code;
        code += BY_LENGTH[len].len() as u32;
        len += 1;
    }
    first
}

/// Decodes a Huffman-coded string into `out`.
fn huffman(bytes: &[u8], out: &mut Vec<u8>) -> Result<(), HpackError> {
    let (mut code, mut len) = (0u32, 0usize);
    for &byte in bytes {
        for shift in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> shift) & 1);
            len += 1;
            if len > 30 {
                return Err(HpackError::Huffman);
            }
            let offset = code.wrapping_sub(FIRST[len]) as usize;
            if let Some(&symbol) = BY_LENGTH[len].get(offset) {
                if symbol == EOS {
                    return Err(HpackError::Huffman);
                }
                out.push(symbol as u8);
                code = 0;
                len = 0;
            }
        }
    }
    // Padding: fewer than 8 bits, all ones (the start of the end-of-string code).
    if len > 7 || code != (1 << len) - 1 {
        return Err(HpackError::Huffman);
    }
    Ok(())
}

/// Reads an integer with an `n`-bit prefix from the start of `input` (RFC 7541 §5.1).
fn integer(input: &mut &[u8], n: u8) -> Result<usize, HpackError> {
    let (&first, rest) = input.split_first().ok_or(HpackError::Truncated)?;
    *input = rest;
    let mask = (1usize << n) - 1;
    let mut value = usize::from(first) & mask;
    if value < mask {
        return Ok(value);
    }
    let mut shift = 0u32;
    loop {
        let (&b, rest) = input.split_first().ok_or(HpackError::Truncated)?;
        *input = rest;
        if shift > 21 {
            return Err(HpackError::Overflow);
        }
        value += usize::from(b & 0x7f) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
}

/// Reads a string literal (RFC 7541 §5.2).
fn string(input: &mut &[u8]) -> Result<Vec<u8>, HpackError> {
    let huffman_coded = input.first().ok_or(HpackError::Truncated)? & 0x80 != 0;
    let len = integer(input, 7)?;
    if len > input.len() {
        return Err(HpackError::Truncated);
    }
    let (raw, rest) = input.split_at(len);
    *input = rest;
    if huffman_coded {
        let mut out = Vec::with_capacity(len * 8 / 5);
        huffman(raw, &mut out)?;
        Ok(out)
    } else {
        Ok(raw.to_vec())
    }
}

/// A header block decoder: one per connection, since the dynamic table lives across blocks.
#[derive(Debug)]
pub struct HpackDecoder {
    /// Newest first.
    dynamic: VecDeque<(Vec<u8>, Vec<u8>)>,
    size: usize,
    max_size: usize,
    /// The most the peer may set the table to: our SETTINGS_HEADER_TABLE_SIZE.
    allowed: usize,
}

impl HpackDecoder {
    /// A decoder whose dynamic table may grow to `allowed` bytes (our
    /// `SETTINGS_HEADER_TABLE_SIZE`; 4,096 by default).
    pub fn new(allowed: usize) -> Self {
        HpackDecoder {
            dynamic: VecDeque::new(),
            size: 0,
            max_size: allowed,
            allowed,
        }
    }

    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        match index {
            0 => Err(HpackError::Index(0)),
            1..=61 => {
                let (n, v) = STATIC[index - 1];
                Ok((n.as_bytes(), v.as_bytes()))
            }
            _ => self
                .dynamic
                .get(index - 62)
                .map(|(n, v)| (n.as_slice(), v.as_slice()))
                .ok_or(HpackError::Index(index)),
        }
    }

    fn evict_to(&mut self, limit: usize) {
        while self.size > limit {
            let Some((n, v)) = self.dynamic.pop_back() else {
                break;
            };
            self.size -= n.len() + v.len() + 32;
        }
    }

    fn insert(&mut self, name: Vec<u8>, value: Vec<u8>) {
        let size = name.len() + value.len() + 32;
        if size > self.max_size {
            self.dynamic.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max_size - size);
        self.size += size;
        self.dynamic.push_front((name, value));
    }

    /// Decodes one header block, calling `field` with each name and value in order.
    pub fn decode(
        &mut self,
        block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), HpackError> {
        self.decode_fields(block, |n, v, _| field(n, v))
    }

    /// Decodes one header block, calling `field` with each name, value and whether the peer
    /// sent it as never indexed (a sensitive field, RFC 7541 §7.1.3), in order.
    pub fn decode_fields(
        &mut self,
        mut block: &[u8],
        mut field: impl FnMut(&[u8], &[u8], bool),
    ) -> Result<(), HpackError> {
        let mut fields_seen = false;
        while let Some(&b) = block.first() {
            if b & 0x80 != 0 {
                // Indexed header field.
                let index = integer(&mut block, 7)?;
                let (n, v) = self.entry(index)?;
                field(n, v, false);
                fields_seen = true;
            } else if b & 0xe0 == 0x20 {
                // Dynamic table size update: only before the block's first field.
                let size = integer(&mut block, 5)?;
                if fields_seen || size > self.allowed {
                    return Err(HpackError::SizeUpdate);
                }
                self.max_size = size;
                self.evict_to(size);
            } else {
                // A literal: with incremental indexing (01), or without / never indexed
                // (0000, 0001).
                let indexing = b & 0xc0 == 0x40;
                let never_indexed = b & 0xf0 == 0x10;
                let index = integer(&mut block, if indexing { 6 } else { 4 })?;
                let name = match index {
                    0 => string(&mut block)?,
                    i => self.entry(i)?.0.to_vec(),
                };
                let value = string(&mut block)?;
                field(&name, &value, never_indexed);
                if indexing {
                    self.insert(name, value);
                }
                fields_seen = true;
            }
        }
        Ok(())
    }
}

/// Encodes `fields` as literals without indexing, with new names and no Huffman coding: the
/// simplest block any decoder reads, for requests of a few small headers.
pub fn encode<'a>(fields: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        encode_field(&mut out, name, value, false);
    }
    out
}

/// Appends one field to a block as a literal that leaves the decoder's dynamic table as it
/// is: without indexing, or never indexed when `never_indexed` (RFC 7541 §6.2.2, §6.2.3),
/// with a new name and no Huffman coding.
pub fn encode_field(out: &mut Vec<u8>, name: &[u8], value: &[u8], never_indexed: bool) {
    out.push(if never_indexed { 0x10 } else { 0 });
    put_integer(out, name.len(), 7, 0);
    out.extend_from_slice(name);
    put_integer(out, value.len(), 7, 0);
    out.extend_from_slice(value);
}

/// Writes an integer with an `n`-bit prefix, the prefix's other bits being `flags` (RFC 7541
/// §5.1).
pub(crate) fn put_integer(out: &mut Vec<u8>, mut value: usize, n: u8, flags: u8) {
    let mask = (1usize << n) - 1;
    if value < mask {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | mask as u8);
    value -= mask;
    while value >= 0x80 {
        out.push((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn fields(d: &mut HpackDecoder, block: &[u8]) -> Result<Vec<(String, String)>, HpackError> {
        let mut out = Vec::new();
        d.decode(block, |n, v| {
            out.push((
                String::from_utf8(n.to_vec()).unwrap(),
                String::from_utf8(v.to_vec()).unwrap(),
            ));
        })?;
        Ok(out)
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_huffman_code_fills_its_code_space_and_ends_in_eos() {
        // Kraft: a complete prefix code has sum(2^-len) == 1.
        let kraft: u64 = (1..31)
            .map(|len| BY_LENGTH[len].len() as u64 * (1u64 << (30 - len)))
            .sum();
        assert_eq!(kraft, 1 << 30);
        let mut symbols: Vec<u16> = BY_LENGTH.iter().flat_map(|l| l.iter().copied()).collect();
        symbols.sort_unstable();
        assert_eq!(symbols, (0..=256).collect::<Vec<u16>>(), "each symbol once");
        // End-of-string is the last 30-bit code: all ones.
        let last = FIRST[30] + BY_LENGTH[30].len() as u32 - 1;
        assert_eq!(last, (1 << 30) - 1);
        assert_eq!(BY_LENGTH[30].last(), Some(&EOS));
        // Codes listed in RFC 7541 Appendix B.
        let code = |sym: u16| {
            (1..31)
                .find_map(|len| {
                    BY_LENGTH[len]
                        .iter()
                        .position(|&s| s == sym)
                        .map(|i| (FIRST[len] + i as u32, len))
                })
                .unwrap()
        };
        assert_eq!(code(0), (0x1ff8, 13));
        assert_eq!(code(b'0'.into()), (0x0, 5));
        assert_eq!(code(b' '.into()), (0x14, 6));
        assert_eq!(code(b'a'.into()), (0x3, 5));
        assert_eq!(code(10), (0x3fff_fffc, 30));
    }

    // RFC 7541 Appendix C.4: requests with Huffman coding, one decoder across the three.
    #[test]
    fn rfc_requests_with_huffman() {
        let mut d = HpackDecoder::new(4096);
        let c41 = hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff");
        assert_eq!(
            fields(&mut d, &c41).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
            ])
        );
        assert_eq!(d.size, 57);
        let c42 = hex("8286 84be 5886 a8eb 1064 9cbf");
        assert_eq!(
            fields(&mut d, &c42).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache"),
            ])
        );
        assert_eq!(d.size, 110);
        let c43 = hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf");
        assert_eq!(
            fields(&mut d, &c43).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ])
        );
        assert_eq!(d.size, 164);
    }

    // RFC 7541 Appendix C.6: responses with Huffman coding and a 256-byte table, so that
    // entries are evicted.
    #[test]
    fn rfc_responses_with_huffman_and_eviction() {
        let mut d = HpackDecoder::new(256);
        let c61 = hex(
            "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6
             2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
        );
        assert_eq!(
            fields(&mut d, &c61).unwrap(),
            pairs(&[
                (":status", "302"),
                ("cache-control", "private"),
                ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
                ("location", "https://www.example.com"),
            ])
        );
        assert_eq!(d.size, 222);
        let c62 = hex("4883 640e ffc1 c0bf");
        assert_eq!(
            fields(&mut d, &c62).unwrap(),
            pairs(&[
                (":status", "307"),
                ("cache-control", "private"),
                ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
                ("location", "https://www.example.com"),
            ])
        );
        assert_eq!(d.size, 222);
        let c63 = hex(
            "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab
             77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f
             9587 3160 65c0 03ed 4ee5 b106 3d50 07",
        );
        assert_eq!(
            fields(&mut d, &c63).unwrap(),
            pairs(&[
                (":status", "200"),
                ("cache-control", "private"),
                ("date", "Mon, 21 Oct 2013 20:13:22 GMT"),
                ("location", "https://www.example.com"),
                ("content-encoding", "gzip"),
                (
                    "set-cookie",
                    "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
                ),
            ])
        );
        assert_eq!(d.size, 215);
        assert_eq!(d.dynamic.len(), 3);
    }

    #[test]
    fn what_we_encode_decodes_back() {
        let long = "v".repeat(300);
        let list: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":path", b"/credgate.v1.Credentials/Lookup"),
            (b"te", b"trailers"),
            (b"x-long", long.as_bytes()),
            (b"", b""),
        ];
        let block = encode(list.iter().copied());
        let mut got = Vec::new();
        HpackDecoder::new(4096)
            .decode(&block, |n, v| got.push((n.to_vec(), v.to_vec())))
            .unwrap();
        let want: Vec<(Vec<u8>, Vec<u8>)> =
            list.iter().map(|(n, v)| (n.to_vec(), v.to_vec())).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn malformed_blocks_are_errors() {
        let mut d = HpackDecoder::new(4096);
        let cases: &[(&[u8], HpackError)] = &[
            (&[0x80], HpackError::Index(0)),
            (&[0xbe], HpackError::Index(62)),
            (&[0x40, 0x05, b'a'], HpackError::Truncated),
            (&[0x00, 0x81], HpackError::Truncated),
            (&[0xff, 0xff, 0xff], HpackError::Truncated),
            (
                &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
                HpackError::Overflow,
            ),
            // A table size above what we allow, and one after a field.
            (&[0x3f, 0xe2, 0x1f], HpackError::SizeUpdate),
            (&[0x82, 0x20], HpackError::SizeUpdate),
            // Huffman: padding of zeros, padding of 8 bits, the EOS symbol inside.
            (&[0x00, 0x81, 0x00, 0x80], HpackError::Huffman),
            (&[0x00, 0x82, 0x1f, 0xff, 0x80], HpackError::Huffman),
            (
                &[0x00, 0x84, 0xff, 0xff, 0xff, 0xff, 0x80],
                HpackError::Huffman,
            ),
        ];
        for (block, want) in cases {
            assert_eq!(d.decode(block, |_, _| {}), Err(*want), "{block:02x?}");
        }
    }

    #[test]
    fn a_size_update_to_zero_empties_the_table() {
        let mut d = HpackDecoder::new(4096);
        d.decode(
            &[0x40, 0x01, b'k', 0x01, b'v', 0x40, 0x01, b'l', 0x01, b'w'],
            |_, _| {},
        )
        .unwrap();
        assert_eq!(d.dynamic.len(), 2);
        d.decode(&[0x20], |_, _| {}).unwrap();
        assert!(d.dynamic.is_empty());
        assert_eq!(d.decode(&[0xbe], |_, _| {}), Err(HpackError::Index(62)));
    }
}
