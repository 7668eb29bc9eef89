//! Long polls (`GET /api/v1/tasks/{id}?wait=`) held open at once, bounded per caller and in
//! total. A long poll holds its connection inside a handler for up to a minute, and the HTTP
//! edge can only make room by closing connections that wait for a request: without a bound,
//! one submit token holding as many long polls as the server has connections kept every
//! operator, the console, `/healthz` and `/metrics` out (503). With these bounds submitters'
//! long polls hold at most [`LONG_POLLS_MAX`] connections, so the rest of the server's
//! connections (the console serves 128) stay for everything else, operators' long polls
//! included (each operator's bounded by [`LONG_POLLS_PER_CALLER_MAX`]); a long poll over a
//! bound is answered at once with 429 and `Retry-After`. A long poll holds its place until it
//! answers (at most a minute), even when its client went away meanwhile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::httpd::Reply;

/// Long polls open at once, over all callers: well under half of the console's 128
/// connections.
pub const LONG_POLLS_MAX: usize = 48;
/// Long polls open at once for one token (or the loopback operator).
pub const LONG_POLLS_PER_CALLER_MAX: usize = 16;

/// Where an operator's long polls are counted apart (a token name cannot hold a NUL).
const OPERATOR: &str = "\0operator:";

/// The long polls open now, by caller.
#[derive(Default)]
pub(super) struct LongPolls {
    open: Mutex<HashMap<String, usize>>,
}

/// One long poll's place (or an event stream's), given back when it is dropped.
pub(super) struct Held {
    polls: Arc<LongPolls>,
    caller: String,
}

impl LongPolls {
    /// A place for a long poll of `caller`, or the 429 to answer when it has
    /// [`LONG_POLLS_PER_CALLER_MAX`] open or, for a submit token, the submitters together
    /// [`LONG_POLLS_MAX`] (an operator's are bounded by the first alone, so submitters never
    /// keep an operator's long poll out).
    pub(super) fn enter(self: &Arc<Self>, caller: &str, operator: bool) -> Result<Held, Reply> {
        let refused = |detail: String| {
            super::problem(429, "too_many_long_polls", &detail).with_header("Retry-After", "1")
        };
        let Ok(mut open) = self.open.lock() else {
            return Err(refused(
                "the server cannot count its long polls; try again".into(),
            ));
        };
        let total: usize = open
            .iter()
            .filter(|(k, _)| !k.starts_with(OPERATOR))
            .map(|(_, n)| n)
            .sum();
        let key = if operator {
            format!("{OPERATOR}{caller}")
        } else {
            caller.to_string()
        };
        let mine = open.get(&key).copied().unwrap_or(0);
        if mine >= LONG_POLLS_PER_CALLER_MAX {
            return Err(refused(format!(
                "this token ({caller}) has {mine} long polls and event streams open, the most one caller may: wait for one to return or close a stream, or ask without `wait`"
            )));
        }
        if !operator && total >= LONG_POLLS_MAX {
            return Err(refused(format!(
                "the server has {total} long polls and event streams open, the most it holds at once: try again in a second, or ask without `wait`"
            )));
        }
        *open.entry(key.clone()).or_insert(0) += 1;
        Ok(Held {
            polls: Arc::clone(self),
            caller: key,
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Ok(mut open) = self.polls.open.lock()
            && let Some(n) = open.get_mut(&self.caller)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.caller);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_polls_are_bounded_per_caller_and_in_total_and_given_back() {
        let polls = Arc::new(LongPolls::default());
        let mine: Vec<Held> = (0..LONG_POLLS_PER_CALLER_MAX)
            .map(|_| polls.enter("job", false).ok().expect("a place"))
            .collect();
        assert!(polls.enter("job", false).is_err(), "one caller's bound");
        drop(mine);
        assert!(polls.enter("job", false).is_ok(), "given back");
        let callers: Vec<String> = (0..LONG_POLLS_MAX).map(|i| format!("c{i}")).collect();
        let all: Vec<Held> = callers
            .iter()
            .map(|c| polls.enter(c, false).ok().expect("a place"))
            .collect();
        assert!(
            polls.enter("other", false).is_err(),
            "the submitters' bound"
        );
        let ops: Vec<Held> = (0..LONG_POLLS_PER_CALLER_MAX)
            .map(|_| polls.enter("ops", true).ok().expect("an operator's place"))
            .collect();
        assert!(polls.enter("ops", true).is_err(), "an operator's own bound");
        drop(ops);
        drop(all);
        assert!(polls.open.lock().expect("lock").is_empty());
    }
}
