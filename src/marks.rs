//! What every attempt carries so servers and balancers can tell attempts apart
//! (and tell them to be the same call): the idempotency key, the attempt count,
//! and the instances that already failed this call.

use std::fmt;

use bytes::Bytes;
use http::{HeaderName, HeaderValue};

/// The request header carrying the call's idempotency key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("x-idempotency-key");
/// The request header on attempt `n + 1` carrying `n` (gRPC A6).
pub const PREVIOUS_ATTEMPTS: HeaderName = HeaderName::from_static("grpc-previous-rpc-attempts");
/// The request header naming, comma-separated, the instances that failed
/// earlier attempts of this call.
pub const ALREADY_TRIED: HeaderName = HeaderName::from_static("x-already-tried");
/// The default response header from which an answering instance's id is read.
pub const INSTANCE_ID: HeaderName = HeaderName::from_static("x-instance-id");

/// A fresh idempotency key: 128 random bits as 32 lowercase hex digits.
pub(crate) fn new_idempotency_key() -> HeaderValue {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bits: u128 = rand::random();
    let mut buf = [0u8; 32];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = HEX[((bits >> (124 - 4 * i)) & 0xf) as usize];
    }
    // `from_owner` makes a reference-counted `Bytes` in one allocation; the
    // header is cloned for every attempt, and a copied slice would allocate
    // again on its first clone.
    let mut key = HeaderValue::from_maybe_shared(Bytes::from_owner(buf))
        .expect("hex digits are a valid header value");
    // A value that never repeats must stay out of HPACK's dynamic table:
    // indexing it would evict the headers that do repeat and make every
    // request on the connection larger. "Sensitive" values are sent as
    // never-indexed literals.
    key.set_sensitive(true);
    key
}

/// The instances that failed earlier attempts of this call.
///
/// Set as a request extension on every retry (and mirrored in the
/// [`x-already-tried`](ALREADY_TRIED) header for balancers in other processes),
/// so a balancer below the layer can send the retry elsewhere. Instance ids are
/// learned from the response header named by
/// [`RetryPolicy::with_instance_header`](crate::RetryPolicy::with_instance_header).
///
/// ```
/// use tonic_retry::AlreadyTried;
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
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AlreadyTried {
    ids: Vec<String>,
}

impl AlreadyTried {
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

    /// Adds the instance named by a response header; ids that are not visible
    /// ASCII, or are already named, are skipped.
    pub(crate) fn record(&mut self, id: &HeaderValue) {
        if let Ok(id) = id.to_str() {
            let id = id.trim();
            if !id.is_empty() && !id.contains(',') && !self.contains(id) {
                self.ids.push(id.to_owned());
            }
        }
    }

    /// The header form: ids joined by `,`.
    pub(crate) fn to_header(&self) -> Option<HeaderValue> {
        HeaderValue::try_from(self.ids.join(",")).ok()
    }
}

impl fmt::Debug for AlreadyTried {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(&self.ids).finish()
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
}
