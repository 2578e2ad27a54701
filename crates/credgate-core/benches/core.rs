//! Criterion benches for the core's hot path: parsing a reference and matching patterns.

use credgate_core::pattern::{Pattern, Target};
use credgate_core::reference::ImageRef;
use criterion::{black_box, criterion_group, criterion_main, Criterion};

fn bench(c: &mut Criterion) {
    c.bench_function("reference/canonical", |b| {
        b.iter(|| {
            ImageRef::parse(black_box("registry.example.com/team/app-0:v1"))
                .unwrap()
                .name()
                .len()
        })
    });
    c.bench_function("reference/familiar", |b| {
        b.iter(|| {
            ImageRef::parse(black_box("nginx:1.25"))
                .unwrap()
                .name()
                .len()
        })
    });
    let literal = Pattern::parse("registry.example.com").unwrap();
    let glob = Pattern::parse("*.dkr.ecr.*.amazonaws.com").unwrap();
    let target_name = "123456789012.dkr.ecr.us-east-1.amazonaws.com/team/app";
    c.bench_function("match/literal", |b| {
        b.iter(|| {
            literal.matches(&Target::from_image_name(black_box(
                "registry.example.com/team/app-0",
            )))
        })
    });
    c.bench_function("match/glob", |b| {
        b.iter(|| glob.matches(&Target::from_image_name(black_box(target_name))))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
