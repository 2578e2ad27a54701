//! What a gRPC client on a unix socket sends as `:authority`, made acceptable to the `h2`
//! server.
//!
//! Clients put the socket's path there (the kubelet and crictl up to 1.30, grpc-go dialing a
//! bare path or `passthrough:///path`, grpc-java), its percent-encoding (Python grpcio 1.57+),
//! nothing, or `localhost`. grpc-go's server accepts them all; `h2` resets every stream whose
//! authority is not a valid URI authority, and has no switch for it. On a unix socket the
//! authority names nothing, so the [`Rewriter`] sits between the socket and `h2` and replaces
//! every request's `:authority` with [`AUTHORITY`].
//!
//! It sees the client's bytes as HTTP/2 frames: the preface and every frame but HEADERS and
//! CONTINUATION pass through untouched, streamed as they come. A header block (a HEADERS frame
//! and its CONTINUATIONs) is gathered whole, within a bound, decoded with a dynamic table that
//! mirrors the client's encoder, and sent on as literals that never touch the server's dynamic
//! table, so the server's decoder stays consistent whatever the client indexes. Padding and
//! the deprecated priority fields are dropped. See `docs/decisions/0012-authority-rewrite.md`
//! for why, and for what to remove once `h2` accepts such authorities.

use crate::frame::{self, Head, CONTINUATION, END_HEADERS, END_STREAM, HEADERS, HEAD_LEN};
use crate::hpack::{self, HpackDecoder, HpackError};

/// What every request's `:authority` becomes.
pub const AUTHORITY: &[u8] = b"localhost";

/// The largest frame a client may send (servers behind the rewriter must not raise
/// SETTINGS_MAX_FRAME_SIZE), and the size re-encoded blocks are cut at.
pub use crate::frame::MAX_FRAME;

/// The dynamic table size the rewriter decodes with: the server's SETTINGS_HEADER_TABLE_SIZE,
/// which servers behind the rewriter must announce (RFC 9113's default).
pub const HEADER_TABLE_SIZE: usize = 4096;

/// A header block may arrive in at most this many frames (a flood of tiny CONTINUATIONs is an
/// attack, not a client).
const MAX_FRAMES_PER_BLOCK: usize = 64;

/// Why the client's bytes cannot be passed on: each ends the connection, as `h2` would end it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RewriteError {
    /// The block does not decode.
    #[error("a header block does not decode: {0}")]
    Hpack(HpackError),
    /// A HEADERS or CONTINUATION frame larger than the frame size.
    #[error("a {0}-byte header frame, above the {MAX_FRAME}-byte frame size")]
    FrameSize(usize),
    /// The block, as sent or as decoded, is larger than the bound.
    #[error("a header block larger than {0} bytes")]
    TooLarge(usize),
    /// The block came in more frames than a client needs.
    #[error("a header block in more than {MAX_FRAMES_PER_BLOCK} frames")]
    TooManyFrames,
    /// A frame other than the block's CONTINUATION came before the block ended.
    #[error("a header block interrupted by another frame")]
    Interrupted,
    /// Padding or priority fields longer than the frame.
    #[error("a malformed HEADERS frame")]
    Malformed,
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// Bytes of the client preface left to pass.
    Preface(usize),
    /// Reading a frame's 9-byte head.
    Head,
    /// Bytes of a frame's payload left to pass.
    Pass(usize),
    /// Gathering the payload of a HEADERS or CONTINUATION frame.
    Gather { len: usize, kind: u8, flags: u8 },
}

/// The header block being gathered.
#[derive(Debug, Clone, Copy)]
struct Open {
    stream: u32,
    end_stream: bool,
    frames: usize,
}

/// The client-to-server side of one connection; sans-IO: bytes in, bytes out.
#[derive(Debug)]
pub struct Rewriter {
    decoder: HpackDecoder,
    max_block: usize,
    state: State,
    head: [u8; HEAD_LEN],
    have: usize,
    payload: Vec<u8>,
    block: Vec<u8>,
    open: Option<Open>,
}

impl Rewriter {
    /// A rewriter for a connection whose server's decoder allows a 4,096-byte dynamic table
    /// (the default SETTINGS_HEADER_TABLE_SIZE), refusing blocks whose encoded or decoded size
    /// is above `max_block` bytes (the decoded size counted as HTTP/2 does: 32 more per field).
    pub fn new(max_block: usize) -> Self {
        Rewriter {
            decoder: HpackDecoder::new(HEADER_TABLE_SIZE),
            max_block,
            state: State::Preface(frame::PREFACE.len()),
            head: [0; HEAD_LEN],
            have: 0,
            payload: Vec::new(),
            block: Vec::new(),
            open: None,
        }
    }

    /// How many of the next bytes pass through unchanged: a reader may hand them to the server
    /// as they are and report them with [`Rewriter::passed`] instead of feeding them.
    pub fn passing(&self) -> usize {
        match self.state {
            State::Preface(left) | State::Pass(left) => left,
            State::Head | State::Gather { .. } => 0,
        }
    }

    /// Reports `n` bytes (at most [`Rewriter::passing`]) handed on unchanged.
    pub fn passed(&mut self, n: usize) {
        match &mut self.state {
            State::Preface(left) => {
                *left -= n.min(*left);
                if *left == 0 {
                    self.state = State::Head;
                }
            }
            State::Pass(left) => {
                *left -= n.min(*left);
                if *left == 0 {
                    self.state = State::Head;
                }
            }
            State::Head | State::Gather { .. } => debug_assert_eq!(n, 0, "nothing is passing"),
        }
    }

    /// Takes the client's next bytes and appends what the server should read instead to `out`.
    /// After an error the connection must end: the rewriter's state is no longer the client's.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), RewriteError> {
        while !input.is_empty() {
            match self.state {
                State::Preface(left) | State::Pass(left) => {
                    let n = left.min(input.len());
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.passed(n);
                }
                State::Head => {
                    let n = (HEAD_LEN - self.have).min(input.len());
                    self.head[self.have..self.have + n].copy_from_slice(&input[..n]);
                    self.have += n;
                    input = &input[n..];
                    if self.have == HEAD_LEN {
                        self.have = 0;
                        self.on_head(out)?;
                    }
                }
                State::Gather { len, .. } => {
                    let n = (len - self.payload.len()).min(input.len());
                    self.payload.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if self.payload.len() == len {
                        self.on_payload(out)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn on_head(&mut self, out: &mut Vec<u8>) -> Result<(), RewriteError> {
        let Head {
            len,
            kind,
            flags,
            stream,
        } = Head::parse(&self.head);
        if let Some(open) = self.open {
            if kind != CONTINUATION || stream != open.stream {
                return Err(RewriteError::Interrupted);
            }
        }
        // A CONTINUATION outside a block is the server's to refuse: passed on like any frame.
        let gathered = kind == HEADERS || (kind == CONTINUATION && self.open.is_some());
        if !gathered {
            out.extend_from_slice(&self.head);
            self.state = if len == 0 {
                State::Head
            } else {
                State::Pass(len)
            };
            return Ok(());
        }
        if len > MAX_FRAME {
            return Err(RewriteError::FrameSize(len));
        }
        if kind == HEADERS {
            self.open = Some(Open {
                stream,
                end_stream: flags & END_STREAM != 0,
                frames: 0,
            });
        }
        self.payload.clear();
        self.state = State::Gather { len, kind, flags };
        if len == 0 {
            self.on_payload(out)?;
        }
        Ok(())
    }

    fn on_payload(&mut self, out: &mut Vec<u8>) -> Result<(), RewriteError> {
        let State::Gather { kind, flags, .. } = self.state else {
            unreachable!("a payload is gathered only in the Gather state");
        };
        self.state = State::Head;
        let fragment = if kind == HEADERS {
            frame::header_fragment(&self.payload, flags).map_err(|_| RewriteError::Malformed)?
        } else {
            &self.payload[..]
        };
        let open = self
            .open
            .as_mut()
            .expect("a gathered frame belongs to a block");
        open.frames += 1;
        if open.frames > MAX_FRAMES_PER_BLOCK {
            return Err(RewriteError::TooManyFrames);
        }
        if self.block.len() + fragment.len() > self.max_block {
            return Err(RewriteError::TooLarge(self.max_block));
        }
        self.block.extend_from_slice(fragment);
        if flags & END_HEADERS != 0 {
            self.finish(out)?;
        }
        Ok(())
    }

    /// Decodes the gathered block and appends it to `out` re-encoded, in frames.
    fn finish(&mut self, out: &mut Vec<u8>) -> Result<(), RewriteError> {
        let open = self.open.take().expect("a block is open");
        let mut encoded = Vec::with_capacity(self.block.len() + 32);
        let (mut size, mut over) = (0usize, false);
        let max = self.max_block;
        let decoded = self
            .decoder
            .decode_fields(&self.block, |name, value, never| {
                size += name.len() + value.len() + 32;
                if size > max {
                    over = true;
                    return;
                }
                let value = if name == b":authority" {
                    AUTHORITY
                } else {
                    value
                };
                hpack::encode_field(&mut encoded, name, value, never);
            });
        self.block.clear();
        if self.block.capacity() > MAX_FRAME {
            self.block = Vec::new();
        }
        if self.payload.capacity() > MAX_FRAME {
            self.payload = Vec::new();
        }
        decoded.map_err(RewriteError::Hpack)?;
        if over {
            return Err(RewriteError::TooLarge(max));
        }
        let mut chunks = encoded.chunks(MAX_FRAME).peekable();
        let mut kind = HEADERS;
        let mut flags = if open.end_stream { END_STREAM } else { 0 };
        loop {
            let chunk = chunks.next().unwrap_or(&[]);
            let last = chunks.peek().is_none();
            if last {
                flags |= END_HEADERS;
            }
            frame::put(out, kind, flags, open.stream, chunk);
            if last {
                return Ok(());
            }
            kind = CONTINUATION;
            flags = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{put as frame, PADDED, PREFACE, PRIORITY};

    /// A SETTINGS frame (empty), a HEADERS block and a DATA frame, as a client sends them.
    fn request(block: &[u8], flags: u8) -> Vec<u8> {
        let mut out = PREFACE.to_vec();
        frame(&mut out, 0x4, 0, 0, &[]);
        frame(&mut out, HEADERS, flags, 1, block);
        frame(&mut out, 0x0, END_STREAM, 1, b"\0\0\0\0\x02hi");
        out
    }

    /// Splits `bytes` into frames after the preface: (kind, flags, stream, payload).
    fn frames(bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert_eq!(&bytes[..24], PREFACE);
        let mut rest = &bytes[24..];
        let mut out = Vec::new();
        while let Some(h) = Head::peek(rest) {
            out.push((h.kind, h.flags, h.stream, rest[9..9 + h.len].to_vec()));
            rest = &rest[9 + h.len..];
        }
        assert!(rest.is_empty());
        out
    }

    fn rewrite(input: &[u8]) -> Result<Vec<u8>, RewriteError> {
        let mut r = Rewriter::new(64 << 10);
        let mut out = Vec::new();
        r.feed(input, &mut out)?;
        Ok(out)
    }

    /// The fields of the re-encoded blocks, decoded as the server does, and a check that no
    /// representation would add to its dynamic table.
    fn server_fields(out: &[u8]) -> Vec<Vec<(String, String)>> {
        let mut decoder = HpackDecoder::new(4096);
        let mut blocks = Vec::new();
        let mut block = Vec::new();
        for (kind, flags, _, payload) in frames(out) {
            if kind == HEADERS || kind == CONTINUATION {
                block.extend_from_slice(&payload);
                if flags & END_HEADERS != 0 {
                    assert!(
                        block.is_empty() || block[0] & 0xc0 != 0x40 && block[0] & 0x80 == 0,
                        "literals only"
                    );
                    let mut fields = Vec::new();
                    decoder
                        .decode(&block, |n, v| {
                            fields.push((
                                String::from_utf8_lossy(n).into_owned(),
                                String::from_utf8_lossy(v).into_owned(),
                            ));
                        })
                        .unwrap();
                    blocks.push(fields);
                    block.clear();
                }
            }
        }
        blocks
    }

    fn literal_indexed(name: &str, value: &str) -> Vec<u8> {
        let mut out = vec![0x40];
        out.push(name.len() as u8);
        out.extend_from_slice(name.as_bytes());
        out.push(value.len() as u8);
        out.extend_from_slice(value.as_bytes());
        out
    }

    #[test]
    fn a_socket_path_authority_becomes_localhost_and_everything_else_passes() {
        for authority in [
            "/run/credgate/credgate.sock",
            "%2Frun%2Fx.sock",
            "",
            "localhost",
        ] {
            // :method POST (static 3), :scheme http (6), :path, :authority indexed into the
            // client's table.
            let mut block = vec![0x83, 0x86];
            block.extend(literal_indexed(":path", "/credgate.v1.Admin/Health"));
            block.extend(literal_indexed(":authority", authority));
            let input = request(&block, END_HEADERS);
            let out = rewrite(&input).unwrap();
            assert_eq!(
                server_fields(&out),
                vec![vec![
                    (":method".into(), "POST".into()),
                    (":scheme".into(), "http".into()),
                    (":path".into(), "/credgate.v1.Admin/Health".into()),
                    (":authority".into(), "localhost".into()),
                ]]
            );
            let f = frames(&out);
            assert_eq!((f[0].0, f[0].3.len()), (0x4, 0), "SETTINGS as sent");
            assert_eq!(f[2], (0x0, END_STREAM, 1, b"\0\0\0\0\x02hi".to_vec()));
        }
    }

    #[test]
    fn the_clients_dynamic_table_is_followed_across_blocks() {
        let mut r = Rewriter::new(64 << 10);
        let mut out = Vec::new();
        let mut first = vec![0x83, 0x86];
        first.extend(literal_indexed(":authority", "/tmp/s.sock"));
        first.extend(literal_indexed("x-id", "one"));
        let mut input = request(&first, END_HEADERS);
        // The second request refers to both entries by index only: 63 is :authority, 62 x-id.
        let mut second = Vec::new();
        frame(
            &mut second,
            HEADERS,
            END_HEADERS | END_STREAM,
            3,
            &[0x83, 0xbf, 0xbe],
        );
        input.extend(second);
        r.feed(&input, &mut out).unwrap();
        let blocks = server_fields(&out);
        assert_eq!(blocks[1][1], (":authority".into(), "localhost".into()));
        assert_eq!(blocks[1][2], ("x-id".into(), "one".into()));
        let last = frames(&out).pop().unwrap();
        assert_eq!(
            (last.0, last.1, last.2),
            (HEADERS, END_HEADERS | END_STREAM, 3)
        );
    }

    #[test]
    fn any_split_of_the_input_gives_the_same_output() {
        let mut block = vec![0x83, 0x86];
        block.extend(literal_indexed(":authority", "/a/b"));
        let input = request(&block, END_HEADERS);
        let whole = rewrite(&input).unwrap();
        for step in 1..12 {
            let mut r = Rewriter::new(64 << 10);
            let mut out = Vec::new();
            let mut rest = &input[..];
            while !rest.is_empty() {
                let n = step.min(rest.len());
                // Half of the time, the passing bytes are handed on directly.
                let passing = r.passing().min(n);
                if step % 2 == 0 && passing > 0 {
                    out.extend_from_slice(&rest[..passing]);
                    r.passed(passing);
                    rest = &rest[passing..];
                    continue;
                }
                r.feed(&rest[..n], &mut out).unwrap();
                rest = &rest[n..];
            }
            assert_eq!(out, whole, "step {step}");
        }
    }

    #[test]
    fn padding_priority_and_continuations_are_read_and_large_blocks_split() {
        let big = "v".repeat(20_000);
        let mut block = vec![0x83, 0x86];
        block.extend(hpack::encode([(&b":authority"[..], &b"/x"[..])]));
        block.extend(hpack::encode([(&b"x-big"[..], big.as_bytes())]));
        let (a, b) = block.split_at(10_000);
        let mut payload = vec![3u8]; // pad length
        payload.extend([0, 0, 0, 0, 16]); // priority: dependency 0, weight 16
        payload.extend(a);
        payload.extend([0, 0, 0]);
        let mut input = PREFACE.to_vec();
        frame(
            &mut input,
            HEADERS,
            PADDED | PRIORITY | END_STREAM,
            5,
            &payload,
        );
        frame(&mut input, CONTINUATION, END_HEADERS, 5, b);
        let out = rewrite(&input).unwrap();
        let f = frames(&out);
        assert_eq!(f.len(), 2, "cut at the frame size");
        assert_eq!(
            (f[0].0, f[0].1, f[0].3.len()),
            (HEADERS, END_STREAM, MAX_FRAME)
        );
        assert_eq!((f[1].0, f[1].1), (CONTINUATION, END_HEADERS));
        let fields = &server_fields(&out)[0];
        assert_eq!(fields[2], (":authority".into(), "localhost".into()));
        assert_eq!(fields[3].1.len(), 20_000);
    }

    #[test]
    fn sensitive_fields_stay_never_indexed() {
        let mut block = vec![0x83];
        block.extend([0x10, 1, b'k', 1, b'v']);
        let out = rewrite(&request(&block, END_HEADERS)).unwrap();
        let headers = &frames(&out)[1].3;
        assert_eq!(&headers[headers.len() - 5..], &[0x10, 1, b'k', 1, b'v']);
    }

    #[test]
    fn hostile_blocks_end_the_connection() {
        let too_big = {
            let mut input = PREFACE.to_vec();
            let fragment = vec![0x83; MAX_FRAME];
            frame(&mut input, HEADERS, 0, 1, &fragment);
            for _ in 0..4 {
                frame(&mut input, CONTINUATION, 0, 1, &fragment);
            }
            input
        };
        let flood = {
            let mut input = PREFACE.to_vec();
            frame(&mut input, HEADERS, 0, 1, &[0x83]);
            for _ in 0..MAX_FRAMES_PER_BLOCK {
                frame(&mut input, CONTINUATION, 0, 1, &[]);
            }
            input
        };
        let interrupted = {
            let mut input = PREFACE.to_vec();
            frame(&mut input, HEADERS, 0, 1, &[0x83]);
            frame(&mut input, 0x0, 0, 1, b"x");
            input
        };
        let other_stream = {
            let mut input = PREFACE.to_vec();
            frame(&mut input, HEADERS, 0, 1, &[0x83]);
            frame(&mut input, CONTINUATION, END_HEADERS, 3, &[0x86]);
            input
        };
        let bomb = {
            // One 4 KiB entry, then a block that refers to it 4,096 times: 16 MiB decoded.
            let mut block = literal_indexed("x", "");
            block.truncate(3);
            block.extend([0x7f, 0xa1, 0x1e]); // value length 4,000 (127 + 3,873)
            block.extend(std::iter::repeat_n(b'a', 4000));
            let mut input = request(&block, END_HEADERS);
            frame(&mut input, HEADERS, END_HEADERS, 3, &[0xbe; 4096]);
            input
        };
        let cases = [
            (too_big, RewriteError::TooLarge(64 << 10)),
            (flood, RewriteError::TooManyFrames),
            (interrupted, RewriteError::Interrupted),
            (other_stream, RewriteError::Interrupted),
            (bomb, RewriteError::TooLarge(64 << 10)),
            (
                request(&[0xbe], END_HEADERS),
                RewriteError::Hpack(HpackError::Index(62)),
            ),
            (request(&[], PADDED | END_HEADERS), RewriteError::Malformed),
            (
                request(&[1, 2, 3], PRIORITY | END_HEADERS),
                RewriteError::Malformed,
            ),
        ];
        for (input, want) in cases {
            assert_eq!(rewrite(&input), Err(want));
        }
        let mut oversized = PREFACE.to_vec();
        oversized.extend([0x00, 0x40, 0x01, HEADERS, 0, 0, 0, 0, 1]);
        assert_eq!(rewrite(&oversized), Err(RewriteError::FrameSize(16_385)));
    }

    /// Every representation a client may use, in blocks on any odd stream, with or without
    /// END_STREAM, padding and priority, cut into CONTINUATIONs anywhere: what the server
    /// decodes of the output is what the client meant (a model of its dynamic table says what
    /// that is, not the decoder under test), `:authority` aside, never-indexed marks kept, and
    /// each block's stream and END_STREAM kept.
    mod representations {
        use super::*;
        use crate::hpack::{put_integer, STATIC};
        use proptest::prelude::*;
        use std::collections::VecDeque;

        #[derive(Debug, Clone)]
        enum Name {
            Static(usize),
            New(String),
        }

        #[derive(Debug, Clone, Copy, PartialEq)]
        enum How {
            Incremental,
            Without,
            Never,
        }

        #[derive(Debug, Clone)]
        enum Rep {
            /// Static table entry 1..=61.
            Static(usize),
            /// A dynamic entry, counted from the newest (taken modulo the table's length).
            Dynamic(usize),
            Literal {
                name: Name,
                value: String,
                how: How,
            },
        }

        #[derive(Debug, Clone)]
        struct Block {
            stream: u32,
            end_stream: bool,
            pad: Option<u8>,
            priority: bool,
            size_update: Option<usize>,
            reps: Vec<Rep>,
            /// Where the encoded block is cut into CONTINUATIONs (fractions of its length).
            cuts: Vec<u8>,
        }

        /// The client's dynamic table, newest first, as RFC 7541 §4 keeps it.
        struct Table {
            entries: VecDeque<(String, String)>,
            size: usize,
            max: usize,
        }

        impl Table {
            fn evict(&mut self) {
                while self.size > self.max {
                    let (n, v) = self.entries.pop_back().expect("size counts entries");
                    self.size -= n.len() + v.len() + 32;
                }
            }

            fn insert(&mut self, name: String, value: String) {
                self.size += name.len() + value.len() + 32;
                self.entries.push_front((name, value));
                self.evict();
            }
        }

        fn string(out: &mut Vec<u8>, s: &str) {
            put_integer(out, s.len(), 7, 0);
            out.extend_from_slice(s.as_bytes());
        }

        /// The block's bytes and the fields it means: (name, value, never indexed).
        fn encode(block: &Block, table: &mut Table) -> (Vec<u8>, Vec<(String, String, bool)>) {
            let mut out = Vec::new();
            let mut fields = Vec::new();
            if let Some(size) = block.size_update {
                put_integer(&mut out, size, 5, 0x20);
                table.max = size;
                table.evict();
            }
            for rep in &block.reps {
                match rep {
                    Rep::Static(i) => {
                        put_integer(&mut out, *i, 7, 0x80);
                        let (n, v) = STATIC[i - 1];
                        fields.push((n.to_owned(), v.to_owned(), false));
                    }
                    Rep::Dynamic(k) if !table.entries.is_empty() => {
                        let k = k % table.entries.len();
                        put_integer(&mut out, 62 + k, 7, 0x80);
                        let (n, v) = table.entries[k].clone();
                        fields.push((n, v, false));
                    }
                    Rep::Dynamic(_) => {
                        put_integer(&mut out, 2, 7, 0x80);
                        fields.push((":method".into(), "GET".into(), false));
                    }
                    Rep::Literal { name, value, how } => {
                        let (prefix, flags) = match how {
                            How::Incremental => (6, 0x40),
                            How::Without => (4, 0x00),
                            How::Never => (4, 0x10),
                        };
                        let name = match name {
                            Name::Static(i) => {
                                put_integer(&mut out, *i, prefix, flags);
                                STATIC[i - 1].0.to_owned()
                            }
                            Name::New(n) => {
                                put_integer(&mut out, 0, prefix, flags);
                                string(&mut out, n);
                                n.clone()
                            }
                        };
                        string(&mut out, value);
                        if *how == How::Incremental {
                            table.insert(name.clone(), value.clone());
                        }
                        fields.push((name, value.clone(), *how == How::Never));
                    }
                }
            }
            let fields = fields
                .into_iter()
                .map(|(n, v, never)| {
                    let v = if n == ":authority" {
                        String::from_utf8_lossy(AUTHORITY).into_owned()
                    } else {
                        v
                    };
                    (n, v, never)
                })
                .collect();
            (out, fields)
        }

        /// HEADERS (with its padding and priority fields) and CONTINUATIONs carrying `encoded`.
        fn frames_of(block: &Block, encoded: &[u8], out: &mut Vec<u8>) {
            let mut at: Vec<usize> = block
                .cuts
                .iter()
                .map(|c| usize::from(*c) * encoded.len() / 256)
                .collect();
            at.sort_unstable();
            at.dedup();
            let mut pieces = Vec::new();
            let mut from = 0;
            for cut in at.into_iter().chain([encoded.len()]) {
                pieces.push(&encoded[from..cut.max(from)]);
                from = cut.max(from);
            }
            let last = pieces.len() - 1;
            for (i, piece) in pieces.into_iter().enumerate() {
                let mut flags = if i == last { END_HEADERS } else { 0 };
                if i > 0 {
                    frame(out, CONTINUATION, flags, block.stream, piece);
                    continue;
                }
                if block.end_stream {
                    flags |= END_STREAM;
                }
                let mut payload = Vec::new();
                if let Some(pad) = block.pad {
                    flags |= PADDED;
                    payload.push(pad);
                }
                if block.priority {
                    flags |= PRIORITY;
                    payload.extend_from_slice(&[0, 0, 0, 1, 15]);
                }
                payload.extend_from_slice(piece);
                payload.extend(std::iter::repeat_n(0, usize::from(block.pad.unwrap_or(0))));
                frame(out, HEADERS, flags, block.stream, &payload);
            }
        }

        fn rep() -> impl Strategy<Value = Rep> {
            let value = "[ -~]{0,40}";
            let name = prop_oneof![
                (1usize..=61).prop_map(Name::Static),
                "[a-z][a-z0-9-]{0,15}".prop_map(Name::New),
                Just(Name::Static(1)), // :authority
            ];
            let how = prop_oneof![Just(How::Incremental), Just(How::Without), Just(How::Never)];
            prop_oneof![
                (1usize..=61).prop_map(Rep::Static),
                (0usize..64).prop_map(Rep::Dynamic),
                (name, value, how).prop_map(|(name, value, how)| Rep::Literal { name, value, how }),
            ]
        }

        fn block() -> impl Strategy<Value = Block> {
            (
                (0u32..1 << 30).prop_map(|n| 2 * n + 1),
                any::<bool>(),
                prop::option::of(0u8..20),
                any::<bool>(),
                prop::option::weighted(0.2, 0usize..=4096),
                prop::collection::vec(rep(), 0..14),
                prop::collection::vec(any::<u8>(), 0..4),
            )
                .prop_map(
                    |(stream, end_stream, pad, priority, size_update, reps, cuts)| Block {
                        stream,
                        end_stream,
                        pad,
                        priority,
                        size_update,
                        reps,
                        cuts,
                    },
                )
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

            #[test]
            fn every_representation_stream_and_end_stream_passes_as_meant(
                blocks in prop::collection::vec(block(), 1..8),
            ) {
                let mut table = Table { entries: VecDeque::new(), size: 0, max: 4096 };
                let mut input = PREFACE.to_vec();
                let mut meant = Vec::new();
                for b in &blocks {
                    let (encoded, fields) = encode(b, &mut table);
                    frames_of(b, &encoded, &mut input);
                    meant.push(fields);
                }
                let mut out = Vec::new();
                Rewriter::new(1 << 16).feed(&input, &mut out).unwrap();
                let mut server = HpackDecoder::new(4096);
                let mut got = Vec::new();
                let mut heads = Vec::new();
                let mut block = Vec::new();
                for (kind, flags, stream, payload) in frames(&out) {
                    if kind == HEADERS {
                        heads.push((stream, flags & END_STREAM != 0));
                        prop_assert_eq!(flags & (PADDED | PRIORITY), 0);
                    }
                    block.extend_from_slice(&payload);
                    if flags & END_HEADERS != 0 {
                        let mut fields = Vec::new();
                        server
                            .decode_fields(&block, |n, v, never| {
                                fields.push((
                                    String::from_utf8_lossy(n).into_owned(),
                                    String::from_utf8_lossy(v).into_owned(),
                                    never,
                                ));
                            })
                            .unwrap();
                        got.push(fields);
                        block.clear();
                    }
                }
                prop_assert_eq!(got, meant);
                let sent: Vec<(u32, bool)> = blocks.iter().map(|b| (b.stream, b.end_stream)).collect();
                prop_assert_eq!(heads, sent);
            }
        }
    }
}
