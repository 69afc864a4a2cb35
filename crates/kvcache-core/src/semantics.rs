//! The vLLM release whose decisions the [`Manager`](crate::Manager) and the policies reproduce.
//!
//! vLLM 0.33 and 0.34 share the chunk pool, the policies' own rules and the request
//! bookkeeping, and differ in four places, each asked of this one setting rather than tested
//! by version at the call site:
//! - `store_threshold`: under 0.34 a key counts toward the threshold once per request, so an
//!   offer a request repeats (a retry after a failed store, a re-offer after preemption) does
//!   not count again, and only a request's first offer of a key can be a skipped store;
//! - stored events announce that a removal will follow (`removal_expected`) under 0.34;
//! - `touch` is part of the manager and policy protocols under 0.33 only;
//! - the policy protocol's default `on_store_miss` is a `touch` under 0.33 and does nothing
//!   under 0.34 (LRU takes the default, so under 0.33 a store miss naming a resident key
//!   refreshes it; ARC has its own).

/// A vLLM release's manager semantics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum VllmSemantics {
    /// vLLM 0.33.0.
    V0_33,
    /// vLLM 0.34.0 (the default: the newest release).
    #[default]
    V0_34,
}

impl VllmSemantics {
    /// Every release, oldest first.
    pub const ALL: [VllmSemantics; 2] = [VllmSemantics::V0_33, VllmSemantics::V0_34];

    /// The release's name as users write it (`"0.33"`, `"0.34"`).
    pub fn name(self) -> &'static str {
        match self {
            VllmSemantics::V0_33 => "0.33",
            VllmSemantics::V0_34 => "0.34",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }

    /// A key counts toward `store_threshold` at most once per request.
    pub fn counts_once_per_request(self) -> bool {
        self == VllmSemantics::V0_34
    }

    /// Stored events carry `removal_expected`.
    pub fn stored_events_expect_removal(self) -> bool {
        self == VllmSemantics::V0_34
    }

    /// The manager and policy protocols have `touch`.
    pub fn has_touch(self) -> bool {
        self == VllmSemantics::V0_33
    }

    /// The policy protocol's default `on_store_miss` is a `touch`.
    pub fn store_miss_touches(self) -> bool {
        self == VllmSemantics::V0_33
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for s in VllmSemantics::ALL {
            assert_eq!(VllmSemantics::from_name(s.name()), Some(s));
        }
        assert_eq!(VllmSemantics::from_name("0.35"), None);
    }
}
