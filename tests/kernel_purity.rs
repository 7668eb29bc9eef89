//! The kernel is sans-IO: no file under src/kernel may import storage, worker, model, tool or
//! network code, or read a clock. This test reads the sources and fails on any such import.

const FORBIDDEN: [&str; 16] = [
    "crate::store",
    "crate::worker",
    "crate::model",
    "crate::tools",
    "crate::sim",
    "crate::cli",
    "crate::http",
    "crate::net",
    "crate::clock",
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
    let mut dirs = vec![std::path::PathBuf::from(format!(
        "{}/src/kernel",
        env!("CARGO_MANIFEST_DIR")
    ))];
    let mut files = Vec::new();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/kernel exists") {
            let path = entry.expect("readable entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().and_then(|e| e.to_str()) == Some("rs") {
                files.push(path);
            }
        }
    }
    let mut checked = 0;
    for path in files {
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
