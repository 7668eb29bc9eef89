//! The per-tool policies a catalog entry carries besides its schema: when a call needs an
//! operator's approval before it is sent, what its plan steps must come after, and how a
//! transient failure is tried again. They are read from the catalog and kept in a task's
//! snapshot; the kernel and the worker enforce them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A tool's approval rule: `"never"` (the default), `"always"`, or `{ above = { ARG = N } }`:
/// a call whose numeric argument ARG is over N (or is missing, or is not a number) needs an
/// approval. The worker holds such a call before anything is sent (HTTP tools carry rules;
/// MCP tools keep their server's own approval setting).
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(try_from = "Value", into = "Value")]
pub enum Approval {
    #[default]
    Never,
    Always,
    Above(BTreeMap<String, f64>),
}

impl Approval {
    pub fn is_never(&self) -> bool {
        *self == Approval::Never
    }

    /// Whether a call with `args` needs an approval first.
    pub fn needs(&self, args: &Map<String, Value>) -> bool {
        match self {
            Approval::Never => false,
            Approval::Always => true,
            Approval::Above(bounds) => bounds.iter().any(|(arg, max)| {
                args.get(arg)
                    .and_then(Value::as_f64)
                    .is_none_or(|v| v > *max)
            }),
        }
    }
}

impl TryFrom<Value> for Approval {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        let wrong = || {
            format!(
                "approval must be \"never\", \"always\" or {{ above = {{ ARGUMENT = NUMBER }} }}, not {v}"
            )
        };
        match &v {
            Value::String(s) if s == "never" => Ok(Approval::Never),
            Value::String(s) if s == "always" => Ok(Approval::Always),
            Value::Object(m) if m.len() == 1 => {
                let bounds = m
                    .get("above")
                    .and_then(Value::as_object)
                    .filter(|b| !b.is_empty())
                    .ok_or_else(wrong)?;
                let mut out = BTreeMap::new();
                for (arg, n) in bounds {
                    let n = n.as_f64().filter(|n| n.is_finite()).ok_or_else(wrong)?;
                    out.insert(arg.clone(), n);
                }
                Ok(Approval::Above(out))
            }
            _ => Err(wrong()),
        }
    }
}

impl From<Approval> for Value {
    fn from(a: Approval) -> Value {
        match a {
            Approval::Never => Value::from("never"),
            Approval::Always => Value::from("always"),
            Approval::Above(b) => {
                let m: Map<String, Value> =
                    b.into_iter().map(|(k, n)| (k, Value::from(n))).collect();
                serde_json::json!({"above": m})
            }
        }
    }
}

/// What a plan step of the tool must come after (checked when a plan is accepted): nothing
/// (the default), `"any_step"` (some earlier step: the design reference's rule for its store's
/// writes), or `["TOOL", ...]`: a step of one of those tools among its prerequisites, direct
/// or not.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(try_from = "Value", into = "Value")]
pub enum Requires {
    #[default]
    Nothing,
    AnyStep,
    Tools(Vec<String>),
}

impl Requires {
    pub fn is_nothing(&self) -> bool {
        *self == Requires::Nothing
    }
}

impl TryFrom<Value> for Requires {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        match &v {
            Value::String(s) if s == "any_step" => Ok(Requires::AnyStep),
            Value::Array(a) if a.is_empty() => Ok(Requires::Nothing),
            Value::Array(a) => a
                .iter()
                .map(|t| t.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .map(Requires::Tools)
                .ok_or_else(|| {
                    format!("requires must be \"any_step\" or a list of tool names, not {v}")
                }),
            _ => Err(format!(
                "requires must be \"any_step\" or a list of tool names, not {v}"
            )),
        }
    }
}

impl From<Requires> for Value {
    fn from(r: Requires) -> Value {
        match r {
            Requires::Nothing => Value::Array(Vec::new()),
            Requires::AnyStep => Value::from("any_step"),
            Requires::Tools(t) => Value::from(t),
        }
    }
}

/// Retries of one tool call after a transient failure, under the same call key and inside
/// the task's remaining active time. They take active time but no tool call of the budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryPolicy {
    /// Tries in all, the first one included (1 turns retries off).
    pub attempts: u32,
    /// The wait before the first retry, doubled for each next one, less up to a quarter at
    /// random; a longer `Retry-After` is waited instead.
    pub backoff_ms: u64,
    /// The longest wait between two tries, whatever a `Retry-After` asks.
    pub max_backoff_ms: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 3,
            backoff_ms: 200,
            max_backoff_ms: 5_000,
        }
    }
}

impl RetryPolicy {
    pub fn is_default(&self) -> bool {
        *self == RetryPolicy::default()
    }

    /// What in this policy cannot work; `Ok` when it can.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=10).contains(&self.attempts) {
            return Err(format!(
                "retry.attempts is {}: it counts every try, the first included, from 1 (no retry) to 10",
                self.attempts
            ));
        }
        if self.max_backoff_ms > 60_000 || self.backoff_ms > self.max_backoff_ms {
            return Err(format!(
                "retry.backoff_ms ({}) must be at most retry.max_backoff_ms ({}), which must be at most 60000",
                self.backoff_ms, self.max_backoff_ms
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn an_approval_rule_holds_what_it_covers_and_nothing_else() {
        let above: Approval = serde_json::from_value(json!({"above": {"amount": 100}})).unwrap();
        assert!(!above.needs(&args(json!({"amount": 100}))));
        assert!(above.needs(&args(json!({"amount": 101}))));
        assert!(above.needs(&args(json!({"amount": 1e300}))));
        // Missing or not a number: it cannot be compared, so it waits.
        assert!(above.needs(&args(json!({}))));
        assert!(above.needs(&args(json!({"amount": "101"}))));
        let always: Approval = serde_json::from_value(json!("always")).unwrap();
        assert!(always.needs(&args(json!({}))));
        assert!(!Approval::default().needs(&args(json!({"amount": 9e9}))));
        for bad in [
            json!("sometimes"),
            json!({"above": {}}),
            json!({"below": {"a": 1}}),
            json!({"above": {"a": "x"}}),
        ] {
            let e = serde_json::from_value::<Approval>(bad.clone()).unwrap_err();
            assert!(e.to_string().contains("approval must be"), "{bad}: {e}");
        }
        // It round-trips through a task's snapshot.
        let v = serde_json::to_value(&above).unwrap();
        assert_eq!(serde_json::from_value::<Approval>(v).unwrap(), above);
    }
}
