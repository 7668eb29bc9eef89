//! The docs hold to the code and to themselves: the README is a front door (short, with a
//! newcomer's path to an own agent, assuming nothing of the design document), no link of
//! README.md, ARCHITECTURE.md or docs/ points nowhere (files and headings; no network), every
//! shell or Python block says which test runs it (or why none does), the blocks a test here
//! runs run as written, and the README's demo table is what `worker demo` prints.

use crate::common::*;

use std::path::{Path, PathBuf};
use std::process::Stdio;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// README.md, ARCHITECTURE.md and every Markdown page under docs/.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md"), root().join("ARCHITECTURE.md")];
    let mut dirs = vec![root().join("docs")];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).expect("docs/") {
            let p = e.expect("an entry").path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The text of `page` outside fenced code blocks, line by line with their numbers.
fn prose(page: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in page.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// GitHub's anchor of a heading: lower case, spaces to `-`, punctuation but `-` and `_` gone.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(page: &str) -> Vec<String> {
    prose(page)
        .into_iter()
        .filter_map(|(_, l)| l.strip_prefix('#'))
        .map(|h| slug(h.trim_start_matches('#')))
        .collect()
}

/// Every `](target)` of `page`'s prose.
fn links(page: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(page) {
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push((n, after[..end].to_string()));
            rest = &after[end..];
        }
    }
    out
}

/// Must-show 1: the README is a front door of at most about 250 lines, with the path from
/// its first line to an own agent's answer (run as written by
/// `models::the_readme_agent_runs_as_written`), and it assumes nothing of the design document.
#[test]
fn the_readme_is_a_front_door() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(lines <= 250, "README.md has {lines} lines");
    assert!(
        readme.contains("\n## Run your own agent\n"),
        "the path to an own agent"
    );
    assert!(
        !readme.to_lowercase().contains("design reference"),
        "the README names the demo as the demo, not by a document a newcomer has not read"
    );
}

/// Must-show 5: no link of README.md, ARCHITECTURE.md or docs/ points nowhere: every relative
/// target is a file or directory of the repository, and every `#anchor` a heading of its page.
#[test]
fn no_link_points_nowhere() {
    let mut broken = Vec::new();
    for p in pages() {
        let page = read(&p);
        for (n, target) in links(&page) {
            if target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let dest = if file.is_empty() {
                p.clone()
            } else {
                p.parent().expect("a directory").join(file)
            };
            if !dest.exists() {
                broken.push(format!("{}:{n}: {target}: no such file", p.display()));
                continue;
            }
            if !anchor.is_empty()
                && dest.extension().is_some_and(|x| x == "md")
                && !anchors(&read(&dest)).contains(&anchor.to_string())
            {
                broken.push(format!("{}:{n}: {target}: no such heading", p.display()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links that point nowhere:\n{}",
        broken.join("\n")
    );
}

/// A shell or Python block of `page`, with the HTML comments right above it.
struct Block {
    line: usize,
    marks: Vec<String>,
    text: String,
}

fn blocks(page: &str) -> Vec<Block> {
    let lines: Vec<&str> = page.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let fence = lines[i].trim_start();
        if let Some(info) = fence.strip_prefix("```") {
            let end = (i + 1..lines.len())
                .find(|&j| lines[j].trim_start().starts_with("```"))
                .unwrap_or(lines.len());
            if matches!(info.trim(), "sh" | "bash" | "python" | "console") {
                let marks = lines[..i]
                    .iter()
                    .rev()
                    .take_while(|l| l.starts_with("<!--"))
                    .map(|l| l.to_string())
                    .collect();
                out.push(Block {
                    line: i + 1,
                    marks,
                    text: lines[i + 1..end].join("\n"),
                });
            }
            i = end + 1;
            continue;
        }
        i += 1;
    }
    out
}

/// Whether the test `module::name` exists in tests/it, or in src for a unit test's path.
fn test_exists(path: &str) -> bool {
    let name = path.rsplit("::").next().unwrap_or(path);
    let module = path.split("::").next().unwrap_or(path);
    let file = root().join(format!("tests/it/{module}.rs"));
    std::fs::read_to_string(file).is_ok_and(|t| t.contains(&format!("fn {name}(")))
}

/// Every shell or Python block says whether a test runs it (`<!-- runs: TEST -->`, naming a
/// test that exists) or why none does (`<!-- shown: WHY -->`): a block meant to run cannot be
/// left unrun by accident.
#[test]
fn every_shell_block_says_which_test_runs_it() {
    let mut unmarked = Vec::new();
    for p in pages() {
        for b in blocks(&read(&p)) {
            let runs = b.marks.iter().find_map(|m| {
                m.strip_prefix("<!-- runs: ")
                    .and_then(|r| r.strip_suffix(" -->"))
            });
            let shown = b.marks.iter().any(|m| m.starts_with("<!-- shown: "));
            match runs {
                Some(test) if !test_exists(test) => unmarked.push(format!(
                    "{}:{}: names {test}, which is no test of tests/it",
                    p.display(),
                    b.line
                )),
                Some(_) => {}
                None if shown => {}
                None => unmarked.push(format!(
                    "{}:{}: neither `<!-- runs: TEST -->` nor `<!-- shown: WHY -->`",
                    p.display(),
                    b.line
                )),
            }
        }
    }
    assert!(unmarked.is_empty(), "{}", unmarked.join("\n"));
}

/// The blocks that name this test run as written, each in a fresh directory, with `worker`
/// on the PATH: every line must succeed.
#[test]
fn guide_blocks_run_as_written() {
    let bin_dir = Path::new(bin()).parent().expect("bin dir").to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut ran = 0;
    for p in pages() {
        for b in blocks(&read(&p)) {
            if !b
                .marks
                .iter()
                .any(|m| m == "<!-- runs: docs::guide_blocks_run_as_written -->")
            {
                continue;
            }
            ran += 1;
            let dir = TempDir::new("guide-block");
            for line in b.text.lines() {
                let cmd = line.split("  #").next().unwrap_or("").trim();
                if cmd.is_empty() || cmd.starts_with('#') {
                    continue;
                }
                let out = std::process::Command::new("sh")
                    .args(["-c", cmd])
                    .current_dir(dir.path())
                    .env("PATH", &path)
                    .env_remove("WORKER_DB")
                    .env_remove("WORKER_CONFIG")
                    .env_remove("WORKER_STORE")
                    .stdin(Stdio::null())
                    .output()
                    .expect("run a line");
                assert!(
                    out.status.success(),
                    "{}:{}: `{cmd}` failed:\n{}",
                    p.display(),
                    b.line,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
    assert!(ran > 0, "no block names this test");
}

/// The table the README shows under its first commands is what `worker demo` prints.
#[test]
fn the_readme_demo_prints_its_table() {
    let readme = read(&root().join("README.md"));
    let shown = readme
        .split("\n```\nscenario")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .map(|t| format!("scenario{t}"))
        .expect("the README shows the demo's table");
    let printed = ok(&TempDir::new("readme-demo").0, &["demo"]);
    let trim = |t: &str| -> Vec<String> {
        t.lines()
            .map(|l| l.trim_end().to_string())
            .filter(|l| !l.is_empty())
            .collect()
    };
    assert_eq!(trim(&printed), trim(&shown));
}
