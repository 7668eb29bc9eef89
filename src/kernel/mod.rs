//! The bounded agent kernel: sans-IO and deterministic.
//!
//! It owns the task state, the budget, view rendering, plan validation, the step transition,
//! stop reasons, spans, the closing message and post-mortem, and the memory policy. It reads no
//! clock and does no I/O: it asks a driver for work through [`session::Action`] and folds the
//! results in. Nothing here may import storage, worker, model, tool or network code (a test in
//! `tests/it/kernel_purity.rs` checks this).

pub mod api;
pub mod budget;
pub mod catalog;
pub mod conversation;
pub mod io;
pub mod json;
pub mod memory;
pub mod person;
pub mod plan;
pub mod policy;
pub mod reply;
pub mod report;
pub mod session;
pub mod state;
pub mod trace;
pub mod view;

pub use catalog::{Access, Catalog, Route, ToolSpec};
pub use reply::RawReply;
pub use session::{
    Action, InputStyle, Keys, ModelError, ModelReply, ModelRequest, ResponseInfo, Run, Session,
    ToolReply, ToolRequest, Turn, TurnCall, Usage,
};
pub use state::{Budget, LastTurn, PlanStep, Status, StepStatus, StopReason, TaskState, ToolCall};
pub use trace::{Span, SpanKind, Trace};
