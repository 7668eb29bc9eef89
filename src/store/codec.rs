//! The record codec: every stored value is JSON with a version tag `"v"`.
//!
//! JSON keeps dynamic values (facts, args, results, spans) decodable, and the tag lets a later
//! version migrate old records and lets this one refuse records from a newer one.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::Error;

/// The record version this build writes.
pub const RECORD_VERSION: u64 = 1;

pub fn encode<T: Serialize>(record: &T) -> Result<Vec<u8>, Error> {
    let mut v = serde_json::to_value(record)
        .map_err(|e| Error::Corrupt(format!("cannot encode a record: {e}")))?;
    if let Value::Object(m) = &mut v {
        m.insert("v".into(), Value::from(RECORD_VERSION));
    }
    serde_json::to_vec(&v).map_err(|e| Error::Corrupt(format!("cannot encode a record: {e}")))
}

pub fn decode<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, Error> {
    let mut v: Value = serde_json::from_slice(bytes)
        .map_err(|e| Error::Corrupt(format!("{what}: not a valid record: {e}")))?;
    let version = v.get("v").and_then(Value::as_u64).unwrap_or(0);
    if version > RECORD_VERSION {
        return Err(Error::NewerVersion {
            what: format!("{what} record"),
            found: version,
            supported: RECORD_VERSION,
        });
    }
    if let Value::Object(m) = &mut v {
        m.remove("v");
    }
    serde_json::from_value(v).map_err(|e| Error::Corrupt(format!("{what}: unexpected record: {e}")))
}
