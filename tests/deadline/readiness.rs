//! Waiting for a saturated service below is charged to the deadline and to
//! the attempt timeout. `tower-test` mocks under paused time.

use crate::support::{bounded_paused, policy, *};
use tokio::time::Instant;
use tonic::Code;
use tonic_retry::RetryPolicy;
use tower::{Service, ServiceExt};

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
    let response = bounded_paused(call).await.unwrap().unwrap();
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
    let response = bounded_paused(call).await.unwrap().unwrap();
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
    assert_eq!(
        code_of(&bounded_paused(call).await.unwrap().unwrap()),
        Code::Ok
    );
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
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(
        message_of(&response).contains("attempt timed out after 100ms"),
        "{}",
        message_of(&response)
    );
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
}
