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
//! whose names contain one of the words given (`outcome`, `envoy`, `budget`, ...).

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
    let cell = |trigger: Trigger, row: Row, attempt_timeout: bool| {
        [1, 3].map(|hops| {
            find(&Scenario {
                row,
                trigger,
                hops,
                attempt_timeout,
                seed: SEED,
            })
            .clone()
        })
    };
    let both = |f: &dyn Fn(&Measured) -> String, [one, three]: &[Measured; 2]| {
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
        None => format!("never ({}k queued)", m.max_queue / 1_000),
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
        for &row in &rows {
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
        for &row in &rows {
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
