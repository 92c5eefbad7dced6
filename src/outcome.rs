//! A retry budget paid by outcome: a retry that succeeds costs nothing.

use std::fmt;

use crate::budget::{Budget, RetryBudget};
use crate::error::ConfigError;

/// A retry budget that charges only the retries that fail.
///
/// Like [`RetryBudget`], a lock-free token account: each call that ends with
/// `OK` deposits `deposit_per_success` tokens, and each retry (or hedge) takes
/// one whole token when it is sent. Unlike it, a retry the call then succeeds
/// with gives its token back. So a token is lost only to a retry (or hedge)
/// the call did not succeed with (a hedge that lost the race included), and
/// what the account bounds is the load retries add *without doing any good*:
///
/// * **A brown-out** (some attempts fail, retries mostly succeed): retries
///   cost little, and every failure that a retry can mend is retried. A
///   budget that charges every retry instead runs dry at its deposit rate,
///   and leaves the rest of the failures unretried.
/// * **An outage or an overload** (retries fail too): nothing is given back
///   and no call succeeds, so once the balance is spent no retry is sent
///   until calls succeed again. Retries then add no load to a service
///   struggling to recover.
/// * **The onset of either**: a token is held from a retry's sending until
///   its outcome, so when every call starts failing at once, the burst of
///   retries is the balance, at most `max_tokens`, and no more. (While other
///   calls still succeed, their deposits pay for more.) Keep `max_tokens`
///   small against the calls a second: the default, 10, is 1 % of a second
///   at 1,000 calls a second.
///
/// Cloning shares the one account, so a single budget can guard several
/// layers or clients. A retry refused ends its call with
/// `RESOURCE_EXHAUSTED` ("retry budget exhausted"), as [`RetryBudget`]'s do.
///
/// # Example
///
/// ```
/// use tonic_retry::{OutcomeBudget, RetryLayer, RetryPolicy, budgets::Budget};
///
/// # fn main() -> Result<(), tonic_retry::ConfigError> {
/// // 10 tokens at most; a tenth of a token per successful call.
/// let budget = OutcomeBudget::new(10, 0.1)?;
/// assert_eq!(budget.available(), 10.0);
///
/// // A retry that succeeds: its token is given back.
/// assert!(budget.withdraw());
/// budget.deposit();
/// budget.on_retry_success();
/// assert_eq!(budget.available(), 10.0);
///
/// // A retry that fails: its token is spent.
/// assert!(budget.withdraw());
/// assert_eq!(budget.available(), 9.0);
///
/// let layer = RetryLayer::with_budget(RetryPolicy::default(), budget);
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct OutcomeBudget {
    account: RetryBudget,
}

impl OutcomeBudget {
    /// Creates a budget holding at most `max_tokens` tokens, full at first,
    /// earning `deposit_per_success` tokens per successful call.
    ///
    /// `deposit_per_success` is kept to three decimals, as
    /// [`RetryBudget::new`]'s is.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] if `max_tokens` is zero or `deposit_per_success` is not
    /// a finite number in `0.001..=max_tokens`.
    pub fn new(max_tokens: u32, deposit_per_success: f64) -> Result<Self, ConfigError> {
        Ok(Self {
            account: RetryBudget::new(max_tokens, deposit_per_success)?.filled(),
        })
    }

    /// The current balance in tokens.
    pub fn available(&self) -> f64 {
        self.account.available()
    }

    /// The most tokens the account can hold: the largest burst of retries
    /// when every call fails.
    pub fn max_tokens(&self) -> u32 {
        self.account.max_tokens()
    }
}

/// 10 tokens, 0.1 per successful call.
impl Default for OutcomeBudget {
    fn default() -> Self {
        Self::new(10, 0.1).expect("the default budget is valid")
    }
}

impl Budget for OutcomeBudget {
    fn deposit(&self) {
        self.account.deposit();
    }

    fn withdraw(&self) -> bool {
        self.account.try_withdraw()
    }

    fn on_retry_success(&self) {
        self.account.refund();
    }

    fn is_known_empty(&self) -> bool {
        !self.account.has_token()
    }

    fn balance(&self) -> Option<f64> {
        Some(self.available())
    }
}

impl fmt::Debug for OutcomeBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutcomeBudget")
            .field("available", &self.available())
            .field("max_tokens", &self.max_tokens())
            .field("deposit_per_success", &self.account.deposit_per_success())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_full_and_defaults_to_ten_tokens_a_tenth_per_success() {
        let b = OutcomeBudget::default();
        assert_eq!((b.available(), b.max_tokens()), (10.0, 10));
        b.deposit();
        assert_eq!(b.available(), 10.0, "capped");
        assert!(b.withdraw());
        b.deposit();
        assert_eq!(b.available(), 9.1);
    }

    #[test]
    fn only_a_failed_retry_costs_its_token() {
        let b = OutcomeBudget::new(2, 0.5).unwrap();
        assert!(b.withdraw() && b.withdraw());
        assert!(!b.withdraw(), "two tokens pay for two retries");
        assert!(b.is_known_empty());
        // One succeeds: its token back (and a deposit); one fails: spent.
        b.deposit();
        b.on_retry_success();
        assert_eq!(b.available(), 1.5);
        assert!(!b.is_known_empty());
        // Refunds never lift the balance past the cap.
        b.on_retry_success();
        b.on_retry_success();
        assert_eq!(b.balance(), Some(2.0));
    }

    #[test]
    fn clones_share_one_account() {
        let a = OutcomeBudget::new(1, 0.1).unwrap();
        let b = a.clone();
        assert!(a.withdraw());
        assert!(!b.withdraw());
        b.on_retry_success();
        assert!(a.withdraw());
    }

    #[test]
    fn rejects_bad_settings_naming_the_field() {
        assert_eq!(
            OutcomeBudget::new(0, 0.1).unwrap_err().field(),
            "max_tokens"
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 11.0] {
            let e = OutcomeBudget::new(10, bad).unwrap_err();
            assert_eq!(e.field(), "deposit_per_success", "for {bad}");
        }
    }

    #[test]
    fn debug_shows_the_balance() {
        let shown = format!("{:?}", OutcomeBudget::new(3, 0.2).unwrap());
        assert_eq!(
            shown,
            "OutcomeBudget { available: 3.0, max_tokens: 3, deposit_per_success: 0.2 }"
        );
    }
}
