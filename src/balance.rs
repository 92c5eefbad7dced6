//! The balancer side of the already-tried mark: route a retry away from the
//! instances that failed the call's earlier attempts.
//!
//! [`RetryLayer`](crate::RetryLayer) learns which instance each failed attempt
//! went to — from the `x-instance-id` response header, or, when the attempt got
//! no response at all, from the [`PickedInstance`] slot the balancer fills in —
//! and names those instances on the next attempt, in the [`AlreadyTried`]
//! request extension and the [`x-already-tried`](crate::marks::ALREADY_TRIED) header.
//! [`PreferUntried`] is a balancer that closes that loop in process: it routes
//! round-robin among named endpoints, sends a retry to one of the endpoints the
//! call has not tried yet (chosen at random, so retries spread evenly), reports
//! its pick in the request's [`PickedInstance`], and stamps the chosen
//! endpoint's id on the response.
//!
//! ```no_run
//! use tonic::transport::Endpoint;
//! use tonic_retry::balance::PreferUntried;
//! use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
//! use tower::ServiceBuilder;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let endpoints = ["10.0.0.1:50051", "10.0.0.2:50051"].map(|addr| {
//!     let channel = Endpoint::from_shared(format!("http://{addr}")).unwrap().connect_lazy();
//!     (addr.to_owned(), channel)
//! });
//! let svc = ServiceBuilder::new()
//!     .layer(RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1)?))
//!     .service(PreferUntried::new(endpoints)?);
//! # let _ = svc;
//! # Ok(())
//! # }
//! ```
//!
//! A balancer in another process (a proxy) can do the same with the
//! `x-already-tried` header, a comma-separated list of instance ids, provided
//! its instances (or the proxy itself) report `x-instance-id` on responses.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use rand::Rng;
use tower::ServiceExt;
use tower::util::Oneshot;
use tower_service::Service;

use crate::error::ConfigError;
use crate::marks::{ALREADY_TRIED, AlreadyTried, INSTANCE_ID, PickedInstance, is_valid_id};

/// An endpoint's name, shared by every clone of the balancer.
struct Named {
    id: String,
    /// The id as a header value whose clones share one buffer.
    header: HeaderValue,
}

/// Routes each request to one of several endpoints, round-robin, avoiding the
/// ones its [`AlreadyTried`] mark names; see the [module docs](self).
///
/// # Readiness
///
/// `poll_ready` polls every endpoint this clone has not readied yet and is
/// ready when at least one of them is (pending when none is, failing only when
/// all have failed), so backpressure from the endpoints — a saturated
/// concurrency limit, a full buffer — reaches the layers above, and
/// `load_shed` above it sheds. `call` uses one readied endpoint and gives
/// back what the others' readiness reserved, so a balancer between calls
/// holds no endpoint's capacity: its clones, and anything else sharing the
/// endpoints, see them as they are. A request goes to a ready endpoint that its mark
/// does not name if there is one; otherwise to a ready endpoint it names
/// rather than wait: having said it was ready, the balancer sends at once (so
/// a retry the layer above paid for is really sent).
pub struct PreferUntried<S> {
    names: Arc<[Named]>,
    /// This clone's handle on each endpoint.
    services: Vec<S>,
    /// Which handles `poll_ready` has readied and no call has used yet.
    ready: Vec<bool>,
    /// Which handles failed their readiness; a failed service is not used again.
    failed: Vec<bool>,
    next: Arc<AtomicUsize>,
}

impl<S> PreferUntried<S> {
    /// A balancer over `(instance id, service)` pairs.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] if there are no endpoints, or an id is empty, longer
    /// than [`MAX_INSTANCE_ID_LEN`](crate::marks::MAX_INSTANCE_ID_LEN), not visible
    /// ASCII, contains a comma, or is repeated.
    pub fn new(endpoints: impl IntoIterator<Item = (String, S)>) -> Result<Self, ConfigError> {
        let mut names: Vec<Named> = Vec::new();
        let mut services = Vec::new();
        for (id, service) in endpoints {
            let id = id.trim().to_owned();
            if names.iter().any(|named| named.id == id) {
                return Err(ConfigError::new(
                    "endpoints",
                    format!("instance id {id:?} is named twice"),
                ));
            }
            // The same rules as the already-tried mark, so every id can be named in it.
            if !is_valid_id(&id) {
                return Err(ConfigError::new(
                    "endpoints",
                    format!(
                        "instance id {id:?} must be 1 to {} visible ASCII characters without commas",
                        crate::marks::MAX_INSTANCE_ID_LEN
                    ),
                ));
            }
            let header = HeaderValue::from_maybe_shared(Bytes::from_owner(id.clone()))
                .map_err(|_| ConfigError::new("endpoints", format!("instance id {id:?}")))?;
            names.push(Named { id, header });
            services.push(service);
        }
        if names.is_empty() {
            return Err(ConfigError::new(
                "endpoints",
                "at least one endpoint is needed",
            ));
        }
        let n = names.len();
        Ok(Self {
            names: names.into(),
            services,
            ready: vec![false; n],
            failed: vec![false; n],
            next: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// The endpoint ids, in order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(|e| e.id.as_str())
    }

    /// The endpoint for `req`: first an untried, ready one; then a ready one;
    /// then (when `call` came without `poll_ready`) an untried one; then any.
    /// Without a mark that is round-robin over the ready endpoints; with one,
    /// a retry goes to an untried endpoint chosen at random, so retries spread
    /// evenly over them.
    fn pick<B>(&self, req: &Request<B>) -> usize {
        let n = self.names.len();
        let from_header;
        let mark = match req.extensions().get::<AlreadyTried>() {
            Some(mark) => Some(mark),
            None => {
                from_header = req
                    .headers()
                    .get(ALREADY_TRIED)
                    .map(AlreadyTried::from_header);
                from_header.as_ref()
            }
        };
        let untried =
            |i: usize| !self.failed[i] && !mark.is_some_and(|m| m.contains(&self.names[i].id));
        let ready = |i: usize| self.ready[i];
        let choose = |keep: &dyn Fn(usize) -> bool| -> Option<usize> {
            let count = (0..n).filter(|&i| keep(i)).count();
            if count == 0 {
                return None;
            }
            let k = match mark {
                Some(m) if !m.is_empty() => rand::rng().random_range(0..count),
                _ => self.next.fetch_add(1, Ordering::Relaxed) % count,
            };
            (0..n).filter(|&i| keep(i)).nth(k)
        };
        // NOTE: a ready endpoint comes before an untried one that is not
        // ready: `poll_ready` said this balancer was ready, and the retry layer
        // above paid for an attempt sent now, not one left waiting here.
        choose(&|i| untried(i) && ready(i))
            .or_else(|| choose(&ready))
            .or_else(|| choose(&untried))
            .or_else(|| choose(&|i| !self.failed[i]))
            .unwrap_or(0)
    }
}

impl<S: Clone> Clone for PreferUntried<S> {
    /// A clone with its own endpoint handles, none of them readied yet.
    fn clone(&self) -> Self {
        let n = self.names.len();
        Self {
            names: Arc::clone(&self.names),
            services: self.services.clone(),
            ready: vec![false; n],
            failed: vec![false; n],
            next: Arc::clone(&self.next),
        }
    }
}

impl<S> fmt::Debug for PreferUntried<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreferUntried")
            .field("endpoints", &self.ids().collect::<Vec<_>>())
            .field("ready", &self.ready)
            .finish()
    }
}

impl<S, B, RB> Service<Request<B>> for PreferUntried<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.failed.iter().all(|f| *f) {
            // Polled again after reporting every endpoint failed: poll them
            // again rather than return `Pending` with no waker registered.
            self.failed.fill(false);
        }
        let mut any_ready = false;
        let mut last_error = None;
        for (i, service) in self.services.iter_mut().enumerate() {
            if self.failed[i] {
                continue;
            }
            if !self.ready[i] {
                match service.poll_ready(cx) {
                    Poll::Ready(Ok(())) => self.ready[i] = true,
                    Poll::Ready(Err(error)) => {
                        tracing::debug!(instance = %self.names[i].id, "endpoint failed its readiness");
                        self.failed[i] = true;
                        last_error = Some(error);
                        continue;
                    }
                    Poll::Pending => {}
                }
            }
            any_ready |= self.ready[i];
        }
        if any_ready {
            return Poll::Ready(Ok(()));
        }
        match last_error {
            Some(error) if self.failed.iter().all(|f| *f) => Poll::Ready(Err(error)),
            _ => Poll::Pending,
        }
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let i = self.pick(&req);
        let named = &self.names[i];
        if let Some(picked) = req.extensions().get::<PickedInstance>() {
            picked.set(named.header.clone());
        }
        // The readied handle makes the call; a fresh one stays. An endpoint
        // that is not ready yet is waited for in the response future.
        let fresh = self.services[i].clone();
        let service = std::mem::replace(&mut self.services[i], fresh);
        self.ready[i] = false;
        // NOTE: the other endpoints `poll_ready` readied give back what their
        // readiness reserved (a concurrency permit, a buffer slot): dropping
        // a readied handle releases it. Otherwise an idle balancer would hold
        // a slot of every endpoint, and other clones — or anyone else sharing
        // the endpoints — would wait for capacity nobody uses.
        for (j, ready) in self.ready.iter_mut().enumerate() {
            if std::mem::take(ready) {
                self.services[j] = self.services[j].clone();
            }
        }
        ResponseFuture {
            inner: service.oneshot(req),
            instance: named.header.clone(),
        }
    }
}

pin_project! {
    /// Response future of [`PreferUntried`].
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        inner: Oneshot<S, Request<B>>,
        instance: HeaderValue,
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl<S, B, RB> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<RB>>,
{
    type Output = Result<Response<RB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut response = ready!(this.inner.poll(cx))?;
        // The instance's own report wins; otherwise say which one we chose.
        response
            .headers_mut()
            .entry(INSTANCE_ID)
            .or_insert_with(|| this.instance.clone());
        Poll::Ready(Ok(response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tonic::Code;
    use tonic::body::Body;
    use tower_test::mock;

    type Log = Arc<Mutex<Vec<&'static str>>>;

    fn endpoint(
        name: &'static str,
        log: Log,
        fail: bool,
    ) -> impl Service<Request<Body>, Response = Response<Body>, Error = tower::BoxError> + Clone
    {
        tower::service_fn(move |_req: Request<Body>| {
            log.lock().unwrap().push(name);
            async move {
                if fail {
                    Err::<Response<Body>, tower::BoxError>("connection refused".into())
                } else {
                    Ok(tonic::Status::new(Code::Ok, "").into_http())
                }
            }
        })
    }

    fn req(tried: &[&str]) -> Request<Body> {
        let mut req = Request::new(Body::empty());
        if !tried.is_empty() {
            let mut mark = AlreadyTried::default();
            for t in tried {
                mark.insert(t);
            }
            req.extensions_mut().insert(mark);
        }
        req
    }

    fn three(
        log: &Log,
    ) -> PreferUntried<
        impl Service<Request<Body>, Response = Response<Body>, Error = tower::BoxError> + Clone,
    > {
        PreferUntried::new([
            ("a".to_owned(), endpoint("a", log.clone(), false)),
            ("b".to_owned(), endpoint("b", log.clone(), false)),
            ("c".to_owned(), endpoint("c", log.clone(), false)),
        ])
        .unwrap()
    }

    #[tokio::test]
    async fn round_robin_then_skips_the_tried() {
        let log = Log::default();
        let lb = three(&log);
        for _ in 0..3 {
            lb.clone().oneshot(req(&[])).await.unwrap();
        }
        assert_eq!(*log.lock().unwrap(), ["a", "b", "c"]);
        log.lock().unwrap().clear();
        for _ in 0..6 {
            let r = lb.clone().oneshot(req(&["a", "b"])).await.unwrap();
            assert_eq!(r.headers()["x-instance-id"], "c");
        }
        assert!(log.lock().unwrap().iter().all(|n| *n == "c"));
    }

    #[tokio::test]
    async fn retries_spread_evenly_over_the_untried() {
        let log = Log::default();
        let lb = three(&log);
        for _ in 0..600 {
            // First attempts keep moving the round-robin cursor meanwhile.
            lb.clone().oneshot(req(&[])).await.unwrap();
            lb.clone().oneshot(req(&["a"])).await.unwrap();
        }
        let log = log.lock().unwrap();
        let retries: Vec<_> = log.iter().skip(1).step_by(2).collect();
        let on_b = retries.iter().filter(|n| ***n == "b").count();
        let on_c = retries.iter().filter(|n| ***n == "c").count();
        assert_eq!(on_b + on_c, 600, "no retry went back to a");
        assert!(
            (240..=360).contains(&on_b),
            "b took {on_b} of 600 retries and c {on_c}: not an even spread"
        );
    }

    #[tokio::test]
    async fn the_header_works_without_the_extension() {
        let log = Log::default();
        let lb = PreferUntried::new([
            ("a".to_owned(), endpoint("a", log.clone(), false)),
            ("b".to_owned(), endpoint("b", log.clone(), false)),
        ])
        .unwrap();
        for _ in 0..4 {
            let mut r = Request::new(Body::empty());
            r.headers_mut()
                .insert(ALREADY_TRIED, HeaderValue::from_static("b, x"));
            let resp = lb.clone().oneshot(r).await.unwrap();
            assert_eq!(resp.headers()["x-instance-id"], "a");
        }
    }

    #[tokio::test]
    async fn the_pick_is_reported_even_when_the_endpoint_fails_without_answering() {
        let log = Log::default();
        let lb =
            PreferUntried::new([("down".to_owned(), endpoint("down", log.clone(), true))]).unwrap();
        let picked = PickedInstance::default();
        let mut r = req(&[]);
        r.extensions_mut().insert(picked.clone());
        let error = lb.clone().oneshot(r).await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "connection refused",
            "the error passes through"
        );
        assert_eq!(picked.get().unwrap(), "down");
        assert_eq!(log.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn readiness_reflects_the_endpoints() {
        let (a, mut handle_a) = mock::pair::<Request<Body>, Response<Body>>();
        let (b, mut handle_b) = mock::pair::<Request<Body>, Response<Body>>();
        handle_a.allow(0);
        handle_b.allow(0);
        let mut lb = PreferUntried::new([("a".to_owned(), a), ("b".to_owned(), b)]).unwrap();
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        assert!(
            lb.poll_ready(&mut cx).is_pending(),
            "no endpoint can take a request"
        );
        handle_b.allow(1);
        assert!(matches!(lb.poll_ready(&mut cx), Poll::Ready(Ok(()))));
        // The ready endpoint takes the request, mark or no mark.
        let call = tokio::spawn(lb.call(req(&[])));
        let (_, send) = handle_b.next_request().await.expect("b takes it");
        send.send_response(tonic::Status::new(Code::Ok, "").into_http());
        let response = call.await.unwrap().unwrap();
        assert_eq!(response.headers()["x-instance-id"], "b");

        // Under load_shed, an endpoint set that cannot take more sheds.
        let mut shed = tower::load_shed::LoadShed::new(lb.clone());
        let error = shed
            .ready()
            .await
            .unwrap()
            .call(req(&[]))
            .await
            .unwrap_err();
        assert!(error.is::<tower::load_shed::error::Overloaded>(), "{error}");
    }

    type Limited = tower::limit::ConcurrencyLimit<mock::Mock<Request<Body>, Response<Body>>>;
    type MockHandle = mock::Handle<Request<Body>, Response<Body>>;

    /// Two endpoints that take one request at a time, and a handle on each
    /// limit that shares it, to see what the balancer holds.
    fn limited() -> (PreferUntried<Limited>, [Limited; 2], [MockHandle; 2]) {
        let (a, handle_a) = mock::pair::<Request<Body>, Response<Body>>();
        let (b, handle_b) = mock::pair::<Request<Body>, Response<Body>>();
        let a = tower::limit::ConcurrencyLimit::new(a, 1);
        let b = tower::limit::ConcurrencyLimit::new(b, 1);
        let probes = [a.clone(), b.clone()];
        let lb = PreferUntried::new([("a".to_owned(), a), ("b".to_owned(), b)]).unwrap();
        (lb, probes, [handle_a, handle_b])
    }

    /// Which endpoint the next request arrives at, and its responder.
    async fn arrival(handles: &mut [MockHandle; 2]) -> (usize, mock::SendResponse<Response<Body>>) {
        let [a, b] = handles;
        tokio::select! {
            Some((_, send)) = a.next_request() => (0, send),
            Some((_, send)) = b.next_request() => (1, send),
        }
    }

    #[tokio::test]
    async fn a_call_holds_only_the_endpoint_it_uses() {
        let (mut lb, mut probes, mut handles) = limited();
        let mut clone = lb.clone();
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        assert!(matches!(lb.poll_ready(&mut cx), Poll::Ready(Ok(()))));
        let first = tokio::spawn(lb.call(req(&[])));
        let (used, send_first) = arrival(&mut handles).await;
        let free = 1 - used;

        // The endpoint the call did not use is free for anyone sharing it.
        assert!(
            matches!(probes[free].poll_ready(&mut cx), Poll::Ready(Ok(()))),
            "the balancer holds no permit of the endpoint it did not use"
        );
        drop(probes);
        // A clone of the balancer is ready, and its call goes there.
        assert!(matches!(clone.poll_ready(&mut cx), Poll::Ready(Ok(()))));
        let second = tokio::spawn(clone.call(req(&[])));
        let (got, send_second) = arrival(&mut handles).await;
        assert_eq!(got, free);
        send_second.send_response(tonic::Status::new(Code::Ok, "").into_http());
        send_first.send_response(tonic::Status::new(Code::Ok, "").into_http());
        let names = ["a", "b"];
        let second = second.await.unwrap().unwrap();
        assert_eq!(second.headers()["x-instance-id"], names[free]);
        let first = first.await.unwrap().unwrap();
        assert_eq!(first.headers()["x-instance-id"], names[used]);
        // Between calls the balancer holds nothing: the one in use, ready again
        // after its call, was given back too.
        assert!(matches!(lb.poll_ready(&mut cx), Poll::Ready(Ok(()))));
        let third = tokio::spawn(lb.call(req(&[])));
        let (_, send) = arrival(&mut handles).await;
        send.send_response(tonic::Status::new(Code::Ok, "").into_http());
        third.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_buffer_in_front_holds_no_endpoint_between_calls() {
        let (lb, mut probes, mut handles) = limited();
        let mut buffered = tower::buffer::Buffer::new(lb, 8);
        let call = tokio::spawn(buffered.ready().await.unwrap().call(req(&[])));
        let (used, send) = arrival(&mut handles).await;
        send.send_response(tonic::Status::new(Code::Ok, "").into_http());
        call.await.unwrap().unwrap();
        // The buffer's worker readied both endpoints for that call; it used
        // one and gave the other back, and the one used ended its call.
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        for (i, probe) in probes.iter_mut().enumerate() {
            assert!(
                matches!(probe.poll_ready(&mut cx), Poll::Ready(Ok(()))),
                "endpoint {i} (used: {used}) is free between calls"
            );
        }
    }

    #[tokio::test]
    async fn endpoints_that_fail_readiness_are_avoided() {
        let (a, mut handle_a) = mock::pair::<Request<Body>, Response<Body>>();
        let (b, mut handle_b) = mock::pair::<Request<Body>, Response<Body>>();
        handle_a.send_error("worker gone");
        let mut lb = PreferUntried::new([("a".to_owned(), a), ("b".to_owned(), b)]).unwrap();
        let call = tokio::spawn(async move { lb.ready().await.unwrap().call(req(&[])).await });
        let (_, send) = handle_b.next_request().await.expect("b takes it");
        send.send_response(tonic::Status::new(Code::Ok, "").into_http());
        assert_eq!(call.await.unwrap().unwrap().headers()["x-instance-id"], "b");

        let (c, mut handle_c) = mock::pair::<Request<Body>, Response<Body>>();
        handle_c.send_error("worker gone");
        let mut lb = PreferUntried::new([("c".to_owned(), c)]).unwrap();
        let error = lb.ready().await.map(|_| ()).unwrap_err();
        assert_eq!(
            error.to_string(),
            "worker gone",
            "all failed: the error is returned"
        );
    }

    #[test]
    fn bad_endpoint_lists_are_errors() {
        type Boxed = tower::util::BoxCloneService<Request<Body>, Response<Body>, tower::BoxError>;
        let none: Vec<(String, Boxed)> = Vec::new();
        assert_eq!(PreferUntried::new(none).unwrap_err().field(), "endpoints");
        let log = Log::default();
        for bad in [
            "a,b",
            "",
            " ",
            "x y",
            &"z".repeat(crate::marks::MAX_INSTANCE_ID_LEN + 1),
        ] {
            let e = PreferUntried::new([(bad.to_owned(), endpoint("a", log.clone(), false))])
                .unwrap_err();
            assert_eq!(e.field(), "endpoints", "{bad:?}");
        }
        let e = PreferUntried::new([
            ("a".to_owned(), endpoint("a", log.clone(), false)),
            ("a".to_owned(), endpoint("a", log.clone(), false)),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        // More endpoints than an already-tried mark names: a repeat is still found.
        let many = (0..=crate::marks::MAX_TRIED_INSTANCES)
            .map(|i| format!("e{i}"))
            .chain(["e8".to_owned()])
            .map(|id| (id, endpoint("a", log.clone(), false)));
        let e = PreferUntried::new(many).unwrap_err();
        assert!(e.to_string().contains("\"e8\" is named twice"), "{e}");
    }
}
