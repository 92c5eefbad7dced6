//! The hedge driver: one hedged call's attempts, side by side.
//!
//! tower's `Retry` sends one attempt after another, so hedging has a driver
//! of its own. It shares the rest with retries: each attempt is an
//! [`AttemptFuture`] (readiness under the attempt's timer, the token taken at
//! send, `grpc-timeout` rewritten, the timers read as one), outcomes are
//! classified by [`classify`](crate::classify), and the request body is the
//! call's [`ReplayBody`], read by its attempts side by side.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tonic::Code;
use tower_service::Service;

use crate::attempt::{Attempt, AttemptFuture, Cut, Failure};
use crate::body::{Credit, ResponseBody};
use crate::budget::Budget;
use crate::call::{
    Last, failure_response, hand_back, mark_given_up, no_response_message, not_replayable,
    previous_attempts,
};
use crate::classify::{
    Verdict, classify_error, classify_response, describe, is_refused_stream, repair_status_details,
};
use crate::hedge::Latencies;
use crate::marks::{
    ALREADY_TRIED, AlreadyTried, IDEMPOTENCY_KEY, PREVIOUS_ATTEMPTS, PickedInstance,
};
use crate::methods::PolicyRef;
use crate::metrics::Event;
use crate::policy::RetryPolicy;
use crate::replay::{ReplayBody, ReplayError};
use crate::shared::{Local, Shared};
use crate::status::{GRPC_STATUS, as_grpc_status, code_name, status_response};
use crate::trace::Metrics;

/// The balancer's report of one attempt's instance.
type Slot = Arc<Mutex<Option<HeaderValue>>>;

/// An attempt in flight.
struct InFlight<F> {
    future: Pin<Box<F>>,
    /// 1 for the call's first attempt.
    number: u32,
    slot: Slot,
    /// When it was started, for the adaptive delay.
    started: Instant,
    /// A transparent retry: it took no place under the extra-load cap.
    transparent: bool,
    /// The budget paid for it: a hedge, or a transparent retry of one
    /// (which carries the hedge's payment).
    paid: bool,
}

impl<F> InFlight<F> {
    /// It was never sent: the place it took under the policy's extra-load
    /// cap, if any, is given back.
    fn never_sent(&self, plan: &crate::hedge::HedgePlan) {
        if !self.transparent {
            plan.never_sent(self.number);
        }
    }
}

pin_project! {
    /// One hedged call: see the [module docs](crate::hedge).
    pub(crate) struct HedgeFuture<S, B, Bu, M>
    where
        S: Service<Request<B>>,
        M: Metrics,
    {
        attempt: Attempt<S, B, Bu, M>,
        shared: Arc<Local<Bu, M>>,
        policy: PolicyRef,
        // The request each attempt is a copy of; dropped once no more
        // attempts can be sent, which lets its body's copy go.
        template: Option<Request<ReplayBody<B>>>,
        inflight: Vec<InFlight<AttemptFuture<S, B, Bu, M>>>,
        // When the next hedge is due, if not now.
        timer: Option<Pin<Box<Sleep>>>,
        // A hedge is due now (the first attempt, or after a non-fatal answer).
        due: bool,
        // The timer is a server's pushback: an answer without one does not
        // cut it short.
        pushed: bool,
        // Attempts started, a transparent retry included.
        started: u32,
        // The number of the attempt whose stream the server refused, once
        // the call's one transparent retry was sent for it (0 before).
        transparent: u32,
        // The idempotency key the call's attempts carry, handed back on a
        // failed call's status.
        key: Option<HeaderValue>,
        // Attempts that reached the inner service.
        sent: u32,
        // Bit n: attempt n was judged never sent.
        unsent_numbers: u32,
        // Hedging stopped because the body is not all there to send again:
        // no transparent retry would find it whole either.
        streaming: bool,
        // No more hedges: pushback said so, the budget or the cap refused,
        // the body cannot be sent again, or the time is up.
        frozen: bool,
        // The end of the call's room: its deadline, or its caller's
        // attempt's end, if sooner.
        room: Option<(Instant, Cut)>,
        // Instances that failed this call.
        failed: AlreadyTried,
        last: Option<Last>,
        // Why the last attempt that was never sent was not, for a call none
        // of whose attempts was.
        unsent: Option<Failure>,
        // A hedge was refused by the budget, the extra-load cap or the time
        // left: a failure then is marked for the layers above.
        refused: bool,
        // The deadline left no time for the next hedge (a server's delay
        // past it, or no time once its service was ready): a call that then
        // fails ends DEADLINE_EXCEEDED.
        no_time: bool,
        // With an adaptive delay: the latencies of the call's method.
        latencies: Option<Arc<Latencies>>,
    }

    impl<S, B, Bu, M> PinnedDrop for HedgeFuture<S, B, Bu, M>
    where
        S: Service<Request<B>>,
        M: Metrics,
    {
        fn drop(this: Pin<&mut Self>) {
            // The caller dropped the call: hedges still waiting for their
            // service were never sent, and give their places under the
            // extra-load cap back. (A call that ended has none in flight.)
            let this = this.project();
            if let Some(plan) = this.shared.policies.get(this.policy).hedge.as_deref() {
                for attempt in this.inflight.iter().filter(|a| !a.future.is_sent()) {
                    attempt.never_sent(plan);
                }
            }
        }
    }
}

impl<S, B, Bu, M> HedgeFuture<S, B, Bu, M>
where
    S: Service<Request<B>>,
    M: Metrics,
{
    pub(crate) fn new(
        attempt: Attempt<S, B, Bu, M>,
        shared: Arc<Local<Bu, M>>,
        policy: PolicyRef,
        request: Request<ReplayBody<B>>,
        room: Option<(Instant, Cut)>,
        tried: AlreadyTried,
    ) -> Self {
        // Hedges read the body side by side with the attempt before them.
        request.body().set_concurrent();
        let key = request.headers().get(IDEMPOTENCY_KEY).cloned();
        let latencies = shared
            .policies
            .get(&policy)
            .hedge
            .as_deref()
            .and_then(|plan| plan.adaptive.as_ref())
            .map(|adaptive| adaptive.of(request.uri().path()));
        Self {
            attempt: attempt.without_report(),
            shared,
            policy,
            template: Some(request),
            inflight: Vec::new(),
            timer: None,
            due: true,
            pushed: false,
            started: 0,
            transparent: 0,
            unsent_numbers: 0,
            streaming: false,
            key,
            sent: 0,
            frozen: false,
            room,
            failed: tried,
            last: None,
            unsent: None,
            refused: false,
            no_time: false,
            latencies,
        }
    }
}

/// What one attempt's outcome means for the call.
enum Judged<RB, M: Metrics> {
    /// The caller gets this: a normal response, `OK`, or a fatal status.
    Commit(Response<ResponseBody<RB, M>>),
    /// Non-fatal: hedge again, at once or after the server's delay; `stop`
    /// when the server asked for no more.
    NonFatal { delay: Option<Duration>, stop: bool },
    /// Never sent (no time, no token, no ready service, no body): no server
    /// answered it, and no more hedges can go either.
    Unsent(Failure),
    /// The call's deadline passed.
    Deadline,
}

/// What polling the attempts in flight came to.
enum Polled<T> {
    /// The call's answer.
    Done(T),
    /// An attempt ended, or one was sent again.
    Progressed,
    /// Nothing ended.
    Idle,
}

impl<S, B, RB, Bu, M> Future for HedgeFuture<S, B, Bu, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    type Output = Response<ResponseBody<RB, M>>;

    // NOTE: no field is pinned (the attempts and the timer are boxed, and
    // nothing pins the rest), so the driver is `Unpin` whatever its
    // parameters, and its steps take it by `&mut`.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            let mut progressed = match this.poll_attempts(cx) {
                Polled::Done(response) => return Poll::Ready(response),
                Polled::Progressed => true,
                Polled::Idle => false,
            };
            this.poll_timer(cx);
            progressed |= this.send_due(cx);
            this.release_to_last();
            if let Some(response) = this.end_if_over(cx) {
                return Poll::Ready(response);
            }
            if !progressed {
                return Poll::Pending;
            }
        }
    }
}

impl<S, B, RB, Bu, M> HedgeFuture<S, B, Bu, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    /// The call's policy.
    fn policy(&self) -> &RetryPolicy {
        self.shared.policies.get(&self.policy)
    }

    /// The most attempts the call may start: its policy's, and a
    /// transparent retry once it made one.
    fn most_attempts(&self) -> u32 {
        self.policy().max_attempts + u32::from(self.transparent != 0)
    }

    /// Polls the attempts in flight, in the order they were sent, and acts
    /// on each that ended.
    fn poll_attempts(&mut self, cx: &mut Context<'_>) -> Polled<Response<ResponseBody<RB, M>>> {
        let mut progressed = false;
        let mut i = 0;
        while i < self.inflight.len() {
            let Poll::Ready(outcome) = self.inflight[i].future.as_mut().poll(cx) else {
                i += 1;
                continue;
            };
            progressed = true;
            let done = self.inflight.remove(i);
            if self.resend_refused(&outcome, &done) {
                continue;
            }
            if let Some(response) = self.after(done, outcome) {
                return Polled::Done(response);
            }
        }
        if progressed {
            Polled::Progressed
        } else {
            Polled::Idle
        }
    }

    /// A stream the server's HTTP/2 library refused: sent again at once,
    /// once a call, as gRPC's transparent retry (see `crate::call`): not a
    /// hedge, not counted, not paid for. Whether it was.
    fn resend_refused(
        &mut self,
        outcome: &Result<Response<ResponseBody<RB, M>>, Failure>,
        done: &InFlight<AttemptFuture<S, B, Bu, M>>,
    ) -> bool {
        let min_attempt_budget = self.policy().min_attempt_budget;
        let refused = self.transparent == 0
            && matches!(outcome, Err(Failure::Transport(error)) if is_refused_stream(&**error))
            && self
                .template
                .as_ref()
                .is_some_and(|template| template.body().whole().is_ok())
            && self.room.is_none_or(|(end, _)| {
                end.saturating_duration_since(Instant::now()) > min_attempt_budget
            });
        if !refused {
            return false;
        }
        self.shared.count_attempt();
        tracing::debug!(
            attempt = done.number,
            "the server refused the stream before its application saw it; sending it again (transparent retry)"
        );
        // The refused attempt is not counted among those sent before it.
        let previous = sent_before(
            self.started + 1,
            (done.number, self.unsent_numbers),
            &self.inflight,
        );
        let policy = self.shared.policies.get(&self.policy);
        let template = self.template.as_ref().expect("checked above");
        let mut request = next_request(
            template,
            (self.started, previous),
            &self.failed,
            &self.inflight,
            policy,
        );
        request.body_mut().set_transparent(true);
        self.started += 1;
        self.transparent = done.number;
        start(
            &mut self.attempt,
            &mut self.inflight,
            policy,
            request,
            (self.started, true, done.paid),
        );
        true
    }

    /// Judges an attempt that ended: the call's answer if it commits it (or
    /// the deadline passed), else what follows is set.
    fn after(
        &mut self,
        done: InFlight<AttemptFuture<S, B, Bu, M>>,
        outcome: Result<Response<ResponseBody<RB, M>>, Failure>,
    ) -> Option<Response<ResponseBody<RB, M>>> {
        let picked = done
            .slot
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let judged = judge(
            outcome,
            self.shared.policies.get(&self.policy),
            &self.shared,
            picked,
            (done.number, done.started, done.paid),
            self.latencies.as_deref(),
            &mut self.sent,
            &mut self.failed,
            &mut self.last,
        );
        match judged {
            Judged::Commit(response) => Some(self.commit(&done, response)),
            Judged::NonFatal { delay, stop } => {
                self.non_fatal(delay, stop);
                None
            }
            Judged::Unsent(failure) => {
                self.unsent(&done, failure);
                None
            }
            Judged::Deadline => Some(self.out_of_time()),
        }
    }

    /// The call commits to `done`'s `response`: the others are drained, not
    /// reset (see `crate::drain`), and the copy goes once they and the
    /// winner are done with it.
    fn commit(
        &mut self,
        done: &InFlight<AttemptFuture<S, B, Bu, M>>,
        mut response: Response<ResponseBody<RB, M>>,
    ) -> Response<ResponseBody<RB, M>> {
        let previous = sent_before(
            done.number,
            (self.transparent, self.unsent_numbers),
            &self.inflight,
        );
        let plan = self.shared.policies.get(&self.policy).hedge.as_deref();
        for mut loser in self.inflight.drain(..) {
            if loser.future.as_mut().abandon() {
                // Sent: an attempt, though it lost.
                self.shared.count_attempt();
            } else if let Some(plan) = plan {
                loser.never_sent(plan);
            }
        }
        // Nothing more is copied, and the copy goes once the winner has read
        // past it — once the attempts being drained are done with it: one may
        // still have to send the body, and failing it would reset its stream
        // after all. The drains end by the deadline.
        if let Some(template) = self.template.take() {
            template.body().release_to(done.number);
        }
        let failed = response
            .headers()
            .get(GRPC_STATUS)
            .is_some_and(|code| code.as_bytes() != b"0");
        if failed || previous > 0 {
            hand_back(
                &mut response,
                previous,
                self.key.as_ref().filter(|_| failed),
            );
        }
        response
    }

    /// A non-fatal answer: the next hedge goes now, or after the server's
    /// `delay`; none more if the server said `stop`, or its delay is longer
    /// than the layer waits or than the call's room.
    fn non_fatal(&mut self, delay: Option<Duration>, stop: bool) {
        if stop {
            self.frozen = true;
        }
        let max_server_delay = self.policy().max_server_delay;
        match delay {
            Some(d) if d > max_server_delay => self.frozen = true,
            Some(d) if !d.is_zero() => {
                let at = Instant::now() + d;
                // Refused by the deadline only if a hedge could still go,
                // its body included.
                let more = !self.frozen
                    && self.started < self.most_attempts()
                    && self
                        .template
                        .as_ref()
                        .is_some_and(|t| t.body().whole().is_ok());
                if more
                    && let Some((end, why)) = self.room
                    && at >= end
                {
                    self.frozen = true;
                    // Refused only by the deadline: see `unsent`.
                    self.refused = why == Cut::Deadline;
                    self.no_time = true;
                    self.shared.record(Event::RefusedByDeadline);
                }
                self.timer = Some(Box::pin(tokio::time::sleep_until(at)));
                self.due = false;
                self.pushed = true;
            }
            // A server asked for the next attempt now.
            Some(_) => {
                self.pushed = false;
                self.due = true;
            }
            // A6: a non-fatal answer sends the next hedge now, unless a
            // server's pushback is still running: the server's word on when
            // stands.
            None => self.due |= !self.pushed,
        }
    }

    /// An attempt was never sent (no time, no token, no ready service, no
    /// body): no more hedges go either.
    fn unsent(&mut self, done: &InFlight<AttemptFuture<S, B, Bu, M>>, failure: Failure) {
        self.frozen = true;
        if let Some(plan) = self.shared.policies.get(&self.policy).hedge.as_deref() {
            done.never_sent(plan);
        }
        self.unsent_numbers |= 1 << done.number.min(31);
        // Not refused for a caller that stops waiting: a retry then is the
        // caller's.
        if done.number > 1
            && matches!(
                failure,
                Failure::NoBudget
                    | Failure::Cut {
                        why: Cut::Deadline | Cut::AttemptTimeout(_) | Cut::Below,
                        ..
                    }
            )
        {
            self.refused = true;
        }
        if let Failure::Cut {
            why: Cut::Deadline | Cut::Caller,
            ..
        } = failure
        {
            // One refusal by the deadline a call: a server's delay past it
            // may have counted it already.
            if done.number > 1 && !self.no_time {
                self.shared.record(Event::RefusedByDeadline);
            }
            self.no_time = true;
        }
        self.unsent = Some(failure);
    }

    /// The call's deadline passed with attempts in flight: each is ended,
    /// and the call with `DEADLINE_EXCEEDED`.
    fn out_of_time(&mut self) -> Response<ResponseBody<RB, M>> {
        let plan = self.shared.policies.get(&self.policy).hedge.as_deref();
        for mut other in self.inflight.drain(..) {
            if other.future.is_sent() {
                self.sent += 1;
                self.shared.count_attempt();
            } else if let Some(plan) = plan {
                other.never_sent(plan);
            }
            other.future.as_mut().out_of_time();
        }
        self.template = None;
        let mut response = status_response(
            Code::DeadlineExceeded,
            "call deadline exceeded while its hedged attempts were in flight",
        );
        if gives_up_marked(self.policy(), self.sent, self.refused) {
            mark_given_up(&mut response, &self.shared.metrics);
        }
        hand_back(
            &mut response,
            self.sent.saturating_sub(1),
            self.key.as_ref(),
        );
        response
    }

    /// The next hedge's time: due once its timer fires.
    fn poll_timer(&mut self, cx: &mut Context<'_>) {
        if !self.due
            && let Some(timer) = self.timer.as_mut()
            && timer.as_mut().poll(cx).is_ready()
        {
            self.timer = None;
            self.due = true;
            self.pushed = false;
        }
    }

    /// Sends the next attempt, if one is due and may go; whether it did.
    fn send_due(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.due || self.frozen || self.started >= self.most_attempts() {
            return false;
        }
        let policy = self.shared.policies.get(&self.policy);
        let plan = policy.hedge.as_deref().expect("a hedged call has a plan");
        // The body is read ahead only once every attempt started is sent: one
        // still waiting for its service must find the body sendable whole
        // when it is ready.
        let ahead = self.inflight.iter().all(|a| a.future.is_sent());
        match may_hedge(&self.template, self.started, plan, (cx, ahead)) {
            May::Send => {
                let template = self.template.as_ref().expect("checked by may_hedge");
                let previous = sent_before(
                    self.started + 1,
                    (self.transparent, self.unsent_numbers),
                    &self.inflight,
                );
                let request = next_request(
                    template,
                    (self.started, previous),
                    &self.failed,
                    &self.inflight,
                    policy,
                );
                self.started += 1;
                start(
                    &mut self.attempt,
                    &mut self.inflight,
                    policy,
                    request,
                    // Every attempt after the first is a hedge, paid for.
                    (self.started, false, self.started > 1),
                );
                // No delay means no timer: a zero-length one would still wait
                // for the timer's next tick.
                let delay = plan.delay_now(self.latencies.as_deref());
                self.due = delay.is_zero();
                self.pushed = false;
                self.timer = (!delay.is_zero()).then(|| Box::pin(tokio::time::sleep(delay)));
                true
            }
            May::NotTheBody => {
                self.frozen = true;
                self.streaming = true;
                body_not_hedged(&self.template, &self.shared, policy);
                false
            }
            May::Capped => {
                self.frozen = true;
                self.refused = true;
                self.shared.metrics.record(Event::HedgeCapped);
                false
            }
            May::Wait => false,
        }
    }

    /// No more hedges, and one attempt left, sent, which no transparent
    /// retry will follow (the call made its one, or the body streams): the
    /// copy goes once it has read past it, and nothing more is copied.
    fn release_to_last(&mut self) {
        if (self.frozen || self.started >= self.most_attempts())
            && (self.transparent != 0 || self.streaming)
            && let [last] = self.inflight.as_slice()
            && last.future.is_sent()
            && let Some(template) = self.template.take()
        {
            template.body().release_to(last.number);
        }
    }

    /// With no attempt in flight and none more to send, the call ends with
    /// how the last one did.
    fn end_if_over(&mut self, cx: &mut Context<'_>) -> Option<Response<ResponseBody<RB, M>>> {
        if !self.inflight.is_empty() {
            return None;
        }
        let more = !self.frozen
            && self.started < self.most_attempts()
            && match self.template.as_ref() {
                Some(t) if t.body().poll_hedgeable(cx, true) == Poll::Ready(true) => true,
                _ => {
                    body_not_hedged(&self.template, &self.shared, self.policy());
                    false
                }
            };
        if more {
            return None;
        }
        self.template = None;
        let unsent = self.unsent.take();
        let mut response = give_up(
            self.last.take(),
            unsent,
            (self.sent, self.refused, self.no_time),
            self.shared.policies.get(&self.policy),
            &self.shared,
        );
        hand_back(
            &mut response,
            self.sent.saturating_sub(1),
            self.key.as_ref(),
        );
        Some(response)
    }
}

/// Starts attempt `number` of the call (a transparent retry if
/// `transparent`; paid for from the budget if `paid`), with a slot for the
/// balancer's report of its instance.
fn start<S, B, RB, Bu, M>(
    attempt: &mut Attempt<S, B, Bu, M>,
    inflight: &mut Vec<InFlight<AttemptFuture<S, B, Bu, M>>>,
    policy: &RetryPolicy,
    mut request: Request<ReplayBody<B>>,
    (number, transparent, paid): (u32, bool, bool),
) where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    let slot: Slot = Arc::default();
    if policy.instance_header.is_some() {
        request
            .extensions_mut()
            .insert(PickedInstance::from_slot(slot.clone()));
    }
    let future = attempt.call(request);
    inflight.push(InFlight {
        future: Box::pin(future),
        number,
        slot,
        started: Instant::now(),
        transparent,
        paid,
    });
}

/// The call's body cannot be sent again: if for a replay limit, that is
/// counted and said, as for a retry.
fn body_not_hedged<B, Bu>(
    template: &Option<Request<ReplayBody<B>>>,
    shared: &Shared<Bu>,
    policy: &RetryPolicy,
) {
    if let Some(template) = template
        && let Err(why @ (ReplayError::Capped | ReplayError::LayerFull)) =
            template.body().replay_state()
    {
        not_replayable(why, shared, policy, true);
    }
}

/// Whether the attempt after `started` ones may be sent now.
enum May {
    Send,
    /// The body is not complete (nor known to fit) when the hedge is due, or
    /// cannot be sent whole again: the call goes on as it is, and nothing
    /// waits for the body.
    NotTheBody,
    /// The policy's extra-load cap refused it.
    Capped,
    /// The first attempt has yet to read the body, which has not stalled:
    /// woken as it reads.
    Wait,
}

/// The first attempt always may be sent; a hedge needs the body complete and
/// within the replay limit, and a place under the policy's extra-load cap.
fn may_hedge<B>(
    template: &Option<Request<ReplayBody<B>>>,
    started: u32,
    plan: &crate::hedge::HedgePlan,
    (cx, ahead): (&mut Context<'_>, bool),
) -> May {
    let Some(template) = template else {
        return May::NotTheBody;
    };
    if started == 0 {
        if let Some((_, account)) = &plan.extra_load {
            // Every call earns its fraction of a hedge.
            account.deposit();
        }
        return May::Send;
    }
    match template.body().poll_hedgeable(cx, ahead) {
        Poll::Pending => return May::Wait,
        Poll::Ready(false) => return May::NotTheBody,
        Poll::Ready(true) => {}
    }
    match &plan.extra_load {
        Some((_, account)) if !account.try_withdraw() => May::Capped,
        _ => May::Send,
    }
}

/// How many of the attempts numbered below `number` were sent: not the one
/// whose stream was refused (`refused`, 0 for none), nor those judged never
/// sent (bit n of `unsent` for attempt n), nor those still waiting to be.
fn sent_before<S, B, Bu, M>(
    number: u32,
    (refused, unsent): (u32, u32),
    inflight: &[InFlight<AttemptFuture<S, B, Bu, M>>],
) -> u32
where
    S: Service<Request<B>>,
    M: Metrics,
{
    (1..number)
        .filter(|&n| {
            n != refused
                && unsent & (1 << n.min(31)) == 0
                && !inflight
                    .iter()
                    .any(|a| a.number == n && !a.future.is_sent())
        })
        .count() as u32
}

/// The request for the attempt after `started` ones, `previous` of them
/// counted as sent before it: a copy of the template, numbered, naming the
/// instances the call has in flight or that failed it, paid for if it is a
/// hedge.
fn next_request<B, F>(
    template: &Request<ReplayBody<B>>,
    (started, previous): (u32, u32),
    failed: &AlreadyTried,
    inflight: &[InFlight<F>],
    policy: &RetryPolicy,
) -> Request<ReplayBody<B>> {
    let mut body = template.body().clone();
    body.set_attempt(started + 1);
    if started > 0 {
        body.set_hedge();
    }
    let mut req = Request::new(body);
    *req.method_mut() = template.method().clone();
    *req.uri_mut() = template.uri().clone();
    *req.version_mut() = template.version();
    *req.headers_mut() = template.headers().clone();
    *req.extensions_mut() = template.extensions().clone();
    if started == 0 {
        return req;
    }
    // A6: hedge k carries the number of attempts sent before it.
    if previous > 0 {
        req.headers_mut()
            .insert(PREVIOUS_ATTEMPTS, previous_attempts(previous));
    } else {
        req.headers_mut().remove(PREVIOUS_ATTEMPTS);
    }
    let mut tried = failed.clone();
    if policy.instance_header.is_some() {
        for attempt in inflight {
            if let Some(id) = attempt
                .slot
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
            {
                tried.record(id);
            }
        }
    }
    if !tried.is_empty() {
        if let Some(value) = tried.to_header() {
            req.headers_mut().insert(ALREADY_TRIED, value);
        }
        req.extensions_mut().insert(tried);
    }
    req
}

/// What an attempt's outcome means for the call, with its bookkeeping: the
/// attempt counted, the budget charged or credited, the failed instance
/// recorded, the last failure kept.
#[allow(clippy::too_many_arguments)]
fn judge<RB, Bu: Budget, M: Metrics>(
    outcome: Result<Response<ResponseBody<RB, M>>, Failure>,
    policy: &RetryPolicy,
    shared: &Arc<Local<Bu, M>>,
    picked: Option<HeaderValue>,
    (number, started, paid): (u32, Instant, bool),
    latencies: Option<&Latencies>,
    sent: &mut u32,
    failed: &mut AlreadyTried,
    last: &mut Option<Last>,
) -> Judged<RB, M> {
    let non_fatal = policy.retryable;
    let (verdict, response) = match outcome {
        Err(
            failure @ (Failure::Cut { sent: false, .. }
            | Failure::NotReady(_)
            | Failure::NoBudget
            | Failure::Unreplayable(_)),
        ) => {
            tracing::debug!(attempt = number, "attempt not sent");
            if matches!(failure, Failure::NoBudget) {
                shared.record(Event::RefusedByBudget);
            }
            return Judged::Unsent(failure);
        }
        Err(Failure::Cut {
            why: Cut::Deadline, ..
        }) => {
            *sent += 1;
            shared.count_attempt();
            return Judged::Deadline;
        }
        Err(Failure::Cut { why, sent: true }) => {
            // Cut by its own timeout (or a timer below) while the call has
            // time: no response at all, which is non-fatal whatever the
            // set says of DEADLINE_EXCEEDED, and the other attempts go on.
            *sent += 1;
            *last = Some(Last::Status {
                code: Code::DeadlineExceeded,
                message: why.message(),
            });
            let verdict = Verdict::Retryable {
                code: Code::DeadlineExceeded,
                server_delay: None,
            };
            (verdict, None)
        }
        Err(Failure::Transport(error)) => {
            *sent += 1;
            let verdict = classify_error(non_fatal);
            let message = no_response_message(number, &describe(&*error));
            if matches!(verdict, Verdict::Final(_)) {
                shared.count_attempt();
                return Judged::Commit(status_response(Code::Unavailable, message));
            }
            *last = Some(Last::Status {
                code: Code::Unavailable,
                message,
            });
            (verdict, None)
        }
        Ok(response) => {
            *sent += 1;
            let verdict = classify_response(response.status(), response.headers(), non_fatal);
            (verdict, Some(response))
        }
    };
    shared.count_attempt();
    let code = verdict.code();
    let non_fatal_code = non_fatal.contains(code) && code != Code::Ok;
    let (delay, stop) = match verdict {
        Verdict::Committed | Verdict::Final(_) if !non_fatal_code => {
            let mut response = response.expect("a verdict on a response");
            if verdict == Verdict::Committed {
                response
                    .body_mut()
                    .credit_on_ok(Arc::clone(shared) as Arc<dyn Credit>, paid);
            } else {
                if code == Code::Ok {
                    shared.credit(paid);
                }
                repair_status_details(response.headers_mut());
                as_grpc_status(&mut response, code);
            }
            if code == Code::Ok
                && let Some(latencies) = latencies
            {
                latencies.record(started.elapsed());
            }
            tracing::debug!(attempt = number, code = code_name(code), "committed");
            return Judged::Commit(response);
        }
        // A non-fatal code whose pushback says "no more" (junk, or the
        // negative mark of a layer below).
        Verdict::Committed | Verdict::Final(_) | Verdict::RetriedBelow(_) => (None, true),
        Verdict::Retryable { server_delay, .. } => (server_delay, false),
    };
    // A6: non-fatal answers (and "do not retry" pushback) charge throttling.
    shared.budget.on_retryable_failure();
    shared.budget_moved();
    let header = policy.instance_header.as_ref();
    let instance = response
        .as_ref()
        .and_then(|r| header.and_then(|h| r.headers().get(h)).cloned())
        .or(picked);
    if let Some(id) = &instance {
        failed.record(id);
    }
    if let Some(mut response) = response {
        *last = Some(Last::Response {
            status: response.status(),
            headers: std::mem::take(response.headers_mut()),
        });
    }
    tracing::debug!(
        attempt = number,
        code = code_name(code),
        instance = instance.as_ref().and_then(|v| v.to_str().ok()).unwrap_or("-"),
        delay = ?delay,
        stop,
        "non-fatal: hedging"
    );
    Judged::NonFatal { delay, stop }
}

/// The call's end when no attempt committed: the last non-fatal failure,
/// marked "do not retry" for the layers above if a hedge was sent, or one was
/// refused by the budget, the cap or the time left after an attempt was.
fn give_up<RB, Bu, M: Metrics>(
    last: Option<Last>,
    unsent: Option<Failure>,
    (sent, refused, out_of_time): (u32, bool, bool),
    policy: &RetryPolicy,
    shared: &Shared<Bu>,
) -> Response<ResponseBody<RB, M>> {
    // The deadline left no time for the next attempt: the call ends
    // DEADLINE_EXCEEDED, naming how the last one ended, as a retried call
    // does.
    let mut response = match last {
        Some(last) if out_of_time => status_response(
            Code::DeadlineExceeded,
            format!(
                "no time left for another attempt; attempt {sent} ended with {}",
                code_name(last.code())
            ),
        ),
        Some(last) => last.into_response(),
        None => match unsent {
            Some(Failure::Cut { why, .. }) => status_response(
                Code::DeadlineExceeded,
                format!("{} before the call could be sent", why.message()),
            ),
            Some(failure) => failure_response(&failure, sent.max(1)),
            None => status_response(Code::Unavailable, "no attempt of the call could be sent"),
        },
    };
    if gives_up_marked(policy, sent, refused) {
        mark_given_up(&mut response, &shared.metrics);
    }
    response
}

/// Whether a hedged call that ends failed with `sent` attempts sent is
/// marked "do not retry" for the layers above: it hedged, or a hedge
/// was refused by the budget, the cap or the time left after an attempt was.
fn gives_up_marked(policy: &RetryPolicy, sent: u32, refused: bool) -> bool {
    policy.retry_at_one_layer && (sent > 1 || (sent > 0 && refused))
}

#[cfg(test)]
mod tests;
