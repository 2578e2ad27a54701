//! Saved answers across engines (a restart): served again with no plugin run while their
//! provider is the same and they are valid; dropped, with the reason, otherwise.

use std::time::{Duration, SystemTime};

use credgate_engine::LookupRequest;

use crate::common::*;

const IMG: &str = "registry.example.com/team/app:v1";

fn req(image: &str) -> LookupRequest<'_> {
    LookupRequest {
        image,
        ..Default::default()
    }
}

fn body() -> String {
    response(
        WIRE_V1,
        "Registry",
        Some("12h"),
        &[("registry.example.com", "saved-user", "saved-pw")],
    )
}

#[tokio::test]
async fn saved_answers_are_served_after_a_restart_without_a_run() {
    let dir = tempfile::tempdir().unwrap();
    counting_plugin(dir.path(), "p", &body());
    let cfg = || config(&[("p", &["registry.example.com"], "1h", WIRE_V1)]);
    let first = engine(cfg(), dir.path());
    first.lookup(&req(IMG)).await.unwrap();
    assert_eq!(runs_of(dir.path(), "p"), 1);
    let saved = first.saved_entries();
    assert_eq!(saved.len(), 1);
    assert!(!format!("{saved:?}").contains("saved-pw"));
    drop(first);

    let second = engine(cfg(), dir.path());
    let report = second.restore(saved.clone());
    assert_eq!(report.restored, 1, "{report:?}");
    let got = second
        .lookup(&req("registry.example.com/other:v2"))
        .await
        .unwrap();
    assert_eq!(got.credentials[0].username, "saved-user");
    assert_eq!(runs_of(dir.path(), "p"), 1, "no run after the restart");

    // Another engine whose provider's args changed: its identity differs, the answer is
    // dropped, and the plugin runs.
    let changed = engine(
        config_with(
            &[("p", &["registry.example.com"], "1h", WIRE_V1)],
            "  args: [--region, eu]\n",
        ),
        dir.path(),
    );
    let report = changed.restore(saved.clone());
    assert_eq!(report.restored, 0);
    assert_eq!(report.dropped.get("config_changed"), Some(&1));
    changed.lookup(&req(IMG)).await.unwrap();
    assert_eq!(runs_of(dir.path(), "p"), 2);

    // Expired, or of a provider the config no longer has: dropped.
    let mut expired = saved.clone();
    expired[0].expires = SystemTime::now() - Duration::from_secs(1);
    let third = engine(cfg(), dir.path());
    assert_eq!(third.restore(expired).dropped.get("expired"), Some(&1));
    counting_plugin(dir.path(), "q", &body());
    let other = engine(
        config(&[("q", &["registry.example.com"], "1h", WIRE_V1)]),
        dir.path(),
    );
    assert_eq!(other.restore(saved).dropped.get("provider_gone"), Some(&1));
}

/// A replaced plugin binary is a changed provider.
#[tokio::test]
async fn a_replaced_plugin_binary_drops_its_answers() {
    let dir = tempfile::tempdir().unwrap();
    counting_plugin(dir.path(), "p", &body());
    let cfg = || config(&[("p", &["registry.example.com"], "1h", WIRE_V1)]);
    let first = engine(cfg(), dir.path());
    first.lookup(&req(IMG)).await.unwrap();
    let saved = first.saved_entries();
    // A new binary at the same path (another inode).
    let path = dir.path().join("p");
    std::fs::rename(&path, dir.path().join("p.old")).unwrap();
    counting_plugin(dir.path(), "p", &body());
    let second = engine(cfg(), dir.path());
    assert_eq!(
        second.restore(saved).dropped.get("config_changed"),
        Some(&1)
    );
}
