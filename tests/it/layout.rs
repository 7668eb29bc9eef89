//! The source layout's rules, read from the sources: no import circle between the crate's
//! top-level modules, no file under `src/` over 600 lines, every file opens with its module
//! docs, the command line is a `cli/` module of verb files (no `src/cli.rs`), no module
//! imports a higher layer, inside `store/` the engines sit beside each other, under nothing, and
//! no function grows past 80 lines without a reason.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable src directory") {
        let path = entry.expect("readable entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().and_then(|e| e.to_str()) == Some("rs") {
            out.push(path);
        }
    }
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The top-level module a file belongs to: `src/store/pg/mod.rs` -> `store`.
fn module_of(path: &Path) -> Option<String> {
    let rel = path.strip_prefix(src()).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.trim_end_matches(".rs");
    (name != "lib" && name != "bin").then(|| name.to_string())
}

/// The crate's top-level modules each file names (`crate::x`, or `crate::{x, y}`).
fn imports(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let inner = group.split('}').next().unwrap_or("");
                for part in inner.split(',') {
                    let name = part.trim().split("::").next().unwrap_or("").trim();
                    if !name.is_empty() {
                        out.insert(name.to_string());
                    }
                }
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        }
    }
    out
}

#[test]
fn no_import_circle_between_modules() {
    let mut files = Vec::new();
    sources(&src(), &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let Some(m) = module_of(f).filter(|m| !TEST_ONLY.contains(&m.as_str())) else {
            continue;
        };
        let text = std::fs::read_to_string(f).expect("readable source");
        let deps = graph.entry(m.clone()).or_default();
        for d in imports(&text) {
            if d != m && !TEST_ONLY.contains(&d.as_str()) {
                deps.insert(d);
            }
        }
    }
    assert!(
        graph.len() >= 10,
        "expected the crate's modules, found {graph:?}"
    );
    // Depth-first search for a back edge; the circle is printed when one is found.
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) {
        if done.contains(m) {
            return;
        }
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut circle = path[at..].to_vec();
            circle.push(m.to_string());
            panic!("import circle between modules: {}", circle.join(" -> "));
        }
        path.push(m.to_string());
        for d in graph.get(m).into_iter().flatten() {
            if graph.contains_key(d) {
                visit(d, graph, path, done);
            }
        }
        path.pop();
        done.insert(m.to_string());
    }
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        visit(m, &graph, &mut Vec::new(), &mut done);
    }
}

#[test]
fn the_import_scan_sees_circles() {
    let found = imports("use crate::{model, tools::Tools};\nlet x = crate::store::open();");
    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        ["model", "store", "tools"]
    );
}

#[test]
fn no_source_file_is_over_600_lines_and_each_has_module_docs() {
    let mut files = Vec::new();
    sources(&src(), &mut files);
    let mut problems = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("readable source");
        let lines = text.lines().count();
        if lines > 600 {
            problems.push(format!("{}: {lines} lines", f.display()));
        }
        if !text.trim_start().starts_with("//!") {
            problems.push(format!(
                "{}: no module docs (`//!`) at the top",
                f.display()
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_command_line_is_a_module_of_verb_files() {
    assert!(
        !src().join("cli.rs").exists(),
        "src/cli.rs should be the cli/ module"
    );
    let mut files = Vec::new();
    sources(&src().join("cli"), &mut files);
    assert!(
        files.len() >= 5,
        "expected a file per verb family: {files:?}"
    );
}

/// The layers of the crate, lowest first, as ARCHITECTURE.md writes them: a module may import
/// modules of its own layer (without a circle) or of a lower one, never of a higher one.
const LAYERS: [&[&str]; 8] = [
    &[
        "clock",
        "filewatch",
        "group",
        "limits",
        "net",
        "httpd",
        "testing",
    ],
    &["kernel"],
    &["model"],
    &["store"],
    &["metrics", "tools", "mcp", "config", "sim"],
    &["operator", "otlp", "replay", "api", "console", "local"],
    &["worker"],
    &["cli"],
];

fn layer_of(m: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&m))
}

/// Modules compiled for the unit tests only (`#[cfg(test)]`), which any layer's tests use and
/// which may use any layer: they are in no layer and no circle.
const TEST_ONLY: [&str; 1] = ["testing"];

#[test]
fn no_module_imports_a_higher_layer() {
    let mut files = Vec::new();
    sources(&src(), &mut files);
    let mut upward = Vec::new();
    for f in &files {
        let Some(m) = module_of(f).filter(|m| !TEST_ONLY.contains(&m.as_str())) else {
            continue;
        };
        let own = layer_of(&m).unwrap_or_else(|| {
            panic!("module {m} is in no layer: add it to LAYERS and to ARCHITECTURE.md")
        });
        let text = std::fs::read_to_string(f).expect("readable source");
        for d in imports(&text) {
            if let Some(l) = layer_of(&d)
                && l > own
            {
                upward.push(format!("{} imports {d}", f.display()));
            }
        }
    }
    assert!(upward.is_empty(), "imports of a higher layer: {upward:#?}");
}

/// Inside `store/`: the interface and the shared records (`backend`, `records`, `codec`,
/// `rows`, `list`, `outbox`) never import an engine, and the engines never import each other.
#[test]
fn the_store_engines_sit_below_nothing_and_beside_each_other() {
    let store = src().join("store");
    let mut files = Vec::new();
    sources(&store, &mut files);
    let engine_of = |p: &Path| -> Option<&'static str> {
        let rel = p.strip_prefix(&store).ok()?;
        match rel.components().next()?.as_os_str().to_str()? {
            "redb" => Some("redb"),
            "pg" => Some("pg"),
            _ => None,
        }
    };
    let mut wrong = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("readable source");
        let code: String = text
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        let names_redb = code.contains("store::redb") || code.contains("super::redb");
        let names_pg = code.contains("store::pg") || code.contains("super::pg");
        let rel = f.strip_prefix(&store).expect("under store");
        match engine_of(f) {
            // The front door opens either engine.
            None if rel == Path::new("mod.rs") => {}
            None if names_redb || names_pg => {
                wrong.push(format!("{} names an engine", f.display()))
            }
            Some("redb") if names_pg => wrong.push(format!("{} names the pg engine", f.display())),
            Some("pg") if names_redb => {
                wrong.push(format!("{} names the redb engine", f.display()))
            }
            _ => {}
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    let front = std::fs::read_to_string(store.join("mod.rs")).expect("store/mod.rs");
    assert!(
        front.lines().count() < 100,
        "store/mod.rs is the front door: modules, re-exports and opening a backend"
    );
}

/// Functions over [`FN_LINES_MAX`] lines that may stay so for now, with their length: debt to
/// pay down, never to grow. A function on this list may not get longer, one that shrinks under
/// the limit must leave the list, and a function not on it may not pass the limit unless the
/// line above it is a comment saying why (`// Long: ...`). The 31 functions listed when the
/// check was written have all been split; keep it empty.
const LONG_FUNCTIONS: &[(&str, &str, usize)] = &[];

/// The length past which a function needs a reason.
const FN_LINES_MAX: usize = 80;

/// Every function of `text` as (name, first line, lines from its signature to its closing
/// brace, whether the line above says why it is long). A function ends at the first line
/// that is its own indentation followed by `}`, as rustfmt writes it.
fn functions(text: &str) -> Vec<(String, usize, usize, bool)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let mut rest = body;
        for prefix in [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "const ",
            "async ",
            "unsafe ",
        ] {
            rest = rest.strip_prefix(prefix).unwrap_or(rest);
        }
        let Some(sig) = rest.strip_prefix("fn ") else {
            continue;
        };
        let name: String = sig
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // A declaration without a body (a trait's required method) ends with `;`.
        let open = lines[i..]
            .iter()
            .position(|l| l.contains('{') || l.trim_end().ends_with(';'));
        let Some(open) = open.filter(|&o| lines[i + o].contains('{')) else {
            continue;
        };
        let close = format!("{indent}}}");
        if let Some(end) = lines[i + open..].iter().position(|l| *l == close) {
            let why = i > 0 && lines[i - 1].trim_start().starts_with("// Long:");
            out.push((name, i + 1, open + end + 1, why));
        }
    }
    out
}

#[test]
fn no_function_is_over_80_lines_without_a_reason() {
    let mut files = Vec::new();
    sources(&src(), &mut files);
    files.sort();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = BTreeMap::new();
    let mut problems = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(root)
            .expect("under the crate")
            .display()
            .to_string();
        let text = std::fs::read_to_string(f).expect("readable source");
        for (name, line, len, why) in functions(&text) {
            if len <= FN_LINES_MAX || why {
                continue;
            }
            let known = LONG_FUNCTIONS
                .iter()
                .find(|(p, n, _)| *p == rel && *n == name);
            match known {
                Some(&(_, _, was)) if len <= was => {
                    found.insert((rel.clone(), name), len);
                }
                Some(&(_, _, was)) => problems.push(format!(
                    "{rel}:{line}: fn {name} grew from {was} to {len} lines: split it"
                )),
                None => problems.push(format!(
                    "{rel}:{line}: fn {name} is {len} lines (over {FN_LINES_MAX}): split it, or say why on the line above it (// Long: ...)"
                )),
            }
        }
    }
    for (p, n, _) in LONG_FUNCTIONS {
        if !found.contains_key(&(p.to_string(), n.to_string())) {
            problems.push(format!(
                "{p}: fn {n} is not over {FN_LINES_MAX} lines any more (or is gone): take it off LONG_FUNCTIONS"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_function_scan_measures_bodies() {
    let text = "//! x\n\npub fn short() {\n    1;\n}\n\nimpl A {\n    pub(crate) fn long(\n        a: u8,\n    ) -> u8 {\n        a\n    }\n    fn decl(&self);\n}\n// Long: a table\nfn table() {\n}\n";
    let fns = functions(text);
    assert_eq!(
        fns,
        vec![
            ("short".to_string(), 3, 3, false),
            ("long".to_string(), 8, 5, false),
            ("table".to_string(), 16, 2, true),
        ]
    );
}
