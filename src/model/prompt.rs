//! What an HTTP model is told, and how its reply becomes a move: the system prompt (the
//! agent's instructions, then the kernel's versioned rules), the tools as functions with their
//! JSON Schemas (plus `propose_plan` and `final_answer`), and the reading of a reply's function
//! calls or text as the kernel's plan, tool call or final answer. Provider-neutral: the
//! adapters (`openai`, `anthropic`) put these into their own protocol.

use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Weak};

use super::profile::{FinalAnswer, ToolCalling, text_digest};
use crate::kernel::catalog::Access;
use crate::kernel::{Catalog, RawReply, TurnCall};
use crate::limits;

/// The function that proposes a plan.
pub const PLAN_FN: &str = "propose_plan";
/// The function that gives the final answer.
pub const FINAL_FN: &str = "final_answer";
/// The argument added to every tool's function: the plan step the call carries out.
pub const PLAN_STEP_ARG: &str = "plan_step";
/// Names a catalog tool may not take: they are the kernel's functions.
pub const RESERVED_NAMES: [&str; 2] = [PLAN_FN, FINAL_FN];

/// Version of the rules in `data/prompt_native_v2.txt` and `data/prompt_json_v3.txt`;
/// recorded with each reply (see [`Prompt::id`]). Native 2 and JSON 3 say how a conversation
/// continues a task.
pub const NATIVE_RULES_VERSION: u32 = 2;
pub const JSON_RULES_VERSION: u32 = 3;
const NATIVE_RULES: &str = include_str!("../../data/prompt_native_v2.txt");
const JSON_RULES: &str = include_str!("../../data/prompt_json_v3.txt");

/// The longest text of a reply kept beside its calls for the next request.
const TURN_TEXT_MAX: usize = 4096;
/// The most calls of one reply kept (and answered) for the next request.
pub const TURN_CALLS_MAX: usize = 8;

/// A function offered to the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments.
    pub parameters: Value,
}

/// What a task's model is told, fixed for the task's run.
#[derive(Clone, Debug)]
pub struct Prompt {
    pub system: Arc<str>,
    /// The functions offered (none with [`ToolCalling::Json`]).
    pub functions: Arc<[Function]>,
    pub calling: ToolCalling,
    pub final_answer: FinalAnswer,
    /// Recorded with each reply: the rules' version and a digest of the instructions.
    pub id: String,
    /// Tools whose own schema has a `plan_step` argument: it is theirs, not the kernel's.
    own_plan_step: Arc<BTreeSet<String>>,
    /// Keeps this prompt's entry of the shared ones alive.
    _shared: Option<Arc<Shared>>,
}

/// What prompts of the same catalog, calling and instructions share: thousands of tasks in
/// flight on one profile hold one copy of its system prompt and functions, not one each.
#[derive(Debug)]
struct Shared {
    system: Arc<str>,
    functions: Arc<[Function]>,
    own_plan_step: Arc<BTreeSet<String>>,
}

/// The prompts alive in this process, by a digest of what they are made of; an entry lives
/// as long as a prompt holds it.
static SHARED: std::sync::Mutex<BTreeMap<String, Weak<Shared>>> =
    std::sync::Mutex::new(BTreeMap::new());

impl Prompt {
    pub fn new(
        catalog: &Catalog,
        calling: ToolCalling,
        final_answer: FinalAnswer,
        profile_instructions: Option<&str>,
        task_instructions: Option<&str>,
    ) -> Prompt {
        let made = Self::build(
            catalog,
            calling,
            final_answer,
            profile_instructions,
            task_instructions,
        );
        let key = format!(
            "{}:{}:{}",
            made.id,
            made.system.len(),
            text_digest(&format!("{}\u{0}{:?}", made.system, made.functions))
        );
        let mut cache = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(shared) = cache.get(&key).and_then(Weak::upgrade) {
            return Prompt {
                system: Arc::clone(&shared.system),
                functions: Arc::clone(&shared.functions),
                own_plan_step: Arc::clone(&shared.own_plan_step),
                _shared: Some(shared),
                ..made
            };
        }
        if cache.len() >= 1024 {
            cache.retain(|_, w| w.strong_count() > 0);
        }
        let shared = Arc::new(Shared {
            system: Arc::clone(&made.system),
            functions: Arc::clone(&made.functions),
            own_plan_step: Arc::clone(&made.own_plan_step),
        });
        cache.insert(key, Arc::downgrade(&shared));
        // The entry lives while a prompt holds one of its parts.
        made.keep(shared)
    }

    fn build(
        catalog: &Catalog,
        calling: ToolCalling,
        final_answer: FinalAnswer,
        profile_instructions: Option<&str>,
        task_instructions: Option<&str>,
    ) -> Prompt {
        let mut system = String::new();
        let mut instructions = String::new();
        if let Some(i) = profile_instructions
            .map(str::trim)
            .filter(|i| !i.is_empty())
        {
            instructions.push_str(i);
            instructions.push_str("\n\n");
        }
        if let Some(i) = task_instructions.map(str::trim).filter(|i| !i.is_empty()) {
            instructions.push_str("Instructions for this task:\n");
            instructions.push_str(i);
            instructions.push_str("\n\n");
        }
        system.push_str(&instructions);
        let (rules, version, mode) = match calling {
            ToolCalling::Native => (NATIVE_RULES, NATIVE_RULES_VERSION, "native"),
            ToolCalling::Json => (JSON_RULES, JSON_RULES_VERSION, "json"),
        };
        system.push_str(rules);
        let mut own_plan_step = BTreeSet::new();
        let mut functions = Vec::new();
        for t in &catalog.tools {
            let (f, own) = function_of(t);
            if own {
                own_plan_step.insert(t.name.clone());
            }
            functions.push(f);
        }
        let tool_names: Vec<Value> = catalog
            .tools
            .iter()
            .map(|t| Value::from(t.name.clone()))
            .collect();
        match calling {
            ToolCalling::Native => {
                functions.insert(0, plan_function(tool_names));
                functions.push(final_function());
            }
            ToolCalling::Json => {
                for f in &functions {
                    system.push_str(&format!(
                        "- {}: {}\n  arguments: {}\n",
                        f.name,
                        f.description,
                        crate::kernel::json::dumps(&f.parameters)
                    ));
                }
                functions.clear();
            }
        }
        let mut id = format!("{mode}-{version}");
        if !instructions.is_empty() {
            id.push('+');
            id.push_str(&text_digest(&instructions));
        }
        Prompt {
            system: system.into(),
            functions: functions.into(),
            calling,
            final_answer,
            id,
            own_plan_step: Arc::new(own_plan_step),
            _shared: None,
        }
    }

    fn keep(mut self, shared: Arc<Shared>) -> Prompt {
        self._shared = Some(shared);
        self
    }

    /// The system prompt and functions as the number of characters they add to every request
    /// (what the kernel's token check counts beside the view).
    pub fn overhead_chars(&self) -> usize {
        self.system.len()
            + self
                .functions
                .iter()
                .map(|f| f.name.len() + f.description.len() + f.parameters.to_string().len())
                .sum::<usize>()
    }

    /// The move a function call makes, as the kernel reads replies.
    pub fn move_of_call(&self, call: &TurnCall) -> RawReply {
        let Value::Object(args) = &call.arguments else {
            return RawReply::Invalid(format!(
                "the arguments of {} are not a JSON object: {}",
                call.name,
                clip_value(&call.arguments)
            ));
        };
        let mut args = args.clone();
        match call.name.as_str() {
            PLAN_FN => RawReply::Json(json!({
                "type": "plan",
                "steps": args.remove("steps").unwrap_or(Value::Null),
            })),
            FINAL_FN => {
                // The function's schema requires one of the two outcomes: without one, a
                // "final" would end the task done without the check that its plan is done.
                let outcome = args.get("outcome").and_then(Value::as_str);
                if !matches!(outcome, Some("completed" | "cannot_complete")) {
                    return RawReply::Invalid(format!(
                        "{FINAL_FN} needs \"outcome\": \"completed\" or \"cannot_complete\"; it had {}",
                        args.get("outcome").map_or("none".to_string(), clip_value)
                    ));
                }
                let mut m = Map::new();
                m.insert("type".into(), Value::from("final"));
                for k in ["outcome", "text"] {
                    if let Some(v) = args.remove(k) {
                        m.insert(k.into(), v);
                    }
                }
                RawReply::Json(Value::Object(m))
            }
            name => {
                let plan_step = if self.own_plan_step.contains(name) {
                    Value::Null
                } else {
                    match args.remove(PLAN_STEP_ARG) {
                        None | Some(Value::Null) => Value::Null,
                        Some(Value::String(s)) => Value::String(s),
                        Some(other) => {
                            return RawReply::Invalid(format!(
                                "{name}: {PLAN_STEP_ARG} must be the id of a plan step (a string), not {}",
                                clip_value(&other)
                            ));
                        }
                    }
                };
                RawReply::Json(json!({
                    "type": "tool",
                    "name": name,
                    "args": Value::Object(args),
                    "plan_step": plan_step,
                }))
            }
        }
    }

    /// The move of a reply the provider did not refuse: none when it was cut off at the output
    /// limit (`cut`), else its first call, else the move in its `text`, else none.
    pub fn move_of_reply(
        &self,
        turn: &crate::kernel::Turn,
        text: Option<&str>,
        cut: bool,
    ) -> RawReply {
        if cut {
            cut_off(turn)
        } else if let Some(first) = turn.calls.first() {
            self.move_of_call(first)
        } else if let Some(t) = text {
            self.move_of_text(t)
        } else {
            RawReply::Invalid("the reply has neither text nor a function call".into())
        }
    }

    /// The move a reply of text alone makes: one JSON object in it that is a move (with JSON
    /// tool calling, any JSON object); with [`FinalAnswer::Content`], otherwise the final
    /// answer; otherwise an invalid reply that says what a reply must be.
    pub fn move_of_text(&self, text: &str) -> RawReply {
        // A reply that is JSON alone (perhaps in a Markdown fence) is the kernel's to read, so
        // that what is wrong with it (a field named twice, nesting too deep) is said exactly.
        let bare = strip_fences(text);
        let found = json_objects(text);
        if bare.starts_with('{') && bare.ends_with('}') && found.len() < 2 {
            return RawReply::Text(bare.to_string());
        }
        match self.calling {
            ToolCalling::Json => match found.as_slice() {
                [one] => RawReply::Json(one.clone()),
                [] => RawReply::Invalid(
                    "the reply has no JSON object: reply with exactly one JSON object (a plan, a tool call or a final answer)".into(),
                ),
                many => RawReply::Invalid(format!(
                    "the reply has {} JSON objects: reply with exactly one",
                    many.len()
                )),
            },
            ToolCalling::Native => {
                let moves: Vec<&Value> = found.iter().filter(|v| v.get("type").is_some()).collect();
                if let [one] = moves.as_slice() {
                    return RawReply::Json((*one).clone());
                }
                match self.final_answer {
                    FinalAnswer::Content if !text.trim().is_empty() => RawReply::Json(json!({
                        "type": "final", "outcome": "completed", "text": text.trim(),
                    })),
                    _ => RawReply::Invalid(format!(
                        "the reply was text without a function call: every reply must call exactly one function ({PLAN_FN}, a tool, or {FINAL_FN})"
                    )),
                }
            }
        }
    }
}

/// What the model is told of one tool: its description (with its access) and its
/// arguments' schema, less the task's user argument, plus the plan step argument unless the
/// tool has one of its own (then `true`).
fn function_of(t: &crate::kernel::ToolSpec) -> (Function, bool) {
    let mut schema = t.input_schema();
    // The task's user id is the task's, never the model's: not offered.
    if let Some(u) = t.mcp.as_ref().and_then(|m| m.user_arg.as_deref()) {
        remove_property(&mut schema, u);
    }
    let has_own = schema
        .get("properties")
        .and_then(Value::as_object)
        .is_some_and(|p| p.contains_key(PLAN_STEP_ARG));
    if !has_own && let Some(obj) = schema.as_object_mut() {
        let props = obj
            .entry("properties")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(p) = props.as_object_mut() {
            p.insert(
                PLAN_STEP_ARG.into(),
                json!({"type": "string", "description": "The id of the plan step this call carries out (s1, s2, ...). May be left out when only one open step uses this tool."}),
            );
        }
    }
    let access = match t.access {
        Access::Read => "Reads; changes nothing.",
        Access::Write => {
            "Writes: it changes something outside, and may wait for a person's approval."
        }
    };
    let description = if t.description.trim().is_empty() {
        access.to_string()
    } else {
        format!("{} ({access})", t.description.trim())
    };
    let f = Function {
        name: t.name.clone(),
        description,
        parameters: schema,
    };
    (f, has_own)
}

/// The function that proposes a plan, its `tool` limited to the catalog's tools.
fn plan_function(tools: Vec<Value>) -> Function {
    Function {
        name: PLAN_FN.into(),
        description: "Propose the plan before acting: the steps that reach the goal, in order; a step runs only after the steps it depends on are done. Call it again to revise the plan after a failure: keep the done steps, and give a retried step a new id.".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "steps": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "string", "description": "A short id: s1, s2, ..."},
                            "tool": {"type": "string", "enum": tools, "description": "The tool this step calls."},
                            "depends_on": {"type": "array", "items": {"type": "string"}, "description": "Ids of the steps that must be done first."}
                        },
                        "required": ["id", "tool", "depends_on"],
                        "additionalProperties": false
                    }
                }
            },
            "required": ["steps"],
            "additionalProperties": false
        }),
    }
}

fn final_function() -> Function {
    Function {
        name: FINAL_FN.into(),
        description: "End the task with the answer for the person who asked. Outcome completed only when no plan step is still pending and no write failed; cannot_complete, with the reason, when the goal cannot be reached.".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "outcome": {"type": "string", "enum": ["completed", "cannot_complete"]},
                "text": {"type": "string", "description": "The answer, or why the goal cannot be reached."}
            },
            "required": ["outcome", "text"],
            "additionalProperties": false
        }),
    }
}

fn remove_property(schema: &mut Value, name: &str) {
    if let Some(p) = schema.get_mut("properties").and_then(Value::as_object_mut) {
        p.remove(name);
    }
    if let Some(r) = schema.get_mut("required").and_then(Value::as_array_mut) {
        r.retain(|v| v.as_str() != Some(name));
    }
}

fn clip_value(v: &Value) -> String {
    let s = match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    limits::one_line(&crate::net::clip(&s)).into_owned()
}

/// The text inside a Markdown code fence, if the reply is one; the trimmed text otherwise.
fn strip_fences(s: &str) -> &str {
    let t = s.trim();
    match t.strip_prefix("```") {
        Some(rest) => {
            let rest = rest.strip_prefix("json").unwrap_or(rest);
            rest.strip_suffix("```").unwrap_or(rest).trim()
        }
        None => t,
    }
}

/// The move of a reply cut off at the output token limit: none, and the model is told why.
pub fn cut_off(turn: &crate::kernel::Turn) -> RawReply {
    RawReply::Invalid(format!(
        "the reply was cut off at the output token limit (after {} characters of text and {} function calls): reply with a shorter move",
        turn.text.as_ref().map_or(0, |t| t.chars().count()),
        turn.calls.len()
    ))
}

/// The text kept beside a reply's calls: at most [`TURN_TEXT_MAX`] bytes, `None` when empty.
pub fn turn_text(text: Option<&str>) -> Option<String> {
    let t = text?.trim();
    if t.is_empty() {
        return None;
    }
    let mut end = t.len().min(TURN_TEXT_MAX);
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    Some(t[..end].to_string())
}

/// A call id as the next request may send it back: the provider's, when it is short letters,
/// digits, `_` and `-` (what every provider accepts); otherwise one made from its place.
pub fn call_id(given: Option<&str>, step: u32, i: usize) -> String {
    match given {
        Some(id)
            if !id.is_empty()
                && id.len() <= 64
                && id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
        {
            id.to_string()
        }
        _ => format!("call_{step}_{i}"),
    }
}

/// A call's arguments as a provider sent them (JSON text): the object, or the text itself
/// when it is not one JSON value.
pub fn arguments_of(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Object(Map::new());
    }
    match limits::strict_json(text) {
        Ok(v) if limits::check_depth(&v, "arguments").is_ok() => v,
        _ => Value::String(text.to_string()),
    }
}

/// The result a call is answered with, as the text of a tool message.
pub fn result_text(v: &Value) -> String {
    crate::kernel::json::dumps(v)
}

/// The JSON objects in a text, outermost only, in order: what a model that wraps its JSON in
/// prose or a Markdown fence meant. At most a few are looked for.
pub fn json_objects(text: &str) -> Vec<Value> {
    const ATTEMPTS_MAX: usize = 64;
    let mut found = Vec::new();
    let mut at = 0;
    let mut attempts = 0;
    while let Some(off) = text[at..].find('{') {
        let start = at + off;
        attempts += 1;
        if attempts > ATTEMPTS_MAX || found.len() > 4 {
            break;
        }
        let mut it = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
        match it.next() {
            Some(Ok(Value::Object(_))) => {
                let end = start + it.byte_offset();
                // Read again strictly: a key named twice is no object a reader can be sure of.
                match limits::strict_json(&text[start..end]) {
                    Ok(v) if limits::check_depth(&v, "reply").is_ok() => found.push(v),
                    _ => {}
                }
                at = end;
            }
            _ => at = start + 1,
        }
    }
    found
}

#[cfg(test)]
mod tests;
