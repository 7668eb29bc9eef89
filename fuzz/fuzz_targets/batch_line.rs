//! One line of a `worker enqueue --file` batch: a task or an error naming the problem.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    // Lines naming a script file would read the disk; the fuzzer finds no such file.
    if let Err(e) = tether::cli::parse_batch_line(line, None, None) {
        assert!(!e.is_empty());
    }
});
