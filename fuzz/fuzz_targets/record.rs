//! The record decoder: any bytes as each kind of stored record. A record either decodes to a
//! value that encodes back to the same bytes, or is an error; never a panic, never a huge
//! allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tether::kernel::memory::Note;
use tether::kernel::{Span, TaskState};
use tether::model::RecordedReply;
use tether::store::CallRecord;
use tether::store::codec::{decode, decode_row, encode, encode_row};
use tether::store::ops::Event;
use tether::store::rows::{Blob, SpecRow, TaskRow};

fn round_trip<T>(data: &[u8])
where
    T: tether::store::codec::Record + serde::de::DeserializeOwned,
{
    if let Ok(v) = decode::<T>("fuzz", data) {
        // A current record that decodes encodes back to itself (legacy JSON is rewritten).
        if !tether::store::codec::is_legacy(data) {
            let again = encode(&v).expect("a decoded record encodes");
            assert!(decode::<T>("fuzz", &again).is_ok());
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // As stored bytes (the checksum stops almost everything), and as a payload behind a valid
    // checksum (what reaches bincode and the JSON text inside rows).
    all(data);
    all(&tether::store::codec::seal(data));
    // The format of rows that changed since (a model reply's format 3).
    all(&tether::store::codec::seal_as(3, data));
});

fn all(data: &[u8]) {
    round_trip::<TaskState>(data);
    round_trip::<CallRecord>(data);
    round_trip::<Span>(data);
    round_trip::<RecordedReply>(data);
    round_trip::<Event>(data);
    round_trip::<Note>(data);
    if let Ok(row) = decode_row::<TaskRow>("fuzz", data) {
        let _ = encode_row(&row);
    }
    let _ = decode_row::<SpecRow>("fuzz", data);
    if let Ok(b) = decode_row::<Blob>("fuzz", data) {
        let _ = b.digest();
    }
}
