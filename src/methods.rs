//! Retry policies by gRPC method.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::error::ConfigError;
use crate::policy::RetryPolicy;

/// Retry (or hedging) policies chosen by the request's gRPC method, as gRPC's service
/// config chooses them: the method's own policy, else its service's, else the
/// default.
///
/// The method comes from the request path, `/package.Service/Method`. A
/// method with no policy of its own, in a service with none, gets the
/// default; a table made with [`MethodPolicies::new`] has
/// [`RetryPolicy::no_retry`] as its default, so such a method passes through
/// unretried — its deadline still applies.
///
/// A single [`RetryPolicy`] converts into a table where it is the default for
/// every method, which is what [`RetryLayer::new`](crate::RetryLayer::new)
/// takes it as.
///
/// Looking a request up costs two hash lookups of slices of its path, and no
/// allocation; a table with no per-service or per-method entries costs none.
///
/// One call can override its method's policy: a [`CallPolicy`] in the
/// request's extensions turns its retries off, or gives it a policy of its
/// own.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tonic_retry::{MethodPolicies, RetryBudget, RetryLayer, RetryPolicy};
///
/// # fn main() -> Result<(), tonic_retry::ConfigError> {
/// let reads = RetryPolicy::new(5, Duration::from_millis(20), Duration::from_millis(500), 0.2)?;
/// let writes = RetryPolicy::new(2, Duration::from_millis(50), Duration::from_millis(500), 0.2)?;
/// let policies = MethodPolicies::new()
///     .with_service("library.v1.Library", reads)?
///     .with_method("library.v1.Library", "ReserveStock", writes)?
///     .with_method("library.v1.Library", "DeleteShelf", RetryPolicy::no_retry())?;
/// assert_eq!(policies.policy_for("/library.v1.Library/GetBook").max_attempts(), 5);
/// assert_eq!(policies.policy_for("/library.v1.Library/ReserveStock").max_attempts(), 2);
/// assert_eq!(policies.policy_for("/library.v1.Library/DeleteShelf").max_attempts(), 1);
/// assert_eq!(policies.policy_for("/other.v1.Catalog/Search").max_attempts(), 1);
///
/// let layer = RetryLayer::new(policies, RetryBudget::new(200, 0.1)?);
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MethodPolicies {
    /// Every policy in the table; the default is the first.
    policies: Vec<RetryPolicy>,
    /// Each policy of `policies`, at the same index, with one attempt and no
    /// hedging: what a call told not to retry follows.
    single: Vec<RetryPolicy>,
    /// `package.Service/Method` → index.
    methods: HashMap<Box<str>, usize, Fnv>,
    /// `package.Service` → index.
    services: HashMap<Box<str>, usize, Fnv>,
}

/// FNV-1a, as `http` hashes header names: a third of SipHash's cost on a
/// method path. A keyed hash guards maps that strangers can insert into; this
/// table is fixed when it is built, and a request only looks up.
type Fnv = BuildHasherDefault<FnvHasher>;

#[derive(Default)]
struct FnvHasher(u64);

impl Hasher for FnvHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut hash = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for &byte in bytes {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = hash;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The index of the default policy.
const DEFAULT: usize = 0;

impl MethodPolicies {
    /// A table whose default is [`RetryPolicy::no_retry`]: only the services
    /// and methods given a policy are retried.
    pub fn new() -> Self {
        Self::with_default(RetryPolicy::no_retry())
    }

    /// A table whose default is `policy`.
    pub fn with_default(policy: impl Into<RetryPolicy>) -> Self {
        let policy = policy.into();
        Self {
            single: vec![policy.single_attempt()],
            policies: vec![policy],
            methods: HashMap::default(),
            services: HashMap::default(),
        }
    }

    /// Gives every method of `service` (`package.Service`) `policy`, unless
    /// the method has its own.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] if `service` is empty, contains `/`, or already has a
    /// policy.
    pub fn with_service(
        mut self,
        service: &str,
        policy: impl Into<RetryPolicy>,
    ) -> Result<Self, ConfigError> {
        self.insert_service(service, policy.into())?;
        Ok(self)
    }

    /// [`with_service`](Self::with_service) in place; on an error the table
    /// is unchanged.
    pub(crate) fn insert_service(
        &mut self,
        service: &str,
        policy: RetryPolicy,
    ) -> Result<(), ConfigError> {
        check_name("service", service)?;
        if self.services.contains_key(service) {
            return Err(ConfigError::new(
                "service",
                format!("{service:?} is given a policy twice"),
            ));
        }
        let index = self.push(policy);
        self.services.insert(service.into(), index);
        Ok(())
    }

    /// Gives `method` of `service` (`package.Service`, `Method`) `policy`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] if `service` or `method` is empty or contains `/`, or
    /// the method already has a policy.
    pub fn with_method(
        mut self,
        service: &str,
        method: &str,
        policy: impl Into<RetryPolicy>,
    ) -> Result<Self, ConfigError> {
        self.insert_method(service, method, policy.into())?;
        Ok(self)
    }

    /// [`with_method`](Self::with_method) in place; on an error the table is
    /// unchanged.
    pub(crate) fn insert_method(
        &mut self,
        service: &str,
        method: &str,
        policy: RetryPolicy,
    ) -> Result<(), ConfigError> {
        check_name("service", service)?;
        check_name("method", method)?;
        let path = format!("{service}/{method}");
        if self.methods.contains_key(path.as_str()) {
            return Err(ConfigError::new(
                "method",
                format!("{path:?} is given a policy twice"),
            ));
        }
        let index = self.push(policy);
        self.methods.insert(path.into(), index);
        Ok(())
    }

    /// The default policy: for methods of services that have no entry.
    pub fn default_policy(&self) -> &RetryPolicy {
        &self.policies[DEFAULT]
    }

    /// The policy for a request to `path` (`/package.Service/Method`).
    pub fn policy_for(&self, path: &str) -> &RetryPolicy {
        &self.policies[self.lookup(path)]
    }

    /// The index of the policy for `path`. Allocates nothing; a table of one
    /// default policy does not even read the path.
    pub(crate) fn lookup(&self, path: &str) -> usize {
        if self.methods.is_empty() && self.services.is_empty() {
            return DEFAULT;
        }
        let full = path.strip_prefix('/').unwrap_or(path);
        if let Some(&index) = self.methods.get(full) {
            return index;
        }
        let service = full.rsplit_once('/').map_or(full, |(service, _)| service);
        self.services.get(service).copied().unwrap_or(DEFAULT)
    }

    /// The policy of a call to `path` whose request carries `own`, the
    /// caller's [`CallPolicy`], if any.
    #[inline]
    pub(crate) fn choose(&self, path: &str, own: Option<&CallPolicy>) -> PolicyRef {
        match own {
            None => PolicyRef::Table(self.lookup(path)),
            Some(own) => own.choose(|| self.lookup(path)),
        }
    }

    /// The policy `chosen` names.
    #[inline]
    pub(crate) fn get<'a>(&'a self, chosen: &'a PolicyRef) -> &'a RetryPolicy {
        match chosen {
            PolicyRef::Table(index) => &self.policies[*index],
            PolicyRef::Single(index) => &self.single[*index],
            PolicyRef::Own(policy) => policy,
        }
    }

    fn push(&mut self, policy: RetryPolicy) -> usize {
        self.single.push(policy.single_attempt());
        self.policies.push(policy);
        self.policies.len() - 1
    }
}

/// The policy a call follows: one of its layer's, or the caller's own.
#[derive(Clone, Debug)]
pub(crate) enum PolicyRef {
    /// The layer's policy at this index.
    Table(usize),
    /// The layer's policy at this index, with one attempt and no hedging.
    Single(usize),
    /// The caller's own, for this call.
    Own(Arc<RetryPolicy>),
}

/// One call's own say on its retries, over its method's policy: set it as
/// a request extension. An extension, not a header, so that only code in
/// the process can set it: nothing a remote caller sends can raise a
/// process's attempts.
///
/// * [`CallPolicy::no_retry`]: no retries and no hedges for this call, say a
///   write the server does not deduplicate, or a call that must fail fast.
///   Everything else of the method's policy still applies: its deadline, the
///   idempotency key, the marks, the shield against malformed statuses, and
///   gRPC's transparent retry of a stream the server refused before its
///   application saw it.
/// * [`CallPolicy::new`]: this call's own [`RetryPolicy`] or
///   [`HedgePolicy`](crate::HedgePolicy), whole, in place of its method's:
///   its attempts, backoff, codes, hedging and timeouts (a call may so be
///   given longer than its method allows). The budget is the layer's, as
///   for any call.
///
/// Make a policy once and clone it for each call: a clone is one reference
/// count, and a hedging policy's clones share its extra-load cap and its
/// latencies.
///
/// ```
/// use std::time::Duration;
/// use tonic_health::pb::HealthCheckRequest;
/// use tonic_retry::{CallPolicy, HedgePolicy};
///
/// # fn main() -> Result<(), tonic_retry::ConfigError> {
/// // A call that must not be sent twice.
/// let mut once = tonic::Request::new(HealthCheckRequest::default());
/// once.extensions_mut().insert(CallPolicy::no_retry());
///
/// // A call hedged after 20 ms, whatever its method does.
/// let hedged = CallPolicy::new(HedgePolicy::new(2, Duration::from_millis(20))?);
/// let mut fast = tonic::Request::new(HealthCheckRequest::default());
/// fast.extensions_mut().insert(hedged.clone());
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct CallPolicy(Option<Arc<RetryPolicy>>);

impl CallPolicy {
    /// No retries and no hedges for this call; the rest of its method's
    /// policy applies.
    pub fn no_retry() -> Self {
        Self(None)
    }

    /// This call follows `policy` (a [`RetryPolicy`] or a
    /// [`HedgePolicy`](crate::HedgePolicy)) in place of its method's.
    pub fn new(policy: impl Into<RetryPolicy>) -> Self {
        Self(Some(Arc::new(policy.into())))
    }

    /// The policy this call follows in place of its method's, if any.
    pub fn policy(&self) -> Option<&RetryPolicy> {
        self.0.as_deref()
    }

    /// Which policy a call follows, its method's being the one at `lookup()`.
    fn choose(&self, lookup: impl FnOnce() -> usize) -> PolicyRef {
        match &self.0 {
            Some(own) => PolicyRef::Own(Arc::clone(own)),
            None => PolicyRef::Single(lookup()),
        }
    }
}

impl From<RetryPolicy> for CallPolicy {
    fn from(policy: RetryPolicy) -> Self {
        Self::new(policy)
    }
}

impl From<crate::HedgePolicy> for CallPolicy {
    fn from(policy: crate::HedgePolicy) -> Self {
        Self::new(policy)
    }
}

fn check_name(field: &'static str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.contains('/') {
        return Err(ConfigError::new(
            field,
            format!("must be a non-empty name without '/', got {name:?}"),
        ));
    }
    Ok(())
}

impl Default for MethodPolicies {
    fn default() -> Self {
        Self::new()
    }
}

impl From<RetryPolicy> for MethodPolicies {
    /// A table where `policy` is the default for every method.
    fn from(policy: RetryPolicy) -> Self {
        Self::with_default(policy)
    }
}

impl fmt::Debug for MethodPolicies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut services: Vec<_> = self.services.iter().collect();
        services.sort();
        let mut methods: Vec<_> = self.methods.iter().collect();
        methods.sort();
        f.debug_struct("MethodPolicies")
            .field("default", self.default_policy())
            .field(
                "services",
                &services
                    .into_iter()
                    .map(|(name, &i)| (name, &self.policies[i]))
                    .collect::<Vec<_>>(),
            )
            .field(
                "methods",
                &methods
                    .into_iter()
                    .map(|(name, &i)| (name, &self.policies[i]))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn attempts(n: u32) -> RetryPolicy {
        RetryPolicy::new(n, Duration::ZERO, Duration::ZERO, 0.0).unwrap()
    }

    #[test]
    fn the_most_specific_entry_wins() {
        let table = MethodPolicies::with_default(attempts(2))
            .with_service("a.S", attempts(3))
            .unwrap()
            .with_method("a.S", "M", attempts(4))
            .unwrap();
        assert_eq!(
            table.policy_for("/a.S/M").max_attempts(),
            4,
            "the method's own"
        );
        assert_eq!(
            table.policy_for("/a.S/Other").max_attempts(),
            3,
            "its service's"
        );
        assert_eq!(table.policy_for("/b.S/M").max_attempts(), 2, "the default");
        for odd in [
            "",
            "/",
            "//",
            "a.S",
            "/a.S",
            "/a.S/",
            "/a.S/M/extra",
            "no-slash",
        ] {
            let _ = table.policy_for(odd); // never panics
        }
        assert_eq!(table.policy_for("/a.S/").max_attempts(), 3);
        assert_eq!(
            table.policy_for("a.S/M").max_attempts(),
            4,
            "a path without '/'"
        );
    }

    #[test]
    fn an_empty_table_passes_everything_through() {
        let table = MethodPolicies::new();
        assert_eq!(table.policy_for("/a.S/M").max_attempts(), 1);
        assert_eq!(table.lookup("/a.S/M"), DEFAULT);
        let single: MethodPolicies = attempts(3).into();
        assert_eq!(single.policy_for("/anything/At").max_attempts(), 3);
    }

    #[test]
    fn bad_and_repeated_names_are_errors() {
        let e = MethodPolicies::new()
            .with_service("", attempts(2))
            .unwrap_err();
        assert_eq!(e.field(), "service");
        let e = MethodPolicies::new()
            .with_method("a.S", "", attempts(2))
            .unwrap_err();
        assert_eq!(e.field(), "method");
        let e = MethodPolicies::new()
            .with_method("a/S", "M", attempts(2))
            .unwrap_err();
        assert_eq!(e.field(), "service");
        let e = MethodPolicies::new()
            .with_service("a.S", attempts(2))
            .unwrap()
            .with_service("a.S", attempts(3))
            .unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        let e = MethodPolicies::new()
            .with_method("a.S", "M", attempts(2))
            .unwrap()
            .with_method("a.S", "M", attempts(3))
            .unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
    }
}
