//! Property test: the guard's SQLite store, driven by random sequences of writes with restarts
//! in between, agrees with a plain in-memory model after every step. The model applies the
//! core's pure rules (`merge`, `learn`, `recovered`) to two ordered maps, one write at a time,
//! with no log, overlay, batching or compaction; the store must come out the same whether
//! writes arrive one by one or many to a transaction, and whether it was reopened or not.

use std::collections::BTreeMap;

use credgate_agent::guard::store::{Done, Intent, Op, PresentImage, Pruned, Store};
use credgate_core::guard::{self, Coords, CredentialHash, Learned, Presented, Record};
use proptest::prelude::*;

#[derive(Default, Debug)]
struct Model {
    records: BTreeMap<String, Record>,
    intents: BTreeMap<String, Intent>,
}

impl Model {
    fn release(&mut self, image: &str) {
        if let Some(i) = self.intents.get_mut(image) {
            i.count -= 1;
            if i.count == 0 {
                self.intents.remove(image);
            }
        }
    }

    fn apply(&mut self, op: &Op, now: i64) -> Done {
        match op {
            Op::Intent { image, name } => {
                self.intents
                    .entry(image.clone())
                    .and_modify(|i| i.count += 1)
                    .or_insert(Intent {
                        name: name.clone(),
                        count: 1,
                        created_ms: now,
                    });
                Done::Ok
            }
            Op::PullResult {
                image,
                name,
                image_ref,
                used,
            } => {
                if let Some(used) = used {
                    let r = guard::merge(self.records.get(image_ref), image_ref, name, used, now);
                    self.records.insert(image_ref.clone(), r);
                }
                self.release(image);
                Done::Ok
            }
            Op::Learn {
                image_ref,
                name,
                learned,
            } => {
                if let Some(r) = self
                    .records
                    .get(image_ref)
                    .and_then(|r| guard::learn(r, name, learned, now))
                {
                    self.records.insert(image_ref.clone(), r);
                }
                Done::Ok
            }
            Op::Delete { image_ref } => Done::Deleted(self.records.remove(image_ref).is_some()),
            Op::Prune { present, before_ms } => {
                let mut pruned = Pruned::default();
                // A reference listed under two image IDs belongs to the last one listed.
                let owner = |image: &str| {
                    present
                        .iter()
                        .rev()
                        .find(|p| p.references.iter().any(|r| r == image))
                        .map(|p| p.image_ref.clone())
                };
                let before: Vec<String> = self
                    .records
                    .iter()
                    .filter(|(k, r)| {
                        r.changed_ms < *before_ms && !present.iter().any(|p| &p.image_ref == *k)
                    })
                    .map(|(k, _)| k.clone())
                    .collect();
                for (image, intent) in std::mem::take(&mut self.intents) {
                    if let Some(image_ref) = owner(&image) {
                        let r = guard::recovered(
                            self.records.get(&image_ref),
                            &image_ref,
                            &intent.name,
                            now,
                        );
                        self.records.insert(image_ref, r);
                        pruned.intents_recovered += 1;
                    } else if intent.created_ms < *before_ms {
                        pruned.intents_dropped += 1;
                    } else {
                        self.intents.insert(image, intent);
                    }
                }
                for k in before {
                    self.records.remove(&k);
                    pruned.records_deleted += 1;
                }
                Done::Pruned(pruned)
            }
        }
    }
}

/// A step of the test.
#[derive(Debug, Clone)]
enum Step {
    /// One write, awaited.
    One(Op),
    /// Many writes queued at once, in order: they share transactions.
    Many(Vec<Op>),
    /// Close and reopen the store.
    Reopen,
    /// Time passes.
    Wait(i64),
}

const APPS: usize = 3;

fn name(app: usize) -> String {
    format!("registry.example/app{app}")
}

fn image(app: usize, tag: usize) -> String {
    format!("{}:v{tag}", name(app))
}

fn coords(s: usize) -> Coords {
    Coords {
        namespace: format!("ns{}", s % 2),
        name: format!("secret{s}"),
        uid: format!("uid{s}"),
    }
}

fn presented() -> impl Strategy<Value = Option<Presented>> {
    prop_oneof![
        1 => Just(None),
        4 => (0usize..4, 0u8..3).prop_map(|(s, h)| Some(Presented::Secret {
            coords: coords(s),
            hash: CredentialHash::new(1, [h; 32]),
        })),
        1 => (0usize..2).prop_map(|s| Some(Presented::ServiceAccount(coords(s)))),
        1 => Just(Some(Presented::NodeWide)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let app = 0usize..APPS;
    let tag = 0usize..2;
    let image_ref = (0usize..4).prop_map(|r| format!("sha256:{r}"));
    prop_oneof![
        4 => (app.clone(), tag.clone()).prop_map(|(a, t)| Op::Intent { image: image(a, t), name: name(a) }),
        6 => (app.clone(), tag.clone(), image_ref.clone(), presented()).prop_map(|(a, t, r, used)| {
            Op::PullResult { image: image(a, t), name: name(a), image_ref: r, used }
        }),
        2 => (app.clone(), image_ref.clone(), 0usize..6, 0u8..3, any::<bool>()).prop_map(|(a, r, s, h, rotated)| {
            let learned = if rotated {
                Learned::Rotated { coords: coords(s), hash: CredentialHash::new(1, [h; 32]) }
            } else {
                Learned::NewCoordinates { coords: coords(s), hash: CredentialHash::new(1, [h; 32]), recorded_ms: 7 }
            };
            Op::Learn { image_ref: r, name: name(a), learned }
        }),
        1 => image_ref.clone().prop_map(|r| Op::Delete { image_ref: r }),
        1 => (prop::collection::vec((0usize..4, app, tag), 0..3), 0i64..3_000).prop_map(|(present, back)| {
            Op::Prune {
                present: present.into_iter().map(|(r, a, t)| PresentImage {
                    image_ref: format!("sha256:{r}"),
                    references: vec![image(a, t)],
                }).collect(),
                // Relative to now; made absolute when applied.
                before_ms: -back,
            }
        }),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => op().prop_map(Step::One),
        2 => prop::collection::vec(op(), 2..12).prop_map(Step::Many),
        1 => Just(Step::Reopen),
        2 => (1i64..2_000).prop_map(Step::Wait),
    ]
}

fn absolute(op: Op, now: i64) -> Op {
    match op {
        Op::Prune { present, before_ms } => Op::Prune {
            present,
            before_ms: now + before_ms,
        },
        op => op,
    }
}

fn agree(store: &Store, model: &Model, context: &str) -> Result<(), TestCaseError> {
    let records: Vec<Record> = store.records().iter().map(|r| (**r).clone()).collect();
    let want: Vec<Record> = model.records.values().cloned().collect();
    prop_assert_eq!(records, want, "records after {}", context);
    let intents = store.intents();
    let want: Vec<(String, Intent)> = model
        .intents
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    prop_assert_eq!(intents, want, "intents after {}", context);
    Ok(())
}

async fn run(steps: Vec<Step>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path()).unwrap();
    let mut model = Model::default();
    let mut now = 1_700_000_000_000i64;
    for (i, step) in steps.into_iter().enumerate() {
        now += 1;
        match step {
            Step::One(op) => {
                let op = absolute(op, now);
                let want = model.apply(&op, now);
                let got = store.apply(op.clone(), now).await.unwrap();
                prop_assert_eq!(got, want, "step {} {:?}", i, op);
            }
            Step::Many(ops) => {
                let ops: Vec<Op> = ops.into_iter().map(|op| absolute(op, now)).collect();
                let want: Vec<Done> = ops.iter().map(|op| model.apply(op, now)).collect();
                // Each apply queues its write when first polled; join_all polls in order.
                let got = futures_util::future::join_all(
                    ops.iter().map(|op| store.apply(op.clone(), now)),
                )
                .await;
                let got: Vec<Done> = got.into_iter().map(Result::unwrap).collect();
                prop_assert_eq!(got, want, "step {} (batch)", i);
            }
            Step::Reopen => {
                store.close().await;
                store = Store::open(dir.path()).unwrap();
            }
            Step::Wait(ms) => now += ms,
        }
        agree(&store, &model, &format!("step {i}"))?;
    }
    store.close().await;
    let store = Store::open(dir.path()).unwrap();
    agree(&store, &model, "the final reopen")?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn the_store_agrees_with_a_model_across_restarts(steps in prop::collection::vec(step(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(run(steps))?;
    }
}

/// Compaction rewrites the log; a model comparison across it, with enough rewrites to trigger it.
#[test]
fn the_store_agrees_with_the_model_across_compaction() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 2,
        ..ProptestConfig::default()
    });
    let churn = prop::collection::vec(op(), 1_500..1_600).prop_map(|ops| {
        let mut steps: Vec<Step> = ops.chunks(300).map(|c| Step::Many(c.to_vec())).collect();
        steps.insert(steps.len() / 2, Step::Reopen);
        steps
    });
    runner.run(&churn, |steps| rt.block_on(run(steps))).unwrap();
}
