//! Hedging, one behaviour a test, under paused time: the
//! schedule, what commits, non-fatal answers, pushback, the budget and the
//! extra-load cap, the deadline, what every hedge carries, bodies, and the
//! call's end.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::support::*;
use http::{HeaderValue, Request, Response};
use http_body_util::BodyExt;
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{HedgePolicy, RetryBudget, RetryLayer, RetryPolicy, RetryService};
use tower::{BoxError, Layer, Service, ServiceExt};
use tower_test::mock;

/// Marks its attempt's future dropped.
struct Flag(Arc<AtomicBool>);

impl Drop for Flag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The mock, with a flag per attempt that says its future was dropped: the
/// attempt was cancelled (or finished).
#[derive(Clone)]
struct Watched {
    inner: mock::Mock<Request<Body>, Response<Body>>,
    dropped: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
}

impl Service<Request<Body>> for Watched {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let flag = Arc::new(AtomicBool::new(false));
        self.dropped.lock().unwrap().push(flag.clone());
        let future = self.inner.call(req);
        Box::pin(async move {
            let _flag = Flag(flag);
            future.await
        })
    }
}

type Hedged = RetryService<Watched>;

struct Setup {
    svc: Hedged,
    handle: Handle,
    layer: RetryLayer,
    dropped: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
}

fn hedged(policy: impl Into<tonic_retry::MethodPolicies>, budget: RetryBudget) -> Setup {
    let layer = RetryLayer::new(policy, budget);
    let (inner, handle) = mock::pair();
    let dropped = Arc::default();
    let watched = Watched {
        inner,
        dropped: Arc::clone(&dropped),
    };
    Setup {
        svc: layer.layer(watched),
        handle,
        layer,
        dropped,
    }
}

fn policy(attempts: u32, delay_ms: u64) -> HedgePolicy {
    HedgePolicy::new(attempts, Duration::from_millis(delay_ms))
        .unwrap()
        .with_max_extra_load(None)
        .unwrap()
}

async fn start(
    setup: &mut Setup,
    req: Request<Body>,
) -> tokio::task::JoinHandle<Result<Response<tonic_retry::ResponseBody<Body>>, BoxError>> {
    let svc = setup.svc.ready().await.expect("never holds the caller");
    tokio::spawn(svc.call(req))
}

/// The next attempt, and when it arrived.
async fn arrives(
    handle: &mut Handle,
) -> (Request<Body>, mock::SendResponse<Response<Body>>, Instant) {
    next(handle).await
}

fn nothing_more(handle: &mut Handle) -> bool {
    handle.next_request().now_or_never().is_none()
}

fn dropped(setup: &Setup, attempt: usize) -> bool {
    setup.dropped.lock().unwrap()[attempt].load(Ordering::SeqCst)
}

#[tokio::test(start_paused = true)]
async fn an_attempt_is_sent_every_delay_up_to_max_attempts() {
    let mut s = hedged(policy(3, 10), budget());
    let t0 = Instant::now();
    let call = start(&mut s, request()).await;
    let (_, _a1, at1) = arrives(&mut s.handle).await;
    let (_, _a2, at2) = arrives(&mut s.handle).await;
    let (_, a3, at3) = arrives(&mut s.handle).await;
    assert_eq!(at1 - t0, Duration::ZERO, "the first at once");
    assert_eq!(at2 - t0, 10 * MS);
    assert_eq!(at3 - t0, 20 * MS);
    tokio::time::sleep(100 * MS).await;
    assert!(nothing_more(&mut s.handle), "no more than max_attempts");
    a3.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    assert_eq!(s.layer.metrics().hedges(), 2);
    assert_eq!(s.layer.metrics().retries(), 0, "hedges are not retries");
    // Every attempt sent counts, the two losers too.
    assert_eq!(s.layer.metrics().attempts(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_zero_delay_sends_every_attempt_at_once() {
    let mut s = hedged(policy(3, 0), budget());
    let t0 = Instant::now();
    let call = start(&mut s, request()).await;
    for _ in 0..3 {
        let (_, send, at) = arrives(&mut s.handle).await;
        assert_eq!(at, t0);
        drop(send);
    }
    assert!(nothing_more(&mut s.handle));
    call.abort();
}

#[tokio::test(start_paused = true)]
async fn headers_commit_and_the_other_attempts_are_cancelled() {
    let mut s = hedged(policy(3, 10), budget());
    let call = start(&mut s, request()).await;
    let (_, slow, _) = arrives(&mut s.handle).await;
    let (_, fast, _) = arrives(&mut s.handle).await;
    fast.send_response(answer(Code::Ok));
    let response = call.await.unwrap().unwrap();
    assert_eq!(read_to_end(response).await, Code::Ok);
    // The slow attempt is no longer the call's: it is drained, not reset.
    assert!(!dropped(&s, 0), "the slow attempt's stream is left to end");
    assert_eq!(s.layer.metrics().draining(), 1);
    tokio::time::sleep(100 * MS).await;
    assert!(nothing_more(&mut s.handle), "no hedge after the commit");
    // Its answer ends the drain; it reaches nobody and credits nothing.
    slow.send_response(answer(Code::Ok));
    settle().await;
    assert!(dropped(&s, 0));
    let m = s.layer.metrics();
    assert_eq!((m.draining(), m.drained(), m.drain_cut()), (0, 1, 0));
    // The committed call ended OK: the budget earned its deposit, once.
    assert_eq!(s.layer.budget().available(), 99.1);
}

/// A loser that never answers is drained no longer than the call's deadline
/// (the `grpc-timeout` its server was sent): then its stream is reset.
#[tokio::test(start_paused = true)]
async fn a_loser_that_never_answers_is_reset_at_the_deadline() {
    let mut s = hedged(policy(2, 10), budget());
    let t0 = Instant::now();
    let call = start(&mut s, with_timeout(request(), "1S")).await;
    let (_, _stuck, _) = arrives(&mut s.handle).await;
    let (_, fast, _) = arrives(&mut s.handle).await;
    fast.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(call.await.unwrap().unwrap()).await, Code::Ok);
    tokio::time::sleep_until(t0 + 999 * MS).await;
    settle().await;
    assert!(!dropped(&s, 0), "drained until the deadline");
    tokio::time::sleep_until(t0 + 1002 * MS).await;
    settle().await;
    assert!(dropped(&s, 0), "reset at the deadline");
    let m = s.layer.metrics();
    assert_eq!((m.draining(), m.drained(), m.drain_cut()), (0, 0, 1));
}

#[tokio::test(start_paused = true)]
async fn a_fatal_status_commits_too() {
    let mut s = hedged(policy(3, 10), budget());
    let call = start(&mut s, request()).await;
    let (_, _a1, _) = arrives(&mut s.handle).await;
    let (_, a2, _) = arrives(&mut s.handle).await;
    a2.send_response(status(Code::NotFound));
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::NotFound);
    assert!(!dropped(&s, 0), "the other attempt is drained, not reset");
    assert_eq!(s.layer.metrics().draining(), 1);
    assert!(nothing_more(&mut s.handle));
    assert_eq!(
        s.layer.metrics().marked(),
        0,
        "a fatal answer is not marked"
    );
}

#[tokio::test(start_paused = true)]
async fn a_non_fatal_answer_sends_the_next_hedge_at_once() {
    let mut s = hedged(policy(3, 50), budget());
    let t0 = Instant::now();
    let call = start(&mut s, request()).await;
    let (_, a1, _) = arrives(&mut s.handle).await;
    tokio::time::sleep(5 * MS).await;
    a1.send_response(status(Code::Unavailable));
    let (_, a2, at2) = arrives(&mut s.handle).await;
    assert_eq!(at2 - t0, 5 * MS, "not after the 50 ms delay");
    // The next hedge resumes the delay from there.
    let (_, a3, at3) = arrives(&mut s.handle).await;
    assert_eq!(at3 - t0, 55 * MS);
    a3.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    drop(a2);
}

#[tokio::test(start_paused = true)]
async fn pushback_delays_the_next_hedge_or_stops_hedging() {
    // n ms: the next hedge n ms after the answer.
    let mut s = hedged(policy(3, 50), budget());
    let t0 = Instant::now();
    let call = start(&mut s, request()).await;
    let (_, a1, _) = arrives(&mut s.handle).await;
    let mut pushed = status(Code::Unavailable);
    pushed
        .headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("30"));
    a1.send_response(pushed);
    let (_, a2, at2) = arrives(&mut s.handle).await;
    assert_eq!(at2 - t0, 30 * MS);
    a2.send_response(ok());
    call.await.unwrap().unwrap();

    // −1: no more hedges; the attempts in flight go on.
    let mut s = hedged(policy(3, 10), budget());
    let call = start(&mut s, request()).await;
    let (_, a1, _) = arrives(&mut s.handle).await;
    let (_, a2, _) = arrives(&mut s.handle).await;
    let mut stop = status(Code::Unavailable);
    stop.headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("-1"));
    a2.send_response(stop);
    tokio::time::sleep(100 * MS).await;
    assert!(nothing_more(&mut s.handle), "no third attempt");
    assert!(!dropped(&s, 0), "the first attempt goes on");
    a1.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn no_token_no_hedge() {
    // Half of one token: the first attempt goes, no hedge can be paid for.
    let poor = RetryBudget::new(1, 0.001).unwrap();
    let mut s = hedged(policy(3, 10), poor);
    let call = start(&mut s, request()).await;
    let (_, a1, _) = arrives(&mut s.handle).await;
    tokio::time::sleep(100 * MS).await;
    assert!(nothing_more(&mut s.handle), "no hedge without a token");
    a1.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    assert_eq!(s.layer.metrics().hedges(), 0);
    assert_eq!(s.layer.metrics().refused_by_budget(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_extra_load_cap_bounds_hedges_however_large_the_budget() {
    // A 10 % cap: the account starts with 50 hedges saved (of the 100 it
    // can save for a burst), and earns a tenth of one per call.
    let capped = HedgePolicy::new(2, Duration::from_millis(10))
        .unwrap()
        .with_max_extra_load(Some(0.1))
        .unwrap();
    let mut s = hedged(capped, RetryBudget::new(1000, 1.0).unwrap());
    let mut hedges = 0;
    for _ in 0..500 {
        let call = start(&mut s, request()).await;
        let (_, a1, _) = arrives(&mut s.handle).await;
        tokio::time::sleep(20 * MS).await;
        if let Some(Some((_, a2))) = s.handle.next_request().now_or_never() {
            hedges += 1;
            drop(a2);
        }
        a1.send_response(ok());
        call.await.unwrap().unwrap();
    }
    // 50 saved, then 0.1 per call: at most 50 + 500 × 0.1 = 100 of 500 calls.
    assert!(
        hedges <= 100,
        "{hedges} hedges for 500 calls under a 10 % cap"
    );
    assert!(hedges >= 99, "the cap allows its share: {hedges}");
    assert_eq!(s.layer.metrics().hedges(), hedges);
    assert_eq!(s.layer.metrics().hedges_capped(), 500 - hedges);
}

#[tokio::test(start_paused = true)]
async fn every_attempt_runs_under_the_calls_deadline() {
    let mut s = hedged(policy(3, 30), budget());
    let t0 = Instant::now();
    let call = start(&mut s, with_timeout(request(), "100m")).await;
    let (r1, _a1, _) = arrives(&mut s.handle).await;
    let (r2, _a2, _) = arrives(&mut s.handle).await;
    let (r3, _a3, _) = arrives(&mut s.handle).await;
    let left = |r: &Request<Body>| parse_timeout(r.headers()["grpc-timeout"].to_str().unwrap());
    assert_eq!(left(&r1), 100 * MS);
    assert_eq!(left(&r2), 70 * MS, "the time left when the hedge was sent");
    assert_eq!(left(&r3), 40 * MS);
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(Instant::now() - t0 <= 101 * MS, "ended at the deadline");
}

#[tokio::test(start_paused = true)]
async fn no_hedge_is_sent_without_the_minimum_attempt_budget() {
    let mut s = hedged(policy(3, 40), budget());
    let call = start(&mut s, with_timeout(request(), "50m")).await;
    let (_, _a1, _) = arrives(&mut s.handle).await;
    // At 40 ms only 10 ms are left: below the 20 ms minimum, no hedge.
    tokio::time::sleep(45 * MS).await;
    assert!(nothing_more(&mut s.handle));
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(s.layer.metrics().hedges(), 0);
}

#[tokio::test(start_paused = true)]
async fn every_hedge_carries_the_key_the_attempt_count_and_the_instances_in_flight() {
    let mut s = hedged(policy(3, 10), budget());
    let call = start(&mut s, request()).await;
    let (r1, a1, _) = arrives(&mut s.handle).await;
    // The first attempt's instance fails non-fatally; the second is in flight.
    let (r2, _a2, _) = arrives(&mut s.handle).await;
    a1.send_response(status_from("instance-a", Code::Unavailable));
    let (r3, a3, _) = arrives(&mut s.handle).await;
    let key = r1.headers()["x-idempotency-key"].clone();
    assert_eq!(r2.headers()["x-idempotency-key"], key);
    assert_eq!(r3.headers()["x-idempotency-key"], key);
    assert!(r1.headers().get("grpc-previous-rpc-attempts").is_none());
    assert_eq!(r2.headers()["grpc-previous-rpc-attempts"], "1");
    assert_eq!(r3.headers()["grpc-previous-rpc-attempts"], "2");
    let tried = r3
        .extensions()
        .get::<tonic_retry::marks::AlreadyTried>()
        .expect("a mark");
    assert!(tried.contains("instance-a"), "{tried:?}");
    assert_eq!(r3.headers()["x-already-tried"], "instance-a");
    a3.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_body_still_streaming_is_not_hedged_and_nothing_waits_for_it() {
    let mut s = hedged(policy(3, 10), budget());
    let (tx, req) = streaming_request();
    let call = start(&mut s, req).await;
    let (r1, a1, _) = arrives(&mut s.handle).await;
    let mut body = r1.into_body();
    tx.send(data("part")).unwrap();
    assert_eq!(next_data(&mut body).await, "part");
    tokio::time::sleep(50 * MS).await;
    assert!(
        nothing_more(&mut s.handle),
        "the body is not complete: no hedge"
    );
    // The single attempt goes on, and its answer is the call's.
    a1.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    drop(tx);
}

#[tokio::test(start_paused = true)]
async fn a_hedge_replays_the_whole_body_once_it_is_complete() {
    let mut s = hedged(policy(2, 10), budget());
    let (tx, req) = streaming_request();
    let call = start(&mut s, req).await;
    let (r1, _a1, _) = arrives(&mut s.handle).await;
    let mut body = r1.into_body();
    tx.send(data("one,")).unwrap();
    tx.send(data("two")).unwrap();
    drop(tx);
    assert_eq!(next_data(&mut body).await, "one,");
    assert_eq!(next_data(&mut body).await, "two");
    assert!(body.frame().await.is_none());
    // Complete now: the hedge is due at 10 ms and replays it.
    let (r2, a2, _) = arrives(&mut s.handle).await;
    assert_eq!(
        r2.into_body().collect().await.unwrap().to_bytes(),
        "one,two"
    );
    a2.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_replay_limit_is_not_hedged() {
    let over = policy(3, 10).with_settings_of(&RetryPolicy::default().with_replay_limit(4));
    let mut s = hedged(over, budget());
    let call = start(&mut s, request()).await;
    let (r1, a1, _) = arrives(&mut s.handle).await;
    r1.into_body().collect().await.unwrap();
    tokio::time::sleep(50 * MS).await;
    assert!(nothing_more(&mut s.handle));
    a1.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn when_every_attempt_fails_non_fatally_the_last_status_is_marked() {
    let mut s = hedged(policy(3, 10), budget());
    let call = start(&mut s, request()).await;
    for n in 0..3 {
        let (_, send, _) = arrives(&mut s.handle).await;
        let mut answer = status(Code::Unavailable);
        answer.headers_mut().insert(
            "grpc-message",
            HeaderValue::from_str(&format!("attempt-{n}")).unwrap(),
        );
        send.send_response(answer);
    }
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Unavailable);
    assert_eq!(message_of(&response), "attempt-2");
    assert_eq!(
        response.headers()["grpc-retry-pushback-ms"],
        "-1",
        "marked: hedges were sent"
    );
    assert_eq!(s.layer.metrics().marked(), 1);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_call_cancels_every_attempt() {
    let mut s = hedged(policy(3, 10), budget());
    let call = start(&mut s, request()).await;
    let mut unanswered = Vec::new();
    for _ in 0..3 {
        let (_, send, _) = arrives(&mut s.handle).await;
        unanswered.push(send);
    }
    call.abort();
    let _ = call.await;
    for attempt in 0..3 {
        assert!(dropped(&s, attempt), "attempt {attempt} cancelled");
    }
}

#[tokio::test(start_paused = true)]
async fn an_adaptive_delay_starts_at_the_configured_one_and_follows_the_latency() {
    let adaptive = policy(2, 50)
        .with_adaptive_delay(0.9, Duration::from_secs(10), Duration::from_millis(1))
        .unwrap();
    let mut s = hedged(adaptive, RetryBudget::new(1000, 1.0).unwrap());
    // The first calls hedge after the configured 50 ms: the window is empty.
    let t0 = Instant::now();
    let call = start(&mut s, request()).await;
    let (_, a1, _) = arrives(&mut s.handle).await;
    let (_, a2, at2) = arrives(&mut s.handle).await;
    assert_eq!(at2 - t0, 50 * MS);
    a2.send_response(ok());
    call.await.unwrap().unwrap();
    drop(a1);
    // 120 calls answered in 4 ms each.
    for _ in 0..120 {
        let call = start(&mut s, request()).await;
        let (_, send, _) = arrives(&mut s.handle).await;
        tokio::time::sleep(4 * MS).await;
        send.send_response(ok());
        call.await.unwrap().unwrap();
    }
    // Now a slow first attempt is hedged at about the 90th percentile.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t0 = Instant::now();
    let call = start(&mut s, request()).await;
    let (_, _slow, _) = arrives(&mut s.handle).await;
    let (_, hedge, at) = arrives(&mut s.handle).await;
    let after = at - t0;
    assert!(after >= 4 * MS && after <= 6 * MS, "hedged after {after:?}");
    hedge.send_response(ok());
    call.await.unwrap().unwrap();
}

/// An attempt cut by its own timeout is drained, not reset: the server was
/// sent the call's deadline, and its late answer ends the attempt's stream.
#[tokio::test(start_paused = true)]
async fn an_attempt_cut_by_its_timeout_is_drained_not_reset() {
    let policy = exact_policy(3).with_attempt_timeout(100 * MS);
    let mut s = hedged(policy, budget());
    let call = start(&mut s, with_timeout(request(), "1S")).await;
    let (req, slow, _) = arrives(&mut s.handle).await;
    assert_eq!(req.headers()["grpc-timeout"], "1000000u", "the deadline");
    let (_, retry, _) = arrives(&mut s.handle).await;
    assert!(!dropped(&s, 0), "the cut attempt is left to end");
    assert_eq!(s.layer.metrics().draining(), 1);
    retry.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(call.await.unwrap().unwrap()).await, Code::Ok);
    slow.send_response(answer(Code::Ok));
    settle().await;
    assert!(dropped(&s, 0));
    let m = s.layer.metrics();
    assert_eq!((m.draining(), m.drained(), m.retries()), (0, 1, 1));
}

/// A retried call the caller drops while its cut attempt drains ends that
/// drain too: nothing of a dropped call is left running.
#[tokio::test(start_paused = true)]
async fn dropping_a_retried_call_ends_the_drain_of_its_cut_attempt() {
    let policy = exact_policy(3).with_attempt_timeout(100 * MS);
    let mut s = hedged(policy, budget());
    let call = start(&mut s, with_timeout(request(), "5S")).await;
    let (_, _slow, _) = arrives(&mut s.handle).await;
    let (_, _retry, _) = arrives(&mut s.handle).await;
    assert_eq!(s.layer.metrics().draining(), 1, "the cut attempt drains");
    call.abort();
    let _ = call.await;
    settle().await;
    assert!(dropped(&s, 1), "the retry in flight is cancelled");
    assert!(dropped(&s, 0), "and so is the drain of the cut attempt");
    let m = s.layer.metrics();
    assert_eq!((m.draining(), m.drained(), m.drain_cut()), (0, 0, 1));
}

/// An attempt cut by the call's deadline is reset at once: the server's own
/// timer (and tonic's Channel's) end it there anyway, and the caller is done.
#[tokio::test(start_paused = true)]
async fn an_attempt_cut_by_the_deadline_is_not_drained() {
    let policy = RetryPolicy::default().with_attempt_timeout(10 * 1000 * MS);
    let mut s = hedged(policy, budget());
    let call = start(&mut s, with_timeout(request(), "100m")).await;
    let (_, _stuck, _) = arrives(&mut s.handle).await;
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(dropped(&s, 0));
    assert_eq!(s.layer.metrics().draining(), 0);
}

/// A call without a per-attempt timeout or hedging has nothing to drain: its
/// attempts are not boxed for it, and a call the caller drops is reset.
#[tokio::test(start_paused = true)]
async fn a_plain_call_dropped_by_the_caller_is_reset() {
    let mut s = hedged(RetryPolicy::default(), budget());
    let call = start(&mut s, with_timeout(request(), "1S")).await;
    let (_, _stuck, _) = arrives(&mut s.handle).await;
    settle().await;
    assert!(!dropped(&s, 0), "in flight");
    call.abort();
    let _ = call.await;
    assert!(dropped(&s, 0));
    assert_eq!(s.layer.metrics().draining(), 0);
}

// The cap, the replay copy, late bodies, per-method latencies, marks, cut hedges.

fn req_to(path: &str) -> Request<Body> {
    let mut r = request();
    *r.uri_mut() = format!("http://library{path}").parse().unwrap();
    r
}

/// A hedge the budget refused was never sent: it uses up no place under the
/// extra-load cap.
#[tokio::test(start_paused = true)]
async fn extra_load_share_is_not_spent_on_hedges_never_sent() {
    // The default 5 % cap (50 hedges saved up); a budget of half a token, so
    // every hedge is refused at send.
    let p = HedgePolicy::new(2, Duration::from_millis(10)).unwrap();
    let poor = RetryBudget::new(1, 0.001).unwrap();
    let mut s = hedged(p, poor.clone());
    for _ in 0..60 {
        let call = start(&mut s, request()).await;
        let (_, a1, _) = arrives(&mut s.handle).await;
        tokio::time::sleep(20 * MS).await;
        assert!(nothing_more(&mut s.handle));
        a1.send_response(ok());
        call.await.unwrap().unwrap();
    }
    assert_eq!(s.layer.metrics().hedges(), 0, "not one hedge was sent");
    // The budget is refilled: a token is there now.
    for _ in 0..1000 {
        poor.deposit();
    }
    assert!(poor.available() >= 1.0);
    let call = start(&mut s, request()).await;
    let (_, a1, _) = arrives(&mut s.handle).await;
    tokio::time::sleep(20 * MS).await;
    let hedge = s.handle.next_request().now_or_never();
    assert!(
        matches!(hedge, Some(Some(_))),
        "0 hedges in 61 calls is within a 5 % cap (50 saved up): the hedge goes"
    );
    a1.send_response(ok());
    call.await.unwrap().unwrap();
}

/// Once a call commits, its replay copy goes: a hedged call's as a
/// retried call's.
async fn copy_held_after_commit(policy: RetryPolicy) -> usize {
    let layer = RetryLayer::new(policy, budget());
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let (tx, req) = streaming_request();
    let svc_ready = svc.ready().await.unwrap();
    let call = tokio::spawn(svc_ready.call(req));
    let (r1, a1) = handle.next_request().await.unwrap();
    let mut body = r1.into_body();
    let (rtx, response) = streaming_response();
    a1.send_response(response);
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok, "committed");
    // A client stream goes on after the commit: the winner reads it.
    for _ in 0..100 {
        tx.send(data("0123456789")).unwrap();
        assert_eq!(next_data(&mut body).await, "0123456789");
    }
    let held = layer.replay_memory_in_use();
    drop((tx, rtx, response, body));
    held
}

#[tokio::test(start_paused = true)]
async fn a_committed_call_holds_no_replay_copy_retry_control() {
    let retry = RetryPolicy::default();
    assert_eq!(
        copy_held_after_commit(retry).await,
        0,
        "a retried call: copy gone at commit"
    );
}

#[tokio::test(start_paused = true)]
async fn a_committed_hedged_call_holds_no_replay_copy() {
    let hedge: RetryPolicy = policy(2, 1000).into();
    assert_eq!(
        copy_held_after_commit(hedge).await,
        0,
        "a hedged call, committed, holds no copy"
    );
}

/// A body incomplete when the hedge is due (the caller's body stalled: it
/// answered the attempt reading it `Pending`) is not hedged, not later either.
#[tokio::test(start_paused = true)]
async fn a_body_incomplete_when_the_hedge_is_due_is_not_hedged_later() {
    let mut s = hedged(policy(2, 10), budget());
    let t0 = Instant::now();
    let (tx, req) = streaming_request();
    let call = start(&mut s, req).await;
    let (r1, a1, _) = arrives(&mut s.handle).await;
    let mut body = r1.into_body();
    tx.send(data("part")).unwrap();
    assert_eq!(next_data(&mut body).await, "part");
    // The HTTP stream reads on, as h2 does, and finds nothing more yet.
    assert!(body.frame().now_or_never().is_none());
    tokio::time::sleep(50 * MS).await;
    assert!(nothing_more(&mut s.handle), "due at 10 ms, body incomplete");
    drop(tx);
    assert!(body.frame().await.is_none());
    let late = tokio::time::timeout(100 * MS, s.handle.next_request()).await;
    if let Ok(Some((_, h))) = late {
        drop(h);
        panic!(
            "hedge sent at {:?} (when the body completed) though it was incomplete when the hedge was due (10 ms)",
            Instant::now() - t0
        );
    }
    a1.send_response(ok());
    call.await.unwrap().unwrap();
}

/// The adaptive delay follows the method's own latency, not another method's.
#[tokio::test(start_paused = true)]
async fn the_adaptive_delay_is_per_method() {
    let adaptive = policy(2, 20)
        .with_adaptive_delay(0.9, Duration::from_secs(60), Duration::from_millis(1))
        .unwrap();
    let mut s = hedged(adaptive, RetryBudget::new(1000, 1.0).unwrap());
    // 120 calls of a slow method, each answered at 100 ms.
    for _ in 0..120 {
        let call = start(&mut s, req_to("/library.v1.Library/ListBooks")).await;
        let (_, a1, _) = arrives(&mut s.handle).await;
        tokio::time::sleep(100 * MS).await;
        a1.send_response(ok());
        call.await.unwrap().unwrap();
        while let Some(Some(_)) = s.handle.next_request().now_or_never() {}
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    {
        let t0 = Instant::now();
        let call = start(&mut s, req_to("/library.v1.Library/ListBooks")).await;
        let (_, _a1, _) = arrives(&mut s.handle).await;
        let (_, hedge, at) = arrives(&mut s.handle).await;
        // Its own latency: hedged after its p90 (100 ms, up to its bucket's top).
        assert!(at - t0 >= 100 * MS && at - t0 <= 120 * MS, "{:?}", at - t0);
        hedge.send_response(ok());
        call.await.unwrap().unwrap();
    }
    // GetBook has no latency of its own yet: its configured 20 ms delay.
    let t0 = Instant::now();
    let call = start(&mut s, req_to("/library.v1.Library/GetBook")).await;
    let (_, _a1, _) = arrives(&mut s.handle).await;
    let (_, hedge, at) = arrives(&mut s.handle).await;
    let after = at - t0;
    hedge.send_response(ok());
    call.await.unwrap().unwrap();
    assert_eq!(after, 20 * MS, "GetBook hedged after another method's p90");
}

/// Reports `inst-N` for the N-th request it gets, as a balancer below would.
#[derive(Clone)]
struct Reporter {
    inner: mock::Mock<Request<Body>, Response<Body>>,
    n: Arc<Mutex<u32>>,
}

impl Service<Request<Body>> for Reporter {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = mock::future::ResponseFuture<Response<Body>>;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }
    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let mut n = self.n.lock().unwrap();
        *n += 1;
        if let Some(p) = req.extensions().get::<tonic_retry::marks::PickedInstance>() {
            p.set(HeaderValue::from_str(&format!("inst-{n}")).unwrap());
        }
        self.inner.call(req)
    }
}

/// Every hedge names the instances in flight.
#[tokio::test(start_paused = true)]
async fn each_hedge_names_every_instance_in_flight() {
    let layer = RetryLayer::new(policy(3, 10), budget());
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(Reporter {
        inner,
        n: Arc::default(),
    });
    let ready = svc.ready().await.unwrap();
    let call = tokio::spawn(ready.call(request()));
    let (_r1, _a1) = handle.next_request().await.unwrap();
    let (r2, _a2) = handle.next_request().await.unwrap();
    let (r3, a3) = handle.next_request().await.unwrap();
    let mark = |r: &Request<Body>| {
        r.headers()
            .get("x-already-tried")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    };
    let (m2, m3) = (mark(&r2), mark(&r3));
    a3.send_response(ok());
    call.await.unwrap().unwrap();
    assert_eq!(m2, "inst-1", "hedge 2 names attempt 1's instance");
    assert!(
        m3.contains("inst-1") && m3.contains("inst-2"),
        "hedge 3: {m3:?}"
    );
}

/// RetryThrottle: hedges only while tokens > max/2; only non-fatal answers charge.
#[tokio::test(start_paused = true)]
async fn throttle_stops_hedges_at_half_and_charges_non_fatal_only() {
    let throttle = tonic_retry::budgets::RetryThrottle::new(10.0, 0.1).unwrap();
    let layer = RetryLayer::with_budget(policy(3, 10), throttle.clone());
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    // A fatal answer: nothing charged.
    let ready = svc.ready().await.unwrap();
    let call = tokio::spawn(ready.call(request()));
    let (_, a1) = handle.next_request().await.unwrap();
    a1.send_response(status(Code::NotFound));
    call.await.unwrap().unwrap();
    assert_eq!(throttle.available(), 10.0);
    // Non-fatal answers: one token each.
    let ready = svc.ready().await.unwrap();
    let call = tokio::spawn(ready.call(request()));
    for _ in 0..3 {
        let (_, a) = handle.next_request().await.unwrap();
        a.send_response(status(Code::Unavailable));
    }
    call.await.unwrap().unwrap();
    assert_eq!(throttle.available(), 7.0);
    // 2 more non-fatal → 5 = max/2: no hedge.
    let ready = svc.ready().await.unwrap();
    let call = tokio::spawn(ready.call(request()));
    for _ in 0..2 {
        let (_, a) = handle.next_request().await.unwrap();
        a.send_response(status(Code::Unavailable));
    }
    tokio::time::sleep(50 * MS).await;
    assert!(
        handle.next_request().now_or_never().is_none(),
        "5 tokens of 10: no hedge"
    );
    let r = call.await.unwrap().unwrap();
    assert_eq!(code_of(&r), Code::Unavailable);
    assert_eq!(throttle.available(), 5.0);
}

/// Extreme values neither panic nor hang.
#[tokio::test(start_paused = true)]
async fn extreme_delays_do_not_panic() {
    for d in [
        Duration::MAX,
        Duration::from_secs(u64::MAX),
        Duration::from_nanos(1),
    ] {
        let p = HedgePolicy::new(5, d)
            .unwrap()
            .with_adaptive_delay(1.0, Duration::MAX, Duration::MAX)
            .unwrap()
            .with_max_extra_load(Some(4.0))
            .unwrap()
            .with_settings_of(
                &RetryPolicy::default()
                    .with_max_server_delay(Duration::MAX)
                    .with_attempt_timeout(Duration::MAX)
                    .with_total_timeout(Duration::MAX),
            );
        let mut s = hedged(p, budget());
        let call = start(&mut s, request()).await;
        let (_, a1, _) = arrives(&mut s.handle).await;
        let mut pushed = status(Code::Unavailable);
        pushed.headers_mut().insert(
            "grpc-retry-pushback-ms",
            HeaderValue::from_static("9223372036854775807"),
        );
        a1.send_response(pushed);
        tokio::time::sleep(10 * MS).await;
        call.abort();
        let _ = call.await;
    }
}

/// What a call gets when attempt 1 answers UNAVAILABLE at once and the next
/// attempt is refused (by the budget, or for lack of time).
async fn refused_after_non_fatal(
    policy: RetryPolicy,
    budget: RetryBudget,
    timeout: Option<&'static str>,
) -> (Code, Option<String>, u64) {
    let layer = RetryLayer::new(policy, budget);
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let req = match timeout {
        Some(t) => with_timeout(request(), t),
        None => request(),
    };
    let ready = svc.ready().await.unwrap();
    let call = tokio::spawn(ready.call(req));
    let (_, a1) = handle.next_request().await.unwrap();
    tokio::time::sleep(40 * MS).await;
    a1.send_response(status(Code::Unavailable));
    let r = call.await.unwrap().unwrap();
    tokio::time::sleep(100 * MS).await;
    assert!(
        handle.next_request().now_or_never().is_none(),
        "no second attempt"
    );
    let pushback = r
        .headers()
        .get("grpc-retry-pushback-ms")
        .map(|v| v.to_str().unwrap().to_owned());
    (code_of(&r), pushback, layer.metrics().marked())
}

/// A call whose next attempt the budget or the deadline (its minimum attempt
/// budget) refused goes up marked "do not retry": hedged as retried.
#[tokio::test(start_paused = true)]
async fn a_call_refused_its_next_attempt_is_marked_for_the_layers_above() {
    let poor = || RetryBudget::new(1, 0.001).unwrap();
    let retry = || RetryPolicy::new(2, 5 * MS, 5 * MS, 0.0).unwrap();
    let hedge = || RetryPolicy::from(policy(2, 1000));
    let cases = [
        ("retried, no token", retry(), poor(), None),
        ("hedged, no token", hedge(), poor(), None),
        ("retried, no time", retry(), budget(), Some("50m")),
        ("hedged, no time", hedge(), budget(), Some("50m")),
    ];
    for (case, policy, budget, timeout) in cases {
        let (_, pushback, marked) = refused_after_non_fatal(policy, budget, timeout).await;
        assert_eq!((pushback.as_deref(), marked), (Some("-1"), 1), "{case}");
    }
}

/// An attempt cut by the per-attempt timeout got no answer: it commits
/// nothing, and the hedge still in flight goes on.
#[tokio::test(start_paused = true)]
async fn a_per_attempt_timeout_does_not_kill_the_hedge_in_flight() {
    let p = policy(2, 10).with_settings_of(&RetryPolicy::default().with_attempt_timeout(50 * MS));
    let mut s = hedged(p, budget());
    let call = start(&mut s, request()).await;
    let (_, _a1, _) = arrives(&mut s.handle).await; // never answers
    let (_, a2, _) = arrives(&mut s.handle).await; // sent at 10 ms, times out at 60 ms
    // At 55 ms: attempt 1 was cut at 50 ms, attempt 2 still has time.
    tokio::time::sleep(45 * MS).await;
    let cancelled = dropped(&s, 1);
    a2.send_response(ok());
    let r = call.await.unwrap().unwrap();
    assert_eq!(
        (code_of(&r), cancelled),
        (Code::Ok, false),
        "caller got {:?} {:?}; hedge 2 cancelled: {cancelled}",
        code_of(&r),
        message_of(&r)
    );
}

/// With no delay the hedge is due before the first attempt has read the body
/// (tonic's unary body has no known size): the body, all there, is read
/// ahead, and both attempts go at once and send it whole.
#[tokio::test(start_paused = true)]
async fn a_zero_delay_hedges_a_complete_body_at_once() {
    let mut s = hedged(policy(2, 0), budget());
    let (tx, req) = streaming_request();
    tx.send(data("whole")).unwrap();
    drop(tx);
    let t0 = Instant::now();
    let call = start(&mut s, req).await;
    let (r1, a1, _) = arrives(&mut s.handle).await;
    let (r2, _a2, at2) = arrives(&mut s.handle).await;
    assert_eq!(at2, t0, "at once");
    assert_eq!(r1.into_body().collect().await.unwrap().to_bytes(), "whole");
    assert_eq!(r2.into_body().collect().await.unwrap().to_bytes(), "whole");
    a1.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

/// The default 5 % cap: 50 hedges saved up at the start.
fn capped(attempts: u32, delay_ms: u64) -> HedgePolicy {
    HedgePolicy::new(attempts, Duration::from_millis(delay_ms)).unwrap()
}

/// Whether a call whose every attempt the service takes at once is hedged.
async fn next_call_hedges(s: &mut Setup) -> bool {
    s.handle.allow(u64::MAX);
    let call = start(s, request()).await;
    let (_, a1, _) = next(&mut s.handle).await;
    tokio::time::sleep(20 * MS).await;
    let hedge = s.handle.next_request().now_or_never();
    let hedged = matches!(hedge, Some(Some(_)));
    a1.send_response(ok());
    call.await.unwrap().unwrap();
    hedged
}

/// The extra-load cap counts hedges sent: a hedge still waiting for its
/// service when another attempt commits gives its place back.
#[tokio::test(start_paused = true)]
async fn a_hedge_that_loses_while_waiting_gives_its_cap_place_back() {
    let mut s = hedged(capped(2, 10), budget());
    for _ in 0..60 {
        s.handle.allow(1);
        let call = start(&mut s, request()).await;
        let (_, a1, _) = next(&mut s.handle).await;
        tokio::time::sleep(20 * MS).await; // hedge due at 10 ms, not ready
        assert!(nothing_more(&mut s.handle));
        a1.send_response(ok());
        call.await.unwrap().unwrap();
    }
    assert_eq!(s.layer.metrics().hedges(), 0);
    assert!(next_call_hedges(&mut s).await, "0 hedges in 61 calls");
}

/// So does one still waiting when the caller drops the call.
#[tokio::test(start_paused = true)]
async fn a_dropped_call_gives_back_the_cap_places_of_hedges_never_sent() {
    let mut s = hedged(capped(2, 10), budget());
    for _ in 0..60 {
        s.handle.allow(1);
        let call = start(&mut s, request()).await;
        let (_, _a1, _) = next(&mut s.handle).await;
        tokio::time::sleep(20 * MS).await; // hedge due at 10 ms, not ready
        assert!(nothing_more(&mut s.handle));
        call.abort();
        let _ = call.await;
    }
    assert_eq!(s.layer.metrics().hedges(), 0, "not one hedge was sent");
    assert!(
        next_call_hedges(&mut s).await,
        "0 hedges sent in 61 calls under a 5 % cap with 50 saved up: the 61st call is hedged"
    );
}

/// And one still waiting when the call's deadline ends it.
#[tokio::test(start_paused = true)]
async fn a_call_ended_by_its_deadline_gives_back_the_cap_places_of_hedges_never_sent() {
    let mut s = hedged(capped(2, 10), budget());
    for _ in 0..60 {
        s.handle.allow(1);
        let call = start(&mut s, with_timeout(request(), "100m")).await;
        let (_, _a1, _) = next(&mut s.handle).await;
        let r = call.await.unwrap().unwrap();
        assert_eq!(code_of(&r), Code::DeadlineExceeded);
    }
    assert_eq!(s.layer.metrics().hedges(), 0, "not one hedge was sent");
    assert!(
        next_call_hedges(&mut s).await,
        "0 hedges sent in 61 calls under a 5 % cap with 50 saved up: the 61st call is hedged"
    );
}

/// An attempt cut by its own timeout is drained while its call goes on; if
/// the caller then drops the call, the drain ends with it (dropping the
/// call leaves nothing running).
#[tokio::test(start_paused = true)]
async fn dropping_the_call_ends_the_drain_of_its_timed_out_attempt() {
    let p = policy(2, 100).with_settings_of(&RetryPolicy::default().with_attempt_timeout(50 * MS));
    let mut s = hedged(p, budget());
    let call = start(&mut s, with_timeout(request(), "10S")).await;
    let (_, _a1, _) = next(&mut s.handle).await; // cut at 50 ms, drained
    let (_, _a2, at2) = next(&mut s.handle).await; // sent at once (non-fatal)
    assert!(at2 - Instant::now() <= Duration::ZERO);
    tokio::time::sleep(10 * MS).await;
    call.abort();
    let _ = call.await;
    settle().await;
    assert!(dropped(&s, 1), "attempt 2 cancelled");
    tokio::time::sleep(Duration::from_secs(5)).await;
    settle().await;
    assert!(
        dropped(&s, 0),
        "attempt 1 ends with the call the caller dropped (draining: {})",
        s.layer.metrics().draining()
    );
}

/// A call whose first attempt fails UNAVAILABLE and whose next attempt waits
/// for a service that never becomes ready: its code, when it ended, and its
/// pushback.
async fn ends_at_deadline_with_service_saturated(
    policy: RetryPolicy,
) -> (Code, Duration, Option<String>) {
    let mut s = hedged(policy, budget());
    s.handle.allow(1);
    let t0 = Instant::now();
    let call = start(&mut s, with_timeout(request(), "200m")).await;
    let (_, a1, _) = next(&mut s.handle).await;
    tokio::time::sleep(5 * MS).await;
    a1.send_response(status(Code::Unavailable));
    let r = call.await.unwrap().unwrap();
    let pushback = r
        .headers()
        .get("grpc-retry-pushback-ms")
        .map(|v| v.to_str().unwrap().to_owned());
    (code_of(&r), Instant::now() - t0, pushback)
}

/// A hedge waiting for a saturated service ends the call at its
/// deadline with DEADLINE_EXCEEDED, as a retry does.
#[tokio::test(start_paused = true)]
async fn a_hedged_call_held_by_a_saturated_service_ends_deadline_exceeded() {
    let retry = RetryPolicy::new(3, 10 * MS, 10 * MS, 0.0).unwrap();
    let (code, took, _) = ends_at_deadline_with_service_saturated(retry).await;
    assert_eq!(
        (code, took),
        (Code::DeadlineExceeded, 200 * MS),
        "retry control"
    );
    let (code, took, pushback) =
        ends_at_deadline_with_service_saturated(policy(3, 10).into()).await;
    assert_eq!(
        (code, took),
        (Code::DeadlineExceeded, 200 * MS),
        "hedged call ended at its deadline with {code:?} (pushback {pushback:?})"
    );
}

/// A call that hedged and then ran out of time goes up marked "do
/// not retry", as a retried one does.
#[tokio::test(start_paused = true)]
async fn a_hedged_call_that_runs_out_of_time_after_hedging_is_marked() {
    // Retry control: attempt 1 UNAVAILABLE, the retry never answers.
    let mut s = hedged(
        RetryPolicy::new(3, 10 * MS, 10 * MS, 0.0).unwrap(),
        budget(),
    );
    let call = start(&mut s, with_timeout(request(), "100m")).await;
    let (_, a1, _) = next(&mut s.handle).await;
    a1.send_response(status(Code::Unavailable));
    let (_, _a2, _) = next(&mut s.handle).await;
    let r = call.await.unwrap().unwrap();
    assert_eq!(code_of(&r), Code::DeadlineExceeded);
    assert_eq!(
        r.headers()
            .get("grpc-retry-pushback-ms")
            .map(|v| v.to_str().unwrap()),
        Some("-1"),
        "retry control"
    );

    // Hedged: 3 attempts sent, none answers before the deadline.
    let mut s = hedged(policy(3, 30), budget());
    let call = start(&mut s, with_timeout(request(), "100m")).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(next(&mut s.handle).await);
    }
    let r = call.await.unwrap().unwrap();
    assert_eq!(code_of(&r), Code::DeadlineExceeded);
    assert_eq!(s.layer.metrics().hedges(), 2);
    assert_eq!(
        r.headers()
            .get("grpc-retry-pushback-ms")
            .map(|v| v.to_str().unwrap()),
        Some("-1"),
        "3 attempts sent: a layer above must not retry the call again"
    );
}

/// A server's pushback delays the next hedge to n ms from then; a later
/// non-fatal answer without pushback does not cut the server's delay short.
#[tokio::test(start_paused = true)]
async fn a_later_answer_without_pushback_does_not_cancel_the_servers_delay() {
    let mut s = hedged(policy(4, 100), budget());
    let t0 = Instant::now();
    let call = start(&mut s, request()).await;
    let (_, a1, _) = next(&mut s.handle).await;
    let (_, a2, _) = next(&mut s.handle).await; // 100 ms
    tokio::time::sleep(10 * MS).await;
    let mut pushed = status(Code::Unavailable);
    pushed
        .headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("1000"));
    a1.send_response(pushed); // 110 ms: next hedge at 1110 ms
    tokio::time::sleep(10 * MS).await;
    a2.send_response(status(Code::Unavailable)); // 120 ms
    let (_, a3, at3) = next(&mut s.handle).await;
    a3.send_response(ok());
    call.await.unwrap().unwrap();
    assert!(
        at3 - t0 >= 1110 * MS,
        "server asked for 1000 ms at 110 ms; hedge 3 sent at {:?}",
        at3 - t0
    );
}

/// The adaptive delay is the percentile of the method's latencies:
/// every attempt takes 8.2 ms, so p95 is 8.2 ms (the bucket it falls in
/// reaches 10.2 ms), and the hedge goes at the next whole millisecond.
#[tokio::test(start_paused = true)]
async fn the_adaptive_delay_is_the_methods_percentile_not_its_buckets_top() {
    let adaptive = policy(2, 50)
        .with_adaptive_delay(0.95, Duration::from_secs(10), Duration::from_millis(1))
        .unwrap();
    let mut s = hedged(adaptive, RetryBudget::new(1000, 1.0).unwrap());
    for _ in 0..150 {
        let call = start(&mut s, request()).await;
        let (_, send, _) = next(&mut s.handle).await;
        tokio::time::sleep(Duration::from_micros(8200)).await;
        send.send_response(ok());
        call.await.unwrap().unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t0 = Instant::now();
    let call = start(&mut s, request()).await;
    let (_, _slow, _) = next(&mut s.handle).await;
    let (_, hedge, at) = next(&mut s.handle).await;
    hedge.send_response(ok());
    call.await.unwrap().unwrap();
    let after = at - t0;
    assert!(
        after <= 9 * MS,
        "p95 of 150 latencies all 8.2 ms; hedged after {after:?}"
    );
}

/// A complete body with no size hint (as tonic's unary bodies have), which
/// the first attempt has not read yet.
fn unsized_request(message: &'static [u8]) -> Request<Body> {
    let frames = [Ok::<_, tonic::Status>(http_body::Frame::data(
        bytes::Bytes::from_static(message),
    ))];
    let mut req = request();
    *req.body_mut() = Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)));
    req
}

/// "when an attempt is slow, send another copy". A first attempt slow
/// before it reads its body (its connection full, or still being made)
/// does not hold back the hedge of a body that is all there: the body is
/// read ahead, and both attempts send it whole.
#[tokio::test(start_paused = true)]
async fn a_first_attempt_that_has_not_read_a_complete_body_does_not_hold_back_the_hedge() {
    let mut s = hedged(policy(2, 10), budget());
    let t0 = Instant::now();
    let call = start(
        &mut s,
        with_timeout(unsized_request(b"\0\0\0\0\x05hello"), "1S"),
    )
    .await;
    let (r1, _a1, _) = arrives(&mut s.handle).await; // its body not read yet
    let (r2, a2, at2) = arrives(&mut s.handle).await;
    assert_eq!(at2 - t0, 10 * MS, "the hedge goes at its delay");
    let whole = &b"\0\0\0\0\x05hello"[..];
    assert_eq!(r2.into_body().collect().await.unwrap().to_bytes(), whole);
    assert_eq!(
        r1.into_body().collect().await.unwrap().to_bytes(),
        whole,
        "the first attempt sends what was read ahead for it"
    );
    a2.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    assert_eq!(s.layer.metrics().hedges(), 1);
}

/// A body read ahead that turns out larger than the replay limit is not
/// hedged, and the first attempt still sends all of it.
#[tokio::test(start_paused = true)]
async fn a_body_read_ahead_past_the_replay_limit_is_not_hedged_and_is_sent_whole() {
    let small = policy(2, 10).with_settings_of(&RetryPolicy::default().with_replay_limit(4));
    let mut s = hedged(small, budget());
    let call = start(
        &mut s,
        with_timeout(unsized_request(b"\0\0\0\0\x05hello"), "1S"),
    )
    .await;
    let (r1, a1, _) = arrives(&mut s.handle).await;
    tokio::time::sleep(50 * MS).await;
    assert!(nothing_more(&mut s.handle), "over the limit: no hedge");
    assert_eq!(
        r1.into_body().collect().await.unwrap().to_bytes(),
        &b"\0\0\0\0\x05hello"[..],
        "nothing read ahead is lost"
    );
    a1.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    assert_eq!(s.layer.metrics().hedges(), 0);
}

/// Every attempt sent counts, however the call ends: at the deadline with
/// all three in flight, or with two in flight after one failed.
#[tokio::test(start_paused = true)]
async fn a_hedged_call_ended_by_its_deadline_counts_every_attempt_sent() {
    let mut s = hedged(policy(3, 30), budget());
    let call = start(&mut s, with_timeout(request(), "100m")).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(arrives(&mut s.handle).await);
    }
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(response.headers()["grpc-previous-rpc-attempts"], "2");
    assert_eq!(s.layer.metrics().attempts(), 3);

    let mut s = hedged(policy(3, 30), budget());
    let call = start(&mut s, with_timeout(request(), "100m")).await;
    let (_, first, _) = arrives(&mut s.handle).await;
    let _second = arrives(&mut s.handle).await;
    first.send_response(status(Code::Unavailable));
    let _third = arrives(&mut s.handle).await;
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert_eq!(s.layer.metrics().attempts(), 3);
}

/// With `OutcomeBudget`, a hedge the call succeeds with gives its token
/// back; a hedge that loses to the first attempt is spent.
#[tokio::test(start_paused = true)]
async fn a_winning_hedge_is_refunded_by_an_outcome_budget() {
    use tonic_retry::OutcomeBudget;
    use tonic_retry::budgets::Budget;
    let budget = OutcomeBudget::new(10, 0.1).unwrap();
    // Spend two tokens, to see what comes back below the cap.
    assert!(budget.withdraw() && budget.withdraw());
    let layer = RetryLayer::with_budget(policy(2, 10), budget);
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);

    // The hedge wins: 0.1 deposited, and its token back.
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    let (_, _first, _) = arrives(&mut handle).await;
    let (_, hedge, _) = arrives(&mut handle).await;
    hedge.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(call.await.unwrap().unwrap()).await, Code::Ok);
    assert_eq!(layer.budget().available(), 8.1);

    // The first attempt wins: 0.1 deposited, the losing hedge spent.
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    let (_, first, _) = arrives(&mut handle).await;
    let (_, _hedge, _) = arrives(&mut handle).await;
    first.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(call.await.unwrap().unwrap()).await, Code::Ok);
    assert_eq!(layer.budget().available(), 7.2);
    assert_eq!(layer.metrics().hedges(), 2);
}
