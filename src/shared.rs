//! What every call through one layer shares.

use std::sync::Arc;

use crate::methods::MethodPolicies;
use crate::metrics::Event;
use crate::metrics::RetryMetrics;
use crate::replay::{Account, ReplayMemory};
use crate::trace::{Gauged, NoMetrics, Record, Trace};

/// The policies, the budget and the counters of one layer: every service the
/// layer makes, and every call through them, holds the same `Arc`.
pub(crate) struct Shared<Bu> {
    pub(crate) policies: MethodPolicies,
    pub(crate) budget: Bu,
    pub(crate) metrics: RetryMetrics,
    /// What the replay copies of the calls in flight hold together.
    pub(crate) replay_memory: ReplayMemory,
    /// What the budget's gauge was last set to, by any recorder.
    pub(crate) gauged: Gauged,
}

impl<Bu> Shared<Bu> {
    pub(crate) fn new(policies: MethodPolicies, budget: Bu) -> Arc<Self> {
        Arc::new(Self {
            policies,
            budget,
            metrics: RetryMetrics::default(),
            replay_memory: ReplayMemory::new(ReplayMemory::DEFAULT_LIMIT),
            gauged: Gauged::default(),
        })
    }
}

/// One service's hold on what its layer shares: each service the layer
/// makes, and each clone of one, makes its own (one allocation), and its
/// calls hold this, not the layer's `Arc`.
///
/// A call takes and lets go of its handle several times (its attempts, its
/// call policy, tower's `Retry` cloning both for a retry, the budget credit
/// its body carries): on one `Arc` for the whole layer, every call on every thread
/// would write to the same cache line that many times. On a service's own,
/// those writes stay with the thread that calls through it. Padded to more
/// than a cache line pair (x86-64 fetches lines in pairs), so that two
/// services' handles, made one after the other, never share one.
///
/// It holds what records the calls' standard metrics too, which the layer's
/// type chose: nothing, by default.
// NOTE: padded, not aligned: an allocation aligned past 16 bytes takes the
// allocator's slow way (glibc's `posix_memalign`), which cost each clone of
// a service about 700 instructions more than a plain one (`cargo bench
// --bench instructions`, stack `c-clone`), and tonic's clients are cloned
// for each call.
pub(crate) struct Local<Bu, M = NoMetrics> {
    shared: Arc<Shared<Bu>>,
    recorder: M,
    _room: [u64; ROOM],
}

/// Words of room in a handle: with its counts and the layer's `Arc`, a
/// handle's allocation is more than 128 bytes, so the counts of two handles
/// in a row are never on one pair of cache lines.
const ROOM: usize = 14;

impl<Bu, M: Record + Clone> Local<Bu, M> {
    pub(crate) fn new(shared: &Arc<Shared<Bu>>, recorder: M) -> Arc<Self> {
        Arc::new(Self {
            shared: Arc::clone(shared),
            recorder,
            _room: [0; ROOM],
        })
    }

    /// The budget's balance may have moved: the gauge of gRPC's standard
    /// metrics follows it, if the layer records them.
    #[inline(always)]
    pub(crate) fn budget_moved(&self)
    where
        Bu: crate::budget::Budget,
    {
        let shared = &self.shared;
        self.recorder
            .balance(&shared.gauged, || shared.budget.balance());
    }

    /// The metrics trace of a call to `path` starting now.
    #[inline(always)]
    pub(crate) fn trace(&self, path: &str) -> Trace<M> {
        self.recorder.call(path)
    }

    /// Counts `event`, in the layer's counters and in the standard metrics
    /// of this service's layer, if it records them.
    pub(crate) fn record(&self, event: Event) {
        self.shared.metrics.record(event);
        self.recorder.record(event);
    }

    /// Counts an attempt sent by one of this service's calls.
    #[inline]
    pub(crate) fn count_attempt(&self) {
        self.shared.metrics.attempt();
    }

    /// A handle of its own for another service of the same layer.
    pub(crate) fn fork(&self) -> Arc<Self> {
        Self::new(&self.shared, self.recorder.clone())
    }
}

impl<Bu, M> Local<Bu, M> {
    /// What records this service's calls.
    pub(crate) fn recorder(&self) -> &M {
        &self.recorder
    }
}

impl<Bu, M> std::ops::Deref for Local<Bu, M> {
    type Target = Shared<Bu>;

    #[inline(always)]
    fn deref(&self) -> &Shared<Bu> {
        &self.shared
    }
}

impl<Bu: Send + Sync, M: Send + Sync> Account for Local<Bu, M> {
    #[inline]
    fn memory(&self) -> &ReplayMemory {
        &self.shared.replay_memory
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::RetryBudget;

    #[test]
    fn a_handles_allocation_spans_more_than_a_pair_of_cache_lines() {
        // An `Arc`'s allocation: its two counts, then the handle.
        let counts = 2 * std::mem::size_of::<usize>();
        assert!(counts + std::mem::size_of::<Local<RetryBudget>>() > 128);
        assert!(
            std::mem::align_of::<Local<RetryBudget>>() <= 16,
            "no slow allocation"
        );
    }
}
