//! One unary gRPC call on a fresh connection, blocking, with no async runtime: what a
//! short-lived process (the docker credential helper) needs. Long-lived clients use
//! [`crate::connect`] and the generated clients instead.
//!
//! The whole request (connection preface, SETTINGS, a connection window update, HEADERS and
//! DATA) leaves in one write, so the agent reads the call in one go without waiting for any
//! answer of ours; then frames are read until the stream ends. Header blocks are decoded with
//! [`crate::hpack`]. The answer is bounded ([`MAX_RESPONSE`]), every read and write by the
//! timeout.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::frame::{self, PREFACE};

/// The largest answer accepted, in bytes of gRPC message. Our flow-control windows are opened
/// this far up front, so the agent never waits for a window update from us.
pub const MAX_RESPONSE: usize = 1 << 20;

/// The largest request sent: the agent's initial stream window, which we cannot wait for.
const MAX_REQUEST: usize = 65_535;
/// A bound on one header block (HEADERS plus CONTINUATION frames).
const MAX_HEADER_BLOCK: usize = 64 << 10;

const STREAM: u32 = 1;

/// Why a unary call failed. Never carries the answer's bytes.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The socket could not be reached.
    #[error("cannot connect: {0}")]
    Connect(io::Error),
    /// The socket is not one this client may trust (another user's, or writable by others).
    #[error("{0}")]
    Untrusted(crate::trust::TrustError),
    /// Reading or writing failed.
    #[error("i/o: {0}")]
    Io(io::Error),
    /// The server did not answer within the call's timeout.
    #[error("no answer within {0:?}")]
    Deadline(Duration),
    /// The server answered with a gRPC status other than OK.
    #[error("status {code}: {message}")]
    Status { code: i32, message: String },
    /// The answer was not well-formed HTTP/2 or gRPC.
    #[error("malformed answer: {0}")]
    Protocol(&'static str),
}

/// The gRPC length-prefixed message (uncompressed).
pub fn grpc_message(msg: &impl prost::Message) -> Vec<u8> {
    let len = msg.encoded_len();
    let mut buf = Vec::with_capacity(5 + len);
    buf.push(0);
    buf.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    msg.encode(&mut buf).expect("a Vec grows as needed");
    buf
}

/// The header block of a gRPC call of `method` to the agent.
pub fn request_head(method: &str) -> Vec<u8> {
    crate::hpack::encode([
        (&b":method"[..], &b"POST"[..]),
        (b":scheme", b"http"),
        (b":path", method.as_bytes()),
        (b":authority", b"credgate.sock"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ])
}

/// Everything the client sends, in one buffer.
fn request_bytes(method: &str, message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFACE.len() + 128 + message.len());
    out.extend_from_slice(PREFACE);
    let window = u32::try_from(MAX_RESPONSE).expect("fits");
    let mut settings = Vec::with_capacity(12);
    for (id, value) in [
        (frame::SETTINGS_ENABLE_PUSH, 0),
        (frame::SETTINGS_INITIAL_WINDOW_SIZE, window),
    ] {
        settings.extend_from_slice(&id.to_be_bytes());
        settings.extend_from_slice(&value.to_be_bytes());
    }
    frame::put(&mut out, frame::SETTINGS, 0, 0, &settings);
    // The connection window starts at 65,535 whatever the settings say: open it as far.
    frame::put(&mut out, frame::WINDOW_UPDATE, 0, 0, &window.to_be_bytes());
    let headers = request_head(method);
    frame::put(
        &mut out,
        frame::HEADERS,
        frame::END_HEADERS,
        STREAM,
        &headers,
    );
    let mut chunks = message.chunks(frame::MAX_FRAME).peekable();
    if chunks.peek().is_none() {
        frame::put(&mut out, frame::DATA, frame::END_STREAM, STREAM, &[]);
    }
    while let Some(chunk) = chunks.next() {
        let last = chunks.peek().is_none();
        let flags = if last { frame::END_STREAM } else { 0 };
        frame::put(&mut out, frame::DATA, flags, STREAM, chunk);
    }
    out
}

/// What gRPC percent-encodes in a `grpc-message`: bytes outside printable ASCII, and `%`.
const GRPC_MESSAGE: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%');

/// Percent-encoding of a `grpc-message` value.
pub fn encode_message(message: &str) -> String {
    percent_encoding::utf8_percent_encode(message, GRPC_MESSAGE).to_string()
}

/// Percent-decoding of a `grpc-message` value; a `%` not followed by two hex digits stays as
/// it is.
pub fn decode_message(raw: &[u8]) -> String {
    percent_encoding::percent_decode(raw)
        .decode_utf8_lossy()
        .into_owned()
}

/// What the stream carried, as far as a unary call cares.
#[derive(Default)]
struct Answer {
    http_status: Option<Vec<u8>>,
    grpc_status: Option<i32>,
    grpc_message: Option<String>,
    body: Vec<u8>,
    ended: bool,
}

impl Answer {
    fn header(&mut self, name: &[u8], value: &[u8]) {
        match name {
            b":status" => self.http_status = Some(value.to_vec()),
            b"grpc-status" => {
                self.grpc_status = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
            }
            b"grpc-message" => self.grpc_message = Some(decode_message(value)),
            _ => {}
        }
    }

    fn finish<Resp: prost::Message + Default>(self) -> Result<Resp, CallError> {
        if self.http_status.as_deref() != Some(b"200") {
            return Err(CallError::Protocol("http status"));
        }
        match self.grpc_status {
            Some(0) => {}
            Some(code) => {
                return Err(CallError::Status {
                    code,
                    message: self.grpc_message.unwrap_or_default(),
                })
            }
            None => return Err(CallError::Protocol("no grpc-status")),
        }
        let body = self.body;
        if body.len() < 5 || body[0] != 0 {
            return Err(CallError::Protocol("message frame"));
        }
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        let msg = body
            .get(5..5 + len)
            .ok_or(CallError::Protocol("message length"))?;
        Resp::decode(msg).map_err(|_| CallError::Protocol("message"))
    }
}

/// Reads frames from `io` until stream 1 ends; answers the agent's SETTINGS and PINGs.
struct Reader<'a, S> {
    io: &'a mut S,
    /// Answers to the agent's SETTINGS and PINGs, sent before the next read, or after the
    /// call's last frame: an answer that arrives in one read with the agent's SETTINGS (the
    /// usual case) is not held up by a write, and the agent reads the acknowledgement and the
    /// end of the connection together.
    replies: Vec<u8>,
    buf: Vec<u8>,
    start: usize,
    hpack: crate::hpack::HpackDecoder,
    block: Vec<u8>,
    in_block: bool,
    block_ends_stream: bool,
}

impl<S: Read + Write> Reader<'_, S> {
    fn frame(&mut self) -> Result<(u8, u8, u32, Vec<u8>), CallError> {
        loop {
            let avail = &self.buf[self.start..];
            if let Some(head) = frame::Head::peek(avail) {
                if head.len > frame::MAX_FRAME {
                    return Err(CallError::Protocol("oversized frame"));
                }
                let end = frame::HEAD_LEN + head.len;
                if let Some(payload) = avail.get(frame::HEAD_LEN..end) {
                    let payload = payload.to_vec();
                    self.start += end;
                    return Ok((head.kind, head.flags, head.stream, payload));
                }
            }
            self.send_replies()?;
            if self.start > 0 {
                self.buf.drain(..self.start);
                self.start = 0;
            }
            let have = self.buf.len();
            self.buf.resize(have + (16 << 10), 0);
            let n = loop {
                match self.io.read(&mut self.buf[have..]) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    r => break r,
                }
            };
            self.buf.truncate(have + *n.as_ref().unwrap_or(&0));
            match n {
                Ok(0) => return Err(CallError::Protocol("the agent closed the connection")),
                Ok(_) => {}
                Err(e) => return Err(CallError::Io(e)),
            }
        }
    }

    fn send_replies(&mut self) -> Result<(), CallError> {
        if !self.replies.is_empty() {
            self.io.write_all(&self.replies).map_err(CallError::Io)?;
            self.replies.clear();
        }
        Ok(())
    }

    fn run(&mut self) -> Result<Answer, CallError> {
        let mut answer = Answer::default();
        while !answer.ended {
            let (kind, flags, stream, payload) = self.frame()?;
            if self.in_block && kind != frame::CONTINUATION {
                return Err(CallError::Protocol("header block interrupted"));
            }
            match kind {
                frame::SETTINGS if stream == 0 && flags & frame::ACK == 0 => {
                    frame::put(&mut self.replies, frame::SETTINGS, frame::ACK, 0, &[]);
                }
                frame::PING if flags & frame::ACK == 0 => {
                    frame::put(&mut self.replies, frame::PING, frame::ACK, 0, &payload);
                }
                frame::GOAWAY => {
                    return Err(CallError::Protocol("the agent closed the connection"))
                }
                frame::RST_STREAM if stream == STREAM => {
                    return Err(CallError::Protocol("the agent reset the call"))
                }
                frame::HEADERS if stream == STREAM => {
                    let fragment = frame::header_fragment(&payload, flags)
                        .map_err(|_| CallError::Protocol("frame padding"))?;
                    self.block.clear();
                    self.block_ends_stream = flags & frame::END_STREAM != 0;
                    self.fragment(fragment, flags, &mut answer)?;
                }
                frame::CONTINUATION if stream == STREAM && self.in_block => {
                    self.fragment(&payload, flags, &mut answer)?;
                }
                frame::DATA if stream == STREAM => {
                    let data = frame::data(&payload, flags)
                        .map_err(|_| CallError::Protocol("frame padding"))?;
                    if answer.body.len() + data.len() > MAX_RESPONSE + 5 {
                        return Err(CallError::Protocol("answer too large"));
                    }
                    answer.body.extend_from_slice(data);
                    answer.ended = flags & frame::END_STREAM != 0;
                }
                frame::CONTINUATION => return Err(CallError::Protocol("stray continuation")),
                // Window updates, priorities, settings acks, frames of other streams and
                // unknown types change nothing for one small call.
                _ => {}
            }
        }
        // The answer is whole: a failed write now (the agent went away) loses nothing.
        let _ = self.send_replies();
        Ok(answer)
    }

    fn fragment(
        &mut self,
        fragment: &[u8],
        flags: u8,
        answer: &mut Answer,
    ) -> Result<(), CallError> {
        if self.block.len() + fragment.len() > MAX_HEADER_BLOCK {
            return Err(CallError::Protocol("header block too large"));
        }
        self.block.extend_from_slice(fragment);
        self.in_block = flags & frame::END_HEADERS == 0;
        if self.in_block {
            return Ok(());
        }
        self.hpack
            .decode(&self.block, |name, value| answer.header(name, value))
            .map_err(|_| CallError::Protocol("header block"))?;
        answer.ended = self.block_ends_stream;
        Ok(())
    }
}

/// Calls `method` (`/credgate.v1.Credentials/Lookup`) once on the socket at `path`; the whole
/// call (connecting, writing, every read) ends by `timeout`, whatever the server sends
/// meanwhile.
pub fn call<Req, Resp>(
    path: &Path,
    method: &str,
    request: &Req,
    timeout: Duration,
) -> Result<Resp, CallError>
where
    Req: prost::Message,
    Resp: prost::Message + Default,
{
    let message = grpc_message(request);
    if message.len() > MAX_REQUEST {
        return Err(CallError::Protocol("request too large"));
    }
    let deadline = std::time::Instant::now() + timeout;
    crate::trust::check_socket(path).map_err(CallError::Untrusted)?;
    let io = UnixStream::connect(path).map_err(CallError::Connect)?;
    let timed_out = |e: CallError| match e {
        // A read or write that waited until the deadline: EAGAIN from SO_RCVTIMEO, or ours.
        CallError::Io(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            CallError::Deadline(timeout)
        }
        e => e,
    };
    exchange(&mut Deadlined { io, deadline }, method, &message)
        .map_err(timed_out)?
        .finish()
        .map_err(timed_out)
}

/// A socket whose every read and write waits at most until one deadline.
struct Deadlined {
    io: UnixStream,
    deadline: std::time::Instant,
}

impl Deadlined {
    fn left(&self) -> io::Result<Duration> {
        let left = self
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the call's deadline passed",
            ));
        }
        Ok(left)
    }
}

impl Read for Deadlined {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.io.set_read_timeout(Some(left))?;
        self.io.read(buf)
    }
}

impl Write for Deadlined {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.io.set_write_timeout(Some(left))?;
        self.io.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.io.flush()
    }
}

fn exchange<S: Read + Write>(
    io: &mut S,
    method: &str,
    message: &[u8],
) -> Result<Answer, CallError> {
    io.write_all(&request_bytes(method, message))
        .map_err(CallError::Io)?;
    // Our SETTINGS keep the default header table size; the agent may not use more.
    let hpack = crate::hpack::HpackDecoder::new(4096);
    Reader {
        io,
        replies: Vec::new(),
        buf: Vec::with_capacity(16 << 10),
        start: 0,
        hpack,
        block: Vec::new(),
        in_block: false,
        block_ends_stream: false,
    }
    .run()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_message_is_percent_encoded_as_grpc_does_and_decodes_back() {
        let message = "100% sure: é\n\x7f~ ok";
        let encoded = encode_message(message);
        assert_eq!(encoded, "100%25 sure: %C3%A9%0A%7F~ ok");
        assert_eq!(decode_message(encoded.as_bytes()), message);
    }

    #[test]
    fn grpc_message_is_percent_decoded() {
        assert_eq!(decode_message(b"bad%20ref%3A x"), "bad ref: x");
        assert_eq!(decode_message(b"100%"), "100%");
        assert_eq!(decode_message(b"%zz"), "%zz");
        assert_eq!(
            decode_message(b"401%20Unauthorized%3A%20x%"),
            "401 Unauthorized: x%"
        );
        assert_eq!(decode_message(b"100%25"), "100%");
    }

    #[test]
    fn messages_carry_a_length_prefix() {
        let f = grpc_message(&crate::v1::PingRequest {});
        assert_eq!(&f[..], &[0, 0, 0, 0, 0]);
        let f = grpc_message(&crate::v1::HealthResponse {
            status: "SERVING".into(),
        });
        assert_eq!(f[4] as usize, f.len() - 5);
    }

    /// A server that never answers but keeps the connection busy with a PING every 50 ms: the
    /// call still ends at its deadline (a per-read timeout would wait for ever).
    #[test]
    fn a_call_ends_at_its_deadline_while_the_server_keeps_pinging() {
        use std::os::unix::net::UnixListener;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut ping = Vec::new();
            frame::put(&mut ping, frame::PING, 0, 0, b"keepbusy");
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                if c.write_all(&ping).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let started = std::time::Instant::now();
        let r: Result<crate::v1::HealthResponse, _> = call(
            &path,
            crate::methods::HEALTH,
            &crate::v1::HealthRequest {},
            Duration::from_millis(400),
        );
        let took = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let e = r.unwrap_err();
        assert!(
            matches!(&e, CallError::Deadline(d) if *d == Duration::from_millis(400)),
            "{e}"
        );
        assert_eq!(e.to_string(), "no answer within 400ms");
        // Far below what endless PINGs would take; the bound is the test's own guard.
        assert!(took < Duration::from_secs(30), "{took:?}");
        server.join().unwrap();
    }

    #[test]
    fn a_socket_of_another_kind_is_refused_before_connecting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("not-a-socket");
        std::fs::write(&path, "").unwrap();
        let r: Result<crate::v1::HealthResponse, _> = call(
            &path,
            crate::methods::HEALTH,
            &crate::v1::HealthRequest {},
            Duration::from_secs(1),
        );
        assert!(matches!(r, Err(CallError::Untrusted(_))));
    }

    /// A scripted peer: what it answers is fixed, what it was sent is kept.
    struct Peer {
        answer: io::Cursor<Vec<u8>>,
        sent: Vec<u8>,
        /// Bytes per read: 1 by default, so that frames split across reads must be put back
        /// together.
        chunk: usize,
    }

    impl Read for Peer {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.chunk);
            self.answer.read(&mut buf[..n])
        }
    }

    impl Write for Peer {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.sent.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn call_against(answer: Vec<u8>) -> (Result<crate::v1::HealthResponse, CallError>, Vec<u8>) {
        call_against_in(answer, 1)
    }

    fn call_against_in(
        answer: Vec<u8>,
        chunk: usize,
    ) -> (Result<crate::v1::HealthResponse, CallError>, Vec<u8>) {
        let mut peer = Peer {
            answer: io::Cursor::new(answer),
            sent: Vec::new(),
            chunk,
        };
        let r = exchange(
            &mut peer,
            crate::methods::HEALTH,
            &grpc_message(&crate::v1::HealthRequest {}),
        )
        .and_then(Answer::finish);
        (r, peer.sent)
    }

    #[test]
    fn a_whole_exchange_with_settings_ping_continuation_and_padding() {
        let mut a = Vec::new();
        frame::put(&mut a, frame::SETTINGS, 0, 0, &[0, 3, 0, 0, 0, 100]);
        frame::put(&mut a, frame::PING, 0, 0, b"12345678");
        // The first block adds an entry to the dynamic table, which the trailers use: one
        // decoder serves the whole connection.
        let mut head = block(&[(b":status", b"200"), (b"content-type", b"application/grpc")]);
        head.extend_from_slice(b"\x40\x06x-seen\x011");
        let (first, rest) = head.split_at(3);
        frame::put(&mut a, frame::HEADERS, 0, STREAM, first);
        frame::put(
            &mut a,
            frame::CONTINUATION,
            frame::END_HEADERS,
            STREAM,
            rest,
        );
        let msg = grpc_message(&crate::v1::HealthResponse {
            status: "SERVING".into(),
        });
        let mut padded = vec![3];
        padded.extend_from_slice(&msg);
        padded.extend_from_slice(&[0, 0, 0]);
        frame::put(&mut a, frame::DATA, frame::PADDED, STREAM, &padded);
        frame::put(&mut a, frame::WINDOW_UPDATE, 0, 0, &[0, 0, 1, 0]);
        let mut trailers = block(&[(b"grpc-status", b"0")]);
        trailers.push(0x80 | 62);
        frame::put(
            &mut a,
            frame::HEADERS,
            frame::END_HEADERS | frame::END_STREAM,
            STREAM,
            &trailers,
        );
        // Byte by byte, and the whole answer in one read (the acknowledgements then leave
        // after it).
        for chunk in [1, usize::MAX] {
            let (r, sent) = call_against_in(a.clone(), chunk);
            assert_eq!(r.unwrap().status, "SERVING");
            assert!(sent.starts_with(PREFACE));
            // After the request: a SETTINGS ack and the PING's answer with its payload.
            let mut tail = Vec::new();
            frame::put(&mut tail, frame::SETTINGS, frame::ACK, 0, &[]);
            frame::put(&mut tail, frame::PING, frame::ACK, 0, b"12345678");
            assert!(sent.ends_with(&tail), "chunk {chunk}");
            let request = request_bytes(
                crate::methods::HEALTH,
                &grpc_message(&crate::v1::HealthRequest {}),
            );
            assert_eq!(sent.len(), request.len() + tail.len(), "chunk {chunk}");
        }
    }

    #[test]
    fn trailers_only_answers_carry_the_status() {
        let a = frames(&[(
            frame::HEADERS,
            frame::END_HEADERS | frame::END_STREAM,
            STREAM,
            &block(&[
                (b":status", b"200"),
                (b"grpc-status", b"7"),
                (b"grpc-message", b"uid%2042 may not"),
            ]),
        )]);
        match call_against(a).0 {
            Err(CallError::Status { code, message }) => {
                assert_eq!((code, message.as_str()), (7, "uid 42 may not"));
            }
            other => panic!("{other:?}"),
        }
    }

    /// Frames after one another.
    fn frames(list: &[(u8, u8, u32, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (kind, flags, stream, payload) in list {
            frame::put(&mut out, *kind, *flags, *stream, payload);
        }
        out
    }

    /// A header block from a fresh encoder.
    fn block(fields: &[(&[u8], &[u8])]) -> Vec<u8> {
        crate::hpack::encode(fields.iter().copied())
    }

    #[test]
    fn broken_answers_are_clear_errors() {
        use frame::*;
        let ok = block(&[(b":status", b"200")]);
        let done = END_HEADERS | END_STREAM;
        let mut oversized = vec![0x01, 0, 0, DATA, 0, 0, 0, 0, 1];
        oversized.resize(9 + 65536, 0);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (Vec::new(), "the agent closed the connection"),
            (
                frames(&[(GOAWAY, 0, 0, &[0; 8])]),
                "the agent closed the connection",
            ),
            (
                frames(&[(RST_STREAM, 0, STREAM, &[0, 0, 0, 2])]),
                "the agent reset the call",
            ),
            (oversized, "oversized frame"),
            (
                frames(&[(HEADERS, 0, STREAM, &ok), (DATA, 0, STREAM, b"x")]),
                "header block interrupted",
            ),
            (
                frames(&[(HEADERS, END_HEADERS, STREAM, &[0xff; 4])]),
                "header block",
            ),
            (
                frames(&[(DATA, PADDED, STREAM, &[9, 1, 2])]),
                "frame padding",
            ),
            (
                frames(&[
                    (HEADERS, END_HEADERS, STREAM, &ok),
                    (DATA, END_STREAM, STREAM, &[0; 5]),
                ]),
                "no grpc-status",
            ),
            (
                frames(&[(
                    HEADERS,
                    done,
                    STREAM,
                    &block(&[(b":status", b"503"), (b"grpc-status", b"0")]),
                )]),
                "http status",
            ),
            (
                frames(&[(
                    HEADERS,
                    done,
                    STREAM,
                    &block(&[(b":status", b"200"), (b"grpc-status", b"0")]),
                )]),
                "message frame",
            ),
        ];
        for (answer, want) in cases {
            match call_against(answer).0 {
                Err(CallError::Protocol(why)) => assert_eq!(why, want),
                other => panic!("{want}: {other:?}"),
            }
        }
    }

    #[test]
    fn large_requests_are_split_into_frames() {
        let message = vec![7u8; 40_000];
        let bytes = request_bytes("/m", &message);
        let mut rest = &bytes[PREFACE.len()..];
        let mut data = Vec::new();
        let mut ended = false;
        while let Some(head) = frame::Head::peek(rest) {
            assert!(head.len <= frame::MAX_FRAME);
            if head.kind == frame::DATA {
                assert!(!ended);
                data.extend_from_slice(&rest[9..9 + head.len]);
                ended = head.flags & frame::END_STREAM != 0;
            }
            rest = &rest[9 + head.len..];
        }
        assert!(rest.is_empty());
        assert!(ended);
        assert_eq!(data, message);
    }
}
