//! When the caller stops waiting: an attempt with a timeout of its own tells
//! its server in `x-attempt-timeout`, beside the call's deadline in
//! `grpc-timeout`; a layer told so by its caller fits its retries and hedges
//! before that end, says it on to the attempts it sends, and leaves a retry
//! after it to the caller (its give-up then is not marked "do not retry",
//! unless it retried).
mod support;

use std::time::Duration;

use http::{HeaderValue, Request};
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{HedgePolicy, RetryLayer, RetryPolicy};
use tower::{Layer, Service, ServiceExt};
use tower_test::mock;

use support::*;

/// The `x-attempt-timeout` an attempt carries, read as a peer would.
fn attempt_timeout(req: &Request<Body>) -> Option<Duration> {
    let all: Vec<_> = req.headers().get_all("x-attempt-timeout").iter().collect();
    assert!(all.len() <= 1, "one x-attempt-timeout at most: {all:?}");
    all.first().map(|v| parse_timeout(v.to_str().unwrap()))
}

fn pushback(response: &http::Response<impl Sized>) -> Option<&HeaderValue> {
    response.headers().get("grpc-retry-pushback-ms")
}

/// A request whose caller sent a deadline and, from its own retry layer,
/// when it stops waiting for this attempt.
fn told(deadline: &'static str, waits: &'static str) -> Request<Body> {
    let mut req = with_timeout(request(), deadline);
    req.headers_mut()
        .insert("x-attempt-timeout", HeaderValue::from_static(waits));
    req
}

/// Five attempts, 1–2 ms apart, the default 20 ms minimum attempt budget.
fn five_attempts() -> RetryPolicy {
    RetryPolicy::new(5, MS, 2 * MS, 0.2).unwrap()
}

#[tokio::test(start_paused = true)]
async fn an_attempt_with_a_timeout_of_its_own_tells_its_server_when_it_ends() {
    let policy = five_attempts().with_attempt_timeout(150 * MS);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "1S")).await;
    for n in 0..2 {
        let (req, send, _) = next(&mut handle).await;
        let told = attempt_timeout(&req).expect("the attempt's end is told");
        assert!(told <= 150 * MS && told > 149 * MS, "attempt {n}: {told:?}");
        // The deadline is what `grpc-timeout` says: tonic's Channel resets a
        // stream whose `grpc-timeout` runs out.
        let deadline = parse_timeout(grpc_timeouts(&req)[0].to_str().unwrap());
        assert!(deadline > 800 * MS, "attempt {n}: {deadline:?}");
        send.send_response(status(Code::Unavailable));
    }
    let (req, send, _) = next(&mut handle).await;
    assert!(attempt_timeout(&req).is_some());
    send.send_response(ok());
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);

    // Without a timeout of its own, an attempt ends at the deadline, which
    // `grpc-timeout` already says.
    let (mut svc, mut handle, _) = setup(five_attempts(), budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "1S")).await;
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(attempt_timeout(&req), None);
    send.send_response(status(Code::Unavailable));
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(attempt_timeout(&req), None);
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_attempt_timeout_longer_than_the_deadline_is_not_told() {
    let policy = five_attempts().with_attempt_timeout(Duration::from_secs(5));
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "1S")).await;
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(attempt_timeout(&req), None);
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_layer_retries_only_within_its_callers_attempt_and_marks_a_give_up_after_retrying() {
    let (mut svc, mut handle, _) = setup(five_attempts(), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, told("1S", "100m")).await;
    for _ in 0..2 {
        let (req, send, at) = next(&mut handle).await;
        // Said on: the time the caller still waits.
        let told = attempt_timeout(&req).expect("said on");
        let left = (start + 100 * MS).saturating_duration_since(at);
        assert!(told >= left && told <= left + MS, "{told:?} vs {left:?}");
        // Each attempt fails after 40 ms.
        tokio::time::sleep(40 * MS).await;
        send.send_response(status(Code::Unavailable));
    }
    let response = call.await.unwrap().unwrap();
    // 0–40 ms, 41–82 ms; then under 20 ms is left: too little for a backoff
    // and the 20 ms minimum attempt budget.
    assert!(
        handle.next_request().now_or_never().is_none(),
        "no third attempt"
    );
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(
        message_of(&response).contains("before the caller's attempt ends"),
        "{}",
        message_of(&response)
    );
    // It retried: the caller does not retry it again.
    assert_eq!(pushback(&response).map(|v| v.as_bytes()), Some(&b"-1"[..]));
}

#[tokio::test(start_paused = true)]
async fn a_first_attempt_cut_at_its_callers_end_is_left_to_the_caller_to_retry() {
    let (mut svc, mut handle, layer) = setup(five_attempts(), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, told("1S", "100m")).await;
    let (req, send, _) = next(&mut handle).await;
    assert!(attempt_timeout(&req).is_some_and(|t| t <= 100 * MS && t > 99 * MS));
    let response = call.await.unwrap().unwrap();
    // Cut when the caller stops waiting, not at the deadline.
    let took = start.elapsed();
    assert!(took >= 100 * MS && took <= 102 * MS, "{took:?}");
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(
        message_of(&response).contains("the caller's attempt timed out"),
        "{}",
        message_of(&response)
    );
    // The caller, with time left, may retry it: not marked.
    assert_eq!(pushback(&response), None);
    assert_eq!(layer.metrics().marked(), 0);
    // The cut attempt is drained, not reset: its answer is still read.
    assert_eq!(layer.metrics().draining(), 1);
    send.send_response(ok());
    settle().await;
    assert_eq!(layer.metrics().draining(), 0);
    assert_eq!(layer.metrics().drained(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_callers_end_at_or_after_the_deadline_or_unreadable_is_not_said_on() {
    for waits in ["1S", "2S", "soon", "100"] {
        let (mut svc, mut handle, _) = setup(five_attempts(), budget());
        let call = spawn_call(&mut svc, told("1S", waits)).await;
        for _ in 0..2 {
            let (req, send, _) = next(&mut handle).await;
            assert_eq!(attempt_timeout(&req), None, "{waits}");
            send.send_response(status(Code::Unavailable));
        }
        let (_, send, _) = next(&mut handle).await;
        send.send_response(ok());
        let response = call.await.unwrap().unwrap();
        assert_eq!(code_of(&response), Code::Ok, "{waits}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_callers_end_bounds_a_call_without_a_deadline() {
    let (mut svc, mut handle, _) = setup(five_attempts(), budget());
    let mut req = request();
    req.headers_mut()
        .insert("x-attempt-timeout", HeaderValue::from_static("100m"));
    let start = Instant::now();
    let call = spawn_call(&mut svc, req).await;
    let (req, _send, _) = next(&mut handle).await;
    assert!(grpc_timeouts(&req).is_empty());
    assert!(attempt_timeout(&req).is_some());
    let response = call.await.unwrap().unwrap();
    assert!(start.elapsed() <= 102 * MS);
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
}

#[tokio::test(start_paused = true)]
async fn a_hedged_call_sends_no_hedge_after_its_caller_stops_waiting() {
    let hedge = HedgePolicy::new(3, 80 * MS)
        .unwrap()
        .with_max_extra_load(None)
        .unwrap();
    let layer = RetryLayer::new(hedge, budget());
    let (inner, mut handle) = mock::pair::<Request<Body>, http::Response<Body>>();
    let mut svc = layer.layer(inner);
    let start = Instant::now();
    let call = tokio::spawn(svc.ready().await.unwrap().call(told("1S", "50m")));
    let (req, _send, _) = next(&mut handle).await;
    assert!(attempt_timeout(&req).is_some_and(|t| t <= 50 * MS));
    let response = call.await.unwrap().unwrap();
    assert!(start.elapsed() <= 52 * MS, "{:?}", start.elapsed());
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    // One attempt, and no hedge refused for want of a token: not marked.
    assert_eq!(pushback(&response), None);
    assert!(
        handle.next_request().now_or_never().is_none(),
        "no hedge was sent"
    );

    // With time for a hedge before the caller's end, it goes.
    let (inner, mut handle) = mock::pair::<Request<Body>, http::Response<Body>>();
    let mut svc = layer.layer(inner);
    let call = tokio::spawn(svc.ready().await.unwrap().call(told("1S", "200m")));
    let (_, _first, at) = next(&mut handle).await;
    let (req, send, hedged_at) = next(&mut handle).await;
    assert_eq!(hedged_at - at, 80 * MS);
    assert!(attempt_timeout(&req).is_some_and(|t| t <= 120 * MS));
    send.send_response(ok());
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
}

#[tokio::test]
async fn forward_deadline_passes_on_only_what_a_layer_can_read() {
    let mut served = tonic::Request::new(());
    served
        .metadata_mut()
        .insert("grpc-timeout", "2S".parse().unwrap());
    served
        .metadata_mut()
        .insert("x-attempt-timeout", "soon".parse().unwrap());
    let mut onward = tonic::Request::new(());
    tonic_retry::forward_deadline(&served, &mut onward);
    assert_eq!(onward.metadata().get("grpc-timeout").unwrap(), "2S");
    assert!(onward.metadata().get("x-attempt-timeout").is_none());
}
