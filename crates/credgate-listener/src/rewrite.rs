//! The IO of an HTTP/2 server connection on a unix socket: the peer's bytes handed to the
//! server with every request's `:authority` made acceptable to `h2`
//! ([`credgate_api::authority`]: clients on a unix socket send the socket's path there).
//! Writes pass unchanged.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use credgate_api::authority::Rewriter;
use tokio::io::{AsyncRead, ReadBuf};

use crate::conn::forward_write;

/// What one read from the peer takes at most when its bytes are rewritten.
const READ_CHUNK: usize = 8 << 10;

pub struct Rewritten<T> {
    io: T,
    rewriter: Rewriter,
    /// Rewritten bytes the server has not read yet, from `at`.
    out: Vec<u8>,
    at: usize,
}

impl<T> Rewritten<T> {
    /// `max_block`: the largest header block the peer may send, as sent or as decoded.
    pub fn new(io: T, max_block: usize) -> Self {
        Rewritten {
            io,
            rewriter: Rewriter::new(max_block),
            out: Vec::new(),
            at: 0,
        }
    }

    /// Hands the server what was rewritten and not read yet; whether there was any.
    fn drain_into(&mut self, buf: &mut ReadBuf<'_>) -> bool {
        if self.at == self.out.len() {
            return false;
        }
        let n = buf.remaining().min(self.out.len() - self.at);
        buf.put_slice(&self.out[self.at..self.at + n]);
        self.at += n;
        if self.at == self.out.len() {
            self.out.clear();
            self.at = 0;
            if self.out.capacity() > 4 * READ_CHUNK {
                self.out = Vec::new();
            }
        }
        true
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Rewritten<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if this.drain_into(buf) {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; READ_CHUNK];
            // Bytes that pass unchanged (the preface, DATA and the like) go straight on.
            let passing = this.rewriter.passing();
            let limit = if passing > 0 {
                passing.min(buf.remaining())
            } else {
                READ_CHUNK
            }
            .min(READ_CHUNK);
            let mut read = ReadBuf::new(&mut chunk[..limit]);
            std::task::ready!(Pin::new(&mut this.io).poll_read(cx, &mut read))?;
            let n = read.filled().len();
            if n == 0 {
                return Poll::Ready(Ok(()));
            }
            if passing > 0 {
                buf.put_slice(read.filled());
                this.rewriter.passed(n);
                return Poll::Ready(Ok(()));
            }
            if let Err(e) = this.rewriter.feed(read.filled(), &mut this.out) {
                tracing::debug!(error = %e, "closing a connection: its HTTP/2 frames cannot be passed on");
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
            }
        }
    }
}

forward_write!(Rewritten);

/// The rewriter's output judged by a decoder that is not credgate's: hyper's client (h2's
/// encoder, which indexes, Huffman-codes and marks sensitive fields never-indexed) sends
/// through [`Rewritten`] to hyper's server (h2's decoder), and every request must arrive as
/// it was sent but for `:authority`.
#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};
    use hyper::body::{Bytes, Incoming};
    use hyper::{HeaderMap, Method, Request, Response};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use proptest::prelude::*;
    use std::sync::{Arc, Mutex};

    #[derive(Debug, Clone, PartialEq)]
    struct Seen {
        method: Method,
        path: String,
        authority: Option<String>,
        headers: Vec<(String, Vec<u8>, bool)>,
        body: Vec<u8>,
    }

    /// The fields the server saw. h2's decoder does not keep a literal's never-indexed mark
    /// (`authority::tests::sensitive_fields_stay_never_indexed` checks the rewriter keeps it):
    /// every field reads as sent without it.
    fn fields(headers: &HeaderMap) -> Vec<(String, Vec<u8>, bool)> {
        let mut all: Vec<_> = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec(), false))
            .collect();
        all.sort();
        all
    }

    /// Sends `requests` at once on one connection; what the server saw, in the order sent.
    async fn through_the_rewriter(requests: Vec<Seen>) -> Vec<Seen> {
        let (client_io, server_io) = tokio::io::duplex(64 << 10);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let record = record.clone();
            async move {
                let (parts, body) = req.into_parts();
                let body = body.collect().await?.to_bytes().to_vec();
                let mut headers = parts.headers.clone();
                let id = headers.remove("x-id");
                // hyper's client adds the length of a body it knows.
                if let Some(length) = headers.remove("content-length") {
                    assert_eq!(length.to_str().unwrap(), body.len().to_string());
                }
                record.lock().unwrap().push((
                    id,
                    Seen {
                        method: parts.method,
                        path: parts.uri.path_and_query().unwrap().to_string(),
                        authority: parts.uri.authority().map(ToString::to_string),
                        headers: fields(&headers),
                        body,
                    },
                ));
                Ok::<_, hyper::Error>(Response::new(Full::new(Bytes::new())))
            }
        });
        let mut server = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        server.max_header_list_size(1 << 20);
        let served = tokio::spawn(
            server.serve_connection(TokioIo::new(Rewritten::new(server_io, 1 << 20)), service),
        );
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .max_header_list_size(1 << 20)
            .handshake::<_, Full<Bytes>>(TokioIo::new(client_io))
            .await
            .unwrap();
        let driven = tokio::spawn(connection);
        let calls = requests.iter().enumerate().map(|(i, r)| {
            let mut sender = sender.clone();
            let mut request = Request::builder()
                .method(r.method.clone())
                .uri(format!("http://credgate.sock.invalid{}", r.path))
                .header("x-id", i.to_string());
            for (name, value, sensitive) in &r.headers {
                let mut value = hyper::header::HeaderValue::from_bytes(value).unwrap();
                value.set_sensitive(*sensitive);
                request = request.header(name.as_str(), value);
            }
            let request = request
                .body(Full::new(Bytes::from(r.body.clone())))
                .unwrap();
            async move { sender.send_request(request).await.map(|r| r.status()) }
        });
        for answer in futures_util::future::join_all(calls).await {
            assert_eq!(answer.unwrap(), 200);
        }
        drop(sender);
        let _ = driven.await;
        let _ = served.await;
        let mut seen = std::mem::take(&mut *seen.lock().unwrap());
        seen.sort_by_key(|(id, _)| {
            id.as_ref()
                .unwrap()
                .to_str()
                .unwrap()
                .parse::<usize>()
                .unwrap()
        });
        seen.into_iter().map(|(_, s)| s).collect()
    }

    fn value() -> impl Strategy<Value = Vec<u8>> {
        // What a header value may hold: visible ASCII, space, tab and obs-text, every byte of
        // which has its own Huffman code; now and then one longer than a frame.
        let byte = prop_oneof![0x20u8..0x7f, 0x80u8..=0xff, Just(b'\t')];
        prop_oneof![
            8 => prop::collection::vec(byte.clone(), 0..64),
            1 => (prop::collection::vec(byte, 1..64), 17_000usize..20_000)
                .prop_map(|(pattern, n)| pattern.into_iter().cycle().take(n).collect()),
        ]
        .prop_map(|mut v| {
            // No leading or trailing whitespace: HTTP trims it.
            while v.first().is_some_and(|b| *b == b' ' || *b == b'\t') {
                v.remove(0);
            }
            while v.last().is_some_and(|b| *b == b' ' || *b == b'\t') {
                v.pop();
            }
            v
        })
    }

    /// Names hyper's client sets, strips (connection-specific) or the test uses itself.
    const HYPER_OWNS: &[&str] = &[
        "x-id",
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "upgrade",
        "te",
    ];

    fn request() -> impl Strategy<Value = Seen> {
        let name = prop_oneof![
            Just("authorization".to_owned()),
            Just("x-secret-token".to_owned()),
            Just("user-agent".to_owned()),
            Just("grpc-timeout".to_owned()),
            Just("x-repeated".to_owned()),
            "[a-z][a-z0-9-]{0,20}",
        ];
        (
            prop_oneof![Just(Method::GET), Just(Method::POST), Just(Method::PUT)],
            "/[a-zA-Z0-9/._~%-]{0,40}",
            prop::collection::vec((name, value()), 0..8),
            prop::collection::vec(any::<u8>(), 0..3000),
        )
            .prop_map(|(method, path, headers, body)| Seen {
                method,
                path,
                authority: None,
                headers: {
                    // Sensitivity goes with the name, and a sensitive value is never empty:
                    // h2's encoder itself indexes a field the static or dynamic table holds
                    // whole (`authorization: ""`), sensitive or not.
                    let mut h: Vec<_> = headers
                        .into_iter()
                        .filter(|(n, _)| !HYPER_OWNS.contains(&n.as_str()))
                        .map(|(n, mut v)| {
                            let sensitive = n == "authorization" || n.starts_with("x-secret");
                            if sensitive && v.is_empty() {
                                v = b"Basic c2VjcmV0".to_vec();
                            }
                            (n, v, sensitive)
                        })
                        .collect();
                    h.sort();
                    h.dedup_by(|a, b| a.0 == b.0);
                    h
                },
                body,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        #[test]
        fn every_request_arrives_as_sent_but_for_its_authority(
            requests in prop::collection::vec(request(), 1..6),
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let seen = runtime.block_on(through_the_rewriter(requests.clone()));
            prop_assert_eq!(seen.len(), requests.len());
            for (sent, got) in requests.iter().zip(&seen) {
                prop_assert_eq!(got.authority.as_deref(), Some("localhost"));
                prop_assert_eq!(&got.method, &sent.method);
                prop_assert_eq!(&got.path, &sent.path);
                let sent_fields: Vec<_> =
                    sent.headers.iter().map(|(n, v, _)| (n.clone(), v.clone(), false)).collect();
                prop_assert_eq!(&got.headers, &sent_fields);
                prop_assert_eq!(&got.body, &sent.body);
            }
        }
    }
}
