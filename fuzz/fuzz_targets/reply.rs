//! Model replies: a completion body through the OpenAI-compatible adapter, and its content
//! through the kernel's reply parser. Any input: an error or a reply, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tether::kernel::RawReply;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = tether::model::openai::parse_completion(text);
    let _ = tether::kernel::reply::parse_owned(RawReply::Text(text.to_string()));
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(text) {
        let _ = tether::kernel::reply::parse_owned(RawReply::Json(v));
    }
    let _ = tether::model::parse_script(text);
});
