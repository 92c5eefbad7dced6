//! One call's retry loop: the per-call [`Policy`] that `tower::retry::Retry`
//! drives, and the service that sends each attempt.

use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use std::any::Any;

use http::{HeaderValue, Request, Response};
use tokio::time::Instant;
use tonic::Code;
use tower::retry::Policy;
use tower::retry::budget::Budget;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::budget::RetryBudget;
use crate::classify::{
    Verdict, classify_error, classify_response, code_name, repair_status_details,
};
use crate::deadline::{GRPC_TIMEOUT, format_grpc_timeout};
use crate::future::{AttemptFuture, Backoff};
use crate::marks::{ALREADY_TRIED, AlreadyTried, IDEMPOTENCY_KEY, PREVIOUS_ATTEMPTS};
use crate::metrics::Event;
use crate::replay::ReplayBody;
use crate::service::Shared;

/// A gRPC Trailers-Only response carrying a status the layer decided itself.
pub(crate) fn status_response<B: Default>(code: Code, message: String) -> Response<B> {
    tonic::Status::new(code, message).into_http()
}

/// Sends one attempt: the inner service, with `grpc-timeout` rewritten to the
/// time left and the attempt cut when that time is up.
#[derive(Debug)]
pub(crate) struct Attempt<S, B> {
    inner: S,
    deadline: Option<Instant>,
    attempt_timeout: Option<Duration>,
    _body: PhantomData<fn(B)>,
}

impl<S, B> Attempt<S, B> {
    pub(crate) fn new(
        inner: S,
        deadline: Option<Instant>,
        attempt_timeout: Option<Duration>,
    ) -> Self {
        Self {
            inner,
            deadline,
            attempt_timeout,
            _body: PhantomData,
        }
    }
}

// Not derived: that would ask for `B: Clone`, which the marker does not need.
impl<S: Clone, B> Clone for Attempt<S, B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            deadline: self.deadline,
            attempt_timeout: self.attempt_timeout,
            _body: PhantomData,
        }
    }
}

/// Why an attempt was cut short.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Cut {
    /// The call's deadline came.
    Deadline,
    /// The per-attempt timeout came first.
    AttemptTimeout(Duration),
}

impl Cut {
    pub(crate) fn message(self) -> String {
        match self {
            Cut::Deadline => "call deadline exceeded".to_owned(),
            Cut::AttemptTimeout(t) => format!("attempt timed out after {t:?}"),
        }
    }
}

impl<S, B, RB> Service<Request<ReplayBody<B>>> for Attempt<S, B>
where
    S: Service<Request<B>, Response = Response<RB>>,
    B: From<ReplayBody<B>>,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = S::Error;
    type Future = AttemptFuture<S::Future, RB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReplayBody<B>>) -> Self::Future {
        // The clock is read only when there is a limit to enforce.
        let now = (self.deadline.is_some() || self.attempt_timeout.is_some()).then(Instant::now);
        let by_deadline = self.deadline.map(|d| (d, Cut::Deadline));
        let by_attempt = self
            .attempt_timeout
            .zip(now)
            .and_then(|(t, now)| Some((now.checked_add(t)?, Cut::AttemptTimeout(t))));
        let cut = match (by_deadline, by_attempt) {
            (Some(d), Some(a)) => Some(if a.0 < d.0 { a } else { d }),
            (d, a) => d.or(a),
        };
        if let (Some((at, why)), Some(now)) = (cut, now) {
            let left = at.saturating_duration_since(now);
            if left.is_zero() {
                // Nothing left to send with: answer now, without a request.
                return AttemptFuture::cut(why);
            }
            req.headers_mut()
                .insert(GRPC_TIMEOUT, format_grpc_timeout(left));
        }
        let future = self.inner.call(req.map(B::from));
        AttemptFuture::new(future, cut)
    }
}

/// One call's policy, cloned by `Retry` into the call's future: what every
/// call shares, and this call's own state.
pub(crate) struct CallPolicy<Bu> {
    shared: Arc<Shared<Bu>>,
    state: CallState,
}

#[derive(Clone, Debug)]
struct CallState {
    deadline: Option<Instant>,
    /// Attempts sent so far.
    sent: u32,
    /// Retries since the last server-given delay (A6: a pushback restarts the
    /// exponential backoff).
    backoff_step: u32,
    tried: AlreadyTried,
}

// Not derived: the budget itself need not be `Clone`, it is shared.
impl<Bu> Clone for CallPolicy<Bu> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            state: self.state.clone(),
        }
    }
}

impl<Bu> CallPolicy<Bu> {
    pub(crate) fn new(shared: Arc<Shared<Bu>>, deadline: Option<Instant>) -> Self {
        Self {
            shared,
            state: CallState {
                deadline,
                sent: 1,
                backoff_step: 0,
                tried: AlreadyTried::default(),
            },
        }
    }
}

impl CallState {
    /// Time left before the deadline, if the call has one. The clock is read
    /// only then.
    fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Last touches on what the caller gets.
    fn finish<RB, E>(
        &self,
        result: &mut Result<Response<ResponseBody<RB>>, E>,
        remaining: Option<Duration>,
    ) {
        match result {
            Ok(response) => {
                repair_status_details(response.headers_mut());
            }
            // tonic reports its own `grpc-timeout` expiry as a transport error
            // that its client turns into CANCELLED; the caller's deadline is
            // what ran out, so say so.
            Err(_) if remaining.is_some_and(|left| left.is_zero()) => {
                *result = Ok(status_response(
                    Code::DeadlineExceeded,
                    format!("call deadline exceeded during attempt {}", self.sent),
                ));
            }
            Err(_) => {}
        }
    }
}

/// What to do after one attempt.
#[derive(Clone, Copy, Debug)]
enum Decision {
    /// Hand the outcome to the caller as it is.
    Done(&'static str),
    /// Retryable, but the deadline has no room for `delay` and another attempt.
    NoTime { left: Duration, delay: Duration },
    /// Retryable, but the budget has no token.
    NoBudget { delay: Duration },
    /// Send another attempt after `delay`.
    Retry { delay: Duration },
}

impl Decision {
    fn describe(self) -> &'static str {
        match self {
            Decision::Done(why) => why,
            Decision::NoTime { .. } => "no time left for another attempt",
            Decision::NoBudget { .. } => "retry budget exhausted",
            Decision::Retry { .. } => "retrying",
        }
    }

    fn delay(self) -> Option<Duration> {
        match self {
            Decision::Done(_) => None,
            Decision::NoTime { delay, .. }
            | Decision::NoBudget { delay }
            | Decision::Retry { delay } => Some(delay),
        }
    }
}

impl CallState {
    /// Classify, then deadline, then budget: a token pays only for an attempt
    /// that will really be sent.
    fn decide<Bu: Budget>(
        &mut self,
        shared: &Shared<Bu>,
        verdict: Verdict,
        instance: Option<&HeaderValue>,
        replayable: bool,
        remaining: Option<Duration>,
    ) -> Decision {
        let Shared { policy, budget, .. } = shared;
        let server_delay = match verdict {
            Verdict::Committed | Verdict::Final(Code::Ok) => {
                Budget::deposit(budget);
                return Decision::Done("succeeded");
            }
            Verdict::Final(_) => return Decision::Done("not retryable"),
            Verdict::Retryable { server_delay, .. } => server_delay,
        };
        if let Some(id) = instance {
            self.tried.record(id);
        }
        if self.sent >= policy.max_attempts {
            return Decision::Done("no attempts left");
        }
        if !replayable {
            return Decision::Done("request body cannot be replayed");
        }
        let delay = match server_delay {
            Some(delay) => {
                self.backoff_step = 0;
                delay
            }
            None => {
                self.backoff_step += 1;
                policy.delay_before(self.backoff_step)
            }
        };
        if let Some(left) = remaining
            && left <= delay.saturating_add(policy.min_attempt_budget)
        {
            return Decision::NoTime { left, delay };
        }
        if !budget.withdraw() {
            return Decision::NoBudget { delay };
        }
        Decision::Retry { delay }
    }
}

/// `grpc-previous-rpc-attempts` for attempt `sent + 1`; attempts are capped at
/// five, so the common values need no allocation.
fn previous_attempts(sent: u32) -> HeaderValue {
    match sent {
        1 => HeaderValue::from_static("1"),
        2 => HeaderValue::from_static("2"),
        3 => HeaderValue::from_static("3"),
        4 => HeaderValue::from_static("4"),
        n => HeaderValue::from(n),
    }
}

/// The balance to show in events: known for a [`RetryBudget`] only.
fn tokens<Bu: 'static>(budget: &Bu) -> f64 {
    (budget as &dyn Any)
        .downcast_ref::<RetryBudget>()
        .map_or(f64::NAN, RetryBudget::available)
}

impl<B, RB, E, Bu> Policy<Request<ReplayBody<B>>, Response<ResponseBody<RB>>, E> for CallPolicy<Bu>
where
    Bu: Budget + 'static,
{
    type Future = Backoff;

    fn retry(
        &mut self,
        req: &mut Request<ReplayBody<B>>,
        result: &mut Result<Response<ResponseBody<RB>>, E>,
    ) -> Option<Backoff> {
        let shared = &*self.shared;
        let state = &mut self.state;
        let Shared {
            policy,
            budget,
            metrics,
        } = shared;
        metrics.record(Event::Attempt);
        let remaining = state.remaining();
        // Borrowed, not cloned: most responses are successes, and the id is
        // only kept (in the tried set) when the attempt failed.
        let (verdict, instance) = match &*result {
            Ok(response) => (
                classify_response(response.status(), response.headers(), policy.retryable),
                policy
                    .instance_header
                    .as_ref()
                    .and_then(|h| response.headers().get(h)),
            ),
            Err(_) => (classify_error(policy.retryable), None),
        };
        let decision = state.decide(
            shared,
            verdict,
            instance,
            req.body().is_replayable(),
            remaining,
        );
        let attempt = state.sent;
        let name = code_name(verdict.code());
        tracing::debug!(
            attempt,
            code = name,
            instance = instance.and_then(|v| v.to_str().ok()).unwrap_or("-"),
            key = req
                .headers()
                .get(IDEMPOTENCY_KEY)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-"),
            delay = ?decision.delay(),
            remaining = ?remaining,
            tokens = tokens(budget),
            "{}",
            decision.describe()
        );

        match decision {
            Decision::Done(_) => {
                state.finish(result, remaining);
                None
            }
            Decision::NoTime { left, .. } => {
                metrics.record(Event::RefusedByDeadline);
                let message = if left.is_zero() {
                    format!("call deadline exceeded; attempt {attempt} ended with {name}")
                } else {
                    format!(
                        "no time left for another attempt: {left:?} left, attempt {attempt} ended with {name}"
                    )
                };
                *result = Ok(status_response(Code::DeadlineExceeded, message));
                None
            }
            Decision::NoBudget { .. } => {
                metrics.record(Event::RefusedByBudget);
                *result = Ok(status_response(
                    Code::ResourceExhausted,
                    format!("retry budget exhausted; attempt {attempt} ended with {name}"),
                ));
                None
            }
            Decision::Retry { delay } => {
                metrics.record(Event::Retry);
                let headers = req.headers_mut();
                headers.insert(PREVIOUS_ATTEMPTS, previous_attempts(state.sent));
                if !state.tried.is_empty() {
                    if let Some(value) = state.tried.to_header() {
                        headers.insert(ALREADY_TRIED, value);
                    }
                    req.extensions_mut().insert(state.tried.clone());
                }
                state.sent += 1;
                Some(Backoff::new(delay))
            }
        }
    }

    fn clone_request(&mut self, req: &Request<ReplayBody<B>>) -> Option<Request<ReplayBody<B>>> {
        // Always a clone, even of a body that can no longer be replayed: `Retry`
        // only shows `retry` the outcomes of requests it holds a clone of, and
        // every outcome must pass `retry` for the budget and the final touches.
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        *clone.extensions_mut() = req.extensions().clone();
        Some(clone)
    }
}

impl<Bu> std::fmt::Debug for CallPolicy<Bu> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallPolicy")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}
