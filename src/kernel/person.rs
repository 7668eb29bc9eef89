//! Questions to a person: the built-in `ask_person` tool a catalog opts into (`[ask_person]`
//! in its file). The model calls it with a question and, optionally, the answers it offers;
//! the kernel sends nothing: the task suspends (`needs_answer`) with the call held, and a
//! person's answer is folded in as that call's result, `{"status": "ok", "answer": TEXT}`. A
//! question is never a tool call of the budget, and its answer is never a fact unless the
//! catalog's rule lists `answer` in `fact_fields`.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::BTreeMap;

use super::catalog::{Access, ArgSpec, ArgType, ToolSpec};
use super::state::ToolCall;

/// A person's words (`what`: "an answer", "a message") as the model may read them: some
/// text, no control character but tabs and line breaks, at most `max` characters.
pub fn check_words(text: &str, what: &str, max: usize) -> Result<(), String> {
    if text.trim().is_empty() {
        return Err(format!("{what} needs some text"));
    }
    if let Some(c) = text
        .chars()
        .find(|c| c.is_control() && !matches!(c, '\t' | '\n'))
    {
        return Err(format!(
            "{what} may not hold the control character {c:?} (tabs and line breaks are fine)"
        ));
    }
    let n = text.chars().count();
    if n > max {
        return Err(format!(
            "{what} is at most {max} characters (this one has {n})"
        ));
    }
    Ok(())
}

/// The built-in tool's name.
pub const ASK_PERSON: &str = "ask_person";

/// The longest answer a person may give, in characters: it enters the model's next request.
pub const ANSWER_MAX_CHARS: usize = 4000;

const DESCRIPTION: &str = "Ask a person a question and wait for the answer (minutes or days). Use it only when the goal cannot go on without something only a person knows or decides. Give `choices` when the answer is one of a few options.";

/// A catalog's `[ask_person]` table: the built-in tool's own words and its rule for facts.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AskPerson {
    /// Who is asked and when to ask, for the model (a default says what the tool does).
    #[serde(default)]
    pub description: String,
    /// `["answer"]` lets an answer become the fact `ask_person.answer`; by default an answer is
    /// the person's words in the view, never a fact.
    #[serde(default)]
    pub fact_fields: Vec<String>,
}

impl AskPerson {
    /// The tool the model is offered.
    pub fn spec(&self) -> Result<ToolSpec, String> {
        if let Some(f) = self.fact_fields.iter().find(|f| *f != "answer") {
            return Err(format!(
                "[ask_person] fact_fields may list only \"answer\" (an answer has no other field), not {f:?}"
            ));
        }
        let arg = |kind, description: &str, required| ArgSpec {
            kind,
            description: description.into(),
            required,
            allowed: None,
            min: None,
            max: None,
            min_len: (kind == ArgType::String).then_some(1),
            max_len: (kind == ArgType::String).then_some(1000),
            pattern: None,
            items: None,
            min_items: None,
            max_items: None,
            properties: BTreeMap::new(),
        };
        let mut choices = arg(
            ArgType::Array,
            "the answers to choose from, when there are only a few",
            false,
        );
        choices.items = Some(Box::new(arg(ArgType::String, "one answer", true)));
        choices.min_items = Some(2);
        choices.max_items = Some(10);
        let description = if self.description.is_empty() {
            DESCRIPTION.to_string()
        } else {
            self.description.clone()
        };
        Ok(ToolSpec {
            name: ASK_PERSON.into(),
            description,
            access: Access::Read,
            idempotent: true,
            fact_fields: self.fact_fields.clone(),
            fact_prefix_arg: String::new(),
            done_phrase: "asked a person".into(),
            not_done_phrase: "did not get a person's answer".into(),
            approval: Default::default(),
            requires: Default::default(),
            args: BTreeMap::from([
                (
                    "question".to_string(),
                    arg(ArgType::String, "the question, in plain words", true),
                ),
                ("choices".to_string(), choices),
            ]),
            http: None,
            mcp: None,
            asks_person: true,
        })
    }
}

/// A question a task holds: its words and the answers it offers (none: any text).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Question {
    pub text: String,
    pub choices: Vec<String>,
}

impl Question {
    /// The question of a held `ask_person` call; `None` for any other call.
    pub fn of(call: &ToolCall) -> Option<Question> {
        if call.name != ASK_PERSON {
            return None;
        }
        let text = call.args.get("question")?.as_str()?.to_string();
        let choices = call
            .args
            .get("choices")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        Some(Question { text, choices })
    }

    /// Whether `answer` may answer this question: not empty, not too long, and one of the
    /// choices when it offers some. `Err` says what an answer must be.
    pub fn check(&self, answer: &str) -> Result<(), String> {
        check_words(answer, "an answer", ANSWER_MAX_CHARS)?;
        if !self.choices.is_empty() && !self.choices.iter().any(|c| c == answer) {
            return Err(format!(
                "the question offers {}: answer with one of them, as written",
                self.choices
                    .iter()
                    .map(|c| format!("{c:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Ok(())
    }

    pub fn to_json(&self) -> Value {
        json!({"text": self.text, "choices": self.choices})
    }
}

/// What in a model's `ask_person` arguments no person could answer (their schema already
/// checked): a blank question, a choice that is blank, has spaces around it, holds a control
/// character (a line break included) or is given twice. `Err` is what the model is told.
pub fn check_asked(args: &serde_json::Map<String, Value>) -> Result<(), String> {
    let question = args.get("question").and_then(Value::as_str).unwrap_or("");
    if question.trim().is_empty() {
        return Err("ask_person: the question is blank".into());
    }
    if question
        .chars()
        .any(|c| c.is_control() && !matches!(c, '\n' | '\t'))
    {
        return Err("ask_person: the question holds a control character".into());
    }
    let choices: Vec<&str> = args
        .get("choices")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for (i, c) in choices.iter().enumerate() {
        let why = if c.trim().is_empty() {
            "is blank"
        } else if c.trim() != *c {
            "has spaces around it"
        } else if c.chars().any(char::is_control) {
            "holds a control character or a line break"
        } else if choices[..i].contains(c) {
            "is given twice"
        } else {
            continue;
        };
        return Err(format!(
            "ask_person: choice {c:?} {why}; give each choice once, as a person would type it"
        ));
    }
    Ok(())
}

/// What the held `ask_person` call is answered with: the person's words.
pub fn answer_result(answer: &str) -> Value {
    json!({"status": "ok", "answer": answer})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    /// A question no one could answer is refused to the model, saying why.
    #[test]
    fn a_question_no_one_could_answer_is_refused() {
        let ok = args(json!({"question": "Which one?\nSay it.", "choices": ["red", "blue"]}));
        assert_eq!(check_asked(&ok), Ok(()));
        for (bad, why) in [
            (json!({"question": "   "}), "blank"),
            (json!({"question": "a\u{7}"}), "control character"),
            (json!({"question": "Q", "choices": [" ", "b"]}), "is blank"),
            (
                json!({"question": "Q", "choices": ["a ", "b"]}),
                "spaces around it",
            ),
            (
                json!({"question": "Q", "choices": ["a\r\nb", "c"]}),
                "line break",
            ),
            (
                json!({"question": "Q", "choices": ["a", "a"]}),
                "given twice",
            ),
        ] {
            let e = check_asked(&args(bad.clone())).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    /// An answer is checked against its question: some text, within the bound, one of the
    /// choices when there are some.
    #[test]
    fn an_answer_fits_its_question() {
        let q = Question {
            text: "Which?".into(),
            choices: vec!["red".into(), "blue".into()],
        };
        assert_eq!(q.check("blue"), Ok(()));
        assert!(q.check("Blue").unwrap_err().contains("\"red\", \"blue\""));
        let free = Question {
            text: "Why?".into(),
            choices: Vec::new(),
        };
        assert_eq!(free.check("because\nof it"), Ok(()));
        assert!(free.check("").is_err() && free.check("a\rb").is_err());
        assert!(free.check(&"x".repeat(ANSWER_MAX_CHARS + 1)).is_err());
    }
}
