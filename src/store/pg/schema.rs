//! The PostgreSQL schema and its versioned migrations, applied at start under an advisory lock
//! (several daemons starting at once apply each migration once) and refused when the database
//! was migrated by a newer Tether.
//!
//! Queue fields are typed columns that the claim, recovery and operator queries filter on;
//! dynamic values are `jsonb` (budget, spec, lease, approval) or `json` where they hold text a
//! model or a tool returned (state, spans, replies, call args and results, event details):
//! `jsonb` cannot store the NUL character (`\u0000`) that such text may contain, `json` keeps
//! it as written. No index covers a column a step changes (state, lease expiry, elapsed time,
//! commit marker), and pages keep room (`fillfactor`), so a step's `UPDATE` can stay on its page
//! (a HOT update) without touching an index. `{s}` stands for the worker schema, `{t}` for the
//! document's store schema.

use postgres::Client;

use super::pool::db_error;
use crate::store::{Error, Result};

/// Each migration, in order; migration `i` brings the schema to version `i + 1`.
const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE {s}.meta (key text PRIMARY KEY, value text NOT NULL);
CREATE SEQUENCE {s}.task_seq;
CREATE SEQUENCE {s}.ready_seq;
CREATE TABLE {s}.tasks (
    id text PRIMARY KEY,
    num bigint NOT NULL,
    status text NOT NULL CHECK (status IN ('queued','running','suspended','held','finished','damaged')),
    priority bigint NOT NULL,
    ready_seq bigint,
    enqueue_key text UNIQUE,
    user_id text NOT NULL,
    token bigint NOT NULL DEFAULT 0,
    lease jsonb,
    lease_owner text,
    lease_expires_ms bigint,
    wait_until_ms bigint,
    held_at_ms bigint,
    suspended_at_ms bigint,
    approval_wait_ms bigint NOT NULL,
    cancel_requested text,
    created_at_ms bigint NOT NULL,
    updated_at_ms bigint NOT NULL,
    next_span_id integer NOT NULL DEFAULT 0,
    deadline_ms bigint NOT NULL,
    elapsed_ms bigint NOT NULL DEFAULT 0,
    claim_commit bigint,
    last_commit bigint,
    budget jsonb NOT NULL,
    spec jsonb NOT NULL,
    state json NOT NULL,
    settle json,
    approval jsonb,
    damaged text
) WITH (fillfactor = 70);
CREATE INDEX tasks_ready ON {s}.tasks (priority DESC, ready_seq) WHERE status = 'queued';
CREATE INDEX tasks_running ON {s}.tasks (id) WHERE status = 'running';
CREATE INDEX tasks_waiting ON {s}.tasks (wait_until_ms) WHERE wait_until_ms IS NOT NULL;
CREATE INDEX tasks_held ON {s}.tasks (num) WHERE held_at_ms IS NOT NULL;
CREATE INDEX tasks_claim_commit ON {s}.tasks (claim_commit) WHERE claim_commit IS NOT NULL;
CREATE TABLE {s}.calls (
    key text PRIMARY KEY,
    task_id text NOT NULL,
    step integer NOT NULL,
    tool text NOT NULL,
    args json NOT NULL,
    digest text NOT NULL,
    intent_at_ms bigint NOT NULL,
    result json,
    result_at_ms bigint
);
CREATE INDEX calls_task ON {s}.calls (task_id);
CREATE TABLE {s}.spans (task_id text NOT NULL, id integer NOT NULL, span json NOT NULL, PRIMARY KEY (task_id, id));
CREATE TABLE {s}.replies (task_id text NOT NULL, step integer NOT NULL, reply json NOT NULL, PRIMARY KEY (task_id, step));
CREATE TABLE {s}.events (
    seq bigserial PRIMARY KEY,
    at_ms bigint NOT NULL,
    task_id text,
    verb text NOT NULL,
    by_name text NOT NULL,
    reason text,
    detail json NOT NULL
);
CREATE INDEX events_task ON {s}.events (task_id);
CREATE TABLE {s}.notes (
    seq bigserial PRIMARY KEY,
    user_id text NOT NULL,
    text text NOT NULL,
    source text NOT NULL,
    created_at_s bigint NOT NULL,
    expires_at_s bigint NOT NULL
);
CREATE TABLE {s}.workers (
    owner text PRIMARY KEY,
    beat_at_ms bigint NOT NULL,
    expires_at_ms bigint NOT NULL
);
CREATE TABLE {s}.commits (id bigint PRIMARY KEY, at_ms bigint NOT NULL);
CREATE INDEX commits_at ON {s}.commits (at_ms);
CREATE TABLE {t}.orders (id text PRIMARY KEY, body jsonb NOT NULL);
CREATE TABLE {t}.ledger (seq bigserial PRIMARY KEY, scope text NOT NULL, effect jsonb NOT NULL, key text NOT NULL, user_id text NOT NULL);
CREATE TABLE {t}.done (key text NOT NULL, tool text NOT NULL, digest text NOT NULL, result json NOT NULL, PRIMARY KEY (key, tool));
CREATE TABLE {t}.arrivals (seq bigserial PRIMARY KEY, key text NOT NULL, tool text NOT NULL, digest text NOT NULL, outcome text NOT NULL);
CREATE TABLE {t}.idempotency (key text PRIMARY KEY, digest text NOT NULL, response json NOT NULL);
"#,
    r#"
CREATE INDEX tasks_num ON {s}.tasks (num);
CREATE INDEX tasks_status_num ON {s}.tasks (status, num);
CREATE INDEX tasks_user_num ON {s}.tasks (user_id, num);
"#,
    r#"
CREATE TABLE {s}.otlp_outbox (seq bigserial PRIMARY KEY, task_id text NOT NULL, spans int[] NOT NULL);
"#,
    // Exporters on several hosts claim outbox entries, so each batch is sent by one of them.
    r#"
ALTER TABLE {s}.otlp_outbox ADD COLUMN claimed_by bigint, ADD COLUMN claimed_until_ms bigint;
"#,
    // A marker inserted by a read-back after a lost acknowledgment carries that read-back's
    // nonce, so a read-back whose own answer was lost never takes its marker for the commit's.
    r#"
ALTER TABLE {s}.commits ADD COLUMN read_back bigint;
"#,
    // Whoever waits for a task's result (`worker wait`, the API's long poll) is woken when a
    // task settles: finishes, or starts waiting on a person. A trigger, so that every path that
    // settles a task (a step commit, a cancel, an expired approval wait) notifies; it fires
    // only on statements that set the status, never on a plain step.
    r#"
CREATE FUNCTION {s}.notify_settled() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '_settled', NEW.id);
    RETURN NULL;
END $$;
CREATE TRIGGER tasks_settled AFTER UPDATE OF status ON {s}.tasks FOR EACH ROW
    WHEN (NEW.status IN ('finished', 'suspended', 'held') AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {s}.notify_settled();
"#,
    // Completion callbacks waiting to be delivered (`store::callbacks`), each added by the
    // commit or decision that settled its task; senders on several hosts claim them.
    r#"
CREATE TABLE {s}.callbacks (
    seq bigserial PRIMARY KEY,
    id text NOT NULL,
    task_id text NOT NULL,
    url text NOT NULL,
    payload text NOT NULL,
    created_at_ms bigint NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    next_at_ms bigint NOT NULL,
    last_error text,
    claimed_by bigint,
    claimed_until_ms bigint
);
CREATE INDEX callbacks_due ON {s}.callbacks (next_at_ms);
"#,
    // PostgreSQL serializes the commits of transactions that `NOTIFY` (a database-wide lock
    // held through the commit's flush), which cost a third of the steps per second with 64
    // tasks in flight. So a settle notifies only while someone listens: each listening
    // session registers its pid in `waiters` under an exclusive lock, which waits for every
    // settling transaction that looked before and found no one (they commit first, so the
    // waiter's next read sees them); a row whose session is gone is ignored, and removed by
    // the next registration. Callbacks get a channel of their own, notified only by tasks
    // that asked for one.
    r#"
CREATE TABLE {s}.waiters (pid integer PRIMARY KEY, since timestamptz NOT NULL DEFAULT now());
CREATE OR REPLACE FUNCTION {s}.notify_settled() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM {s}.waiters w WHERE EXISTS (SELECT 1 FROM pg_stat_get_activity(w.pid))) THEN
        PERFORM pg_notify(TG_TABLE_SCHEMA || '_settled', NEW.id);
    END IF;
    RETURN NULL;
END $$;
CREATE FUNCTION {s}.notify_callback() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '_callbacks', NEW.task_id);
    RETURN NULL;
END $$;
CREATE TRIGGER callbacks_added AFTER INSERT ON {s}.callbacks FOR EACH ROW
    EXECUTE FUNCTION {s}.notify_callback();
"#,
    // Flow control: a task is not claimed before `not_before_ms` (a delayed start, or a wait
    // for its model's capacity); `concurrency_key` names the limit that bounds it, and a
    // running task that took one of its key's slots names it in `slot`; `slots.cap` is the
    // key's limit as the last claim that took a slot saw it. The trigger gives the
    // slot back in whatever statement moves the task out of `running`, so no path can miss it.
    r#"
ALTER TABLE {s}.tasks ADD COLUMN not_before_ms bigint, ADD COLUMN concurrency_key text, ADD COLUMN slot text;
CREATE INDEX tasks_scheduled ON {s}.tasks (not_before_ms) WHERE status = 'queued' AND not_before_ms IS NOT NULL;
CREATE TABLE {s}.slots (key text PRIMARY KEY, running integer NOT NULL, cap integer NOT NULL);
CREATE FUNCTION {s}.give_back_slot() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE {s}.slots SET running = running - 1 WHERE key = OLD.slot;
    NEW.slot := NULL;
    RETURN NEW;
END $$;
CREATE TRIGGER tasks_give_back_slot BEFORE UPDATE OF status ON {s}.tasks FOR EACH ROW
    WHEN (OLD.slot IS NOT NULL AND NEW.status <> 'running')
    EXECUTE FUNCTION {s}.give_back_slot();
"#,
    // Model rate limits shared by every daemon (`model::rate`): the reservations of each
    // limited model profile in its window, and per key the time until which a provider's
    // 429 holds it (its row is also what a reservation locks, so daemons take turns).
    r#"
CREATE TABLE {s}.rate_keys (key text PRIMARY KEY, blocked_until_ms bigint NOT NULL DEFAULT 0);
CREATE TABLE {s}.rate_log (key text NOT NULL, id bigserial, at_ms bigint NOT NULL, tokens bigint NOT NULL, PRIMARY KEY (key, id));
"#,
    // Schedules (`store::schedule`): one row per schedule, its record as JSON.
    r#"
CREATE TABLE {s}.schedules (name text PRIMARY KEY, body text NOT NULL);
"#,
    // A claim takes its slots in one statement: the upsert of a key's row records how many
    // slots it granted that claim (`granted`), which the same statement's `RETURNING` reads.
    r#"
ALTER TABLE {s}.slots ADD COLUMN granted integer NOT NULL DEFAULT 0;
"#,
    // The head of the ready queue, for the claims: at most `p_n` queued tasks in the ready
    // index's order (highest priority first, then first ready), due at `p_now`, keyless
    // only if `p_keyless`, skipping rows another claim holds. A function so that its plan is
    // pinned (its settings hold only while it runs): on a table the planner has no
    // statistics for (a new schema, a queue that grew since the last `ANALYZE`) it chose a
    // bitmap scan and a sort of every queued row for the claim in a final commit, reading
    // each dead index entry a claim left (until a vacuum) on every claim.
    r#"
CREATE FUNCTION {s}.ready_head(p_now bigint, p_n bigint, p_keyless boolean) RETURNS SETOF text
    LANGUAGE plpgsql VOLATILE ROWS 1
    SET enable_bitmapscan = off SET enable_sort = off SET enable_seqscan = off
AS $$
BEGIN
    RETURN QUERY SELECT t.id FROM {s}.tasks t
        WHERE t.status = 'queued' AND (NOT p_keyless OR t.concurrency_key IS NULL)
        AND (t.not_before_ms IS NULL OR t.not_before_ms <= p_now)
        ORDER BY t.priority DESC, t.ready_seq LIMIT p_n FOR UPDATE SKIP LOCKED;
END $$;
"#,
];

/// Registers the session as one that listens on the settled channel (migration 8's
/// `waiters`), and forgets sessions that are gone. Run after its `LISTEN`; the lock waits
/// for settling transactions that found no one listening, so whatever the session reads
/// after this returns includes them. Settles queue behind a registration that waits, so it
/// gives up after 100 ms (something holds `waiters` long: a dump, an idle transaction) and
/// is tried again with backoff, the waiters reading their tasks at each try meanwhile.
pub const REGISTER_WAITER: &str = "BEGIN; SET LOCAL lock_timeout = '100ms'; \
     LOCK TABLE {s}.waiters IN ACCESS EXCLUSIVE MODE; \
     DELETE FROM {s}.waiters w WHERE NOT EXISTS (SELECT 1 FROM pg_stat_get_activity(w.pid)); \
     INSERT INTO {s}.waiters (pid) VALUES (pg_backend_pid()) ON CONFLICT (pid) DO NOTHING; COMMIT;";

/// The schema version this build writes and understands.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The SQL of a template for the worker schema `s` and the store schema `t`.
pub fn sql(template: &str, s: &str, t: &str) -> String {
    template.replace("{s}", s).replace("{t}", t)
}

/// Brings the database to [`SCHEMA_VERSION`], under an advisory lock so that daemons starting
/// together apply each migration once; refuses a database migrated by a newer Tether. Returns
/// the database id (made at random on the first migration).
pub fn migrate(c: &mut Client, s: &str, t: &str) -> Result<String> {
    let lock_key = advisory_key(s);
    let mut tx = c.transaction().map_err(db_error)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock_key])
        .map_err(db_error)?;
    tx.batch_execute(&sql(
        "CREATE SCHEMA IF NOT EXISTS {s}; CREATE SCHEMA IF NOT EXISTS {t};
         CREATE TABLE IF NOT EXISTS {s}.migrations (version bigint PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now());",
        s,
        t,
    ))
    .map_err(db_error)?;
    let found: i64 = tx
        .query_one(
            &sql("SELECT coalesce(max(version), 0) FROM {s}.migrations", s, t),
            &[],
        )
        .map_err(db_error)?
        .get(0);
    if found > SCHEMA_VERSION {
        return Err(Error::NewerVersion {
            what: format!("the PostgreSQL schema {s}"),
            found: found as u64,
            supported: SCHEMA_VERSION as u64,
        });
    }
    for (i, m) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        let version = i as i64 + 1;
        tx.batch_execute(&sql(m, s, t)).map_err(db_error)?;
        tx.execute(
            &sql("INSERT INTO {s}.migrations (version) VALUES ($1)", s, t),
            &[&version],
        )
        .map_err(db_error)?;
        tracing::info!(schema = s, version, "applied a PostgreSQL migration");
    }
    let id = format!("{:012x}", crate::store::random_u64() & 0xffff_ffff_ffff);
    tx.execute(
        &sql(
            "INSERT INTO {s}.meta (key, value) VALUES ('db_id', $1) ON CONFLICT (key) DO NOTHING",
            s,
            t,
        ),
        &[&id],
    )
    .map_err(db_error)?;
    let db_id: String = tx
        .query_one(
            &sql("SELECT value FROM {s}.meta WHERE key = 'db_id'", s, t),
            &[],
        )
        .map_err(db_error)?
        .get(0);
    tx.commit().map_err(db_error)?;
    Ok(db_id)
}

/// The schema version of an existing database, without changing anything (0: none yet).
pub fn version(c: &mut Client, s: &str) -> Result<i64> {
    let exists: bool = c
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{s}.migrations")],
        )
        .map_err(db_error)?
        .get(0);
    if !exists {
        return Ok(0);
    }
    Ok(c.query_one(
        &sql(
            "SELECT coalesce(max(version), 0) FROM {s}.migrations",
            s,
            "",
        ),
        &[],
    )
    .map_err(db_error)?
    .get(0))
}

/// The advisory lock key of a schema's migrations.
fn advisory_key(schema: &str) -> i64 {
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(format!("tether-migrate:{schema}").as_bytes());
    i64::from_be_bytes(h[..8].try_into().unwrap_or([0; 8]))
}
