use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tower::BoxError;
use tower::retry::Retry;
use tower::retry::budget::Budget;
use tower_service::Service;

use crate::attempt::{Attempt, CallPolicy};
use crate::body::ResponseBody;
use crate::budget::RetryBudget;
use crate::deadline::{GRPC_TIMEOUT, parse_grpc_timeout};
use crate::future::ResponseFuture;
use crate::marks::{IDEMPOTENCY_KEY, new_idempotency_key};
use crate::metrics::RetryMetrics;
use crate::policy::RetryPolicy;
use crate::replay::ReplayBody;

/// What every call through one layer shares.
pub(crate) struct Shared<Bu> {
    pub(crate) policy: RetryPolicy,
    pub(crate) budget: Bu,
    pub(crate) metrics: RetryMetrics,
}

impl<Bu> Shared<Bu> {
    pub(crate) fn new(policy: RetryPolicy, budget: Bu) -> Arc<Self> {
        Arc::new(Self {
            policy,
            budget,
            metrics: RetryMetrics::default(),
        })
    }
}

/// Retries gRPC calls to the inner service; see the [crate docs](crate).
///
/// Made by [`RetryLayer`](crate::RetryLayer). The inner service's error type is
/// kept, so a tonic generated client accepts the wrapped service as it accepted
/// the inner one.
///
/// # Bounds
///
/// The inner service must be `Clone` (each attempt is sent through a clone, as
/// with `tower::retry::Retry`). The request body `B` must yield `Bytes`, be
/// `Unpin`, and be buildable from a [`ReplayBody<B>`](crate::ReplayBody) — the
/// wrapper that keeps a copy for replay. That holds for `tonic::body::Body` (what
/// tonic's `Channel` and generated clients use) and for http-body-util's
/// `BoxBody` / `UnsyncBoxBody` with `BoxError` errors; for a body type of your
/// own, implement `From<ReplayBody<YourBody>>`.
///
/// The response body is wrapped in [`ResponseBody`](crate::ResponseBody), which
/// passes frames through, so that the layer can answer with statuses of its own.
pub struct RetryService<S, Bu = RetryBudget> {
    inner: S,
    shared: Arc<Shared<Bu>>,
}

impl<S> RetryService<S> {
    /// Wraps `inner`, retrying by `policy` and paying from `budget`.
    pub fn new(inner: S, policy: RetryPolicy, budget: RetryBudget) -> Self {
        Self::with_budget(inner, policy, budget)
    }
}

impl<S, Bu> RetryService<S, Bu> {
    /// Wraps `inner`, paying for retries from any `tower` retry budget.
    pub fn with_budget(inner: S, policy: RetryPolicy, budget: Bu) -> Self {
        Self::from_shared(inner, Shared::new(policy, budget))
    }

    pub(crate) fn from_shared(inner: S, shared: Arc<Shared<Bu>>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The budget retries are paid from.
    pub fn budget(&self) -> &Bu {
        &self.shared.budget
    }

    /// What this service (and every other made by the same layer) has done.
    pub fn metrics(&self) -> &RetryMetrics {
        &self.shared.metrics
    }
}

impl<S: Clone, Bu> Clone for RetryService<S, Bu> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, B, RB, Bu> Service<Request<B>> for RetryService<S, Bu>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: Body<Data = Bytes> + From<ReplayBody<B>> + Unpin,
    B::Error: Into<BoxError>,
    Bu: Budget + 'static,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B, RB, Bu>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let policy = &self.shared.policy;
        let (mut parts, body) = req.into_parts();

        // One deadline for the whole call, on tokio's clock so tests can pause it.
        let timeout = match parts.headers.get(GRPC_TIMEOUT) {
            Some(value) => parse_grpc_timeout(value).or(policy.total_timeout),
            None => policy.total_timeout,
        };
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));

        if policy.idempotency_key {
            // A key the caller set is kept; one lookup either way.
            parts
                .headers
                .entry(IDEMPOTENCY_KEY)
                .or_insert_with(new_idempotency_key);
        }
        let req = Request::from_parts(parts, ReplayBody::new(body, policy.replay_limit));

        // NOTE: `poll_ready` readied `self.inner`; that instance must make the
        // first attempt, so it goes to the call and a fresh clone stays here.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let attempt = Attempt::new(inner, deadline, policy.attempt_timeout);
        let call = CallPolicy::new(Arc::clone(&self.shared), deadline);
        ResponseFuture::new(Retry::new(call, attempt).call(req))
    }
}

impl<S: fmt::Debug, Bu: fmt::Debug> fmt::Debug for RetryService<S, Bu> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryService")
            .field("inner", &self.inner)
            .field("policy", &self.shared.policy)
            .field("budget", &self.shared.budget)
            .finish()
    }
}
