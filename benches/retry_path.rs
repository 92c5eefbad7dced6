//! A call that fails once with UNAVAILABLE and then succeeds, with zero
//! backoff, so the retry mechanism is timed rather than a sleep: (b) tower's
//! `Retry` with a body-buffering policy and `Arc<TpsBudget>` vs (c) `RetryLayer`.

mod common;

use common::*;
use criterion::{Criterion, criterion_group, criterion_main};

fn retry_path(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    let mut group = c.benchmark_group("retry_path");
    let b_svc = tower_retry(inner_fails_once());
    group.bench_function("b_tower_retry", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| timed(b_svc.clone(), iters, &SMALL))
    });
    let c_svc = layered(inner_fails_once(), zero_backoff());
    group.bench_function("c_retry_layer", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| timed(c_svc.clone(), iters, &SMALL))
    });
    group.finish();
}

criterion_group!(benches, retry_path);
criterion_main!(benches);
