//! gRPC service config through the layer: A6's retry throttling as
//! the layer's budget, per-method policies from JSON against a real tonic
//! server, and JSON that must never make the reader panic.

use std::time::Duration;

use crate::support::Instance;
use crate::support::pb::library_client::LibraryClient;
use crate::support::pb::{GetBookRequest, ReserveStockRequest};
use proptest::prelude::*;
use tonic::Code;
use tonic_retry::service_config::ServiceConfig;
use tonic_retry::{RetryLayer, RetryPolicy, budgets::RetryThrottle};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::{Layer, ServiceBuilder};
use tower_test::mock;

use crate::support::*;

#[tokio::test(start_paused = true)]
async fn a6_throttling_charges_failures_and_stops_retries_at_half() {
    // grpc-go's throttling test: maxTokens 10, tokenRatio 0.5, every attempt
    // UNAVAILABLE. Tokens: 10 → each failure −1; no retry at or below 5.
    let throttle = RetryThrottle::new(10.0, 0.5).unwrap();
    let policy = RetryPolicy::new(3, Duration::ZERO, Duration::ZERO, 0.0).unwrap();
    let layer = RetryLayer::with_budget(policy, throttle.clone());
    let (inner, mut handle) =
        mock::pair::<http::Request<tonic::body::Body>, http::Response<tonic::body::Body>>();
    let mut svc = layer.layer(inner);
    // (attempts made, tokens after the call)
    let mut seen = Vec::new();
    for _ in 0..4 {
        use tower::{Service, ServiceExt};
        let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
        let mut attempts = 0;
        while let Ok(Some((_, send))) =
            tokio::time::timeout(Duration::from_secs(1), handle.next_request()).await
        {
            attempts += 1;
            send.send_response(status(Code::Unavailable));
            if attempts == 3 {
                break;
            }
        }
        let response = call.await.unwrap().unwrap();
        // A throttled call ends with the failure's own status.
        assert_eq!(code_of(&response), Code::Unavailable);
        seen.push((attempts, throttle.available()));
    }
    assert_eq!(seen, [(3, 7.0), (2, 5.0), (1, 4.0), (1, 3.0)]);
    assert_eq!(layer.metrics().refused_by_budget(), 3);

    // Successes refill it by tokenRatio each: 3 → above 5 takes 5 successes.
    for _ in 0..5 {
        use tower::{Service, ServiceExt};
        let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
        let (_, send) = handle.next_request().await.unwrap();
        send.send_response(answer(Code::Ok));
        let response = call.await.unwrap().unwrap();
        assert_eq!(read_to_end(response).await, Code::Ok);
    }
    assert_eq!(throttle.available(), 5.5);
    assert!(throttle.allows_retry());
}

type Throttled = tonic_retry::RetryService<
    mock::Mock<http::Request<tonic::body::Body>, http::Response<tonic::body::Body>>,
    RetryThrottle,
>;

/// A layer built from `json`'s per-method policies and throttle, over a mock.
fn throttled(json: &str) -> (Throttled, Handle, RetryThrottle) {
    let config: ServiceConfig = json.parse().unwrap();
    let throttle = config.retry_throttle();
    let layer = RetryLayer::with_budget(config.policies(&RetryPolicy::default()), throttle.clone());
    let (inner, handle) = mock::pair();
    (layer.layer(inner), handle, throttle)
}

/// One call to `path` whose attempts are answered with `answers` in turn
/// (`ok()` once they run out): the attempts made, and the code the caller got.
async fn call_to(
    svc: &mut Throttled,
    handle: &mut Handle,
    path: &str,
    answers: &[Code],
) -> (usize, Code) {
    use tower::{Service, ServiceExt};
    let mut req = request();
    *req.uri_mut() = format!("http://library{path}").parse().unwrap();
    let call = tokio::spawn(svc.ready().await.unwrap().call(req));
    let mut attempts = 0;
    while let Ok(Some((_, send))) =
        tokio::time::timeout(Duration::from_secs(1), handle.next_request()).await
    {
        match answers.get(attempts) {
            Some(&code) => send.send_response(status(code)),
            None => send.send_response(answer(Code::Ok)),
        }
        attempts += 1;
    }
    let response = call.await.unwrap().unwrap();
    (attempts, read_to_end(response).await)
}

const THROTTLED: &str = r#"{
  "methodConfig": [{
    "name": [{ "service": "library.v1.Library", "method": "GetBook" }],
    "retryPolicy": { "maxAttempts": 3, "initialBackoff": "0.001s", "maxBackoff": "0.001s",
                     "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"] }
  }],
  "retryThrottling": { "maxTokens": 10, "tokenRatio": 0.1 }
}"#;

/// grpc-go and grpc-java charge the throttle only for methods with a retry
/// policy: failures of a method the config does not retry must not use up
/// the tokens of the methods it does.
#[tokio::test(start_paused = true)]
async fn methods_that_never_retry_do_not_drain_the_throttle() {
    let (mut svc, mut handle, throttle) = throttled(THROTTLED);
    let reserve = "/library.v1.Library/ReserveStock";
    for _ in 0..6 {
        let got = call_to(&mut svc, &mut handle, reserve, &[Code::Unavailable]).await;
        assert_eq!(got, (1, Code::Unavailable), "ReserveStock is not retried");
    }
    assert_eq!(throttle.available(), 10.0);
    let get_book = "/library.v1.Library/GetBook";
    let got = call_to(&mut svc, &mut handle, get_book, &[Code::Unavailable]).await;
    assert_eq!(got, (2, Code::Ok), "GetBook is retried");
    assert_eq!(throttle.available(), 9.1);
}

/// `tokenRatio` and `maxTokens` keep three decimals as written, although
/// 1.001 × 1000 is 1000.9999… in binary floating point.
#[tokio::test(start_paused = true)]
async fn three_decimals_are_kept_as_written() {
    let json = THROTTLED.replace(
        r#""maxTokens": 10, "tokenRatio": 0.1"#,
        r#""maxTokens": 100, "tokenRatio": 1.001"#,
    );
    let (mut svc, mut handle, throttle) = throttled(&json);
    let get_book = "/library.v1.Library/GetBook";
    let failures = [Code::Unavailable; 3];
    let got = call_to(&mut svc, &mut handle, get_book, &failures).await;
    assert_eq!(got, (3, Code::Unavailable));
    assert_eq!(throttle.available(), 97.0);
    let got = call_to(&mut svc, &mut handle, get_book, &[]).await;
    assert_eq!(got, (1, Code::Ok));
    assert_eq!(throttle.available(), 98.001);

    for (written, kept) in [
        (2.002, 2.002),
        (0.5466, 0.546),
        (1.003, 1.003),
        (999.999, 999.999),
    ] {
        let t = RetryThrottle::new(written, 0.1).unwrap();
        assert_eq!(t.max_tokens(), kept, "maxTokens {written}");
    }
}

#[tokio::test]
async fn one_channel_two_methods_two_policies() {
    let config: ServiceConfig = r#"{
        "methodConfig": [
          { "name": [{ "service": "library.v1.Library", "method": "GetBook" }],
            "retryPolicy": { "maxAttempts": 4, "initialBackoff": "0.001s", "maxBackoff": "0.002s",
                             "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"] } },
          { "name": [{ "service": "library.v1.Library", "method": "ReserveStock" }] }
        ]
    }"#
    .parse()
    .unwrap();
    // Every call to either method fails UNAVAILABLE at the server.
    let server = Instance::with_faults(
        FaultLayer::new("a")
            .unwrap()
            .with(Rule::always(Fault::unavailable())),
    )
    .await;
    let layer = RetryLayer::with_budget(
        config.policies(&RetryPolicy::default()),
        config.retry_throttle(),
    );
    let mut client = LibraryClient::new(
        ServiceBuilder::new()
            .layer(layer.clone())
            .service(server.channel()),
    );

    let status = tokio::time::timeout(
        Duration::from_secs(20),
        client.get_book(GetBookRequest { isbn: "1".into() }),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let status = tokio::time::timeout(
        Duration::from_secs(20),
        client.reserve_stock(ReserveStockRequest {
            isbn: "1".into(),
            quantity: 1,
        }),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);

    let seen = server.faults.seen();
    let count = |method: &str| seen.iter().filter(|s| s.path.ends_with(method)).count();
    assert_eq!(count("/GetBook"), 4, "GetBook: maxAttempts 4");
    assert_eq!(count("/ReserveStock"), 1, "ReserveStock: no retryPolicy");
    let reserve = seen
        .iter()
        .find(|s| s.path.ends_with("/ReserveStock"))
        .unwrap();
    assert!(
        reserve.idempotency_key.is_some(),
        "not retried, but keyed as the base policy says"
    );
}

/// A client through a layer built from `json` (its policies and throttle) to
/// `server`.
fn client_from(
    json: &str,
    server: &Instance,
) -> (LibraryClient<ConfigLayered>, RetryLayer<RetryThrottle>) {
    let config: ServiceConfig = json.parse().unwrap();
    let layer = RetryLayer::with_budget(
        config.policies(&RetryPolicy::default()),
        config.retry_throttle(),
    );
    let client = LibraryClient::new(layer.layer(server.channel()));
    (client, layer)
}

type ConfigLayered = tonic_retry::RetryService<tonic::transport::Channel, RetryThrottle>;

/// The same JSON means the same retries to this layer as to grpc-go,
/// grpc-java and grpcio: a code listed in `retryableStatusCodes` is retried,
/// whether or not the status carries `RetryInfo`.
#[tokio::test]
async fn resource_exhausted_listed_in_a_config_is_retried_without_retry_info() {
    let server = Instance::with_faults(
        FaultLayer::new("a")
            .unwrap()
            .with(Rule::first(1, Fault::status(Code::ResourceExhausted))),
    )
    .await;
    let (mut client, layer) = client_from(
        r#"{"methodConfig": [{
              "name": [{ "service": "library.v1.Library" }],
              "retryPolicy": { "maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.1s",
                               "backoffMultiplier": 2,
                               "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"] } }]}"#,
        &server,
    );
    let book = tokio::time::timeout(
        Duration::from_secs(20),
        client.get_book(GetBookRequest { isbn: "7".into() }),
    )
    .await
    .unwrap()
    .expect("OK after one retry");
    assert_eq!(book.into_inner().isbn, "7");
    assert_eq!(server.faults.requests(), 2, "two attempts at the server");
    assert_eq!(layer.metrics().retries(), 1);

    // The builder's default set keeps the crate's rule: no RetryInfo, no retry.
    let server = Instance::with_faults(
        FaultLayer::new("b")
            .unwrap()
            .with(Rule::first(1, Fault::status(Code::ResourceExhausted))),
    )
    .await;
    let mut client = LibraryClient::new(
        RetryLayer::new(
            RetryPolicy::default(),
            tonic_retry::RetryBudget::new(10, 0.1).unwrap(),
        )
        .layer(server.channel()),
    );
    let status = client
        .get_book(GetBookRequest { isbn: "7".into() })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(server.faults.requests(), 1);
}

/// grpc-go's own retry example writes its keys capitalised; grpc-go reads
/// them whatever their case, and so does this layer.
#[tokio::test]
async fn grpc_gos_retry_example_config_works_as_written() {
    let server = Instance::with_faults(
        FaultLayer::new("a")
            .unwrap()
            .with(Rule::first(3, Fault::unavailable())),
    )
    .await;
    let (mut client, layer) = client_from(
        r#"{
            "methodConfig": [{
              "name": [{"service": "library.v1.Library"}],
              "waitForReady": true,
              "retryPolicy": {
                  "MaxAttempts": 4,
                  "InitialBackoff": ".01s",
                  "MaxBackoff": ".01s",
                  "BackoffMultiplier": 1.0,
                  "RetryableStatusCodes": [ "UNAVAILABLE" ]
              }
            }]}"#,
        &server,
    );
    let book = tokio::time::timeout(
        Duration::from_secs(20),
        client.get_book(GetBookRequest { isbn: "9".into() }),
    )
    .await
    .unwrap()
    .expect("OK on the fourth attempt");
    assert_eq!(book.into_inner().isbn, "9");
    assert_eq!(server.faults.requests(), 4, "MaxAttempts 4, at the server");
    assert_eq!(layer.metrics().retries(), 3);
    let attempts: Vec<_> = server
        .faults
        .seen()
        .iter()
        .map(|s| s.previous_attempts)
        .collect();
    assert_eq!(attempts, [None, Some(1), Some(2), Some(3)]);
}

/// JSON values of every shape, nested up to `depth`.
fn json_value(depth: u32) -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[-+.0-9a-zA-Z_ s]{0,16}".prop_map(Value::String),
        prop_oneof![
            Just("UNAVAILABLE"),
            Just("unavailable"),
            Just("0.1s"),
            Just(".01s"),
            Just("-1s"),
            Just("315576000001s"),
            Just("1.0000000001s"),
            Just("library.v1.Library"),
            Just("GetBook"),
            Just(""),
        ]
        .prop_map(|s| Value::String(s.to_owned())),
    ];
    let keys = prop_oneof![
        Just("methodConfig"),
        Just("name"),
        Just("service"),
        Just("method"),
        Just("retryPolicy"),
        Just("hedgingPolicy"),
        Just("maxAttempts"),
        Just("initialBackoff"),
        Just("maxBackoff"),
        Just("backoffMultiplier"),
        Just("retryableStatusCodes"),
        Just("perAttemptRecvTimeout"),
        Just("timeout"),
        Just("retryThrottling"),
        Just("maxTokens"),
        Just("tokenRatio"),
        Just("other"),
    ];
    leaf.prop_recursive(depth, 64, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            prop::collection::vec((keys.clone(), inner), 0..6).prop_map(|pairs| {
                serde_json::Value::Object(
                    pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
                )
            }),
        ]
    })
}

const VALID: &str = r#"{"methodConfig":[{"name":[{"service":"library.v1.Library","method":"GetBook"},{"service":"library.v1.Library"}],"timeout":"1.5s","retryPolicy":{"maxAttempts":4,"initialBackoff":".01s","maxBackoff":"0.2s","backoffMultiplier":1.5,"retryableStatusCodes":["UNAVAILABLE",4]}}],"retryThrottling":{"maxTokens":10,"tokenRatio":0.1}}"#;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn no_json_value_makes_the_reader_panic(value in json_value(6)) {
        let json = value.to_string();
        if let Ok(config) = ServiceConfig::from_json(&json) {
            // Whatever it accepts, it can build policies from.
            let table = config.policies(&RetryPolicy::default());
            let _ = table.policy_for("/library.v1.Library/GetBook");
            let _ = config.retry_throttle();
        }
    }

    #[test]
    fn no_string_makes_the_reader_panic(json in ".{0,200}") {
        let _ = ServiceConfig::from_json(&json);
    }

    #[test]
    fn a_valid_config_cut_or_corrupted_anywhere_never_panics(
        cut in 0..VALID.len(),
        at in 0..VALID.len(),
        byte in any::<u8>(),
    ) {
        let _ = ServiceConfig::from_json(&VALID[..cut]);
        let mut bytes = VALID.as_bytes().to_vec();
        bytes[at] = byte;
        if let Ok(json) = std::str::from_utf8(&bytes) {
            let _ = ServiceConfig::from_json(json);
        }
    }
}

#[test]
fn deep_nesting_and_huge_numbers_are_errors_not_crashes() {
    assert!(ServiceConfig::from_json(VALID).is_ok());
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(
        ServiceConfig::from_json(&deep).is_err(),
        "serde_json's depth limit"
    );
    let deep_in_place = VALID.replace(r#""other""#, "");
    let _ = ServiceConfig::from_json(&deep_in_place);
    for number in [
        "1e400",
        "-1e400",
        "1e-400",
        "123456789012345678901234567890",
        "-0",
    ] {
        let json = VALID.replace(r#""maxAttempts":4"#, &format!(r#""maxAttempts":{number}"#));
        let _ = ServiceConfig::from_json(&json);
        let json = VALID.replace(r#""tokenRatio":0.1"#, &format!(r#""tokenRatio":{number}"#));
        let _ = ServiceConfig::from_json(&json);
        let json = VALID.replace(r#"4]"#, &format!("{number}]"));
        let _ = ServiceConfig::from_json(&json);
    }
}
