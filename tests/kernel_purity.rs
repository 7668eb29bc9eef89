//! The kernel is sans-IO: no file in src/kernel may import storage, worker, model, tool or
//! network code, or read a clock. This test reads the sources and fails on any such import.

const FORBIDDEN: [&str; 14] = [
    "crate::store",
    "crate::worker",
    "crate::model",
    "crate::tools",
    "crate::sim",
    "crate::cli",
    "crate::http",
    "redb",
    "std::net",
    "std::fs",
    "std::time",
    "std::thread",
    "crossbeam",
    "std::process",
];

#[test]
fn kernel_imports_no_io() {
    let dir = format!("{}/src/kernel", env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("src/kernel exists") {
        let path = entry.expect("readable entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for bad in FORBIDDEN {
                assert!(
                    !code.contains(bad),
                    "{}:{}: kernel code must not use {bad}: {line}",
                    path.display(),
                    n + 1
                );
            }
        }
        checked += 1;
    }
    assert!(
        checked >= 8,
        "expected the kernel's source files, found {checked}"
    );
}
