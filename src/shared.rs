//! What every call through one layer shares.

use std::sync::Arc;

use crate::methods::MethodPolicies;
use crate::metrics::RetryMetrics;
use crate::replay::ReplayMemory;
use crate::trace::Trace;

/// The policies, the budget and the counters of one layer: every service the
/// layer makes, and every call through them, holds the same `Arc`.
pub(crate) struct Shared<Bu> {
    pub(crate) policies: MethodPolicies,
    pub(crate) budget: Bu,
    pub(crate) metrics: RetryMetrics,
    /// What the replay copies of the calls in flight hold together.
    pub(crate) replay_memory: Arc<ReplayMemory>,
    /// gRPC's standard metrics, once given to the layer.
    #[cfg(feature = "opentelemetry")]
    pub(crate) otel: std::sync::OnceLock<Arc<crate::otel::Otel>>,
}

impl<Bu> Shared<Bu> {
    pub(crate) fn new(policies: MethodPolicies, budget: Bu) -> Arc<Self> {
        Arc::new(Self {
            policies,
            budget,
            metrics: RetryMetrics::default(),
            replay_memory: Arc::new(ReplayMemory::new(ReplayMemory::DEFAULT_LIMIT)),
            #[cfg(feature = "opentelemetry")]
            otel: std::sync::OnceLock::new(),
        })
    }

    /// The budget's balance may have moved: the gauge of gRPC's standard
    /// metrics follows it, if the layer records them.
    #[inline]
    pub(crate) fn budget_moved(&self)
    where
        Bu: crate::budget::Budget,
    {
        #[cfg(feature = "opentelemetry")]
        if let Some(otel) = self.otel.get() {
            otel.balance(self.budget.balance());
        }
    }

    /// The metrics trace of a call to `path` starting now: nothing unless
    /// the layer was given gRPC's standard metrics.
    #[inline]
    pub(crate) fn trace(&self, path: &str) -> Trace {
        #[cfg(feature = "opentelemetry")]
        if let Some(otel) = self.otel.get() {
            return otel.call(path);
        }
        let _ = path;
        Trace::none()
    }
}
