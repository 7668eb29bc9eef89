//! The row of a recorded model reply, in its current format (5) and the three before (4, 3,
//! 2), which are still read: see [`super::super::codec`] on how a row type changes format.

use serde::{Deserialize, Serialize};

use super::R;
use crate::kernel::ResponseInfo;
use crate::model::{RecordedOutcome, RecordedReply, RecordedTool};
use crate::store::Error;
use crate::store::codec::{Json, Record, decode_payload};

#[derive(Serialize, Deserialize)]
pub enum OutcomeRow {
    Json(Json),
    Text(String),
    Timeout,
    Failed(String),
    /// Format 4 on.
    Invalid(String),
    Refused(String),
    Fatal(String),
}

/// A model reply, format 5: format 4 and what the tools answered in its step.
#[derive(Serialize, Deserialize)]
pub struct ReplyRow {
    step: u32,
    outcome: OutcomeRow,
    latency_ms: u64,
    usage: Option<[u64; 2]>,
    response: Option<ResponseRow>,
    turn: Option<Json>,
    prompt: Option<String>,
    tools: Option<Vec<ToolRow>>,
}

/// One tool answer of a step (format 5 on).
#[derive(Serialize, Deserialize)]
pub struct ToolRow {
    name: String,
    digest: String,
    result: Json,
    latency_ms: u64,
}

/// A model reply, format 4: format 3, the reply in the provider's protocol (JSON of a
/// [`crate::kernel::Turn`]) and the version of the prompt it was made with.
#[derive(Serialize, Deserialize)]
pub struct ReplyRowV4 {
    step: u32,
    outcome: OutcomeRow,
    latency_ms: u64,
    usage: Option<[u64; 2]>,
    response: Option<ResponseRow>,
    turn: Option<Json>,
    prompt: Option<String>,
}

/// A model reply, format 3: format 2 and what the provider said of its response.
#[derive(Serialize, Deserialize)]
pub struct ReplyRowV3 {
    step: u32,
    outcome: OutcomeRow,
    latency_ms: u64,
    usage: Option<[u64; 2]>,
    response: Option<ResponseRow>,
}

#[derive(Serialize, Deserialize)]
pub struct ResponseRow {
    id: Option<String>,
    model: Option<String>,
    finish_reasons: Vec<String>,
}

/// A model reply, format 2 (before the response's id, model and finish reasons were kept).
#[derive(Serialize, Deserialize)]
pub struct ReplyRowV2 {
    step: u32,
    outcome: OutcomeRow,
    latency_ms: u64,
    usage: Option<[u64; 2]>,
}

impl Record for RecordedReply {
    type Row = ReplyRow;
    const FORMAT: u8 = 5;
    fn to_row(&self) -> ReplyRow {
        ReplyRow {
            step: self.step,
            outcome: match &self.outcome {
                RecordedOutcome::Json(v) => OutcomeRow::Json(Json::of(v)),
                RecordedOutcome::Text(t) => OutcomeRow::Text(t.clone()),
                RecordedOutcome::Timeout => OutcomeRow::Timeout,
                RecordedOutcome::Failed(m) => OutcomeRow::Failed(m.clone()),
                RecordedOutcome::Invalid(m) => OutcomeRow::Invalid(m.clone()),
                RecordedOutcome::Refused(m) => OutcomeRow::Refused(m.clone()),
                RecordedOutcome::Fatal(m) => OutcomeRow::Fatal(m.clone()),
            },
            latency_ms: self.latency_ms,
            usage: self.usage,
            response: self.response.as_ref().map(|r| ResponseRow {
                id: r.id.clone(),
                model: r.model.clone(),
                finish_reasons: r.finish_reasons.clone(),
            }),
            turn: self
                .turn
                .as_ref()
                .and_then(|t| serde_json::to_value(t).ok())
                .map(|v| Json::of(&v)),
            prompt: self.prompt.clone(),
            tools: self.tools.as_ref().map(|ts| {
                ts.iter()
                    .map(|t| ToolRow {
                        name: t.name.clone(),
                        digest: t.digest.clone(),
                        result: Json::of(&t.result),
                        latency_ms: t.latency_ms,
                    })
                    .collect()
            }),
        }
    }
    fn from_row(r: ReplyRow) -> R<RecordedReply> {
        Ok(RecordedReply {
            step: r.step,
            outcome: match r.outcome {
                OutcomeRow::Json(j) => RecordedOutcome::Json(j.value()?),
                OutcomeRow::Text(t) => RecordedOutcome::Text(t),
                OutcomeRow::Timeout => RecordedOutcome::Timeout,
                OutcomeRow::Failed(m) => RecordedOutcome::Failed(m),
                OutcomeRow::Invalid(m) => RecordedOutcome::Invalid(m),
                OutcomeRow::Refused(m) => RecordedOutcome::Refused(m),
                OutcomeRow::Fatal(m) => RecordedOutcome::Fatal(m),
            },
            latency_ms: r.latency_ms,
            usage: r.usage,
            response: r.response.map(|r| ResponseInfo {
                id: r.id,
                model: r.model,
                finish_reasons: r.finish_reasons,
            }),
            turn: match r.turn {
                None => None,
                Some(j) => Some(
                    serde_json::from_value(j.value()?)
                        .map_err(|e| format!("the reply's turn: {e}"))?,
                ),
            },
            prompt: r.prompt,
            tools: match r.tools {
                None => None,
                Some(ts) => Some(
                    ts.into_iter()
                        .map(|t| {
                            Ok(RecordedTool {
                                result: t.result.value()?,
                                name: t.name,
                                digest: t.digest,
                                latency_ms: t.latency_ms,
                            })
                        })
                        .collect::<R<Vec<_>>>()?,
                ),
            },
        })
    }
    fn older_row(what: &str, version: u8, payload: &[u8]) -> Result<ReplyRow, Error> {
        if version == 4 {
            let o: ReplyRowV4 = decode_payload(what, payload)?;
            return Ok(ReplyRow {
                step: o.step,
                outcome: o.outcome,
                latency_ms: o.latency_ms,
                usage: o.usage,
                response: o.response,
                turn: o.turn,
                prompt: o.prompt,
                tools: None,
            });
        }
        let (step, outcome, latency_ms, usage, response) = match version {
            2 => {
                let o: ReplyRowV2 = decode_payload(what, payload)?;
                (o.step, o.outcome, o.latency_ms, o.usage, None)
            }
            3 => {
                let o: ReplyRowV3 = decode_payload(what, payload)?;
                (o.step, o.outcome, o.latency_ms, o.usage, o.response)
            }
            _ => {
                return Err(Error::Corrupt(format!(
                    "{what} record: unknown record format {version}"
                )));
            }
        };
        Ok(ReplyRow {
            step,
            outcome,
            latency_ms,
            usage,
            response,
            turn: None,
            prompt: None,
            tools: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::codec::{decode, encode, encode_row};

    fn reply(response: Option<ResponseInfo>) -> RecordedReply {
        RecordedReply {
            step: 3,
            outcome: RecordedOutcome::Text("{\"type\": \"final\"}".into()),
            latency_ms: 120,
            usage: Some([50, 9]),
            response,
            turn: None,
            prompt: None,
            tools: None,
        }
    }

    #[test]
    fn a_reply_is_written_in_format_5_and_read_back_with_its_response_turn_and_tools() {
        let mut r = reply(Some(ResponseInfo {
            id: Some("cmpl-1".into()),
            model: Some("m-2026".into()),
            finish_reasons: vec!["tool_calls".into()],
        }));
        r.outcome = RecordedOutcome::Refused("the model refused: no".into());
        r.turn = Some(crate::kernel::Turn {
            text: Some("Looking it up.".into()),
            calls: vec![crate::kernel::TurnCall {
                id: "call_1".into(),
                name: "get_order".into(),
                arguments: serde_json::json!({"order_id": "o1"}),
            }],
        });
        r.prompt = Some("native-1+abc".into());
        r.tools = Some(vec![RecordedTool {
            name: "get_order".into(),
            digest: "0123456789".into(),
            result: serde_json::json!({"status": "ok", "order": {"id": "o1"}}),
            latency_ms: 37,
        }]);
        let bytes = encode(&r).unwrap();
        assert_eq!(bytes[1], 5);
        assert_eq!(decode::<RecordedReply>("reply", &bytes).unwrap(), r);
    }

    #[test]
    fn a_format_4_reply_is_read_without_tool_answers() {
        let old = ReplyRowV4 {
            step: 3,
            outcome: OutcomeRow::Text("{\"type\": \"final\"}".into()),
            latency_ms: 120,
            usage: Some([50, 9]),
            response: None,
            turn: None,
            prompt: Some("p1".into()),
        };
        let bytes = crate::store::codec::encode_row_as(4, &old).unwrap();
        let mut want = reply(None);
        want.prompt = Some("p1".into());
        assert_eq!(decode::<RecordedReply>("reply", &bytes).unwrap(), want);
    }

    #[test]
    fn a_format_3_reply_is_read_without_a_turn() {
        let old = ReplyRowV3 {
            step: 3,
            outcome: OutcomeRow::Text("{\"type\": \"final\"}".into()),
            latency_ms: 120,
            usage: Some([50, 9]),
            response: None,
        };
        let bytes = crate::store::codec::encode_row_as(3, &old).unwrap();
        assert_eq!(
            decode::<RecordedReply>("reply", &bytes).unwrap(),
            reply(None)
        );
    }

    #[test]
    fn a_format_2_reply_is_read_without_a_response() {
        let old = ReplyRowV2 {
            step: 3,
            outcome: OutcomeRow::Text("{\"type\": \"final\"}".into()),
            latency_ms: 120,
            usage: Some([50, 9]),
        };
        let bytes = encode_row(&old).unwrap();
        assert_eq!(bytes[1], 2);
        assert_eq!(
            decode::<RecordedReply>("reply", &bytes).unwrap(),
            reply(None)
        );
    }

    #[test]
    fn a_format_2_reader_refuses_a_format_5_reply_as_newer() {
        let bytes = encode(&reply(None)).unwrap();
        let err = crate::store::codec::decode_row::<ReplyRowV2>("reply t1/3", &bytes)
            .err()
            .expect("refused");
        assert!(
            err.to_string()
                .contains("reply t1/3 record was written by a newer version"),
            "{err}"
        );
    }
}
