//! Counts kept in stripes, one a thread: a count every call writes, kept
//! as one, would be written by every thread on every call.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// How many stripes a count is kept in.
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

/// Gives a thread's stripe back when the thread ends. What a thread's
/// `STRIPE` holds: below [`STRIPES`], a stripe it holds alone; from
/// [`STRIPES`] on, a stripe shared in turn (that number modulo [`STRIPES`])
/// until one is free; or [`UNSET`] or [`ENDED`].
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

/// A value alone on its cache lines (x86-64 fetches them in pairs): one
/// stripe of a count.
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

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
    fn a_first_call_made_while_its_thread_ends_holds_a_stripe_it_gives_back() {
        struct AtEnd(std::sync::mpsc::Sender<(usize, usize, usize)>);
        impl Drop for AtEnd {
            fn drop(&mut self) {
                let at = thread_stripe();
                let cell = STRIPE.with(Cell::get);
                let held = HOLDER.try_with(|holder| holder.0.get()).unwrap_or(UNSET);
                let _ = self.0.send((at, cell, held));
            }
        }
        thread_local! {
            static AT_END: std::cell::RefCell<Option<AtEnd>> = const { std::cell::RefCell::new(None) };
        }
        let (tell, told) = std::sync::mpsc::channel();
        // The thread's first call is made by a thread-local's destructor.
        std::thread::spawn(move || {
            AT_END.with(|at_end| *at_end.borrow_mut() = Some(AtEnd(tell)));
        })
        .join()
        .unwrap();
        let (at, cell, held) = told.recv().unwrap();
        assert!(at < STRIPES);
        assert_eq!(
            (cell, held),
            (at, at),
            "(the thread's cell, its holder): the stripe is its own, and given back at its end"
        );
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
