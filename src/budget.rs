//! A process-wide retry budget.
//!
//! A maximum number of attempts bounds what one call may cost, but not what a
//! fleet of callers may cost together: when a dependency goes down, every call
//! fails, every call retries, and a service that normally takes `N` requests a
//! second suddenly takes `N × max_attempts`, exactly when it can least afford
//! it. A budget bounds the *sum*: retries are paid for with tokens, and tokens
//! are earned only by successful calls. In steady state the retry rate can
//! never exceed `deposit_per_success` of the success rate (10 % with the
//! reference setting), while a saved balance lets short bursts of failures be
//! retried in full.
//!
//! The account is a single atomic integer holding thousandths of a token, so
//! deposits and withdrawals are lock-free compare-and-swap loops, and a balance
//! already at its cap costs a deposit no more than one load.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::ConfigError;
#[cfg(doc)]
use crate::{outcome::OutcomeBudget, throttle::RetryThrottle};

/// Thousandths of a token: the unit the account is kept in.
const MILLI: u64 = 1_000;

/// A token account shared by every call that goes through any clone of it.
///
/// Starts at half of `max_tokens`. Each successful call (one that ends with
/// `OK`: for a committed response, when its trailers say so) deposits
/// `deposit_per_success` tokens (capped at `max_tokens`); each retry withdraws
/// one whole token; without a whole token there is no retry. Cloning shares the
/// one account, so a single budget can guard several layers or clients.
///
/// # Example
///
/// ```
/// use tonic_retry::RetryBudget;
///
/// # fn main() -> Result<(), tonic_retry::ConfigError> {
/// // 200 tokens at most (200 rps × 10 s), one token per ten successes.
/// let budget = RetryBudget::new(200, 0.1)?;
/// assert_eq!(budget.available(), 100.0);
///
/// let shared = budget.clone();
/// assert!(shared.try_withdraw());
/// assert_eq!(budget.available(), 99.0);
/// budget.deposit();
/// assert_eq!(shared.available(), 99.1);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RetryBudget {
    inner: Arc<Account>,
}

struct Account {
    /// Balance in thousandths of a token, always within `0..=max`.
    balance: AtomicU64,
    max: u64,
    deposit: u64,
}

impl RetryBudget {
    /// Creates a budget holding at most `max_tokens` tokens, earning
    /// `deposit_per_success` tokens per successful call.
    ///
    /// `deposit_per_success` is kept to three decimals, further ones dropped
    /// (as gRPC's `retryThrottling.tokenRatio` is: `0.0019` deposits
    /// `0.001`); it must be at least `0.001`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] if `max_tokens` is zero or `deposit_per_success` is not
    /// a finite number in `0.001..=max_tokens`.
    pub fn new(max_tokens: u32, deposit_per_success: f64) -> Result<Self, ConfigError> {
        if max_tokens == 0 {
            return Err(ConfigError::new("max_tokens", "must be at least 1, got 0"));
        }
        if !deposit_per_success.is_finite()
            || deposit_per_success < 0.001
            || deposit_per_success > f64::from(max_tokens)
        {
            return Err(ConfigError::new(
                "deposit_per_success",
                format!(
                    "must be a number from 0.001 to max_tokens ({max_tokens}), got {deposit_per_success}"
                ),
            ));
        }
        let max = u64::from(max_tokens) * MILLI;
        // Further decimals dropped, as documented and as gRPC's `tokenRatio`
        // (0.0019 deposits 0.001); the range check above keeps it at least 1.
        let deposit = crate::throttle::thousandths(deposit_per_success);
        Ok(Self {
            inner: Arc::new(Account {
                balance: AtomicU64::new(max / 2),
                max,
                deposit,
            }),
        })
    }

    /// This account, filled to its cap.
    pub(crate) fn filled(self) -> Self {
        self.inner.balance.store(self.inner.max, Ordering::Relaxed);
        self
    }

    /// Records a successful call: adds `deposit_per_success` tokens, up to the cap.
    pub fn deposit(&self) {
        let Account {
            balance,
            max,
            deposit,
        } = &*self.inner;
        // NOTE: `Relaxed` is enough: the balance publishes no other memory, and
        // each read-modify-write is atomic on its own. A full account is the
        // common case under healthy traffic; `fetch_update` then stops after the
        // load, so successes do not contend on the cache line.
        let _ = balance.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cur| {
            (cur < *max).then(|| cur.saturating_add(*deposit).min(*max))
        });
    }

    /// Takes one token for a retry. Returns `false`, and takes nothing, when
    /// less than one whole token is left.
    pub fn try_withdraw(&self) -> bool {
        self.inner
            .balance
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cur| {
                cur.checked_sub(MILLI)
            })
            .is_ok()
    }

    /// Gives back a token taken for a retry that was never sent.
    pub(crate) fn refund(&self) {
        let Account { balance, max, .. } = &*self.inner;
        let _ = balance.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cur| {
            Some(cur.saturating_add(MILLI).min(*max))
        });
    }

    /// Whether a whole token is there to withdraw (without taking it).
    pub(crate) fn has_token(&self) -> bool {
        self.inner.balance.load(Ordering::Relaxed) >= MILLI
    }

    /// The current balance in tokens, e.g. for a `retry_budget_available` gauge.
    pub fn available(&self) -> f64 {
        self.inner.balance.load(Ordering::Relaxed) as f64 / MILLI as f64
    }

    /// The most tokens the account can hold.
    pub fn max_tokens(&self) -> u32 {
        (self.inner.max / MILLI) as u32
    }

    /// The tokens a successful call deposits, as kept (to three decimals).
    pub(crate) fn deposit_per_success(&self) -> f64 {
        self.inner.deposit as f64 / MILLI as f64
    }
}

/// What the layer asks of the budget its retries (and hedges) are paid from.
///
/// The crate's own budgets implement it: [`RetryBudget`] (a token account),
/// [`OutcomeBudget`] (one whose successful retries cost nothing) and
/// [`RetryThrottle`] (gRPC A6's retry throttling). Any `tower` retry budget
/// (tower's `TpsBudget`, say) works through [`TowerBudget`]. A budget is
/// shared by every call, on any thread, so it is `Send + Sync`.
///
/// Only [`deposit`](Budget::deposit) and [`withdraw`](Budget::withdraw) are
/// required; the others say what a budget knows beyond them, and default to
/// knowing nothing.
pub trait Budget: Send + Sync + 'static {
    /// A call ended with `OK` (for a committed response: when its trailers
    /// said so).
    fn deposit(&self);

    /// Pays for one retry (or hedge) about to be sent. `false` means it is
    /// not sent.
    fn withdraw(&self) -> bool;

    /// An attempt of a method that retries failed with a retryable status,
    /// retried or not. gRPC's throttling charges these; by default, nothing.
    fn on_retryable_failure(&self) {}

    /// The call ended with `OK` on a retry (or hedge) this budget paid for,
    /// told after [`deposit`](Budget::deposit). [`OutcomeBudget`] gives the
    /// retry's token back; by default, nothing.
    fn on_retry_success(&self) {}

    /// Whether [`withdraw`](Budget::withdraw) would refuse now, asked without
    /// taking anything, so that the layer refuses a retry before its backoff
    /// rather than after. By default a budget is never known to be empty.
    fn is_known_empty(&self) -> bool {
        false
    }

    /// Whether a retry this budget refuses ends the call with the failure's
    /// own status (as gRPC's throttling does) rather than with
    /// `RESOURCE_EXHAUSTED` ("retry budget exhausted").
    fn refusal_keeps_status(&self) -> bool {
        false
    }

    /// The tokens available now, for the layer's events; `None` if the
    /// budget has no such number.
    fn balance(&self) -> Option<f64> {
        None
    }
}

/// Tells `budget` that a call ended with `OK`: a deposit, and, if the call
/// succeeded on a retry (or hedge) it paid for, that retry's success.
#[inline]
pub(crate) fn call_succeeded<Bu: Budget>(budget: &Bu, on_paid_retry: bool) {
    budget.deposit();
    if on_paid_retry {
        budget.on_retry_success();
    }
}

/// Any `tower` retry budget as the layer's [`Budget`]: deposited on each
/// successful call, withdrawn from once per retry sent.
///
/// ```
/// use std::time::Duration;
/// use tonic_retry::{RetryLayer, RetryPolicy, budgets::TowerBudget};
/// use tower::retry::budget::TpsBudget;
///
/// let tps = TpsBudget::new(Duration::from_secs(10), 10, 0.2);
/// let layer = RetryLayer::with_budget(RetryPolicy::default(), TowerBudget::new(tps));
/// # let _ = layer;
/// ```
#[derive(Clone, Debug, Default)]
pub struct TowerBudget<B>(B);

impl<B> TowerBudget<B> {
    /// Wraps `budget`.
    pub const fn new(budget: B) -> Self {
        Self(budget)
    }

    /// The tower budget.
    pub fn get_ref(&self) -> &B {
        &self.0
    }

    /// Unwraps the tower budget.
    pub fn into_inner(self) -> B {
        self.0
    }
}

impl<B> Budget for TowerBudget<B>
where
    B: tower::retry::budget::Budget + Send + Sync + 'static,
{
    fn deposit(&self) {
        self.0.deposit();
    }

    fn withdraw(&self) -> bool {
        self.0.withdraw()
    }
}

impl Budget for RetryBudget {
    fn deposit(&self) {
        RetryBudget::deposit(self);
    }

    fn withdraw(&self) -> bool {
        self.try_withdraw()
    }

    fn is_known_empty(&self) -> bool {
        !self.has_token()
    }

    fn balance(&self) -> Option<f64> {
        Some(self.available())
    }
}

impl tower::retry::budget::Budget for RetryBudget {
    fn deposit(&self) {
        RetryBudget::deposit(self);
    }

    fn withdraw(&self) -> bool {
        self.try_withdraw()
    }
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("available", &self.available())
            .field("max_tokens", &self.max_tokens())
            .field("deposit_per_success", &self.deposit_per_success())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn starts_at_half() {
        let b = RetryBudget::new(200, 0.1).unwrap();
        assert_eq!(b.available(), 100.0);
        let odd = RetryBudget::new(3, 0.5).unwrap();
        assert_eq!(odd.available(), 1.5);
    }

    #[test]
    fn fractional_deposits_add_up_exactly() {
        let b = RetryBudget::new(10, 0.1).unwrap();
        assert_eq!(b.available(), 5.0);
        for _ in 0..10 {
            b.deposit();
        }
        assert_eq!(
            b.available(),
            6.0,
            "ten deposits of 0.1 make exactly one token"
        );
    }

    #[test]
    fn deposits_keep_three_decimals_and_drop_the_rest() {
        // (deposit_per_success, balance after one deposit from 5)
        for (ratio, after) in [
            (0.0019, 5.001),
            (0.001, 5.001),
            (0.1, 5.1),
            (0.5466, 5.546),
            (1.001, 6.001),
            (0.9999, 5.999),
        ] {
            let budget = RetryBudget::new(10, ratio).unwrap();
            budget.deposit();
            assert_eq!(budget.available(), after, "deposit_per_success {ratio}");
        }
    }

    #[test]
    fn deposits_are_capped() {
        let b = RetryBudget::new(4, 1.5).unwrap();
        for _ in 0..10 {
            b.deposit();
        }
        assert_eq!(b.available(), 4.0);
    }

    #[test]
    fn withdraw_needs_a_whole_token() {
        let b = RetryBudget::new(3, 0.5).unwrap();
        assert!(b.try_withdraw(), "1.5 tokens pay for one retry");
        assert_eq!(b.available(), 0.5);
        assert!(!b.try_withdraw(), "half a token pays for nothing");
        assert_eq!(b.available(), 0.5, "a refused withdrawal takes nothing");
        b.deposit();
        assert!(b.try_withdraw());
        assert_eq!(b.available(), 0.0);
    }

    #[test]
    fn clones_share_one_account() {
        let a = RetryBudget::new(2, 1.0).unwrap();
        let b = a.clone();
        assert!(a.try_withdraw());
        assert!(!b.try_withdraw());
        b.deposit();
        assert_eq!(a.available(), 1.0);
    }

    #[test]
    fn tower_budget_trait_uses_the_same_account() {
        use tower::retry::budget::Budget;
        let b = RetryBudget::new(2, 1.0).unwrap();
        assert!(Budget::withdraw(&b));
        assert!(!Budget::withdraw(&b));
        Budget::deposit(&b);
        assert_eq!(b.available(), 1.0);
    }

    #[test]
    fn rejects_bad_settings_naming_the_field() {
        let e = RetryBudget::new(0, 0.1).unwrap_err();
        assert_eq!(e.field(), "max_tokens");
        assert!(e.to_string().contains("max_tokens"), "{e}");
        for bad in [0.0, -0.1, 0.0004, f64::NAN, f64::INFINITY, 11.0] {
            let e = RetryBudget::new(10, bad).unwrap_err();
            assert_eq!(e.field(), "deposit_per_success", "for {bad}");
            assert!(e.to_string().contains("deposit_per_success"), "{e}");
        }
    }

    #[test]
    fn contended_account_never_grants_more_than_it_holds() {
        const THREADS: usize = 4;
        const OPS: usize = 20_000;
        let b = RetryBudget::new(50, 0.25).unwrap();
        let start = b.available();
        let threads: Vec<_> = (0..THREADS)
            .map(|i| {
                let b = b.clone();
                std::thread::spawn(move || {
                    let (mut granted, mut deposits) = (0u64, 0u64);
                    for n in 0..OPS {
                        // Two threads mostly withdraw, two mostly deposit.
                        if (n + i) % 3 == 0 || i % 2 == 0 {
                            granted += u64::from(b.try_withdraw());
                        } else {
                            b.deposit();
                            deposits += 1;
                        }
                        let now = b.available();
                        assert!((0.0..=50.0).contains(&now), "balance {now} out of range");
                    }
                    (granted, deposits)
                })
            })
            .collect();
        let (granted, deposits) = threads
            .into_iter()
            .map(|t| t.join().expect("worker thread panicked"))
            .fold((0, 0), |(g, d), (g2, d2)| (g + g2, d + d2));
        assert!(granted > 0 && deposits > 0);
        let ceiling = start + deposits as f64 * 0.25;
        assert!(
            granted as f64 <= ceiling,
            "granted {granted} withdrawals from a start of {start} plus {deposits} deposits"
        );
        // Withdrawals take whole tokens, and deposits are lost only at the cap:
        // the balance left is what came in minus what went out, never more.
        assert!(b.available() <= ceiling - granted as f64 + 1e-9);
    }

    proptest! {
        #[test]
        fn balance_stays_in_range(max in 1u32..500, deposit in 1u32..2000, ops in proptest::collection::vec(any::<bool>(), 0..400)) {
            let deposit = (f64::from(deposit) / 1000.0).min(f64::from(max));
            let b = RetryBudget::new(max, deposit).unwrap();
            for op in ops {
                let before = b.available();
                if op {
                    let ok = b.try_withdraw();
                    prop_assert_eq!(ok, before >= 1.0);
                } else {
                    b.deposit();
                }
                let now = b.available();
                prop_assert!(now >= 0.0 && now <= f64::from(max));
            }
        }
    }
}
