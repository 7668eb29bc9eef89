//! Claim rules both engines apply: the concurrency limits of a daemon's `[concurrency]`
//! config, by key or by key prefix (`"tenant:*" = 2`, `"tenant:acme" = 5`), and the model
//! profiles whose tasks a daemon passes over (it lacks their API key).

use std::collections::BTreeMap;

/// How many tasks of a concurrency key may run at once, across every daemon that claims with
/// these limits. A key no limit names runs unbounded.
///
/// A daemon's claims also pass over the tasks of the model profiles it cannot run (its
/// environment lacks their key): they keep their place for a daemon that can.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConcurrencyLimits {
    exact: BTreeMap<String, u32>,
    /// `(prefix, limit)` of the patterns ending in `*`, longest prefix first.
    prefixes: Vec<(String, u32)>,
    /// Model profiles whose tasks these claims pass over.
    passed_over: Vec<String>,
}

impl ConcurrencyLimits {
    /// Limits from `pattern = n` pairs; a pattern is a key, or a prefix followed by `*`.
    pub fn new(pairs: impl IntoIterator<Item = (String, u32)>) -> Result<Self, String> {
        let mut out = ConcurrencyLimits::default();
        for (pattern, n) in pairs {
            if n == 0 {
                return Err(format!(
                    "concurrency.{pattern:?} = 0 would never run its tasks; give 1 or more"
                ));
            }
            match pattern.strip_suffix('*') {
                Some(prefix) if prefix.contains('*') => {
                    return Err(format!(
                        "concurrency.{pattern:?}: '*' may only end a pattern"
                    ));
                }
                Some(prefix) => out.prefixes.push((prefix.to_string(), n)),
                None if pattern.contains('*') => {
                    return Err(format!(
                        "concurrency.{pattern:?}: '*' may only end a pattern"
                    ));
                }
                None => {
                    out.exact.insert(pattern, n);
                }
            }
        }
        out.prefixes.sort_by_key(|p| std::cmp::Reverse(p.0.len()));
        Ok(out)
    }

    /// The limit of `key`: its own, else that of the longest pattern it starts with.
    pub fn limit_of(&self, key: &str) -> Option<u32> {
        self.exact.get(key).copied().or_else(|| {
            self.prefixes
                .iter()
                .find(|(p, _)| key.starts_with(p.as_str()))
                .map(|(_, n)| *n)
        })
    }

    /// The limits of single keys, `(key, limit)`.
    pub fn exact(&self) -> impl Iterator<Item = (&str, u32)> {
        self.exact.iter().map(|(k, n)| (k.as_str(), *n))
    }

    /// The limits of key prefixes, `(prefix, limit)`, longest prefix first.
    pub fn prefixes(&self) -> impl Iterator<Item = (&str, u32)> {
        self.prefixes.iter().map(|(k, n)| (k.as_str(), *n))
    }

    /// These limits, with claims that pass over the tasks of these model profiles.
    pub fn passing_over(mut self, profiles: Vec<String>) -> Self {
        self.passed_over = profiles;
        self
    }

    /// The model profiles whose tasks are passed over.
    pub fn passed_over(&self) -> &[String] {
        &self.passed_over
    }

    /// Whether a claim passes over a task of `model`.
    pub fn passes_over(&self, model: &crate::model::ModelProfile) -> bool {
        match model {
            crate::model::ModelProfile::Profile { name } => self.passed_over.contains(name),
            _ => false,
        }
    }

    /// No limit and nothing passed over: every due task may be claimed.
    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.prefixes.is_empty() && self.passed_over.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exact_key_then_the_longest_pattern() {
        let l = ConcurrencyLimits::new([
            ("tenant:*".to_string(), 2),
            ("tenant:acme".to_string(), 5),
            ("tenant:big*".to_string(), 9),
            ("*".to_string(), 50),
        ])
        .expect("limits");
        assert_eq!(l.limit_of("tenant:acme"), Some(5));
        assert_eq!(l.limit_of("tenant:other"), Some(2));
        assert_eq!(l.limit_of("tenant:bigco"), Some(9));
        assert_eq!(l.limit_of("openai"), Some(50));
        assert!(ConcurrencyLimits::default().limit_of("x").is_none());
        assert!(ConcurrencyLimits::new([("a*b".to_string(), 1)]).is_err());
        assert!(ConcurrencyLimits::new([("a".to_string(), 0)]).is_err());
    }
}
