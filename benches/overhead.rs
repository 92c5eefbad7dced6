//! The happy path: one unary call through (a) no layer, (b) tower's `Retry`
//! with a body-buffering policy and `Arc<TpsBudget>`, (c) `RetryLayer`, over
//! an in-memory service that answers OK. Also with a 16 KiB body and with key
//! generation off.

mod common;

use common::*;
use criterion::{Criterion, criterion_group, criterion_main};
use tonic_retry::RetryPolicy;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime")
}

macro_rules! bench_stack {
    ($group:expr, $rt:expr, $name:expr, $svc:expr, $payload:expr) => {{
        let svc = $svc;
        $group.bench_function($name, |b| {
            b.to_async(&$rt)
                .iter_custom(|iters| timed(svc.clone(), iters, $payload))
        });
    }};
}

fn overhead(c: &mut Criterion) {
    let rt = runtime();
    for (label, payload) in [("16 B", &SMALL[..]), ("16 KiB", &LARGE[..])] {
        let mut group = c.benchmark_group(format!("overhead/{label}"));
        bench_stack!(group, rt, "a_no_layer", inner_ok(), payload);
        bench_stack!(group, rt, "b_tower_retry", tower_retry(inner_ok()), payload);
        bench_stack!(
            group,
            rt,
            "c_retry_layer",
            layered(inner_ok(), RetryPolicy::default()),
            payload
        );
        bench_stack!(
            group,
            rt,
            "c_retry_layer_per_method",
            layered_per_method(inner_ok()),
            payload
        );
        bench_stack!(
            group,
            rt,
            "c_retry_layer_no_key",
            layered(
                inner_ok(),
                RetryPolicy::default().with_idempotency_key(false)
            ),
            payload
        );
        group.finish();
    }
}

criterion_group!(benches, overhead);
criterion_main!(benches);
