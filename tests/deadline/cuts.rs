//! Attempts are cut at the deadline or at their own timeout, never before, and
//! a cut reads as `DEADLINE_EXCEEDED` (or the last attempt's code). `tower-test`
//! mocks under paused time.

use crate::support::{bounded_paused, policy, scripted, *};
use bytes::Bytes;
use http::{HeaderValue, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{RetryLayer, RetryPolicy};
use tower::{BoxError, Layer, ServiceExt};

#[tokio::test(start_paused = true)]
async fn no_retry_without_room_for_backoff_plus_minimum_attempt() {
    let policy = RetryPolicy::new(5, 20 * MS, 500 * MS, 0.0).unwrap();
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "100m")).await;
    // Attempt 1 fails at 30 ms: 70 ms left > 20 ms backoff + 20 ms: retried.
    let (_, send, _) = next(&mut handle).await;
    tokio::time::sleep(30 * MS).await;
    send.send_response(status(Code::Unavailable));
    // Attempt 2 starts at 50 ms and fails at 70 ms: 30 ms left <= 40 ms + 20 ms.
    let (_, send, at) = next(&mut handle).await;
    assert_eq!(at - start, 50 * MS);
    tokio::time::sleep(20 * MS).await;
    send.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert_eq!(
        Instant::now() - start,
        70 * MS,
        "failed at once, without sleeping"
    );
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    let message = message_of(&response);
    assert!(message.contains("no time left"), "{message}");
    assert!(
        message.contains("UNAVAILABLE"),
        "names the last code: {message}"
    );
    assert_eq!(layer.metrics().refused_by_deadline(), 1);
    assert_eq!(
        layer.budget().available(),
        99.0,
        "only the one retry sent was paid for"
    );
}

#[tokio::test(start_paused = true)]
async fn the_attempt_is_cut_at_the_deadline() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "250m")).await;
    let (_, _send, _) = next(&mut handle).await; // never answered
    let response = call.await.unwrap().unwrap();
    assert_eq!(Instant::now() - start, 250 * MS);
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(response.headers()["content-type"], "application/grpc");
}

#[tokio::test(start_paused = true)]
async fn an_inner_timeout_error_at_the_deadline_reads_as_deadline_exceeded() {
    // tonic's Channel enforces `grpc-timeout` itself and fails with a transport
    // error (which tonic's client reports as CANCELLED). The caller must see
    // DEADLINE_EXCEEDED.
    let policy = RetryPolicy::new(1, 20 * MS, 500 * MS, 0.2).unwrap();
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "100m")).await;
    let (_, send, _) = next(&mut handle).await;
    tokio::time::sleep(100 * MS).await;
    send.send_error("timeout expired");
    let response = call
        .await
        .unwrap()
        .expect("a status, not the transport error");
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
}

#[tokio::test(start_paused = true)]
async fn deadline_exceeded_from_a_hop_is_retried_while_time_remains() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "1S")).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::DeadlineExceeded));
    let (_, send, _) = next(&mut handle).await;
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn per_attempt_timeout_retries_a_slow_hop() {
    let policy = RetryPolicy::default().with_attempt_timeout(100 * MS);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "1S")).await;
    let (req, _slow, _) = next(&mut handle).await;
    // The server is sent the call's deadline: the attempt's own limit is
    // the client's, which drains the attempt it cuts rather than reset it.
    assert_eq!(req.headers()["grpc-timeout"], "1000000u");
    let (_, send, at) = next(&mut handle).await;
    assert!(
        at - start >= 116 * MS && at - start <= 124 * MS,
        "{:?}",
        at - start
    );
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    assert_eq!(layer.metrics().retries(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_call_whose_deadline_already_passed_sends_nothing() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "0n")).await;
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(layer.budget().available(), 100.0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        handle.next_request().now_or_never().is_none(),
        "an attempt was sent with no time left"
    );
}

#[tokio::test(start_paused = true)]
async fn a_committed_stream_ends_at_the_deadline_with_deadline_exceeded() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "300m")).await;
    let (_, send, _) = next(&mut handle).await;
    let (tx, rx) = mpsc::unbounded_channel::<Result<Frame<Bytes>, tonic::Status>>();
    tx.send(Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\x01a"))))
        .unwrap();
    send.send_response(
        Response::builder()
            .header("content-type", "application/grpc")
            .body(Body::new(http_body_util::StreamBody::new(
                tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
            )))
            .unwrap(),
    );
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok, "committed");
    let mut body = response.into_body();
    let first = bounded_paused(body.frame()).await.unwrap().unwrap();
    assert!(first.is_data());
    // The server stalls with the stream open.
    let last = bounded_paused(body.frame()).await.unwrap().unwrap();
    let trailers = last.into_trailers().expect("trailers end the stream");
    assert_eq!(
        tonic::Status::from_header_map(&trailers).unwrap().code(),
        Code::DeadlineExceeded
    );
    assert_eq!(start.elapsed(), 300 * MS);
    assert!(body.frame().await.is_none());
    assert!(tx.is_closed(), "the server's stream was dropped");
}

#[tokio::test(start_paused = true)]
async fn a_servers_cancelled_at_the_attempts_limit_is_its_time_running_out() {
    // A tonic server answers CANCELLED when the grpc-timeout it got expires.
    let inner = scripted(100 * MS, |i| {
        Ok(if i == 0 {
            tonic::Status::cancelled("Timeout expired").into_http()
        } else {
            ok()
        })
    });
    let layer = RetryLayer::new(policy(3).with_attempt_timeout(100 * MS), budget());
    let response = bounded_paused(layer.layer(inner).oneshot(request()))
        .await
        .unwrap();
    assert_eq!(code_of(&response), Code::Ok, "retried as DEADLINE_EXCEEDED");
    assert_eq!(layer.metrics().attempts(), 2);

    // With no retry left, the caller sees DEADLINE_EXCEEDED, not CANCELLED.
    let inner = scripted(100 * MS, |_| {
        Ok(tonic::Status::cancelled("Timeout expired").into_http())
    });
    let layer = RetryLayer::new(policy(1).with_attempt_timeout(100 * MS), budget());
    let response = layer.layer(inner).oneshot(request()).await.unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
}

/// A server that got `grpc-timeout` ends a stream it is still sending when
/// that time runs out: with CANCELLED trailers (tonic, grpc-java) or a reset
/// (the body fails). The server is sent the call's deadline (an attempt's own
/// timeout stays with the client), so once the deadline has passed either
/// reaches the caller as DEADLINE_EXCEEDED; before it, past the attempt
/// timeout included, the server's answer passes as is.
#[tokio::test(start_paused = true)]
async fn a_stream_the_server_ends_at_the_deadline_ends_deadline_exceeded() {
    let cancelled = || {
        let mut t = http::HeaderMap::new();
        t.insert("grpc-status", HeaderValue::from_static("1"));
        Ok(Frame::trailers(t))
    };
    let reset = || Err(tonic::Status::cancelled("stream reset by the server"));
    type End = fn() -> Result<Frame<Bytes>, tonic::Status>;
    let cases: [(&str, Duration, End, Option<Code>); 6] = [
        // (deadline, when the server ends it, how, what the caller's client reads)
        ("80m", 80 * MS, cancelled, Some(Code::DeadlineExceeded)),
        ("80m", 80 * MS, reset, Some(Code::DeadlineExceeded)),
        ("1S", 100 * MS, cancelled, Some(Code::Cancelled)),
        ("1S", 150 * MS, reset, None),
        ("1S", 50 * MS, cancelled, Some(Code::Cancelled)),
        ("1S", 50 * MS, reset, None),
    ];
    for (deadline, at, end, expected) in cases {
        let policy = RetryPolicy::default().with_attempt_timeout(100 * MS);
        let (mut svc, mut handle, _) = setup(policy, budget());
        let start = Instant::now();
        let call = spawn_call(&mut svc, with_timeout(request(), deadline)).await;
        let (_, send, _) = next(&mut handle).await;
        let (tx, response) = streaming_response();
        tx.send(data("\0\0\0\0\x01a")).unwrap();
        send.send_response(response);
        let response = call.await.unwrap().unwrap();
        assert_eq!(code_of(&response), Code::Ok, "committed");
        let mut body = response.into_body();
        assert!(
            bounded_paused(body.frame())
                .await
                .unwrap()
                .unwrap()
                .is_data()
        );
        tokio::time::sleep_until(start + at).await;
        tx.send(end()).unwrap();
        drop(tx);
        let last = bounded_paused(body.frame()).await.unwrap();
        let case = format!("{deadline}, ended at {at:?}: {last:?}");
        let got = match last {
            Ok(frame) => {
                let trailers = frame.into_trailers().expect("trailers");
                Some(tonic::Status::from_header_map(&trailers).unwrap())
            }
            Err(_) => None,
        };
        assert_eq!(got.as_ref().map(tonic::Status::code), expected, "{case}");
        if let Some(status) = got.filter(|s| s.code() == Code::DeadlineExceeded) {
            assert!(
                status.message().starts_with("call deadline exceeded"),
                "{case}"
            );
        }
        assert!(body.frame().await.is_none(), "{case}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_before_any_limit_is_the_servers_own_answer() {
    let inner = scripted(10 * MS, |_| {
        Ok(tonic::Status::cancelled("by the app").into_http())
    });
    let layer = RetryLayer::new(policy(3).with_attempt_timeout(100 * MS), budget());
    let response = layer.layer(inner).oneshot(request()).await.unwrap();
    assert_eq!(code_of(&response), Code::Cancelled);
    assert_eq!(layer.metrics().attempts(), 1, "CANCELLED is final");
}

#[tokio::test(start_paused = true)]
async fn timer_errors_from_below_read_as_deadline_exceeded() {
    // tonic's Channel reports its own grpc-timeout expiry as a transport
    // error whose source is `TimeoutExpired` (tonic would say CANCELLED);
    // tower's Timeout says `Elapsed`. Either is the attempt's time running out.
    for error in [
        || -> BoxError { Box::new(tonic::TimeoutExpired(())) },
        || -> BoxError { Box::new(tower::timeout::error::Elapsed::new()) },
    ] {
        let inner = scripted(
            50 * MS,
            move |i| if i == 0 { Err(error()) } else { Ok(ok()) },
        );
        let layer = RetryLayer::new(policy(3), budget());
        let response = layer.layer(inner).oneshot(request()).await.unwrap();
        assert_eq!(code_of(&response), Code::Ok);
        assert_eq!(layer.metrics().attempts(), 2);

        let inner = scripted(50 * MS, move |_| Err(error()));
        let layer = RetryLayer::new(policy(1), budget());
        let response = layer.layer(inner).oneshot(request()).await.unwrap();
        assert_eq!(
            code_of(&response),
            Code::DeadlineExceeded,
            "never CANCELLED"
        );
    }
}

// ---------------------------------------------------------------------------
// A token pays only for an attempt that is really sent
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_zero_attempt_timeout_sends_nothing_and_spends_nothing() {
    let (mut svc, mut handle, layer) = setup(
        RetryPolicy::default().with_attempt_timeout(Duration::ZERO),
        budget(),
    );
    let call = spawn_call(&mut svc, request()).await;
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(handle.next_request().now_or_never().is_none());
    assert_eq!(layer.metrics().attempts(), 0, "no attempt was sent");
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
}

/// A call with a 100 ms deadline answered at once with `response`, whose
/// body the caller reads to its end from `wait` on: the code it reads, and
/// when the read ended, from the call's start.
async fn read_after(response: Response<Body>, wait: Duration) -> (Code, Duration) {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "100m")).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(response);
    let response = call.await.unwrap().unwrap();
    tokio::time::advance(wait).await;
    let code = bounded_paused(read_to_end(response)).await;
    (code, Instant::now() - start)
}

// ---------------------------------------------------------------------------
// The committed body is cut at the deadline — not before it
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_body_is_not_cut_before_the_deadline() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let start = Instant::now();
    // tonic writes sub-millisecond timeouts ("300500u"); a real clock never
    // starts a call on a timer tick either.
    let call = spawn_call(&mut svc, with_timeout(request(), "300500u")).await;
    let (_, send, _) = next(&mut handle).await;
    let (tx, response) = streaming_response();
    send.send_response(response);
    let response = call.await.unwrap().unwrap();
    let deadline = start + Duration::from_micros(300_500);
    let mut body = response.into_body();
    // Nothing to read yet: the body waits (and arms its deadline timer).
    assert!(body.frame().now_or_never().is_none());
    // The server finishes with OK trailers at 300 ms, before the deadline.
    tokio::time::advance(Duration::from_millis(300)).await;
    tx.send(Ok(Frame::trailers(ok_trailers()))).unwrap();
    assert!(Instant::now() < deadline, "still before the deadline");
    let frame = bounded_paused(body.frame()).await.unwrap().unwrap();
    let trailers = frame.into_trailers().unwrap();
    assert_eq!(
        trailers["grpc-status"],
        "0",
        "OK trailers ready {:?} before the deadline were replaced by {:?}",
        deadline - Instant::now(),
        trailers
    );
}

/// A Trailers-Only answer (its status in its headers) arrived in time: the
/// call's deadline, passing before the caller reads its empty body, must not
/// turn it into DEADLINE_EXCEEDED. (A committed body ends with it.)
#[tokio::test(start_paused = true)]
async fn a_trailers_only_ok_read_after_the_deadline_stays_ok() {
    let (code, _) = read_after(status(Code::Ok), Duration::from_millis(150)).await;
    assert_eq!(code, Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn a_trailers_only_error_read_after_the_deadline_keeps_its_code() {
    let (code, _) = read_after(status(Code::NotFound), Duration::from_millis(150)).await;
    assert_eq!(code, Code::NotFound);
}

#[tokio::test(start_paused = true)]
async fn a_trailers_only_answer_whose_body_stalls_still_ends_at_the_deadline() {
    // A server that sends OK in its headers and then keeps the stream open.
    let (_tx, mut response) = streaming_response();
    response
        .headers_mut()
        .insert("grpc-status", HeaderValue::from_static("0"));
    let (code, ended) = read_after(response, Duration::ZERO).await;
    assert_eq!(code, Code::Ok);
    assert_eq!(
        ended,
        Duration::from_millis(100),
        "the body ended at the deadline, not before and not never"
    );
}

// ---------------------------------------------------------------------------
// "no time left", naming the last attempt's code
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn no_time_left_names_the_last_attempts_code() {
    let (mut svc, mut handle, layer) = setup(policy(5), budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "200m")).await;
    let (_, send, _) = next(&mut handle).await;
    handle.allow(0);
    send.send_response(status(Code::Unavailable));
    // The retry waits for the service below; it frees up with 10 ms left.
    tokio::time::sleep(190 * MS).await;
    handle.allow(1);
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(handle.next_request().now_or_never().is_none(), "not sent");
    let message = message_of(&response);
    assert!(
        message.contains("attempt 1 ended with UNAVAILABLE"),
        "only one attempt was sent and it ended UNAVAILABLE; the caller is told: {message:?}"
    );
    let _ = layer;
}

// ---------------------------------------------------------------------------
// The attempt itself is cut before the deadline (same timer slack)
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn an_attempt_is_not_cut_before_the_deadline() {
    let (mut svc, mut handle, _) = setup(policy(1), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "300500u")).await;
    let (_, send, _) = next(&mut handle).await;
    let deadline = start + Duration::from_micros(300_500);
    tokio::time::advance(Duration::from_millis(300)).await;
    tokio::task::yield_now().await;
    assert!(Instant::now() < deadline);
    // The server answers OK, 0.5 ms before the deadline.
    send.send_response(ok());
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(
        code_of(&response),
        Code::Ok,
        "cut at {:?} of a {:?} deadline: {}",
        start.elapsed(),
        deadline - start,
        message_of(&response)
    );
}

#[tokio::test(start_paused = true)]
async fn attempt_timeout_longer_than_deadline() {
    let (mut svc, mut handle, _) = setup(
        RetryPolicy::default().with_attempt_timeout(Duration::from_secs(10)),
        budget(),
    );
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "100m")).await;
    let (req, _never, _) = next(&mut handle).await;
    assert_eq!(req.headers()["grpc-timeout"], "100000u");
    let r = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&r), Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), 100 * MS);
}

// ---------------------------------------------------------------------------
// The last retry refused at send time for lack of time
// ---------------------------------------------------------------------------

/// One failed attempt (UNAVAILABLE), then its retry finds the service ready
/// only when 15 ms are left (<= min_attempt_budget, 20 ms): it is not sent.
/// Whether or not it was the last retry allowed, the call ends there naming
/// attempt 1's UNAVAILABLE, and the refusal by the deadline is counted.
#[tokio::test(start_paused = true)]
async fn a_retry_refused_for_time_at_send_is_counted_and_named_even_the_last() {
    async fn run(attempts: u32) -> (String, u64, Duration) {
        let (mut svc, mut handle, layer) = setup(policy(attempts), budget());
        let start = Instant::now();
        let call = spawn_call(&mut svc, with_timeout(request(), "100m")).await;
        let (_, send, _) = next(&mut handle).await;
        handle.allow(0);
        send.send_response(status(Code::Unavailable));
        // The retry waits for readiness from ~20 ms; ready at 85 ms.
        tokio::time::sleep_until(start + 85 * MS).await;
        handle.allow(1);
        let response = bounded_paused(call).await.unwrap().unwrap();
        assert_eq!(code_of(&response), Code::DeadlineExceeded);
        assert_eq!(layer.metrics().retries(), 0, "not sent");
        (
            message_of(&response),
            layer.metrics().refused_by_deadline(),
            start.elapsed(),
        )
    }
    // Control: a retry left after this one.
    let (message, refused, at) = run(3).await;
    assert_eq!(at, 85 * MS);
    assert!(
        message.contains("attempt 1 ended with UNAVAILABLE"),
        "{message}"
    );
    assert_eq!(refused, 1);
    // The refused retry is the last one allowed.
    let (message, refused, at) = run(2).await;
    assert_eq!(at, 85 * MS, "ended 15 ms before its deadline");
    assert!(
        message.contains("attempt 1 ended with UNAVAILABLE"),
        "{message}"
    );
    assert_eq!(refused, 1);
}

/// A zero per-attempt timeout: every attempt is cut before it is sent; no
/// token, no attempt, no retry is counted.
#[tokio::test(start_paused = true)]
async fn zero_attempt_timeout_spends_nothing() {
    let (mut svc, mut handle, layer) =
        setup(policy(3).with_attempt_timeout(Duration::ZERO), budget());
    let call = spawn_call(&mut svc, request()).await;
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(handle.next_request().now_or_never().is_none());
    let m = layer.metrics();
    assert_eq!(
        (m.attempts(), m.retries(), m.refused_by_budget()),
        (0, 0, 0)
    );
    assert_eq!(layer.budget().available(), 100.0);
}
