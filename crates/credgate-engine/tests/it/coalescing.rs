//! Coalescing of concurrent misses, counted with a fake runner under tokio's paused clock:
//! every request is queued before the first run's one-second delay elapses.

use std::sync::Arc;
use std::time::Duration;

use credgate_engine::{Engine, EngineOptions, LookupRequest, ProviderError};
use tokio::sync::Barrier;
use tokio::time::Instant;

use crate::common::*;

const RUN: Duration = Duration::from_secs(1);

fn fake_engine(
    key_type: &'static str,
    runner: Option<Arc<FakeRunner>>,
) -> (Engine, Arc<FakeRunner>) {
    let runner = runner.unwrap_or_else(|| {
        FakeRunner::new(RUN, move |_, _| {
            Ok(response(
                WIRE_V1,
                key_type,
                Some("1h"),
                &[("registry.example.com", "u", "p")],
            ))
        })
    });
    let engine = Engine::builder()
        .config(config(&[(
            "p",
            &["registry.example.com", "other.example.com"],
            "10m",
            WIRE_V1,
        )]))
        .options(EngineOptions::default())
        .runner(runner.clone())
        .build()
        .unwrap();
    (engine, runner)
}

/// Starts `images.len()` lookups behind a barrier; returns each one's wait.
async fn burst(engine: &Engine, images: Vec<String>) -> Vec<Duration> {
    let barrier = Arc::new(Barrier::new(images.len()));
    let tasks: Vec<_> = images
        .into_iter()
        .map(|image| {
            let (engine, barrier) = (engine.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let started = Instant::now();
                let got = engine
                    .lookup(&LookupRequest {
                        image: &image,
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                assert!(got.errors.is_empty(), "{:?}", got.errors);
                started.elapsed()
            })
        })
        .collect();
    let mut waits = Vec::new();
    for t in tasks {
        waits.push(t.await.unwrap());
    }
    waits
}

fn distinct(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("registry.example.com/team/app-{i}:v1"))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn registry_keyed_burst_of_distinct_images_costs_one_run() {
    let (engine, runner) = fake_engine("Registry", None);
    let waits = burst(&engine, distinct(100)).await;
    assert_eq!(runner.runs(), 1);
    assert!(waits.iter().all(|w| *w <= RUN), "{waits:?}");
}

#[tokio::test(start_paused = true)]
async fn global_keyed_burst_across_registries_costs_one_run() {
    let (engine, runner) = fake_engine("Global", None);
    let mut images = distinct(50);
    images.extend((0..50).map(|i| format!("other.example.com/x/{i}")));
    burst(&engine, images).await;
    assert_eq!(runner.runs(), 1);
}

#[tokio::test(start_paused = true)]
async fn image_keyed_burst_costs_n_runs_and_waits_at_most_two() {
    let (engine, runner) = fake_engine("Image", None);
    let waits = burst(&engine, distinct(100)).await;
    assert_eq!(runner.runs(), 100);
    assert!(waits.iter().all(|w| *w <= 2 * RUN), "{waits:?}");
    // Once the provider is known to answer per image, nobody waits on someone else's run.
    let more: Vec<String> = (100..200)
        .map(|i| format!("registry.example.com/team/app-{i}:v1"))
        .collect();
    let waits = burst(&engine, more).await;
    assert_eq!(runner.runs(), 200);
    assert!(waits.iter().all(|w| *w <= RUN), "{waits:?}");
}

#[tokio::test(start_paused = true)]
async fn same_image_burst_costs_one_run() {
    for key_type in ["Image", "Registry", "Global"] {
        let (engine, runner) = fake_engine(key_type, None);
        burst(
            &engine,
            vec!["registry.example.com/team/app:v1".to_owned(); 100],
        )
        .await;
        assert_eq!(runner.runs(), 1, "{key_type}");
    }
}

#[tokio::test(start_paused = true)]
async fn zero_duration_answers_still_reach_every_waiter() {
    let runner = FakeRunner::new(RUN, |_, _| {
        Ok(response(
            WIRE_V1,
            "Registry",
            Some("0s"),
            &[("registry.example.com", "u", "p")],
        ))
    });
    let (engine, runner) = fake_engine("Registry", Some(runner));
    let waits = burst(&engine, distinct(20)).await;
    assert_eq!(runner.runs(), 1);
    assert!(waits.iter().all(|w| *w <= RUN));
}

#[tokio::test(start_paused = true)]
async fn a_failed_run_is_shared_by_its_waiters() {
    let runner = FakeRunner::new(RUN, |_, _| Err(()));
    let (engine, runner) = fake_engine("Registry", Some(runner));
    let barrier = Arc::new(Barrier::new(10));
    let tasks: Vec<_> = distinct(10)
        .into_iter()
        .map(|image| {
            let (engine, barrier) = (engine.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                engine
                    .lookup(&LookupRequest {
                        image: &image,
                        ..Default::default()
                    })
                    .await
                    .unwrap()
            })
        })
        .collect();
    for t in tasks {
        let got = t.await.unwrap();
        assert_eq!(got.errors.len(), 1);
    }
    assert_eq!(runner.runs(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_caller_does_not_strand_the_others() {
    let (engine, runner) = fake_engine("Registry", None);
    let first = spawn_lookup(&engine, "registry.example.com/a");
    tokio::task::yield_now().await;
    first.abort();
    let got = spawn_lookup(&engine, "registry.example.com/b")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.credentials.len(), 1);
    assert_eq!(runner.runs(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_run_whose_only_caller_is_cancelled_still_fills_the_cache() {
    let (engine, runner) = fake_engine("Registry", None);
    let first = spawn_lookup(&engine, "registry.example.com/a");
    tokio::task::yield_now().await;
    assert_eq!(runner.runs(), 1, "the caller started the run");
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    // The run goes on without its caller and fills the cache.
    tokio::time::sleep(RUN * 2).await;
    let got = spawn_lookup(&engine, "registry.example.com/b")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.credentials.len(), 1);
    assert_eq!(runner.runs(), 1, "served from the cache");
    assert_eq!(engine.provider_status()[0].cache_hits, 1);
}

/// A runner with a bug: it panics mid-run.
struct Panicking;

impl credgate_engine::exec::PluginRunner for Panicking {
    fn run<'a>(
        &'a self,
        _: &'a credgate_engine::exec::PluginCommand,
        _: Vec<u8>,
    ) -> credgate_engine::exec::BoxFuture<'a, Result<Vec<u8>, credgate_engine::exec::RunError>>
    {
        Box::pin(async {
            tokio::time::sleep(RUN).await;
            panic!("a runner bug");
        })
    }
}

#[tokio::test(start_paused = true)]
async fn a_run_that_panics_fails_its_caller_and_abandons_the_others() {
    let engine = Engine::builder()
        .config(config(&[("p", &["registry.example.com"], "10m", WIRE_V1)]))
        .options(EngineOptions::default())
        .runner(Arc::new(Panicking))
        .build()
        .unwrap();
    // Watch for a second panic: the panicked run being polled again.
    static REPOLLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.to_string().contains("resumed after panicking") {
            REPOLLED.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        default_hook(info);
    }));
    let first = spawn_lookup(&engine, "registry.example.com/a");
    tokio::task::yield_now().await;
    let joiner = spawn_lookup(&engine, "registry.example.com/a");
    assert!(
        first.await.unwrap_err().is_panic(),
        "the caller that drove the run"
    );
    // The panicked run is not polled again elsewhere: the joiner is told it was abandoned.
    let got = joiner.await.unwrap().unwrap();
    assert!(
        matches!(got.errors[..], [ProviderError::Abandoned { .. }]),
        "{:?}",
        got.errors
    );
    assert!(!REPOLLED.load(std::sync::atomic::Ordering::SeqCst));
}

/// A lookup of `image` in a task of its own.
fn spawn_lookup(
    engine: &Engine,
    image: &'static str,
) -> tokio::task::JoinHandle<Result<credgate_engine::Lookup, credgate_engine::LookupError>> {
    let engine = engine.clone();
    tokio::spawn(async move {
        engine
            .lookup(&LookupRequest {
                image,
                ..Default::default()
            })
            .await
    })
}

/// A runner that records how many runs were in flight at once.
struct Gauged {
    inner: Arc<FakeRunner>,
    now: std::sync::atomic::AtomicUsize,
    max: std::sync::atomic::AtomicUsize,
}

impl credgate_engine::exec::PluginRunner for Gauged {
    fn run<'a>(
        &'a self,
        command: &'a credgate_engine::exec::PluginCommand,
        stdin: Vec<u8>,
    ) -> credgate_engine::exec::BoxFuture<'a, Result<Vec<u8>, credgate_engine::exec::RunError>>
    {
        use std::sync::atomic::Ordering::SeqCst;
        Box::pin(async move {
            let n = self.now.fetch_add(1, SeqCst) + 1;
            self.max.fetch_max(n, SeqCst);
            let out = self.inner.run(command, stdin).await;
            self.now.fetch_sub(1, SeqCst);
            out
        })
    }
}

#[tokio::test(start_paused = true)]
async fn plugin_runs_in_flight_are_bounded_per_provider_and_in_total() {
    use std::sync::atomic::Ordering::SeqCst;
    let answer = |_: &str, _| {
        Ok(response(
            WIRE_V1,
            "Image",
            Some("1h"),
            &[("registry.example.com", "u", "p")],
        ))
    };
    let gauged = Arc::new(Gauged {
        inner: FakeRunner::new(RUN, answer),
        now: Default::default(),
        max: Default::default(),
    });
    let engine = Engine::builder()
        .config(config(&[
            ("a", &["registry.example.com"], "10m", WIRE_V1),
            ("b", &["registry.example.com"], "10m", WIRE_V1),
        ]))
        .options(EngineOptions {
            max_runs_per_provider: 4,
            max_runs: 6,
            ..EngineOptions::default()
        })
        .runner(gauged.clone())
        .build()
        .unwrap();
    let started = Instant::now();
    let waits = burst(&engine, distinct(20)).await;
    // 20 images x 2 providers = 40 runs, at most 6 at a time (4 per provider).
    assert_eq!(gauged.inner.runs(), 40);
    assert!(
        gauged.max.load(SeqCst) <= 6,
        "max {}",
        gauged.max.load(SeqCst)
    );
    assert!(gauged.max.load(SeqCst) >= 4);
    assert!(waits.iter().all(|w| *w <= started.elapsed()));
    assert!(started.elapsed() >= RUN * 40 / 6);
}

/// `--plugin-rate`: runs beyond the rate wait for their turn and succeed; none fails, and the
/// waits are counted.
#[tokio::test(start_paused = true)]
async fn a_plugin_rate_queues_runs_instead_of_failing_them() {
    let runner = FakeRunner::new(Duration::ZERO, |_, _| {
        Ok(response(
            WIRE_V1,
            "Image",
            Some("1h"),
            &[("registry.example.com", "u", "p")],
        ))
    });
    let mut options = EngineOptions::default();
    options.plugin_rates.insert(
        "p".into(),
        credgate_engine::rate::PluginRate {
            per_second: 5.0,
            burst: 1,
        },
    );
    let engine = Engine::builder()
        .config(config(&[("p", &["registry.example.com"], "10m", WIRE_V1)]))
        .options(options)
        .runner(runner.clone())
        .build()
        .unwrap();
    let started = Instant::now();
    let waits = burst(&engine, distinct(6)).await;
    assert_eq!(runner.runs(), 6);
    // One at once, then five at 5/s: a second in all, never all at once.
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert_eq!(waits.iter().filter(|w| w.is_zero()).count(), 1, "{waits:?}");
    let mut text = String::new();
    let mut registry = prometheus_client::registry::Registry::default();
    engine.metrics().register(&mut registry);
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("credgate_plugin_runs_delayed_total{provider=\"p\"} 5"),
        "{text}"
    );
}
