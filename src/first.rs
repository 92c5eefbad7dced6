//! The first attempt's speed-ups: what a call's first attempt, sent at once,
//! does to cost less on every call. Its `grpc-timeout` says the call's own
//! timeout, which HPACK indexes, rather than the time left
//! ([`FirstTimeout`]); and the copy its first retry is made from keeps the
//! request's headers as a list taken from a per-thread pool, not as a second
//! header map ([`FirstCopy`]). Neither changes what a call does: each is
//! measured by `cargo bench --bench instructions`.

use std::cell::RefCell;
use std::time::Duration;

use http::{
    Extensions, HeaderMap, HeaderName, HeaderValue, Method, Request, Uri, Version, request,
};
use tokio::time::Instant;

use crate::attempt::set_timeout;
use crate::call::RetryCopy;
use crate::deadline::{GRPC_TIMEOUT, format_repeating};
use crate::policy::RetryPolicy;
use crate::replay::ReplayBody;

/// What a call's first attempt says its time is, if it is sent at once.
///
/// An attempt says the time left to the call's deadline, rounded up, in
/// `grpc-timeout`: a value that differs on every call, sent as a literal
/// HPACK never indexes (name and value, Huffman-coded by the client and
/// decoded, then allocated, by the server, on every call). A first attempt
/// sent at once says the call's timeout itself instead, as tonic's own
/// client does: the caller's header left as it is, or the layer's timeout
/// (a policy's, the same on every call, so HPACK indexes it and sends it
/// again as one byte). "At once" is within a thousandth of the timeout and
/// at most a millisecond of the call setting its deadline: no more than
/// that is added to the time the server is told, which is never less than
/// the time left (`cargo bench --bench instructions`, stack `c-deadline`).
///
/// The caller's header goes as the caller made it, sensitive or not: a
/// caller passing on a deadline of its own, a different value on every
/// call, keeps it out of HPACK's table by marking it sensitive, as it would
/// without the layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FirstTimeout {
    /// When the call set its deadline.
    pub(crate) started: Instant,
    /// The call's timeout: its deadline less `started`.
    // NOTE: kept, though derivable: computed from the deadline where the
    // attempt is sent, it cost every call with a deadline 63 instructions.
    pub(crate) timeout: Duration,
    /// Whose timeout it is.
    pub(crate) said: Said,
}

/// Whose timeout set a call's deadline, and so what its first attempt sent
/// at once says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Said {
    /// The caller's one `grpc-timeout` header, which stays as it is.
    Callers,
    /// The policy's total timeout.
    Total,
    /// The policy's cap on a method's calls.
    Max,
}

impl FirstTimeout {
    /// The most a first attempt sent at once may be sent after the call set
    /// its deadline.
    const AT_ONCE: Duration = Duration::from_millis(1);

    /// Whether an attempt sent at `now` is sent at once.
    fn at_once(&self, now: Instant) -> bool {
        // A timeout of a second or more allows the whole millisecond: no
        // division, as most timeouts are.
        let limit = if self.timeout >= Duration::from_secs(1) {
            Self::AT_ONCE
        } else {
            self.timeout / 1000
        };
        self.started
            .checked_add(limit)
            .is_some_and(|until| now <= until)
    }
}

/// Writes the `grpc-timeout` of a call's first attempt, sent at `now`, under
/// the call's `deadline`.
// NOTE: out of line: inlined, it made `RetryService::call` large enough that
// the compiler stopped inlining the header map's insert of the key, a cost
// on every call.
#[inline(never)]
pub(crate) fn say_first_timeout(
    headers: &mut HeaderMap,
    timeout: Option<FirstTimeout>,
    policy: &RetryPolicy,
    deadline: Instant,
    now: Instant,
) {
    let Some(first) = timeout.filter(|first| first.at_once(now)) else {
        set_timeout(headers, Some(deadline), now);
        return;
    };
    let policys = match first.said {
        // The caller's header stays, as it is.
        Said::Callers => return,
        Said::Total => &policy.total_timeout,
        Said::Max => &policy.max_timeout,
    };
    // NOTE: `said` was read from this policy, so its timeout is there; the
    // call's own timeout formatted keeps this total without a panic.
    let value = match policys {
        Some(timeout) => timeout.header(),
        None => format_repeating(first.timeout),
    };
    headers.insert(GRPC_TIMEOUT, value);
}

/// The copy of a call's request that its first retry is made from, kept
/// while the first attempt runs.
///
/// Its headers are a list, not a [`HeaderMap`]: a map's copy is two
/// allocations and its index, made and dropped on every call, and most
/// calls are never retried. The map is built again only for a retry
/// ([`into_request`](Self::into_request)); tower's `Retry` copies that one
/// whole for the retries after it.
pub(crate) struct FirstCopy<B> {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderList,
    extensions: Extensions,
    body: ReplayBody<B>,
}

/// Every value of every header of a first copy, in the request's order.
///
/// Most copies are dropped unused (their call succeeded at once), so the
/// list's allocation is not given back to the allocator with them: a thread
/// keeps up to [`KEPT_LISTS`] emptied lists for its next calls' copies.
struct HeaderList(Vec<(HeaderName, HeaderValue)>);

/// How many emptied lists a thread keeps.
const KEPT_LISTS: usize = 16;

/// The most values a list kept may have room for: a request with more
/// headers than that is rare, and its list is freed.
const KEPT_CAPACITY: usize = 32;

thread_local! {
    /// This thread's emptied lists.
    static LISTS: RefCell<Vec<Vec<(HeaderName, HeaderValue)>>> =
        const { RefCell::new(Vec::new()) };
}

impl HeaderList {
    /// An empty list with room for `len` values: one the thread kept, if
    /// any.
    #[inline]
    fn with_capacity(len: usize) -> Self {
        let mut list = LISTS
            .try_with(|lists| {
                lists
                    .try_borrow_mut()
                    .ok()
                    .and_then(|mut lists| lists.pop())
            })
            .ok()
            .flatten()
            .unwrap_or_default();
        list.reserve(len);
        Self(list)
    }
}

impl Drop for HeaderList {
    fn drop(&mut self) {
        let mut list = std::mem::take(&mut self.0);
        list.clear();
        if list.capacity() == 0 || list.capacity() > KEPT_CAPACITY {
            return;
        }
        // A thread that is ending, or has enough lists, frees it.
        let _ = LISTS.try_with(move |lists| {
            if let Ok(mut lists) = lists.try_borrow_mut()
                && lists.len() < KEPT_LISTS
            {
                lists.push(list);
            }
        });
    }
}

impl<B> FirstCopy<B> {
    /// A copy of the request of `head` and `body`, its body a clone that
    /// reads it again from its start; without its `grpc-timeout` if
    /// `retimed`, as every retry of a call with a deadline says its own.
    // NOTE: a `grpc-timeout` made by tonic is a value made from a `Vec`,
    // whose first clone allocates to share it; a retry writes over it.
    #[inline(always)]
    pub(crate) fn of(head: &request::Parts, body: &ReplayBody<B>, retimed: bool) -> Self {
        let mut headers = HeaderList::with_capacity(head.headers.len());
        for (name, value) in &head.headers {
            if retimed && name == GRPC_TIMEOUT {
                continue;
            }
            headers.0.push((name.clone(), value.clone()));
        }
        Self {
            method: head.method.clone(),
            uri: head.uri.clone(),
            version: head.version,
            headers,
            extensions: head.extensions.clone(),
            body: body.clone(),
        }
    }

    /// The request the first retry sends.
    pub(crate) fn into_request(self) -> Request<ReplayBody<B>> {
        // NOTE: sized by values, not names: a map holds any number of
        // values for its at most 24,576 names, and its capacity is bounded,
        // so a request with more values grows its map as it is filled.
        let mut list = self.headers;
        let mut headers = HeaderMap::try_with_capacity(list.0.len()).unwrap_or_default();
        for (name, value) in list.0.drain(..) {
            headers.append(name, value);
        }
        drop(list);
        let mut req = Request::new(self.body);
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.version_mut() = self.version;
        *req.headers_mut() = headers;
        *req.extensions_mut() = self.extensions;
        req
    }
}

impl<B> RetryCopy<B> for FirstCopy<B> {
    fn body(&self) -> &ReplayBody<B> {
        &self.body
    }

    fn body_mut(&mut self) -> &mut ReplayBody<B> {
        &mut self.body
    }

    fn header(&self, name: &HeaderName) -> Option<&HeaderValue> {
        self.headers
            .0
            .iter()
            .find_map(|(n, value)| (n == name).then_some(value))
    }

    fn set_header(&mut self, name: HeaderName, value: HeaderValue) {
        // As `HeaderMap::insert`: the value takes the header's place, where
        // it had one, and its other values go.
        let headers = &mut self.headers.0;
        let Some(at) = headers.iter().position(|(n, _)| *n == name) else {
            headers.push((name, value));
            return;
        };
        headers[at].1 = value;
        let mut i = 0;
        headers.retain(|(n, _)| {
            i += 1;
            i <= at + 1 || *n != name
        });
    }

    fn extensions_mut(&mut self) -> &mut Extensions {
        &mut self.extensions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_once_is_a_thousandth_of_the_timeout_and_at_most_a_millisecond() {
        let started = Instant::now();
        let ns = Duration::from_nanos(1);
        for (timeout, limit) in [
            (Duration::from_secs(3_600), Duration::from_millis(1)),
            (Duration::from_secs(1), Duration::from_millis(1)),
            (Duration::from_secs(1) - ns, Duration::from_nanos(999_999)),
            (Duration::from_millis(500), Duration::from_micros(500)),
            (Duration::from_micros(999), Duration::from_nanos(999)),
            (Duration::from_nanos(999), Duration::ZERO),
            (Duration::ZERO, Duration::ZERO),
        ] {
            let first = FirstTimeout {
                started,
                timeout,
                said: Said::Callers,
            };
            assert!(first.at_once(started), "{timeout:?}");
            assert!(first.at_once(started + limit), "{timeout:?}");
            assert!(!first.at_once(started + limit + ns), "{timeout:?}");
        }
    }

    #[test]
    fn a_thread_keeps_the_lists_its_copies_dropped_emptied_and_bounded() {
        // Run on a thread of its own: the thread's lists are this test's.
        std::thread::spawn(|| {
            let value = bytes::Bytes::from(vec![b'v'; 8]);
            let list = |len: usize| {
                let mut list = HeaderList::with_capacity(len);
                for _ in 0..len {
                    let value = HeaderValue::from_maybe_shared(value.clone()).unwrap();
                    list.0.push((HeaderName::from_static("x-tag"), value));
                }
                list
            };
            let first = list(4);
            let at = first.0.as_ptr();
            drop(first);
            assert!(value.is_unique(), "a list kept holds no value");
            let again = list(4);
            assert_eq!(again.0.as_ptr(), at, "the next copy's list is the one kept");
            drop(again);

            let kept = || LISTS.with(|lists| lists.borrow().len());
            assert_eq!(kept(), 1);
            drop(list(KEPT_CAPACITY + 1));
            assert_eq!(kept(), 0, "a list past the capacity kept is freed");
            let lists: Vec<_> = (0..KEPT_LISTS + 4).map(|_| list(2)).collect();
            drop(lists);
            assert_eq!(kept(), KEPT_LISTS);
            assert!(value.is_unique());
        })
        .join()
        .unwrap();
    }
}
