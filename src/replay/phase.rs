//! The copy's life, as explicit state: which attempts may read ([`Phase`]),
//! whether the copy is kept ([`Keeping`]), and each drained attempt's part in
//! it ([`Drain`]). Every transition of a [`Phase`] is made here.

use super::*;

/// Which attempts may read the body.
///
/// ```text
///            release_to, losers alive          last loser's clone gone
///   Open ─────────────────────────────▶ Losers(n) ─────────────────────▶ Only(epoch of n)
///    │   finalize(e), others drain               last other drain over
///    ├────────────────────────────────▶ Drains(e) ──────────────────────▶ Only(e)
///    │   finalize(e), release_to(n), no other reader
///    └────────────────────────────────────────────────────────────────▶ Only(_)
/// ```
///
/// No transition leads back to `Open`: once the call can no longer be
/// retried, it never can again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// A retry may follow: any attempt sent may read, and what the attempt
    /// at the front reads is copied.
    Open,
    /// A hedged call committed to its attempt `n` (1 to [`HEDGE_SLOTS`])
    /// while other attempts' clones are alive (losers being drained: their
    /// transport may still have to send the body, and failing it would reset
    /// their stream after all). Chunks are still copied for them.
    ///
    /// Entered only by [`ReplayBody::release_to`]; a hedged call is released
    /// no other way.
    Losers(u8),
    /// Released to the attempt sent as this epoch while other attempts
    /// drain (cut by their own timeout). Nothing read from now on is copied:
    /// only this attempt reads the caller's body; the drained ones replay
    /// what is kept, then wait for their drain to end.
    Drains(u32),
    /// Only the clone sent as this epoch may read. Nothing more is copied,
    /// and the copy goes once it has replayed it.
    Only(u32),
}

impl Phase {
    /// The one attempt left to read the caller's body, now or once the
    /// others are done.
    pub(super) fn reader(self) -> Option<u32> {
        match self {
            Phase::Drains(epoch) | Phase::Only(epoch) => Some(epoch),
            Phase::Open | Phase::Losers(_) => None,
        }
    }
}

/// Whether the copy is kept.
///
/// ```text
///   Copying ──outgrew a limit──▶ Capped(cap)
///      │ ──read ahead past a limit──▶ Over(cap) ──its reader past it──▶ Dropped(Some(cap))
///      └──no attempt needs it──▶ Dropped(None)
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Keeping {
    /// Every chunk read is copied (as long as the [`Phase`] needs it).
    Copying,
    /// The body outgrew `cap`: the copy is dropped, the attempt reading
    /// carries on, and no other attempt may read what was dropped.
    Capped(Cap),
    /// A chunk read ahead went past `cap`: kept for the attempt sent, which
    /// has yet to send it, and no other attempt may be sent. The copy goes
    /// once that attempt has read past it, and nothing more is copied.
    Over(Cap),
    /// The copy is dropped because no attempt needs it; after [`Over`](Self::Over), the
    /// limit it went past.
    Dropped(Option<Cap>),
}

impl Keeping {
    /// The limit the body went past, if any: no retry may be sent.
    pub(super) fn limit(self) -> Option<Cap> {
        match self {
            Keeping::Capped(cap) | Keeping::Over(cap) | Keeping::Dropped(Some(cap)) => Some(cap),
            Keeping::Copying | Keeping::Dropped(None) => None,
        }
    }

    pub(super) fn is_capped(self) -> bool {
        matches!(self, Keeping::Capped(_))
    }

    pub(super) fn is_over(self) -> bool {
        matches!(self, Keeping::Over(_) | Keeping::Dropped(Some(_)))
    }

    pub(super) fn is_dropped(self) -> bool {
        matches!(self, Keeping::Dropped(_))
    }

    /// A chunk read ahead went past `cap`. Reading ahead stops there, so
    /// this happens at most once, while copying.
    pub(super) fn go_over(&mut self, cap: Cap) {
        if *self == Keeping::Copying {
            *self = Keeping::Over(cap);
        }
    }

    /// No attempt needs the copy: whether it was still held (a capped copy
    /// was dropped already).
    pub(super) fn drop_copy(&mut self) -> bool {
        match *self {
            Keeping::Copying => *self = Keeping::Dropped(None),
            Keeping::Over(cap) => *self = Keeping::Dropped(Some(cap)),
            Keeping::Capped(_) | Keeping::Dropped(_) => return false,
        }
        true
    }
}

/// A retried call's attempt, in the drain's view.
///
/// ```text
///   Idle ──sent, may be drained──▶ Sent ──cut, drain starts──▶ Draining ──▶ Past
///    │                              │                            │           │
///    │ cut, its clone gone          └──clone gone──▶ Idle         └─drain over or clone gone─▶ Cut
///    └──────────────────────────────────────────────────────────────────────▶ Cut
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Drain {
    /// Not sent as a drainable attempt, or its clone is gone before any cut.
    #[default]
    Idle,
    /// Sent, its clone alive: it may be cut and drained.
    Sent,
    /// Cut by its own timeout and drained, its clone alive: its transport
    /// may still have to send the body (failing it would reset the stream
    /// after all), so it may replay what later attempts read, and the copy
    /// is kept for it.
    Draining,
    /// Draining, and since the call was released ([`Phase::Drains`]) it
    /// has replayed all the copy holds: it needs nothing more of it.
    Past,
    /// Cut once, its drain over or its clone gone: its transport may hold
    /// its body a while, so it never reads the caller's body ahead of an
    /// attempt to come.
    Cut,
}

/// How many of a retried call's attempts the drain tracks: attempts sent
/// later are never drained (they are reset when cut).
pub(super) const DRAIN_SLOTS: usize = 32;

/// The [`Drain`] of each of a retried call's attempts, by epoch.
#[derive(Default)]
pub(super) struct DrainTable([Drain; DRAIN_SLOTS]);

impl DrainTable {
    fn of(&self, epoch: u32) -> Drain {
        usize::try_from(epoch)
            .ok()
            .and_then(|i| self.0.get(i))
            .copied()
            .unwrap_or_default()
    }

    fn set(&mut self, epoch: u32, drain: Drain) {
        if let Some(slot) = usize::try_from(epoch).ok().and_then(|i| self.0.get_mut(i)) {
            *slot = drain;
        }
    }

    /// Whether the attempt sent as `epoch` can be tracked.
    pub(super) fn tracks(epoch: u32) -> bool {
        usize::try_from(epoch).is_ok_and(|i| i < DRAIN_SLOTS)
    }

    /// The attempt sent as `epoch` may be drained.
    pub(super) fn sent(&mut self, epoch: u32) {
        self.set(epoch, Drain::Sent);
    }

    /// The attempt sent as `epoch` is cut and drained.
    pub(super) fn start(&mut self, epoch: u32) {
        let next = match self.of(epoch) {
            Drain::Sent => Drain::Draining,
            Drain::Draining | Drain::Past => return,
            Drain::Idle | Drain::Cut => Drain::Cut,
        };
        self.set(epoch, next);
    }

    /// The clone of the attempt sent as `epoch` is gone.
    pub(super) fn gone(&mut self, epoch: u32) {
        if self.of(epoch) == Drain::Sent {
            self.set(epoch, Drain::Idle);
        }
    }

    /// The drain of the attempt sent as `epoch` is over (or its clone gone).
    pub(super) fn over(&mut self, epoch: u32) {
        if self.is_draining(epoch) {
            self.set(epoch, Drain::Cut);
        }
    }

    /// The attempt sent as `epoch`, draining, needs nothing more of the copy.
    pub(super) fn past(&mut self, epoch: u32) {
        if self.of(epoch) == Drain::Draining {
            self.set(epoch, Drain::Past);
        }
    }

    pub(super) fn is_draining(&self, epoch: u32) -> bool {
        matches!(self.of(epoch), Drain::Draining | Drain::Past)
    }

    pub(super) fn was_cut(&self, epoch: u32) -> bool {
        matches!(self.of(epoch), Drain::Draining | Drain::Past | Drain::Cut)
    }

    /// Whether an attempt other than `epoch` is draining.
    pub(super) fn others_draining(&self, epoch: u32) -> bool {
        self.others(epoch)
            .any(|d| matches!(d, Drain::Draining | Drain::Past))
    }

    /// Whether an attempt other than `epoch` is draining and may still
    /// replay the copy.
    pub(super) fn others_need_copy(&self, epoch: u32) -> bool {
        self.others(epoch).any(|d| d == Drain::Draining)
    }

    fn others(&self, epoch: u32) -> impl Iterator<Item = Drain> + '_ {
        self.0
            .iter()
            .enumerate()
            .filter(move |(i, _)| u32::try_from(*i).ok() != Some(epoch))
            .map(|(_, d)| *d)
    }
}

/// The transitions of [`Phase`], and the copy's release they bring.
impl<B> Shared<B> {
    /// Only the clone sent as `epoch` may read from now on (`Open` or
    /// `Drains` to `Drains(epoch)` while other attempts drain, else to
    /// `Only(epoch)`); the copy goes as soon as that clone has replayed it.
    ///
    /// A call is released once: a hedged call by [`commit_to`](Self::commit_to),
    /// whose `Losers` stays as it is here; a retried one by its last attempt
    /// sent, then again (to the same attempt) when it ends. So `Only` never
    /// becomes `Drains`: a drain that starts later finds its clone released.
    pub(super) fn finalize(&mut self, epoch: u32) {
        if matches!(self.phase, Phase::Losers(_)) {
            return;
        }
        if !matches!(self.phase, Phase::Only(_)) && self.readers.drains.others_draining(epoch) {
            self.phase = Phase::Drains(epoch);
            // The attempt released to may be a drained one, now the one
            // reader left; and the drained ones past the copy say so.
            self.input.wake_waiting();
            self.drop_unneeded();
            return;
        }
        self.phase = Phase::Only(epoch);
        if self.readers.live == epoch && self.readers.live_pos >= self.copy.read {
            self.copy.drop_copy();
        }
        // A drained attempt it is released to may read on now (and one it
        // is not, fail).
        self.input.wake_waiting();
    }

    /// A hedged call's attempt `number` (0: none sent) is the only one that
    /// may read from now on (to `Only`); the copy goes as soon as it has
    /// replayed it.
    pub(super) fn release_to_attempt(&mut self, number: u8) {
        let Some(slot) = self.readers.attempt(number).map(|slot| *slot) else {
            return self.finalize(UNSENT);
        };
        self.phase = Phase::Only(slot.epoch);
        let readers = &self.readers;
        let live_done = readers.live == slot.epoch && readers.live_pos >= self.copy.read;
        if slot.pos >= self.copy.read || live_done {
            self.copy.drop_copy();
        }
    }

    /// A hedged call committed to its attempt `number`: `Open` to `Only` at
    /// once when no other attempt's clone is alive, else to `Losers(number)`.
    /// A call already released stays released: a clone refused never reads
    /// again, and nothing more is copied.
    pub(super) fn commit_to(&mut self, number: u8) {
        if self.phase != Phase::Open {
            return;
        }
        if !self.readers.others_alive(number) {
            self.release_to_attempt(number);
        } else if number != 0 {
            self.phase = Phase::Losers(number);
        }
    }

    /// The clone of a hedged call's attempt `number` is gone: if it was the
    /// last loser the body was kept for, `Losers` to `Only`.
    pub(super) fn gone(&mut self, number: u8) {
        if let Some(slot) = self.readers.attempt(number) {
            slot.alive = false;
        }
        if let Phase::Losers(heir) = self.phase
            && !self.readers.others_alive(heir)
        {
            self.release_to_attempt(heir);
        }
    }

    /// The attempt sent as `epoch` no longer drains (its clone or its drain
    /// is gone): if the call was released meanwhile, `Drains` to `Only`
    /// once no other attempt drains.
    pub(super) fn drain_over(&mut self, epoch: u32) {
        self.readers.drains.over(epoch);
        // A clone that waited because it was drained may read (or fail) now.
        self.input.wake_waiting();
        if let Phase::Drains(heir) = self.phase
            && !self.readers.drains.others_draining(heir)
        {
            self.finalize(heir);
        } else {
            // This attempt needs nothing more of the copy.
            self.drop_unneeded();
        }
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
        if matches!(self.phase, Phase::Drains(_)) && self.readers.drains.is_draining(epoch) {
            self.readers.drains.past(epoch);
            self.drop_unneeded();
        }
        self.input.wait(cx);
        *waited = true;
        Poll::Pending
    }

    /// Released to an attempt while others drain: the copy goes once that
    /// attempt has replayed it and every drained one needs nothing more of it.
    pub(super) fn drop_unneeded(&mut self) {
        if let Phase::Drains(heir) = self.phase
            && self.readers.live == heir
            && self.readers.live_pos >= self.copy.chunks.len()
            && !self.readers.drains.others_need_copy(heir)
        {
            self.copy.drop_copy();
        }
    }
}
