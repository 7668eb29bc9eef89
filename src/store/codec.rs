//! The record codec: every stored value is a bincode row inside a versioned, checksummed
//! envelope.
//!
//! ```text
//! byte 0      MAGIC (0xB7: never `{`, the first byte of every version-1 JSON record)
//! byte 1      format version (2; 3 for a reply row, see below)
//! bytes 2..10 the first 8 bytes of SHA-256(format version, payload)
//! bytes 10..  payload: the row, bincode 2 (standard config, at most RECORD_BYTES_MAX)
//! ```
//!
//! A row is a plain struct of its own (see [`super::rows`]), not the domain type: domain types
//! shape their JSON for people (internally tagged enums, omitted empty fields), which a
//! non-self-describing format cannot read back, and keeping the two apart means a change to
//! `--json` output never changes the file format. Dynamic values (facts, arguments, results,
//! span attributes, event details) are canonical JSON text inside the row ([`Json`]), so
//! bincode never meets `serde_json::Value`. Enums are encoded by variant index: variants may
//! only be appended.
//!
//! A row type changes by a new format version of its own ([`Record::FORMAT`]): its older
//! rows stay readable through [`Record::older_row`] (or [`decode_row_versioned`]), and a build
//! that meets a version larger than it knows refuses the record as newer. Format 3 of a model
//! reply adds the provider's response id, model and finish reasons; format 3 of a task's spec
//! adds its call-key namespace, the budget its enqueue asked for, and a model named by its
//! profile; every other row is still written in format 2.
//!
//! Decoding checks the magic, the version and the checksum before bincode sees a byte, refuses
//! trailing bytes, and bounds every length bincode reads. A record that fails any check is an
//! error that names the record; nothing is ever returned silently wrong. Version-1 records
//! (JSON with a `"v"` tag, written before this format) are still read, so that the migration
//! at open can rewrite them.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::Error;
use crate::limits;

/// The record format of rows that never changed since the envelope was introduced (the
/// oldest one this build reads); a row type's own format is [`Record::FORMAT`].
pub const RECORD_VERSION: u8 = 2;
/// First byte of every record of format 2 and later.
const MAGIC: u8 = 0xB7;
const HEADER_LEN: usize = 10;
/// The largest record bincode will read: a length prefix damaged into a huge number is an
/// error, not an allocation.
pub const RECORD_BYTES_MAX: usize = limits::RECORD_BYTES_MAX;

const CONFIG: bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<RECORD_BYTES_MAX>,
> = bincode::config::standard().with_limit::<RECORD_BYTES_MAX>();

/// A domain value that is stored as a row.
pub trait Record: Sized {
    type Row: Serialize + DeserializeOwned;
    /// The format version this build writes this row in.
    const FORMAT: u8 = RECORD_VERSION;
    fn to_row(&self) -> Self::Row;
    /// `Err` says what in the row is wrong (a JSON text that does not parse, a missing blob).
    fn from_row(row: Self::Row) -> std::result::Result<Self, String>;
    /// Reads a row written in an older format `version` (at least [`RECORD_VERSION`], less
    /// than [`Self::FORMAT`]), as the current row.
    fn older_row(what: &str, version: u8, _payload: &[u8]) -> Result<Self::Row, Error> {
        Err(Error::Corrupt(format!(
            "{what} record: unknown record format {version}"
        )))
    }
}

/// Canonical JSON text of a dynamic value, stored inside a row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Json(pub String);

impl Json {
    pub fn of(v: &Value) -> Json {
        Json(v.to_string())
    }

    pub fn of_map(m: &serde_json::Map<String, Value>) -> Json {
        Json(serde_json::to_string(m).unwrap_or_else(|_| "{}".into()))
    }

    pub fn value(&self) -> std::result::Result<Value, String> {
        limits::parse_json(&self.0, "stored JSON").map_err(|e| e.to_string())
    }

    pub fn map(&self) -> std::result::Result<serde_json::Map<String, Value>, String> {
        match self.value()? {
            Value::Object(m) => Ok(m),
            other => Err(format!("expected a JSON object, found {}", kind(&other))),
        }
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Encodes a row into an envelope of format [`RECORD_VERSION`].
pub fn encode_row<R: Serialize>(row: &R) -> Result<Vec<u8>, Error> {
    encode_row_as(RECORD_VERSION, row)
}

/// Encodes a row into an envelope of format `version`.
pub fn encode_row_as<R: Serialize>(version: u8, row: &R) -> Result<Vec<u8>, Error> {
    let mut out = vec![MAGIC, version, 0, 0, 0, 0, 0, 0, 0, 0];
    bincode::serde::encode_into_std_write(row, &mut out, CONFIG)
        .map_err(|e| Error::Corrupt(format!("cannot encode a record: {e}")))?;
    if out.len() > RECORD_BYTES_MAX {
        return Err(Error::Invalid(format!(
            "a record of {} bytes is over the limit of {RECORD_BYTES_MAX} bytes",
            out.len()
        )));
    }
    let sum = checksum(version, &out[HEADER_LEN..]);
    out[2..HEADER_LEN].copy_from_slice(&sum);
    Ok(out)
}

/// An envelope around an arbitrary payload, with a valid checksum: what a fuzzer or a test
/// uses to reach the row decoder behind the checksum.
pub fn seal(payload: &[u8]) -> Vec<u8> {
    seal_as(RECORD_VERSION, payload)
}

/// [`seal`] with the format version `version` (a reply row's format 3, say).
pub fn seal_as(version: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![MAGIC, version];
    out.extend_from_slice(&checksum(version, payload));
    out.extend_from_slice(payload);
    out
}

/// Decodes an envelope of format [`RECORD_VERSION`] into a row, checking magic, version,
/// checksum and length.
pub fn decode_row<R: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<R, Error> {
    let (_, payload) = open_envelope(what, bytes, RECORD_VERSION)?;
    decode_payload(what, payload)
}

/// Decodes a row of a type whose current format is `newest`: a record of that format as it
/// is, an older one through `older` (given its format and payload).
pub fn decode_row_versioned<R: DeserializeOwned>(
    what: &str,
    bytes: &[u8],
    newest: u8,
    older: impl FnOnce(u8, &[u8]) -> Result<R, Error>,
) -> Result<R, Error> {
    let (version, payload) = open_envelope(what, bytes, newest)?;
    if version == newest {
        decode_payload(what, payload)
    } else {
        older(version, payload)
    }
}

/// Decodes the bincode payload of an envelope, refusing trailing bytes.
pub fn decode_payload<R: DeserializeOwned>(what: &str, payload: &[u8]) -> Result<R, Error> {
    let (row, read) = bincode::serde::decode_from_slice::<R, _>(payload, CONFIG)
        .map_err(|e| Error::Corrupt(format!("{what} record: cannot be decoded: {e}")))?;
    if read != payload.len() {
        return Err(Error::Corrupt(format!(
            "{what} record: {} bytes left over after the record",
            payload.len() - read
        )));
    }
    Ok(row)
}

/// The format version and payload of an envelope whose header and checksum are right and
/// whose version is between [`RECORD_VERSION`] and `newest`.
fn open_envelope<'a>(what: &str, bytes: &'a [u8], newest: u8) -> Result<(u8, &'a [u8]), Error> {
    if bytes.len() < HEADER_LEN || bytes[0] != MAGIC {
        return Err(Error::Corrupt(format!(
            "{what} record: not a record of this format ({} bytes)",
            bytes.len()
        )));
    }
    let version = bytes[1];
    let payload = &bytes[HEADER_LEN..];
    // The checksum first: the header layout is kept by every later format, so a record whose
    // checksum holds and whose version is larger really is newer, while a flipped version
    // byte is damage like any other.
    if checksum(version, payload) != bytes[2..HEADER_LEN] {
        return Err(Error::Corrupt(format!(
            "{what} record: checksum mismatch (the stored bytes changed after they were written)"
        )));
    }
    if version > newest {
        return Err(Error::NewerVersion {
            what: format!("{what} record"),
            found: u64::from(version),
            supported: u64::from(newest),
        });
    }
    if version < RECORD_VERSION {
        return Err(Error::Corrupt(format!(
            "{what} record: unknown record format {version}"
        )));
    }
    Ok((version, payload))
}

fn checksum(version: u8, payload: &[u8]) -> [u8; 8] {
    let mut h = Sha256::new();
    h.update([version]);
    h.update(payload);
    let d = h.finalize();
    let mut out = [0u8; 8];
    out.copy_from_slice(&d[..8]);
    out
}

/// Whether `bytes` is a version-1 record (JSON text with a `"v"` tag).
pub fn is_legacy(bytes: &[u8]) -> bool {
    bytes.first() == Some(&b'{')
}

/// Encodes a domain value as its row.
pub fn encode<T: Record>(value: &T) -> Result<Vec<u8>, Error> {
    encode_row_as(T::FORMAT, &value.to_row())
}

/// Decodes a domain value: a current record, or a version-1 record (read so that the migration
/// can rewrite it; nothing else writes them any more).
pub fn decode<T: Record + DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, Error> {
    if is_legacy(bytes) {
        return decode_legacy(what, bytes);
    }
    let (version, payload) = open_envelope(what, bytes, T::FORMAT)?;
    let row = if version == T::FORMAT {
        decode_payload::<T::Row>(what, payload)?
    } else {
        T::older_row(what, version, payload)?
    };
    T::from_row(row).map_err(|e| Error::Corrupt(format!("{what} record: {e}")))
}

/// Decodes a version-1 record: JSON with a version tag `"v"` (absent or 1).
pub fn decode_legacy<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, Error> {
    let mut v: Value = serde_json::from_slice(bytes)
        .map_err(|e| Error::Corrupt(format!("{what}: not a valid version-1 record: {e}")))?;
    let version = v.get("v").and_then(Value::as_u64).unwrap_or(1);
    if version != 1 {
        return Err(Error::Corrupt(format!(
            "{what}: a JSON record of version {version}; only version 1 was ever written as JSON"
        )));
    }
    if let Value::Object(m) = &mut v {
        m.remove("v");
    }
    serde_json::from_value(v).map_err(|e| Error::Corrupt(format!("{what}: unexpected record: {e}")))
}

/// Rewrites every version-1 record of table `t` in the current format; returns how many.
/// A version-1 record that does not decode is left as it is, for the readers and
/// `worker check` to report as damaged.
pub fn migrate_table<K, T>(t: &mut redb::Table<K, &'static [u8]>, what: &str) -> Result<u64, Error>
where
    K: redb::Key + 'static,
    T: Record + DeserializeOwned,
{
    use redb::ReadableTable;
    let mut redo: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    for entry in t.iter()? {
        let (k, v) = entry?;
        if !is_legacy(v.value()) {
            continue;
        }
        if let Ok(rec) = decode_legacy::<T>(what, v.value()) {
            let key = K::as_bytes(&k.value()).as_ref().to_vec();
            redo.push((key, encode(&rec)?));
        }
    }
    for (k, v) in &redo {
        t.insert(K::from_bytes(k), v.as_slice())?;
    }
    Ok(redo.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Row {
        a: u64,
        s: String,
        j: Json,
    }

    fn row() -> Row {
        Row {
            a: 708,
            s: "loop".into(),
            j: Json::of(&serde_json::json!({"k": [1, 2, {"x": null}]})),
        }
    }

    #[test]
    fn a_row_round_trips() {
        let bytes = encode_row(&row()).unwrap();
        assert_eq!(bytes[0], MAGIC);
        assert_eq!(decode_row::<Row>("test", &bytes).unwrap(), row());
    }

    #[test]
    fn every_single_bit_flip_is_an_error_never_a_wrong_value() {
        let bytes = encode_row(&row()).unwrap();
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                match decode_row::<Row>("test", &b) {
                    Err(Error::Corrupt(m)) => assert!(m.starts_with("test record"), "{m}"),
                    other => panic!("byte {i} bit {bit}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn truncated_and_extended_records_are_errors() {
        let bytes = encode_row(&row()).unwrap();
        for n in 0..bytes.len() {
            assert!(decode_row::<Row>("test", &bytes[..n]).is_err(), "{n}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode_row::<Row>("test", &longer).is_err());
    }

    #[test]
    fn a_huge_length_prefix_is_an_error_not_an_allocation() {
        // A row of one string whose length prefix says 2^60 bytes, with a valid checksum: the
        // decoder must refuse it by the limit before allocating.
        let mut payload = vec![0xFFu8];
        payload.extend_from_slice(&(1u64 << 60).to_le_bytes());
        let mut bytes = vec![MAGIC, RECORD_VERSION, 0, 0, 0, 0, 0, 0, 0, 0];
        bytes.extend_from_slice(&payload);
        let sum = checksum(RECORD_VERSION, &payload);
        bytes[2..HEADER_LEN].copy_from_slice(&sum);
        let e = decode_row::<String>("test", &bytes).unwrap_err();
        assert!(e.to_string().contains("cannot be decoded"), "{e}");
    }

    #[test]
    fn a_newer_format_is_refused_by_name() {
        let mut bytes = encode_row(&row()).unwrap();
        bytes[1] = RECORD_VERSION + 1;
        let sum = checksum(RECORD_VERSION + 1, &bytes[HEADER_LEN..]);
        bytes[2..HEADER_LEN].copy_from_slice(&sum);
        assert!(matches!(
            decode_row::<Row>("task", &bytes),
            Err(Error::NewerVersion { found: 3, .. })
        ));
    }
}
