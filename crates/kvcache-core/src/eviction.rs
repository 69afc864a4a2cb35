//! Eviction as a transaction, written once for every [`Policy`].
//!
//! [`evict`] plans on `&P` (so "no plan" cannot have changed anything: the compiler enforces
//! the atomicity vLLM's `evict` promises) and only then commits on `&mut P`. A plan never
//! leaves this module, so it cannot be applied to a policy that changed since it was made.

use hashbrown::HashSet;

use crate::chunk::RefCounts;
use crate::key::KeyBuf;
use crate::policy::{EntryId, Policy};

/// An evicted entry: its key and the chunk that was stored under it.
#[derive(Debug)]
pub struct Evicted<C> {
    pub key: KeyBuf,
    pub chunk: C,
}

/// Entries an eviction must skip: the resident keys the caller is about to use. Keys that
/// are not resident need no entry, so the set is at most as large as the offer.
#[derive(Default, Debug)]
pub struct Protected {
    entries: HashSet<EntryId, foldhash::fast::FixedState>,
}

impl Protected {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn from_ids(ids: impl IntoIterator<Item = EntryId>) -> Self {
        Protected {
            entries: ids.into_iter().collect(),
        }
    }

    #[inline]
    pub fn contains(&self, id: EntryId) -> bool {
        !self.entries.is_empty() && self.entries.contains(&id)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Victims chosen by [`plan`], in eviction order.
struct EvictionPlan {
    victims: Vec<EntryId>,
}

/// Chooses exactly `n` victims without changing anything, or `None` if fewer than `n` resident
/// chunks are idle (`ref_cnt == 0`) and unprotected. The victim list is sized by the policy's
/// resident count, never by `n` alone.
fn plan<C, P: Policy<C>>(
    policy: &P,
    n: usize,
    protected: &Protected,
    counts: &impl RefCounts<C>,
) -> Option<EvictionPlan> {
    if n > policy.len() {
        return None;
    }
    let mut victims = Vec::with_capacity(n);
    victims.extend(
        policy
            .victims(|id, chunk| counts.ref_cnt(chunk) == 0 && !protected.contains(id))
            .take(n),
    );
    (victims.len() == n).then_some(EvictionPlan { victims })
}

/// Takes the planned victims out, in plan order, then lets the policy tidy up once.
fn commit<C, P: Policy<C>>(policy: &mut P, plan: EvictionPlan) -> Vec<Evicted<C>> {
    let evicted = plan
        .victims
        .into_iter()
        .map(|id| policy.evict_entry(id))
        .collect();
    policy.after_eviction();
    evicted
}

/// Evicts exactly `n` idle, unprotected chunks in the policy's order, or returns `None` and
/// changes nothing.
pub fn evict<C, P: Policy<C>>(
    policy: &mut P,
    n: usize,
    protected: &Protected,
    counts: &impl RefCounts<C>,
) -> Option<Vec<Evicted<C>>> {
    if n == 0 {
        // vLLM's policies return at once; nothing to plan or tidy.
        return Some(Vec::new());
    }
    let plan = plan(&*policy, n, protected, counts)?;
    Some(commit(policy, plan))
}
