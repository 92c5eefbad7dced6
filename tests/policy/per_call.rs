//! One call's own say on its retries, through a request extension, counted
//! at a real HTTP/2 server: off, a stricter policy, hedging on a retrying
//! method; and what such a call keeps of its method's policy.

use std::time::Duration;

use crate::support::bounded;
use crate::support::pb::GetBookRequest;
use crate::support::pb::library_client::LibraryClient;
use crate::support::raw::{RawServer, Step};
use tonic::Code;
use tonic::transport::Channel;
use tonic_retry::{
    CallPolicy, HedgePolicy, RetryBudget, RetryLayer, RetryPolicy, RetryService,
    marks::IDEMPOTENCY_KEY,
};

const MS: Duration = Duration::from_millis(1);

fn client(
    server: &RawServer,
    policy: RetryPolicy,
) -> (LibraryClient<RetryService<Channel>>, RetryLayer) {
    server.client(policy, RetryBudget::new(100, 0.1).unwrap())
}

/// The method's policy: three attempts on `UNAVAILABLE`, within 5 s.
fn retrying(attempts: u32) -> RetryPolicy {
    RetryPolicy::new(attempts, MS, 5 * MS, 0.2)
        .unwrap()
        .with_total_timeout(Duration::from_secs(5))
}

fn get_book(own: Option<CallPolicy>) -> tonic::Request<GetBookRequest> {
    let mut request = tonic::Request::new(GetBookRequest { isbn: "1".into() });
    if let Some(own) = own {
        request.extensions_mut().insert(own);
    }
    request
}

#[tokio::test]
async fn without_the_extension_the_methods_policy_applies() {
    let server = RawServer::start([Step::Status(Code::Unavailable); 3]).await;
    let (mut client, _) = client(&server, retrying(3));
    let status = bounded(client.get_book(get_book(None))).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(server.streams(), 3);
}

#[tokio::test]
async fn a_call_told_not_to_retry_is_sent_once_with_its_key_and_deadline() {
    let server = RawServer::start([Step::Status(Code::Unavailable); 3]).await;
    let (mut client, layer) = client(&server, retrying(3));
    let status = bounded(client.get_book(get_book(Some(CallPolicy::no_retry()))))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(server.streams(), 1);
    assert_eq!(layer.metrics().retries(), 0);
    // What the method's policy does besides retrying still applies.
    let key = server.header(IDEMPOTENCY_KEY.as_str());
    assert!(key[0].is_some(), "the key");
    let timeout = server.header("grpc-timeout");
    let told = crate::support::parse_timeout(timeout[0].as_deref().expect("a grpc-timeout"));
    assert!(
        told > Duration::from_secs(4) && told <= Duration::from_secs(5),
        "the method's deadline, got {told:?}"
    );
    assert_eq!(
        status
            .metadata()
            .get(IDEMPOTENCY_KEY.as_str())
            .unwrap()
            .to_str()
            .unwrap(),
        key[0].as_deref().unwrap(),
        "the key handed back"
    );
    // Not marked "do not retry": this layer did not retry.
    assert!(status.metadata().get("grpc-retry-pushback-ms").is_none());
}

#[tokio::test]
async fn a_call_given_a_stricter_policy_follows_it() {
    let server = RawServer::start([Step::Status(Code::Unavailable); 3]).await;
    let (mut client, layer) = client(&server, retrying(3));
    let own = CallPolicy::new(retrying(2));
    let status = bounded(client.get_book(get_book(Some(own))))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(server.streams(), 2);
    assert_eq!(layer.metrics().retries(), 1, "paid from the layer's budget");
    assert_eq!(layer.budget().available(), 49.0);
}

#[tokio::test]
async fn a_call_given_a_hedging_policy_hedges_on_a_retrying_method() {
    let server = RawServer::start([Step::AnswerAfter(Duration::from_secs(3))]).await;
    let (mut client, layer) = client(&server, retrying(3));
    let hedge = HedgePolicy::new(2, 20 * MS).unwrap();
    let book = bounded(client.get_book(get_book(Some(CallPolicy::new(hedge)))))
        .await
        .expect("the hedge answers");
    assert_eq!(book.get_ref().title, "Raw");
    assert_eq!(server.streams(), 2);
    assert_eq!(layer.metrics().hedges(), 1);
}

#[tokio::test]
async fn a_call_given_a_longer_policy_than_its_method_gets_its_time() {
    // The method caps its calls at 50 ms; this call may take 5 s.
    let server = RawServer::start([Step::AnswerAfter(200 * MS)]).await;
    let method = retrying(1).with_max_timeout(50 * MS);
    let (mut client, _) = client(&server, method);
    let status = bounded(client.get_book(get_book(None))).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    let own = CallPolicy::new(retrying(1));
    let book = bounded(client.get_book(get_book(Some(own)))).await.unwrap();
    assert_eq!(book.get_ref().title, "Raw");
}
