//! Hedged bodies read ahead, proxy answers handed up as gRPC statuses, and
//! the hedge driver's deadline bookkeeping,
//! each against the retry path where it has one. Mocks under paused time.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body_util::BodyExt;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{HedgePolicy, ResponseBody, RetryLayer, RetryPolicy};
use tower::{Layer, Service, ServiceExt};
use tower_test::mock;

type Call = tokio::task::JoinHandle<Outcome>;

fn hedge(attempts: u32, delay_ms: u64) -> HedgePolicy {
    HedgePolicy::new(attempts, Duration::from_millis(delay_ms))
        .unwrap()
        .with_max_extra_load(None)
        .unwrap()
}

async fn start(svc: &mut Svc, req: Request<Body>) -> Call {
    let ready = svc.ready().await.unwrap();
    tokio::spawn(ready.call(req))
}

/// A complete body of `chunks`, with no size hint (as tonic's bodies).
fn unsized_body(chunks: Vec<Bytes>) -> Body {
    let frames: Vec<Result<http_body::Frame<Bytes>, tonic::Status>> = chunks
        .into_iter()
        .map(|c| Ok(http_body::Frame::data(c)))
        .collect();
    Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)))
}

fn unsized_request(chunks: Vec<Bytes>) -> Request<Body> {
    let mut req = with_timeout(request(), "1S");
    *req.body_mut() = unsized_body(chunks);
    req
}

/// A retried call's copy goes as soon as its body outgrows the limit.
#[tokio::test(start_paused = true)]
async fn a_retried_calls_copy_past_the_limit_goes_at_once() {
    let policy = RetryPolicy::default().with_replay_limit(4);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let (big, freed) = watched_chunk(64 * 1024);
    let call = start(
        &mut svc,
        unsized_request(vec![Bytes::from_static(b"abc"), big]),
    )
    .await;
    let (r1, a1, _) = next(&mut handle).await;
    let sent = r1.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(sent.len(), 3 + 64 * 1024);
    drop(sent);
    settle().await;
    assert_eq!(layer.replay_memory_in_use(), 0, "copy released");
    assert!(freed.load(Ordering::SeqCst), "the big chunk is not held");
    a1.send_response(ok());
    call.await.unwrap().unwrap();
}

/// A hedged call whose body was read ahead past the replay limit can hedge no
/// more: once its one attempt has sent the whole body, the copy goes (the
/// layer memory it reserved, and the chunk past the limit), not at the
/// call's end.
#[tokio::test(start_paused = true)]
async fn a_copy_read_ahead_past_the_limit_goes_once_the_body_is_sent() {
    let small = hedge(2, 10).with_settings_of(&RetryPolicy::default().with_replay_limit(4));
    let (mut svc, mut handle, layer) = setup(small.into(), budget());
    let (big, freed) = watched_chunk(64 * 1024);
    let call = start(
        &mut svc,
        unsized_request(vec![Bytes::from_static(b"abc"), big]),
    )
    .await;
    let (r1, a1, _) = next(&mut handle).await;
    // The hedge is due at 10 ms: the driver reads the body ahead, and finds
    // it over the limit; no hedge.
    tokio::time::sleep(50 * MS).await;
    assert!(handle.next_request().now_or_never().is_none(), "no hedge");
    // The one attempt sends the whole body.
    let sent = r1.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(sent.len(), 3 + 64 * 1024);
    drop(sent);
    settle().await;
    // The server is slow to answer; meanwhile, what does the call hold?
    tokio::time::sleep(500 * MS).await;
    let in_use = layer.replay_memory_in_use();
    let big_freed = freed.load(Ordering::SeqCst);
    a1.send_response(ok());
    call.await.unwrap().unwrap();
    assert_eq!(
        (in_use, big_freed),
        (0, true),
        "(layer memory in use, chunk past the limit freed) while the call waits for its answer"
    );
}

fn unavailable_with_pushback(ms: &'static str) -> Response<Body> {
    let mut r = status(Code::Unavailable);
    r.headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static(ms));
    r
}

/// A retried call whose last attempt answers UNAVAILABLE with a pushback
/// past the deadline ends with that status: no attempt was left to refuse.
#[tokio::test(start_paused = true)]
async fn a_retried_call_with_no_attempt_left_ends_with_the_last_status() {
    let policy = exact_policy(2);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let call = start(&mut svc, with_timeout(request(), "100m")).await;
    let (_, a1, _) = next(&mut handle).await;
    a1.send_response(status(Code::Unavailable));
    let (_, a2, _) = next(&mut handle).await;
    a2.send_response(unavailable_with_pushback("500"));
    let response = call.await.unwrap().unwrap();
    ends_unavailable_unrefused(&response, &layer);
}

/// So does a hedged call ("with the last status ... as for retries"):
/// both attempts of a two-attempt hedge were sent, one answers UNAVAILABLE
/// with a pushback past the deadline, the other UNAVAILABLE. No hedge was
/// refused, nothing ran out of time.
#[tokio::test(start_paused = true)]
async fn a_hedged_call_with_no_attempt_left_ends_with_the_last_status_despite_a_pushback_past_its_deadline()
 {
    let (mut svc, mut handle, layer) = setup(hedge(2, 0).into(), budget());
    let call = start(&mut svc, with_timeout(request(), "100m")).await;
    let (_, a1, _) = next(&mut handle).await;
    let (_, a2, _) = next(&mut handle).await;
    a1.send_response(unavailable_with_pushback("500"));
    settle().await;
    a2.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    ends_unavailable_unrefused(&response, &layer);
}

/// The call ended with the last attempt's UNAVAILABLE, and nothing was
/// counted refused by the deadline.
fn ends_unavailable_unrefused<B>(response: &Response<B>, layer: &RetryLayer) {
    let got = (
        code_of(response),
        message_of(response),
        layer.metrics().refused_by_deadline(),
    );
    assert_eq!(
        (got.0, got.2),
        (Code::Unavailable, 0),
        "caller got {got:?}: (code, message, refused_by_deadline)"
    );
}

fn http_503_marked() -> Response<Body> {
    Response::builder()
        .status(503)
        .header("grpc-retry-pushback-ms", "-1")
        .body(Body::empty())
        .unwrap()
}

/// One layer: the mark on a 503 (no grpc-status) is not retried here
/// (RetriedBelow), and must still be on what is handed up.
#[tokio::test(start_paused = true)]
async fn a_503_marked_do_not_retry_keeps_its_mark_when_retried() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = start(&mut svc, request()).await;
    let (_, a1, _) = next(&mut handle).await;
    a1.send_response(http_503_marked());
    let response = call.await.unwrap().unwrap();
    assert_eq!(layer.metrics().retried_below(), 1, "not retried here");
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_marked(&response);
}

#[tokio::test(start_paused = true)]
async fn a_503_marked_do_not_retry_keeps_its_mark_when_hedged() {
    let (mut svc, mut handle, _layer) = setup(hedge(2, 1000).into(), budget());
    let call = start(&mut svc, request()).await;
    let (_, a1, _) = next(&mut handle).await;
    a1.send_response(http_503_marked());
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Unavailable);
    assert!(
        handle.next_request().now_or_never().is_none(),
        "not hedged: the mark stops hedges"
    );
    assert_marked(&response);
}

/// The "do not retry" mark is on what is handed up.
fn assert_marked<B>(response: &Response<B>) {
    let mark = response.headers().get("grpc-retry-pushback-ms");
    assert_eq!(
        mark.map(|v| v.to_str().unwrap()),
        Some("-1"),
        "the do-not-retry mark handed up; headers: {:?}",
        response.headers()
    );
}

/// Two layers stacked ("Every A6 client (... this layer) then passes
/// the failure up without retrying it"): the server sends one marked 503,
/// and must see one attempt in all.
#[tokio::test(start_paused = true)]
async fn stacked_layers_do_not_retry_a_marked_503() {
    let policy = exact_policy(3);
    let lower = RetryLayer::new(policy.clone(), budget());
    let upper = RetryLayer::new(policy, budget());
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = upper.layer(lower.layer(inner));
    let ready = svc.ready().await.unwrap();
    let call = tokio::spawn(ready.call(request()));
    let mut attempts = 0;
    loop {
        tokio::select! {
            got = handle.next_request() => {
                let (_, send) = got.unwrap();
                attempts += 1;
                send.send_response(http_503_marked());
            }
            _ = tokio::time::sleep(Duration::from_secs(5)) => break,
        }
    }
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_eq!(attempts, 1, "the server was sent {attempts} attempts");
}

#[tokio::test(start_paused = true)]
async fn a_body_error_read_ahead_reaches_the_first_attempt_as_the_callers_error() {
    let (mut svc, mut handle, _layer) = setup(hedge(2, 10).into(), budget());
    let frames: Vec<Result<http_body::Frame<Bytes>, tonic::Status>> = vec![
        Ok(http_body::Frame::data(Bytes::from_static(b"abc"))),
        Err(tonic::Status::internal("the caller's body broke")),
    ];
    let mut req = with_timeout(request(), "1S");
    *req.body_mut() = Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)));
    let call = start(&mut svc, req).await;
    let (r1, a1, _) = next(&mut handle).await;
    tokio::time::sleep(50 * MS).await; // the hedge was due: read ahead
    let mut body = r1.into_body();
    assert_eq!(next_data(&mut body).await, "abc");
    let err = body.frame().await.unwrap().unwrap_err();
    let text = err.to_string();
    a1.send_response(ok());
    call.await.unwrap().unwrap();
    assert!(
        text.contains("the caller's body broke"),
        "the first attempt's body failed with: {text:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_hedge_refused_for_a_body_read_ahead_past_the_limit_is_counted() {
    let small = hedge(2, 1000).with_settings_of(&RetryPolicy::default().with_replay_limit(4));
    let (mut svc, mut handle, layer) = setup(small.into(), budget());
    let call = start(
        &mut svc,
        unsized_request(vec![Bytes::from_static(b"0123456789")]),
    )
    .await;
    let (_r1, a1, _) = next(&mut handle).await;
    // Non-fatal at once: the next hedge is due now, and the body (read ahead)
    // is over the limit.
    a1.send_response(status(Code::Unavailable));
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Unavailable);
    assert!(handle.next_request().now_or_never().is_none());
    assert_eq!(layer.metrics().body_too_large(), 1, "counted");
}

#[tokio::test(start_paused = true)]
async fn five_attempts_at_once_all_send_the_body_read_ahead_with_its_trailers() {
    let (mut svc, mut handle, _layer) = setup(hedge(5, 0).into(), budget());
    let mut t = http::HeaderMap::new();
    t.insert("x-sum", HeaderValue::from_static("9"));
    let frames: Vec<Result<http_body::Frame<Bytes>, tonic::Status>> = vec![
        Ok(http_body::Frame::data(Bytes::from_static(b"ab"))),
        Ok(http_body::Frame::data(Bytes::from_static(b"cd"))),
        Ok(http_body::Frame::trailers(t)),
    ];
    let mut req = with_timeout(request(), "1S");
    *req.body_mut() = Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)));
    let call = start(&mut svc, req).await;
    let mut sends = Vec::new();
    let mut bodies = Vec::new();
    for _ in 0..5 {
        let (r, s, _) = next(&mut handle).await;
        bodies.push(r.into_body());
        sends.push(s);
    }
    for b in bodies.into_iter().rev() {
        let c = b.collect().await.unwrap();
        assert_eq!(c.trailers().unwrap()["x-sum"], "9");
        assert_eq!(c.to_bytes(), "abcd");
    }
    sends.pop().unwrap().send_response(ok());
    call.await.unwrap().unwrap();
}

/// A body of known size within the call's limit is hedged side by side
/// before it is complete only if the layer's replay memory can hold all of
/// it: with the layer's memory too small, it is not hedged (counted
/// and said), and its one attempt sends it whole.
#[tokio::test(start_paused = true)]
async fn a_body_of_known_size_the_layers_memory_cannot_hold_is_not_hedged() {
    let layer = RetryLayer::new(hedge(2, 0), crate::support::budget()).with_replay_memory(8);
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let req = with_timeout(request(), "1S"); // a 10-byte body, its size known
    let call = start(&mut svc, req).await;
    let (r1, a1, _) = next(&mut handle).await;
    settle().await;
    assert!(
        handle.next_request().now_or_never().is_none(),
        "no hedge: the layer cannot hold the copy"
    );
    assert_eq!(layer.metrics().body_too_large(), 1, "counted");
    let sent = r1.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(sent.len(), 10, "sent whole: {sent:?}");
    a1.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    assert_eq!(layer.replay_memory_in_use(), 0);
}

/// With room for it, the same body is hedged at once, and both attempts
/// send all of it while the layer holds its copy.
#[tokio::test(start_paused = true)]
async fn a_body_of_known_size_is_hedged_with_its_copy_reserved_whole() {
    let layer = RetryLayer::new(hedge(2, 0), crate::support::budget()).with_replay_memory(10);
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let call = start(&mut svc, with_timeout(request(), "1S")).await;
    let (r1, a1, _) = next(&mut handle).await;
    let (r2, _a2, _) = next(&mut handle).await;
    assert_eq!(layer.replay_memory_in_use(), 10, "reserved whole, ahead");
    let first = r1.into_body().collect().await.unwrap().to_bytes();
    let second = r2.into_body().collect().await.unwrap().to_bytes();
    assert_eq!((first.len(), second.len()), (10, 10));
    assert_eq!(first, second);
    a1.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    settle().await;
    assert_eq!(layer.replay_memory_in_use(), 0);
}

/// A retried call whose body outgrew its replay limit cannot retry: a
/// pushback past its deadline refuses nothing, and it ends with the last
/// status.
#[tokio::test(start_paused = true)]
async fn a_retried_call_whose_body_cannot_be_resent_ends_with_the_last_status_despite_a_pushback_past_its_deadline()
 {
    let policy = exact_policy(3).with_replay_limit(4);
    let (response, _, layer) = over_the_limit_then_pushed_past_the_deadline(policy).await;
    ends_unavailable_unrefused(&response, &layer);
}

/// A call under `policy` (replay limit 4, deadline 100 ms) whose only
/// attempt sends its 10-byte body whole and answers UNAVAILABLE with a
/// pushback of 500 ms: what the caller got, the service and its mock
/// (both kept, so the mock can still tell that no hedge was sent), the layer.
async fn over_the_limit_then_pushed_past_the_deadline(
    policy: RetryPolicy,
) -> (Response<ResponseBody<Body>>, (Svc, Handle), RetryLayer) {
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let call = start(&mut svc, with_timeout(request(), "100m")).await;
    let (r1, a1, _) = next(&mut handle).await;
    let sent = r1.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(sent.len(), 10);
    a1.send_response(unavailable_with_pushback("500"));
    (call.await.unwrap().unwrap(), (svc, handle), layer)
}

/// Nor can a hedged one hedge: the same.
#[tokio::test(start_paused = true)]
async fn a_hedged_call_whose_body_cannot_be_resent_ends_with_the_last_status_despite_a_pushback_past_its_deadline()
 {
    let small = hedge(3, 1000).with_settings_of(&RetryPolicy::default().with_replay_limit(4));
    let (response, (_svc, mut handle), layer) =
        over_the_limit_then_pushed_past_the_deadline(small.into()).await;
    assert!(handle.next_request().now_or_never().is_none(), "no hedge");
    ends_unavailable_unrefused(&response, &layer);
}

/// A request whose body's size hint is only an upper bound (`Limited`).
fn limited_request(payload: &'static [u8], upper: usize) -> Request<Body> {
    let frames: Vec<Result<http_body::Frame<Bytes>, tonic::Status>> =
        vec![Ok(http_body::Frame::data(Bytes::from_static(payload)))];
    let inner = http_body_util::StreamBody::new(tokio_stream::iter(frames));
    let body = http_body_util::Limited::new(inner, upper);
    let mut req = with_timeout(request(), "1S");
    *req.body_mut() = Body::new(body);
    req
}

/// An upper bound is not a size: a body whose hint is loose is not taken to
/// fit, and reserves only what its copy holds.
#[tokio::test(start_paused = true)]
async fn a_loose_size_hint_reserves_no_layer_memory_the_copy_does_not_hold() {
    let layer = RetryLayer::new(hedge(2, 0), budget()).with_replay_memory(1500);
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let first = start(&mut svc, limited_request(b"0123456789", 1000)).await;
    let (ra1, sa1, _) = next(&mut handle).await;
    let (ra2, _sa2, _) = next(&mut handle).await;
    let in_use_after_first = layer.replay_memory_in_use();
    let second = start(&mut svc, limited_request(b"abcdefghij", 1000)).await;
    let (rb1, sb1, _) = next(&mut handle).await;
    settle().await;
    let second_hedged = handle.next_request().now_or_never().is_some();
    let too_large = layer.metrics().body_too_large();
    // Clean up.
    for r in [ra1, ra2, rb1] {
        let _ = r.into_body().collect().await;
    }
    sa1.send_response(ok());
    sb1.send_response(ok());
    let _ = first.await;
    let _ = second.await;
    assert_eq!(
        (second_hedged, too_large),
        (true, 0),
        "(second call hedged, body_too_large); layer memory held for the first \
         call's 10-byte body: {in_use_after_first}"
    );
}

/// A hedged call that can hedge no more (its body streams), with one attempt
/// left, holds no copy of its stream.
#[tokio::test(start_paused = true)]
async fn a_hedged_stream_that_can_hedge_no_more_holds_no_copy() {
    let (mut svc, mut handle, layer) = setup(hedge(2, 10).into(), budget());
    let (tx, mut req) = streaming_request();
    req.headers_mut()
        .insert("grpc-timeout", HeaderValue::from_static("10S"));
    let call = start(&mut svc, req).await;
    let (r1, a1, _) = next(&mut handle).await;
    let mut body = r1.into_body();
    tx.send(Ok(http_body::Frame::data(Bytes::from(vec![b'x'; 1024]))))
        .unwrap();
    assert_eq!(next_data(&mut body).await.len(), 1024);
    // The hedge is due at 10 ms: the body is a stream, not all there: no
    // hedge, ever. The call can no longer be hedged nor retried.
    tokio::time::sleep(50 * MS).await;
    assert!(handle.next_request().now_or_never().is_none(), "no hedge");
    // A long client stream goes on through its one attempt.
    for _ in 0..200 {
        tx.send(Ok(http_body::Frame::data(Bytes::from(vec![b'y'; 1024]))))
            .unwrap();
        assert_eq!(next_data(&mut body).await.len(), 1024);
    }
    let in_use = layer.replay_memory_in_use();
    drop(tx);
    let _ = body.collect().await;
    a1.send_response(ok());
    call.await.unwrap().unwrap();
    assert_eq!(
        in_use, 0,
        "bytes of replay memory held by a call that can no longer be hedged or retried"
    );
}

/// A proxy's answer handed up as a gRPC status keeps its other headers, every
/// value of each, and drops what described the page and any status details.
#[tokio::test(start_paused = true)]
async fn a_proxy_answer_keeps_every_value_of_a_repeated_header_and_drops_its_details() {
    let (mut svc, mut handle, _layer) = setup(RetryPolicy::default(), budget());
    let call = start(&mut svc, request()).await;
    let (_, a1, _) = next(&mut handle).await;
    let resp = Response::builder()
        .status(403)
        .header("x-instance-id", "a")
        .header("x-instance-id", "b")
        .header("x-other", "1")
        .header("x-instance-id", "c")
        .header("grpc-status-details-bin", "AAAA")
        .header("grpc-message", "junk%")
        .header("content-type", "text/html")
        .header("content-length", "0")
        .body(Body::empty())
        .unwrap();
    a1.send_response(resp);
    let response = call.await.unwrap().unwrap();
    let h = response.headers();
    let ids: Vec<_> = h.get_all("x-instance-id").iter().collect();
    assert_eq!(ids, ["a", "b", "c"], "{h:?}");
    assert_eq!(h.get_all("x-other").iter().count(), 1, "{h:?}");
    assert!(h.get("grpc-status-details-bin").is_none(), "{h:?}");
    assert_eq!(h.get_all("content-type").iter().count(), 1, "{h:?}");
    assert_eq!(h.get_all("grpc-message").iter().count(), 1, "{h:?}");
    assert!(h.get("content-length").is_none(), "{h:?}");
    assert_eq!(code_of(&response), Code::PermissionDenied);
}

/// A hedge that loses is drained, not reset: its request body must still be
/// there to send after another attempt committed, or the transport fails the
/// body and resets the stream after all ("Cancelled losers never cost
/// a connection").
#[tokio::test(start_paused = true)]
async fn a_loser_that_has_yet_to_send_its_body_sends_it_whole_after_the_commit() {
    let (mut svc, mut handle, layer) = setup(hedge(2, 0).into(), budget());
    let call = start(&mut svc, with_timeout(request(), "1S")).await;
    let (r1, a1, _) = next(&mut handle).await;
    let (r2, _a2, _) = next(&mut handle).await;
    let first = r1.into_body().collect().await.unwrap().to_bytes();
    a1.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the loser drains");
    let second = r2.into_body().collect().await.map(|c| c.to_bytes());
    assert_eq!(
        second.as_ref().ok(),
        Some(&first),
        "the loser's body: {second:?}"
    );
}
