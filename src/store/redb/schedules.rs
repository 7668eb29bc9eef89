//! Schedules in the redb file (see `store::schedule`): one row per schedule, its record as
//! JSON, each change one write transaction. A reader of a file that never had a schedule
//! finds no table, which is no schedule.

use redb::{ReadableTable, TableDefinition};

use super::RedbStore;
use crate::store::backend::Schedules;
use crate::store::schedule::Schedule;
use crate::store::{Error, Result};

/// schedule name -> its record as JSON.
pub const SCHEDULES: TableDefinition<&str, &str> = TableDefinition::new("schedules");

fn decode(name: &str, text: &str) -> Result<Schedule> {
    serde_json::from_str(text)
        .map_err(|e| Error::Corrupt(format!("the schedule {name:?} cannot be read: {e}")))
}

fn encode(s: &Schedule) -> Result<String> {
    serde_json::to_string(s).map_err(|e| Error::Invalid(e.to_string()))
}

impl Schedules for RedbStore {
    fn schedules(&self) -> Result<Vec<Schedule>> {
        let r = self.begin_read()?;
        let t = match r.open_table(SCHEDULES) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        let mut out = Vec::new();
        for e in t.iter()? {
            let (k, v) = e?;
            out.push(decode(k.value(), v.value())?);
        }
        Ok(out)
    }

    fn add_schedule(&self, s: &Schedule) -> Result<()> {
        let w = self.begin_write()?;
        {
            let mut t = w.open_table(SCHEDULES)?;
            if t.get(s.name.as_str())?.is_some() {
                return Err(Error::Conflict(format!(
                    "a schedule named {:?} exists already (remove it first, or choose another name)",
                    s.name
                )));
            }
            t.insert(s.name.as_str(), encode(s)?.as_str())?;
        }
        w.commit()?;
        Ok(())
    }

    fn update_schedule(&self, name: &str, f: &mut dyn FnMut(&mut Schedule)) -> Result<bool> {
        let w = self.begin_write()?;
        {
            let mut t = w.open_table(SCHEDULES)?;
            let Some(text) = t.get(name)?.map(|g| g.value().to_string()) else {
                return Ok(false);
            };
            let mut s = decode(name, &text)?;
            f(&mut s);
            t.insert(name, encode(&s)?.as_str())?;
        }
        w.commit()?;
        Ok(true)
    }

    fn remove_schedule(&self, name: &str) -> Result<bool> {
        let w = self.begin_write()?;
        let gone = w.open_table(SCHEDULES)?.remove(name)?.is_some();
        w.commit()?;
        Ok(gone)
    }
}
