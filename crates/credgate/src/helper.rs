//! `docker-credential-credgate`: the docker credential helper protocol, backed by the running
//! agent (it never runs plugins itself).
//!
//! `get` reads a registry `host[:port]` on stdin and prints `{"ServerURL","Username","Secret"}`
//! for the first credential in try-order; when there is none it prints `credentials not found
//! in native keychain` and exits 1, so clients carry on anonymously. `store` and `erase`
//! answer that the store is read-only; `list` prints `{}` (plugins cannot be enumerated).
//! The agent is found through `CREDGATE_SOCKET`, else the default socket.

use std::io::{Read, Write};
use std::process::ExitCode;

use credgate_api::unary::{self, CallError};
use credgate_api::v1::{LookupRequest, LookupResponse};

const NOT_FOUND: &str = "credentials not found in native keychain";
const LOOKUP: &str = "/credgate.v1.Credentials/Lookup";

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let verb = args.next().unwrap_or_default();
    let result = match verb.as_str() {
        "get" => get(),
        "store" | "erase" => {
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            Err("credgate: the credential store is read-only; credentials come from the node's providers".into())
        }
        "list" => Ok("{}".into()),
        "version" | "--version" | "-v" => Ok(format!(
            "docker-credential-credgate {}",
            env!("CARGO_PKG_VERSION")
        )),
        _ => {
            eprintln!("usage: docker-credential-credgate get|store|erase|list|version\n\nA docker credential helper backed by the credgate agent (CREDGATE_SOCKET or the default socket).");
            return ExitCode::from(2);
        }
    };
    // The protocol reads answers and errors alike from stdout.
    let mut out = std::io::stdout().lock();
    match result {
        Ok(text) => {
            let _ = writeln!(out, "{text}");
            ExitCode::SUCCESS
        }
        Err(text) => {
            let _ = writeln!(out, "{text}");
            ExitCode::from(1)
        }
    }
}

/// `https://index.docker.io/v1/` → `index.docker.io`; `127.0.0.1:5000` unchanged.
fn registry_host(input: &str) -> &str {
    let s = input.trim();
    let s = s
        .strip_prefix("https://")
        .or_else(|| s.strip_prefix("http://"))
        .unwrap_or(s);
    s.split('/').next().unwrap_or_default()
}

fn get() -> Result<String, String> {
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .map_err(|e| format!("credgate: cannot read the server URL: {e}"))?;
    let server_url = input.trim().to_owned();
    let host = registry_host(&server_url).to_owned();
    if host.is_empty() {
        return Err("credgate: no server URL on stdin".into());
    }
    let socket = credgate_api::socket_path(None);
    // One call on a fresh connection: a current-thread runtime with IO only, and a bare
    // HTTP/2 exchange instead of a channel (this process lives for one answer).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|e| format!("credgate: {e}"))?;
    let request = LookupRequest {
        image: host.clone(),
        registry_host: true,
        ..Default::default()
    };
    let answer: LookupResponse = runtime
        .block_on(unary::call(&socket, LOOKUP, &request))
        .map_err(|e| match e {
            CallError::Connect(e) => format!(
                "credgate: cannot reach the agent at {}: {e}",
                socket.display()
            ),
            CallError::Status { message, .. } => format!("credgate: lookup failed: {message}"),
            other => format!("credgate: lookup failed: {other}"),
        })?;
    let Some(first) = answer.credentials.first() else {
        if answer.failures.is_empty() {
            return Err(NOT_FOUND.into());
        }
        let why: Vec<&str> = answer.failures.iter().map(|f| f.message.as_str()).collect();
        return Err(format!(
            "credgate: no credentials for {host}: {}",
            why.join("; ")
        ));
    };
    Ok(serde_json::json!({
        "ServerURL": server_url,
        "Username": first.username,
        "Secret": first.password,
    })
    .to_string())
}

#[cfg(test)]
mod tests {
    use super::registry_host;

    #[test]
    fn server_urls_become_hosts() {
        assert_eq!(registry_host("127.0.0.1:5000"), "127.0.0.1:5000");
        assert_eq!(
            registry_host("https://index.docker.io/v1/"),
            "index.docker.io"
        );
        assert_eq!(
            registry_host(" registry.example.com\n"),
            "registry.example.com"
        );
        assert_eq!(registry_host("http://localhost:5000/v2/"), "localhost:5000");
    }
}
