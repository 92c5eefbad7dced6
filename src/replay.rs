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

/// A body that was all there when the call was made (a unary call's one
/// message): every clone replays it from here, and nothing is locked to read
/// it. No clone can take anything another needs, so none is ever refused
/// (an earlier attempt's stream, still pulled after a later one was sent,
/// reads what it would have sent), and release only ends the retries.
///
/// The layer's memory counts the body while a retry may still replay it or
/// an attempt sent (a drained one too) has yet to read it all: it gets it
/// back once the call is released and no such attempt is left, or when the
/// last clone goes.
struct Whole {
    chunks: Kept,
    trailers: Option<HeaderMap>,
    /// The caller's body knew its size exactly. The first attempt's clone
    /// says its size as the caller's body did (so an HTTP/2 client adds a
    /// `content-length` to the request only where it would have without the
    /// layer); a clone for a retry, of a body all read, knows it exactly.
    exact: bool,
    /// No retry can follow: a clone can no longer be sent.
    released: AtomicBool,
    /// Attempts sent that have yet to read the whole body.
    readers: AtomicUsize,
    /// The layer's memory for the copies of its calls in flight, how much of
    /// it this body holds, and whether it got that back.
    memory: Option<Arc<dyn Account>>,
    reserved: usize,
    given_back: AtomicBool,
    /// The instance a balancer below reported for the current attempt.
    picked: Mutex<Option<HeaderValue>>,
}

impl Whole {
    fn replay_state(&self) -> Result<(), ReplayError> {
        if self.released.load(Ordering::Relaxed) {
            return Err(ReplayError::Released);
        }
        Ok(())
    }

    /// No retry can follow.
    fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
        self.give_back_if_unneeded();
    }

    /// An attempt is sent: until it has read the whole body, the body is
    /// still needed.
    fn reading(&self) {
        self.readers.fetch_add(1, Ordering::SeqCst);
    }

    /// An attempt sent has read the whole body, or is gone.
    fn read(&self) {
        self.readers.fetch_sub(1, Ordering::SeqCst);
        self.give_back_if_unneeded();
    }

    // NOTE: `released` and `readers` are each written before the other is
    // read, all sequentially consistent: of a release and the last reader
    // finishing at once, at least one sees the other's write.
    fn give_back_if_unneeded(&self) {
        if self.released.load(Ordering::SeqCst) && self.readers.load(Ordering::SeqCst) == 0 {
            self.give_back();
        }
    }

    /// The layer's memory gets back what the body held, once.
    fn give_back(&self) {
        if self.reserved > 0
            && !self.given_back.swap(true, Ordering::SeqCst)
            && let Some(memory) = &self.memory
        {
            memory.release(self.reserved);
        }
    }

    /// Whether a clone at `pos` has read the whole body.
    fn read_by(&self, pos: usize, trailers_sent: bool) -> bool {
        pos >= self.chunks.len() && (self.trailers.is_none() || trailers_sent)
    }

    /// The frame a clone at `pos` reads next.
    #[inline]
    fn frame(&self, pos: &mut usize, trailers_sent: &mut bool) -> Option<Frame<Bytes>> {
        if *pos < self.chunks.len() {
            let chunk = self.chunks.get(*pos).clone();
            *pos += 1;
            return Some(Frame::data(chunk));
        }
        match &self.trailers {
            Some(trailers) if !*trailers_sent => {
                *trailers_sent = true;
                Some(Frame::trailers(trailers.clone()))
            }
            _ => None,
        }
    }
}

impl Drop for Whole {
    fn drop(&mut self) {
        self.give_back();
    }
}

impl PickSlot for Whole {
    fn set(&self, instance: HeaderValue) {
        PickSlot::set(&self.picked, instance);
    }

    fn get(&self) -> Option<HeaderValue> {
        PickSlot::get(&self.picked)
    }
}

/// The most frames [`ReplayBody::at_once`] reads before the first attempt.
const AT_ONCE_FRAMES: usize = 8;

/// What the caller's body had ready when the call was made.
struct AtOnce {
    chunks: Kept,
    bytes: usize,
    trailers: Option<HeaderMap>,
    /// The body ended (its last frame, or trailers, was read).
    ended: bool,
    /// The body failed: its error, which the attempt reading up to it gets.
    error: Option<BoxError>,
}

impl AtOnce {
    /// Reads what `body` has ready now, without waiting: until it ends, fails
    /// or answers `Pending`, has given [`AT_ONCE_FRAMES`] frames, or more
    /// than `limit` bytes.
    #[inline(always)]
    fn read<B>(body: &mut B, limit: usize) -> Self
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        // NOTE: nothing is woken through this waker, and nothing needs to
        // be: the attempt that reads on polls the body itself, with its own.
        let mut cx = Context::from_waker(Waker::noop());
        let mut read = AtOnce {
            chunks: Kept::default(),
            bytes: 0,
            trailers: None,
            ended: false,
            error: None,
        };
        while read.chunks.len() < AT_ONCE_FRAMES && read.bytes <= limit {
            match Pin::new(&mut *body).poll_frame(&mut cx) {
                Poll::Pending => break,
                Poll::Ready(None) => {
                    read.ended = true;
                    break;
                }
                Poll::Ready(Some(Err(error))) => {
                    read.error = Some(error.into());
                    break;
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(chunk) => {
                        read.bytes = read.bytes.saturating_add(chunk.len());
                        read.chunks.push(chunk);
                    }
                    Err(frame) => {
                        // NOTE: http-body's frames are data or trailers, and
                        // trailers end a body.
                        read.trailers = frame.into_trailers().ok();
                        read.ended = true;
                        break;
                    }
                },
            }
        }
        read
    }

    /// The frames read, in order, for an attempt to send first.
    fn into_frames(self) -> VecDeque<Result<Frame<Bytes>, BoxError>> {
        let AtOnce {
            chunks: Kept { first, rest },
            trailers,
            error,
            ..
        } = self;
        first
            .into_iter()
            .chain(rest)
            .map(|chunk| Ok(Frame::data(chunk)))
            .chain(trailers.map(|t| Ok(Frame::trailers(t))))
            .chain(error.map(Err))
            .collect()
    }
}

/// The epoch of a clone that was never sent.
const UNSENT: u32 = u32::MAX;

/// How many attempts a hedged call may send: its policy's five at most, and
/// one transparent retry.
const HEDGE_SLOTS: usize = crate::policy::MAX_ATTEMPTS_LIMIT as usize + 1;

/// A hedged call's attempt `number` (1 to [`HEDGE_SLOTS`]), or 0 for none.
fn attempt_number(number: u32) -> u8 {
    u8::try_from(number)
        .ok()
        .filter(|n| (1..=HEDGE_SLOTS as u8).contains(n))
        .unwrap_or(0)
}

/// The bit of `epoch` in a mask of epochs; 0 past 31 (or unsent).
fn epoch_bit(epoch: u32) -> u32 {
    1u32.checked_shl(epoch).unwrap_or(0)
}

/// The bit of attempt `number` (1 to 5) in a mask of attempts; 0 for none.
fn attempt_bit(number: u8) -> u8 {
    number.checked_sub(1).map_or(0, |i| 1 << i)
}

struct Shared<B> {
    /// The caller's body, while it has more to give.
    source: Option<B>,
    /// Frames read from the caller's body before the first attempt was
    /// sent ([`ReplayBody::at_once`]), which the attempt at the front reads
    /// as it would the body's.
    head: VecDeque<Result<Frame<Bytes>, BoxError>>,
    /// The caller's body ended with the last of `head`.
    head_ends: bool,
    /// The caller's body knew its size exactly when `head` was read.
    head_exact: bool,
    /// A copy of every data chunk read so far, until the limit is passed.
    chunks: Kept,
    /// Data chunks read from the source, including ones no longer kept.
    read: usize,
    /// Bytes read from the source.
    bytes: usize,
    limit: usize,
    capped: bool,
    /// Why the copy was dropped, once `capped`.
    cap: Cap,
    /// The memory the copies of every call in flight through one layer share,
    /// and how much of it this copy holds.
    memory: Option<Arc<dyn Account>>,
    reserved: usize,
    /// The epoch of the clone sent last, and how far it has read.
    live: u32,
    live_pos: usize,
    /// Once the call can no longer be retried: the one clone still allowed to
    /// read (the live attempt's). Nothing it reads is copied.
    only: Option<u32>,
    /// The copy is dropped: `only` has replayed it, or never needed it.
    released: bool,
    /// Attempts read the body side by side (a hedged call): a later one
    /// being sent does not end an earlier one's reading.
    concurrent: bool,
    /// The body's size, when it is known exactly and within the limit: its
    /// copy can never be dropped for the limit, so another attempt can read
    /// it side by side before it is complete (once the layer's memory is
    /// reserved for all of it).
    fits: Option<usize>,
    ended: bool,
    failed: bool,
    /// The caller's body once answered `Pending`: it is not all there.
    stalled: bool,
    trailers: Option<HeaderMap>,
    /// Clones waiting for the source to make progress.
    waiting: Vec<Waker>,
    /// The instance a balancer below reported for the current attempt
    /// (see [`PickedInstance`]): every attempt's request carries this state.
    picked: Option<HeaderValue>,
    /// A hedged call's attempts 1 to 6 (five and a transparent retry): the
    /// epoch each was sent as, and how far each has read.
    hedge_epochs: [u32; HEDGE_SLOTS],
    hedge_pos: [usize; HEDGE_SLOTS],
    /// A hedged call's attempts whose clone is alive (bit `n - 1` for
    /// attempt `n`).
    alive: u8,
    /// The attempt the call committed to while other attempts' clones are
    /// alive (losers, or attempts cut by their own timeout, being drained:
    /// their transport may still have to send the body, so it is kept for
    /// them): the copy is released to it when the last of them goes.
    heir: u8,
    /// A retried call's attempts sent that may be drained, whose clone is
    /// alive (bit `epoch`).
    drainable: u32,
    /// Those of them being drained (cut by their own timeout): their
    /// transport may still have to send the body (failing it would reset
    /// the stream after all), so they may replay what later attempts read,
    /// and the copy is kept while their clone and their drain both last.
    draining: u32,
    /// The epoch the call was released to while attempts drain: the release
    /// happens when the last drain is over. Nothing read from then on is
    /// copied: only that attempt reads the caller's body.
    heir_epoch: Option<u32>,
    /// Attempts ever cut by their own timeout and drained (bit `epoch`):
    /// even once their drain is over, their transport may hold their body a
    /// while, and they never read the caller's body ahead of an attempt to
    /// come.
    cut: u32,
    /// Those draining ones that, since the call was released to
    /// `heir_epoch`, have replayed all the copy holds: they need nothing more
    /// of it.
    past: u32,
    /// For a hedged call: reads the caller's body, so that a hedge due
    /// before the first attempt has read it can read it ahead (proven where
    /// the layer's service is made, as the service's other conversions).
    pull: Option<Pull<B>>,
    /// A chunk read ahead went past a replay limit: kept for the attempt
    /// sent, which has yet to send it, and no other attempt may be sent. The
    /// copy goes once that attempt has read past it, and nothing more is
    /// copied.
    over: bool,
    /// The caller's body failed while read ahead: its error, for the attempt
    /// that reads up to it (later ones get [`ReplayError::SourceFailed`]).
    error: Option<BoxError>,
}

/// Whether the caller runs on a tokio runtime.
// NOTE: this clones the runtime's handle (a count the workers of a
// multi-thread runtime share, as each of tokio's timers does). A task's id
// is no cheaper proof: a `LocalSet` polled outside any runtime (by
// `futures::executor::block_on`) runs tasks that have one.
#[inline]
fn on_runtime() -> bool {
    tokio::runtime::Handle::try_current().is_ok()
}

/// Polls the caller's body for its next frame, its error boxed.
type Pull<B> = fn(&mut B, &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>;

fn pull<B>(body: &mut B, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    Pin::new(body)
        .poll_frame(cx)
        .map(|frame| frame.map(|frame| frame.map_err(Into::into)))
}

/// Which limit a body outgrew.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cap {
    /// The call's own replay limit.
    Call,
    /// The layer's memory for the copies of all its calls in flight.
    Layer,
}

/// The bytes the replay copies of one layer's calls in flight hold together,
/// and the most they may: a copy that would pass it is dropped, as one that
/// outgrows its call's limit.
///
/// Counted in [`STRIPES`] stripes, each alone on its cache lines, one per
/// thread (as the attempts are counted): a copy reserves from the bytes the
/// stripe of the thread that makes it was granted ahead, and gives them back
/// to the stripe of the thread that drops it, so the usual call writes no
/// count that every thread writes. (Where one thread makes the copies and
/// another drops them, the bytes flow from one stripe to the other through
/// the shared count: once a grain, not once a call.) Only a stripe that
/// runs short, or holds more than it needs, touches the shared count (so
/// does every copy larger than a grain, 64 KiB at the default limit, whose
/// call copies and sends that much anyway). Every write of the shared count
/// is made under a lock, and a copy is refused only once every stripe's
/// spare bytes have come back, so it is refused exactly when the copies held
/// leave it no room.
pub(crate) struct ReplayMemory {
    /// Bytes granted to the stripes, held by copies or spare in a stripe:
    /// never more than the limit when they were granted.
    granted: AtomicUsize,
    limit: AtomicUsize,
    /// Taken to grant bytes, and to refuse a copy.
    granting: Mutex<()>,
    /// Per stripe: bytes granted and held by no copy.
    spare: [Padded<AtomicUsize>; STRIPES],
}

impl ReplayMemory {
    /// grpc-java's retry buffer size.
    pub(crate) const DEFAULT_LIMIT: usize = 16 << 20;

    /// The most a stripe is granted ahead: 64 KiB at the default limit.
    const MAX_GRAIN: usize = 64 << 10;

    pub(crate) fn new(limit: usize) -> Self {
        Self {
            granted: AtomicUsize::new(0),
            limit: AtomicUsize::new(limit),
            granting: Mutex::new(()),
            spare: Default::default(),
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// A lowered limit holds from the next copy on: stripes holding more
    /// than it allows give their spare bytes back first.
    pub(crate) fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Bytes held now.
    pub(crate) fn used(&self) -> usize {
        let spare = self.spare.iter().fold(0usize, |sum, s| {
            sum.saturating_add(s.0.load(Ordering::Relaxed))
        });
        self.granted.load(Ordering::Relaxed).saturating_sub(spare)
    }

    /// What a stripe is granted ahead under `limit`: at most an eighth of
    /// it for all the stripes together, each holding up to twice its grain.
    fn grain(limit: usize) -> usize {
        (limit / (STRIPES * 16)).min(Self::MAX_GRAIN)
    }

    /// Takes `bytes` for a copy counted in `stripe`, if they fit; never
    /// waits for a copy to be given back.
    #[inline]
    fn try_reserve(&self, stripe: usize, bytes: usize) -> bool {
        let spare = &self.spare[stripe % STRIPES].0;
        // NOTE: the grants within the limit, any spare bytes of the stripe
        // are room under it. A lowered limit the grants pass takes the
        // locked way, which takes the spare bytes back first.
        if self.granted.load(Ordering::Relaxed) <= self.limit()
            && spare
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                    s.checked_sub(bytes)
                })
                .is_ok()
        {
            return true;
        }
        self.reserve_granting(spare, bytes)
    }

    /// [`try_reserve`](Self::try_reserve) for a stripe short of `bytes`, or
    /// grants past the limit: bytes granted to the stripe with some ahead,
    /// else exactly, else once every stripe's spare bytes are back.
    #[cold]
    fn reserve_granting(&self, spare: &AtomicUsize, bytes: usize) -> bool {
        let _granting = self.granting.lock().unwrap_or_else(PoisonError::into_inner);
        let limit = self.limit();
        let grain = Self::grain(limit);
        if let Some(ahead) = bytes.checked_add(grain)
            && self.grant(ahead, limit)
        {
            spare.fetch_add(grain, Ordering::Relaxed);
            return true;
        }
        if self.grant(bytes, limit) {
            return true;
        }
        for stripe in &self.spare {
            let back = stripe.0.swap(0, Ordering::Relaxed);
            self.granted.fetch_sub(back, Ordering::Relaxed);
        }
        self.grant(bytes, limit)
    }

    /// Grants `bytes` more if all the grants then fit in `limit`.
    fn grant(&self, bytes: usize, limit: usize) -> bool {
        self.granted
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |granted| {
                granted.checked_add(bytes).filter(|&total| total <= limit)
            })
            .is_ok()
    }

    /// Gives back `bytes` a copy counted in `stripe` held: to the stripe,
    /// which gives the layer back what it holds past twice its grain.
    #[inline]
    fn release(&self, stripe: usize, bytes: usize) {
        let spare = &self.spare[stripe % STRIPES].0;
        let now = spare
            .fetch_add(bytes, Ordering::Relaxed)
            .saturating_add(bytes);
        let grain = Self::grain(self.limit());
        if now > grain.saturating_mul(2) {
            self.release_spare(spare, grain);
        }
    }

    /// The stripe keeps `grain` of its spare bytes; the layer gets the rest.
    // NOTE: under the lock, as every write of `granted` is: bytes taken
    // from a stripe and not yet taken off `granted` would count as held to
    // a copy refused meanwhile.
    #[cold]
    fn release_spare(&self, spare: &AtomicUsize, grain: usize) {
        let _granting = self.granting.lock().unwrap_or_else(PoisonError::into_inner);
        if let Ok(before) = spare.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
            (s > grain).then_some(grain)
        }) {
            self.granted.fetch_sub(before - grain, Ordering::Relaxed);
        }
    }
}

impl fmt::Debug for ReplayMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayMemory")
            .field("used", &self.used())
            .field("limit", &self.limit())
            .finish()
    }
}

/// The layer's [`ReplayMemory`] as a call's copy reaches it: through the
/// handle of the service that made the call (`shared::Local`), so that
/// holding it moves no count every thread writes.
pub(crate) trait Account: Send + Sync {
    fn memory(&self) -> &ReplayMemory;
}

impl dyn Account {
    /// Takes `bytes` in the layer's memory, in the calling thread's stripe,
    /// if they fit.
    #[inline]
    fn try_reserve(&self, bytes: usize) -> bool {
        self.memory().try_reserve(thread_stripe(), bytes)
    }

    /// Gives back `bytes` taken in the layer's memory, to the calling
    /// thread's stripe.
    #[inline]
    fn release(&self, bytes: usize) {
        self.memory().release(thread_stripe(), bytes);
    }
}

#[cfg(test)]
impl Account for ReplayMemory {
    fn memory(&self) -> &ReplayMemory {
        self
    }
}

/// The kept chunks. Most gRPC requests are one chunk, which is kept inline;
/// only a second chunk allocates.
#[derive(Default)]
struct Kept {
    first: Option<Bytes>,
    rest: Vec<Bytes>,
}

impl Kept {
    fn push(&mut self, chunk: Bytes) {
        if self.first.is_none() {
            self.first = Some(chunk);
        } else {
            self.rest.push(chunk);
        }
    }

    /// How many chunks are kept (chunks 0 to `len - 1`).
    fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.len()
    }

    /// Chunk `i`; callers only ask for chunks that were kept.
    fn get(&self, i: usize) -> &Bytes {
        match (i, &self.first) {
            (0, Some(first)) => first,
            _ => &self.rest[i - 1],
        }
    }

    /// Bytes kept from chunk `i` on.
    fn bytes_from(&self, i: usize) -> u64 {
        let first = self
            .first
            .iter()
            .skip(i)
            .map(|c| c.len() as u64)
            .sum::<u64>();
        let rest = self
            .rest
            .iter()
            .skip(i.saturating_sub(1))
            .map(|c| c.len() as u64);
        first + rest.sum::<u64>()
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
            state: State::Streamed(Arc::new(Mutex::new(Shared {
                source: Some(body),
                head: VecDeque::new(),
                head_ends: false,
                head_exact: false,
                chunks: Kept::default(),
                read: 0,
                bytes: 0,
                limit,
                capped,
                cap: Cap::Call,
                memory,
                reserved: 0,
                live: 0,
                live_pos: 0,
                only: None,
                released: false,
                stalled: false,
                concurrent: false,
                fits,
                ended: false,
                failed: false,
                trailers: None,
                waiting: Vec::new(),
                picked: None,
                hedge_epochs: [UNSENT; HEDGE_SLOTS],
                hedge_pos: [0; HEDGE_SLOTS],
                alive: 0,
                heir: 0,
                drainable: 0,
                draining: 0,
                heir_epoch: None,
                cut: 0,
                past: 0,
                pull,
                over: false,
                error: None,
            }))),
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
            shared.head_ends = read.ended;
            shared.head_exact = exact;
            if read.ended {
                shared.source = None;
            }
            shared.head = read.into_frames();
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
        if shared.read == 0 && !shared.failed && !shared.released_to_one() {
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
                let live = shared.live;
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
        shared.live = shared.live.saturating_add(1).min(UNSENT - 1);
        shared.live_pos = self.pos;
        self.epoch = shared.live;
        if let Some(slot) = usize::from(self.attempt)
            .checked_sub(1)
            .and_then(|i| shared.hedge_epochs.get_mut(i))
        {
            *slot = self.epoch;
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
        let bit = epoch_bit(self.epoch);
        if self.attempt != 0 || bit == 0 {
            return None;
        }
        self.marks.set(Marks::DRAINABLE);
        shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drainable |= bit;
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
        {
            shared.alive |= attempt_bit(self.attempt);
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
        let number = attempt_number(number);
        if shared.alive & !attempt_bit(number) == 0 {
            shared.release_to_attempt(number);
        } else {
            shared.heir = number;
        }
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
        self.state().is_ok_and(|shared| shared.capped)
    }

    /// Whether the caller's body has been read to its end.
    #[cfg(test)]
    pub(crate) fn is_complete(&self) -> bool {
        self.state().map_or(true, |shared| shared.ended)
    }

    /// Lets attempts read the body side by side, as a hedged call's do: a
    /// later attempt being sent no longer ends an earlier one's reading.
    pub(crate) fn set_concurrent(&self) {
        if let Ok(mut shared) = self.state() {
            shared.concurrent = true;
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
        if shared.ended {
            return Poll::Ready(true);
        }
        if let Some(size) = shared.fits {
            // Attempts read it side by side before it is complete: the
            // layer's memory must hold all of it, or the copy could be
            // dropped under a later attempt's reading.
            if shared.reserve(size) {
                return Poll::Ready(true);
            }
            shared.cap(Cap::Layer);
            return Poll::Ready(false);
        }
        if shared.stalled || shared.failed {
            return Poll::Ready(false);
        }
        let (Some(pull), true) = (shared.pull, ahead) else {
            if shared.source.is_none() {
                return Poll::Ready(false);
            }
            shared.wait(cx);
            return Poll::Pending;
        };
        let hedgeable = loop {
            let Some(source) = shared.source.as_mut() else {
                break false;
            };
            match pull(source, cx) {
                Poll::Pending => {
                    shared.stalled = true;
                    break false;
                }
                Poll::Ready(None) => {
                    shared.ended = true;
                    shared.source = None;
                    break true;
                }
                Poll::Ready(Some(Err(error))) => {
                    // Kept for the attempt that reads up to it.
                    shared.failed = true;
                    shared.source = None;
                    shared.error = Some(error);
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
                            shared.trailers = Some(trailers);
                            shared.ended = true;
                            shared.source = None;
                        }
                        break shared.ended;
                    }
                },
            }
        };
        // The attempts waiting for the body have more of it.
        shared.wake_waiting();
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
    fn replay_state(&self) -> Result<(), ReplayError> {
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
    fn released_to_one(&self) -> bool {
        self.only.is_some() || self.heir != 0 || self.heir_epoch.is_some()
    }

    fn wake_waiting(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        for waker in self.waiting.drain(..) {
            waker.wake();
        }
    }

    fn wait(&mut self, cx: &Context<'_>) {
        if !self.waiting.iter().any(|w| w.will_wake(cx.waker())) {
            self.waiting.push(cx.waker().clone());
        }
    }

    /// A hedged call's attempt `number` (0: none sent) is the only one that
    /// may read from now on; the copy goes as soon as it has replayed it.
    fn release_to_attempt(&mut self, number: u8) {
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
    fn drain_over(&mut self, epoch: u32) {
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
    fn gone(&mut self, number: u8) {
        self.alive &= !attempt_bit(number);
        if self.heir != 0 && self.alive & !attempt_bit(self.heir) == 0 {
            let heir = std::mem::take(&mut self.heir);
            self.release_to_attempt(heir);
        }
    }

    /// Only the clone sent as `epoch` may read from now on; the copy goes
    /// as soon as that clone has replayed it.
    fn finalize(&mut self, epoch: u32) {
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
    fn hold_back<T>(&mut self, epoch: u32, waited: &mut bool, cx: &Context<'_>) -> Poll<T> {
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
    fn drop_unneeded(&mut self) {
        if let Some(heir) = self.heir_epoch
            && self.live == heir
            && self.live_pos >= self.chunks.len()
            && self.draining & !epoch_bit(heir) & !self.past == 0
        {
            self.drop_copy();
        }
    }

    fn drop_copy(&mut self) {
        if !self.released {
            self.released = true;
            self.chunks = Kept::default();
            self.give_back();
        }
    }

    /// Gives the layer's memory back what this copy held.
    fn give_back(&mut self) {
        if self.reserved > 0
            && let Some(memory) = &self.memory
        {
            memory.release(std::mem::take(&mut self.reserved));
        }
    }

    fn cap_error(&self) -> ReplayError {
        match self.cap {
            Cap::Call => ReplayError::Capped,
            Cap::Layer => ReplayError::LayerFull,
        }
    }

    /// Drops the copy: the body outgrew `cap`.
    fn cap(&mut self, cap: Cap) {
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
    fn advanced(&mut self, (epoch, attempt): (u32, u8), pos: usize) {
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
    fn keep_ahead(&mut self, chunk: &Bytes) -> bool {
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

    fn keep(&mut self, chunk: &Bytes) {
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
    fn reserve_to_bytes(&mut self) -> bool {
        self.reserve(self.bytes)
    }

    /// Reserves in the layer's memory up to `bytes` for the copy in all.
    fn reserve(&mut self, bytes: usize) -> bool {
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

impl<B> Body for ReplayBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let shared = match &this.state {
            State::Streamed(shared) => shared,
            State::Whole(whole) => {
                let frame = whole.frame(&mut this.pos, &mut this.trailers_sent);
                if this.marks.has(Marks::READING) && whole.read_by(this.pos, this.trailers_sent) {
                    this.marks.clear(Marks::READING);
                    whole.read();
                }
                return Poll::Ready(frame.map(Ok));
            }
        };
        let mut guard = shared.lock().unwrap_or_else(PoisonError::into_inner);
        let shared = &mut *guard;

        // An earlier attempt's stream, still pulled after a later attempt was
        // sent, must not take chunks from it (nor push the copy over its cap).
        // A drained attempt's may go on replaying what the live one read.
        let stale = this.epoch != UNSENT && this.epoch < shared.live && !shared.concurrent;
        if stale && shared.draining & epoch_bit(this.epoch) == 0 {
            return Poll::Ready(Some(Err(ReplayError::Superseded.into())));
        }
        // Once no retry can follow, only the live attempt reads.
        if shared.only.is_some_and(|only| only != this.epoch) {
            return Poll::Ready(Some(Err(ReplayError::Released.into())));
        }
        // Replay what an earlier attempt already read.
        if this.pos < shared.read {
            if shared.capped {
                return Poll::Ready(Some(Err(shared.cap_error().into())));
            }
            if shared.heir_epoch.is_some()
                && shared.draining & epoch_bit(this.epoch) != 0
                && (shared.released || this.pos >= shared.chunks.len())
            {
                // Past what was kept when the call was released while
                // attempts drain (read since by the attempt it is released
                // to, and not copied), or the copy is gone because none
                // needed it: a drained attempt waits for its drain to end.
                return shared.hold_back(this.epoch, &mut this.waited, cx);
            }
            if shared.released || this.pos >= shared.chunks.len() {
                return Poll::Ready(Some(Err(ReplayError::Released.into())));
            }
            let chunk = shared.chunks.get(this.pos).clone();
            this.pos += 1;
            shared.advanced((this.epoch, this.attempt), this.pos);
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        shared.advanced((this.epoch, this.attempt), this.pos);
        if shared.failed {
            let error = shared
                .error
                .take()
                .unwrap_or_else(|| ReplayError::SourceFailed.into());
            return Poll::Ready(Some(Err(error)));
        }
        if shared.ended {
            return Poll::Ready(match &shared.trailers {
                Some(trailers) if !this.trailers_sent => {
                    this.trailers_sent = true;
                    Some(Ok(Frame::trailers(trailers.clone())))
                }
                _ => None,
            });
        }

        // A drained attempt's clone never reads ahead of the live one (what
        // it read would have to be kept for the live one, and could push the
        // copy past its limit), nor, before the retry is sent, ahead of the
        // retry to come (even once its drain is over: its transport may hold
        // its body a while yet): it waits for the live one to read on. Unless
        // no other attempt can follow: then it is the one reader left.
        // NOTE: once the live attempt's clone is gone too, nothing reads on:
        // the drained one waits until its drain ends.
        let reader_left = shared.only == Some(this.epoch) || shared.heir_epoch == Some(this.epoch);
        if stale || (shared.cut & epoch_bit(this.epoch) != 0 && !reader_left) {
            return shared.hold_back(this.epoch, &mut this.waited, cx);
        }

        // This clone is at the front: read on from the caller's body, the
        // frames read before the first attempt first.
        let polled = if let Some(frame) = shared.head.pop_front() {
            Poll::Ready(Some(frame))
        } else if shared.head_ends {
            Poll::Ready(None)
        } else {
            let Some(source) = shared.source.as_mut() else {
                return Poll::Ready(None);
            };
            Pin::new(source)
                .poll_frame(cx)
                .map(|frame| frame.map(|frame| frame.map_err(Into::into)))
        };
        let out = match polled {
            Poll::Pending => {
                shared.stalled = true;
                shared.wait(cx);
                this.waited = true;
                return Poll::Pending;
            }
            Poll::Ready(None) => {
                shared.ended = true;
                shared.source = None;
                None
            }
            Poll::Ready(Some(Err(e))) => {
                shared.failed = true;
                shared.source = None;
                shared.head.clear();
                Some(Err(e))
            }
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(chunk) => {
                    shared.keep(&chunk);
                    this.pos += 1;
                    shared.advanced((this.epoch, this.attempt), this.pos);
                    Some(Ok(Frame::data(chunk)))
                }
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => {
                        // Trailers end an HTTP body.
                        shared.trailers = Some(trailers.clone());
                        shared.ended = true;
                        shared.source = None;
                        this.trailers_sent = true;
                        Some(Ok(Frame::trailers(trailers)))
                    }
                    // A frame kind this crate does not know: pass it on once.
                    Err(frame) => Some(Ok(frame)),
                },
            },
        };
        // Other clones may be waiting on what this one just read.
        shared.wake_waiting();
        Poll::Ready(out)
    }

    fn is_end_stream(&self) -> bool {
        let shared = match self.state() {
            Ok(shared) => shared,
            Err(whole) => {
                return self.pos >= whole.chunks.len()
                    && (whole.trailers.is_none() || self.trailers_sent);
            }
        };
        if self.pos < shared.read {
            return false;
        }
        if shared.ended {
            return shared.trailers.is_none() || self.trailers_sent;
        }
        // NOTE: frames read before the first attempt are still to come, and
        // a body whose end was read then still has that end to give.
        !shared.failed
            && shared.head.is_empty()
            && !shared.head_ends
            && shared.source.as_ref().is_some_and(B::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let shared = match self.state() {
            Ok(shared) => shared,
            Err(whole) => {
                let rest = whole.chunks.bytes_from(self.pos);
                // The first attempt's clone is the only one not made by `clone`.
                if whole.exact || self.epoch != 0 {
                    return SizeHint::with_exact(rest);
                }
                let mut hint = SizeHint::new();
                hint.set_lower(rest);
                return hint;
            }
        };
        if shared.capped && self.pos < shared.read {
            return SizeHint::default();
        }
        let head: u64 = shared
            .head
            .iter()
            .filter_map(|frame| frame.as_ref().ok()?.data_ref())
            .map(|chunk| chunk.len() as u64)
            .sum();
        let kept = shared.chunks.bytes_from(self.pos).saturating_add(head);
        if shared.head_ends {
            // As the caller's body said its size (see `Whole::exact`).
            if shared.head_exact {
                return SizeHint::with_exact(kept);
            }
            let mut hint = SizeHint::new();
            hint.set_lower(kept);
            return hint;
        }
        match &shared.source {
            None => SizeHint::with_exact(kept),
            Some(source) => {
                let rest = source.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(kept));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(kept));
                }
                hint
            }
        }
    }
}

impl<B> Clone for ReplayBody<B> {
    /// A clone that reads the body again from its start.
    fn clone(&self) -> Self {
        ReplayBody {
            state: self.state.clone(),
            pos: 0,
            trailers_sent: false,
            epoch: UNSENT,
            marks: Marks::default(),
            waited: false,
            attempt: 0,
        }
    }
}

impl<B> Drop for ReplayBody<B> {
    #[inline]
    fn drop(&mut self) {
        // If this clone was the one the source would wake, whoever waits must
        // poll the source themselves now. A clone the source never answered
        // `Pending` holds no waker of the source's: nothing to hand over, and
        // no lock to take (the common case: a unary body, read at once).
        // A hedged call's attempt, or a retried call's that may be drained,
        // also says it is gone: it may be the last the copy is kept for.
        if self.waited || self.attempt != 0 || self.marks.has(Marks::DRAINABLE | Marks::READING) {
            self.gone();
        }
    }
}

impl<B> ReplayBody<B> {
    /// This clone, which the shared state knows of, is gone.
    #[cold]
    fn gone(&mut self) {
        let drainable = self.marks.has(Marks::DRAINABLE);
        let mut shared = match self.state() {
            Ok(shared) => shared,
            Err(whole) => {
                // An attempt sent that had yet to read it all.
                if self.marks.has(Marks::READING) {
                    whole.read();
                }
                return;
            }
        };
        if self.attempt != 0 {
            shared.gone(self.attempt);
        }
        if drainable {
            shared.drainable &= !epoch_bit(self.epoch);
            if shared.live == self.epoch {
                // The live attempt is gone: it needs nothing more of the
                // copy (a retry sent after it reads from its own start).
                shared.live_pos = usize::MAX;
            }
            shared.drain_over(self.epoch);
        }
        if self.waited {
            shared.wake_waiting();
        }
    }
}

impl<B> fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shared = match self.state() {
            Ok(shared) => shared,
            Err(whole) => {
                return f
                    .debug_struct("ReplayBody")
                    .field("pos", &self.pos)
                    .field("chunks", &whole.chunks.len())
                    .field("released", &whole.released.load(Ordering::Relaxed))
                    .field("retry", &self.is_retry())
                    .field("whole", &true)
                    .finish();
            }
        };
        f.debug_struct("ReplayBody")
            .field("pos", &self.pos)
            .field("read", &shared.read)
            .field("bytes", &shared.bytes)
            .field("limit", &shared.limit)
            .field("capped", &shared.capped)
            .field("released", &shared.released)
            .field("epoch", &self.epoch)
            .field("retry", &self.is_retry())
            .field("ended", &shared.ended)
            .finish()
    }
}

/// A retried call's attempt sent, which may be drained: [`drain`](Self::drain)
/// lets its clone read on (replaying what later attempts read) while the
/// guard it returns, held by the drain, lasts and the clone is alive; the
/// call's copy is kept that long. It does not keep the call's body state
/// alive: once every clone is gone, the copy and the caller's body go,
/// however long the drain lasts.
pub(crate) struct Lingering {
    shared: Weak<dyn Drains>,
    epoch: u32,
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
trait Drains: Send + Sync {
    fn start(&self, epoch: u32);
    fn end(&self, epoch: u32);
}

impl<B: Send> Drains for Mutex<Shared<B>> {
    fn start(&self, epoch: u32) {
        let mut shared = self.lock().unwrap_or_else(PoisonError::into_inner);
        // A clone already gone (its body sent whole) needs nothing kept.
        let bit = epoch_bit(epoch);
        shared.cut |= bit;
        shared.draining |= shared.drainable & bit;
    }

    fn end(&self, epoch: u32) {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain_over(epoch);
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

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full, StreamBody};
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::UnboundedReceiverStream;

    type Source = StreamBody<UnboundedReceiverStream<Result<Frame<Bytes>, BoxError>>>;

    /// A body fed by hand: returns the sender and the wrapped body.
    fn fixture(
        limit: usize,
    ) -> (
        mpsc::UnboundedSender<Result<Frame<Bytes>, BoxError>>,
        ReplayBody<Source>,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        let body = ReplayBody::new(StreamBody::new(UnboundedReceiverStream::new(rx)), limit);
        (tx, body)
    }

    /// The source `fixture` wraps, for a body made another way.
    fn fixture_source() -> (
        mpsc::UnboundedSender<Result<Frame<Bytes>, BoxError>>,
        Source,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, StreamBody::new(UnboundedReceiverStream::new(rx)))
    }

    fn data(s: &'static str) -> Result<Frame<Bytes>, BoxError> {
        Ok(Frame::data(Bytes::from_static(s.as_bytes())))
    }

    fn trailers(k: &'static str, v: &'static str) -> HeaderMap {
        let mut t = HeaderMap::new();
        t.insert(k, v.parse().unwrap());
        t
    }

    async fn collect(body: ReplayBody<Source>) -> (Vec<u8>, Option<HeaderMap>) {
        let c = body
            .collect()
            .await
            .expect("body should be collected whole");
        let t = c.trailers().cloned();
        (c.to_bytes().to_vec(), t)
    }

    #[tokio::test]
    async fn one_chunk_replays() {
        let (tx, first) = fixture(64);
        let second = first.clone();
        tx.send(data("hello")).unwrap();
        drop(tx);
        assert_eq!(collect(first).await.0, b"hello");
        assert!(second.is_replayable());
        assert_eq!(
            collect(second).await.0,
            b"hello",
            "the retry sends the same bytes"
        );
    }

    #[tokio::test]
    async fn many_chunks_and_trailers_replay_in_order() {
        let (tx, first) = fixture(64);
        let second = first.clone();
        for s in ["a", "bc", "def"] {
            tx.send(data(s)).unwrap();
        }
        tx.send(Ok(Frame::trailers(trailers("x-sum", "6"))))
            .unwrap();
        drop(tx);
        let (bytes, t) = collect(first).await;
        assert_eq!(bytes, b"abcdef");
        assert_eq!(t.unwrap()["x-sum"], "6");
        let (bytes, t) = collect(second).await;
        assert_eq!(bytes, b"abcdef");
        assert_eq!(t.expect("trailers should be replayed")["x-sum"], "6");
    }

    #[tokio::test]
    async fn replay_is_zero_copy() {
        let (tx, mut first) = fixture(64);
        let mut second = first.clone();
        tx.send(data("shared")).unwrap();
        let a = first.frame().await.unwrap().unwrap().into_data().unwrap();
        let b = second.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(
            a.as_ptr(),
            b.as_ptr(),
            "the replayed chunk is the same memory"
        );
    }

    #[tokio::test]
    async fn a_clone_switched_in_mid_body_replays_then_reads_on() {
        let (tx, mut first) = fixture(64);
        let second = first.clone();
        tx.send(data("one ")).unwrap();
        assert_eq!(
            first.frame().await.unwrap().unwrap().into_data().unwrap(),
            "one "
        );
        // The first attempt fails here; its body is dropped mid-stream.
        drop(first);
        tx.send(data("two")).unwrap();
        drop(tx);
        assert_eq!(collect(second).await.0, b"one two");
    }

    #[tokio::test]
    async fn two_clones_reading_at_once_both_see_everything() {
        let (tx, first) = fixture(64);
        let second = first.clone();
        let feed = async move {
            for s in ["x", "y", "z"] {
                tokio::task::yield_now().await;
                tx.send(data(s)).unwrap();
            }
        };
        let (a, b, ()) = tokio::join!(collect(first), collect(second), feed);
        assert_eq!(a.0, b"xyz");
        assert_eq!(b.0, b"xyz", "the waiting clone was woken");
    }

    #[tokio::test]
    async fn over_the_limit_the_body_is_delivered_whole_but_not_replayable() {
        let (tx, first) = fixture(8);
        let mut second = first.clone();
        for s in ["1234", "5678", "9"] {
            tx.send(data(s)).unwrap();
        }
        drop(tx);
        assert_eq!(collect(first).await.0, b"123456789", "never truncated");
        assert!(!second.is_replayable());
        assert!(second.is_capped());
        let err = second.frame().await.unwrap().unwrap_err();
        assert_eq!(
            err.downcast_ref::<ReplayError>(),
            Some(&ReplayError::Capped)
        );
    }

    #[tokio::test]
    async fn exactly_the_limit_is_still_replayable() {
        let (tx, first) = fixture(8);
        let second = first.clone();
        tx.send(data("12345678")).unwrap();
        drop(tx);
        assert_eq!(collect(first).await.0, b"12345678");
        assert!(second.is_replayable());
        assert_eq!(collect(second).await.0, b"12345678");
    }

    #[tokio::test]
    async fn a_size_hint_over_the_limit_keeps_nothing() {
        let body = ReplayBody::new(
            http_body_util::Full::new(Bytes::from_static(b"0123456789")),
            4,
        );
        assert!(body.is_capped());
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, "0123456789");
    }

    /// How many chunks the shared copy holds.
    fn kept(body: &ReplayBody<Source>) -> usize {
        let shared = body.state().ok().expect("a streamed body");
        usize::from(shared.chunks.first.is_some()) + shared.chunks.rest.len()
    }

    #[tokio::test]
    async fn after_release_the_stream_goes_on_and_nothing_is_copied() {
        let (tx, mut first) = fixture(1 << 20);
        tx.send(data("before")).unwrap();
        first.frame().await.unwrap().unwrap();
        assert_eq!(kept(&first), 1);
        // The response committed: no retry can follow.
        first.release();
        assert_eq!(kept(&first), 0, "the copy is dropped at once");
        assert!(!first.is_replayable());
        for _ in 0..100 {
            tx.send(data("streamed on")).unwrap();
            let chunk = first.frame().await.unwrap().unwrap().into_data().unwrap();
            assert_eq!(chunk, "streamed on", "the stream is not disturbed");
        }
        assert_eq!(kept(&first), 0, "nothing is copied after the release");
        let mut late = first.clone();
        let err = late.frame().await.unwrap().unwrap_err();
        assert_eq!(
            err.downcast_ref::<ReplayError>(),
            Some(&ReplayError::Released)
        );
    }

    #[tokio::test]
    async fn the_last_attempt_releases_the_copy_once_it_has_replayed_it() {
        let (tx, mut first) = fixture(1 << 20);
        tx.send(data("a")).unwrap();
        tx.send(data("b")).unwrap();
        first.frame().await.unwrap().unwrap();
        first.frame().await.unwrap().unwrap();
        let mut last = first.clone();
        drop(first);
        last.mark_last();
        last.sent();
        assert_eq!(
            last.frame().await.unwrap().unwrap().into_data().unwrap(),
            "a"
        );
        assert_eq!(kept(&last), 2, "still replaying");
        assert_eq!(
            last.frame().await.unwrap().unwrap().into_data().unwrap(),
            "b"
        );
        assert_eq!(kept(&last), 0, "replayed whole: the copy goes");
        tx.send(data("c")).unwrap();
        drop(tx);
        assert_eq!(
            last.frame().await.unwrap().unwrap().into_data().unwrap(),
            "c"
        );
        assert_eq!(kept(&last), 0, "and nothing more is copied");
        assert!(last.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_failed_source_fails_later_clones_too() {
        let (tx, mut first) = fixture(64);
        let mut second = first.clone();
        tx.send(Err("boom".into())).unwrap();
        assert!(first.frame().await.unwrap().is_err());
        assert!(!second.is_replayable());
        let err = second.frame().await.unwrap().unwrap_err();
        assert_eq!(
            err.downcast_ref::<ReplayError>(),
            Some(&ReplayError::SourceFailed)
        );
    }

    #[tokio::test]
    async fn end_of_stream_and_size_hints() {
        let body = ReplayBody::new(http_body_util::Empty::<Bytes>::new(), 4);
        assert!(
            body.is_end_stream(),
            "an empty body says so before being polled"
        );
        let full = ReplayBody::new(http_body_util::Full::new(Bytes::from_static(b"abc")), 64);
        assert_eq!(full.size_hint().exact(), Some(3));
        let again = full.clone();
        let (bytes, _) = {
            let c = full.collect().await.unwrap();
            (c.to_bytes(), ())
        };
        assert_eq!(bytes, "abc");
        assert_eq!(
            again.size_hint().exact(),
            Some(3),
            "replay knows its exact size"
        );
        assert!(!again.is_end_stream());
        assert_eq!(again.collect().await.unwrap().to_bytes(), "abc");
    }

    #[tokio::test]
    async fn the_first_attempt_streams_before_the_body_ends() {
        let (tx, mut first) = fixture(64);
        tx.send(data("early")).unwrap();
        // The sender is still open: the body has not ended, yet the chunk flows.
        let chunk = first.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(chunk, "early");
        assert!(!first.is_complete());
        drop(tx);
        assert!(first.frame().await.is_none());
        assert!(first.is_complete());
    }

    #[test]
    fn the_layers_memory_never_overflows_nor_passes_its_limit() {
        let memory = ReplayMemory::new(10);
        assert!(memory.try_reserve(0, 10));
        assert!(!memory.try_reserve(0, 1), "full");
        memory.release(0, 4);
        assert!(
            !memory.try_reserve(0, usize::MAX),
            "an overflowing reservation is refused"
        );
        assert!(memory.try_reserve(0, 4));
        assert_eq!(memory.used(), 10);
        let unbounded = ReplayMemory::new(usize::MAX);
        assert!(unbounded.try_reserve(0, usize::MAX));
        assert!(!unbounded.try_reserve(1, 1));
    }

    #[test]
    fn bytes_a_stripe_holds_spare_are_room_for_any_other_stripe() {
        let memory = ReplayMemory::new(1 << 20);
        // Stripe 0 is granted bytes ahead, and keeps them when its copy goes.
        assert!(memory.try_reserve(0, 3000));
        memory.release(0, 3000);
        assert_eq!(memory.used(), 0, "spare bytes are held by no copy");
        // The whole limit is still room for a copy counted elsewhere.
        assert!(memory.try_reserve(1, 1 << 20));
        assert_eq!(memory.used(), 1 << 20);
        for stripe in 0..STRIPES {
            assert!(!memory.try_reserve(stripe, 1), "full, from stripe {stripe}");
        }
        memory.release(1, 1 << 20);
        assert_eq!(memory.used(), 0);
        assert!(memory.try_reserve(2, 1 << 20), "all of it back");
    }

    #[test]
    fn a_stripes_copies_write_no_shared_count_once_it_holds_bytes_ahead() {
        let memory = ReplayMemory::new(ReplayMemory::DEFAULT_LIMIT);
        assert!(memory.try_reserve(5, 16));
        memory.release(5, 16);
        let granted = memory.granted.load(Ordering::Relaxed);
        // Unary calls one after another, and up to a grain's worth at once.
        for size in [16, 4 << 10, 60 << 10] {
            for _ in 0..1_000 {
                assert!(memory.try_reserve(5, size));
                memory.release(5, size);
            }
        }
        let held: Vec<usize> = (0..16).map(|n| 1 + n * 250).collect();
        for &size in &held {
            assert!(memory.try_reserve(5, size));
        }
        for &size in &held {
            memory.release(5, size);
        }
        assert_eq!(
            memory.granted.load(Ordering::Relaxed),
            granted,
            "the shared count was not written again"
        );
        assert_eq!(memory.used(), 0);
    }

    #[test]
    fn copies_larger_than_a_grain_that_fit_together_are_never_refused() {
        // A stripe giving spare bytes back (past twice its grain) while a
        // copy is refused elsewhere.
        const LIMIT: usize = 1 << 20;
        let small = 3 * ReplayMemory::grain(LIMIT);
        let memory = ReplayMemory::new(LIMIT);
        let sizes = [LIMIT - small, small];
        let refused: Vec<usize> = std::thread::scope(|scope| {
            let threads: Vec<_> = sizes
                .iter()
                .enumerate()
                .map(|(stripe, &size)| {
                    let memory = &memory;
                    scope.spawn(move || {
                        let mut refused = 0;
                        for _ in 0..50_000 {
                            if memory.try_reserve(stripe, size) {
                                memory.release(stripe, size);
                            } else {
                                refused += 1;
                            }
                        }
                        refused
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert_eq!(refused, [0, 0], "refused, by stripe");
        assert_eq!(memory.used(), 0);
    }

    #[test]
    fn calls_through_a_handle_each_count_in_their_threads_stripe() {
        use crate::shared::{Local, Shared};
        // tonic's clients are cloned for each call: a service handle each.
        std::thread::spawn(|| {
            let policies = crate::MethodPolicies::from(crate::RetryPolicy::default());
            let budget = crate::RetryBudget::new(10, 0.1).unwrap();
            let shared = Shared::new(policies, budget);
            for _ in 0..100 {
                let handle: Arc<dyn Account> = Local::new(&shared, crate::trace::NoMetrics);
                assert!(handle.try_reserve(16));
                handle.release(16);
            }
            let memory = &shared.replay_memory;
            let spare: Vec<usize> = memory
                .spare
                .iter()
                .map(|s| s.0.load(Ordering::Relaxed))
                .collect();
            let mine = thread_stripe();
            assert!(spare[mine] > 0, "the thread's stripe holds bytes ahead");
            assert_eq!(
                spare.iter().filter(|&&s| s > 0).count(),
                1,
                "no other stripe was written: {spare:?}"
            );
            assert_eq!(memory.used(), 0);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_lowered_limit_holds_for_bytes_granted_ahead_under_the_old_one() {
        let memory = ReplayMemory::new(1 << 20);
        // Stripe 0 keeps bytes granted ahead under the first limit.
        assert!(memory.try_reserve(0, 100));
        memory.release(0, 100);
        assert!(memory.try_reserve(1, 500 << 10));
        memory.set_limit(500 << 10);
        assert!(
            !memory.try_reserve(0, 100),
            "stripe 0's spare bytes are no room past the lowered limit"
        );
        assert_eq!(memory.used(), 500 << 10);
        memory.release(1, 500 << 10);
        assert!(memory.try_reserve(0, 500 << 10), "what fits under it does");
        assert!(!memory.try_reserve(1, 1));
        assert_eq!(memory.used(), 500 << 10);
    }

    #[test]
    fn copies_that_fit_together_are_never_refused_whatever_their_stripes_do_at_once() {
        // Each thread holds at most its copy; together they fill the limit
        // exactly, so every reservation fits whatever the order.
        const LIMIT: usize = 1 << 20;
        let memory = ReplayMemory::new(LIMIT);
        let sizes = [LIMIT - 3000, 1000, 2000];
        std::thread::scope(|scope| {
            for (stripe, &size) in sizes.iter().enumerate() {
                let memory = &memory;
                scope.spawn(move || {
                    for _ in 0..20_000 {
                        assert!(memory.try_reserve(stripe, size), "stripe {stripe} refused");
                        memory.release(stripe, size);
                    }
                });
            }
        });
        assert_eq!(memory.used(), 0);
    }

    #[tokio::test]
    async fn a_copy_the_layer_has_no_room_for_is_dropped_and_says_why() {
        let memory = Arc::new(ReplayMemory::new(4));
        let (tx, source) = tokio::sync::mpsc::unbounded_channel();
        let source = http_body_util::StreamBody::new(
            tokio_stream::wrappers::UnboundedReceiverStream::new(source),
        );
        let first = ReplayBody::sharing(source, 64, Some(Arc::clone(&memory) as Arc<dyn Account>));
        let second = first.clone();
        tx.send(data("abc")).unwrap();
        tx.send(data("def")).unwrap();
        drop(tx);
        let sent = first.collect().await.unwrap().to_bytes();
        assert_eq!(sent, "abcdef", "the first attempt gets the whole body");
        assert_eq!(second.replay_state(), Err(ReplayError::LayerFull));
        assert_eq!(memory.used(), 0, "what the copy held is given back");
        let err = second.collect().await.unwrap_err();
        assert_eq!(
            err.downcast_ref::<ReplayError>(),
            Some(&ReplayError::LayerFull)
        );
    }

    /// A body the layer's memory counts, read at once as a retried call's is.
    fn at_once<T>(source: T, limit: usize, memory: &Arc<ReplayMemory>) -> ReplayBody<T>
    where
        T: Body<Data = Bytes> + Unpin,
        T::Error: Into<BoxError>,
    {
        let memory = Some(Arc::clone(memory) as Arc<dyn Account>);
        ReplayBody::at_once(source, limit, memory)
    }

    #[tokio::test]
    async fn a_body_all_there_is_read_whole_and_replayed_without_its_source() {
        let memory = Arc::new(ReplayMemory::new(1 << 20));
        let (tx, source) = fixture_source();
        tx.send(data("ab")).unwrap();
        tx.send(data("cd")).unwrap();
        tx.send(Ok(Frame::trailers(trailers("x-t", "1")))).unwrap();
        let first = at_once(source, 64, &memory);
        assert!(matches!(first.state, State::Whole(_)));
        assert!(first.is_complete() && first.is_replayable() && !first.is_capped());
        assert_eq!(memory.used(), 4, "the copy is counted from the start");
        let second = first.clone();
        let third = first.clone();
        // The caller's body is not read again: its sender may go.
        drop(tx);
        for body in [first, second] {
            let (bytes, t) = collect(body).await;
            assert_eq!(bytes, b"abcd");
            assert_eq!(t.unwrap()["x-t"], "1");
        }
        // No retry follows: a clone can no longer be sent, and the layer's
        // memory gets back what the copy held.
        third.release();
        assert_eq!(third.whole(), Err(ReplayError::Released));
        assert_eq!(memory.used(), 0);
        drop(third);
        assert_eq!(memory.used(), 0, "given back once");
    }

    #[tokio::test]
    async fn a_body_read_whole_gives_the_memory_back_when_its_last_clone_goes() {
        let memory = Arc::new(ReplayMemory::new(1 << 20));
        let first = at_once(Full::new(Bytes::from_static(b"hello")), 64, &memory);
        let second = first.clone();
        assert_eq!(memory.used(), 5);
        drop(first);
        assert_eq!(memory.used(), 5, "a clone still holds the copy");
        drop(second);
        assert_eq!(memory.used(), 0, "a call dropped unreleased holds nothing");
    }

    #[tokio::test]
    async fn a_body_not_all_there_sends_what_was_read_then_streams_on() {
        let memory = Arc::new(ReplayMemory::new(1 << 20));
        let (tx, source) = fixture_source();
        tx.send(data("early")).unwrap();
        let mut first = at_once(source, 64, &memory);
        assert!(matches!(first.state, State::Streamed(_)));
        let second = first.clone();
        let chunk = first.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(chunk, "early", "what was read at once goes first");
        tx.send(data(" late")).unwrap();
        drop(tx);
        assert_eq!(collect(first).await.0, b" late");
        assert_eq!(
            collect(second).await.0,
            b"early late",
            "a retry replays all"
        );
    }

    #[tokio::test]
    async fn a_body_failing_at_once_fails_its_first_attempt_and_is_not_replayed() {
        let memory = Arc::new(ReplayMemory::new(1 << 20));
        let (tx, source) = fixture_source();
        tx.send(data("ok")).unwrap();
        tx.send(Err("the caller's body broke".into())).unwrap();
        let mut first = at_once(source, 64, &memory);
        let second = first.clone();
        assert!(
            second.whole().is_ok(),
            "nothing is known broken before it is sent"
        );
        let chunk = first.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(chunk, "ok");
        let err = first.frame().await.unwrap().unwrap_err();
        assert_eq!(err.to_string(), "the caller's body broke");
        assert_eq!(second.replay_state(), Err(ReplayError::SourceFailed));
        drop(tx);
    }

    #[tokio::test]
    async fn a_body_over_the_limit_read_at_once_is_sent_whole_and_not_replayed() {
        let memory = Arc::new(ReplayMemory::new(1 << 20));
        let (tx, source) = fixture_source();
        tx.send(data("0123")).unwrap();
        tx.send(data("4567")).unwrap();
        drop(tx);
        let first = at_once(source, 6, &memory);
        let second = first.clone();
        assert_eq!(collect(first).await.0, b"01234567", "sent whole");
        assert_eq!(second.replay_state(), Err(ReplayError::Capped));
        assert_eq!(memory.used(), 0);
    }

    #[tokio::test]
    async fn a_body_the_layer_has_no_room_for_is_sent_whole_and_not_replayed() {
        let memory = Arc::new(ReplayMemory::new(3));
        let first = at_once(Full::new(Bytes::from_static(b"hello")), 64, &memory);
        let second = first.clone();
        assert_eq!(first.collect().await.unwrap().to_bytes(), "hello");
        assert_eq!(second.replay_state(), Err(ReplayError::LayerFull));
        assert_eq!(memory.used(), 0);
    }

    #[tokio::test]
    async fn no_more_than_a_few_frames_are_read_before_the_first_attempt() {
        let memory = Arc::new(ReplayMemory::new(1 << 20));
        let (tx, source) = fixture_source();
        for _ in 0..AT_ONCE_FRAMES * 4 {
            tx.send(data("x")).unwrap();
        }
        let first = at_once(source, 1 << 20, &memory);
        match &first.state {
            State::Streamed(shared) => {
                let shared = shared.lock().unwrap();
                assert_eq!(shared.head.len(), AT_ONCE_FRAMES, "the rest waits its turn");
            }
            State::Whole(_) => panic!("an unfinished body is not read whole"),
        }
        drop(tx);
        let sent = collect(first).await.0;
        assert_eq!(
            sent.len(),
            AT_ONCE_FRAMES * 4,
            "nothing lost, nothing twice"
        );
    }

    #[tokio::test]
    async fn the_first_attempt_says_its_size_as_the_callers_body_did() {
        let memory = Arc::new(ReplayMemory::new(1 << 20));
        // A body that knows its size says so; one that does not (a stream, as
        // tonic's encoder is) does not start to, so a client adds no
        // `content-length` the caller's body would not have had.
        let known = at_once(Full::new(Bytes::from_static(b"hello")), 64, &memory);
        assert_eq!(known.size_hint().exact(), Some(5));
        let (tx, source) = fixture_source();
        tx.send(data("hello")).unwrap();
        drop(tx);
        let unknown = at_once(source, 64, &memory);
        assert!(matches!(unknown.state, State::Whole(_)));
        assert_eq!(unknown.size_hint().exact(), None);
        assert_eq!(unknown.size_hint().lower(), 5);
        // A retry's clone of a body all read knows its size.
        assert_eq!(unknown.clone().size_hint().exact(), Some(5));
    }

    #[tokio::test]
    async fn an_empty_body_is_read_whole_and_ends_at_once() {
        let memory = Arc::new(ReplayMemory::new(1 << 20));
        let first = at_once(http_body_util::Empty::<Bytes>::new(), 64, &memory);
        assert!(first.is_end_stream());
        assert!(first.clone().is_end_stream() && first.is_replayable());
    }
}
