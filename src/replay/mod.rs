//! A request body that can be sent again.
//!
//! The first attempt streams the body as the caller produces it — nothing waits
//! for the body to end — while a copy of each chunk (a `Bytes` clone, so no
//! bytes are copied) is kept, up to a limit. A clone made for a retry first
//! replays the kept chunks, then goes on reading the caller's body where the
//! earlier attempt left off, so a retry can even start before the caller has
//! finished sending. Trailers are kept and replayed too.
//!
//! Once the body outgrows the limit, the copy is dropped: the attempt that is
//! reading carries on and delivers the body whole, but the body can no longer be
//! replayed, and the layer does not retry the call. A clone that would need
//! dropped chunks fails with [`ReplayError`] rather than send a truncated body.
//! The layer also bounds the copies of all its calls in flight together (16
//! MiB by default, as grpc-java's retry buffer): a call whose copy would pass
//! that drops its copy the same way — it is sent, never held back, and not
//! retried.
//!
//! The copy also goes as soon as the call can no longer be retried — its
//! response committed, the call decided, or its last attempt sent — and the
//! attempt still reading has replayed it; nothing more is copied after that: a
//! long client or bidirectional stream holds no copy for its lifetime. From
//! then on only that attempt's clone may read: an earlier attempt's clone that
//! its HTTP stream still pulls fails instead of taking chunks the live attempt
//! needs.
//!
//! A retried call whose first attempt is sent at once (its service was
//! ready, and no limit of zero cuts it before it goes, on a tokio runtime)
//! has what its body holds ready read first, without waiting: a unary call's
//! one message, which tonic's encoder gives at once, is then all there. A body
//! read to its end so, within the limits, is kept whole: every clone replays
//! it from one immutable copy, with no lock, and none is ever refused (none
//! can take what another needs). The layer's memory counts it while a retry
//! may still replay it or an attempt sent has yet to read it all. A body not
//! all there goes on as above, its first attempt sending what was read before
//! it reads on. (The one wire difference: an HTTP/2 client sees the request's
//! end with its last chunk, and sends it in the same frame rather than in an
//! empty one after it.)

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use tower::BoxError;

use crate::marks::{PickSlot, PickedInstance};
use crate::stripes::{Padded, STRIPES, thread_stripe};

mod drain;
mod memory;
mod phase;
mod read;
mod shared;
#[cfg(test)]
mod tests;
mod whole;

use drain::Drains;
pub(crate) use drain::{DrainGuard, Lingering};
use memory::Kept;
pub(crate) use memory::{Account, Cap, ReplayMemory};
use phase::*;
use shared::*;
use whole::*;

/// A request body shared by every attempt of one call; see the
/// [module docs](self).
///
/// Clones share one source and one copy; each clone reads the whole body from
/// its start.
pub struct ReplayBody<B> {
    state: State<B>,
    /// The next chunk this clone yields.
    pos: usize,
    /// Whether this clone has yielded the trailers.
    trailers_sent: bool,
    /// Which send this clone went out as: 0 for the first attempt's (the
    /// body `new` made), [`UNSENT`] for a clone not sent (yet).
    epoch: u32,
    /// What the call marked this clone as (see [`Marks`]).
    marks: Marks,
    /// Whether the caller's body ever answered this clone `Pending`: only
    /// then can its waker be the one the body will wake.
    waited: bool,
    /// For a hedged call's attempt, its number (1 to 5); 0 otherwise.
    attempt: u8,
}

/// What the call marked a clone as, a bit each. (A clone goes with every
/// attempt's request, which is moved several times on every call: kept in
/// one byte, a body stays at 32 bytes, and a request within what a move
/// copies cheaply.)
#[derive(Clone, Copy, Default)]
struct Marks(u8);

impl Marks {
    /// The clone is to be the call's last attempt.
    const LAST: u8 = 1;
    /// The clone goes out as a retry: an earlier attempt of the call was
    /// sent, so this one is paid for.
    const RETRY: u8 = 1 << 1;
    /// The clone goes out as a hedge (paid for as a retry is).
    const HEDGE: u8 = 1 << 2;
    /// A retried call's attempt sent that may be drained if cut by its own
    /// timeout (see [`ReplayBody::drainable`]).
    const DRAINABLE: u8 = 1 << 3;
    /// An attempt sent whose clone of a [`Whole`] body has yet to read it
    /// all: one of the body's readers.
    const READING: u8 = 1 << 4;
    /// The clone goes out as a transparent retry: sent again because the
    /// server refused the stream of the attempt before it, and not paid for.
    const TRANSPARENT: u8 = 1 << 5;

    fn has(self, mark: u8) -> bool {
        self.0 & mark != 0
    }

    fn set(&mut self, mark: u8) {
        self.0 |= mark;
    }

    fn clear(&mut self, mark: u8) {
        self.0 &= !mark;
    }
}

/// Where the clones of one body read from.
enum State<B> {
    /// The caller's body, streamed by the attempt at the front and copied
    /// for the others.
    Streamed(Arc<Mutex<Shared<B>>>),
    /// The caller's body, read whole before the first attempt was sent.
    Whole(Arc<Whole>),
}

impl<B> Clone for State<B> {
    fn clone(&self) -> Self {
        match self {
            State::Streamed(shared) => State::Streamed(Arc::clone(shared)),
            State::Whole(whole) => State::Whole(Arc::clone(whole)),
        }
    }
}

/// Why a clone of a [`ReplayBody`] could not give the whole body again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplayError {
    /// The body outgrew the replay limit, so its copy was dropped.
    Capped,
    /// The layer's memory for the copies of its calls in flight was full, so
    /// this body's copy was dropped.
    LayerFull,
    /// The caller's body failed while an earlier attempt was reading it.
    SourceFailed,
    /// The call could no longer be retried, so its copy was released.
    Released,
    /// A later attempt of the call is reading the body: this one is over.
    Superseded,
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReplayError::Capped => "request body outgrew the replay limit and cannot be sent again",
            ReplayError::LayerFull => {
                "the layer's replay memory for calls in flight was full, so the request body cannot be sent again"
            }
            ReplayError::SourceFailed => "request body failed on an earlier attempt",
            ReplayError::Released => {
                "the call could no longer be retried, so its copy of the request body was released"
            }
            ReplayError::Superseded => "a later attempt of the call is sending the request body",
        })
    }
}

impl std::error::Error for ReplayError {}

impl<B: Body> ReplayBody<B> {
    /// Wraps `body`, keeping a copy of at most `limit` bytes for replay.
    ///
    /// A body whose size hint already says it is larger than `limit` keeps no
    /// copy at all: it is sent once, as it is, and is never replayable.
    #[cfg(test)]
    pub(crate) fn new(body: B, limit: usize) -> Self {
        Self::sharing(body, limit, None)
    }

    /// Wraps `body` as [`new`](Self::new) does, its copy also counted in
    /// `memory`, which the copies of other calls share.
    pub(crate) fn sharing(body: B, limit: usize, memory: Option<Arc<dyn Account>>) -> Self {
        Self::copying(body, limit, memory, None)
    }

    /// As [`sharing`](Self::sharing), for a hedged call: a hedge due before
    /// the first attempt has read the body may read it ahead.
    pub(crate) fn hedged(body: B, limit: usize, memory: Option<Arc<dyn Account>>) -> Self
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        Self::copying(body, limit, memory, Some(pull::<B>))
    }

    fn copying(
        body: B,
        limit: usize,
        memory: Option<Arc<dyn Account>>,
        pull: Option<Pull<B>>,
    ) -> Self {
        let hint = body.size_hint();
        let capped = hint.lower() > limit as u64;
        // NOTE: only an exact size: an upper bound may be far above the body
        // (`Limited` reports its limit), and its whole size is reserved in
        // the layer's memory before the body is hedged.
        let fits = hint
            .exact()
            .filter(|size| *size <= limit as u64)
            .and_then(|size| usize::try_from(size).ok());
        Self::with_state(body, limit, (capped, fits), memory, pull)
    }

    fn with_state(
        body: B,
        limit: usize,
        (capped, fits): (bool, Option<usize>),
        memory: Option<Arc<dyn Account>>,
        pull: Option<Pull<B>>,
    ) -> Self {
        ReplayBody {
            state: State::Streamed(Arc::new(Mutex::new(Shared::new(
                body,
                limit,
                (capped, fits),
                memory,
                pull,
            )))),
            pos: 0,
            trailers_sent: false,
            epoch: 0,
            marks: Marks::default(),
            waited: false,
            attempt: 0,
        }
    }
}

impl<B> ReplayBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    /// Wraps `body` as [`sharing`](Self::sharing) does, for a call that may
    /// be retried and whose first attempt is sent now, once what the
    /// caller's body has ready now is read ([`AtOnce`]). A body read to its
    /// end within the limits — a unary call's one message — is kept
    /// [`Whole`]: its clones replay it without a lock. Any other goes on as
    /// `sharing` makes it, the first attempt sending what was read before it
    /// reads on.
    ///
    /// Outside a tokio runtime nothing is read (a body may need one to be
    /// polled: a timer, a file), and the body is made as `sharing` makes it.
    pub(crate) fn at_once(mut body: B, limit: usize, memory: Option<Arc<dyn Account>>) -> Self {
        let hint = body.size_hint();
        if hint.lower() > limit as u64 || !on_runtime() {
            return Self::sharing(body, limit, memory);
        }
        let exact = hint.exact().is_some();
        let read = AtOnce::read(&mut body, limit);
        if read.ended && read.error.is_none() && read.bytes <= limit {
            let reserved = match &memory {
                Some(account) if read.bytes > 0 => account.try_reserve(read.bytes),
                _ => true,
            };
            if reserved {
                let memory = memory.filter(|_| read.bytes > 0);
                return Self::read_whole(read, exact, memory);
            }
        }
        let replay = Self::sharing(body, limit, memory);
        let read_any = read.chunks.len() > 0 || read.ended || read.error.is_some();
        if read_any && let Ok(mut shared) = replay.state() {
            let input = &mut shared.input;
            input.head_ends = read.ended;
            input.head_exact = exact;
            if read.ended {
                input.source = None;
            }
            input.head = read.into_frames();
        }
        replay
    }

    /// A body read whole, `memory` (if any) holding what it reserved there.
    fn read_whole(read: AtOnce, exact: bool, memory: Option<Arc<dyn Account>>) -> Self {
        let reserved = if memory.is_some() { read.bytes } else { 0 };
        ReplayBody {
            state: State::Whole(Arc::new(Whole {
                chunks: read.chunks,
                trailers: read.trailers,
                exact,
                released: AtomicBool::new(false),
                // The first attempt's, sent now.
                readers: AtomicUsize::new(1),
                memory,
                reserved,
                given_back: AtomicBool::new(false),
                picked: Mutex::new(None),
            })),
            pos: 0,
            trailers_sent: false,
            epoch: 0,
            marks: Marks(Marks::READING),
            waited: false,
            attempt: 0,
        }
    }
}

impl<B> ReplayBody<B> {
    /// The streamed state, locked; or the body read whole.
    fn state(&self) -> Result<MutexGuard<'_, Shared<B>>, &Whole> {
        match &self.state {
            // A poisoned lock only means a body poll panicked elsewhere; the
            // counts it guards are updated atomically with respect to that,
            // so go on.
            State::Streamed(shared) => Ok(shared.lock().unwrap_or_else(PoisonError::into_inner)),
            State::Whole(whole) => Err(whole),
        }
    }

    /// Whether a new clone could still send the whole body: the copy has not
    /// been dropped and the caller's body has not failed.
    #[cfg(test)]
    pub(crate) fn is_replayable(&self) -> bool {
        self.replay_state().is_ok()
    }

    /// Why a new clone could not send the whole body, if it could not. A
    /// body nothing has been read from yet can always be sent whole.
    pub(crate) fn whole(&self) -> Result<(), ReplayError> {
        let shared = match self.state() {
            Ok(shared) => shared,
            Err(whole) => return whole.replay_state(),
        };
        if shared.copy.read == 0 && !shared.input.failed && !shared.released_to_one() {
            return Ok(());
        }
        shared.replay_state()
    }

    /// Why a new clone could not send the whole body, if it could not.
    pub(crate) fn replay_state(&self) -> Result<(), ReplayError> {
        match self.state() {
            Ok(shared) => shared.replay_state(),
            Err(whole) => whole.replay_state(),
        }
    }

    /// The call can no longer be retried: only the attempt sent last may read
    /// on, nothing more is copied, and the copy goes once that attempt has
    /// replayed it. Other clones fail with [`ReplayError::Released`].
    pub(crate) fn release(&self) {
        match self.state() {
            Ok(mut shared) => {
                let live = shared.readers.live;
                shared.finalize(live);
            }
            Err(whole) => whole.release(),
        }
    }

    /// Marks this clone as the call's last attempt, to be sent next: once it
    /// is sent, it is the only clone that may read.
    pub(crate) fn mark_last(&mut self) {
        self.marks.set(Marks::LAST);
    }

    /// Marks this clone as a retry: an earlier attempt of the call was sent.
    /// An attempt after attempts that were never sent is no retry (it adds
    /// no load the server did not already miss) and is not paid for.
    pub(crate) fn set_retry(&mut self) {
        self.marks.clear(Marks::TRANSPARENT);
        self.marks.set(Marks::RETRY);
    }

    /// Marks this clone as a transparent retry, or not: sent again in place
    /// of an attempt whose stream the server refused, it is not paid for.
    pub(crate) fn set_transparent(&mut self, transparent: bool) {
        if transparent {
            self.marks.set(Marks::TRANSPARENT);
        } else {
            self.marks.clear(Marks::TRANSPARENT);
        }
    }

    /// Whether this clone goes out as a transparent retry.
    pub(crate) fn is_transparent(&self) -> bool {
        self.marks.has(Marks::TRANSPARENT)
    }

    /// Whether this clone goes out as a retry.
    pub(crate) fn is_retry(&self) -> bool {
        self.marks.has(Marks::RETRY)
    }

    /// Marks this clone as a hedge: paid for as a retry, counted as a hedge.
    pub(crate) fn set_hedge(&mut self) {
        self.marks.set(Marks::RETRY | Marks::HEDGE);
    }

    /// Whether this clone goes out as a hedge.
    pub(crate) fn is_hedge(&self) -> bool {
        self.marks.has(Marks::HEDGE)
    }

    /// Records that this clone is being sent as the call's next attempt.
    pub(crate) fn sent(&mut self) {
        let shared = match &self.state {
            State::Streamed(shared) => shared,
            State::Whole(whole) => {
                if !self.marks.has(Marks::READING) && !whole.read_by(self.pos, self.trailers_sent) {
                    self.marks.set(Marks::READING);
                    whole.reading();
                }
                if self.marks.has(Marks::LAST) {
                    whole.release();
                }
                return;
            }
        };
        let mut shared = shared.lock().unwrap_or_else(PoisonError::into_inner);
        let readers = &mut shared.readers;
        readers.live = readers.live.saturating_add(1).min(UNSENT - 1);
        readers.live_pos = self.pos;
        self.epoch = readers.live;
        if let Some(slot) = readers.attempt(self.attempt) {
            slot.epoch = self.epoch;
        }
        if self.marks.has(Marks::LAST) {
            shared.finalize(self.epoch);
        }
    }

    /// This clone, just sent, is an attempt of a retried call drained if cut
    /// by its own timeout: what lets it read on then (see
    /// [`Lingering`]). `None` for a hedged call's attempt, which
    /// [`release_to`](Self::release_to) keeps the body for.
    pub(crate) fn drainable(&mut self) -> Option<Lingering>
    where
        B: Send + 'static,
    {
        // A body read whole needs nothing kept for a drained attempt: its
        // clone reads on from what every clone shares.
        let State::Streamed(shared) = &self.state else {
            return None;
        };
        if self.attempt != 0 || !DrainTable::tracks(self.epoch) {
            return None;
        }
        self.marks.set(Marks::DRAINABLE);
        shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .readers
            .drains
            .sent(self.epoch);
        Some(Lingering {
            shared: Arc::downgrade(shared) as Weak<dyn Drains>,
            epoch: self.epoch,
        })
    }

    /// Numbers this clone as attempt `number` of a hedged call.
    pub(crate) fn set_attempt(&mut self, number: u32) {
        self.attempt = attempt_number(number);
        if self.attempt != 0
            && let Ok(mut shared) = self.state()
            && let Some(slot) = shared.readers.attempt(self.attempt)
        {
            slot.alive = true;
        }
    }

    /// A hedged call committed to its attempt `number`: as [`release`](Self::release),
    /// for that attempt, whichever was sent last. (A first attempt sent at
    /// once keeps the epoch of a clone not sent; no other reader has it.)
    ///
    /// Other attempts whose clone is still alive (losers being drained, or
    /// attempts cut by their own timeout and drained) may still have to send
    /// the body, and failing it would reset their stream after all: the body
    /// is kept for them, and released to `number` when the last of them goes.
    pub(crate) fn release_to(&self, number: u32) {
        let mut shared = match self.state() {
            Ok(shared) => shared,
            Err(whole) => return whole.release(),
        };
        shared.commit_to(attempt_number(number));
    }

    /// Takes the instance a balancer reported for the last attempt, leaving
    /// the slot empty for the next.
    pub(crate) fn take_picked(&self) -> Option<HeaderValue> {
        match self.state() {
            Ok(mut shared) => shared.picked.take(),
            Err(whole) => whole
                .picked
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        }
    }

    /// Whether the body outgrew the replay limit.
    #[cfg(test)]
    pub(crate) fn is_capped(&self) -> bool {
        self.state()
            .is_ok_and(|shared| shared.copy.keeping.is_capped())
    }

    /// Whether the caller's body has been read to its end.
    #[cfg(test)]
    pub(crate) fn is_complete(&self) -> bool {
        self.state().map_or(true, |shared| shared.input.ended)
    }

    /// Lets attempts read the body side by side, as a hedged call's do: a
    /// later attempt being sent no longer ends an earlier one's reading.
    pub(crate) fn set_concurrent(&self) {
        if let Ok(mut shared) = self.state() {
            shared.readers.concurrent = true;
        }
    }

    /// Whether a hedge due now can send the whole body side by side with the
    /// attempts before it: `true` once the caller's body has been read to its
    /// end with a copy of all of it kept, or when its size is known and
    /// within the limit (so its copy can never be dropped); `false` once it
    /// cannot be, or once the caller's body has answered `Pending` (it is not
    /// all there: a streaming body is not hedged, and nothing waits for it).
    ///
    /// Until then, with `ahead` (every attempt started has been sent), the
    /// body is read ahead of the attempts into the copy, which they replay:
    /// a first attempt slow to read its body (its connection full, or still
    /// being made) does not hold back the hedge of a body that is all there.
    /// Without it, Pending while the first attempt reads, woken as it does.
    pub(crate) fn poll_hedgeable(&self, cx: &mut Context<'_>, ahead: bool) -> Poll<bool> {
        // NOTE: a hedged call's body is never read before its first attempt
        // (`at_once`), so its streamed state has no `head` to read first.
        let mut guard = match self.state() {
            Ok(shared) => shared,
            Err(whole) => return Poll::Ready(whole.replay_state().is_ok()),
        };
        let shared = &mut *guard;
        if shared.replay_state().is_err() {
            return Poll::Ready(false);
        }
        if shared.input.ended {
            return Poll::Ready(true);
        }
        if let Some(size) = shared.copy.fits {
            // Attempts read it side by side before it is complete: the
            // layer's memory must hold all of it, or the copy could be
            // dropped under a later attempt's reading.
            if shared.copy.reserve(size) {
                return Poll::Ready(true);
            }
            shared.copy.cap(Cap::Layer);
            return Poll::Ready(false);
        }
        if shared.input.stalled || shared.input.failed {
            return Poll::Ready(false);
        }
        let (Some(pull), true) = (shared.input.pull, ahead) else {
            if shared.input.source.is_none() {
                return Poll::Ready(false);
            }
            shared.input.wait(cx);
            return Poll::Pending;
        };
        let hedgeable = loop {
            let input = &mut shared.input;
            let Some(source) = input.source.as_mut() else {
                break false;
            };
            match pull(source, cx) {
                Poll::Pending => {
                    input.stalled = true;
                    break false;
                }
                Poll::Ready(None) => {
                    input.end(None);
                    break true;
                }
                Poll::Ready(Some(Err(error))) => {
                    input.fail(Some(error));
                    break false;
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(chunk) => {
                        if !shared.keep_ahead(&chunk) {
                            break false;
                        }
                    }
                    Err(frame) => {
                        // NOTE: http-body's frames are data or trailers.
                        if let Ok(trailers) = frame.into_trailers() {
                            input.end(Some(trailers));
                        }
                        break input.ended;
                    }
                },
            }
        };
        // The attempts waiting for the body have more of it.
        shared.input.wake_waiting();
        Poll::Ready(hedgeable)
    }
}

impl<B: Send + 'static> ReplayBody<B> {
    /// The call's [`PickedInstance`] slot, for an attempt's request extensions.
    pub(crate) fn picked_instance(&self) -> PickedInstance {
        PickedInstance::from_slot(match &self.state {
            State::Streamed(shared) => Arc::clone(shared) as Arc<dyn PickSlot>,
            State::Whole(whole) => Arc::clone(whole) as Arc<dyn PickSlot>,
        })
    }
}

impl<B> From<ReplayBody<B>> for tonic::body::Body
where
    B: Body<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
{
    fn from(body: ReplayBody<B>) -> Self {
        tonic::body::Body::new(body)
    }
}

impl<B> From<ReplayBody<B>> for http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>
where
    B: Body<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
{
    fn from(body: ReplayBody<B>) -> Self {
        http_body_util::combinators::UnsyncBoxBody::new(body)
    }
}

impl<B> From<ReplayBody<B>> for http_body_util::combinators::BoxBody<Bytes, BoxError>
where
    B: Body<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
{
    fn from(body: ReplayBody<B>) -> Self {
        http_body_util::combinators::BoxBody::new(body)
    }
}
