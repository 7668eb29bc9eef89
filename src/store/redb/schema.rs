//! Every redb table of the worker's database, in one place, and the schema version.
//!
//! Values are rows (see [`super::rows`]) in the checksummed envelope of [`super::codec`]. Keys
//! are plain redb types so that ranges and order come for free.

use redb::TableDefinition;

/// The schema this build writes and understands. A file with a larger number was written by a
/// newer Tether and is refused, never guessed at. Version 1 stored JSON records, a task as one
/// record; version 2 stores bincode rows in an envelope, a task as a row, a spec and blobs.
/// Version 3 adds the list indexes (by status, user and creation, and the status counts; see
/// [`super::list`]), built from the task rows when an older file is opened for writing.
/// Version 4 adds flow control (delayed starts, concurrency keys and slots; see
/// [`super::flow`]): a version-3 file gets the tables, empty, when opened for writing, and
/// an older Tether refuses a version-4 file rather than ignore its delayed tasks and limits.
/// Opening a version-1 or -2 file for writing migrates it (see `open`).
pub const SCHEMA_VERSION: u64 = 4;

/// "schema_version" -> u64; "task_seq" -> next task number; "event_seq", "ready_seq",
/// "note_seq"; "db_id" -> the database id.
pub const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// task id -> task row: what steps and operators change (queue status, budget, state, lease).
pub const TASKS: TableDefinition<&str, &[u8]> = TableDefinition::new("tasks");
/// task id -> spec row: what enqueue fixed (key, model, tool settings, creation time).
pub const TASK_SPECS: TableDefinition<&str, &[u8]> = TableDefinition::new("task_specs");
/// digest -> blob: a script's replies or a tool catalog, stored once for all tasks using it.
pub const BLOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("blobs");
/// digest -> how many task specs refer to the blob; at zero the blob is deleted.
pub const BLOB_REFS: TableDefinition<&str, u64> = TableDefinition::new("blob_refs");
/// (-priority, sequence) -> task id: the ready queue, highest priority first, then FIFO.
pub const READY: TableDefinition<(i64, u64), &str> = TableDefinition::new("ready");
/// task id -> lease expiry at claim time: the index of the tasks some worker is running; the
/// expiry renewed by each step commit is in the task record.
pub const RUNNING: TableDefinition<&str, u64> = TableDefinition::new("running");
/// task id -> when its approval wait runs out (ms since the epoch): the suspended tasks, so
/// that expiring waits reads only them.
pub const WAITING: TableDefinition<&str, u64> = TableDefinition::new("waiting");
/// task id -> when it was held: the tasks whose write has an unknown outcome.
pub const HELD: TableDefinition<&str, u64> = TableDefinition::new("held");
/// task id -> why its record could not be decoded: quarantined tasks, listed and never run,
/// so one damaged record never stops the queue.
pub const DAMAGED: TableDefinition<&str, &str> = TableDefinition::new("damaged");
/// enqueue key -> task id: a retried `worker enqueue --key K` finds its task here.
pub const ENQUEUE_KEYS: TableDefinition<&str, &str> = TableDefinition::new("enqueue_keys");
/// call key -> call record: a write's intent, then its result, with the digest of tool and args.
pub const CALL_KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("call_keys");
/// (task id, span id) -> span.
pub const SPANS: TableDefinition<(&str, u32), &[u8]> = TableDefinition::new("spans");
/// (task id, step) -> the model reply of that step, for recovery mid-step and for replay.
pub const REPLIES: TableDefinition<(&str, u32), &[u8]> = TableDefinition::new("replies");
/// sequence -> audit event (who, what, when, why).
pub const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
/// sequence -> long-term memory note.
pub const NOTES: TableDefinition<u64, &[u8]> = TableDefinition::new("notes");

/// The name of every table: a file missing one gets it at open.
pub const ALL_TABLES: [&str; 24] = [
    "meta",
    "tasks",
    "task_specs",
    "blobs",
    "blob_refs",
    "ready",
    "running",
    "waiting",
    "held",
    "damaged",
    "enqueue_keys",
    "call_keys",
    "spans",
    "replies",
    "events",
    "notes",
    "by_status",
    "by_user",
    "created",
    "status_counts",
    "delayed",
    "concurrency_keys",
    "slots",
    "slot_holders",
];

pub const META_SCHEMA: &str = "schema_version";
pub const META_TASK_SEQ: &str = "task_seq";
pub const META_READY_SEQ: &str = "ready_seq";
pub const META_EVENT_SEQ: &str = "event_seq";
pub const META_NOTE_SEQ: &str = "note_seq";
/// The database id (48 random bits) that prefixes every call key.
pub const META_DB_ID: &str = "db_id";
