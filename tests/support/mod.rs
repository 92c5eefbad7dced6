//! Helpers shared by the tests: `tower-test` mocks and their requests and
//! answers, a real tonic `Library` server ([`library`]), a raw HTTP/2 server
//! ([`raw`]), a service with a capacity and what budgets do to it
//! ([`capacity`]), and the OpenTelemetry SDK's in-memory exporter
//! ([`exported`]).

#![allow(dead_code, unreachable_pub, unused_imports)]

pub mod capacity;
pub mod library;
pub mod raw;

pub use library::pb;
pub use library::{Instance, Shelf};

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::Frame;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{
    ResponseBody, RetryBudget, RetryLayer, RetryPolicy, metrics::Metrics, metrics::NoMetrics,
};
use tower::{BoxError, Layer, Service, ServiceExt};
use tower_test::mock;

pub const MS: Duration = Duration::from_millis(1);

/// Awaits `f` on real time, failing the test if it takes more than 20 s.
pub async fn bounded<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("the call hung")
}

/// Awaits `f` on paused time, where every call ends in well under an hour
/// of virtual time: a hang fails the test instead of stalling it.
pub async fn bounded_paused<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(3600), f)
        .await
        .expect("the call hung")
}

/// A policy of `attempts`, backing off from 20 ms to 500 ms with 20 % jitter.
pub fn policy(attempts: u32) -> RetryPolicy {
    RetryPolicy::new(attempts, 20 * MS, 500 * MS, 0.2).unwrap()
}

/// A policy of `attempts`, backing off from 10 ms to 100 ms without jitter:
/// on paused time its retries go at exact times.
pub fn exact_policy(attempts: u32) -> RetryPolicy {
    RetryPolicy::new(attempts, 10 * MS, 100 * MS, 0.0).unwrap()
}

/// A service answering each attempt as `answer` says (given the attempt's
/// index), after `delay`.
pub fn scripted<F>(
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

pub type Handle = mock::Handle<Request<Body>, Response<Body>>;
/// A mock behind the layer; `M` is what records its metrics.
pub type Svc<M = NoMetrics> =
    tonic_retry::RetryService<mock::Mock<Request<Body>, Response<Body>>, RetryBudget, Body, M>;
pub type Outcome<M = NoMetrics> = Result<Response<ResponseBody<Body, M>>, BoxError>;

pub fn budget() -> RetryBudget {
    RetryBudget::new(200, 0.1).unwrap()
}

pub fn setup(policy: RetryPolicy, budget: RetryBudget) -> (Svc, Handle, RetryLayer) {
    let layer = RetryLayer::new(policy, budget);
    let (inner, handle) = mock::pair();
    (layer.layer(inner), handle, layer)
}

pub fn request() -> Request<Body> {
    Request::builder()
        .method("POST")
        .uri("http://library/library.v1.Library/GetBook")
        .header("content-type", "application/grpc")
        .body(Body::new(http_body_util::Full::new(Bytes::from_static(
            b"\0\0\0\0\x05hello",
        ))))
        .unwrap()
}

pub fn with_timeout(mut req: Request<Body>, value: &'static str) -> Request<Body> {
    req.headers_mut()
        .insert("grpc-timeout", HeaderValue::from_static(value));
    req
}

/// A Trailers-Only response, as a tonic server sends an early error.
pub fn status(code: Code) -> Response<Body> {
    tonic::Status::new(code, "from the server").into_http()
}

pub fn status_from(instance: &'static str, code: Code) -> Response<Body> {
    let mut r = status(code);
    r.headers_mut()
        .insert("x-instance-id", HeaderValue::from_static(instance));
    r
}

/// A normal response: headers without `grpc-status`, the status in trailers.
pub fn ok() -> Response<Body> {
    Response::builder()
        .header("content-type", "application/grpc")
        .body(Body::empty())
        .unwrap()
}

/// A unary answer as a tonic server sends one: headers, one message, then
/// trailers with `code`.
pub fn answer(code: Code) -> Response<Body> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from(code as i32));
    let frames = [
        Ok::<_, tonic::Status>(Frame::data(Bytes::from_static(b"\0\0\0\0\x01x"))),
        Ok(Frame::trailers(trailers)),
    ];
    Response::builder()
        .header("content-type", "application/grpc")
        .body(Body::new(http_body_util::StreamBody::new(
            tokio_stream::iter(frames),
        )))
        .unwrap()
}

/// Reads a response to its end, as a client does: the code its trailers (or
/// its headers, for a Trailers-Only response) end the call with.
pub async fn read_to_end<M: Metrics>(response: Response<ResponseBody<Body, M>>) -> Code {
    use http_body_util::BodyExt;
    let headers_code = code_of(&response);
    let collected = response.into_body().collect().await.expect("the body");
    match collected.trailers() {
        Some(trailers) => trailers
            .get("grpc-status")
            .map_or(Code::Unknown, |v| Code::from_bytes(v.as_bytes())),
        None => headers_code,
    }
}

pub fn code_of<B>(r: &Response<B>) -> Code {
    match r.headers().get("grpc-status") {
        Some(v) => Code::from_bytes(v.as_bytes()),
        None => Code::Ok,
    }
}

pub fn message_of<B>(r: &Response<B>) -> String {
    tonic::Status::from_header_map(r.headers())
        .map(|s| s.message().to_owned())
        .unwrap_or_default()
}

/// Starts a call through the service on its own task.
pub async fn spawn_call<M: Metrics>(
    svc: &mut Svc<M>,
    req: Request<Body>,
) -> tokio::task::JoinHandle<Outcome<M>> {
    let svc = svc.ready().await.expect("mock is ready");
    tokio::spawn(svc.call(req))
}

pub async fn next(
    handle: &mut Handle,
) -> (Request<Body>, mock::SendResponse<Response<Body>>, Instant) {
    let (req, send) = handle
        .next_request()
        .await
        .expect("an attempt should arrive");
    (req, send, Instant::now())
}

/// Answers `n` attempts of one call with Trailers-Only UNAVAILABLE and returns
/// what the caller got.
pub async fn unavailable_every_time(
    svc: &mut Svc,
    handle: &mut Handle,
    n: usize,
) -> Response<ResponseBody<Body>> {
    let call = spawn_call(svc, request()).await;
    for _ in 0..n {
        let (_, send, _) = next(handle).await;
        send.send_response(status(Code::Unavailable));
    }
    call.await
        .expect("the call task")
        .expect("the layer answers")
}

/// The next frame of a request body, which must be data.
pub async fn next_data(body: &mut Body) -> Bytes {
    use http_body_util::BodyExt;
    let frame = body.frame().await.expect("a frame").expect("no error");
    frame.into_data().expect("a data frame")
}

pub trait NowOrNever: std::future::Future + Sized {
    fn now_or_never(self) -> Option<Self::Output> {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut fut = std::pin::pin!(self);
        match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }
}
impl<F: std::future::Future> NowOrNever for F {}

/// Every `grpc-timeout` value of `req`, in order.
pub fn grpc_timeouts(req: &Request<Body>) -> Vec<HeaderValue> {
    req.headers()
        .get_all("grpc-timeout")
        .iter()
        .cloned()
        .collect()
}

/// Reads a `grpc-timeout` value as a peer would.
pub fn parse_timeout(s: &str) -> Duration {
    let (n, unit) = s.split_at(s.len() - 1);
    let n: u64 = n.parse().unwrap();
    match unit {
        "n" => Duration::from_nanos(n),
        "u" => Duration::from_micros(n),
        "m" => Duration::from_millis(n),
        "S" => Duration::from_secs(n),
        "M" => Duration::from_secs(n * 60),
        "H" => Duration::from_secs(n * 3600),
        other => panic!("unexpected unit {other}"),
    }
}

/// Feeds a body written by hand.
pub type Tx = mpsc::UnboundedSender<Result<Frame<Bytes>, tonic::Status>>;

fn channel_body() -> (Tx, Body) {
    let (tx, rx) = mpsc::unbounded_channel();
    let body =
        http_body_util::StreamBody::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
    (tx, Body::new(body))
}

/// A request whose body the test writes chunk by chunk.
pub fn streaming_request() -> (Tx, Request<Body>) {
    let (tx, body) = channel_body();
    let mut req = request();
    *req.body_mut() = body;
    (tx, req)
}

/// A committed response whose body the test writes chunk by chunk.
pub fn streaming_response() -> (Tx, Response<Body>) {
    let (tx, body) = channel_body();
    let mut response = ok();
    *response.body_mut() = body;
    (tx, response)
}

/// A data frame.
pub fn data(s: &'static str) -> Result<Frame<Bytes>, tonic::Status> {
    Ok(Frame::data(Bytes::from_static(s.as_bytes())))
}

/// Trailers carrying `grpc-status: 0`.
pub fn ok_trailers() -> HeaderMap {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    trailers
}

#[cfg(feature = "opentelemetry")]
pub mod exported;

/// Lets spawned tasks (the drains) run to where they wait.
pub async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

/// Bytes whose memory says when it is freed.
struct Owned(Vec<u8>, std::sync::Arc<std::sync::atomic::AtomicBool>);

impl AsRef<[u8]> for Owned {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        self.1.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A chunk of `len` bytes, and a flag set once its memory is freed.
pub fn watched_chunk(len: usize) -> (Bytes, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    let freed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let owner = Owned(vec![b'x'; len], std::sync::Arc::clone(&freed));
    (Bytes::from_owner(owner), freed)
}
