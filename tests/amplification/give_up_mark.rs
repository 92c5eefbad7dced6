//! Retry at one layer: a layer that gives up on a retryable failure
//! after retrying, or because its budget or the deadline refused a retry,
//! marks the failure "do not retry" (`grpc-retry-pushback-ms: -1`) for the
//! layers above; a failure it did not retry is not marked; a layer that gets a
//! marked failure passes it up unretried. `tower-test` mocks under paused time.

use bytes::Bytes;
use http::{HeaderValue, Response};
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{
    RetryBudget, RetryLayer, RetryPolicy, budgets::RetryThrottle, marks::RetryMarkExt,
};

use crate::support::*;

fn mark_of<B>(r: &Response<B>) -> Option<&str> {
    r.headers()
        .get("grpc-retry-pushback-ms")
        .map(|v| v.to_str().unwrap())
}

fn marked(code: Code) -> Response<Body> {
    let mut r = status(code);
    r.headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("-1"));
    r
}

#[tokio::test(start_paused = true)]
async fn giving_up_after_retrying_marks_the_failure() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let response = unavailable_every_time(&mut svc, &mut handle, 3).await;
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_eq!(
        message_of(&response),
        "from the server",
        "the server's answer"
    );
    assert_eq!(mark_of(&response), Some("-1"));
    assert!(
        tonic::Status::from_header_map(response.headers())
            .unwrap()
            .retried_below(),
        "a tonic client sees the mark in the status metadata"
    );
    assert_eq!(layer.metrics().marked(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_mark_replaces_a_servers_pushback() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::new(2, MS, MS, 0.0).unwrap(), budget());
    let call = spawn_call(&mut svc, request()).await;
    for _ in 0..2 {
        let (_, send, _) = next(&mut handle).await;
        let mut r = status(Code::Unavailable);
        r.headers_mut()
            .insert("grpc-retry-pushback-ms", HeaderValue::from_static("5"));
        send.send_response(r);
    }
    let response = call.await.unwrap().unwrap();
    let values: Vec<_> = response
        .headers()
        .get_all("grpc-retry-pushback-ms")
        .iter()
        .collect();
    assert_eq!(values, ["-1"], "one value: the mark");
}

#[tokio::test(start_paused = true)]
async fn attempts_that_found_no_server_are_marked_too() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    for _ in 0..3 {
        let (_, send, _) = next(&mut handle).await;
        send.send_error("connection refused");
    }
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_eq!(mark_of(&response), Some("-1"));
}

#[tokio::test(start_paused = true)]
async fn refusals_by_the_budget_or_the_deadline_are_marked() {
    // Budget: nothing to pay a retry with.
    let empty = RetryBudget::new(1, 0.1).unwrap(); // half a token
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), empty);
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::ResourceExhausted);
    assert_eq!(mark_of(&response), Some("-1"));
    assert_eq!(layer.metrics().refused_by_budget(), 1);

    // Deadline: no room for the backoff and another attempt.
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "30m")).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(mark_of(&response), Some("-1"));
    assert_eq!(layer.metrics().refused_by_deadline(), 1);
}

#[tokio::test(start_paused = true)]
async fn failures_this_layer_did_not_retry_are_not_marked() {
    // One attempt allowed.
    let (mut svc, mut handle, layer) = setup(RetryPolicy::new(1, MS, MS, 0.0).unwrap(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert_eq!(mark_of(&response), None, "max_attempts 1");
    assert_eq!(layer.metrics().marked(), 0);

    // A final code.
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::NotFound));
    let response = call.await.unwrap().unwrap();
    assert_eq!(mark_of(&response), None, "a final code");

    // A body that cannot be replayed.
    let policy = RetryPolicy::default().with_replay_limit(4);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let mut req = request();
    *req.body_mut() = Body::new(http_body_util::Full::new(Bytes::from_static(
        b"far more than four bytes",
    )));
    let call = spawn_call(&mut svc, req).await;
    // The attempt reads the body, so no copy is left to send again.
    let (req, send, _) = next(&mut handle).await;
    http_body_util::BodyExt::collect(req.into_body())
        .await
        .unwrap();
    send.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert_eq!(mark_of(&response), None, "a body that cannot be replayed");
}

/// A call whose first attempt could not be sent before the deadline (the
/// service below never ready, or no time at all) retried nothing and was
/// refused no retry: not marked, not counted as a deadline refusal, whatever
/// attempts the policy allows.
#[tokio::test(start_paused = true)]
async fn a_call_never_sent_is_not_marked() {
    for policy in [RetryPolicy::no_retry(), RetryPolicy::default()] {
        let attempts = policy.max_attempts();
        // The service below is never ready before the 50 ms deadline.
        let (mut svc, mut handle, layer) = setup(policy.clone(), budget());
        handle.allow(0);
        let call = spawn_call(&mut svc, with_timeout(request(), "50m")).await;
        let response = call.await.unwrap().unwrap();
        assert_eq!(code_of(&response), Code::DeadlineExceeded);
        assert_eq!(
            message_of(&response),
            "call deadline exceeded before the call could be sent"
        );
        assert_eq!(mark_of(&response), None, "{attempts} attempts, never ready");
        assert_eq!(layer.metrics().marked(), 0);
        assert_eq!(layer.metrics().refused_by_deadline(), 0);

        // The caller's deadline has already passed.
        let (mut svc, _handle, layer) = setup(policy, budget());
        let call = spawn_call(&mut svc, with_timeout(request(), "0m")).await;
        let response = call.await.unwrap().unwrap();
        assert_eq!(code_of(&response), Code::DeadlineExceeded);
        assert_eq!(mark_of(&response), None, "{attempts} attempts, no time");
        assert_eq!(layer.metrics().marked(), 0);
        assert_eq!(layer.metrics().refused_by_deadline(), 0);
    }
}

/// Attempt 1 fails UNAVAILABLE; the service below is then never ready, so
/// every retry waits until a timer cuts it: the deadline (a retry refused by
/// it) or the attempt timeout (retries decided, none sent). Either way the
/// layer retried and gave up: marked, and no retry was paid for.
#[tokio::test(start_paused = true)]
async fn retries_never_sent_after_a_failure_are_marked_whichever_timer_cut_them() {
    let by_deadline = (RetryPolicy::default(), "200m");
    let by_attempt_timeout = (RetryPolicy::default().with_attempt_timeout(30 * MS), "1S");
    for (policy, deadline) in [by_deadline, by_attempt_timeout] {
        let (mut svc, mut handle, layer) = setup(policy, budget());
        let call = spawn_call(&mut svc, with_timeout(request(), deadline)).await;
        let (_, send, _) = next(&mut handle).await;
        handle.allow(0);
        send.send_response(status(Code::Unavailable));
        let response = call.await.unwrap().unwrap();
        let message = message_of(&response);
        assert_eq!(code_of(&response), Code::DeadlineExceeded, "{message}");
        assert!(
            message.ends_with("attempt 1 ended with UNAVAILABLE"),
            "{message}"
        );
        assert_eq!(mark_of(&response), Some("-1"), "{message}");
        let m = layer.metrics();
        assert_eq!((m.marked(), m.retries()), (1, 0), "{message}");
        let refused = u64::from(deadline == "200m");
        assert_eq!(m.refused_by_deadline(), refused, "{message}");
    }
}

/// The same never-sent call, whichever timer cut its waits: never marked,
/// never counted as a refusal, never charged — only the time it had differs.
#[tokio::test(start_paused = true)]
async fn a_call_never_sent_is_not_marked_whichever_timer_cut_it() {
    // (deadline, budget tokens): the attempt timeout (30 ms) cuts each wait;
    // the deadline leaves room for another wait or not; the budget is empty
    // or not.
    for (deadline, tokens) in [("60m", 200), ("65m", 200), ("1S", 200), ("1S", 1)] {
        let policy = RetryPolicy::new(3, 10 * MS, 500 * MS, 0.0)
            .unwrap()
            .with_attempt_timeout(30 * MS);
        let budget = RetryBudget::new(tokens, 0.5).unwrap();
        let (mut svc, mut handle, layer) = setup(policy, budget);
        handle.allow(0);
        let call = spawn_call(&mut svc, with_timeout(request(), deadline)).await;
        let response = call.await.unwrap().unwrap();
        let case = format!("{deadline}, {tokens} tokens: {:?}", message_of(&response));
        assert_eq!(code_of(&response), Code::DeadlineExceeded, "{case}");
        assert_eq!(mark_of(&response), None, "{case}");
        let m = layer.metrics();
        assert_eq!((m.attempts(), m.retries()), (0, 0), "{case}");
        assert_eq!(
            (m.refused_by_deadline(), m.refused_by_budget()),
            (0, 0),
            "{case}"
        );
        assert_eq!(m.marked(), 0, "{case}");
    }
}

#[tokio::test(start_paused = true)]
async fn attempts_never_sent_do_not_charge_the_throttle() {
    use tower::{Layer, Service, ServiceExt};
    let throttle = RetryThrottle::new(10.0, 0.1).unwrap();
    let policy = RetryPolicy::default().with_attempt_timeout(20 * MS);
    let layer = RetryLayer::with_budget(policy, throttle.clone());
    let (inner, mut handle) = tower_test::mock::pair::<http::Request<Body>, Response<Body>>();
    handle.allow(0);
    let mut svc = layer.layer(inner);
    let call = svc
        .ready()
        .await
        .unwrap()
        .call(with_timeout(request(), "1S"));
    let response = tokio::spawn(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(layer.metrics().attempts(), 0);
    assert_eq!(throttle.available(), 10.0, "nothing sent, nothing charged");
}

#[tokio::test(start_paused = true)]
async fn with_the_mark_off_nothing_is_marked() {
    let policy = RetryPolicy::default().with_retry_at_one_layer(false);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let response = unavailable_every_time(&mut svc, &mut handle, 3).await;
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_eq!(mark_of(&response), None);
    assert_eq!(layer.metrics().marked(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_marked_failure_from_below_is_passed_up_unretried_and_counted() {
    for mark_on in [true, false] {
        let policy = RetryPolicy::default().with_retry_at_one_layer(mark_on);
        let (mut svc, mut handle, layer) = setup(policy, budget());
        let call = spawn_call(&mut svc, request()).await;
        let (_, send, _) = next(&mut handle).await;
        send.send_response(marked(Code::Unavailable));
        let response = call.await.unwrap().unwrap();
        assert_eq!(code_of(&response), Code::Unavailable);
        assert_eq!(mark_of(&response), Some("-1"), "the mark passes on up");
        let m = layer.metrics();
        assert_eq!(m.attempts(), 1, "not retried (mark {mark_on})");
        assert_eq!(m.retried_below(), 1);
        assert_eq!(
            (m.refused_by_budget(), m.refused_by_deadline(), m.marked()),
            (0, 0, 0),
            "not a refusal of this layer's, nor a mark of its own"
        );
        assert_eq!(layer.budget().available(), 100.0, "no deposit, no token");
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        assert!(handle.next_request().now_or_never().is_none());
    }
}

#[tokio::test(start_paused = true)]
async fn a_final_code_with_a_mark_is_just_final() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(marked(Code::Aborted));
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Aborted);
    assert_eq!(layer.metrics().retried_below(), 0, "never retryable anyway");
}

/// "-0" is the integer zero, as grpc-go, grpc-java and C-core read it: a
/// pushback of no delay, not the mark.
#[tokio::test(start_paused = true)]
async fn minus_zero_is_no_delay_not_the_mark() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, failed_at) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("-0"));
    send.send_response(r);
    let retry = tokio::time::timeout(std::time::Duration::from_secs(1), next(&mut handle)).await;
    let (_, send, retried_at) = retry.expect("\"-0\" was not retried");
    assert_eq!(retried_at, failed_at, "retried at once");
    send.send_response(ok());
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
    assert_eq!(layer.metrics().retried_below(), 0);
}
