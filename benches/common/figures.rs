//! What the benches print their rounds with: the median of a round's figures, and the
//! figures themselves, two decimals each, in the order they were measured.

/// The middle value (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The rounds' figures as `0.41 0.39 ...`.
#[allow(dead_code)]
pub fn listed(v: &[f64]) -> String {
    v.iter()
        .map(|r| format!("{r:.2}"))
        .collect::<Vec<_>>()
        .join(" ")
}
