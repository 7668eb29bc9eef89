//! The kernel is sans-IO: code under src/kernel may name only an allow-list of paths (its own
//! modules, the crate's limits, serde, serde_json, sha2, jsonschema, and the parts of std that
//! do no I/O and read no clock). This test reads the sources and fails on any other path, so a
//! new dependency of the kernel (a crate, a module of this crate, `std::time`) is a decision
//! made here, not an accident. The durable step's machine (`src/worker/machine/`) is held to
//! the same list, plus the kernel, the store's records and the model's recorded replies.

/// Where a path may start: `crate::X` and `std::X` by their second segment, others by their
/// first.
const CRATE: [&str; 2] = ["kernel", "limits"];
const STD: [&str; 17] = [
    "borrow",
    "char",
    "cmp",
    "collections",
    "convert",
    "error",
    "fmt",
    "hash",
    "iter",
    "mem",
    "num",
    "ops",
    "option",
    "result",
    "str",
    "string",
    // `Arc`, for the driver's send gate a route may keep (`kernel::io::Gate`): no I/O.
    "sync",
];
const ROOTS: [&str; 9] = [
    "super",
    "self",
    "serde",
    "serde_json",
    "sha2",
    "jsonschema",
    // Names the kernel imported from the allowed paths above.
    "fmt",
    "limits",
    "json",
];
/// Primitive types, whose associated items are paths too (`u64::MAX`).
const PRIMITIVES: [&str; 12] = [
    "bool", "char", "f32", "f64", "i32", "i64", "str", "u8", "u16", "u32", "u64", "usize",
];

/// The paths of a line of code: each lower-case identifier followed by `::` that does not
/// itself follow `::`, with its next segment.
fn paths(code: &str) -> Vec<(String, String)> {
    let b = code.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        // Not a segment of a longer path, nor a method (`.collect::<T>()`).
        let starts = ident(b[i])
            && (i == 0 || !ident(b[i - 1]))
            && !code[..i].ends_with("::")
            && !code[..i].ends_with('.');
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < b.len() && ident(b[j]) {
            j += 1;
        }
        let first = &code[i..j];
        if code[j..].starts_with("::")
            && !code[j..].starts_with("::<")
            && first.starts_with(|c: char| c.is_ascii_lowercase())
        {
            let k = j + 2;
            let mut m = k;
            while m < b.len() && ident(b[m]) {
                m += 1;
            }
            out.push((first.to_string(), code[k..m].to_string()));
        }
        i = j;
    }
    out
}

fn allowed(first: &str, second: &str, own: &[String]) -> bool {
    match first {
        "crate" => CRATE.contains(&second),
        "std" | "core" => STD.contains(&second),
        f => ROOTS.contains(&f) || PRIMITIVES.contains(&f) || own.iter().any(|m| m == f),
    }
}

/// The Rust files under `src/DIR`.
fn files_of(dir: &str) -> Vec<std::path::PathBuf> {
    let root = std::path::PathBuf::from(format!("{}/src/{dir}", env!("CARGO_MANIFEST_DIR")));
    let mut dirs = vec![root];
    let mut files = Vec::new();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("the directory exists") {
            let path = entry.expect("readable entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().and_then(|e| e.to_str()) == Some("rs") {
                files.push(path);
            }
        }
    }
    files
}

/// Every path of `files`' code (not comments or strings), with where it is.
fn code_paths(files: &[std::path::PathBuf]) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(path).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            // String literals are text, not paths.
            let code: String = code.split('"').step_by(2).collect::<Vec<_>>().join(" ");
            let at = format!("{}:{}: {line}", path.display(), n + 1);
            for (first, second) in paths(&code) {
                out.push((first, second, at.clone()));
            }
        }
    }
    out
}

#[test]
fn kernel_imports_only_its_allow_list() {
    let files = files_of("kernel");
    // The kernel's own modules, which its files name by their short names.
    let own: Vec<String> = files
        .iter()
        .filter_map(|p| p.file_stem()?.to_str().map(str::to_string))
        .chain(std::iter::once("session".to_string()))
        .filter(|m| m != "mod")
        .collect();
    for (first, second, at) in code_paths(&files) {
        assert!(
            allowed(&first, &second, &own),
            "{at}\nkernel code may not use {first}::{second} (not on the allow-list of tests/kernel_purity.rs)"
        );
    }
    assert!(
        files.len() >= 8,
        "expected the kernel's source files, found {}",
        files.len()
    );
}

/// The durable step's machine (`src/worker/machine/`) is sans-IO too: beside the kernel's
/// allow-list it may name the kernel, the model's recorded replies and the store's record
/// types (and log with `tracing`), and never a backend, a committer, a clock or a thread.
#[test]
fn the_durable_steps_machine_does_no_io() {
    let files = files_of("worker/machine");
    let own: Vec<String> = ["commit", "write", "machine"].map(str::to_string).to_vec();
    for (first, second, at) in code_paths(&files) {
        let ok = match first.as_str() {
            "crate" => ["kernel", "model", "store"].contains(&second.as_str()),
            "tracing" => true,
            _ => allowed(&first, &second, &own),
        };
        assert!(ok, "{at}\nthe machine may not use {first}::{second}");
    }
    for path in &files {
        let text = std::fs::read_to_string(path).expect("readable source");
        for word in [
            "Backend",
            "Committer",
            "now_ms()",
            "Instant",
            "SystemTime",
            "thread::",
            "Proof",
        ] {
            assert!(
                !text
                    .lines()
                    .any(|l| l.split("//").next().unwrap_or("").contains(word)),
                "{}: the machine names {word}: it must ask its driver instead",
                path.display()
            );
        }
    }
    assert!(files.len() >= 3, "the machine's files");
}

/// The scan itself: what it must catch, and what it must let through.
#[test]
fn the_allow_list_scan_sees_forbidden_paths() {
    let own = vec!["state".to_string()];
    let bad = [
        "let t = std::time::Instant::now();",
        "use crate::store::Backend;",
        "crate::mcp::call(x)",
        "let r = ureq::get(url);",
        "use std::fs;",
        "tokio::spawn(f)",
        "use crate::clock::now_ms;",
    ];
    for line in bad {
        assert!(
            paths(line).iter().any(|(f, s)| !allowed(f, s, &own)),
            "missed: {line}"
        );
    }
    let good = [
        "use std::collections::BTreeMap;",
        "use super::state::TaskState;",
        "let v = serde_json::json!({});",
        "Value::String(s)",
        "u64::MAX",
        "state::digest(x)",
    ];
    for line in good {
        assert!(
            paths(line).iter().all(|(f, s)| allowed(f, s, &own)),
            "refused: {line} {:?}",
            paths(line)
        );
    }
}
