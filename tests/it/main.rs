//! The integration tests, as one test binary (the layout ripgrep uses): each module is what
//! was a `tests/*.rs` file; `common` holds the helpers they share (the binary run in a
//! temporary directory, the PostgreSQL cluster, the demo shop as a service, the MCP and
//! WebDriver peers). One binary links the crate once instead of once per file.

#[macro_use]
mod common;

mod api; // the HTTP API against Schemathesis, a generated client and its own rules (roles, users=, keys, long polls)
mod bad_input; // 369 hostile inputs: each an exit code (or status) and an error naming it, never a panic
pub(crate) mod callbacks; // completion callbacks verified by `standardwebhooks` through kills and a receiver that was down
mod cli; // the binary's verbs in temp dirs: exit codes, damaged and newer files, allocators
mod console; // the console driven by headless chromium; forged and stale forms refused
mod conversations; // a finished task continued with follow-up messages: three turns on the same state, from the CLI, the console and the API, on both providers
mod corruption; // every page zeroed and every record's bit flipped: verbs report, never panic
mod crash_recovery; // daemons killed 32 times beside enqueuers: nothing lost, nothing sent twice
mod daemon; // graceful shutdown, a daemon paused past its lease never commits
mod docs; // the docs hold to the code: the README a front door, links, shell blocks run or say why not
pub(crate) mod exactly_once; // one regression test per exactly-once defect found in review, read off the arrivals log
mod executor; // 500 tasks of a profile waiting at once on a newcomer's daemon; wake-ups, not polls, start tasks
mod figures; // the design document's tables, byte for byte
mod flow; // delayed starts, concurrency keys, time limits
mod http; // the demo shop over HTTP with writes in flight, redirects, approvals, the edge's limits
mod http_client; // model requests over TLS with the machine's roots and through a proxy's CONNECT tunnel
mod in_flight; // a write in flight when its daemon died stays held whatever ends its task
mod kernel; // the kernel's own scenarios and edge cases
mod kernel_purity; // the kernel names only an allow-list of paths
mod layout; // layer order, no import circle, file and function lengths, module docs
mod list; // pages, cursors, filters, RFC 3339 times, `key:KEY`
mod local_api; // the daemon's socket: requests sent once, SIGSTOP and SIGKILL, sole writers
mod mcp; // the MCP client against server-everything and the Python SDK server
mod mcp_tasks; // tasks calling MCP tools: approvals, lost answers, changed definitions, kills
pub(crate) mod metrics; // `promtool check metrics` and every figure against the database
pub(crate) mod models; // real-model adapters against fakes built from the SDKs' types; the README's agent as written
mod openapi_tools; // tools from the OpenAPI document of a FastAPI service, on both providers
mod operator; // operators' decisions on both engines: bound to the reviewed call, audited, racing
mod otlp; // live export to a receiver decoding with the official protobuf schema
mod paused; // a daemon paused inside a write's slow part never sends after a takeover
mod postgres; // migrations, newer databases, NOTIFY wake-ups, TLS sslmodes
mod progress; // what counts as progress
mod property; // 10,000 random scripts under random budgets: bounds hold, every run ends
mod questions; // a model asks a person: answered by `worker answer`, the API, the console (a real browser too) or left to run out, through a kill, on both providers
mod rate_limits; // three daemons under one shared rate limit against a fake provider
mod record_format; // files of earlier formats read, migrated and replayed
mod rest_tools; // HTTP tools served as plain REST APIs answer: retries, holds, refusals, approval rules
mod schedules; // each tick one task under kills, DST, reserved keys
mod settle; // the daemon settling held writes by their lookups
mod several_hosts; // three hosts on PostgreSQL, killed, cut off, the server restarted
mod simulation; // 2,000 seeded schedules of workers, crashes, pauses and operators, invariants after every step
mod stops; // every stop reason explained in plain words: show, the closing message, postmortem
mod stream; // a task's events over SSE (httpx-sse reconnecting through a kill and an approval) and `worker watch`
mod wait; // `worker wait` and its exit codes, waiters woken not polling
