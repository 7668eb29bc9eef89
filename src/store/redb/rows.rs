//! Reading and writing a task as its rows (see [`super::rows`]): the task row every step
//! rewrites, the spec row written once at enqueue, and the shared blobs (script replies,
//! catalogs) counted by reference so that purge can delete the last user's copy.

use redb::{ReadableTable, Table, WriteTransaction};
use std::collections::HashMap;

use super::schema::*;
use crate::store::codec::{decode_legacy, decode_row, encode_row, is_legacy};
use crate::store::rows::{
    Blob, ModelRow, SpecRow, TaskRow, decode_spec, encode_spec, join, split, task_row,
};
use crate::store::{Error, Result, TaskRecord};

/// The task row of `id`, if the task exists.
pub(super) fn read_row<T>(tasks: &T, id: &str) -> Result<Option<TaskRow>>
where
    T: ReadableTable<&'static str, &'static [u8]>,
{
    let Some(g) = tasks.get(id)? else {
        return Ok(None);
    };
    let bytes = g.value();
    if is_legacy(bytes) {
        // Only a file not yet migrated (opened read-only) has these; writers migrate at open.
        let rec: TaskRecord = decode_legacy(&format!("task {id}"), bytes)?;
        return Ok(Some(task_row(&rec)));
    }
    Ok(Some(crate::store::rows::decode_task(
        &format!("task {id}"),
        bytes,
    )?))
}

/// Reads whole task records, decoding each shared blob once.
pub(super) struct Reader<'a, T, S, B> {
    pub tasks: &'a T,
    pub specs: &'a S,
    pub blobs: &'a B,
    cache: HashMap<String, Blob>,
}

impl<'a, T, S, B> Reader<'a, T, S, B>
where
    T: ReadableTable<&'static str, &'static [u8]>,
    S: ReadableTable<&'static str, &'static [u8]>,
    B: ReadableTable<&'static str, &'static [u8]>,
{
    pub fn new(tasks: &'a T, specs: &'a S, blobs: &'a B) -> Self {
        Reader {
            tasks,
            specs,
            blobs,
            cache: HashMap::new(),
        }
    }

    /// The task `id`, `None` if there is no such task, `Err` naming the damaged part.
    pub fn get(&mut self, id: &str) -> Result<Option<TaskRecord>> {
        let Some(g) = self.tasks.get(id)? else {
            return Ok(None);
        };
        let what = format!("task {id}");
        if is_legacy(g.value()) {
            return Ok(Some(decode_legacy(&what, g.value())?));
        }
        let row: TaskRow = crate::store::rows::decode_task(&what, g.value())?;
        drop(g);
        self.with_row(row).map(Some)
    }

    /// The whole record of a task whose row is already read.
    pub fn with_row(&mut self, row: TaskRow) -> Result<TaskRecord> {
        let what = format!("task {}", row.id);
        let spec: SpecRow = match self.specs.get(row.id.as_str())? {
            Some(g) => decode_spec(&format!("{what} spec"), g.value())?,
            None => {
                return Err(Error::Corrupt(format!(
                    "{what}: its spec record is missing"
                )));
            }
        };
        let (blobs, cache) = (self.blobs, &mut self.cache);
        let mut find = |d: &str| -> std::result::Result<Blob, String> {
            if let Some(b) = cache.get(d) {
                return Ok(b.clone());
            }
            let g = blobs
                .get(d)
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("blob {d} is missing"))?;
            let b: Blob = decode_row(&format!("blob {d}"), g.value()).map_err(|e| e.to_string())?;
            if b.digest() != d {
                return Err(format!("blob {d}: its content does not match its digest"));
            }
            cache.insert(d.to_string(), b.clone());
            Ok(b)
        };
        join(row, spec, &mut find).map_err(|e| Error::Corrupt(format!("{what}: {e}")))
    }
}

/// The tables of tasks, open in a write transaction.
pub(super) struct Tables<'w> {
    pub tasks: Table<'w, &'static str, &'static [u8]>,
    pub specs: Table<'w, &'static str, &'static [u8]>,
    pub blobs: Table<'w, &'static str, &'static [u8]>,
    pub refs: Table<'w, &'static str, u64>,
}

impl<'w> Tables<'w> {
    pub fn open(w: &'w WriteTransaction) -> Result<Tables<'w>> {
        Ok(Tables {
            tasks: w.open_table(TASKS)?,
            specs: w.open_table(TASK_SPECS)?,
            blobs: w.open_table(BLOBS)?,
            refs: w.open_table(BLOB_REFS)?,
        })
    }

    /// The task `id`, `None` if there is none, `Err` naming the damaged part.
    pub fn get(&self, id: &str) -> Result<Option<TaskRecord>> {
        Reader::new(&self.tasks, &self.specs, &self.blobs).get(id)
    }

    /// Writes what a step or an operator changed: the task row only (the spec is fixed).
    pub fn save(&mut self, rec: &TaskRecord) -> Result<()> {
        save_row(&mut self.tasks, &task_row(rec))
    }

    /// Writes a new task: its row, its spec, and the blobs it refers to (shared, counted).
    pub fn insert_new(&mut self, rec: &TaskRecord) -> Result<()> {
        let s = split(rec);
        for (d, b) in &s.blobs {
            let n = self.refs.get(d.as_str())?.map_or(0, |g| g.value());
            if n == 0 || self.blobs.get(d.as_str())?.is_none() {
                self.blobs.insert(d.as_str(), encode_row(b)?.as_slice())?;
            }
            self.refs.insert(d.as_str(), n + 1)?;
        }
        self.specs
            .insert(rec.id.as_str(), encode_spec(&s.spec)?.as_slice())?;
        save_row(&mut self.tasks, &s.row)
    }

    /// Deletes a task's row and spec, and each blob of which it was the last user.
    pub fn delete(&mut self, id: &str) -> Result<()> {
        self.tasks.remove(id)?;
        let spec = self.specs.remove(id)?.map(|g| g.value().to_vec());
        let Some(bytes) = spec else { return Ok(()) };
        // A damaged spec's blobs stay; `worker check` reports blobs no task refers to.
        let Ok(spec) = decode_spec("spec", &bytes) else {
            return Ok(());
        };
        let mut digests = Vec::new();
        if let ModelRow::Script { replies, .. } = &spec.model {
            digests.push(replies.clone());
        }
        digests.extend(spec.catalog.clone());
        for d in digests {
            let n = self.refs.get(d.as_str())?.map_or(0, |g| g.value());
            if n <= 1 {
                self.refs.remove(d.as_str())?;
                self.blobs.remove(d.as_str())?;
            } else {
                self.refs.insert(d.as_str(), n - 1)?;
            }
        }
        Ok(())
    }
}

/// Reads task `id` inside a write transaction.
pub(super) fn load(w: &WriteTransaction, id: &str) -> Result<Option<TaskRecord>> {
    Tables::open(w)?.get(id)
}

/// Writes what a step or an operator changes: the task row only.
pub(super) fn save_row(tasks: &mut Table<&str, &[u8]>, row: &TaskRow) -> Result<()> {
    tasks.insert(
        row.id.as_str(),
        crate::store::rows::encode_task(row)?.as_slice(),
    )?;
    Ok(())
}

/// Writes the task row of `rec` (its spec is unchanged since enqueue).
pub(super) fn save(w: &WriteTransaction, rec: &TaskRecord) -> Result<()> {
    save_row(&mut w.open_table(TASKS)?, &task_row(rec))
}
