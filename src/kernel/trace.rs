//! Trace spans: task, step, model, tool and resume, each with a parent, start and end times in
//! milliseconds of active time, a status, and the attributes the design reference records.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    Task,
    Step,
    Model,
    Tool,
    Resume,
}

impl SpanKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SpanKind::Task => "task",
            SpanKind::Step => "step",
            SpanKind::Model => "model",
            SpanKind::Tool => "tool",
            SpanKind::Resume => "resume",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Span {
    pub id: u32,
    pub parent: Option<u32>,
    pub kind: SpanKind,
    /// Borrowed when the name is a fixed one ("model.next"), so most spans allocate nothing.
    pub name: Cow<'static, str>,
    pub t0_ms: u64,
    pub t1_ms: Option<u64>,
    /// "open" until the span ends; then "ok", a stop reason, or a tool result code.
    pub status: Cow<'static, str>,
    /// Model spans: estimated (or provider-reported) input and output tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tin: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tout: Option<u64>,
    /// Tool spans: the arguments, the call key and the estimated size of the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_tokens: Option<u64>,
}

impl Span {
    pub fn duration_ms(&self) -> u64 {
        self.t1_ms.map_or(0, |t1| t1.saturating_sub(self.t0_ms))
    }
}

/// The spans of one run, numbered from `first_id` so that a resumed task continues its trace.
#[derive(Debug, Default)]
pub struct Trace {
    pub spans: Vec<Span>,
    first_id: u32,
    /// How many spans there were at the last [`Trace::take_changed`]: the ones after are new.
    taken: usize,
    /// Indexes of spans before `taken` changed since then.
    touched: Vec<usize>,
}

impl Trace {
    pub fn new(first_id: u32) -> Trace {
        Trace {
            // Room for a step's spans from the start, no more: thousands of runs wait at once,
            // each holding its trace.
            spans: Vec::with_capacity(4),
            first_id,
            taken: 0,
            touched: Vec::new(),
        }
    }

    pub fn start(
        &mut self,
        kind: SpanKind,
        name: impl Into<Cow<'static, str>>,
        parent: Option<u32>,
        t_ms: u64,
    ) -> u32 {
        let id = self.first_id + self.spans.len() as u32;
        self.spans.push(Span {
            id,
            parent,
            kind,
            name: name.into(),
            t0_ms: t_ms,
            t1_ms: None,
            status: Cow::Borrowed("open"),
            tin: None,
            tout: None,
            args: None,
            key: None,
            result_tokens: None,
        });
        id
    }

    pub fn get_mut(&mut self, id: u32) -> &mut Span {
        let i = (id - self.first_id) as usize;
        if i < self.taken && !self.touched.contains(&i) {
            self.touched.push(i);
        }
        &mut self.spans[i]
    }

    pub fn end(&mut self, id: u32, status: impl Into<Cow<'static, str>>, t_ms: u64) {
        let span = self.get_mut(id);
        span.t1_ms = Some(t_ms);
        span.status = status.into();
    }

    /// Spans created or changed since the last call, in id order: what a durable driver must
    /// write (and, of those that ended, what a live exporter sends). A span is listed again
    /// only if it changed again.
    pub fn take_changed(&mut self) -> Vec<Span> {
        self.touched.sort_unstable();
        let mut out: Vec<Span> = self
            .touched
            .iter()
            .map(|&i| self.spans[i].clone())
            .collect();
        out.extend_from_slice(&self.spans[self.taken.min(self.spans.len())..]);
        self.touched.clear();
        self.taken = self.spans.len();
        out
    }

    pub fn next_id(&self) -> u32 {
        self.first_id + self.spans.len() as u32
    }
}

/// A step span's name, `step N`: borrowed for the first steps (every step of a run under the
/// default budget), written out beyond them.
pub fn step_name(step: u32) -> std::borrow::Cow<'static, str> {
    const NAMES: [&str; 17] = [
        "step 0", "step 1", "step 2", "step 3", "step 4", "step 5", "step 6", "step 7", "step 8",
        "step 9", "step 10", "step 11", "step 12", "step 13", "step 14", "step 15", "step 16",
    ];
    match NAMES.get(step as usize) {
        Some(n) => std::borrow::Cow::Borrowed(n),
        None => std::borrow::Cow::Owned(format!("step {step}")),
    }
}
