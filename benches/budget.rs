//! Budget operations: `RetryBudget` (one atomic account) against tower's
//! `TpsBudget`, a withdraw and a deposit per iteration, on one thread and with
//! a second thread hammering the same budget on the other core.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use tonic_retry::RetryBudget;
use tower::retry::budget::{Budget, TpsBudget};

fn pair<B: Budget>(budget: &B) {
    budget.deposit();
    black_box(budget.withdraw());
}

/// Times `iters` deposit+withdraw pairs while another thread does the same.
fn contended<B: Budget + Send + Sync + 'static>(budget: Arc<B>, iters: u64) -> Duration {
    let stop = Arc::new(AtomicBool::new(false));
    let rival = {
        let (budget, stop) = (budget.clone(), stop.clone());
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                pair(&*budget);
            }
        })
    };
    let start = Instant::now();
    for _ in 0..iters {
        pair(&*budget);
    }
    let took = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    rival.join().expect("the rival thread");
    took
}

fn budgets(c: &mut Criterion) {
    // The reference settings: 200 tokens, 0.1 per success; tower's budget
    // with the same 10 % over a 10 s window.
    let ours = || RetryBudget::new(200, 0.1).expect("a valid budget");
    let towers = || TpsBudget::new(Duration::from_secs(10), 10, 0.1);

    let mut group = c.benchmark_group("budget/single");
    let b = ours();
    group.bench_function("RetryBudget", |bench| bench.iter(|| pair(&b)));
    let t = towers();
    group.bench_function("TpsBudget", |bench| bench.iter(|| pair(&t)));
    group.finish();

    let mut group = c.benchmark_group("budget/contended");
    let b = Arc::new(ours());
    group.bench_function("RetryBudget", |bench| {
        bench.iter_custom(|iters| contended(b.clone(), iters))
    });
    let t = Arc::new(towers());
    group.bench_function("TpsBudget", |bench| {
        bench.iter_custom(|iters| contended(t.clone(), iters))
    });
    group.finish();
}

criterion_group!(benches, budgets);
criterion_main!(benches);
