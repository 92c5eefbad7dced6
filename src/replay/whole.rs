//! A body read whole before the first attempt: every clone replays it from one immutable copy.

use super::*;

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
pub(super) struct Whole {
    pub(super) chunks: Kept,
    pub(super) trailers: Option<HeaderMap>,
    /// The caller's body knew its size exactly. The first attempt's clone
    /// says its size as the caller's body did (so an HTTP/2 client adds a
    /// `content-length` to the request only where it would have without the
    /// layer); a clone for a retry, of a body all read, knows it exactly.
    pub(super) exact: bool,
    /// No retry can follow: a clone can no longer be sent.
    pub(super) released: AtomicBool,
    /// Attempts sent that have yet to read the whole body.
    pub(super) readers: AtomicUsize,
    /// The layer's memory for the copies of its calls in flight, how much of
    /// it this body holds, and whether it got that back.
    pub(super) memory: Option<Arc<dyn Account>>,
    pub(super) reserved: usize,
    pub(super) given_back: AtomicBool,
    /// The instance a balancer below reported for the current attempt.
    pub(super) picked: Mutex<Option<HeaderValue>>,
}

impl Whole {
    pub(super) fn replay_state(&self) -> Result<(), ReplayError> {
        if self.released.load(Ordering::Relaxed) {
            return Err(ReplayError::Released);
        }
        Ok(())
    }

    /// No retry can follow.
    pub(super) fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
        self.give_back_if_unneeded();
    }

    /// An attempt is sent: until it has read the whole body, the body is
    /// still needed.
    pub(super) fn reading(&self) {
        self.readers.fetch_add(1, Ordering::SeqCst);
    }

    /// An attempt sent has read the whole body, or is gone.
    pub(super) fn read(&self) {
        self.readers.fetch_sub(1, Ordering::SeqCst);
        self.give_back_if_unneeded();
    }

    // NOTE: `released` and `readers` are each written before the other is
    // read, all sequentially consistent: of a release and the last reader
    // finishing at once, at least one sees the other's write.
    pub(super) fn give_back_if_unneeded(&self) {
        if self.released.load(Ordering::SeqCst) && self.readers.load(Ordering::SeqCst) == 0 {
            self.give_back();
        }
    }

    /// The layer's memory gets back what the body held, once.
    pub(super) fn give_back(&self) {
        if self.reserved > 0
            && !self.given_back.swap(true, Ordering::SeqCst)
            && let Some(memory) = &self.memory
        {
            memory.release(self.reserved);
        }
    }

    /// Whether a clone at `pos` has read the whole body.
    pub(super) fn read_by(&self, pos: usize, trailers_sent: bool) -> bool {
        pos >= self.chunks.len() && (self.trailers.is_none() || trailers_sent)
    }

    /// The frame a clone at `pos` reads next.
    #[inline]
    pub(super) fn frame(&self, pos: &mut usize, trailers_sent: &mut bool) -> Option<Frame<Bytes>> {
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
pub(super) const AT_ONCE_FRAMES: usize = 8;

/// What the caller's body had ready when the call was made.
pub(super) struct AtOnce {
    pub(super) chunks: Kept,
    pub(super) bytes: usize,
    pub(super) trailers: Option<HeaderMap>,
    /// The body ended (its last frame, or trailers, was read).
    pub(super) ended: bool,
    /// The body failed: its error, which the attempt reading up to it gets.
    pub(super) error: Option<BoxError>,
}

impl AtOnce {
    /// Reads what `body` has ready now, without waiting: until it ends, fails
    /// or answers `Pending`, has given [`AT_ONCE_FRAMES`] frames, or more
    /// than `limit` bytes.
    #[inline(always)]
    pub(super) fn read<B>(body: &mut B, limit: usize) -> Self
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
    pub(super) fn into_frames(self) -> VecDeque<Result<Frame<Bytes>, BoxError>> {
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
