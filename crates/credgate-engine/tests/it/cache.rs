//! Cache expiry, minimum validity and last-known-good, on tokio's paused clock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use credgate_engine::clock::TokioClock;
use credgate_engine::{Engine, EngineOptions, LookupRequest};

use crate::common::*;

const IMG: &str = "registry.example.com/team/app:v1";

fn engine_with(runner: Arc<FakeRunner>, capacity: usize) -> Engine {
    Engine::builder()
        .config(config(&[("p", &["registry.example.com"], "10m", WIRE_V1)]))
        .options(EngineOptions {
            cache_capacity: capacity,
            ..Default::default()
        })
        .runner(runner)
        .clock(Arc::new(TokioClock::new()))
        .build()
        .unwrap()
}

fn ten_minutes() -> Arc<FakeRunner> {
    FakeRunner::new(Duration::ZERO, |_, n| {
        Ok(response(
            WIRE_V1,
            "Registry",
            None,
            &[("registry.example.com", &format!("u{n}"), "p")],
        ))
    })
}

async fn user(engine: &Engine, min_valid_for: Duration) -> Option<String> {
    let got = engine
        .lookup(&LookupRequest {
            image: IMG,
            min_valid_for,
            ..Default::default()
        })
        .await
        .unwrap();
    got.credentials.first().map(|c| c.username.clone())
}

#[tokio::test(start_paused = true)]
async fn entries_live_until_expiry_then_rerun() {
    let runner = ten_minutes();
    let engine = engine_with(runner.clone(), 100);
    assert_eq!(user(&engine, Duration::ZERO).await.as_deref(), Some("u1"));
    tokio::time::advance(Duration::from_secs(599)).await;
    assert_eq!(user(&engine, Duration::ZERO).await.as_deref(), Some("u1"));
    assert_eq!(runner.runs(), 1);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(
        user(&engine, Duration::ZERO).await.as_deref(),
        Some("u2"),
        "dead the moment expiry passed"
    );
    assert_eq!(runner.runs(), 2);
}

#[tokio::test(start_paused = true)]
async fn minimum_validity_forces_a_rerun() {
    let runner = ten_minutes();
    let engine = engine_with(runner.clone(), 100);
    user(&engine, Duration::ZERO).await;
    tokio::time::advance(Duration::from_secs(300)).await;
    assert_eq!(
        user(&engine, Duration::from_secs(299)).await.as_deref(),
        Some("u1")
    );
    assert_eq!(
        user(&engine, Duration::from_secs(301)).await.as_deref(),
        Some("u2")
    );
    assert_eq!(runner.runs(), 2);
    let served = engine.lookup_cached(
        &LookupRequest {
            image: IMG,
            ..Default::default()
        },
        |c| c[0].username.to_owned(),
    );
    assert_eq!(served.unwrap().as_deref(), Some("u2"));
}

#[tokio::test(start_paused = true)]
async fn failed_rerun_keeps_the_last_known_good() {
    let failing = Arc::new(AtomicBool::new(false));
    let flag = failing.clone();
    let runner = FakeRunner::new(Duration::ZERO, move |_, n| {
        if flag.load(Ordering::SeqCst) {
            Err(())
        } else {
            Ok(response(
                WIRE_V1,
                "Registry",
                None,
                &[("registry.example.com", &format!("u{n}"), "p")],
            ))
        }
    });
    let engine = engine_with(runner.clone(), 100);
    user(&engine, Duration::ZERO).await;
    tokio::time::advance(Duration::from_secs(300)).await;
    failing.store(true, Ordering::SeqCst);
    let strict = engine
        .lookup(&LookupRequest {
            image: IMG,
            min_valid_for: Duration::from_secs(400),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(strict.credentials.is_empty());
    assert_eq!(strict.errors.len(), 1);
    assert_eq!(
        user(&engine, Duration::ZERO).await.as_deref(),
        Some("u1"),
        "last known good still served"
    );
    assert_eq!(runner.runs(), 2);
}

#[tokio::test(start_paused = true)]
async fn memory_is_bounded_under_distinct_images() {
    let runner = FakeRunner::new(Duration::ZERO, |_, _| {
        Ok(response(
            WIRE_V1,
            "Image",
            Some("1h"),
            &[("registry.example.com", "u", "p")],
        ))
    });
    let engine = engine_with(runner.clone(), 50);
    for i in 0..500 {
        let image = format!("registry.example.com/app-{i}");
        engine
            .lookup(&LookupRequest {
                image: &image,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert_eq!(runner.runs(), 500);
    assert_eq!(engine.provider_status()[0].cache_entries, 50);
}

#[tokio::test(start_paused = true)]
async fn lookup_cached_serves_hits_and_declines_misses() {
    let runner = ten_minutes();
    let engine = engine_with(runner, 100);
    let req = LookupRequest {
        image: IMG,
        ..Default::default()
    };
    assert_eq!(engine.lookup_cached(&req, |c| c.len()).unwrap(), None);
    user(&engine, Duration::ZERO).await;
    let got = engine
        .lookup_cached(&req, |c| {
            (c.len(), c[0].source.to_owned(), c[0].pattern.to_owned())
        })
        .unwrap();
    assert_eq!(
        got,
        Some((1, "p".to_owned(), "registry.example.com".to_owned()))
    );
    assert!(engine
        .lookup_cached(
            &LookupRequest {
                image: "UPPER",
                ..Default::default()
            },
            |_| ()
        )
        .is_err());
    let status = &engine.provider_status()[0];
    assert_eq!((status.cache_hits, status.cache_misses), (1, 1));
}

/// A provider whose backend lags the registry: asked again at a refusal, the plugin still
/// answers the refused credential. That answer is kept 1 s, 2 s, then 4 s at most (not its
/// hour), so the plugin is asked again soon but never once per lookup; once it answers a new
/// credential, the next run serves it for its own duration and the provider no longer counts
/// as answering a refused one.
#[tokio::test(start_paused = true)]
async fn a_plugin_that_still_answers_a_refused_credential_is_asked_again_at_doubling_intervals() {
    let caught_up = Arc::new(AtomicBool::new(false));
    let runner = FakeRunner::new(Duration::ZERO, {
        let caught_up = caught_up.clone();
        move |_, _| {
            let password = if caught_up.load(Ordering::SeqCst) {
                "new"
            } else {
                "old"
            };
            Ok(response(
                WIRE_V1,
                "Registry",
                Some("1h"),
                &[("registry.example.com", "u", password)],
            ))
        }
    });
    let engine = engine_with(runner.clone(), 64);
    let password = |e: &Engine| {
        let e = e.clone();
        async move {
            let got = e
                .lookup(&LookupRequest {
                    image: IMG,
                    ..Default::default()
                })
                .await
                .unwrap();
            secrecy::ExposeSecret::expose_secret(&got.credentials[0].password).to_owned()
        }
    };
    assert_eq!(password(&engine).await, "old");
    engine
        .refuse("p", IMG, "u", "old", "refused by the registry")
        .unwrap();
    let refused = tokio::time::Instant::now();
    // A lookup every 100 ms for 12 s: the runs it causes, in seconds after the refusal.
    let mut runs_at = Vec::new();
    let mut ran = runner.runs();
    for step in 0..120u64 {
        if step == 80 {
            caught_up.store(true, Ordering::SeqCst);
        }
        let got = password(&engine).await;
        if runner.runs() > ran {
            ran = runner.runs();
            runs_at.push((refused.elapsed().as_millis() as u64, got));
        } else if step < 80 {
            assert!(engine.answers_refused_since("p").is_some());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let old = |ms: u64| (ms, "old".to_owned());
    assert_eq!(
        runs_at,
        [
            old(0),
            old(1000),
            old(3000),
            old(7000),
            (11000, "new".to_owned())
        ],
        "kept 1 s, 2 s, 4 s, 4 s; the new one served at the next run"
    );
    assert!(engine.answers_refused_since("p").is_none());
    // The new answer keeps its hour.
    tokio::time::sleep(Duration::from_secs(600)).await;
    password(&engine).await;
    assert_eq!(runner.runs(), ran);
}
