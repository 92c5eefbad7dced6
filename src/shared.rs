//! What every call through one layer shares.

use std::sync::Arc;

use crate::metrics::RetryMetrics;
use crate::policy::RetryPolicy;

/// The policy, the budget and the counters of one layer: every service the
/// layer makes, and every call through them, holds the same `Arc`.
pub(crate) struct Shared<Bu> {
    pub(crate) policy: RetryPolicy,
    pub(crate) budget: Bu,
    pub(crate) metrics: RetryMetrics,
}

impl<Bu> Shared<Bu> {
    pub(crate) fn new(policy: RetryPolicy, budget: Bu) -> Arc<Self> {
        Arc::new(Self {
            policy,
            budget,
            metrics: RetryMetrics::default(),
        })
    }
}
