//! Counters a caller can read, e.g. to export as metrics.

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Counts of what the layer did, shared by every clone of one [`RetryLayer`]
/// and the services it made.
///
/// [`RetryLayer`]: crate::RetryLayer
#[derive(Clone, Default)]
pub struct RetryMetrics {
    inner: Arc<Counters>,
}

#[derive(Default)]
struct Counters {
    /// Attempts, counted in stripes: every call counts one, so one counter
    /// would be written by every thread on every call. A thread counts in
    /// its own stripe ([`thread_stripe`]).
    attempts: [Stripe; STRIPES],
    retries: AtomicU64,
    refused_by_budget: AtomicU64,
    refused_by_deadline: AtomicU64,
    retried_below: AtomicU64,
    marked: AtomicU64,
    body_too_large: AtomicU64,
    hedges: AtomicU64,
    hedges_capped: AtomicU64,
    draining: AtomicU64,
    drained: AtomicU64,
    drain_cut: AtomicU64,
    drain_refused: AtomicU64,
}

/// How many stripes the attempts are counted in.
pub(crate) const STRIPES: usize = 16;

/// The stripe the calls made on this thread count in, of every layer's
/// counts kept in stripes: one a thread, so that the calls of one thread
/// write lines no other thread writes, whichever service handle they go
/// through (tonic's clients are cloned for each call) and wherever a
/// multi-thread runtime moves their tasks.
///
/// A thread holds the lowest stripe no living thread holds, from its first
/// call to its end, when the stripe is free again. With more than
/// [`STRIPES`] threads calling at once, the others share stripes in turn
/// until one is free; so do the calls a thread's thread-local destructors
/// make once its stripe is given back.
///
/// One case keeps a stripe held after its thread ends: a thread whose first
/// call comes from a destructor that runs after Rust's thread-locals are
/// gone (one the C library runs at thread exit, registered with
/// `pthread_key_create`), since nothing then runs the holder's destructor.
/// Counts stay exact; once all stripes are held so, threads share them.
#[inline]
pub(crate) fn thread_stripe() -> usize {
    STRIPE.with(|stripe| match stripe.get() {
        at if at < STRIPES => at,
        at => ThreadStripe::find(stripe, at),
    })
}

thread_local! {
    /// The thread's stripe (see [`ThreadStripe`]), read on every call.
    // NOTE: a cell with no destructor: a thread-local with one is checked
    // for it on every read. The stripe is given back by `HOLDER`'s.
    static STRIPE: Cell<usize> = const { Cell::new(UNSET) };
    /// Gives the thread's stripe back when the thread ends.
    static HOLDER: ThreadStripe = const { ThreadStripe(Cell::new(UNSET)) };
}

/// What a thread counts in: below [`STRIPES`], a stripe it holds alone,
/// given back when it ends; from [`STRIPES`] on, a stripe shared in turn
/// (that number modulo [`STRIPES`]) until one is free.
struct ThreadStripe(Cell<usize>);

/// No stripe taken yet.
const UNSET: usize = usize::MAX;

/// The thread's stripe is given back: it is ending, and the calls its other
/// thread-locals' destructors make count in stripes shared in turn.
const ENDED: usize = usize::MAX - 1;

/// Which stripes living threads hold, one bit each.
static HELD: AtomicUsize = AtomicUsize::new(0);

/// The next stripe shared in turn, while every stripe is held.
static NEXT_SHARED: AtomicUsize = AtomicUsize::new(0);

impl ThreadStripe {
    /// The stripe for a thread with none of its own (`at`: none yet, one
    /// shared in turn, or given back): the lowest no living thread holds,
    /// held from now on, if there is one and the thread is not ending.
    #[cold]
    fn find(cell: &Cell<usize>, at: usize) -> usize {
        if at == ENDED {
            return Self::shared();
        }
        if let Some(own) = Self::take() {
            if HOLDER.try_with(|holder| holder.0.set(own)).is_ok() {
                cell.set(own);
                return own;
            }
            // The thread is ending: nothing would give a stripe back.
            Self::free(own);
            cell.set(ENDED);
            return Self::shared();
        }
        let at = if at == UNSET {
            STRIPES + Self::shared()
        } else {
            at
        };
        cell.set(at);
        at % STRIPES
    }

    /// The lowest stripe no living thread holds, now held.
    fn take() -> Option<usize> {
        let all = (1usize << STRIPES) - 1;
        let mut held = HELD.load(Ordering::Relaxed);
        while held & all != all {
            let at = (!held & all).trailing_zeros() as usize;
            match HELD.compare_exchange_weak(
                held,
                held | 1 << at,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(at),
                Err(now) => held = now,
            }
        }
        None
    }

    /// A stripe shared in turn.
    fn shared() -> usize {
        NEXT_SHARED.fetch_add(1, Ordering::Relaxed) % STRIPES
    }

    /// Gives `at` back, if it was held.
    fn free(at: usize) {
        if at < STRIPES {
            HELD.fetch_and(!(1 << at), Ordering::Relaxed);
        }
    }
}

impl Drop for ThreadStripe {
    fn drop(&mut self) {
        Self::free(self.0.get());
        // Calls made after this, by the thread's other thread-locals'
        // destructors, no longer count in the stripe given back.
        let _ = STRIPE.try_with(|stripe| stripe.set(ENDED));
    }
}

/// One stripe of a count, alone on its cache lines (x86-64 fetches them in
/// pairs).
#[derive(Default)]
#[repr(align(128))]
struct Stripe(AtomicU64);

/// What to count.
#[derive(Clone, Copy, Debug)]
// NOTE: `pub` in a private module: the recorders' sealed trait takes it.
pub enum Event {
    Retry,
    RefusedByBudget,
    RefusedByDeadline,
    RetriedBelow,
    Marked,
    BodyTooLarge,
    Hedge,
    HedgeCapped,
    Drained,
    DrainCut,
    DrainRefused,
}

impl RetryMetrics {
    pub(crate) fn record(&self, event: Event) {
        let c = &self.inner;
        let counter = match event {
            Event::Retry => &c.retries,
            Event::RefusedByBudget => &c.refused_by_budget,
            Event::RefusedByDeadline => &c.refused_by_deadline,
            Event::RetriedBelow => &c.retried_below,
            Event::Marked => &c.marked,
            Event::BodyTooLarge => &c.body_too_large,
            Event::Hedge => &c.hedges,
            Event::HedgeCapped => &c.hedges_capped,
            Event::Drained => &c.drained,
            Event::DrainCut => &c.drain_cut,
            Event::DrainRefused => &c.drain_refused,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an attempt, in the stripe of the thread that sent it.
    #[inline]
    pub(crate) fn attempt(&self) {
        if let Some(Stripe(count)) = self.inner.attempts.get(thread_stripe()) {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Attempts sent whose outcome came back (first attempts and retries;
    /// an attempt cut before it could be sent is not counted).
    pub fn attempts(&self) -> u64 {
        self.inner
            .attempts
            .iter()
            .map(|Stripe(count)| count.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }

    /// Retries sent, each paid for with one token when it was sent.
    pub fn retries(&self) -> u64 {
        self.inner.retries.load(Ordering::Relaxed)
    }

    /// Hedges sent (attempts of a hedged call after its first), each paid
    /// for with one token when it was sent. Not counted in
    /// [`retries`](Self::retries).
    pub fn hedges(&self) -> u64 {
        self.inner.hedges.load(Ordering::Relaxed)
    }

    /// Hedges due but not sent because the policy's extra-load cap
    /// ([`HedgePolicy::with_max_extra_load`](crate::HedgePolicy::with_max_extra_load))
    /// had none left: the call went on with the attempts it had.
    pub fn hedges_capped(&self) -> u64 {
        self.inner.hedges_capped.load(Ordering::Relaxed)
    }

    /// Retryable failures not retried because the budget was empty.
    pub fn refused_by_budget(&self) -> u64 {
        self.inner.refused_by_budget.load(Ordering::Relaxed)
    }

    /// Retryable failures not retried because the call's deadline had no room.
    pub fn refused_by_deadline(&self) -> u64 {
        self.inner.refused_by_deadline.load(Ordering::Relaxed)
    }

    /// Retryable failures passed up without a retry because they carried the
    /// "do not retry" mark (`grpc-retry-pushback-ms` negative): a retry layer
    /// below had already retried them and given up (or the server asked for
    /// no retry). Not counted in the refusals by budget or deadline.
    pub fn retried_below(&self) -> u64 {
        self.inner.retried_below.load(Ordering::Relaxed)
    }

    /// Failures this layer gave up on and marked "do not retry" for the layers
    /// above (see
    /// [`RetryPolicy::with_retry_at_one_layer`](crate::RetryPolicy::with_retry_at_one_layer)).
    pub fn marked(&self) -> u64 {
        self.inner.marked.load(Ordering::Relaxed)
    }

    /// Retryable failures not retried because the request body outgrew its
    /// replay limit — the call's ([`RetryPolicy::with_replay_limit`]) or the
    /// layer's for all calls in flight
    /// ([`RetryLayer::with_replay_memory`](crate::RetryLayer::with_replay_memory)) —
    /// so no copy was left to send again.
    ///
    /// [`RetryPolicy::with_replay_limit`]: crate::RetryPolicy::with_replay_limit
    pub fn body_too_large(&self) -> u64 {
        self.inner.body_too_large.load(Ordering::Relaxed)
    }

    /// Counts one more drain in progress, unless `max` already are.
    pub(crate) fn start_drain(&self, max: u64) -> bool {
        self.inner
            .draining
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then(|| n + 1)
            })
            .is_ok()
    }

    pub(crate) fn end_drain(&self) {
        self.inner.draining.fetch_sub(1, Ordering::Relaxed);
    }

    /// Abandoned attempts being drained now: attempts a hedged call no
    /// longer needs, or that its per-attempt timeout cut, read to their end
    /// in a task of their own rather than reset (see
    /// [`HedgePolicy`](crate::HedgePolicy) and
    /// [`RetryPolicy::with_attempt_timeout`](crate::RetryPolicy::with_attempt_timeout)).
    pub fn draining(&self) -> u64 {
        self.inner.draining.load(Ordering::Relaxed)
    }

    /// Abandoned attempts read to their end: their streams ended with no
    /// reset.
    pub fn drained(&self) -> u64 {
        self.inner.drained.load(Ordering::Relaxed)
    }

    /// Drains that ran into a bound (the call's deadline, else 10 s; 64 KiB
    /// of response body) and so reset their streams after all.
    pub fn drain_cut(&self) -> u64 {
        self.inner.drain_cut.load(Ordering::Relaxed)
    }

    /// Abandoned attempts reset at once instead of drained: 1,024 were
    /// already draining through this layer, or there was no tokio runtime to
    /// drain on.
    pub fn drain_refused(&self) -> u64 {
        self.inner.drain_refused.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for RetryMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryMetrics")
            .field("attempts", &self.attempts())
            .field("retries", &self.retries())
            .field("hedges", &self.hedges())
            .field("hedges_capped", &self.hedges_capped())
            .field("refused_by_budget", &self.refused_by_budget())
            .field("refused_by_deadline", &self.refused_by_deadline())
            .field("retried_below", &self.retried_below())
            .field("marked", &self.marked())
            .field("body_too_large", &self.body_too_large())
            .field("draining", &self.draining())
            .field("drained", &self.drained())
            .field("drain_cut", &self.drain_cut())
            .field("drain_refused", &self.drain_refused())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_living_threads_stripe_is_not_given_to_another_thread() {
        let (stay, stop) = std::sync::mpsc::channel::<()>();
        let (told, stripe) = std::sync::mpsc::channel();
        let living = std::thread::spawn(move || {
            told.send(thread_stripe()).unwrap();
            stop.recv().unwrap();
        });
        let held = stripe.recv().unwrap();
        // Threads that make a call each and end, one after the other: each
        // takes a stripe and gives it back, and none takes the living one's.
        let others: Vec<usize> = (0..4 * STRIPES)
            .map(|_| std::thread::spawn(thread_stripe).join().unwrap())
            .collect();
        stay.send(()).unwrap();
        living.join().unwrap();
        assert!(!others.contains(&held), "{held} given again: {others:?}");
        assert!(others.iter().all(|&at| at < STRIPES));
    }

    #[test]
    fn a_call_counted_while_its_thread_ends_takes_a_stripe_all_the_same() {
        struct AtEnd(std::sync::mpsc::Sender<usize>);
        impl Drop for AtEnd {
            fn drop(&mut self) {
                let _ = self.0.send(thread_stripe());
            }
        }
        thread_local! {
            static AT_END: std::cell::RefCell<Option<AtEnd>> = const { std::cell::RefCell::new(None) };
        }
        let (tell, told) = std::sync::mpsc::channel();
        for first in [false, true] {
            let tell = tell.clone();
            std::thread::spawn(move || {
                // Before or after the thread took its stripe.
                if first {
                    thread_stripe();
                }
                AT_END.with(|at_end| *at_end.borrow_mut() = Some(AtEnd(tell)));
            })
            .join()
            .unwrap();
        }
        drop(tell);
        let stripes: Vec<usize> = told.iter().collect();
        assert_eq!(stripes.len(), 2);
        assert!(stripes.iter().all(|&at| at < STRIPES), "{stripes:?}");
    }

    #[test]
    fn a_thread_sharing_a_stripe_takes_one_of_its_own_once_one_is_free() {
        std::thread::spawn(|| {
            // As if its first call came while every stripe was held.
            STRIPE.with(|stripe| stripe.set(STRIPES + 3));
            let at = thread_stripe();
            assert!(at < STRIPES);
            assert_eq!(STRIPE.with(Cell::get), at, "held from now on");
            assert_ne!(HELD.load(Ordering::Relaxed) & 1 << at, 0);
            assert_eq!(thread_stripe(), at);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn calls_made_once_the_stripe_is_given_back_count_in_stripes_shared_in_turn() {
        struct AtEnd(std::sync::mpsc::Sender<(usize, usize)>);
        impl Drop for AtEnd {
            fn drop(&mut self) {
                // Registered before the thread's first call, so dropped
                // after the stripe's holder.
                let _ = self.0.send((STRIPE.with(Cell::get), thread_stripe()));
            }
        }
        thread_local! {
            static AT_END: std::cell::RefCell<Option<AtEnd>> = const { std::cell::RefCell::new(None) };
        }
        let (tell, told) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            AT_END.with(|at_end| *at_end.borrow_mut() = Some(AtEnd(tell)));
            thread_stripe();
        })
        .join()
        .unwrap();
        let (cell, at) = told.recv().unwrap();
        assert_eq!(cell, ENDED, "the stripe given back is not counted in");
        assert!(at < STRIPES);
    }
}
