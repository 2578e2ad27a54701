//! Criterion benches for a cache hit through the engine: the zero-copy `lookup_cached` and the
//! owned `lookup`, on an engine warmed by one plugin run of a fake runner.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use credgate_core::config::ProviderConfig;
use credgate_engine::exec::{BoxFuture, PluginCommand, PluginRunner, RunError};
use credgate_engine::{Engine, LookupRequest};
use criterion::{black_box, criterion_group, criterion_main, Criterion};

struct Static;

impl PluginRunner for Static {
    fn run<'a>(
        &'a self,
        _: &'a PluginCommand,
        _: Vec<u8>,
    ) -> BoxFuture<'a, Result<Vec<u8>, RunError>> {
        Box::pin(async {
            Ok(br#"{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Registry","cacheDuration":"1h","auth":{"registry.example.com":{"username":"u","password":"p"}}}"#.to_vec())
        })
    }
}

const CONFIG: &str = "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: p\n  matchImages: [registry.example.com]\n  defaultCacheDuration: 10m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n";

fn poll_once<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("a cache hit never waits"),
    }
}

fn bench(c: &mut Criterion) {
    let config = ProviderConfig::from_slice("bench.yaml", CONFIG.as_bytes()).unwrap();
    let engine = Engine::builder()
        .config(config)
        .runner(Arc::new(Static))
        .build()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let req = LookupRequest {
        image: "registry.example.com/team/app-0:v1",
        ..Default::default()
    };
    rt.block_on(engine.lookup(&req)).unwrap();
    c.bench_function("hit/lookup_cached", |b| {
        b.iter(|| engine.lookup_cached(black_box(&req), |c| c.len()).unwrap())
    });
    c.bench_function("hit/lookup_owned", |b| {
        b.iter(|| {
            poll_once(engine.lookup(black_box(&req)))
                .unwrap()
                .credentials
                .len()
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
