//! Conversations: a finished task continued with a person's follow-up message, as a new turn
//! of the same task.
//!
//! A turn runs on the same state (its facts, its memory notes, the spent call keys) with the
//! conversation so far in the model's input: the agent's earlier answers and the person's
//! messages, the last [`VIEW_MESSAGES_MAX`] of them. What a turn keeps for itself starts
//! afresh: its plan, its stall and repeat counts, its plan revisions, and its budget (the one
//! the task was enqueued with, counted from where the conversation stands: see
//! [`next_turn_budget`]). A conversation runs at most [`TURNS_MAX`] turns, so it never
//! spends more than that many budgets.
//!
//! The call keys of a later turn carry its number (`task#2:s1`, see
//! [`TaskState::key_scope`]), so a step id a model gives again in a new turn never reuses a
//! key of an earlier one; the first turn's keys are the design reference's, unchanged.

use serde::{Deserialize, Serialize};
use std::borrow::Cow;

use super::state::{Budget, Status, StopReason, TaskState};

/// Turns a conversation may run, the first included.
pub const TURNS_MAX: u32 = 20;

/// The longest message a person may send, in characters (an agent's answer kept in the
/// conversation is cut to the same length).
pub const MESSAGE_MAX_CHARS: usize = 4000;

/// Messages of the conversation the model is shown, the most recent ones.
pub const VIEW_MESSAGES_MAX: usize = 8;

/// Who said a message of a conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Speaker {
    /// The person the task works for (its goal is their first message).
    User,
    /// The agent: the final answer of a turn.
    Agent,
}

impl Speaker {
    pub fn as_str(self) -> &'static str {
        match self {
            Speaker::User => "user",
            Speaker::Agent => "agent",
        }
    }
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: Speaker,
    pub text: String,
}

/// A follow-up message as a person wrote it, made ready for the model: line breaks as `\n`,
/// spaces around dropped; refused when empty, too long or holding a control character.
pub fn check_message(text: &str) -> Result<String, String> {
    let text = text.replace("\r\n", "\n");
    let text = text.trim();
    super::person::check_words(text, "a message", MESSAGE_MAX_CHARS)?;
    Ok(text.to_string())
}

impl TaskState {
    /// The turn the task is on: 1 until a person sends a follow-up message.
    pub fn turn(&self) -> u32 {
        let said = self.conversation.iter().filter(|m| m.role == Speaker::User);
        1 + said.count() as u32
    }

    /// What the call keys of this turn are made under: the task id in the first turn (the
    /// design reference's keys), `task#N` in turn N after it.
    pub fn key_scope(&self) -> Cow<'_, str> {
        match self.turn() {
            1 => Cow::Borrowed(&self.task_id),
            n => Cow::Owned(format!("{}#{n}", self.task_id)),
        }
    }

    /// The messages the model is shown: the most recent [`VIEW_MESSAGES_MAX`], always
    /// starting with an answer of the agent (after the goal, the person's first message).
    pub fn conversation_tail(&self) -> &[Message] {
        let c = &self.conversation;
        let mut from = c.len().saturating_sub(VIEW_MESSAGES_MAX);
        if c.get(from).is_some_and(|m| m.role == Speaker::User) {
            from += 1;
        }
        &c[from..]
    }

    /// Why the task cannot take a follow-up message now, if it cannot.
    pub fn why_not_continued(&self) -> Option<String> {
        if self.status != Status::Stopped {
            return Some(match self.stop {
                Some(s) if s.suspends() => format!("it waits ({s}); settle that first"),
                _ => "it is still working on its turn; send the message once it finished".into(),
            });
        }
        if self.unknown_write().is_some() {
            return Some(
                "a write of it has an unknown outcome; reconcile it first (`worker reconcile`)"
                    .into(),
            );
        }
        match self.stop {
            Some(StopReason::Cancelled) => Some("it was cancelled".into()),
            Some(StopReason::Expired) => Some("it expired before it started".into()),
            _ if self.turn() >= TURNS_MAX => Some(format!(
                "its conversation has had {TURNS_MAX} turns, the most one may have; enqueue a new task"
            )),
            _ => None,
        }
    }

    /// Continues the finished task with the person's message `text` (checked with
    /// [`check_message`]): the last answer and the message join the conversation, and what
    /// a turn keeps for itself starts afresh.
    pub fn continue_with(&mut self, text: &str) -> Result<(), String> {
        if let Some(why) = self.why_not_continued() {
            return Err(why);
        }
        let text = check_message(text)?;
        let answer = match (&self.answer, self.stop) {
            (Some(a), _) => a.chars().take(MESSAGE_MAX_CHARS).collect(),
            (None, stop) => format!(
                "(no answer: the turn stopped with {})",
                stop.map_or("no reason", StopReason::as_str)
            ),
        };
        self.conversation.push(Message {
            role: Speaker::Agent,
            text: answer,
        });
        self.conversation.push(Message {
            role: Speaker::User,
            text,
        });
        self.status = Status::Running;
        self.stop = None;
        self.answer = None;
        self.outcome = None;
        self.pending = None;
        self.cancelled_from = None;
        self.last_result = None;
        self.last_turn = None;
        self.plan.clear();
        self.seen.clear();
        self.stalls = 0;
        self.replans = 0;
        self.failed_writes.clear();
        self.spent_steps.clear();
        Ok(())
    }
}

/// The limits of a new turn: `per_turn` (the budget the task was enqueued with) counted from
/// what the conversation spent so far, so that each turn may spend `per_turn` again.
pub fn next_turn_budget(per_turn: &Budget, state: &TaskState) -> Budget {
    Budget {
        steps_max: state.step.saturating_add(per_turn.steps_max),
        tool_calls_max: state.tool_calls.saturating_add(per_turn.tool_calls_max),
        tokens_max: state.tokens.saturating_add(per_turn.tokens_max),
        deadline_ms: state.elapsed_ms.saturating_add(per_turn.deadline_ms),
        ..*per_turn
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finished(answer: &str) -> TaskState {
        let mut s = TaskState::new("t7", "cu_ana", "what is order ord_1 worth?");
        s.status = Status::Stopped;
        s.stop = Some(StopReason::Done);
        s.answer = Some(answer.into());
        s.step = 3;
        s.tool_calls = 1;
        s.tokens = 900;
        s.elapsed_ms = 2_000;
        s.replans = 1;
        s.facts.insert("ord_1.total_cents".into(), 4200.into());
        s
    }

    #[test]
    fn a_new_turn_keeps_the_facts_and_starts_its_own_plan() {
        let mut s = finished("It is worth 42.00.");
        assert_eq!((s.turn(), s.key_scope().as_ref()), (1, "t7"));
        s.continue_with("  and in euros?\r\nplease ")
            .expect("continued");
        assert_eq!((s.turn(), s.key_scope().as_ref()), (2, "t7#2"));
        let asked = s.conversation.last().map(|m| (m.role, m.text.as_str()));
        assert_eq!(asked, Some((Speaker::User, "and in euros?\nplease")));
        assert_eq!(s.conversation[0].text, "It is worth 42.00.");
        assert_eq!(s.facts["ord_1.total_cents"], 4200);
        assert_eq!(
            (s.status, s.stop, s.answer.as_deref()),
            (Status::Running, None, None)
        );
        assert_eq!((s.replans, s.step), (0, 3), "the step count goes on");
        let b = next_turn_budget(&Budget::default(), &s);
        assert_eq!((b.steps_max, b.tool_calls_max, b.tokens_max), (11, 7, 4900));
        assert_eq!(b.deadline_ms, 32_000);
    }

    #[test]
    fn a_task_takes_a_message_only_when_it_finished_cleanly() {
        let mut s = finished("x");
        s.status = Status::Running;
        s.stop = None;
        assert!(
            s.continue_with("more")
                .unwrap_err()
                .contains("still working")
        );
        let mut s = finished("x");
        s.stop = Some(StopReason::Cancelled);
        assert!(s.continue_with("more").unwrap_err().contains("cancelled"));
        let mut s = finished("x");
        for bad in ["", " \n ", "a\u{7}b"] {
            assert!(s.continue_with(bad).is_err(), "{bad:?}");
        }
        assert!(s.continue_with(&"x".repeat(4001)).is_err());
        assert_eq!(s.turn(), 1, "nothing changed");
        for n in 2..=TURNS_MAX {
            s.continue_with("again").expect("a turn");
            s.status = Status::Stopped;
            s.stop = Some(StopReason::MaxSteps);
            assert_eq!(s.turn(), n);
        }
        assert!(s.continue_with("again").unwrap_err().contains("20 turns"));
        assert!(s.conversation[2].text.contains("stopped with"));
    }

    #[test]
    fn the_model_sees_the_latest_messages_starting_with_an_answer() {
        let mut s = finished("a1");
        for i in 0..6 {
            s.continue_with(&format!("m{i}")).expect("a turn");
            s.status = Status::Stopped;
            s.stop = Some(StopReason::Done);
            s.answer = Some(format!("a{}", i + 2));
        }
        let tail = s.conversation_tail();
        assert!(tail.len() <= VIEW_MESSAGES_MAX);
        assert_eq!(tail[0].role, Speaker::Agent);
        assert_eq!(tail.last().map(|m| m.text.as_str()), Some("m5"));
    }
}
