//! The state a streamed body's clones share: the caller's body, the copy, and which attempt may read.

use super::*;

/// The epoch of a clone that was never sent.
pub(super) const UNSENT: u32 = u32::MAX;

/// How many attempts a hedged call may send: its policy's five at most, and
/// one transparent retry.
pub(super) const HEDGE_SLOTS: usize = crate::policy::MAX_ATTEMPTS_LIMIT as usize + 1;

/// A hedged call's attempt `number` (1 to [`HEDGE_SLOTS`]), or 0 for none.
pub(super) fn attempt_number(number: u32) -> u8 {
    u8::try_from(number)
        .ok()
        .filter(|n| (1..=HEDGE_SLOTS as u8).contains(n))
        .unwrap_or(0)
}

/// The bit of `epoch` in a mask of epochs; 0 past 31 (or unsent).
pub(super) fn epoch_bit(epoch: u32) -> u32 {
    1u32.checked_shl(epoch).unwrap_or(0)
}

/// The bit of attempt `number` (1 to 5) in a mask of attempts; 0 for none.
pub(super) fn attempt_bit(number: u8) -> u8 {
    number.checked_sub(1).map_or(0, |i| 1 << i)
}

pub(super) struct Shared<B> {
    /// The caller's body, while it has more to give.
    pub(super) source: Option<B>,
    /// Frames read from the caller's body before the first attempt was
    /// sent ([`ReplayBody::at_once`]), which the attempt at the front reads
    /// as it would the body's.
    pub(super) head: VecDeque<Result<Frame<Bytes>, BoxError>>,
    /// The caller's body ended with the last of `head`.
    pub(super) head_ends: bool,
    /// The caller's body knew its size exactly when `head` was read.
    pub(super) head_exact: bool,
    /// A copy of every data chunk read so far, until the limit is passed.
    pub(super) chunks: Kept,
    /// Data chunks read from the source, including ones no longer kept.
    pub(super) read: usize,
    /// Bytes read from the source.
    pub(super) bytes: usize,
    pub(super) limit: usize,
    pub(super) capped: bool,
    /// Why the copy was dropped, once `capped`.
    pub(super) cap: Cap,
    /// The memory the copies of every call in flight through one layer share,
    /// and how much of it this copy holds.
    pub(super) memory: Option<Arc<dyn Account>>,
    pub(super) reserved: usize,
    /// The epoch of the clone sent last, and how far it has read.
    pub(super) live: u32,
    pub(super) live_pos: usize,
    /// Once the call can no longer be retried: the one clone still allowed to
    /// read (the live attempt's). Nothing it reads is copied.
    pub(super) only: Option<u32>,
    /// The copy is dropped: `only` has replayed it, or never needed it.
    pub(super) released: bool,
    /// Attempts read the body side by side (a hedged call): a later one
    /// being sent does not end an earlier one's reading.
    pub(super) concurrent: bool,
    /// The body's size, when it is known exactly and within the limit: its
    /// copy can never be dropped for the limit, so another attempt can read
    /// it side by side before it is complete (once the layer's memory is
    /// reserved for all of it).
    pub(super) fits: Option<usize>,
    pub(super) ended: bool,
    pub(super) failed: bool,
    /// The caller's body once answered `Pending`: it is not all there.
    pub(super) stalled: bool,
    pub(super) trailers: Option<HeaderMap>,
    /// Clones waiting for the source to make progress.
    pub(super) waiting: Vec<Waker>,
    /// The instance a balancer below reported for the current attempt
    /// (see [`PickedInstance`]): every attempt's request carries this state.
    pub(super) picked: Option<HeaderValue>,
    /// A hedged call's attempts 1 to 6 (five and a transparent retry): the
    /// epoch each was sent as, and how far each has read.
    pub(super) hedge_epochs: [u32; HEDGE_SLOTS],
    pub(super) hedge_pos: [usize; HEDGE_SLOTS],
    /// A hedged call's attempts whose clone is alive (bit `n - 1` for
    /// attempt `n`).
    pub(super) alive: u8,
    /// The attempt the call committed to while other attempts' clones are
    /// alive (losers, or attempts cut by their own timeout, being drained:
    /// their transport may still have to send the body, so it is kept for
    /// them): the copy is released to it when the last of them goes.
    pub(super) heir: u8,
    /// A retried call's attempts sent that may be drained, whose clone is
    /// alive (bit `epoch`).
    pub(super) drainable: u32,
    /// Those of them being drained (cut by their own timeout): their
    /// transport may still have to send the body (failing it would reset
    /// the stream after all), so they may replay what later attempts read,
    /// and the copy is kept while their clone and their drain both last.
    pub(super) draining: u32,
    /// The epoch the call was released to while attempts drain: the release
    /// happens when the last drain is over. Nothing read from then on is
    /// copied: only that attempt reads the caller's body.
    pub(super) heir_epoch: Option<u32>,
    /// Attempts ever cut by their own timeout and drained (bit `epoch`):
    /// even once their drain is over, their transport may hold their body a
    /// while, and they never read the caller's body ahead of an attempt to
    /// come.
    pub(super) cut: u32,
    /// Those draining ones that, since the call was released to
    /// `heir_epoch`, have replayed all the copy holds: they need nothing more
    /// of it.
    pub(super) past: u32,
    /// For a hedged call: reads the caller's body, so that a hedge due
    /// before the first attempt has read it can read it ahead (proven where
    /// the layer's service is made, as the service's other conversions).
    pub(super) pull: Option<Pull<B>>,
    /// A chunk read ahead went past a replay limit: kept for the attempt
    /// sent, which has yet to send it, and no other attempt may be sent. The
    /// copy goes once that attempt has read past it, and nothing more is
    /// copied.
    pub(super) over: bool,
    /// The caller's body failed while read ahead: its error, for the attempt
    /// that reads up to it (later ones get [`ReplayError::SourceFailed`]).
    pub(super) error: Option<BoxError>,
}

/// Whether the caller runs on a tokio runtime.
// NOTE: this clones the runtime's handle (a count the workers of a
// multi-thread runtime share, as each of tokio's timers does). A task's id
// is no cheaper proof: a `LocalSet` polled outside any runtime (by
// `futures::executor::block_on`) runs tasks that have one.
#[inline]
pub(super) fn on_runtime() -> bool {
    tokio::runtime::Handle::try_current().is_ok()
}

/// Polls the caller's body for its next frame, its error boxed.
pub(super) type Pull<B> =
    fn(&mut B, &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>;

pub(super) fn pull<B>(
    body: &mut B,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    Pin::new(body)
        .poll_frame(cx)
        .map(|frame| frame.map(|frame| frame.map_err(Into::into)))
}

impl<B: Send> PickSlot for Mutex<Shared<B>> {
    fn set(&self, instance: HeaderValue) {
        self.lock().unwrap_or_else(PoisonError::into_inner).picked = Some(instance);
    }

    fn get(&self) -> Option<HeaderValue> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .picked
            .clone()
    }
}

impl<B> Shared<B> {
    pub(super) fn replay_state(&self) -> Result<(), ReplayError> {
        if self.capped || self.over {
            return Err(self.cap_error());
        }
        if self.failed {
            return Err(ReplayError::SourceFailed);
        }
        if self.released_to_one() {
            return Err(ReplayError::Released);
        }
        Ok(())
    }

    /// The call can no longer be retried: released to one attempt, now or
    /// once the attempts still draining are done.
    pub(super) fn released_to_one(&self) -> bool {
        self.only.is_some() || self.heir != 0 || self.heir_epoch.is_some()
    }

    pub(super) fn wake_waiting(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        for waker in self.waiting.drain(..) {
            waker.wake();
        }
    }

    pub(super) fn wait(&mut self, cx: &Context<'_>) {
        if !self.waiting.iter().any(|w| w.will_wake(cx.waker())) {
            self.waiting.push(cx.waker().clone());
        }
    }

    /// A hedged call's attempt `number` (0: none sent) is the only one that
    /// may read from now on; the copy goes as soon as it has replayed it.
    pub(super) fn release_to_attempt(&mut self, number: u8) {
        let Some(i) = number.checked_sub(1).map(usize::from) else {
            return self.finalize(UNSENT);
        };
        let epoch = self.hedge_epochs[i];
        self.only = Some(epoch);
        if self.hedge_pos[i] >= self.read || (self.live == epoch && self.live_pos >= self.read) {
            self.drop_copy();
        }
    }

    /// The attempt sent as `epoch` no longer drains (its clone or its drain
    /// is gone): if the call was released meanwhile, the release happens
    /// once no other attempt drains.
    pub(super) fn drain_over(&mut self, epoch: u32) {
        self.draining &= !epoch_bit(epoch);
        // A clone that waited because it was drained may read (or fail) now.
        self.wake_waiting();
        if let Some(heir) = self.heir_epoch
            && self.draining & !epoch_bit(heir) == 0
        {
            self.heir_epoch = None;
            self.finalize(heir);
        } else {
            // This attempt needs nothing more of the copy.
            self.drop_unneeded();
        }
    }

    /// The clone of a hedged call's attempt `number` is gone: if it was the
    /// last loser the body was kept for, the copy goes to the winner.
    pub(super) fn gone(&mut self, number: u8) {
        self.alive &= !attempt_bit(number);
        if self.heir != 0 && self.alive & !attempt_bit(self.heir) == 0 {
            let heir = std::mem::take(&mut self.heir);
            self.release_to_attempt(heir);
        }
    }

    /// Only the clone sent as `epoch` may read from now on; the copy goes
    /// as soon as that clone has replayed it.
    pub(super) fn finalize(&mut self, epoch: u32) {
        if self.draining & !epoch_bit(epoch) != 0 {
            self.heir_epoch = Some(epoch);
            // The attempt released to may be a drained one, now the one
            // reader left; and the drained ones past the copy say so.
            self.wake_waiting();
            self.drop_unneeded();
            return;
        }
        self.only = Some(epoch);
        if self.live == epoch && self.live_pos >= self.read {
            self.drop_copy();
        }
        // A drained attempt it is released to may read on now (and one it
        // is not, fail).
        self.wake_waiting();
    }

    /// The clone of the attempt cut and drained as `epoch` waits: for the
    /// live attempt to read on, or for its drain to end (`waited` set). Once
    /// the call is released while it drains, it needs nothing more of the
    /// copy, which may go.
    pub(super) fn hold_back<T>(
        &mut self,
        epoch: u32,
        waited: &mut bool,
        cx: &Context<'_>,
    ) -> Poll<T> {
        let bit = epoch_bit(epoch);
        if self.heir_epoch.is_some() && self.draining & bit != 0 {
            self.past |= bit;
            self.drop_unneeded();
        }
        self.wait(cx);
        *waited = true;
        Poll::Pending
    }

    /// Released to `heir_epoch` while attempts drain: the copy goes once that
    /// attempt has replayed it and every drained one needs nothing more of it.
    pub(super) fn drop_unneeded(&mut self) {
        if let Some(heir) = self.heir_epoch
            && self.live == heir
            && self.live_pos >= self.chunks.len()
            && self.draining & !epoch_bit(heir) & !self.past == 0
        {
            self.drop_copy();
        }
    }

    pub(super) fn drop_copy(&mut self) {
        if !self.released {
            self.released = true;
            self.chunks = Kept::default();
            self.give_back();
        }
    }

    /// Gives the layer's memory back what this copy held.
    pub(super) fn give_back(&mut self) {
        if self.reserved > 0
            && let Some(memory) = &self.memory
        {
            memory.release(std::mem::take(&mut self.reserved));
        }
    }

    pub(super) fn cap_error(&self) -> ReplayError {
        match self.cap {
            Cap::Call => ReplayError::Capped,
            Cap::Layer => ReplayError::LayerFull,
        }
    }

    /// Drops the copy: the body outgrew `cap`.
    pub(super) fn cap(&mut self, cap: Cap) {
        tracing::debug!(
            limit = self.limit,
            layer_limit = self.memory.as_ref().map(|m| m.memory().limit()),
            ?cap,
            "request body outgrew a replay limit; the call will not be retried"
        );
        self.capped = true;
        self.cap = cap;
        self.chunks = Kept::default();
        self.give_back();
    }

    /// Notes that the clone sent as `epoch` has read up to `pos`.
    pub(super) fn advanced(&mut self, (epoch, attempt): (u32, u8), pos: usize) {
        if let Some(i) = attempt.checked_sub(1) {
            self.hedge_pos[usize::from(i)] = pos;
        }
        if epoch == self.live {
            self.live_pos = pos;
        }
        if (self.only == Some(epoch) || self.over) && pos >= self.read {
            // The last reader has the whole copy now; nobody else will. (Past
            // a limit read ahead, the one attempt sent is that reader.)
            self.drop_copy();
        } else if self.heir_epoch == Some(epoch) {
            self.drop_unneeded();
        }
    }

    /// Keeps a chunk read ahead of the attempts, which have yet to send it:
    /// kept even past a limit (then `over`, and no other attempt may be
    /// sent). Whether it was within the limits.
    pub(super) fn keep_ahead(&mut self, chunk: &Bytes) -> bool {
        self.read += 1;
        self.bytes = self.bytes.saturating_add(chunk.len());
        let within = if self.bytes > self.limit {
            self.cap = Cap::Call;
            false
        } else if self.reserve_to_bytes() {
            true
        } else {
            self.cap = Cap::Layer;
            false
        };
        self.over |= !within;
        self.chunks.push(chunk.clone());
        within
    }

    pub(super) fn keep(&mut self, chunk: &Bytes) {
        self.read += 1;
        self.bytes = self.bytes.saturating_add(chunk.len());
        // Only `only` (or, `over`, the one attempt sent; or the attempt the
        // call is released to once the drains end) reads from here on, and it
        // has this chunk in hand: attempts being drained never read ahead.
        if self.capped || self.only.is_some() || self.over || self.heir_epoch.is_some() {
            return;
        }
        if self.bytes > self.limit {
            return self.cap(Cap::Call);
        }
        if !self.reserve_to_bytes() {
            return self.cap(Cap::Layer);
        }
        self.chunks.push(chunk.clone());
    }

    /// Reserves in the layer's memory what the copy holds beyond what is
    /// reserved for it already (nothing, when its whole size was reserved
    /// ahead). Whether it could.
    pub(super) fn reserve_to_bytes(&mut self) -> bool {
        self.reserve(self.bytes)
    }

    /// Reserves in the layer's memory up to `bytes` for the copy in all.
    pub(super) fn reserve(&mut self, bytes: usize) -> bool {
        let more = bytes.saturating_sub(self.reserved);
        match &self.memory {
            Some(memory) if more > 0 => {
                if !memory.try_reserve(more) {
                    return false;
                }
                self.reserved += more;
                true
            }
            _ => true,
        }
    }
}

impl<B> Drop for Shared<B> {
    fn drop(&mut self) {
        self.give_back();
    }
}
