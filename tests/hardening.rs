//! The promises that matter under overload, on long streams and against
//! hostile servers, against
//! `tower-test` mocks under paused tokio time: every wait is virtual and exact.

mod support;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{RetryLayer, RetryPolicy, marks::AlreadyTried, marks::PickedInstance};
use tower::{BoxError, Layer, Service, ServiceExt};

use support::*;

/// Every call here ends in well under this much virtual time; a hang fails
/// the test instead of stalling it.
async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(3600), f)
        .await
        .expect("the call hung")
}

fn policy(attempts: u32) -> RetryPolicy {
    RetryPolicy::new(attempts, 20 * MS, 500 * MS, 0.2).unwrap()
}

/// A `grpc-status-details-bin` value carrying a RetryInfo with a raw delay.
fn retry_info(seconds: i64, nanos: i32) -> HeaderValue {
    use base64::Engine as _;
    use prost::Message as _;
    let info = tonic_types::pb::RetryInfo {
        retry_delay: Some(prost_types::Duration { seconds, nanos }),
    };
    let status = tonic_types::pb::Status {
        code: 8,
        message: "slow down".into(),
        details: vec![prost_types::Any {
            type_url: tonic_types::RetryInfo::TYPE_URL.into(),
            value: info.encode_to_vec(),
        }],
    };
    let encoded = base64::engine::general_purpose::STANDARD.encode(status.encode_to_vec());
    HeaderValue::try_from(encoded).unwrap()
}

// ---------------------------------------------------------------------------
// The deadline bounds everything the call does
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_retry_waiting_for_a_saturated_service_ends_at_the_deadline() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "200m")).await;
    let (_, send, _) = next(&mut handle).await;
    // The service below saturates: no attempt can be sent any more.
    handle.allow(0);
    send.send_response(status(Code::Unavailable));
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), 200 * MS, "ended at the deadline");
    assert_eq!(layer.metrics().retries(), 0, "no retry was sent");
    assert_eq!(layer.budget().available(), 100.0, "no token was spent");
}

#[tokio::test(start_paused = true)]
async fn a_first_attempt_waiting_for_a_saturated_service_ends_at_the_deadline() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    handle.allow(0);
    let start = Instant::now();
    // The caller is not held in `poll_ready`: the deadline is in the request.
    let ready = svc.ready().await.expect("never holds the caller");
    let call = tokio::spawn(ready.call(with_timeout(request(), "150m")));
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), 150 * MS);
    assert!(
        handle.next_request().now_or_never().is_none(),
        "nothing was sent"
    );
}

#[tokio::test(start_paused = true)]
async fn a_service_that_becomes_ready_in_time_gets_the_attempt() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    handle.allow(0);
    let start = Instant::now();
    let call = tokio::spawn(
        svc.ready()
            .await
            .unwrap()
            .call(with_timeout(request(), "1S")),
    );
    tokio::time::sleep(300 * MS).await;
    handle.allow(1);
    let (req, send, _) = next(&mut handle).await;
    // Sent with the time left after the wait, not the whole second.
    let sent = parse_timeout(req.headers()["grpc-timeout"].to_str().unwrap());
    assert!(sent <= 700 * MS && sent > 699 * MS, "grpc-timeout {sent:?}");
    send.send_response(ok());
    assert_eq!(code_of(&bounded(call).await.unwrap().unwrap()), Code::Ok);
    assert_eq!(start.elapsed(), 300 * MS);
}

#[tokio::test(start_paused = true)]
async fn readiness_for_a_retry_is_cut_by_the_attempt_timeout_too() {
    // No deadline: only the per-attempt timeout bounds each wait.
    let policy = policy(3).with_attempt_timeout(100 * MS);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    handle.allow(0);
    send.send_response(status(Code::Unavailable));
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(
        message_of(&response).contains("attempt timed out after 100ms"),
        "{}",
        message_of(&response)
    );
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
}

#[tokio::test(start_paused = true)]
async fn a_readiness_error_on_a_retry_ends_with_the_last_status_and_spends_no_token() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut last = status_from("instance-a", Code::Unavailable);
    last.headers_mut()
        .insert("x-detail", HeaderValue::from_static("kept"));
    send.send_response(last);
    handle.send_error("the buffer's worker is gone");
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_eq!(message_of(&response), "from the server");
    assert_eq!(
        response.headers()["x-detail"],
        "kept",
        "the server's answer"
    );
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
}

#[tokio::test(start_paused = true)]
async fn the_last_status_given_after_a_readiness_error_is_safe_for_tonic() {
    // Found by tests/hostile.rs (seed 5429): the last attempt's headers were
    // handed up without the repair every other answer gets.
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut last = status(Code::Unavailable);
    last.headers_mut()
        .insert("grpc-status-details-bin", HeaderValue::from_static("C"));
    send.send_response(last);
    handle.send_error("the buffer's worker is gone");
    let response = bounded(call).await.unwrap().unwrap();
    let status = tonic::Status::from_header_map(response.headers()).expect("no panic");
    assert_eq!(status.code(), Code::Unavailable);
    assert!(response.headers().get("grpc-status-details-bin").is_none());
}

#[tokio::test(start_paused = true)]
async fn a_readiness_error_before_the_first_attempt_is_unavailable_naming_it() {
    // The caller is never held in `poll_ready`, so a service that fails while
    // the first attempt waits for it fails inside the call.
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    handle.allow(0);
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    tokio::time::sleep(10 * MS).await;
    handle.send_error("the buffer's worker is gone");
    let response = bounded(call).await.unwrap().unwrap();
    let status = tonic::Status::from_header_map(response.headers()).unwrap();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains("worker is gone"), "{status:?}");
    assert_eq!(layer.metrics().attempts(), 0);
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
    let first = bounded(body.frame()).await.unwrap().unwrap();
    assert!(first.is_data());
    // The server stalls with the stream open.
    let last = bounded(body.frame()).await.unwrap().unwrap();
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
async fn a_server_delay_beyond_the_cap_ends_the_call_with_the_servers_status() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut().insert(
        "grpc-retry-pushback-ms",
        HeaderValue::from_static("4000000000"),
    );
    send.send_response(r);
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_eq!(message_of(&response), "from the server");
    assert_eq!(start.elapsed(), Duration::ZERO, "no wait at all");
    assert_eq!(layer.metrics().attempts(), 1);

    // The same for a RetryInfo delay (a million seconds, valid but absurd).
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut r = status(Code::ResourceExhausted);
    r.headers_mut()
        .insert("grpc-status-details-bin", retry_info(1_000_000, 0));
    send.send_response(r);
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::ResourceExhausted);
    assert_eq!(start.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn a_larger_cap_lets_a_long_server_delay_be_waited_for() {
    let policy = RetryPolicy::default().with_max_server_delay(Duration::from_secs(60));
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, t0) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("45000"));
    send.send_response(r);
    let (_, send, t1) = next(&mut handle).await;
    assert_eq!(t1 - t0, Duration::from_secs(45));
    send.send_response(ok());
    assert_eq!(code_of(&bounded(call).await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn a_server_delay_beyond_the_deadline_ends_with_deadline_exceeded_at_once() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "1S")).await;
    let (_, send, _) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("5000"));
    send.send_response(r);
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(layer.metrics().refused_by_deadline(), 1);
}

/// A service answering each attempt as `answer` says, after `delay`.
fn scripted<F>(
    delay: Duration,
    answer: F,
) -> impl Service<Request<Body>, Response = Response<Body>, Error = BoxError, Future: Send>
+ Clone
+ Send
+ 'static
where
    F: Fn(usize) -> Result<Response<Body>, BoxError> + Clone + Send + Sync + 'static,
{
    let n = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    tower::service_fn(move |_req: Request<Body>| {
        let i = n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let answer = answer.clone();
        async move {
            tokio::time::sleep(delay).await;
            answer(i)
        }
    })
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
    let response = bounded(layer.layer(inner).oneshot(request()))
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
        assert!(bounded(body.frame()).await.unwrap().unwrap().is_data());
        tokio::time::sleep_until(start + at).await;
        tx.send(end()).unwrap();
        drop(tx);
        let last = bounded(body.frame()).await.unwrap();
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
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(handle.next_request().now_or_never().is_none());
    assert_eq!(layer.metrics().attempts(), 0, "no attempt was sent");
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
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
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::ResourceExhausted);
    assert!(message_of(&response).contains("attempt 1 ended with UNAVAILABLE"));
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.metrics().refused_by_budget(), 1);
    assert!(handle.next_request().now_or_never().is_none());
}

// ---------------------------------------------------------------------------
// What the caller sees when the attempts found no server
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn attempts_that_find_no_server_end_as_unavailable() {
    for attempts in [1, 3] {
        let inner = scripted(MS, |_| Err("connection reset by peer".into()));
        let layer = RetryLayer::new(policy(attempts), budget());
        let response = layer.layer(inner).oneshot(request()).await.unwrap();
        let status = tonic::Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            status.message().contains("connection reset by peer"),
            "{status:?}"
        );
        if attempts > 1 {
            assert!(status.message().contains("attempt 3"), "{status:?}");
        }
        assert_eq!(layer.metrics().attempts(), u64::from(attempts));
    }
}

#[tokio::test(start_paused = true)]
async fn an_error_carrying_a_status_is_that_status() {
    let inner = scripted(MS, |_| {
        Err(Box::new(tonic::Status::permission_denied("no entry")) as BoxError)
    });
    let layer = RetryLayer::new(policy(3), budget());
    let response = layer.layer(inner).oneshot(request()).await.unwrap();
    assert_eq!(code_of(&response), Code::PermissionDenied);
    assert_eq!(message_of(&response), "no entry");
    assert_eq!(layer.metrics().attempts(), 1);
}

// ---------------------------------------------------------------------------
// Metadata read exactly as the client will read it
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn statuses_tonic_reads_as_unknown_are_final_and_never_successes() {
    for raw in ["014", "00", "+14", " 14"] {
        let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
        let call = spawn_call(&mut svc, request()).await;
        let (_, send, _) = next(&mut handle).await;
        let mut r = ok();
        r.headers_mut()
            .insert("grpc-status", HeaderValue::from_str(raw).unwrap());
        send.send_response(r);
        let response = call.await.unwrap().unwrap();
        assert_eq!(
            tonic::Status::from_header_map(response.headers())
                .unwrap()
                .code(),
            Code::Unknown
        );
        assert_eq!(layer.metrics().attempts(), 1, "{raw:?} was retried");
        assert_eq!(layer.budget().available(), 100.0, "{raw:?} deposited");
    }
}

#[tokio::test(start_paused = true)]
async fn an_html_page_is_not_a_success() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(
        Response::builder()
            .header("content-type", "text/html")
            .body(Body::new(http_body_util::Full::new(Bytes::from_static(
                b"<html>gateway says hi</html>",
            ))))
            .unwrap(),
    );
    call.await.unwrap().unwrap();
    assert_eq!(layer.metrics().attempts(), 1);
    assert_eq!(layer.budget().available(), 100.0, "an HTML page deposited");
}

/// One unary call by tonic's own client through the layer, answered with
/// `answer`: the code tonic reports.
async fn tonic_call(svc: Svc, handle: &mut Handle, answer: Response<Body>) -> Code {
    let call = tokio::spawn(async move {
        let mut grpc = tonic::client::Grpc::new(svc);
        grpc.ready().await.expect("ready");
        let path = http::uri::PathAndQuery::from_static("/library.v1.Library/GetBook");
        let codec = tonic_prost::ProstCodec::<(), ()>::default();
        grpc.unary(tonic::Request::new(()), path, codec).await
    });
    let (_, send, _) = next(handle).await;
    send.send_response(answer);
    match call.await.expect("the call task") {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    }
}

/// tonic's client reports any code as UNKNOWN when `grpc-message` does not
/// percent-decode to UTF-8: such a call is no success, and no retry either.
#[tokio::test(start_paused = true)]
async fn a_message_tonic_cannot_decode_is_unknown_to_the_layer_too() {
    let half_full = tonic_retry::RetryBudget::new(10, 1.0).unwrap();
    let (svc, mut handle, layer) = setup(RetryPolicy::default(), half_full);
    let start = layer.budget().available();
    let mut committed = answer(Code::Ok);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    trailers.insert("grpc-message", HeaderValue::from_static("%FF"));
    let data = Frame::data(Bytes::from_static(b"\0\0\0\0\0"));
    *committed.body_mut() = Body::new(http_body_util::StreamBody::new(tokio_stream::iter([
        Ok::<_, tonic::Status>(data),
        Ok(Frame::trailers(trailers)),
    ])));
    assert_eq!(tonic_call(svc, &mut handle, committed).await, Code::Unknown);
    assert_eq!(layer.budget().available(), start, "no credit for UNKNOWN");

    let (svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let mut unavailable = status(Code::Unavailable);
    unavailable
        .headers_mut()
        .insert("grpc-message", HeaderValue::from_static("%FF"));
    assert_eq!(
        tonic_call(svc, &mut handle, unavailable).await,
        Code::Unknown
    );
    assert_eq!(layer.metrics().attempts(), 1, "UNKNOWN is final");
    assert_eq!(layer.metrics().retries(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_retry_info_at_i64_min_neither_panics_nor_retries() {
    for (seconds, nanos) in [
        (i64::MIN, 0),
        (i64::MIN, i32::MIN),
        (0, -5),
        (1, 2_000_000_000),
    ] {
        let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
        let call = spawn_call(&mut svc, request()).await;
        let (_, send, _) = next(&mut handle).await;
        let mut r = status(Code::ResourceExhausted);
        r.headers_mut()
            .insert("grpc-status-details-bin", retry_info(seconds, nanos));
        send.send_response(r);
        let response = call.await.unwrap().expect("no panic");
        assert_eq!(code_of(&response), Code::ResourceExhausted);
        assert_eq!(layer.metrics().attempts(), 1, "({seconds}, {nanos})");
    }
}

#[tokio::test(start_paused = true)]
async fn an_empty_idempotency_key_is_replaced() {
    for generate in [true, false] {
        let (mut svc, mut handle, _) = setup(
            RetryPolicy::default().with_idempotency_key(generate),
            budget(),
        );
        let mut req = request();
        req.headers_mut()
            .insert("x-idempotency-key", HeaderValue::from_static(""));
        let call = spawn_call(&mut svc, req).await;
        let (req, send, _) = next(&mut handle).await;
        assert_eq!(req.headers()["x-idempotency-key"].len(), 32);
        send.send_response(ok());
        call.await.unwrap().unwrap();
    }
}

// ---------------------------------------------------------------------------
// The already-tried loop without a response
// ---------------------------------------------------------------------------

/// Plays a balancer below the layer: reports picking `instance` in the
/// request's `PickedInstance`, then hands the request to the mock.
fn picks(instance: &'static str) -> impl Fn(Request<Body>) -> Request<Body> + Clone {
    move |req: Request<Body>| {
        if let Some(picked) = req.extensions().get::<PickedInstance>() {
            picked.set(HeaderValue::from_static(instance));
        }
        req
    }
}

#[tokio::test(start_paused = true)]
async fn an_attempt_cut_by_the_attempt_timeout_names_its_instance() {
    let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let layer = RetryLayer::new(policy(3).with_attempt_timeout(100 * MS), budget());
    let mut svc = layer.layer(tower::util::MapRequest::new(mock, picks("slow-a")));
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    let (first, _never_answered, _) = next(&mut handle).await;
    assert!(first.headers().get("x-already-tried").is_none());
    let (retry, send, _) = next(&mut handle).await;
    assert_eq!(retry.headers()["x-already-tried"], "slow-a");
    assert!(
        retry
            .extensions()
            .get::<AlreadyTried>()
            .unwrap()
            .contains("slow-a")
    );
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn a_transport_error_names_its_instance() {
    let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let layer = RetryLayer::new(policy(3), budget());
    let mut svc = layer.layer(tower::util::MapRequest::new(mock, picks("gone-b")));
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    let (_, send, _) = next(&mut handle).await;
    send.send_error("connection refused");
    let (retry, send, _) = next(&mut handle).await;
    assert_eq!(retry.headers()["x-already-tried"], "gone-b");
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn a_callers_attempt_count_never_reaches_the_first_attempt() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    req.headers_mut()
        .insert("grpc-previous-rpc-attempts", HeaderValue::from_static("7"));
    let call = spawn_call(&mut svc, req).await;
    let (first, send, _) = next(&mut handle).await;
    assert!(first.headers().get("grpc-previous-rpc-attempts").is_none());
    send.send_response(status(Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    let counts: Vec<_> = retry
        .headers()
        .get_all("grpc-previous-rpc-attempts")
        .iter()
        .collect();
    assert_eq!(counts, ["1"]);
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_callers_already_tried_mark_is_merged_and_bounded() {
    let policy = RetryPolicy::default().with_callers_mark_trusted(true);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let mut req = request();
    let junk = format!("x, has space ,{},y", "z".repeat(500));
    req.headers_mut()
        .insert("x-already-tried", HeaderValue::try_from(junk).unwrap());
    let call = spawn_call(&mut svc, req).await;
    let (first, send, _) = next(&mut handle).await;
    assert_eq!(first.headers()["x-already-tried"], "x,y");
    let mark = first.extensions().get::<AlreadyTried>().unwrap();
    assert_eq!(mark.iter().collect::<Vec<_>>(), ["x", "y"]);
    send.send_response(status_from("a", Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    assert_eq!(retry.headers()["x-already-tried"], "x,y,a");
    let mark = retry.extensions().get::<AlreadyTried>().unwrap();
    assert_eq!(mark.iter().collect::<Vec<_>>(), ["x", "y", "a"]);
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_callers_already_tried_header_is_removed_unless_trusted() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    req.headers_mut()
        .insert("x-already-tried", HeaderValue::from_static("x,y"));
    // The mark set in process is honoured, whatever the setting.
    let mut own = AlreadyTried::default();
    own.insert("z");
    req.extensions_mut().insert(own);
    let call = spawn_call(&mut svc, req).await;
    let (first, send, _) = next(&mut handle).await;
    assert_eq!(first.headers()["x-already-tried"], "z");
    let mark = first.extensions().get::<AlreadyTried>().unwrap();
    assert_eq!(mark.iter().collect::<Vec<_>>(), ["z"]);
    send.send_response(status_from("a", Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    assert_eq!(retry.headers()["x-already-tried"], "z,a");
    send.send_response(ok());
    call.await.unwrap().unwrap();

    // A header alone: gone from every attempt.
    let mut req = request();
    req.headers_mut()
        .insert("x-already-tried", HeaderValue::from_static("x,y"));
    let call = spawn_call(&mut svc, req).await;
    let (first, send, _) = next(&mut handle).await;
    assert!(first.headers().get("x-already-tried").is_none());
    assert!(first.extensions().get::<AlreadyTried>().is_none());
    send.send_response(status(Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    assert!(retry.headers().get("x-already-tried").is_none());
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_huge_instance_id_from_a_server_is_skipped() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut().insert(
        "x-instance-id",
        HeaderValue::try_from("i".repeat(100_000)).unwrap(),
    );
    send.send_response(r);
    let (retry, send, _) = next(&mut handle).await;
    assert!(retry.headers().get("x-already-tried").is_none());
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

// ---------------------------------------------------------------------------
// Replay memory ends when retries end
// ---------------------------------------------------------------------------

/// A chunk of fresh memory, and a handle that tells whether anyone else still
/// holds it.
fn fresh_chunk(i: usize) -> (Bytes, Bytes) {
    let chunk = Bytes::from(format!("chunk {i}").into_bytes());
    (chunk.clone(), chunk)
}

#[tokio::test(start_paused = true)]
async fn once_the_call_commits_the_replay_copy_goes_and_nothing_more_is_copied() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    let (sent, mut mine) = fresh_chunk(0);
    tx.send(Ok(Frame::data(sent))).unwrap();
    drop(body.frame().await.unwrap().unwrap());
    assert!(
        !mine.is_unique(),
        "kept for a retry while none has answered"
    );
    // Response headers: the call is committed, no retry can follow.
    send.send_response(ok());
    call.await.unwrap().unwrap();
    assert!(mine.is_unique(), "the copy was released at the commit");
    for i in 1..200 {
        let (sent, chunk) = fresh_chunk(i);
        tx.send(Ok(Frame::data(sent))).unwrap();
        drop(body.frame().await.unwrap().unwrap());
        mine = chunk;
        assert!(mine.is_unique(), "chunk {i} was copied after the commit");
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_with_one_attempt_keeps_its_copy_only_until_its_answer_starts() {
    // A stream the server refuses is sent again whatever the policy, so a
    // call of one attempt keeps a copy too, but only until the answer
    // starts: then nothing is kept, and nothing more is copied.
    let (mut svc, mut handle, _) = setup(policy(1), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    let (sent, mine) = fresh_chunk(0);
    tx.send(Ok(Frame::data(sent))).unwrap();
    drop(body.frame().await.unwrap().unwrap());
    assert!(!mine.is_unique(), "kept while the stream may be refused");
    send.send_response(ok());
    call.await.unwrap().unwrap();
    assert!(mine.is_unique(), "the copy was released at the answer");
    let (sent, next) = fresh_chunk(1);
    tx.send(Ok(Frame::data(sent))).unwrap();
    drop(body.frame().await.unwrap().unwrap());
    assert!(next.is_unique(), "a chunk was copied after the answer");
}

#[tokio::test(start_paused = true)]
async fn the_last_attempt_drops_the_copy_once_its_answer_starts() {
    let (mut svc, mut handle, _) = setup(policy(2), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    let (sent, first) = fresh_chunk(0);
    tx.send(Ok(Frame::data(sent))).unwrap();
    drop(body.frame().await.unwrap().unwrap());
    drop(body);
    send.send_response(status(Code::Unavailable));
    // The second and last attempt replays the first chunk, then reads on;
    // the copy is kept while its stream may still be refused.
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    drop(body.frame().await.unwrap().unwrap());
    let (sent, second) = fresh_chunk(1);
    tx.send(Ok(Frame::data(sent))).unwrap();
    drop(body.frame().await.unwrap().unwrap());
    send.send_response(ok());
    call.await.unwrap().unwrap();
    assert!(first.is_unique(), "the copy outlived the answer");
    assert!(second.is_unique(), "the copy outlived the answer");
    let (sent, third) = fresh_chunk(2);
    tx.send(Ok(Frame::data(sent))).unwrap();
    drop(body.frame().await.unwrap().unwrap());
    assert!(third.is_unique(), "a chunk was copied after the answer");
}
