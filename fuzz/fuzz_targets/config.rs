//! The config and catalog parsers (TOML): a config or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = tether::config::parse(text, Path::new("/nonexistent/worker.toml"));
    let _ = tether::config::parse_catalog(text, Path::new("tools.toml"));
});
