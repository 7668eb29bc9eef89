//! Long-term memory notes on PostgreSQL, each change with its audit event in one transaction.

use super::PgStore;
use super::decide::event;
use super::pool::db_error;
use super::rows::{i64_of, u64_of};
use crate::kernel::memory::Note;
use crate::store::Decision;
use crate::store::Result;
use crate::store::backend::Notes;

impl Notes for PgStore {
    fn add_note(
        &self,
        user: &str,
        text: &str,
        source: &str,
        ttl_s: u64,
        d: &Decision,
    ) -> Result<Note> {
        let note = crate::store::records::admit_note(user, text, source, ttl_s, d)?;
        let sql = self.sql(
            "INSERT INTO {s}.notes (user_id, text, source, created_at_s, expires_at_s) \
             VALUES ($1, $2, $3, $4, $5)",
        );
        self.write(|tx| {
            tx.execute(
                &sql,
                &[
                    &note.user,
                    &note.text,
                    &note.source,
                    &i64_of(note.created_at_s),
                    &i64_of(note.expires_at_s),
                ],
            )
            .map_err(db_error)?;
            event(
                self,
                tx,
                None,
                "memory_add",
                d,
                serde_json::json!({"user": user, "source": source, "ttl_s": ttl_s}),
            )
        })?;
        Ok(note)
    }

    fn notes(&self, user: Option<&str>, now_ms: u64, all: bool) -> Result<Vec<Note>> {
        let sql = self.sql(
            "SELECT user_id, text, source, created_at_s, expires_at_s FROM {s}.notes \
             WHERE ($1::text IS NULL OR user_id = $1) AND ($2 OR expires_at_s > $3) ORDER BY seq",
        );
        let now_s = i64_of(now_ms / 1000);
        let rows = self.read(|c| c.client.query(&sql, &[&user, &all, &now_s]))?;
        Ok(rows
            .iter()
            .map(|r| Note {
                user: r.get(0),
                text: r.get(1),
                source: r.get(2),
                created_at_s: u64_of(r.get(3)),
                expires_at_s: u64_of(r.get(4)),
            })
            .collect())
    }

    fn forget(&self, user: &str, source: Option<&str>, d: &Decision) -> Result<usize> {
        let sql = self
            .sql("DELETE FROM {s}.notes WHERE user_id = $1 AND ($2::text IS NULL OR source = $2)");
        self.write(|tx| {
            let n = tx.execute(&sql, &[&user, &source]).map_err(db_error)? as usize;
            event(
                self,
                tx,
                None,
                "memory_forget",
                d,
                serde_json::json!({"user": user, "source": source, "deleted": n}),
            )?;
            Ok(n)
        })
    }
}
