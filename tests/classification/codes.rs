//! Which outcomes are retried and which end the call, and the status a
//! failure reaches the caller as. `tower-test` mocks under paused time.

use crate::support::{bounded_paused, policy, scripted, *};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use std::time::Duration;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{RetryLayer, RetryPolicy, RetryWhen, RetryableCodes};
use tower::{BoxError, Layer, Service, ServiceExt};

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
    let response = bounded_paused(call).await.unwrap().unwrap();
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
    // Found by the hostile-server fuzz (seed 5429): the last attempt's headers were
    // handed up without the repair every other answer gets.
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut last = status(Code::Unavailable);
    last.headers_mut()
        .insert("grpc-status-details-bin", HeaderValue::from_static("C"));
    send.send_response(last);
    handle.send_error("the buffer's worker is gone");
    let response = bounded_paused(call).await.unwrap().unwrap();
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
    let response = bounded_paused(call).await.unwrap().unwrap();
    let status = tonic::Status::from_header_map(response.headers()).unwrap();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains("worker is gone"), "{status:?}");
    assert_eq!(layer.metrics().attempts(), 0);
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

// ---------------------------------------------------------------------------
// The first attempt's readiness failure names the transport error
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_first_attempt_that_finds_no_server_names_the_error() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    handle.allow(0);
    let ready = svc.ready().await.expect("never holds the caller");
    let call = tokio::spawn(ready.call(request()));
    tokio::time::sleep(MS).await;
    handle.send_error("connection refused (os error 111)");
    handle.allow(1);
    let response = bounded_paused(call).await.unwrap().unwrap();
    let status = tonic::Status::from_header_map(response.headers()).unwrap();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("connection refused"),
        "the transport error is lost: {status:?}"
    );
}
