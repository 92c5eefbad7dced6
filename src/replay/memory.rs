//! The layer-wide account of replay memory, kept in stripes, and the chunks a copy keeps.

use super::*;

/// Which limit a body outgrew.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cap {
    /// The call's own replay limit.
    Call,
    /// The layer's memory for the copies of all its calls in flight.
    Layer,
}

impl Cap {
    /// What a clone that needs a copy dropped for this limit fails with.
    pub(super) fn error(self) -> ReplayError {
        match self {
            Cap::Call => ReplayError::Capped,
            Cap::Layer => ReplayError::LayerFull,
        }
    }
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
    pub(super) granted: AtomicUsize,
    pub(super) limit: AtomicUsize,
    /// Taken to grant bytes, and to refuse a copy.
    pub(super) granting: Mutex<()>,
    /// Per stripe: bytes granted and held by no copy.
    pub(super) spare: [Padded<AtomicUsize>; STRIPES],
}

impl ReplayMemory {
    /// grpc-java's retry buffer size.
    pub(crate) const DEFAULT_LIMIT: usize = 16 << 20;

    /// The most a stripe is granted ahead: 64 KiB at the default limit.
    pub(super) const MAX_GRAIN: usize = 64 << 10;

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
    pub(super) fn grain(limit: usize) -> usize {
        (limit / (STRIPES * 16)).min(Self::MAX_GRAIN)
    }

    /// Takes `bytes` for a copy counted in `stripe`, if they fit; never
    /// waits for a copy to be given back.
    #[inline]
    pub(super) fn try_reserve(&self, stripe: usize, bytes: usize) -> bool {
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
    pub(super) fn reserve_granting(&self, spare: &AtomicUsize, bytes: usize) -> bool {
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
    pub(super) fn grant(&self, bytes: usize, limit: usize) -> bool {
        self.granted
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |granted| {
                granted.checked_add(bytes).filter(|&total| total <= limit)
            })
            .is_ok()
    }

    /// Gives back `bytes` a copy counted in `stripe` held: to the stripe,
    /// which gives the layer back what it holds past twice its grain.
    #[inline]
    pub(super) fn release(&self, stripe: usize, bytes: usize) {
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
    pub(super) fn release_spare(&self, spare: &AtomicUsize, grain: usize) {
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
    pub(super) fn try_reserve(&self, bytes: usize) -> bool {
        self.memory().try_reserve(thread_stripe(), bytes)
    }

    /// Gives back `bytes` taken in the layer's memory, to the calling
    /// thread's stripe.
    #[inline]
    pub(super) fn release(&self, bytes: usize) {
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
pub(super) struct Kept {
    pub(super) first: Option<Bytes>,
    pub(super) rest: Vec<Bytes>,
}

impl Kept {
    pub(super) fn push(&mut self, chunk: Bytes) {
        if self.first.is_none() {
            self.first = Some(chunk);
        } else {
            self.rest.push(chunk);
        }
    }

    /// How many chunks are kept (chunks 0 to `len - 1`).
    pub(super) fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.len()
    }

    /// Chunk `i`; callers only ask for chunks that were kept.
    pub(super) fn get(&self, i: usize) -> &Bytes {
        match (i, &self.first) {
            (0, Some(first)) => first,
            _ => &self.rest[i - 1],
        }
    }

    /// Bytes kept from chunk `i` on.
    pub(super) fn bytes_from(&self, i: usize) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
