//! What an operator's decision carries besides who and why: the held call they reviewed
//! ([`Reviewed`]), more budget they grant ([`Extension`]), and how they settle a held write
//! ([`Settlement`]). The CLI's and the console's parsers build these; `decide` checks them.

use serde_json::Value;

use crate::kernel::{Budget, ToolCall};
use crate::store::{Error, Result};

/// How an operator settles a held write.
#[derive(Clone, Debug, PartialEq)]
pub enum Settlement {
    /// The write took effect; `result` is what the service answered (or `{"status": "ok"}`).
    Applied(Value),
    /// The write did not take effect: the step runs again under the same call key.
    NotApplied,
}

/// The held call an operator reviewed, as `worker show` printed it: its call key, its digest,
/// or both. A decision is applied only if it still names the call the task holds when the
/// decision's transaction runs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reviewed {
    pub key: Option<String>,
    pub digest: Option<String>,
}

impl Reviewed {
    pub fn is_empty(&self) -> bool {
        self.key.is_none() && self.digest.is_none()
    }

    /// Refuses unless every given part equals the held call's.
    pub(super) fn check(&self, id: &str, call: &ToolCall, key: &str) -> Result<()> {
        let digest = call.digest();
        let key_ok = self.key.as_deref().is_none_or(|k| k == key);
        let digest_ok = self.digest.as_deref().is_none_or(|d| d == digest);
        if key_ok && digest_ok {
            return Ok(());
        }
        Err(Error::Conflict(format!(
            "the decision does not match the held call: task {id} holds {} {} under key {key} with digest {digest}; the decision names {}",
            call.name,
            Value::Object(call.args.clone()),
            [
                self.key.as_ref().map(|k| format!("key {k}")),
                self.digest.as_ref().map(|d| format!("digest {d}")),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(" and ")
        )))
    }
}

/// More budget an operator grants with a decision: each named limit grows by its amount.
/// Recorded in the decision's audit event.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Extension(pub Vec<(String, u64)>);

impl Extension {
    /// Parses `steps=2,deadline_ms=10000` (names as in `--budget`, or without `_max`).
    pub fn parse(text: &str) -> std::result::Result<Extension, String> {
        let mut out = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| format!("--extend {part:?}: expected NAME=AMOUNT"))?;
            let name = name.trim();
            let full = if crate::kernel::state::BUDGET_FIELDS.contains(&name) {
                name.to_string()
            } else {
                format!("{name}_max")
            };
            if !crate::kernel::state::BUDGET_FIELDS.contains(&full.as_str()) {
                return Err(format!(
                    "--extend: unknown limit {name:?}; known: steps, tool_calls, tokens, deadline_ms, ..."
                ));
            }
            let amount: u64 = value
                .trim()
                .parse()
                .map_err(|_| format!("--extend {name}: {value:?} is not a whole number"))?;
            out.push((full, amount));
        }
        Ok(Extension(out))
    }

    /// The extension an audit event's `extend` detail records.
    pub fn from_json(v: &Value) -> Extension {
        Extension(
            v.as_object()
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, n)| n.as_u64().map(|n| (k.clone(), n)))
                        .collect()
                })
                .unwrap_or_default(),
        )
    }

    /// `b` as it was before this extension grew it (the replay starts from there).
    pub fn undo(&self, b: &mut Budget) {
        for (name, amount) in &self.0 {
            // A name this build does not know (a damaged event) undoes nothing.
            if let Some(now) = b.get(name) {
                let _ = b.set(name, &now.saturating_sub(*amount).to_string());
            }
        }
    }

    /// The budget with every limit grown (saturating: a limit never wraps around).
    pub fn apply(&self, b: &mut Budget) -> Result<()> {
        for (name, amount) in &self.0 {
            let now = b
                .get(name)
                .ok_or_else(|| Error::Invalid(format!("unknown budget limit {name:?}")))?;
            let grown = now.saturating_add(*amount);
            let text = match name.as_str() {
                "tokens_max" | "deadline_ms" => grown.to_string(),
                _ => grown.min(u64::from(u32::MAX)).to_string(),
            };
            b.set(name, &text).map_err(Error::Invalid)?;
        }
        Ok(())
    }

    pub(super) fn to_json(&self) -> Value {
        Value::Object(
            self.0
                .iter()
                .map(|(k, v)| (k.clone(), Value::from(*v)))
                .collect(),
        )
    }
}
