//! The guard's SQLite store: durability across reopen, intents, recovery, pruning, group
//! commit, damaged files.

use std::os::unix::fs::PermissionsExt;

use credgate_agent::guard::store::{Done, Op, PresentImage, Pruned, Store, StoreError};
use credgate_core::guard::{Coords, CredentialHash, Presented};

const NOW: i64 = 1_700_000_000_000;
const NAME: &str = "registry.example.com/team-a/app";
const IMAGE: &str = "registry.example.com/team-a/app:v1";
const REF: &str = "sha256:1111";

fn secret(name: &str, h: u8) -> Presented {
    Presented::Secret {
        coords: Coords {
            namespace: "team-a".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        },
        hash: CredentialHash::new(1, [h; 32]),
    }
}

fn intent(image: &str) -> Op {
    Op::Intent {
        image: image.into(),
        name: NAME.into(),
    }
}

fn result(image: &str, used: Option<Presented>) -> Op {
    Op::PullResult {
        image: image.into(),
        name: NAME.into(),
        image_ref: REF.into(),
        used,
    }
}

/// The pull of image `i{i}` (reference `sha256:{i}`) with `used`.
fn numbered(i: impl std::fmt::Display, used: Presented) -> Op {
    Op::PullResult {
        image: format!("i{i}"),
        name: NAME.into(),
        image_ref: format!("sha256:{i}"),
        used: Some(used),
    }
}

#[tokio::test]
async fn records_survive_reopen_with_private_files() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    {
        let store = Store::open(&state).unwrap();
        store.apply(intent(IMAGE), NOW).await.unwrap();
        store
            .apply(result(IMAGE, Some(secret("pull", 1))), NOW)
            .await
            .unwrap();
        assert_eq!(store.counts(), (1, 0));
        store.close().await;
    }
    let store = Store::open(&state).unwrap();
    let r = store.record(REF).expect("durable");
    assert_eq!(r.names[NAME].secrets.len(), 1);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&state.join("guard.db")), 0o600);
}

#[tokio::test]
async fn intents_are_reference_counted_and_dropped_on_failure() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    store.apply(intent(IMAGE), NOW).await.unwrap();
    store.apply(intent(IMAGE), NOW).await.unwrap();
    assert_eq!(store.intents()[0].1.count, 2);
    assert!(
        store.view(REF, NAME).1,
        "an intent marks the name as pulled by the node"
    );
    // One pull fails: its intent goes, the other pull's stays.
    store.apply(result(IMAGE, None), NOW).await.unwrap();
    assert_eq!(store.intents()[0].1.count, 1);
    assert!(store.record(REF).is_none());
    store
        .apply(result(IMAGE, Some(Presented::NodeWide)), NOW)
        .await
        .unwrap();
    assert!(store.intents().is_empty());
    assert!(store.record(REF).unwrap().names[NAME].node_accessible);
}

#[tokio::test]
async fn prune_recovers_present_intents_and_drops_old_absent_state() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    // A pull that never reported (the agent died): its image is present now.
    store.apply(intent(IMAGE), NOW).await.unwrap();
    // A pull of an image that never arrived, long ago.
    store
        .apply(intent("registry.example.com/team-a/app:gone"), NOW - 10_000)
        .await
        .unwrap();
    // A record of an image that was removed from the node, long ago, and a recent one.
    store
        .apply(
            Op::PullResult {
                image: "x".into(),
                name: "registry.example.com/old".into(),
                image_ref: "sha256:old".into(),
                used: Some(Presented::NodeWide),
            },
            NOW - 10_000,
        )
        .await
        .unwrap();
    store
        .apply(
            Op::PullResult {
                image: "y".into(),
                name: "registry.example.com/new".into(),
                image_ref: "sha256:new".into(),
                used: Some(Presented::NodeWide),
            },
            NOW,
        )
        .await
        .unwrap();
    let done = store
        .apply(
            Op::Prune {
                present: vec![PresentImage {
                    image_ref: REF.into(),
                    references: vec![IMAGE.into()],
                }],
                before_ms: NOW - 1_000,
            },
            NOW + 1,
        )
        .await
        .unwrap();
    assert_eq!(
        done,
        Done::Pruned(Pruned {
            records_deleted: 1,
            intents_recovered: 1,
            intents_dropped: 1,
        })
    );
    assert!(store.intents().is_empty());
    let r = store.record(REF).expect("recovered");
    let e = &r.names[NAME];
    assert!(!e.node_accessible && e.secrets.is_empty() && e.service_accounts.is_empty());
    assert!(store.record("sha256:old").is_none());
    assert!(
        store.record("sha256:new").is_some(),
        "changed after the horizon"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_recordings_share_transactions() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let before = store.commits();
    let mut tasks = Vec::new();
    for i in 0..256u32 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .apply(numbered(i, secret("pull", 1)), NOW)
                .await
                .unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(store.counts().0, 256);
    let commits = store.commits() - before;
    assert!(commits < 256, "{commits} transactions for 256 recordings");
}

#[tokio::test]
async fn damaged_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("guard.db"), vec![0x5a; 8192]).unwrap();
    let e = Store::open(dir.path()).err().expect("garbage is refused");
    assert!(matches!(e, StoreError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains("fail safe"), "{e}");

    // A real store cut short.
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path()).unwrap();
        for i in 0..200 {
            store
                .apply(numbered(i, secret("pull", 1)), NOW)
                .await
                .unwrap();
        }
        store.close().await;
    }
    let db = dir.path().join("guard.db");
    let _ = std::fs::remove_file(dir.path().join("guard.db-wal"));
    let _ = std::fs::remove_file(dir.path().join("guard.db-shm"));
    let len = std::fs::metadata(&db).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&db).unwrap();
    f.set_len(len / 2).unwrap();
    drop(f);
    match Store::open(dir.path()) {
        Err(StoreError::Corrupt { .. }) => {}
        Err(other) => panic!("unexpected error: {other}"),
        Ok(store) => panic!("a truncated store opened with {:?} records", store.counts()),
    }
}

#[tokio::test]
async fn a_store_from_a_newer_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    Store::open(dir.path()).unwrap().close().await;
    let conn = rusqlite::Connection::open(dir.path().join("guard.db")).unwrap();
    conn.execute_batch("PRAGMA user_version = 99;").unwrap();
    drop(conn);
    let e = Store::open(dir.path()).err().unwrap();
    assert!(matches!(e, StoreError::TooNew { found: 99, .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_cannot_be_written_keeps_its_intent_and_fails_alone() {
    let dir = tempfile::tempdir().unwrap();
    Store::open(dir.path()).unwrap().close().await;
    // Inject a write failure for one image ID.
    let conn = rusqlite::Connection::open(dir.path().join("guard.db")).unwrap();
    conn.execute_batch(
        "CREATE TRIGGER injected BEFORE INSERT ON record_log WHEN NEW.image_ref = 'sha256:fail'
         BEGIN SELECT RAISE(ABORT, 'injected failure'); END;",
    )
    .unwrap();
    drop(conn);
    let store = Store::open(dir.path()).unwrap();
    let bad = "registry.example.com/team-a/bad:v1";
    store.apply(intent(bad), NOW).await.unwrap();
    // The failing write and good ones, concurrently: they may share a batch.
    let mut tasks = Vec::new();
    for i in 0..32 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .apply(
                    Op::PullResult {
                        image: format!("ok-{i}"),
                        name: NAME.into(),
                        image_ref: format!("sha256:ok{i}"),
                        used: Some(Presented::NodeWide),
                    },
                    NOW,
                )
                .await
        }));
    }
    let failed = store
        .apply(
            Op::PullResult {
                image: bad.into(),
                name: NAME.into(),
                image_ref: "sha256:fail".into(),
                used: Some(secret("pull", 1)),
            },
            NOW,
        )
        .await;
    assert!(matches!(failed, Err(StoreError::Write(_))), "{failed:?}");
    for t in tasks {
        t.await.unwrap().expect("the other writes commit");
    }
    assert_eq!(store.counts().0, 32);
    assert!(store.record("sha256:fail").is_none());
    let intents = store.intents();
    assert_eq!(
        intents.len(),
        1,
        "the intent stays: the image keeps requiring authentication"
    );
    assert_eq!(intents[0].0, bad);
}

#[tokio::test]
async fn a_version_1_store_is_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let conn = rusqlite::Connection::open(dir.path().join("guard.db")).unwrap();
    let body = r#"{"image_ref":"sha256:old","names":{"registry.example.com/app":{"node_accessible":true,"changed_ms":1}},"changed_ms":1}"#;
    conn.execute_batch(&format!(
        "CREATE TABLE records (image_ref TEXT PRIMARY KEY, body TEXT NOT NULL, changed_ms INTEGER NOT NULL);
         CREATE TABLE intents (image TEXT PRIMARY KEY, name TEXT NOT NULL, count INTEGER NOT NULL, created_ms INTEGER NOT NULL);
         INSERT INTO records VALUES ('sha256:old', '{body}', 1);
         PRAGMA user_version = 1;"
    ))
    .unwrap();
    drop(conn);
    let store = Store::open(dir.path()).unwrap();
    let r = store.record("sha256:old").expect("carried over");
    assert!(r.names["registry.example.com/app"].node_accessible);
    store.close().await;
    let conn = rusqlite::Connection::open(dir.path().join("guard.db")).unwrap();
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, credgate_agent::guard::store::SCHEMA_VERSION);
}

#[tokio::test]
async fn deletes_and_rewrites_survive_reopen_and_compaction() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path()).unwrap();
        // Many rewrites of a few records: the log outgrows them and is compacted.
        for round in 0..600 {
            for i in 0..4 {
                store
                    .apply(
                        numbered(i, secret(&format!("s{round}"), (round % 200) as u8)),
                        NOW + round,
                    )
                    .await
                    .unwrap();
            }
        }
        let done = store
            .apply(
                Op::Delete {
                    image_ref: "sha256:3".into(),
                },
                NOW,
            )
            .await
            .unwrap();
        assert_eq!(done, Done::Deleted(true));
        store.close().await;
    }
    let conn = rusqlite::Connection::open(dir.path().join("guard.db")).unwrap();
    let rows: i64 = conn
        .query_row("SELECT COUNT(*) FROM record_log", [], |r| r.get(0))
        .unwrap();
    assert!(
        rows < 2_000,
        "the log was compacted: {rows} rows for 2,400 writes"
    );
    drop(conn);
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.counts().0, 3);
    assert!(store.record("sha256:3").is_none());
    let r = store.record("sha256:0").unwrap();
    assert_eq!(
        r.names[NAME].secrets.len(),
        100,
        "the last 100 secrets, as written"
    );
}

/// A store another process (an agent still stopping) holds is reported as in use, not as
/// damage an operator should delete. (`Store::open` waits `LOCK_WAIT` for it first; this one
/// does not wait: what is checked is what it says.)
#[tokio::test]
async fn a_store_held_by_another_process_is_reported_as_locked() {
    let dir = tempfile::tempdir().unwrap();
    let first = Store::open(dir.path()).unwrap();
    first.apply(intent("reg.io/a:v1"), 1).await.unwrap();
    let e = match Store::open_waiting(dir.path(), std::time::Duration::ZERO) {
        Err(e) => e,
        Ok(_) => panic!("a second store opened a held file"),
    };
    assert!(matches!(e, StoreError::Locked { .. }), "{e}");
    assert!(e.to_string().contains("in use by another process"), "{e}");
    assert!(!e.to_string().contains("damaged"), "{e}");
}

/// A state directory someone else can write, or a link, is refused before anything in it is
/// opened.
#[tokio::test]
async fn an_untrusted_state_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = match Store::open(&shared) {
        Err(e) => e,
        Ok(_) => panic!("opened a store in a world-writable directory"),
    };
    assert!(matches!(e, StoreError::Untrusted(_)), "{e}");
    assert_eq!(
        std::fs::metadata(&shared).unwrap().permissions().mode() & 0o777,
        0o777,
        "refused, not chmod'ed"
    );
    let link = dir.path().join("link");
    let private = dir.path().join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(&private, &link).unwrap();
    assert!(matches!(Store::open(&link), Err(StoreError::Untrusted(_))));
    // A planted database link inside a private directory is refused too.
    std::os::unix::fs::symlink("/dev/null", private.join("guard.db")).unwrap();
    let e = match Store::open(&private) {
        Err(e) => e,
        Ok(_) => panic!("followed a planted link"),
    };
    assert!(e.to_string().contains("symbolic link"), "{e}");
}

/// The size of the store's files on disk (the database and its write-ahead log).
fn store_bytes(state: &std::path::Path) -> u64 {
    std::fs::read_dir(state)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("guard.db"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum()
}

/// One image content pulled anonymously under 3000 names (a tenant names it at will): its
/// record keeps a bounded number of names, and the store's files stay small, since a record
/// rewritten at each pull is small and the log is compacted by what it weighs.
#[tokio::test]
async fn one_content_under_many_names_keeps_the_store_small() {
    use credgate_core::guard::MAX_NAMES_PER_RECORD;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let store = Store::open(&state).unwrap();
    let long = "x".repeat(150);
    for i in 0..3000 {
        let name = format!("registry.example.com/{long}/name-{i}");
        store
            .apply(
                Op::PullResult {
                    image: format!("{name}:v1"),
                    name,
                    image_ref: REF.into(),
                    used: Some(Presented::NodeWide),
                },
                NOW + i,
            )
            .await
            .unwrap();
    }
    let record = store.record(REF).unwrap();
    assert_eq!(record.names.len(), MAX_NAMES_PER_RECORD);
    let bytes = store_bytes(&state);
    assert!(bytes < 16 << 20, "{bytes} bytes on disk");
    store.close().await;
    let again = Store::open(&state).unwrap();
    assert_eq!(again.record(REF).unwrap().names.len(), MAX_NAMES_PER_RECORD);
}
