//! The span outbox of live OTLP export (redb). A commit made by a daemon that exports adds, in
//! its own transaction, an entry naming the spans it ended; the exporter reads entries oldest
//! first, sends those spans, and removes the entries it sent. So a step that was not committed
//! is never exported, a committed one survives a crash until it is sent, and memory holds a
//! batch, never the backlog (a receiver that is down makes the table grow on disk instead).

use redb::{ReadableTable, TableDefinition, WriteTransaction};

use super::{Commit, Result, Store, next_seq};

/// seq -> "TASK SPAN,SPAN,...": the spans a commit ended, to export.
pub const OUTBOX: TableDefinition<u64, &str> = TableDefinition::new("otlp_outbox");
const META_OUTBOX_SEQ: &str = "otlp_outbox_seq";

/// Spans of one commit waiting to be exported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxEntry {
    pub seq: u64,
    pub task_id: String,
    pub spans: Vec<u32>,
}

/// The ids of the spans `c` ends (an open span is exported once it ends, by a later commit).
pub fn ended(c: &Commit) -> Vec<u32> {
    c.spans
        .iter()
        .filter(|s| s.t1_ms.is_some())
        .map(|s| s.id)
        .collect()
}

/// Adds `c`'s ended spans to the outbox, inside the commit's transaction.
pub(super) fn queue(w: &WriteTransaction, c: &Commit) -> Result<()> {
    let spans = ended(c);
    if !c.export || spans.is_empty() {
        return Ok(());
    }
    let ids: Vec<String> = spans.iter().map(u32::to_string).collect();
    let seq = next_seq(&mut w.open_table(super::META)?, META_OUTBOX_SEQ)?;
    w.open_table(OUTBOX)?
        .insert(seq, format!("{} {}", c.task_id, ids.join(",")).as_str())?;
    Ok(())
}

fn parse(seq: u64, v: &str) -> Option<OutboxEntry> {
    let (task, ids) = v.split_once(' ')?;
    let spans = ids
        .split(',')
        .map(str::parse)
        .collect::<std::result::Result<Vec<u32>, _>>()
        .ok()?;
    Some(OutboxEntry {
        seq,
        task_id: task.to_string(),
        spans,
    })
}

impl Store {
    /// At most `max` entries, oldest first. An entry that cannot be read is returned with no
    /// spans (the exporter drops it and says so).
    pub fn outbox(&self, max: usize) -> Result<Vec<OutboxEntry>> {
        let r = self.db.begin_read()?;
        let table = match r.open_table(OUTBOX) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        let mut out = Vec::new();
        for item in table.iter()?.take(max) {
            let (k, v) = item?;
            let seq = k.value();
            out.push(parse(seq, v.value()).unwrap_or(OutboxEntry {
                seq,
                task_id: String::new(),
                spans: Vec::new(),
            }));
        }
        Ok(out)
    }

    /// Removes exported entries. Without a flush of its own: the next step commit makes it
    /// durable, and a removal lost in a crash only means those spans are sent again, with the
    /// same ids.
    pub fn outbox_done(&self, seqs: &[u64]) -> Result<()> {
        if seqs.is_empty() {
            return Ok(());
        }
        let mut w = self.begin_write()?;
        if let Err(e) = w.set_durability(redb::Durability::None) {
            tracing::debug!(error = %e, "outbox removal committed durably");
        }
        {
            let mut t = w.open_table(OUTBOX)?;
            for s in seqs {
                t.remove(s)?;
            }
        }
        w.commit()?;
        Ok(())
    }
}
