//! Long-term memory policy: who may write, whose a note is, how long it lasts, how it is removed.
//!
//! Only trusted sources may write; the user scope and expiry are applied before any matching;
//! notes are found and deleted by user and by source. Retrieval is the design reference's word overlap
//! (long words, plural `s` removed), chosen so that the policy is the visible part. Times are
//! seconds on whatever clock the caller uses; the kernel reads no clock.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Content from retrieved pages or free-text tool output is not on this list.
pub const TRUSTED_SOURCES: [&str; 2] = ["user_message", "validated_tool"];

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Note {
    pub user: String,
    pub text: String,
    pub source: String,
    pub created_at_s: u64,
    pub expires_at_s: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteError {
    UntrustedSource(String),
    EmptyText,
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::UntrustedSource(s) => write!(
                f,
                "source {s:?} is not trusted for memory (trusted: {})",
                TRUSTED_SOURCES.join(", ")
            ),
            WriteError::EmptyText => write!(f, "a note needs non-empty text"),
        }
    }
}

impl std::error::Error for WriteError {}

/// Checks a write against the policy and builds the note.
pub fn admit(
    user: &str,
    text: &str,
    source: &str,
    now_s: u64,
    ttl_s: u64,
) -> Result<Note, WriteError> {
    if !TRUSTED_SOURCES.contains(&source) {
        return Err(WriteError::UntrustedSource(source.to_string()));
    }
    if text.trim().is_empty() {
        return Err(WriteError::EmptyText);
    }
    Ok(Note {
        user: user.to_string(),
        text: text.to_string(),
        source: source.to_string(),
        created_at_s: now_s,
        expires_at_s: now_s.saturating_add(ttl_s),
    })
}

/// The design reference's crude word set: lowercase words longer than 3 letters, trailing `s` removed.
pub fn words(text: &str) -> BTreeSet<String> {
    let lower = text.to_lowercase();
    lower
        .split(|c: char| !c.is_ascii_lowercase())
        .filter(|w| w.len() > 3)
        .map(|w| w.trim_end_matches('s').to_string())
        .collect()
}

/// Up to `k` notes of `user` that are live at `now_s` and share a word with `query`, best
/// first, earlier notes first among equals. Scope and expiry are applied before matching.
pub fn select<'a>(
    notes: &'a [Note],
    user: &str,
    query: &str,
    now_s: u64,
    k: usize,
) -> Vec<&'a Note> {
    let q = words(query);
    let mut scored: Vec<(usize, &Note)> = notes
        .iter()
        .filter(|n| n.user == user && n.expires_at_s > now_s)
        .map(|n| (q.intersection(&words(&n.text)).count(), n))
        .collect();
    scored.sort_by_key(|s| std::cmp::Reverse(s.0)); // stable: ties keep insertion order
    scored
        .into_iter()
        .take(k)
        .filter(|(s, _)| *s > 0)
        .map(|(_, n)| n)
        .collect()
}

/// An in-memory note store with the policy applied; the durable store keeps the same notes in
/// redb and uses [`admit`] and [`select`] the same way.
#[derive(Debug, Default)]
pub struct Memory {
    pub notes: Vec<Note>,
}

impl Memory {
    pub fn write(
        &mut self,
        user: &str,
        text: &str,
        source: &str,
        now_s: u64,
        ttl_s: u64,
    ) -> Result<(), WriteError> {
        self.notes.push(admit(user, text, source, now_s, ttl_s)?);
        Ok(())
    }

    pub fn read(&self, user: &str, query: &str, now_s: u64, k: usize) -> Vec<String> {
        select(&self.notes, user, query, now_s, k)
            .into_iter()
            .map(|n| n.text.clone())
            .collect()
    }

    /// Deletes the notes of `user`, only those from `source` when given; returns how many.
    pub fn forget(&mut self, user: &str, source: Option<&str>) -> usize {
        let before = self.notes.len();
        self.notes
            .retain(|n| !(n.user == user && source.is_none_or(|s| n.source == s)));
        before - self.notes.len()
    }
}
