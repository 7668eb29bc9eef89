//! JSON text exactly as Python's `json.dumps(..., sort_keys=True)` writes it.
//!
//! Every token figure of the design document is `(len(text) + 3) // 4` of a text made by
//! `json.dumps`, so the view must match Python byte for byte: separators `", "` and `": "`,
//! keys sorted by code point, non-ASCII (and DEL) escaped as `\uXXXX` in UTF-16 units, and floats
//! printed as Python's `repr` prints them. `serde_json::Map` is a `BTreeMap`, whose byte order on
//! UTF-8 keys is code point order, so objects come out sorted without extra work.
//!
//! The writer is generic over a [`Sink`] so that a length can be measured without allocating.

use serde_json::{Number, Value};

/// Where JSON text goes: a `String`, or a counter when only the length matters.
pub trait Sink {
    fn put(&mut self, s: &str);
}

impl Sink for String {
    #[inline]
    fn put(&mut self, s: &str) {
        self.push_str(s);
    }
}

/// Counts bytes instead of storing them. JSON text made here is ASCII, so bytes are characters.
#[derive(Default)]
pub struct Count(pub usize);

impl Sink for Count {
    #[inline]
    fn put(&mut self, s: &str) {
        self.0 += s.len();
    }
}

/// Feeds the text to a hash instead of storing it.
pub struct Hashing<H>(pub H);

impl<H: sha2::Digest> Sink for Hashing<H> {
    #[inline]
    fn put(&mut self, s: &str) {
        self.0.update(s.as_bytes());
    }
}

/// `json.dumps(v, sort_keys=True)`.
pub fn dumps(v: &Value) -> String {
    let mut out = String::with_capacity(64);
    write_value(&mut out, v);
    out
}

/// Length of `json.dumps(v)`; key order does not change a length, so this serves both the
/// sorted and the unsorted form.
pub fn dumped_len(v: &Value) -> usize {
    let mut c = Count::default();
    write_value(&mut c, v);
    c.0
}

pub fn write_value<S: Sink>(out: &mut S, v: &Value) {
    match v {
        Value::Null => out.put("null"),
        Value::Bool(true) => out.put("true"),
        Value::Bool(false) => out.put("false"),
        Value::Number(n) => write_number(out, n),
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            out.put("[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.put(", ");
                }
                write_value(out, item);
            }
            out.put("]");
        }
        Value::Object(map) => write_map(out, map),
    }
}

pub fn write_map<S: Sink>(out: &mut S, map: &serde_json::Map<String, Value>) {
    out.put("{");
    for (i, (k, item)) in map.iter().enumerate() {
        if i > 0 {
            out.put(", ");
        }
        write_str(out, k);
        out.put(": ");
        write_value(out, item);
    }
    out.put("}");
}

pub fn write_number<S: Sink>(out: &mut S, n: &Number) {
    if let Some(i) = n.as_i64() {
        write_int(out, i);
    } else if let Some(u) = n.as_u64() {
        let mut buf = itoa_buf();
        out.put(fmt_u64(&mut buf, u));
    } else {
        write_float(out, n.as_f64().unwrap_or(f64::NAN));
    }
}

pub fn write_int<S: Sink>(out: &mut S, i: i64) {
    let mut buf = itoa_buf();
    if i < 0 {
        out.put("-");
    }
    out.put(fmt_u64(&mut buf, i.unsigned_abs()));
}

fn itoa_buf() -> [u8; 20] {
    [0u8; 20]
}

fn fmt_u64(buf: &mut [u8; 20], mut u: u64) -> &str {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (u % 10) as u8;
        u /= 10;
        if u == 0 {
            break;
        }
    }
    // Only ASCII digits were written.
    std::str::from_utf8(&buf[i..]).unwrap_or("0")
}

/// A float as Python's `repr` (and so `json.dumps`) prints it: the shortest digits that round
/// trip, in positional notation for decimal exponents -4..16 and scientific notation otherwise.
pub fn write_float<S: Sink>(out: &mut S, x: f64) {
    out.put(&py_float_repr(x));
}

pub fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".to_string();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    // Rust's `{:e}` gives the shortest round-trip digits, e.g. "1.5e0", "-1e-5".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut s = String::from(sign);
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                s.push_str(&digits);
                s.extend(std::iter::repeat_n('0', int_len - digits.len()));
                s.push_str(".0");
            } else {
                s.push_str(&digits[..int_len]);
                s.push('.');
                s.push_str(&digits[int_len..]);
            }
        } else {
            s.push_str("0.");
            s.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            s.push_str(&digits);
        }
    } else {
        s.push_str(&digits[..1]);
        if digits.len() > 1 {
            s.push('.');
            s.push_str(&digits[1..]);
        }
        s.push('e');
        s.push(if exp < 0 { '-' } else { '+' });
        let e = exp.unsigned_abs();
        if e < 10 {
            s.push('0');
        }
        s.push_str(&e.to_string());
    }
    s
}

/// A string with `ensure_ascii=True` escaping.
pub fn write_str<S: Sink>(out: &mut S, s: &str) {
    out.put("\"");
    let bytes = s.as_bytes();
    // Fast path: most strings need no escaping. Checked in chunks without early exit, so the
    // compiler can vectorize it.
    let needs = |b: u8| !(0x20..0x7f).contains(&b) || b == b'"' || b == b'\\';
    let clean = bytes
        .chunks(32)
        .all(|c| !c.iter().fold(false, |acc, &b| acc | needs(b)));
    if clean {
        out.put(s);
        out.put("\"");
        return;
    }
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\' {
            continue;
        }
        if b >= 0x80 && !s.is_char_boundary(i) {
            continue; // continuation byte: handled with its leading byte
        }
        if start < i {
            out.put(&s[start..i]);
        }
        match b {
            b'"' => out.put("\\\""),
            b'\\' => out.put("\\\\"),
            b'\n' => out.put("\\n"),
            b'\r' => out.put("\\r"),
            b'\t' => out.put("\\t"),
            0x08 => out.put("\\b"),
            0x0c => out.put("\\f"),
            _ => {
                let c = s[i..].chars().next().unwrap_or('\u{fffd}');
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.put(&format!("\\u{u:04x}"));
                }
            }
        }
        start = i + if b >= 0x80 {
            s[i..].chars().next().map_or(1, char::len_utf8)
        } else {
            1
        };
    }
    if start < bytes.len() {
        out.put(&s[start..]);
    }
    out.put("\"");
}

/// Python's `repr` of a string, as the design reference's tables print it.
pub fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `repr` of a JSON-shaped value (dicts, lists, str, int, float, bool, None).
pub fn py_repr(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) => {
            let mut s = String::new();
            write_number(&mut s, n);
            s
        }
        Value::String(s) => py_str_repr(s),
        Value::Array(items) => {
            let parts: Vec<String> = items.iter().map(py_repr).collect();
            format!("[{}]", parts.join(", "))
        }
        Value::Object(map) => {
            let parts: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", py_str_repr(k), py_repr(v)))
                .collect();
            format!("{{{}}}", parts.join(", "))
        }
    }
}

/// The first `n` hex digits of `bytes`.
pub fn hex_prefix(bytes: &[u8], n: usize) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(n);
    for b in bytes {
        if s.len() >= n {
            break;
        }
        s.push(HEX[(b >> 4) as usize] as char);
        if s.len() < n {
            s.push(HEX[(b & 15) as usize] as char);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_separators_and_sorting() {
        let v = json!({"b": [1, 2.5, null], "a": {"y": true, "x": "s"}});
        assert_eq!(
            dumps(&v),
            r#"{"a": {"x": "s", "y": true}, "b": [1, 2.5, null]}"#
        );
        assert_eq!(dumped_len(&v), dumps(&v).len());
    }

    #[test]
    fn escapes_like_ensure_ascii() {
        let v = json!("é\u{1F600}\"\\\n\t\u{1}\u{7f}/x");
        assert_eq!(dumps(&v), r#""\u00e9\ud83d\ude00\"\\\n\t\u0001\u007f/x""#);
        assert_eq!(dumped_len(&v), dumps(&v).len());
    }

    #[test]
    fn short_and_long_strings_escape_the_same() {
        // The clean check runs in chunks of 32 bytes: a character that needs escaping is
        // escaped in a short string and in a long one, in the first, a middle or the last chunk.
        let cases = [
            ('"', r#"\""#),
            ('\\', r"\\"),
            ('\n', r"\n"),
            ('\u{1}', r"\u0001"),
            ('\u{7f}', r"\u007f"),
            ('é', r"\u00e9"),
        ];
        for (c, escaped) in cases {
            for (pad, at) in [(3, 0), (3, 2), (40, 0), (40, 39), (70, 33)] {
                let mut text = "a".repeat(pad);
                text.insert(at, c);
                let want = format!("\"{}{escaped}{}\"", "a".repeat(at), "a".repeat(pad - at));
                assert_eq!(dumps(&json!(text)), want, "{c:?} at {at} of {pad}");
                assert_eq!(dumped_len(&json!(text)), want.len());
            }
        }
        assert_eq!(
            dumps(&json!("a".repeat(40))),
            format!("\"{}\"", "a".repeat(40))
        );
    }

    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (10.0, "10.0"),
            (1.5, "1.5"),
            (0.1, "0.1"),
            (30.0, "30.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (1234567890123456.0, "1234567890123456.0"),
            (-2.5e-7, "-2.5e-07"),
            (0.0, "0.0"),
            (1e100, "1e+100"),
        ];
        for (x, want) in cases {
            assert_eq!(py_float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn repr_of_strings_and_values() {
        assert_eq!(py_str_repr("it's"), "\"it's\"");
        assert_eq!(
            py_repr(&json!({"a": [1, null, true]})),
            "{'a': [1, None, True]}"
        );
    }
}
