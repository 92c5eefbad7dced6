//! One call's retry decisions: the per-call [`Policy`] that tower's `Retry`
//! drives (and the call's response future, for the first attempt's outcome),
//! and the backoff future it returns.
//!
//! After every attempt, [`CallRetry::retry`] reads the outcome and decides:
//! classify (is this retryable at all?), then the attempts left, then the
//! deadline's room for the backoff and another attempt, then the budget. The
//! token itself is taken when the retry is sent (in the attempt), so that only
//! attempts really sent are paid for.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::budget::{Budget, call_succeeded};
use http::{
    Extensions, HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, request,
};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tonic::Code;
use tower::retry::Policy;

use crate::attempt::{Cut, Failure, Limits};
use crate::body::{Credit, ResponseBody};
use crate::classify::{
    Verdict, classify_error, classify_response, classify_timeout, describe, is_refused_stream,
    repair_status_details,
};
use crate::first::FirstCopy;
use crate::marks::{ALREADY_TRIED, AlreadyTried, IDEMPOTENCY_KEY, PREVIOUS_ATTEMPTS};
use crate::methods::PolicyRef;
use crate::metrics::{Event, RetryMetrics};
use crate::policy::RetryPolicy;
use crate::replay::{ReplayBody, ReplayError};
use crate::shared::{Local, Shared};
use crate::status::{GRPC_RETRY_PUSHBACK, as_grpc_status, code_name, status_response};
use crate::trace::{Metrics, NoMetrics};

/// One call's policy, cloned by `Retry` into the call's future: what every
/// call shares, and this call's own state.
pub(crate) struct CallRetry<Bu, M = NoMetrics> {
    shared: Arc<Local<Bu, M>>,
    /// The call's policy.
    policy: PolicyRef,
    /// The call hedges: its one "attempt" is the hedge driver, never retried.
    hedged: bool,
    state: CallState,
}

#[derive(Clone, Debug)]
struct CallState {
    /// The end of the room its attempts and waits fit in: when the caller
    /// stops waiting, if a layer above said so (always before the deadline),
    /// else the deadline (see `Limits::room`).
    end: Option<Instant>,
    /// `end` is the caller's.
    callers_end: bool,
    /// Attempts made so far, the current one included, sent or not.
    made: u32,
    /// Attempts that reached the inner service.
    sent: u32,
    /// Retries since the last server-given delay (A6: a pushback restarts the
    /// exponential backoff).
    backoff_step: u32,
    tried: AlreadyTried,
    /// How the last failed attempt ended: what the caller gets if the retry
    /// after it cannot be sent. Boxed: only a call that retries pays for it.
    last: Option<Box<Last>>,
    /// A retry was decided after an attempt that was sent: the call retried,
    /// sent or not, so giving up on it is marked.
    retried: bool,
    /// The call's one transparent retry was decided: an attempt's stream
    /// was refused by the server, and the attempt sent again.
    transparent: bool,
}

/// How the last failed attempt of a call ended: what its caller gets if no
/// attempt after it answers (retries and hedges alike).
#[derive(Clone, Debug)]
pub(crate) enum Last {
    /// A response, kept as the server sent it (headers only: it was a
    /// Trailers-Only status or an HTTP error).
    Response {
        status: StatusCode,
        headers: HeaderMap,
    },
    /// A status the layer read from an attempt without a response.
    Status { code: Code, message: String },
}

impl Last {
    /// The code the attempt ended with.
    pub(crate) fn code(&self) -> Code {
        match self {
            Last::Response { status, headers } => {
                classify_response(*status, headers, Default::default()).code()
            }
            Last::Status { code, .. } => *code,
        }
    }

    /// The response the caller gets for it: the server's headers, repaired,
    /// and a proxy's answer as the gRPC status it maps to.
    pub(crate) fn into_response<RB, M: Metrics>(self) -> Response<ResponseBody<RB, M>> {
        let code = self.code();
        match self {
            Last::Response {
                status,
                mut headers,
            } => {
                repair_status_details(&mut headers);
                let mut response = Response::new(ResponseBody::empty());
                *response.status_mut() = status;
                *response.headers_mut() = headers;
                as_grpc_status(&mut response, code);
                response
            }
            Last::Status { message, .. } => status_response(code, message),
        }
    }
}

// Not derived: the budget itself need not be `Clone`, it is shared.
impl<Bu, M> Clone for CallRetry<Bu, M> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            policy: self.policy.clone(),
            hedged: self.hedged,
            state: self.state.clone(),
        }
    }
}

impl<Bu, M> CallRetry<Bu, M> {
    /// The policy of a call under `limits`, whose caller already marked
    /// `tried` as tried.
    pub(crate) fn new(
        shared: Arc<Local<Bu, M>>,
        policy: PolicyRef,
        limits: Limits,
        tried: AlreadyTried,
        hedged: bool,
    ) -> Self {
        Self {
            shared,
            policy,
            hedged,
            state: CallState {
                end: limits.caller_waits.or(limits.deadline),
                callers_end: limits.caller_waits.is_some(),
                made: 1,
                sent: 0,
                backoff_step: 0,
                tried,
                last: None,
                retried: false,
                transparent: false,
            },
        }
    }
}

/// The request a retry is made from, as the call policy reads and marks it:
/// tower's copy (a [`Request`]), or the first attempt's [`FirstCopy`].
pub(crate) trait RetryCopy<B> {
    fn body(&self) -> &ReplayBody<B>;
    fn body_mut(&mut self) -> &mut ReplayBody<B>;
    /// The first value of the header `name`.
    fn header(&self, name: &HeaderName) -> Option<&HeaderValue>;
    /// Sets the header `name` to `value` alone.
    fn set_header(&mut self, name: HeaderName, value: HeaderValue);
    fn extensions_mut(&mut self) -> &mut Extensions;
}

impl<B> RetryCopy<B> for Request<ReplayBody<B>> {
    fn body(&self) -> &ReplayBody<B> {
        self.body()
    }

    fn body_mut(&mut self) -> &mut ReplayBody<B> {
        self.body_mut()
    }

    fn header(&self, name: &HeaderName) -> Option<&HeaderValue> {
        self.headers().get(name)
    }

    fn set_header(&mut self, name: HeaderName, value: HeaderValue) {
        self.headers_mut().insert(name, value);
    }

    fn extensions_mut(&mut self) -> &mut Extensions {
        self.extensions_mut()
    }
}

/// What one attempt told the call, for the decision after it.
struct Outcome<'a> {
    verdict: Verdict,
    /// The instance a failed attempt went to, if known.
    instance: Option<&'a HeaderValue>,
    /// Whether the request body can still be sent again, or why not (asked
    /// only for a retryable failure).
    replay: Result<(), ReplayError>,
    /// Time left before the call's deadline, if it has one.
    remaining: Option<Duration>,
    /// A retry found no time left to be sent.
    out_of_time: bool,
    /// The attempt reached the inner service: a failure it ended with is the
    /// server's, not a wait that ran out.
    sent: bool,
}

/// What to do after one attempt.
#[derive(Clone, Copy, Debug)]
enum Decision {
    /// Hand the outcome to the caller.
    Done(&'static str),
    /// Retryable, but the room has none for `delay` and another attempt;
    /// `caller`: its end is the caller's attempt's, not the deadline.
    NoTime {
        left: Duration,
        delay: Duration,
        caller: bool,
    },
    /// Retryable, but the budget has no token.
    NoBudget { delay: Duration },
    /// Retryable, but gRPC's throttling refuses retries for now: the caller
    /// gets the failure as it is.
    Throttled,
    /// Send another attempt after `delay`.
    Retry { delay: Duration },
}

impl Decision {
    fn describe(self) -> &'static str {
        match self {
            Decision::Done(why) => why,
            Decision::NoTime { .. } => "no time left for another attempt",
            Decision::NoBudget { .. } => "retry budget exhausted",
            Decision::Throttled => "retries throttled",
            Decision::Retry { .. } => "retrying",
        }
    }

    fn delay(self) -> Option<Duration> {
        match self {
            Decision::Done(_) | Decision::Throttled => None,
            Decision::NoTime { delay, .. }
            | Decision::NoBudget { delay }
            | Decision::Retry { delay } => Some(delay),
        }
    }
}

impl CallState {
    /// Time left in the call's room, if it has an end. The clock is read
    /// only then.
    fn remaining(&self) -> Option<Duration> {
        self.end
            .map(|end| end.saturating_duration_since(Instant::now()))
    }

    /// Classify, then attempts, then deadline, then budget: what follows an
    /// attempt that did not succeed.
    fn decide<Bu: Budget>(
        &mut self,
        shared: &Shared<Bu>,
        policy: &RetryPolicy,
        outcome: Outcome<'_>,
    ) -> Decision {
        let Outcome {
            verdict,
            instance,
            replay,
            remaining,
            out_of_time,
            sent,
        } = outcome;
        let budget = &shared.budget;
        if out_of_time {
            if self.sent == 0 {
                // The first attempt found no time to be sent: the deadline
                // passed, and no retry was refused.
                return Decision::Done("call deadline exceeded before an attempt was sent");
            }
            // A retry found no time left to be sent: refused by the deadline,
            // whatever attempts were left.
            return Decision::NoTime {
                left: remaining.unwrap_or_default(),
                delay: Duration::ZERO,
                caller: self.callers_end,
            };
        }
        // NOTE: a success never gets here (see `after`).
        debug_assert!(!verdict.is_success(), "a success is decided by `after`");
        // A method that never retries charges gRPC's throttle nothing, as in
        // grpc-go and grpc-java (a method without a retry policy); nor does
        // an attempt that was never sent, which no server failed.
        let charge = policy.max_attempts > 1 && sent;
        if let Verdict::RetriedBelow(_) = verdict {
            if charge {
                budget.on_retryable_failure();
            }
            shared.metrics.record(Event::RetriedBelow);
            return Decision::Done("not retried: a layer below already retried");
        }
        let Verdict::Retryable { server_delay, .. } = verdict else {
            return Decision::Done("not retryable");
        };
        if charge {
            budget.on_retryable_failure();
        }
        if let Some(id) = instance {
            self.tried.record(id);
        }
        if self.made >= policy.max_attempts {
            return Decision::Done("no attempts left");
        }
        if let Err(why) = replay {
            return Decision::Done(not_replayable(why, shared, policy, false));
        }
        let delay = match server_delay {
            Some(delay) if delay > policy.max_server_delay => {
                return Decision::Done("the server asked for a longer delay than the layer waits");
            }
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
            if self.sent == 0 {
                // Nothing was sent, so no retry is refused: the wait for the
                // service below ran out, and there is no time for another.
                return Decision::Done("no time left to wait for the service");
            }
            return Decision::NoTime {
                left,
                delay,
                caller: self.callers_end,
            };
        }
        // While nothing has been sent, the next attempt is no retry and
        // costs no token. Otherwise the token is taken when the retry is
        // sent; a budget known to be empty refuses now, not after the backoff.
        if self.sent > 0 && budget.is_known_empty() {
            if budget.refusal_keeps_status() {
                return Decision::Throttled;
            }
            return Decision::NoBudget { delay };
        }
        Decision::Retry { delay }
    }

    /// Keeps what the failed attempt ended with, for when the retry after it
    /// cannot be sent. The response is about to be dropped, so its headers
    /// are moved, not copied.
    fn remember<RB, M: Metrics>(
        &mut self,
        result: &mut Result<Response<ResponseBody<RB, M>>, Failure>,
    ) {
        let last = match result {
            Ok(response) => Last::Response {
                status: response.status(),
                headers: std::mem::take(response.headers_mut()),
            },
            Err(Failure::Transport(error)) => Last::Status {
                code: Code::Unavailable,
                message: no_response_message(self.sent, &describe(&**error)),
            },
            Err(Failure::Cut { why, sent: true }) => Last::Status {
                code: Code::DeadlineExceeded,
                message: why.message(),
            },
            // Nothing new was learned: the last attempt sent still stands.
            Err(
                Failure::Cut { sent: false, .. }
                | Failure::NotReady(_)
                | Failure::NoBudget
                | Failure::Unreplayable(_),
            ) => {
                return;
            }
        };
        self.last = Some(Box::new(last));
    }

    /// The last failed attempt's status, as the caller gets it when the
    /// attempt after it could not be sent because the inner service failed
    /// (`error`) while it waited to be ready. Without an earlier attempt, that
    /// failure is the call's: `UNAVAILABLE`, naming it.
    fn last_status<RB, M: Metrics>(&mut self, error: &str) -> Response<ResponseBody<RB, M>> {
        let Some(last) = self.last.take() else {
            return status_response(
                Code::Unavailable,
                format!("the service failed before the call could be sent: {error}"),
            );
        };
        last.into_response()
    }

    /// What the caller is told the call ended with: the last attempt sent,
    /// numbered among the attempts sent, with its code — `current` if the
    /// attempt just judged was sent, else the one before. An attempt cut
    /// before it could be sent answered nothing.
    fn ended_with(&self, current: Option<&'static str>) -> String {
        match current {
            Some(name) => format!("attempt {} ended with {name}", self.sent),
            None if self.sent > 0 => {
                format!("attempt {} ended with {}", self.sent, self.last_code())
            }
            None => "no attempt could be sent in time".to_owned(),
        }
    }

    /// The name of the last failed attempt's code, for messages.
    fn last_code(&self) -> &'static str {
        self.last
            .as_deref()
            .map_or("-", |last| code_name(last.code()))
    }
}

/// Why a retry (or a hedge: `hedge`) the request body cannot be sent again
/// for is not made. A body that outgrew a replay limit is counted and said at
/// `WARN`, where the caller's logs show it: the call is one the layer would
/// have retried, or hedged.
pub(crate) fn not_replayable<Bu>(
    why: ReplayError,
    shared: &Shared<Bu>,
    policy: &RetryPolicy,
    hedge: bool,
) -> &'static str {
    let not = if hedge { "not hedged" } else { "not retried" };
    match why {
        ReplayError::Capped => {
            shared.metrics.record(Event::BodyTooLarge);
            tracing::warn!(
                limit = policy.replay_limit,
                "{not}: the request body outgrew the call's replay limit \
                 (RetryPolicy::with_replay_limit)"
            );
            "request body outgrew the replay limit"
        }
        ReplayError::LayerFull => {
            shared.metrics.record(Event::BodyTooLarge);
            tracing::warn!(
                layer_limit = shared.replay_memory.limit(),
                "{not}: the layer's replay memory for calls in flight was full \
                 (RetryLayer::with_replay_memory)"
            );
            "the layer's replay memory was full"
        }
        _ => "request body cannot be replayed",
    }
}

/// The call's one transparent retry, after an attempt whose stream the
/// server's HTTP/2 library refused: sent at once, whatever the policy, if the
/// body can be sent whole again and the call has time for an attempt. Not
/// counted among the policy's attempts (the refused one is not either, so
/// the retry carries the same `grpc-previous-rpc-attempts`), nor charged to
/// the budget or to gRPC's throttle; its failed instance is not marked, as
/// nothing failed there. `None` where it cannot be sent: the policy decides.
#[cold]
#[inline(never)]
fn transparent_retry<B, Bu: Budget, M: Metrics>(
    state: &mut CallState,
    policy: &RetryPolicy,
    shared: &Local<Bu, M>,
    req: &mut impl RetryCopy<B>,
) -> Option<Backoff> {
    if req.body().whole().is_err() {
        return None;
    }
    let remaining = state.remaining();
    if remaining.is_some_and(|left| left <= policy.min_attempt_budget) {
        return None;
    }
    state.transparent = true;
    // It was sent, and answered nothing: counted as an attempt.
    shared.count_attempt();
    req.body_mut().set_transparent(true);
    if state.made >= policy.max_attempts {
        // No retry can follow this one: once it has replayed the body, the
        // copy goes.
        req.body_mut().mark_last();
    }
    tracing::debug!(
        attempt = state.made,
        remaining = ?remaining,
        "the server refused the stream before its application saw it; sending it again (transparent retry)"
    );
    Some(Backoff::new(Duration::ZERO))
}

/// The message of the `UNAVAILABLE` a caller gets when the last attempt got
/// no response at all.
pub(crate) fn no_response_message(made: u32, error: &str) -> String {
    if made == 1 {
        format!("no response from the server: {error}")
    } else {
        format!("no response from the server to attempt {made} of the call: {error}")
    }
}

/// The instance an attempt went to: the response's own report, else the
/// balancer's; none for an attempt that was never sent.
fn instance<'a, RB, M: Metrics>(
    result: &'a Result<Response<ResponseBody<RB, M>>, Failure>,
    header: Option<&HeaderName>,
    picked: Option<&'a HeaderValue>,
) -> Option<&'a HeaderValue> {
    match result {
        Ok(response) => header.and_then(|h| response.headers().get(h)).or(picked),
        Err(Failure::Cut { sent: false, .. }) => None,
        Err(_) => picked,
    }
}

/// `grpc-previous-rpc-attempts` for the attempt after `sent` attempts;
/// attempts are capped at five, so the common values need no allocation.
pub(crate) fn previous_attempts(sent: u32) -> HeaderValue {
    match sent {
        1 => HeaderValue::from_static("1"),
        2 => HeaderValue::from_static("2"),
        3 => HeaderValue::from_static("3"),
        4 => HeaderValue::from_static("4"),
        n => HeaderValue::from(n),
    }
}

/// A call that ended with `OK` after its response was committed.
impl<Bu: Budget, M: Metrics> Credit for Local<Bu, M> {
    fn credit(&self, paid: bool) {
        call_succeeded(&self.budget, paid);
        self.budget_moved();
    }
}

impl<B, RB, Bu, M> Policy<Request<ReplayBody<B>>, Response<ResponseBody<RB, M>>, Failure>
    for CallRetry<Bu, M>
where
    M: Metrics,
    Bu: Budget,
{
    type Future = Backoff;

    fn retry(
        &mut self,
        req: &mut Request<ReplayBody<B>>,
        result: &mut Result<Response<ResponseBody<RB, M>>, Failure>,
    ) -> Option<Backoff> {
        self.after(req, result)
    }

    fn clone_request(&mut self, req: &Request<ReplayBody<B>>) -> Option<Request<ReplayBody<B>>> {
        // Always a clone, even of a body that can no longer be replayed: `Retry`
        // only shows `retry` the outcomes of requests it holds a clone of, and
        // every outcome must pass `retry` for the budget and the final touches.
        // (A hedged call's one attempt is never retried, and keeps no copy:
        // see `first_copy`.)
        (!self.hedged).then(|| req.clone())
    }
}

impl<Bu, M> CallRetry<Bu, M>
where
    M: Metrics,
    Bu: Budget,
{
    /// The copy of `req` the call's first retry is made from, kept while its
    /// first attempt runs; none for a hedged call, whose hedge driver makes
    /// its attempts, so that its one outcome is handed over as it is.
    /// `retimed`: the caller sent a `grpc-timeout` and the call has a
    /// deadline, so every retry writes over it, and the copy leaves it out.
    #[inline(always)]
    pub(crate) fn first_copy<B>(
        &self,
        head: &request::Parts,
        body: &ReplayBody<B>,
        retimed: bool,
    ) -> Option<FirstCopy<B>> {
        (!self.hedged).then(|| FirstCopy::of(head, body, retimed))
    }

    /// The decision after an attempt of the request `req` is a copy of,
    /// with `result`: `Some` wait before the next attempt, or `None` and the
    /// outcome made what the caller gets. What tower's `Retry` asks of
    /// [`Policy::retry`], for the first attempt's copy too.
    pub(crate) fn after<B, RB, R>(
        &mut self,
        req: &mut R,
        result: &mut Result<Response<ResponseBody<RB, M>>, Failure>,
    ) -> Option<Backoff>
    where
        R: RetryCopy<B>,
    {
        let shared: &Shared<Bu> = &self.shared;
        let Shared {
            policies,
            budget,
            metrics,
            ..
        } = shared;
        let policy = policies.get(&self.policy);
        let state = &mut self.state;
        // Read only where an event is recorded: a lookup of a custom header
        // name hashes it byte by byte.
        let key = |req: &R| {
            req.header(&IDEMPOTENCY_KEY)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .unwrap_or_default()
        };

        // A retry that could not be sent ends the call with what the attempt
        // before it ended with: no token was taken for it.
        match result {
            Err(Failure::NotReady(error)) => {
                let error = describe(&**error);
                tracing::debug!(
                    attempt = state.made,
                    key = key(req),
                    error,
                    "the inner service failed while the attempt waited for it; ending with the last status"
                );
                *result = Ok(state.last_status(&error));
                let marked = policy.retry_at_one_layer && state.retried;
                return end_call(req, result, (marked, true, state.sent), metrics);
            }
            Err(Failure::NoBudget) => {
                self.shared.record(Event::RefusedByBudget);
                tracing::debug!(
                    attempt = state.made,
                    key = key(req),
                    "retry budget exhausted"
                );
                *result = Ok(if budget.refusal_keeps_status() {
                    state.last_status("retries throttled")
                } else {
                    let message = format!("retry budget exhausted; {}", state.ended_with(None));
                    status_response(Code::ResourceExhausted, message)
                });
                return end_call(
                    req,
                    result,
                    (policy.retry_at_one_layer, true, state.sent),
                    metrics,
                );
            }
            Err(Failure::Unreplayable(why)) => {
                let reason = not_replayable(*why, shared, policy, false);
                tracing::debug!(
                    attempt = state.made,
                    key = key(req),
                    "{reason}; ending with the last status"
                );
                *result = Ok(state.last_status(reason));
                // Not retried after all: marked only if an earlier retry was sent.
                let marked = policy.retry_at_one_layer && state.sent > 1;
                return end_call(req, result, (marked, true, state.sent), metrics);
            }
            _ => {}
        }

        // A stream the server's HTTP/2 library refused: sent again at once,
        // once a call, whatever the policy, as gRPC's transparent retry.
        if let Err(Failure::Transport(error)) = &*result
            && !state.transparent
            && is_refused_stream(&**error)
            && let Some(backoff) = transparent_retry(state, policy, &self.shared, req)
        {
            return Some(backoff);
        }

        // An attempt cut before it was sent got no answer; one the deadline
        // cut so is a retry (or a first attempt) that found no time left.
        let (sent, out_of_time) = match result {
            Err(Failure::Cut { why, sent: false }) => {
                (false, matches!(why, Cut::Deadline | Cut::Caller))
            }
            _ => (true, false),
        };
        if sent {
            state.sent += 1;
            self.shared.count_attempt();
        }
        let verdict = match &*result {
            Ok(response) => {
                classify_response(response.status(), response.headers(), policy.retryable)
            }
            Err(Failure::Transport(_)) => classify_error(policy.retryable),
            Err(_) => classify_timeout(policy.retryable),
        };
        // The instance the attempt went to: the response's own report, else
        // the balancer's. Borrowed, not cloned, and only looked up when it is
        // kept (a failure to retry) or shown.
        let header = policy.instance_header.as_ref();
        // What a balancer below reported for this attempt; read for failures
        // only (a success needs no instance), which also clears the slot for
        // the next attempt.
        let picked = match verdict {
            _ if header.is_none() || verdict.is_success() => None,
            _ => req.body().take_picked(),
        };
        let failed_instance = match verdict {
            Verdict::Retryable { .. } => instance(result, header, picked.as_ref()),
            _ => None,
        };
        // The time left decides only a failure's retry: a success reads the
        // clock for its event alone, and only if that is recorded.
        let remaining = if verdict.is_success() {
            None
        } else {
            state.remaining()
        };
        // NOTE: a success is decided here, not in `decide`, whose checks
        // before it concern only failures (an answer is never out of time):
        // every call takes this path, and `decide` is large.
        let decision = if verdict.is_success() {
            // A committed response is credited when its trailers say OK.
            // After a retry, the call succeeded on one: it was paid for (a
            // transparent retry of it carries its payment).
            if verdict != Verdict::Committed {
                call_succeeded(budget, state.retried);
            }
            Decision::Done("succeeded")
        } else {
            let outcome = Outcome {
                verdict,
                instance: failed_instance,
                // Asked only where a retry is in question: it takes the body's lock.
                replay: match verdict {
                    Verdict::Retryable { .. } => req.body().whole(),
                    _ => Ok(()),
                },
                remaining,
                out_of_time,
                sent,
            };
            state.decide(shared, policy, outcome)
        };
        // A committed response moves the budget later, with its trailers.
        if verdict != Verdict::Committed {
            self.shared.budget_moved();
        }
        let attempt = state.made;
        let name = code_name(verdict.code());
        // Retry at one layer: a call given up on after retrying, or refused a
        // retry by the budget or the deadline, tells the layers above not to
        // retry it again. Not one that found no time before its caller's
        // attempt ends, unless it sent a retry: a retry then is the caller's.
        let marked = policy.retry_at_one_layer
            && match decision {
                Decision::NoTime { caller: false, .. } => state.sent > 0,
                Decision::NoTime { caller: true, .. } => state.sent > 1,
                Decision::NoBudget { .. } | Decision::Throttled => state.sent > 0,
                Decision::Done(_) => matches!(verdict, Verdict::Retryable { .. }) && state.retried,
                Decision::Retry { .. } => false,
            };
        // Written only when the call ends on the layer's own decision.
        let ended_with = |state: &CallState| state.ended_with(sent.then_some(name));
        tracing::debug!(
            attempt,
            code = name,
            instance = instance(result, header, picked.as_ref())
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-"),
            key = key(req),
            delay = ?decision.delay(),
            remaining = ?remaining.or_else(|| state.remaining()),
            tokens = budget.balance().unwrap_or(f64::NAN),
            marked,
            "{}",
            decision.describe()
        );

        match decision {
            Decision::Done(_) if verdict == Verdict::Committed => {
                if let Ok(response) = result {
                    response
                        .body_mut()
                        .credit_on_ok(Arc::clone(&self.shared) as Arc<dyn Credit>, state.retried);
                }
            }
            Decision::Done(_) => finish(result, state, verdict.code()),
            Decision::Throttled => {
                self.shared.record(Event::RefusedByBudget);
                finish(result, state, verdict.code());
            }
            Decision::NoTime { left, caller, .. } => {
                self.shared.record(Event::RefusedByDeadline);
                let ended_with = ended_with(state);
                let message = match (left.is_zero(), caller) {
                    (true, false) => format!("call deadline exceeded; {ended_with}"),
                    (true, true) => format!("the caller's attempt timed out; {ended_with}"),
                    (false, false) => {
                        format!("no time left for another attempt: {left:?} left, {ended_with}")
                    }
                    (false, true) => format!(
                        "no time left for another attempt before the caller's attempt ends: {left:?} left, {ended_with}"
                    ),
                };
                *result = Ok(status_response(Code::DeadlineExceeded, message));
            }
            Decision::NoBudget { .. } => {
                self.shared.record(Event::RefusedByBudget);
                let message = format!("retry budget exhausted; {}", ended_with(state));
                *result = Ok(status_response(Code::ResourceExhausted, message));
            }
            Decision::Retry { delay } => {
                state.remember(result);
                req.body_mut().set_transparent(false);
                if state.sent > 0 {
                    // An attempt was sent: the next one is a retry.
                    state.retried = true;
                    req.body_mut().set_retry();
                    req.set_header(PREVIOUS_ATTEMPTS, previous_attempts(state.sent));
                }
                if !state.tried.is_empty() {
                    if let Some(value) = state.tried.to_header() {
                        req.set_header(ALREADY_TRIED, value);
                    }
                    req.extensions_mut().insert(state.tried.clone());
                }
                state.made += 1;
                if state.made >= policy.max_attempts && state.transparent {
                    // After this attempt no retry can follow (not even a
                    // transparent one): once it has replayed the body, the
                    // copy goes.
                    req.body_mut().mark_last();
                }
                return Some(Backoff::new(delay));
            }
        }
        let failed = !verdict.is_success();
        end_call(req, result, (marked, failed, state.sent), metrics)
    }
}

/// The call ends with `result`: marked "do not retry" for the layers above
/// if `marked`, handed back its attempt count if `sent` attempts were sent
/// and its idempotency key if it `failed`, and the replay copy released.
// NOTE: inlined whatever features are compiled: with `opentelemetry`
// the caller grew past the inliner's limit and this went out of line,
// a cost of its own on every call (`cargo bench --bench instructions_otel`).
#[inline(always)]
fn end_call<B, RB, M: Metrics>(
    req: &impl RetryCopy<B>,
    result: &mut Result<Response<ResponseBody<RB, M>>, Failure>,
    (marked, failed, sent): (bool, bool, u32),
    metrics: &RetryMetrics,
) -> Option<Backoff> {
    if let Ok(response) = result {
        if marked {
            mark_given_up(response, metrics);
        }
        if failed || sent > 1 {
            let key = failed.then(|| req.header(&IDEMPOTENCY_KEY)).flatten();
            hand_back(response, sent.saturating_sub(1), key);
        }
    }
    req.body().release();
    None
}

/// What a call's answer tells its caller of how it went (gRPC A6 allows the
/// first): `grpc-previous-rpc-attempts`, the attempts sent before the one
/// that answered, where there were any; and `key`, the idempotency key the
/// call's attempts carried, on a failed call's status, so that its caller
/// can send the call again later under the same key.
#[cold]
#[inline(never)]
pub(crate) fn hand_back<RB, M: Metrics>(
    response: &mut Response<ResponseBody<RB, M>>,
    previous: u32,
    key: Option<&HeaderValue>,
) {
    let headers = response.headers_mut();
    if previous > 0 {
        headers.insert(PREVIOUS_ATTEMPTS, previous_attempts(previous));
    }
    if let Some(key) = key {
        headers.insert(IDEMPOTENCY_KEY, key.clone());
    }
}

/// Marks a failure this layer gave up on "do not retry" for the layers above
/// (gRPC A6: a negative `grpc-retry-pushback-ms`), replacing any pushback the
/// server sent: the retries happened here, at the lowest hop.
pub(crate) fn mark_given_up<RB, M: Metrics>(
    response: &mut Response<ResponseBody<RB, M>>,
    metrics: &RetryMetrics,
) {
    response
        .headers_mut()
        .insert(GRPC_RETRY_PUSHBACK, HeaderValue::from_static("-1"));
    metrics.record(Event::Marked);
}

/// Last touches on an outcome handed to the caller as it is (a committed
/// response needs none: its status comes in trailers, repaired by its body).
fn finish<RB, M: Metrics>(
    result: &mut Result<Response<ResponseBody<RB, M>>, Failure>,
    state: &CallState,
    code: Code,
) {
    match result {
        Ok(response) => {
            repair_status_details(response.headers_mut());
            as_grpc_status(response, code);
        }
        // An attempt cut before it was sent answered nothing: say what the
        // last one sent did.
        Err(Failure::Cut { why, sent: false }) => {
            let message = if state.sent == 0 {
                format!("{} before the call could be sent", why.message())
            } else {
                format!(
                    "{} before the retry could be sent; {}",
                    why.message(),
                    state.ended_with(None)
                )
            };
            *result = Ok(status_response(Code::DeadlineExceeded, message));
        }
        Err(failure) => *result = Ok(failure_response(failure, state.sent)),
    }
}

/// The status a caller gets for an attempt that ended without a response.
pub(crate) fn failure_response<RB, M: Metrics>(
    failure: &Failure,
    attempt: u32,
) -> Response<ResponseBody<RB, M>> {
    match failure {
        // gRPC reports a call whose attempts found no server as UNAVAILABLE,
        // never as tonic's raw transport error (UNKNOWN).
        Failure::Transport(error) | Failure::NotReady(error) => status_response(
            Code::Unavailable,
            no_response_message(attempt, &describe(&**error)),
        ),
        // The caller cancelled nothing: a limit ran out.
        Failure::Cut { why, .. } => status_response(Code::DeadlineExceeded, why.message()),
        Failure::NoBudget => status_response(Code::ResourceExhausted, "retry budget exhausted"),
        Failure::Unreplayable(why) => status_response(Code::Unavailable, why.to_string()),
    }
}

impl<Bu, M> std::fmt::Debug for CallRetry<Bu, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallRetry")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

pin_project! {
    /// The wait before a retry. No delay means no timer: a zero-length `Sleep`
    /// would still wait for the timer's next tick, about a millisecond.
    #[derive(Debug)]
    pub(crate) struct Backoff {
        #[pin]
        sleep: Option<Sleep>,
    }
}

impl Backoff {
    fn new(delay: Duration) -> Self {
        Self {
            sleep: (!delay.is_zero()).then(|| tokio::time::sleep(delay)),
        }
    }
}

impl Future for Backoff {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.project().sleep.as_pin_mut() {
            Some(sleep) => sleep.poll(cx),
            None => Poll::Ready(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Empty = http_body_util::Empty<bytes::Bytes>;

    fn request() -> Request<ReplayBody<Empty>> {
        let mut req = Request::new(ReplayBody::new(Empty::new(), 1024));
        let headers = req.headers_mut();
        headers.append("x-tag", HeaderValue::from_static("first"));
        headers.append("x-tag", HeaderValue::from_static("second"));
        headers.append("x-other", HeaderValue::from_static("other"));
        req
    }

    #[test]
    fn the_first_copy_reads_and_marks_as_a_request_does() {
        let req = request();
        let (head, body) = req.clone().into_parts();
        let mut copy = FirstCopy::of(&head, &body, false);
        let mut same = req.clone();
        let tag = HeaderName::from_static("x-tag");
        assert_eq!(
            RetryCopy::header(&copy, &tag),
            RetryCopy::header(&same, &tag)
        );
        assert_eq!(RetryCopy::header(&copy, &PREVIOUS_ATTEMPTS), None);
        // Setting a header replaces every value it had, as `insert` does.
        for r in [&mut copy as &mut dyn RetryCopy<_>, &mut same] {
            r.set_header(tag.clone(), HeaderValue::from_static("only"));
            r.set_header(PREVIOUS_ATTEMPTS, HeaderValue::from_static("1"));
        }
        let rebuilt = copy.into_request();
        assert_eq!(rebuilt.headers(), same.headers());
        // In the same order too: a header set again keeps its place.
        let names = |map: &HeaderMap| map.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(rebuilt.headers()), names(same.headers()));
        let tags: Vec<_> = rebuilt.headers().get_all("x-tag").iter().collect();
        assert_eq!(tags, ["only"]);
    }
}
