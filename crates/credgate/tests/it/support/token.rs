//! A small token endpoint for the registry's Bearer auth, written for the tests: users with
//! passwords and the repositories each may pull; tokens are JWTs signed RS256 with a
//! self-signed certificate (made with the openssl command) that the registry trusts.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;

pub const ISSUER: &str = "credgate-test-issuer";
pub const SERVICE: &str = "credgate-test-registry";

/// user → (password, repositories it may pull; `*` for all, with push).
pub type Users = Arc<Mutex<HashMap<String, (String, Vec<String>)>>>;

pub struct TokenServer {
    pub port: u16,
    pub cert: PathBuf,
    pub users: Users,
}

fn b64url(data: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(data)
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("openssl runs");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TokenServer {
    pub fn start(dir: &Path, users: &[(&str, &str, &[&str])]) -> TokenServer {
        for (user, password, _) in users {
            super::secrets::login(user, password);
        }
        super::require("openssl");
        let key = dir.join("token.key");
        let cert = dir.join("token.crt");
        run(Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=credgate-test-token",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert));
        let der = dir.join("token.der");
        run(Command::new("openssl")
            .args(["x509", "-outform", "DER", "-in"])
            .arg(&cert)
            .arg("-out")
            .arg(&der));
        let x5c = base64::engine::general_purpose::STANDARD.encode(std::fs::read(&der).unwrap());
        let users: Users = Arc::new(Mutex::new(
            users
                .iter()
                .map(|(u, p, repos)| {
                    (
                        (*u).to_owned(),
                        (
                            (*p).to_owned(),
                            repos.iter().map(|r| (*r).to_owned()).collect(),
                        ),
                    )
                })
                .collect(),
        ));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = users.clone();
        let key_path = key.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let (status, body) = handle(&mut stream, &state, &key_path, &x5c);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        TokenServer { port, cert, users }
    }

    pub fn realm(&self) -> String {
        format!("http://127.0.0.1:{}/token", self.port)
    }

    pub fn set_password(&self, user: &str, password: &str) {
        super::secrets::login(user, password);
        if let Some(entry) = self.users.lock().unwrap().get_mut(user) {
            entry.0 = password.to_owned();
        }
    }
}

/// A form value: `+` is a space, `%XX` a byte.
fn decode_form(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(x) => {
                        out.push(x);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn handle(
    stream: &mut std::net::TcpStream,
    users: &Users,
    key: &Path,
    x5c: &str,
) -> (&'static str, String) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return ("400 Bad Request", "{}".into());
    }
    let mut auth = None;
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).is_err() || line == "\r\n" || line.is_empty() {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("authorization: basic ") {
            let raw = line["authorization: basic ".len()..].trim().to_owned();
            let _ = v;
            auth = base64::engine::general_purpose::STANDARD
                .decode(raw)
                .ok()
                .and_then(|b| String::from_utf8(b).ok());
        }
        if let Some(v) = lower.strip_prefix("content-length: ") {
            length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    let _ = reader.read_exact(&mut body);
    let path = request_line.split_whitespace().nth(1).unwrap_or("");
    // containerd asks with OAuth's POST when it has a credential (a form: grant_type=password,
    // username, password, scope), as Docker Hub's endpoint takes it; other clients with GET.
    let form = String::from_utf8_lossy(&body).into_owned();
    let posted = request_line.starts_with("POST ");
    let query = if posted {
        form.as_str()
    } else {
        path.split_once('?').map(|(_, q)| q).unwrap_or("")
    };
    if posted {
        let field = |k: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(k))
                .map(decode_form)
        };
        if let (Some(u), Some(p)) = (field("username="), field("password=")) {
            auth = Some(format!("{u}:{p}"));
        }
    }
    let scopes: Vec<String> = query
        .split('&')
        .filter_map(|kv| kv.strip_prefix("scope="))
        .map(|s| {
            s.replace("%3A", ":")
                .replace("%2F", "/")
                .replace("%2C", ",")
        })
        .collect();
    let (subject, allowed): (String, Vec<String>) = match auth {
        None => (String::new(), Vec::new()),
        Some(pair) => {
            let (u, p) = pair.split_once(':').unwrap_or((&pair, ""));
            match users.lock().unwrap().get(u) {
                Some((pw, repos)) if pw == p => (u.to_owned(), repos.clone()),
                _ => {
                    return (
                        "401 Unauthorized",
                        r#"{"details":"bad credentials"}"#.into(),
                    )
                }
            }
        }
    };
    let mut access = Vec::new();
    for scope in scopes {
        // repository:NAME:ACTIONS
        let mut parts = scope.splitn(3, ':');
        let (Some("repository"), Some(name), Some(actions)) =
            (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let granted: Vec<&str> = if allowed.iter().any(|r| r == "*") {
            actions.split(',').collect()
        } else if allowed.iter().any(|r| r == name) {
            actions.split(',').filter(|a| *a == "pull").collect()
        } else {
            Vec::new()
        };
        access.push(serde_json::json!({"type": "repository", "name": name, "actions": granted}));
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let header = serde_json::json!({"typ": "JWT", "alg": "RS256", "x5c": [x5c]});
    let claims = serde_json::json!({
        "iss": ISSUER, "sub": subject, "aud": SERVICE,
        "exp": now + 300, "nbf": now - 10, "iat": now,
        "jti": format!("{now}-{}", std::process::id()),
        "access": access,
    });
    let signing_input = format!(
        "{}.{}",
        b64url(header.to_string().as_bytes()),
        b64url(claims.to_string().as_bytes())
    );
    let signature = super::output_with_stdin(
        Command::new("openssl")
            .args(["dgst", "-sha256", "-sign"])
            .arg(key),
        signing_input.as_bytes(),
    )
    .stdout;
    let token = format!("{signing_input}.{}", b64url(&signature));
    (
        "200 OK",
        serde_json::json!({"token": token, "access_token": token}).to_string(),
    )
}
