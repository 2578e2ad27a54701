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
        // Enums by their words in JSON, not by number (src/names.rs).
        .field_attribute(
            ".credgate.v1.Credential.source_kind",
            r#"#[serde(serialize_with = "crate::names::source_kind")]"#,
        )
        .field_attribute(
            ".credgate.v1.Pull.source_kind",
            r#"#[serde(serialize_with = "crate::names::source_kind")]"#,
        )
        .field_attribute(
            ".credgate.v1.Pull.auth",
            r#"#[serde(serialize_with = "crate::names::pull_auth")]"#,
        )
        .field_attribute(
            ".credgate.v1.Pull.result",
            r#"#[serde(serialize_with = "crate::names::pull_result")]"#,
        )
        .field_attribute(
            ".credgate.v1.ReportRefusedResponse.outcome",
            r#"#[serde(serialize_with = "crate::names::refusal_outcome")]"#,
        )
        .field_attribute(
            ".credgate.v1.CheckAccessResponse.decision",
            r#"#[serde(serialize_with = "crate::names::decision")]"#,
        )
        .field_attribute(
            ".credgate.v1.VerifyResponse.decision",
            r#"#[serde(serialize_with = "crate::names::decision")]"#,
        )
        .field_attribute(
            ".credgate.v1.CheckAccessRequest.pull_policy",
            r#"#[serde(serialize_with = "crate::names::pull_policy")]"#,
        )
        // Messages with secrets get a hand-written, redacting Debug (src/redact.rs).
        .skip_debug([
            ".credgate.v1.Credential",
            ".credgate.v1.ServiceAccount",
            ".credgate.v1.SecretCredential",
        ])
        .compile_fds(descriptors)?;
    Ok(())
}
