//! Balancers below the layer: `PreferUntried` steering retries away from
//! failed instances, saturated or failing endpoints, and round-robin through
//! the layer. Mostly `tower-test` mocks under paused time.

use crate::support::{bounded_paused, policy, *};
use http::{Request, Response};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::balance::PreferUntried;
use tonic_retry::{RetryLayer, RetryPolicy};
use tower::{BoxError, Layer, Service, ServiceExt};
use tower_test::mock;

// ---------------------------------------------------------------------------
// A token only for an attempt really sent — through PreferUntried
// ---------------------------------------------------------------------------

type MockSvc = tower_test::mock::Mock<Request<Body>, Response<Body>>;

// ---------------------------------------------------------------------------
// PreferUntried whose endpoints have all failed
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
    send.send_response(answer(Code::Ok));
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(read_to_end(response).await, Code::Ok);
    assert!(handle_b.next_request().now_or_never().is_none());
    assert_eq!(
        (layer.metrics().retries(), layer.budget().available()),
        (1, 99.1),
        "one retry, really sent, paid one token; the success earned 0.1"
    );
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

mod balancing {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tonic_retry::balance::PreferUntried;

    type Log = Arc<Mutex<Vec<&'static str>>>;

    fn endpoint(
        name: &'static str,
        log: Log,
    ) -> impl Service<
        Request<Body>,
        Response = Response<Body>,
        Error = tower::BoxError,
        Future: Send + 'static,
    > + Clone {
        tower::service_fn(move |_req: Request<Body>| {
            log.lock().unwrap().push(name);
            async move { Ok::<_, tower::BoxError>(ok()) }
        })
    }

    /// Round-robin without marks, through the retry layer.
    #[tokio::test(start_paused = true)]
    async fn round_robin_through_the_layer() {
        let log = Log::default();
        let lb =
            PreferUntried::new(["a", "b", "c"].map(|n| (n.to_owned(), endpoint(n, log.clone()))))
                .unwrap();
        let mut svc = RetryLayer::new(policy(3), budget()).layer(lb);
        for _ in 0..300 {
            svc.ready().await.unwrap().call(request()).await.unwrap();
        }
        let log = log.lock().unwrap();
        for n in ["a", "b", "c"] {
            assert_eq!(log.iter().filter(|x| **x == n).count(), 100, "{n}");
        }
    }

    /// Mixed ready / never-ready endpoints, a readiness error on one endpoint,
    /// load_shed above.
    #[tokio::test(start_paused = true)]
    async fn mixed_readiness_errors_and_load_shed() {
        let (a, mut ha) = mock::pair::<Request<Body>, Response<Body>>();
        let (b, mut hb) = mock::pair::<Request<Body>, Response<Body>>();
        hb.allow(0);
        type Boxed = tower::util::BoxCloneService<Request<Body>, Response<Body>, tower::BoxError>;
        let boxed = |m: mock::Mock<Request<Body>, Response<Body>>| -> Boxed {
            Boxed::new(m.map_err(Into::into))
        };
        let lb = PreferUntried::new([
            ("a".to_owned(), boxed(a)),
            ("b".to_owned(), boxed(b)),
            ("c".to_owned(), Boxed::new(Gone)),
        ])
        .unwrap();
        let mut svc = RetryLayer::new(policy(3), budget()).layer(lb.clone());
        for _ in 0..4 {
            let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
            let (_, send) = bounded_paused(ha.next_request()).await.unwrap();
            send.send_response(ok());
            assert_eq!(call.await.unwrap().unwrap().headers()["x-instance-id"], "a");
        }
        // load_shed directly above: b and c cannot take it, a can.
        ha.allow(0);
        let mut shed = tower::load_shed::LoadShed::new(lb.clone());
        let e = shed
            .ready()
            .await
            .unwrap()
            .call(request())
            .await
            .unwrap_err();
        assert!(e.is::<tower::load_shed::error::Overloaded>(), "{e}");
        let _ = &mut hb;
    }

    /// An endpoint whose readiness always fails (a buffer whose worker died).
    #[derive(Clone)]
    struct Gone;
    impl Service<Request<Body>> for Gone {
        type Response = Response<Body>;
        type Error = tower::BoxError;
        type Future = std::future::Ready<Result<Response<Body>, tower::BoxError>>;
        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), tower::BoxError>> {
            std::task::Poll::Ready(Err("worker gone".into()))
        }
        fn call(&mut self, _: Request<Body>) -> Self::Future {
            panic!("called after failing readiness")
        }
    }
}
