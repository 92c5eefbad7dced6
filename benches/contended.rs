//! Both cores at once: the happy path of each stack, (a) no layer, (b) tower's
//! `Retry` with `Arc<TpsBudget>`, (c) `RetryLayer` (with `RetryBudget`, and
//! with `OutcomeBudget`), driven by one thread, then
//! by two threads at once through clones of the same service (so one budget,
//! one set of counters, one replay-memory account), each thread on a runtime
//! of its own. The time is per call on each thread: with nothing shared
//! written on every call, two threads take as long per call as one does; a
//! cache line written by both on every call (a shared counter, a lock) makes
//! each call slower with two.
//!
//! `cargo bench --bench contended`

mod common;

use std::time::Duration;

use common::*;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{Request, Response};
use tonic::body::Body;
use tonic_retry::RetryPolicy;
use tower::{BoxError, Service};

/// `iters` calls on each of `threads` threads at once, through clones of
/// `svc`; the longest any thread took.
fn on_threads<S, R>(svc: &S, threads: usize, iters: u64) -> Duration
where
    S: Service<Request<Body>, Response = Response<R>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
    R: http_body::Body + Send + 'static,
    R::Error: std::fmt::Debug,
{
    let start = std::sync::Barrier::new(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let svc = svc.clone();
                let start = &start;
                scope.spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .build()
                        .expect("a runtime");
                    start.wait();
                    rt.block_on(timed(svc, iters, &SMALL))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a bench thread"))
            .max()
            .unwrap_or_default()
    })
}

macro_rules! bench_stack {
    ($c:expr, $name:expr, $svc:expr) => {{
        let svc = $svc;
        let mut group = $c.benchmark_group(format!("contended/{}", $name));
        for threads in [1, 2] {
            group.bench_function(format!("{threads} thread(s)"), |b| {
                b.iter_custom(|iters| on_threads(&svc, threads, iters))
            });
        }
        group.finish();
    }};
}

fn contended(c: &mut Criterion) {
    bench_stack!(c, "a_no_layer", inner_ok());
    bench_stack!(c, "b_tower_retry", tower_retry(inner_ok()));
    bench_stack!(
        c,
        "c_retry_layer",
        layered(inner_ok(), RetryPolicy::default())
    );
    bench_stack!(
        c,
        "c_outcome_budget",
        layered_outcome(inner_ok(), RetryPolicy::default())
    );
}

criterion_group!(benches, contended);
criterion_main!(benches);
