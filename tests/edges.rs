//! The hardening promises at their edges: a
//! commit while a retry is still replaying, a failed attempt's stream reading
//! on, limits that are not on a millisecond, balancers at their limits, the
//! call dropped at each await point, values at the ends of their types. Mock
//! tests run under paused tokio time; the last one uses a real tonic server.

mod common;
mod support;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::balance::PreferUntried;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tower::retry::budget::TpsBudget;
use tower::{BoxError, Layer, Service, ServiceExt};
use tower_test::mock;

use support::*;

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(3600), f)
        .await
        .expect("the call hung")
}

fn policy(attempts: u32) -> RetryPolicy {
    RetryPolicy::new(attempts, 20 * MS, 500 * MS, 0.2).unwrap()
}

// ---------------------------------------------------------------------------
// The replay copy released while a retry still replays it
// ---------------------------------------------------------------------------

/// A client stream whose attempt 1 read `chunks` and failed (Trailers-Only
/// UNAVAILABLE), and whose attempt 2 has just arrived at the mock.
struct Retried {
    /// The caller's feed.
    tx: Tx,
    /// Attempt 1's request body, which its HTTP stream may still pull.
    dead: Body,
    /// Attempt 2, not answered yet.
    req2: Request<Body>,
    send2: mock::SendResponse<Response<Body>>,
    call: tokio::task::JoinHandle<Outcome>,
    /// Kept so that the inner service stays up.
    _handle: Handle,
}

async fn retried_after_reading(policy: RetryPolicy, chunks: &[&'static str]) -> Retried {
    let (mut svc, mut handle, _) = setup(policy, budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req1, send1, _) = next(&mut handle).await;
    let mut dead = req1.into_body();
    for &chunk in chunks {
        tx.send(data(chunk)).unwrap();
        assert_eq!(next_data(&mut dead).await, chunk);
    }
    send1.send_response(status(Code::Unavailable));
    let (req2, send2, _) = next(&mut handle).await;
    Retried {
        tx,
        dead,
        req2,
        send2,
        call,
        _handle: handle,
    }
}

/// A bidi / client-streaming call: attempt 1 reads two messages then fails
/// (Trailers-Only UNAVAILABLE); attempt 2 goes to a server whose handler
/// answers response headers at once (a server-streaming handler returns its
/// `Response` before reading the request stream). The commit releases the
/// copy while attempt 2 has not replayed it yet: attempt 2's request body
/// must still be sent whole (never truncated, never corrupted).
#[tokio::test(start_paused = true)]
async fn commit_while_the_retry_is_still_replaying_keeps_its_body_whole() {
    let Retried {
        tx,
        dead,
        req2,
        send2,
        call,
        ..
    } = retried_after_reading(policy(3), &["one ", "two "]).await;
    drop(dead);
    // Response headers first, request stream read afterwards.
    send2.send_response(ok());
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok, "committed");

    tx.send(data("three")).unwrap();
    drop(tx);
    let got = bounded(req2.into_body().collect()).await;
    match got {
        Ok(c) => assert_eq!(c.to_bytes(), "one two three"),
        Err(e) => panic!("attempt 2's request body failed: {e}"),
    }
}

/// The last attempt releases the copy once it has replayed it. But the failed
/// attempt's body may still be read by the transport (hyper's request-body
/// pipe runs until the server's RST_STREAM arrives, after the Trailers-Only
/// answer): that read must fail, not take a chunk that is no longer copied
/// and that the last attempt needs.
#[tokio::test(start_paused = true)]
async fn the_last_attempt_survives_a_late_read_by_the_failed_attempt() {
    let Retried {
        tx,
        dead: mut body1,
        req2,
        send2,
        call,
        ..
    } = retried_after_reading(policy(2), &["one "]).await;
    let mut body2 = req2.into_body();
    assert_eq!(next_data(&mut body2).await, "one ");
    // The failed attempt's pipe pulls the next chunk before its stream is
    // reset: it must not take it from the live attempt.
    tx.send(data("two")).unwrap();
    let late = body1.frame().await.unwrap();
    assert!(late.is_err(), "the dead attempt read on: {late:?}");
    drop(body1);
    drop(tx);
    let rest = bounded(body2.collect()).await;
    match rest {
        Ok(c) => assert_eq!(c.to_bytes(), "two"),
        Err(e) => panic!("the last attempt's request body failed: {e}"),
    }
    send2.send_response(ok());
    call.await.unwrap().unwrap();
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
    let frame = bounded(body.frame()).await.unwrap().unwrap();
    let trailers = frame.into_trailers().unwrap();
    assert_eq!(
        trailers["grpc-status"],
        "0",
        "OK trailers ready {:?} before the deadline were replaced by {:?}",
        deadline - Instant::now(),
        trailers
    );
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
    let code = bounded(read_to_end(response)).await;
    (code, Instant::now() - start)
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
// A token only for an attempt really sent — through PreferUntried
// ---------------------------------------------------------------------------

type MockSvc = tower_test::mock::Mock<Request<Body>, Response<Body>>;

#[tokio::test(start_paused = true)]
async fn prefer_untried_sends_a_paid_retry_at_once_rather_than_wait_for_a_saturated_endpoint() {
    let (a, mut handle_a) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let (b, mut handle_b) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    handle_b.allow(0); // endpoint b is saturated
    let lb: PreferUntried<MockSvc> =
        PreferUntried::new([("a".to_owned(), a), ("b".to_owned(), b)]).unwrap();
    let layer = RetryLayer::new(RetryPolicy::default(), budget());
    let mut svc = layer.layer(lb);
    let call = tokio::spawn(
        svc.ready()
            .await
            .unwrap()
            .call(with_timeout(request(), "200m")),
    );
    let (_, send) = handle_a.next_request().await.unwrap();
    send.send_response(status(Code::Unavailable));
    // The balancer said it was ready (a is), so the retry the layer paid for
    // goes out at once — to a, the only endpoint that can take it — instead
    // of waiting for b behind the layer's back.
    let (retry, send) = handle_a.next_request().await.expect("sent at once");
    assert_eq!(retry.headers()["x-already-tried"], "a");
    send.send_response(answer(Code::Ok));
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(read_to_end(response).await, Code::Ok);
    assert!(handle_b.next_request().now_or_never().is_none());
    assert_eq!(
        (layer.metrics().retries(), layer.budget().available()),
        (1, 99.1),
        "one retry, really sent, paid one token; the success earned 0.1"
    );
}

// ---------------------------------------------------------------------------
// PreferUntried whose endpoints have all failed
// ---------------------------------------------------------------------------

#[derive(Clone)]
struct Refusing;

impl Service<Request<Body>> for Refusing {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Err("connection refused".into()))
    }
    fn call(&mut self, _: Request<Body>) -> Self::Future {
        Box::pin(async { Err::<Response<Body>, BoxError>("connection refused".into()) })
    }
}

#[tokio::test(start_paused = true)]
async fn prefer_untried_with_all_endpoints_failed_never_hangs_a_call() {
    let lb = PreferUntried::new([("a".to_owned(), Refusing), ("b".to_owned(), Refusing)]).unwrap();
    let layer = RetryLayer::new(RetryPolicy::default(), budget());
    let mut svc = layer.layer(lb);
    // The failure is reported once...
    assert!(svc.ready().await.is_err());
    // ...and a client made from the service (tonic clients are cloned per
    // task) serves its next call. No deadline: only the layer bounds it.
    let mut clone = svc.clone();
    let outcome = tokio::time::timeout(Duration::from_secs(600), async move {
        match clone.ready().await {
            Ok(s) => s.call(request()).await.map(|r| code_of(&r)),
            Err(e) => Err(e),
        }
    })
    .await;
    assert!(outcome.is_ok(), "the call hung for 600 s");
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
    let response = bounded(call).await.unwrap().unwrap();
    let status = tonic::Status::from_header_map(response.headers()).unwrap();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("connection refused"),
        "the transport error is lost: {status:?}"
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
    let response = bounded(call).await.unwrap().unwrap();
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
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(
        code_of(&response),
        Code::Ok,
        "cut at {:?} of a {:?} deadline: {}",
        start.elapsed(),
        deadline - start,
        message_of(&response)
    );
}

// ---------------------------------------------------------------------------
// Probes expected to hold
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn drop_during_backoff_spends_nothing() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    tokio::time::sleep(5 * MS).await; // inside the 16-24 ms backoff
    call.abort();
    let _ = call.await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(handle.next_request().now_or_never().is_none());
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
}

#[tokio::test(start_paused = true)]
async fn drop_during_retry_readiness_spends_nothing() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    handle.allow(0);
    send.send_response(status(Code::Unavailable));
    tokio::time::sleep(100 * MS).await;
    call.abort();
    let _ = call.await;
    handle.allow(1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(handle.next_request().now_or_never().is_none());
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
}

/// `grpc-timeout` at the ends of its range: zero (nothing is sent), one
/// nanosecond, and the largest values of each unit (sent on, with a
/// `grpc-timeout` no longer than the caller's).
#[tokio::test(start_paused = true)]
async fn grpc_timeout_edges() {
    for t in ["0n", "00000000n"] {
        let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
        let call = spawn_call(&mut svc, with_timeout(request(), t)).await;
        let r = bounded(call).await.unwrap().unwrap();
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
        let r = bounded(call).await.unwrap().unwrap();
        assert_eq!(code_of(&r), Code::Ok, "{t}");
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
    let r = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&r), Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), Duration::ZERO, "at once");
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
    let r = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&r), Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), 100 * MS);
}

#[tokio::test(start_paused = true)]
async fn budget_shared_only_one_of_many_pays() {
    let b = RetryBudget::new(2, 0.1).unwrap(); // one token
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), b.clone());
    let mut calls = Vec::new();
    for _ in 0..5 {
        calls.push(spawn_call(&mut svc, request()).await);
    }
    for _ in 0..5 {
        let (_, send, _) = next(&mut handle).await;
        send.send_response(status(Code::Unavailable));
    }
    let (_, send, _) = next(&mut handle).await;
    send.send_response(ok());
    let mut codes = Vec::new();
    for c in calls {
        codes.push(code_of(&bounded(c).await.unwrap().unwrap()));
    }
    assert_eq!(layer.metrics().retries(), 1);
    assert_eq!(layer.metrics().refused_by_budget(), 4);
    assert_eq!(codes.iter().filter(|c| **c == Code::Ok).count(), 1);
    assert!(handle.next_request().now_or_never().is_none());
}

// ---------------------------------------------------------------------------
// Against a real tonic server: a bidi retry committed mid-replay
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_bidi_retry_committed_mid_replay_is_not_broken() {
    use common::pb::Book;
    use common::pb::library_client::LibraryClient;
    // A tonic server with HTTP/2's default 64 KiB flow-control windows (as
    // grpc-go and grpc-java servers start out), whose first SyncBooks reads
    // 20 messages of the stream and then fails UNAVAILABLE (Trailers-Only).
    let first = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(
        tonic::transport::Server::builder()
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .layer(tower::layer::layer_fn(move |inner| FailFirstAfterReading {
                inner,
                first: first.clone(),
            }))
            .add_service(common::pb::library_server::LibraryServer::new(
                common::Shelf::default(),
            ))
            .serve_with_incoming(incoming),
    );
    let channel = common::library::channel(addr);
    let layer = RetryLayer::new(
        RetryPolicy::default().with_replay_limit(16 << 20),
        RetryBudget::new(200, 0.1).unwrap(),
    );
    let mut client = LibraryClient::new(
        tower::ServiceBuilder::new()
            .layer(layer.clone())
            .service(channel),
    );
    let n = 64;
    let books: Vec<Book> = (0..n)
        .map(|i| Book {
            isbn: format!("isbn-{i:05}"),
            title: "t".repeat(16 * 1024),
            author: "a".into(),
        })
        .collect();
    let outbound = tokio_stream::iter(books.clone());
    let result = tokio::time::timeout(Duration::from_secs(20), async {
        let mut echoes = client.sync_books(outbound).await?.into_inner();
        let mut got = 0;
        while let Some(book) = echoes.message().await? {
            assert_eq!(book.isbn, format!("isbn-{got:05}"));
            got += 1;
        }
        Ok::<_, tonic::Status>(got)
    })
    .await
    .expect("hung");
    assert_eq!(
        layer.metrics().retries(),
        1,
        "the first attempt was retried"
    );
    match result {
        Ok(got) => assert_eq!(got, n),
        Err(status) => panic!("the retried bidi stream broke: {status:?}"),
    }
}

#[derive(Clone)]
struct FailFirstAfterReading<S> {
    inner: S,
    first: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl<S> Service<Request<Body>> for FailFirstAfterReading<S>
where
    S: Service<Request<Body>, Response = Response<Body>> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        if self.first.swap(false, std::sync::atomic::Ordering::SeqCst) {
            Box::pin(async move {
                let mut body = req.into_body();
                let mut frames = 0;
                while frames < 20 {
                    match body.frame().await {
                        Some(Ok(_)) => frames += 1,
                        _ => break,
                    }
                }
                Ok(tonic::Status::unavailable("failed after reading").into_http())
            })
        } else {
            Box::pin(self.inner.call(req))
        }
    }
}

// ---------------------------------------------------------------------------
// The caller's mark must not crowd out the instance this call failed on
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_callers_full_mark_still_names_the_instance_that_failed_here() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    req.headers_mut().insert(
        "x-already-tried",
        HeaderValue::from_static("u1,u2,u3,u4,u5,u6,u7,u8"),
    );
    let call = spawn_call(&mut svc, req).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status_from("a", Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    let mark = retry.headers()["x-already-tried"]
        .to_str()
        .unwrap()
        .to_owned();
    send.send_response(ok());
    call.await.unwrap().unwrap();
    assert!(
        mark.split(',').any(|id| id == "a"),
        "the retry may go straight back to the instance that just failed: {mark}"
    );
}

// ---------------------------------------------------------------------------
// Attempts refused before they were sent, the live attempt's replay, timers
// below a millisecond, the balancer through the layer
// ---------------------------------------------------------------------------

/// tower's own budget with no reserve and no deposits: every `withdraw` is
/// refused, and the layer only learns it when a retry is sent.
fn empty_tps() -> tonic_retry::budgets::TowerBudget<TpsBudget> {
    tonic_retry::budgets::TowerBudget::new(TpsBudget::new(Duration::from_secs(10), 0, 0.0))
}

/// The first attempt is cut before it was sent: no server failed, so the
/// attempt after it is no retry — sent without a token, even from a budget
/// that refuses every withdrawal.
#[tokio::test(start_paused = true)]
async fn an_attempt_after_an_unsent_first_attempt_is_no_retry_and_costs_no_token() {
    let layer = RetryLayer::with_budget(policy(3).with_attempt_timeout(100 * MS), empty_tps());
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    handle.allow(0);
    let mut svc = layer.layer(inner);
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    // The first attempt is cut unsent at 100 ms; the next waits 16..24 ms.
    tokio::time::sleep(110 * MS).await;
    handle.allow(1);
    let (req, send, _) = next(&mut handle).await;
    assert!(
        !req.headers().contains_key("grpc-previous-rpc-attempts"),
        "no attempt was sent before this one"
    );
    send.send_response(ok());
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
    assert_eq!(layer.metrics().attempts(), 1);
    assert_eq!(layer.metrics().retries(), 0, "no retry was paid for");
}

/// Attempt 1 is sent and fails UNAVAILABLE; attempt 2 is cut before it is
/// sent; attempt 3 is refused by the budget at send time. The message names
/// attempt 1, the last one sent, not attempt 2, which never was.
#[tokio::test(start_paused = true)]
async fn no_budget_at_send_names_the_last_attempt_sent() {
    let layer = RetryLayer::with_budget(policy(3).with_attempt_timeout(100 * MS), empty_tps());
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc = layer.layer(inner);
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    let (_, send, t0) = next(&mut handle).await;
    handle.allow(0);
    send.send_response(status(Code::Unavailable));
    // Attempt 2 starts at 16..24 ms, waits for readiness and is cut unsent at
    // 116..124 ms; attempt 3 starts 32..48 ms later (148..172 ms).
    tokio::time::sleep_until(t0 + 135 * MS).await;
    handle.allow(1);
    let response = bounded(call).await.unwrap().unwrap();
    let message = message_of(&response);
    assert_eq!(code_of(&response), Code::ResourceExhausted, "{message}");
    assert_eq!(layer.metrics().attempts(), 1, "only attempt 1 was sent");
    assert!(
        message.contains("attempt 1 ended with UNAVAILABLE"),
        "the last attempt sent was attempt 1; the caller reads: {message:?}"
    );
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
        let response = bounded(call).await.unwrap().unwrap();
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

// ---------------------------------------------------------------------------
// The live attempt's replay
// ---------------------------------------------------------------------------

/// Attempt 1 fails (Trailers-Only UNAVAILABLE) while its transport still
/// pulls its request body (hyper's pipe runs until the server's RST_STREAM —
/// the hazard tests/edges.rs models for the last attempt). Attempt 2 is live
/// and mid-replay, but not the last attempt, so no release has happened yet.
/// The dead clone's late read must fail, not push the copy over the replay
/// limit and so fail the live attempt, which delivers the body whole.
#[tokio::test(start_paused = true)]
async fn a_dead_attempts_late_read_cannot_push_the_live_attempt_over_the_cap() {
    let Retried {
        tx,
        dead: mut body1,
        req2,
        send2,
        call,
        ..
    } = retried_after_reading(policy(3).with_replay_limit(8), &["1234"]).await;
    let mut body2 = req2.into_body();
    assert_eq!(next_data(&mut body2).await, "1234");
    // The failed attempt's pipe pulls the next chunk before its reset arrives.
    tx.send(data("56789")).unwrap();
    let late = body1.frame().await.unwrap();
    drop(body1);
    drop(tx);
    let rest = bounded(body2.collect()).await;
    send2.send_response(ok());
    let _ = call.await;
    match rest {
        Ok(c) => assert_eq!(c.to_bytes(), "56789"),
        Err(e) => {
            panic!("the live attempt's request body failed: {e} (the dead attempt read {late:?})")
        }
    }
}

/// After the release only the live clone may read. A dead clone that polled
/// the source last holds the source's waker; polled after the release, it
/// fails — and the live clone waiting for the source is still woken, without
/// waiting for the dead clone to be dropped.
#[tokio::test(start_paused = true)]
async fn live_clone_woken_after_dead_clone_errors() {
    let Retried {
        tx,
        dead: mut body1,
        req2,
        send2,
        call,
        ..
    } = retried_after_reading(policy(3), &["one "]).await;
    // The live attempt is read on its own task: replays "one ", then waits.
    let reader = tokio::spawn(async move { req2.into_body().collect().await });
    tokio::time::sleep(MS).await;
    // The dead attempt's task polls once more (Pending): it now owns the
    // source's waker. Its own task is a separate one.
    let (poll_tx, mut poll_rx) = mpsc::unbounded_channel::<()>();
    let dead = tokio::spawn(async move {
        let mut results = Vec::new();
        // Poll the dead body whenever woken, keep it after an error (as a
        // consumer that has not been dropped yet would).
        loop {
            let r = body1.frame().await;
            results.push(r.map(|r| r.is_ok()));
            if poll_rx.recv().await.is_none() {
                break;
            }
        }
        (results, body1)
    });
    tokio::time::sleep(MS).await;
    // Attempt 2 commits: only it may read from now on.
    send2.send_response(ok());
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
    tx.send(data("two")).unwrap();
    tx.send(Ok(Frame::trailers(ok_trailers()))).unwrap();
    drop(tx);
    let got = tokio::time::timeout(Duration::from_secs(10), reader).await;
    drop(poll_tx);
    let _ = dead.await;
    match got {
        Ok(Ok(Ok(c))) => assert_eq!(c.to_bytes(), "one two"),
        Ok(other) => panic!("the live body failed: {other:?}"),
        Err(_) => panic!("the live attempt's body was never woken"),
    }
}

/// Attempt 1 cut before it was sent, attempt 2 sent and answered UNAVAILABLE:
/// the caller's message numbers attempts among those sent, so it names
/// "attempt 1" whether the call ends at once or after attempt 3 is cut unsent.
#[tokio::test(start_paused = true)]
async fn the_last_attempt_sent_keeps_its_number() {
    async fn run(deadline: &'static str, respond_at: Duration) -> String {
        let (mut svc, mut handle, _) = setup(policy(4).with_attempt_timeout(100 * MS), budget());
        let start = Instant::now();
        handle.allow(0);
        let call = spawn_call(&mut svc, with_timeout(request(), deadline)).await;
        // Attempt 1 waits for readiness and is cut unsent at 100 ms.
        tokio::time::sleep_until(start + 105 * MS).await;
        handle.allow(1);
        let (_, send, _) = next(&mut handle).await; // attempt 2, at 116..124 ms
        handle.allow(0);
        tokio::time::sleep_until(start + respond_at).await;
        send.send_response(status(Code::Unavailable));
        let response = bounded(call).await.unwrap().unwrap();
        assert_eq!(code_of(&response), Code::DeadlineExceeded);
        message_of(&response)
    }
    // Deadline 250 ms, answer at 210 ms: no room for another attempt at once.
    let direct = run("250m", 210 * MS).await;
    // Deadline 200 ms, answer at 125 ms: attempt 3 is decided, waits for
    // readiness and is cut unsent at the deadline.
    let after_cut = run("200m", 125 * MS).await;
    let number = |m: &str| {
        m.split("attempt ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .map(str::to_owned)
    };
    assert_eq!(number(&direct).as_deref(), Some("1"), "{direct:?}");
    assert_eq!(number(&after_cut).as_deref(), Some("1"), "{after_cut:?}");
}

// ---------------------------------------------------------------------------
// Probes that held up
// ---------------------------------------------------------------------------

/// The first attempt waited for readiness inside the call: its body is the
/// first epoch, and a commit before it read anything leaves it whole.
#[tokio::test(start_paused = true)]
async fn first_attempt_after_readiness_wait_commits_and_streams_whole() {
    let (mut svc, mut handle, _) = setup(policy(3), budget());
    handle.allow(0);
    let (tx, req) = streaming_request();
    let call = tokio::spawn(svc.ready().await.unwrap().call(req));
    tokio::time::sleep(10 * MS).await;
    handle.allow(1);
    let (req1, send1, _) = next(&mut handle).await;
    send1.send_response(ok());
    assert_eq!(code_of(&bounded(call).await.unwrap().unwrap()), Code::Ok);
    tx.send(data("a")).unwrap();
    tx.send(data("b")).unwrap();
    tx.send(Ok(Frame::trailers(ok_trailers()))).unwrap();
    drop(tx);
    let c = bounded(req1.into_body().collect()).await.unwrap();
    assert_eq!(c.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(c.to_bytes(), "ab");
}

/// Release while the live clone is mid-replay, the source already ended with
/// trailers: data and trailers are replayed, size hint and end-of-stream right.
#[tokio::test(start_paused = true)]
async fn release_mid_replay_after_trailers() {
    let (mut svc, mut handle, _) = setup(policy(3), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req1, send1, _) = next(&mut handle).await;
    tx.send(data("ab")).unwrap();
    tx.send(data("cd")).unwrap();
    tx.send(Ok(Frame::trailers(ok_trailers()))).unwrap();
    drop(tx);
    let c = req1.into_body().collect().await.unwrap();
    assert_eq!(c.to_bytes(), "abcd");
    send1.send_response(status(Code::Unavailable));
    let (req2, send2, _) = next(&mut handle).await;
    let mut body2 = req2.into_body();
    assert_eq!(next_data(&mut body2).await, "ab");
    send2.send_response(ok());
    assert_eq!(code_of(&bounded(call).await.unwrap().unwrap()), Code::Ok);
    assert_eq!(http_body::Body::size_hint(&body2).exact(), Some(2));
    assert!(!http_body::Body::is_end_stream(&body2));
    let c = body2.collect().await.unwrap();
    assert_eq!(c.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(c.to_bytes(), "cd");
}

/// Attempt 2 sent, attempt 3 (the last) cut before it was sent; the release
/// then leaves attempt 2's stream readable and attempt 1's failing.
#[tokio::test(start_paused = true)]
async fn second_retry_cut_unsent_then_release() {
    let (mut svc, mut handle, _) = setup(policy(3).with_attempt_timeout(100 * MS), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req1, send1, _) = next(&mut handle).await;
    let mut body1 = req1.into_body();
    tx.send(data("x")).unwrap();
    body1.frame().await.unwrap().unwrap();
    send1.send_response(status(Code::Unavailable));
    let (req2, send2, _) = next(&mut handle).await;
    handle.allow(0);
    send2.send_response(status(Code::Unavailable));
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(
        code_of(&response),
        Code::DeadlineExceeded,
        "{}",
        message_of(&response)
    );
    tx.send(data("y")).unwrap();
    drop(tx);
    assert!(body1.frame().await.unwrap().is_err());
    assert_eq!(req2.into_body().collect().await.unwrap().to_bytes(), "xy");
}

/// Over the replay limit: not retried, attempt 1's body keeps streaming whole.
#[tokio::test(start_paused = true)]
async fn over_the_limit_then_release() {
    let (mut svc, mut handle, layer) = setup(policy(3).with_replay_limit(4), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req1, send1, _) = next(&mut handle).await;
    let mut body1 = req1.into_body();
    tx.send(data("12345")).unwrap();
    body1.frame().await.unwrap().unwrap();
    send1.send_response(status(Code::Unavailable));
    assert_eq!(
        code_of(&bounded(call).await.unwrap().unwrap()),
        Code::Unavailable
    );
    tx.send(data("6")).unwrap();
    drop(tx);
    assert_eq!(body1.collect().await.unwrap().to_bytes(), "6");
    assert_eq!(layer.metrics().attempts(), 1);
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
    assert_eq!(code_of(&bounded(call).await.unwrap().unwrap()), Code::Ok);

    let call = spawn_call(&mut svc, with_timeout(request(), "1500u")).await;
    let t = Instant::now();
    let (_, _send, _) = next(&mut handle).await;
    let response = bounded(call).await.unwrap().unwrap();
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
    assert_eq!(code_of(&bounded(call).await.unwrap().unwrap()), Code::Ok);
    assert!(t0.elapsed() < Duration::from_micros(700));
    assert_eq!(layer.metrics().attempts(), 1);
}

mod balancing {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tonic_retry::balance::PreferUntried;

    type Log = Arc<Mutex<Vec<&'static str>>>;

    fn endpoint(
        name: &'static str,
        log: Log,
    ) -> impl Service<
        Request<Body>,
        Response = Response<Body>,
        Error = tower::BoxError,
        Future: Send + 'static,
    > + Clone {
        tower::service_fn(move |_req: Request<Body>| {
            log.lock().unwrap().push(name);
            async move { Ok::<_, tower::BoxError>(ok()) }
        })
    }

    /// Round-robin without marks, through the retry layer.
    #[tokio::test(start_paused = true)]
    async fn round_robin_through_the_layer() {
        let log = Log::default();
        let lb =
            PreferUntried::new(["a", "b", "c"].map(|n| (n.to_owned(), endpoint(n, log.clone()))))
                .unwrap();
        let mut svc = RetryLayer::new(policy(3), budget()).layer(lb);
        for _ in 0..300 {
            svc.ready().await.unwrap().call(request()).await.unwrap();
        }
        let log = log.lock().unwrap();
        for n in ["a", "b", "c"] {
            assert_eq!(log.iter().filter(|x| **x == n).count(), 100, "{n}");
        }
    }

    /// Mixed ready / never-ready endpoints, a readiness error on one endpoint,
    /// load_shed above.
    #[tokio::test(start_paused = true)]
    async fn mixed_readiness_errors_and_load_shed() {
        let (a, mut ha) = mock::pair::<Request<Body>, Response<Body>>();
        let (b, mut hb) = mock::pair::<Request<Body>, Response<Body>>();
        hb.allow(0);
        type Boxed = tower::util::BoxCloneService<Request<Body>, Response<Body>, tower::BoxError>;
        let boxed = |m: mock::Mock<Request<Body>, Response<Body>>| -> Boxed {
            Boxed::new(m.map_err(Into::into))
        };
        let lb = PreferUntried::new([
            ("a".to_owned(), boxed(a)),
            ("b".to_owned(), boxed(b)),
            ("c".to_owned(), Boxed::new(Gone)),
        ])
        .unwrap();
        let mut svc = RetryLayer::new(policy(3), budget()).layer(lb.clone());
        for _ in 0..4 {
            let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
            let (_, send) = bounded(ha.next_request()).await.unwrap();
            send.send_response(ok());
            assert_eq!(call.await.unwrap().unwrap().headers()["x-instance-id"], "a");
        }
        // load_shed directly above: b and c cannot take it, a can.
        ha.allow(0);
        let mut shed = tower::load_shed::LoadShed::new(lb.clone());
        let e = shed
            .ready()
            .await
            .unwrap()
            .call(request())
            .await
            .unwrap_err();
        assert!(e.is::<tower::load_shed::error::Overloaded>(), "{e}");
        let _ = &mut hb;
    }

    /// An endpoint whose readiness always fails (a buffer whose worker died).
    #[derive(Clone)]
    struct Gone;
    impl Service<Request<Body>> for Gone {
        type Response = Response<Body>;
        type Error = tower::BoxError;
        type Future = std::future::Ready<Result<Response<Body>, tower::BoxError>>;
        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), tower::BoxError>> {
            std::task::Poll::Ready(Err("worker gone".into()))
        }
        fn call(&mut self, _: Request<Body>) -> Self::Future {
            panic!("called after failing readiness")
        }
    }
}

/// A zero per-attempt timeout: every attempt is cut before it is sent; no
/// token, no attempt, no retry is counted.
#[tokio::test(start_paused = true)]
async fn zero_attempt_timeout_spends_nothing() {
    let (mut svc, mut handle, layer) =
        setup(policy(3).with_attempt_timeout(Duration::ZERO), budget());
    let call = spawn_call(&mut svc, request()).await;
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    assert!(handle.next_request().now_or_never().is_none());
    let m = layer.metrics();
    assert_eq!(
        (m.attempts(), m.retries(), m.refused_by_budget()),
        (0, 0, 0)
    );
    assert_eq!(layer.budget().available(), 100.0);
}
