//! gRPC's standard client metrics (gRFC A66, A96) from calls between a
//! generated tonic client and a real tonic server on loopback, read back
//! through the OpenTelemetry SDK's in-memory exporter. Times are real but
//! short; every call is bounded.
#![cfg(feature = "opentelemetry")]

use crate::support::{bounded, exact_policy};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::support::Instance;
use crate::support::exported::Exported;
use crate::support::pb::library_client::LibraryClient;
use crate::support::pb::library_server::LibraryServer;
use crate::support::pb::{GetBookRequest, ListBooksRequest};
use tonic::Code;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::{BoxError, Service, ServiceBuilder};

const MS: Duration = Duration::from_millis(1);
const GET_BOOK: &str = "/library.v1.Library/GetBook";
const LIST_BOOKS: &str = "/library.v1.Library/ListBooks";

/// A client through a layer given metrics: its metrics are in its type.
type Client = LibraryClient<
    tonic_retry::RetryService<
        tonic::transport::Channel,
        RetryBudget,
        tonic::body::Body,
        tonic_retry::otel::Recorder,
    >,
>;

/// A generated client through a layer recording on `exported`, `grpc.target`
/// the instance's URI, and both methods named.
fn connect(instance: &Instance, exported: &Exported, policy: RetryPolicy) -> (Client, String) {
    let target = format!("dns:///{}", instance.addr);
    let metrics = exported
        .metrics(&target)
        .with_methods([GET_BOOK, LIST_BOOKS])
        .unwrap();
    let layer =
        RetryLayer::new(policy, RetryBudget::new(200, 0.1).unwrap()).with_grpc_metrics(metrics);
    let client = LibraryClient::new(
        ServiceBuilder::new()
            .layer(layer)
            .service(instance.channel()),
    );
    (client, target)
}

#[tokio::test]
async fn a_call_through_two_unavailable_answers_records_three_attempts_and_two_retries() {
    let server = Instance::with_faults(
        FaultLayer::new("a")
            .unwrap()
            .with(Rule::first(2, Fault::unavailable())),
    )
    .await;
    let exported = Exported::new();
    let policy = RetryPolicy::new(4, 10 * MS, 100 * MS, 0.2).unwrap();
    let (mut client, target) = connect(&server, &exported, policy);

    let book = bounded(client.get_book(GetBookRequest { isbn: "7".into() }))
        .await
        .expect("the third attempt succeeds");
    assert_eq!(book.into_inner().isbn, "7");
    assert_eq!(server.faults.requests(), 3);

    let got = exported.collect();
    let method = ("grpc.method", "library.v1.Library/GetBook");
    let target = ("grpc.target", target.as_str());
    assert_eq!(
        got.point("grpc.client.attempt.started", &[method, target])
            .sum,
        3.0
    );
    let failed = got.point(
        "grpc.client.attempt.duration",
        &[method, target, ("grpc.status", "UNAVAILABLE")],
    );
    assert_eq!(failed.count, 2);
    let ok = got.point(
        "grpc.client.attempt.duration",
        &[method, target, ("grpc.status", "OK")],
    );
    assert_eq!(ok.count, 1);
    let call = got.point(
        "grpc.client.call.duration",
        &[method, target, ("grpc.status", "OK")],
    );
    assert_eq!(call.count, 1);
    assert!(
        call.sum >= failed.sum + ok.sum,
        "the call lasts at least as long as its attempts: {call:?}, {failed:?}, {ok:?}"
    );

    let retries = got.point("grpc.client.call.retries", &[method, target]);
    assert_eq!((retries.count, retries.sum), (1, 2.0));
    // Two backoffs of about 10 ms and 20 ms, ±20 % each.
    let delay = got.point("grpc.client.call.retry_delay", &[method, target]);
    assert_eq!(delay.count, 1);
    assert!(delay.sum >= 0.024, "{delay:?}");
    assert!(
        got.points("grpc.client.call.transparent_retries")
            .is_empty(),
        "the server answered both failures: not transparent"
    );
    assert!(got.points("grpc.client.call.hedges").is_empty());
}

#[tokio::test]
async fn attempts_that_found_no_connection_are_the_policys_retries() {
    let mut server = Instance::with_faults(FaultLayer::new("a").unwrap()).await;
    let exported = Exported::new();
    let policy = RetryPolicy::new(5, 20 * MS, 200 * MS, 0.2).unwrap();
    let (mut client, target) = connect(&server, &exported, policy);
    bounded(client.get_book(GetBookRequest { isbn: "0".into() }))
        .await
        .expect("healthy at first");

    server.stop().await;
    let restarted = tokio::spawn(async move {
        tokio::time::sleep(60 * MS).await;
        server.restart().await;
        server
    });
    bounded(client.get_book(GetBookRequest { isbn: "1".into() }))
        .await
        .expect("a retry reaches the restarted instance");
    let _server = restarted.await.unwrap();
    let got = exported.collect();
    let method = ("grpc.method", "library.v1.Library/GetBook");
    let target = ("grpc.target", target.as_str());
    // Every failed attempt found no connection: it failed where the channel
    // picks one, which gRPC hands to the retry policy (paced by its backoff,
    // paid for), so A96 counts its retries as `retries`, not transparent.
    let retries = got.point("grpc.client.call.retries", &[method, target]);
    assert_eq!(retries.count, 1, "one call retried");
    assert!(retries.sum >= 1.0, "{retries:?}");
    assert!(
        got.points("grpc.client.call.transparent_retries")
            .is_empty(),
        "no stream was refused by a server"
    );
    let refused = got.point(
        "grpc.client.attempt.duration",
        &[method, target, ("grpc.status", "UNAVAILABLE")],
    );
    assert_eq!(refused.count as f64, retries.sum);
    let started = got.point("grpc.client.attempt.started", &[method, target]);
    assert_eq!(started.sum, retries.sum + 2.0, "two calls and the retries");
    let delay = got.point("grpc.client.call.retry_delay", &[method, target]);
    assert_eq!(delay.count, 1);
    let calls = got.point(
        "grpc.client.call.duration",
        &[method, target, ("grpc.status", "OK")],
    );
    assert_eq!(calls.count, 2);
}

#[tokio::test]
async fn a_server_stream_is_measured_until_its_last_message_is_read() {
    let server = Instance::with_faults(FaultLayer::new("a").unwrap()).await;
    let exported = Exported::new();
    let (mut client, target) = connect(&server, &exported, RetryPolicy::default());

    let request = ListBooksRequest {
        author: "Anonymous".into(),
        limit: 3,
    };
    let mut stream = bounded(client.list_books(request))
        .await
        .expect("the stream opens")
        .into_inner();
    bounded(stream.message())
        .await
        .unwrap()
        .expect("a first book");
    // The caller reads slowly: the attempt and the call last until the end.
    tokio::time::sleep(100 * MS).await;
    let mut rest = 0;
    while bounded(stream.message()).await.unwrap().is_some() {
        rest += 1;
    }
    assert_eq!(rest, 2);
    drop(stream);

    let got = exported.collect();
    let method = ("grpc.method", "library.v1.Library/ListBooks");
    let target = ("grpc.target", target.as_str());
    let attempt = got.point(
        "grpc.client.attempt.duration",
        &[method, target, ("grpc.status", "OK")],
    );
    assert_eq!(attempt.count, 1);
    assert!(attempt.sum >= 0.1, "measured to its trailers: {attempt:?}");
    let call = got.point(
        "grpc.client.call.duration",
        &[method, target, ("grpc.status", "OK")],
    );
    assert_eq!(call.count, 1);
    assert!(call.sum >= 0.1, "{call:?}");
    assert!(got.points("grpc.client.call.retries").is_empty());
}

#[tokio::test]
async fn a_fatal_status_from_the_server_is_the_calls_status() {
    let server = Instance::with_faults(
        FaultLayer::new("a")
            .unwrap()
            .with(Rule::first(1, Fault::status(Code::NotFound))),
    )
    .await;
    let exported = Exported::new();
    let (mut client, target) = connect(&server, &exported, RetryPolicy::default());

    let status = bounded(client.get_book(GetBookRequest { isbn: "9".into() }))
        .await
        .expect_err("NOT_FOUND is not retried");
    assert_eq!(status.code(), Code::NotFound);

    let got = exported.collect();
    let method = ("grpc.method", "library.v1.Library/GetBook");
    let target = ("grpc.target", target.as_str());
    for name in ["grpc.client.attempt.duration", "grpc.client.call.duration"] {
        let p = got.point(name, &[method, target, ("grpc.status", "NOT_FOUND")]);
        assert_eq!(p.count, 1, "{name}");
    }
    assert_eq!(
        got.point("grpc.client.attempt.started", &[method, target])
            .sum,
        1.0
    );
    assert!(got.points("grpc.client.call.retries").is_empty());
}

/// A proxy in front of the server that answers the first request HTTP 503
/// without `grpc-status`, as Envoy or nginx does for an overloaded upstream.
#[derive(Clone)]
struct Proxy503<S> {
    inner: S,
    seen: Arc<AtomicU64>,
}

impl<S> Service<http::Request<tonic::body::Body>> for Proxy503<S>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        if self.seen.fetch_add(1, Ordering::SeqCst) == 0 {
            return Box::pin(async {
                Ok(http::Response::builder()
                    .status(503)
                    .header("content-type", "text/plain")
                    .body(tonic::body::Body::empty())
                    .unwrap())
            });
        }
        let fut = self.inner.call(req);
        Box::pin(async move { fut.await.map_err(Into::into) })
    }
}

#[tokio::test]
async fn a_call_retried_past_a_proxys_503_is_recorded_ok_with_one_retry() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = TcpIncoming::from(listener);
    let seen = Arc::new(AtomicU64::new(0));
    let s = seen.clone();
    tokio::spawn(
        Server::builder()
            .layer(tower::layer::layer_fn(move |inner| Proxy503 {
                inner,
                seen: s.clone(),
            }))
            .add_service(LibraryServer::new(crate::support::Shelf::default()))
            .serve_with_incoming(incoming),
    );

    let exported = Exported::new();
    let target = format!("dns:///{addr}");
    let metrics = exported
        .metrics(&target)
        .with_methods(["/library.v1.Library/GetBook"])
        .unwrap();
    let policy = exact_policy(3);
    let layer =
        RetryLayer::new(policy, RetryBudget::new(200, 0.1).unwrap()).with_grpc_metrics(metrics);
    let mut client = LibraryClient::new(
        ServiceBuilder::new()
            .layer(layer)
            .service(crate::support::library::channel(addr)),
    );
    let book = tokio::time::timeout(
        Duration::from_secs(10),
        client.get_book(GetBookRequest { isbn: "7".into() }),
    )
    .await
    .expect("bounded")
    .expect("the retry succeeds");
    assert_eq!(book.into_inner().isbn, "7");
    assert_eq!(
        seen.load(Ordering::SeqCst),
        2,
        "two attempts reached the proxy"
    );

    let got = exported.collect();
    let calls: Vec<_> = got
        .points("grpc.client.call.duration")
        .into_iter()
        .map(|p| (p.attributes["grpc.status"].clone(), p.count))
        .collect();
    assert_eq!(calls, vec![("OK".to_owned(), 1)], "call.duration");
    let retries: f64 = got
        .points("grpc.client.call.retries")
        .iter()
        .map(|p| p.sum)
        .sum();
    assert_eq!(retries, 1.0, "call.retries");
}
