//! HTTP/2 framing (RFC 9113 §4 and §6) as far as credgate reads and writes it by hand: the
//! preface, frame heads, the types and flags it uses, padding and priority fields. Used by
//! the one-shot client ([`crate::unary`]), the authority rewriter ([`crate::authority`]), the
//! fuzz checks and the tests' hostile clients.

/// The client connection preface.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A frame head's length.
pub const HEAD_LEN: usize = 9;

/// The largest frame a peer may send unless the other raised SETTINGS_MAX_FRAME_SIZE
/// (RFC 9113 §4.2; credgate's servers and clients never do).
pub const MAX_FRAME: usize = 16_384;

pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const WINDOW_UPDATE: u8 = 0x8;
pub const CONTINUATION: u8 = 0x9;

pub const END_STREAM: u8 = 0x1;
pub const ACK: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const PADDED: u8 = 0x8;
pub const PRIORITY: u8 = 0x20;

pub const SETTINGS_ENABLE_PUSH: u16 = 0x2;
pub const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;

/// A frame head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub len: usize,
    pub kind: u8,
    pub flags: u8,
    /// Without the reserved bit.
    pub stream: u32,
}

impl Head {
    pub fn parse(h: &[u8; HEAD_LEN]) -> Head {
        Head {
            len: usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]),
            kind: h[3],
            flags: h[4],
            stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff,
        }
    }

    /// The head at the start of `bytes`, when they hold one.
    pub fn peek(bytes: &[u8]) -> Option<Head> {
        bytes.first_chunk::<HEAD_LEN>().map(Head::parse)
    }
}

/// Appends one frame. Panics on a payload longer than a frame can say (16 MiB): callers cut
/// theirs at [`MAX_FRAME`].
pub fn put(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l < 1 << 24)
        .expect("a frame payload fits 24 bits");
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// Padding or priority fields longer than their frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a frame's padding or priority fields are longer than the frame")]
pub struct Malformed;

/// A DATA frame's data: the payload without its padding.
pub fn data(payload: &[u8], flags: u8) -> Result<&[u8], Malformed> {
    unpad(payload, flags)
}

/// A HEADERS frame's block fragment: the payload without padding and priority fields.
pub fn header_fragment(payload: &[u8], flags: u8) -> Result<&[u8], Malformed> {
    let body = unpad(payload, flags)?;
    if flags & PRIORITY != 0 {
        return body.get(5..).ok_or(Malformed);
    }
    Ok(body)
}

fn unpad(payload: &[u8], flags: u8) -> Result<&[u8], Malformed> {
    if flags & PADDED == 0 {
        return Ok(payload);
    }
    let (&pad, rest) = payload.split_first().ok_or(Malformed)?;
    let keep = rest.len().checked_sub(usize::from(pad)).ok_or(Malformed)?;
    Ok(&rest[..keep])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_put_is_the_head_it_parses() {
        let mut out = Vec::new();
        put(&mut out, HEADERS, END_HEADERS, 0x8000_0003, &[7; 300]);
        let head = Head::peek(&out).unwrap();
        assert_eq!(
            head,
            Head {
                len: 300,
                kind: HEADERS,
                flags: END_HEADERS,
                stream: 3
            }
        );
        assert_eq!(out.len(), HEAD_LEN + 300);
        assert_eq!(Head::peek(&out[..8]), None);
    }

    #[test]
    fn padding_and_priority_are_stripped_or_refused() {
        assert_eq!(data(b"\x02ab..", PADDED), Ok(&b"ab"[..]));
        assert_eq!(data(b"\x05ab", PADDED), Err(Malformed));
        assert_eq!(data(b"", PADDED), Err(Malformed));
        assert_eq!(data(b"\x01ab", 0), Ok(&b"\x01ab"[..]));
        assert_eq!(
            header_fragment(b"\x01\0\0\0\x01\x10block.", PADDED | PRIORITY),
            Ok(&b"block"[..])
        );
        assert_eq!(header_fragment(b"\0\0\0", PRIORITY), Err(Malformed));
        // PRIORITY is a HEADERS flag only: DATA keeps the bytes.
        assert_eq!(data(b"\0\0\0", PRIORITY), Ok(&b"\0\0\0"[..]));
    }
}
