//! The explanation's verdict names what operators must look at first.

use credgate_engine::LookupRequest;

use crate::common::*;

fn req(image: &str) -> LookupRequest<'_> {
    LookupRequest {
        image,
        ..Default::default()
    }
}

/// With several providers that miss, the verdict names the nearest miss (a port, then a
/// path, before any host), not the first provider in config order.
#[tokio::test]
async fn the_verdict_names_the_nearest_miss() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["other-host", "portless"] {
        counting_plugin(
            dir.path(),
            name,
            &response(WIRE_V1, "Registry", Some("1h"), &[]),
        );
    }
    let e = engine(
        config(&[
            ("other-host", &["quay.example.com"], "1h", WIRE_V1),
            ("portless", &["registry.example.com"], "1h", WIRE_V1),
        ]),
        dir.path(),
    );
    let verdict = e
        .explain(&req("registry.example.com:5000/team/app:v1"))
        .unwrap()
        .verdict(std::time::SystemTime::now());
    assert!(
        verdict.contains("provider portless's pattern") && verdict.contains("port"),
        "{verdict}"
    );
}

/// A provider that answered no credential: the verdict says the pull goes anonymous, not
/// "0 credential(s)".
#[tokio::test]
async fn an_empty_answer_is_called_what_it_is() {
    let dir = tempfile::tempdir().unwrap();
    counting_plugin(
        dir.path(),
        "empty",
        &response(WIRE_V1, "Registry", Some("1h"), &[]),
    );
    let e = engine(
        config(&[("empty", &["registry.example.com"], "1h", WIRE_V1)]),
        dir.path(),
    );
    let image = "registry.example.com/team/app:v1";
    e.lookup(&req(image)).await.unwrap();
    let verdict = e
        .explain(&req(image))
        .unwrap()
        .verdict(std::time::SystemTime::now());
    assert!(
        verdict.contains("provider empty answered no credential: the pull goes anonymous"),
        "{verdict}"
    );
    // What a client shows by default: only the sources that matched.
    let other = e.explain(&req("quay.example.com/x:1")).unwrap();
    assert!(other.matched_reasons().is_empty());
    assert_eq!(other.reasons().len(), 1);
    let matched = e.explain(&req(image)).unwrap().matched_reasons();
    assert_eq!(matched.len(), 1);
    assert!(matched[0].contains("provider empty matched"), "{matched:?}");
}
