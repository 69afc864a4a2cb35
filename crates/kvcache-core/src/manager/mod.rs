//! The CPU offloading manager, decision-identical to vLLM 0.33.0's and 0.34.0's
//! `CPUOffloadingManager` (the release is a setting, [`VllmSemantics`]).
//!
//! It owns the chunk pool ([`table`]: ids handed out in vLLM's order, reference counts in one
//! contiguous table), the evictable and write-pending counts, the `store_threshold` access
//! tracker ([`tracker`]), per-request access tracking ([`request`]), events and usage figures,
//! and drives a [`Policy`] (LRU or ARC) exactly as vLLM's manager drives its policy. Every call
//! hashes each key once (the caller builds [`Key`]s with [`Manager::key`]) and checks its input
//! before changing anything: an `Err` means no change.
//!
//! The calls live by concern: a request's state and what every request call shares
//! (`access`), loads (`load`), stores (`store`), finishing a request (`finish`),
//! events and figures (`report`), the CPU primary tier's calls (`primary`); this file holds
//! the state and the lookups.
//!
//! Where vLLM would trip an `assert` (a load of a missing or pending chunk, a completion of a
//! load that was never prepared, new keys after a request finished), the call returns
//! [`CoreError`] instead and changes nothing. One offer may not name the same key twice
//! (vLLM would allocate it twice and leak a chunk).
//!
//! Cost: the work is memory-bound, so each call looks its keys up in the policy once, in one
//! batched pass ([`Policy::find_many`]) whose cache misses overlap, and passes the
//! handles on (ARC's ghost handles reach `on_store_miss` and `insert`). A request's table
//! remembers each key's handle, so finishing it probes no index; handles are checked against
//! their key before use, since entries come and go. Request tables are pooled. Per key visit:
//! O(1) expected, plus O(log n) for an LRU insertion into the middle of a large request group.

mod access;
mod finish;
mod load;
mod primary;
mod report;
mod request;
mod store;
mod table;
mod tracker;
#[cfg(any(test, feature = "validate"))]
mod validate;

use crate::error::{CoreError, CoreResult};
use crate::key::{Key, KeyBuf, KeyHasher};
use crate::policy::{EntryId, Policy, PolicyExt};
pub use crate::semantics::VllmSemantics;
use request::RequestRegistry;
pub use table::{ChunkId, ChunkRecord, ChunkTable, TableRecord, FREE, MAX_CHUNKS};
use tracker::AccessTracker;

/// A key a call records in the request: its offer index, its resident entry (`None`: not
/// resident), for store candidates any other policy entry (ARC's ghost), and its token
/// position.
#[derive(Clone, Copy)]
struct Recorded<'a> {
    offer_index: usize,
    key: Key<'a>,
    resident: Option<EntryId>,
    ghost: Option<EntryId>,
    position: Option<i64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LookupResult {
    Miss,
    Hit,
    HitPending,
}

/// The answer to `prepare_store`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StoreOutput {
    /// Offered keys to store, as indices into the offer (so callers can reuse their key objects).
    pub stored: Vec<usize>,
    /// The chunk allocated for each stored key.
    pub chunk_ids: Vec<ChunkId>,
    /// Keys evicted to make room, in eviction order.
    pub evicted: Vec<KeyBuf>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub keys: Vec<KeyBuf>,
    /// Removed (evicted, or dropped after a failed store) rather than stored.
    pub removed: bool,
    /// A failed store's cleanup: no public eviction happened.
    pub metadata_only: bool,
    /// A stored event announcing that a removal event will follow (vLLM 0.34).
    pub removal_expected: bool,
}

/// Usage figures since the last call to [`Manager::take_stats`] (vLLM's `get_stats`).
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    /// Chunks pinned by transfers (pending stores and loads) over all chunks.
    pub usage: f64,
    pub write_usage: f64,
    pub read_usage: f64,
    /// Chunks requested by each successful allocation since the last call.
    pub allocation_sizes: Vec<usize>,
    /// Store candidates below `store_threshold` (None when the threshold is off).
    pub stores_skipped: Option<u64>,
    /// Requests that arrived with a retention hint.
    pub hinted_requests: u64,
    /// Retention hints the caller could not read and ignored.
    pub ignored_hints: u64,
    /// Reads of chunks the policy kept because of a retention hint (policies that read hints).
    pub hint_kept_hits: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct ManagerConfig {
    pub num_chunks: usize,
    pub enable_events: bool,
    /// Offers a key needs before it is stored; values below 2 store on the first offer.
    pub store_threshold: i64,
    pub max_tracker_size: usize,
    /// The vLLM release whose decisions the manager reproduces.
    pub semantics: VllmSemantics,
}

/// Heap bytes by structure.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemoryUsage {
    pub policy: usize,
    pub table: usize,
    pub tracker: usize,
    pub requests: usize,
}

impl MemoryUsage {
    pub fn total(&self) -> usize {
        self.policy + self.table + self.tracker + self.requests
    }
}

pub struct Manager<P: Policy<ChunkId>> {
    config: ManagerConfig,
    table: ChunkTable,
    policy: P,
    hasher: KeyHasher,
    events: Option<Vec<Event>>,
    tracker: Option<AccessTracker>,
    num_evictable: usize,
    num_write_pending: usize,
    stores_skipped: u64,
    hints: HintCounts,
    allocation_sizes: Vec<usize>,
    requests: RequestRegistry<P::Request>,
    /// Chunks of failed writes whose release a tiering caller deferred: out of the policy,
    /// still write-pending, not yet free (see `primary`).
    deferred: hashbrown::HashSet<ChunkId, foldhash::fast::FixedState>,
    scratch: Scratch,
}

/// Retention hint figures since the last [`Manager::take_stats`].
#[derive(Clone, Copy, Debug, Default)]
struct HintCounts {
    hinted_requests: u64,
    ignored_hints: u64,
    /// The policy's cumulative `hint_kept_hits` at the last `take_stats`.
    kept_hits_taken: u64,
}

/// Buffers reused across calls, so the hot paths do not allocate.
#[derive(Default)]
struct Scratch {
    /// Offer indices by key hash, to find a key named twice in one offer.
    offer: hashbrown::HashTable<usize>,
}

impl<P: Policy<ChunkId>> Manager<P> {
    /// A manager for `config.num_chunks` chunks (at most [`MAX_CHUNKS`]). Memory grows with
    /// the chunks in use, not with `num_chunks`.
    pub fn new(config: ManagerConfig) -> CoreResult<Self> {
        Ok(Manager {
            table: ChunkTable::new(config.num_chunks)?,
            policy: P::new(config.num_chunks),
            hasher: KeyHasher::global(),
            events: config.enable_events.then(Vec::new),
            tracker: (config.store_threshold >= 2)
                .then(|| AccessTracker::new(config.max_tracker_size)),
            num_evictable: 0,
            num_write_pending: 0,
            stores_skipped: 0,
            hints: HintCounts::default(),
            allocation_sizes: Vec::new(),
            requests: RequestRegistry::new(),
            deferred: hashbrown::HashSet::default(),
            scratch: Scratch::default(),
            config,
        })
    }

    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    pub fn policy(&self) -> &P {
        &self.policy
    }

    pub fn table(&self) -> &ChunkTable {
        &self.table
    }

    #[inline]
    pub fn key<'a>(&self, bytes: &'a [u8]) -> Key<'a> {
        Key::new(&self.hasher, bytes)
    }

    pub fn num_evictable(&self) -> usize {
        self.num_evictable
    }

    pub fn num_write_pending(&self) -> usize {
        self.num_write_pending
    }

    /// The `store_threshold` tracker's keys and counts, least recent first; `None` when the
    /// threshold is off.
    pub fn tracked_offers(&self) -> Option<impl Iterator<Item = (&[u8], u32)> + '_> {
        self.tracker.as_ref().map(AccessTracker::entries)
    }

    /// Stores skipped by the threshold since the last `take_stats` (vLLM's
    /// `stores_skipped_in_current_batch`).
    pub fn stores_skipped(&self) -> u64 {
        self.stores_skipped
    }

    /// Live request states.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Chunks in use: pending, ready or pinned, or held for a deferred release.
    pub fn len(&self) -> usize {
        self.table.num_resident()
    }

    // A public `len` goes with an `is_empty` (clippy's `len_without_is_empty`).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub fn lookup(&self, key: Key<'_>) -> LookupResult {
        match self.policy.get(key) {
            None => LookupResult::Miss,
            Some(&c) if self.table.record(c).ref_cnt() < 0 => LookupResult::HitPending,
            Some(_) => LookupResult::Hit,
        }
    }

    /// Drops every chunk and request state (vLLM's `reset_cache`); events, the access tracker
    /// and pending stats survive, as in vLLM.
    pub fn reset(&mut self) {
        debug_assert!(self.deferred.is_empty(), "see try_reset");
        self.policy.clear();
        // The policy's count of hits on hint-kept chunks restarts with it.
        self.hints.kept_hits_taken = 0;
        self.requests.reset();
        self.num_evictable = 0;
        self.num_write_pending = 0;
        self.table.reset();
    }

    /// The resident entry a handle names, with its chunk (`None` for an absent key or a ghost).
    #[inline]
    fn resident(&self, found: Option<EntryId>) -> Option<(EntryId, ChunkId)> {
        found.and_then(|id| self.policy.chunk(id).map(|&c| (id, c)))
    }

    /// The entry and chunk a load of `key` reads: resident, and ready (not pending).
    #[inline]
    fn loadable(&self, key: Key<'_>, found: Option<EntryId>) -> CoreResult<(EntryId, ChunkId)> {
        let Some((handle, chunk)) = self.resident(found) else {
            return Err(CoreError::KeyNotFound(KeyBuf::new(key.bytes)));
        };
        if self.table.record(chunk).ref_cnt() < 0 {
            return Err(CoreError::ChunkPending(KeyBuf::new(key.bytes)));
        }
        Ok((handle, chunk))
    }
}

#[cfg(test)]
mod tests;
