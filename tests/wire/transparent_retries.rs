//! Transparent retries as gRPC defines them, against a raw HTTP/2 server: a
//! stream the server's library refused before its application saw it is
//! sent again at once, once a call, whatever the method's policy, not
//! counted toward its attempts nor paid for; and what a call's answer hands
//! back (the attempts before it, the idempotency key of a failed call).

use std::time::Duration;

use crate::support::bounded;
use crate::support::pb::GetBookRequest;
use crate::support::pb::library_client::LibraryClient;
use crate::support::raw::{RawServer, Step};
use tonic::Code;
use tonic::transport::Channel;
use tonic_retry::{
    HedgePolicy, OutcomeBudget, RetryBudget, RetryLayer, RetryPolicy, RetryService,
    budgets::{Budget, RetryThrottle},
    marks::IDEMPOTENCY_KEY,
    marks::PREVIOUS_ATTEMPTS,
};
use tower::ServiceBuilder;

const MS: Duration = Duration::from_millis(1);

type Client<Bu = RetryBudget> = LibraryClient<RetryService<Channel, Bu>>;

/// A client of `server` whose calls are retried by `policy`.
fn client(server: &RawServer, policy: RetryPolicy) -> (Client, RetryLayer) {
    server.client(policy, RetryBudget::new(10, 0.1).unwrap())
}

/// A policy retrying `UNAVAILABLE` with short waits.
fn retrying(attempts: u32) -> RetryPolicy {
    RetryPolicy::new(attempts, MS, 5 * MS, 0.2).unwrap()
}

fn get_book() -> tonic::Request<GetBookRequest> {
    let mut request = tonic::Request::new(GetBookRequest { isbn: "1".into() });
    request.set_timeout(Duration::from_secs(5));
    request
}

#[tokio::test]
async fn a_refused_stream_is_sent_again_under_a_policy_of_one_attempt() {
    let server = RawServer::start([Step::Refuse]).await;
    let (mut client, layer) = client(&server, RetryPolicy::no_retry());
    let book = bounded(client.get_book(get_book()))
        .await
        .expect("the server's answer, on a second stream");
    assert_eq!(book.get_ref().title, "Raw");
    assert_eq!(server.streams(), 2);
    let metrics = layer.metrics();
    assert_eq!(metrics.transparent_retries(), 1);
    assert_eq!(metrics.retries(), 0);
    assert_eq!(metrics.attempts(), 2);
    // Not paid for: the one success deposited, nothing was withdrawn.
    assert_eq!(layer.budget().available(), 5.1);
    // The refused attempt is not counted: the retry carries no count, and
    // the answer hands none back.
    assert_eq!(server.header(PREVIOUS_ATTEMPTS.as_str()), [None, None]);
    assert!(book.metadata().get(PREVIOUS_ATTEMPTS.as_str()).is_none());
}

#[tokio::test]
async fn refused_then_unavailable_then_answered_under_two_attempts() {
    let server = RawServer::start([Step::Refuse, Step::Status(Code::Unavailable)]).await;
    let (mut client, layer) = client(&server, retrying(2));
    let book = bounded(client.get_book(get_book()))
        .await
        .expect("the policy's retry answers");
    assert_eq!(server.streams(), 3);
    let metrics = layer.metrics();
    assert_eq!(
        (metrics.transparent_retries(), metrics.retries()),
        (1, 1),
        "the policy's attempts are the two the server's application saw"
    );
    // One token for the policy's retry, a tenth back for the success.
    assert_eq!(layer.budget().available(), 4.1);
    let key = server.header(IDEMPOTENCY_KEY.as_str());
    assert!(key[0].is_some());
    assert!(key.iter().all(|k| *k == key[0]), "one key: {key:?}");
    one_attempt_before_the_third(&server, &book);
}

/// The third stream, and the answer it gave, say one attempt the server's
/// application saw came before (the refused stream is not one).
fn one_attempt_before_the_third<T>(server: &RawServer, answer: &tonic::Response<T>) {
    assert_eq!(
        server.header(PREVIOUS_ATTEMPTS.as_str()),
        [None, None, Some("1".to_owned())]
    );
    assert_eq!(
        answer.metadata().get(PREVIOUS_ATTEMPTS.as_str()).unwrap(),
        "1"
    );
}

#[tokio::test]
async fn a_call_retries_transparently_once() {
    let server = RawServer::start([Step::Refuse, Step::Refuse]).await;
    let (mut client, layer) = client(&server, RetryPolicy::no_retry());
    let status = bounded(client.get_book(get_book()))
        .await
        .expect_err("refused twice");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(server.streams(), 2);
    assert_eq!(layer.metrics().transparent_retries(), 1);
    assert_eq!(layer.metrics().retries(), 0);
}

#[tokio::test]
async fn a_transparent_retry_charges_no_throttle() {
    // Four refused calls would take gRPC's throttle from 10 to 6, at which
    // retries stop; they are not failures to it.
    let server = RawServer::start([
        Step::Refuse,
        Step::AnswerAfter(Duration::ZERO),
        Step::Refuse,
        Step::AnswerAfter(Duration::ZERO),
        Step::Refuse,
        Step::AnswerAfter(Duration::ZERO),
        Step::Refuse,
    ])
    .await;
    let layer = RetryLayer::with_budget(retrying(3), RetryThrottle::new(10.0, 0.1).unwrap());
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(server.channel());
    let mut client = LibraryClient::new(svc);
    for _ in 0..4 {
        bounded(client.get_book(get_book())).await.unwrap();
    }
    assert_eq!(layer.metrics().transparent_retries(), 4);
    assert_eq!(layer.budget().available(), 10.0);
}

#[tokio::test]
async fn a_stream_a_graceful_goaway_did_not_take_is_sent_again() {
    let server = RawServer::start([Step::GoAway]).await;
    let (mut client, layer) = client(&server, RetryPolicy::no_retry());
    let book = bounded(client.get_book(get_book()))
        .await
        .expect("answered on a new connection");
    assert_eq!(book.get_ref().title, "Raw");
    assert_eq!(server.streams(), 2);
    assert_eq!(layer.metrics().transparent_retries(), 1);
}

#[tokio::test]
async fn a_hedged_call_retries_a_refused_stream_transparently() {
    let server = RawServer::start([Step::Refuse]).await;
    let hedge = HedgePolicy::new(2, Duration::from_secs(2)).unwrap();
    let (mut client, layer) = client(&server, RetryPolicy::from(hedge));
    let book = bounded(client.get_book(get_book())).await.unwrap();
    assert_eq!(server.streams(), 2);
    let metrics = layer.metrics();
    assert_eq!(
        (metrics.transparent_retries(), metrics.hedges()),
        (1, 0),
        "sent again at once, not as a hedge after its delay"
    );
    assert_eq!(server.header(PREVIOUS_ATTEMPTS.as_str()), [None, None]);
    assert!(book.metadata().get(PREVIOUS_ATTEMPTS.as_str()).is_none());
}

#[tokio::test]
async fn an_answer_by_the_first_attempt_hands_nothing_back() {
    let server = RawServer::start([]).await;
    let (mut client, _) = client(&server, retrying(3));
    let book = bounded(client.get_book(get_book())).await.unwrap();
    assert!(book.metadata().get(PREVIOUS_ATTEMPTS.as_str()).is_none());
    assert!(book.metadata().get(IDEMPOTENCY_KEY.as_str()).is_none());
}

#[tokio::test]
async fn an_answer_by_the_third_attempt_says_two_came_before() {
    let server = RawServer::start([
        Step::Status(Code::Unavailable),
        Step::Status(Code::Unavailable),
    ])
    .await;
    let (mut client, _) = client(&server, retrying(3));
    let book = bounded(client.get_book(get_book())).await.unwrap();
    assert_eq!(
        book.metadata().get(PREVIOUS_ATTEMPTS.as_str()).unwrap(),
        "2"
    );
    assert!(
        book.metadata().get(IDEMPOTENCY_KEY.as_str()).is_none(),
        "a success needs no key back"
    );
}

#[tokio::test]
async fn a_call_failed_by_its_third_attempt_hands_back_the_count_and_its_key() {
    let server = RawServer::start([Step::Status(Code::Unavailable); 3]).await;
    let (mut client, _) = client(&server, retrying(3));
    let status = bounded(client.get_book(get_book())).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let metadata = status.metadata();
    assert_eq!(metadata.get(PREVIOUS_ATTEMPTS.as_str()).unwrap(), "2");
    let sent = server.header(IDEMPOTENCY_KEY.as_str());
    assert_eq!(
        metadata
            .get(IDEMPOTENCY_KEY.as_str())
            .unwrap()
            .to_str()
            .unwrap(),
        sent[0].as_deref().unwrap(),
        "the key every attempt carried"
    );
}

#[tokio::test]
async fn a_failed_call_hands_back_the_callers_own_key() {
    let server = RawServer::start([Step::Status(Code::InvalidArgument)]).await;
    let (mut client, _) = client(&server, retrying(3));
    let mut request = get_book();
    request
        .metadata_mut()
        .insert("x-idempotency-key", "order-17".parse().unwrap());
    let status = bounded(client.get_book(request)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.metadata().get(IDEMPOTENCY_KEY.as_str()).unwrap(),
        "order-17"
    );
    assert!(status.metadata().get(PREVIOUS_ATTEMPTS.as_str()).is_none());
}

#[tokio::test]
async fn a_hedged_call_won_by_its_second_attempt_says_one_came_before() {
    let server = RawServer::start([Step::AnswerAfter(Duration::from_secs(3))]).await;
    let hedge = HedgePolicy::new(2, 20 * MS).unwrap();
    let (mut client, layer) = client(&server, RetryPolicy::from(hedge));
    let book = bounded(client.get_book(get_book())).await.unwrap();
    assert_eq!(layer.metrics().hedges(), 1);
    assert_eq!(
        book.metadata().get(PREVIOUS_ATTEMPTS.as_str()).unwrap(),
        "1"
    );
}

#[tokio::test]
async fn a_hedged_call_that_failed_hands_back_its_key() {
    let server = RawServer::start([Step::Status(Code::Unavailable); 2]).await;
    let hedge = HedgePolicy::new(2, 20 * MS).unwrap();
    let (mut client, _) = client(&server, RetryPolicy::from(hedge));
    let status = bounded(client.get_book(get_book())).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(
        status.metadata().get(PREVIOUS_ATTEMPTS.as_str()).unwrap(),
        "1"
    );
    let sent = server.header(IDEMPOTENCY_KEY.as_str());
    assert_eq!(
        status
            .metadata()
            .get(IDEMPOTENCY_KEY.as_str())
            .unwrap()
            .to_str()
            .unwrap(),
        sent[0].as_deref().unwrap()
    );
}

#[cfg(feature = "opentelemetry")]
#[tokio::test]
async fn a96_counts_a_transparent_retry_apart_from_the_policys() {
    use crate::support::exported::Exported;

    let server = RawServer::start([Step::Refuse, Step::Status(Code::Unavailable)]).await;
    let exported = Exported::new();
    let target = format!("dns:///{}", server.addr);
    let metrics = exported
        .metrics(&target)
        .with_methods(["library.v1.Library/GetBook"])
        .unwrap();
    let layer =
        RetryLayer::new(retrying(3), RetryBudget::new(10, 0.1).unwrap()).with_grpc_metrics(metrics);
    let svc = ServiceBuilder::new().layer(layer).service(server.channel());
    let mut client = LibraryClient::new(svc);
    bounded(client.get_book(get_book())).await.unwrap();

    let got = exported.collect();
    let method = ("grpc.method", "library.v1.Library/GetBook");
    let target = ("grpc.target", target.as_str());
    let (unit, points) = got
        .get("grpc.client.call.transparent_retries")
        .expect("exported");
    assert_eq!(unit, "{transparent_retry}");
    assert_eq!(points[0].bounds, [1.0, 2.0, 3.0, 4.0, 5.0, 10.0]);
    let transparent = got.point("grpc.client.call.transparent_retries", &[method, target]);
    assert_eq!((transparent.count, transparent.sum), (1, 1.0));
    let retries = got.point("grpc.client.call.retries", &[method, target]);
    assert_eq!((retries.count, retries.sum), (1, 1.0));
    let started = got.point("grpc.client.attempt.started", &[method, target]);
    assert_eq!(started.sum, 3.0, "the refused attempt was started too");
}

#[tokio::test]
async fn a_hedge_after_a_transparent_retry_counts_only_attempts_sent() {
    // The first stream is refused and sent again at once; the hedge after
    // the delay follows one attempt the server's application saw.
    let server = RawServer::start([Step::Refuse, Step::AnswerAfter(Duration::from_secs(3))]).await;
    let hedge = HedgePolicy::new(3, 20 * MS).unwrap();
    let (mut client, layer) = client(&server, RetryPolicy::from(hedge));
    let book = bounded(client.get_book(get_book())).await.unwrap();
    let metrics = layer.metrics();
    assert_eq!((metrics.transparent_retries(), metrics.hedges()), (1, 1));
    one_attempt_before_the_third(&server, &book);
}

#[tokio::test]
async fn a_hedged_call_whose_hedges_stopped_still_retries_a_refused_stream() {
    // The budget refuses the hedge at 20 ms, so it never leaves; the one
    // attempt left is then refused by the server at 100 ms, and is sent
    // again, following no attempt the server's application saw.
    let server = RawServer::start([Step::RefuseAfter(100 * MS)]).await;
    let hedge = HedgePolicy::new(2, 20 * MS).unwrap();
    let layer = RetryLayer::new(
        RetryPolicy::from(hedge),
        RetryBudget::new(1, 0.001).unwrap(),
    );
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(server.channel());
    let mut client = LibraryClient::new(svc);
    let book = bounded(client.get_book(get_book())).await.unwrap();
    assert_eq!(server.streams(), 2);
    assert_eq!(layer.metrics().transparent_retries(), 1);
    assert_eq!(server.header(PREVIOUS_ATTEMPTS.as_str()), [None, None]);
    assert!(book.metadata().get(PREVIOUS_ATTEMPTS.as_str()).is_none());
}

#[tokio::test]
async fn a_hedged_call_with_no_attempt_left_after_its_transparent_retry_holds_no_copy() {
    // Refused, resent at once (answering in 800 ms), hedged at 20 ms
    // (UNAVAILABLE): the one attempt left can be followed by none.
    let server = RawServer::start([
        Step::Refuse,
        Step::AnswerAfter(Duration::from_millis(800)),
        Step::Status(Code::Unavailable),
    ])
    .await;
    let hedge = HedgePolicy::new(2, 20 * MS).unwrap();
    let (mut client, layer) = client(&server, RetryPolicy::from(hedge));
    let call = tokio::spawn(async move { client.get_book(get_book()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let in_use = layer.replay_memory_in_use();
    let streams = server.streams();
    let book = bounded(call).await.unwrap();
    assert!(book.is_ok(), "{book:?}");
    assert_eq!(streams, 3);
    assert_eq!(layer.metrics().transparent_retries(), 1);
    assert_eq!(in_use, 0, "bytes held once no attempt can follow");
}

#[tokio::test]
async fn a_resend_no_retry_can_follow_holds_no_copy_once_it_has_replayed_the_body() {
    // One attempt: the refused stream is sent again at once, and nothing can
    // follow that resend, so its copy goes once the body is replayed,
    // before the answer (800 ms later).
    let server = RawServer::start([Step::Refuse, Step::AnswerAfter(800 * MS)]).await;
    let (mut client, layer) = client(&server, retrying(1));
    let call = tokio::spawn(async move { client.get_book(get_book()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let in_use = layer.replay_memory_in_use();
    let streams = server.streams();
    assert!(bounded(call).await.unwrap().is_ok());
    assert_eq!((streams, layer.metrics().transparent_retries()), (2, 1));
    assert_eq!(in_use, 0, "bytes held by a resend no retry can follow");
}

/// A stream refused just before its caller stops waiting (a layer above said
/// so in `x-attempt-timeout`) is not sent again: a retried call and a hedged
/// one alike end saying how the one attempt the server saw ended.
#[tokio::test]
async fn a_stream_refused_just_before_its_callers_end_is_not_sent_again() {
    let hedged = RetryPolicy::from(HedgePolicy::new(2, Duration::from_secs(2)).unwrap());
    for policy in [retrying(3), hedged] {
        let server = RawServer::start([Step::RefuseAfter(90 * MS)]).await;
        let (mut client, _) = self::client(&server, policy);
        let mut req = get_book();
        req.set_timeout(Duration::from_secs(5));
        req.metadata_mut()
            .insert("x-attempt-timeout", "100m".parse().unwrap());
        let status = bounded(client.get_book(req)).await.unwrap_err();
        assert_eq!(server.streams(), 1);
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        assert!(
            status.message().contains("ended with UNAVAILABLE"),
            "{status:?}"
        );
    }
}

/// A transparent retry is no paid retry: a call that succeeds on one gets no
/// token back from `OutcomeBudget`; a call that succeeds on a retry does,
/// even when that retry's own stream was refused and sent again.
#[tokio::test]
async fn only_a_paid_retry_that_succeeds_gets_its_token_back() {
    let server = RawServer::start([
        Step::Refuse,
        Step::AnswerAfter(Duration::ZERO),
        Step::Status(Code::Unavailable),
        Step::Refuse,
        Step::AnswerAfter(Duration::ZERO),
    ])
    .await;
    let budget = OutcomeBudget::new(10, 0.1).unwrap();
    // Spend two tokens, to see what comes back below the cap.
    assert!(budget.withdraw() && budget.withdraw());
    let (mut client, layer) = server.client(retrying(3), budget);
    bounded(client.get_book(get_book())).await.unwrap();
    assert_eq!(layer.budget().available(), 8.1, "a deposit, no refund");
    bounded(client.get_book(get_book())).await.unwrap();
    // The retry took one, its success deposited 0.1 and gave the one back.
    assert_eq!(layer.budget().available(), 8.2);
    assert_eq!(layer.metrics().retries(), 1);
    assert_eq!(layer.metrics().transparent_retries(), 2);
}

/// In a hedged call too: the first attempt refused and sent again, and that
/// transparent retry answering, is no hedge the budget paid for, and gives
/// `OutcomeBudget` no token back.
#[tokio::test]
async fn a_hedged_calls_transparent_retry_gets_no_token_back() {
    let server = RawServer::start([Step::Refuse, Step::AnswerAfter(Duration::ZERO)]).await;
    let budget = OutcomeBudget::new(10, 0.1).unwrap();
    assert!(budget.withdraw() && budget.withdraw());
    // A hedge delay no answer here waits for.
    let hedged = HedgePolicy::new(2, Duration::from_secs(5)).unwrap();
    let (mut client, layer) = server.client(hedged.into(), budget);
    bounded(client.get_book(get_book())).await.unwrap();
    assert_eq!(layer.metrics().transparent_retries(), 1);
    assert_eq!(layer.metrics().hedges(), 0);
    assert_eq!(layer.budget().available(), 8.1, "a deposit, no refund");
}
