//! OpenAI's Chat Completions, and the servers that speak it: the request a step sends and the
//! reading of its response ([`super::http`] sends it).
//!
//! A request is bounded, not a transcript: the system message (instructions and the kernel's
//! rules), the goal, the conversation after it when a person continued the task (earlier
//! answers as `assistant` messages, follow-ups as `user` ones), the model's last reply and
//! what came of each of its calls (the `assistant` message with its `tool_calls` and one
//! `tool` message per call, as the protocol requires), then the task's state as JSON. With native tool calling every tool is a
//! function with its JSON Schema, beside `propose_plan` and `final_answer`; `tool_choice` is
//! `required` (or `auto` when plain text may be the final answer) and `parallel_tool_calls`
//! is false. A reply that still carries several calls runs the first; the others are
//! answered `not_run` in the next request. With JSON tool calling the reply is one JSON
//! object (`response_format: json_object`), found in any prose around it.

use serde_json::{Map, Value, json};

use super::http::Parsed;
use super::profile::{FinalAnswer, HttpProfile, MaxTokensParam, ToolCalling};
use super::prompt::{Prompt, TURN_CALLS_MAX, arguments_of, call_id, result_text, turn_text};
use crate::kernel::conversation::Speaker;
use crate::kernel::{ModelError, ModelRequest, ResponseInfo, Turn, TurnCall, Usage};
use crate::limits;
use crate::net::clip;

/// The text before the state in the last user message.
pub const STATE_LEAD: &str = "The task's state now (JSON):\n";

/// The Chat Completions request for `req`.
pub fn request(p: &HttpProfile, pr: &Prompt, req: &ModelRequest<'_>) -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": pr.system}),
        json!({"role": "user", "content": req.goal}),
    ];
    for m in req.conversation {
        let role = match m.role {
            Speaker::User => "user",
            Speaker::Agent => "assistant",
        };
        messages.push(json!({"role": role, "content": m.text}));
    }
    if let Some(last) = req.last_turn {
        let t = &last.turn;
        if !t.calls.is_empty() {
            let calls: Vec<Value> = t
                .calls
                .iter()
                .map(|c| {
                    json!({"id": c.id, "type": "function", "function": {
                        "name": c.name,
                        "arguments": arguments_text(&c.arguments),
                    }})
                })
                .collect();
            messages.push(json!({"role": "assistant", "content": t.text, "tool_calls": calls}));
            for (i, c) in t.calls.iter().enumerate() {
                messages.push(json!({
                    "role": "tool",
                    "tool_call_id": c.id,
                    "content": result_text(last.results.get(i).unwrap_or(&missing_result())),
                }));
            }
        } else if let Some(text) = &t.text {
            messages.push(json!({"role": "assistant", "content": text}));
        }
    }
    messages.push(json!({"role": "user", "content": format!("{STATE_LEAD}{}", req.view)}));
    let mut body = Map::new();
    body.insert("model".into(), Value::from(p.model.clone()));
    body.insert("messages".into(), Value::Array(messages));
    let cap = match p.max_tokens_param {
        MaxTokensParam::MaxCompletionTokens => "max_completion_tokens",
        MaxTokensParam::MaxTokens => "max_tokens",
    };
    body.insert(cap.into(), Value::from(req.output_tokens_max));
    if let Some(t) = p.temperature {
        body.insert("temperature".into(), Value::from(t));
    }
    match pr.calling {
        ToolCalling::Native => {
            let tools: Vec<Value> = pr
                .functions
                .iter()
                .map(|f| {
                    json!({"type": "function", "function": {
                        "name": f.name,
                        "description": f.description,
                        "parameters": f.parameters,
                    }})
                })
                .collect();
            body.insert("tools".into(), Value::Array(tools));
            let choice = match pr.final_answer {
                FinalAnswer::Function => "required",
                FinalAnswer::Content => "auto",
            };
            body.insert("tool_choice".into(), Value::from(choice));
            body.insert("parallel_tool_calls".into(), Value::Bool(false));
        }
        ToolCalling::Json => {
            body.insert("response_format".into(), json!({"type": "json_object"}));
        }
    }
    Value::Object(body)
}

/// What a call is answered with when its step left no result (a run cut short).
pub fn missing_result() -> Value {
    json!({"status": "error", "code": "no_result", "detail": "this call has no recorded result"})
}

/// A call's arguments as the protocol carries them: JSON text.
pub fn arguments_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Reads a Chat Completions response: the move (or why there is none), the usage billed and
/// the reply's turn.
pub fn parse(pr: &Prompt, step: u32, text: &str) -> Result<Parsed, ModelError> {
    let v: Value = limits::parse_json_input(text, "the completion", limits::REPLY_BYTES_MAX)
        .map_err(|e| ModelError::Failed(e.0))?;
    let text_of = |x: &Value| x.as_str().map(|s| clip(s).to_string());
    let response = ResponseInfo {
        id: text_of(&v["id"]),
        model: text_of(&v["model"]),
        finish_reasons: v["choices"]
            .as_array()
            .map(|cs| {
                cs.iter()
                    .filter_map(|c| text_of(&c["finish_reason"]))
                    .collect()
            })
            .unwrap_or_default(),
    };
    let usage = match (
        v["usage"]["prompt_tokens"].as_u64(),
        v["usage"]["completion_tokens"].as_u64(),
    ) {
        (Some(i), Some(o)) => Some(Usage {
            input_tokens: i,
            output_tokens: o,
        }),
        _ => None,
    };
    let choice = &v["choices"][0];
    if !choice.is_object() {
        return Err(ModelError::Failed(format!(
            "the response is not a chat completion (it has no choices[0]): {}",
            clip(text)
        )));
    }
    let msg = &choice["message"];
    let content = msg["content"].as_str();
    let calls: Vec<TurnCall> = msg["tool_calls"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .take(TURN_CALLS_MAX)
                .enumerate()
                .map(|(i, c)| TurnCall {
                    id: call_id(c["id"].as_str(), step, i),
                    name: c["function"]["name"].as_str().unwrap_or("").to_string(),
                    arguments: arguments_of(c["function"]["arguments"].as_str().unwrap_or("")),
                })
                .collect()
        })
        .unwrap_or_default();
    let turn = Turn {
        text: turn_text(content),
        calls,
    };
    let finish = choice["finish_reason"].as_str().unwrap_or("");
    let outcome = if let Some(r) = msg["refusal"].as_str().filter(|r| !r.is_empty()) {
        Err(ModelError::Refused(format!(
            "the model refused: {}",
            limits::one_line(&clip(r))
        )))
    } else if finish == "content_filter" {
        Err(ModelError::Refused(
            "the provider's content filter stopped the reply".into(),
        ))
    } else {
        Ok(pr.move_of_reply(&turn, content, finish == "length"))
    };
    Ok(Parsed::new(outcome, usage, response, turn))
}
