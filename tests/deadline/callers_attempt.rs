//! When the caller stops waiting: an attempt with a timeout of its own tells
//! its server in `x-attempt-timeout`, beside the call's deadline in
//! `grpc-timeout`; a layer told so by its caller fits its retries and hedges
//! before that end, says it on to the attempts it sends, and leaves a retry
//! after it to the caller (its give-up then is not marked "do not retry",
//! unless it retried).

use std::time::Duration;

use http::{HeaderValue, Request};
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{HedgePolicy, RetryLayer, RetryPolicy};
use tower::{Layer, Service, ServiceExt};
use tower_test::mock;

use crate::support::*;

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

/// A call through a layer hedging up to 3 attempts 80 ms apart, started on
/// its own task.
async fn hedged_call(req: Request<Body>) -> (Svc, Handle, tokio::task::JoinHandle<Outcome>) {
    let hedge = HedgePolicy::new(3, 80 * MS)
        .unwrap()
        .with_max_extra_load(None)
        .unwrap();
    let layer = RetryLayer::new(hedge, budget());
    let (inner, handle) = mock::pair::<Request<Body>, http::Response<Body>>();
    let mut svc = layer.layer(inner);
    let call = tokio::spawn(svc.ready().await.unwrap().call(req));
    (svc, handle, call)
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
    // Counted as a failure not retried for lack of time.
    assert_eq!(layer.metrics().refused_by_deadline(), 1);
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
    let start = Instant::now();
    let (_svc, mut handle, call) = hedged_call(told("1S", "50m")).await;
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
    let (_svc, mut handle, call) = hedged_call(told("1S", "200m")).await;
    let (_, _first, at) = next(&mut handle).await;
    let (req, send, hedged_at) = next(&mut handle).await;
    assert_eq!(hedged_at - at, 80 * MS);
    assert!(attempt_timeout(&req).is_some_and(|t| t <= 120 * MS));
    send.send_response(ok());
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
}

/// A retry that was decided but never sent (its service was not ready before
/// the caller's end) is no retry: the layer sent one attempt, and the give-up
/// for lack of time before the caller's end must be left to the caller.
#[tokio::test(start_paused = true)]
async fn a_retry_never_sent_before_the_callers_end_leaves_the_give_up_unmarked() {
    let (mut svc, mut handle, layer) = setup(five_attempts(), budget());
    let call = spawn_call(&mut svc, told("1S", "100m")).await;
    let (_req, send, _) = next(&mut handle).await;
    // The service below stops being ready (a reconnecting channel, a full
    // concurrency limit) ...
    handle.allow(0);
    tokio::time::sleep(50 * MS).await;
    // ... and the first attempt fails fast with time left for a retry.
    send.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert!(
        handle.next_request().now_or_never().is_none(),
        "no retry was sent"
    );
    assert_eq!(layer.metrics().retries(), 0, "no retry was sent");
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    // One attempt reached the server: the caller, which has time, may retry.
    assert_eq!(
        pushback(&response),
        None,
        "marked do-not-retry though the layer sent no retry: {}",
        message_of(&response)
    );
}

/// A hedged call's server pushback that ends after the caller stops waiting
/// (but before the deadline) is a wait that does not fit in the call's room:
/// the call must end now, as a retried call does, not hold on to past the
/// caller's end.
#[tokio::test(start_paused = true)]
async fn a_hedged_call_does_not_wait_out_a_pushback_past_its_callers_end() {
    let start = Instant::now();
    let (_svc, mut handle, call) = hedged_call(told("1S", "50m")).await;
    let (_req, send, _) = next(&mut handle).await;
    tokio::time::sleep(10 * MS).await;
    let mut answer = status(Code::Unavailable);
    answer
        .headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("600"));
    send.send_response(answer);
    let response = call.await.unwrap().unwrap();
    let took = start.elapsed();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(
        handle.next_request().now_or_never().is_none(),
        "no hedge was sent"
    );
    assert!(
        took <= 52 * MS,
        "the call ended {took:?} after it started, past its caller's 50 ms end"
    );
}

/// Compare: the same call without hedging ends at once.
#[tokio::test(start_paused = true)]
async fn a_retried_call_does_not_wait_out_a_pushback_past_its_callers_end() {
    let (mut svc, mut handle, _) = setup(five_attempts(), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, told("1S", "50m")).await;
    let (_req, send, _) = next(&mut handle).await;
    tokio::time::sleep(10 * MS).await;
    let mut answer = status(Code::Unavailable);
    answer
        .headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("600"));
    send.send_response(answer);
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(start.elapsed() <= 11 * MS, "{:?}", start.elapsed());
}

/// Several `x-attempt-timeout` values: the layer must read the one a peer
/// (and `forward_deadline`, and the layer itself for `grpc-timeout`) reads,
/// the first.
#[tokio::test(start_paused = true)]
async fn of_several_callers_ends_the_first_is_read() {
    let (mut svc, mut handle, _) = setup(five_attempts(), budget());
    let two = || {
        let mut req = with_timeout(request(), "1S");
        req.headers_mut()
            .append("x-attempt-timeout", HeaderValue::from_static("100m"));
        req.headers_mut()
            .append("x-attempt-timeout", HeaderValue::from_static("5S"));
        req
    };
    // What a handler passes on: the first value.
    let served = tonic::Request::from_http(two().map(|_| ()));
    let mut onward = tonic::Request::new(());
    tonic_retry::forward_deadline(&served, &mut onward);
    assert_eq!(onward.metadata().get("x-attempt-timeout").unwrap(), "100m");
    let req = two();
    let start = Instant::now();
    let call = spawn_call(&mut svc, req).await;
    let (req, _send, _) = next(&mut handle).await;
    let told = req
        .headers()
        .get("x-attempt-timeout")
        .map(|v| v.to_str().unwrap().to_owned());
    let response = call.await.unwrap().unwrap();
    assert_eq!(
        told.as_deref().map(parse_timeout),
        Some(100 * MS),
        "said on: {told:?}"
    );
    assert!(start.elapsed() <= 101 * MS, "cut at {:?}", start.elapsed());
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
}

#[tokio::test(start_paused = true)]
async fn the_largest_zero_and_deadline_long_callers_ends() {
    // Huge, no deadline: no panic, said on, answered.
    let (mut svc, mut handle, _) = setup(five_attempts(), budget());
    let mut req = request();
    req.headers_mut()
        .insert("x-attempt-timeout", HeaderValue::from_static("99999999H"));
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    assert!(req.headers().get("x-attempt-timeout").is_some());
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);

    // Huge, with an attempt timeout and a deadline of the same size.
    let (mut svc, mut handle, _) = setup(
        five_attempts().with_attempt_timeout(Duration::MAX),
        budget(),
    );
    let call = spawn_call(&mut svc, told("99999999H", "99999999H")).await;
    let (req, send, _) = next(&mut handle).await;
    assert!(req.headers().get("x-attempt-timeout").is_none());
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);

    // Zero: nothing sent, DEADLINE_EXCEEDED, not marked.
    let (mut svc, mut handle, layer) = setup(five_attempts(), budget());
    let call = spawn_call(&mut svc, told("1S", "0m")).await;
    let response = call.await.unwrap().unwrap();
    assert!(handle.next_request().now_or_never().is_none());
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(pushback(&response), None);
    assert_eq!(layer.metrics().attempts(), 0);

    // Equal to the deadline: ignored.
    let (mut svc, mut handle, _) = setup(five_attempts(), budget());
    let call = spawn_call(&mut svc, told("1S", "1000m")).await;
    let (req, send, _) = next(&mut handle).await;
    assert!(req.headers().get("x-attempt-timeout").is_none());
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn an_attempt_cut_at_its_callers_end_without_a_deadline_drains_for_a_bounded_time() {
    let (mut svc, mut handle, layer) = setup(five_attempts(), budget());
    let mut req = request();
    req.headers_mut()
        .insert("x-attempt-timeout", HeaderValue::from_static("100m"));
    let call = spawn_call(&mut svc, req).await;
    // The server never answers (its handle is held to the end).
    let (_req, _send, _) = next(&mut handle).await;
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(layer.metrics().draining(), 1);
    // The drain of an attempt without a deadline ends after 10 s.
    tokio::time::sleep(Duration::from_secs(11)).await;
    settle().await;
    assert_eq!(layer.metrics().draining(), 0);
    assert_eq!(layer.metrics().drain_cut(), 1);
}

#[tokio::test(start_paused = true)]
async fn every_retry_says_one_fresh_end() {
    let policy = five_attempts().with_attempt_timeout(30 * MS);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, told("1S", "200m")).await;
    for _ in 0..4 {
        let (req, send, at) = next(&mut handle).await;
        let all: Vec<_> = req.headers().get_all("x-attempt-timeout").iter().collect();
        assert_eq!(all.len(), 1);
        let said = parse_timeout(all[0].to_str().unwrap());
        let left = (start + 200 * MS).saturating_duration_since(at);
        assert!(said <= left.min(30 * MS) + MS, "{said:?} vs {left:?}");
        send.send_response(status(Code::Unavailable));
    }
    let (_, send, _) = next(&mut handle).await;
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

/// A layer without an attempt timeout of its own, under a caller with one:
/// its retries fit before the caller's end, and its cut attempt drains.
#[tokio::test(start_paused = true)]
async fn a_layer_without_an_attempt_timeout_retries_within_its_callers_and_drains_the_cut() {
    let (mut svc, mut handle, layer) = setup(five_attempts(), budget());
    let call = spawn_call(&mut svc, told("1S", "150m")).await;
    let (_, send, _) = next(&mut handle).await;
    tokio::time::sleep(10 * MS).await;
    send.send_response(status(Code::Unavailable));
    let (req, send2, _) = next(&mut handle).await;
    assert!(req.headers().get("x-attempt-timeout").is_some());
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    // It retried: marked.
    assert_eq!(pushback(&response).map(|v| v.as_bytes()), Some(&b"-1"[..]));
    assert_eq!(layer.metrics().draining(), 1);
    send2.send_response(ok());
    settle().await;
    assert_eq!(layer.metrics().drained(), 1);
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
