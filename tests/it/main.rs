//! The integration tests, as one test binary (the layout ripgrep uses): each module is what
//! was a `tests/*.rs` file; `common` holds the helpers they share (the binary run in a
//! temporary directory, the PostgreSQL cluster, the demo shop as a service, the MCP and
//! WebDriver peers). One binary links the crate once instead of once per file.

#[macro_use]
mod common;

mod api;
mod bad_input;
mod callbacks;
mod cli;
mod console;
mod corruption;
mod crash_recovery;
mod daemon;
pub(crate) mod exactly_once;
mod figures;
mod flow;
mod http;
mod in_flight;
mod kernel;
mod kernel_purity;
mod layout;
mod list;
mod local_api;
mod mcp;
mod mcp_tasks;
mod metrics;
pub(crate) mod models;
mod operator;
mod otlp;
mod paused;
mod postgres;
mod progress;
mod property;
mod rate_limits;
mod record_format;
mod rest_tools;
mod schedules;
mod settle;
mod several_hosts;
mod simulation;
mod wait;
