//! Instructions per call on the retry path, for `valgrind --tool=callgrind`,
//! as `--bench instructions` counts the happy path: every call fails once
//! with `UNAVAILABLE` and is retried at once (zero backoff). `STACK` is `b`
//! (tower's `Retry` + `TpsBudget`) or `c` (`RetryLayer`). A binary of its
//! own, so that `instructions` holds only the happy path's layers.
//!
//! ```text
//! cargo bench --bench instructions_retry --no-run
//! BIN=$(ls -t target/release/deps/instructions_retry-* | grep -v '\.d$' | head -1)
//! for n in 1000 11000; do
//!   STACK=c N=$n valgrind --tool=callgrind --callgrind-out-file=/dev/null $BIN 2>&1 | grep Collected
//! done   # (second - first) / 10000 = instructions per call, both attempts
//! ```

mod common;

use common::*;

fn main() {
    run_stack(|stack, n| async move {
        let payload = &SMALL[..];
        match stack.as_str() {
            "b" => timed(tower_retry(inner_fails_once()), n, payload).await,
            "c" => timed(layered(inner_fails_once(), zero_backoff()), n, payload).await,
            other => panic!("STACK must be b or c, not {other:?}"),
        }
    });
}
