//! A registry stub with `Basic` auth, for what Debian's registry cannot show: it accepts its
//! users' credentials at `/v2/` and answers 401 for every repository (a credential that may not
//! read the image, or a typo'd name, as token registries and Docker Hub answer them). It
//! counts the requests it gets, and whether each carried credentials. `silent` stubs accept
//! connections and never answer (a registry that does not answer in time); `holding` stubs
//! never answer the requests that carry one user's credential.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use base64::Engine as _;

#[derive(Default)]
struct State {
    /// user → password.
    users: Vec<(String, String)>,
    /// Each request: its path and whether it carried an Authorization header.
    seen: Vec<(String, bool)>,
    /// Manifests are served to its users (a registry they may read).
    serves: bool,
    /// Connections a silent stub holds, or requests a holding stub holds.
    held: usize,
    /// A holding stub's user, whose requests are never answered, and those requests.
    holds: Option<(String, Vec<std::net::TcpStream>)>,
}

pub struct StubRegistry {
    pub port: u16,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
}

impl StubRegistry {
    /// A stub whose one user is `user`:`password`.
    pub fn start(user: &str, password: &str) -> StubRegistry {
        Self::spawn(Some((user, password)))
    }

    /// A stub that accepts connections and never answers.
    pub fn silent() -> StubRegistry {
        Self::spawn(None)
    }

    /// A stub whose one user may read every repository: manifests are served to it (with a
    /// digest), as a registry that accepts a pod's secret does.
    pub fn serving(user: &str, password: &str) -> StubRegistry {
        let stub = Self::spawn(Some((user, password)));
        stub.state.lock().unwrap().serves = true;
        stub
    }

    /// A stub whose one user is `user`:`password`, and that never answers a request carrying
    /// `holds`'s credential (whatever its password): a registry stalling on one credential.
    pub fn holding(user: &str, password: &str, holds: &str) -> StubRegistry {
        let stub = Self::spawn(Some((user, password)));
        stub.state.lock().unwrap().holds = Some((holds.to_owned(), Vec::new()));
        stub
    }

    fn spawn(user: Option<(&str, &str)>) -> StubRegistry {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let answers = user.is_some();
        if let Some((u, p)) = user {
            crate::secrets::login(u, p);
            state.lock().unwrap().users.push((u.into(), p.into()));
        }
        let (st, halt) = (state.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming() {
                if halt.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(mut stream) = stream else { continue };
                if !answers {
                    held.push(stream);
                    st.lock().unwrap().held = held.len();
                    continue;
                }
                let st = st.clone();
                std::thread::spawn(move || {
                    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(5)));
                    answer(&mut stream, &st);
                });
            }
        });
        StubRegistry { port, state, stop }
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `user`'s password is `password` from now on.
    pub fn set_password(&self, user: &str, password: &str) {
        crate::secrets::login(user, password);
        let mut st = self.state.lock().unwrap();
        st.users.retain(|(u, _)| u != user);
        st.users.push((user.into(), password.into()));
    }

    /// Connections a silent stub accepted, or requests a holding stub received, and holds,
    /// never answering.
    pub fn held(&self) -> usize {
        self.state.lock().unwrap().held
    }

    /// Requests so far: (path, carried credentials).
    pub fn seen(&self) -> Vec<(String, bool)> {
        self.state.lock().unwrap().seen.clone()
    }
}

impl Drop for StubRegistry {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop.
        let _ = std::net::TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn answer(stream: &mut std::net::TcpStream, state: &Mutex<State>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let mut basic = None;
    let mut authorized = false;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).is_err() || line == "\r\n" || line.is_empty() {
            break;
        }
        if line.to_ascii_lowercase().starts_with("authorization:") {
            authorized = true;
            basic = line
                .split_once(' ')
                .map(|(_, v)| v.trim())
                .and_then(|v| v.strip_prefix("Basic "))
                .and_then(|raw| base64::engine::general_purpose::STANDARD.decode(raw).ok())
                .and_then(|b| String::from_utf8(b).ok());
        }
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .to_owned();
    let mut st = state.lock().unwrap();
    st.seen.push((path.clone(), authorized));
    let user = basic
        .as_deref()
        .map(|pair| pair.split_once(':').map_or(pair, |(u, _)| u));
    if let Some((holds, kept)) = st.holds.as_mut() {
        if user == Some(holds.as_str()) {
            kept.extend(stream.try_clone());
            st.held += 1;
            return;
        }
    }
    let accepted = basic.as_deref().is_some_and(|pair| {
        let (u, p) = pair.split_once(':').unwrap_or((pair, ""));
        st.users.iter().any(|(user, pw)| user == u && pw == p)
    });
    let serves = st.serves;
    drop(st);
    let ok = (path == "/v2/" || (serves && path.contains("/manifests/"))) && accepted;
    let _ = if ok {
        write!(
            stream,
            "HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\nDocker-Content-Digest: sha256:{}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}",
            "ab".repeat(32)
        )
    } else {
        let body = r#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}"#;
        write!(
            stream,
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"stub\"\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
}
