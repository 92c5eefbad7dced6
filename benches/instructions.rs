//! Instructions per call, for `valgrind --tool=callgrind`: on a shared,
//! virtualised machine wall-clock timings move by ±15 % from run to run, while
//! callgrind's instruction counts repeat exactly. It runs `N` calls (default
//! 10,000) of one stack, chosen by `STACK`: `a` (no layer), `b` (tower's
//! `Retry` + `TpsBudget`), `c` (`RetryLayer`), `c-outcome` (`c` paid from
//! `OutcomeBudget` rather than `RetryBudget`), `c-no-key`, `c-no-report`
//! (no idempotency key, and no instance ids learnt, so no balancer's report
//! slot on the attempt), `c-per-method` (per-method policies: 8 services, 33
//! methods), `c-deadline` (`c` with a total timeout of 10 s, so every
//! attempt carries `grpc-timeout`), `c-clone` (`c` cloned for each call and the clone called with
//! `oneshot`, as tonic's generated clients are cloned for each call, and as
//! `b` clones tower's `Retry` for each); the same stacks and
//! request as `--bench overhead`. (`c` recording gRPC's standard metrics is
//! `--bench instructions_otel`: a metered layer in this binary would be a
//! second copy of the call path, and change what the compiler inlines in
//! the first.) The cost of one call is the difference
//! between two runs, which cancels start-up:
//!
//! ```text
//! cargo bench --bench instructions --no-run
//! BIN=$(ls -t target/release/deps/instructions-* | grep -v '\.d$' | head -1)
//! for n in 1000 11000; do
//!   STACK=c N=$n valgrind --tool=callgrind --callgrind-out-file=/dev/null $BIN 2>&1 | grep Collected
//! done   # (second - first) / 10000 = instructions per call
//! ```

mod common;

use common::*;
use std::time::Duration;

use tonic_retry::RetryPolicy;
use tower::ServiceExt;

fn main() {
    run_stack(|stack, n| async move {
        let payload = &SMALL[..];
        match stack.as_str() {
            "a" => timed(inner_ok(), n, payload).await,
            "b" => timed(tower_retry(inner_ok()), n, payload).await,
            "c" => timed(layered(inner_ok(), RetryPolicy::default()), n, payload).await,
            "c-no-key" => {
                let policy = RetryPolicy::default().with_idempotency_key(false);
                timed(layered(inner_ok(), policy), n, payload).await
            }
            "c-no-report" => {
                let policy = RetryPolicy::default()
                    .with_idempotency_key(false)
                    .with_instance_header(None);
                timed(layered(inner_ok(), policy), n, payload).await
            }
            "c-outcome" => {
                timed(
                    layered_outcome(inner_ok(), RetryPolicy::default()),
                    n,
                    payload,
                )
                .await
            }
            "c-per-method" => timed(layered_per_method(inner_ok()), n, payload).await,
            "c-deadline" => {
                let policy = RetryPolicy::default().with_total_timeout(Duration::from_secs(10));
                timed(layered(inner_ok(), policy), n, payload).await
            }
            "c-clone" => {
                let svc = layered(inner_ok(), RetryPolicy::default());
                let each = tower::service_fn(move |req| svc.clone().oneshot(req));
                timed(each, n, payload).await
            }
            other => panic!(
                "STACK must be a, b, c, c-outcome, c-no-key, c-no-report, c-per-method, c-deadline or c-clone (c-otel is --bench instructions_otel), not {other:?}"
            ),
        }
    });
}
