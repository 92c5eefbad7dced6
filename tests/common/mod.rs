//! Shared by the end-to-end tests.

#![allow(dead_code, unreachable_pub, unused_imports)]

pub mod library;
pub mod raw;

pub use library::pb;
pub use library::{Instance, Shelf};
