//! `worker store` (the demo shop: orders, ledger, arrivals) and `worker memory`.

use super::*;

pub(super) fn cmd_store(cli: &Cli, shop: &ShopArg, c: &StoreCommand) -> CliResult {
    let open = || open_tools(cli, shop);
    match c {
        StoreCommand::Orders { json } => {
            let orders = open()?.orders()?;
            if *json {
                print_json(&serde_json::to_value(&orders).unwrap_or(Value::Null))?;
            } else {
                outln!(
                    "{:16} {:10} {:>8} {:>8} status",
                    "order",
                    "customer",
                    "total",
                    "refunded"
                );
                for (id, o) in &orders {
                    outln!(
                        "{:16} {:10} {:>8} {:>8} {}",
                        id,
                        o.customer,
                        o.total,
                        o.refunded,
                        o.status
                    );
                }
            }
        }
        StoreCommand::AddOrder { orders, json } => {
            let parsed = parse_orders(orders)?;
            open()?.put_orders(&parsed)?;
            if *json {
                let ids: Vec<&str> = parsed.iter().map(|(id, _)| id.as_str()).collect();
                return print_json(&json!({"stored": ids}));
            }
            outln!("{} order(s) stored", parsed.len());
        }
        StoreCommand::Ledger { json } => {
            let ledger = open()?.ledger()?;
            if *json {
                print_json(&serde_json::to_value(&ledger).unwrap_or(Value::Null))?;
            } else {
                for e in &ledger {
                    outln!("{:6} {:24} {}", e.seq, e.key, e.effect.to_python());
                }
            }
        }
        StoreCommand::Arrivals { json } => {
            let arrivals = open()?.arrivals()?;
            if *json {
                print_json(&serde_json::to_value(&arrivals).unwrap_or(Value::Null))?;
            } else {
                for a in &arrivals {
                    outln!(
                        "{:6} {:24} {:18} {} {}",
                        a.seq,
                        a.key,
                        a.tool,
                        a.digest,
                        a.outcome
                    );
                }
            }
        }
    }
    Ok(())
}

/// `--order ID:CUSTOMER:TOTAL_CENTS` values as the orders they describe.
fn parse_orders(orders: &[String]) -> Result<Vec<(String, Order)>, CliError> {
    let mut parsed = Vec::new();
    for o in orders {
        let parts: Vec<&str> = o.split(':').collect();
        let [id, customer, total] = parts.as_slice() else {
            return Err(CliError::usage(format!(
                "--order {o:?}: expected ID:CUSTOMER:TOTAL_CENTS"
            )));
        };
        let total: i64 = total.parse().ok().filter(|t| *t > 0).ok_or_else(|| {
            CliError::usage(format!(
                "--order {o:?}: total must be a positive whole number of cents"
            ))
        })?;
        if id.is_empty() || customer.is_empty() || id.contains('/') {
            return Err(CliError::usage(format!(
                "--order {o:?}: id and customer must be non-empty (and the id without '/')"
            )));
        }
        parsed.push((
            id.to_string(),
            Order {
                customer: customer.to_string(),
                total,
                refunded: 0,
                status: "delivered".into(),
            },
        ));
    }
    Ok(parsed)
}

pub(super) fn cmd_memory(cli: &Cli, c: &MemoryCommand) -> CliResult {
    match c {
        MemoryCommand::Add {
            user,
            text,
            source,
            ttl_days,
            by,
            json,
        } => {
            if user.trim().is_empty() {
                return Err(CliError::usage("--user must not be empty"));
            }
            decision(by, &None)?;
            let asked = crate::local::Decide::Note {
                user: user.clone(),
                text: text.clone(),
                source: source.clone(),
                ttl_s: ttl_days.saturating_mul(86_400),
                by: by.clone(),
            };
            let note: crate::kernel::memory::Note =
                operator_write(cli, &asked, Access::Create, None)?;
            if *json {
                return print_json(&serde_json::to_value(&note).unwrap_or(Value::Null));
            }
            outln!(
                "stored for {} until {}",
                note.user,
                crate::clock::rfc3339(note.expires_at_s.saturating_mul(1000))
            );
        }
        MemoryCommand::List {
            user,
            all,
            json: as_json,
        } => {
            let notes = open_reader(cli)?.notes(user.as_deref(), now_ms(), *all)?;
            if *as_json {
                print_json(&serde_json::to_value(&notes).unwrap_or(Value::Null))?;
            } else {
                for n in &notes {
                    outln!(
                        "{:10} {:16} expires {:>10}  {}",
                        n.user,
                        n.source,
                        n.expires_at_s,
                        crate::limits::one_line(&n.text)
                    );
                }
            }
        }
        MemoryCommand::Forget {
            user,
            source,
            by,
            json,
        } => {
            decision(by, &None)?;
            let asked = crate::local::Decide::Forget {
                user: user.clone(),
                source: source.clone(),
                by: by.clone(),
            };
            let n: usize = operator_write(cli, &asked, Access::Write, None)?;
            if *json {
                return print_json(&json!({"user": user, "deleted": n}));
            }
            outln!("{n} note(s) deleted");
        }
    }
    Ok(())
}

pub(super) fn cmd_check(cli: &Cli, a: &ShopJsonArgs) -> CliResult {
    let mut damaged = Vec::new();
    let mut records = BTreeMap::new();
    // redb's own integrity check first: it needs the file to itself.
    let file = !store::pg::is_url(&cli.db);
    if file && let Err(e) = redb_integrity(Path::new(&cli.db))? {
        damaged.push(e);
    }
    match store::open_backend(&cli.db, Access::Write, 2) {
        Ok(store) => {
            let rep = store.check()?;
            damaged.extend(rep.damaged);
            for (k, v) in rep.records {
                records.insert(k.to_string(), v);
            }
        }
        // Not there, or not a worker database at all: nothing to check. A file its daemon
        // writes alone is not damaged: it is in use.
        Err(e @ (store::Error::Missing(_) | store::Error::Io { .. } | store::Error::InUse(_))) => {
            return Err(e.into());
        }
        Err(e) => damaged.push(e.to_string()),
    }
    let sp = store_target(cli, &a.shop);
    if store::pg::is_url(&sp) || Path::new(&sp).exists() {
        match DurableStore::open_target(&sp) {
            Ok(ds) => match ds.check() {
                Ok((n, bad)) => {
                    records.insert("store record".to_string(), n);
                    damaged.extend(bad);
                }
                Err(e) => damaged.push(format!("{}: {e}", ds.path.display())),
            },
            Err(e) => damaged.push(format!("{sp}: {e}")),
        }
    }
    if a.json {
        print_json(&json!({"ok": damaged.is_empty(), "records": records, "damaged": damaged}))?;
    } else {
        let total: u64 = records.values().sum();
        for d in &damaged {
            outln!("damaged  {}", crate::limits::printable(d));
        }
        if damaged.is_empty() {
            outln!("ok: {total} records checked, nothing damaged");
        } else {
            outln!("{} damaged; {total} records read", damaged.len());
        }
    }
    if damaged.is_empty() {
        Ok(())
    } else {
        Err(
            CliError::op(format!("{} damaged record(s) or table(s)", damaged.len()))
                .hint("restore the file from a backup; quarantined tasks are listed and never run"),
        )
    }
}

/// redb's check of its pages and trees, on a handle of our own.
fn redb_integrity(path: &Path) -> Result<Result<(), String>, CliError> {
    if !path.exists() {
        return Ok(Ok(()));
    }
    let p = path.to_path_buf();
    let r = std::panic::catch_unwind(move || -> Result<bool, redb::Error> {
        let mut db = redb::Builder::new()
            .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
            .open(&p)?;
        Ok(db.check_integrity()?)
    });
    Ok(match r {
        Ok(Ok(true)) => Ok(()),
        Ok(Ok(false)) => Err(format!(
            "{}: the storage engine found damage in its pages and repaired what it could",
            path.display()
        )),
        // A daemon that is the file's only writer: in use, not damaged.
        Ok(Err(redb::Error::DatabaseAlreadyOpen)) => {
            return Err(store::Error::InUse(path.to_path_buf()).into());
        }
        Ok(Err(e)) => Err(format!("{}: {e}", path.display())),
        Err(_) => Err(format!(
            "{}: the storage engine stopped on an inconsistency in its pages",
            path.display()
        )),
    })
}

pub(super) fn cmd_purge(cli: &Cli, a: &PurgeArgs) -> CliResult {
    let d = decision(&a.by, &a.reason)?;
    let asked = crate::local::Decide::Purge {
        before_ms: d.now_ms.saturating_sub(a.finished_before),
        batch: a.batch as usize,
        by: d.by,
        reason: d.reason,
    };
    let ids: Vec<String> = operator_write(cli, &asked, Access::Write, None)?;
    if a.json {
        print_json(&json!({"purged": ids.len(), "ids": ids}))?;
    } else {
        outln!("purged {} finished task(s)", ids.len());
    }
    Ok(())
}

/// The tools as a table, one line each.
fn print_tools_table(rows: &[Value]) -> CliResult {
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    let width = |k: &str, least: usize| {
        rows.iter()
            .map(|r| text(&r[k]).chars().count())
            .max()
            .unwrap_or(0)
            .max(least)
    };
    let (sw, nw, aw) = (width("source", 6), width("name", 4), width("approval", 8));
    outln!(
        "{:sw$} {:nw$} {:6} {:10} {:aw$} {:28} description",
        "source",
        "tool",
        "access",
        "idempotent",
        "approval",
        "retry"
    );
    for r in rows {
        let retry = match r.get("retry") {
            Some(p) => format!(
                "{} tries, {}-{} ms",
                p["attempts"], p["backoff_ms"], p["max_backoff_ms"]
            ),
            None => "-".into(),
        };
        // A server's text: one line, no control characters, in the table.
        let description: String = text(&r["description"])
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .take(60)
            .collect();
        outln!(
            "{:sw$} {:nw$} {:6} {:10} {:aw$} {:28} {description}",
            text(&r["source"]),
            text(&r["name"]),
            text(&r["access"]),
            text(&r["idempotent"]),
            text(&r["approval"]),
            retry
        );
    }
    Ok(())
}

pub(super) fn cmd_tools(cli: &Cli, c: &ToolsCommand) -> CliResult {
    let ToolsCommand::List { timeout_ms, json } = c;
    let cfg = super::enqueue::load_config(cli)?.unwrap_or_default();
    // The demo shop's tools (with the config's rules for them), the catalog's HTTP tools,
    // and each MCP server's, as the worker resolves them.
    let mut rows: Vec<Value> = Vec::new();
    let row = |source: &str, t: &crate::kernel::ToolSpec| {
        let mut v = json!({
            "source": source,
            "name": t.name,
            "description": t.description,
            "access": if t.access == crate::kernel::catalog::Access::Read { "read" } else { "write" },
            "idempotent": t.idempotent,
            "approval": Value::from(t.approval.clone()),
            "requires": Value::from(t.requires.clone()),
        });
        if t.asks_person {
            // The built-in question: answered by a person, never sent anywhere.
            v["source"] = json!("person");
        }
        if let Some(h) = &t.http {
            v["url"] = json!(h.url);
            if let Some(api) = &h.api {
                // A tool from an OpenAPI document: its operation's method and path.
                v["source"] = json!("openapi");
                v["url"] = json!(format!("{} {}{}", h.method, h.url, api.path));
                v["operation"] = json!(api.operation);
                v["schema"] = api.schema.clone();
            }
            v["lookup_url"] = json!(h.lookup_url);
            v["auto_settle"] = json!(h.auto_settle && h.lookup_url.is_some());
            v["retry"] = serde_json::to_value(h.retry).unwrap_or(Value::Null);
        }
        v
    };
    // The demo shop's tools serve the demo models: listed when the config names no tools of
    // its own (or sets rules for the demo's), not beside a user's catalog.
    let demo = (cfg.catalog.is_none() && cfg.mcp.servers.is_empty()) || !cfg.demo.tools.is_empty();
    if demo {
        for t in &cfg.demo_catalog().tools {
            rows.push(row("demo", t));
        }
    }
    for t in cfg.catalog.iter().flat_map(|c| c.tools.iter()) {
        rows.push(row("http", t));
    }
    // A server that cannot be reached fails the verb, after the tools that could be listed.
    let mut failed = None;
    if !cfg.mcp.servers.is_empty() {
        let mcp = crate::mcp::Mcp::new(cfg.mcp.clone()).map_err(CliError::usage)?;
        let tools = crate::mcp::discover(&mcp, std::time::Duration::from_millis(*timeout_ms))
            .unwrap_or_else(|e| {
                failed = Some(CliError::op(e));
                Vec::new()
            });
        for t in &tools {
            let mut v = serde_json::to_value(t).unwrap_or(Value::Null);
            v["source"] = json!(format!("mcp:{}", t.server));
            v["approval"] = match &t.rule {
                Some(r) => Value::from(r.clone()),
                None => serde_json::to_value(t.approval).unwrap_or(Value::Null),
            };
            rows.push(v);
        }
    }
    if *json {
        print_json(&Value::Array(rows))?;
        return failed.map_or(Ok(()), Err);
    }
    print_tools_table(&rows)?;
    failed.map_or(Ok(()), Err)
}
