//! gRPC's standard client metrics (gRFC A66, A96), read back through the real
//! OpenTelemetry SDK and its in-memory exporter: names, units, buckets and
//! attributes as the gRFCs give them, and what each call records. Mock
//! services under paused time.
#![cfg(feature = "opentelemetry")]

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::exported::{Exported, Point, attrs};
use crate::support::*;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::Frame;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{HedgePolicy, MethodPolicies, RetryBudget, RetryLayer, RetryPolicy};
use tonic_retry::{otel::GrpcMetrics, otel::LATENCY_BUCKETS, otel::Recorder};
use tower::{Layer, Service, ServiceExt};
use tower_test::mock;

const MS: Duration = Duration::from_millis(1);
const GET_BOOK: &str = "/library.v1.Library/GetBook";

type Svc = crate::support::Svc<Recorder>;

fn layered(
    policy: impl Into<MethodPolicies>,
    budget: RetryBudget,
    metrics: GrpcMetrics,
) -> (Svc, Handle) {
    let layer = RetryLayer::new(policy, budget).with_grpc_metrics(metrics);
    let (inner, handle) = mock::pair();
    (layer.layer(inner), handle)
}

fn named(exported: &Exported) -> GrpcMetrics {
    exported
        .metrics("dns:///library:50051")
        .with_methods([GET_BOOK])
        .unwrap()
}

fn to(path: &str) -> Request<Body> {
    let mut req = request();
    *req.uri_mut() = format!("http://library{path}").parse().unwrap();
    req
}

async fn call(svc: &mut Svc, req: Request<Body>) -> tokio::task::JoinHandle<Outcome<Recorder>> {
    let ready = svc.ready().await.unwrap();
    tokio::spawn(ready.call(req))
}

/// A transport error with no status in it: no response at all.
fn refused() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused")
}

const METHOD: (&str, &str) = ("grpc.method", "library.v1.Library/GetBook");
const TARGET: (&str, &str) = ("grpc.target", "dns:///library:50051");

#[tokio::test(start_paused = true)]
async fn a_call_that_succeeds_at_once_records_one_attempt_and_no_retry() {
    let exported = Exported::new();
    let (mut svc, mut handle) = layered(RetryPolicy::default(), budget(), named(&exported));
    let c = call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    tokio::time::sleep(3 * MS).await;
    send.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(c.await.unwrap().unwrap()).await, Code::Ok);
    let got = exported.collect();
    assert_eq!(
        got.points("grpc.client.attempt.started"),
        vec![Point {
            attributes: attrs(&[METHOD, TARGET]),
            count: 1,
            sum: 1.0,
            bounds: vec![]
        }]
    );
    let ok = [METHOD, TARGET, ("grpc.status", "OK")];
    let attempt = got.point("grpc.client.attempt.duration", &ok);
    assert_eq!((attempt.attributes, attempt.count), (attrs(&ok), 1));
    assert!((attempt.sum - 0.003).abs() < 0.0015, "{}", attempt.sum);
    assert_eq!(got.point("grpc.client.call.duration", &ok).count, 1);
    for none in [
        "grpc.client.call.retries",
        "grpc.client.call.transparent_retries",
        "grpc.client.call.hedges",
        "grpc.client.call.retry_delay",
    ] {
        assert_eq!(got.points(none), vec![], "{none}: 0 is not recorded");
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_retried_twice_records_two_retries_and_its_delay() {
    let exported = Exported::new();
    let policy = RetryPolicy::new(3, 100 * MS, 1000 * MS, 0.0).unwrap();
    let (mut svc, mut handle) = layered(policy, budget(), named(&exported));
    let c = call(&mut svc, request()).await;
    for _ in 0..2 {
        let (_, send, _) = next(&mut handle).await;
        send.send_response(status(Code::Unavailable));
    }
    let (_, send, _) = next(&mut handle).await;
    send.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(c.await.unwrap().unwrap()).await, Code::Ok);
    let got = exported.collect();
    let retries = got.point("grpc.client.call.retries", &[METHOD]);
    assert_eq!(
        (retries.attributes, retries.count, retries.sum),
        (attrs(&[METHOD, TARGET]), 1, 2.0)
    );
    // Backoffs of 100 and 200 ms (no jitter), to the timer's millisecond.
    let delay = got.point("grpc.client.call.retry_delay", &[METHOD]);
    assert_eq!(delay.count, 1);
    assert!((delay.sum - 0.3).abs() <= 0.003, "{}", delay.sum);
    assert_eq!(got.point("grpc.client.attempt.started", &[METHOD]).sum, 3.0);
    let unavailable = [METHOD, TARGET, ("grpc.status", "UNAVAILABLE")];
    assert_eq!(
        got.point("grpc.client.attempt.duration", &unavailable)
            .count,
        2
    );
    let ok = [METHOD, TARGET, ("grpc.status", "OK")];
    assert_eq!(got.point("grpc.client.attempt.duration", &ok).count, 1);
    let call = got.point("grpc.client.call.duration", &ok);
    assert_eq!(call.count, 1);
    assert!((call.sum - 0.3).abs() <= 0.003, "{}", call.sum);
    assert_eq!(got.points("grpc.client.call.transparent_retries"), vec![]);
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_a_connection_refused_is_the_policys_retry() {
    let exported = Exported::new();
    let (mut svc, mut handle) = layered(RetryPolicy::default(), budget(), named(&exported));
    let c = call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    // No response at all: the connection was refused.
    send.send_error(refused());
    let (_, send, _) = next(&mut handle).await;
    send.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(c.await.unwrap().unwrap()).await, Code::Ok);
    let got = exported.collect();
    // A96 counts as transparent only gRPC's transparent retries, of a
    // stream a server refused; a connection refused is the policy's to retry.
    let retries = got.point("grpc.client.call.retries", &[METHOD]);
    assert_eq!((retries.count, retries.sum), (1, 1.0));
    assert_eq!(got.points("grpc.client.call.transparent_retries"), vec![]);
    assert_eq!(
        got.point("grpc.client.call.retry_delay", &[METHOD]).count,
        1
    );
}

#[tokio::test(start_paused = true)]
async fn names_units_and_buckets_are_a66_and_a96s() {
    let exported = Exported::new();
    let hedge = HedgePolicy::new(2, 10 * MS).unwrap();
    let table = MethodPolicies::with_default(RetryPolicy::default())
        .with_method("library.v1.Library", "ListBooks", hedge)
        .unwrap();
    let metrics = named(&exported)
        .with_methods(["library.v1.Library/ListBooks"])
        .unwrap();
    let (mut svc, mut handle) = layered(table, RetryBudget::new(10, 0.5).unwrap(), metrics);
    // A retried call and a hedged one, so every metric has a point.
    let c = call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_error(refused());
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    let (_, send, _) = next(&mut handle).await;
    send.send_response(answer(Code::Ok));
    read_to_end(c.await.unwrap().unwrap()).await;
    let c = call(&mut svc, to("/library.v1.Library/ListBooks")).await;
    let (_, _slow, _) = next(&mut handle).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(answer(Code::Ok));
    read_to_end(c.await.unwrap().unwrap()).await;

    let got = exported.collect();
    // A66's latency boundaries, as the gRFC writes them (not the crate's
    // constant: the exporter must show these).
    let latency = vec![
        0.0, 0.00001, 0.00005, 0.0001, 0.0003, 0.0006, 0.0008, 0.001, 0.002, 0.003, 0.004, 0.005,
        0.006, 0.008, 0.01, 0.013, 0.016, 0.02, 0.025, 0.03, 0.04, 0.05, 0.065, 0.08, 0.1, 0.13,
        0.16, 0.2, 0.25, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0,
    ];
    assert_eq!(latency, LATENCY_BUCKETS, "the public constant is A66's too");
    // (`grpc.client.call.transparent_retries` needs a stream a real server
    // refused: its name, unit and buckets are checked in
    // tests/wire/transparent_retries.rs.)
    let expected: [(&str, &str, Vec<f64>); 7] = [
        ("grpc.client.attempt.started", "{attempt}", vec![]),
        ("grpc.client.attempt.duration", "s", latency.clone()),
        ("grpc.client.call.duration", "s", latency.clone()),
        (
            "grpc.client.call.retries",
            "{retry}",
            vec![1.0, 2.0, 3.0, 4.0, 5.0],
        ),
        (
            "grpc.client.call.hedges",
            "{hedge}",
            vec![1.0, 2.0, 3.0, 4.0, 5.0],
        ),
        ("grpc.client.call.retry_delay", "s", latency.clone()),
        ("tonic_retry.budget.tokens", "{token}", vec![]),
    ];
    for (name, unit, bounds) in expected {
        let (got_unit, points) = got.get(name).unwrap_or_else(|| panic!("{name} exported"));
        assert_eq!(got_unit, unit, "{name}");
        assert!(!points.is_empty(), "{name}");
        for p in &points {
            assert_eq!(p.bounds, bounds, "{name}");
            let keys: Vec<_> = p.attributes.keys().map(String::as_str).collect();
            let want: &[&str] = match name {
                "grpc.client.attempt.duration" | "grpc.client.call.duration" => {
                    &["grpc.method", "grpc.status", "grpc.target"]
                }
                "tonic_retry.budget.tokens" => &["grpc.target"],
                _ => &["grpc.method", "grpc.target"],
            };
            assert_eq!(keys, want, "{name}");
        }
    }
    let hedges = got.point(
        "grpc.client.call.hedges",
        &[("grpc.method", "library.v1.Library/ListBooks")],
    );
    assert_eq!((hedges.count, hedges.sum), (1, 1.0));
    // The hedge that lost ended CANCELLED.
    let cancelled = [
        ("grpc.method", "library.v1.Library/ListBooks"),
        ("grpc.status", "CANCELLED"),
    ];
    assert_eq!(
        got.point("grpc.client.attempt.duration", &cancelled).count,
        1
    );
}

#[tokio::test(start_paused = true)]
async fn a_method_not_named_is_other_whatever_its_path() {
    let exported = Exported::new();
    let metrics = named(&exported).with_any_method(2);
    let (mut svc, mut handle) = layered(RetryPolicy::default(), budget(), metrics);
    let paths = [
        GET_BOOK.to_owned(),
        "/a.B/One".to_owned(),
        "/a.B/Two".to_owned(),
        "/a.B/Three".to_owned(),
        "/a.B/One".to_owned(),
        "/not-a-method".to_owned(),
        format!("/a.B/{}", "x".repeat(300)),
        "/a.B/%F0%9F%92%A3".to_owned(),
    ];
    for path in &paths {
        let c = call(&mut svc, to(path)).await;
        let (_, send, _) = next(&mut handle).await;
        send.send_response(answer(Code::Ok));
        read_to_end(c.await.unwrap().unwrap()).await;
    }
    let got = exported.collect();
    let mut by_method: BTreeMap<String, f64> = BTreeMap::new();
    for p in got.points("grpc.client.attempt.started") {
        *by_method
            .entry(p.attributes["grpc.method"].clone())
            .or_default() += p.sum;
    }
    let expected: BTreeMap<String, f64> = [
        ("library.v1.Library/GetBook", 1.0),
        ("a.B/One", 2.0),
        ("a.B/Two", 1.0),
        ("other", 4.0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(by_method, expected);

    // Without `with_any_method`, only the listed methods are named.
    let exported = Exported::new();
    let (mut svc, mut handle) = layered(RetryPolicy::default(), budget(), named(&exported));
    let c = call(&mut svc, to("/a.B/One")).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(answer(Code::Ok));
    read_to_end(c.await.unwrap().unwrap()).await;
    let got = exported.collect();
    assert_eq!(
        got.point("grpc.client.attempt.started", &[]).attributes["grpc.method"],
        "other"
    );
}

#[test]
fn a_listed_method_must_be_a_method_path() {
    let exported = Exported::new();
    for bad in ["", "/", "GetBook", "/a.B/", "/a.B/C/D", "a b/C"] {
        let error = exported.metrics("t").with_methods([bad]).unwrap_err();
        assert!(error.to_string().contains("methods"), "{bad:?}: {error}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_server_streaming_attempt_lasts_until_its_trailers() {
    let exported = Exported::new();
    let (mut svc, mut handle) = layered(RetryPolicy::default(), budget(), named(&exported));
    let c = call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let (tx, response) = streaming_response();
    tx.send(data("\0\0\0\0\x01a")).unwrap();
    send.send_response(response);
    let response = c.await.unwrap().unwrap();
    tokio::time::sleep(500 * MS).await;
    tx.send(data("\0\0\0\0\x01b")).unwrap();
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    tx.send(Ok(Frame::trailers(trailers))).unwrap();
    drop(tx);
    assert_eq!(read_to_end(response).await, Code::Ok);
    let got = exported.collect();
    let ok = [METHOD, ("grpc.status", "OK")];
    for name in ["grpc.client.attempt.duration", "grpc.client.call.duration"] {
        let p = got.point(name, &ok);
        assert_eq!(p.count, 1, "{name}");
        assert!((p.sum - 0.5).abs() < 0.002, "{name}: {}", p.sum);
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_the_caller_drops_ends_cancelled() {
    let exported = Exported::new();
    let (mut svc, mut handle) = layered(RetryPolicy::default(), budget(), named(&exported));
    let c = call(&mut svc, request()).await;
    let (_, _never, _) = next(&mut handle).await;
    tokio::time::sleep(20 * MS).await;
    c.abort();
    let _ = c.await;
    let got = exported.collect();
    let cancelled = [METHOD, ("grpc.status", "CANCELLED")];
    assert_eq!(
        got.point("grpc.client.attempt.duration", &cancelled).count,
        1
    );
    assert_eq!(got.point("grpc.client.call.duration", &cancelled).count, 1);
}

#[tokio::test(start_paused = true)]
async fn refusals_by_reason_and_the_budget_balance() {
    let exported = Exported::new();
    // Half a token: the retry is refused by the budget.
    let poor = RetryBudget::new(1, 0.001).unwrap();
    let (mut svc, mut handle) = layered(RetryPolicy::default(), poor, named(&exported));
    let c = call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    assert_eq!(code_of(&c.await.unwrap().unwrap()), Code::ResourceExhausted);
    // No time for a retry: refused by the deadline.
    let c = call(&mut svc, with_timeout(request(), "30m")).await;
    let (_, send, _) = next(&mut handle).await;
    tokio::time::sleep(20 * MS).await;
    send.send_response(status(Code::Unavailable));
    c.await.unwrap().unwrap();
    let got = exported.collect();
    let refused = |reason| got.point("tonic_retry.retries.refused", &[("reason", reason)]);
    assert_eq!(refused("budget").sum, 1.0);
    assert_eq!(refused("deadline").sum, 1.0);
    assert_eq!(refused("budget").attributes["grpc.target"], TARGET.1);
    let tokens = got.point("tonic_retry.budget.tokens", &[TARGET]);
    assert_eq!(tokens.sum, 0.5);
}

/// What a proxy (Envoy, nginx, a load balancer) answers for an overloaded or
/// missing backend: an HTTP error status, no `grpc-status`, an empty body.
fn http_error(status: u16) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/grpc")
        .body(Body::empty())
        .unwrap()
}

/// The `grpc.status` values of every point of `name`, with their counts.
fn statuses(got: &crate::support::exported::Collected, name: &str) -> Vec<(String, u64)> {
    let mut v: Vec<_> = got
        .points(name)
        .into_iter()
        .map(|p| (p.attributes["grpc.status"].clone(), p.count))
        .collect();
    v.sort();
    v
}

/// A unary call made by tonic's own generic client over `svc`: the status
/// tonic's client reports.
async fn tonic_unary(svc: Svc) -> Result<(), tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(svc);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unknown(e.to_string()))?;
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    grpc.unary(
        tonic::Request::new(()),
        http::uri::PathAndQuery::from_static(GET_BOOK),
        codec,
    )
    .await
    .map(|_| ())
}

#[tokio::test(start_paused = true)]
async fn an_http_503_retried_to_ok_records_a_call_that_ended_ok_after_one_retry() {
    let exported = Exported::new();
    let policy = exact_policy(3);
    let (mut svc, mut handle) = layered(policy, budget(), named(&exported));
    let c = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(http_error(503)); // UNAVAILABLE: retried
    let (_, send, _) = next(&mut handle).await;
    send.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(c.await.unwrap().unwrap()).await, Code::Ok);
    let got = exported.collect();
    // The caller got OK: one call, OK.
    assert_eq!(
        statuses(&got, "grpc.client.call.duration"),
        vec![("OK".to_owned(), 1)],
        "call.duration"
    );
    // One retry was sent.
    assert_eq!(
        got.points("grpc.client.call.retries")
            .iter()
            .map(|p| p.sum)
            .sum::<f64>(),
        1.0,
        "call.retries"
    );
    // The 503 attempt ended UNAVAILABLE (as gRPC maps HTTP 503), not CANCELLED.
    assert_eq!(
        statuses(&got, "grpc.client.attempt.duration"),
        vec![("OK".to_owned(), 1), ("UNAVAILABLE".to_owned(), 1)],
        "attempt.duration"
    );
}

#[tokio::test(start_paused = true)]
async fn an_http_503_whose_retry_is_refused_records_the_status_the_caller_got() {
    let exported = Exported::new();
    // Half a token: the retry is refused by the budget.
    let poor = RetryBudget::new(1, 0.001).unwrap();
    let (mut svc, mut handle) = layered(RetryPolicy::default(), poor, named(&exported));
    let c = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(http_error(503));
    let response = c.await.unwrap().unwrap();
    let got_code = read_to_end(response).await;
    assert_eq!(got_code, Code::ResourceExhausted, "what the caller got");
    let got = exported.collect();
    assert_eq!(
        statuses(&got, "grpc.client.call.duration"),
        vec![("RESOURCE_EXHAUSTED".to_owned(), 1)],
        "call.duration"
    );
}

#[tokio::test(start_paused = true)]
async fn a_hedge_answered_http_503_does_not_end_the_hedged_call() {
    let exported = Exported::new();
    let hedge = HedgePolicy::new(2, 10 * MS).unwrap();
    let (mut svc, mut handle) = layered(hedge, budget(), named(&exported));
    let c = spawn_call(&mut svc, request()).await;
    let (_, first, _) = next(&mut handle).await;
    let (_, second, _) = next(&mut handle).await;
    // The first hedge's proxy says 503 (non-fatal UNAVAILABLE); the second
    // one answers 100 ms later with OK.
    first.send_response(http_error(503));
    tokio::time::sleep(100 * MS).await;
    second.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(c.await.unwrap().unwrap()).await, Code::Ok);
    let got = exported.collect();
    let calls = got.points("grpc.client.call.duration");
    assert_eq!(
        statuses(&got, "grpc.client.call.duration"),
        vec![("OK".to_owned(), 1)],
        "call.duration: {calls:?}"
    );
    let call = &calls[0];
    assert!(call.sum >= 0.1, "the call lasted 100 ms: {}", call.sum);
}

#[tokio::test(start_paused = true)]
async fn an_http_404_is_recorded_unimplemented_as_tonic_reads_it() {
    let exported = Exported::new();
    let (svc, mut handle) = layered(RetryPolicy::default(), budget(), named(&exported));
    let server = tokio::spawn(async move {
        let (_, send, _) = next(&mut handle).await;
        send.send_response(http_error(404));
        handle
    });
    let status = tonic_unary(svc).await.unwrap_err();
    let _handle = server.await.unwrap();
    assert_eq!(
        status.code(),
        Code::Unimplemented,
        "tonic reads: {status:?}"
    );
    let got = exported.collect();
    for name in ["grpc.client.attempt.duration", "grpc.client.call.duration"] {
        assert_eq!(
            statuses(&got, name),
            vec![("UNIMPLEMENTED".to_owned(), 1)],
            "{name}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_body_that_fails_mid_stream_is_recorded_with_the_status_tonic_reads() {
    let exported = Exported::new();
    let (svc, mut handle) = layered(RetryPolicy::default(), budget(), named(&exported));
    let server = tokio::spawn(async move {
        let (_, send, _) = next(&mut handle).await;
        let (tx, response) = streaming_response();
        send.send_response(response);
        // The stream is reset (RST_STREAM INTERNAL_ERROR): tonic's Channel
        // gives its body error as the Status tonic maps it to.
        tx.send(Err(tonic::Status::internal(
            "h2 protocol error: stream reset",
        )))
        .unwrap();
        handle
    });
    let status = tonic_unary(svc).await.unwrap_err();
    let _handle = server.await.unwrap();
    assert_eq!(status.code(), Code::Internal, "tonic reads: {status:?}");
    let got = exported.collect();
    for name in ["grpc.client.attempt.duration", "grpc.client.call.duration"] {
        assert_eq!(
            statuses(&got, name),
            vec![("INTERNAL".to_owned(), 1)],
            "{name}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn hedges_in_flight_at_the_deadline_end_deadline_exceeded() {
    let exported = Exported::new();
    let hedge = HedgePolicy::new(3, 10 * MS).unwrap();
    let (mut svc, mut handle) = layered(hedge, budget(), named(&exported));
    let c = call(&mut svc, with_timeout(request(), "50m")).await;
    // Three attempts, none of them answered by the deadline.
    let (_, _first, _) = next(&mut handle).await;
    let (_, _second, _) = next(&mut handle).await;
    let (_, _third, _) = next(&mut handle).await;
    let response = c.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    drop(response);
    let got = exported.collect();
    assert_eq!(
        statuses(&got, "grpc.client.attempt.duration"),
        vec![("DEADLINE_EXCEEDED".to_owned(), 3)]
    );
    assert_eq!(
        statuses(&got, "grpc.client.call.duration"),
        vec![("DEADLINE_EXCEEDED".to_owned(), 1)]
    );
}

/// A plain HTTP proxy's answer: an HTTP status, no `grpc-status`, an HTML
/// page.
fn html(status: u16) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "text/html")
        .body(Body::new(http_body_util::Full::new(
            bytes::Bytes::from_static(
                b"<html><body><h1>503 Service Temporarily Unavailable</h1></body></html>",
            ),
        )))
        .unwrap()
}

/// What tonic's client reports, and the call's recorded `grpc.status`, for
/// a call whose one attempt a proxy answers with `response`.
async fn proxy_answer(response: Response<Body>) -> (Code, Vec<(String, u64)>) {
    let exported = Exported::new();
    let once = RetryPolicy::new(1, 20 * MS, 500 * MS, 0.0).unwrap();
    let (svc, mut handle) = layered(once, budget(), named(&exported));
    let server = tokio::spawn(async move {
        let (_, send, _) = next(&mut handle).await;
        send.send_response(response);
        handle
    });
    let status = tonic_unary(svc).await.unwrap_err();
    let _handle = server.await.unwrap();
    let got = exported.collect();
    (status.code(), statuses(&got, "grpc.client.call.duration"))
}

/// A proxy's HTTP 503 page is UNAVAILABLE, for the caller (tonic's
/// client would read the page as gRPC messages and report INTERNAL) and in
/// the metrics alike.
#[tokio::test(start_paused = true)]
async fn a_final_html_503_is_unavailable_to_the_caller_and_in_the_metrics() {
    let (reported, recorded) = proxy_answer(html(503)).await;
    assert_eq!(reported, Code::Unavailable);
    assert_eq!(recorded, vec![("UNAVAILABLE".to_owned(), 1)]);
}

/// An HTTP 200 that is not gRPC (an HTML page) is UNKNOWN, for the
/// caller and in the metrics (not CANCELLED: the caller cancelled nothing).
#[tokio::test(start_paused = true)]
async fn a_final_html_200_is_unknown_to_the_caller_and_in_the_metrics() {
    let (reported, recorded) = proxy_answer(html(200)).await;
    assert_eq!(reported, Code::Unknown);
    assert_eq!(recorded, vec![("UNKNOWN".to_owned(), 1)]);
}

/// A96: `retry_delay` is the time a call had no attempt in flight, for a
/// hedged call too: here a server's pushback of 100 ms.
#[tokio::test(start_paused = true)]
async fn a_hedged_calls_pushback_wait_is_its_retry_delay() {
    let exported = Exported::new();
    let hedge = HedgePolicy::new(3, 1000 * MS).unwrap();
    let (mut svc, mut handle) = layered(hedge, budget(), named(&exported));
    let c = spawn_call(&mut svc, request()).await;
    let (_, first, _) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("100"));
    first.send_response(r);
    let (_, second, _) = next(&mut handle).await;
    second.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(c.await.unwrap().unwrap()).await, Code::Ok);
    let got = exported.collect();
    assert_eq!(got.point("grpc.client.call.hedges", &[METHOD]).sum, 1.0);
    let delay = got.point("grpc.client.call.retry_delay", &[METHOD]);
    assert_eq!(delay.count, 1);
    assert!((delay.sum - 0.1).abs() < 0.003, "{}", delay.sum);
}

/// UNAVAILABLE, with a server's pushback of 100 ms.
fn unavailable_for_100ms() -> Response<Body> {
    let mut r = status(Code::Unavailable);
    r.headers_mut()
        .insert("grpc-retry-pushback-ms", HeaderValue::from_static("100"));
    r
}

/// The refused retries exported, by reason.
fn refusals(got: &crate::support::exported::Collected) -> Vec<(String, f64)> {
    got.points("tonic_retry.retries.refused")
        .iter()
        .map(|p| (p.attributes["reason"].clone(), p.sum))
        .collect()
}

/// A hedge the deadline leaves no time for is a refusal by the deadline, as
/// a retry is, and the call ends DEADLINE_EXCEEDED, counted once.
#[tokio::test(start_paused = true)]
async fn a_hedge_refused_by_the_deadline_is_counted_as_a_retry_is() {
    for hedged in [false, true] {
        let exported = Exported::new();
        let policies: MethodPolicies = if hedged {
            HedgePolicy::new(3, 1000 * MS).unwrap().into()
        } else {
            RetryPolicy::default().into()
        };
        let (mut svc, mut handle) = layered(policies, budget(), named(&exported));
        let c = spawn_call(&mut svc, with_timeout(request(), "50m")).await;
        let (_, first, _) = next(&mut handle).await;
        first.send_response(unavailable_for_100ms());
        let response = c.await.unwrap().unwrap();
        assert_eq!(
            code_of(&response),
            Code::DeadlineExceeded,
            "hedged: {hedged}"
        );
        assert_eq!(
            refusals(&exported.collect()),
            vec![("deadline".to_owned(), 1.0)],
            "hedged: {hedged}"
        );
    }
}

/// Ends one call with a Trailers-Only OK and returns (budget balance,
/// gauge) afterwards.
async fn balance_and_gauge(policy: MethodPolicies) -> (f64, f64) {
    let exported = Exported::new();
    let layer = RetryLayer::new(policy, budget()).with_grpc_metrics(named(&exported));
    let (inner, mut handle) = mock::pair();
    let mut svc = layer.layer(inner);
    let c = call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Ok));
    assert_eq!(code_of(&c.await.unwrap().unwrap()), Code::Ok);
    let balance = layer.budget().available();
    let got = exported.collect();
    let gauge = got.point("tonic_retry.budget.tokens", &[TARGET]).sum;
    (balance, gauge)
}

/// A retried call's Trailers-Only OK deposits, and the gauge says so.
#[tokio::test(start_paused = true)]
async fn a_retried_calls_trailers_only_ok_moves_the_gauge() {
    let (balance, gauge) = balance_and_gauge(RetryPolicy::default().into()).await;
    assert!((balance - 100.1).abs() < 1e-9, "{balance}");
    assert!(
        (gauge - balance).abs() < 1e-9,
        "gauge {gauge}, balance {balance}"
    );
}

/// The budget's balance gauge. A hedged call whose first attempt ends
/// with a Trailers-Only OK deposits, and the gauge says so too.
#[tokio::test(start_paused = true)]
async fn a_hedged_calls_trailers_only_ok_moves_the_gauge() {
    let hedge = HedgePolicy::new(2, Duration::from_millis(50)).unwrap();
    let (balance, gauge) = balance_and_gauge(RetryPolicy::from(hedge).into()).await;
    assert!((balance - 100.1).abs() < 1e-9, "{balance}");
    assert!(
        (gauge - balance).abs() < 1e-9,
        "gauge {gauge}, balance {balance}"
    );
}

/// One call through `svc` whose only attempt fails UNAVAILABLE, and whose
/// retry the budget (`RetryBudget::new(1, 0.001)`, empty) refuses.
async fn a_call_refused_its_retry<M: tonic_retry::metrics::Metrics>(
    svc: &mut crate::support::Svc<M>,
    handle: &mut Handle,
) {
    let c = spawn_call(svc, request()).await;
    let (_, send, _) = next(handle).await;
    send.send_response(status(Code::Unavailable));
    assert_eq!(code_of(&c.await.unwrap().unwrap()), Code::ResourceExhausted);
}

fn empty_budget() -> RetryBudget {
    RetryBudget::new(1, 0.001).unwrap()
}

/// A layer's metrics are in its type: a clone taken before it was given
/// them records nothing, not even its refusals, though it shares the
/// budget (and the gauge is set again by the next call that records).
#[tokio::test(start_paused = true)]
async fn a_clone_taken_before_the_metrics_records_nothing() {
    let exported = Exported::new();
    let layer = RetryLayer::new(RetryPolicy::default(), empty_budget());
    let early = layer.clone();
    let metered = layer.with_grpc_metrics(named(&exported));
    let (inner, mut handle) = mock::pair();
    let mut svc = early.layer(inner);
    a_call_refused_its_retry(&mut svc, &mut handle).await;
    let got = exported.collect();
    for name in [
        "grpc.client.attempt.started",
        "grpc.client.call.duration",
        "tonic_retry.retries.refused",
    ] {
        assert!(
            got.points(name).is_empty(),
            "{name}: {:?}",
            got.points(name)
        );
    }

    let (inner, mut handle) = mock::pair();
    let mut svc = metered.layer(inner);
    a_call_refused_its_retry(&mut svc, &mut handle).await;
    let got = exported.collect();
    assert_eq!(got.points("grpc.client.call.duration").len(), 1);
    assert_eq!(got.points("tonic_retry.retries.refused").len(), 1);
    let gauge = got.point("tonic_retry.budget.tokens", &[TARGET]).sum;
    assert_eq!(gauge, metered.budget().available());
}

/// Two clones of a layer, each given metrics for a target of its own: a
/// call's refusal is counted under its own layer's target, as its call is.
#[tokio::test(start_paused = true)]
async fn a_refusal_is_recorded_under_the_calls_own_target() {
    let exported = Exported::new();
    let base = RetryLayer::new(RetryPolicy::default(), empty_budget());
    let _a = base.clone().with_grpc_metrics(exported.metrics("a"));
    let b = base.with_grpc_metrics(exported.metrics("b"));
    let (inner, mut handle) = mock::pair();
    let mut svc = b.layer(inner);
    a_call_refused_its_retry(&mut svc, &mut handle).await;
    let got = exported.collect();
    let targets = |name| -> Vec<String> {
        got.points(name)
            .iter()
            .map(|p| p.attributes["grpc.target"].clone())
            .collect()
    };
    assert_eq!(targets("grpc.client.call.duration"), ["b"]);
    assert_eq!(targets("tonic_retry.retries.refused"), ["b"]);
}

/// Metrics chosen at run time: one layer type, recording with `Some` and
/// nothing with `None`.
#[tokio::test(start_paused = true)]
async fn metrics_chosen_at_run_time_are_recorded_or_not() {
    fn layer(metrics: Option<GrpcMetrics>) -> RetryLayer<RetryBudget, Body, Option<Recorder>> {
        RetryLayer::new(RetryPolicy::default(), empty_budget()).with_optional_grpc_metrics(metrics)
    }
    for on in [false, true] {
        let exported = Exported::new();
        let layer = layer(on.then(|| named(&exported)));
        let (inner, mut handle) = mock::pair();
        let mut svc = layer.layer(inner);
        // A retried call: an attempt, a refusal, the call.
        a_call_refused_its_retry(&mut svc, &mut handle).await;
        // A call read to its trailers.
        let c = spawn_call(&mut svc, request()).await;
        let (_, send, _) = next(&mut handle).await;
        send.send_response(answer(Code::Ok));
        assert_eq!(read_to_end(c.await.unwrap().unwrap()).await, Code::Ok);
        if !on {
            assert!(exported.nothing(), "no metrics given, nothing recorded");
            continue;
        }
        assert!(!exported.nothing(), "metrics given, recorded");
        let got = exported.collect();
        let count = |name| got.points(name).iter().map(|p| p.count).sum::<u64>();
        let sum = |name| got.points(name).iter().map(|p| p.sum).sum::<f64>();
        assert_eq!(sum("grpc.client.attempt.started"), 2.0);
        assert_eq!(count("grpc.client.attempt.duration"), 2);
        assert_eq!(count("grpc.client.call.duration"), 2);
        assert_eq!(sum("tonic_retry.retries.refused"), 1.0);
        assert!(!got.points("tonic_retry.budget.tokens").is_empty());
    }
}

/// A hedged call whose next hedge a server's delay pushes past the deadline,
/// while a hedge already waits for its service: one refusal by the deadline,
/// as a retried call counts (the waiting hedge, cut by the deadline, is the
/// same refusal).
#[tokio::test(start_paused = true)]
async fn a_hedged_call_refused_by_the_deadline_counts_one_refusal() {
    let exported = Exported::new();
    let hedge = HedgePolicy::new(3, 10 * MS).unwrap();
    let (mut svc, mut handle) = layered(hedge, budget(), named(&exported));
    handle.allow(1);
    let c = spawn_call(&mut svc, with_timeout(request(), "50m")).await;
    let (_, first, _) = next(&mut handle).await;
    // The hedge is due at 10 ms, and waits for its service.
    tokio::time::sleep(15 * MS).await;
    first.send_response(unavailable_for_100ms());
    let response = c.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    let got = exported.collect();
    assert_eq!(got.point("grpc.client.attempt.started", &[METHOD]).sum, 1.0);
    assert_eq!(svc.metrics().refused_by_deadline(), 1, "RetryMetrics");
    assert_eq!(refusals(&got), vec![("deadline".to_owned(), 1.0)]);
}

/// Two clones of a layer, each given metrics for the same target, with one
/// budget: both write one gauge series, which follows the balance whichever
/// moved it last.
#[tokio::test(start_paused = true)]
async fn the_gauge_follows_the_balance_across_two_recorders_of_one_target() {
    let exported = Exported::new();
    let once = exact_policy(2);
    let base = RetryLayer::new(once, RetryBudget::new(10, 1.0).unwrap());
    let a = base
        .clone()
        .with_optional_grpc_metrics(Some(named(&exported)));
    let b = base.with_optional_grpc_metrics(Some(named(&exported)));
    let (inner, mut ha) = mock::pair();
    let mut sa = a.layer(inner);
    let (inner, mut hb) = mock::pair();
    let mut sb = b.layer(inner);
    let gauge = || {
        exported
            .collect()
            .point("tonic_retry.budget.tokens", &[TARGET])
            .sum
    };
    assert_eq!((gauge(), a.budget().available()), (5.0, 5.0));
    // Through b: a retry paid for (5 -> 4), which ends NOT_FOUND.
    let c = spawn_call(&mut sb, request()).await;
    let (_, send, _) = next(&mut hb).await;
    send.send_response(status(Code::Unavailable));
    let (_, send, _) = next(&mut hb).await;
    send.send_response(status(Code::NotFound));
    assert_eq!(code_of(&c.await.unwrap().unwrap()), Code::NotFound);
    assert_eq!((gauge(), a.budget().available()), (4.0, 4.0));
    // Through a: a call that succeeds deposits (4 -> 5).
    let c = spawn_call(&mut sa, request()).await;
    let (_, send, _) = next(&mut ha).await;
    send.send_response(status(Code::Ok));
    assert_eq!(code_of(&c.await.unwrap().unwrap()), Code::Ok);
    assert_eq!(a.budget().available(), 5.0);
    assert_eq!(gauge(), a.budget().available(), "the exported gauge");
}
