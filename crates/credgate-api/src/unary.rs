//! One unary call on a fresh connection, with nothing but hyper's HTTP/2 client: what a
//! short-lived process (the docker credential helper) needs, without a channel's background
//! machinery. Long-lived clients use [`crate::connect`] and the generated clients instead.

use std::path::Path;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::UnixStream;

/// Why a unary call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The socket could not be reached.
    #[error("cannot connect: {0}")]
    Connect(#[source] std::io::Error),
    /// HTTP/2 failed.
    #[error("http/2: {0}")]
    Http(#[source] hyper::Error),
    /// The server answered with a gRPC status other than OK.
    #[error("status {code}: {message}")]
    Status { code: i32, message: String },
    /// The answer was not a well-formed gRPC message.
    #[error("malformed answer: {0}")]
    Protocol(&'static str),
}

fn frame(msg: &impl prost::Message) -> Bytes {
    let len = msg.encoded_len();
    let mut buf = Vec::with_capacity(5 + len);
    buf.push(0);
    buf.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    msg.encode(&mut buf).expect("a Vec grows as needed");
    Bytes::from(buf)
}

/// Percent-decoding of `grpc-message`.
fn decode_message(raw: &[u8]) -> String {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%' && i + 2 < raw.len() {
            let hex = std::str::from_utf8(&raw[i + 1..i + 3]).unwrap_or("");
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(raw[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn status(headers: &hyper::HeaderMap) -> Option<Result<(), CallError>> {
    let code: i32 = headers.get("grpc-status")?.to_str().ok()?.parse().ok()?;
    if code == 0 {
        return Some(Ok(()));
    }
    let message = headers
        .get("grpc-message")
        .map(|m| decode_message(m.as_bytes()))
        .unwrap_or_default();
    Some(Err(CallError::Status { code, message }))
}

/// Calls `method` (`/credgate.v1.Credentials/Lookup`) once on the socket at `path`.
pub async fn call<Req, Resp>(path: &Path, method: &str, request: &Req) -> Result<Resp, CallError>
where
    Req: prost::Message,
    Resp: prost::Message + Default,
{
    let io = UnixStream::connect(path)
        .await
        .map_err(CallError::Connect)?;
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
            .await
            .map_err(CallError::Http)?;
    tokio::spawn(conn);
    let req = hyper::Request::post(format!("http://credgate.sock{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(frame(request)))
        .map_err(|_| CallError::Protocol("request"))?;
    let resp = send.send_request(req).await.map_err(CallError::Http)?;
    if resp.status() != hyper::StatusCode::OK {
        return Err(CallError::Protocol("http status"));
    }
    // A trailers-only answer carries the status in the headers.
    if let Some(Err(e)) = status(resp.headers()) {
        return Err(e);
    }
    let collected = resp.into_body().collect().await.map_err(CallError::Http)?;
    if let Some(Err(e)) = collected.trailers().and_then(status) {
        return Err(e);
    }
    let body = collected.to_bytes();
    if body.len() < 5 || body[0] != 0 {
        return Err(CallError::Protocol("message frame"));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    let msg = body
        .get(5..5 + len)
        .ok_or(CallError::Protocol("message length"))?;
    Resp::decode(msg).map_err(|_| CallError::Protocol("message"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_message_is_percent_decoded() {
        assert_eq!(decode_message(b"bad%20ref%3A x"), "bad ref: x");
        assert_eq!(decode_message(b"100%"), "100%");
        assert_eq!(decode_message(b"%zz"), "%zz");
    }

    #[test]
    fn frames_carry_a_length_prefix() {
        let f = frame(&crate::v1::PingRequest {});
        assert_eq!(&f[..], &[0, 0, 0, 0, 0]);
        let f = frame(&crate::v1::HealthResponse {
            status: "SERVING".into(),
        });
        assert_eq!(f[4] as usize, f.len() - 5);
    }
}
