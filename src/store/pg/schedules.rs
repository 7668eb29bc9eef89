//! Schedules on PostgreSQL (see `store::schedule`): migration 11's `schedules`, one row per
//! schedule with its record as JSON; a change locks its row, so daemons on every host take
//! turns on a schedule.

use super::PgStore;
use super::pool::db_error;
use crate::store::backend::Schedules;
use crate::store::schedule::Schedule;
use crate::store::{Error, Result};

fn decode(name: &str, text: &str) -> Result<Schedule> {
    serde_json::from_str(text)
        .map_err(|e| Error::Corrupt(format!("the schedule {name:?} cannot be read: {e}")))
}

fn encode(s: &Schedule) -> Result<String> {
    serde_json::to_string(s).map_err(|e| Error::Invalid(e.to_string()))
}

impl Schedules for PgStore {
    fn schedules(&self) -> Result<Vec<Schedule>> {
        let sql = self.sql("SELECT name, body FROM {s}.schedules ORDER BY name");
        let rows = self.read(|c| c.client.query(&sql, &[]))?;
        rows.iter()
            .map(|r| decode(r.get::<_, &str>(0), r.get::<_, &str>(1)))
            .collect()
    }

    fn add_schedule(&self, s: &Schedule) -> Result<()> {
        let sql = self.sql(
            "INSERT INTO {s}.schedules (name, body) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
        );
        let body = encode(s)?;
        let n = self.write(|tx| tx.execute(&sql, &[&s.name, &body]).map_err(db_error))?;
        if n == 0 {
            return Err(Error::Conflict(format!(
                "a schedule named {:?} exists already (remove it first, or choose another name)",
                s.name
            )));
        }
        Ok(())
    }

    fn update_schedule(&self, name: &str, f: &mut dyn FnMut(&mut Schedule)) -> Result<bool> {
        let get = self.sql("SELECT body FROM {s}.schedules WHERE name = $1 FOR UPDATE");
        let put = self.sql("UPDATE {s}.schedules SET body = $2 WHERE name = $1");
        self.write(|tx| {
            let Some(row) = tx.query_opt(&get, &[&name]).map_err(db_error)? else {
                return Ok(false);
            };
            let mut s = decode(name, row.get::<_, &str>(0))?;
            f(&mut s);
            tx.execute(&put, &[&name, &encode(&s)?]).map_err(db_error)?;
            Ok(true)
        })
    }

    fn remove_schedule(&self, name: &str) -> Result<bool> {
        let sql = self.sql("DELETE FROM {s}.schedules WHERE name = $1");
        let n = self.write(|tx| tx.execute(&sql, &[&name]).map_err(db_error))?;
        Ok(n > 0)
    }
}
