//! Compiles `proto/` with protox (pure Rust), so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("credgate/v1/credgate.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let descriptors = protox::compile([&file], [&root])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // A message that does not decode is INVALID_ARGUMENT (src/codec.rs).
        .codec_path("crate::codec::Codec")
        .type_attribute(".credgate.v1", "#[derive(serde::Serialize)]")
        // Messages with secrets get a hand-written, redacting Debug (src/redact.rs).
        .skip_debug([
            ".credgate.v1.Credential",
            ".credgate.v1.ServiceAccount",
            ".credgate.v1.SecretCredential",
        ])
        .compile_fds(descriptors)?;
    Ok(())
}
