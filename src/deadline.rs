//! The `grpc-timeout` header: reading a call's deadline and writing what is left.
//!
//! The wire format (gRPC over HTTP/2) is at most eight ASCII digits followed by
//! a unit: `H` hours, `M` minutes, `S` seconds, `m` milliseconds, `u`
//! microseconds, `n` nanoseconds.

use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use tokio::time::{Instant, Sleep};

pub(crate) const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// The largest number the header may carry.
const MAX_DIGITS_VALUE: u64 = 99_999_999;

/// An hour in nanoseconds.
const HOUR_NANOS: u64 = 3_600 * 1_000_000_000;

/// Units from finest to coarsest, with their length in nanoseconds.
const UNITS: [(u8, u64); 6] = [
    (b'n', 1),
    (b'u', 1_000),
    (b'm', 1_000_000),
    (b'S', 1_000_000_000),
    (b'M', 60 * 1_000_000_000),
    (b'H', HOUR_NANOS),
];

/// Passes the time a served call has on to a call its handler makes for it:
/// the deadline its caller sent (`grpc-timeout`) and, if its caller's retry
/// layer said one, when that caller stops waiting for this attempt
/// ([`ATTEMPT_TIMEOUT`](crate::marks::ATTEMPT_TIMEOUT)). A retry layer on the onward call then fits its
/// retries in that time, and leaves a retry after it to the caller, so that
/// stacked services with attempt timeouts retry at one layer.
///
/// A value not in `grpc-timeout`'s format is not passed on. The time the
/// handler spent before the onward call is not taken off; call this as the
/// handler starts, or set a shorter timeout on the onward call.
///
/// ```
/// use tonic::Request;
///
/// // What a handler is served (tonic puts the caller's headers in its
/// // metadata), and the request it makes for it.
/// let mut served = Request::new(());
/// served.metadata_mut().insert("grpc-timeout", "500m".parse().unwrap());
/// served.metadata_mut().insert("x-attempt-timeout", "150m".parse().unwrap());
/// let mut onward = Request::new(());
/// tonic_retry::forward_deadline(&served, &mut onward);
/// assert_eq!(onward.metadata().get("grpc-timeout").unwrap(), "500m");
/// assert_eq!(onward.metadata().get("x-attempt-timeout").unwrap(), "150m");
/// ```
pub fn forward_deadline<T, U>(served: &tonic::Request<T>, onward: &mut tonic::Request<U>) {
    for name in ["grpc-timeout", "x-attempt-timeout"] {
        if let Some(value) = served.metadata().get(name)
            && parse_grpc_timeout(value.as_ref()).is_some()
        {
            onward.metadata_mut().insert(name, value.clone());
        }
    }
}

/// A timer for a limit at `at`.
///
/// tokio fires it on the first millisecond tick at or after `at`, so the limit
/// is enforced to that resolution: up to a millisecond after `at`, never
/// before — an answer that arrives in time always wins over the cut.
pub(crate) fn timer_at(at: Instant) -> Sleep {
    tokio::time::sleep_until(at)
}

/// Parses a `grpc-timeout` value; `None` if it is not in the wire format.
pub(crate) fn parse_grpc_timeout(bytes: &[u8]) -> Option<Duration> {
    let (&unit, digits) = bytes.split_last()?;
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    // One pass: each byte checked as it is read (at most 8 digits: no
    // overflow in any unit below).
    let mut amount = 0u64;
    for &byte in digits {
        let digit = byte.wrapping_sub(b'0');
        if digit > 9 {
            return None;
        }
        amount = amount * 10 + u64::from(digit);
    }
    Some(match unit {
        b'H' => Duration::from_secs(amount * 3_600),
        b'M' => Duration::from_secs(amount * 60),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// Formats `timeout` for the `grpc-timeout` header, in the finest unit whose
/// count fits eight digits.
///
/// The count is rounded *up*, so a peer enforcing the header never gives up
/// before the layer's own deadline does: the layer's timer fires first and the
/// caller sees `DEADLINE_EXCEEDED` rather than the peer's cancellation.
pub(crate) fn format_grpc_timeout(timeout: Duration) -> HeaderValue {
    let mut value = format_repeating(timeout);
    // The time left differs on every attempt; keep it out of HPACK's dynamic
    // table, where it would only evict the headers that repeat.
    value.set_sensitive(true);
    value
}

/// A timeout set on a policy, with its `grpc-timeout` value made once.
///
/// A first attempt sent at once says the policy's timeout (see
/// `FirstTimeout`); the value is made when the policy is, so that a call
/// neither formats nor allocates it.
#[derive(Clone)]
pub(crate) struct PolicyTimeout {
    pub(crate) duration: Duration,
    /// The value over `'static` bytes, so that the clone each call makes
    /// writes nothing that another thread's clones write too (a shared
    /// buffer's would write its reference count); none once [`KEPT_TIMEOUTS`]
    /// values are kept, and then each call formats its own.
    header: Option<HeaderValue>,
}

impl PolicyTimeout {
    pub(crate) fn new(duration: Duration) -> Self {
        Self {
            duration,
            header: kept(duration),
        }
    }

    /// The `grpc-timeout` saying this timeout, not sensitive: it is the same
    /// on every call, so HPACK may index it, and then sends it as one byte.
    pub(crate) fn header(&self) -> HeaderValue {
        match &self.header {
            Some(value) => value.clone(),
            None => format_repeating(self.duration),
        }
    }
}

impl fmt::Debug for PolicyTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.duration.fmt(f)
    }
}

/// How many policy timeouts' values the process keeps: a few bytes each,
/// kept for its life, so a process making policies with ever new timeouts
/// keeps no more than this.
const KEPT_TIMEOUTS: usize = 64;

/// The kept value of `duration`'s `grpc-timeout`: made, and kept, the first
/// time a policy sets that timeout.
fn kept(duration: Duration) -> Option<HeaderValue> {
    static KEPT: Kept = Mutex::new(Vec::new());
    kept_in(&KEPT, duration)
}

/// The values kept, with the timeouts they say.
type Kept = Mutex<Vec<(Duration, HeaderValue)>>;

/// [`kept`], from and into `list`.
fn kept_in(list: &Kept, duration: Duration) -> Option<HeaderValue> {
    // The list is only ever pushed to whole; a panic elsewhere leaves it whole.
    let mut kept = list.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, value)) = kept.iter().find(|(kept, _)| *kept == duration) {
        return Some(value.clone());
    }
    if kept.len() >= KEPT_TIMEOUTS {
        return None;
    }
    let text: &'static [u8] = Box::leak(format_repeating(duration).as_bytes().into());
    let value = HeaderValue::from_maybe_shared(Bytes::from_static(text)).ok()?;
    kept.push((duration, value.clone()));
    Some(value)
}

/// [`format_grpc_timeout`] for a value sent again and again (a policy's
/// timeout): HPACK may index it, and then sends it as one byte.
pub(crate) fn format_repeating(timeout: Duration) -> HeaderValue {
    // NOTE: in 64 bits: a 128-bit division is a library call, made once per
    // unit tried.
    let nanos = timeout.as_nanos();
    let (unit, count) = match u64::try_from(nanos) {
        Ok(nanos) => UNITS
            .iter()
            .map(|&(unit, len)| (unit, nanos.div_ceil(len)))
            .find(|&(_, count)| count <= MAX_DIGITS_VALUE)
            .unwrap_or((b'H', MAX_DIGITS_VALUE)),
        // Past 2^64 nanoseconds (some 584 years) only hours can fit; past
        // 99,999,999 hours (over 11,000 years), say the most we can.
        Err(_) => {
            let hours = nanos.div_ceil(u128::from(HOUR_NANOS));
            let hours = u64::try_from(hours).unwrap_or(MAX_DIGITS_VALUE);
            (b'H', hours.min(MAX_DIGITS_VALUE))
        }
    };
    let mut rest = count;
    let mut buf = [0u8; 9];
    let mut at = buf.len() - 1;
    buf[at] = unit;
    loop {
        at -= 1;
        buf[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    HeaderValue::from_bytes(&buf[at..]).expect("digits and a unit letter are a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(s: &str) -> Option<Duration> {
        parse_grpc_timeout(HeaderValue::from_str(s).unwrap().as_bytes())
    }

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse("800m"), Some(Duration::from_millis(800)));
        assert_eq!(parse("5u"), Some(Duration::from_micros(5)));
        assert_eq!(parse("99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(parse("0m"), Some(Duration::ZERO));
        assert_eq!(
            parse("99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
    }

    #[test]
    fn rejects_what_is_not_the_wire_format() {
        for bad in [
            "",
            "m",
            "100",
            "100x",
            "123456789m",
            "-1m",
            "1.5S",
            " 1S",
            "1 S",
            "1s",
            "+1m",
            // The bytes either side of the digits.
            "1/S",
            "1:S",
        ] {
            assert_eq!(parse(bad), None, "{bad:?} should not parse");
        }
        let non_utf8 = HeaderValue::from_bytes(&[b'1', 0xff]).unwrap();
        assert_eq!(parse_grpc_timeout(non_utf8.as_bytes()), None);
    }

    #[test]
    fn formats_in_the_finest_unit_that_fits() {
        let f = |d: Duration| format_grpc_timeout(d).to_str().unwrap().to_owned();
        assert_eq!(f(Duration::ZERO), "0n");
        assert_eq!(f(Duration::from_nanos(99_999_999)), "99999999n");
        assert_eq!(f(Duration::from_millis(800)), "800000u");
        assert_eq!(
            f(Duration::from_nanos(123_456_789)),
            "123457u",
            "rounded up"
        );
        assert_eq!(f(Duration::from_secs(100)), "100000m");
        assert_eq!(f(Duration::from_secs(86_400 * 365)), "31536000S");
        assert_eq!(f(Duration::MAX), "99999999H");
    }

    #[test]
    fn a_policys_timeout_is_said_by_one_kept_value_until_the_list_is_full() {
        // A list of the test's own: the process's is shared by every test.
        let list = Kept::new(Vec::new());
        let second = |n: u64| Duration::from_secs(n);
        let first = kept_in(&list, second(0)).expect("room in the list");
        let again = kept_in(&list, second(0)).expect("kept");
        assert_eq!(first, format_repeating(second(0)));
        assert!(!first.is_sensitive(), "it repeats: HPACK may index it");
        // One value for both, over the same static bytes.
        assert_eq!(first.as_bytes().as_ptr(), again.as_bytes().as_ptr());
        // Past the limit nothing more is kept.
        for n in 1..KEPT_TIMEOUTS as u64 {
            assert_eq!(kept_in(&list, second(n)), Some(format_repeating(second(n))));
        }
        assert_eq!(kept_in(&list, second(KEPT_TIMEOUTS as u64)), None);
        // What was kept stays kept.
        let still = kept_in(&list, second(0)).expect("kept");
        assert_eq!(still.as_bytes().as_ptr(), first.as_bytes().as_ptr());
        // A policy's timeout says the right value either way.
        for (duration, header) in [(second(3), kept_in(&list, second(3))), (second(100), None)] {
            let timeout = PolicyTimeout { duration, header };
            assert_eq!(timeout.header(), format_repeating(duration));
            assert!(!timeout.header().is_sensitive());
        }
    }

    proptest! {
        #[test]
        fn round_trip_is_never_shorter_and_close(nanos in any::<u64>(), secs in 0u64..300_000_000_000) {
            for d in [Duration::from_nanos(nanos), Duration::new(secs, (nanos % 1_000_000_000) as u32)] {
                let v = format_grpc_timeout(d);
                prop_assert!(v.len() <= 9, "{:?} is longer than 8 digits and a unit", v);
                let back = parse_grpc_timeout(v.as_bytes()).expect("what we write, we read");
                prop_assert!(back >= d, "{:?} came back as {:?}", d, back);
                let slack = (d / 10_000).max(Duration::from_nanos(1));
                prop_assert!(back - d <= slack, "{:?} came back as {:?}", d, back);
            }
        }
    }
}
