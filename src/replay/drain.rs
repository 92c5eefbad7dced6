//! The hand-off of an attempt to the drain, which reads it to its end after the call let it go.

use super::*;

/// A retried call's attempt sent, which may be drained: [`drain`](Self::drain)
/// lets its clone read on (replaying what later attempts read) while the
/// guard it returns, held by the drain, lasts and the clone is alive; the
/// call's copy is kept that long. It does not keep the call's body state
/// alive: once every clone is gone, the copy and the caller's body go,
/// however long the drain lasts.
pub(crate) struct Lingering {
    pub(super) shared: Weak<dyn Drains>,
    pub(super) epoch: u32,
}

impl Lingering {
    /// The attempt is drained from now on.
    pub(crate) fn drain(self) -> DrainGuard {
        if let Some(shared) = self.shared.upgrade() {
            shared.start(self.epoch);
        }
        DrainGuard(self)
    }
}

/// An attempt being drained; see [`Lingering`].
pub(crate) struct DrainGuard(Lingering);

impl Drop for DrainGuard {
    fn drop(&mut self) {
        if let Some(shared) = self.0.shared.upgrade() {
            shared.end(self.0.epoch);
        }
    }
}

/// The replay state, as a drain sees it (whatever the body type).
pub(super) trait Drains: Send + Sync {
    fn start(&self, epoch: u32);
    fn end(&self, epoch: u32);
}

impl<B: Send> Drains for Mutex<Shared<B>> {
    fn start(&self, epoch: u32) {
        // A clone already gone (its body sent whole) needs nothing kept.
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .readers
            .drains
            .start(epoch);
    }

    fn end(&self, epoch: u32) {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain_over(epoch);
    }
}
