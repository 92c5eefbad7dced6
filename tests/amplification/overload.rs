//! Retrying stays at one layer under attempt timeouts, in a service with a
//! capacity (the model in `tests/support/capacity.rs`): three retrying
//! layers stacked in process (each reads the deadline and the attempt's end
//! the layer above sent), every one with a 150 ms attempt timeout and no
//! budget, over a bottom of 16 workers and a FIFO queue that serves every
//! request, even one whose caller has gone. Calls arrive at 65 % of
//! capacity; for 2 s the capacity drops to 5 workers, the queue grows and
//! every hop's attempts time out. However many layers cut their attempts, the
//! bottom sees no more attempts per call than one layer makes; and without a
//! budget those attempts keep the service overloaded after the drop.

use crate::support::capacity::{self, RATE, Row, Scenario, Trigger};

#[tokio::test(start_paused = true)]
async fn three_layers_with_attempt_timeouts_send_one_layers_attempts_in_an_overload() {
    let run = |hops| {
        capacity::run(Scenario {
            row: Row::NoBudget,
            trigger: Trigger::CapacityDrop,
            hops,
            attempt_timeout: true,
            seed: 2026,
        })
    };
    let one = run(1).await;
    let three = run(3).await;
    // The model's load is as stated: 2 s of calls at `RATE`, within 5 %.
    let expected = RATE * Trigger::CapacityDrop.duration().as_secs_f64();
    for m in [&one, &three] {
        let calls = m.calls as f64;
        assert!(
            (calls - expected).abs() < 0.05 * expected,
            "{calls} calls during the drop, {expected:.0} expected"
        );
    }
    let (one_attempts, three_attempts) = (one.attempts_per_call, three.attempts_per_call);
    eprintln!(
        "attempts per call at the bottom: 1 layer {one_attempts:.2}, 3 layers {three_attempts:.2}"
    );
    // The model's check: the drop overloads the bottom enough that one
    // layer retries (its calls' first attempts time out).
    assert!(
        one_attempts > 1.5,
        "one layer: {one_attempts:.2} attempts per call"
    );
    assert!(
        three_attempts <= 3.0,
        "three layers: {three_attempts:.2} attempts per call at the bottom (one layer: {one_attempts:.2})"
    );
    // Without a budget, the retries keep the service overloaded for good.
    assert_eq!(one.recovery, None, "recovered: {one:?}");
    assert_eq!(three.recovery, None, "recovered: {three:?}");
}
