//! A method's recent latencies, for a hedging delay that follows them.
//!
//! A sliding window of two halves, each a histogram of log-spaced buckets
//! (four a power of two, so a bucket spans at most 25 % of its lower end) of
//! atomic counts and sums: recording is two adds, lock-free, from any
//! thread. The percentile is the mean of the samples in its bucket, so a
//! method whose latencies sit together gets their value, not the bucket's
//! edge. The
//! older half is cleared as the window slides past it, so the percentile
//! reflects the last one to two half-windows. Reading a percentile scans the
//! buckets, so the delay is read from it at most every 10 ms (or sixteenth
//! of a half-window, if sooner) and kept in between; until the window holds
//! enough samples, it is read at every call.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use tokio::time::Instant;

/// Buckets per half: durations from 1 µs to about 2^40 µs (12 days).
const BUCKETS: usize = 160;

/// Buckets per power of two.
const STEPS: u32 = 4;

/// The longest a delay read from the window is kept before it is read again.
const REREAD: Duration = Duration::from_millis(10);

pub(crate) struct Latencies {
    /// When the window started; half-windows are counted from it.
    start: Instant,
    half: Duration,
    halves: [Half; 2],
    percentile: f64,
    floor: Duration,
    /// The fewest samples the window must hold before its percentile is
    /// trusted over the configured delay.
    min_samples: u64,
    /// The delay last read, in µs, and the half-window tick it was read at
    /// (`u64::MAX` before the first).
    cached: AtomicU64,
    cached_at: AtomicU64,
}

struct Half {
    /// The half-window tick this half counts; a half whose tick has passed
    /// is cleared before it counts again.
    tick: AtomicU64,
    counts: [AtomicU64; BUCKETS],
    /// The sum of each bucket's samples, in µs.
    sums: [AtomicU64; BUCKETS],
}

impl Half {
    fn new() -> Self {
        Self {
            tick: AtomicU64::new(0),
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sums: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// The bucket of `micros`.
fn bucket(micros: u64) -> usize {
    // Below 4 µs a bucket each (their steps would be under a microsecond).
    if micros < 4 {
        return micros as usize;
    }
    let log = 63 - u64::from(micros.leading_zeros());
    // The fraction above the power of two, in `STEPS` steps.
    let step = (micros >> (log - u64::from(STEPS.ilog2()))) & u64::from(STEPS - 1);
    ((log * u64::from(STEPS) + step) as usize).min(BUCKETS - 1)
}

/// The largest duration, in µs, in bucket `i`.
fn upper(i: usize) -> u64 {
    if i < 4 {
        return (i as u64).max(1);
    }
    let log = (i as u32) / STEPS;
    let step = (i as u32) % STEPS;
    let base = 1u64 << log.min(62);
    let upper = base.saturating_add(base / u64::from(STEPS) * u64::from(step + 1));
    upper.saturating_sub(1).max(1)
}

impl Latencies {
    pub(crate) fn new(
        window: Duration,
        percentile: f64,
        floor: Duration,
        min_samples: u64,
    ) -> Self {
        Self {
            start: Instant::now(),
            half: (window / 2).max(Duration::from_millis(1)),
            halves: [Half::new(), Half::new()],
            percentile,
            floor,
            min_samples,
            cached: AtomicU64::new(0),
            cached_at: AtomicU64::new(u64::MAX),
        }
    }

    /// Empty latencies with the same settings.
    pub(crate) fn fresh(&self) -> Self {
        Self::new(self.half * 2, self.percentile, self.floor, self.min_samples)
    }

    /// The half-window tick of `now`.
    fn tick(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.start);
        (elapsed.as_nanos() / self.half.as_nanos()) as u64
    }

    /// The half that counts `tick`, cleared first if it last counted an
    /// earlier one.
    fn half_for(&self, tick: u64) -> &Half {
        let half = &self.halves[(tick % 2) as usize];
        let seen = half.tick.load(Ordering::Relaxed);
        if seen != tick
            && half
                .tick
                .compare_exchange(seen, tick, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            // NOTE: a sample recorded by another thread between the swap and
            // the clearing may be lost: a percentile is an estimate.
            for (count, sum) in half.counts.iter().zip(&half.sums) {
                count.store(0, Ordering::Relaxed);
                sum.store(0, Ordering::Relaxed);
            }
        }
        half
    }

    /// Records one successful attempt's latency.
    pub(crate) fn record(&self, latency: Duration) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let half = self.half_for(self.tick(Instant::now()));
        let i = bucket(micros);
        half.counts[i].fetch_add(1, Ordering::Relaxed);
        // NOTE: the last bucket holds everything past 2^40 µs; its samples
        // are summed as that, so no sum can wrap.
        half.sums[i].fetch_add(micros.min(upper(i)), Ordering::Relaxed);
    }

    /// The hedging delay: the percentile of the window's latencies, not
    /// below the floor; `configured` until the window holds enough samples.
    pub(crate) fn delay(&self, configured: Duration) -> Duration {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.start).as_nanos();
        // Read afresh every sixteenth of a half-window, or every 10 ms if
        // that is sooner; and at every call until the window holds enough
        // samples, so that the first estimate is used as soon as it exists.
        let period = (self.half.as_nanos() / 16).clamp(1, REREAD.as_nanos());
        let at = (elapsed / period) as u64;
        let cached = self.cached.load(Ordering::Relaxed);
        if cached != 0 && self.cached_at.load(Ordering::Relaxed) == at {
            return Duration::from_micros(cached);
        }
        let micros = self.percentile_micros(self.tick(now));
        self.cached.store(micros.unwrap_or(0), Ordering::Relaxed);
        self.cached_at.store(at, Ordering::Relaxed);
        match micros {
            Some(micros) => Duration::from_micros(micros),
            None => configured,
        }
    }

    /// The percentile over the halves counting `tick` and the one before,
    /// floored; `None` with too few samples.
    fn percentile_micros(&self, tick: u64) -> Option<u64> {
        let mut counts = [0u64; BUCKETS];
        let mut sums = [0u64; BUCKETS];
        for half in &self.halves {
            let seen = half.tick.load(Ordering::Relaxed);
            if seen == tick || seen.saturating_add(1) == tick {
                for (total, count) in counts.iter_mut().zip(&half.counts) {
                    *total += count.load(Ordering::Relaxed);
                }
                for (total, sum) in sums.iter_mut().zip(&half.sums) {
                    *total = total.saturating_add(sum.load(Ordering::Relaxed));
                }
            }
        }
        let total: u64 = counts.iter().sum();
        if total < self.min_samples.max(1) {
            return None;
        }
        let rank = ((total as f64) * self.percentile).ceil() as u64;
        let mut seen = 0;
        let index = counts
            .iter()
            .position(|&count| {
                seen += count;
                seen >= rank.max(1)
            })
            .unwrap_or(BUCKETS - 1);
        // The mean of the bucket's samples, kept within the bucket (a sample
        // counted but not yet summed, by another thread, could move it out).
        let top = upper(index);
        let lower = index
            .checked_sub(1)
            .map_or(0, |i| upper(i).saturating_add(1));
        let mean = sums[index]
            .checked_div(counts[index])
            .unwrap_or(top)
            .clamp(lower.min(top), top);
        let floor = u64::try_from(self.floor.as_micros()).unwrap_or(u64::MAX);
        Some(mean.max(floor).max(1))
    }
}

/// The most methods one policy keeps latencies of apart; the methods past
/// it share one window.
const MAX_METHODS: usize = 256;

/// One window of latencies per method (a policy given as a service's or the
/// default one serves many, and each has latencies of its own).
pub(crate) struct PerMethod {
    /// The settings every method's window is made with.
    settings: Latencies,
    methods: RwLock<HashMap<Box<str>, Arc<Latencies>>>,
    /// For the methods past [`MAX_METHODS`].
    others: Arc<Latencies>,
}

impl PerMethod {
    pub(crate) fn new(settings: Latencies) -> Self {
        Self {
            others: Arc::new(settings.fresh()),
            settings,
            methods: RwLock::default(),
        }
    }

    /// Empty windows with the same settings.
    pub(crate) fn fresh(&self) -> Self {
        Self::new(self.settings.fresh())
    }

    /// The window of the method at `path` (`/package.Service/Method`).
    pub(crate) fn of(&self, path: &str) -> Arc<Latencies> {
        let read = self.methods.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(latencies) = read.get(path) {
            return Arc::clone(latencies);
        }
        let full = read.len() >= MAX_METHODS;
        drop(read);
        if full {
            return Arc::clone(&self.others);
        }
        let mut write = self.methods.write().unwrap_or_else(PoisonError::into_inner);
        if write.len() >= MAX_METHODS {
            return Arc::clone(&self.others);
        }
        let latencies = write
            .entry(path.into())
            .or_insert_with(|| Arc::new(self.settings.fresh()));
        Arc::clone(latencies)
    }
}

impl std::fmt::Debug for PerMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.settings.fmt(f)
    }
}

impl std::fmt::Debug for Latencies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Latencies")
            .field("window", &(self.half * 2))
            .field("percentile", &self.percentile)
            .field("floor", &self.floor)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_ordered_and_bound_their_values() {
        let mut last = 0;
        for micros in [
            1u64,
            2,
            3,
            4,
            5,
            7,
            8,
            100,
            1_000,
            1_234,
            50_000,
            1 << 40,
            u64::MAX,
        ] {
            let i = bucket(micros);
            assert!(i >= last, "{micros}");
            last = i;
            if i < BUCKETS - 1 {
                assert!(
                    upper(i) >= micros,
                    "bucket {i} bounds {micros}: {}",
                    upper(i)
                );
                // Within a fifth above the value.
                assert!(
                    upper(i) as f64 <= micros as f64 * 1.26 + 1.0,
                    "{micros} {}",
                    upper(i)
                );
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_configured_delay_until_enough_samples_then_the_percentile() {
        let l = Latencies::new(Duration::from_secs(10), 0.9, Duration::from_millis(2), 20);
        let configured = Duration::from_millis(30);
        for _ in 0..10 {
            l.record(Duration::from_millis(1));
        }
        assert_eq!(l.delay(configured), configured, "10 samples: too few");
        for _ in 0..85 {
            l.record(Duration::from_millis(1));
        }
        for _ in 0..5 {
            l.record(Duration::from_millis(50));
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        // p90 of 95 × 1 ms and 5 × 50 ms is about 1 ms; the floor is 2 ms.
        assert_eq!(l.delay(configured), Duration::from_millis(2));
        for _ in 0..100 {
            l.record(Duration::from_millis(10));
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        let d = l.delay(configured);
        assert!(
            d >= Duration::from_millis(10) && d <= Duration::from_millis(12),
            "{d:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_percentile_is_its_samples_value_not_its_buckets_edge() {
        // 8.2 ms lies in the bucket 8,192–10,239 µs.
        let l = Latencies::new(Duration::from_secs(10), 0.95, Duration::ZERO, 10);
        for _ in 0..150 {
            l.record(Duration::from_micros(8_200));
        }
        assert_eq!(
            l.delay(Duration::from_millis(50)),
            Duration::from_micros(8_200)
        );
        // Spread over the bucket, the delay is their mean.
        let l = Latencies::new(Duration::from_secs(10), 0.5, Duration::ZERO, 10);
        for micros in [8_200, 8_400, 8_600, 8_800] {
            for _ in 0..10 {
                l.record(Duration::from_micros(micros));
            }
        }
        assert_eq!(
            l.delay(Duration::from_millis(50)),
            Duration::from_micros(8_500)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_smallest_and_largest_latencies_read_back() {
        for (micros, expected) in [
            (0, 1),
            (1, 1),
            (2, 2),
            (3, 3),
            (4, 4),
            (5, 5),
            (7, 7),
            (u64::MAX, upper(BUCKETS - 1)),
        ] {
            let l = Latencies::new(Duration::from_secs(10), 0.99, Duration::ZERO, 1);
            l.record(Duration::from_micros(micros));
            l.record(Duration::from_micros(micros));
            assert_eq!(
                l.delay(Duration::from_millis(50)),
                Duration::from_micros(expected),
                "{micros} µs"
            );
        }
        let l = Latencies::new(Duration::from_secs(10), 0.5, Duration::ZERO, 1);
        l.record(Duration::MAX);
        assert!(l.delay(Duration::from_millis(50)) >= Duration::from_secs(1 << 20));
    }

    #[tokio::test(start_paused = true)]
    async fn old_samples_leave_the_window() {
        let l = Latencies::new(Duration::from_secs(2), 0.5, Duration::ZERO, 10);
        for _ in 0..100 {
            l.record(Duration::from_millis(100));
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        let d = l.delay(Duration::from_millis(5));
        assert!(
            d >= Duration::from_millis(100) && d < Duration::from_millis(120),
            "{d:?}"
        );
        // Two half-windows later, only the new samples count.
        tokio::time::advance(Duration::from_secs(2)).await;
        for _ in 0..100 {
            l.record(Duration::from_millis(3));
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        let d = l.delay(Duration::from_millis(5));
        assert!(
            d >= Duration::from_millis(3) && d < Duration::from_millis(4),
            "{d:?}"
        );
    }
}
