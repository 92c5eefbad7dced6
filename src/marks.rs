//! What every attempt carries so servers and balancers can tell attempts apart
//! (and tell them to be the same call): the idempotency key, the attempt count,
//! and the instances that already failed this call.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use http::{HeaderName, HeaderValue};

use crate::classify::{Pushback, pushback_value};
use crate::status::RETRY_PUSHBACK;

/// The request header carrying the call's idempotency key; a failed call's
/// status carries it back to the caller (see the
/// [crate docs](crate#what-the-answer-tells-the-caller)).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("x-idempotency-key");
/// The request header on attempt `n + 1` carrying `n` (gRPC A6); on the
/// answer of a call that took more than one attempt, the attempts before
/// the one that answered.
pub const PREVIOUS_ATTEMPTS: HeaderName = HeaderName::from_static("grpc-previous-rpc-attempts");
/// The request header naming, comma-separated, the instances that failed
/// earlier attempts of this call. One the caller set is not trusted by
/// default (see [`AlreadyTried`]).
pub const ALREADY_TRIED: HeaderName = HeaderName::from_static("x-already-tried");
/// The request header saying, in `grpc-timeout`'s format, when the caller
/// stops waiting for this attempt, where that is before the call's deadline
/// (see [`RetryPolicy::with_attempt_timeout`](crate::RetryPolicy::with_attempt_timeout)).
/// A retry layer below fits its own retries in that time;
/// [`forward_deadline`](crate::forward_deadline) passes it on through a
/// handler. Taken from any caller, as `grpc-timeout` is: it can only shorten
/// the time a call has, and one at or past the deadline, or unreadable, is
/// removed.
pub const ATTEMPT_TIMEOUT: HeaderName = HeaderName::from_static(ATTEMPT_TIMEOUT_NAME);
/// [`ATTEMPT_TIMEOUT`]'s name.
pub(crate) const ATTEMPT_TIMEOUT_NAME: &str = "x-attempt-timeout";
/// The default response header from which an answering instance's id is read.
pub const INSTANCE_ID: HeaderName = HeaderName::from_static("x-instance-id");

/// A fresh idempotency key: 128 random bits as 32 lowercase hex digits.
///
/// Keys are cut from a block of [`KEYS_PER_BLOCK`] made at once on each
/// thread: one allocation and one pass of the generator per block rather
/// than per call, and each key a reference into the block (the header is
/// cloned for every attempt, and a clone of it is a reference count). A block
/// is freed when the last call holding one of its keys ends.
pub(crate) fn new_idempotency_key() -> HeaderValue {
    let key = KEYS
        .try_with(|keys| {
            let mut keys = keys.borrow_mut();
            if keys.is_empty() {
                *keys = key_block();
            }
            keys.split_to(KEY_LEN)
        })
        // The thread is ending and its block is gone: a block of its own.
        .unwrap_or_else(|_| key_block().split_to(KEY_LEN));
    let mut key = HeaderValue::from_maybe_shared(key).expect("hex digits are a valid header value");
    // A value that never repeats must stay out of HPACK's dynamic table:
    // indexing it would evict the headers that do repeat and make every
    // request on the connection larger. "Sensitive" values are sent as
    // never-indexed literals.
    key.set_sensitive(true);
    key
}

/// The length of a key, in hex digits.
const KEY_LEN: usize = 32;

/// How many keys a thread makes at once (2 KiB of hex digits).
const KEYS_PER_BLOCK: usize = 64;

thread_local! {
    /// This thread's keys not yet handed out (empty: make a block).
    static KEYS: std::cell::RefCell<Bytes> = const { std::cell::RefCell::new(Bytes::new()) };
}

/// [`KEYS_PER_BLOCK`] keys of 128 bits each from the thread's
/// cryptographically seeded generator, as hex digits.
///
/// The block is made on the stack and moved into the one allocation
/// [`Bytes::from_owner`] makes for it, whose keys are then cut with a
/// reference count: a `Vec` given to `Bytes` would be a second allocation,
/// and its first cut a third (it is made shared then).
fn key_block() -> Bytes {
    use rand::Rng;

    let mut words = [0u64; KEYS_PER_BLOCK * KEY_LEN / 16];
    rand::rng().fill(&mut words[..]);
    let mut digits = [0u8; KEYS_PER_BLOCK * KEY_LEN];
    for (out, word) in digits.chunks_exact_mut(16).zip(words) {
        // Every nibble of the word becomes one digit, so all 64 random bits
        // are kept (in an order of no consequence: they are random).
        const LOW: u64 = 0x0f0f_0f0f_0f0f_0f0f;
        out[..8].copy_from_slice(&hex_digits(word & LOW));
        out[8..].copy_from_slice(&hex_digits((word >> 4) & LOW));
    }
    Bytes::from_owner(digits)
}

/// The lowercase hex digits of eight nibbles, one in each byte of
/// `nibbles` (each byte 0 to 15), eight at a time.
fn hex_digits(nibbles: u64) -> [u8; 8] {
    const ONES: u64 = 0x0101_0101_0101_0101;
    // 1 in each byte whose nibble is 10 or more; no byte carries into the
    // next (15 + 6 < 256, and 15 + '0' + 39 < 256).
    let letters = ((nibbles + 6 * ONES) >> 4) & ONES;
    let digits = nibbles + u64::from(b'0') * ONES + letters * u64::from(b'a' - b'0' - 10);
    digits.to_le_bytes()
}

/// The longest instance id, in bytes, that the already-tried mark carries;
/// longer ids are skipped.
pub const MAX_INSTANCE_ID_LEN: usize = 128;

/// The most instances the already-tried mark names; further ids are skipped.
pub const MAX_TRIED_INSTANCES: usize = 8;

/// Whether `id` can be named in the already-tried mark: 1 to
/// [`MAX_INSTANCE_ID_LEN`] bytes of visible ASCII, no comma.
pub(crate) fn is_valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_INSTANCE_ID_LEN
        && id.bytes().all(|b| b.is_ascii_graphic() && b != b',')
}

/// The instances that failed earlier attempts of this call.
///
/// Set as a request extension on every retry (and mirrored in the
/// [`x-already-tried`](ALREADY_TRIED) header for balancers in other processes),
/// so a balancer below the layer can send the retry elsewhere. The layer learns
/// instance ids from the response header named by
/// [`RetryPolicy::with_instance_header`](crate::RetryPolicy::with_instance_header),
/// or, for an attempt that got no response, from the balancer's
/// [`PickedInstance`] report. A mark the caller sets in process (this
/// extension) is merged with what the layer learns. An `x-already-tried`
/// header the caller set is removed before the first attempt, unless the
/// policy trusts it ([`RetryPolicy::with_callers_mark_trusted`](crate::RetryPolicy::with_callers_mark_trusted)):
/// a server forwarding its clients' metadata would otherwise let them steer
/// its calls.
///
/// The mark is bounded: an id is visible ASCII without commas, at most
/// [`MAX_INSTANCE_ID_LEN`] bytes, and at most [`MAX_TRIED_INSTANCES`] ids are
/// kept. Anything else is skipped, never an error.
///
/// ```
/// use tonic_retry::marks::AlreadyTried;
///
/// fn pick<'a>(endpoints: &'a [&'a str], req: &http::Request<()>) -> Option<&'a str> {
///     let tried = req.extensions().get::<AlreadyTried>();
///     endpoints
///         .iter()
///         .copied()
///         .find(|e| !tried.is_some_and(|t| t.contains(e)))
/// }
/// # let mut req = http::Request::new(());
/// # assert_eq!(pick(&["a", "b"], &req), Some("a"));
/// # let mut tried = AlreadyTried::default();
/// # tried.insert("a");
/// # req.extensions_mut().insert(tried);
/// # assert_eq!(pick(&["a", "b"], &req), Some("b"));
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AlreadyTried {
    ids: Vec<String>,
}

impl AlreadyTried {
    /// The ids named by an `x-already-tried` header value (comma-separated);
    /// ids that are invalid, repeated or over the bounds are skipped.
    pub fn from_header(value: &HeaderValue) -> Self {
        let mut tried = Self::default();
        tried.merge_header(value);
        tried
    }

    /// Whether `instance` failed an earlier attempt of this call.
    pub fn contains(&self, instance: &str) -> bool {
        self.ids.iter().any(|id| id == instance)
    }

    /// The instance ids, in the order they failed.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.ids.iter().map(String::as_str)
    }

    /// How many instances are named.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether no instance is named.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Names `instance` (surrounding whitespace trimmed). Returns whether it
    /// was added: an id that is empty, not visible ASCII, contains a comma, is
    /// longer than [`MAX_INSTANCE_ID_LEN`], is already named, or would exceed
    /// [`MAX_TRIED_INSTANCES`] is skipped.
    pub fn insert(&mut self, instance: &str) -> bool {
        let id = instance.trim();
        if !is_valid_id(id) || self.ids.len() >= MAX_TRIED_INSTANCES || self.contains(id) {
            return false;
        }
        self.ids.push(id.to_owned());
        true
    }

    /// Adds an instance this call just failed on, named by a header value
    /// (a response's `x-instance-id`, or a balancer's report), if it is a
    /// valid id. A full mark makes room by dropping its oldest id: the
    /// instance that failed last matters most to the next attempt.
    pub(crate) fn record(&mut self, id: &HeaderValue) -> bool {
        let Ok(id) = id.to_str() else {
            return false;
        };
        let id = id.trim();
        if self.ids.len() >= MAX_TRIED_INSTANCES && is_valid_id(id) && !self.contains(id) {
            self.ids.remove(0);
        }
        self.insert(id)
    }

    /// Adds the ids of an `x-already-tried` header value.
    pub(crate) fn merge_header(&mut self, value: &HeaderValue) {
        if let Ok(list) = value.to_str() {
            for id in list.split(',') {
                self.insert(id);
            }
        }
    }

    /// Adds every id of `other`.
    pub(crate) fn merge(&mut self, other: &AlreadyTried) {
        for id in other.iter() {
            self.insert(id);
        }
    }

    /// The header form: ids joined by `,`. Every id is visible ASCII, so the
    /// value is always valid.
    pub(crate) fn to_header(&self) -> Option<HeaderValue> {
        HeaderValue::try_from(self.ids.join(",")).ok()
    }
}

impl fmt::Debug for AlreadyTried {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(&self.ids).finish()
    }
}

/// Where a balancer below the layer reports the instance it sent an attempt
/// to, so that the layer learns it whatever the attempt's outcome — also when
/// the attempt got no response at all (cut by the per-attempt timeout, or a
/// transport error) and so carries no `x-instance-id`.
///
/// The layer puts one in the request extensions of every attempt (unless the
/// policy learns no instance ids: `with_instance_header(None)`); a balancer
/// that picks an endpoint calls [`set`](PickedInstance::set) on it. The
/// instance then counts as tried if the attempt fails, and the retry is marked
/// to go elsewhere. [`PreferUntried`](crate::balance::PreferUntried) does this.
///
/// ```
/// use http::HeaderValue;
/// use tonic_retry::marks::PickedInstance;
///
/// fn route<B>(req: &http::Request<B>, chosen: &'static str) {
///     if let Some(picked) = req.extensions().get::<PickedInstance>() {
///         picked.set(HeaderValue::from_static(chosen));
///     }
/// }
/// # let picked = PickedInstance::default();
/// # let mut req = http::Request::new(());
/// # req.extensions_mut().insert(picked.clone());
/// # route(&req, "b");
/// # assert_eq!(picked.get().unwrap(), "b");
/// ```
#[derive(Clone)]
pub struct PickedInstance {
    slot: Arc<dyn PickSlot>,
}

/// Where a report is kept. The layer's slot is part of the state every
/// attempt of the call already shares (its replayable body), so the report
/// costs no allocation of its own.
pub(crate) trait PickSlot: Send + Sync {
    fn set(&self, instance: HeaderValue);
    fn get(&self) -> Option<HeaderValue>;
}

impl PickSlot for Mutex<Option<HeaderValue>> {
    fn set(&self, instance: HeaderValue) {
        *lock(self) = Some(instance);
    }

    fn get(&self) -> Option<HeaderValue> {
        lock(self).clone()
    }
}

fn lock<T>(slot: &Mutex<T>) -> MutexGuard<'_, T> {
    // The slot holds a plain value; a panic elsewhere cannot leave it torn.
    slot.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Default for PickedInstance {
    /// A slot of its own, e.g. to test a balancer.
    fn default() -> Self {
        Self {
            slot: Arc::new(Mutex::new(None)),
        }
    }
}

impl PickedInstance {
    pub(crate) fn from_slot(slot: Arc<dyn PickSlot>) -> Self {
        Self { slot }
    }

    /// Reports the instance the attempt is sent to.
    pub fn set(&self, instance: HeaderValue) {
        self.slot.set(instance);
    }

    /// The instance reported for the current attempt, if any.
    pub fn get(&self) -> Option<HeaderValue> {
        self.slot.get()
    }
}

impl fmt::Debug for PickedInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PickedInstance").field(&self.get()).finish()
    }
}

/// The "do not retry" mark on a [`tonic::Status`]: retry at one layer, across
/// processes.
///
/// A [`RetryLayer`](crate::RetryLayer) that gives up on a retryable failure
/// after retrying (or because its budget or the deadline refused a retry)
/// hands the failure up with `grpc-retry-pushback-ms: -1`, gRPC A6's "do not
/// retry": every A6 client passes such a failure up without retrying it (see
/// [`RetryPolicy::with_retry_at_one_layer`](crate::RetryPolicy::with_retry_at_one_layer)).
///
/// In a tonic server that calls another service, the mark crosses the hop by
/// itself when the handler returns the downstream `Status` — `?` does — since
/// tonic writes a `Status`'s metadata into the response. A handler that
/// answers with a status of its own keeps the mark with one call:
///
/// ```
/// use tonic::Status;
/// use tonic_retry::marks::RetryMarkExt;
///
/// // What the next hop's call returned: a failure its retry layer gave up on.
/// # let mut downstream = Status::unavailable("inventory is down");
/// # downstream
/// #     .metadata_mut()
/// #     .insert("grpc-retry-pushback-ms", "-1".parse().unwrap());
/// assert!(downstream.retried_below());
///
/// // In the handler: `.map_err(|e| Status::unavailable("...").keep_retry_mark(&e))?`
/// let answer = Status::unavailable("cannot price the book").keep_retry_mark(&downstream);
/// assert!(answer.retried_below());
/// ```
pub trait RetryMarkExt {
    /// Whether this status carries the "do not retry" mark: a negative
    /// `grpc-retry-pushback-ms`.
    fn retried_below(&self) -> bool;

    /// This status, carrying `from`'s "do not retry" mark if `from` has one.
    #[must_use]
    fn keep_retry_mark(self, from: &tonic::Status) -> Self;
}

impl RetryMarkExt for tonic::Status {
    fn retried_below(&self) -> bool {
        self.metadata()
            .get(RETRY_PUSHBACK)
            .is_some_and(|v| matches!(pushback_value(v.as_bytes()), Pushback::Refused))
    }

    fn keep_retry_mark(mut self, from: &tonic::Status) -> Self {
        if from.retried_below() {
            self.metadata_mut().insert(
                RETRY_PUSHBACK,
                tonic::metadata::MetadataValue::from_static("-1"),
            );
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_128_bit_hex_and_differ() {
        let a = new_idempotency_key();
        let b = new_idempotency_key();
        assert_eq!(a.len(), 32);
        assert!(a.to_str().unwrap().bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        assert!(a.is_sensitive());
    }

    #[test]
    fn every_nibble_has_its_digit() {
        let nibbles = u64::from_le_bytes([0, 1, 9, 10, 11, 14, 15, 5]);
        assert_eq!(&hex_digits(nibbles), b"019abef5");
        for n in 0..16u64 {
            let digit = hex_digits(n * 0x0101_0101_0101_0101);
            let want = b"0123456789abcdef"[n as usize];
            assert_eq!(digit, [want; 8], "nibble {n}");
        }
    }

    #[test]
    fn keys_across_blocks_are_all_distinct_lowercase_hex() {
        // Several blocks' worth, on two threads: no key repeats, and every
        // digit is used (a broken digit table would show as a missing one).
        let on_thread = || {
            (0..KEYS_PER_BLOCK * 5 + 3)
                .map(|_| new_idempotency_key())
                .collect::<Vec<_>>()
        };
        let other = std::thread::spawn(on_thread);
        let mut keys = on_thread();
        keys.extend(other.join().unwrap());
        let mut digits = std::collections::BTreeSet::new();
        for key in &keys {
            let key = key.to_str().unwrap();
            assert_eq!(key.len(), KEY_LEN);
            assert!(
                key.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')),
                "{key}"
            );
            digits.extend(key.bytes());
        }
        assert_eq!(digits.len(), 16);
        let distinct: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len());
    }

    #[test]
    fn tried_set_skips_junk_and_repeats() {
        let mut t = AlreadyTried::default();
        t.record(&HeaderValue::from_static("a"));
        t.record(&HeaderValue::from_static("a"));
        t.record(&HeaderValue::from_static(" "));
        t.record(&HeaderValue::from_static("x,y"));
        t.record(&HeaderValue::from_bytes(b"\xffz").unwrap());
        t.record(&HeaderValue::from_static("b"));
        assert_eq!(t.iter().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(t.to_header().unwrap(), "a,b");
        assert!(t.contains("b") && !t.contains("c"));
    }

    #[test]
    fn the_mark_is_bounded_in_ids_and_bytes() {
        let mut t = AlreadyTried::default();
        assert!(!t.insert(&"x".repeat(MAX_INSTANCE_ID_LEN + 1)), "too long");
        assert!(t.insert(&"x".repeat(MAX_INSTANCE_ID_LEN)), "just fits");
        assert!(!t.insert("has space"), "not visible ASCII");
        assert!(!t.insert("caf\u{e9}"), "not ASCII");
        for i in 0..100 {
            t.insert(&format!("i{i}"));
        }
        assert_eq!(t.len(), MAX_TRIED_INSTANCES);
        let header = t.to_header().unwrap();
        assert!(header.len() <= MAX_TRIED_INSTANCES * (MAX_INSTANCE_ID_LEN + 1));

        let huge = HeaderValue::try_from(format!("a, ,b,,{},c,a", "y".repeat(1000))).unwrap();
        let parsed = AlreadyTried::from_header(&huge);
        assert_eq!(parsed.iter().collect::<Vec<_>>(), ["a", "b", "c"]);
    }

    #[test]
    fn the_retry_mark_survives_a_tonic_hop_and_a_fresh_status() {
        // A failure the layer gave up on, as the next hop's client reads it.
        let mut headers = http::HeaderMap::new();
        headers.insert("grpc-status", HeaderValue::from_static("14"));
        headers.insert("grpc-retry-pushback-ms", HeaderValue::from_static("-1"));
        let downstream = tonic::Status::from_header_map(&headers).unwrap();
        assert!(downstream.retried_below());

        // `?` in a handler: tonic writes the status, metadata and all.
        let passed_on = downstream.clone().into_http::<()>();
        assert_eq!(passed_on.headers()["grpc-retry-pushback-ms"], "-1");

        // A fresh status loses it, unless it is kept.
        let fresh = tonic::Status::unavailable("cannot price the book");
        assert!(!fresh.retried_below());
        let kept = fresh.keep_retry_mark(&downstream).into_http::<()>();
        assert_eq!(kept.headers()["grpc-retry-pushback-ms"], "-1");

        // Only a negative pushback is the mark.
        for (value, marked) in [
            ("-1", true),
            ("-250", true),
            ("-0", false),
            ("+1", false),
            ("250", false),
            ("-", false),
            ("x", false),
        ] {
            let mut s = tonic::Status::unavailable("");
            s.metadata_mut()
                .insert("grpc-retry-pushback-ms", value.parse().unwrap());
            assert_eq!(s.retried_below(), marked, "{value:?}");
            let carried = tonic::Status::aborted("").keep_retry_mark(&s);
            assert_eq!(carried.retried_below(), marked, "{value:?}");
        }
    }

    #[test]
    fn a_picked_instance_is_shared_by_its_clones() {
        let picked = PickedInstance::default();
        assert!(picked.get().is_none());
        let seen_by_balancer = picked.clone();
        seen_by_balancer.set(HeaderValue::from_static("b"));
        assert_eq!(picked.get().unwrap(), "b");
    }
}
