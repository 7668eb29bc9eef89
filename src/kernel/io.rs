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
    /// The call failed (after the driver's own bounded retries).
    Failed(String),
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
}

impl ModelReply {
    pub fn json(v: Value, latency_ms: u64) -> ModelReply {
        ModelReply {
            outcome: Ok(RawReply::Json(v)),
            latency_ms,
            usage: None,
            response: None,
        }
    }
}

/// What a driver reports back after a tool call: the result object and the time it took.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolReply {
    pub result: Value,
    pub latency_ms: u64,
}

pub struct ModelRequest<'a> {
    /// The rendered view: the model's whole input.
    pub view: &'a str,
    /// 1-based number of this step.
    pub step: u32,
    pub output_tokens_max: u32,
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
/// The document's keys are `task_id:plan_step` (or `task_id:adhoc<step>`), and a model may
/// name any plan step. The durable path is strict: a write must name a step of the accepted
/// plan whose tool matches, so the kernel, not the model's text, decides which logical write a
/// key stands for; and every key starts with the database's id, so keys of two databases never
/// collide at a shared tool service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Keys {
    /// Prefix of every key (`namespace:task_id:plan_step`); empty for the document's keys.
    pub namespace: String,
    /// A write must name a plan step whose tool matches.
    pub strict: bool,
}

impl Keys {
    /// The document's keys, for the in-memory reproduction of its figures.
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
