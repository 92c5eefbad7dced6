use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use crate::budget::RetryBudget;
use crate::metrics::RetryMetrics;
use crate::policy::RetryPolicy;
use crate::service::{RetryService, Shared};

/// Applies [`RetryService`] to a service: see the [crate docs](crate).
///
/// Clones share the budget and the [`RetryMetrics`].
#[derive(Clone)]
pub struct RetryLayer {
    shared: Arc<Shared>,
}

impl RetryLayer {
    /// A layer retrying by `policy`, paying for each retry from `budget`.
    ///
    /// Give several layers clones of one budget to make them share it.
    pub fn new(policy: RetryPolicy, budget: RetryBudget) -> Self {
        Self {
            shared: Arc::new(Shared {
                policy,
                budget,
                metrics: RetryMetrics::default(),
            }),
        }
    }

    /// The policy in use.
    pub fn policy(&self) -> &RetryPolicy {
        &self.shared.policy
    }

    /// The budget retries are paid from; its [`available`](RetryBudget::available)
    /// balance is the `retry_budget_available` gauge.
    pub fn budget(&self) -> &RetryBudget {
        &self.shared.budget
    }

    /// What this layer's services have done so far.
    pub fn metrics(&self) -> &RetryMetrics {
        &self.shared.metrics
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = RetryService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryService::from_shared(inner, Arc::clone(&self.shared))
    }
}

impl fmt::Debug for RetryLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("policy", &self.shared.policy)
            .field("budget", &self.shared.budget)
            .field("metrics", &self.shared.metrics)
            .finish()
    }
}
