//! Shared by the end-to-end tests.

#![allow(dead_code, unreachable_pub)]

pub mod library;

pub use library::pb;
pub use library::{Instance, Shelf};
