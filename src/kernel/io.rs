//! What a driver and the step machine ([`super::session::Session`]) exchange: the model and
//! tool requests the kernel makes, the replies a driver feeds back, the [`Action`] a poll
//! returns, and the call keys ([`Keys`]) the kernel owns.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::reply::RawReply;

use super::catalog::Access;
use super::state::{StopReason, ToolCall};

/// Token counts reported by a provider; they replace the estimate when present.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ModelError {
    /// The call did not return within the remaining active time.
    Timeout,
    /// The call failed (after the driver's own bounded retries): the step counts and the run
    /// goes on; the model is shown the error.
    Failed(String),
    /// The model declined to answer (a refusal, a content filter): the step counts, and the
    /// model is shown that it refused.
    Refused(String),
    /// The provider cannot be used as configured (an API key refused, a model that does not
    /// exist, a request longer than the model's context window): the run stops with
    /// `model_failed`, since asking again cannot help.
    Fatal(String),
}

impl ModelError {
    /// What the error says, for a person.
    pub fn detail(&self) -> &str {
        match self {
            ModelError::Timeout => "the model call did not return within the remaining active time",
            ModelError::Failed(m) | ModelError::Refused(m) | ModelError::Fatal(m) => m,
        }
    }
}

/// One function call in a model's reply, as the provider's protocol carries it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TurnCall {
    /// The provider's id of the call: what the result sent back must answer to.
    pub id: String,
    pub name: String,
    /// The arguments: the object the model sent, or its text when that was not a JSON object.
    pub arguments: Value,
}

/// A model's reply in a provider's own protocol: its text and its function calls. An adapter
/// that speaks such a protocol reports it, so that the next request can show the model its
/// own last move and what came of each call (the assistant and tool messages the protocol
/// requires), instead of a transcript.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calls: Vec<TurnCall>,
}

/// How a model takes its input.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InputStyle {
    /// The design reference's view alone, the goal and last result in it (the scripted models).
    #[default]
    View,
    /// Messages: instructions and tools (`overhead_chars` of them), the goal, the last turn
    /// with each call's result, then the view without what those messages already carry.
    Messages { overhead_chars: usize },
}

/// What a provider said of its response besides the content, kept for traces (the GenAI
/// conventions' `gen_ai.response.*`). The kernel never reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseInfo {
    /// The provider's id of the response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The model that answered (may differ from the one requested, e.g. a dated version).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Why the provider stopped generating, one per choice (`stop`, `length`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub finish_reasons: Vec<String>,
}

/// What a driver reports back after a model call.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelReply {
    pub outcome: Result<RawReply, ModelError>,
    pub latency_ms: u64,
    pub usage: Option<Usage>,
    /// `None` when no provider answered (a scripted model, a call that failed or timed out
    /// before a response).
    pub response: Option<ResponseInfo>,
    /// The reply in the provider's protocol, when the adapter speaks one (see [`Turn`]).
    pub turn: Option<Turn>,
}

impl ModelReply {
    pub fn json(v: Value, latency_ms: u64) -> ModelReply {
        ModelReply {
            outcome: Ok(RawReply::Json(v)),
            latency_ms,
            usage: None,
            response: None,
            turn: None,
        }
    }

    /// A reply that is an error (no provider answered, or its answer was not used).
    pub fn failed(e: ModelError, latency_ms: u64) -> ModelReply {
        ModelReply {
            outcome: Err(e),
            latency_ms,
            usage: None,
            response: None,
            turn: None,
        }
    }
}

/// The `code` a driver answers (with status `needs_approval`) for a call that the tool's
/// approval rule held before anything was sent: not a tool call of the budget.
pub const HELD_BY_RULE: &str = "approval_rule";

/// What a driver reports back after a tool call: the result object and the time it took.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolReply {
    pub result: Value,
    pub latency_ms: u64,
}

pub struct ModelRequest<'a> {
    /// The rendered view: a scripted model's whole input; with [`InputStyle::Messages`], the
    /// state message (without the goal, and without the last result when the last turn's
    /// messages carry it).
    pub view: &'a str,
    /// The task's goal (in the view too, with [`InputStyle::View`]).
    pub goal: &'a str,
    /// The latest messages of the task's conversation after the goal, an answer of the agent
    /// first and the person's message this turn answers last; empty in a task's first turn
    /// (in the view too, with [`InputStyle::View`]).
    pub conversation: &'a [super::conversation::Message],
    /// The model's last reply and what came of each of its calls, when its adapter reported
    /// one (see [`Turn`]).
    pub last_turn: Option<&'a super::state::LastTurn>,
    /// 1-based number of this step.
    pub step: u32,
    pub output_tokens_max: u32,
    /// The kernel's pessimistic estimate of the call's tokens (the input it expects plus
    /// the output cap), which a shared rate limit reserves before the call.
    pub expected_tokens: u64,
    /// Remaining active time: the call must not outlive it.
    pub timeout_ms: u64,
}

pub struct ToolRequest<'a> {
    pub call: &'a ToolCall,
    /// `task_id:plan_step` or `task_id:adhoc<step>`; the same logical write keeps its key.
    pub key: &'a str,
    pub user_id: &'a str,
    pub timeout_ms: u64,
    pub access: Access,
    pub idempotent: bool,
    /// The held call of a suspended task, executed first on resume.
    pub held: bool,
    /// The approval this call runs under: the digest of tool and args an operator approved.
    /// The kernel never sets it; the durable driver attaches it from the worker database (the
    /// one place an approval lives) to the held call it covers, and the tool service checks
    /// it against the call's own digest.
    pub approval: Option<&'a str>,
    /// The driver's last word before the call leaves: a route asks it right before the
    /// request's first byte, after any definition check or connection set-up, and sends
    /// nothing if it refuses. The kernel never sets it; the durable driver proves its claim
    /// there.
    pub gate: Option<&'a Gate>,
}

/// See [`ToolRequest::gate`].
pub trait SendGate {
    /// `Ok` when the call may leave now; `Err` says why it may not (nothing is sent).
    fn ready(&self) -> Result<(), String>;
}

/// A send gate a route may keep while it sends (an HTTP connection holds one).
pub type Gate = std::sync::Arc<dyn SendGate + Send + Sync>;

impl ToolRequest<'_> {
    /// Asks the gate, if there is one, whether the call may leave now.
    pub fn ready_to_send(&self) -> Result<(), String> {
        self.gate.map_or(Ok(()), |g| g.ready())
    }
}

pub enum Action<'a> {
    Model(ModelRequest<'a>),
    /// A write must have its intent committed before it is sent; reads need nothing.
    Tool(ToolRequest<'a>),
    /// A step ended and the run goes on: commit the state now.
    StepEnd,
    /// The run ended (stopped, or suspended for needs_approval): commit the final state.
    Finished(StopReason),
}

/// How a session names the idempotency keys of its writes.
///
/// The design reference's keys are `task_id:plan_step` (or `task_id:adhoc<step>`), and a model may
/// name any plan step. The durable path is strict: a write must name a step of the accepted
/// plan whose tool matches, so the kernel, not the model's text, decides which logical write a
/// key stands for; and every key starts with the database's id, so keys of two databases never
/// collide at a shared tool service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Keys {
    /// Prefix of every key (`namespace:task_id:plan_step`); empty for the design reference's keys.
    pub namespace: String,
    /// A write must name a plan step whose tool matches.
    pub strict: bool,
}

impl Keys {
    /// The design reference's keys, for the in-memory reproduction of its figures.
    pub fn document() -> Keys {
        Keys::default()
    }

    /// Keys of the durable path: namespaced by the database id, and owned by the plan.
    pub fn durable(namespace: &str) -> Keys {
        Keys {
            namespace: namespace.to_string(),
            strict: true,
        }
    }

    pub fn key(&self, call: &ToolCall, task_id: &str, step: u32) -> String {
        call.key_in(&self.namespace, task_id, step)
    }
}
