//! Compiles `proto/` with protox (pure Rust), so no system `protoc` is needed.

/// Enums by their words in JSON, not by number: each field and its serializer in src/names.rs.
const NAMED_ENUMS: [(&str, &str); 14] = [
    ("Credential.source_kind", "source_kind"),
    ("Pull.source_kind", "source_kind"),
    ("Pull.auth", "pull_auth"),
    ("Pull.result", "pull_result"),
    ("ReportRefusedResponse.outcome", "refusal_outcome"),
    ("CheckAccessResponse.decision", "decision"),
    ("VerifyResponse.decision", "decision"),
    ("CheckAccessRequest.pull_policy", "pull_policy"),
    ("ProviderFailure.reason", "failure_reason"),
    ("LookupResponse.cache_key_type", "cache_key_type"),
    ("ExplainedSource.cache_key_type", "cache_key_type"),
    ("DroppedAnswer.cache_key_type", "cache_key_type"),
    ("CheckAccessResponse.reason", "access_reason"),
    ("VerifyResponse.reason", "verify_reason"),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("credgate/v1/credgate.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let descriptors = protox::compile([&file], [&root])?;
    let mut config = tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // A message that does not decode is INVALID_ARGUMENT (src/codec.rs).
        .codec_path("crate::codec::Codec")
        .type_attribute(".credgate.v1", "#[derive(serde::Serialize)]");
    for (field, serializer) in NAMED_ENUMS {
        config = config.field_attribute(
            format!(".credgate.v1.{field}"),
            format!(r#"#[serde(serialize_with = "crate::names::{serializer}")]"#),
        );
    }
    config
        // Messages with secrets get a hand-written, redacting Debug (src/redact.rs).
        .skip_debug([
            ".credgate.v1.Credential",
            ".credgate.v1.ServiceAccount",
            ".credgate.v1.SecretCredential",
        ])
        .compile_fds(descriptors)?;
    Ok(())
}
