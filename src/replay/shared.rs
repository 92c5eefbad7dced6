//! The state a streamed body's clones share: the caller's body, the copy, and which attempts may read.
//!
//! [`Shared`] holds four parts, each with its own invariants:
//!
//! | part | what it holds | changed by |
//! |---|---|---|
//! | [`Input`] | the caller's body, what was read of it before the first attempt, how it ended, the clones waiting on it | the clone at the front, and a hedge reading ahead |
//! | [`Copied`] | the chunks kept for replay, the limits on them, what they hold of the layer's memory, and the copy's [`Keeping`] | reading on; the transitions in `phase` |
//! | [`Phase`] | which attempts may read: any, or one (now or once others are done) | the transitions in `phase` only |
//! | [`Readers`] | the attempts sent: the live one, a hedged call's attempts, a retried call's drains | sending, reading and dropping clones; the drains |

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

pub(super) struct Shared<B> {
    pub(super) input: Input<B>,
    pub(super) copy: Copied,
    pub(super) phase: Phase,
    pub(super) readers: Readers,
    /// The instance a balancer below reported for the current attempt
    /// (see [`PickedInstance`]): every attempt's request carries this state.
    pub(super) picked: Option<HeaderValue>,
}

/// The caller's body, and what reading it has shown.
pub(super) struct Input<B> {
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
    /// For a hedged call: reads the caller's body, so that a hedge due
    /// before the first attempt has read it can read it ahead (proven where
    /// the layer's service is made, as the service's other conversions).
    pub(super) pull: Option<Pull<B>>,
    /// The caller's body once answered `Pending`: it is not all there.
    pub(super) stalled: bool,
    pub(super) ended: bool,
    pub(super) failed: bool,
    /// The caller's body failed while read ahead: its error, for the attempt
    /// that reads up to it (later ones get [`ReplayError::SourceFailed`]).
    pub(super) error: Option<BoxError>,
    pub(super) trailers: Option<HeaderMap>,
    /// Clones waiting for the source to make progress.
    pub(super) waiting: Vec<Waker>,
}

/// The chunks kept for replay, and what may be kept.
pub(super) struct Copied {
    /// A copy of every data chunk read so far, while [`Keeping`] allows.
    pub(super) chunks: Kept,
    /// Data chunks read from the source, including ones no longer kept.
    pub(super) read: usize,
    /// Bytes read from the source.
    pub(super) bytes: usize,
    pub(super) limit: usize,
    /// The body's size, when it is known exactly and within the limit: its
    /// copy can never be dropped for the limit, so another attempt can read
    /// it side by side before it is complete (once the layer's memory is
    /// reserved for all of it).
    pub(super) fits: Option<usize>,
    /// The memory the copies of every call in flight through one layer share,
    /// and how much of it this copy holds.
    pub(super) memory: Option<Arc<dyn Account>>,
    pub(super) reserved: usize,
    pub(super) keeping: Keeping,
}

/// The attempts sent, and how far each has read.
pub(super) struct Readers {
    /// The epoch of the clone sent last, and how far it has read.
    pub(super) live: u32,
    pub(super) live_pos: usize,
    /// Attempts read the body side by side (a hedged call): a later one
    /// being sent does not end an earlier one's reading.
    pub(super) concurrent: bool,
    /// A hedged call's attempts 1 to 6 (five and a transparent retry).
    pub(super) hedged: [Hedged; HEDGE_SLOTS],
    /// A retried call's attempts that may be drained, by epoch.
    pub(super) drains: DrainTable,
}

/// One of a hedged call's attempts.
#[derive(Clone, Copy)]
pub(super) struct Hedged {
    /// The epoch it was sent as ([`UNSENT`] until it is).
    pub(super) epoch: u32,
    /// How far it has read.
    pub(super) pos: usize,
    /// Its clone is alive: it may still have to send the body.
    pub(super) alive: bool,
}

impl Readers {
    /// A hedged call's attempt `number` (1 to [`HEDGE_SLOTS`]); `None` for
    /// 0, a clone that is no hedged call's attempt.
    pub(super) fn attempt(&mut self, number: u8) -> Option<&mut Hedged> {
        usize::from(number)
            .checked_sub(1)
            .and_then(|i| self.hedged.get_mut(i))
    }

    /// Whether a hedged call's attempt other than `number` has its clone
    /// alive.
    pub(super) fn others_alive(&self, number: u8) -> bool {
        self.hedged
            .iter()
            .zip(1..)
            .any(|(slot, n)| slot.alive && n != number)
    }
}

impl Default for Hedged {
    fn default() -> Self {
        Hedged {
            epoch: UNSENT,
            pos: 0,
            alive: false,
        }
    }
}

impl<B> Shared<B> {
    pub(super) fn new(
        body: B,
        limit: usize,
        (capped, fits): (bool, Option<usize>),
        memory: Option<Arc<dyn Account>>,
        pull: Option<Pull<B>>,
    ) -> Self {
        Shared {
            input: Input {
                source: Some(body),
                head: VecDeque::new(),
                head_ends: false,
                head_exact: false,
                pull,
                stalled: false,
                ended: false,
                failed: false,
                error: None,
                trailers: None,
                waiting: Vec::new(),
            },
            copy: Copied {
                chunks: Kept::default(),
                read: 0,
                bytes: 0,
                limit,
                fits,
                memory,
                reserved: 0,
                keeping: if capped {
                    Keeping::Capped(Cap::Call)
                } else {
                    Keeping::Copying
                },
            },
            phase: Phase::Open,
            readers: Readers {
                live: 0,
                live_pos: 0,
                concurrent: false,
                hedged: [Hedged::default(); HEDGE_SLOTS],
                drains: DrainTable::default(),
            },
            picked: None,
        }
    }
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

impl<B> Input<B> {
    pub(super) fn wake_waiting(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        for waker in self.waiting.drain(..) {
            waker.wake();
        }
    }

    /// The caller's body ended, with `trailers` if it sent some.
    pub(super) fn end(&mut self, trailers: Option<HeaderMap>) {
        self.trailers = trailers;
        self.ended = true;
        self.source = None;
    }

    /// The caller's body failed; `error` is kept for the attempt that reads
    /// up to it.
    pub(super) fn fail(&mut self, error: Option<BoxError>) {
        self.failed = true;
        self.source = None;
        self.error = error;
    }

    pub(super) fn wait(&mut self, cx: &Context<'_>) {
        if !self.waiting.iter().any(|w| w.will_wake(cx.waker())) {
            self.waiting.push(cx.waker().clone());
        }
    }
}

impl<B> Shared<B> {
    pub(super) fn replay_state(&self) -> Result<(), ReplayError> {
        if let Some(cap) = self.copy.keeping.limit() {
            return Err(cap.error());
        }
        if self.input.failed {
            return Err(ReplayError::SourceFailed);
        }
        if self.released_to_one() {
            return Err(ReplayError::Released);
        }
        Ok(())
    }

    /// The call can no longer be retried: released to one attempt, now or
    /// once the attempts still draining (or a hedged call's losers) are done.
    pub(super) fn released_to_one(&self) -> bool {
        !matches!(self.phase, Phase::Open)
    }

    /// Notes that the clone sent as `epoch` (a hedged call's `attempt`, or
    /// 0) has read up to `pos`.
    pub(super) fn advanced(&mut self, (epoch, attempt): (u32, u8), pos: usize) {
        if let Some(slot) = self.readers.attempt(attempt) {
            slot.pos = pos;
        }
        if epoch == self.readers.live {
            self.readers.live_pos = pos;
        }
        let over = self.copy.keeping.is_over();
        if (self.phase == Phase::Only(epoch) || over) && pos >= self.copy.read {
            // The last reader has the whole copy now; nobody else will. (Past
            // a limit read ahead, the one attempt sent is that reader.)
            self.copy.drop_copy();
        } else if self.phase == Phase::Drains(epoch) {
            self.drop_unneeded();
        }
    }

    /// Keeps a chunk read ahead of the attempts, which have yet to send it:
    /// kept even past a limit (then [`Keeping::Over`], and no other attempt
    /// may be sent). Whether it was within the limits.
    pub(super) fn keep_ahead(&mut self, chunk: &Bytes) -> bool {
        let copy = &mut self.copy;
        copy.read += 1;
        copy.bytes = copy.bytes.saturating_add(chunk.len());
        let outgrown = if copy.bytes > copy.limit {
            Some(Cap::Call)
        } else if copy.reserve_to_bytes() {
            None
        } else {
            Some(Cap::Layer)
        };
        if let Some(cap) = outgrown {
            copy.keeping.go_over(cap);
        }
        copy.chunks.push(chunk.clone());
        outgrown.is_none()
    }

    /// Copies a chunk the attempt at the front has just read, while another
    /// attempt may need it.
    pub(super) fn keep(&mut self, chunk: &Bytes) {
        let copy = &mut self.copy;
        copy.read += 1;
        copy.bytes = copy.bytes.saturating_add(chunk.len());
        // Only the one reader left (or, over a limit, the one attempt sent)
        // reads from here on, and it has this chunk in hand: attempts being
        // drained never read ahead. (A hedged call's losers still alive may
        // replay it: it is copied for them.)
        if copy.keeping != Keeping::Copying
            || matches!(self.phase, Phase::Only(_) | Phase::Drains(_))
        {
            return;
        }
        if copy.bytes > copy.limit {
            return copy.cap(Cap::Call);
        }
        if !copy.reserve_to_bytes() {
            return copy.cap(Cap::Layer);
        }
        copy.chunks.push(chunk.clone());
    }
}

impl Copied {
    /// Drops the copy: no attempt will replay it.
    pub(super) fn drop_copy(&mut self) {
        if self.keeping.drop_copy() {
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

    /// Drops the copy: the body outgrew `cap`.
    pub(super) fn cap(&mut self, cap: Cap) {
        tracing::debug!(
            limit = self.limit,
            layer_limit = self.memory.as_ref().map(|m| m.memory().limit()),
            ?cap,
            "request body outgrew a replay limit; the call will not be retried"
        );
        self.keeping = Keeping::Capped(cap);
        self.chunks = Kept::default();
        self.give_back();
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

impl Drop for Copied {
    fn drop(&mut self) {
        self.give_back();
    }
}
