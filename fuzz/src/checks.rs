//! What each fuzz target checks, shared by the libFuzzer targets (`fuzz_targets/`) and the
//! corpus replay in the normal test suite (`crates/credgate-core/tests/it/fuzz_corpus.rs`).
//! Every function takes arbitrary bytes; a panic is a finding.

use credgate_core::config::{ProviderConfig, WireVersion};
use credgate_core::helper;
use credgate_core::pattern::{glob_match, glob_valid, parse_schemeless, Pattern, Target};
use credgate_core::reference::ImageRef;
use credgate_core::wire::decode_response;

/// Image references: parsing never panics, and normalizing is idempotent.
pub fn image_ref(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(r) = ImageRef::parse(s) {
        let name = r.name().to_owned();
        let again = ImageRef::parse(&name)
            .unwrap_or_else(|e| panic!("normalized name {name:?} of {s:?} does not parse: {e}"));
        assert_eq!(again.name(), name, "normalizing {s:?} twice");
        assert!(again.tag().is_none() && again.digest().is_none());
    }
}

/// Patterns and matching: `pattern\nimage`.
pub fn pattern(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let (p, target) = s.split_once('\n').unwrap_or((s, ""));
    if glob_valid(p) {
        let _ = glob_match(p, target);
    }
    let Ok(pattern) = Pattern::parse(p) else {
        return;
    };
    assert_eq!(pattern.as_str(), p);
    let _ = pattern.lints();
    if let Ok(image) = ImageRef::parse(target) {
        let _ = pattern.matches(&Target::from_image_name(image.name()));
    }
    if let Ok(parts) = parse_schemeless(target) {
        let _ = pattern.matches(&Target::from_parts(&parts));
    }
}

/// The provider config decoder and validator, as YAML and as JSON.
pub fn provider_config(data: &[u8]) {
    for name in ["fuzz.yaml", "fuzz.json"] {
        match ProviderConfig::from_slice(name, data) {
            Ok(config) => {
                for provider in &config.providers {
                    assert!(!provider.name.is_empty());
                }
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}

/// The plugin response decoder: the first byte picks the wire version.
pub fn plugin_response(data: &[u8]) {
    let Some((first, stdout)) = data.split_first() else {
        return;
    };
    let version = WireVersion::ALL[usize::from(*first) % WireVersion::ALL.len()];
    match decode_response(stdout, version) {
        Ok(response) => {
            let _ = format!("{response:?}");
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

/// The docker credential helper's stdin.
pub fn helper_stdin(data: &[u8]) {
    if let Ok(url) = helper::parse_get(data) {
        // The host is part of the URL, except that Docker Hub's names (in any case) become
        // `docker.io`.
        assert!(!url.host.is_empty());
        assert!(
            url.url.contains(url.host)
                || (url.host == "docker.io" && url.url.to_ascii_lowercase().contains("docker")),
            "{:?} -> {:?}",
            url.url,
            url.host
        );
        let parts = parse_schemeless(url.host).expect("a parsed host parses again");
        let _ = Target::from_parts(&parts);
    }
}

/// The record store's row decoder: a record that decodes encodes to the same record.
pub fn record_decode(data: &[u8]) {
    if let Ok(record) = credgate_core::guard::stored::decode(data) {
        let body = credgate_core::guard::stored::encode(&record);
        let again =
            credgate_core::guard::stored::decode(body.as_bytes()).expect("encoded records decode");
        assert_eq!(again, record);
    }
}
