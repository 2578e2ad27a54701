//! Saved answers across engines (a restart): served again with no plugin run while their
//! provider is the same and they are valid; dropped, with the reason, otherwise.

use std::time::{Duration, SystemTime};

use credgate_engine::saved::Unrestored;
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
    assert_eq!(report.dropped.get(&Unrestored::ConfigChanged), Some(&1));
    changed.lookup(&req(IMG)).await.unwrap();
    assert_eq!(runs_of(dir.path(), "p"), 2);

    // Expired, or of a provider the config no longer has: dropped.
    let mut expired = saved.clone();
    expired[0].expires = SystemTime::now() - Duration::from_secs(1);
    let third = engine(cfg(), dir.path());
    assert_eq!(
        third.restore(expired).dropped.get(&Unrestored::Expired),
        Some(&1)
    );
    counting_plugin(dir.path(), "q", &body());
    let other = engine(
        config(&[("q", &["registry.example.com"], "1h", WIRE_V1)]),
        dir.path(),
    );
    assert_eq!(
        other.restore(saved).dropped.get(&Unrestored::ProviderGone),
        Some(&1)
    );
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
        second
            .restore(saved)
            .dropped
            .get(&Unrestored::ConfigChanged),
        Some(&1)
    );
}

/// A plugin rewritten in place (same inode) to the same size with its modification time set
/// back is a changed provider too: its change time moved.
#[tokio::test]
async fn a_plugin_rewritten_in_place_with_its_times_set_back_drops_its_answers() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let path = counting_plugin(dir.path(), "p", &body());
    let cfg = || config(&[("p", &["registry.example.com"], "1h", WIRE_V1)]);
    let first = engine(cfg(), dir.path());
    first.lookup(&req(IMG)).await.unwrap();
    let saved = first.saved_entries();
    let before = std::fs::metadata(&path).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let text = std::fs::read(&path).unwrap();
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all(&text).unwrap();
    f.set_modified(before.modified().unwrap()).unwrap();
    drop(f);
    let after = std::fs::metadata(&path).unwrap();
    assert_eq!(
        (after.len(), after.modified().unwrap()),
        (before.len(), before.modified().unwrap())
    );
    let second = engine(cfg(), dir.path());
    assert_eq!(
        second
            .restore(saved)
            .dropped
            .get(&Unrestored::ConfigChanged),
        Some(&1)
    );
}

/// An answer with no credential is served from the cache as the plugin answered it, but never
/// handed out to be kept.
#[tokio::test]
async fn answers_with_no_credential_are_not_kept() {
    let dir = tempfile::tempdir().unwrap();
    counting_plugin(
        dir.path(),
        "p",
        &response(WIRE_V1, "Registry", Some("12h"), &[]),
    );
    let e = engine(
        config(&[("p", &["registry.example.com"], "1h", WIRE_V1)]),
        dir.path(),
    );
    e.lookup(&req(IMG)).await.unwrap();
    e.lookup(&req(IMG)).await.unwrap();
    assert_eq!(runs_of(dir.path(), "p"), 1, "cached as answered");
    assert!(e.saved_entries().is_empty());
}

/// A refused credential drops exactly the answers of that provider that hold it and answer
/// the image; a flush drops by provider and by image; the next lookup runs the plugin, and the
/// drop is in the provider's status.
#[tokio::test]
async fn refused_and_flushed_answers_make_the_plugin_run_again() {
    let dir = tempfile::tempdir().unwrap();
    counting_plugin(dir.path(), "p", &body());
    counting_plugin(
        dir.path(),
        "q",
        &response(
            WIRE_V1,
            "Registry",
            Some("12h"),
            &[("quay.example.com", "q-user", "q-pw")],
        ),
    );
    let e = engine(
        config(&[
            ("p", &["registry.example.com"], "1h", WIRE_V1),
            ("q", &["quay.example.com"], "1h", WIRE_V1),
        ]),
        dir.path(),
    );
    let quay = "quay.example.com/team/db:v1";
    e.lookup(&req(IMG)).await.unwrap();
    e.lookup(&req(quay)).await.unwrap();
    assert_eq!(
        e.given_by(IMG, "saved-user", "saved-pw"),
        vec![credgate_engine::Source::Provider("p".into())]
    );
    assert!(e.given_by(IMG, "saved-user", "other").is_empty());
    assert!(e.given_by(quay, "saved-user", "saved-pw").is_empty());

    // Another credential, another provider, another image: nothing dropped.
    assert!(e
        .refuse("p", IMG, "saved-user", "wrong", "refused")
        .unwrap()
        .is_empty());
    assert!(e
        .refuse("q", IMG, "saved-user", "saved-pw", "refused")
        .unwrap()
        .is_empty());
    let dropped = e
        .refuse(
            "p",
            IMG,
            "saved-user",
            "saved-pw",
            "refused by the registry",
        )
        .unwrap();
    assert_eq!(dropped.len(), 1);
    assert_eq!(dropped[0].key, "registry.example.com");
    let status = e.provider_status();
    assert_eq!(
        status[0].last_dropped.as_ref().map(|d| d.1.as_str()),
        Some("refused by the registry")
    );
    assert!(status[1].last_dropped.is_none());
    // Remembered resolutions go with the answer.
    e.lookup(&req(IMG)).await.unwrap();
    assert_eq!(runs_of(dir.path(), "p"), 2);
    e.lookup(&req(quay)).await.unwrap();
    assert_eq!(runs_of(dir.path(), "q"), 1);

    // Flush: an unknown provider is refused; by image only the answers that answer it.
    assert!(e.flush(Some("nope"), &[], "x").is_err());
    assert!(e
        .flush(None, &["other.example.com/x:1".into()], "x")
        .unwrap()
        .is_empty());
    assert_eq!(e.flush(None, &[quay.into()], "x").unwrap().len(), 1);
    e.lookup(&req(quay)).await.unwrap();
    assert_eq!(runs_of(dir.path(), "q"), 2);
    assert_eq!(e.flush(None, &[], "x").unwrap().len(), 2);
    assert!(e.saved_entries().is_empty());
}

/// Seconds until `expires` (0 when unset or past).
fn left(expires: Option<SystemTime>) -> Duration {
    expires
        .and_then(|t| t.duration_since(SystemTime::now()).ok())
        .unwrap_or_default()
}

/// One registry's refusal bounds what it can do to the others (decision 0025): a credential
/// that registry `h` refused, answered again by the plugin, is kept seconds for `h`'s images
/// only; a `Registry`-keyed answer for `r`'s images keeps its whole hour, and a `Global` one a
/// minute at most (before: seconds for every registry sharing the credential, for an hour).
#[tokio::test]
async fn a_refusal_shortens_only_the_refusing_registrys_answers() {
    let dir = tempfile::tempdir().unwrap();
    let (h, r) = ("h.example/team/app:v1", "r.example/team/app:v1");
    counting_plugin(
        dir.path(),
        "p",
        &response(
            WIRE_V1,
            "Registry",
            Some("1h"),
            &[("h.example", "shared", "pw"), ("r.example", "shared", "pw")],
        ),
    );
    let e = engine(
        config(&[("p", &["h.example", "r.example"], "1h", WIRE_V1)]),
        dir.path(),
    );
    e.lookup(&req(h)).await.unwrap();
    e.refuse("p", h, "shared", "pw", "refused by h").unwrap();
    // r's answer, fetched after h's refusal: its own hour.
    let got = e.lookup(&req(r)).await.unwrap();
    assert!(left(got.credentials[0].expires_at) > Duration::from_secs(3000));
    // h's, fetched again: seconds, the plugin asked again soon.
    let got = e.lookup(&req(h)).await.unwrap();
    assert!(left(got.credentials[0].expires_at) <= credgate_engine::FOLLOW_MAX);
    assert_eq!(runs_of(dir.path(), "p"), 3);

    // Keyed Global, it serves every registry: a minute at most, never seconds, whoever asks.
    let global = tempfile::tempdir().unwrap();
    counting_plugin(
        global.path(),
        "g",
        &response(
            WIRE_V1,
            "Global",
            Some("1h"),
            &[("*.example", "shared", "pw")],
        ),
    );
    let e = engine(
        config(&[("g", &["*.example"], "1h", WIRE_V1)]),
        global.path(),
    );
    e.lookup(&req(h)).await.unwrap();
    e.refuse("g", h, "shared", "pw", "refused by h").unwrap();
    for image in [r, h] {
        e.flush(None, &[], "test").unwrap();
        let got = e.lookup(&req(image)).await.unwrap();
        let kept = left(got.credentials[0].expires_at);
        assert!(
            kept > credgate_engine::FOLLOW_MAX && kept <= credgate_engine::FOLLOW_SHARED,
            "{image}: {kept:?}"
        );
    }
}
