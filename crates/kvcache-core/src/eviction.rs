//! Eviction as a transaction: `plan(&self, …) -> Option<EvictionPlan>`, then
//! `commit(&mut self, plan)`.
//!
//! Planning borrows the policy immutably, so "no plan" (fewer than `n` evictable entries)
//! cannot have changed anything: the compiler enforces the atomicity vLLM's `evict` promises.
//! A plan records the policy's mutation epoch; committing it after any other mutation is
//! refused ([`CoreError::StalePlan`](crate::CoreError::StalePlan)) instead of evicting entries
//! that may no longer qualify.

use hashbrown::HashSet;

/// Victims chosen by a policy's `plan_eviction`, in eviction order.
#[derive(Debug)]
#[must_use = "a plan does nothing until it is committed"]
pub struct EvictionPlan {
    pub(crate) victims: Vec<u32>,
    pub(crate) epoch: u64,
    pub(crate) policy_id: u64,
}

impl EvictionPlan {
    pub fn len(&self) -> usize {
        self.victims.len()
    }

    pub fn is_empty(&self) -> bool {
        self.victims.is_empty()
    }
}

/// An evicted entry: its key and the chunk handle that was stored under it.
#[derive(Debug)]
pub struct Evicted<C> {
    pub key: crate::KeyBuf,
    pub chunk: C,
}

/// Entries (by slab index) that an eviction must skip: the keys the caller is about to use.
/// Keys that are not resident need no entry, so the set is at most as large as the offer.
#[derive(Default, Debug)]
pub struct Protected {
    entries: HashSet<u32, foldhash::fast::FixedState>,
}

impl Protected {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_capacity(n: usize) -> Self {
        Protected {
            entries: HashSet::with_capacity_and_hasher(n, Default::default()),
        }
    }

    /// Protects the given entry handles (`NIL` entries, for absent keys, are skipped).
    pub fn from_handles(handles: impl IntoIterator<Item = u32>) -> Self {
        let handles = handles.into_iter();
        let mut protected = Protected::with_capacity(handles.size_hint().0);
        for h in handles {
            if h != crate::slab::NIL {
                protected.insert(h);
            }
        }
        protected
    }

    pub(crate) fn insert(&mut self, entry: u32) {
        self.entries.insert(entry);
    }

    #[inline]
    pub(crate) fn contains(&self, entry: u32) -> bool {
        !self.entries.is_empty() && self.entries.contains(&entry)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Gives every policy instance a distinct id, so a plan cannot be committed to another policy.
pub(crate) fn next_policy_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
