//! Benchmark of agents that wait: thousands of tasks in flight on one daemon, each spending
//! nearly all its time waiting on a model provider and a tool, measured through the release
//! binary (`worker run --drain`) against a fake OpenAI-compatible provider in this process.
//!
//! The provider (tokio, a task per connection, no thread per request) answers each model
//! request after a fixed delay: a plan, then a `get_order` call, then a final answer (three
//! model calls), and serves the REST tool `get_order` after its own delay. A task's ideal wall
//! time is one task's waits (three model delays and one tool delay): every task waiting at
//! once. For each workload the bench prints the wall time against that ideal, the daemon's
//! peak RSS and CPU time (from `wait4`), for this executor (`worker run`, its defaults) and,
//! in the same run, for the thread executor of the commit before it (`--workers 1024`, the
//! most it allowed), built once into `target/old-executor/` (or named by
//! `TETHER_OLD_WORKER=PATH`; `TETHER_OLD_WORKER=skip` leaves it out).
//!
//! Run with `cargo bench --bench inflight` (`TETHER_INFLIGHT=small` or `large` runs one of the
//! two workloads; `TETHER_INFLIGHT_FLAGS="--max-in-flight 1000"` adds flags to this executor's
//! daemon). Targets: 1,000 tasks within 1.1x of the ideal; 10,000 within 1.25x and under
//! 512 MB.

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The commit whose daemon gave every task in flight a thread of its own.
const OLD_COMMIT: &str = "6bcf0fc";

struct Workload {
    tasks: usize,
    model_ms: u64,
    tool_ms: u64,
    target: f64,
}

impl Workload {
    fn ideal(&self) -> Duration {
        Duration::from_millis(3 * self.model_ms + self.tool_ms)
    }
}

/// What one daemon's run measured.
struct Run {
    wall: Duration,
    rss_mb: f64,
    cpu: Duration,
}

fn main() {
    raise_open_files();
    let provider = Provider::start();
    let workloads = [
        Workload {
            tasks: 1_000,
            model_ms: 2_000,
            tool_ms: 200,
            target: 1.1,
        },
        Workload {
            tasks: 10_000,
            model_ms: 10_000,
            tool_ms: 1_000,
            target: 1.25,
        },
    ];
    let only = std::env::var("TETHER_INFLIGHT").unwrap_or_default();
    let flags = std::env::var("TETHER_INFLIGHT_FLAGS").unwrap_or_default();
    let flags: Vec<&str> = flags.split_whitespace().collect();
    let old = old_worker();
    let chosen = workloads
        .iter()
        .enumerate()
        .filter(|(i, _)| match only.as_str() {
            "small" => *i == 0,
            "large" => *i == 1,
            _ => true,
        });
    for (_, w) in chosen {
        println!(
            "{} tasks, each 3 model calls of {} ms and 1 tool call of {} ms (ideal: {:.1} s)",
            w.tasks,
            w.model_ms,
            w.tool_ms,
            w.ideal().as_secs_f64()
        );
        let new = run(env!("CARGO_BIN_EXE_worker"), w, &provider, &flags);
        report("  this executor (worker run)      ", w, &new);
        println!(
            "    target {:.2}x: {}",
            w.target,
            if ratio(w, &new) <= w.target {
                "met"
            } else {
                "missed"
            }
        );
        if let Some(old) = &old {
            let was = run(old, w, &provider, &["--workers", "1024"]);
            report("  threads (--workers 1024, before)", w, &was);
            println!(
                "    this executor: {:.1}x the threads' speed, {:.2}x their peak RSS, {:.2}x their CPU time",
                was.wall.as_secs_f64() / new.wall.as_secs_f64(),
                new.rss_mb / was.rss_mb,
                new.cpu.as_secs_f64() / was.cpu.as_secs_f64()
            );
        }
    }
}

fn ratio(w: &Workload, r: &Run) -> f64 {
    r.wall.as_secs_f64() / w.ideal().as_secs_f64()
}

fn report(name: &str, w: &Workload, r: &Run) {
    println!(
        "{name}: {:.1} s, {:.2}x the ideal; peak RSS {:.0} MB; CPU {:.1} s",
        r.wall.as_secs_f64(),
        ratio(w, r),
        r.rss_mb,
        r.cpu.as_secs_f64()
    );
}

/// Enqueues the workload's tasks in a fresh directory, then times `worker run --drain` (with
/// `flags`) until every task ended, and checks each ended done.
// The daemon is reaped by wait4, for its resource usage, not by Child::wait.
#[allow(clippy::zombie_processes)]
fn run(bin: impl AsRef<Path>, w: &Workload, provider: &Provider, flags: &[&str]) -> Run {
    let bin = bin.as_ref();
    let dir = std::env::temp_dir().join(format!("tether-inflight-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    let base = format!("http://{}", provider.addr);
    std::fs::write(
        dir.join("worker.toml"),
        format!(
            "[models.agent]\nkind = \"openai\"\nbase_url = \"{base}/m{}/v1\"\nmodel = \"gpt-4o\"\n\
             \n[tools]\ncatalog = \"tools.toml\"\n",
            w.model_ms
        ),
    )
    .expect("config");
    std::fs::write(
        dir.join("tools.toml"),
        format!(
            "version = 1\n\n[[tools]]\nname = \"get_order\"\ndescription = \"Read an order.\"\n\
             access = \"read\"\nidempotent = true\nfact_fields = [\"order_status\"]\n\
             fact_prefix_arg = \"order_id\"\n\
             http = {{ url = \"{base}/t{}/tools/get_order\", timeout_ms = 60000 }}\n\
             args.order_id = {{ type = \"string\", required = true, max_len = 64 }}\n",
            w.tool_ms
        ),
    )
    .expect("catalog");
    let lines: Vec<String> = (0..w.tasks)
        .map(|i| {
            json!({"user": format!("cu_{i}"), "goal": format!("check order {i}"), "model": "agent"})
                .to_string()
        })
        .collect();
    std::fs::write(dir.join("batch.jsonl"), lines.join("\n")).expect("batch");
    let worker = |args: &[&str]| {
        let mut c = Command::new(bin);
        c.current_dir(&dir)
            .env_remove("WORKER_DB")
            .env("WORKER_CONFIG", "worker.toml")
            .args(args);
        c
    };
    let out = worker(&["enqueue", "--file", "batch.jsonl"])
        .output()
        .expect("enqueue");
    assert!(
        out.status.success(),
        "enqueue: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let before = provider.requests.load(Ordering::Relaxed);
    let log = std::fs::File::create(dir.join("daemon.log")).expect("log");
    let t = Instant::now();
    let child = worker(&[&["run", "--drain"], flags].concat())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start the daemon");
    let (status, usage) = wait4(child.id());
    let wall = t.elapsed();
    assert!(
        status == 0,
        "the daemon exited {status}: {}",
        std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default()
    );
    let answered = provider.requests.load(Ordering::Relaxed) - before;
    assert_eq!(
        answered,
        4 * w.tasks as u64,
        "three model requests and one tool request per task"
    );
    let out = worker(&["list", "--stop", "done", "--json", "--limit", "10000"])
        .output()
        .expect("list");
    let done: Value = serde_json::from_slice(&out.stdout).expect("a JSON list");
    assert_eq!(
        done.as_array().map(Vec::len),
        Some(w.tasks),
        "every task ended done"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Run {
        wall,
        rss_mb: usage.ru_maxrss as f64 / 1024.0,
        cpu: tv(usage.ru_utime) + tv(usage.ru_stime),
    }
}

fn tv(t: libc::timeval) -> Duration {
    Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
}

/// Waits for the child `pid`: its exit status and its resource usage.
fn wait4(pid: u32) -> (i32, libc::rusage) {
    let mut status = 0;
    // SAFETY: rusage is plain data, zero is a valid value, and wait4 writes it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: pid is our child; both pointers are to live locals.
    let r = unsafe { libc::wait4(pid as i32, &mut status, 0, &mut usage) };
    assert_eq!(r, pid as i32, "wait4: {}", std::io::Error::last_os_error());
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    (code, usage)
}

/// Thousands of connections, to the provider and from the daemon.
fn raise_open_files() {
    // SAFETY: getrlimit/setrlimit with a pointer to a live local.
    unsafe {
        let mut l: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// The daemon of the commit before this executor, built once (a release build without LTO,
/// which costs it nothing on a workload that waits).
fn old_worker() -> Option<PathBuf> {
    match std::env::var("TETHER_OLD_WORKER") {
        Ok(v) if v == "skip" => return None,
        Ok(v) => return Some(PathBuf::from(v)),
        Err(_) => {}
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tree = root.join("target/old-executor/src");
    let bin = root.join("target/old-executor/target/release/worker");
    if bin.exists() {
        return Some(bin);
    }
    println!("building the thread executor of {OLD_COMMIT} into target/old-executor/ (once)");
    if !tree.exists() {
        let ok = Command::new("git")
            .current_dir(root)
            .args(["worktree", "add", "--detach"])
            .arg(&tree)
            .arg(OLD_COMMIT)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            println!("  cannot check out {OLD_COMMIT}: the old executor is left out");
            return None;
        }
    }
    let ok = Command::new("cargo")
        .current_dir(&tree)
        .args(["build", "--release", "--bin", "worker", "--target-dir"])
        .arg(root.join("target/old-executor/target"))
        .env("CARGO_PROFILE_RELEASE_LTO", "false")
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        println!("  the build failed: the old executor is left out");
        return None;
    }
    Some(bin)
}

/// The fake provider and tool service: `/m{MS}/v1/chat/completions` answers after MS
/// milliseconds, by how far the conversation got (a plan, a tool call, a final answer);
/// `/t{MS}/tools/get_order` answers an order after MS milliseconds.
struct Provider {
    addr: std::net::SocketAddr,
    requests: Arc<AtomicU64>,
}

impl Provider {
    fn start() -> Provider {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        let _guard = runtime.enter();
        socket
            .bind("127.0.0.1:0".parse().expect("an address"))
            .expect("bind");
        let listener = socket.listen(8192).expect("listen");
        let addr = listener.local_addr().expect("its address");
        let requests = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&requests);
        runtime.spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    continue;
                };
                let counted = Arc::clone(&counted);
                tokio::spawn(async move {
                    let _ = serve(conn, &counted).await;
                });
            }
        });
        // The runtime lives as long as the bench.
        std::mem::forget(runtime);
        Provider { addr, requests }
    }
}

/// One connection: requests one after another (keep-alive), each answered after its delay.
async fn serve(mut conn: tokio::net::TcpStream, counted: &AtomicU64) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(8192);
    loop {
        let (path, body) = loop {
            if let Some(done) = parse(&buf) {
                let (path, head, length) = done;
                if buf.len() >= head + length {
                    let body = buf[head..head + length].to_vec();
                    buf.drain(..head + length);
                    break (path, body);
                }
            }
            let mut chunk = [0u8; 16384];
            let n = conn.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let (ms, reply) = answer(&path, &body);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        counted.fetch_add(1, Ordering::Relaxed);
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            reply.len()
        );
        conn.write_all(head.as_bytes()).await?;
        conn.write_all(reply.as_bytes()).await?;
    }
}

/// A complete request head in `buf`: its path, its length and the body's content-length.
fn parse(buf: &[u8]) -> Option<(String, usize, usize)> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let httparse::Status::Complete(head) = req.parse(buf).ok()? else {
        return None;
    };
    let length = req
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse().ok())
        .unwrap_or(0);
    Some((req.path?.to_string(), head, length))
}

/// The delay and the answer for a request to `path`.
fn answer(path: &str, body: &[u8]) -> (u64, String) {
    let ms = path
        .get(2..)
        .and_then(|p| p.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    if path.contains("/tools/") {
        let order = json!({"order_status": "delivered", "total_cents": 5000, "refunded_cents": 0});
        return (ms, order.to_string());
    }
    // The turn, from the conversation the daemon sends (the task's last turn and its state):
    // none yet, the plan just accepted, or the tool's result.
    let text = String::from_utf8_lossy(body);
    let turn = if !text.contains("\"role\":\"assistant\"") {
        0
    } else if text.contains("plan_accepted") {
        1
    } else {
        2
    };
    let (name, args) = match turn {
        0 => (
            "propose_plan",
            json!({"steps": [{"id": "s1", "tool": "get_order", "depends_on": []}]}),
        ),
        1 => (
            "get_order",
            json!({"order_id": "ord_1001", "plan_step": "s1"}),
        ),
        _ => (
            "final_answer",
            json!({"outcome": "completed", "text": "The order was delivered."}),
        ),
    };
    let reply = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "gpt-4o",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": null,
            "tool_calls": [{"id": format!("call_{turn}"), "type": "function",
                "function": {"name": name, "arguments": args.to_string()}}]}}],
        "usage": {"prompt_tokens": 400, "completion_tokens": 30, "total_tokens": 430}
    });
    (ms, reply.to_string())
}
