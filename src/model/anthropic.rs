//! Anthropic's Messages API: the request a step sends and the reading of its response
//! ([`super::http`] sends it, with `x-api-key` and `anthropic-version`).
//!
//! The same bounded input as Chat Completions, in this protocol's shape: the system prompt
//! as a cached block; a first user message with the goal; the conversation after it when a
//! person continued the task (answers as `assistant` text, follow-ups as `user` text); the
//! model's last reply as an `assistant` message of `text` and `tool_use` blocks, answered in
//! the next `user` message by one `tool_result` block per call, followed by the state as a
//! text block. Tools carry their
//! JSON Schema as `input_schema`; `tool_choice` is `any` (or `auto` when text may be the final
//! answer) with `disable_parallel_tool_use`. `stop_reason` `refusal` is recorded as a refusal,
//! `max_tokens` as a reply cut off; the usage counts cached input tokens as input.

use serde_json::{Map, Value, json};

use super::http::Parsed;
use super::openai::{STATE_LEAD, missing_result};
use super::profile::{FinalAnswer, HttpProfile, ToolCalling};
use super::prompt::{Prompt, TURN_CALLS_MAX, call_id, result_text, turn_text};
use crate::kernel::conversation::Speaker;
use crate::kernel::{ModelError, ModelRequest, ResponseInfo, Turn, TurnCall, Usage};
use crate::limits;
use crate::net::clip;

/// The API version sent as `anthropic-version`.
pub const VERSION: &str = "2023-06-01";

/// Adds `block` to the last message when it is `role`'s, else as a message of its own: the
/// protocol wants the roles to take turns.
fn say(messages: &mut Vec<Value>, role: &str, block: Value) {
    if let Some(last) = messages.last_mut()
        && last["role"] == role
        && let Some(content) = last["content"].as_array_mut()
    {
        content.push(block);
        return;
    }
    messages.push(json!({"role": role, "content": [block]}));
}

/// The Messages request for `req`.
pub fn request(p: &HttpProfile, pr: &Prompt, req: &ModelRequest<'_>) -> Value {
    let state = json!({"type": "text", "text": format!("{STATE_LEAD}{}", req.view)});
    let mut messages = Vec::new();
    say(
        &mut messages,
        "user",
        json!({"type": "text", "text": req.goal}),
    );
    for m in req.conversation {
        let role = match m.role {
            Speaker::User => "user",
            Speaker::Agent => "assistant",
        };
        say(&mut messages, role, json!({"type": "text", "text": m.text}));
    }
    if let Some(last) = req.last_turn {
        let t = &last.turn;
        if let Some(text) = &t.text {
            say(
                &mut messages,
                "assistant",
                json!({"type": "text", "text": text}),
            );
        }
        for c in &t.calls {
            let input = match &c.arguments {
                Value::Object(_) => c.arguments.clone(),
                _ => Value::Object(Map::new()),
            };
            let used = json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input});
            say(&mut messages, "assistant", used);
        }
        for (i, c) in t.calls.iter().enumerate() {
            let result = result_text(last.results.get(i).unwrap_or(&missing_result()));
            let block = json!({"type": "tool_result", "tool_use_id": c.id, "content": result});
            say(&mut messages, "user", block);
        }
    }
    say(&mut messages, "user", state);
    let mut body = Map::new();
    body.insert("model".into(), Value::from(p.model.clone()));
    body.insert("max_tokens".into(), Value::from(req.output_tokens_max));
    body.insert(
        "system".into(),
        json!([{"type": "text", "text": pr.system, "cache_control": {"type": "ephemeral"}}]),
    );
    body.insert("messages".into(), Value::Array(messages));
    if let Some(t) = p.temperature {
        body.insert("temperature".into(), Value::from(t.min(1.0)));
    }
    if pr.calling == ToolCalling::Native {
        let tools: Vec<Value> = pr
            .functions
            .iter()
            .map(|f| {
                json!({"name": f.name, "description": f.description, "input_schema": f.parameters})
            })
            .collect();
        body.insert("tools".into(), Value::Array(tools));
        let kind = match pr.final_answer {
            FinalAnswer::Function => "any",
            FinalAnswer::Content => "auto",
        };
        body.insert(
            "tool_choice".into(),
            json!({"type": kind, "disable_parallel_tool_use": true}),
        );
    }
    Value::Object(body)
}

/// Reads a Messages response.
pub fn parse(pr: &Prompt, step: u32, text: &str) -> Result<Parsed, ModelError> {
    let v: Value = limits::parse_json_input(text, "the message", limits::REPLY_BYTES_MAX)
        .map_err(|e| ModelError::Failed(e.0))?;
    let Some(blocks) = v["content"].as_array() else {
        return Err(ModelError::Failed(format!(
            "the response is not a message (it has no content): {}",
            clip(text)
        )));
    };
    let text_of = |x: &Value| x.as_str().map(|s| clip(s).to_string());
    let stop = v["stop_reason"].as_str().unwrap_or("");
    let response = ResponseInfo {
        id: text_of(&v["id"]),
        model: text_of(&v["model"]),
        finish_reasons: text_of(&v["stop_reason"]).into_iter().collect(),
    };
    let u = &v["usage"];
    let usage = match (u["input_tokens"].as_u64(), u["output_tokens"].as_u64()) {
        (Some(i), Some(o)) => Some(Usage {
            input_tokens: i
                + u["cache_creation_input_tokens"].as_u64().unwrap_or(0)
                + u["cache_read_input_tokens"].as_u64().unwrap_or(0),
            output_tokens: o,
        }),
        _ => None,
    };
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    for b in blocks {
        match b["type"].as_str() {
            Some("text") => texts.extend(b["text"].as_str()),
            Some("tool_use") if calls.len() < TURN_CALLS_MAX => calls.push(TurnCall {
                id: call_id(b["id"].as_str(), step, calls.len()),
                name: b["name"].as_str().unwrap_or("").to_string(),
                arguments: b["input"].clone(),
            }),
            _ => {}
        }
    }
    let joined = texts.join("\n");
    let turn = Turn {
        text: turn_text(Some(&joined)),
        calls,
    };
    let outcome = if stop == "refusal" {
        Err(ModelError::Refused(format!(
            "the model refused{}",
            turn.text
                .as_ref()
                .map(|t| format!(": {}", limits::one_line(&clip(t))))
                .unwrap_or_default()
        )))
    } else {
        let text = turn.text.is_some().then_some(joined.as_str());
        Ok(pr.move_of_reply(&turn, text, stop == "max_tokens"))
    };
    Ok(Parsed::new(outcome, usage, response, turn))
}
