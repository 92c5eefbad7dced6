//! One attempt: the service a call's attempts are sent through (the first by
//! the call's response future, each retry by tower's `Retry`), and the future
//! that runs one attempt.
//!
//! This is where a call's limits meet the inner service:
//!
//! * For a retry, readiness is waited for *here*, under the attempt's timer.
//!   [`Attempt::poll_ready`] is always ready, because tower's `Retry` would
//!   otherwise wait for the inner service with no timer at all — and a
//!   saturated concurrency limit, a full buffer or a reconnecting channel
//!   would hold the call past its deadline.
//! * The retry's token is taken here, when the inner service is ready and the
//!   attempt is really sent: a call dropped during its backoff, a retry with no
//!   time left, or a readiness failure spends nothing.
//! * The three timers that can end an attempt — the layer's own cut, a tonic
//!   Channel enforcing `grpc-timeout` (a transport error tonic would report as
//!   CANCELLED), a tonic server whose received `grpc-timeout` expired (it
//!   answers CANCELLED) — read as one outcome: the attempt's time ran out.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::budget::Budget;
use http::{HeaderMap, Request, Response, request};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower::BoxError;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::classify::{is_timeout, status_in};
use crate::deadline::{GRPC_TIMEOUT, format_grpc_timeout, timer_at};
use crate::drain::{Drain, Drainer};
use crate::first::{FirstTimeout, say_first_timeout};
use crate::hedge::HedgeFuture;
use crate::marks::ATTEMPT_TIMEOUT_NAME;
use crate::marks::AlreadyTried;
use crate::methods::PolicyRef;
use crate::metrics::{Event, RetryMetrics};
use crate::replay::{Lingering, ReplayBody, ReplayError};
use crate::shared::Local;
use crate::status::{StatusHeaders, code_at_headers};
use crate::trace::{AttemptRecord, AttemptTrace, CallRecord, Metrics, NoMetrics, Trace};
use tokio_util::sync::{CancellationToken, DropGuard};

/// The time limits every attempt of one call runs under.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// The call's deadline.
    pub(crate) deadline: Option<Instant>,
    /// The per-attempt timeout.
    pub(crate) attempt_timeout: Option<Duration>,
    /// When the caller stops waiting for the call: the end of its own
    /// attempt, said by a retry layer above in `x-attempt-timeout`.
    pub(crate) caller_waits: Option<Instant>,
}

impl Limits {
    /// The end of the room the call's attempts and waits must fit in, and
    /// why: the sooner of the deadline and the caller's wait.
    pub(crate) fn room(&self) -> Option<(Instant, Cut)> {
        sooner(
            self.deadline.map(|d| (d, Cut::Deadline)),
            self.caller_waits.map(|w| (w, Cut::Caller)),
        )
    }

    /// When an attempt starting at `now` must end, and why: the sooner of the
    /// room and the per-attempt timeout.
    fn cut_for(&self, now: Instant) -> Option<(Instant, Cut)> {
        let by_attempt = self
            .attempt_timeout
            .and_then(|t| Some((now.checked_add(t)?, Cut::AttemptTimeout(t))));
        sooner(self.room(), by_attempt)
    }

    /// The cut for an attempt starting now. The clock is read only when a
    /// limit applies.
    #[inline]
    fn cut_from_now(&self) -> Option<(Instant, Cut)> {
        if self.deadline.is_none() && self.attempt_timeout.is_none() && self.caller_waits.is_none()
        {
            return None;
        }
        self.cut_for(Instant::now())
    }
}

/// When a limit ends, and which limit it is.
type End = Option<(Instant, Cut)>;

/// The sooner of two limits; the first on a tie.
fn sooner(a: Option<(Instant, Cut)>, b: Option<(Instant, Cut)>) -> Option<(Instant, Cut)> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// Which limit ended an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cut {
    /// The call's deadline.
    Deadline,
    /// The per-attempt timeout.
    AttemptTimeout(Duration),
    /// The end of the caller's own attempt, which a retry layer above said
    /// in `x-attempt-timeout`: its caller no longer waits for the answer.
    Caller,
    /// A limit below the layer (a Channel's `Endpoint::timeout`, a tower
    /// `Timeout`) ran out before any of the layer's own.
    Below,
}

impl Cut {
    pub(crate) fn message(self) -> String {
        match self {
            Cut::Deadline => "call deadline exceeded".to_owned(),
            Cut::AttemptTimeout(t) => format!("attempt timed out after {t:?}"),
            Cut::Caller => "the caller's attempt timed out".to_owned(),
            Cut::Below => "attempt timed out below the retry layer".to_owned(),
        }
    }
}

/// How an attempt ended without a response to hand over as it is.
#[derive(Debug)]
pub(crate) enum Failure {
    /// No response headers: the inner service failed (connection refused or
    /// reset, stream refused, GOAWAY).
    Transport(BoxError),
    /// A time limit ran out; `sent` says whether the attempt had been sent.
    Cut { why: Cut, sent: bool },
    /// The inner service failed while a retry waited for it to be ready.
    NotReady(BoxError),
    /// No token was left when the retry was to be sent.
    NoBudget,
    /// The request body could no longer be sent whole when the attempt was
    /// to be sent (its copy outgrew a replay limit while it waited).
    Unreplayable(ReplayError),
}

/// What the layer proved of the inner service where its service was made:
/// how its errors become `BoxError`, and how its abandoned attempts drain.
pub(crate) type Proven<S, B> = (
    fn(<S as Service<Request<B>>>::Error) -> BoxError,
    Drainer<<S as Service<Request<B>>>::Future>,
);

/// Sends each attempt of one call to the inner service.
// NOTE: the bound names `S::Error` for `into_box`; see `RetryService`.
pub(crate) struct Attempt<S, B, Bu, M = NoMetrics>
where
    S: Service<Request<B>>,
    M: Metrics,
{
    /// What the attempts after the first are sent through, clones of it: a
    /// clone of the caller's instance taken once the first was sent through
    /// it (as tower's `Retry` clones its service after the first `call`). A
    /// hedge driver's is the caller's instance itself, for its first attempt.
    inner: Option<S>,
    /// The inner service's error as a `BoxError`, proven where the layer's
    /// service was made.
    into_box: fn(S::Error) -> BoxError,
    /// Reads an abandoned attempt to its end, proven where the layer's
    /// service was made.
    drain: Drainer<S::Future>,
    /// Its attempts may be abandoned while their streams are open (they
    /// have a per-attempt timeout, or hedge), so they are drained then.
    drainable: bool,
    /// For a call whose attempts may be drained: cancelled if the caller
    /// drops the call, which ends their drains.
    cancel: Option<CancellationToken>,
    /// The next call is the call's first attempt.
    first: bool,
    /// The caller's instance was readied, through `RetryService::poll_ready`,
    /// for the first attempt.
    ready: bool,
    shared: Arc<Local<Bu, M>>,
    limits: Limits,
    /// Whether to ask a balancer below to report each attempt's instance.
    report: bool,
    /// The call's policy.
    policy: PolicyRef,
    /// The call hedges: the first call starts the hedge driver.
    hedge: bool,
    /// The call's metrics.
    trace: Trace<M>,
    _body: PhantomData<fn(B)>,
}

impl<S, B, Bu, M> Attempt<S, B, Bu, M>
where
    S: Service<Request<B>>,
    M: Metrics,
{
    /// The attempts of one call under `policy`: the first
    /// through the caller's instance, which its `poll_ready` made ready if
    /// `ready`, the others through clones of it.
    /// A hedging policy's one call (the call's first attempt) starts the hedge
    /// driver, which makes the call's attempts through a plain copy of this.
    // NOTE: inlined whatever features are compiled: with `opentelemetry`
    // the caller grew past the inliner's limit and this went out of line,
    // a cost of its own on every call (`cargo bench --bench instructions_otel`).
    #[inline(always)]
    pub(crate) fn new(
        ready: bool,
        (into_box, drain): Proven<S, B>,
        shared: Arc<Local<Bu, M>>,
        chosen: PolicyRef,
        limits: Limits,
        trace: Trace<M>,
    ) -> Self {
        let policy = shared.policies.get(&chosen);
        let drainable = limits.attempt_timeout.is_some() || limits.caller_waits.is_some();
        Self {
            inner: None,
            into_box,
            drain,
            drainable,
            cancel: (drainable || policy.hedge.is_some()).then(CancellationToken::new),
            first: true,
            ready,
            report: policy.instance_header.is_some(),
            hedge: policy.hedge.is_some(),
            policy: chosen,
            shared,
            limits,
            trace,
            _body: PhantomData,
        }
    }
}

impl<S, B, Bu, M> Attempt<S, B, Bu, M>
where
    S: Service<Request<B>>,
    M: Metrics,
{
    /// What cancels the drains of the call's abandoned attempts when the
    /// caller drops the call (disarmed once the call has its answer).
    pub(crate) fn cancel_on_drop(&self) -> Option<DropGuard> {
        self.cancel.clone().map(CancellationToken::drop_guard)
    }

    /// Leaves the balancer's report slot to the caller: a hedged call gives
    /// each of its attempts, side by side, a slot of its own.
    pub(crate) fn without_report(mut self) -> Self {
        self.report = false;
        self
    }
}

// Not derived: that would ask for `B: Clone` and `Bu: Clone`, which the
// markers and the shared handle do not need.
impl<S, B, Bu, M> Clone for Attempt<S, B, Bu, M>
where
    S: Service<Request<B>> + Clone,
    M: Metrics,
{
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            into_box: self.into_box,
            drain: self.drain,
            drainable: self.drainable,
            cancel: self.cancel.clone(),
            first: self.first,
            ready: false,
            shared: Arc::clone(&self.shared),
            limits: self.limits,
            report: self.report,
            policy: self.policy.clone(),
            hedge: self.hedge,
            trace: self.trace.clone(),
            _body: PhantomData,
        }
    }
}

impl<S, B, RB, Bu, M> Service<Request<ReplayBody<B>>> for Attempt<S, B, Bu, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    type Response = Response<ResponseBody<RB, M>>;
    type Error = Failure;
    type Future = AttemptFuture<S, B, Bu, M>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // NOTE: always ready. The first attempt goes to the instance the caller
        // polled; every attempt that finds its service not ready waits in its
        // `AttemptFuture`, under the attempt's timer, where tower's `Retry`
        // would wait with none.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReplayBody<B>>) -> Self::Future {
        self.attempt(None, req)
    }
}

impl<S, B, RB, Bu, M> Attempt<S, B, Bu, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    /// Sends the call's first attempt, the request of `head` and `body`,
    /// through `readied`, the instance the caller polled ready (or on its way
    /// to it), which stays the caller's. `timeout`, for a call with a
    /// deadline, is what the attempt may say its time is if it is sent at
    /// once (see [`FirstTimeout`]).
    // NOTE: the common first attempt (its instance ready, no hedging, no
    // per-attempt timeout, so nothing to drain, and time left) is sent as it
    // is: made a request of the caller's body type once, not first a request
    // of the replayed body, moved again to be mapped (`cargo bench
    // --bench instructions`). It does what `attempt` does for
    // it; any other goes there.
    #[inline(always)]
    pub(crate) fn call_first(
        &mut self,
        readied: &mut S,
        mut head: request::Parts,
        body: ReplayBody<B>,
        timeout: Option<FirstTimeout>,
    ) -> AttemptFuture<S, B, Bu, M> {
        let plain = self.first
            && self.ready
            && !self.hedge
            && !self.drainable
            && self.limits.attempt_timeout.is_none()
            && self.limits.caller_waits.is_none();
        if !plain {
            return self.attempt(Some(readied), Request::from_parts(head, body));
        }
        let deadline = self.limits.deadline;
        if let Some(at) = deadline {
            // NOTE: read now, not where the call set its deadline: reading
            // the caller's body at once (its message encoded), in between,
            // is time the deadline counts.
            let now = Instant::now();
            if at <= now {
                return self.attempt(Some(readied), Request::from_parts(head, body));
            }
            let policy = self.shared.policies.get(&self.policy);
            say_first_timeout(&mut head.headers, timeout, policy, at, now);
        }
        let cut = deadline.map(|at| (at, Cut::Deadline));
        self.first = false;
        self.ready = false;
        if self.report {
            head.extensions.insert(body.picked_instance());
        }
        let traced = self.trace.attempt();
        let future = readied.call(Request::from_parts(head, B::from(body)));
        self.inner = Some(readied.clone());
        let state = State::Called { future };
        AttemptFuture::new(state, self.into_box, cut, deadline, traced)
    }

    /// An attempt; the call's first goes through `readied`, the caller's
    /// instance, if given, else through `inner` (a hedge driver's).
    #[inline(always)]
    fn attempt(
        &mut self,
        readied: Option<&mut S>,
        mut req: Request<ReplayBody<B>>,
    ) -> AttemptFuture<S, B, Bu, M> {
        if std::mem::take(&mut self.hedge) {
            return self.start_hedging(readied, req);
        }
        // NOTE: the copy kept for the next retry is already made (by the
        // call's response future, or tower's `Retry`), so the report slot goes
        // with this attempt only.
        if self.report {
            let picked = req.body().picked_instance();
            req.extensions_mut().insert(picked);
        }
        let cut = self.limits.cut_from_now();
        let deadline = self.limits.deadline;
        let first = std::mem::take(&mut self.first);
        let ready = std::mem::take(&mut self.ready);
        let mut drain = self.drainable.then(|| DrainWith {
            drainer: self.drain,
            metrics: self.shared.metrics.clone(),
            cancel: self.cancel.clone(),
            body: None,
        });
        if !first {
            // A retry, through an instance of its own: it waits for readiness
            // under the timer, then pays, and is sent.
            let service = self.instance();
            return self.readying(service, req, drain, true, cut);
        }
        // The call's first attempt goes through the caller's instance, which
        // a hedge driver holds as its own; the call's own attempt keeps a
        // clone of it for the retries.
        let (readied, keep) = match readied {
            Some(readied) => (readied, true),
            None => (self.inner.as_mut().expect(HOLDS), false),
        };
        if !ready {
            // The instance the caller polled, which may be part way to
            // ready, waits for readiness under the attempt's timer; the
            // caller keeps a fresh clone.
            let fresh = readied.clone();
            let service = std::mem::replace(readied, fresh);
            if keep {
                self.inner = Some(readied.clone());
            }
            return self.readying(service, req, drain, false, cut);
        }
        // The first attempt, on the instance the caller readied: sent now.
        if let Some((at, why)) = cut {
            let now = Instant::now();
            if at <= now {
                // Not sent: what the caller's `poll_ready` reserved on the
                // instance (a permit, a slot in a buffer or a channel) is
                // given back now, not held until the caller's next call.
                release_readied(readied);
                if keep {
                    self.inner = Some(readied.clone());
                }
                let failure = Failure::Cut { why, sent: false };
                return AttemptFuture::failed(failure, self.into_box);
            }
            say_time(req.headers_mut(), deadline, (at, why), now);
        }
        let traced = self.trace.attempt();
        if let Some(drain) = drain.as_mut() {
            drain.body = req.body_mut().drainable();
        }
        let future = readied.call(req.map(B::from));
        if keep {
            self.inner = Some(readied.clone());
        }
        let into_box = self.into_box;
        // NOTE: each return builds the future where it goes: one chosen
        // first, or changed after, would be copied whole once more.
        if let Some(drain) = drain {
            let state = sent(future, drain);
            return AttemptFuture::new(state, into_box, cut, deadline, traced);
        }
        let state = State::Called { future };
        AttemptFuture::new(state, into_box, cut, deadline, traced)
    }

    /// A fresh instance, for an attempt after the first.
    fn instance(&self) -> S {
        self.inner.as_ref().expect(HOLDS).clone()
    }

    /// An attempt through `service`, which it polls ready before it is sent;
    /// paid for as a retry if `retry`.
    fn readying(
        &self,
        service: S,
        req: Request<ReplayBody<B>>,
        drain: Option<DrainWith<S::Future>>,
        retry: bool,
        cut: Option<(Instant, Cut)>,
    ) -> AttemptFuture<S, B, Bu, M> {
        let state = State::Readying {
            waiting: Box::new(Waiting {
                service,
                request: Some(req),
                drain,
                retry: retry.then(|| Arc::clone(&self.shared)),
                min_attempt_budget: self.shared.policies.get(&self.policy).min_attempt_budget,
                room: self.limits.room(),
                trace: self.trace.clone(),
            }),
        };
        let deadline = self.limits.deadline;
        AttemptFuture::new(state, self.into_box, cut, deadline, AttemptTrace::<M>::NONE)
    }

    /// The hedge driver for the call of `req`, making its attempts through a
    /// plain copy of this, the first through the instance the caller readied.
    fn start_hedging(
        &mut self,
        readied: Option<&mut S>,
        req: Request<ReplayBody<B>>,
    ) -> AttemptFuture<S, B, Bu, M> {
        let chosen = self.policy.clone();
        // The driver holds the caller's instance for its first attempt; the
        // caller keeps a fresh clone. (The call's own attempt is never
        // retried: the driver makes every attempt.)
        let inner = match readied {
            Some(readied) => {
                let fresh = readied.clone();
                Some(std::mem::replace(readied, fresh))
            }
            None => self.inner.take(),
        };
        let driver = Attempt {
            inner,
            into_box: self.into_box,
            drain: self.drain,
            // Every attempt but the winner is abandoned.
            drainable: true,
            cancel: self.cancel.clone(),
            first: true,
            ready: std::mem::take(&mut self.ready),
            shared: Arc::clone(&self.shared),
            limits: self.limits,
            report: self.report,
            policy: self.policy.clone(),
            hedge: false,
            trace: self.trace.clone(),
            _body: PhantomData,
        };
        let tried = req
            .extensions()
            .get::<AlreadyTried>()
            .cloned()
            .unwrap_or_default();
        let deadline = self.limits.deadline;
        let shared = Arc::clone(&self.shared);
        let room = self.limits.room();
        let hedged = HedgeFuture::new(driver, shared, chosen, req, room, tried);
        AttemptFuture::new(
            State::Hedged {
                future: Box::pin(hedged),
            },
            self.into_box,
            None,
            deadline,
            AttemptTrace::<M>::NONE,
        )
    }
}

/// Why an attempt after a call's first always has an instance to clone: the
/// first is sent only through `call_first`, which keeps a clone of the
/// caller's instance for them, or by a hedge driver, which holds it.
const HOLDS: &str = "an attempt after the first holds an instance of the service";

/// Drops the instance the caller readied, unused, for a fresh clone:
/// dropping it gives back what its readiness reserved.
#[cold]
fn release_readied<S: Clone>(readied: &mut S) {
    let fresh = readied.clone();
    drop(std::mem::replace(readied, fresh));
}

/// What an attempt is doing.
type AttemptState<S, B, Bu, M> = State<
    Waiting<S, Request<ReplayBody<B>>, <S as Service<Request<B>>>::Future, Bu, M>,
    <S as Service<Request<B>>>::Future,
    Pin<Box<HedgeFuture<S, B, Bu, M>>>,
>;

/// An attempt waiting for its service to be ready, and what it needs to be
/// sent then. Boxed in the state: most first attempts never wait, so the
/// future every call moves does not carry it.
struct Waiting<S, R, F, Bu, M: Metrics> {
    service: S,
    request: Option<R>,
    /// How to drain it once sent, if it may be abandoned.
    drain: Option<DrainWith<F>>,
    /// For an attempt after the first: the budget a retry pays from and the
    /// counters, at send time. `None` for the first attempt.
    retry: Option<Arc<Local<Bu, M>>>,
    /// The least time worth sending a retry with.
    min_attempt_budget: Duration,
    /// The end of the call's room (see [`Limits::room`]).
    room: Option<(Instant, Cut)>,
    /// The call's metrics, to start this attempt's when it is sent.
    trace: Trace<M>,
}

pin_project! {
    /// One attempt: readiness (for a retry), the inner service's future, and
    /// the timer that cuts both.
    pub(crate) struct AttemptFuture<S, B, Bu, M>
    where
        S: Service<Request<B>>,
        M: Metrics,
    {
        #[pin]
        state: AttemptState<S, B, Bu, M>,
        into_box: fn(S::Error) -> BoxError,
        // The timer for `cut`, made the first time the attempt has to wait:
        // none is made for an attempt answered at once, nor where the call
        // was made (which need not be on a runtime).
        #[pin]
        timer: Option<Sleep>,
        cut: Option<(Instant, Cut)>,
        // The call's deadline, which the response body keeps to.
        deadline: Option<Instant>,
        // This attempt's metrics, once it is sent.
        traced: AttemptTrace<M>,
    }
}

/// An attempt sent that may be abandoned: its future, boxed to be handed to
/// its drain. (One pointer in the state: a variant with more would make every
/// attempt's state larger, and slower to move.)
struct SentAttempt<F> {
    future: Option<Pin<Box<F>>>,
    drain: DrainWith<F>,
}

/// How an abandoned attempt is drained, who counts it, and what ends it if
/// the caller drops the call.
struct DrainWith<F> {
    drainer: Drainer<F>,
    metrics: RetryMetrics,
    cancel: Option<CancellationToken>,
    /// A retried call's attempt: its body may be read on while it drains.
    body: Option<Lingering>,
}

impl<F> DrainWith<F> {
    /// Drains `future`, the attempt of a call with `deadline`.
    fn hand(&mut self, future: Pin<Box<F>>, deadline: Option<Instant>) {
        let drain = Drain {
            deadline,
            metrics: self.metrics.clone(),
            cancel: self.cancel.clone(),
            body: self.body.take().map(Lingering::drain),
        };
        (self.drainer)(future, drain);
    }
}

/// The state of an attempt just sent: its future boxed if it may be drained
/// (a box can be handed to the drain; a pinned future cannot).
#[inline(always)]
fn called<W, F, H>(future: F, drain: Option<DrainWith<F>>) -> State<W, F, H> {
    match drain {
        Some(drain) => sent(future, drain),
        None => State::Called { future },
    }
}

/// The state of an attempt that may be drained, just sent. Out of line: the
/// happy path does not need it.
#[cold]
#[inline(never)]
fn sent<W, F, H>(future: F, drain: DrainWith<F>) -> State<W, F, H> {
    State::Sent {
        sent: Box::new(SentAttempt {
            future: Some(Box::pin(future)),
            drain,
        }),
    }
}

/// Tells the server of an attempt sent at `now` and cut at `cut` its time:
/// the call's deadline as `grpc-timeout`, and, for an attempt cut sooner (by
/// its own timeout, or by its caller's), that end as `x-attempt-timeout`.
///
/// `grpc-timeout` says the deadline, not the attempt's own limit: tonic's
/// Channel enforces the header it sends by resetting the stream when it
/// runs out, at the moment the server answers for the same limit, and that
/// answer would cross the reset. The layer cuts an attempt at its own limit
/// and drains it, so the stream ends by the server's answer (or at the
/// deadline). `x-attempt-timeout` is only told: a server may stop work its
/// caller no longer waits for, and a retry layer in it fits its retries
/// before that end (see
/// [`RetryPolicy::with_attempt_timeout`](crate::RetryPolicy::with_attempt_timeout)).
#[inline]
fn say_time(
    headers: &mut HeaderMap,
    deadline: Option<Instant>,
    (at, why): (Instant, Cut),
    now: Instant,
) {
    set_timeout(headers, deadline, now);
    if let Cut::AttemptTimeout(_) | Cut::Caller = why {
        let left = at.saturating_duration_since(now);
        // NOTE: by its `&'static str`: another insert by a `HeaderName`
        // kept the compiler from inlining the key's, and folding the hash of
        // its name, on every call.
        headers.insert(ATTEMPT_TIMEOUT_NAME, format_grpc_timeout(left));
    }
}

/// Sends the call's deadline to the server as `grpc-timeout`.
pub(crate) fn set_timeout(headers: &mut HeaderMap, deadline: Option<Instant>, now: Instant) {
    if let Some(deadline) = deadline {
        let left = deadline.saturating_duration_since(now);
        headers.insert(GRPC_TIMEOUT, format_grpc_timeout(left));
    }
}

pin_project! {
    #[project = StateProj]
    enum State<W, F, H> {
        /// Waiting for the inner service to be ready.
        Readying {
            waiting: Box<W>,
        },
        /// Sent: the inner service's future.
        Called {
            #[pin]
            future: F,
        },
        /// Sent, and drained if abandoned: the inner service's future, boxed.
        /// (Here rather than in the future's fields: only such attempts pay
        /// for it, and the future every call moves stays as small.)
        Sent {
            sent: Box<SentAttempt<F>>,
        },
        /// Ended without being sent, or done.
        Failed {
            failure: Option<Failure>,
        },
        /// A hedged call: its driver makes the attempts. Boxed: the driver
        /// is large, and only a hedged call pays for it.
        Hedged {
            future: H,
        },
    }
}

#[cfg(test)]
impl<S, B, Bu, M> AttemptFuture<S, B, Bu, M>
where
    S: Service<Request<B>>,
    M: Metrics,
{
    /// A hedged call's driver, for its steps' unit tests.
    pub(crate) fn hedge_driver(self: Pin<&mut Self>) -> Option<&mut HedgeFuture<S, B, Bu, M>> {
        match self.project().state.project() {
            StateProj::Hedged { future } => Some(future.as_mut().get_mut()),
            _ => None,
        }
    }
}

impl<S, B, Bu, M> AttemptFuture<S, B, Bu, M>
where
    S: Service<Request<B>>,
    M: Metrics,
{
    #[inline(always)]
    fn new(
        state: AttemptState<S, B, Bu, M>,
        into_box: fn(S::Error) -> BoxError,
        cut: Option<(Instant, Cut)>,
        deadline: Option<Instant>,
        traced: AttemptTrace<M>,
    ) -> Self {
        Self {
            state,
            into_box,
            timer: None,
            cut,
            deadline,
            traced,
        }
    }

    fn failed(failure: Failure, into_box: fn(S::Error) -> BoxError) -> Self {
        Self::new(
            State::Failed {
                failure: Some(failure),
            },
            into_box,
            None,
            None,
            AttemptTrace::<M>::NONE,
        )
    }
}

impl<S, B, Bu, M> AttemptFuture<S, B, Bu, M>
where
    S: Service<Request<B>>,
    M: Metrics,
{
    /// Whether the attempt has been sent (it is no longer waiting for its
    /// service to be ready).
    pub(crate) fn is_sent(&self) -> bool {
        !matches!(self.state, State::Readying { .. })
    }

    /// The call no longer needs this attempt (another one of its hedges
    /// committed): if it is sent and its stream open, it is drained rather
    /// than reset; otherwise it is simply dropped after this. Whether it was
    /// sent.
    pub(crate) fn abandon(self: Pin<&mut Self>) -> bool {
        let this = self.project();
        let state = this.state.project();
        let sent = !matches!(state, StateProj::Readying { .. });
        drain_sent(state, *this.deadline);
        sent
    }
}

impl<S, B, Bu, M> AttemptFuture<S, B, Bu, M>
where
    S: Service<Request<B>>,
    M: Metrics,
{
    /// The call's deadline passed with this attempt in flight, and it is
    /// dropped after this: its metrics end `DEADLINE_EXCEEDED`, as the call
    /// does, not `CANCELLED`.
    pub(crate) fn out_of_time(self: Pin<&mut Self>) {
        self.project().traced.end(tonic::Code::DeadlineExceeded);
    }
}

/// Whether the time `at` has come: the timer for it is made the first time
/// this is asked.
fn fired(mut timer: Pin<&mut Option<Sleep>>, at: Instant, cx: &mut Context<'_>) -> bool {
    if timer.is_none() {
        timer.set(Some(timer_at(at)));
    }
    timer
        .as_pin_mut()
        .is_some_and(|timer| timer.poll(cx).is_ready())
}

impl<S, B, RB, Bu, M> Future for AttemptFuture<S, B, Bu, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    type Output = Result<Response<ResponseBody<RB, M>>, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let polled = loop {
            match this.state.as_mut().project() {
                StateProj::Readying { waiting } => {
                    let Waiting {
                        service,
                        request,
                        drain,
                        retry,
                        min_attempt_budget,
                        room,
                        trace,
                    } = &mut **waiting;
                    let failure = match service.poll_ready(cx) {
                        Poll::Ready(Ok(())) => {
                            let Some(mut req) = request.take() else {
                                panic!("an attempt was polled after it was sent");
                            };
                            let limits = (*this.cut, *this.deadline, *room, *min_attempt_budget);
                            match send(&mut req, limits, retry) {
                                Ok(()) => {
                                    if <Trace<M> as CallRecord>::ON
                                        && (req.body().is_retry() || req.body().is_transparent())
                                    {
                                        if req.body().is_transparent() {
                                            trace.transparent_retry();
                                        } else if req.body().is_hedge() {
                                            trace.hedge();
                                        } else {
                                            trace.retry();
                                        }
                                    }
                                    *this.traced = trace.attempt();
                                    if let Some(drain) = drain.as_mut() {
                                        drain.body = req.body_mut().drainable();
                                    }
                                    let future = service.call(req.map(B::from));
                                    let drain = drain.take();
                                    this.state.set(called(future, drain));
                                    continue;
                                }
                                Err(failure) => failure,
                            }
                        }
                        Poll::Ready(Err(error)) => Failure::NotReady((this.into_box)(error)),
                        Poll::Pending => match *this.cut {
                            Some((at, why)) if fired(this.timer.as_mut(), at, cx) => {
                                Failure::Cut { why, sent: false }
                            }
                            _ => return Poll::Pending,
                        },
                    };
                    // NOTE: dropping the service gives back any capacity its
                    // readiness reserved.
                    this.state.set(State::Failed { failure: None });
                    return Poll::Ready(Err(failure));
                }
                StateProj::Called { future } => break future.poll(cx),
                StateProj::Sent { sent } => {
                    let Some(inner) = sent.future.as_mut() else {
                        panic!("an attempt was polled after it completed");
                    };
                    break inner.as_mut().poll(cx);
                }
                StateProj::Hedged { future } => return future.as_mut().poll(cx).map(Ok),
                StateProj::Failed { failure } => {
                    let Some(failure) = failure.take() else {
                        panic!("an attempt was polled after it completed");
                    };
                    return Poll::Ready(Err(failure));
                }
            }
        };
        // Sent: its answer, or its cut.
        if let Poll::Ready(result) = polled {
            this.timer.set(None);
            let result = result.map_err(*this.into_box);
            let mut outcome = outcome(result, *this.cut, *this.deadline);
            if this.traced.is_open() {
                trace_outcome(&mut outcome, std::mem::take(this.traced));
            }
            return Poll::Ready(outcome);
        }
        let Some((at, why)) = *this.cut else {
            return Poll::Pending;
        };
        if !fired(this.timer.as_mut(), at, cx) {
            return Poll::Pending;
        }
        // Cut by its own timeout, the attempt still has the deadline the
        // server was sent: drained, not reset. Cut by the deadline, it is
        // dropped, which resets its stream (tonic's Channel would reset it
        // there anyway).
        if let Cut::AttemptTimeout(_) | Cut::Caller = why {
            drain_sent(this.state.as_mut().project(), *this.deadline);
        }
        this.traced.end(tonic::Code::DeadlineExceeded);
        this.state.set(State::Failed { failure: None });
        Poll::Ready(Err(Failure::Cut { why, sent: true }))
    }
}

/// Hands the future of an attempt sent to be drained if abandoned to its
/// drain, if it is one (and still there).
#[cold]
fn drain_sent<W, F, H>(state: StateProj<'_, W, F, H>, deadline: Option<Instant>) {
    if let StateProj::Sent { sent } = state
        && let Some(future) = sent.future.take()
    {
        sent.drain.hand(future, deadline);
    }
}

/// The last steps before an attempt whose service is now ready is sent: is
/// there still time for it, and, for a retry (an attempt after one that was
/// sent), a token to pay for it? Then it is sent with the time left, and a
/// retry is counted.
fn send<B, Bu: Budget, M: Metrics>(
    req: &mut Request<ReplayBody<B>>,
    (cut, deadline, room, min_attempt_budget): (End, Option<Instant>, End, Duration),
    retry: &Option<Arc<Local<Bu, M>>>,
) -> Result<(), Failure> {
    if let Some((at, why)) = cut {
        let now = Instant::now();
        if at <= now {
            return Err(Failure::Cut { why, sent: false });
        }
        // Waiting for readiness may have used up the call's time: a retry
        // with less than the minimum attempt budget left cannot succeed.
        if let (Some(_), Some((end, why))) = (retry, room)
            && end.saturating_duration_since(now) <= min_attempt_budget
        {
            return Err(Failure::Cut { why, sent: false });
        }
        say_time(req.headers_mut(), deadline, (at, why), now);
    }
    if let Some(shared) = retry {
        // The copy may have been dropped since the retry was decided: the
        // attempt before it read on and outgrew a replay limit. A body that
        // cannot be sent whole is not sent, nor paid for.
        req.body().whole().map_err(Failure::Unreplayable)?;
        if req.body().is_transparent() {
            // In place of an attempt the server refused: not paid for.
            shared.metrics.record(Event::TransparentRetry);
        } else if req.body().is_retry() {
            let paid = shared.budget.withdraw();
            shared.budget_moved();
            if !paid {
                return Err(Failure::NoBudget);
            }
            let event = if req.body().is_hedge() {
                Event::Hedge
            } else {
                Event::Retry
            };
            shared.metrics.record(event);
        }
        // From now on this attempt's body is the live one.
        req.body_mut().sent();
    }
    Ok(())
}

/// Ends the metrics of an attempt that ended with `outcome`: a status
/// answer ends it now, a streamed response when its body ends (which is then
/// the call's end too: a streamed response always goes to the caller).
fn trace_outcome<RB, M: Metrics>(
    outcome: &mut Result<Response<ResponseBody<RB, M>>, Failure>,
    mut traced: AttemptTrace<M>,
) {
    match outcome {
        // NOTE: an answer its headers decide (a status, or an HTTP error such
        // as a proxy's 503) ends the attempt here, whether the caller gets it
        // or it is retried; one its trailers decide ends with its body, which
        // ends the call too once the caller is given it.
        Ok(response) => match code_at_headers(response.status(), response.headers()) {
            Some(code) => traced.end(code),
            None => response.body_mut().trace(traced),
        },
        Err(Failure::Transport(_)) => traced.no_response(),
        Err(_) => traced.end(tonic::Code::DeadlineExceeded),
    }
}

/// What the inner service's answer means for the attempt.
fn outcome<RB, M: Metrics>(
    result: Result<Response<RB>, BoxError>,
    cut: Option<(Instant, Cut)>,
    deadline: Option<Instant>,
) -> Result<Response<ResponseBody<RB, M>>, Failure> {
    let expired = |cut: Option<(Instant, Cut)>| cut.filter(|(at, _)| Instant::now() >= *at);
    match result {
        Ok(response) => {
            // NOTE: an attempt has a cut whenever the call has a deadline or
            // an attempt timeout; a call with neither looks up nothing here.
            let status = match cut {
                Some(_) => StatusHeaders::of(response.headers()).status,
                None => None,
            };
            // A tonic server answers CANCELLED when the `grpc-timeout` we sent
            // runs out; the caller cancelled nothing, the attempt's time ran
            // out. (Only an attempt with a limit sent a `grpc-timeout`.)
            if status.is_some_and(|v| v.as_bytes() == b"1")
                && let Some((_, why)) = expired(cut)
            {
                return Err(Failure::Cut { why, sent: true });
            }
            // A Trailers-Only answer (its status in its headers) arrived in
            // time: its body still ends at the deadline, but keeps that status.
            let status_in_headers = status.is_some();
            Ok(response.map(|body| ResponseBody::new(body, deadline, status_in_headers)))
        }
        Err(error) => {
            // A Channel enforcing the `grpc-timeout` we sent reports a
            // transport error (`TimeoutExpired`) that tonic would show as
            // CANCELLED: it too is the attempt's time running out.
            if let Some((_, why)) = expired(cut) {
                return Err(Failure::Cut { why, sent: true });
            }
            if is_timeout(&*error) {
                return Err(Failure::Cut {
                    why: Cut::Below,
                    sent: true,
                });
            }
            // An error carrying a gRPC status is that status, as tonic's
            // client would report it.
            if let Some(status) = status_in(&*error) {
                return Ok(status.clone().into_http());
            }
            Err(Failure::Transport(error))
        }
    }
}
