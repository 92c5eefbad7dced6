//! The waits between attempts: jittered exponential backoff, the server's
//! pushback and `RetryInfo`, and their caps. `tower-test` mocks under paused
//! time.

use crate::support::{bounded_paused, *};
use http::HeaderValue;
use std::time::Duration;
use tokio::time::Instant;
use tonic::Code;
use tonic_retry::RetryPolicy;
use tonic_types::{ErrorDetails, StatusExt};

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
    let response = bounded_paused(call).await.unwrap().unwrap();
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
    let response = bounded_paused(call).await.unwrap().unwrap();
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
    assert_eq!(
        code_of(&bounded_paused(call).await.unwrap().unwrap()),
        Code::Ok
    );
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
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(layer.metrics().refused_by_deadline(), 1);
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

/// A server asks for the largest pushback there is (u64::MAX ms), and the
/// layer's cap is lifted. Without a deadline the call waits, as asked,
/// sending nothing more; with one (however far), the delay is beyond it and
/// the call ends at once with DEADLINE_EXCEEDED. No overflow either way.
#[tokio::test(start_paused = true)]
async fn huge_server_delays_with_no_cap_and_no_deadline() {
    let huge = || {
        let mut r = status(Code::Unavailable);
        r.headers_mut().insert(
            "grpc-retry-pushback-ms",
            HeaderValue::from_static("18446744073709551615"),
        );
        r
    };
    let policy = RetryPolicy::default().with_max_server_delay(Duration::MAX);
    let (mut svc, mut handle, _) = setup(policy.clone(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(huge());
    tokio::time::sleep(Duration::from_secs(10 * 365 * 24 * 3600)).await;
    assert!(!call.is_finished(), "still waiting, as the server asked");
    assert!(handle.next_request().now_or_never().is_none());
    call.abort();

    let (mut svc, mut handle, _) = setup(policy, budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "99999999H")).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(huge());
    let r = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&r), Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), Duration::ZERO, "at once");
}
