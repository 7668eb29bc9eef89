//! Every limit on input, named in one place.
//!
//! Anything that comes from outside (a model reply, a tool result, an operator's `--result`, a
//! batch line, a config or script file, a goal, a note, a key) is checked against these before
//! anything is stored: an input over a limit is an error for that step or that command, never
//! a stored record. JSON is parsed by serde_json (which stops at 128 levels, so parsing never
//! exhausts the stack) and then held to [`JSON_DEPTH_MAX`], far below what any stored record
//! adds around it. Numbers that must fit are added with saturating arithmetic where they are
//! used (tokens, leases, priorities, times).

use serde_json::Value;
use std::fmt;

/// Deepest nesting of arrays and objects accepted in any JSON input.
pub const JSON_DEPTH_MAX: usize = 32;
/// A model reply's body (the HTTP response of an OpenAI-compatible server, or a script line).
pub const REPLY_BYTES_MAX: usize = 1 << 20;
/// A tool's result (an HTTP tool's response body).
pub const TOOL_RESULT_BYTES_MAX: usize = 1 << 20;
/// An operator's `reconcile --applied --result JSON`.
pub const OPERATOR_RESULT_BYTES_MAX: usize = 64 << 10;
/// One line of a `worker enqueue --file` batch.
pub const BATCH_LINE_BYTES_MAX: usize = 64 << 10;
/// Tasks in one `worker enqueue --file` batch (one transaction).
pub const BATCH_TASKS_MAX: usize = 100_000;
/// A config (TOML) file.
pub const CONFIG_BYTES_MAX: usize = 1 << 20;
/// A script model's file (`--model script:FILE`), stored once per distinct content.
pub const SCRIPT_BYTES_MAX: usize = 8 << 20;
/// A task's goal.
/// The longest instructions a task may carry (`enqueue --instructions`).
pub const INSTRUCTIONS_BYTES_MAX: usize = 4096;
pub const GOAL_BYTES_MAX: usize = 4096;
/// A memory note's text.
pub const NOTE_BYTES_MAX: usize = 2048;
/// An enqueue key, a user id, an operator name, a tenant scope, a tool name. Stripe refuses
/// idempotency keys over 255 characters; so does Tether.
pub const NAME_BYTES_MAX: usize = 255;
/// An operator's reason.
pub const REASON_BYTES_MAX: usize = 1024;
/// The largest record the database stores or reads.
pub const RECORD_BYTES_MAX: usize = 32 << 20;
/// A `demo-store` request body.
pub const HTTP_BODY_BYTES_MAX: usize = 64 << 10;
/// Task priorities run from `-PRIORITY_MAX` to `PRIORITY_MAX`.
pub const PRIORITY_MAX: i64 = 1_000_000_000;
/// A lease: one day. Longer leases only hide dead workers.
pub const LEASE_MS_MAX: u64 = 24 * 3600 * 1000;

/// An input over a limit, or malformed: says what and which limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitError(pub String);

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LimitError {}

/// Parses JSON input of at most `max_bytes`, nested at most [`JSON_DEPTH_MAX`] levels.
pub fn parse_json_input(text: &str, what: &str, max_bytes: usize) -> Result<Value, LimitError> {
    if text.len() > max_bytes {
        return Err(LimitError(format!(
            "{what} is {} bytes, over the limit of {max_bytes}",
            text.len()
        )));
    }
    let v = parse_json(text, what)?;
    check_depth(&v, what)?;
    Ok(v)
}

/// Parses JSON text (serde_json's own 128-level bound applies; no depth check of ours). For
/// values that were checked before they were stored. A field named twice in one object is
/// refused, never resolved by keeping one of them: `{"user": "u", "user": "v"}` means nothing
/// a reader can be sure of.
pub fn parse_json(text: &str, what: &str) -> Result<Value, LimitError> {
    strict_json(text).map_err(|e| {
        let e = e.to_string();
        if e.contains("recursion limit") {
            LimitError(format!(
                "{what} nests deeper than {JSON_DEPTH_MAX} levels of arrays and objects"
            ))
        } else if let Some(rest) = e.strip_prefix(DUPLICATE) {
            LimitError(format!("{what} names the field {rest}"))
        } else {
            LimitError(format!("{what} is not valid JSON: {e}"))
        }
    })
}

const DUPLICATE: &str = "duplicate field ";

/// JSON text as a value, refusing an object that names a field twice.
pub fn strict_json(text: &str) -> Result<Value, serde_json::Error> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(text);
    let v = Strict.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// A `serde_json::Value` read by a visitor that refuses duplicate object keys.
struct Strict;

impl<'de> serde::de::DeserializeSeed<'de> for Strict {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(Strict)
    }
}

impl<'de> serde::de::Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(Strict)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(v) = seq.next_element_seed(Strict)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                return Err(serde::de::Error::custom(format!(
                    "{DUPLICATE}{:?} twice",
                    printable(&k)
                )));
            }
            let v = map.next_value_seed(Strict)?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

/// How deep arrays and objects nest in `v` (a scalar is 0), without recursion.
pub fn json_depth(v: &Value) -> usize {
    let is_container = |v: &Value| matches!(v, Value::Array(_) | Value::Object(_));
    if !is_container(v) {
        return 0;
    }
    let mut deepest = 0;
    let mut stack: Vec<(&Value, usize)> = vec![(v, 1)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        // Only containers go on the stack: a scalar adds no depth.
        match v {
            Value::Array(a) => {
                stack.extend(a.iter().filter(|c| is_container(c)).map(|c| (c, d + 1)))
            }
            Value::Object(m) => {
                stack.extend(m.values().filter(|c| is_container(c)).map(|c| (c, d + 1)))
            }
            _ => {}
        }
    }
    deepest
}

/// `Err` if `v` nests deeper than [`JSON_DEPTH_MAX`].
pub fn check_depth(v: &Value, what: &str) -> Result<(), LimitError> {
    let d = json_depth(v);
    if d > JSON_DEPTH_MAX {
        return Err(LimitError(format!(
            "{what} nests {d} levels of arrays and objects, over the limit of {JSON_DEPTH_MAX}"
        )));
    }
    Ok(())
}

/// `Err` if `v` nests too deep or its JSON text is longer than `max_bytes`.
pub fn check_value(v: &Value, what: &str, max_bytes: usize) -> Result<(), LimitError> {
    check_depth(v, what)?;
    let n = v.to_string().len();
    if n > max_bytes {
        return Err(LimitError(format!(
            "{what} is {n} bytes of JSON, over the limit of {max_bytes}"
        )));
    }
    Ok(())
}

/// A text field: at most `max_bytes`, not empty when `required`, and no control characters
/// other than newline and tab (which terminals and logs handle).
pub fn check_text(s: &str, what: &str, max_bytes: usize) -> Result<(), LimitError> {
    if s.len() > max_bytes {
        return Err(LimitError(format!(
            "{what} is {} bytes, over the limit of {max_bytes}",
            s.len()
        )));
    }
    if let Some(c) = s
        .chars()
        .find(|c| c.is_control() && *c != '\n' && *c != '\t')
    {
        return Err(LimitError(format!(
            "{what} contains the control character {:?}",
            c
        )));
    }
    Ok(())
}

/// A name (key, user, operator, scope): 1 to [`NAME_BYTES_MAX`] bytes of printable ASCII.
pub fn check_name(s: &str, what: &str) -> Result<(), LimitError> {
    if s.is_empty() {
        return Err(LimitError(format!("{what} must not be empty")));
    }
    if s.len() > NAME_BYTES_MAX {
        return Err(LimitError(format!(
            "{what} is {} bytes, over the limit of {NAME_BYTES_MAX}",
            s.len()
        )));
    }
    if let Some(c) = s.chars().find(|c| !c.is_ascii_graphic() && *c != ' ') {
        return Err(LimitError(format!(
            "{what} contains {c:?}; use printable ASCII characters"
        )));
    }
    Ok(())
}

/// Text for a terminal: control characters (escape sequences above all) are shown escaped, so
/// that stored text can never move the cursor, recolour or retitle an operator's terminal.
/// `--json` output does not go through this; JSON escapes them itself.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| (c.is_control() && c != '\n' && c != '\t') || reorders(c);
    if !s.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Characters that reorder or break a line without being control characters: the
/// bidirectional overrides, embeddings, isolates and marks, and the line and paragraph
/// separators. A stored text could use them to make a row read as another.
fn reorders(c: char) -> bool {
    matches!(c, '\u{200E}' | '\u{200F}' | '\u{061C}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{2028}' | '\u{2029}')
}

/// Text for one field of one line of output (a table cell): newlines, carriage returns and
/// tabs shown escaped too, so a stored goal or note can never print a row of its own.
pub fn one_line(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(|c| matches!(c, '\n' | '\r' | '\t')) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Why a file could not be read whole.
#[derive(Debug)]
pub enum ReadError {
    /// It could not be opened or read (missing, a directory, no permission, not UTF-8).
    Unreadable(std::io::Error),
    /// It is over the limit, in bytes.
    TooBig(usize),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Unreadable(e) => write!(f, "cannot read it: {e}"),
            ReadError::TooBig(max) => write!(f, "it is over the limit of {max} bytes"),
        }
    }
}

/// Reads a whole file of at most `max_bytes` (checked before reading, and while reading, so
/// a file that grows meanwhile is still bounded).
pub fn read_file(path: &std::path::Path, max_bytes: usize) -> Result<String, ReadError> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(ReadError::Unreadable)?;
    let mut text = String::new();
    f.take(max_bytes as u64 + 1)
        .read_to_string(&mut text)
        .map_err(ReadError::Unreadable)?;
    if text.len() > max_bytes {
        return Err(ReadError::TooBig(max_bytes));
    }
    Ok(text)
}

/// Why a line could not be read.
#[derive(Debug)]
pub enum LineError {
    Io(std::io::Error),
    /// Too long, or not UTF-8.
    Bad(String),
}

/// Lines of a reader, each at most a given length: a line of a gigabyte is an error after
/// `max_bytes`, not an allocation.
pub struct Lines<R> {
    r: R,
    buf: Vec<u8>,
}

impl<R: std::io::BufRead> Lines<R> {
    pub fn new(r: R) -> Self {
        Lines { r, buf: Vec::new() }
    }

    pub fn next_line(&mut self, max_bytes: usize) -> Result<Option<String>, LineError> {
        use std::io::{BufRead, Read};
        self.buf.clear();
        let n = (&mut self.r)
            .take(max_bytes as u64 + 2)
            .read_until(b'\n', &mut self.buf)
            .map_err(LineError::Io)?;
        if n == 0 {
            return Ok(None);
        }
        if self.buf.last() == Some(&b'\n') {
            self.buf.pop();
            if self.buf.last() == Some(&b'\r') {
                self.buf.pop();
            }
        } else if self.buf.len() > max_bytes {
            return Err(LineError::Bad(format!(
                "the line is over the limit of {max_bytes} bytes"
            )));
        }
        if self.buf.len() > max_bytes {
            return Err(LineError::Bad(format!(
                "the line is over the limit of {max_bytes} bytes"
            )));
        }
        String::from_utf8(std::mem::take(&mut self.buf))
            .map(Some)
            .map_err(|_| LineError::Bad("the line is not UTF-8".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(levels: usize) -> String {
        format!("{}{}", "[".repeat(levels), "]".repeat(levels))
    }

    #[test]
    fn depth_is_counted_without_recursion() {
        assert_eq!(json_depth(&serde_json::json!(1)), 0);
        assert_eq!(json_depth(&serde_json::json!({"a": [1, {"b": []}]})), 4);
        let v = parse_json(&nested(100), "x").unwrap();
        assert_eq!(json_depth(&v), 100);
    }

    #[test]
    fn inputs_over_the_depth_limit_are_refused_by_name() {
        assert!(parse_json_input(&nested(JSON_DEPTH_MAX), "reply", 1 << 20).is_ok());
        let e = parse_json_input(&nested(JSON_DEPTH_MAX + 1), "reply", 1 << 20).unwrap_err();
        assert!(e.0.contains("reply nests 33 levels"), "{e}");
        let e = parse_json_input(&nested(500), "reply", 1 << 20).unwrap_err();
        assert!(e.0.contains("deeper than 32"), "{e}");
        let e = parse_json_input("[1,2]", "reply", 3).unwrap_err();
        assert!(e.0.contains("over the limit of 3"), "{e}");
    }

    #[test]
    fn names_and_texts() {
        assert!(check_name("job-42", "key").is_ok());
        assert!(check_name("", "key").is_err());
        assert!(check_name(&"k".repeat(256), "key").is_err());
        assert!(check_name("clé", "key").is_err());
        assert!(check_text("a\tb\nc", "goal", 10).is_ok());
        assert!(check_text("a\u{1b}[2J", "goal", 10).is_err());
        assert_eq!(printable("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(printable("plain\nline"), "plain\nline");
    }
}
