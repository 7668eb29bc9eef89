//! The long-term memory store: notes admitted by the kernel's memory policy (trusted sources,
//! scoped to a user, expiring), listed and deleted by user and source, each change with its
//! audit event in one transaction.

use redb::ReadableTable;
use serde_json::json;

use super::decide::event;
use super::schema::*;
use super::{RedbStore, next_seq};
use crate::kernel::memory::Note;
use crate::store::Result;
use crate::store::backend::{Decision, Notes};
use crate::store::codec::{decode, encode};
use crate::store::records::admit_note;

impl Notes for RedbStore {
    /// Stores a long-term memory note if the policy admits it (trusted source, non-empty).
    fn add_note(
        &self,
        user: &str,
        text: &str,
        source: &str,
        ttl_s: u64,
        d: &Decision,
    ) -> Result<Note> {
        let note = admit_note(user, text, source, ttl_s, d)?;
        let w = self.begin_write()?;
        let seq = next_seq(&mut w.open_table(META)?, META_NOTE_SEQ)?;
        w.open_table(NOTES)?
            .insert(seq, encode(&note)?.as_slice())?;
        event(
            &w,
            None,
            "memory_add",
            d,
            json!({"user": user, "source": source, "ttl_s": ttl_s}),
        )?;
        w.commit()?;
        Ok(note)
    }

    /// Notes, of one user when given; expired ones only with `all`.
    fn notes(&self, user: Option<&str>, now_ms: u64, all: bool) -> Result<Vec<Note>> {
        let r = self.begin_read()?;
        let t = r.open_table(NOTES)?;
        let mut out = Vec::new();
        for e in t.iter()? {
            let (_, v) = e?;
            let n: Note = decode("note", v.value())?;
            if user.is_none_or(|u| n.user == u) && (all || n.expires_at_s > now_ms / 1000) {
                out.push(n);
            }
        }
        Ok(out)
    }

    /// Deletes a user's notes, only those from `source` when given. Returns how many.
    fn forget(&self, user: &str, source: Option<&str>, d: &Decision) -> Result<usize> {
        let w = self.begin_write()?;
        let mut gone = Vec::new();
        {
            let t = w.open_table(NOTES)?;
            for e in t.iter()? {
                let (k, v) = e?;
                let n: Note = decode("note", v.value())?;
                if n.user == user && source.is_none_or(|s| n.source == s) {
                    gone.push(k.value());
                }
            }
        }
        {
            let mut t = w.open_table(NOTES)?;
            for k in &gone {
                t.remove(k)?;
            }
        }
        event(
            &w,
            None,
            "memory_forget",
            d,
            json!({"user": user, "source": source, "deleted": gone.len()}),
        )?;
        w.commit()?;
        Ok(gone.len())
    }
}
