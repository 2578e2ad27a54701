//! A small OCI image, and pushing it to a registry.

use std::path::Path;
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::process::{require, run};
use crate::Registry;

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Writes a one-layer OCI image layout at `dir/layout` (tag `v1`), deterministic bytes.
pub fn oci_image(dir: &Path) {
    oci_image_saying(dir, "hello from credgate\n");
}

/// The same with `hello.txt` holding `text`: images of other texts have other IDs (a
/// runtime's `RemoveImage` removes every name of an image ID).
pub fn oci_image_saying(dir: &Path, text: &str) {
    let rootfs = dir.join("rootfs");
    std::fs::create_dir_all(&rootfs).unwrap();
    std::fs::write(rootfs.join("hello.txt"), text).unwrap();
    let blobs = dir.join("layout/blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let tar = dir.join("layer.tar");
    run(Command::new("tar")
        .args([
            "--sort=name",
            "--mtime=@0",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "-cf",
        ])
        .arg(&tar)
        .arg("-C")
        .arg(&rootfs)
        .arg("."));
    let tar_bytes = std::fs::read(&tar).unwrap();
    let gz = run(Command::new("gzip").args(["-n", "-c"]).arg(&tar)).stdout;
    let put = |bytes: &[u8]| {
        let hex = sha256_hex(bytes);
        std::fs::write(blobs.join(&hex), bytes).unwrap();
        (format!("sha256:{hex}"), bytes.len())
    };
    let (layer, layer_size) = put(&gz);
    let config = format!(
        r#"{{"architecture":"amd64","os":"linux","config":{{}},"rootfs":{{"type":"layers","diff_ids":["sha256:{}"]}}}}"#,
        sha256_hex(&tar_bytes)
    );
    let (config_digest, config_size) = put(config.as_bytes());
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config_digest}","size":{config_size}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{layer}","size":{layer_size}}}]}}"#
    );
    let (manifest_digest, manifest_size) = put(manifest.as_bytes());
    std::fs::write(
        dir.join("layout/index.json"),
        format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{manifest_digest}","size":{manifest_size},"annotations":{{"org.opencontainers.image.ref.name":"v1"}}}}]}}"#
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("layout/oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
}

/// Pushes the layout at `dir/layout` to `registry` as `repo:v1` with skopeo.
pub fn push(dir: &Path, registry: &Registry, repo: &str, user: &str, password: &str) {
    require("skopeo");
    run(Command::new("skopeo")
        .args(["copy", "--dest-tls-verify=false", "--dest-creds"])
        .arg(format!("{user}:{password}"))
        .arg(format!("oci:{}:v1", dir.join("layout").display()))
        .arg(format!("docker://{}/{repo}:v1", registry.host())));
}
