//! The config's tests: the reference page lists every key the parser reads, stored models run
//! only as the config names them, and the rest of loading a config.

use super::*;
use crate::model::profile::real_model_budget;

/// Each table of the config and catalog files with the keys its parser reads.
fn parsed_tables() -> Vec<(&'static str, Vec<&'static str>)> {
    use crate::testing::fields_of;
    let without = |fields: Vec<&'static str>, skip: &[&str]| -> Vec<&'static str> {
        fields.into_iter().filter(|x| !skip.contains(x)).collect()
    };
    vec![
        ("Top level", fields_of::<ConfigFile>()),
        (
            "`[models.NAME]`",
            fields_of::<crate::model::profile::ProfileEntry>(),
        ),
        (
            "`[models.NAME.budget]`",
            fields_of::<crate::kernel::Budget>(),
        ),
        (
            "`[models.NAME.rate_limit]`",
            fields_of::<crate::model::profile::RateLimitEntry>(),
        ),
        ("`[tools]`", fields_of::<ToolsEntry>()),
        ("`[mcp]`", fields_of::<crate::mcp::McpConfig>()),
        (
            "`[mcp.servers.NAME]`",
            fields_of::<crate::mcp::config::ServerConfig>(),
        ),
        (
            "`[mcp.servers.NAME.tools.TOOL]`",
            fields_of::<crate::mcp::config::ToolOverride>(),
        ),
        ("`[demo]`", fields_of::<DemoConfig>()),
        ("`[demo.tools.NAME]`", fields_of::<DemoTool>()),
        ("`[callbacks]`", fields_of::<callbacks::CallbacksEntry>()),
        ("Top level (catalog)", fields_of::<catalog::CatalogFile>()),
        // `mcp` is a task's snapshot of an MCP tool, `asks_person` the mark of the built-in
        // question: a catalog file naming either is refused.
        (
            "`[[tools]]`",
            without(
                fields_of::<crate::kernel::ToolSpec>(),
                &["mcp", "asks_person"],
            ),
        ),
        (
            "`[ask_person]`",
            fields_of::<crate::kernel::person::AskPerson>(),
        ),
        // `api` is written by an `[[openapi]]` source: a catalog file naming it is refused.
        (
            "`http`",
            without(fields_of::<crate::kernel::catalog::HttpSpec>(), &["api"]),
        ),
        ("`[[openapi]]`", fields_of::<openapi::Source>()),
        ("`[openapi.tools.NAME]`", fields_of::<openapi::Overrides>()),
        (
            "`http.retry`",
            fields_of::<crate::kernel::catalog::RetryPolicy>(),
        ),
        (
            "`args.NAME`",
            fields_of::<crate::kernel::catalog::ArgSpec>(),
        ),
    ]
}

/// `docs/reference/config.md` lists, under each table's heading, exactly the keys the
/// parser reads there (the field names serde derives), and no table the parser lacks.
#[test]
fn the_reference_lists_every_key_the_parser_reads() {
    use crate::testing::{code_names, page, tables};
    let parsed = parsed_tables();
    let doc = page("docs/reference/config.md");
    let documented: Vec<(String, Vec<String>)> = tables(&doc)
        .into_iter()
        .filter(|(_, rows)| !rows.is_empty())
        .map(|(h, rows)| {
            let mut keys: Vec<String> = rows.iter().flat_map(|r| code_names(&r[0])).collect();
            keys.sort_unstable();
            (h, keys)
        })
        .collect();
    for (heading, fields) in &parsed {
        let (_, keys) = documented
            .iter()
            .find(|(h, _)| h == heading)
            .unwrap_or_else(|| panic!("config.md has no table under {heading}"));
        assert_eq!(keys, fields, "the keys under {heading}");
    }
    for (heading, _) in &documented {
        assert!(
            parsed.iter().any(|(h, _)| h == heading),
            "config.md has a table under {heading}, which the test does not know: add its keys' type here"
        );
    }
}

#[test]
fn a_stored_model_runs_only_as_this_config_names_it() {
    let cfg = parse(
        "[models.openai]\nkind = \"openai\"\nbase_url = \"https://api.openai.com/v1\"\nmodel = \"gpt-4o-mini\"\napi_key_env = \"OPENAI_API_KEY\"\ntemperature = 0.0\n",
        Path::new("worker.toml"),
    )
    .expect("config");
    let mine = RunModel::Http {
        name: "openai".into(),
        profile: Box::new(cfg.models["openai"].clone()),
    };
    let named = ModelProfile::Profile {
        name: "openai".into(),
    };
    assert_eq!(cfg.model_for(&named), Ok(mine.clone()));
    let other = ModelProfile::Profile {
        name: "exfil".into(),
    };
    assert!(
        cfg.model_for(&other)
            .unwrap_err()
            .contains("no model profile \"exfil\"")
    );
    // A whole profile stored by an older version: only one this config has too.
    let legacy = ModelProfile::OpenAi {
        base_url: "https://api.openai.com/v1".into(),
        model: "gpt-4o-mini".into(),
        api_key_env: Some("OPENAI_API_KEY".into()),
        max_retries: 3,
        temperature: 0.0,
    };
    assert_eq!(cfg.model_for(&legacy), Ok(mine));
    let elsewhere = ModelProfile::OpenAi {
        base_url: "http://attacker.example/v1".into(),
        model: "gpt-4o-mini".into(),
        api_key_env: Some("PGPASSWORD".into()),
        max_retries: 3,
        temperature: 0.0,
    };
    let e = cfg.model_for(&elsewhere).unwrap_err();
    assert!(e.contains("http://attacker.example/v1"), "{e}");
    assert_eq!(
        Config::default().model_for(&ModelProfile::policy()),
        Ok(RunModel::Scripted(ModelProfile::policy()))
    );
}

#[test]
fn a_profile_takes_its_options_and_refuses_wrong_ones() {
    let dir = std::env::temp_dir();
    let cfg = parse(
        "default_model = \"claude\"\n[models.claude]\nkind = \"anthropic\"\nbase_url = \"https://api.anthropic.com/v1/\"\nmodel = \"claude-sonnet-4-5\"\ninstructions = \"Be brief.\"\n[models.claude.budget]\nsteps_max = 40\ndeadline_ms = \"900000\"\n",
        &dir.join("worker.toml"),
    )
    .expect("config");
    let p = &cfg.models["claude"];
    assert_eq!(cfg.default_model.as_deref(), Some("claude"));
    assert_eq!(p.api, Api::Anthropic);
    assert_eq!(p.base_url, "https://api.anthropic.com/v1");
    assert_eq!(p.temperature, None);
    assert_eq!(p.instructions.as_deref(), Some("Be brief."));
    assert_eq!(p.budget.steps_max, 40);
    assert_eq!(p.budget.deadline_ms, 900_000);
    assert_eq!(p.budget.tokens_max, real_model_budget().tokens_max);
    for (text, wanted) in [
        (
            "default_model = \"x\"\n",
            "default_model \"x\" is not a profile",
        ),
        (
            "[models.a]\nkind = \"gemini\"\nbase_url = \"http://h/v1\"\nmodel = \"m\"\n",
            "kind \"gemini\" is not supported",
        ),
        (
            "[models.a]\nkind = \"openai\"\nbase_url = \"http://h/v1\"\nmodel = \"m\"\n[models.a.budget]\nsteps = 3\n",
            "unknown budget \"steps\"",
        ),
        (
            "[models.a]\nkind = \"openai\"\nbase_url = \"http://h/v1\"\nmodel = \"m\"\ninstructions = \"a\"\ninstructions_file = \"b\"\n",
            "not both",
        ),
        (
            "[models.a]\nkind = \"openai\"\nbase_url = \"http://h/v1\"\nmodel = \"m\"\ntool_calling = \"xml\"\n",
            "tool_calling",
        ),
        (
            "[models.a]\nkind = \"openai\"\nbase_url = \"http://h/v1\"\nmodel = \"m\"\napi_key_env = \"$KEY\"\n",
            "name of an environment variable",
        ),
    ] {
        let e = parse(text, &dir.join("worker.toml")).unwrap_err();
        assert!(e.contains(wanted), "{text}: {e}");
    }
}

/// The question to a person follows the daemon's catalog: worded by it, and not asked (the
/// call is answered as unavailable) when the daemon's catalog has no `[ask_person]`.
#[test]
fn the_daemons_catalog_decides_whether_a_person_is_asked() {
    let dir = std::env::temp_dir().join(format!("tether-ask-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("tools.toml");
    let with = "version = 1\n\n[ask_person]\ndescription = \"Ask the manager.\"\n";
    let stored = parse_catalog(with, &path).expect("a catalog");
    let own = "version = 1\n\n[ask_person]\ndescription = \"Ask the on-call manager.\"\n";
    let asking = Config {
        catalog: Some(parse_catalog(own, &path).expect("a catalog")),
        ..Config::default()
    };
    let r = asking.catalog_for(Some(&stored));
    let t = r.catalog.get("ask_person").expect("the tool");
    assert!(t.asks_person && r.unavailable.is_empty());
    assert_eq!(t.description, "Ask the on-call manager.");
    let r = Config::default().catalog_for(Some(&stored));
    let t = r.catalog.get("ask_person").expect("the tool");
    assert!(!t.asks_person, "not held for a person");
    assert!(r.unavailable["ask_person"].contains("no [ask_person]"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ask_person = true` (a boolean where a table belongs) is told how to write the table.
#[test]
fn ask_person_written_as_a_flag_is_told_it_is_a_table() {
    let e = super::parse_catalog(
        "version = 1\nask_person = true\n",
        std::path::Path::new("tools.toml"),
    )
    .unwrap_err();
    assert!(
        e.contains("ask_person is a table, not boolean") && e.contains("[ask_person]"),
        "{e}"
    );
    let ok = super::parse_catalog(
        "version = 1\n[ask_person]\n",
        std::path::Path::new("tools.toml"),
    )
    .expect("an empty table is enough");
    assert!(ok.get("ask_person").is_some());
}
