//! A call dropped at any await point sends nothing more and spends nothing.
//! `tower-test` mocks under paused time.

use crate::support::*;
use http::{Request, Response};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{RetryLayer, RetryPolicy};
use tower::{BoxError, Layer, Service, ServiceExt};

#[tokio::test(start_paused = true)]
async fn dropping_the_call_during_backoff_sends_nothing_more() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    // Let the layer decide to retry and start its backoff.
    tokio::time::sleep(5 * MS).await;
    call.abort();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        handle.next_request().now_or_never().is_none(),
        "a retry was sent after the drop"
    );
    // The token pays for an attempt really sent; none was.
    assert_eq!(
        layer.metrics().retries(),
        0,
        "a retry never sent was counted"
    );
    assert_eq!(layer.budget().available(), 100.0, "a token was lost");
}

#[tokio::test(start_paused = true)]
async fn dropping_the_call_cancels_the_attempt_in_flight() {
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let dropped = Arc::new(AtomicBool::new(false));
    let seen = dropped.clone();
    let inner = tower::service_fn(move |_req: Request<Body>| {
        let flag = Flag(seen.clone());
        async move {
            let _flag = flag;
            std::future::pending::<Result<Response<Body>, BoxError>>().await
        }
    });
    let mut svc = RetryLayer::new(RetryPolicy::default(), budget()).layer(inner);
    let fut = svc.ready().await.unwrap().call(request());
    let task = tokio::spawn(fut);
    tokio::time::sleep(10 * MS).await;
    assert!(!dropped.load(Ordering::SeqCst));
    task.abort();
    let _ = task.await;
    assert!(
        dropped.load(Ordering::SeqCst),
        "the attempt's future was not dropped"
    );
}

// ---------------------------------------------------------------------------
// Probes expected to hold
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn drop_during_backoff_spends_nothing() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status(Code::Unavailable));
    tokio::time::sleep(5 * MS).await; // inside the 16-24 ms backoff
    call.abort();
    let _ = call.await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(handle.next_request().now_or_never().is_none());
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
}

#[tokio::test(start_paused = true)]
async fn drop_during_retry_readiness_spends_nothing() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    handle.allow(0);
    send.send_response(status(Code::Unavailable));
    tokio::time::sleep(100 * MS).await;
    call.abort();
    let _ = call.await;
    handle.allow(1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(handle.next_request().now_or_never().is_none());
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
}
