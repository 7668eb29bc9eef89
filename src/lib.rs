//! Tether: a durable, bounded agent worker.
//!
//! [`kernel`] is the sans-IO agent loop; [`model`] and [`tools`] are the things it calls;
//! [`sim`] drives the kernel in memory (the design document's programs and benchmarks).

pub mod api;
pub mod cli;
pub mod clock;
pub mod config;
pub mod console;
pub mod filewatch;
pub mod group;
pub mod httpd;
pub mod kernel;
pub mod limits;
pub mod local;
pub mod mcp;
pub mod metrics;
pub mod model;
pub mod net;
pub mod operator;
pub mod otlp;
pub mod replay;
pub mod sim;
pub mod store;
#[cfg(test)]
mod testing;
pub mod tools;
pub mod worker;
