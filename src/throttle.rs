//! gRPC's own retry throttling (gRFC A6 `retryThrottling`), as a budget.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::ConfigError;

/// Thousandths of a token.
const MILLI: u64 = 1_000;

/// gRPC's retry throttling, as gRFC A6 defines it and grpc-go and grpc-java
/// implement it: a token count shared by every call through the layer, which
/// takes it as its budget.
///
/// * It starts **full**, at `max_tokens`.
/// * Each **retryable failure** — every attempt that fails with a retryable
///   status, the last one included, retried or not — takes one token. A
///   method that is never retried (one attempt, as for a method without a
///   `retryPolicy` in a service config) takes none, as in grpc-go and
///   grpc-java.
/// * Each **successful** call (one that ends with `OK`) adds `token_ratio`
///   tokens (kept to three
///   decimals: `0.5466` counts as `0.546`), up to `max_tokens`.
/// * **No retry** is made while the count is at or below half of
///   `max_tokens`; the call ends with the failure's own status.
///
/// How it differs from [`RetryBudget`](crate::RetryBudget), the budget of
/// this crate's design: a `RetryBudget` starts *half* full, charges only the
/// retries it pays for (one token each, when sent), and refuses at zero, with
/// `RESOURCE_EXHAUSTED`. The throttle charges failures, retried or not, and
/// stops retries at half, so during an outage it keeps half its tokens in
/// reserve and a failing call costs it one token per attempt. Use the
/// throttle to behave as grpc-go and grpc-java clients with the same service
/// config do; use `RetryBudget` to cap retries at a fraction of traffic.
///
/// Without `retryThrottling` a service config does not throttle retries:
/// [`RetryThrottle::unlimited`] is that.
///
/// # Example
///
/// ```
/// use tonic_retry::budgets::RetryThrottle;
///
/// # fn main() -> Result<(), tonic_retry::ConfigError> {
/// let throttle = RetryThrottle::new(10.0, 0.1)?;
/// assert_eq!(throttle.available(), 10.0);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RetryThrottle {
    inner: Option<Arc<Tokens>>,
}

struct Tokens {
    /// In thousandths, within `0..=max`.
    count: AtomicU64,
    max: u64,
    ratio: u64,
}

impl RetryThrottle {
    /// A throttle of `max_tokens` tokens, earning `token_ratio` per success.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] unless `max_tokens` is in `(0, 1000]` and
    /// `token_ratio` is greater than 0 (both finite), as A6 requires.
    pub fn new(max_tokens: f64, token_ratio: f64) -> Result<Self, ConfigError> {
        if !(max_tokens.is_finite() && max_tokens > 0.0 && max_tokens <= 1000.0) {
            return Err(ConfigError::new(
                "max_tokens",
                format!("must be in (0, 1000], got {max_tokens}"),
            ));
        }
        if !(token_ratio.is_finite() && token_ratio > 0.0) {
            return Err(ConfigError::new(
                "token_ratio",
                format!("must be a number greater than 0, got {token_ratio}"),
            ));
        }
        let max = thousandths(max_tokens);
        let ratio = thousandths(token_ratio.min(1e12));
        Ok(Self {
            inner: Some(Arc::new(Tokens {
                count: AtomicU64::new(max),
                max,
                ratio,
            })),
        })
    }

    /// No throttling: every retry the policy allows is made.
    pub fn unlimited() -> Self {
        Self { inner: None }
    }

    /// The token count, as [`RetryBudget::available`](crate::RetryBudget::available)
    /// says its balance; infinite for [`unlimited`](Self::unlimited).
    pub fn available(&self) -> f64 {
        self.inner.as_ref().map_or(f64::INFINITY, |t| {
            t.count.load(Ordering::Relaxed) as f64 / MILLI as f64
        })
    }

    /// The most tokens; infinite for [`unlimited`](Self::unlimited).
    pub fn max_tokens(&self) -> f64 {
        self.inner
            .as_ref()
            .map_or(f64::INFINITY, |t| t.max as f64 / MILLI as f64)
    }

    /// Whether a retry may be made now: more than half the tokens are left.
    pub fn allows_retry(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(|t| t.count.load(Ordering::Relaxed).saturating_mul(2) > t.max)
    }

    /// Records a retryable failure: one token less (never below zero).
    pub(crate) fn on_retryable_failure(&self) {
        if let Some(t) = &self.inner {
            // NOTE: `Relaxed` suffices: the count publishes no other memory.
            let _ = t
                .count
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                    (c > 0).then(|| c.saturating_sub(MILLI))
                });
        }
    }

    /// Records a success: `token_ratio` more, up to the maximum.
    pub(crate) fn on_success(&self) {
        if let Some(t) = &self.inner {
            let _ = t
                .count
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                    (c < t.max).then(|| c.saturating_add(t.ratio).min(t.max))
                });
        }
    }
}

/// `value` in thousandths, further decimals dropped (A6), as it was written:
/// 1.001 is 1000.9999… thousandths in binary floating point, yet 1001. A
/// product within a few units in the last place of a whole number is that
/// number; any other is truncated (0.5466 is 546). `value` is positive and at
/// most 10¹², so the product fits.
pub(crate) fn thousandths(value: f64) -> u64 {
    let scaled = value * MILLI as f64;
    let nearest = scaled.round();
    // A few units in the last place: the parse's and the product's rounding.
    if (scaled - nearest).abs() <= nearest * 4.0 * f64::EPSILON {
        nearest as u64
    } else {
        scaled as u64
    }
}

impl Default for RetryThrottle {
    /// [`RetryThrottle::unlimited`].
    fn default() -> Self {
        Self::unlimited()
    }
}

impl tower::retry::budget::Budget for RetryThrottle {
    fn deposit(&self) {
        self.on_success();
    }

    /// Whether a retry may be sent: A6 charges failures, not retries, so this
    /// takes nothing; the layer charges each retryable failure itself.
    fn withdraw(&self) -> bool {
        self.allows_retry()
    }
}

impl crate::budget::Budget for RetryThrottle {
    fn deposit(&self) {
        self.on_success();
    }

    /// Whether a retry may be sent: A6 charges failures, not retries, so this
    /// takes nothing.
    fn withdraw(&self) -> bool {
        self.allows_retry()
    }

    fn on_retryable_failure(&self) {
        RetryThrottle::on_retryable_failure(self);
    }

    fn is_known_empty(&self) -> bool {
        !self.allows_retry()
    }

    fn refusal_keeps_status(&self) -> bool {
        true
    }

    fn balance(&self) -> Option<f64> {
        self.inner.is_some().then(|| self.available())
    }
}

impl fmt::Debug for RetryThrottle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            None => f.write_str("RetryThrottle(unlimited)"),
            Some(t) => f
                .debug_struct("RetryThrottle")
                .field(
                    "available",
                    &(t.count.load(Ordering::Relaxed) as f64 / MILLI as f64),
                )
                .field("max_tokens", &(t.max as f64 / MILLI as f64))
                .field("token_ratio", &(t.ratio as f64 / MILLI as f64))
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_decimals_are_kept_as_written_and_more_dropped() {
        // Every value of three decimals up to the largest `max_tokens`, read
        // from its decimal text as a JSON parser reads it.
        for n in 1..=1_000_000u64 {
            let written = format!("{}.{:03}", n / 1000, n % 1000);
            let value: f64 = written.parse().unwrap();
            assert_eq!(thousandths(value), n, "{written}");
            // A fourth decimal is dropped, whatever it is.
            let longer: f64 = format!("{written}9").parse().unwrap();
            assert_eq!(thousandths(longer), n, "{written}9");
        }
        assert_eq!(thousandths(1e12), 1_000_000_000_000_000);
        assert_eq!(thousandths(0.0009), 0);
        // Many more decimals, just below a thousandth: still dropped.
        assert_eq!(thousandths(9.999_999_999_999), 9_999);
        assert_eq!(thousandths(999.999_999_999_9), 999_999);
        assert_eq!(thousandths(0.006_999_999_999_999), 6);
    }

    #[test]
    fn it_behaves_as_a6_says() {
        // grpc-go's throttling test: maxTokens 10, tokenRatio 0.5.
        let t = RetryThrottle::new(10.0, 0.5).unwrap();
        assert_eq!(t.available(), 10.0, "starts full");
        for left in [9.0, 8.0, 7.0, 6.0] {
            t.on_retryable_failure();
            assert_eq!(t.available(), left);
            assert!(t.allows_retry(), "{left} > 5");
        }
        t.on_retryable_failure();
        assert_eq!(t.available(), 5.0);
        assert!(!t.allows_retry(), "no retry at half");
        t.on_success();
        assert_eq!(t.available(), 5.5);
        assert!(t.allows_retry());
        for _ in 0..100 {
            t.on_success();
        }
        assert_eq!(t.available(), 10.0, "capped at max");
        for _ in 0..100 {
            t.on_retryable_failure();
        }
        assert_eq!(t.available(), 0.0, "never below zero");
    }

    #[test]
    fn the_ratio_keeps_three_decimals_and_bad_settings_are_errors() {
        let t = RetryThrottle::new(3.0, 0.5466).unwrap();
        t.on_retryable_failure();
        t.on_success();
        assert_eq!(t.available(), 2.546);
        for (max, ratio, field) in [
            (0.0, 0.1, "max_tokens"),
            (-1.0, 0.1, "max_tokens"),
            (1000.5, 0.1, "max_tokens"),
            (f64::NAN, 0.1, "max_tokens"),
            (10.0, 0.0, "token_ratio"),
            (10.0, -0.1, "token_ratio"),
            (10.0, f64::INFINITY, "token_ratio"),
        ] {
            assert_eq!(RetryThrottle::new(max, ratio).unwrap_err().field(), field);
        }
        assert!(RetryThrottle::new(1000.0, 1e300).is_ok(), "huge ratios cap");
    }

    #[test]
    fn unlimited_always_allows() {
        let t = RetryThrottle::unlimited();
        for _ in 0..10 {
            t.on_retryable_failure();
        }
        assert!(t.allows_retry());
        assert_eq!(t.available(), f64::INFINITY);
    }
}
