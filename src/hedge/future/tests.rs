//! The driver's steps, one by one, on paused time against a `tower-test`
//! mock: each test drives a hedged call's driver to the step it checks and
//! looks at what the step did.

use std::task::Waker;

use bytes::Bytes;
use http_body_util::Full;
use tonic::body::Body;
use tower::{Layer, ServiceExt};
use tower_test::mock;

use super::*;
use crate::budget::RetryBudget;
use crate::future::ResponseFuture;
use crate::hedge::HedgePolicy;
use crate::layer::RetryLayer;

const MS: Duration = Duration::from_millis(1);

type Mock = mock::Mock<Request<Body>, Response<Body>>;
type Handle = mock::Handle<Request<Body>, Response<Body>>;
type Call = Pin<Box<ResponseFuture<Mock, RetryBudget, Body, Body>>>;

/// A hedged call of `policy` (no extra-load cap) through a mock, not yet
/// polled, and the mock's handle.
async fn hedged_call(policy: HedgePolicy, body: Body) -> (Call, Handle) {
    hedged_with(policy.with_max_extra_load(None).unwrap(), body).await
}

async fn hedged_with(policy: impl Into<crate::MethodPolicies>, body: Body) -> (Call, Handle) {
    let (mock, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let layer = RetryLayer::new(policy, RetryBudget::new(200, 0.1).unwrap());
    let mut service = layer.layer(mock);
    let mut req = Request::new(body);
    *req.uri_mut() = "/library.v1.Library/GetBook".parse().unwrap();
    req.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    let call = service.ready().await.unwrap().call(req);
    (Box::pin(call), handle)
}

fn whole() -> Body {
    Body::new(Full::new(Bytes::from_static(b"\0\0\0\0\x01x")))
}

/// A Trailers-Only answer with `code`, and `pushback` if given.
fn status(code: u8, pushback: Option<&'static str>) -> Response<Body> {
    let mut response = ok();
    response
        .headers_mut()
        .insert(GRPC_STATUS, HeaderValue::from(u16::from(code)));
    if let Some(ms) = pushback {
        response
            .headers_mut()
            .insert("grpc-retry-pushback-ms", HeaderValue::from_static(ms));
    }
    response
}

/// Response headers without a status: the call is committed.
fn ok() -> Response<Body> {
    let mut response = Response::new(Body::empty());
    response
        .headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    response
}

fn cx() -> Context<'static> {
    Context::from_waker(Waker::noop())
}

/// Sends what is due and lets the mock take the attempts started.
fn step(driver: &mut HedgeFuture<Mock, Body, RetryBudget, crate::metrics::NoMetrics>) {
    driver.poll_timer(&mut cx());
    driver.send_due(&mut cx());
    let _ = driver.poll_attempts(&mut cx());
}

#[tokio::test(start_paused = true)]
async fn send_due_sends_the_first_attempt_at_once_and_a_hedge_at_its_delay() {
    let (mut call, mut handle) = hedged_call(HedgePolicy::new(3, 10 * MS).unwrap(), whole()).await;
    let driver = call.as_mut().hedge_driver().expect("a hedged call");
    assert!(driver.send_due(&mut cx()), "the first attempt goes at once");
    assert_eq!(driver.started, 1);
    assert!(!driver.send_due(&mut cx()), "the hedge waits for its delay");
    let _ = driver.poll_attempts(&mut cx());
    let (_, _first) = handle.next_request().await.unwrap();

    tokio::time::advance(9 * MS).await;
    driver.poll_timer(&mut cx());
    assert!(!driver.due, "not before the delay");
    tokio::time::advance(MS).await;
    driver.poll_timer(&mut cx());
    assert!(driver.due, "due at the delay");
    assert!(driver.send_due(&mut cx()));
    assert_eq!(driver.started, 2);
    assert_eq!(driver.inflight.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn send_due_sends_no_more_than_the_policys_attempts() {
    let (mut call, _handle) =
        hedged_call(HedgePolicy::new(2, Duration::ZERO).unwrap(), whole()).await;
    let driver = call.as_mut().hedge_driver().unwrap();
    for _ in 0..4 {
        step(driver);
    }
    assert_eq!(driver.started, 2);
    assert!(!driver.send_due(&mut cx()));
}

#[tokio::test(start_paused = true)]
async fn a_body_not_all_there_when_the_hedge_is_due_stops_the_hedges_and_is_released_to_the_attempt_sent()
 {
    let (tx, rx) =
        tokio::sync::mpsc::unbounded_channel::<Result<http_body::Frame<Bytes>, tower::BoxError>>();
    let body = Body::new(http_body_util::StreamBody::new(
        tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
    ));
    let (mut call, mut handle) = hedged_call(HedgePolicy::new(3, 10 * MS).unwrap(), body).await;
    let driver = call.as_mut().hedge_driver().unwrap();
    step(driver);
    let (_, _first) = handle.next_request().await.unwrap();
    tokio::time::advance(10 * MS).await;
    step(driver);
    assert!(
        driver.frozen && driver.streaming,
        "a streaming body is not hedged"
    );
    assert_eq!(driver.started, 1);
    driver.release_to_last();
    assert!(
        driver.template.is_none(),
        "released to the one attempt left"
    );
    drop(tx);
}

#[tokio::test(start_paused = true)]
async fn an_answer_with_headers_commits_and_the_other_attempts_are_handed_to_their_drains() {
    let (mut call, mut handle) = hedged_call(HedgePolicy::new(3, 10 * MS).unwrap(), whole()).await;
    let driver = call.as_mut().hedge_driver().unwrap();
    step(driver);
    let (_, _first) = handle.next_request().await.unwrap();
    tokio::time::advance(10 * MS).await;
    step(driver);
    let (_, second) = handle.next_request().await.unwrap();
    second.send_response(ok());
    let Polled::Done(response) = driver.poll_attempts(&mut cx()) else {
        panic!("the answer commits the call");
    };
    assert_eq!(response.status(), http::StatusCode::OK);
    assert!(driver.inflight.is_empty(), "the loser went to its drain");
    assert!(
        driver.template.is_none(),
        "the body is released to the winner"
    );
    assert_eq!(
        response
            .headers()
            .get(PREVIOUS_ATTEMPTS)
            .map(|v| v.as_bytes()),
        Some(&b"1"[..]),
        "one attempt came before the winner"
    );
}

#[tokio::test(start_paused = true)]
async fn a_non_fatal_answer_makes_the_next_hedge_due_at_once() {
    let (mut call, mut handle) = hedged_call(HedgePolicy::new(3, 10 * MS).unwrap(), whole()).await;
    let driver = call.as_mut().hedge_driver().unwrap();
    step(driver);
    let (_, first) = handle.next_request().await.unwrap();
    first.send_response(status(14, None));
    assert!(matches!(
        driver.poll_attempts(&mut cx()),
        Polled::Progressed
    ));
    assert!(driver.due, "due before its delay");
    assert!(driver.send_due(&mut cx()));
    assert_eq!(driver.started, 2);
}

#[tokio::test(start_paused = true)]
async fn pushback_puts_the_next_hedge_at_the_servers_delay() {
    let (mut call, mut handle) = hedged_call(HedgePolicy::new(3, 10 * MS).unwrap(), whole()).await;
    let driver = call.as_mut().hedge_driver().unwrap();
    step(driver);
    let (_, first) = handle.next_request().await.unwrap();
    first.send_response(status(14, Some("30")));
    let _ = driver.poll_attempts(&mut cx());
    assert!(!driver.due && driver.pushed);
    tokio::time::advance(10 * MS).await;
    driver.poll_timer(&mut cx());
    assert!(!driver.due, "the hedge's own delay no longer counts");
    tokio::time::advance(20 * MS).await;
    driver.poll_timer(&mut cx());
    assert!(driver.due, "due at the server's delay");
}

#[tokio::test(start_paused = true)]
async fn pushback_of_minus_one_stops_the_hedges() {
    let (mut call, mut handle) = hedged_call(HedgePolicy::new(3, 10 * MS).unwrap(), whole()).await;
    let driver = call.as_mut().hedge_driver().unwrap();
    step(driver);
    let (_, first) = handle.next_request().await.unwrap();
    first.send_response(status(14, Some("-1")));
    let _ = driver.poll_attempts(&mut cx());
    assert!(driver.frozen);
    tokio::time::advance(10 * MS).await;
    driver.poll_timer(&mut cx());
    assert!(!driver.send_due(&mut cx()));
}

#[tokio::test(start_paused = true)]
async fn with_nothing_in_flight_and_nothing_to_send_the_call_ends_with_the_last_answer_marked() {
    let (mut call, mut handle) = hedged_call(HedgePolicy::new(2, 10 * MS).unwrap(), whole()).await;
    let driver = call.as_mut().hedge_driver().unwrap();
    step(driver);
    let (_, first) = handle.next_request().await.unwrap();
    first.send_response(status(14, None));
    let _ = driver.poll_attempts(&mut cx());
    assert!(
        driver.end_if_over(&mut cx()).is_none(),
        "a hedge may still go"
    );
    step(driver);
    let (_, second) = handle.next_request().await.unwrap();
    second.send_response(status(14, None));
    let _ = driver.poll_attempts(&mut cx());
    let response = driver.end_if_over(&mut cx()).expect("nothing more to send");
    assert_eq!(response.headers().get(GRPC_STATUS).unwrap(), "14");
    assert_eq!(
        response.headers().get("grpc-retry-pushback-ms").unwrap(),
        "-1",
        "a call that hedged gives up marked for the layers above"
    );
}

#[tokio::test(start_paused = true)]
async fn the_deadline_ends_the_attempts_in_flight_with_deadline_exceeded() {
    let policy = crate::RetryPolicy::from(
        HedgePolicy::new(3, 10 * MS)
            .unwrap()
            .with_max_extra_load(None)
            .unwrap(),
    )
    .with_total_timeout(100 * MS);
    let (mut call, mut handle) = hedged_with(policy, whole()).await;
    let driver = call.as_mut().hedge_driver().unwrap();
    step(driver);
    let (_, _first) = handle.next_request().await.unwrap();
    tokio::time::advance(10 * MS).await;
    step(driver);
    let (_, _second) = handle.next_request().await.unwrap();
    tokio::time::advance(90 * MS).await;
    let Polled::Done(response) = driver.poll_attempts(&mut cx()) else {
        panic!("the deadline ends the call");
    };
    assert_eq!(response.headers().get(GRPC_STATUS).unwrap(), "4");
    assert!(driver.inflight.is_empty() && driver.template.is_none());
    assert_eq!(driver.sent, 2, "both attempts sent are counted");
}

#[test]
fn a_call_is_marked_given_up_once_it_hedged_or_a_hedge_was_refused() {
    let policy = crate::RetryPolicy::default();
    for (sent, refused, marked) in [
        (0, false, false),
        (0, true, false),
        (1, false, false),
        (1, true, true),
        (2, false, true),
        (5, true, true),
    ] {
        assert_eq!(
            gives_up_marked(&policy, sent, refused),
            marked,
            "sent {sent}, refused {refused}"
        );
    }
    let off = policy.with_retry_at_one_layer(false);
    assert!(!gives_up_marked(&off, 2, true));
}
