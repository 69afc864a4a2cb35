//! Per-request state a policy keeps on vLLM's `ReqContext`, and how it is let go.
//!
//! vLLM's LRU stores its request rank on the context (`set_state`), keyed by type, so the rank
//! lives exactly as long as the request's context. Ours does the same with its own type
//! (`_RequestRanks`), which holds one slot per policy instance: two policies seeing one context
//! never share or overwrite each other's rank, and vLLM's policy (keyed by its own type) is
//! untouched. When the context dies, the state object's destructor reports each rank to its
//! policy's graveyard; the policy drops the rank's anchor at its next call. A rank from before a
//! `clear()` is stale and replaced on first use, as in vLLM.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use kvcache_core::RequestRank;
use pyo3::prelude::*;

/// Ranks whose request state was collected, waiting for their policy to release them.
#[derive(Default)]
pub struct Graveyard {
    pending: AtomicBool,
    ranks: Mutex<Vec<RequestRank>>,
}

impl Graveyard {
    fn bury(&self, rank: RequestRank) {
        self.ranks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(rank);
        self.pending.store(true, Ordering::Release);
    }

    /// Takes the buried ranks, if any (one atomic load when there are none).
    pub fn take(&self) -> Vec<RequestRank> {
        if !self.pending.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.ranks.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

struct Slot {
    policy: u64,
    rank: RequestRank,
    graveyard: Weak<Graveyard>,
}

/// Request ranks of every kvcache policy that has seen one request context.
#[pyclass(name = "_RequestRanks", module = "kvcache._core", frozen)]
#[derive(Default)]
pub struct RequestRanks {
    slots: Mutex<Vec<Slot>>,
}

impl RequestRanks {
    pub fn get(&self, policy: u64) -> Option<RequestRank> {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.iter().find(|s| s.policy == policy).map(|s| s.rank)
    }

    /// Records `rank` for `policy`; a replaced rank is stale (from before a `clear`), so it is
    /// not reported to the graveyard.
    pub fn set(&self, policy: u64, rank: RequestRank, graveyard: &Arc<Graveyard>) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        match slots.iter_mut().find(|s| s.policy == policy) {
            Some(slot) => slot.rank = rank,
            None => slots.push(Slot {
                policy,
                rank,
                graveyard: Arc::downgrade(graveyard),
            }),
        }
    }
}

impl Drop for RequestRanks {
    fn drop(&mut self) {
        let slots = std::mem::take(self.slots.get_mut().unwrap_or_else(|p| p.into_inner()));
        for slot in slots {
            if let Some(graveyard) = slot.graveyard.upgrade() {
                graveyard.bury(slot.rank);
            }
        }
    }
}

/// Gives each policy instance an id for its slot.
pub fn next_policy_uid() -> u64 {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
