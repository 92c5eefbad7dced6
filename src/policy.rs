//! What to retry, how long to wait, and how much time one call may take.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use rand::Rng;
use tonic::Code;

use crate::deadline::PolicyTimeout;
use crate::error::ConfigError;
use crate::hedge::HedgePlan;

/// The most attempts a call may make (see [`RetryPolicy::MAX_ATTEMPTS`]).
pub(crate) const MAX_ATTEMPTS_LIMIT: u32 = 5;

/// See [`RetryPolicy::DEFAULT_MAX_SERVER_DELAY`].
pub(crate) const DEFAULT_MAX_SERVER_DELAY: Duration = Duration::from_secs(30);

/// See [`RetryPolicy::DEFAULT_REPLAY_LIMIT`].
pub(crate) const DEFAULT_REPLAY_LIMIT: usize = 1 << 20;

/// The set of status codes the layer may retry, and for each the rule it
/// follows ([`RetryWhen`]).
///
/// A code added with [`with`](Self::with) is retried whenever an attempt
/// ends with it, as gRPC's A6 retries every code in `retryableStatusCodes`
/// (and as a [service config](crate::service_config) reads its list). One
/// added with [`with_retry_info`](Self::with_retry_info) is retried only when
/// the status carries `google.rpc.RetryInfo`. Either way, a `RetryInfo`
/// delay the server sent is waited for instead of the backoff, and
/// `DEADLINE_EXCEEDED` is retried only while the call's deadline has room.
///
/// The default is `UNAVAILABLE` and `DEADLINE_EXCEEDED` always, and
/// `RESOURCE_EXHAUSTED` only with `RetryInfo`: without it, a resource
/// exhausted is a wall (a full queue, a memory guard) that a retry only hits
/// again; with it, it is a rate limit with a time to come back.
///
/// ```
/// use tonic::Code;
/// use tonic_retry::{RetryWhen, RetryableCodes};
///
/// let codes = RetryableCodes::default().without(Code::DeadlineExceeded);
/// assert_eq!(codes.when(Code::Unavailable), Some(RetryWhen::Always));
/// assert_eq!(codes.when(Code::ResourceExhausted), Some(RetryWhen::WithRetryInfo));
/// assert_eq!(codes.when(Code::DeadlineExceeded), None);
///
/// // A set written out retries each of its codes always, as A6 does.
/// let written = RetryableCodes::empty().with(Code::Unavailable).with(Code::ResourceExhausted);
/// assert_eq!(written.when(Code::ResourceExhausted), Some(RetryWhen::Always));
/// assert_eq!(format!("{written:?}"), "{ResourceExhausted, Unavailable}");
/// assert_eq!(
///     format!("{:?}", RetryableCodes::default()),
///     "{DeadlineExceeded, ResourceExhausted (with RetryInfo), Unavailable}"
/// );
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct RetryableCodes {
    always: u32,
    with_retry_info: u32,
}

/// When a code in a [`RetryableCodes`] set is retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryWhen {
    /// Whenever an attempt ends with it (gRPC A6's `retryableStatusCodes`).
    Always,
    /// Only when the status carries `google.rpc.RetryInfo` (the default for
    /// `RESOURCE_EXHAUSTED`).
    WithRetryInfo,
}

impl RetryableCodes {
    /// No code at all: nothing is retried.
    pub const fn empty() -> Self {
        Self {
            always: 0,
            with_retry_info: 0,
        }
    }

    /// Adds `code`, retried whenever an attempt ends with it (replacing any
    /// rule it had).
    #[must_use]
    pub const fn with(self, code: Code) -> Self {
        Self {
            always: self.always | Self::bit(code),
            with_retry_info: self.with_retry_info & !Self::bit(code),
        }
    }

    /// Adds `code`, retried only when the status carries
    /// `google.rpc.RetryInfo` (replacing any rule it had).
    #[must_use]
    pub const fn with_retry_info(self, code: Code) -> Self {
        Self {
            always: self.always & !Self::bit(code),
            with_retry_info: self.with_retry_info | Self::bit(code),
        }
    }

    /// Removes `code` from the set.
    #[must_use]
    pub const fn without(self, code: Code) -> Self {
        Self {
            always: self.always & !Self::bit(code),
            with_retry_info: self.with_retry_info & !Self::bit(code),
        }
    }

    /// Whether `code` is in the set, under either rule.
    pub const fn contains(self, code: Code) -> bool {
        (self.always | self.with_retry_info) & Self::bit(code) != 0
    }

    /// The rule `code` is retried by, if it is in the set.
    pub const fn when(self, code: Code) -> Option<RetryWhen> {
        if self.always & Self::bit(code) != 0 {
            Some(RetryWhen::Always)
        } else if self.with_retry_info & Self::bit(code) != 0 {
            Some(RetryWhen::WithRetryInfo)
        } else {
            None
        }
    }

    const fn bit(code: Code) -> u32 {
        // Codes are 0..=16, so the shift always fits.
        1 << (code as u32 & 31)
    }
}

impl Default for RetryableCodes {
    fn default() -> Self {
        Self::empty()
            .with(Code::Unavailable)
            .with(Code::DeadlineExceeded)
            .with_retry_info(Code::ResourceExhausted)
    }
}

/// Each code retried always, as a list of A6's `retryableStatusCodes` is.
impl FromIterator<Code> for RetryableCodes {
    fn from_iter<I: IntoIterator<Item = Code>>(iter: I) -> Self {
        iter.into_iter().fold(Self::empty(), Self::with)
    }
}

impl fmt::Debug for RetryableCodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Entry(Code, RetryWhen);
        impl fmt::Debug for Entry {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.1 {
                    RetryWhen::WithRetryInfo => write!(f, "{:?} (with RetryInfo)", self.0),
                    _ => write!(f, "{:?}", self.0),
                }
            }
        }
        f.debug_set()
            .entries(
                (0..=16)
                    .map(Code::from_i32)
                    .filter_map(|c| Some(Entry(c, self.when(c)?))),
            )
            .finish()
    }
}

/// How the layer retries: attempts, backoff, time limits and what it adds to
/// each request.
///
/// Built by [`RetryPolicy::new`] (or [`Default`]) and refined with the `with_*`
/// settings; every setting is checked when it is made, so a policy that exists
/// is valid.
///
/// | setting | default |
/// |---|---|
/// | `max_attempts` (first attempt included) | 3 |
/// | `base_delay` / `max_delay` | 20 ms / 500 ms |
/// | backoff multiplier | 2 |
/// | `jitter` (± fraction) | 0.20 |
/// | retryable codes | `UNAVAILABLE`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED` |
/// | total timeout (without `grpc-timeout`) | none |
/// | longest timeout (caps the caller's deadline) | none |
/// | per-attempt timeout | none |
/// | minimum attempt budget | 20 ms |
/// | longest server-given delay waited for | 30 s |
/// | replay buffer limit, per call | 1 MiB (the layer's for all calls in flight: 16 MiB) |
/// | retry at one layer (mark a give-up `grpc-retry-pushback-ms: -1`) | on |
/// | idempotency key generation | on (`x-idempotency-key`) |
/// | instance id response header | `x-instance-id` |
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tonic_retry::RetryPolicy;
///
/// # fn main() -> Result<(), tonic_retry::ConfigError> {
/// let policy = RetryPolicy::new(4, Duration::from_millis(10), Duration::from_millis(200), 0.2)?
///     .with_total_timeout(Duration::from_secs(2))
///     .with_attempt_timeout(Duration::from_millis(500));
/// let first = policy.delay_before(1);
/// assert!(first >= Duration::from_millis(8) && first <= Duration::from_millis(12));
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) base_delay: Duration,
    pub(crate) max_delay: Duration,
    pub(crate) multiplier: f64,
    pub(crate) jitter: f64,
    /// Draw each backoff from `[0, raw]` ("full jitter") instead of
    /// `raw · (1 ± jitter)`.
    pub(crate) full_jitter: bool,
    pub(crate) retryable: RetryableCodes,
    pub(crate) total_timeout: Option<PolicyTimeout>,
    pub(crate) max_timeout: Option<PolicyTimeout>,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) min_attempt_budget: Duration,
    pub(crate) max_server_delay: Duration,
    pub(crate) replay_limit: usize,
    pub(crate) idempotency_key: bool,
    pub(crate) instance_header: Option<HeaderName>,
    pub(crate) retry_at_one_layer: bool,
    /// An `x-already-tried` header the caller set is merged into the call's
    /// mark, rather than removed.
    pub(crate) callers_mark_trusted: bool,
    /// Set for a hedging policy (made by [`HedgePolicy`](crate::HedgePolicy)):
    /// the method hedges instead of retrying.
    pub(crate) hedge: Option<Arc<HedgePlan>>,
}

impl RetryPolicy {
    /// The most attempts a call may make, first attempt included (as in
    /// gRPC's A6; a service config's larger values are read as this).
    pub const MAX_ATTEMPTS: u32 = MAX_ATTEMPTS_LIMIT;

    /// The longest server-given delay a retry waits for by default; see
    /// [`with_max_server_delay`](Self::with_max_server_delay).
    pub const DEFAULT_MAX_SERVER_DELAY: Duration = DEFAULT_MAX_SERVER_DELAY;

    /// The most request body bytes a call keeps for replay by default
    /// (grpc-java's per-call limit); see
    /// [`with_replay_limit`](Self::with_replay_limit).
    pub const DEFAULT_REPLAY_LIMIT: usize = DEFAULT_REPLAY_LIMIT;

    /// A policy making at most `max_attempts` attempts (first included), waiting
    /// `min(base_delay · 2^(k-1), max_delay) · (1 ± jitter)` before retry `k`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the field when `max_attempts` is outside `1..=5`,
    /// `max_delay < base_delay`, or `jitter` is not a number in `0.0..=1.0`.
    pub fn new(
        max_attempts: u32,
        base_delay: Duration,
        max_delay: Duration,
        jitter: f64,
    ) -> Result<Self, ConfigError> {
        if !(1..=MAX_ATTEMPTS_LIMIT).contains(&max_attempts) {
            return Err(ConfigError::new(
                "max_attempts",
                format!(
                    "must be within 1..={MAX_ATTEMPTS_LIMIT} (the first attempt counts), got {max_attempts}"
                ),
            ));
        }
        if max_delay < base_delay {
            return Err(ConfigError::new(
                "max_delay",
                format!("must not be less than base_delay ({base_delay:?}), got {max_delay:?}"),
            ));
        }
        // `contains` is false for NaN, so NaN is rejected here too.
        if !(0.0..=1.0).contains(&jitter) {
            return Err(ConfigError::new(
                "jitter",
                format!("must be a fraction within 0.0..=1.0, got {jitter}"),
            ));
        }
        Ok(Self {
            max_attempts,
            base_delay,
            max_delay,
            multiplier: 2.0,
            jitter,
            full_jitter: false,
            retryable: RetryableCodes::default(),
            total_timeout: None,
            max_timeout: None,
            attempt_timeout: None,
            min_attempt_budget: Duration::from_millis(20),
            max_server_delay: DEFAULT_MAX_SERVER_DELAY,
            replay_limit: DEFAULT_REPLAY_LIMIT,
            idempotency_key: true,
            instance_header: Some(crate::marks::INSTANCE_ID),
            retry_at_one_layer: true,
            callers_mark_trusted: false,
            hedge: None,
        })
    }

    /// A policy that never retries: one attempt, no idempotency key generated,
    /// no instance ids learned. A call under it passes through the layer with
    /// only its deadline applied (see [`MethodPolicies`](crate::MethodPolicies),
    /// where it is the default for methods without a policy), and gRPC's
    /// transparent retry: a stream the server refused before its application
    /// saw it is sent once more, at once.
    pub fn no_retry() -> Self {
        let mut policy = Self::new(1, Duration::ZERO, Duration::ZERO, 0.0)
            .expect("one attempt and no delays are valid");
        policy.idempotency_key = false;
        policy.instance_header = None;
        policy
    }

    /// This policy with one attempt and no hedging: what a method that is
    /// not retried, or a call told not to retry, follows.
    pub(crate) fn single_attempt(&self) -> Self {
        let mut policy = self.clone();
        policy.max_attempts = 1;
        policy.hedge = None;
        policy
    }

    /// Grows the backoff by `multiplier` per retry instead of 2 (gRPC's
    /// `backoffMultiplier`): retry `k` waits
    /// `min(base_delay · multiplier^(k-1), max_delay) · (1 ± jitter)`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming `backoff_multiplier` unless it is a finite
    /// number greater than 0.
    pub fn with_backoff_multiplier(mut self, multiplier: f64) -> Result<Self, ConfigError> {
        if !(multiplier.is_finite() && multiplier > 0.0) {
            return Err(ConfigError::new(
                "backoff_multiplier",
                format!("must be a finite number greater than 0, got {multiplier}"),
            ));
        }
        self.multiplier = multiplier;
        Ok(self)
    }

    /// Draws each backoff uniformly from `[0, raw]`, where
    /// `raw = min(base_delay · multiplier^(k-1), max_delay)` — "full jitter",
    /// as AWS's architecture blog named it — instead of `raw · (1 ± jitter)`.
    ///
    /// gRPC's retry design (A6) drew full jitter until August 2024, and
    /// grpc-java did until 1.80; A6, grpc-go, grpc-java and C-core now draw
    /// `raw · random(0.8, 1.2)`, as this crate's default policy and every
    /// policy read from a [service config](crate::service_config) do. Full
    /// jitter spreads retries wider, and its mean wait is half as long.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tonic_retry::RetryPolicy;
    ///
    /// let policy = RetryPolicy::default().with_full_jitter();
    /// assert!(policy.delay_before(1) <= Duration::from_millis(20));
    /// ```
    #[must_use]
    pub fn with_full_jitter(mut self) -> Self {
        self.full_jitter = true;
        self
    }

    /// The longest a call may take: its deadline is the sooner of the
    /// caller's (`grpc-timeout`, or [`with_total_timeout`](Self::with_total_timeout))
    /// and `timeout` from the start of the call, as gRPC service config's
    /// per-method `timeout` caps the application's deadline.
    #[must_use]
    pub fn with_max_timeout(mut self, timeout: Duration) -> Self {
        self.max_timeout = Some(PolicyTimeout::new(timeout));
        self
    }

    /// The codes that may be retried (see [`RetryableCodes`]).
    #[must_use]
    pub fn with_retryable_codes(mut self, codes: RetryableCodes) -> Self {
        self.retryable = codes;
        self
    }

    /// The deadline for calls whose request carries no `grpc-timeout` header:
    /// all attempts and waits of one call share it.
    #[must_use]
    pub fn with_total_timeout(mut self, timeout: Duration) -> Self {
        self.total_timeout = Some(PolicyTimeout::new(timeout));
        self
    }

    /// Cuts each attempt after `timeout` (or at the call's deadline, if sooner),
    /// so that one slow instance can be retried on another while the call's
    /// deadline still has room.
    ///
    /// A per-attempt timeout does not make a slow service fast: when every
    /// instance needs longer than `timeout`, every attempt times out and the
    /// call fails with `DEADLINE_EXCEEDED` after using its attempts.
    ///
    /// The server is told when the attempt ends: its `grpc-timeout` says the
    /// call's deadline (none, with no deadline) and its `x-attempt-timeout`
    /// ([`ATTEMPT_TIMEOUT`](crate::marks::ATTEMPT_TIMEOUT)) the attempt's own end,
    /// where that is sooner. A server may stop work nobody waits for; a retry
    /// layer in it (its handler passing both on with
    /// [`forward_deadline`](crate::forward_deadline)) fits its own retries
    /// and hedges before that end, cuts its attempts there, says it on, and
    /// hands a give-up there up unmarked unless it sent a retry: stacked services
    /// with attempt timeouts retry at one layer, the one with time for it.
    ///
    /// `grpc-timeout` says the deadline, not the attempt's limit: tonic's
    /// Channel resets the stream when the `grpc-timeout` it sent runs out, at
    /// the moment the server answers. And an attempt the limit cuts is not
    /// reset but read to its end in a task of its own, bounded by the
    /// deadline (else 10 s) and 64 KiB of body. A reset would cross the
    /// server's answer already on its way, and under load h2's limits on such
    /// frames (50 reset streams remembered for a second, then 1,024 frames on
    /// forgotten ones) close the whole connection with
    /// `too_many_internal_resets`.
    ///
    /// The resets that remain (a drain past its bound, a call the caller
    /// drops, a deadline) are counted only past what h2 remembers. Raise that
    /// on the channel's `Endpoint` where calls are cut in numbers:
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// use tonic::transport::Endpoint;
    /// use tonic_retry::RetryPolicy;
    ///
    /// let policy = RetryPolicy::default().with_attempt_timeout(Duration::from_millis(250));
    /// let channel = Endpoint::from_static("http://[::1]:50051")
    ///     .http2_max_concurrent_reset_streams(4096)
    ///     .connect_lazy();
    /// # let _ = (policy, channel);
    /// ```
    #[must_use]
    pub fn with_attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// The least time worth sending an attempt with (default 20 ms: enough to
    /// open a stream, encode a message and see a first byte). A retry is not
    /// made when the call's remaining time is at most its backoff plus this.
    #[must_use]
    pub fn with_min_attempt_budget(mut self, budget: Duration) -> Self {
        self.min_attempt_budget = budget;
        self
    }

    /// The longest delay a server may make a retry wait (default 30 s), through
    /// `grpc-retry-pushback-ms` or `google.rpc.RetryInfo`. A server asking for
    /// longer gets no retry: the call ends at once with the server's status.
    ///
    /// Without it, a call with no deadline would sleep for as long as any
    /// server said (`grpc-retry-pushback-ms: 4000000000` is 46 days). With a
    /// deadline, a delay beyond the time left ends the call with
    /// `DEADLINE_EXCEEDED` whatever this says.
    #[must_use]
    pub fn with_max_server_delay(mut self, max: Duration) -> Self {
        self.max_server_delay = max;
        self
    }

    /// The most request body bytes kept for replay (default 1 MiB,
    /// grpc-java's per-call limit). A call whose body outgrows it is sent
    /// whole but not retried; [`RetryMetrics::body_too_large`] counts such
    /// calls and a `WARN` event names the limit. The layer also bounds all its
    /// calls' copies together: see
    /// [`RetryLayer::with_replay_memory`](crate::RetryLayer::with_replay_memory).
    ///
    /// [`RetryMetrics::body_too_large`]: crate::metrics::RetryMetrics::body_too_large
    #[must_use]
    pub fn with_replay_limit(mut self, bytes: usize) -> Self {
        self.replay_limit = bytes;
        self
    }

    /// Whether the layer generates an `x-idempotency-key` for requests that do
    /// not carry one (default on). A key set by the caller is always kept.
    #[must_use]
    pub fn with_idempotency_key(mut self, generate: bool) -> Self {
        self.idempotency_key = generate;
        self
    }

    /// Whether an [`x-already-tried`](crate::marks::ALREADY_TRIED) header the
    /// caller set is trusted (default off).
    ///
    /// Off, the layer removes such a header before the first attempt: a
    /// server that forwards its clients' metadata to its own calls (a
    /// gateway, a proxy, a handler copying headers) would otherwise let any
    /// remote client steer those calls, naming every instance but one to
    /// send them all to that one. The instances a caller one hop up knows
    /// are its own targets, not this layer's, so nothing is lost. A mark set
    /// in process, the [`AlreadyTried`](crate::marks::AlreadyTried) request
    /// extension, is always honoured. Turn it on where instance ids are
    /// shared across hops and every caller is trusted.
    #[must_use]
    pub fn with_callers_mark_trusted(mut self, trusted: bool) -> Self {
        self.callers_mark_trusted = trusted;
        self
    }

    /// The response header naming the instance that answered (default
    /// `x-instance-id`), or `None` to learn no instance ids. Instances that
    /// failed an attempt are named on later attempts of the same call (see
    /// [`AlreadyTried`](crate::marks::AlreadyTried)).
    #[must_use]
    pub fn with_instance_header(mut self, header: Option<HeaderName>) -> Self {
        self.instance_header = header;
        self
    }

    /// Whether a call this layer gives up on tells the layers above not to
    /// retry it (default on): retry at one layer, the one directly above the
    /// failure.
    ///
    /// When the layer gives up on a retryable failure after it retried, or
    /// because its budget or the deadline refused a retry, the response it
    /// hands up carries gRPC A6's "do not retry" mark,
    /// `grpc-retry-pushback-ms: -1`. Every A6 client — this layer, grpc-go,
    /// grpc-java, C-core — then passes the failure up without retrying it, so
    /// a stack of retrying hops makes `max_attempts` calls to a failing
    /// service per user call, not `max_attempts` to the power of the number
    /// of hops. A failure the layer did not retry (one attempt allowed, a
    /// final code, a body that cannot be replayed) is not marked.
    ///
    /// Turn it off for a hop whose own retries cannot reach instances its
    /// caller could: say, a hop pinned to one zone under a caller that
    /// balances across zones. Then the caller's retry may still succeed
    /// where this hop's could not. See also
    /// [`RetryMarkExt`](crate::marks::RetryMarkExt), for server handlers that answer
    /// with a status of their own.
    #[must_use]
    pub fn with_retry_at_one_layer(mut self, on: bool) -> Self {
        self.retry_at_one_layer = on;
        self
    }

    /// The most attempts a call makes, first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The backoff before the first retry.
    pub fn base_delay(&self) -> Duration {
        self.base_delay
    }

    /// The longest backoff.
    pub fn max_delay(&self) -> Duration {
        self.max_delay
    }

    /// How much the backoff grows per retry.
    pub fn backoff_multiplier(&self) -> f64 {
        self.multiplier
    }

    /// The jitter, as a fraction of each backoff.
    pub fn jitter(&self) -> f64 {
        self.jitter
    }

    /// Whether each backoff is drawn from `[0, raw]` (see
    /// [`with_full_jitter`](Self::with_full_jitter)).
    pub fn full_jitter(&self) -> bool {
        self.full_jitter
    }

    /// The codes that may be retried.
    pub fn retryable_codes(&self) -> RetryableCodes {
        self.retryable
    }

    /// The longest a call may take, if capped (see [`with_max_timeout`](Self::with_max_timeout)).
    pub fn max_timeout(&self) -> Option<Duration> {
        self.max_timeout.as_ref().map(|timeout| timeout.duration)
    }

    /// The per-attempt timeout, if any.
    pub fn attempt_timeout(&self) -> Option<Duration> {
        self.attempt_timeout
    }

    /// For a policy made from a [`HedgePolicy`](crate::HedgePolicy): the
    /// hedging delay, as [`HedgePolicy::delay`](crate::HedgePolicy::delay)
    /// says. `None` for a policy that retries.
    pub fn hedge_delay(&self) -> Option<Duration> {
        self.hedge.as_ref().map(|plan| plan.delay)
    }

    /// The backoff before retry `retry` (1 for the first retry), with a fresh
    /// random jitter on every call.
    ///
    /// The exponent is capped, so no index overflows; index 0 is treated as 1.
    pub fn delay_before(&self, retry: u32) -> Duration {
        let factor = if self.full_jitter {
            rand::rng().random_range(0.0..=1.0)
        } else if self.jitter > 0.0 {
            1.0 + rand::rng().random_range(-self.jitter..=self.jitter)
        } else {
            1.0
        };
        self.jittered(retry, factor)
    }

    /// The delay before retry `retry` for a given jitter factor `1 + u`.
    pub(crate) fn jittered(&self, retry: u32, factor: f64) -> Duration {
        let steps = retry.saturating_sub(1);
        let raw = if self.multiplier == 2.0 {
            // 2^31 times any non-zero delay already exceeds any sane
            // `max_delay`; saturating keeps even `Duration::MAX` settings from
            // overflowing, and the doubling stays exact.
            self.base_delay
                .saturating_mul(1 << steps.min(31))
                .min(self.max_delay)
        } else {
            let steps = i32::try_from(steps).unwrap_or(i32::MAX);
            let grown = self.base_delay.as_secs_f64() * self.multiplier.powi(steps);
            // Too large (or infinite) to be a `Duration` is past any maximum.
            Duration::try_from_secs_f64(grown).map_or(self.max_delay, |d| d.min(self.max_delay))
        };
        Duration::try_from_secs_f64(raw.as_secs_f64() * factor).unwrap_or(raw)
    }
}

impl Default for RetryPolicy {
    /// 3 attempts, 20 ms base, 500 ms cap, ±20 % jitter.
    fn default() -> Self {
        Self::new(
            3,
            Duration::from_millis(20),
            Duration::from_millis(500),
            0.2,
        )
        .expect("the default policy is valid")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn defaults_are_the_documented_ones() {
        let p = RetryPolicy::default();
        assert_eq!(p.max_attempts, 3);
        assert_eq!(p.base_delay, 20 * MS);
        assert_eq!(p.max_delay, 500 * MS);
        assert_eq!(p.jitter, 0.2);
        assert_eq!(p.min_attempt_budget, 20 * MS);
        assert_eq!(p.max_server_delay, Duration::from_secs(30));
        assert!(p.retry_at_one_layer);
        assert_eq!(p.replay_limit, 1 << 20);
        assert!(p.idempotency_key);
        assert_eq!(p.retryable, RetryableCodes::default());
    }

    #[test]
    fn first_two_retries_wait_the_documented_ranges() {
        let p = RetryPolicy::default();
        for _ in 0..1000 {
            let d1 = p.delay_before(1);
            assert!((16 * MS..=24 * MS).contains(&d1), "retry 1 waited {d1:?}");
            let d2 = p.delay_before(2);
            assert!((32 * MS..=48 * MS).contains(&d2), "retry 2 waited {d2:?}");
        }
    }

    #[test]
    fn delay_grows_then_caps() {
        let p = RetryPolicy::new(5, 20 * MS, 500 * MS, 0.0).unwrap();
        let got: Vec<_> = (1..=7).map(|k| p.delay_before(k)).collect();
        assert_eq!(
            got,
            [
                20 * MS,
                40 * MS,
                80 * MS,
                160 * MS,
                320 * MS,
                500 * MS,
                500 * MS
            ]
        );
        assert_eq!(
            p.delay_before(0),
            20 * MS,
            "index 0 reads as the first retry"
        );
    }

    #[test]
    fn huge_indexes_and_delays_do_not_overflow() {
        let p = RetryPolicy::new(5, Duration::MAX, Duration::MAX, 1.0).unwrap();
        for k in [1, 2, 32, 33, 64, u32::MAX] {
            let _ = p.delay_before(k);
        }
        let p = RetryPolicy::new(5, 3 * MS, Duration::from_secs(u64::MAX / 4), 0.2).unwrap();
        let d = p.delay_before(u32::MAX);
        assert!(d > 3 * MS);
        let zero = RetryPolicy::new(5, Duration::ZERO, Duration::ZERO, 0.2).unwrap();
        assert_eq!(zero.delay_before(u32::MAX), Duration::ZERO);
    }

    #[test]
    fn two_calls_do_not_share_one_jitter_sequence() {
        let a = RetryPolicy::default();
        let b = a.clone();
        let seq_a: Vec<_> = (0..16).map(|_| a.delay_before(1)).collect();
        let seq_b: Vec<_> = (0..16).map(|_| b.delay_before(1)).collect();
        assert_ne!(seq_a, seq_b, "clones of one policy must draw independently");
        let distinct: std::collections::HashSet<_> = seq_a.iter().collect();
        assert!(
            distinct.len() > 8,
            "draws within one sequence repeat: {seq_a:?}"
        );
    }

    #[test]
    fn the_multiplier_grows_the_backoff_and_is_validated() {
        let p = RetryPolicy::new(5, 100 * MS, Duration::from_secs(1), 0.0)
            .unwrap()
            .with_backoff_multiplier(1.5)
            .unwrap();
        let got: Vec<_> = (1..=6).map(|k| p.delay_before(k).as_micros()).collect();
        assert_eq!(got, [100_000, 150_000, 225_000, 337_500, 506_250, 759_375]);
        assert_eq!(p.delay_before(u32::MAX), Duration::from_secs(1), "capped");
        let shrinking = p.clone().with_backoff_multiplier(0.5).unwrap();
        assert_eq!(shrinking.delay_before(3), 25 * MS);
        assert_eq!(shrinking.delay_before(u32::MAX), Duration::ZERO);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = p.clone().with_backoff_multiplier(bad).unwrap_err();
            assert_eq!(e.field(), "backoff_multiplier");
        }
        assert_eq!(RetryPolicy::default().backoff_multiplier(), 2.0);
    }

    #[test]
    fn no_retry_is_one_attempt_and_touches_nothing() {
        let p = RetryPolicy::no_retry();
        assert_eq!(p.max_attempts(), 1);
        assert!(!p.idempotency_key);
        assert!(p.instance_header.is_none());
    }

    #[test]
    fn bad_settings_are_typed_errors_naming_the_field() {
        let cases = [
            (0, 20, 500, 0.2, "max_attempts"),
            (6, 20, 500, 0.2, "max_attempts"),
            (3, 500, 20, 0.2, "max_delay"),
            (3, 20, 500, -0.1, "jitter"),
            (3, 20, 500, 1.5, "jitter"),
            (3, 20, 500, f64::NAN, "jitter"),
            (3, 20, 500, f64::INFINITY, "jitter"),
        ];
        for (attempts, base, max, jitter, field) in cases {
            let e = RetryPolicy::new(attempts, base * MS, max * MS, jitter).unwrap_err();
            assert_eq!(e.field(), field);
            assert!(
                e.to_string().contains(field),
                "message `{e}` names no field"
            );
        }
    }

    #[test]
    fn retryable_codes_set_operations() {
        let all: RetryableCodes = (0..=16).map(Code::from_i32).collect();
        for n in 0..=16 {
            assert!(all.contains(Code::from_i32(n)));
            assert!(!RetryableCodes::empty().contains(Code::from_i32(n)));
        }
        assert_eq!(all.when(Code::ResourceExhausted), Some(RetryWhen::Always));
        let d = RetryableCodes::default();
        assert_eq!(
            format!("{d:?}"),
            "{DeadlineExceeded, ResourceExhausted (with RetryInfo), Unavailable}"
        );
        assert_eq!(d.when(Code::Unavailable), Some(RetryWhen::Always));
        assert_eq!(d.when(Code::DeadlineExceeded), Some(RetryWhen::Always));
        assert_eq!(
            d.when(Code::ResourceExhausted),
            Some(RetryWhen::WithRetryInfo)
        );
        assert_eq!(d.when(Code::Aborted), None);
        // Each of `with` and `with_retry_info` replaces the other's rule.
        let switched = d.with(Code::ResourceExhausted);
        assert_eq!(
            switched.when(Code::ResourceExhausted),
            Some(RetryWhen::Always)
        );
        let back = switched.with_retry_info(Code::ResourceExhausted);
        assert_eq!(back, d);
        assert!(
            !d.without(Code::ResourceExhausted)
                .contains(Code::ResourceExhausted)
        );
        let policy = RetryPolicy::default().with_retryable_codes(switched);
        assert_eq!(
            format!("{:?}", policy.retryable_codes()),
            "{DeadlineExceeded, ResourceExhausted, Unavailable}"
        );
    }

    #[test]
    fn full_jitter_draws_from_zero_to_the_raw_backoff() {
        let p = RetryPolicy::new(5, 20 * MS, 100 * MS, 0.2)
            .unwrap()
            .with_full_jitter();
        assert!(p.full_jitter());
        for (retry, raw) in [(1, 20 * MS), (2, 40 * MS), (3, 80 * MS), (4, 100 * MS)] {
            let draws: Vec<Duration> = (0..2000).map(|_| p.delay_before(retry)).collect();
            assert!(
                draws.iter().all(|d| *d <= raw),
                "retry {retry}: none above {raw:?}"
            );
            // Spread over the whole range, not ±20 % around raw.
            assert!(
                draws.iter().any(|d| *d < raw / 4),
                "retry {retry}: some below a quarter"
            );
            assert!(
                draws.iter().any(|d| *d > raw * 3 / 4),
                "retry {retry}: some above 3/4"
            );
        }
        assert_eq!(p.jittered(3, 0.0), Duration::ZERO);
        assert_eq!(p.jittered(3, 1.0), 80 * MS);
    }

    proptest! {
        #[test]
        fn every_draw_is_within_bounds(
            base_ms in 0u64..10_000,
            extra_ms in 0u64..100_000,
            jitter in 0.0f64..=1.0,
            retry in 1u32..200,
        ) {
            let base = Duration::from_millis(base_ms);
            let max = base + Duration::from_millis(extra_ms);
            let p = RetryPolicy::new(5, base, max, jitter).unwrap();
            let shift = (retry - 1).min(31);
            let raw = base.saturating_mul(1 << shift).min(max);
            let d = p.delay_before(retry);
            let lo = raw.as_secs_f64() * (1.0 - jitter);
            let hi = raw.as_secs_f64() * (1.0 + jitter);
            prop_assert!(d.as_secs_f64() >= lo - 1e-9 && d.as_secs_f64() <= hi + 1e-9,
                "retry {} drew {:?}, outside [{}, {}]", retry, d, lo, hi);
        }
    }
}
