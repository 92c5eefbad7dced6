use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::budget::Budget;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tower::BoxError;
use tower_service::Service;

use crate::attempt::{Attempt, Limits};
use crate::body::ResponseBody;
use crate::budget::RetryBudget;
use crate::call::CallRetry;
use crate::deadline::{GRPC_TIMEOUT, parse_grpc_timeout};
use crate::drain::{self, Drainer};
use crate::first::{FirstTimeout, Said};
use crate::future::ResponseFuture;
use crate::marks::{
    ALREADY_TRIED, ATTEMPT_TIMEOUT, AlreadyTried, IDEMPOTENCY_KEY, PREVIOUS_ATTEMPTS,
    new_idempotency_key,
};
use crate::methods::{CallPolicy, MethodPolicies};
use crate::metrics::RetryMetrics;
use crate::replay::{Account, ReplayBody};
use crate::shared::{Local, Shared};
use crate::trace::{CallEnd, Metrics, NoMetrics};

/// Retries gRPC calls to the inner service; see the [crate docs](crate).
///
/// Made by [`RetryLayer`](crate::RetryLayer). The inner service's error type is
/// kept, so a tonic generated client accepts the wrapped service as it accepted
/// the inner one.
///
/// # Bounds
///
/// The inner service must be `Clone`: a call's first attempt goes through the
/// instance the caller readied, and each retry or hedge through a clone of it,
/// as with `tower::retry::Retry`. The request body `B` must yield `Bytes`, be
/// `Unpin`, and be buildable from a [`ReplayBody<B>`](crate::replay::ReplayBody) — the
/// wrapper that keeps a copy for replay. That holds for `tonic::body::Body` (what
/// tonic's `Channel` and generated clients use) and for http-body-util's
/// `BoxBody` / `UnsyncBoxBody` with `BoxError` errors; for a body type of your
/// own, implement `From<ReplayBody<YourBody>>`.
///
/// The response body is wrapped in [`ResponseBody`](crate::ResponseBody), which
/// passes frames through, so that the layer can answer with statuses of its own
/// and end a response still streaming at the call's deadline.
///
/// The inner service's errors must convert into `BoxError` (tonic's own do):
/// the layer reads them — a timer below it, a status inside — and a call whose
/// last attempt got no response reaches the caller as an `UNAVAILABLE` status
/// naming the error, as gRPC reports transport failures.
///
/// The inner service's futures and response bodies must be `Send + 'static`
/// (a `Channel`'s, and those of tower's own services over it, are): an
/// attempt the call no longer needs — a hedge that lost, an attempt cut by
/// its timeout — is read to its end on a task of its own rather than reset,
/// so that its server's answer never crosses a reset stream (see
/// [`RetryMetrics::drained`](crate::metrics::RetryMetrics::drained)).
///
/// `B` is the request body type: tonic's [`Body`](tonic::body::Body) unless
/// the layer was made for another ([`RetryLayer::for_body`](crate::RetryLayer::for_body)).
///
/// # Spawning calls
///
/// A call through the service can be `tokio::spawn`ed whatever the inner
/// service's error type — a `BoxError` named in its own type included, as
/// with a `tower::util::BoxCloneService<_, _, BoxError>` or a `service_fn`
/// closure returning `BoxError`:
///
/// ```
/// use tonic::body::Body;
/// use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
/// use tower::{BoxError, Layer, ServiceExt};
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), BoxError> {
/// let inner = tower::service_fn(|_req: http::Request<Body>| {
///     std::future::ready(Ok::<_, BoxError>(tonic::Status::ok("").into_http::<Body>()))
/// });
/// let svc = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(10, 0.1)?).layer(inner);
/// let call = tokio::spawn(async move { svc.oneshot(http::Request::new(Body::empty())).await });
/// assert_eq!(call.await??.headers()["grpc-status"], "0");
/// # Ok(())
/// # }
/// ```
///
/// That is why the conversion of the inner service's error is proven where
/// the service is made (by the layer or a constructor) and kept as a function,
/// rather than asked of every impl: the compiler proves an impl's bounds again,
/// with every lifetime erased, wherever its future is held across an await,
/// and `Box<dyn Error + '_>: Into<BoxError>` does not hold for every lifetime.
// NOTE: the one bound here is what names `S::Error` in `into_box`; it holds
// for every service of requests with a body of `B`, whatever its error type.
pub struct RetryService<S, Bu = RetryBudget, B = tonic::body::Body, M = NoMetrics>
where
    S: Service<Request<B>>,
{
    inner: S,
    /// Whether `inner` said it was ready and no call has used it since.
    ready: bool,
    shared: Arc<Local<Bu, M>>,
    into_box: fn(S::Error) -> BoxError,
    drain: Drainer<S::Future>,
}

impl<S, RB> RetryService<S>
where
    S: Service<Request<tonic::body::Body>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: Body + Send + 'static,
{
    /// Wraps `inner`, retrying by `policy` (one [`RetryPolicy`](crate::RetryPolicy),
    /// or [`MethodPolicies`]) and paying from `budget`.
    pub fn new(inner: S, policy: impl Into<MethodPolicies>, budget: RetryBudget) -> Self {
        Self::with_budget(inner, policy, budget)
    }
}

impl<S, Bu, B, RB> RetryService<S, Bu, B>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: Body + Send + 'static,
{
    /// Wraps `inner`, paying for retries from any [`Budget`] (every call
    /// shares it; see [`RetryLayer::with_budget`](crate::RetryLayer::with_budget)). The request body type `B` is
    /// the one `inner` takes.
    pub fn with_budget(inner: S, policy: impl Into<MethodPolicies>, budget: Bu) -> Self
    where
        Bu: Budget,
    {
        Self::from_shared(inner, Shared::new(policy.into(), budget), NoMetrics)
    }
}

impl<S, Bu, B, RB, M> RetryService<S, Bu, B, M>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: Body + Send + 'static,
    M: Metrics,
{
    pub(crate) fn from_shared(inner: S, shared: Arc<Shared<Bu>>, recorder: M) -> Self {
        Self {
            inner,
            ready: false,
            shared: Local::new(&shared, recorder),
            into_box: Into::into,
            drain: drain::spawn,
        }
    }
}

impl<S, Bu, B, M> RetryService<S, Bu, B, M>
where
    S: Service<Request<B>>,
{
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

impl<S, Bu, B, M> Clone for RetryService<S, Bu, B, M>
where
    S: Service<Request<B>> + Clone,
    M: Metrics,
{
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            ready: false,
            shared: self.shared.fork(),
            into_box: self.into_box,
            drain: self.drain,
        }
    }
}

// NOTE: no bound on `S::Error` here, nor on any impl a call's future needs:
// see "Spawning calls" above.
impl<S, B, RB, Bu, M> Service<Request<B>> for RetryService<S, Bu, B, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: Body<Data = Bytes> + From<ReplayBody<B>> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
    Bu: Budget,
    M: Metrics,
{
    type Response = Response<ResponseBody<RB, M>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, Bu, B, RB, M>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // NOTE: a call's deadline is only known from its request, so a caller
        // is never held here: an inner service that is not ready yet is waited
        // for inside the call, under the call's deadline and the per-attempt
        // timeout. Polling it here still lets a ready one take the first
        // attempt at once, and reports a failed one.
        if !self.ready {
            match self.inner.poll_ready(cx) {
                Poll::Ready(Ok(())) => self.ready = true,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => {}
            }
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        // The method's policy, unless the caller chose one for this call.
        let own = parts.extensions.get::<CallPolicy>();
        let chosen = self.shared.policies.choose(parts.uri.path(), own);
        let policy = self.shared.policies.get(&chosen);
        let trace = self.shared.trace(parts.uri.path());

        // One pass over the caller's headers finds what the layer reads or
        // owns: custom header names are hashed byte by byte, so a lookup
        // each would cost more than the scan.
        let mut timeout = None;
        let mut timeouts = 0usize;
        let mut key = None;
        let mut previous_attempts = false;
        let mut already_tried = false;
        let mut callers_end = false;
        for (name, value) in &parts.headers {
            if name == GRPC_TIMEOUT {
                timeout = timeout.or(Some(value));
                timeouts += 1;
            } else if name == IDEMPOTENCY_KEY {
                key = key.or(Some(value.is_empty()));
            } else if name == PREVIOUS_ATTEMPTS {
                previous_attempts = true;
            } else if name == ALREADY_TRIED {
                already_tried = true;
            } else if name == ATTEMPT_TIMEOUT {
                callers_end = true;
            }
        }

        // One deadline for the whole call, on tokio's clock so tests can pause it.
        let timeout = match timeout.and_then(|value| parse_grpc_timeout(value.as_bytes())) {
            Some(callers) => Some((callers, Said::Callers)),
            None => policy
                .total_timeout
                .as_ref()
                .map(|t| (t.duration, Said::Total)),
        };
        // A per-method limit caps the caller's deadline, as gRPC's service
        // config `timeout` does.
        let max = policy
            .max_timeout
            .as_ref()
            .map(|max| (max.duration, Said::Max));
        let timeout = match (timeout, max) {
            (Some(t), Some(max)) if max.0 < t.0 => Some(max),
            (t, max) => t.or(max),
        };
        let started = timeout.map(|_| Instant::now());
        let deadline = timeout
            .zip(started)
            .and_then(|((t, _), now)| now.checked_add(t));
        // What the first attempt may say its time is, if it is sent at once:
        // the caller's own header, when it alone set the deadline; the
        // policy's timeout, when that did. (Not the first of a caller's
        // several headers: the time left is written over them.)
        let first_timeout = timeout
            .zip(started)
            .filter(|&((_, said), _)| {
                deadline.is_some() && (said != Said::Callers || timeouts == 1)
            })
            .map(|((timeout, said), started)| FirstTimeout {
                started,
                timeout,
                said,
            });
        let timeout = timeout.map(|(timeout, _)| timeout);
        // When the caller stops waiting, if a layer above said so: the
        // call's retries fit before it, and its attempts say it on.
        let caller_waits = if callers_end {
            caller_waits(&mut parts.headers, started, deadline)
        } else {
            None
        };

        // A key the caller set is kept on every attempt; an empty one is no
        // key (unrelated calls would share one dedup slot) and is replaced.
        let generate = match key {
            Some(empty) => empty,
            None => policy.idempotency_key,
        };
        if generate {
            parts.headers.insert(IDEMPOTENCY_KEY, new_idempotency_key());
        }
        if previous_attempts {
            // A6: the first attempt carries no attempt count, whatever the caller set.
            parts.headers.remove(PREVIOUS_ATTEMPTS);
        }
        let tried = callers_mark(&mut parts, already_tried, policy.callers_mark_trusted);

        // NOTE: a method that is never retried keeps a copy too: a stream
        // the server refuses is sent again whatever the policy (gRPC's
        // transparent retry). The copy goes as soon as the answer starts.
        let memory = Some(Arc::clone(&self.shared) as Arc<dyn Account>);
        let body = if policy.hedge.is_some() {
            ReplayBody::hedged(body, policy.replay_limit, memory)
        } else if self.ready
            && timeout != Some(Duration::ZERO)
            && policy.attempt_timeout != Some(Duration::ZERO)
        {
            // The first attempt is sent now (its service is ready, and
            // no limit cuts it before it goes): what its body has ready
            // is read, and counted in the layer's memory, from now on.
            ReplayBody::at_once(body, policy.replay_limit, memory)
        } else {
            // It waits for the service first: its body is read, and
            // counted, only once it is sent.
            ReplayBody::sharing(body, policy.replay_limit, memory)
        };

        // NOTE: the first attempt goes through the instance `poll_ready`
        // polled (ready, or on its way to it), which stays here, as a call
        // without the layer leaves it; the call keeps a clone of it, never
        // polled unless the call retries. (A `Channel`'s fresh clone, kept
        // here, would allocate again at its first readiness.)
        let ready = std::mem::take(&mut self.ready);
        let limits = Limits {
            deadline,
            attempt_timeout: policy.attempt_timeout,
            caller_waits,
        };
        let attempt = Attempt::new(
            ready,
            (self.into_box, self.drain),
            Arc::clone(&self.shared),
            chosen.clone(),
            limits,
            trace.clone(),
        );
        // NOTE: a hedged call is one "attempt", which the call policy never
        // retries: the hedge driver runs inside it. So a retried call's
        // future stays as small and cheap as before.
        let hedged = policy.hedge.is_some();
        let call = CallRetry::new(Arc::clone(&self.shared), chosen, limits, tried, hedged);
        let cancel = attempt.cancel_on_drop();
        ResponseFuture::new(
            call,
            attempt,
            &mut self.inner,
            (parts, body),
            (first_timeout, timeouts > 0 && deadline.is_some()),
            CallEnd::new(trace),
            cancel,
        )
    }
}

/// When a caller whose layer said so in `x-attempt-timeout` (the first
/// value) stops waiting, counted from `now` if the call read the clock
/// already; `None` for a value not in `grpc-timeout`'s format, or not before
/// the `deadline`. The header goes: each attempt says its own.
// NOTE: out of line: inlined, it made `RetryService::call` large enough that
// the compiler stopped inlining the header map's insert of the key.
#[cold]
#[inline(never)]
fn caller_waits(
    headers: &mut HeaderMap,
    now: Option<Instant>,
    deadline: Option<Instant>,
) -> Option<Instant> {
    let left = headers
        .get(ATTEMPT_TIMEOUT)
        .and_then(|value| parse_grpc_timeout(value.as_bytes()));
    headers.remove(ATTEMPT_TIMEOUT);
    let waits = now.unwrap_or_else(Instant::now).checked_add(left?)?;
    deadline
        .is_none_or(|deadline| waits < deadline)
        .then_some(waits)
}

/// The already-tried mark the caller set (the extension, and the header
/// where it is `trusted`), merged and bounded; the first attempt carries it
/// both ways. A header not trusted is removed.
#[inline]
fn callers_mark(parts: &mut Parts, in_headers: bool, trusted: bool) -> AlreadyTried {
    if !in_headers && parts.extensions.get::<AlreadyTried>().is_none() {
        return AlreadyTried::default();
    }
    merged_mark(parts, trusted)
}

/// The mark the caller set, merged from the extension and, if `trusted`,
/// the header.
#[cold]
fn merged_mark(parts: &mut Parts, trusted: bool) -> AlreadyTried {
    let mut tried = AlreadyTried::default();
    if let Some(mark) = parts.extensions.get::<AlreadyTried>() {
        tried.merge(mark);
    }
    if trusted {
        for value in parts.headers.get_all(ALREADY_TRIED) {
            tried.merge_header(value);
        }
    }
    match tried.to_header().filter(|_| !tried.is_empty()) {
        Some(value) => {
            parts.headers.insert(ALREADY_TRIED, value);
            parts.extensions.insert(tried.clone());
        }
        None => {
            parts.headers.remove(ALREADY_TRIED);
            parts.extensions.remove::<AlreadyTried>();
        }
    }
    tried
}

impl<S, Bu, B, M> fmt::Debug for RetryService<S, Bu, B, M>
where
    S: Service<Request<B>> + fmt::Debug,
    Bu: fmt::Debug,
    M: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryService")
            .field("inner", &self.inner)
            .field("ready", &self.ready)
            .field("policies", &self.shared.policies)
            .field("budget", &self.shared.budget)
            .field("recorder", self.shared.recorder())
            .finish()
    }
}
