//! gRPC service config JSON (gRFC A6, `grpc/service_config/service_config.proto`):
//! per-method retry policies and timeouts, and retry throttling, read the way
//! grpc-go and grpc-java read them.
//!
//! ```
//! use tonic_retry::service_config::ServiceConfig;
//! use tonic_retry::{RetryLayer, RetryPolicy};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let config: ServiceConfig = r#"{
//!   "methodConfig": [
//!     { "name": [{ "service": "library.v1.Library", "method": "GetBook" }],
//!       "timeout": "2s",
//!       "retryPolicy": {
//!         "maxAttempts": 4,
//!         "initialBackoff": "0.05s",
//!         "maxBackoff": "1s",
//!         "backoffMultiplier": 2,
//!         "retryableStatusCodes": ["UNAVAILABLE", "resource_exhausted"]
//!       } },
//!     { "name": [{ "service": "library.v1.Library", "method": "ReserveStock" }] }
//!   ],
//!   "retryThrottling": { "maxTokens": 100, "tokenRatio": 0.1 }
//! }"#
//! .parse()?;
//! let layer = RetryLayer::with_budget(
//!     config.policies(&RetryPolicy::default()),
//!     config.retry_throttle(),
//! );
//! let get_book = layer.policies().policy_for("/library.v1.Library/GetBook");
//! assert_eq!(get_book.max_attempts(), 4);
//! let reserve = layer.policies().policy_for("/library.v1.Library/ReserveStock");
//! assert_eq!(reserve.max_attempts(), 1, "a method config without retryPolicy: no retries");
//! # Ok(())
//! # }
//! ```
//!
//! # What is read, and how
//!
//! * `methodConfig[].name[]`: `{ "service": "package.Service", "method": "Method" }`.
//!   An empty or missing `method` makes the entry its service's default; an
//!   empty or missing `service` (with no `method`) the default for every
//!   method. A `method` without a `service`, and a name given twice anywhere in
//!   the config, are errors. An entry with no names is ignored. The most
//!   specific entry wins, whole: a method entry without `retryPolicy` is not
//!   retried, even if its service's entry has one.
//! * `retryPolicy`, with A6's validation: `maxAttempts` an integer greater
//!   than 1 (above 5 it counts as 5, as A6 says); `initialBackoff` and
//!   `maxBackoff` durations greater than 0; `backoffMultiplier` a number
//!   greater than 0; `retryableStatusCodes` a non-empty list of codes, each an
//!   integer (`14`) or a name in any case (`"UNAVAILABLE"`, `"unavailable"`).
//!   `perAttemptRecvTimeout`, where present, is the per-attempt timeout,
//!   greater than 0 as C-core requires. Everything A6 does not set (replay
//!   limit, key, marks) comes from the base [`RetryPolicy`] given to
//!   [`ServiceConfig::policies`].
//! * Every code in `retryableStatusCodes` is retried whenever an attempt ends
//!   with it ([`RetryWhen::Always`](crate::RetryWhen::Always)), as A6,
//!   grpc-go, grpc-java and grpcio retry it: `RESOURCE_EXHAUSTED` listed
//!   there is retried with or without `google.rpc.RetryInfo` (whose delay,
//!   when present, is waited for). The crate's own rule, "only with
//!   RetryInfo", belongs to [`RetryableCodes::default`], not to a list a
//!   config writes.
//! * The backoff is A6's: retry *n* waits
//!   `min(initialBackoff · backoffMultiplier^(n-1), maxBackoff) · random(0.8, 1.2)`,
//!   so a delay may be a little under `initialBackoff` or over `maxBackoff`,
//!   as A6 says. The base policy's jitter is not used: every config backs off
//!   by ±20 %, as grpc-go, grpc-java and C-core do.
//! * `hedgingPolicy` ([`HedgePolicy`]), with A6's validation: `maxAttempts`
//!   an integer greater than 1 (above 5 it counts as 5); `hedgingDelay` a
//!   duration, zero or absent sending every attempt at once;
//!   `nonFatalStatusCodes` a list of codes, absent meaning none. A method
//!   config with both `retryPolicy` and `hedgingPolicy` is an error. As in
//!   A6, hedges are bounded by `retryThrottling` alone: the policy has no
//!   extra-load cap of its own.
//! * `timeout`: the method's deadline; a call's deadline is the sooner of it
//!   and the caller's.
//! * `retryThrottling`: `maxTokens` in `(0, 1000]`, `tokenRatio` greater than
//!   0 (three decimals kept), as a [`RetryThrottle`].
//! * Durations are proto3 JSON strings: seconds with up to nine decimals and
//!   an `s` (`"1s"`, `"0.1s"`, `".01s"`, `"1.5s"`), at most 315,576,000,000 s.
//! * Keys are read whatever their (ASCII) case, as grpc-go's JSON decoding
//!   reads them: grpc-go's own retry example writes `"MaxAttempts": 4,
//!   "InitialBackoff": ".01s"`, and configs in the wild copy it. A key given
//!   twice in two spellings (`"maxAttempts"` and `"MaxAttempts"`) is an
//!   error naming both, where grpc-go would silently keep the later one.
//!
//! An invalid config is rejected whole (gRFC A21), with a
//! [`ServiceConfigError`] naming the JSON path and the rule broken
//! (`methodConfig[1].retryPolicy.maxAttempts: must be greater than 1, got 1`).
//! Unknown fields are ignored.
//!
//! # Fields read but not applied
//!
//! These are never dropped silently: loading a config that sets one emits a
//! `WARN` event naming its path and what to use instead, and
//! [`ServiceConfig::not_applied`] lists them.
//!
//! * `waitForReady`: a call does not wait for the channel to connect. A call
//!   that finds no connection fails `UNAVAILABLE` (connection refused), which
//!   the layer retries under the call's deadline and budget; to ride out a
//!   longer outage give the method a longer `timeout` and more attempts, or
//!   connect the channel (`Endpoint::connect`) before use.
//! * `maxRequestMessageBytes`, `maxResponseMessageBytes`: set the generated
//!   client's `max_encoding_message_size` / `max_decoding_message_size`.
//! * `loadBalancingConfig`, `loadBalancingPolicy`, `healthCheckConfig`:
//!   the channel's business (tonic's `Channel::balance_list`, or
//!   [`PreferUntried`](crate::balance::PreferUntried) below the layer).
//!
//! # Where implementations differ
//!
//! This reader follows gRFC A6 and A21:
//!
//! * Backoff: A6 draws `x · random(0.8, 1.2)`, as grpc-go (`stream.go`),
//!   grpc-java (`RetriableStream`, from 1.80) and C-core (grpcio) do, and as
//!   this reader's policies do. Older texts of A6, and grpc-java before 1.80,
//!   drew "full jitter", `random(0, x)`: a policy that must spread its
//!   retries as those did can ask for it
//!   ([`RetryPolicy::with_full_jitter`]).
//! * `RetryInfo`: grpc-go, grpc-java and C-core do not read it; this layer
//!   waits for its delay when a status carries one, and treats a status
//!   whose `grpc-status-details-bin` holds an unreadable `RetryInfo` as not
//!   retryable (a server's malformed answer never causes a retry).
//! * Status names in any case: A6 allows `"unavailable"`; grpc-go accepts
//!   only `"UNAVAILABLE"` and grpc-java only the exact enum name.
//! * An invalid `retryPolicy` rejects the config: grpc-java rejects it,
//!   grpc-go logs a warning and drops the policy (the method is then not
//!   retried).
//! * `".01s"` is a duration: grpc-go accepts it, grpc-java does not.
//! * `OK` among the retryable codes is accepted (A6 asks only for valid
//!   codes) and has no effect, since a success is never retried; grpc-java
//!   rejects it.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde_json::{Map, Value};
use tonic::Code;

use crate::HedgePolicy;
use crate::error::ConfigError;
use crate::methods::MethodPolicies;
use crate::policy::{MAX_ATTEMPTS_LIMIT, RetryPolicy, RetryableCodes};
use crate::status::code_name;
use crate::throttle::RetryThrottle;

/// The longest duration protobuf allows (10,000 years), in seconds.
const MAX_SECONDS: u64 = 315_576_000_000;

/// A parsed and validated gRPC service config: see the [module docs](self).
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceConfig {
    default: Option<MethodConfig>,
    services: Vec<(String, MethodConfig)>,
    methods: Vec<(String, String, MethodConfig)>,
    throttling: Option<(f64, f64)>,
    /// Fields read but not applied: their JSON paths, and what to use instead.
    not_applied: Vec<(String, &'static str)>,
}

/// Fields of a service config this layer reads but does not apply, and what
/// to use instead. Each is said at load (a `WARN` event) and listed by
/// [`ServiceConfig::not_applied`], never dropped silently.
const METHOD_FIELDS_NOT_APPLIED: &[(&str, &str)] = &[
    (
        "waitForReady",
        "calls do not wait for the channel to connect: a call that finds no connection fails \
         UNAVAILABLE, which the layer retries under the call's deadline and budget; give such \
         methods a longer deadline (`timeout`) and more attempts, or connect the channel \
         (Endpoint::connect) before use",
    ),
    (
        "maxRequestMessageBytes",
        "set the generated client's max_encoding_message_size",
    ),
    (
        "maxResponseMessageBytes",
        "set the generated client's max_decoding_message_size",
    ),
];

/// Top-level fields read but not applied, and what to use instead.
const CONFIG_FIELDS_NOT_APPLIED: &[(&str, &str)] = &[
    (
        "loadBalancingConfig",
        "balancing belongs to the channel: tonic's Channel::balance_list, or \
         tonic_retry::balance::PreferUntried below the layer",
    ),
    (
        "loadBalancingPolicy",
        "balancing belongs to the channel: tonic's Channel::balance_list, or \
         tonic_retry::balance::PreferUntried below the layer",
    ),
    (
        "healthCheckConfig",
        "health checking belongs to the channel; this layer does not do it",
    ),
];

/// What one `methodConfig` entry says.
#[derive(Clone, Debug, PartialEq)]
struct MethodConfig {
    retry: Option<Retry>,
    hedge: Option<Hedge>,
    timeout: Option<Duration>,
}

/// A validated `hedgingPolicy`.
#[derive(Clone, Debug, PartialEq)]
struct Hedge {
    max_attempts: u32,
    delay: Duration,
    non_fatal: RetryableCodes,
}

/// A validated `retryPolicy`.
#[derive(Clone, Debug, PartialEq)]
struct Retry {
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    multiplier: f64,
    codes: RetryableCodes,
    per_attempt: Option<Duration>,
}

/// Why a service config was rejected: the JSON path of the offending value
/// and the rule it breaks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceConfigError {
    path: String,
    rule: String,
}

impl ServiceConfigError {
    fn new(path: &str, rule: impl Into<String>) -> Self {
        Self {
            path: path.to_owned(),
            rule: rule.into(),
        }
    }

    /// Where in the JSON, e.g. `methodConfig[1].retryPolicy.maxAttempts`;
    /// empty for the document itself.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The rule broken, e.g. `must be greater than 1, got 1`.
    pub fn rule(&self) -> &str {
        &self.rule
    }
}

impl fmt::Display for ServiceConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "invalid service config: {}", self.rule)
        } else {
            write!(f, "invalid service config: {}: {}", self.path, self.rule)
        }
    }
}

impl std::error::Error for ServiceConfigError {}

type Result<T> = std::result::Result<T, ServiceConfigError>;

impl ServiceConfig {
    /// Parses and validates a service config.
    ///
    /// # Errors
    ///
    /// [`ServiceConfigError`] naming the path and the rule, for JSON that does
    /// not parse, and for any value A6 does not allow.
    pub fn from_json(json: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(json)
            .map_err(|e| ServiceConfigError::new("", format!("not valid JSON: {e}")))?;
        let root = object(&value, "")?;
        let mut config = ServiceConfig {
            default: None,
            services: Vec::new(),
            methods: Vec::new(),
            throttling: None,
            not_applied: Vec::new(),
        };
        config.note_not_applied(root, "", CONFIG_FIELDS_NOT_APPLIED)?;
        if let Some(list) = field(root, "methodConfig", "")? {
            let entries = array(list, "methodConfig")?;
            let mut seen = std::collections::HashSet::new();
            for (i, entry) in entries.iter().enumerate() {
                config.add(entry, &format!("methodConfig[{i}]"), &mut seen)?;
            }
        }
        if let Some(throttling) = field(root, "retryThrottling", "")? {
            config.throttling = Some(throttling_of(throttling, "retryThrottling")?);
        }
        Ok(config)
    }

    fn add(
        &mut self,
        entry: &Value,
        path: &str,
        seen: &mut std::collections::HashSet<(String, String)>,
    ) -> Result<()> {
        let entry_map = object(entry, path)?;
        let method_config = method_config(entry_map, path)?;
        self.note_not_applied(entry_map, path, METHOD_FIELDS_NOT_APPLIED)?;
        let Some(names) = field(entry_map, "name", path)? else {
            return Ok(());
        };
        let names_path = format!("{path}.name");
        for (j, name) in array(names, &names_path)?.iter().enumerate() {
            let name_path = format!("{names_path}[{j}]");
            let name = object(name, &name_path)?;
            let service = string_or_empty(name, "service", &name_path)?;
            let method = string_or_empty(name, "method", &name_path)?;
            for (part, value) in [("service", &service), ("method", &method)] {
                if value.contains('/') {
                    return Err(ServiceConfigError::new(
                        &format!("{name_path}.{part}"),
                        format!("must not contain '/', got {value:?}"),
                    ));
                }
            }
            if service.is_empty() && !method.is_empty() {
                return Err(ServiceConfigError::new(
                    &format!("{name_path}.method"),
                    format!("a method ({method:?}) needs a service"),
                ));
            }
            if !seen.insert((service.clone(), method.clone())) {
                return Err(ServiceConfigError::new(
                    &name_path,
                    format!("duplicate name: service {service:?}, method {method:?}"),
                ));
            }
            let config = method_config.clone();
            match (service.is_empty(), method.is_empty()) {
                (true, _) => self.default = Some(config),
                (false, true) => self.services.push((service, config)),
                (false, false) => self.methods.push((service, method, config)),
            }
        }
        Ok(())
    }

    /// Records, and says at `WARN`, each of `fields` the object at `path` sets.
    fn note_not_applied(
        &mut self,
        map: &Map<String, Value>,
        path: &str,
        fields: &[(&str, &'static str)],
    ) -> Result<()> {
        for &(name, instead) in fields {
            if field(map, name, path)?.is_some() {
                let at = join(path, name);
                tracing::warn!(
                    field = %at,
                    instead,
                    "service config: {at} is not applied by tonic-retry"
                );
                self.not_applied.push((at, instead));
            }
        }
        Ok(())
    }

    /// The fields this config sets that the layer does not apply, as JSON
    /// paths (`methodConfig[0].waitForReady`) with what to use instead.
    /// Each was also said at load, in a `WARN` event.
    pub fn not_applied(&self) -> impl Iterator<Item = (&str, &str)> {
        self.not_applied
            .iter()
            .map(|(path, instead)| (path.as_str(), *instead))
    }

    /// The config's policies by method, built on `base`: each `retryPolicy`
    /// sets the attempts, backoff, multiplier, retryable codes and per-attempt
    /// timeout of a copy of `base`; a method config without one, and a method
    /// no entry covers, get `base` with a single attempt (not retried, but
    /// still given its idempotency key, replay-free body and the like); each
    /// `timeout` caps the call's deadline.
    pub fn policies(&self, base: &RetryPolicy) -> MethodPolicies {
        self.policies_with_hedging(base, Ok)
            .expect("hedging policies passed on as they are")
    }

    /// [`policies`](Self::policies), with `hedging` applied to each policy a
    /// `hedgingPolicy` gives: what A6 has no field for, such as an extra-load
    /// cap (a config's hedging is bounded by its `retryThrottling` alone) or
    /// an adaptive delay.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tonic_retry::service_config::ServiceConfig;
    /// use tonic_retry::RetryPolicy;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let config: ServiceConfig = r#"{"methodConfig": [{
    ///     "name": [{"service": "library.v1.Library", "method": "GetBook"}],
    ///     "hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": "0.05s"}
    /// }]}"#
    ///     .parse()?;
    /// let policies = config.policies_with_hedging(&RetryPolicy::default(), |hedge| {
    ///     hedge
    ///         .with_max_extra_load(Some(0.05))?
    ///         .with_adaptive_delay(0.95, Duration::from_secs(10), Duration::from_millis(5))
    /// })?;
    /// let get_book = policies.policy_for("/library.v1.Library/GetBook");
    /// assert_eq!(get_book.hedge_delay(), Some(Duration::from_millis(50)));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// The first error `hedging` returns.
    pub fn policies_with_hedging(
        &self,
        base: &RetryPolicy,
        hedging: impl Fn(HedgePolicy) -> std::result::Result<HedgePolicy, ConfigError>,
    ) -> std::result::Result<MethodPolicies, ConfigError> {
        let policy = |config: &MethodConfig| config.policy(base, &hedging);
        let mut table = MethodPolicies::with_default(match &self.default {
            Some(config) => policy(config)?,
            None => base.single_attempt(),
        });
        // NOTE: the names were checked when the config was parsed (non-empty,
        // no '/', each once), so the table takes every one.
        for (service, config) in &self.services {
            let taken = table.insert_service(service, policy(config)?);
            debug_assert!(taken.is_ok(), "{taken:?}");
        }
        for (service, method, config) in &self.methods {
            let taken = table.insert_method(service, method, policy(config)?);
            debug_assert!(taken.is_ok(), "{taken:?}");
        }
        Ok(table)
    }

    /// The config's `retryThrottling` as a budget for the layer, or
    /// [`RetryThrottle::unlimited`] without one (A6: no throttling).
    pub fn retry_throttle(&self) -> RetryThrottle {
        match self.throttling {
            Some((max, ratio)) => {
                RetryThrottle::new(max, ratio).unwrap_or_else(|_| RetryThrottle::unlimited())
            }
            None => RetryThrottle::unlimited(),
        }
    }
}

impl FromStr for ServiceConfig {
    type Err = ServiceConfigError;

    fn from_str(json: &str) -> Result<Self> {
        Self::from_json(json)
    }
}

impl MethodConfig {
    fn policy(
        &self,
        base: &RetryPolicy,
        hedging: &impl Fn(HedgePolicy) -> std::result::Result<HedgePolicy, ConfigError>,
    ) -> std::result::Result<RetryPolicy, ConfigError> {
        let policy = match (&self.retry, &self.hedge) {
            (None, Some(hedge)) => {
                let hedge = HedgePolicy::new(hedge.max_attempts, hedge.delay)
                    .expect("a validated hedgingPolicy sends 2..=5 attempts")
                    .with_non_fatal_codes(hedge.non_fatal)
                    // A6 bounds hedges by throttling alone.
                    .with_max_extra_load(None)
                    .expect("no cap is a valid cap")
                    .with_settings_of(base);
                RetryPolicy::from(hedging(hedge)?)
            }
            (None, None) => base.single_attempt(),
            (Some(retry), _) => {
                let mut policy = base.clone();
                policy.hedge = None;
                policy.max_attempts = retry.max_attempts;
                policy.base_delay = retry.initial_backoff;
                policy.max_delay = retry.max_backoff;
                policy.multiplier = retry.multiplier;
                policy.retryable = retry.codes;
                // A6's backoff: min(initial · multiplier^(n-1), max) · random(0.8, 1.2).
                policy.jitter = A6_JITTER;
                policy.full_jitter = false;
                if let Some(timeout) = retry.per_attempt {
                    policy.attempt_timeout = Some(timeout);
                }
                policy
            }
        };
        Ok(match self.timeout {
            Some(timeout) => policy.with_max_timeout(timeout),
            None => policy,
        })
    }
}

/// A6's jitter: every backoff is its raw value times `random(0.8, 1.2)`.
const A6_JITTER: f64 = 0.2;

fn method_config(entry: &Map<String, Value>, path: &str) -> Result<MethodConfig> {
    let timeout = match field(entry, "timeout", path)? {
        Some(v) => {
            let path = format!("{path}.timeout");
            Some(duration(v, &path, false)?)
        }
        None => None,
    };
    let retry = match field(entry, "retryPolicy", path)? {
        Some(v) => Some(retry_policy(v, &format!("{path}.retryPolicy"))?),
        None => None,
    };
    let hedge = match field(entry, "hedgingPolicy", path)? {
        Some(v) => Some(hedging_policy(v, &format!("{path}.hedgingPolicy"))?),
        None => None,
    };
    if retry.is_some() && hedge.is_some() {
        return Err(ServiceConfigError::new(
            &format!("{path}.hedgingPolicy"),
            "a method either retries or hedges (A6): retryPolicy and hedgingPolicy are both set",
        ));
    }
    Ok(MethodConfig {
        retry,
        hedge,
        timeout,
    })
}

/// `maxAttempts` of a retry or hedging policy at `path`: an integer greater
/// than 1, above 5 counted as 5 (A6).
fn max_attempts(value: &Value, path: &str) -> Result<u32> {
    let attempts = integer(value, path)?;
    if attempts <= 1.0 {
        return Err(ServiceConfigError::new(
            path,
            format!("must be greater than 1, got {attempts}"),
        ));
    }
    Ok(if attempts >= f64::from(MAX_ATTEMPTS_LIMIT) {
        MAX_ATTEMPTS_LIMIT
    } else {
        attempts as u32
    })
}

/// A list of status codes at `path`.
fn status_codes(value: &Value, path: &str) -> Result<(RetryableCodes, usize)> {
    let list = array(value, path)?;
    let mut codes = RetryableCodes::empty();
    for (i, code) in list.iter().enumerate() {
        codes = codes.with(status_code(code, &format!("{path}[{i}]"))?);
    }
    Ok((codes, list.len()))
}

fn hedging_policy(value: &Value, path: &str) -> Result<Hedge> {
    let map = object(value, path)?;
    let attempts_path = format!("{path}.maxAttempts");
    let attempts = field(map, "maxAttempts", path)?
        .ok_or_else(|| ServiceConfigError::new(&attempts_path, "is required"))?;
    let max_attempts = max_attempts(attempts, &attempts_path)?;
    // A6: a zero or absent delay sends every attempt at once.
    let delay = match field(map, "hedgingDelay", path)? {
        Some(v) => duration(v, &format!("{path}.hedgingDelay"), false)?,
        None => Duration::ZERO,
    };
    let non_fatal = match field(map, "nonFatalStatusCodes", path)? {
        Some(v) => status_codes(v, &format!("{path}.nonFatalStatusCodes"))?.0,
        None => RetryableCodes::empty(),
    };
    Ok(Hedge {
        max_attempts,
        delay,
        non_fatal,
    })
}

fn retry_policy(value: &Value, path: &str) -> Result<Retry> {
    let map = object(value, path)?;
    let required = |name: &str| {
        field(map, name, path)?
            .ok_or_else(|| ServiceConfigError::new(&format!("{path}.{name}"), "is required"))
    };

    // A6: values above 5 are treated as 5, not an error.
    let max_attempts = max_attempts(required("maxAttempts")?, &format!("{path}.maxAttempts"))?;

    let initial_backoff = duration(
        required("initialBackoff")?,
        &format!("{path}.initialBackoff"),
        true,
    )?;
    let max_backoff = duration(required("maxBackoff")?, &format!("{path}.maxBackoff"), true)?;

    let multiplier_path = format!("{path}.backoffMultiplier");
    let multiplier = number(required("backoffMultiplier")?, &multiplier_path)?;
    // `number` only returns finite values, so this is the whole check.
    if multiplier <= 0.0 {
        return Err(ServiceConfigError::new(
            &multiplier_path,
            format!("must be greater than 0, got {multiplier}"),
        ));
    }

    let codes_path = format!("{path}.retryableStatusCodes");
    let (codes, listed) = status_codes(required("retryableStatusCodes")?, &codes_path)?;
    if listed == 0 {
        return Err(ServiceConfigError::new(&codes_path, "must not be empty"));
    }

    let per_attempt = match field(map, "perAttemptRecvTimeout", path)? {
        Some(v) => Some(duration(
            v,
            &format!("{path}.perAttemptRecvTimeout"),
            // C-core, the client that reads it: "must be greater than 0".
            true,
        )?),
        None => None,
    };

    Ok(Retry {
        max_attempts,
        initial_backoff,
        max_backoff,
        multiplier,
        codes,
        per_attempt,
    })
}

fn throttling_of(value: &Value, path: &str) -> Result<(f64, f64)> {
    let map = object(value, path)?;
    let get = |name: &str| {
        let at = format!("{path}.{name}");
        let value =
            field(map, name, path)?.ok_or_else(|| ServiceConfigError::new(&at, "is required"))?;
        Ok::<_, ServiceConfigError>((number(value, &at)?, at))
    };
    let (max, max_path) = get("maxTokens")?;
    if !(max > 0.0 && max <= 1000.0) {
        return Err(ServiceConfigError::new(
            &max_path,
            format!("must be in (0, 1000], got {max}"),
        ));
    }
    let (ratio, ratio_path) = get("tokenRatio")?;
    if ratio <= 0.0 {
        return Err(ServiceConfigError::new(
            &ratio_path,
            format!("must be greater than 0, got {ratio}"),
        ));
    }
    Ok((max, ratio))
}

/// The field `name` of the object at `path`, if present and not `null`
/// (protobuf JSON reads `null` as unset). Keys match whatever their ASCII
/// case, as grpc-go's JSON decoding matches them (`"MaxAttempts"`); a key
/// given twice in two spellings is an error naming both.
fn field<'a>(map: &'a Map<String, Value>, name: &str, path: &str) -> Result<Option<&'a Value>> {
    let mut found: Option<(&String, &Value)> = None;
    for (key, value) in map {
        if !key.eq_ignore_ascii_case(name) {
            continue;
        }
        if let Some((first, _)) = found {
            return Err(ServiceConfigError::new(
                &join(path, name),
                format!("given twice, as {first:?} and {key:?}"),
            ));
        }
        found = Some((key, value));
    }
    Ok(found.map(|(_, v)| v).filter(|v| !v.is_null()))
}

/// The path of field `name` in the object at `path`.
fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

fn object<'a>(value: &'a Value, path: &str) -> Result<&'a Map<String, Value>> {
    value.as_object().ok_or_else(|| {
        ServiceConfigError::new(path, format!("must be an object, got {}", kind(value)))
    })
}

fn array<'a>(value: &'a Value, path: &str) -> Result<&'a Vec<Value>> {
    value.as_array().ok_or_else(|| {
        ServiceConfigError::new(path, format!("must be an array, got {}", kind(value)))
    })
}

fn string_or_empty(map: &Map<String, Value>, name: &str, path: &str) -> Result<String> {
    match field(map, name, path)? {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(ServiceConfigError::new(
            &format!("{path}.{name}"),
            format!("must be a string, got {}", kind(other)),
        )),
    }
}

fn number(value: &Value, path: &str) -> Result<f64> {
    value.as_f64().filter(|n| n.is_finite()).ok_or_else(|| {
        ServiceConfigError::new(path, format!("must be a number, got {}", kind(value)))
    })
}

/// A JSON number with no fractional part (`3` or `3.0`), as a float: large
/// values stay representable.
fn integer(value: &Value, path: &str) -> Result<f64> {
    let n = number(value, path)?;
    if n.fract() != 0.0 {
        return Err(ServiceConfigError::new(
            path,
            format!("must be an integer, got {n}"),
        ));
    }
    Ok(n)
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A status code: an integer 0–16, or a code's name in any case.
fn status_code(value: &Value, path: &str) -> Result<Code> {
    match value {
        Value::Number(_) => {
            let n = integer(value, path)?;
            if (0.0..=16.0).contains(&n) {
                Ok(Code::from_i32(n as i32))
            } else {
                Err(ServiceConfigError::new(
                    path,
                    format!("is not a gRPC status code (0 to 16): {n}"),
                ))
            }
        }
        Value::String(name) => (0..=16)
            .map(Code::from_i32)
            .find(|code| code_name(*code).eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                ServiceConfigError::new(path, format!("is not a gRPC status code name: {name:?}"))
            }),
        other => Err(ServiceConfigError::new(
            path,
            format!("must be a status code name or number, got {}", kind(other)),
        )),
    }
}

/// A proto3 JSON duration string; `positive` requires it greater than 0,
/// otherwise it must not be negative.
fn duration(value: &Value, path: &str, positive: bool) -> Result<Duration> {
    let Value::String(text) = value else {
        return Err(ServiceConfigError::new(
            path,
            format!(
                "must be a duration string like \"0.1s\", got {}",
                kind(value)
            ),
        ));
    };
    let malformed = || {
        ServiceConfigError::new(
            path,
            format!("{text:?} is not a duration: seconds, up to 9 decimals, and \"s\" (\"0.1s\")"),
        )
    };
    let (negative, parsed) = parse_duration(text).ok_or_else(malformed)?;
    if negative && !parsed.is_zero() {
        return Err(ServiceConfigError::new(
            path,
            format!("must not be negative, got {text:?}"),
        ));
    }
    if positive && parsed.is_zero() {
        return Err(ServiceConfigError::new(
            path,
            format!("must be greater than 0, got {text:?}"),
        ));
    }
    Ok(parsed)
}

/// `[+-]?(\d*)(\.\d{1,9})?s` with at least one digit, at most
/// [`MAX_SECONDS`]: the sign and the magnitude.
fn parse_duration(text: &str) -> Option<(bool, Duration)> {
    let body = text.strip_suffix('s')?;
    let (negative, body) = match body.as_bytes().first() {
        Some(b'-') => (true, &body[1..]),
        Some(b'+') => (false, &body[1..]),
        _ => (false, body),
    };
    let (whole, fraction) = match body.split_once('.') {
        Some((whole, fraction)) => (whole, Some(fraction)),
        None => (body, None),
    };
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || !fraction.is_none_or(|f| digits(f) && f.len() <= 9) {
        return None;
    }
    if whole.is_empty() && fraction.is_none_or(str::is_empty) {
        return None;
    }
    let seconds = if whole.is_empty() {
        0
    } else {
        // Digits only, but possibly too many for a u64: too long is too large.
        whole.parse::<u64>().ok().filter(|s| *s <= MAX_SECONDS)?
    };
    let nanos = match fraction {
        Some(f) if !f.is_empty() => {
            let scale = 10u32.pow(9 - f.len() as u32);
            f.parse::<u32>().ok()? * scale
        }
        _ => 0,
    };
    Some((negative, Duration::new(seconds, nanos)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn parse(json: &str) -> ServiceConfig {
        ServiceConfig::from_json(json).unwrap_or_else(|e| panic!("{e}\n{json}"))
    }

    fn reject(json: &str) -> ServiceConfigError {
        match ServiceConfig::from_json(json) {
            Ok(config) => panic!("accepted: {json}\n{config:?}"),
            Err(e) => e,
        }
    }

    /// A config with one method entry for `foo/Bar` holding `body`.
    fn method(body: &str) -> String {
        format!(
            r#"{{"methodConfig": [{{"name": [{{"service": "foo", "method": "Bar"}}], {body}}}]}}"#
        )
    }

    fn retry(fields: &str) -> String {
        method(&format!(r#""retryPolicy": {{{fields}}}"#))
    }

    const GOOD: &str = r#""maxAttempts": 2, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
        "backoffMultiplier": 1.0, "retryableStatusCodes": ["UNAVAILABLE"]"#;

    #[test]
    fn durations_read_as_grpc_go_reads_them() {
        // grpc-go's TestParseDuration, plus proto3's bounds.
        for (text, want) in [
            ("1s", Duration::from_secs(1)),
            ("1.1s", 1100 * MS),
            ("1.s", Duration::from_secs(1)),
            ("1.0s", Duration::from_secs(1)),
            (".002s", 2 * MS),
            (".002000s", 2 * MS),
            ("0.003s", 3 * MS),
            ("0.000004s", Duration::from_micros(4)),
            ("5000.000000009s", Duration::new(5000, 9)),
            ("4999.999999999s", Duration::new(4999, 999_999_999)),
            ("+1.5s", 1500 * MS),
            ("315576000000s", Duration::from_secs(MAX_SECONDS)),
        ] {
            assert_eq!(parse_duration(text), Some((false, want)), "{text}");
        }
        assert_eq!(parse_duration("-1s"), Some((true, Duration::from_secs(1))));
        for bad in [
            "1",
            "s",
            ".s",
            "1 s",
            " 1s",
            "1ms",
            "1.1.1s",
            "Xs",
            "as",
            ".0000000001s",
            "--1s",
            "+-1s",
            "1.+5s",
            "315576000001s",
            "99999999999999999999999s",
            "",
            "-",
            "+s",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_full_config_gives_the_policies_grpc_would_use() {
        let config = parse(
            r#"{
              "loadBalancingPolicy": "round_robin",
              "methodConfig": [
                { "name": [{}],
                  "retryPolicy": { "maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                                   "backoffMultiplier": 2, "retryableStatusCodes": [14] } },
                { "name": [{ "service": "foo" }],
                  "timeout": "5s",
                  "retryPolicy": { "maxAttempts": 2, "initialBackoff": "0.2s", "maxBackoff": "0.2s",
                                   "backoffMultiplier": 1.5, "retryableStatusCodes": ["unavailable", "Deadline_Exceeded"] } },
                { "name": [{ "service": "foo", "method": "Bar" }, { "service": "foo", "method": "Baz" }],
                  "waitForReady": true,
                  "retryPolicy": { "maxAttempts": 7, "initialBackoff": ".05s", "maxBackoff": "2s",
                                   "backoffMultiplier": 3, "retryableStatusCodes": ["RESOURCE_EXHAUSTED"],
                                   "perAttemptRecvTimeout": "0.3s" } },
                { "name": [{ "service": "foo", "method": "Write" }], "timeout": "1s" }
              ],
              "retryThrottling": { "maxTokens": 10, "tokenRatio": 0.5466 }
            }"#,
        );
        let table = config.policies(&RetryPolicy::default());

        let default = table.policy_for("/other.Service/Any");
        assert_eq!(default.max_attempts(), 3);
        assert_eq!(default.base_delay(), 100 * MS);
        assert_eq!(default.max_delay(), Duration::from_secs(1));
        assert_eq!(
            default.retryable_codes(),
            RetryableCodes::empty().with(Code::Unavailable)
        );
        assert_eq!(
            default.jitter(),
            0.2,
            "the base policy's jitter (A6: ±20 %)"
        );

        let service = table.policy_for("/foo/Other");
        assert_eq!(service.max_attempts(), 2);
        assert_eq!(service.backoff_multiplier(), 1.5);
        assert_eq!(
            service.retryable_codes(),
            RetryableCodes::empty()
                .with(Code::Unavailable)
                .with(Code::DeadlineExceeded),
            "names in any case"
        );
        assert_eq!(service.max_timeout(), Some(Duration::from_secs(5)));

        for name in ["/foo/Bar", "/foo/Baz"] {
            let method = table.policy_for(name);
            assert_eq!(method.max_attempts(), 5, "7 counts as 5 (A6)");
            assert_eq!(method.base_delay(), 50 * MS, "\".05s\"");
            assert_eq!(method.backoff_multiplier(), 3.0);
            assert_eq!(method.attempt_timeout(), Some(300 * MS));
            assert_eq!(method.max_timeout(), None, "the method's entry wins whole");
        }

        let write = table.policy_for("/foo/Write");
        assert_eq!(write.max_attempts(), 1, "no retryPolicy: not retried");
        assert_eq!(write.max_timeout(), Some(Duration::from_secs(1)));

        let throttle = config.retry_throttle();
        assert_eq!(throttle.max_tokens(), 10.0);
    }

    #[test]
    fn without_a_default_entry_unnamed_methods_are_not_retried() {
        let config = parse(&retry(GOOD));
        let table = config.policies(&RetryPolicy::default());
        assert_eq!(table.policy_for("/foo/Bar").max_attempts(), 2);
        assert_eq!(table.policy_for("/foo/Other").max_attempts(), 1);
        assert_eq!(
            config.retry_throttle().available(),
            f64::INFINITY,
            "no throttling"
        );
        // An entry without names is ignored; so is an empty document.
        let config = parse(&format!(
            r#"{{"methodConfig": [{{"retryPolicy": {{{GOOD}}}}}]}}"#
        ));
        assert_eq!(
            config
                .policies(&RetryPolicy::default())
                .policy_for("/foo/Bar")
                .max_attempts(),
            1
        );
        parse("{}");
        parse(r#"{"methodConfig": null, "retryThrottling": null}"#);
    }

    #[test]
    fn invalid_configs_name_the_path_and_the_rule() {
        let cases: Vec<(String, &str, &str)> = vec![
            // Names (grpc-go: errEmptyServiceNonEmptyMethod, errDuplicatedName).
            (
                r#"{"methodConfig": [{"name": [{"method": "Bar"}]}]}"#.into(),
                "methodConfig[0].name[0].method",
                "needs a service",
            ),
            (
                r#"{"methodConfig": [{"name": [{"service": "foo"}]}, {"name": [{"service": "foo"}]}]}"#.into(),
                "methodConfig[1].name[0]",
                "duplicate",
            ),
            (
                r#"{"methodConfig": [{"name": [{}]}, {"name": [{"service": ""}]}]}"#.into(),
                "methodConfig[1].name[0]",
                "duplicate",
            ),
            (
                r#"{"methodConfig": [{"name": [{"service": "a/b"}]}]}"#.into(),
                "methodConfig[0].name[0].service",
                "'/'",
            ),
            (
                r#"{"methodConfig": [{"name": [{"service": 1}]}]}"#.into(),
                "methodConfig[0].name[0].service",
                "must be a string",
            ),
            (r#"{"methodConfig": {}}"#.into(), "methodConfig", "must be an array"),
            (r#"[]"#.into(), "", "must be an object"),
            // retryPolicy, A6's validation.
            (
                retry(&GOOD.replace(r#""maxAttempts": 2"#, r#""maxAttempts": 1"#)),
                "methodConfig[0].retryPolicy.maxAttempts",
                "must be greater than 1, got 1",
            ),
            (
                retry(&GOOD.replace(r#""maxAttempts": 2"#, r#""maxAttempts": 2.5"#)),
                "methodConfig[0].retryPolicy.maxAttempts",
                "integer",
            ),
            (
                retry(&GOOD.replace(r#""maxAttempts": 2, "#, "")),
                "methodConfig[0].retryPolicy.maxAttempts",
                "is required",
            ),
            (
                retry(&GOOD.replace(r#""0.01s", "maxBackoff""#, r#""0s", "maxBackoff""#)),
                "methodConfig[0].retryPolicy.initialBackoff",
                "greater than 0",
            ),
            (
                retry(&GOOD.replace(r#""maxBackoff": "0.01s""#, r#""maxBackoff": "-1s""#)),
                "methodConfig[0].retryPolicy.maxBackoff",
                "negative",
            ),
            (
                retry(&GOOD.replace(r#""maxBackoff": "0.01s""#, r#""maxBackoff": "10ms""#)),
                "methodConfig[0].retryPolicy.maxBackoff",
                "not a duration",
            ),
            (
                retry(&GOOD.replace(r#""maxBackoff": "0.01s""#, r#""maxBackoff": 1"#)),
                "methodConfig[0].retryPolicy.maxBackoff",
                "duration string",
            ),
            (
                retry(&GOOD.replace("1.0", "0")),
                "methodConfig[0].retryPolicy.backoffMultiplier",
                "greater than 0",
            ),
            (
                retry(&GOOD.replace(r#"["UNAVAILABLE"]"#, "[]")),
                "methodConfig[0].retryPolicy.retryableStatusCodes",
                "must not be empty",
            ),
            (
                retry(&GOOD.replace(r#"["UNAVAILABLE"]"#, r#"["UNAVAILABLE", "NOT_A_CODE"]"#)),
                "methodConfig[0].retryPolicy.retryableStatusCodes[1]",
                "not a gRPC status code name",
            ),
            (
                retry(&GOOD.replace(r#"["UNAVAILABLE"]"#, "[17]")),
                "methodConfig[0].retryPolicy.retryableStatusCodes[0]",
                "0 to 16",
            ),
            (
                retry(&GOOD.replace(r#"["UNAVAILABLE"]"#, "[14.5]")),
                "methodConfig[0].retryPolicy.retryableStatusCodes[0]",
                "integer",
            ),
            (
                retry(&format!(r#"{GOOD}, "perAttemptRecvTimeout": "0s""#)),
                "methodConfig[0].retryPolicy.perAttemptRecvTimeout",
                "greater than 0",
            ),
            (
                method(r#""timeout": "3c""#),
                "methodConfig[0].timeout",
                "not a duration",
            ),
            (
                method(
                    r#""hedgingPolicy": {"maxAttempts": 3}, "retryPolicy": {"maxAttempts": 2,
                       "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2,
                       "retryableStatusCodes": [14]}"#,
                ),
                "methodConfig[0].hedgingPolicy",
                "either retries or hedges",
            ),
            (
                method(r#""hedgingPolicy": {"maxAttempts": 1}"#),
                "methodConfig[0].hedgingPolicy.maxAttempts",
                "greater than 1",
            ),
            (
                method(r#""hedgingPolicy": {"hedgingDelay": "1s"}"#),
                "methodConfig[0].hedgingPolicy.maxAttempts",
                "is required",
            ),
            (
                method(r#""hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": "-1s"}"#),
                "methodConfig[0].hedgingPolicy.hedgingDelay",
                "negative",
            ),
            (
                method(r#""hedgingPolicy": {"maxAttempts": 2, "nonFatalStatusCodes": ["NOPE"]}"#),
                "methodConfig[0].hedgingPolicy.nonFatalStatusCodes[0]",
                "status code",
            ),
            // retryThrottling (grpc-go: maxTokens in (0, 1000], tokenRatio > 0).
            (
                r#"{"retryThrottling": {"maxTokens": 1001, "tokenRatio": 0.1}}"#.into(),
                "retryThrottling.maxTokens",
                "(0, 1000]",
            ),
            (
                r#"{"retryThrottling": {"maxTokens": 0, "tokenRatio": 0.1}}"#.into(),
                "retryThrottling.maxTokens",
                "(0, 1000]",
            ),
            (
                r#"{"retryThrottling": {"maxTokens": 10, "tokenRatio": -0.1}}"#.into(),
                "retryThrottling.tokenRatio",
                "greater than 0",
            ),
            (
                r#"{"retryThrottling": {"maxTokens": 10}}"#.into(),
                "retryThrottling.tokenRatio",
                "is required",
            ),
        ];
        for (json, path, rule) in cases {
            let e = reject(&json);
            assert_eq!(e.path(), path, "{json}\n{e}");
            assert!(e.rule().contains(rule), "{json}\nwanted {rule:?} in {e}");
            assert!(e.to_string().contains(path), "{e}");
        }
        // The rule in the issue's own words.
        let e = reject(&format!(
            r#"{{"methodConfig": [{{"name": [{{"service": "a"}}]}}, {{"name": [{{"service": "b"}}], "retryPolicy": {{{}}}}}]}}"#,
            GOOD.replace(r#""maxAttempts": 2"#, r#""maxAttempts": 1"#)
        ));
        assert_eq!(
            e.to_string(),
            "invalid service config: methodConfig[1].retryPolicy.maxAttempts: must be greater than 1, got 1"
        );
    }

    #[test]
    fn unknown_fields_are_ignored_and_json_errors_are_typed() {
        let config = parse(&method(r#""somethingNew": {"x": [1]}"#));
        assert_eq!(config.not_applied().count(), 0);
        let e = reject(r#"{"methodConfig": [}"#);
        assert_eq!(e.path(), "");
        assert!(e.rule().starts_with("not valid JSON"), "{e}");
    }

    #[test]
    fn fields_not_applied_are_listed_with_what_to_use_instead() {
        let config = parse(&method(
            r#""waitForReady": true, "maxRequestMessageBytes": 1024, "maxResponseMessageBytes": 9"#,
        ));
        let paths: Vec<&str> = config.not_applied().map(|(path, _)| path).collect();
        assert_eq!(
            paths,
            [
                "methodConfig[0].waitForReady",
                "methodConfig[0].maxRequestMessageBytes",
                "methodConfig[0].maxResponseMessageBytes",
            ]
        );
        let (_, instead) = config.not_applied().next().unwrap();
        assert!(instead.contains("UNAVAILABLE"), "{instead}");
        let config = parse(
            r#"{"healthCheckConfig": {"serviceName": "x"}, "loadBalancingConfig": [{"round_robin": {}}]}"#,
        );
        let paths: Vec<&str> = config.not_applied().map(|(path, _)| path).collect();
        assert_eq!(paths, ["loadBalancingConfig", "healthCheckConfig"]);
        // `false` or `null` asks for nothing the layer would not do anyway,
        // but is said too: a config is read as written.
        let config = parse(&method(r#""waitForReady": false"#));
        assert_eq!(config.not_applied().count(), 1);
        let config = parse(&method(r#""waitForReady": null"#));
        assert_eq!(config.not_applied().count(), 0, "null is unset");
    }

    #[test]
    fn keys_are_read_whatever_their_case_as_grpc_go_reads_them() {
        // grpc-go's own retry example (examples/features/retry/client).
        let config = parse(
            r#"{
              "methodConfig": [{
                "name": [{"service": "grpc.examples.echo.Echo"}],
                "waitForReady": true,
                "retryPolicy": {
                  "MaxAttempts": 4,
                  "InitialBackoff": ".01s",
                  "MaxBackoff": ".01s",
                  "BackoffMultiplier": 1.0,
                  "RetryableStatusCodes": [ "UNAVAILABLE" ]
                }
              }]
            }"#,
        );
        let policy = config
            .policies(&RetryPolicy::default())
            .policy_for("/grpc.examples.echo.Echo/UnaryEcho")
            .clone();
        assert_eq!(policy.max_attempts(), 4);
        assert_eq!(policy.base_delay(), 10 * MS);
        assert_eq!(policy.max_delay(), 10 * MS);
        assert_eq!(policy.backoff_multiplier(), 1.0);
        assert!(policy.retryable_codes().contains(Code::Unavailable));
        // Every field, at every level.
        let config = parse(
            r#"{"MethodConfig": [{"NAME": [{"Service": "foo", "METHOD": "Bar"}], "Timeout": "1s",
                "RETRYPOLICY": {"maxattempts": 2, "initialbackoff": "1s", "maxbackoff": "1s",
                "backoffmultiplier": 2, "retryablestatuscodes": [14]}}],
                "RetryThrottling": {"MAXTOKENS": 10, "TOKENRATIO": 0.5}}"#,
        );
        let policy = config
            .policies(&RetryPolicy::default())
            .policy_for("/foo/Bar")
            .clone();
        assert_eq!(policy.max_attempts(), 2);
        assert_eq!(policy.max_timeout(), Some(Duration::from_secs(1)));
        assert_eq!(config.retry_throttle().available(), 10.0);
    }

    #[test]
    fn a_key_given_twice_in_two_spellings_is_an_error_naming_both() {
        let e = reject(&retry(
            r#""maxAttempts": 2, "MaxAttempts": 4, "initialBackoff": "1s", "maxBackoff": "1s",
               "backoffMultiplier": 2, "retryableStatusCodes": [14]"#,
        ));
        assert_eq!(e.path(), "methodConfig[0].retryPolicy.maxAttempts");
        assert_eq!(
            e.rule(),
            r#"given twice, as "MaxAttempts" and "maxAttempts""#
        );
        let e = reject(r#"{"methodConfig": [], "methodconfig": []}"#);
        assert_eq!(e.path(), "methodConfig");
        assert!(e.rule().contains("\"methodconfig\""), "{e}");
    }

    #[test]
    fn a_hook_sets_what_a6_has_no_field_for_on_hedged_methods_only() {
        let config: ServiceConfig = r#"{"methodConfig": [
            {"name": [{"service": "s.S", "method": "Hedged"}],
             "timeout": "1s",
             "hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "0.02s"}},
            {"name": [{"service": "s.S", "method": "Retried"}],
             "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.01s",
                             "maxBackoff": "0.1s", "backoffMultiplier": 2,
                             "retryableStatusCodes": ["UNAVAILABLE"]}}
        ]}"#
        .parse()
        .unwrap();
        let cap = |policies: &MethodPolicies, path: &str| {
            policies
                .policy_for(path)
                .hedge
                .as_ref()
                .map(|plan| plan.extra_load.as_ref().map(|(fraction, _)| *fraction))
        };
        let base = RetryPolicy::default();
        // A6: no cap but the throttle.
        let plain = config.policies(&base);
        assert_eq!(cap(&plain, "/s.S/Hedged"), Some(None));
        let capped = config
            .policies_with_hedging(&base, |hedge| hedge.with_max_extra_load(Some(0.1)))
            .unwrap();
        assert_eq!(cap(&capped, "/s.S/Hedged"), Some(Some(0.1)));
        let hedged = capped.policy_for("/s.S/Hedged");
        // The config's own fields stay.
        assert_eq!(hedged.max_attempts(), 3);
        assert_eq!(hedged.hedge_delay(), Some(Duration::from_millis(20)));
        assert_eq!(hedged.max_timeout(), Some(Duration::from_secs(1)));
        assert_eq!(
            cap(&capped, "/s.S/Retried"),
            None,
            "a retried method is left"
        );
        // The hook's error is the caller's.
        let error = config
            .policies_with_hedging(&base, |hedge| hedge.with_max_extra_load(Some(9.0)))
            .unwrap_err();
        assert!(error.to_string().contains("max_extra_load"), "{error}");
    }

    #[test]
    fn policies_read_from_a_config_back_off_as_a6_says_today() {
        let config = parse(&retry(
            r#""maxAttempts": 5, "initialBackoff": "0.02s", "maxBackoff": "0.05s",
               "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]"#,
        ));
        // Whatever jitter the base policy has, or full jitter asked of it.
        for base in [
            RetryPolicy::default(),
            RetryPolicy::new(3, 20 * MS, 500 * MS, 0.9).unwrap(),
            RetryPolicy::new(3, 20 * MS, 500 * MS, 0.0)
                .unwrap()
                .with_full_jitter(),
        ] {
            let policy = config.policies(&base).policy_for("/foo/Bar").clone();
            assert!(!policy.full_jitter());
            assert_eq!(policy.jitter(), 0.2);
            // Retry 3's raw delay is the max, 50 ms: A6 lets it go over it.
            for (retry, raw) in [(1, 20.0), (2, 40.0), (3, 50.0)] {
                let draws: Vec<f64> = (0..4000)
                    .map(|_| policy.delay_before(retry).as_secs_f64() * 1e3 / raw)
                    .collect();
                assert!(
                    draws.iter().all(|d| (0.8 - 1e-9..=1.2 + 1e-9).contains(d)),
                    "retry {retry}: every delay within [0.8, 1.2] of {raw} ms"
                );
                let (low, high) = draws
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(l, h), d| (l.min(*d), h.max(*d)));
                assert!(
                    low < 0.805 && high > 1.195,
                    "retry {retry}: both ends reached, got [{low}, {high}]"
                );
            }
        }
        let policy = config
            .policies(&RetryPolicy::default())
            .policy_for("/foo/Bar")
            .clone();
        // A listed code is retried whatever else the status carries, as A6,
        // grpc-go and grpc-java retry it.
        assert_eq!(
            policy.retryable_codes().when(Code::ResourceExhausted),
            Some(crate::RetryWhen::Always)
        );
    }

    #[test]
    fn a_hedging_policy_gives_a_hedging_method() {
        let config = parse(&method(
            r#""timeout": "2s", "hedgingPolicy": {"maxAttempts": 9, "hedgingDelay": "0.01s",
               "nonFatalStatusCodes": ["UNAVAILABLE", "internal"]}"#,
        ));
        let base = RetryPolicy::default().with_idempotency_key(false);
        let table = config.policies(&base);
        let policy = table.policy_for("/foo/Bar");
        assert_eq!(policy.hedge_delay(), Some(10 * MS));
        assert_eq!(policy.max_attempts(), 5, "above five counts as five");
        assert_eq!(policy.max_timeout(), Some(Duration::from_secs(2)));
        let codes = policy.retryable_codes();
        assert!(codes.contains(Code::Unavailable) && codes.contains(Code::Internal));
        assert!(!codes.contains(Code::Aborted));
        assert!(!policy.idempotency_key, "the base's settings");
        // Another method is not retried, nor hedged.
        assert_eq!(table.policy_for("/foo/Baz").hedge_delay(), None);
        // No delay, no codes: all at once, and every code fatal.
        let config = parse(&method(r#""hedgingPolicy": {"MaxAttempts": 3}"#));
        let policy = config.policies(&base).policy_for("/foo/Bar").clone();
        assert_eq!(policy.hedge_delay(), Some(Duration::ZERO));
        assert_eq!(policy.retryable_codes(), RetryableCodes::empty());
    }

    #[test]
    fn max_attempts_above_five_count_as_five_however_large() {
        for n in ["6", "5", "1e300", "18446744073709551616"] {
            let config = parse(&retry(
                &GOOD.replace(r#""maxAttempts": 2"#, &format!(r#""maxAttempts": {n}"#)),
            ));
            let table = config.policies(&RetryPolicy::default());
            assert_eq!(table.policy_for("/foo/Bar").max_attempts(), 5, "{n}");
        }
        let e = reject(&retry(
            &GOOD.replace(r#""maxAttempts": 2"#, r#""maxAttempts": -7"#),
        ));
        assert!(e.rule().contains("greater than 1"), "{e}");
    }

    #[test]
    fn a_max_backoff_below_the_initial_one_waits_the_max() {
        // A6 allows it (min(initial · multiplier^n, max)); RetryPolicy::new would not.
        let config = parse(&retry(
            &GOOD.replace(r#""maxBackoff": "0.01s""#, r#""maxBackoff": "0.005s""#),
        ));
        let base = RetryPolicy::new(3, 20 * MS, 500 * MS, 0.0).unwrap();
        let table = config.policies(&base);
        // The raw backoff is the max; A6's jitter draws from 0.8 to 1.2 of it.
        assert_eq!(table.policy_for("/foo/Bar").jittered(1, 1.0), 5 * MS);
        let delay = table.policy_for("/foo/Bar").delay_before(1);
        assert!(delay >= 4 * MS && delay <= 6 * MS, "{delay:?}");
    }

    #[test]
    fn a_config_of_thousands_of_names_keeps_every_one() {
        // Each method of 100 services its own policy, numbered by its attempts.
        let entries: Vec<String> = (0..4000)
            .map(|i| {
                let fields = GOOD.replace(
                    r#""maxAttempts": 2"#,
                    &format!(r#""maxAttempts": {}"#, 2 + i % 4),
                );
                format!(
                    r#"{{"name": [{{"service": "s{}", "method": "M{i}"}}], "retryPolicy": {{{fields}}}}}"#,
                    i % 100
                )
            })
            .collect();
        let json = format!(r#"{{"methodConfig": [{}]}}"#, entries.join(","));
        let table = parse(&json).policies(&RetryPolicy::default());
        for i in 0..4000 {
            let path = format!("/s{}/M{i}", i % 100);
            assert_eq!(table.policy_for(&path).max_attempts(), 2 + i % 4, "{path}");
        }
        assert_eq!(table.policy_for("/s1/Other").max_attempts(), 1);
    }
}
