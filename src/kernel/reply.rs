//! What a model may reply, and how a raw reply becomes one: a plan, a tool call, or a final
//! answer. Anything else is an error the kernel writes into `last_result`; never a panic.

use serde_json::{Map, Value};

use super::json::{Count, Sink, write_map, write_str, write_value};
use super::state::ToolCall;
use crate::limits;

/// A model's reply as it arrived: parsed JSON (scripted models and an adapter's function
/// calls), text (a model that answers in JSON text), a move a scripted model built as a typed
/// value (no JSON tree in between), or a reply its adapter could already tell is not a usable
/// move (function arguments that are not JSON, a reply cut off at the output cap), with what
/// was wrong.
#[derive(Clone, Debug, PartialEq)]
pub enum RawReply {
    Json(Value),
    Text(String),
    /// Counted and recorded as its JSON form ([`Reply::to_value`]), as if it had come as that.
    Move(Reply),
    Invalid(String),
}

impl RawReply {
    /// The reply as a JSON value for recording: text that is not JSON is kept as a string.
    pub fn to_value(&self) -> Value {
        match self {
            RawReply::Json(v) => v.clone(),
            RawReply::Text(t) => Value::String(t.clone()),
            RawReply::Move(m) => m.to_value(),
            RawReply::Invalid(why) => serde_json::json!({"invalid": why}),
        }
    }

    /// Rebuilds a recorded reply: a string is the text a model sent, anything else is JSON.
    pub fn from_value(v: Value) -> RawReply {
        match v {
            Value::String(t) => RawReply::Text(t),
            other => RawReply::Json(other),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    Final {
        outcome: Option<String>,
        text: String,
    },
    Plan {
        steps: Value,
    },
    Tool(ToolCall),
}

impl Reply {
    /// The reply as JSON: `{"type": "final", "outcome": ..., "text": ...}` (no `outcome` when
    /// it has none), `{"type": "plan", "steps": ...}`, `{"type": "tool", "name": ..., "args":
    /// ..., "plan_step": ...}` (`plan_step` null when it names none). Parsing it gives `self`.
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        match self {
            Reply::Final { outcome, text } => {
                m.insert("type".into(), "final".into());
                if let Some(o) = outcome {
                    m.insert("outcome".into(), o.as_str().into());
                }
                m.insert("text".into(), text.as_str().into());
            }
            Reply::Plan { steps } => {
                m.insert("type".into(), "plan".into());
                m.insert("steps".into(), steps.clone());
            }
            Reply::Tool(c) => {
                m.insert("type".into(), "tool".into());
                m.insert("name".into(), c.name.as_str().into());
                m.insert("args".into(), Value::Object(c.args.clone()));
                m.insert("plan_step".into(), c.plan_step.as_deref().into());
            }
        }
        Value::Object(m)
    }

    /// The length of `json.dumps` of [`Reply::to_value`], without building it.
    pub fn json_len(&self) -> usize {
        let mut n = Count::default();
        let key = |n: &mut Count, k: &str| {
            write_str(n, k);
            n.put(": ");
        };
        n.put("{");
        match self {
            Reply::Final { outcome, text } => {
                if let Some(o) = outcome {
                    key(&mut n, "outcome");
                    write_str(&mut n, o);
                    n.put(", ");
                }
                key(&mut n, "text");
                write_str(&mut n, text);
                n.put(", ");
                key(&mut n, "type");
                write_str(&mut n, "final");
            }
            Reply::Plan { steps } => {
                key(&mut n, "steps");
                write_value(&mut n, steps);
                n.put(", ");
                key(&mut n, "type");
                write_str(&mut n, "plan");
            }
            Reply::Tool(c) => {
                key(&mut n, "args");
                write_map(&mut n, &c.args);
                n.put(", ");
                key(&mut n, "name");
                write_str(&mut n, &c.name);
                n.put(", ");
                key(&mut n, "plan_step");
                match &c.plan_step {
                    Some(p) => write_str(&mut n, p),
                    None => n.put("null"),
                }
                n.put(", ");
                key(&mut n, "type");
                write_str(&mut n, "tool");
            }
        }
        n.put("}");
        n.0
    }
}

/// Parses a reply. Text is parsed as JSON first; the error names what was wrong.
pub fn parse_reply(raw: &RawReply) -> Result<Reply, String> {
    parse_owned(raw.clone())
}

/// Like [`parse_reply`], taking the reply by value so its parts move instead of being copied.
pub fn parse_owned(raw: RawReply) -> Result<Reply, String> {
    let v = match raw {
        RawReply::Json(v) => v,
        RawReply::Move(m) => return check_move(m),
        RawReply::Invalid(why) => return Err(why),
        RawReply::Text(t) => {
            if t.len() > limits::REPLY_BYTES_MAX {
                return Err(format!(
                    "reply is {} bytes, over the limit of {}",
                    t.len(),
                    limits::REPLY_BYTES_MAX
                ));
            }
            limits::strict_json(&t).map_err(|e| format!("reply is not JSON: {e}"))?
        }
    };
    // Checked before anything of the reply reaches the state, a call record or a span.
    limits::check_depth(&v, "reply").map_err(|e| e.0)?;
    let Value::Object(mut obj) = v else {
        return Err("reply must be a JSON object".into());
    };
    let kind = match obj.remove("type") {
        Some(Value::String(t)) => t,
        Some(_) => return Err("reply `type` must be a string".into()),
        None => return Err("reply has no `type` (expected plan, tool or final)".into()),
    };
    match kind.as_str() {
        "final" => {
            let outcome = match obj.remove("outcome") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s),
                Some(_) => return Err("final reply `outcome` must be a string".into()),
            };
            let text = match obj.remove("text") {
                Some(Value::String(s)) => s,
                _ => return Err("final reply needs a string `text`".into()),
            };
            Ok(Reply::Final { outcome, text })
        }
        "plan" => Ok(Reply::Plan {
            steps: obj.remove("steps").unwrap_or(Value::Null),
        }),
        "tool" => {
            let name = match obj.remove("name") {
                Some(Value::String(s)) => s,
                _ => return Err("tool reply needs a string `name`".into()),
            };
            let args = match obj.remove("args") {
                Some(Value::Object(m)) => m,
                _ => return Err("tool reply `args` must be an object".into()),
            };
            let plan_step = match obj.remove("plan_step") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s),
                Some(_) => return Err("tool reply `plan_step` must be a string or null".into()),
            };
            Ok(Reply::Tool(ToolCall {
                name,
                args,
                plan_step,
            }))
        }
        other => Err(format!(
            "unknown reply type {:?} (expected plan, tool or final)",
            other
        )),
    }
}

/// A typed move: built as a value, so its shape is right; only its nesting is left to check,
/// as the depth of its JSON form.
fn check_move(m: Reply) -> Result<Reply, String> {
    let d = match &m {
        Reply::Final { .. } => 1,
        Reply::Plan { steps } => 1 + limits::json_depth(steps),
        Reply::Tool(c) => 2 + c.args.values().map(limits::json_depth).max().unwrap_or(0),
    };
    if d > limits::JSON_DEPTH_MAX {
        return Err(format!(
            "reply nests {d} levels of arrays and objects, over the limit of {}",
            limits::JSON_DEPTH_MAX
        ));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(raw: RawReply) -> String {
        parse_reply(&raw).expect_err("must be rejected")
    }

    #[test]
    fn every_malformed_reply_names_its_problem() {
        assert!(err(RawReply::Text("{not json".into())).starts_with("reply is not JSON"));
        assert_eq!(
            err(RawReply::Json(json!([1]))),
            "reply must be a JSON object"
        );
        assert!(err(RawReply::Json(json!({"x": 1}))).contains("no `type`"));
        assert!(err(RawReply::Json(json!({"type": "dance"}))).contains("unknown reply type"));
        assert!(
            err(RawReply::Json(
                json!({"type": "tool", "name": "get_order", "args": [1]})
            ))
            .contains("`args` must be an object")
        );
        assert!(err(RawReply::Json(json!({"type": "tool", "args": {}}))).contains("`name`"));
        assert!(err(RawReply::Json(json!({"type": "final"}))).contains("`text`"));
    }

    #[test]
    fn a_deeply_nested_reply_is_refused_before_it_is_stored() {
        let deep = format!(
            r#"{{"type": "tool", "name": "get_order", "args": {{"order_id": "ord_1001", "x": {}{}}}}}"#,
            "[".repeat(124),
            "]".repeat(124)
        );
        let e = err(RawReply::Text(deep.clone()));
        assert!(e.contains("reply nests 126 levels"), "{e}");
        let v: Value = serde_json::from_str(&deep).unwrap();
        assert!(err(RawReply::Json(v)).contains("over the limit of 32"));
    }

    #[test]
    fn a_typed_move_counts_and_records_as_its_json() {
        let moves = [
            Reply::Final {
                outcome: Some("completed".into()),
                text: "done \u{e9}".into(),
            },
            Reply::Final {
                outcome: None,
                text: "x".into(),
            },
            Reply::Plan {
                steps: json!([{"id": "s1", "tool": "get_order", "depends_on": []}]),
            },
            Reply::Tool(ToolCall {
                name: "issue_refund".into(),
                args: json!({"order_id": "ord_1001", "amount_cents": 3000})
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
                plan_step: None,
            }),
            Reply::Tool(ToolCall {
                name: "get_order".into(),
                args: Map::new(),
                plan_step: Some("s1".into()),
            }),
        ];
        for m in moves {
            let v = m.to_value();
            assert_eq!(m.json_len(), crate::kernel::json::dumped_len(&v), "{v}");
            assert_eq!(parse_reply(&RawReply::Json(v.clone())), Ok(m.clone()));
            assert_eq!(parse_reply(&RawReply::Move(m.clone())), Ok(m.clone()));
            assert_eq!(RawReply::Move(m).to_value(), v);
        }
        // As deep as the limit allows in JSON, and one level more, either way.
        for extra in [30, 31] {
            let args = json!({"x": serde_json::from_str::<Value>(&format!("{}{}", "[".repeat(extra), "]".repeat(extra))).unwrap()});
            let m = Reply::Tool(ToolCall {
                name: "get_order".into(),
                args: args.as_object().cloned().unwrap_or_default(),
                plan_step: None,
            });
            let as_json = parse_reply(&RawReply::Json(m.to_value()));
            assert_eq!(
                parse_reply(&RawReply::Move(m)).is_ok(),
                as_json.is_ok(),
                "{extra}"
            );
        }
    }

    #[test]
    fn text_replies_parse_like_json() {
        let r = parse_reply(&RawReply::Text(
            r#"{"type": "final", "outcome": "cannot_complete", "text": "no"}"#.into(),
        ));
        assert_eq!(
            r,
            Ok(Reply::Final {
                outcome: Some("cannot_complete".into()),
                text: "no".into()
            })
        );
    }
}
