//! How a clone reads: the `Body` every attempt sends, and what a clone's end gives back.

use super::*;

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
        let epoch = this.epoch;

        // An earlier attempt's stream, still pulled after a later attempt was
        // sent, must not take chunks from it (nor push the copy over its cap).
        // A drained attempt's may go on replaying what the live one read.
        let readers = &shared.readers;
        let stale = epoch != UNSENT && epoch < readers.live && !readers.concurrent;
        if stale && !readers.drains.is_draining(epoch) {
            return Poll::Ready(Some(Err(ReplayError::Superseded.into())));
        }
        // Once no retry can follow, only the live attempt reads.
        if let Phase::Only(only) = shared.phase
            && only != epoch
        {
            return Poll::Ready(Some(Err(ReplayError::Released.into())));
        }
        // Replay what an earlier attempt already read.
        if this.pos < shared.copy.read {
            let copy = &shared.copy;
            if let Keeping::Capped(cap) = copy.keeping {
                return Poll::Ready(Some(Err(cap.error().into())));
            }
            let dropped = copy.keeping.is_dropped() || this.pos >= copy.chunks.len();
            if dropped
                && matches!(shared.phase, Phase::Drains(_))
                && shared.readers.drains.is_draining(epoch)
            {
                // Past what was kept when the call was released while
                // attempts drain (read since by the attempt it is released
                // to, and not copied), or the copy is gone because none
                // needed it: a drained attempt waits for its drain to end.
                return shared.hold_back(epoch, &mut this.waited, cx);
            }
            if dropped {
                return Poll::Ready(Some(Err(ReplayError::Released.into())));
            }
            let chunk = copy.chunks.get(this.pos).clone();
            this.pos += 1;
            shared.advanced((epoch, this.attempt), this.pos);
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        shared.advanced((epoch, this.attempt), this.pos);
        let input = &mut shared.input;
        if input.failed {
            let error = input
                .error
                .take()
                .unwrap_or_else(|| ReplayError::SourceFailed.into());
            return Poll::Ready(Some(Err(error)));
        }
        if input.ended {
            return Poll::Ready(match &input.trailers {
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
        let reader_left = shared.phase.reader() == Some(epoch);
        if stale || (shared.readers.drains.was_cut(epoch) && !reader_left) {
            return shared.hold_back(epoch, &mut this.waited, cx);
        }

        // This clone is at the front: read on from the caller's body, the
        // frames read before the first attempt first.
        let input = &mut shared.input;
        let polled = if let Some(frame) = input.head.pop_front() {
            Poll::Ready(Some(frame))
        } else if input.head_ends {
            Poll::Ready(None)
        } else {
            let Some(source) = input.source.as_mut() else {
                return Poll::Ready(None);
            };
            Pin::new(source)
                .poll_frame(cx)
                .map(|frame| frame.map(|frame| frame.map_err(Into::into)))
        };
        let out = match polled {
            Poll::Pending => {
                input.stalled = true;
                input.wait(cx);
                this.waited = true;
                return Poll::Pending;
            }
            Poll::Ready(None) => {
                input.end(None);
                None
            }
            Poll::Ready(Some(Err(e))) => {
                // This clone hands the error on: later ones get
                // `SourceFailed`.
                input.fail(None);
                input.head.clear();
                Some(Err(e))
            }
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(chunk) => {
                    shared.keep(&chunk);
                    this.pos += 1;
                    shared.advanced((epoch, this.attempt), this.pos);
                    Some(Ok(Frame::data(chunk)))
                }
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => {
                        // Trailers end an HTTP body.
                        input.end(Some(trailers.clone()));
                        this.trailers_sent = true;
                        Some(Ok(Frame::trailers(trailers)))
                    }
                    // A frame kind this crate does not know: pass it on once.
                    Err(frame) => Some(Ok(frame)),
                },
            },
        };
        // Other clones may be waiting on what this one just read.
        shared.input.wake_waiting();
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
        if self.pos < shared.copy.read {
            return false;
        }
        let input = &shared.input;
        if input.ended {
            return input.trailers.is_none() || self.trailers_sent;
        }
        // NOTE: frames read before the first attempt are still to come, and
        // a body whose end was read then still has that end to give.
        !input.failed
            && input.head.is_empty()
            && !input.head_ends
            && input.source.as_ref().is_some_and(B::is_end_stream)
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
        if shared.copy.keeping.is_capped() && self.pos < shared.copy.read {
            return SizeHint::default();
        }
        let input = &shared.input;
        let head: u64 = input
            .head
            .iter()
            .filter_map(|frame| frame.as_ref().ok()?.data_ref())
            .map(|chunk| chunk.len() as u64)
            .sum();
        let kept = shared.copy.chunks.bytes_from(self.pos).saturating_add(head);
        if input.head_ends {
            // As the caller's body said its size (see `Whole::exact`).
            if input.head_exact {
                return SizeHint::with_exact(kept);
            }
            let mut hint = SizeHint::new();
            hint.set_lower(kept);
            return hint;
        }
        match &input.source {
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
            shared.readers.drains.gone(self.epoch);
            if shared.readers.live == self.epoch {
                // The live attempt is gone: it needs nothing more of the
                // copy (a retry sent after it reads from its own start).
                shared.readers.live_pos = usize::MAX;
            }
            shared.drain_over(self.epoch);
        }
        if self.waited {
            shared.input.wake_waiting();
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
            .field("read", &shared.copy.read)
            .field("bytes", &shared.copy.bytes)
            .field("limit", &shared.copy.limit)
            .field("keeping", &shared.copy.keeping)
            .field("phase", &shared.phase)
            .field("epoch", &self.epoch)
            .field("retry", &self.is_retry())
            .field("ended", &shared.input.ended)
            .finish()
    }
}
