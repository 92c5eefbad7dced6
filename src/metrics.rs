//! What the layer did: [`RetryMetrics`], counters a caller reads (from
//! [`RetryLayer::metrics`](crate::RetryLayer::metrics)), and the
//! [`Metrics`] a layer records into: [`NoMetrics`] by default, gRPC's
//! standard metrics with the `opentelemetry` feature (`otel::Recorder`).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::stripes::{Padded, STRIPES, thread_stripe};
pub use crate::trace::{Metrics, NoMetrics};

/// Counts of what the layer did, shared by every clone of one [`RetryLayer`]
/// and the services it made.
///
/// [`RetryLayer`]: crate::RetryLayer
#[derive(Clone, Default)]
pub struct RetryMetrics {
    inner: Arc<Counters>,
}

#[derive(Default)]
struct Counters {
    /// Attempts, counted in stripes: every call counts one, so one counter
    /// would be written by every thread on every call. A thread counts in
    /// its own stripe ([`thread_stripe`]).
    attempts: [Padded<AtomicU64>; STRIPES],
    retries: AtomicU64,
    transparent_retries: AtomicU64,
    refused_by_budget: AtomicU64,
    refused_by_deadline: AtomicU64,
    retried_below: AtomicU64,
    marked: AtomicU64,
    body_too_large: AtomicU64,
    hedges: AtomicU64,
    hedges_capped: AtomicU64,
    draining: AtomicU64,
    drained: AtomicU64,
    drain_cut: AtomicU64,
    drain_refused: AtomicU64,
}

pub(crate) use event::Event;

// NOTE: `pub` in a private module: the recorders' sealed trait takes it.
mod event {
    /// What to count.
    #[derive(Clone, Copy, Debug)]
    pub enum Event {
        Retry,
        TransparentRetry,
        RefusedByBudget,
        RefusedByDeadline,
        RetriedBelow,
        Marked,
        BodyTooLarge,
        Hedge,
        HedgeCapped,
        Drained,
        DrainCut,
        DrainRefused,
    }
}

impl RetryMetrics {
    pub(crate) fn record(&self, event: Event) {
        let c = &self.inner;
        let counter = match event {
            Event::Retry => &c.retries,
            Event::TransparentRetry => &c.transparent_retries,
            Event::RefusedByBudget => &c.refused_by_budget,
            Event::RefusedByDeadline => &c.refused_by_deadline,
            Event::RetriedBelow => &c.retried_below,
            Event::Marked => &c.marked,
            Event::BodyTooLarge => &c.body_too_large,
            Event::Hedge => &c.hedges,
            Event::HedgeCapped => &c.hedges_capped,
            Event::Drained => &c.drained,
            Event::DrainCut => &c.drain_cut,
            Event::DrainRefused => &c.drain_refused,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an attempt, in the stripe of the thread that sent it.
    #[inline]
    pub(crate) fn attempt(&self) {
        if let Some(Padded(count)) = self.inner.attempts.get(thread_stripe()) {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Attempts sent: first attempts, retries, hedges (the losers of a
    /// hedged call included) and transparent retries, each counted once its
    /// call is done with it. Not an attempt cut before it could be sent, nor
    /// one in flight when its caller dropped the call.
    pub fn attempts(&self) -> u64 {
        self.inner
            .attempts
            .iter()
            .map(|Padded(count)| count.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }

    /// Retries sent, each paid for with one token when it was sent.
    pub fn retries(&self) -> u64 {
        self.inner.retries.load(Ordering::Relaxed)
    }

    /// Transparent retries sent: attempts sent again at once because the
    /// server's HTTP/2 library refused their stream before its application
    /// saw them (`REFUSED_STREAM`, or a graceful `GOAWAY` that did not
    /// take them), at most one a call, whatever its policy. Never paid for,
    /// never counted toward a policy's attempts; not counted in
    /// [`retries`](Self::retries) or [`hedges`](Self::hedges).
    pub fn transparent_retries(&self) -> u64 {
        self.inner.transparent_retries.load(Ordering::Relaxed)
    }

    /// Hedges sent (attempts of a hedged call after its first), each paid
    /// for with one token when it was sent. Not counted in
    /// [`retries`](Self::retries).
    pub fn hedges(&self) -> u64 {
        self.inner.hedges.load(Ordering::Relaxed)
    }

    /// Hedges due but not sent because the policy's extra-load cap
    /// ([`HedgePolicy::with_max_extra_load`](crate::HedgePolicy::with_max_extra_load))
    /// had none left: the call went on with the attempts it had.
    pub fn hedges_capped(&self) -> u64 {
        self.inner.hedges_capped.load(Ordering::Relaxed)
    }

    /// Retryable failures not retried because the budget was empty.
    pub fn refused_by_budget(&self) -> u64 {
        self.inner.refused_by_budget.load(Ordering::Relaxed)
    }

    /// Retryable failures not retried for lack of time: the call's deadline,
    /// or the end of its caller's attempt (`x-attempt-timeout`), had no room
    /// for another attempt.
    pub fn refused_by_deadline(&self) -> u64 {
        self.inner.refused_by_deadline.load(Ordering::Relaxed)
    }

    /// Retryable failures passed up without a retry because they carried the
    /// "do not retry" mark (`grpc-retry-pushback-ms` negative): a retry layer
    /// below had already retried them and given up (or the server asked for
    /// no retry). Not counted in the refusals by budget or deadline.
    pub fn retried_below(&self) -> u64 {
        self.inner.retried_below.load(Ordering::Relaxed)
    }

    /// Failures this layer gave up on and marked "do not retry" for the layers
    /// above (see
    /// [`RetryPolicy::with_retry_at_one_layer`](crate::RetryPolicy::with_retry_at_one_layer)).
    pub fn marked(&self) -> u64 {
        self.inner.marked.load(Ordering::Relaxed)
    }

    /// Retryable failures not retried because the request body outgrew its
    /// replay limit — the call's ([`RetryPolicy::with_replay_limit`]) or the
    /// layer's for all calls in flight
    /// ([`RetryLayer::with_replay_memory`](crate::RetryLayer::with_replay_memory)) —
    /// so no copy was left to send again.
    ///
    /// [`RetryPolicy::with_replay_limit`]: crate::RetryPolicy::with_replay_limit
    pub fn body_too_large(&self) -> u64 {
        self.inner.body_too_large.load(Ordering::Relaxed)
    }

    /// Counts one more drain in progress, unless `max` already are.
    pub(crate) fn start_drain(&self, max: u64) -> bool {
        self.inner
            .draining
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then(|| n + 1)
            })
            .is_ok()
    }

    pub(crate) fn end_drain(&self) {
        self.inner.draining.fetch_sub(1, Ordering::Relaxed);
    }

    /// Abandoned attempts being drained now: attempts a hedged call no
    /// longer needs, or that its per-attempt timeout cut, read to their end
    /// in a task of their own rather than reset (see
    /// [`HedgePolicy`](crate::HedgePolicy) and
    /// [`RetryPolicy::with_attempt_timeout`](crate::RetryPolicy::with_attempt_timeout)).
    pub fn draining(&self) -> u64 {
        self.inner.draining.load(Ordering::Relaxed)
    }

    /// Abandoned attempts read to their end: their streams ended with no
    /// reset.
    pub fn drained(&self) -> u64 {
        self.inner.drained.load(Ordering::Relaxed)
    }

    /// Drains that ran into a bound (the call's deadline, else 10 s; 64 KiB
    /// of response body) and so reset their streams after all.
    pub fn drain_cut(&self) -> u64 {
        self.inner.drain_cut.load(Ordering::Relaxed)
    }

    /// Abandoned attempts reset at once instead of drained: 1,024 were
    /// already draining through this layer, or there was no tokio runtime to
    /// drain on.
    pub fn drain_refused(&self) -> u64 {
        self.inner.drain_refused.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for RetryMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryMetrics")
            .field("attempts", &self.attempts())
            .field("retries", &self.retries())
            .field("hedges", &self.hedges())
            .field("hedges_capped", &self.hedges_capped())
            .field("refused_by_budget", &self.refused_by_budget())
            .field("refused_by_deadline", &self.refused_by_deadline())
            .field("retried_below", &self.retried_below())
            .field("marked", &self.marked())
            .field("body_too_large", &self.body_too_large())
            .field("draining", &self.draining())
            .field("drained", &self.drained())
            .field("drain_cut", &self.drain_cut())
            .field("drain_refused", &self.drain_refused())
            .finish()
    }
}
