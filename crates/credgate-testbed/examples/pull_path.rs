//! The two ends of `scripts/pull-path`, which traces what one PullImage and one bridge lookup
//! run inside `credgate serve`:
//!
//! - `pull_path parts DIR`: Debian's registry (one user) and the fake runtime at
//!   `DIR/runtime.sock` until SIGTERM; a docker config for the registry at `DIR/config.json`
//!   and a provider `path-plugin` for it (`DIR/providers.yaml`, its plugin in `DIR/bin`);
//!   writes the registry's host to `DIR/host` once they serve.
//! - `pull_path pull DIR`: one PullImage through the proxy at `DIR/cri.sock`, as a kubelet
//!   sends it for a pod with a pull secret.

use std::path::Path;

use credgate_testbed::cri::{call, pull_request, PullImageResponse};

const USER: &str = "pathuser";
const PASSWORD: &str = "path-Pa55word";

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(what), Some(dir)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: pull_path parts|pull DIR");
        std::process::exit(2);
    };
    let dir = Path::new(dir);
    match what.as_str() {
        "parts" => parts(dir).await,
        "pull" => pull(dir).await,
        other => {
            eprintln!("pull_path: no such step: {other}");
            std::process::exit(2);
        }
    }
}

async fn parts(dir: &Path) {
    let registry = credgate_testbed::Registry::start(dir, USER, PASSWORD);
    let _runtime = credgate_testbed::fake_runtime::start(
        &dir.join("runtime.sock"),
        credgate_testbed::fake_runtime::Answers::default(),
    )
    .await;
    let host = registry.host();
    credgate_testbed::docker_config(dir, &host, USER, PASSWORD);
    std::fs::write(
        dir.join("providers.yaml"),
        format!(
            "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n  - name: path-plugin\n    matchImages: [\"{host}\"]\n    defaultCacheDuration: 1h\n    apiVersion: credentialprovider.kubelet.k8s.io/v1\n"
        ),
    )
    .unwrap();
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let plugin = bin.join("path-plugin");
    std::fs::write(
        &plugin,
        format!(
            "#!/bin/sh\ncat >/dev/null\nprintf '%s' '{{\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"kind\":\"CredentialProviderResponse\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"1h\",\"auth\":{{\"{host}\":{{\"username\":\"{USER}\",\"password\":\"{PASSWORD}\"}}}}}}'\n"
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.join("host"), &host).unwrap();
    // Until SIGTERM; the registry and the runtime stop with this process.
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
    term.recv().await;
    drop(registry);
}

async fn pull(dir: &Path) {
    let host = std::fs::read_to_string(dir.join("host")).unwrap();
    let image = format!("{}/team/app:v1", host.trim());
    let answer = call::<_, PullImageResponse>(
        &dir.join("cri.sock"),
        "/runtime.v1.ImageService/PullImage",
        pull_request(&image, Some((USER, PASSWORD)), "team"),
    )
    .await;
    match answer {
        Ok(_) => println!("pulled {image}"),
        Err(status) => {
            eprintln!("pull_path: the pull failed: {}", status.message());
            std::process::exit(1);
        }
    }
}
