//! Damage to the file (issue 9): every 4 KiB page of a small database overwritten in turn, and
//! a bit flipped inside every stored record. Every read verb either prints exactly what it
//! printed before the damage (a task it cannot read shows as `damaged`), or exits 1 with an
//! `error:` line; nothing panics, nothing prints wrong data, and `worker check` reports the
//! damage whenever a verb saw it. The writing verbs (enqueue, run) end done or in an error.

use crate::common;
use common::*;

use serde_json::Value;
use std::path::Path;

const VERBS: [&[&str]; 8] = [
    &["list", "--json", "--limit", "10000"],
    &["show", "t1", "--json"],
    &["show", "t2", "--json"],
    &["show", "t3", "--json"],
    &["trace", "t1", "--json"],
    &["events", "--json"],
    &["memory", "list", "--json"],
    &["reconcile"],
];

/// A small database: a finished task with writes, a suspended one, a held one; a note and
/// audit events. Returns each verb's output on the undamaged file.
fn make(d: &Path) -> Vec<String> {
    enqueue(d, &[]);
    enqueue(d, &["--model", "policy:ord_1004:8000"]);
    enqueue(d, &["--tool-latency", "issue_refund=40000"]);
    ok(
        d,
        &[
            "memory",
            "add",
            "--user",
            "cu_ana",
            "--source",
            "user_message",
            "--text",
            "Prefers email.",
        ],
    );
    ok(d, &["run", "--drain", "--max-in-flight", "1"]);
    VERBS.iter().map(|v| ok(d, v)).collect()
}

/// What a verb may print on a damaged file: exactly what it printed before, or (for `list`)
/// the same tasks with some shown as `damaged` instead, or (for `show`) the task with its
/// damaged call records marked as such.
fn same_or_marked(verb: &[&str], before: &str, after: &str) -> bool {
    if before == after {
        return true;
    }
    if verb[0] == "show" {
        // `show` marks a damaged part (its call records) in place and shows the rest.
        let (Ok(mut b), Ok(mut a)) = (
            serde_json::from_str::<Value>(before),
            serde_json::from_str::<Value>(after),
        ) else {
            return false;
        };
        let marked = a["calls"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("damaged"));
        b["calls"] = Value::Null;
        a["calls"] = Value::Null;
        return marked && a == b;
    }
    if verb[0] == "reconcile" {
        // A held write whose call record is damaged is listed, saying so.
        let (b, a): (Vec<&str>, Vec<&str>) = (before.lines().collect(), after.lines().collect());
        return b.len() == a.len()
            && b.iter().zip(&a).all(|(b, a)| {
                b == a || a.contains("its call record is unreadable (the database is damaged")
            });
    }
    if verb[0] != "list" {
        return false;
    }
    let (Ok(Value::Array(b)), Ok(Value::Array(a))) = (
        serde_json::from_str::<Value>(before),
        serde_json::from_str::<Value>(after),
    ) else {
        return false;
    };
    b.len() == a.len()
        && b.iter().all(|t| {
            a.iter()
                .any(|x| x == t || (x["id"] == t["id"] && x["status"] == "damaged"))
        })
}

/// Runs every read verb on a damaged copy; returns whether any of them saw the damage.
fn verbs_on(d: &Path, good: &[String], what: &str) -> bool {
    let mut saw = false;
    for (verb, before) in VERBS.iter().zip(good) {
        let out = worker(d, verb);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        for bad in ["panicked", "RUST_BACKTRACE", "stack backtrace"] {
            assert!(!stderr.contains(bad), "{what}, {verb:?}: {stderr}");
        }
        match out.status.code() {
            Some(0) => {
                assert!(
                    same_or_marked(verb, before, &stdout),
                    "{what}, {verb:?}: printed other data than before the damage:\n{stdout}\nbefore:\n{before}"
                );
                saw |= stdout.as_ref() != before;
            }
            Some(1) => {
                assert!(stderr.starts_with("error:"), "{what}, {verb:?}: {stderr}");
                saw = true;
            }
            other => panic!("{what}, {verb:?}: exit {other:?}: {stderr}"),
        }
    }
    saw
}

fn check_reports(d: &Path, what: &str) {
    let out = worker(d, &["check"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{what}: a verb saw damage that `worker check` did not report:\n{}{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn every_page_overwritten_in_turn() {
    let dir = TempDir::new("pages");
    let d = dir.path();
    let good = make(d);
    let pristine = std::fs::read(d.join("worker.redb")).expect("db");
    let pages = pristine.len() / 4096;
    assert!(pages >= 8, "{pages} pages");
    let case = TempDir::new("pages-case");
    let c = case.path();
    std::fs::copy(d.join("worker.store.redb"), c.join("worker.store.redb")).expect("store");
    let mut seen = 0;
    for page in 0..pages {
        let mut bytes = pristine.clone();
        bytes[page * 4096..(page + 1) * 4096].fill(0);
        std::fs::write(c.join("worker.redb"), &bytes).expect("write");
        let what = format!("page {page} of {pages} zeroed");
        if verbs_on(c, &good, &what) {
            seen += 1;
            std::fs::write(c.join("worker.redb"), &bytes).expect("write");
            check_reports(c, &what);
        }
        // The writing verbs too: done or an error, never a panic.
        std::fs::write(c.join("worker.redb"), &bytes).expect("write");
        for verb in [
            &["enqueue", "--model", "policy", "--user", "u", "--goal", "g"][..],
            &["run", "--drain"],
        ] {
            let out = worker(c, verb);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!stderr.contains("panicked"), "{what}, {verb:?}: {stderr}");
            match out.status.code() {
                Some(0) => {}
                Some(1) => assert!(stderr.contains("error:"), "{what}, {verb:?}: {stderr}"),
                other => panic!("{what}, {verb:?}: exit {other:?}: {stderr}"),
            }
        }
    }
    eprintln!("{pages} pages overwritten; {seen} of them damaged what a verb reads");
    assert!(seen > 0);
}

#[test]
fn a_bit_flipped_in_every_stored_record() {
    let dir = TempDir::new("flips");
    let d = dir.path();
    let good = make(d);
    let pristine = std::fs::read(d.join("worker.redb")).expect("db");
    let records = stored_records(&d.join("worker.redb"));
    assert!(records.len() >= 20, "{} records", records.len());
    let case = TempDir::new("flips-case");
    let c = case.path();
    std::fs::copy(d.join("worker.store.redb"), c.join("worker.store.redb")).expect("store");
    let mut flipped = 0;
    for (n, (table, value)) in records.iter().enumerate() {
        // Where the record lies in the file: redb is copy-on-write, so stale copies of it may
        // lie in freed pages too; the same bit is flipped in every copy.
        let at: Vec<usize> = pristine
            .windows(value.len())
            .enumerate()
            .filter(|(_, w)| *w == value.as_slice())
            .map(|(i, _)| i)
            .collect();
        if at.is_empty() {
            continue;
        }
        // A bit of the payload, of the checksum and of the header, in turn.
        for offset in [value.len() / 2, 5, 1] {
            let mut bytes = pristine.clone();
            for a in &at {
                bytes[a + offset] ^= 0x10;
            }
            std::fs::write(c.join("worker.redb"), &bytes).expect("write");
            let what = format!("record {n} ({table}), byte {offset} flipped");
            verbs_on(c, &good, &what);
            std::fs::write(c.join("worker.redb"), &bytes).expect("write");
            // Every flip is damage, whether or not a read verb reads that record.
            check_reports(c, &what);
            flipped += 1;
        }
    }
    eprintln!("{flipped} bit flips in {} records", records.len());
    assert!(flipped >= 60, "{flipped}");
}
