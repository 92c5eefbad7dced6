//! The layer against `tower-test` mocks, under paused tokio time: every wait is
//! virtual and exact, so timings are asserted to the instant.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{
    RetryBudget, RetryLayer, RetryPolicy, RetryWhen, RetryableCodes, marks::AlreadyTried,
};
use tonic_types::{ErrorDetails, StatusExt};
use tower::{BoxError, Layer, Service, ServiceExt};

use support::*;

#[tokio::test(start_paused = true)]
async fn unavailable_is_retried_until_success() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let (_, send, _) = next(&mut handle).await;
    send.send_response(ok());
    let response = call.await.unwrap().expect("a response");
    assert_eq!(code_of(&response), Code::Ok);
    assert_eq!(layer.metrics().attempts(), 3);
    assert_eq!(layer.metrics().retries(), 2);
}

#[tokio::test(start_paused = true)]
async fn backoff_waits_the_jittered_exponential_delay() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, t0) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let (_, send, t1) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let (_, send, t2) = next(&mut handle).await;
    send.send_response(ok());
    call.await.unwrap().unwrap();
    let (d1, d2) = (t1 - t0, t2 - t1);
    assert!(
        (16 * MS..=24 * MS).contains(&d1),
        "first retry waited {d1:?}"
    );
    assert!(
        (32 * MS..=48 * MS).contains(&d2),
        "second retry waited {d2:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn final_codes_are_never_retried() {
    for code in [
        Code::Aborted,
        Code::NotFound,
        Code::InvalidArgument,
        Code::PermissionDenied,
        Code::Unauthenticated,
        Code::Unimplemented,
        Code::Internal,
        Code::AlreadyExists,
        Code::FailedPrecondition,
        Code::ResourceExhausted,
        Code::Cancelled,
        Code::Unknown,
    ] {
        let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
        let call = spawn_call(&mut svc, request()).await;
        let (_, send, _) = next(&mut handle).await;
        send.send_response(status(code));
        let response = call.await.unwrap().unwrap();
        assert_eq!(code_of(&response), code);
        assert_eq!(
            message_of(&response),
            "from the server",
            "{code:?} passed untouched"
        );
        assert_eq!(layer.metrics().attempts(), 1, "{code:?} was retried");
        assert_eq!(layer.budget().available(), 100.0, "{code:?} spent a token");
    }
}

#[tokio::test(start_paused = true)]
async fn attempts_run_out_with_the_last_status() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let response = unavailable_every_time(&mut svc, &mut handle, 3).await;
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_eq!(layer.metrics().attempts(), 3);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        handle.next_request().now_or_never().is_none(),
        "a fourth attempt was sent"
    );
}

#[tokio::test(start_paused = true)]
async fn transport_errors_are_retried_as_unavailable() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_error("connection refused");
    let (_, send, _) = next(&mut handle).await;
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn http_503_without_grpc_status_is_retried() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(Response::builder().status(503).body(Body::empty()).unwrap());
    let (_, send, _) = next(&mut handle).await;
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn committed_responses_are_never_retried() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    // Headers start the response normally; the failure comes in the trailers.
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("14"));
    let body = http_body_util::StreamBody::new(tokio_stream::iter([
        Ok::<_, tonic::Status>(Frame::data(Bytes::from_static(b"partial"))),
        Ok(Frame::trailers(trailers)),
    ]));
    send.send_response(
        Response::builder()
            .header("content-type", "application/grpc")
            .header("x-custom", "kept")
            .body(Body::new(body))
            .unwrap(),
    );
    let response = call.await.unwrap().unwrap();
    assert_eq!(response.headers()["x-custom"], "kept");
    let collected = response.into_body().collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["grpc-status"], "14");
    assert_eq!(collected.to_bytes(), "partial");
    assert_eq!(layer.metrics().attempts(), 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(handle.next_request().now_or_never().is_none());
}

#[tokio::test(start_paused = true)]
async fn grpc_timeout_is_rewritten_to_the_time_left_on_every_attempt() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "1S")).await;
    let deadline = start + Duration::from_secs(1);
    let mut seen = Vec::new();
    for n in 0..3 {
        let (req, send, at) = next(&mut handle).await;
        let header = req.headers()["grpc-timeout"].to_str().unwrap().to_owned();
        seen.push((header, deadline - at));
        // Each attempt takes 100 ms to fail.
        tokio::time::sleep(100 * MS).await;
        send.send_response(if n < 2 {
            status(Code::Unavailable)
        } else {
            ok()
        });
    }
    call.await.unwrap().unwrap();
    let mut last = Duration::MAX;
    for (header, left) in &seen {
        let parsed = parse_timeout(header);
        assert!(
            parsed >= *left && parsed - *left < Duration::from_micros(1),
            "{header} for {left:?}"
        );
        assert!(parsed < last, "grpc-timeout did not shrink: {seen:?}");
        last = parsed;
    }
    // The first attempt, sent at once, has the whole second: the caller's
    // own header, as it was.
    assert_eq!(seen[0].0, "1S", "the first attempt has the whole second");
}

/// A first attempt sent at once says the call's timeout itself: the caller's
/// one header as it was, or the policy's timeout, which repeats from call to
/// call (so it is not marked sensitive, and HPACK may index it). A retry says
/// the time left, which never repeats (sensitive: never indexed).
#[tokio::test(start_paused = true)]
async fn a_first_attempt_sent_at_once_says_the_calls_own_timeout() {
    // The caller's header, left as it is.
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "2S")).await;
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(grpc_timeouts(&req), ["2S"]);
    assert!(!req.headers()["grpc-timeout"].is_sensitive());
    tokio::time::sleep(100 * MS).await;
    send.send_response(status(Code::Unavailable));
    let (req, send, _) = next(&mut handle).await;
    let retry = &req.headers()["grpc-timeout"];
    assert!(parse_timeout(retry.to_str().unwrap()) < Duration::from_millis(1_900));
    assert!(retry.is_sensitive(), "the time left never repeats");
    send.send_response(ok());
    call.await.unwrap().unwrap();

    // The policy's timeout.
    let policy = RetryPolicy::default().with_total_timeout(Duration::from_secs(3));
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, request()).await;
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(grpc_timeouts(&req), ["3000000u"]);
    assert!(!req.headers()["grpc-timeout"].is_sensitive());
    send.send_response(ok());
    call.await.unwrap().unwrap();

    // A caller's header capped by the method's limit: the limit, which is
    // the policy's, and repeats.
    let policy = RetryPolicy::default().with_max_timeout(Duration::from_secs(1));
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "2S")).await;
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(grpc_timeouts(&req), ["1000000u"]);
    send.send_response(ok());
    call.await.unwrap().unwrap();

    // Two headers from the caller: the first sets the deadline, and the
    // attempt says the time left once, sensitive.
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = with_timeout(request(), "2S");
    req.headers_mut()
        .append("grpc-timeout", http::HeaderValue::from_static("9S"));
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(grpc_timeouts(&req), ["2000000u"]);
    assert!(req.headers()["grpc-timeout"].is_sensitive());
    send.send_response(ok());
    call.await.unwrap().unwrap();

    // A caller passing on a deadline of its own: its header as it made it,
    // here marked sensitive, as a different value on every call should be.
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    for value in ["1999m", "1998m"] {
        let mut value = http::HeaderValue::from_static(value);
        value.set_sensitive(true);
        let mut req = request();
        req.headers_mut().insert("grpc-timeout", value.clone());
        let call = spawn_call(&mut svc, req).await;
        let (req, send, _) = next(&mut handle).await;
        assert_eq!(grpc_timeouts(&req), [value]);
        assert!(req.headers()["grpc-timeout"].is_sensitive());
        send.send_response(ok());
        call.await.unwrap().unwrap();
    }
}

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
async fn a_total_timeout_applies_when_the_request_has_none() {
    let policy = RetryPolicy::default().with_total_timeout(300 * MS);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, request()).await;
    let (req, _never, _) = next(&mut handle).await;
    assert_eq!(req.headers()["grpc-timeout"], "300000u");
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
}

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
async fn one_idempotency_key_for_every_attempt() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let mut keys = Vec::new();
    for n in 0..3 {
        let (req, send, _) = next(&mut handle).await;
        keys.push(req.headers()["x-idempotency-key"].clone());
        send.send_response(if n < 2 {
            status(Code::Unavailable)
        } else {
            ok()
        });
    }
    call.await.unwrap().unwrap();
    assert_eq!(keys[0].len(), 32, "128 bits in hex");
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");

    // A second call gets a key of its own.
    let call2 = spawn_call(&mut svc, request()).await;
    let (req, send, _) = next(&mut handle).await;
    assert_ne!(req.headers()["x-idempotency-key"], keys[0]);
    send.send_response(ok());
    call2.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_callers_key_is_kept_and_generation_can_be_off() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    req.headers_mut()
        .insert("x-idempotency-key", HeaderValue::from_static("order-42"));
    let call = spawn_call(&mut svc, req).await;
    for n in 0..2 {
        let (req, send, _) = next(&mut handle).await;
        assert_eq!(req.headers()["x-idempotency-key"], "order-42");
        send.send_response(if n == 0 {
            status(Code::Unavailable)
        } else {
            ok()
        });
    }
    call.await.unwrap().unwrap();

    let (mut svc, mut handle, _) =
        setup(RetryPolicy::default().with_idempotency_key(false), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (req, send, _) = next(&mut handle).await;
    assert!(!req.headers().contains_key("x-idempotency-key"));
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn attempts_are_numbered_and_failed_instances_marked() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;

    let (req, send, _) = next(&mut handle).await;
    assert!(!req.headers().contains_key("grpc-previous-rpc-attempts"));
    assert!(!req.headers().contains_key("x-already-tried"));
    assert!(req.extensions().get::<AlreadyTried>().is_none());
    send.send_response(status_from("instance-a", Code::Unavailable));

    let (req, send, _) = next(&mut handle).await;
    assert_eq!(req.headers()["grpc-previous-rpc-attempts"], "1");
    assert_eq!(req.headers()["x-already-tried"], "instance-a");
    let tried = req.extensions().get::<AlreadyTried>().expect("typed mark");
    assert!(tried.contains("instance-a") && tried.len() == 1);
    send.send_response(status_from("instance-b", Code::Unavailable));

    let (req, send, _) = next(&mut handle).await;
    assert_eq!(req.headers()["grpc-previous-rpc-attempts"], "2");
    assert_eq!(req.headers()["x-already-tried"], "instance-a,instance-b");
    let tried: Vec<_> = req
        .extensions()
        .get::<AlreadyTried>()
        .unwrap()
        .iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(tried, ["instance-a", "instance-b"]);
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

/// What a retry sends beside the layer's own marks is the caller's request
/// as it was: method, URI, version, every value of every header in order
/// (a repeated header too, its sensitive flag kept) and the extensions.
#[tokio::test(start_paused = true)]
async fn a_retry_carries_the_callers_request_whole() {
    #[derive(Clone, Debug, PartialEq)]
    struct Tenant(&'static str);

    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    *req.version_mut() = http::Version::HTTP_2;
    req.headers_mut()
        .append("x-tag", HeaderValue::from_static("first"));
    req.headers_mut()
        .append("x-tag", HeaderValue::from_static("second"));
    let mut secret = HeaderValue::from_static("s3cret");
    secret.set_sensitive(true);
    req.headers_mut().insert("authorization", secret);
    req.extensions_mut().insert(Tenant("acme"));
    let call = spawn_call(&mut svc, req).await;

    let (first, send, _) = next(&mut handle).await;
    send.send_response(status_from("instance-a", Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    send.send_response(ok());
    call.await.unwrap().unwrap();

    assert_eq!(retry.method(), first.method());
    assert_eq!(retry.uri(), first.uri());
    assert_eq!(retry.version(), http::Version::HTTP_2);
    let tags: Vec<_> = retry.headers().get_all("x-tag").iter().collect();
    assert_eq!(tags, ["first", "second"]);
    assert!(retry.headers()["authorization"].is_sensitive());
    assert_eq!(retry.extensions().get::<Tenant>(), Some(&Tenant("acme")));
    // Every header of the first attempt is on the retry, once, with its
    // values; the retry adds only its marks.
    let mut expected = first.headers().clone();
    expected.insert("grpc-previous-rpc-attempts", HeaderValue::from_static("1"));
    expected.insert("x-already-tried", HeaderValue::from_static("instance-a"));
    assert_eq!(retry.headers(), &expected);
}

/// A caller's `x-already-tried` (merged with what the layer learns) is set
/// again on every retry where the caller put it, as `HeaderMap::insert`
/// does: the retries carry the first attempt's headers in its order.
#[tokio::test(start_paused = true)]
async fn a_callers_already_tried_mark_keeps_its_place_on_retries() {
    fn names(req: &Request<Body>) -> Vec<String> {
        req.headers()
            .keys()
            .map(|n| n.as_str().to_owned())
            .collect()
    }

    let policy = RetryPolicy::default().with_callers_mark_trusted(true);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let mut req = request();
    req.headers_mut()
        .insert("x-already-tried", HeaderValue::from_static("zone-x"));
    req.headers_mut()
        .insert("x-after", HeaderValue::from_static("1"));
    let call = spawn_call(&mut svc, req).await;

    let (first, send, _) = next(&mut handle).await;
    send.send_response(status_from("instance-a", Code::Unavailable));
    let (retry1, send, _) = next(&mut handle).await;
    send.send_response(status_from("instance-b", Code::Unavailable));
    let (retry2, send, _) = next(&mut handle).await;
    send.send_response(ok());
    call.await.unwrap().unwrap();

    assert_eq!(retry1.headers()["x-already-tried"], "zone-x,instance-a");
    assert_eq!(
        retry2.headers()["x-already-tried"],
        "zone-x,instance-a,instance-b"
    );
    let mut expected = names(&first);
    expected.push("grpc-previous-rpc-attempts".to_owned());
    assert_eq!(
        [names(&retry1), names(&retry2)],
        [expected.clone(), expected],
        "first and second retries"
    );
}

/// A request whose headers hold more values than a header map has room for
/// names (one name repeated past 24,576 values) is retried as any other:
/// the retry's map is never sized past what a map may reserve.
#[tokio::test(start_paused = true)]
async fn a_request_with_many_header_values_is_retried() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    for _ in 0..24_577 {
        req.headers_mut()
            .append("x-tag", HeaderValue::from_static("v"));
    }
    let call = spawn_call(&mut svc, req).await;

    let (first, send, _) = next(&mut handle).await;
    assert_eq!(first.headers().get_all("x-tag").iter().count(), 24_577);
    send.send_response(status(Code::Unavailable));
    let retry = tokio::time::timeout(Duration::from_secs(5), next(&mut handle)).await;
    let Ok((retry, send, _)) = retry else {
        let why = match call.await {
            Err(e) if e.is_panic() => "the call panicked".to_owned(),
            other => format!("{other:?}"),
        };
        panic!("no retry was sent: {why}");
    };
    assert_eq!(retry.headers().get_all("x-tag").iter().count(), 24_577);
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn resource_exhausted_waits_the_servers_retry_delay() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, t0) = next(&mut handle).await;
    let status = tonic::Status::with_error_details(
        Code::ResourceExhausted,
        "rate limited",
        ErrorDetails::with_retry_info(Some(Duration::from_millis(1_500))),
    );
    send.send_response(status.into_http());
    let (_, send, t1) = next(&mut handle).await;
    assert_eq!(
        t1 - t0,
        Duration::from_millis(1_500),
        "the server's delay, not the backoff"
    );
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn pushback_is_honoured_and_negative_pushback_stops() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call1 = spawn_call(&mut svc, request()).await;
    let (_, send, t0) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("1000"));
    send.send_response(r);
    let (_, send, t1) = next(&mut handle).await;
    assert_eq!(t1 - t0, Duration::from_secs(1));
    send.send_response(ok());
    call1.await.unwrap().unwrap();

    let call2 = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("-1"));
    send.send_response(r);
    assert_eq!(code_of(&call2.await.unwrap().unwrap()), Code::Unavailable);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(handle.next_request().now_or_never().is_none());
}

#[tokio::test(start_paused = true)]
async fn undecodable_status_details_are_dropped_before_tonic_sees_them() {
    let policy = RetryPolicy::new(1, 20 * MS, 500 * MS, 0.2).unwrap();
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut().insert(
        "grpc-status-details-bin",
        HeaderValue::from_static("@@not-base64@@"),
    );
    send.send_response(r);
    let response = call.await.unwrap().unwrap();
    assert!(!response.headers().contains_key("grpc-status-details-bin"));
    // tonic's own parser would have panicked on the original header.
    let status = tonic::Status::from_header_map(response.headers()).unwrap();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(status.message(), "from the server");
}

#[tokio::test(start_paused = true)]
async fn layer_made_errors_are_trailers_only_grpc_responses() {
    let policy = RetryPolicy::default();
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "10m")).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/grpc");
    assert_eq!(response.headers()["grpc-status"], "4");
    assert!(response.headers().contains_key("grpc-message"));
    assert!(response.into_body().frame().await.is_none(), "no body");
}

#[tokio::test(start_paused = true)]
async fn a_retry_replays_the_same_bytes_and_trailers() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let (tx, req) = streaming_request();
    for s in ["abc", "def"] {
        tx.send(data(s)).unwrap();
    }
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("6"));
    tx.send(Ok(Frame::trailers(trailers))).unwrap();
    drop(tx);
    let call = spawn_call(&mut svc, req).await;
    let mut bodies = Vec::new();
    for n in 0..2 {
        let (req, send, _) = next(&mut handle).await;
        let collected = req.into_body().collect().await.expect("whole body");
        bodies.push((collected.trailers().cloned(), collected.to_bytes()));
        send.send_response(if n == 0 {
            status(Code::Unavailable)
        } else {
            ok()
        });
    }
    call.await.unwrap().unwrap();
    assert_eq!(bodies[0].1, "abcdef");
    assert_eq!(bodies[1].1, "abcdef");
    assert_eq!(bodies[1].0.as_ref().unwrap()["x-checksum"], "6");
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_replay_limit_is_delivered_whole_and_not_retried() {
    let policy = RetryPolicy::default().with_replay_limit(8);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let (tx, req) = streaming_request();
    for s in ["0123", "4567", "89ab", "cdef"] {
        tx.send(data(s)).unwrap();
    }
    drop(tx);
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    let body = req.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "0123456789abcdef", "never truncated");
    send.send_response(status(Code::Unavailable));
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Unavailable);
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
}

#[tokio::test(start_paused = true)]
async fn a_streaming_body_is_not_held_back_until_it_ends() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    // The attempt arrives before the caller has sent anything.
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    tx.send(data("first")).unwrap();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "first");
    // The body is still open; the server answers anyway.
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    tx.send(data("second")).unwrap();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "second");
}

#[tokio::test(start_paused = true)]
async fn a_retry_mid_stream_replays_then_reads_on() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    tx.send(data("one,")).unwrap();
    assert_eq!(next_data(&mut body).await, "one,");
    send.send_response(status(Code::Unavailable));
    drop(body);
    let (req, send, _) = next(&mut handle).await;
    tx.send(data("two")).unwrap();
    drop(tx);
    let replayed = req.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(replayed, "one,two");
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn dropping_the_call_during_backoff_sends_nothing_more() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    // Let the layer decide to retry and start its backoff.
    tokio::time::sleep(5 * MS).await;
    call.abort();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        handle.next_request().now_or_never().is_none(),
        "a retry was sent after the drop"
    );
    // The token pays for an attempt really sent; none was.
    assert_eq!(
        layer.metrics().retries(),
        0,
        "a retry never sent was counted"
    );
    assert_eq!(layer.budget().available(), 100.0, "a token was lost");
}

#[tokio::test(start_paused = true)]
async fn dropping_the_call_cancels_the_attempt_in_flight() {
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let dropped = Arc::new(AtomicBool::new(false));
    let seen = dropped.clone();
    let inner = tower::service_fn(move |_req: Request<Body>| {
        let flag = Flag(seen.clone());
        async move {
            let _flag = flag;
            std::future::pending::<Result<Response<Body>, BoxError>>().await
        }
    });
    let mut svc = RetryLayer::new(RetryPolicy::default(), budget()).layer(inner);
    let fut = svc.ready().await.unwrap().call(request());
    let task = tokio::spawn(fut);
    tokio::time::sleep(10 * MS).await;
    assert!(!dropped.load(Ordering::SeqCst));
    task.abort();
    let _ = task.await;
    assert!(
        dropped.load(Ordering::SeqCst),
        "the attempt's future was not dropped"
    );
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

/// A code retried only with `RetryInfo` is not retried when an attempt ends
/// with no status at all (a transport error reads as UNAVAILABLE, a timeout as
/// DEADLINE_EXCEEDED): there is no RetryInfo to be had.
#[tokio::test(start_paused = true)]
async fn failures_without_a_status_follow_the_with_retry_info_rule() {
    let codes = RetryableCodes::empty().with_retry_info(Code::Unavailable);
    assert_eq!(
        codes.when(Code::Unavailable),
        Some(RetryWhen::WithRetryInfo)
    );
    let policy = RetryPolicy::default().with_retryable_codes(codes);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_error("connection refused");
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_eq!(
        layer.metrics().retries(),
        0,
        "a transport error: not retried"
    );

    let codes = RetryableCodes::empty().with_retry_info(Code::DeadlineExceeded);
    let policy = RetryPolicy::default()
        .with_retryable_codes(codes)
        .with_attempt_timeout(Duration::from_millis(100));
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, _never_answered, _) = next(&mut handle).await;
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(
        layer.metrics().retries(),
        0,
        "an attempt timeout: not retried"
    );
    assert!(
        handle.next_request().now_or_never().is_none(),
        "no second attempt"
    );
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
