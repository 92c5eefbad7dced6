//! `grpc-timeout` says the time left on every attempt, at the edges of its
//! format. `tower-test` mocks under paused time.

use crate::support::{bounded_paused, policy, *};
use std::time::Duration;
use tokio::time::Instant;
use tonic::Code;
use tonic_retry::RetryPolicy;

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
async fn a_total_timeout_applies_when_the_request_has_none() {
    let policy = RetryPolicy::default().with_total_timeout(300 * MS);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, request()).await;
    let (req, _never, _) = next(&mut handle).await;
    assert_eq!(req.headers()["grpc-timeout"], "300000u");
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
}

/// `grpc-timeout` at the ends of its range: zero (nothing is sent), one
/// nanosecond, and the largest values of each unit (sent on, with a
/// `grpc-timeout` no longer than the caller's).
#[tokio::test(start_paused = true)]
async fn grpc_timeout_edges() {
    for t in ["0n", "00000000n"] {
        let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
        let call = spawn_call(&mut svc, with_timeout(request(), t)).await;
        let r = bounded_paused(call).await.unwrap().unwrap();
        assert_eq!(code_of(&r), Code::DeadlineExceeded, "{t}");
        assert!(handle.next_request().now_or_never().is_none(), "{t}: sent");
        assert_eq!(layer.metrics().attempts(), 0, "{t}");
    }
    for t in ["1n", "99999999H", "99999999M"] {
        let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
        let call = spawn_call(&mut svc, with_timeout(request(), t)).await;
        let (req, send) = handle
            .next_request()
            .now_or_never()
            .flatten()
            .expect("sent at once");
        let sent = req.headers()["grpc-timeout"].to_str().unwrap().to_owned();
        assert!(sent.len() <= 9, "{t}: sent {sent:?}");
        let caller = parse_timeout(t);
        assert!(parse_timeout(&sent) <= caller, "{t}: sent {sent:?}");
        send.send_response(ok());
        let r = bounded_paused(call).await.unwrap().unwrap();
        assert_eq!(code_of(&r), Code::Ok, "{t}");
    }
}

/// A sub-millisecond deadline: an answer arriving exactly at it is not cut
/// early; the call is cut on the first tick at or after it.
#[tokio::test(start_paused = true)]
async fn sub_millisecond_deadline_and_answer_at_the_deadline() {
    let (mut svc, mut handle, _) = setup(policy(3), budget());
    let start = Instant::now();
    let call = spawn_call(&mut svc, with_timeout(request(), "1500u")).await;
    let (_, send, _) = next(&mut handle).await;
    tokio::time::advance(Duration::from_micros(1500)).await;
    send.send_response(ok());
    assert_eq!(
        code_of(&bounded_paused(call).await.unwrap().unwrap()),
        Code::Ok
    );

    let call = spawn_call(&mut svc, with_timeout(request(), "1500u")).await;
    let t = Instant::now();
    let (_, _send, _) = next(&mut handle).await;
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(
        t.elapsed() >= Duration::from_micros(1500) && t.elapsed() < 3 * MS,
        "{:?}",
        t.elapsed()
    );
    let _ = start;
}

/// A sub-millisecond per-attempt timeout is never cut early.
#[tokio::test(start_paused = true)]
async fn sub_millisecond_attempt_timeout() {
    let (mut svc, mut handle, layer) = setup(
        policy(3).with_attempt_timeout(Duration::from_micros(700)),
        budget(),
    );
    let call = spawn_call(&mut svc, request()).await;
    let (req, send, t0) = next(&mut handle).await;
    // The attempt's own limit stays with the client (the server is sent the
    // call's deadline, and this call has none).
    assert!(req.headers().get("grpc-timeout").is_none());
    tokio::time::advance(Duration::from_micros(699)).await;
    send.send_response(ok());
    assert_eq!(
        code_of(&bounded_paused(call).await.unwrap().unwrap()),
        Code::Ok
    );
    assert!(t0.elapsed() < Duration::from_micros(700));
    assert_eq!(layer.metrics().attempts(), 1);
}
