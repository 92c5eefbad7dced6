//! Hedging: the policy, and the driver that makes a hedged call's attempts.

mod future;
mod latency;

pub(crate) use future::HedgeFuture;
pub(crate) use latency::{Latencies, PerMethod};

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tonic::Code;

use crate::budget::RetryBudget;
use crate::error::ConfigError;
use crate::policy::{MAX_ATTEMPTS_LIMIT, RetryPolicy, RetryableCodes};

/// Hedging: when an attempt is slow, send another copy to another instance
/// and take the first good answer (gRPC A6's `hedgingPolicy`).
///
/// Retries fix failures; they do not fix slowness. A call stuck on a slow
/// instance waits out its deadline while the other instances idle. A
/// [`HedgePolicy`] sends the first attempt at once and, while no attempt has
/// committed, another every hedging delay, up to `max_attempts`; the first
/// attempt to commit wins, and the others no longer reach the caller.
///
/// * **What commits:** response headers that start a normal response, or a
///   status that is *fatal* (not among the non-fatal codes). A *non-fatal*
///   answer (by default `UNAVAILABLE`, and no response at all) commits
///   nothing: the next hedge goes at once instead of waiting out its delay.
///   When every attempt failed non-fatally, the call fails with the last one.
/// * **Pushback:** `grpc-retry-pushback-ms: n` on a non-fatal answer delays
///   the next hedge to `n` ms from then; a negative value stops hedging (the
///   attempts in flight go on).
/// * **Paid for:** each hedge after the first attempt takes a token from the
///   layer's budget when it is sent (with [`RetryThrottle`](crate::budgets::RetryThrottle),
///   only while it allows retries), and the policy's extra-load cap bounds
///   hedges to a fraction of its calls however large the budget.
/// * **Elsewhere:** every hedge carries the call's idempotency key,
///   `grpc-previous-rpc-attempts`, and an already-tried mark naming the
///   instances the call has in flight or that failed, so
///   [`PreferUntried`](crate::balance::PreferUntried) sends it to another
///   instance.
/// * **Under the deadline** as every attempt is: sent with `grpc-timeout` set
///   to the time left, and none with less than the minimum attempt budget.
/// * **Bodies:** a hedge replays the request's copy, so it is sent only when
///   the body is complete (or of a known size) and within the replay limit.
///   When a hedge is due and the first attempt (sent) has yet to read the
///   body, the body is read ahead into the copy the attempts send, so a first
///   attempt slow before it reads (its connection full, or being made) does
///   not hold the hedge back. A body that answers `Pending` (a client stream),
///   or outgrows the replay limit, is not hedged, and nothing waits for it;
///   what was read ahead goes to the attempt sent, whole.
///
/// A method either retries or hedges, never both (A6).
///
/// # The losers, and HTTP/2 resets
///
/// A loser is not reset: dropping an attempt whose stream is open resets
/// it, the server's answer already on its way then lands on a stream the
/// client reset, and h2 closes the whole connection after 1,024 such frames
/// on streams it no longer remembers (`too_many_internal_resets`; it
/// remembers 50 for a second). With every call hedged that took a connection
/// every 7,000 calls or so (3 in a 20,000-call run of the tail example). So
/// each loser is handed to a task that reads it to its end and throws the
/// answer away, bounded by the call's deadline (else 10 s), 64 KiB of body
/// and 1,024 drains at once per layer; past a bound it is reset after all ([`RetryMetrics::drained`](crate::metrics::RetryMetrics::drained),
/// [`drain_cut`](crate::metrics::RetryMetrics::drain_cut),
/// [`drain_refused`](crate::metrics::RetryMetrics::drain_refused)). A call the caller
/// drops is cancelled at once, its attempts reset, drained ones included.
///
/// What only the channel can set: how many reset streams h2 remembers, and
/// for how long — the resets that remain (a drain past its bound, a dropped
/// call, a deadline) are then never counted against the connection. Raise
/// them where calls are cancelled in numbers:
///
/// ```no_run
/// # use std::time::Duration;
/// use tonic::transport::Endpoint;
///
/// let channel = Endpoint::from_static("http://[::1]:50051")
///     .http2_max_concurrent_reset_streams(4096) // h2's default: 50
///     .http2_reset_stream_duration(Duration::from_secs(5)) // h2's default: 1 s
///     .connect_lazy();
/// # let _ = channel;
/// ```
///
/// With those at tonic's defaults, the tail example (`cargo run --release
/// --example tail -- 10`) hedges every one of 20,000 calls in its stress row
/// and closes no connection.
///
/// # The policy
///
/// Made by [`HedgePolicy::new`], refined with the `with_*` settings, and used
/// wherever a [`RetryPolicy`] is: [`RetryLayer::new`](crate::RetryLayer::new),
/// or a [`MethodPolicies`](crate::MethodPolicies) entry. The settings a hedge
/// shares with a retry (the deadline, the per-attempt timeout, the minimum
/// attempt budget, the replay limit, the idempotency key, the instance header,
/// retry at one layer) are [`RetryPolicy`]'s defaults unless taken from one
/// with [`with_settings_of`](Self::with_settings_of).
///
/// | setting | default |
/// |---|---|
/// | `max_attempts` (the first included) | as given, 2..=5 |
/// | hedging delay | as given (zero sends every attempt at once) |
/// | non-fatal codes | `UNAVAILABLE` (and no response at all) |
/// | extra-load cap | 5 % of the policy's calls |
///
/// ```
/// use std::time::Duration;
/// use tonic_retry::{HedgePolicy, MethodPolicies, RetryPolicy};
///
/// # fn main() -> Result<(), tonic_retry::ConfigError> {
/// let reads = HedgePolicy::new(3, Duration::from_millis(10))?
///     .with_settings_of(&RetryPolicy::default().with_total_timeout(Duration::from_secs(1)));
/// let policies = MethodPolicies::with_default(RetryPolicy::default())
///     .with_method("library.v1.Library", "GetBook", reads)?;
/// let get_book = policies.policy_for("/library.v1.Library/GetBook");
/// assert_eq!(get_book.hedge_delay(), Some(Duration::from_millis(10)));
/// assert_eq!(policies.policy_for("/library.v1.Library/ReserveStock").hedge_delay(), None);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct HedgePolicy {
    /// The shared settings, with the hedge's attempts in `max_attempts` and
    /// its non-fatal codes in `retryable`; `hedge` is always set.
    policy: RetryPolicy,
}

/// The default extra-load cap: hedges at most this fraction of calls.
const DEFAULT_MAX_EXTRA_LOAD: f64 = 0.05;

/// The samples an adaptive delay's window must hold before it is used.
const ADAPTIVE_MIN_SAMPLES: u64 = 100;

/// The hedges the extra-load account can save up for a burst. With 10, the
/// tail example's adaptive row (32 calls in flight) had 0–32 hedges a run
/// refused by the cap in clusters of slow answers, and its p99.9 went past
/// 12 ms in runs that did; with 100, none.
const EXTRA_LOAD_BURST: u32 = 100;

/// What a hedging policy adds to a [`RetryPolicy`]'s settings.
pub(crate) struct HedgePlan {
    pub(crate) delay: Duration,
    /// When the delay follows the method's latency: its recent successful
    /// attempts.
    pub(crate) adaptive: Option<PerMethod>,
    /// The extra-load cap, as a fraction of calls, and the account that
    /// keeps hedges to it: every call deposits the fraction, every hedge
    /// takes one. `None`: no cap but the budget's.
    pub(crate) extra_load: Option<(f64, RetryBudget)>,
}

impl fmt::Debug for HedgePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HedgePlan")
            .field("delay", &self.delay)
            .field("adaptive", &self.adaptive)
            .field("max_extra_load", &self.extra_load.as_ref().map(|(f, _)| f))
            .finish()
    }
}

impl HedgePlan {
    fn new(delay: Duration, max_extra_load: Option<f64>) -> Self {
        let extra_load = max_extra_load.map(|fraction| {
            let account = RetryBudget::new(EXTRA_LOAD_BURST, fraction.max(0.001))
                .expect("a fraction of at least 0.001, below the burst, is a valid budget");
            (fraction, account)
        });
        Self {
            delay,
            adaptive: None,
            extra_load,
        }
    }

    /// Attempt `number` of a call was never sent: a hedge gives its place
    /// under the extra-load cap back.
    pub(crate) fn never_sent(&self, number: u32) {
        if number > 1
            && let Some((_, account)) = &self.extra_load
        {
            account.refund();
        }
    }

    /// The delay before the next hedge now, for a call whose method's
    /// latencies (with an adaptive delay) are `latencies`.
    pub(crate) fn delay_now(&self, latencies: Option<&Latencies>) -> Duration {
        match latencies {
            Some(latencies) => latencies.delay(self.delay),
            None => self.delay,
        }
    }
}

impl HedgePolicy {
    /// A policy sending up to `max_attempts` attempts (the first included),
    /// one more every `delay` while none has committed; a zero `delay` sends
    /// them all at once.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming `max_attempts` unless it is within `2..=5`.
    pub fn new(max_attempts: u32, delay: Duration) -> Result<Self, ConfigError> {
        if !(2..=MAX_ATTEMPTS_LIMIT).contains(&max_attempts) {
            return Err(ConfigError::new(
                "max_attempts",
                format!(
                    "a hedging policy sends 2..={MAX_ATTEMPTS_LIMIT} attempts (the first counts), got {max_attempts}"
                ),
            ));
        }
        let policy = RetryPolicy {
            max_attempts,
            retryable: RetryableCodes::empty().with(Code::Unavailable),
            hedge: Some(Arc::new(HedgePlan::new(
                delay,
                Some(DEFAULT_MAX_EXTRA_LOAD),
            ))),
            ..RetryPolicy::default()
        };
        Ok(Self { policy })
    }

    /// The codes that commit nothing: an attempt ending with one of them lets
    /// the next hedge go at once. Every other code is fatal, ends the call
    /// with it, and cancels the other attempts.
    #[must_use]
    pub fn with_non_fatal_codes(mut self, codes: RetryableCodes) -> Self {
        self.policy.retryable = codes;
        self
    }

    /// Hedges at most `fraction` of this policy's calls (default 0.05: 5 %),
    /// whatever the budget allows; up to 100 hedges may be saved up for a
    /// burst (50 at the start), so that a client with many calls in flight
    /// hedges a cluster of slow answers rather than the first few of it.
    /// [`RetryMetrics::hedges_capped`](crate::metrics::RetryMetrics::hedges_capped)
    /// counts the hedges it refused. `None` leaves only the budget to bound
    /// them.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming `max_extra_load` unless `fraction` is a number
    /// in `0.001..=4.0` (four hedges a call is the most five attempts send).
    pub fn with_max_extra_load(mut self, fraction: Option<f64>) -> Result<Self, ConfigError> {
        if let Some(fraction) = fraction
            && !(0.001..=f64::from(MAX_ATTEMPTS_LIMIT - 1)).contains(&fraction)
        {
            return Err(ConfigError::new(
                "max_extra_load",
                format!("must be a fraction of calls within 0.001..=4, got {fraction}"),
            ));
        }
        let plan = self.plan();
        let mut new = HedgePlan::new(plan.delay, fraction);
        new.adaptive = plan.adaptive.as_ref().map(PerMethod::fresh);
        self.policy.hedge = Some(Arc::new(new));
        Ok(self)
    }

    /// Makes the delay follow the method's latency (beyond A6): the
    /// `percentile` (e.g. `0.95`) of the latencies of its successful
    /// attempts over the last `window`, never below `floor`. Each method the
    /// policy serves has a window of its own (the first 256; any more share
    /// one). Until the
    /// window holds 100 of them the configured delay is used, so the policy
    /// hedges from its first call.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tonic_retry::HedgePolicy;
    ///
    /// # fn main() -> Result<(), tonic_retry::ConfigError> {
    /// let policy = HedgePolicy::new(2, Duration::from_millis(10))?
    ///     .with_adaptive_delay(0.95, Duration::from_secs(10), Duration::from_millis(2))?;
    /// assert_eq!(policy.delay(), Duration::from_millis(10), "until the window fills");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming `percentile` unless it is within `(0, 1]`, or
    /// `window` unless it is at least 2 ms.
    pub fn with_adaptive_delay(
        mut self,
        percentile: f64,
        window: Duration,
        floor: Duration,
    ) -> Result<Self, ConfigError> {
        if !(percentile > 0.0 && percentile <= 1.0) {
            return Err(ConfigError::new(
                "percentile",
                format!("must be within (0, 1], got {percentile}"),
            ));
        }
        if window < Duration::from_millis(2) {
            return Err(ConfigError::new(
                "window",
                format!("must be at least 2 ms, got {window:?}"),
            ));
        }
        let plan = self.plan();
        let mut new = HedgePlan::new(plan.delay, self.max_extra_load());
        new.adaptive = Some(PerMethod::new(Latencies::new(
            window,
            percentile,
            floor,
            ADAPTIVE_MIN_SAMPLES,
        )));
        self.policy.hedge = Some(Arc::new(new));
        Ok(self)
    }

    /// Takes from `policy` every setting a hedge shares with a retry: the
    /// total and longest timeouts, the per-attempt timeout, the minimum
    /// attempt budget, the longest server-given delay, the replay limit, the
    /// idempotency key, the instance header and retry at one layer.
    #[must_use]
    pub fn with_settings_of(mut self, policy: &RetryPolicy) -> Self {
        let hedge = self.policy.hedge.take();
        let (attempts, codes) = (self.policy.max_attempts, self.policy.retryable);
        self.policy = policy.clone();
        self.policy.hedge = hedge;
        self.policy.max_attempts = attempts;
        self.policy.retryable = codes;
        self
    }

    /// The most attempts a call sends, the first included.
    pub fn max_attempts(&self) -> u32 {
        self.policy.max_attempts
    }

    /// The time between one attempt and the next hedge, as configured; with
    /// [`with_adaptive_delay`](Self::with_adaptive_delay), the one each
    /// method starts from until its own latencies say otherwise.
    pub fn delay(&self) -> Duration {
        self.plan().delay
    }

    /// The codes that commit nothing.
    pub fn non_fatal_codes(&self) -> RetryableCodes {
        self.policy.retryable
    }

    /// The extra-load cap, as a fraction of calls, if any.
    pub fn max_extra_load(&self) -> Option<f64> {
        self.plan()
            .extra_load
            .as_ref()
            .map(|(fraction, _)| *fraction)
    }

    fn plan(&self) -> &HedgePlan {
        self.policy
            .hedge
            .as_deref()
            .expect("a hedging policy has a plan")
    }
}

impl From<HedgePolicy> for RetryPolicy {
    /// The hedging policy as the layer carries it: a [`RetryPolicy`] whose
    /// [`hedge_delay`](RetryPolicy::hedge_delay) is set, its
    /// [`max_attempts`](RetryPolicy::max_attempts) the hedge's, and its
    /// [`retryable_codes`](RetryPolicy::retryable_codes) the non-fatal ones.
    fn from(policy: HedgePolicy) -> Self {
        policy.policy
    }
}

impl From<HedgePolicy> for crate::MethodPolicies {
    /// A table where `policy` is the default for every method.
    fn from(policy: HedgePolicy) -> Self {
        Self::with_default(policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attempts_are_within_a6s_limits() {
        for bad in [0, 1, 6, u32::MAX] {
            let e = HedgePolicy::new(bad, Duration::ZERO).unwrap_err();
            assert_eq!(e.field(), "max_attempts");
        }
        for good in 2..=5 {
            let p = HedgePolicy::new(good, Duration::from_millis(5)).unwrap();
            assert_eq!(p.max_attempts(), good);
            assert_eq!(p.delay(), Duration::from_millis(5));
        }
    }

    #[test]
    fn defaults_and_settings() {
        let p = HedgePolicy::new(3, Duration::from_millis(10)).unwrap();
        assert_eq!(
            p.non_fatal_codes(),
            RetryableCodes::empty().with(Code::Unavailable)
        );
        assert_eq!(p.max_extra_load(), Some(0.05));
        let p = p.with_max_extra_load(None).unwrap();
        assert_eq!(p.max_extra_load(), None);
        for bad in [0.0, -1.0, 4.5, f64::NAN, f64::INFINITY] {
            let e = HedgePolicy::new(3, Duration::ZERO)
                .unwrap()
                .with_max_extra_load(Some(bad))
                .unwrap_err();
            assert_eq!(e.field(), "max_extra_load");
        }
        let base = RetryPolicy::default()
            .with_total_timeout(Duration::from_secs(2))
            .with_idempotency_key(false);
        let p = HedgePolicy::new(4, Duration::from_millis(7))
            .unwrap()
            .with_settings_of(&base);
        let carried = RetryPolicy::from(p);
        assert_eq!(
            carried.max_attempts(),
            4,
            "the hedge's attempts, not the base's"
        );
        assert_eq!(carried.hedge_delay(), Some(Duration::from_millis(7)));
        assert_eq!(
            carried.total_timeout.map(|timeout| timeout.duration),
            Some(Duration::from_secs(2))
        );
        assert!(!carried.idempotency_key);
        assert_eq!(RetryPolicy::default().hedge_delay(), None);
    }
}
