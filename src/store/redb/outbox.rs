//! The span outbox in the redb file: a table of entries, each naming the spans one commit
//! ended, written in that commit's transaction (see `store::outbox`).

use redb::{ReadableTable, TableDefinition, WriteTransaction};

use super::{RedbStore, next_seq, schema::META};
use crate::store::backend::Outbox;
use crate::store::outbox::{OutboxEntry, ROOT, ended};
use crate::store::{Commit, Result};

/// seq -> "TASK SPAN,SPAN,...": the spans a commit ended, to export.
pub const OUTBOX: TableDefinition<u64, &str> = TableDefinition::new("otlp_outbox");
const META_OUTBOX_SEQ: &str = "otlp_outbox_seq";

/// Queues the root span of task `id`, which a decision (a cancel, an expired approval wait)
/// finished without a step, if a daemon ever exported from this database (the outbox's
/// sequence exists): in the decision's transaction, like a commit's spans.
pub(super) fn queue_root(w: &WriteTransaction, id: &str) -> Result<()> {
    let mut meta = w.open_table(META)?;
    if meta.get(META_OUTBOX_SEQ)?.is_none() {
        return Ok(());
    }
    let seq = next_seq(&mut meta, META_OUTBOX_SEQ)?;
    w.open_table(OUTBOX)?
        .insert(seq, format!("{id} {ROOT}").as_str())?;
    Ok(())
}

/// Adds `c`'s ended spans to the outbox, inside the commit's transaction.
pub(super) fn queue(w: &WriteTransaction, c: &Commit) -> Result<()> {
    let spans = ended(c);
    if !c.export || spans.is_empty() {
        return Ok(());
    }
    let ids: Vec<String> = spans.iter().map(u32::to_string).collect();
    let seq = next_seq(&mut w.open_table(META)?, META_OUTBOX_SEQ)?;
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

impl Outbox for RedbStore {
    /// At most `max` entries, oldest first. An entry that cannot be read is returned with no
    /// spans (the exporter drops it and says so).
    fn outbox(&self, max: usize) -> Result<Vec<OutboxEntry>> {
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

    /// Drops the oldest entries while more than `keep` wait (a receiver down for long), so the
    /// backlog on disk stays bounded. Returns how many entries and spans were dropped.
    fn outbox_trim(&self, keep: usize) -> Result<(u64, u64)> {
        // Entries are numbered in order and removed oldest first: the span of numbers is the
        // backlog (two lookups, not a count).
        let bound = {
            let r = self.db.begin_read()?;
            let table = match r.open_table(OUTBOX) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok((0, 0)),
                Err(e) => return Err(e.into()),
            };
            match (table.first()?, table.last()?) {
                (Some(a), Some(b)) if b.0.value() - a.0.value() >= keep as u64 => {
                    b.0.value() - keep as u64
                }
                _ => return Ok((0, 0)),
            }
        };
        let w = self.begin_write()?;
        let mut dropped = (0, 0);
        {
            let mut t = w.open_table(OUTBOX)?;
            let old: Vec<(u64, u64)> = t
                .range(..=bound)?
                .map(|e| {
                    e.map(|(k, v)| {
                        let spans = parse(k.value(), v.value()).map_or(0, |e| e.spans.len());
                        (k.value(), spans as u64)
                    })
                })
                .collect::<std::result::Result<_, _>>()?;
            for (seq, spans) in old {
                t.remove(seq)?;
                dropped.0 += 1;
                dropped.1 += spans;
            }
        }
        w.commit()?;
        Ok(dropped)
    }

    /// Removes exported entries. Without a flush of its own: the next step commit makes it
    /// durable, and a removal lost in a crash only means those spans are sent again, with the
    /// same ids.
    fn outbox_done(&self, seqs: &[u64]) -> Result<()> {
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

    /// Nothing to give up: one file, no claims of entries.
    fn outbox_release(&self) -> Result<()> {
        Ok(())
    }
}
