//! A model profile as a config file declares it (`[models.NAME]`): which provider API, where,
//! which model, the key's variable, how tools are offered, the agent's instructions, and the
//! budgets its tasks get by default. A task stores only the profile's name; the daemon that
//! runs it resolves the name in its own config, so the endpoint, the key and the instructions
//! are the daemon's (see `docs/models.md`).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::kernel::Budget;

/// The provider API a profile speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// OpenAI's Chat Completions, and the servers that speak it (vLLM, llama.cpp, Ollama,
    /// LiteLLM, OpenRouter, ...).
    #[serde(rename = "openai")]
    OpenAi,
    /// Anthropic's Messages API.
    Anthropic,
}

/// How the model is offered its moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCalling {
    /// The provider's function calling: every tool, the plan and the final answer are
    /// functions with JSON Schema parameters, and each reply is one call.
    Native,
    /// For models without function calling: the tools and their schemas are in the system
    /// prompt, the reply is one JSON object (JSON mode where the API has one), and one JSON
    /// object is taken from any prose around it.
    Json,
}

/// How a model gives its final answer with native tool calling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinalAnswer {
    /// The `final_answer` function (with an outcome); every reply must be a call.
    Function,
    /// Plain text without a call is the final answer (outcome `completed`); the functions
    /// are offered, not required. For models that answer in text when they are done.
    Content,
}

/// Which request field caps a Chat Completions reply's length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaxTokensParam {
    /// OpenAI's current field; reasoning models accept only this one.
    MaxCompletionTokens,
    /// The older field, which many OpenAI-compatible servers still read.
    MaxTokens,
}

/// A model profile of the config.
#[derive(Clone, Debug, PartialEq)]
pub struct HttpProfile {
    pub api: Api,
    /// The API's base, e.g. `https://api.openai.com/v1`; requests go to `/chat/completions`
    /// or `/messages` under it.
    pub base_url: String,
    pub model: String,
    /// The environment variable holding the API key (the key itself is never stored).
    pub api_key_env: Option<String>,
    /// Retries of a 429, 5xx or 529 answer (and of a failed connection), within the task's
    /// remaining active time.
    pub max_retries: u32,
    /// Sent only when set: reasoning models refuse it.
    pub temperature: Option<f64>,
    pub max_tokens_param: MaxTokensParam,
    pub tool_calling: ToolCalling,
    pub final_answer: FinalAnswer,
    /// The agent's instructions (from `instructions` or `instructions_file`).
    pub instructions: Option<String>,
    /// The budget a task of this profile gets unless its enqueue says otherwise.
    pub budget: Budget,
    /// Where a task of this profile's result is POSTed when it settles, unless its enqueue
    /// names another URL (checked against the config's `[callbacks] allow`).
    pub callback_url: Option<String>,
    /// The concurrency key of a task of this profile unless its enqueue names one, so a
    /// limit in `[concurrency]` bounds how many of them call this provider at once.
    pub concurrency_key: Option<String>,
    /// The provider's rate limit, shared by every daemon on the database under its key.
    pub rate_limit: Option<(String, crate::model::rate::RateLimit)>,
}

/// The budget of a task on a real model, unless its profile or its enqueue says otherwise:
/// room for model calls of several seconds each, a long final answer, and a plan of a dozen
/// steps. (The design reference's smaller defaults stay with its own models.)
pub fn real_model_budget() -> Budget {
    Budget {
        steps_max: 24,
        tool_calls_max: 16,
        tokens_max: 200_000,
        output_tokens_max: 2_048,
        deadline_ms: 600_000,
        repeat_max: 2,
        stalls_max: 3,
        plan_steps_max: 12,
        replans_max: 3,
    }
}

impl HttpProfile {
    /// The provider's name in traces (`gen_ai.provider.name`).
    pub fn provider(&self) -> &'static str {
        match self.api {
            Api::OpenAi => "openai",
            Api::Anthropic => "anthropic",
        }
    }

    /// The API key from its variable, or why it cannot be had.
    pub fn api_key(&self) -> Result<Option<String>, String> {
        let Some(var) = &self.api_key_env else {
            return Ok(None);
        };
        match std::env::var(var) {
            Ok(k) if !k.trim().is_empty() => Ok(Some(k)),
            Ok(_) => Err(format!("the API key variable {var} is empty")),
            Err(_) => Err(format!("the API key variable {var} is not set")),
        }
    }
}

/// A short digest of a text, to record which version of it a reply was made with.
pub fn text_digest(text: &str) -> String {
    crate::kernel::state::hex_prefix(&Sha256::digest(text.as_bytes()), 12)
}

/// A `[models.NAME]` section as the config file has it.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileEntry {
    kind: String,
    base_url: String,
    model: String,
    #[serde(default)]
    api_key_env: Option<String>,
    #[serde(default = "default_retries")]
    max_retries: u32,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    max_tokens_param: Option<MaxTokensParam>,
    #[serde(default)]
    tool_calling: Option<ToolCalling>,
    #[serde(default)]
    final_answer: Option<FinalAnswer>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    instructions_file: Option<PathBuf>,
    #[serde(default)]
    budget: BTreeMap<String, toml::Value>,
    #[serde(default)]
    callback_url: Option<String>,
    #[serde(default)]
    concurrency_key: Option<String>,
    #[serde(default)]
    requests_per_minute: Option<u32>,
    #[serde(default)]
    tokens_per_minute: Option<u64>,
    #[serde(default)]
    rate_limit: Option<RateLimitEntry>,
}

/// A `[models.NAME.rate_limit]` table: the limit over any window of `per`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitEntry {
    #[serde(default)]
    requests: Option<u32>,
    #[serde(default)]
    tokens: Option<u64>,
    /// The window, as `1m` (the default), `10s`, `1h`.
    #[serde(default)]
    per: Option<String>,
    /// The name the limit is shared under (default: the profile's name), so several profiles
    /// on one provider account can share one limit.
    #[serde(default)]
    key: Option<String>,
}

/// A profile's rate limit, from `requests_per_minute`/`tokens_per_minute` or `rate_limit`.
fn rate_limit_of(
    name: &str,
    rpm: Option<u32>,
    tpm: Option<u64>,
    table: Option<RateLimitEntry>,
) -> Result<Option<(String, crate::model::rate::RateLimit)>, String> {
    let (requests, tokens, per, key) = match (rpm.is_some() || tpm.is_some(), table) {
        (true, Some(_)) => {
            return Err(format!(
                "models.{name}: give requests_per_minute/tokens_per_minute or a rate_limit table, not both"
            ));
        }
        (false, None) => return Ok(None),
        (true, None) => (rpm, tpm, 60_000, None),
        (false, Some(t)) => {
            let per = match &t.per {
                None => 60_000,
                Some(p) => crate::clock::parse_duration_ms(p)
                    .map_err(|e| format!("models.{name}.rate_limit.per: {e}"))?,
            };
            (t.requests, t.tokens, per, t.key)
        }
    };
    if requests == Some(0) || tokens == Some(0) {
        return Err(format!(
            "models.{name}: a rate limit of 0 would never call the model; give 1 or more"
        ));
    }
    if requests.is_none() && tokens.is_none() {
        return Err(format!(
            "models.{name}.rate_limit: give requests, tokens or both"
        ));
    }
    if !(1_000..=86_400_000).contains(&per) {
        return Err(format!(
            "models.{name}.rate_limit.per must be between 1s and 24h"
        ));
    }
    let key = key.unwrap_or_else(|| name.to_string());
    crate::limits::check_name(&key, &format!("models.{name}.rate_limit.key")).map_err(|e| e.0)?;
    let limit = crate::model::rate::RateLimit {
        requests,
        tokens,
        per_ms: per,
    };
    Ok(Some((key, limit)))
}

fn default_retries() -> u32 {
    3
}

/// The longest agent instructions a profile (or a task) may carry.
pub const INSTRUCTIONS_BYTES_MAX: usize = 16 * 1024;

/// A `[models.NAME]` entry as a profile; `Err` says which option is wrong.
pub(crate) fn from_entry(name: &str, m: ProfileEntry, path: &Path) -> Result<HttpProfile, String> {
    let api = match m.kind.as_str() {
        "openai" => Api::OpenAi,
        "anthropic" => Api::Anthropic,
        other => {
            return Err(format!(
                "models.{name}.kind {other:?} is not supported (use \"openai\" for Chat Completions or \"anthropic\" for Messages)"
            ));
        }
    };
    if crate::net::check_url(&m.base_url).is_err() {
        return Err(format!(
            "models.{name}.base_url must be an http:// or https:// URL with a host"
        ));
    }
    if m.model.trim().is_empty() {
        return Err(format!("models.{name}.model is empty"));
    }
    if let Some(t) = m.temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err(format!("models.{name}.temperature must be between 0 and 2"));
    }
    if let Some(v) = &m.api_key_env
        && (v.is_empty() || !v.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
    {
        return Err(format!(
            "models.{name}.api_key_env must be the name of an environment variable (letters, digits and '_'), not {v:?}"
        ));
    }
    if api == Api::Anthropic && m.max_tokens_param.is_some() {
        return Err(format!(
            "models.{name}.max_tokens_param is for kind \"openai\" (Messages always uses max_tokens)"
        ));
    }
    let instructions = instructions_of(name, m.instructions, m.instructions_file, path)?;
    let budget = budget_of(name, &m.budget)?;
    if let Some(k) = &m.concurrency_key {
        crate::limits::check_name(k, &format!("models.{name}.concurrency_key")).map_err(|e| e.0)?;
    }
    let rate_limit = rate_limit_of(
        name,
        m.requests_per_minute,
        m.tokens_per_minute,
        m.rate_limit,
    )?;
    Ok(HttpProfile {
        rate_limit,
        api,
        base_url: m.base_url.trim_end_matches('/').to_string(),
        model: m.model,
        api_key_env: m.api_key_env,
        max_retries: m.max_retries.min(10),
        temperature: m.temperature,
        max_tokens_param: m
            .max_tokens_param
            .unwrap_or(MaxTokensParam::MaxCompletionTokens),
        tool_calling: m.tool_calling.unwrap_or(ToolCalling::Native),
        final_answer: m.final_answer.unwrap_or(FinalAnswer::Function),
        instructions,
        budget,
        callback_url: m.callback_url,
        concurrency_key: m.concurrency_key,
    })
}

/// A profile's instructions: given in the config, or read from a file named relative to it.
fn instructions_of(
    name: &str,
    text: Option<String>,
    file: Option<std::path::PathBuf>,
    path: &Path,
) -> Result<Option<String>, String> {
    let instructions = match (text, file) {
        (Some(_), Some(_)) => {
            return Err(format!(
                "models.{name}: give instructions or instructions_file, not both"
            ));
        }
        (Some(i), None) => Some(i),
        (None, Some(f)) => {
            let f = if f.is_absolute() {
                f
            } else {
                path.parent().unwrap_or(Path::new(".")).join(f)
            };
            Some(
                crate::limits::read_file(&f, INSTRUCTIONS_BYTES_MAX)
                    .map_err(|e| format!("models.{name}.instructions_file {}: {e}", f.display()))?,
            )
        }
        (None, None) => None,
    };
    if let Some(i) = &instructions
        && i.len() > INSTRUCTIONS_BYTES_MAX
    {
        return Err(format!(
            "models.{name}.instructions: {} bytes, over the limit of {INSTRUCTIONS_BYTES_MAX}",
            i.len()
        ));
    }
    Ok(instructions)
}

/// A profile's budget: the real-model defaults with the config's `budget` table applied.
fn budget_of(name: &str, table: &BTreeMap<String, toml::Value>) -> Result<Budget, String> {
    let mut budget: Budget = real_model_budget();
    for (k, v) in table {
        let v = match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            other => {
                return Err(format!(
                    "models.{name}.budget.{k}: {other:?} is not a whole number"
                ));
            }
        };
        budget
            .set(k, &v)
            .map_err(|e| format!("models.{name}.budget: {e}"))?;
    }
    Ok(budget)
}
