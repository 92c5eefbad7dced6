//! The headers the layer writes on each attempt (the idempotency key, the
//! attempt count, the instances already tried) and what it takes from a
//! caller or a server. `tower-test` mocks under paused time.

use crate::support::{bounded_paused, policy, *};
use http::{HeaderValue, Request, Response};
use std::time::Duration;
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::marks::{AlreadyTried, PickedInstance};
use tonic_retry::{RetryLayer, RetryPolicy};
use tower::{Layer, Service, ServiceExt};

#[tokio::test(start_paused = true)]
async fn one_idempotency_key_for_every_attempt() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let mut keys = Vec::new();
    for n in 0..3 {
        let (req, send, _) = next(&mut handle).await;
        keys.push(req.headers()["x-idempotency-key"].clone());
        send.send_response(if n < 2 {
            status(Code::Unavailable)
        } else {
            ok()
        });
    }
    call.await.unwrap().unwrap();
    assert_eq!(keys[0].len(), 32, "128 bits in hex");
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");

    // A second call gets a key of its own.
    let call2 = spawn_call(&mut svc, request()).await;
    let (req, send, _) = next(&mut handle).await;
    assert_ne!(req.headers()["x-idempotency-key"], keys[0]);
    send.send_response(ok());
    call2.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_callers_key_is_kept_and_generation_can_be_off() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    req.headers_mut()
        .insert("x-idempotency-key", HeaderValue::from_static("order-42"));
    let call = spawn_call(&mut svc, req).await;
    for n in 0..2 {
        let (req, send, _) = next(&mut handle).await;
        assert_eq!(req.headers()["x-idempotency-key"], "order-42");
        send.send_response(if n == 0 {
            status(Code::Unavailable)
        } else {
            ok()
        });
    }
    call.await.unwrap().unwrap();

    let (mut svc, mut handle, _) =
        setup(RetryPolicy::default().with_idempotency_key(false), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (req, send, _) = next(&mut handle).await;
    assert!(!req.headers().contains_key("x-idempotency-key"));
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn attempts_are_numbered_and_failed_instances_marked() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;

    let (req, send, _) = next(&mut handle).await;
    assert!(!req.headers().contains_key("grpc-previous-rpc-attempts"));
    assert!(!req.headers().contains_key("x-already-tried"));
    assert!(req.extensions().get::<AlreadyTried>().is_none());
    send.send_response(status_from("instance-a", Code::Unavailable));

    let (req, send, _) = next(&mut handle).await;
    assert_eq!(req.headers()["grpc-previous-rpc-attempts"], "1");
    assert_eq!(req.headers()["x-already-tried"], "instance-a");
    let tried = req.extensions().get::<AlreadyTried>().expect("typed mark");
    assert!(tried.contains("instance-a") && tried.len() == 1);
    send.send_response(status_from("instance-b", Code::Unavailable));

    let (req, send, _) = next(&mut handle).await;
    assert_eq!(req.headers()["grpc-previous-rpc-attempts"], "2");
    assert_eq!(req.headers()["x-already-tried"], "instance-a,instance-b");
    let tried: Vec<_> = req
        .extensions()
        .get::<AlreadyTried>()
        .unwrap()
        .iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(tried, ["instance-a", "instance-b"]);
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

/// A caller's `x-already-tried` (merged with what the layer learns) is set
/// again on every retry where the caller put it, as `HeaderMap::insert`
/// does: the retries carry the first attempt's headers in its order.
#[tokio::test(start_paused = true)]
async fn a_callers_already_tried_mark_keeps_its_place_on_retries() {
    fn names(req: &Request<Body>) -> Vec<String> {
        req.headers()
            .keys()
            .map(|n| n.as_str().to_owned())
            .collect()
    }

    let policy = RetryPolicy::default().with_callers_mark_trusted(true);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let mut req = request();
    req.headers_mut()
        .insert("x-already-tried", HeaderValue::from_static("zone-x"));
    req.headers_mut()
        .insert("x-after", HeaderValue::from_static("1"));
    let call = spawn_call(&mut svc, req).await;

    let (first, send, _) = next(&mut handle).await;
    send.send_response(status_from("instance-a", Code::Unavailable));
    let (retry1, send, _) = next(&mut handle).await;
    send.send_response(status_from("instance-b", Code::Unavailable));
    let (retry2, send, _) = next(&mut handle).await;
    send.send_response(ok());
    call.await.unwrap().unwrap();

    assert_eq!(retry1.headers()["x-already-tried"], "zone-x,instance-a");
    assert_eq!(
        retry2.headers()["x-already-tried"],
        "zone-x,instance-a,instance-b"
    );
    let mut expected = names(&first);
    expected.push("grpc-previous-rpc-attempts".to_owned());
    assert_eq!(
        [names(&retry1), names(&retry2)],
        [expected.clone(), expected],
        "first and second retries"
    );
}

// ---------------------------------------------------------------------------
// The already-tried loop without a response
// ---------------------------------------------------------------------------

/// Plays a balancer below the layer: reports picking `instance` in the
/// request's `PickedInstance`, then hands the request to the mock.
fn picks(instance: &'static str) -> impl Fn(Request<Body>) -> Request<Body> + Clone {
    move |req: Request<Body>| {
        if let Some(picked) = req.extensions().get::<PickedInstance>() {
            picked.set(HeaderValue::from_static(instance));
        }
        req
    }
}

#[tokio::test(start_paused = true)]
async fn an_empty_idempotency_key_is_replaced() {
    for generate in [true, false] {
        let (mut svc, mut handle, _) = setup(
            RetryPolicy::default().with_idempotency_key(generate),
            budget(),
        );
        let mut req = request();
        req.headers_mut()
            .insert("x-idempotency-key", HeaderValue::from_static(""));
        let call = spawn_call(&mut svc, req).await;
        let (req, send, _) = next(&mut handle).await;
        assert_eq!(req.headers()["x-idempotency-key"].len(), 32);
        send.send_response(ok());
        call.await.unwrap().unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn an_attempt_cut_by_the_attempt_timeout_names_its_instance() {
    let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let layer = RetryLayer::new(policy(3).with_attempt_timeout(100 * MS), budget());
    let mut svc = layer.layer(tower::util::MapRequest::new(mock, picks("slow-a")));
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    let (first, _never_answered, _) = next(&mut handle).await;
    assert!(first.headers().get("x-already-tried").is_none());
    let (retry, send, _) = next(&mut handle).await;
    assert_eq!(retry.headers()["x-already-tried"], "slow-a");
    assert!(
        retry
            .extensions()
            .get::<AlreadyTried>()
            .unwrap()
            .contains("slow-a")
    );
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn a_transport_error_names_its_instance() {
    let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let layer = RetryLayer::new(policy(3), budget());
    let mut svc = layer.layer(tower::util::MapRequest::new(mock, picks("gone-b")));
    let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
    let (_, send, _) = next(&mut handle).await;
    send.send_error("connection refused");
    let (retry, send, _) = next(&mut handle).await;
    assert_eq!(retry.headers()["x-already-tried"], "gone-b");
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn a_callers_attempt_count_never_reaches_the_first_attempt() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    req.headers_mut()
        .insert("grpc-previous-rpc-attempts", HeaderValue::from_static("7"));
    let call = spawn_call(&mut svc, req).await;
    let (first, send, _) = next(&mut handle).await;
    assert!(first.headers().get("grpc-previous-rpc-attempts").is_none());
    send.send_response(status(Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    let counts: Vec<_> = retry
        .headers()
        .get_all("grpc-previous-rpc-attempts")
        .iter()
        .collect();
    assert_eq!(counts, ["1"]);
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_callers_already_tried_mark_is_merged_and_bounded() {
    let policy = RetryPolicy::default().with_callers_mark_trusted(true);
    let (mut svc, mut handle, _) = setup(policy, budget());
    let mut req = request();
    let junk = format!("x, has space ,{},y", "z".repeat(500));
    req.headers_mut()
        .insert("x-already-tried", HeaderValue::try_from(junk).unwrap());
    let call = spawn_call(&mut svc, req).await;
    let (first, send, _) = next(&mut handle).await;
    assert_eq!(first.headers()["x-already-tried"], "x,y");
    let mark = first.extensions().get::<AlreadyTried>().unwrap();
    assert_eq!(mark.iter().collect::<Vec<_>>(), ["x", "y"]);
    send.send_response(status_from("a", Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    assert_eq!(retry.headers()["x-already-tried"], "x,y,a");
    let mark = retry.extensions().get::<AlreadyTried>().unwrap();
    assert_eq!(mark.iter().collect::<Vec<_>>(), ["x", "y", "a"]);
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_callers_already_tried_header_is_removed_unless_trusted() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    req.headers_mut()
        .insert("x-already-tried", HeaderValue::from_static("x,y"));
    // The mark set in process is honoured, whatever the setting.
    let mut own = AlreadyTried::default();
    own.insert("z");
    req.extensions_mut().insert(own);
    let call = spawn_call(&mut svc, req).await;
    let (first, send, _) = next(&mut handle).await;
    assert_eq!(first.headers()["x-already-tried"], "z");
    let mark = first.extensions().get::<AlreadyTried>().unwrap();
    assert_eq!(mark.iter().collect::<Vec<_>>(), ["z"]);
    send.send_response(status_from("a", Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    assert_eq!(retry.headers()["x-already-tried"], "z,a");
    send.send_response(ok());
    call.await.unwrap().unwrap();

    // A header alone: gone from every attempt.
    let mut req = request();
    req.headers_mut()
        .insert("x-already-tried", HeaderValue::from_static("x,y"));
    let call = spawn_call(&mut svc, req).await;
    let (first, send, _) = next(&mut handle).await;
    assert!(first.headers().get("x-already-tried").is_none());
    assert!(first.extensions().get::<AlreadyTried>().is_none());
    send.send_response(status(Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    assert!(retry.headers().get("x-already-tried").is_none());
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_huge_instance_id_from_a_server_is_skipped() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut r = status(Code::Unavailable);
    r.headers_mut().insert(
        "x-instance-id",
        HeaderValue::try_from("i".repeat(100_000)).unwrap(),
    );
    send.send_response(r);
    let (retry, send, _) = next(&mut handle).await;
    assert!(retry.headers().get("x-already-tried").is_none());
    send.send_response(ok());
    call.await.unwrap().unwrap();
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
        let response = bounded_paused(call).await.unwrap().unwrap();
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
