//! The balancer side of the already-tried mark: route a retry away from the
//! instances that failed the call's earlier attempts.
//!
//! [`RetryLayer`](crate::RetryLayer) learns which instance answered each failed
//! attempt from the `x-instance-id` response header and names those instances
//! on the next attempt, in the [`AlreadyTried`] request extension and the
//! [`x-already-tried`](crate::ALREADY_TRIED) header. [`PreferUntried`] is a
//! balancer that closes that loop in process: it routes round-robin among named
//! endpoints, skips the ones the request names while any other is left, and
//! stamps the chosen endpoint's id on the response so the layer above can
//! learn it.
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

use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use tonic::Code;
use tower::ServiceExt;
use tower::util::Oneshot;
use tower_service::Service;

use crate::attempt::status_response;
use crate::error::ConfigError;
use crate::marks::{ALREADY_TRIED, AlreadyTried, INSTANCE_ID};

struct Endpoint<S> {
    id: String,
    header: HeaderValue,
    service: S,
}

/// Routes each request to one of several endpoints, round-robin, avoiding the
/// ones its [`AlreadyTried`] mark names; see the [module docs](self).
///
/// An endpoint that fails without answering (connection refused, reset) is
/// reported as an `UNAVAILABLE` status naming it in `x-instance-id`, so the
/// retry layer above retries elsewhere.
pub struct PreferUntried<S> {
    endpoints: Arc<[Endpoint<S>]>,
    next: Arc<AtomicUsize>,
}

impl<S> PreferUntried<S> {
    /// A balancer over `(instance id, service)` pairs.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] if there are no endpoints, or an id is not a valid
    /// header value or contains a comma.
    pub fn new(endpoints: impl IntoIterator<Item = (String, S)>) -> Result<Self, ConfigError> {
        let endpoints = endpoints
            .into_iter()
            .map(|(id, service)| {
                let header = HeaderValue::from_str(&id)
                    .ok()
                    .filter(|_| !id.contains(',') && !id.trim().is_empty())
                    .ok_or_else(|| {
                        ConfigError::new(
                            "endpoints",
                            format!("instance id {id:?} must be visible ASCII without commas"),
                        )
                    })?;
                Ok(Endpoint {
                    id: id.trim().to_owned(),
                    header,
                    service,
                })
            })
            .collect::<Result<Arc<[_]>, ConfigError>>()?;
        if endpoints.is_empty() {
            return Err(ConfigError::new(
                "endpoints",
                "at least one endpoint is needed",
            ));
        }
        Ok(Self {
            endpoints,
            next: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// The endpoint ids, in order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.endpoints.iter().map(|e| e.id.as_str())
    }

    fn pick<B>(&self, req: &Request<B>) -> &Endpoint<S> {
        let n = self.endpoints.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let header = req
            .headers()
            .get(ALREADY_TRIED)
            .and_then(|v| v.to_str().ok());
        let tried = |id: &str| match req.extensions().get::<AlreadyTried>() {
            Some(tried) => tried.contains(id),
            None => header.is_some_and(|h| h.split(',').any(|t| t.trim() == id)),
        };
        let index = (0..n)
            .map(|i| (start + i) % n)
            .find(|&i| !tried(&self.endpoints[i].id))
            // Every endpoint failed already: round-robin among them all.
            .unwrap_or(start);
        &self.endpoints[index]
    }
}

impl<S> Clone for PreferUntried<S> {
    fn clone(&self) -> Self {
        Self {
            endpoints: Arc::clone(&self.endpoints),
            next: Arc::clone(&self.next),
        }
    }
}

impl<S> fmt::Debug for PreferUntried<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreferUntried")
            .field("endpoints", &self.ids().collect::<Vec<_>>())
            .finish()
    }
}

impl<S, B, RB> Service<Request<B>> for PreferUntried<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    S::Error: fmt::Display,
    RB: Default,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // NOTE: which endpoint serves a request depends on the request, so
        // readiness is awaited per call, on a clone of the chosen endpoint.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let endpoint = self.pick(&req);
        ResponseFuture {
            inner: endpoint.service.clone().oneshot(req),
            instance: endpoint.header.clone(),
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
    S::Error: fmt::Display,
    RB: Default,
{
    type Output = Result<Response<RB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut response = match ready!(this.inner.poll(cx)) {
            Ok(response) => response,
            Err(error) => {
                tracing::debug!(instance = ?this.instance, %error, "endpoint failed without answering");
                status_response(
                    Code::Unavailable,
                    format!(
                        "instance {} failed: {error}",
                        this.instance.to_str().unwrap_or("?")
                    ),
                )
            }
        };
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
    use tonic::body::Body;

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
                mark.record(&HeaderValue::from_str(t).unwrap());
            }
            req.extensions_mut().insert(mark);
        }
        req
    }

    #[tokio::test]
    async fn round_robin_then_skips_the_tried() {
        let log = Log::default();
        let lb = PreferUntried::new([
            ("a".to_owned(), endpoint("a", log.clone(), false)),
            ("b".to_owned(), endpoint("b", log.clone(), false)),
            ("c".to_owned(), endpoint("c", log.clone(), false)),
        ])
        .unwrap();
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
    async fn all_tried_still_routes_and_errors_become_unavailable_naming_the_instance() {
        let log = Log::default();
        let lb =
            PreferUntried::new([("down".to_owned(), endpoint("down", log.clone(), true))]).unwrap();
        let r = lb.clone().oneshot(req(&["down"])).await.unwrap();
        assert_eq!(r.headers()["grpc-status"], "14");
        assert_eq!(r.headers()["x-instance-id"], "down");
        assert_eq!(log.lock().unwrap().len(), 1);
    }

    #[test]
    fn bad_endpoint_lists_are_errors() {
        type Boxed = tower::util::BoxCloneService<Request<Body>, Response<Body>, tower::BoxError>;
        let none: Vec<(String, Boxed)> = Vec::new();
        assert_eq!(PreferUntried::new(none).unwrap_err().field(), "endpoints");
        let log = Log::default();
        let e = PreferUntried::new([("a,b".to_owned(), endpoint("a", log, false))]).unwrap_err();
        assert_eq!(e.field(), "endpoints");
    }
}
