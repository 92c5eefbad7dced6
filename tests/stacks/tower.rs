//! The layer fits every common tower stack: a call through it can
//! be `tokio::spawn`ed on a multi-threaded runtime whatever sits below or
//! above it, with a generated client on top where one applies.
//!
//! This file is a compile matrix first: each case names its stack with
//! concrete types and spawns the call inside an `async move` block, which is
//! where a trait bound carried by a struct definition (rather than by its
//! impls) used to fail with "implementation of `From` is not general
//! enough". Each case then runs the call against a real tonic server on
//! loopback that fails the first attempt, and checks that the layer retried
//! it.

use crate::support::bounded;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::pb::library_client::LibraryClient;
use crate::support::pb::{Book, GetBookRequest};
use crate::support::{Instance, Shelf};
use bytes::Bytes;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use tonic::Code;
use tonic::body::Body;
use tonic::transport::Channel;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::util::BoxCloneService;
use tower::{BoxError, Layer, ServiceBuilder, ServiceExt};

fn layer() -> RetryLayer {
    RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1).unwrap())
}

/// A server whose first call answers `UNAVAILABLE`: the layer must retry it.
async fn server() -> Instance {
    let faults = FaultLayer::new("a")
        .unwrap()
        .with(Rule::first(1, Fault::unavailable()));
    Instance::start(Shelf::default(), faults).await
}

/// A unary `GetBook` request as tonic's generated client encodes it.
fn raw_request(channel_uri: &str) -> http::Request<Body> {
    let message = b"\n\x0242"; // GetBookRequest { isbn: "42" }
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(message);
    http::Request::builder()
        .method("POST")
        .uri(format!("{channel_uri}/library.v1.Library/GetBook"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Body::new(http_body_util::Full::new(Bytes::from(frame))))
        .unwrap()
}

/// The `grpc-status` a raw call ended with, read to its trailers.
async fn grpc_status<RB>(response: http::Response<RB>) -> Result<String, BoxError>
where
    RB: http_body::Body,
    RB::Error: Into<BoxError>,
{
    let (parts, body) = response.into_parts();
    if let Some(code) = parts.headers.get("grpc-status") {
        return Ok(code.to_str()?.to_owned());
    }
    let collected = body.collect().await.map_err(Into::into)?;
    let trailers = collected.trailers().cloned().unwrap_or_default();
    Ok(trailers
        .get("grpc-status")
        .map(|v| v.to_str().unwrap_or("?").to_owned())
        .unwrap_or_else(|| "none".to_owned()))
}

/// Spawns a raw call through `$svc` (moved into the task) and checks it
/// ended `OK` after one retry at `$server`.
macro_rules! spawn_oneshot {
    ($server:expr, $svc:expr) => {{
        let server = &$server;
        let svc = $svc;
        let req = raw_request(&format!("http://{}", server.addr));
        let task = tokio::spawn(async move {
            let response = svc.oneshot(req).await.map_err(Into::<BoxError>::into)?;
            grpc_status(response).await
        });
        let status = bounded(task).await.expect("the task panicked");
        assert_eq!(status.expect("the call failed"), "0");
        assert_eq!(server.faults.requests(), 2, "one failure, one retry");
    }};
}

/// Spawns a generated client's call through `$svc` (moved into the task)
/// and checks it got the book after one retry at `$server`.
macro_rules! spawn_client {
    ($server:expr, $svc:expr) => {{
        let server = &$server;
        let mut client = LibraryClient::new($svc);
        let task = tokio::spawn(async move {
            client
                .get_book(GetBookRequest { isbn: "42".into() })
                .await
                .map(tonic::Response::into_inner)
        });
        let book: Book = bounded(task)
            .await
            .expect("the task panicked")
            .expect("the call failed");
        assert_eq!(book.isbn, "42");
        assert_eq!(server.faults.requests(), 2, "one failure, one retry");
    }};
}

/// A `service_fn` over a channel whose closure returns `BoxError`, as a
/// hand-written service usually does: the closure's type, and so the
/// service's, names `BoxError`. A macro, so that the closure is written where
/// the call is spawned, as a user writes it.
macro_rules! service_fn_over {
    ($channel:expr) => {{
        let channel: Channel = $channel;
        tower::service_fn(move |req: http::Request<Body>| {
            let channel = channel.clone();
            async move {
                let response = channel.oneshot(req).await?;
                Ok::<_, BoxError>(response)
            }
        })
    }};
}

// ---- the layer over … ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_channel() {
    let server = server().await;
    spawn_oneshot!(server, layer().layer(server.channel()));
    let server = self::server().await;
    spawn_client!(server, layer().layer(server.channel()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_timeout() {
    let server = server().await;
    let svc = ServiceBuilder::new()
        .layer(layer())
        .timeout(Duration::from_secs(5))
        .service(server.channel());
    spawn_oneshot!(server, svc);
    let server = self::server().await;
    let svc = ServiceBuilder::new()
        .layer(layer())
        .timeout(Duration::from_secs(5))
        .service(server.channel());
    spawn_client!(server, svc);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_concurrency_limit() {
    let server = server().await;
    let svc = ServiceBuilder::new()
        .layer(layer())
        .concurrency_limit(4)
        .service(server.channel());
    spawn_oneshot!(server, svc);
    let server = self::server().await;
    let svc = ServiceBuilder::new()
        .layer(layer())
        .concurrency_limit(4)
        .service(server.channel());
    spawn_client!(server, svc);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_buffer() {
    let server = server().await;
    let svc = ServiceBuilder::new()
        .layer(layer())
        .buffer(16)
        .service(server.channel());
    spawn_oneshot!(server, svc);
    let server = self::server().await;
    let svc = ServiceBuilder::new()
        .layer(layer())
        .buffer(16)
        .service(server.channel());
    spawn_client!(server, svc);
}

/// A boxed stack erroring with `BoxError`. No generated client goes on top:
/// tonic's `GrpcService` asks `Error: Into<BoxError>` of the service it is
/// given, which the compiler cannot prove for an error type named in the
/// service's own type once the call is spawned — true of tonic's client over
/// the boxed service alone, and of tower's `Timeout`, `Buffer` and `LoadShed`
/// over it. `ConcurrencyLimit`, which keeps the error type, can go above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_box_clone_service() {
    type Boxed = BoxCloneService<http::Request<Body>, http::Response<Body>, BoxError>;
    let server = server().await;
    let boxed: Boxed = BoxCloneService::new(server.channel().map_err(BoxError::from));
    spawn_oneshot!(server, layer().layer(boxed));
    let server = self::server().await;
    let boxed: Boxed = BoxCloneService::new(server.channel().map_err(BoxError::from));
    let svc = ServiceBuilder::new()
        .concurrency_limit(4)
        .layer(layer())
        .service(boxed);
    spawn_oneshot!(server, svc);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_service_fn_with_box_error() {
    let server = server().await;
    spawn_oneshot!(server, layer().layer(service_fn_over!(server.channel())));
    let server = self::server().await;
    let svc = ServiceBuilder::new()
        .concurrency_limit(4)
        .layer(layer())
        .service(service_fn_over!(server.channel()));
    spawn_oneshot!(server, svc);
}

/// The issue's own case: a `service_fn` whose closure names `BoxError` in
/// its signature, answering without a server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_an_inline_service_fn_answering_ok() {
    let inner = tower::service_fn(|_req: http::Request<Body>| {
        std::future::ready(Ok::<_, BoxError>(
            tonic::Status::new(Code::Ok, "").into_http::<Body>(),
        ))
    });
    let svc = layer().layer(inner);
    let task = tokio::spawn(async move {
        svc.oneshot(http::Request::new(Body::empty()))
            .await
            .map(|r| r.headers()["grpc-status"].clone())
    });
    let status = bounded(task).await.expect("the task panicked");
    assert_eq!(status.expect("the call failed"), "0");
}

/// A request body of http-body-util's boxed kind, through a layer made for it
/// with `for_body`. Awaited, not spawned: a request type that names
/// `BoxError` cannot be spawned through any tower service (tower's own
/// `Oneshot` asks the service to take the request type with every lifetime
/// erased).
#[tokio::test]
async fn with_a_boxed_request_body() {
    type Boxed = UnsyncBoxBody<Bytes, BoxError>;
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&calls);
    let inner = tower::service_fn(move |req: http::Request<Boxed>| {
        let n = seen.fetch_add(1, Ordering::SeqCst);
        async move {
            // Read the body to its end, as a server would, before answering:
            // UNAVAILABLE first, then OK if the retry replayed the body whole.
            let body = req.into_body().collect().await?.to_bytes();
            let code = match (n, body.len()) {
                (0, _) => Code::Unavailable,
                (_, 5) => Code::Ok,
                _ => Code::Internal,
            };
            Ok::<_, BoxError>(tonic::Status::new(code, "").into_http::<Body>())
        }
    });
    let svc = layer().for_body::<Boxed>().layer(inner);
    let body: Boxed = http_body_util::Full::new(Bytes::from_static(b"\0\0\0\0\0"))
        .map_err(BoxError::from)
        .boxed_unsync();
    let response = bounded(svc.oneshot(http::Request::new(body)))
        .await
        .expect("the call failed");
    assert_eq!(response.headers()["grpc-status"], "0");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "one failure, one retry");
}

// ---- the layer under … ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_timeout() {
    let server = server().await;
    let svc = ServiceBuilder::new()
        .timeout(Duration::from_secs(5))
        .layer(layer())
        .service(server.channel());
    spawn_oneshot!(server, svc);
    let server = self::server().await;
    let svc = ServiceBuilder::new()
        .timeout(Duration::from_secs(5))
        .layer(layer())
        .service(server.channel());
    spawn_client!(server, svc);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_load_shed() {
    let server = server().await;
    let svc = ServiceBuilder::new()
        .load_shed()
        .layer(layer())
        .service(server.channel());
    spawn_oneshot!(server, svc);
    let server = self::server().await;
    let svc = ServiceBuilder::new()
        .load_shed()
        .layer(layer())
        .service(server.channel());
    spawn_client!(server, svc);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_buffer() {
    let server = server().await;
    let svc = ServiceBuilder::new()
        .buffer(16)
        .layer(layer())
        .service(server.channel());
    spawn_oneshot!(server, svc);
    let server = self::server().await;
    let svc = ServiceBuilder::new()
        .buffer(16)
        .layer(layer())
        .service(server.channel());
    spawn_client!(server, svc);
}

/// The layers users stack most: a buffer, shedding, a limit and a timeout
/// above the layer, a per-attempt timeout and a limit below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inside_a_full_stack() {
    let stack = |channel: Channel| {
        ServiceBuilder::new()
            .buffer(16)
            .load_shed()
            .concurrency_limit(8)
            .timeout(Duration::from_secs(5))
            .layer(layer())
            .timeout(Duration::from_secs(2))
            .concurrency_limit(4)
            .service(channel)
    };
    let server = server().await;
    spawn_oneshot!(server, stack(server.channel()));
    let server = self::server().await;
    spawn_client!(server, stack(server.channel()));
}

/// Where a timeout goes decides what it is: a tower `timeout` above the layer
/// is not the call's deadline (the layer never learns it, and the caller
/// gets tonic's `UNKNOWN`), while `Request::set_timeout` is, attempts and
/// retries included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tower_timeout_above_the_layer_is_not_the_calls_deadline() {
    let slow = || {
        FaultLayer::new("slow")
            .unwrap()
            .with(Rule::always(Fault::slow(Duration::from_millis(500))))
    };
    let server = Instance::start(Shelf::default(), slow()).await;
    let svc = ServiceBuilder::new()
        .timeout(Duration::from_millis(100))
        .layer(layer())
        .service(server.channel());
    let status = bounded(LibraryClient::new(svc).get_book(GetBookRequest { isbn: "1".into() }))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unknown);
    assert!(status.message().contains("request timed out"), "{status:?}");

    let server = Instance::start(Shelf::default(), slow()).await;
    let mut client = LibraryClient::new(layer().layer(server.channel()));
    let mut request = tonic::Request::new(GetBookRequest { isbn: "1".into() });
    request.set_timeout(Duration::from_millis(100));
    let status = bounded(client.get_book(request)).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
}
