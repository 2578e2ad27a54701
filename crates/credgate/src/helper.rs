//! `docker-credential-credgate`: the docker credential helper protocol, backed by the running
//! agent (it never runs plugins itself).
//!
//! `get` reads a registry `host[:port]` on stdin and prints `{"ServerURL","Username","Secret"}`
//! for the first credential in try-order; when there is none it prints `credentials not found
//! in native keychain` and exits 1, so clients carry on anonymously. `store` and `erase`
//! answer that the store is read-only; with `CREDGATE_HELPER_ERASE=ignore`, `erase` succeeds
//! without effect (for logout commands that fail or crash on a refusal). `list` prints `{}`
//! (plugins cannot be enumerated). Every failure other than "not found" is written to stderr
//! as well, since some clients hide the helper's stdout. The agent is found through
//! `CREDGATE_SOCKET`, else the default socket.

use std::io::{Read, Write};
use std::process::ExitCode;

use credgate_api::unary::{self, CallError};
use credgate_api::v1::{LookupRequest, LookupResponse};
use credgate_core::helper;
use zeroize::{Zeroize, Zeroizing};

const NOT_FOUND: &str = "credentials not found in native keychain";
use credgate_api::methods::LOOKUP;

#[path = "helper_help.rs"]
mod help;
use help::HELP;

/// Set (to anything but `0`), the helper writes every source it tried on an anonymous answer,
/// not only those that matched the host.
const EXPLAIN_ENV: &str = "CREDGATE_HELPER_EXPLAIN";
/// How long the agent may take to answer: longer than a plugin's default timeout (1 minute),
/// since a miss runs one.
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let verb = args.next().unwrap_or_default();
    let result = match verb.as_str() {
        "get" => get(),
        "erase" if erase_ignored() => {
            drain_stdin();
            Ok(Zeroizing::new(String::new()))
        }
        "store" | "erase" => {
            drain_stdin();
            Err("credgate: the credential store is read-only; credentials come from the node's providers".into())
        }
        "list" => Ok(Zeroizing::new("{}".into())),
        "version" | "--version" | "-v" => Ok(Zeroizing::new(format!(
            "docker-credential-credgate {}",
            env!("CARGO_PKG_VERSION")
        ))),
        "help" | "--help" | "-h" => {
            return answer(HELP, ExitCode::SUCCESS);
        }
        _ => {
            warn(HELP);
            return ExitCode::from(2);
        }
    };
    // The protocol reads answers and errors alike from stdout.
    match result {
        Ok(text) if text.is_empty() => ExitCode::SUCCESS,
        Ok(text) => answer(&text, ExitCode::SUCCESS),
        Err(text) => {
            if text != NOT_FOUND {
                warn(&text);
            }
            answer(&text, ExitCode::from(1))
        }
    }
}

/// Writes `text` and a newline to stdout and exits with `code`; a reader that went away (a
/// closed pipe) is a clean exit 1 with a line on stderr, never a panic.
fn answer(text: &str, code: ExitCode) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Ok(()) => code,
        Err(e) => {
            warn(&format!("credgate: cannot write the answer to stdout: {e}"));
            ExitCode::from(1)
        }
    }
}

/// A line on stderr, best effort: a closed stderr is no reason to fail (`eprintln!` panics).
fn warn(text: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{text}");
}

/// `CREDGATE_HELPER_ERASE=ignore` (any case; `1`, `true` and `yes` too): erase succeeds and
/// does nothing. Any other value is said to be ignored, on stderr.
fn erase_ignored() -> bool {
    let Ok(v) = std::env::var("CREDGATE_HELPER_ERASE") else {
        return false;
    };
    let on = matches!(
        v.to_ascii_lowercase().as_str(),
        "ignore" | "1" | "true" | "yes"
    );
    if !on && !v.is_empty() {
        warn(&format!(
            "credgate: CREDGATE_HELPER_ERASE={} is not understood (ignore, 1, true, yes): erase refused",
            credgate_core::text::Quoted(&v)
        ));
    }
    on
}

/// Reads what a client sends to `store` or `erase`, up to a bound, and drops it.
fn drain_stdin() {
    let mut sink = Zeroizing::new(Vec::new());
    let _ = std::io::stdin()
        .take(helper::MAX_STORE_INPUT as u64)
        .read_to_end(&mut sink);
}

fn get() -> Result<Zeroizing<String>, String> {
    // Read one byte past the limit, so that an oversized input is refused, not cut.
    let mut input = Vec::new();
    std::io::stdin()
        .take(helper::MAX_INPUT as u64 + 1)
        .read_to_end(&mut input)
        .map_err(|e| format!("credgate: cannot read the server URL: {e}"))?;
    let parsed = helper::parse_get(&input).map_err(|e| format!("credgate: {e}"))?;
    let (server_url, host) = (parsed.url.to_owned(), parsed.host.to_owned());
    let socket = credgate_api::socket_path(None);
    // One call on a fresh connection, blocking, with no async runtime: this process lives for
    // one answer.
    let request = LookupRequest {
        image: host.clone(),
        registry_host: true,
        caller: "docker-helper".into(),
        explain: true,
        ..Default::default()
    };
    let mut answer: LookupResponse =
        unary::call(&socket, LOOKUP, &request, TIMEOUT).map_err(|e| match e {
            CallError::Connect(e) => format!(
                "credgate: cannot reach the agent at {}: {e}",
                socket.display()
            ),
            CallError::Deadline(limit) => format!(
                "credgate: the agent at {} did not answer within {limit:?}",
                socket.display()
            ),
            CallError::Status { message, .. } => format!("credgate: lookup failed: {message}"),
            other => format!("credgate: lookup failed: {other}"),
        })?;
    let Some(first) = answer.credentials.first() else {
        if answer.failures.is_empty() {
            // Clients read the "not found" text from stdout exactly; what was tried goes to
            // stderr: the sources that matched the host and gave nothing (docker, skopeo and
            // podman show stderr like an error before an anonymous pull that succeeds, so the
            // others' mismatches only when asked: CREDGATE_HELPER_EXPLAIN=1).
            let all = std::env::var_os(EXPLAIN_ENV).is_some_and(|v| !v.is_empty() && v != "0");
            let reasons = if all {
                &answer.reasons
            } else {
                &answer.matched_reasons
            };
            if !reasons.is_empty() {
                warn(&format!(
                    "credgate: no credentials for {host}: {}",
                    reasons.join("; ")
                ));
            }
            return Err(NOT_FOUND.into());
        }
        let why: Vec<&str> = answer.failures.iter().map(|f| f.message.as_str()).collect();
        return Err(format!(
            "credgate: no credentials for {host}: {}",
            why.join("; ")
        ));
    };
    let text = serde_json::json!({
        "ServerURL": server_url,
        "Username": first.username,
        "Secret": first.password,
    })
    .to_string();
    for c in &mut answer.credentials {
        c.password.zeroize();
    }
    Ok(Zeroizing::new(text))
}
