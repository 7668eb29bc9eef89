//! `docs/reference/cli.md`, generated from the CLI's own definition: every verb's long help,
//! as `worker VERB --help` prints it, in the order `worker --help` lists them. A test compares
//! the file with what this makes, so the reference cannot fall behind the binary
//! (`TETHER_BLESS=1 cargo test --lib cli::reference` writes it anew).

use clap::CommandFactory;

/// The reference page.
pub fn markdown() -> String {
    let mut cmd = super::Cli::command().term_width(100);
    cmd.build();
    let mut out = String::from(
        "# CLI reference\n\n\
         Every verb of `worker`, with its `--help` as the binary prints it. Generated from the\n\
         CLI's definition by `src/cli/reference.rs`; a test fails when this page and the binary\n\
         differ (`TETHER_BLESS=1 cargo test --lib cli::reference` writes it anew).\n",
    );
    section(&mut out, &mut cmd, "worker");
    out
}

/// `cmd`'s help under `path`, then each of its visible subcommands'.
fn section(out: &mut String, cmd: &mut clap::Command, path: &str) {
    // A variable's value in this environment is not the reference's.
    let mut shown = cmd.clone().mut_args(|a| a.hide_env_values(true));
    let help = shown.render_long_help().to_string();
    out.push_str(&format!(
        "\n## `{path}`\n\n```text\n{}\n```\n",
        help.trim_end()
    ));
    let names: Vec<String> = cmd
        .get_subcommands()
        .filter(|c| !c.is_hide_set() && c.get_name() != "help")
        .map(|c| c.get_name().to_string())
        .collect();
    for name in names {
        if let Some(sub) = cmd.find_subcommand_mut(&name) {
            section(out, sub, &format!("{path} {name}"));
        }
    }
}

/// Every environment variable a flag falls back to.
pub fn flag_variables() -> Vec<String> {
    fn walk(cmd: &clap::Command, out: &mut Vec<String>) {
        for a in cmd.get_arguments() {
            if let Some(v) = a.get_env().and_then(|v| v.to_str()) {
                out.push(v.to_string());
            }
        }
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    let mut out = Vec::new();
    walk(&super::Cli::command(), &mut out);
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    /// `docs/reference/environment.md` lists every variable a flag falls back to, and every
    /// variable the code reads by name (found in the sources).
    #[test]
    fn the_environment_reference_lists_every_variable() {
        let page = crate::testing::page("docs/reference/environment.md");
        let listed: Vec<String> = crate::testing::tables(&page)
            .into_iter()
            .flat_map(|(_, rows)| rows)
            .flat_map(|r| crate::testing::code_names(&r[0]))
            .collect();
        let mut read = super::flag_variables();
        let mut dirs = vec![std::path::PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/src"
        ))];
        while let Some(dir) = dirs.pop() {
            for e in std::fs::read_dir(&dir).expect("src") {
                let p = e.expect("an entry").path();
                if p.is_dir() {
                    dirs.push(p);
                    continue;
                }
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                for part in text.split("env::var").skip(1) {
                    let name: String = part
                        .trim_start_matches("_os")
                        .trim_start_matches("(\"")
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || *c == '_')
                        .collect();
                    if part.trim_start_matches("_os").starts_with("(\"") && !name.is_empty() {
                        read.push(name);
                    }
                }
            }
        }
        read.sort();
        read.dedup();
        let missing: Vec<&String> = read.iter().filter(|v| !listed.contains(v)).collect();
        assert!(
            missing.is_empty(),
            "environment.md does not list {missing:?}"
        );
    }

    /// The committed page is what the binary's definition makes.
    #[test]
    fn the_cli_reference_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/reference/cli.md");
        let made = super::markdown();
        if std::env::var("TETHER_BLESS").is_ok_and(|v| v == "1") {
            std::fs::write(path, &made).expect("write docs/reference/cli.md");
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == made,
            "docs/reference/cli.md is not what the CLI's definition makes: run `TETHER_BLESS=1 cargo test --lib cli::reference` and commit the file"
        );
    }
}
