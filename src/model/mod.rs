//! Models: the `Model` trait and the design reference's stand-ins.
//!
//! A model reads only the rendered view, as a real prompt builder would hand it over. The
//! stand-ins: the design reference's `Policy`, the one-line scripted models of the scenarios
//! (`same_call`, `new_ids`, `search_loop`), a script of replies (one JSON reply per line, so any
//! sequence can drive a task), the random model of the design reference's bound check, and a
//! [`Recorder`] and [`Replay`] pair. A [`ModelProfile`] names a model as data, so a stored task
//! can rebuild its model in another process.

pub mod anthropic;
pub mod http;
pub mod openai;
pub mod profile;
pub mod prompt;
pub mod pyrandom;
pub mod random;
pub mod rate;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::kernel::{
    InputStyle, ModelError, ModelReply, ModelRequest, RawReply, ResponseInfo, Turn, Usage,
};
pub use profile::HttpProfile;
pub use random::RandomModel;

pub trait Model: Send {
    fn next(&mut self, req: &ModelRequest<'_>) -> ModelReply;
    /// The reply as a future: a model that waits on a provider is awaited without holding a
    /// thread (the executor's way); one that answers at once answers through [`Model::next`].
    fn ask<'a>(&'a mut self, req: &'a ModelRequest<'a>) -> Asking<'a> {
        Box::pin(std::future::ready(self.next(req)))
    }
    /// How the model takes its input: the view alone (the design reference's models), or messages.
    fn input(&self) -> InputStyle {
        InputStyle::View
    }
    /// The version of what the model is told (rules and instructions), recorded with each
    /// reply; `None` for the scripted models.
    fn prompt_id(&self) -> Option<String> {
        None
    }
    /// After a call: the provider asked to slow down (a `429`) and this model was built to
    /// hand the wait to its driver rather than wait itself (a profile with a shared rate
    /// limit): how long, in ms. The reply of that call is then not to be folded in.
    fn busy(&mut self) -> Option<u64> {
        None
    }
}

/// A model's reply on its way (see [`Model::ask`]).
pub type Asking<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ModelReply> + Send + 'a>>;

/// A task's model as this process runs it: a scripted model as the task stored it, or a
/// profile of this process's config.
#[derive(Clone, Debug, PartialEq)]
pub enum RunModel {
    Scripted(ModelProfile),
    Http {
        name: String,
        profile: Box<HttpProfile>,
    },
}

impl RunModel {
    /// The model for a task whose tools are `catalog`, with the task's own instructions.
    pub fn build(
        &self,
        catalog: &crate::kernel::Catalog,
        instructions: Option<&str>,
    ) -> Box<dyn Model> {
        match self {
            RunModel::Scripted(p) => p.build(),
            RunModel::Http { profile, .. } => http::build(profile, catalog, instructions),
        }
    }

    /// The HTTP profile, if this is one.
    pub fn http(&self) -> Option<&HttpProfile> {
        match self {
            RunModel::Http { profile, .. } => Some(profile),
            RunModel::Scripted(_) => None,
        }
    }
}

/// A model named as data: what `worker enqueue --model` stores with a task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ModelProfile {
    /// The design reference's Policy: plan, read the order, refund, email, final answer.
    Policy {
        order: String,
        amount_cents: i64,
        latency_ms: u64,
    },
    /// Proposes `get_order` for a nonexistent order every step.
    SameCall { latency_ms: u64 },
    /// Proposes `get_order` for a new nonexistent order every step.
    NewIds { latency_ms: u64 },
    /// Calls `search_policy`, whose results are large, with a new query every step.
    SearchLoop { latency_ms: u64 },
    /// Reply `n` answers step `n`; past the end the model fails (which counts as a step).
    Script {
        replies: Vec<Value>,
        latency_ms: u64,
    },
    /// An OpenAI-compatible Chat Completions endpoint. The API key is read from the named
    /// environment variable when the model is built; it is never stored. This is a profile as
    /// a config file declares it; a task stores [`ModelProfile::Profile`] instead (tasks of
    /// older versions stored this, and run only where a profile of the config equals it).
    OpenAi {
        base_url: String,
        model: String,
        api_key_env: Option<String>,
        max_retries: u32,
        temperature: f64,
    },
    /// A model profile of the config, by name: what `worker enqueue --model NAME` stores.
    /// The daemon that runs the task resolves the name in its own config, so the endpoint a
    /// request goes to and the secret it carries are the daemon's, never the enqueuer's.
    Profile { name: String },
}

pub const DEFAULT_LATENCY_MS: u64 = 1500;

impl ModelProfile {
    /// The name metrics and logs give this model: its kind, or an HTTP model's model name.
    pub fn label(&self) -> &str {
        match self {
            ModelProfile::Policy { .. } => "policy",
            ModelProfile::SameCall { .. } => "same_call",
            ModelProfile::NewIds { .. } => "new_ids",
            ModelProfile::SearchLoop { .. } => "search_loop",
            ModelProfile::Script { .. } => "script",
            ModelProfile::OpenAi { model, .. } => model,
            ModelProfile::Profile { name } => name,
        }
    }

    pub fn policy() -> ModelProfile {
        ModelProfile::Policy {
            order: "ord_1001".into(),
            amount_cents: 3000,
            latency_ms: DEFAULT_LATENCY_MS,
        }
    }

    /// Builds the model with the design reference's catalog.
    pub fn build(&self) -> Box<dyn Model> {
        match self.clone() {
            ModelProfile::Policy {
                order,
                amount_cents,
                latency_ms,
            } => Box::new(Policy {
                order,
                amount_cents,
                latency_ms,
            }),
            ModelProfile::SameCall { latency_ms } => Box::new(OneLiner {
                kind: OneLinerKind::SameCall,
                latency_ms,
            }),
            ModelProfile::NewIds { latency_ms } => Box::new(OneLiner {
                kind: OneLinerKind::NewIds,
                latency_ms,
            }),
            ModelProfile::SearchLoop { latency_ms } => Box::new(OneLiner {
                kind: OneLinerKind::SearchLoop,
                latency_ms,
            }),
            ModelProfile::Script {
                replies,
                latency_ms,
            } => Box::new(Script {
                replies,
                latency_ms,
            }),
            // Only a config resolves these (`Config::model_for`); unresolved, every call fails
            // saying so.
            ModelProfile::OpenAi { base_url, .. } => Box::new(Unavailable(format!(
                "the model endpoint {base_url} was not resolved by a config"
            ))),
            ModelProfile::Profile { name } => Box::new(Unavailable(format!(
                "model profile {name:?} was not resolved by a config"
            ))),
        }
    }

    /// Whether `spec` names one of the demo models (its kind before any `:`), well formed or
    /// not: anything else is a profile's name, or unknown.
    pub fn names_a_demo_model(spec: &str) -> bool {
        let kind = spec.split(':').next().unwrap_or("");
        ["policy", "same_call", "new_ids", "search_loop", "script"].contains(&kind)
    }

    /// Parses the `--model` argument: `policy[:ORDER:AMOUNT[:LATENCY_MS]]`, `same_call`,
    /// `new_ids`, `search_loop` (each with an optional `:LATENCY_MS`), or
    /// `script:FILE.jsonl[:LATENCY_MS]` (the file is read by the caller and passed as
    /// `script_text`; see [`script_file`]).
    pub fn parse(spec: &str, script_text: Option<&str>) -> Result<ModelProfile, String> {
        let parts: Vec<&str> = spec.split(':').collect();
        let latency = |s: Option<&&str>| -> Result<u64, String> {
            match s {
                None => Ok(DEFAULT_LATENCY_MS),
                Some(v) => v.parse().map_err(|_| {
                    format!("model latency {v:?} is not a whole number of milliseconds")
                }),
            }
        };
        match parts[0] {
            "policy" => match parts.len() {
                1 => Ok(ModelProfile::policy()),
                3 | 4 => Ok(ModelProfile::Policy {
                    order: parts[1].to_string(),
                    amount_cents: parts[2].parse().map_err(|_| {
                        format!(
                            "policy amount {:?} is not a whole number of cents",
                            parts[2]
                        )
                    })?,
                    latency_ms: latency(parts.get(3))?,
                }),
                _ => Err("expected policy or policy:ORDER:AMOUNT_CENTS[:LATENCY_MS]".into()),
            },
            "same_call" if parts.len() <= 2 => Ok(ModelProfile::SameCall {
                latency_ms: latency(parts.get(1))?,
            }),
            "new_ids" if parts.len() <= 2 => Ok(ModelProfile::NewIds {
                latency_ms: latency(parts.get(1))?,
            }),
            "search_loop" if parts.len() <= 2 => Ok(ModelProfile::SearchLoop {
                latency_ms: latency(parts.get(1))?,
            }),
            "script" => {
                let text = script_text.ok_or("script:FILE needs the file's text")?;
                Ok(ModelProfile::Script {
                    replies: parse_script(text)?,
                    latency_ms: latency(parts.get(1))?,
                })
            }
            other => Err(format!(
                "unknown model {other:?}; known: policy, same_call, new_ids, search_loop, script:FILE"
            )),
        }
    }
}

/// `script:`'s argument split into the file and its simulated latency per reply:
/// `FILE[:LATENCY_MS]`, a trailing `:` and digits being the latency (as the other demo models
/// take theirs) unless the whole argument names a file.
pub fn script_file(arg: &str) -> (&str, Option<u64>) {
    // A file whose own name ends in `:` and digits is that file.
    if std::path::Path::new(arg).is_file() {
        return (arg, None);
    }
    match arg.rsplit_once(':') {
        Some((file, ms))
            if !file.is_empty() && !ms.is_empty() && ms.bytes().all(|b| b.is_ascii_digit()) =>
        {
            match ms.parse() {
                Ok(ms) => (file, Some(ms)),
                Err(_) => (arg, None),
            }
        }
        _ => (arg, None),
    }
}

/// A script file: one reply per line. A line that is JSON is that reply; any other non-empty
/// line is kept as text, so a script can also feed the kernel malformed replies.
pub fn parse_script(text: &str) -> Result<Vec<Value>, String> {
    let mut replies = Vec::new();
    for (n, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        if l.len() > crate::limits::REPLY_BYTES_MAX {
            return Err(format!(
                "line {}: {} bytes, over the limit of {}",
                n + 1,
                l.len(),
                crate::limits::REPLY_BYTES_MAX
            ));
        }
        let v = match crate::limits::strict_json(l) {
            Ok(v) => v,
            Err(e) if e.to_string().contains("recursion limit") => {
                return Err(format!(
                    "line {}: nests deeper than {} levels",
                    n + 1,
                    crate::limits::JSON_DEPTH_MAX
                ));
            }
            // A reply that names a field twice is no reply a reader can be sure of.
            Err(e) if e.to_string().starts_with("duplicate field") => {
                return Err(format!("line {}: {e}", n + 1));
            }
            Err(_) => Value::String(l.to_string()),
        };
        crate::limits::check_depth(&v, &format!("line {}", n + 1)).map_err(|e| e.0)?;
        replies.push(v);
    }
    if replies.is_empty() {
        return Err("the script has no replies (one JSON reply per line)".into());
    }
    Ok(replies)
}

/// A model that cannot be called here (a profile this process's config does not have): every
/// call fails with the reason, as a provider's error would, and nothing is sent.
pub struct Unavailable(pub String);

impl Model for Unavailable {
    fn next(&mut self, _req: &ModelRequest<'_>) -> ModelReply {
        ModelReply::failed(ModelError::Failed(self.0.clone()), 0)
    }
}

/// The design reference's Policy: decides the next call from the facts and plan in its view.
pub struct Policy {
    pub order: String,
    pub amount_cents: i64,
    pub latency_ms: u64,
}

impl Model for Policy {
    fn next(&mut self, req: &ModelRequest<'_>) -> ModelReply {
        let v: Value = match serde_json::from_str(req.view) {
            Ok(v) => v,
            Err(e) => {
                return ModelReply::failed(
                    ModelError::Failed(format!("view is not JSON: {e}")),
                    self.latency_ms,
                );
            }
        };
        let o = &self.order;
        let empty = Vec::new();
        let plan = v["plan"].as_array().unwrap_or(&empty);
        let facts = &v["facts"];
        let has = |k: String| facts.get(k).is_some();
        let reply = if plan.is_empty() {
            json!({"type": "plan", "steps": [
                {"id": "s1", "tool": "get_order", "depends_on": []},
                {"id": "s2", "tool": "issue_refund", "depends_on": ["s1"]},
                {"id": "s3", "tool": "send_status_email", "depends_on": ["s2"]}]})
        } else if !has(format!("{o}.total_cents")) {
            json!({"type": "tool", "name": "get_order", "args": {"order_id": o}, "plan_step": "s1"})
        } else if !plan
            .iter()
            .any(|s| s["id"] == "s2" && s["status"] == "done")
        {
            json!({"type": "tool", "name": "issue_refund", "plan_step": "s2",
                   "args": {"order_id": o, "amount_cents": self.amount_cents, "reason": "damaged"}})
        } else if !has(format!("{o}.sent")) {
            json!({"type": "tool", "name": "send_status_email", "args": {"order_id": o}, "plan_step": "s3"})
        } else {
            json!({"type": "final", "outcome": "completed", "text": "Refund issued and confirmation sent."})
        };
        ModelReply::json(reply, self.latency_ms)
    }
}

enum OneLinerKind {
    SameCall,
    NewIds,
    SearchLoop,
}

/// The design reference's `Fn` one-liners. `i` is the step number, so a resumed or recovered task
/// proposes what the same step proposed before.
struct OneLiner {
    kind: OneLinerKind,
    latency_ms: u64,
}

impl Model for OneLiner {
    fn next(&mut self, req: &ModelRequest<'_>) -> ModelReply {
        let i = req.step;
        let reply = match self.kind {
            OneLinerKind::SameCall => {
                json!({"type": "tool", "name": "get_order", "args": {"order_id": "ord_9999"}})
            }
            OneLinerKind::NewIds => {
                json!({"type": "tool", "name": "get_order", "args": {"order_id": format!("ord_{}", 9000 + i)}})
            }
            OneLinerKind::SearchLoop => json!({"type": "tool", "name": "search_policy",
                "args": {"order_id": "x", "q": format!("returns policy {i}")}}),
        };
        ModelReply::json(reply, self.latency_ms)
    }
}

/// Replies from a script, reply `n` for step `n`.
struct Script {
    replies: Vec<Value>,
    latency_ms: u64,
}

impl Model for Script {
    fn next(&mut self, req: &ModelRequest<'_>) -> ModelReply {
        let outcome = match self.replies.get(req.step as usize - 1) {
            Some(v) => Ok(RawReply::from_value(v.clone())),
            None => Err(ModelError::Failed(format!(
                "script has {} replies and step {} asked for another",
                self.replies.len(),
                req.step
            ))),
        };
        ModelReply {
            outcome,
            latency_ms: self.latency_ms,
            usage: None,
            response: None,
            turn: None,
        }
    }
}

/// A model reply as stored for replay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordedOutcome {
    Json(Value),
    Text(String),
    Timeout,
    Failed(String),
    /// A reply the adapter could read but that is no move (why).
    Invalid(String),
    Refused(String),
    Fatal(String),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecordedReply {
    pub step: u32,
    pub outcome: RecordedOutcome,
    pub latency_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<[u64; 2]>,
    /// The provider's response id, model and finish reasons, when a provider answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<ResponseInfo>,
    /// The reply in the provider's protocol (its text and function calls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<Turn>,
    /// The version of what the model was told (see [`Model::prompt_id`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// What the tools answered in this step, in order (a held call resumed later is added to
    /// the step that proposed it). `None` in replies recorded before tool answers were kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<RecordedTool>>,
}

/// One tool answer as the kernel got it: which call (tool name and the digest of its
/// arguments), its result and the active time it took. `worker replay` answers the replayed
/// calls from these, so a replay needs no tool service and sees what the run saw.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecordedTool {
    pub name: String,
    pub digest: String,
    pub result: Value,
    pub latency_ms: u64,
}

impl RecordedReply {
    pub fn of(step: u32, r: &ModelReply, prompt: Option<String>) -> RecordedReply {
        RecordedReply {
            step,
            outcome: match &r.outcome {
                Ok(RawReply::Json(v)) => RecordedOutcome::Json(v.clone()),
                Ok(RawReply::Move(m)) => RecordedOutcome::Json(m.to_value()),
                Ok(RawReply::Text(t)) => RecordedOutcome::Text(t.clone()),
                Ok(RawReply::Invalid(m)) => RecordedOutcome::Invalid(m.clone()),
                Err(ModelError::Timeout) => RecordedOutcome::Timeout,
                Err(ModelError::Failed(m)) => RecordedOutcome::Failed(m.clone()),
                Err(ModelError::Refused(m)) => RecordedOutcome::Refused(m.clone()),
                Err(ModelError::Fatal(m)) => RecordedOutcome::Fatal(m.clone()),
            },
            latency_ms: r.latency_ms,
            usage: r.usage.map(|u| [u.input_tokens, u.output_tokens]),
            response: r.response.clone(),
            turn: r.turn.clone(),
            prompt,
            tools: None,
        }
    }

    pub fn to_reply(&self) -> ModelReply {
        ModelReply {
            outcome: match &self.outcome {
                RecordedOutcome::Json(v) => Ok(RawReply::Json(v.clone())),
                RecordedOutcome::Text(t) => Ok(RawReply::Text(t.clone())),
                RecordedOutcome::Timeout => Err(ModelError::Timeout),
                RecordedOutcome::Failed(m) => Err(ModelError::Failed(m.clone())),
                RecordedOutcome::Invalid(m) => Ok(RawReply::Invalid(m.clone())),
                RecordedOutcome::Refused(m) => Err(ModelError::Refused(m.clone())),
                RecordedOutcome::Fatal(m) => Err(ModelError::Fatal(m.clone())),
            },
            latency_ms: self.latency_ms,
            usage: self.usage.map(|[i, o]| Usage {
                input_tokens: i,
                output_tokens: o,
            }),
            response: self.response.clone(),
            turn: self.turn.clone(),
        }
    }
}

/// Wraps a model and keeps its replies, so a run can be replayed without the model.
pub struct Recorder<M> {
    pub inner: M,
    pub replies: Vec<RecordedReply>,
}

impl<M: Model> Recorder<M> {
    pub fn new(inner: M) -> Self {
        Recorder {
            inner,
            replies: Vec::new(),
        }
    }
}

impl<M: Model> Model for Recorder<M> {
    fn next(&mut self, req: &ModelRequest<'_>) -> ModelReply {
        let r = self.inner.next(req);
        self.replies
            .push(RecordedReply::of(req.step, &r, self.inner.prompt_id()));
        r
    }
    fn input(&self) -> InputStyle {
        self.inner.input()
    }
    fn prompt_id(&self) -> Option<String> {
        self.inner.prompt_id()
    }
    fn busy(&mut self) -> Option<u64> {
        self.inner.busy()
    }
}

/// Returns recorded replies in order; past the end it fails, which the kernel counts as a step.
pub struct Replay {
    replies: Vec<RecordedReply>,
    next: usize,
}

impl Replay {
    pub fn new(replies: Vec<RecordedReply>) -> Replay {
        Replay { replies, next: 0 }
    }

    /// Whether every recorded reply was given.
    pub fn is_done(&self) -> bool {
        self.next >= self.replies.len()
    }
}

impl Model for Replay {
    fn next(&mut self, _req: &ModelRequest<'_>) -> ModelReply {
        let r = match self.replies.get(self.next) {
            Some(r) => r.to_reply(),
            None => ModelReply::failed(
                ModelError::Failed("replay has no more recorded replies".into()),
                0,
            ),
        };
        self.next += 1;
        r
    }
}

impl Model for Box<dyn Model> {
    fn next(&mut self, req: &ModelRequest<'_>) -> ModelReply {
        (**self).next(req)
    }
    fn ask<'a>(&'a mut self, req: &'a ModelRequest<'a>) -> Asking<'a> {
        (**self).ask(req)
    }
    fn input(&self) -> InputStyle {
        (**self).input()
    }
    fn prompt_id(&self) -> Option<String> {
        (**self).prompt_id()
    }
    fn busy(&mut self) -> Option<u64> {
        (**self).busy()
    }
}
