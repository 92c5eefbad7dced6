use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use crate::budget::RetryBudget;
use crate::methods::MethodPolicies;
use crate::metrics::RetryMetrics;
use crate::policy::RetryPolicy;
use crate::service::RetryService;
use crate::shared::Shared;

/// Applies [`RetryService`] to a service: see the [crate docs](crate).
///
/// Clones share the budget and the [`RetryMetrics`].
///
/// The budget is a [`RetryBudget`] unless the layer is made with
/// [`with_budget`](RetryLayer::with_budget), which takes any
/// [`tower::retry::budget::Budget`] that is `Send + Sync` (tower's
/// `TpsBudget`, say).
pub struct RetryLayer<Bu = RetryBudget> {
    shared: Arc<Shared<Bu>>,
}

impl RetryLayer {
    /// A layer retrying by `policy`, paying for each retry from `budget`.
    ///
    /// `policy` is one [`RetryPolicy`] for every method, or
    /// [`MethodPolicies`] choosing one per method. Give several layers clones
    /// of one budget to make them share it.
    pub fn new(policy: impl Into<MethodPolicies>, budget: RetryBudget) -> Self {
        Self::with_budget(policy, budget)
    }
}

impl<Bu> RetryLayer<Bu> {
    /// A layer paying for retries from any `tower` retry budget.
    ///
    /// The layer deposits on each successful call (one that ends with `OK`:
    /// for a committed response, when its trailers say so) and withdraws once
    /// per retry, as with [`RetryBudget`]; only a [`RetryBudget`]'s or a
    /// [`RetryThrottle`](crate::RetryThrottle)'s balance shows in the layer's
    /// tracing events. The budget is shared by every call, on any thread: it
    /// must be `Send + Sync`. A budget of `Cell`s is refused here, where it is
    /// made, not at the first call:
    ///
    /// ```compile_fail
    /// use std::cell::Cell;
    /// use tonic_retry::{RetryLayer, RetryPolicy};
    ///
    /// struct Local(Cell<u32>);
    /// impl tower::retry::budget::Budget for Local {
    ///     fn deposit(&self) {}
    ///     fn withdraw(&self) -> bool {
    ///         false
    ///     }
    /// }
    /// let layer = RetryLayer::with_budget(RetryPolicy::default(), Local(Cell::new(0)));
    /// ```
    pub fn with_budget(policy: impl Into<MethodPolicies>, budget: Bu) -> Self
    where
        Bu: tower::retry::budget::Budget + Send + Sync + 'static,
    {
        Self {
            shared: Shared::new(policy.into(), budget),
        }
    }

    /// The default policy: the only one, unless the layer was given
    /// [`MethodPolicies`].
    pub fn policy(&self) -> &RetryPolicy {
        self.shared.policies.default_policy()
    }

    /// The policies by method.
    pub fn policies(&self) -> &MethodPolicies {
        &self.shared.policies
    }

    /// The budget retries are paid from; a [`RetryBudget`]'s
    /// [`available`](RetryBudget::available) balance is the
    /// `retry_budget_available` gauge.
    pub fn budget(&self) -> &Bu {
        &self.shared.budget
    }

    /// What this layer's services have done so far.
    pub fn metrics(&self) -> &RetryMetrics {
        &self.shared.metrics
    }
}

impl<Bu> Clone for RetryLayer<Bu> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, Bu> Layer<S> for RetryLayer<Bu> {
    type Service = RetryService<S, Bu>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryService::from_shared(inner, Arc::clone(&self.shared))
    }
}

impl<Bu: fmt::Debug> fmt::Debug for RetryLayer<Bu> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("policies", &self.shared.policies)
            .field("budget", &self.shared.budget)
            .field("metrics", &self.shared.metrics)
            .finish()
    }
}
