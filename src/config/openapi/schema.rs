//! An OpenAPI document's schemas as JSON Schema a model is shown and the kernel checks:
//! every local `$ref` written out in place (recursion and runaway growth refused), and
//! OpenAPI 3.0's `nullable` as a null the schema accepts.

use serde_json::{Map, Value, json};

/// How deep `$ref`s may nest before a schema is refused.
const REF_DEPTH_MAX: usize = 32;

/// The most values a schema may hold once its `$ref`s are written out.
const EXPANDED_VALUES_MAX: usize = 20_000;

/// `v` with every local `$ref` replaced by what it points to (sibling keywords kept over
/// it) and OpenAPI 3.0's `nullable` written as JSON Schema. A schema that refers to itself
/// cannot be shown to a model whole, and is refused; so is one that grows past
/// [`EXPANDED_VALUES_MAX`] values once written out.
pub(super) fn resolve(doc: &Value, v: &Value) -> Result<Value, String> {
    let mut left = EXPANDED_VALUES_MAX;
    Resolver {
        doc,
        stack: Vec::new(),
        left: &mut left,
    }
    .schema(v)
}

/// The walk of [`resolve`]: the `$ref`s being followed, and how many values may still be made.
struct Resolver<'a> {
    doc: &'a Value,
    stack: Vec<String>,
    left: &'a mut usize,
}

impl Resolver<'_> {
    fn spend(&mut self) -> Result<(), String> {
        *self.left = self.left.checked_sub(1).ok_or_else(|| {
            format!("a schema grows past {EXPANDED_VALUES_MAX} values once its $refs are written out, too large to give a model")
        })?;
        Ok(())
    }

    /// A schema (or any value that holds schemas).
    fn schema(&mut self, v: &Value) -> Result<Value, String> {
        self.spend()?;
        if self.stack.len() > REF_DEPTH_MAX {
            return Err(format!(
                "$refs nest deeper than {REF_DEPTH_MAX}: {}",
                self.stack.join(" -> ")
            ));
        }
        match v {
            Value::Object(m) => {
                if let Some(r) = m.get("$ref").and_then(Value::as_str) {
                    return self.reference(r, m);
                }
                let mut out = Map::new();
                for (k, x) in m {
                    // A map of names to schemas: its keys are names, never keywords.
                    let value = if matches!(
                        k.as_str(),
                        "properties" | "patternProperties" | "$defs" | "definitions"
                    ) && let Value::Object(names) = x
                    {
                        let mut each = Map::new();
                        for (n, s) in names {
                            each.insert(n.clone(), self.schema(s)?);
                        }
                        Value::Object(each)
                    } else {
                        self.schema(x)?
                    };
                    out.insert(k.clone(), value);
                }
                Ok(nullable(out))
            }
            Value::Array(a) => a
                .iter()
                .map(|x| self.schema(x))
                .collect::<Result<_, _>>()
                .map(Value::Array),
            v => Ok(v.clone()),
        }
    }

    /// What `$ref` `r` points to, with the sibling keywords of `m` over it.
    fn reference(&mut self, r: &str, m: &Map<String, Value>) -> Result<Value, String> {
        let Some(pointer) = r.strip_prefix('#') else {
            return Err(format!(
                "$ref {r:?} points outside the document; only references inside it (#/...) are read"
            ));
        };
        if self.stack.iter().any(|s| s == r) {
            return Err(format!(
                "{r} refers to itself ({} -> {r}); a recursive schema cannot be given to a model",
                self.stack.join(" -> ")
            ));
        }
        let doc = self.doc;
        let target = doc
            .pointer(pointer)
            .ok_or_else(|| format!("$ref {r:?} points to nothing in the document"))?;
        self.stack.push(r.to_string());
        let mut out = self.schema(target)?;
        self.stack.pop();
        // The keywords beside the `$ref` (a `description`, OpenAPI 3.0's `nullable`), each
        // resolved on its own, then `nullable` applied to the whole.
        let mut siblings = Map::new();
        for (k, v) in m.iter().filter(|(k, _)| *k != "$ref") {
            siblings.insert(k.clone(), self.schema(v)?);
        }
        if siblings.is_empty() {
            return Ok(out);
        }
        if let Value::Object(o) = &mut out {
            o.extend(siblings);
            return Ok(nullable(std::mem::take(o)));
        }
        Ok(out)
    }
}

/// A schema with OpenAPI 3.0's `nullable: true` written as JSON Schema: a `"null"` type
/// beside a single type (and `null` among its `enum` or `const`), else `anyOf` the schema or
/// null.
fn nullable(mut s: Map<String, Value>) -> Value {
    // `nullable` is OpenAPI's keyword, not JSON Schema's: never passed on.
    if s.remove("nullable") != Some(Value::Bool(true)) {
        return Value::Object(s);
    }
    if let Some(c) = s.remove("const") {
        s.insert("enum".into(), Value::Array(vec![c]));
    }
    if let Some(Value::Array(values)) = s.get_mut("enum")
        && !values.contains(&Value::Null)
    {
        values.push(Value::Null);
    }
    match s.get("type").cloned() {
        Some(Value::String(t)) => {
            s.insert("type".into(), json!([t, "null"]));
            Value::Object(s)
        }
        _ => json!({"anyOf": [Value::Object(s), {"type": "null"}]}),
    }
}
