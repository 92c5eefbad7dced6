//! tonic-retry (docs to come)
mod attempt;
mod body;
mod budget;
mod classify;
mod deadline;
mod error;
pub mod future;
mod layer;
mod marks;
mod metrics;
mod policy;
pub mod replay;
mod service;

pub use body::ResponseBody;
pub use budget::RetryBudget;
pub use error::ConfigError;
pub use layer::RetryLayer;
pub use marks::{ALREADY_TRIED, AlreadyTried, IDEMPOTENCY_KEY, INSTANCE_ID, PREVIOUS_ATTEMPTS};
pub use metrics::RetryMetrics;
pub use policy::{MAX_ATTEMPTS_LIMIT, RetryPolicy, RetryableCodes};
pub use replay::ReplayBody;
pub use service::RetryService;
