//! `cargo run --release --example overload`
//!
//! What retries and their budgets do to a service with a capacity when
//! something goes wrong: an outage, a brown-out, a capacity drop and a load
//! spike, under every budget, at 1 and 3 hops, with and without a
//! per-attempt timeout, all in one run. The model (16 workers, a FIFO queue,
//! calls at 65 % of capacity) is described in `tests/support/capacity.rs`.
//! Time is tokio's paused clock and the model's draws are seeded, so every
//! row sees the same arrivals; the layer's backoff jitter is its own, so a
//! run moves some figures in their last digit.
//!
//! The model is checked first: without retries the service recovers from the
//! capacity drop within a second or two, and with retries and attempt
//! timeouts but no budget it does not recover at all. The example stops if
//! either is not so.

use std::collections::HashMap;
use std::sync::Mutex;

use support::capacity::{self, Measured, Row, Scenario, Trigger};

#[path = "../tests/support/mod.rs"]
mod support;

/// The seed of every run.
const SEED: u64 = 2026;

/// What a scenario is found by.
type Key = (Row, Trigger, usize, bool);

fn main() {
    let mut scenarios = Vec::new();
    for trigger in Trigger::ALL {
        for attempt_timeout in [false, true] {
            for row in Row::ALL {
                for hops in [1, 3] {
                    scenarios.push(Scenario {
                        row,
                        trigger,
                        hops,
                        attempt_timeout,
                        seed: SEED,
                    });
                }
            }
        }
    }
    let results = run_all(&scenarios);
    let cell = |trigger: Trigger, row: Row, attempt_timeout: bool| {
        [1, 3].map(|hops| &results[&(row, trigger, hops, attempt_timeout)])
    };
    check_the_model(
        &results[&(Row::NoRetries, Trigger::CapacityDrop, 1, true)],
        &results[&(Row::NoBudget, Trigger::CapacityDrop, 3, true)],
    );
    let both = |f: &dyn Fn(&Measured) -> String, [one, three]: &[&Measured; 2]| {
        format!("{} / {}", f(one), f(three))
    };
    let onset = |m: &Measured| format!("{:.2}×", m.onset_peak);
    let attempts = |m: &Measured| {
        format!(
            "{:.2} ({:.2})",
            m.attempts_per_call, m.attempts_first_second
        )
    };
    let success = |m: &Measured| format!("{:.1} %", 100.0 * m.success);
    let recovery = |m: &Measured| match m.recovery {
        Some(d) => format!("{:.2} s", d.as_secs_f64()),
        None => format!("never (queue {}k)", m.max_queue / 1_000),
    };
    println!(
        "Each cell: 1 hop / 3 hops. Onset: attempts at the bottom per call offered, in the busiest\n\
         100 ms of the trigger's first second. Attempts: per call started during the trigger (in its\n\
         first second). Recovery: from the trigger's end until every later 50 ms of calls succeeds\n\
         as in health (within 5 %) and the queue is below the workers."
    );
    for attempt_timeout in [true, false] {
        let timeout = if attempt_timeout {
            "150 ms attempt timeout"
        } else {
            "no attempt timeout"
        };
        println!("\nFast failures, {timeout}\n");
        println!(
            "| row | outage: onset | attempts per call | brown-out: onset | attempts per call | success |"
        );
        println!("|---|---|---|---|---|---|");
        for row in Row::ALL {
            let outage = cell(Trigger::Outage, row, attempt_timeout);
            let brown = cell(Trigger::BrownOut, row, attempt_timeout);
            println!(
                "| {} | {} | {} | {} | {} | {} |",
                row.name(),
                both(&onset, &outage),
                both(&attempts, &outage),
                both(&onset, &brown),
                both(&attempts, &brown),
                both(&success, &brown),
            );
        }
        println!("\nOverload, {timeout}\n");
        println!(
            "| row | capacity drop: onset | attempts per call | success | recovery | load spike: onset | attempts per call | success | recovery |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        for row in Row::ALL {
            let drop = cell(Trigger::CapacityDrop, row, attempt_timeout);
            let spike = cell(Trigger::LoadSpike, row, attempt_timeout);
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                row.name(),
                both(&onset, &drop),
                both(&attempts, &drop),
                both(&success, &drop),
                both(&recovery, &drop),
                both(&onset, &spike),
                both(&attempts, &spike),
                both(&success, &spike),
                both(&recovery, &spike),
            );
        }
    }
}

/// The model's check, before any table: without retries the service
/// recovers from the capacity drop within a second or two (the queue the
/// drop leaves drains), and retries under attempt timeouts without a budget
/// keep it overloaded for good.
fn check_the_model(alone: &Measured, unbudgeted: &Measured) {
    let Some(recovery) = capacity::recovers_alone(alone) else {
        eprintln!("the model is wrong: without retries, the capacity drop gives {alone:?}");
        std::process::exit(1);
    };
    if unbudgeted.recovery.is_some() {
        eprintln!("the model is wrong: without a budget, the capacity drop gives {unbudgeted:?}");
        std::process::exit(1);
    }
    println!(
        "The model's check: without retries the service recovers from the capacity drop in \
         {:.2} s; retrying\nwithout a budget under 150 ms attempt timeouts, at 3 hops, it never \
         does (its queue grows to {}k).\n",
        recovery.as_secs_f64(),
        unbudgeted.max_queue / 1_000
    );
}

/// Runs every scenario, as many at a time as there are cores (each on a
/// paused runtime of its own).
fn run_all(scenarios: &[Scenario]) -> HashMap<Key, Measured> {
    let next = Mutex::new(scenarios.iter());
    let results = Mutex::new(HashMap::new());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let Some(&scenario) = next.lock().unwrap().next() else {
                        return;
                    };
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .start_paused(true)
                        .build()
                        .expect("a runtime");
                    let measured = runtime.block_on(capacity::run(scenario));
                    let key = (
                        scenario.row,
                        scenario.trigger,
                        scenario.hops,
                        scenario.attempt_timeout,
                    );
                    results.lock().unwrap().insert(key, measured);
                }
            });
        }
    });
    results.into_inner().unwrap()
}
