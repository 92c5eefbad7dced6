//! `cargo run --release --example overload`
//!
//! What retries and their budgets do to a service with a capacity when
//! something goes wrong: an outage, a brown-out, a capacity drop and a load
//! spike, each under every budget, at 1 and 3 hops, with and without a
//! per-attempt timeout. The model (16 workers, a FIFO queue, calls at 65 % of
//! capacity) is described in `tests/support/capacity.rs`; time is tokio's
//! paused clock and every draw is seeded, so the tables are the same on any
//! machine.
//!
//! `cargo run --release --example overload -- ROW...` runs only the rows
//! whose names contain one of the words given (`outcome`, `none`, ...).

use std::sync::Mutex;

use capacity::{Measured, Row, Scenario, Trigger};

#[path = "../tests/support/capacity.rs"]
#[allow(dead_code)]
mod capacity;

/// The seed of every run.
const SEED: u64 = 2026;

fn main() {
    let words: Vec<String> = std::env::args().skip(1).map(|w| w.to_lowercase()).collect();
    let rows: Vec<Row> = Row::ALL
        .into_iter()
        .filter(|row| {
            words.is_empty()
                || words
                    .iter()
                    .any(|w| row.name().to_lowercase().contains(w.as_str()))
        })
        .collect();
    let mut scenarios = Vec::new();
    for trigger in Trigger::ALL {
        for attempt_timeout in [false, true] {
            for &row in &rows {
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
    let find = |s: &Scenario| -> &Measured {
        let i = scenarios
            .iter()
            .position(|o| {
                o.row == s.row
                    && o.trigger == s.trigger
                    && o.hops == s.hops
                    && o.attempt_timeout == s.attempt_timeout
            })
            .expect("every scenario was run");
        &results[i]
    };
    println!(
        "Each cell: 1 hop / 3 hops. Onset: the busiest 100 ms of the trigger's first second,\n\
         against health. Attempts per call at the bottom, for calls started during the trigger\n\
         (in its first second). Recovery: from the trigger's end until goodput is back and\n\
         the queue is below the workers."
    );
    for trigger in Trigger::ALL {
        for attempt_timeout in [false, true] {
            println!(
                "\n{}, {}\n",
                trigger.name(),
                if attempt_timeout {
                    "150 ms attempt timeout"
                } else {
                    "no attempt timeout"
                }
            );
            println!(
                "| row | onset peak | attempts per call (first s) | success | recovery | longest queue |"
            );
            println!("|---|---|---|---|---|---|");
            for &row in &rows {
                let [one, three] = [1, 3].map(|hops| {
                    find(&Scenario {
                        row,
                        trigger,
                        hops,
                        attempt_timeout,
                        seed: SEED,
                    })
                });
                let recovery = |m: &Measured| match m.recovery {
                    Some(d) => format!("{:.2} s", d.as_secs_f64()),
                    None => "never".to_string(),
                };
                println!(
                    "| {} | {:.2}× / {:.2}× | {:.2} ({:.2}) / {:.2} ({:.2}) | {:.1} % / {:.1} % | {} / {} | {} / {} |",
                    row.name(),
                    one.onset_peak,
                    three.onset_peak,
                    one.attempts_per_call,
                    one.attempts_first_second,
                    three.attempts_per_call,
                    three.attempts_first_second,
                    100.0 * one.success,
                    100.0 * three.success,
                    recovery(one),
                    recovery(three),
                    one.max_queue,
                    three.max_queue,
                );
            }
        }
    }
}

/// Runs every scenario, two at a time (each on its own paused runtime).
fn run_all(scenarios: &[Scenario]) -> Vec<Measured> {
    let next = Mutex::new(0..scenarios.len());
    let results = Mutex::new(vec![None; scenarios.len()]);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let Some(i) = next.lock().unwrap().next() else {
                        return;
                    };
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .start_paused(true)
                        .build()
                        .expect("a runtime");
                    let measured = runtime.block_on(capacity::run(scenarios[i]));
                    eprintln!("{:?}: {measured:?}", scenarios[i]);
                    results.lock().unwrap()[i] = Some(measured);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|m| m.expect("every scenario was run"))
        .collect()
}
