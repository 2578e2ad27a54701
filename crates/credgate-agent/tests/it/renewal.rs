//! Renewal on a paused clock: days of simulated time in milliseconds. The plugin is a fake
//! runner (this tests the renewal component; real plugins are exercised over the socket in
//! `rpc.rs` and end to end in the CLI's tests).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use credgate_agent::metrics::AgentMetrics;
use credgate_agent::renewal::Renewer;
use credgate_core::config::ProviderConfig;
use credgate_core::renewal::RenewalPolicy;
use credgate_engine::clock::{Clock, TokioClock};
use credgate_engine::exec::{BoxFuture, PluginCommand, PluginRunner, RunError};
use credgate_engine::{Engine, EngineOptions};
use secrecy::ExposeSecret;

const MIN: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);

/// Answers like a token-issuing plugin: `token-N` for the N-th run, or the same password every
/// time when `rotate` is off; fails while `failing` is on.
struct TokenPlugin {
    runs: AtomicUsize,
    failing: AtomicBool,
    rotate: AtomicBool,
    key_type: &'static str,
    ttl: &'static str,
}

impl TokenPlugin {
    fn new(key_type: &'static str, ttl: &'static str) -> Arc<Self> {
        Arc::new(TokenPlugin {
            runs: AtomicUsize::new(0),
            failing: AtomicBool::new(false),
            rotate: AtomicBool::new(true),
            key_type,
            ttl,
        })
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

impl PluginRunner for TokenPlugin {
    fn run<'a>(
        &'a self,
        command: &'a PluginCommand,
        _stdin: Vec<u8>,
    ) -> BoxFuture<'a, Result<Vec<u8>, RunError>> {
        Box::pin(async move {
            let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
            if self.failing.load(Ordering::SeqCst) {
                return Err(RunError::NonZeroExit {
                    plugin: command.name().to_owned(),
                    status: "exit status: 1".into(),
                    stderr: String::new(),
                });
            }
            let password = if self.rotate.load(Ordering::SeqCst) {
                format!("token-{n}")
            } else {
                "static-token".to_owned()
            };
            Ok(format!(
                r#"{{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"{}","cacheDuration":"{}","auth":{{"reg.example.com":{{"username":"u","password":"{password}"}}}}}}"#,
                self.key_type, self.ttl
            )
            .into_bytes())
        })
    }
}

struct Fixture {
    plugin: Arc<TokenPlugin>,
    engine: Arc<ArcSwap<Engine>>,
    renewer: Renewer,
    clock: Arc<dyn Clock>,
    _stop: tokio_util::sync::DropGuard,
}

fn policy() -> RenewalPolicy {
    RenewalPolicy::default()
}

fn start(plugin: Arc<TokenPlugin>, policy: RenewalPolicy) -> Fixture {
    let config = ProviderConfig::from_slice(
        "t.yaml",
        b"apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: tokens\n  matchImages: [reg.example.com]\n  defaultCacheDuration: 10m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
    )
    .unwrap();
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let engine = Engine::builder()
        .config(config)
        .options(EngineOptions::default())
        .runner(plugin.clone())
        .clock(clock.clone())
        .build()
        .unwrap();
    let engine = Arc::new(ArcSwap::from_pointee(engine));
    let tasks = credgate_agent::tasks::Tasks::new();
    let renewer = Renewer::new(
        engine.clone(),
        clock.clone(),
        policy,
        AgentMetrics::default(),
        tasks.clone(),
        None,
    );
    tokio::spawn(renewer.clone().run());
    Fixture {
        plugin,
        engine,
        renewer,
        clock,
        _stop: tasks.token().clone().drop_guard(),
    }
}

fn refs(images: &[&str]) -> Vec<String> {
    images.iter().map(|s| (*s).to_owned()).collect()
}

fn password(f: &Fixture, image: &str) -> Option<String> {
    f.renewer
        .last_good(image)
        .map(|v| v.credentials[0].password.expose_secret().to_owned())
}

#[tokio::test(start_paused = true)]
async fn ten_minute_credential_stays_fresh_for_days() {
    let f = start(TokenPlugin::new("Image", "10m"), policy());
    let image = "reg.example.com/team/app:v1";
    f.renewer.track("nydus", &refs(&[image])).unwrap();
    let mut rx = f
        .renewer
        .watch(&refs(&[image]))
        .unwrap()
        .receivers
        .remove(0)
        .1;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let days = 3;
    let mut revisions = 0u64;
    for _ in 0..(days * 24 * 60) {
        tokio::time::sleep(MIN).await;
        let value = f
            .renewer
            .last_good(image)
            .expect("a credential is always there");
        let expires = value.credentials[0].expires_at.expect("cached with a TTL");
        // Renewed ahead of expiry: what a consumer holds always has time left.
        assert!(
            expires > f.clock.wall() + Duration::from_secs(30),
            "credential about to expire at minute check"
        );
        if rx.has_changed().unwrap_or(false) {
            revisions = rx.borrow_and_update().as_ref().unwrap().revision;
        }
    }
    let runs = f.plugin.runs();
    // A 10-minute credential renewed 1 to 1.2 minutes early: a run every 8.8 to 9 minutes.
    let minutes = (days * 24 * 60) as f64;
    assert!(
        (minutes / 9.0 - 2.0..=minutes / 8.8 + 2.0).contains(&(runs as f64)),
        "{runs} runs in {days} days"
    );
    assert_eq!(revisions as usize, runs, "every new token was pushed");
}

#[tokio::test(start_paused = true)]
async fn failing_plugin_keeps_the_last_good_credential_and_backs_off() {
    let f = start(TokenPlugin::new("Image", "10m"), policy());
    let image = "reg.example.com/team/app:v1";
    f.renewer.track("nydus", &refs(&[image])).unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(password(&f, image).as_deref(), Some("token-1"));

    f.plugin.failing.store(true, Ordering::SeqCst);
    let before = f.plugin.runs();
    tokio::time::sleep(2 * HOUR).await;
    let failed_runs = f.plugin.runs() - before;
    // Retries from minute 9 back off 2 s, 4 s, ... up to 5 min: about 30 runs in 2 hours,
    // not one per second.
    assert!(
        (8..=40).contains(&failed_runs),
        "{failed_runs} runs while failing"
    );
    assert_eq!(
        password(&f, image).as_deref(),
        Some("token-1"),
        "last good kept"
    );
    let info = &f.renewer.list(None)[0];
    assert!(info.consecutive_failures >= 8, "{info:?}");
    assert!(info
        .last_error
        .as_deref()
        .is_some_and(|e| e.contains("plugin tokens")));
    let next = info.next_attempt.expect("a retry is scheduled");
    assert!(next <= f.clock.wall() + Duration::from_secs(300));

    f.plugin.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(301)).await;
    let fresh = password(&f, image).unwrap();
    assert_ne!(fresh, "token-1");
    let info = &f.renewer.list(None)[0];
    assert_eq!(info.consecutive_failures, 0);
    assert!(info.last_error.is_none());
}

#[tokio::test(start_paused = true)]
async fn shared_refs_stay_while_any_consumer_holds_them_then_get_evicted_after_grace() {
    let p = RenewalPolicy {
        grace: 10 * MIN,
        ..policy()
    };
    let f = start(TokenPlugin::new("Registry", "10m"), p);
    let image = "reg.example.com/team/app:v1";
    f.renewer.track("a", &refs(&[image])).unwrap();
    f.renewer.track("b", &refs(&[image])).unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    f.renewer.untrack("a", &refs(&[image])).unwrap();
    tokio::time::sleep(HOUR).await;
    assert_eq!(f.renewer.list(None)[0].consumers, ["b"]);
    assert!(password(&f, image).is_some());

    let change = f.renewer.set_tracked("b", &[]).unwrap();
    assert_eq!(change.removed, [image]);
    tokio::time::sleep(9 * MIN).await;
    assert_eq!(f.renewer.len(), 1, "kept during the grace period");
    // Re-registered within the grace period: the last good credential is still there.
    f.renewer.track("b", &refs(&[image])).unwrap();
    assert!(password(&f, image).is_some());
    f.renewer.untrack("b", &refs(&[image])).unwrap();
    tokio::time::sleep(11 * MIN).await;
    assert_eq!(f.renewer.len(), 0, "evicted after the grace period");
    assert!(f.renewer.last_good(image).is_none());
}

#[tokio::test(start_paused = true)]
async fn one_run_per_cache_entry_for_a_hundred_refs_of_one_registry() {
    let f = start(TokenPlugin::new("Registry", "10m"), policy());
    let images: Vec<String> = (0..100)
        .map(|i| format!("reg.example.com/team/app-{i}:v1"))
        .collect();
    f.renewer.set_tracked("mirror", &images).unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(f.plugin.runs(), 1, "the first resolution of 100 refs");
    tokio::time::sleep(24 * HOUR).await;
    let runs = f.plugin.runs();
    // One renewal of the shared Registry entry every ~9 minutes: about 160 a day, not 16000.
    assert!((155..=170).contains(&runs), "{runs} runs");
    let first = password(&f, &images[0]).unwrap();
    for image in &images {
        assert_eq!(password(&f, image).unwrap(), first, "{image}");
    }
}

#[tokio::test(start_paused = true)]
async fn watch_gets_the_current_value_first_then_only_changes() {
    let plugin = TokenPlugin::new("Image", "10m");
    plugin.rotate.store(false, Ordering::SeqCst);
    let f = start(plugin, policy());
    let image = "reg.example.com/team/app:v1";
    f.renewer.track("nydus", &refs(&[image])).unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;

    // A late subscriber sees the current value at once.
    let mut sub = f.renewer.watch(&refs(&[image])).unwrap();
    let mut rx = sub.receivers.remove(0).1;
    let current = rx.borrow_and_update().clone().expect("current value");
    assert_eq!(current.revision, 1);

    // Renewals that return the same credential push nothing.
    tokio::time::sleep(2 * HOUR).await;
    assert!(f.plugin.runs() >= 12, "renewals happened");
    assert!(!rx.has_changed().unwrap(), "no event without a change");

    // A rotated credential is pushed once.
    f.plugin.rotate.store(true, Ordering::SeqCst);
    tokio::time::timeout(20 * MIN, rx.changed())
        .await
        .expect("change pushed")
        .unwrap();
    let v = rx.borrow_and_update().clone().unwrap();
    assert_eq!(v.revision, 2);
    assert!(v.credentials[0]
        .password
        .expose_secret()
        .starts_with("token-"));
}

#[tokio::test(start_paused = true)]
async fn tracking_is_bounded_in_names_refs_and_consumers() {
    use credgate_agent::renewal::{TrackError, MAX_CONSUMERS, MAX_REFS_PER_CONSUMER};
    let f = start(TokenPlugin::new("Registry", "10m"), policy());
    let image = "reg.example.com/team/app:v1";
    // Names: length and charset.
    for bad in ["a\nb", "has space", &"c".repeat(254)] {
        let e = f.renewer.track(bad, &refs(&[image])).unwrap_err();
        assert!(matches!(e, TrackError::BadConsumer(_)), "{e}");
        assert!(e.to_string().len() < 300, "quoted, not echoed: {e}");
    }
    f.renewer
        .track("node/nydus-snapshotter@1:a_b.c", &refs(&[image]))
        .unwrap();
    // A huge ref is refused by length, and its message does not echo it.
    let huge = format!("reg.example.com/app@sha999:{}", "a".repeat(4 << 20));
    let e = f.renewer.track("x", &[huge]).unwrap_err();
    assert!(e.to_string().len() < 300, "{} bytes", e.to_string().len());
    // Refs per consumer, across calls and in one SetTracked.
    let many: Vec<String> = (0..MAX_REFS_PER_CONSUMER)
        .map(|i| format!("reg.example.com/app-{i}:v1"))
        .collect();
    f.renewer.set_tracked("full", &many).unwrap();
    let e = f
        .renewer
        .track("full", &refs(&["reg.example.com/one-more:v1"]))
        .unwrap_err();
    assert_eq!(e, TrackError::TooManyRefs);
    // Tracking one already held still works at the limit.
    f.renewer.track("full", &many[..1]).unwrap();
    let mut over = many.clone();
    over.push("reg.example.com/one-more:v1".into());
    assert_eq!(
        f.renewer.set_tracked("full", &over).unwrap_err(),
        TrackError::TooManyRefs
    );
    f.renewer.set_tracked("full", &[]).unwrap();
    // Consumers.
    let held = f.renewer.list(None).len();
    assert!(held > 0);
    for i in 0..MAX_CONSUMERS - 1 {
        f.renewer.track(&format!("c{i}"), &refs(&[image])).unwrap();
    }
    assert_eq!(
        f.renewer
            .track("one-too-many", &refs(&[image]))
            .unwrap_err(),
        TrackError::TooManyConsumers
    );
    // A consumer that already holds refs may still change them.
    f.renewer
        .track("c0", &refs(&["reg.example.com/b:v1"]))
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_ref_whose_renewal_is_late_is_counted_due() {
    let f = start(TokenPlugin::new("Image", "10m"), policy());
    let image = "reg.example.com/team/app:v1";
    f.renewer.track("c", &refs(&[image])).unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(password(&f, image).is_some());
    assert_eq!(f.renewer.due_count(), 0, "fresh");
    f.plugin.failing.store(true, Ordering::SeqCst);
    // Renewal starts a minute before expiry and keeps failing: inside the lead, it is due.
    tokio::time::sleep(9 * MIN + Duration::from_secs(30)).await;
    assert_eq!(f.renewer.due_count(), 1);
    f.plugin.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(2 * MIN).await;
    assert_eq!(f.renewer.due_count(), 0, "renewed once the plugin recovers");
}

/// A restored ref whose saved credential has less time left than the restore spread is checked
/// before that credential expires (the spread shrinks to a part of what is left), so its first
/// renewal never lands after the expiry; refs with nothing restored keep the whole spread.
#[tokio::test(start_paused = true)]
async fn restored_refs_are_checked_before_their_credentials_expire() {
    use credgate_engine::saved::{SavedAuth, SavedEntry};
    let f = start(TokenPlugin::new("Registry", "10m"), policy());
    let engine = f.engine.load_full();
    let wall = f.clock.wall();
    let left = Duration::from_secs(4);
    let restored = engine.restore(vec![SavedEntry {
        provider: "tokens".into(),
        provider_identity: engine.provider_identity("tokens").unwrap().to_owned(),
        key_type: credgate_core::wire::CacheKeyType::Registry,
        image: "reg.example.com/team/app".into(),
        registry: "reg.example.com".into(),
        scope: None,
        auth: vec![SavedAuth {
            key: "reg.example.com".into(),
            username: "u".into(),
            password: "restored".to_owned().into(),
        }],
        fetched: wall - Duration::from_secs(596),
        expires: wall + left,
    }]);
    assert_eq!(restored.restored, 1);
    let images: Vec<String> = (0..20)
        .map(|i| format!("reg.example.com/team/app-{i}:v1"))
        .collect();
    f.renewer.restore("nydus", &images).unwrap();
    for info in f.renewer.list(None) {
        let next = info.next_attempt.expect("a first check is scheduled");
        assert!(
            next <= wall + left / 4,
            "{} first checked {:?} after the restore, its credential expires after {left:?}",
            info.image,
            next.duration_since(wall).unwrap()
        );
    }
    assert_eq!(f.plugin.runs(), 0, "restoring runs no plugin");
}

/// The consumers one caller uid names hold at most `MAX_REFS_PER_UID` refs together: naming
/// more consumers does not grow what a socket-group member may track; another uid, root and
/// in-process callers are not held back by it.
#[tokio::test(start_paused = true)]
async fn one_caller_uid_cannot_track_without_bound_by_naming_consumers() {
    use credgate_agent::renewal::{TrackError, MAX_REFS_PER_UID};
    let f = start(TokenPlugin::new("Registry", "10m"), policy());
    let refs = |prefix: &str, n: usize| -> Vec<String> {
        (0..n)
            .map(|i| format!("reg.example.com/{prefix}/app-{i}:v1"))
            .collect()
    };
    let half = MAX_REFS_PER_UID / 2;
    f.renewer
        .track_as(Some(4242), "c1", &refs("a", half))
        .unwrap();
    f.renewer
        .set_tracked_as(Some(4242), "c2", &refs("b", half))
        .unwrap();
    assert_eq!(
        f.renewer.track_as(Some(4242), "c3", &refs("c", 1)),
        Err(TrackError::TooManyRefsForCaller)
    );
    assert_eq!(
        f.renewer
            .set_tracked_as(Some(4242), "c2", &refs("b", half + 1))
            .unwrap_err(),
        TrackError::TooManyRefsForCaller
    );
    // Replacing within the bound is fine; another uid and root are not counted with it.
    f.renewer
        .set_tracked_as(Some(4242), "c2", &refs("d", half))
        .unwrap();
    f.renewer
        .track_as(Some(4243), "c4", &refs("e", half))
        .unwrap();
    f.renewer.track_as(Some(0), "c5", &refs("f", half)).unwrap();
    f.renewer.track("c6", &refs("g", half)).unwrap();
    // Untracking gives room back.
    f.renewer.untrack("c1", &refs("a", 10)).unwrap();
    f.renewer
        .track_as(Some(4242), "c3", &refs("c", 10))
        .unwrap();
    // A Watch stream's refs count with the uid's consumers', and are given back with it.
    assert_eq!(
        f.renewer.watch_as(Some(4242), &refs("w", 1)).err(),
        Some(TrackError::TooManyRefsForCaller)
    );
    f.renewer.untrack("c3", &refs("c", 10)).unwrap();
    let stream = f.renewer.watch_as(Some(4242), &refs("w", 10)).unwrap();
    assert_eq!(
        f.renewer.track_as(Some(4242), "c3", &refs("c", 1)),
        Err(TrackError::TooManyRefsForCaller)
    );
    assert!(f.renewer.watch_as(Some(0), &refs("x", half)).is_ok());
    drop(stream);
    f.renewer
        .track_as(Some(4242), "c3", &refs("c", 10))
        .unwrap();
}

/// Uids are cheap (a pod picks its `runAsUser`): the consumers of every uid but root's and the
/// agent's own hold at most `MAX_REFS_UNPRIVILEGED` refs together, while root keeps its room.
#[tokio::test(start_paused = true)]
async fn many_uids_together_cannot_track_without_bound() {
    use credgate_agent::renewal::{TrackError, MAX_REFS_PER_UID, MAX_REFS_UNPRIVILEGED};
    let f = start(TokenPlugin::new("Registry", "10m"), policy());
    let refs = |prefix: &str, n: usize| -> Vec<String> {
        (0..n)
            .map(|i| format!("reg.example.com/{prefix}/app-{i}:v1"))
            .collect()
    };
    let uids = MAX_REFS_UNPRIVILEGED / MAX_REFS_PER_UID;
    for u in 0..uids {
        let uid = 10_000 + u as u32;
        f.renewer
            .track_as(
                Some(uid),
                &format!("c{u}"),
                &refs(&format!("u{u}"), MAX_REFS_PER_UID),
            )
            .unwrap();
    }
    assert_eq!(
        f.renewer.track_as(Some(20_000), "late", &refs("late", 1)),
        Err(TrackError::TooManyRefsUnprivileged)
    );
    assert_eq!(
        f.renewer.watch_as(Some(20_001), &refs("w", 1)).err(),
        Some(TrackError::TooManyRefsUnprivileged)
    );
    f.renewer
        .track_as(Some(0), "root", &refs("root", 1000))
        .unwrap();
    f.renewer.track("in-process", &refs("own", 1000)).unwrap();
    f.renewer.untrack("c0", &refs("u0", 1)).unwrap();
    f.renewer
        .track_as(Some(20_000), "late", &refs("late", 1))
        .unwrap();
}

/// Renewal scheduled by due time: 8,000 refs behind one cache entry of an hour cost one run,
/// and a thousand wakes in the meantime (refs tracked and untracked) run nothing. (What a
/// wake costs in CPU is `credgate-bench soak`'s figure: BENCHMARKS.md.)
#[tokio::test(start_paused = true)]
async fn renewal_follows_what_is_due_not_what_is_held() {
    let f = start(TokenPlugin::new("Registry", "1h"), policy());
    let many: Vec<String> = (0..8000)
        .map(|i| format!("reg.example.com/team/app-{i}:v1"))
        .collect();
    f.renewer.track("bulk-1", &many[..4000]).unwrap();
    f.renewer.track("bulk-2", &many[4000..]).unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    assert!(f.plugin.runs() >= 1);
    let after_first = f.plugin.runs();
    for i in 0..1000 {
        let r = vec![format!("other.example.com/x/{i}:v1")];
        f.renewer.track("churn", &r).unwrap();
        f.renewer.untrack("churn", &r).unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_secs(60)).await;
    // The churned refs match no provider; bulk's entry is not renewed again within its hour.
    assert_eq!(f.plugin.runs(), after_first);
    assert_eq!(after_first, 1, "one run for the one entry of 8,000 refs");
}
