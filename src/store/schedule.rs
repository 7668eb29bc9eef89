//! Schedules as the database keeps them (`worker schedule add`): a cron expression in a time
//! zone, the task each tick enqueues (as a batch line would ask for it), what happens to ticks
//! missed while no daemon ran, whether it is paused, and the latest tick already fired. The
//! cron arithmetic is `operator::schedule`'s; this is the record both engines store (as JSON).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Ticks missed while no daemon ran (or the schedule was paused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CatchUp {
    /// The latest missed tick fires once; earlier ones are skipped.
    Latest,
    /// Missed ticks are skipped; only a tick found within a minute of its time fires.
    None,
}

impl CatchUp {
    pub fn as_str(self) -> &'static str {
        match self {
            CatchUp::Latest => "latest",
            CatchUp::None => "none",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub name: String,
    /// Five fields (minute to weekday) or six (with seconds first).
    pub cron: String,
    /// An IANA time zone (`Europe/Paris`); the expression's times are its wall clock.
    pub tz: String,
    pub catch_up: CatchUp,
    pub paused: bool,
    /// The task of each tick, as a batch line asks for it (`operator::submit::TaskRequest`).
    pub task: Value,
    /// The latest tick fired or skipped (ms); ticks after it are due. Starts at creation.
    pub last_tick_ms: u64,
    pub created_at_ms: u64,
    /// How many ticks enqueued a task.
    #[serde(default)]
    pub fired: u64,
}
