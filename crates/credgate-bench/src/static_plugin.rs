//! `credgate-static-plugin`: a minimal compiled credential provider plugin for benchmarks. It
//! reads the request, answers for the request's apiVersion with a fixed credential, and takes
//! its key type and duration from its arguments (`--key-type Registry --duration 1h`; a
//! duration of `none` leaves `cacheDuration` out).

use std::io::{Read, Write};

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut key_type, mut duration) = ("Registry".to_owned(), "1h".to_owned());
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_default();
        match flag.as_str() {
            "--key-type" => key_type = value,
            "--duration" => duration = value,
            other => {
                eprintln!("credgate-static-plugin: unknown flag {other}");
                std::process::exit(2);
            }
        }
    }
    let mut request = String::new();
    if std::io::stdin().read_to_string(&mut request).is_err() {
        std::process::exit(1);
    }
    let request: serde_json::Value = match serde_json::from_str(&request) {
        Ok(v) => v,
        Err(_) => {
            eprintln!("credgate-static-plugin: request is not JSON");
            std::process::exit(1);
        }
    };
    let image = request["image"].as_str().unwrap_or_default();
    let registry = image.split('/').next().unwrap_or_default();
    let mut response = serde_json::json!({
        "kind": "CredentialProviderResponse",
        "apiVersion": request["apiVersion"],
        "cacheKeyType": key_type,
        "auth": { registry: { "username": "bench", "password": "bench-password" } },
    });
    if duration != "none" {
        response["cacheDuration"] = serde_json::Value::String(duration);
    }
    let mut out = std::io::stdout().lock();
    let _ = serde_json::to_writer(&mut out, &response);
    let _ = out.write_all(b"\n");
}
