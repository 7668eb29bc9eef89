//! Model rate limits shared by every daemon on a database: the arithmetic both engines
//! apply. A profile with a limit (`requests` and/or `tokens` per window) keeps, in the
//! database, a log of the reservations made in the last window and the time until which a
//! provider's `429` asked the profile to wait. Before a model call a daemon reserves one
//! request and the kernel's pessimistic estimate of its tokens; when the window has no room
//! the call waits (the task yields its thread) until the time [`wait_until`] computes. After
//! the call the reservation is settled with the tokens the provider reported.

/// A profile's limit: at most `requests` calls and `tokens` tokens in any window of
/// `per_ms` (either may be absent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    pub requests: Option<u32>,
    pub tokens: Option<u64>,
    pub per_ms: u64,
}

/// What a reservation got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reserve {
    /// The call may go now; settle the reservation with this id afterwards.
    Granted(u64),
    /// The window has no room (or the provider asked to wait): try again at this time.
    WaitUntil(u64),
}

/// A reservation still in the window: when it was made and the tokens it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub at_ms: u64,
    pub tokens: u64,
}

impl RateLimit {
    /// Whether a reservation made at `at_ms` has left the window at `now_ms`.
    pub fn expired(&self, at_ms: u64, now_ms: u64) -> bool {
        at_ms.saturating_add(self.per_ms) <= now_ms
    }

    /// The tokens a call estimated at `tokens` reserves: never more than the whole limit, so
    /// that a call larger than the limit still goes, alone in its window.
    pub fn reserved(&self, tokens: u64) -> u64 {
        self.tokens.map_or(tokens, |t| tokens.min(t))
    }

    /// When a call of `tokens` may go, given the reservations `held` still in the window
    /// (oldest first) and the profile's `blocked_until_ms`: `None` for now.
    pub fn wait_until(
        &self,
        held: &[Held],
        blocked_until_ms: u64,
        tokens: u64,
        now_ms: u64,
    ) -> Option<u64> {
        let mut until = blocked_until_ms;
        if let Some(r) = self.requests.map(|r| r as usize)
            && held.len() >= r
        {
            // The (len - r + 1) oldest must leave the window first.
            until = until.max(held[held.len() - r].at_ms.saturating_add(self.per_ms));
        }
        if let Some(t) = self.tokens {
            let want = self.reserved(tokens);
            let mut sum: u64 = held.iter().map(|h| h.tokens).sum();
            if sum.saturating_add(want) > t {
                for h in held {
                    sum -= h.tokens;
                    if sum + want <= t {
                        until = until.max(h.at_ms.saturating_add(self.per_ms));
                        break;
                    }
                }
            }
        }
        (until > now_ms).then_some(until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(requests: Option<u32>, tokens: Option<u64>) -> RateLimit {
        RateLimit {
            requests,
            tokens,
            per_ms: 1_000,
        }
    }

    fn held(v: &[(u64, u64)]) -> Vec<Held> {
        v.iter()
            .map(|&(at_ms, tokens)| Held { at_ms, tokens })
            .collect()
    }

    #[test]
    fn requests_wait_for_the_oldest_to_leave_the_window() {
        let l = limit(Some(2), None);
        assert_eq!(l.wait_until(&held(&[(100, 0)]), 0, 5, 500), None);
        assert_eq!(
            l.wait_until(&held(&[(100, 0), (300, 0)]), 0, 5, 500),
            Some(1_100)
        );
        assert_eq!(
            l.wait_until(&held(&[(100, 0), (300, 0), (400, 0)]), 0, 5, 500),
            Some(1_300)
        );
    }

    #[test]
    fn tokens_wait_until_enough_have_left() {
        let l = limit(None, Some(1_000));
        let h = held(&[(100, 600), (200, 300)]);
        assert_eq!(l.wait_until(&h, 0, 100, 500), None);
        assert_eq!(l.wait_until(&h, 0, 200, 500), Some(1_100));
        assert_eq!(l.wait_until(&h, 0, 800, 500), Some(1_200));
        // Larger than the limit: it goes alone once the window is empty.
        assert_eq!(l.wait_until(&h, 0, 5_000, 500), Some(1_200));
        assert_eq!(l.wait_until(&[], 0, 5_000, 500), None);
        assert_eq!(l.reserved(5_000), 1_000);
    }

    #[test]
    fn a_slow_down_holds_every_call_until_it_ends() {
        let l = limit(Some(10), Some(10_000));
        assert_eq!(l.wait_until(&[], 2_000, 1, 500), Some(2_000));
        assert_eq!(l.wait_until(&[], 2_000, 1, 2_000), None);
    }
}
