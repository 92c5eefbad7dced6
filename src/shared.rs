//! What every call through one layer shares.

use std::sync::Arc;

use crate::methods::MethodPolicies;
use crate::metrics::RetryMetrics;
use crate::replay::ReplayMemory;

/// The policies, the budget and the counters of one layer: every service the
/// layer makes, and every call through them, holds the same `Arc`.
pub(crate) struct Shared<Bu> {
    pub(crate) policies: MethodPolicies,
    pub(crate) budget: Bu,
    pub(crate) metrics: RetryMetrics,
    /// What the replay copies of the calls in flight hold together.
    pub(crate) replay_memory: Arc<ReplayMemory>,
}

impl<Bu> Shared<Bu> {
    pub(crate) fn new(policies: MethodPolicies, budget: Bu) -> Arc<Self> {
        Arc::new(Self {
            policies,
            budget,
            metrics: RetryMetrics::default(),
            replay_memory: Arc::new(ReplayMemory::new(ReplayMemory::DEFAULT_LIMIT)),
        })
    }
}
