//! Every retry is paid for from the budget, whatever `Budget` it is, and a
//! call dropped or refused spends nothing. `tower-test` mocks under paused
//! time.

use crate::support::{bounded_paused, policy, *};
use http::{Request, Response};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tower::retry::budget::TpsBudget;
use tower::{Layer, Service, ServiceExt};
use tower_test::mock;

#[tokio::test(start_paused = true)]
async fn an_empty_budget_stops_retries() {
    // Two tokens at most, so one to start with.
    let budget = RetryBudget::new(2, 0.1).unwrap();
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget);
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::ResourceExhausted);
    let message = message_of(&response);
    assert!(message.contains("retry budget exhausted"), "{message}");
    assert!(message.contains("UNAVAILABLE"), "{message}");
    assert_eq!(layer.metrics().refused_by_budget(), 1);
    assert_eq!(layer.budget().available(), 0.0);
}

#[tokio::test(start_paused = true)]
async fn successes_refill_the_budget() {
    let budget = RetryBudget::new(2, 0.5).unwrap();
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget);
    for _ in 0..2 {
        let call = spawn_call(&mut svc, request()).await;
        let (_, send, _) = next(&mut handle).await;
        send.send_response(answer(Code::Ok));
        let response = call.await.unwrap().unwrap();
        assert_eq!(read_to_end(response).await, Code::Ok);
    }
    assert_eq!(layer.budget().available(), 2.0);
}

/// Only a call that ends with OK is a success: a committed response is
/// credited when its trailers say OK, not when its headers arrive.
#[tokio::test(start_paused = true)]
async fn only_calls_that_end_ok_refill_the_budget() {
    let budget = RetryBudget::new(10, 1.0).unwrap();
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget);
    let start = layer.budget().available();
    let mut call_answered = async |answer: Response<Body>| {
        let call = spawn_call(&mut svc, with_timeout(request(), "1S")).await;
        let (_, send, _) = next(&mut handle).await;
        send.send_response(answer);
        call.await.unwrap().unwrap()
    };

    // Committed, then failed in its trailers: no success.
    let response = call_answered(answer(Code::Unavailable)).await;
    assert_eq!(code_of(&response), Code::Ok, "committed");
    assert_eq!(read_to_end(response).await, Code::Unavailable);
    assert_eq!(layer.budget().available(), start);

    // Committed and dropped unread, or cut at the deadline: no success.
    drop(call_answered(answer(Code::Ok)).await);
    assert_eq!(layer.budget().available(), start);
    let (tx, stalled) = streaming_response();
    let response = call_answered(stalled).await;
    assert_eq!(read_to_end(response).await, Code::DeadlineExceeded);
    drop(tx);
    assert_eq!(layer.budget().available(), start);

    // Committed, headers read, then OK in its trailers: credited then.
    let response = call_answered(answer(Code::Ok)).await;
    assert_eq!(layer.budget().available(), start, "not at the headers");
    assert_eq!(read_to_end(response).await, Code::Ok);
    assert_eq!(layer.budget().available(), start + 1.0);

    // Trailers-Only OK: credited at once.
    let response = call_answered(status(Code::Ok)).await;
    assert_eq!(layer.budget().available(), start + 2.0);
    assert_eq!(read_to_end(response).await, Code::Ok);
    assert_eq!(layer.budget().available(), start + 2.0, "once");
}

#[tokio::test(start_paused = true)]
async fn any_tower_budget_can_pay_for_retries() {
    use tower::retry::budget::TpsBudget;
    // No reserve, no earnings: tower's budget refuses every retry.
    let none =
        tonic_retry::budgets::TowerBudget::new(TpsBudget::new(Duration::from_secs(10), 0, 0.0));
    let layer = RetryLayer::with_budget(RetryPolicy::default(), none);
    let (inner, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::ResourceExhausted);
    assert_eq!(layer.metrics().refused_by_budget(), 1);

    // A generous one lets the retry through.
    let plenty =
        tonic_retry::budgets::TowerBudget::new(TpsBudget::new(Duration::from_secs(10), 100, 0.5));
    let layer = RetryLayer::with_budget(RetryPolicy::default(), plenty);
    let (inner, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(status(Code::Unavailable));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

/// A budget of the user's own is asked what the crate's are: charged for each
/// retryable failure, asked whether it is empty before the backoff, and
/// whether its refusal keeps the failure's own status.
#[tokio::test(start_paused = true)]
async fn a_budget_of_ones_own_is_asked_as_the_crates_are() {
    use std::sync::atomic::AtomicU32;
    #[derive(Default)]
    struct Strict {
        failures: AtomicU32,
        withdrawals: AtomicU32,
    }
    impl tonic_retry::budgets::Budget for Strict {
        fn deposit(&self) {}
        fn withdraw(&self) -> bool {
            self.withdrawals.fetch_add(1, Ordering::SeqCst);
            true
        }
        fn on_retryable_failure(&self) {
            self.failures.fetch_add(1, Ordering::SeqCst);
        }
        fn is_known_empty(&self) -> bool {
            self.failures.load(Ordering::SeqCst) >= 2
        }
        fn refusal_keeps_status(&self) -> bool {
            true
        }
        fn balance(&self) -> Option<f64> {
            Some(7.0)
        }
    }
    let layer = RetryLayer::with_budget(RetryPolicy::default(), Strict::default());
    let (inner, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    // Failure 1: charged, not empty yet, so retried (one withdrawal).
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(status(Code::Unavailable));
    // Failure 2: charged, now known empty: refused before any backoff,
    // ending with the failure's own status.
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_eq!(layer.budget().failures.load(Ordering::SeqCst), 2);
    assert_eq!(layer.budget().withdrawals.load(Ordering::SeqCst), 1);
    assert_eq!(layer.metrics().refused_by_budget(), 1);
    assert!(handle.next_request().now_or_never().is_none());
}

#[tokio::test(start_paused = true)]
async fn a_budget_emptied_during_the_backoff_refuses_when_the_retry_is_sent() {
    let budget = tonic_retry::RetryBudget::new(2, 0.1).unwrap(); // one token
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget.clone());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    // Another call takes the only token while this one waits.
    tokio::time::sleep(MS).await;
    assert!(budget.try_withdraw());
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::ResourceExhausted);
    assert!(message_of(&response).contains("attempt 1 ended with UNAVAILABLE"));
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.metrics().refused_by_budget(), 1);
    assert!(handle.next_request().now_or_never().is_none());
}

// ---------------------------------------------------------------------------
// Attempts refused before they were sent, the live attempt's replay, timers
// below a millisecond, the balancer through the layer
// ---------------------------------------------------------------------------

/// tower's own budget with no reserve and no deposits: every `withdraw` is
/// refused, and the layer only learns it when a retry is sent.
fn empty_tps() -> tonic_retry::budgets::TowerBudget<TpsBudget> {
    tonic_retry::budgets::TowerBudget::new(TpsBudget::new(Duration::from_secs(10), 0, 0.0))
}

#[tokio::test(start_paused = true)]
async fn budget_shared_only_one_of_many_pays() {
    let b = RetryBudget::new(2, 0.1).unwrap(); // one token
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), b.clone());
    let mut calls = Vec::new();
    for _ in 0..5 {
        calls.push(spawn_call(&mut svc, request()).await);
    }
    for _ in 0..5 {
        let (_, send, _) = next(&mut handle).await;
        send.send_response(status(Code::Unavailable));
    }
    let (_, send, _) = next(&mut handle).await;
    send.send_response(ok());
    let mut codes = Vec::new();
    for c in calls {
        codes.push(code_of(&bounded_paused(c).await.unwrap().unwrap()));
    }
    assert_eq!(layer.metrics().retries(), 1);
    assert_eq!(layer.metrics().refused_by_budget(), 4);
    assert_eq!(codes.iter().filter(|c| **c == Code::Ok).count(), 1);
    assert!(handle.next_request().now_or_never().is_none());
}

/// The first attempt is cut before it was sent: no server failed, so the
/// attempt after it is no retry — sent without a token, even from a budget
/// that refuses every withdrawal.
#[tokio::test(start_paused = true)]
async fn an_attempt_after_an_unsent_first_attempt_is_no_retry_and_costs_no_token() {
    let layer = RetryLayer::with_budget(policy(3).with_attempt_timeout(100 * MS), empty_tps());
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    handle.allow(0);
    let mut svc = layer.layer(inner);
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    // The first attempt is cut unsent at 100 ms; the next waits 16..24 ms.
    tokio::time::sleep(110 * MS).await;
    handle.allow(1);
    let (req, send, _) = next(&mut handle).await;
    assert!(
        !req.headers().contains_key("grpc-previous-rpc-attempts"),
        "no attempt was sent before this one"
    );
    send.send_response(ok());
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
    assert_eq!(layer.metrics().attempts(), 1);
    assert_eq!(layer.metrics().retries(), 0, "no retry was paid for");
}

/// Attempt 1 is sent and fails UNAVAILABLE; attempt 2 is cut before it is
/// sent; attempt 3 is refused by the budget at send time. The message names
/// attempt 1, the last one sent, not attempt 2, which never was.
#[tokio::test(start_paused = true)]
async fn no_budget_at_send_names_the_last_attempt_sent() {
    let layer = RetryLayer::with_budget(policy(3).with_attempt_timeout(100 * MS), empty_tps());
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    let (_, send, t0) = next(&mut handle).await;
    handle.allow(0);
    send.send_response(status(Code::Unavailable));
    // Attempt 2 starts at 16..24 ms, waits for readiness and is cut unsent at
    // 116..124 ms; attempt 3 starts 32..48 ms later (148..172 ms).
    tokio::time::sleep_until(t0 + 135 * MS).await;
    handle.allow(1);
    let response = bounded_paused(call).await.unwrap().unwrap();
    let message = message_of(&response);
    assert_eq!(code_of(&response), Code::ResourceExhausted, "{message}");
    assert_eq!(layer.metrics().attempts(), 1, "only attempt 1 was sent");
    assert!(
        message.contains("attempt 1 ended with UNAVAILABLE"),
        "the last attempt sent was attempt 1; the caller reads: {message:?}"
    );
}

/// `OutcomeBudget` charges only the retries that fail: a retry the call
/// succeeds with, whether its status came in the headers or in the trailers
/// of a committed response, gives its token back; a first attempt's success
/// only deposits.
#[tokio::test(start_paused = true)]
async fn outcome_budget_charges_only_failed_retries() {
    use tonic_retry::OutcomeBudget;
    // Each answer: in the trailers of a committed response, or Trailers-Only.
    const FAILED: (bool, Code) = (false, Code::Unavailable);
    let budget = OutcomeBudget::new(10, 0.1).unwrap();
    let layer = RetryLayer::with_budget(RetryPolicy::default(), budget);
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let mut call = async |answers: &[(bool, Code)]| {
        let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
        for &(committed, code) in answers {
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(if committed {
                answer(code)
            } else {
                status(code)
            });
        }
        read_to_end(call.await.unwrap().unwrap()).await
    };
    // Three failures: two retries, both spent.
    assert_eq!(call(&[FAILED, FAILED, FAILED]).await, Code::Unavailable);
    assert_eq!(layer.budget().available(), 8.0);
    // A retry that succeeds in its trailers: 0.1 deposited, its token back.
    assert_eq!(call(&[FAILED, (true, Code::Ok)]).await, Code::Ok);
    assert_eq!(layer.budget().available(), 8.1);
    // A retry that succeeds in its headers: the same.
    assert_eq!(call(&[FAILED, (false, Code::Ok)]).await, Code::Ok);
    assert_eq!(layer.budget().available(), 8.2);
    // A first attempt's success: the deposit alone.
    assert_eq!(call(&[(true, Code::Ok)]).await, Code::Ok);
    assert_eq!(layer.budget().available(), 8.3);
    // A retry whose committed response then fails in its trailers: spent.
    let failed_late = [FAILED, (true, Code::Unavailable)];
    assert_eq!(call(&failed_late).await, Code::Unavailable);
    assert_eq!(layer.budget().available(), 7.3);
}
