//! Error types.

use std::fmt;

/// A retry setting was out of range.
///
/// Returned by [`RetryPolicy::new`](crate::RetryPolicy::new),
/// [`RetryBudget::new`](crate::RetryBudget::new) and the policy's `with_*`
/// settings. The message names the offending field and the range it must lie
/// in, so a misconfiguration read from a file is easy to trace.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    field: &'static str,
    reason: String,
}

impl ConfigError {
    pub(crate) fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }

    /// The name of the setting that was rejected, e.g. `"max_attempts"`.
    pub fn field(&self) -> &'static str {
        self.field
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid retry setting `{}`: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}
