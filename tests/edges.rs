//! The hardening promises at their edges (SPEC §3a, §4a, §6a, §7a, §8a): a
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

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::balance::PreferUntried;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tower::{BoxError, Layer, Service, ServiceExt};

use support::*;

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(3600), f)
        .await
        .expect("the call hung")
}

fn policy(attempts: u32) -> RetryPolicy {
    RetryPolicy::new(attempts, 20 * MS, 500 * MS, 0.2).unwrap()
}

type Tx = mpsc::UnboundedSender<Result<Frame<Bytes>, tonic::Status>>;

fn streaming_request() -> (Tx, Request<Body>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let body = Body::new(http_body_util::StreamBody::new(
        tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
    ));
    let mut req = request();
    *req.body_mut() = body;
    (tx, req)
}

fn data(s: &'static str) -> Result<Frame<Bytes>, tonic::Status> {
    Ok(Frame::data(Bytes::from_static(s.as_bytes())))
}

/// A committed response whose body the test feeds by hand.
fn streaming_response() -> (Tx, Response<Body>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let r = Response::builder()
        .header("content-type", "application/grpc")
        .body(Body::new(http_body_util::StreamBody::new(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        )))
        .unwrap();
    (tx, r)
}

fn ok_trailers() -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from_static("0"));
    t
}

// ---------------------------------------------------------------------------
// §7 / §7a: the replay copy released while a retry still replays it
// ---------------------------------------------------------------------------

/// A bidi / client-streaming call: attempt 1 reads two messages then fails
/// (Trailers-Only UNAVAILABLE); attempt 2 goes to a server whose handler
/// answers response headers at once (a server-streaming handler returns its
/// `Response` before reading the request stream). The commit releases the
/// copy while attempt 2 has not replayed it yet: attempt 2's request body
/// must still be sent whole (§7: never truncated, never corrupted).
#[tokio::test(start_paused = true)]
async fn commit_while_the_retry_is_still_replaying_keeps_its_body_whole() {
    let (mut svc, mut handle, _) = setup(policy(3), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;

    let (req1, send1, _) = next(&mut handle).await;
    let mut body1 = req1.into_body();
    tx.send(data("one ")).unwrap();
    assert_eq!(
        body1.frame().await.unwrap().unwrap().into_data().unwrap(),
        "one "
    );
    tx.send(data("two ")).unwrap();
    assert_eq!(
        body1.frame().await.unwrap().unwrap().into_data().unwrap(),
        "two "
    );
    drop(body1);
    send1.send_response(status(Code::Unavailable));

    let (req2, send2, _) = next(&mut handle).await;
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
/// answer): the chunk it pulls is no longer copied and the last attempt loses
/// it.
#[tokio::test(start_paused = true)]
async fn the_last_attempt_survives_a_late_read_by_the_failed_attempt() {
    let (mut svc, mut handle, _) = setup(policy(2), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;

    let (req1, send1, _) = next(&mut handle).await;
    let mut body1 = req1.into_body();
    tx.send(data("one ")).unwrap();
    assert_eq!(
        body1.frame().await.unwrap().unwrap().into_data().unwrap(),
        "one "
    );
    send1.send_response(status(Code::Unavailable));

    let (req2, send2, _) = next(&mut handle).await;
    let mut body2 = req2.into_body();
    assert_eq!(
        body2.frame().await.unwrap().unwrap().into_data().unwrap(),
        "one "
    );
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
// §3a: the committed body is cut at the deadline — not before it
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

// ---------------------------------------------------------------------------
// §4a: a token only for an attempt really sent — through PreferUntried
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
    send.send_response(ok());
    let response = bounded(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
    assert!(handle_b.next_request().now_or_never().is_none());
    assert_eq!(
        (layer.metrics().retries(), layer.budget().available()),
        (1, 99.1),
        "one retry, really sent, paid one token; the success earned 0.1"
    );
}

// ---------------------------------------------------------------------------
// §6a / no hang: PreferUntried whose endpoints have all failed
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
// §8a: the first attempt's readiness failure names the transport error
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
// §3: "no time left", naming the last attempt's code
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
// §3a: the attempt itself is cut before the deadline (same timer slack)
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

#[tokio::test(start_paused = true)]
async fn grpc_timeout_edges() {
    for t in ["0n", "00000000n", "99999999H", "99999999M", "1n"] {
        let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
        let call = spawn_call(&mut svc, with_timeout(request(), t)).await;
        if let Some(Some((req, send))) = handle.next_request().now_or_never() {
            let _ = req;
            send.send_response(ok());
        }
        let r = bounded(call).await.unwrap().unwrap();
        let _ = code_of(&r);
    }
}

#[tokio::test(start_paused = true)]
async fn huge_server_delays_with_no_cap_and_no_deadline() {
    let policy = RetryPolicy::default().with_max_server_delay(Duration::MAX);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut().insert(
        "grpc-retry-pushback-ms",
        HeaderValue::from_static("18446744073709551615"),
    );
    send.send_response(r);
    tokio::time::sleep(Duration::from_secs(10)).await;
    call.abort();
    let _ = call.await;
    // and with a deadline
    let policy = RetryPolicy::default().with_max_server_delay(Duration::MAX);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "99999999H")).await;
    let (_, send, _) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut().insert(
        "grpc-retry-pushback-ms",
        HeaderValue::from_static("18446744073709551615"),
    );
    send.send_response(r);
    tokio::time::sleep(Duration::from_secs(10)).await;
    call.abort();
    let _ = call.await;
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
// §7 / §7a against a real tonic server: a bidi retry committed mid-replay
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
// §6a: the caller's mark must not crowd out the instance this call failed on
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
