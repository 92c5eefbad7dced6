//! What the benchmarks share: the in-memory inner service, the request, and
//! the three stacks compared — (a) no layer, (b) what a user writes with tower
//! alone (`tower::retry::Retry`, a minimal policy that buffers the body, and an
//! `Arc<TpsBudget>`), (c) `RetryLayer`.

#![allow(dead_code, unreachable_pub, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tonic::body::Body;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tower::retry::budget::{Budget, TpsBudget};
use tower::retry::{Policy, Retry};
use tower::{BoxError, Layer, Service, ServiceExt};

pub static SMALL: [u8; 16] = [7; 16];
pub static LARGE: [u8; 16 * 1024] = [7; 16 * 1024];

/// A unary gRPC request carrying `payload`, as tonic's generated client makes
/// it: its headers (static values) and the `GrpcMethod` extension.
pub fn request(payload: &'static [u8]) -> Request<Body> {
    Request::builder()
        .method("POST")
        .uri("http://bench/library.v1.Library/GetBook")
        .header(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        )
        .header(http::header::TE, http::HeaderValue::from_static("trailers"))
        .extension(tonic::GrpcMethod::new("library.v1.Library", "GetBook"))
        .body(Body::new(Full::new(Bytes::from_static(payload))))
        .expect("a valid request")
}

/// A unary answer as a gRPC server sends one: headers, one message, then
/// `OK` in the trailers.
fn ok() -> Response<Body> {
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let body = Full::new(Bytes::from_static(b"\0\0\0\0\x01x"))
        .with_trailers(std::future::ready(Some(Ok(trailers))));
    Response::builder()
        .header(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        )
        .body(Body::new(body))
        .expect("a valid response")
}

fn unavailable() -> Response<Body> {
    tonic::Status::unavailable("bench").into_http()
}

/// Reads the whole request body, then answers OK: an in-memory server.
pub fn inner_ok()
-> impl Service<Request<Body>, Response = Response<Body>, Error = BoxError, Future: Send>
+ Clone
+ Send
+ 'static {
    tower::service_fn(|req: Request<Body>| async move {
        req.into_body().collect().await?;
        Ok::<_, BoxError>(ok())
    })
}

/// Like [`inner_ok`], but every other call fails with UNAVAILABLE: called
/// sequentially, each call fails once and then succeeds.
pub fn inner_fails_once()
-> impl Service<Request<Body>, Response = Response<Body>, Error = BoxError, Future: Send>
+ Clone
+ Send
+ 'static {
    let calls = Arc::new(AtomicU64::new(0));
    tower::service_fn(move |req: Request<Body>| {
        let n = calls.fetch_add(1, Ordering::Relaxed);
        async move {
            req.into_body().collect().await?;
            Ok::<_, BoxError>(if n.is_multiple_of(2) {
                unavailable()
            } else {
                ok()
            })
        }
    })
}

/// (b): the retry policy a user writes for tower's `Retry`: retry
/// UNAVAILABLE and transport errors, paid from a shared `TpsBudget`.
#[derive(Clone)]
pub struct TowerPolicy {
    budget: Arc<TpsBudget>,
}

impl<E> Policy<Request<Bytes>, Response<Body>, E> for TowerPolicy {
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _: &mut Request<Bytes>,
        result: &mut Result<Response<Body>, E>,
    ) -> Option<Self::Future> {
        let failed = match result {
            Ok(r) => r.headers().get("grpc-status").is_some_and(|v| v == "14"),
            Err(_) => true,
        };
        if !failed {
            self.budget.deposit();
            return None;
        }
        self.budget.withdraw().then(|| std::future::ready(()))
    }

    fn clone_request(&mut self, req: &Request<Bytes>) -> Option<Request<Bytes>> {
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        *clone.extensions_mut() = req.extensions().clone();
        Some(clone)
    }
}

/// (b): tower alone. The body is buffered first (tower's `Retry` needs a
/// clonable request), then sent through `Retry`.
pub fn tower_retry<S>(
    inner: S,
) -> impl Service<Request<Body>, Response = Response<Body>, Error = BoxError, Future: Send>
+ Clone
+ Send
+ 'static
where
    S: Service<Request<Body>, Response = Response<Body>, Error = BoxError, Future: Send>
        + Clone
        + Send
        + 'static,
{
    let budget = Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2));
    let inner = tower::util::MapRequest::new(inner, |r: Request<Bytes>| {
        r.map(|b| Body::new(Full::new(b)))
    });
    let retry = Retry::new(TowerPolicy { budget }, inner);
    tower::service_fn(move |req: Request<Body>| {
        let retry = retry.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await?.to_bytes();
            retry.oneshot(Request::from_parts(parts, body)).await
        }
    })
}

/// (c): this crate's layer.
pub fn layered<S, RB>(inner: S, policy: RetryPolicy) -> tonic_retry::RetryService<S>
where
    S: Service<Request<Body>, Response = http::Response<RB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: http_body::Body + Send + 'static,
{
    let layer = RetryLayer::new(
        policy,
        RetryBudget::new(1_000, 0.1).expect("a valid budget"),
    );
    layer.layer(inner)
}

/// (c) with `OutcomeBudget::default()` paying for its retries.
pub fn layered_outcome<S, RB>(
    inner: S,
    policy: RetryPolicy,
) -> tonic_retry::RetryService<S, tonic_retry::OutcomeBudget>
where
    S: Service<Request<Body>, Response = http::Response<RB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: http_body::Body + Send + 'static,
{
    RetryLayer::with_budget(policy, tonic_retry::OutcomeBudget::default()).layer(inner)
}

/// (c) with per-method policies: a table of 8 services and 32 methods, the
/// request's `GetBook` having an entry of its own (the longest lookup: the
/// method map hit; `/GetBook` at a service entry would look up twice).
pub fn layered_per_method<S, RB>(inner: S) -> tonic_retry::RetryService<S>
where
    S: Service<Request<Body>, Response = http::Response<RB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: http_body::Body + Send + 'static,
{
    let mut table = tonic_retry::MethodPolicies::with_default(RetryPolicy::default());
    for s in 0..8 {
        let service = format!("bench.v{s}.Service");
        table = table
            .with_service(&service, RetryPolicy::default())
            .expect("distinct names");
        for m in 0..4 {
            table = table
                .with_method(&service, &format!("Method{m}"), RetryPolicy::default())
                .expect("distinct names");
        }
    }
    let table = table
        .with_method("library.v1.Library", "GetBook", RetryPolicy::default())
        .expect("distinct names");
    let layer = RetryLayer::new(table, RetryBudget::new(1_000, 0.1).expect("a valid budget"));
    layer.layer(inner)
}

/// One call, to the end of the response: its body is read to the trailers,
/// as a client reads a unary answer.
pub async fn call<S, R>(svc: &mut S, payload: &'static [u8])
where
    S: Service<Request<Body>, Response = Response<R>, Error = BoxError>,
    R: http_body::Body,
    R::Error: std::fmt::Debug,
{
    let response = svc
        .ready()
        .await
        .expect("ready")
        .call(request(payload))
        .await
        .expect("a response");
    let collected = response.into_body().collect().await.expect("the body");
    std::hint::black_box(collected);
}

/// `iters` calls one after another; the time they took.
pub async fn timed<S, R>(mut svc: S, iters: u64, payload: &'static [u8]) -> std::time::Duration
where
    S: Service<Request<Body>, Response = Response<R>, Error = BoxError>,
    R: http_body::Body,
    R::Error: std::fmt::Debug,
{
    let start = std::time::Instant::now();
    for _ in 0..iters {
        call(&mut svc, payload).await;
    }
    start.elapsed()
}

pub fn zero_backoff() -> RetryPolicy {
    RetryPolicy::new(3, Duration::ZERO, Duration::ZERO, 0.0).expect("a valid policy")
}

/// For the callgrind benches: runs `calls(stack, n)` on a runtime of one
/// thread, with `stack` and `n` from the `STACK` and `N` (default 10,000)
/// environment variables.
pub fn run_stack<F, Fut>(calls: F)
where
    F: FnOnce(String, u64) -> Fut,
    Fut: std::future::Future<Output = std::time::Duration>,
{
    let stack = std::env::var("STACK").unwrap_or_default();
    let n = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    runtime.block_on(calls(stack, n));
}
