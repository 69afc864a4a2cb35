//! The CPU offloading manager, decision-identical to vLLM 0.33.0's and 0.34.0's
//! `CPUOffloadingManager` (the release is a setting, [`VllmSemantics`]).
//!
//! It owns the chunk pool ([`table`]: ids handed out in vLLM's order, reference counts in one
//! contiguous table), the evictable and write-pending counts, the `store_threshold` access
//! tracker ([`tracker`]), per-request access tracking ([`request`]), events and usage figures,
//! and drives a [`Policy`] (LRU or ARC) exactly as vLLM's manager drives its policy. Every call hashes each key once (the caller builds [`Key`]s with
//! [`Manager::key`]) and checks its input before changing anything: an `Err` means no change.
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

mod primary;
mod request;
mod table;
mod tracker;

use crate::error::{CoreError, CoreResult};
use crate::key::{Key, KeyBuf, KeyHasher};
use crate::policy::Protected;
use crate::policy::{Access, EntryId, Observed, Policy, PolicyExt};
use crate::registry::RequestToken;
use crate::retention::RetentionHint;
pub use crate::semantics::VllmSemantics;
use request::{RequestRegistry, INSERTED, REUSED, STORE_MISS};
#[cfg(any(test, feature = "validate"))]
use table::PENDING;
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

/// A finished request's key, for ordering: group, position, resident entry, access.
struct Finished {
    group: u32,
    position: Option<i64>,
    handle: Option<EntryId>,
    access: Access,
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

    /// The request's state for this cache generation: `current` if still valid, else new
    /// (vLLM's `on_new_request` / `_get_request_cache_access`).
    pub fn request(&mut self, current: Option<RequestToken>) -> RequestToken {
        self.requests.get_or_create(current)
    }

    /// Whether `token` still names a request state (not released, not reset).
    pub fn is_live_request(&self, token: RequestToken) -> bool {
        self.requests.get(token).is_some()
    }

    /// Whether the live request still waits for its retention hint (a caller reads a request's
    /// hint once, when it first sees the request).
    pub fn wants_retention_hint(&self, token: RequestToken) -> bool {
        self.requests.get(token).is_some_and(|r| !r.hint_given)
    }

    /// The request's retention hint (`None`: it has none), given once; later calls, and calls
    /// for a stale token, change nothing. It is counted now, and handed to the policy right
    /// before the policy first sees the request (its first observed or inserted key, or its
    /// finish), so a policy decides alike under this manager and under vLLM's.
    pub fn set_retention_hint(&mut self, token: RequestToken, hint: Option<RetentionHint>) {
        let Some(req) = self.requests.get_mut(token).filter(|r| !r.hint_given) else {
            return;
        };
        req.hint_given = true;
        if hint.is_some() {
            self.hints.hinted_requests += 1;
        }
        req.pending_hint = hint;
    }

    /// A caller found a retention hint it could not read and ignored it.
    pub fn note_ignored_hint(&mut self) {
        self.hints.ignored_hints += 1;
    }

    /// The request's context is gone: drop its state (and the policy's).
    pub fn release_request(&mut self, token: RequestToken) {
        if let Some(mut access) = self.requests.release(token) {
            self.policy
                .release_request(std::mem::take(&mut access.policy_state));
            self.requests.recycle(access);
        }
    }

    /// Whether `prepare_load` (`load`) or `prepare_store` of `keys` would be refused for
    /// reasons that do not depend on the request (an absent or pending chunk; a key offered
    /// twice). A caller about to create a request's state checks first, so that a refused
    /// first call leaves no state behind.
    pub fn check_request_call(&self, keys: &[Key<'_>], load: bool) -> CoreResult<()> {
        if !load {
            return unique_in(keys, &mut hashbrown::HashTable::new());
        }
        for (&key, found) in keys.iter().zip(self.policy.find_many(keys)) {
            self.loadable(key, found)?;
        }
        Ok(())
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

    fn check_unique(&mut self, keys: &[Key<'_>]) -> CoreResult<()> {
        unique_in(keys, &mut self.scratch.offer)
    }

    /// vLLM asserts no new key is observed once a request finished.
    fn check_not_finished<'k>(
        &self,
        token: RequestToken,
        mut recorded: impl Iterator<Item = Key<'k>>,
    ) -> CoreResult<()> {
        let req = self.requests.get(token).ok_or(CoreError::StaleRequest)?;
        if req.finished && recorded.any(|k| req.find(k).is_none()) {
            return Err(CoreError::RequestFinished);
        }
        Ok(())
    }

    /// vLLM's `_record_request_cache_access`: new keys join the request's key groups and are
    /// shown to the policy. Returns each recorded key's entry in the request. `observed`
    /// receives the offer indices of newly observed keys.
    fn record_access(
        &mut self,
        token: RequestToken,
        recorded: &[Recorded<'_>],
        observed: &mut Vec<usize>,
    ) -> Vec<crate::slab::Idx> {
        let req = self.requests.get_mut(token).expect("checked by the caller");
        if req.num_keys() == 0 {
            req.reserve(&self.hasher, recorded.len());
        }
        let mut entries = Vec::with_capacity(recorded.len());
        let mut new_keys = Vec::new();
        for r in recorded {
            let (entry, new) = req.observe(&self.hasher, r.key, r.resident);
            if new {
                new_keys.push(Observed {
                    key: r.key,
                    id: r.resident,
                    position: r.position,
                });
                observed.push(r.offer_index);
            }
            entries.push(entry);
        }
        if !new_keys.is_empty() {
            req.hand_hint(&mut self.policy);
            self.policy
                .on_request_access(&mut req.policy_state, &new_keys);
        }
        entries
    }

    /// Pins ready chunks for reading; returns their chunk ids. `observed` receives the offer
    /// indices of keys the request sees for the first time, in the order it records them (the
    /// order of the indices [`finish_request`](Self::finish_request) passes back).
    pub fn prepare_load(
        &mut self,
        token: RequestToken,
        keys: &[Key<'_>],
        positions: &[Option<i64>],
        observed: &mut Vec<usize>,
    ) -> CoreResult<Vec<ChunkId>> {
        debug_assert_eq!(keys.len(), positions.len());
        let mut recorded = Vec::with_capacity(keys.len());
        let mut chunks = Vec::with_capacity(keys.len());
        let resolved = self.policy.find_many(keys);
        for (i, ((&key, &position), &found)) in
            keys.iter().zip(positions).zip(&resolved).enumerate()
        {
            let (handle, chunk) = self.loadable(key, found)?;
            recorded.push(Recorded {
                offer_index: i,
                key,
                resident: Some(handle),
                ghost: None,
                position,
            });
            chunks.push(chunk);
        }
        self.check_not_finished(token, keys.iter().copied())?;
        for (r, &chunk) in recorded.iter().zip(&chunks) {
            self.pin(r.resident.expect("loads are resident"), chunk);
        }
        let entries = self.record_access(token, &recorded, observed);
        let req = self.requests.get_mut(token).expect("checked above");
        for e in entries {
            if req.flags(e) & INSERTED == 0 {
                req.set(e, REUSED);
            }
        }
        Ok(chunks)
    }

    /// One more reader of a ready chunk: a chunk nobody read becomes non-evictable.
    fn pin(&mut self, handle: EntryId, chunk: ChunkId) {
        let record = self.table.record(chunk);
        let cnt = record.ref_cnt();
        if cnt == 0 {
            debug_assert_ne!(self.policy.evictable(handle), Some(false));
            self.policy.set_evictable(handle, false);
            self.num_evictable -= 1;
        }
        record.set_ref_cnt(cnt + 1);
    }

    /// vLLM 0.33's `touch`: marks keys recently used. vLLM 0.34 has no `touch`.
    pub fn touch(&mut self, keys: &[Key<'_>]) -> CoreResult<()> {
        if !self.config.semantics.has_touch() {
            return Err(CoreError::Unsupported {
                what: "touch",
                semantics: self.config.semantics.name(),
            });
        }
        self.policy.touch_keys(keys, &self.table);
        Ok(())
    }

    /// Tells the policy when each resident key of `keys` is used next (`next_uses[i]`, a
    /// request index; `u64::MAX`: never). Absent keys are skipped. Only an offline caller
    /// knows this; online policies ignore it.
    pub fn hint_next_uses(&mut self, keys: &[Key<'_>], next_uses: &[u64]) {
        debug_assert_eq!(keys.len(), next_uses.len());
        let resolved = self.policy.find_many(keys);
        for (found, &next) in resolved.into_iter().zip(next_uses) {
            if let Some((id, _)) = self.resident(found) {
                self.policy.hint_next_use(id, next);
            }
        }
    }

    /// Unpins chunks after their loads finished.
    pub fn complete_load(&mut self, keys: &[Key<'_>]) -> CoreResult<()> {
        // Checked and applied in one pass, undone if a key fails: a key named twice unpins
        // twice, and must have been pinned twice. `zeroed`: this unpin made the count 0.
        let mut done: Vec<(EntryId, ChunkId, bool)> = Vec::with_capacity(keys.len());
        let undo = |table: &ChunkTable, done: &[(EntryId, ChunkId, bool)]| {
            for &(_, chunk, _) in done.iter().rev() {
                let record = table.record(chunk);
                record.set_ref_cnt(record.ref_cnt() + 1);
            }
        };
        let resolved = self.policy.find_many(keys);
        for (&key, &found) in keys.iter().zip(&resolved) {
            let Some((handle, chunk)) = self.resident(found) else {
                undo(&self.table, &done);
                return Err(CoreError::KeyNotFound(KeyBuf::new(key.bytes)));
            };
            let record = self.table.record(chunk);
            let cnt = record.ref_cnt();
            if cnt <= 0 {
                undo(&self.table, &done);
                return Err(CoreError::NoLoadPending(KeyBuf::new(key.bytes)));
            }
            record.set_ref_cnt(cnt - 1);
            done.push((handle, chunk, cnt == 1));
        }
        for (handle, _, zeroed) in done {
            if zeroed {
                self.num_evictable += 1;
                self.policy.set_evictable(handle, true);
            }
        }
        Ok(())
    }

    /// Decides which offered keys to store, evicting to make room; `None` when it cannot.
    /// `positions[i]` is the token position of `keys[i]` in the request; `observed` as for
    /// [`prepare_load`](Self::prepare_load).
    pub fn prepare_store(
        &mut self,
        token: RequestToken,
        keys: &[Key<'_>],
        positions: &[Option<i64>],
        observed: &mut Vec<usize>,
    ) -> CoreResult<Option<StoreOutput>> {
        debug_assert_eq!(keys.len(), positions.len());
        self.check_unique(keys)?;
        // vLLM 0.34: which keys an earlier offer of this request counted toward the
        // threshold (they do not count again, and are not skipped stores again).
        let counted: Vec<bool> =
            if self.tracker.is_some() && self.config.semantics.counts_once_per_request() {
                let req = self.requests.get(token).ok_or(CoreError::StaleRequest)?;
                keys.iter().map(|&k| req.is_counted(k)).collect()
            } else {
                Vec::new()
            };
        let was_counted = |i: usize| counted.get(i).copied().unwrap_or(false);
        // Each key is looked up once. Recorded: store candidates (not resident; `ghost` is
        // any entry the policy keeps for them) and ready resident keys, in offer order.
        let mut recorded: Vec<Recorded<'_>> = Vec::with_capacity(keys.len());
        let mut protected = Vec::new();
        let mut skipped = 0u64;
        let tracker = self.tracker.as_ref();
        let resolved = self.policy.find_many(keys);
        for (i, ((&key, &position), &entry)) in
            keys.iter().zip(positions).zip(&resolved).enumerate()
        {
            if let Some((id, chunk)) = self.resident(entry) {
                if self.table.record(chunk).ref_cnt() >= 0 {
                    // A chunk this offer names must stay cached.
                    protected.push(id);
                    recorded.push(Recorded {
                        offer_index: i,
                        key,
                        resident: Some(id),
                        ghost: None,
                        position,
                    });
                }
                continue;
            }
            // After this offer is recorded, a tracked candidate counts one more (unless this
            // request counted it already); an untracked one at most 1, below any threshold
            // >= 2.
            if let Some(t) = tracker {
                let c = t.count(key);
                let after = i64::from(c) + i64::from(!was_counted(i));
                if c == 0 || after < self.config.store_threshold {
                    skipped += u64::from(!was_counted(i));
                    continue;
                }
            }
            recorded.push(Recorded {
                offer_index: i,
                key,
                resident: None,
                ghost: entry,
                position,
            });
        }
        self.check_not_finished(token, recorded.iter().map(|r| r.key))?;
        let num_to_store = recorded.iter().filter(|r| r.resident.is_none()).count();
        if num_to_store <= self.table.num_free() + self.num_evictable {
            self.table.reserve(num_to_store)?;
        }

        // Nothing can fail from here on.
        if let Some(tracker) = &mut self.tracker {
            tracker.record(keys, was_counted);
            self.stores_skipped += skipped;
        }
        if !counted.is_empty() {
            let req = self.requests.get_mut(token).expect("checked above");
            req.count(&self.hasher, keys);
        }
        let entries = self.record_access(token, &recorded, observed);
        let req = self.requests.get_mut(token).expect("checked above");
        // ARC learns from B1/B2 before insert() drops the ghost; once per key and request.
        let new_misses: Vec<Option<EntryId>> = recorded
            .iter()
            .zip(&entries)
            .filter(|&(r, &e)| r.resident.is_none() && req.flags(e) & STORE_MISS == 0)
            .map(|(r, _)| r.ghost)
            .collect();
        for (r, &e) in recorded.iter().zip(&entries) {
            if r.resident.is_none() {
                req.set(e, STORE_MISS);
            } else if req.flags(e) & INSERTED == 0 {
                req.set(e, REUSED);
            }
        }
        if !new_misses.is_empty() {
            self.policy
                .on_store_miss(&new_misses, &self.table, self.config.semantics);
        }

        if num_to_store == 0 {
            return Ok(Some(StoreOutput::default()));
        }
        self.allocation_sizes.push(num_to_store);
        let mut evicted = Vec::new();
        let needed = num_to_store.saturating_sub(self.table.num_free());
        if needed > 0 {
            if needed > self.num_evictable {
                return Ok(None);
            }
            let protected = Protected::from_ids(protected);
            let Some(victims) = self.policy.evict(needed, &protected, &self.table) else {
                return Ok(None);
            };
            self.num_evictable -= victims.len();
            evicted.reserve(victims.len());
            for victim in victims {
                self.table.free(victim.chunk);
                evicted.push(victim.key);
            }
        }
        if !evicted.is_empty() {
            if let Some(events) = &mut self.events {
                events.push(Event {
                    keys: evicted.clone(),
                    removed: true,
                    metadata_only: false,
                    removal_expected: false,
                });
            }
        }
        let chunk_ids = self.table.allocate(num_to_store);
        let req = self.requests.get_mut(token).expect("checked above");
        let mut stored = Vec::with_capacity(num_to_store);
        let stores = recorded
            .iter()
            .zip(&entries)
            .filter(|(r, _)| r.resident.is_none());
        req.hand_hint(&mut self.policy);
        for ((r, &e), &chunk) in stores.zip(&chunk_ids) {
            // A new chunk is pending (ref_cnt −1), so not evictable yet.
            let handle = self.policy.insert(
                &mut req.policy_state,
                r.ghost,
                r.key,
                chunk,
                r.position,
                false,
            );
            req.set(e, INSERTED);
            req.set_handle(e, handle);
            stored.push(r.offer_index);
        }
        self.num_write_pending += num_to_store;
        Ok(Some(StoreOutput {
            stored,
            chunk_ids,
            evicted,
        }))
    }

    /// Marks pending stores done: ready and evictable on success, dropped on failure. Keys that
    /// are absent or already ready are ignored. Returns how many keys it completed (with
    /// events on, they make one event).
    pub fn complete_store(&mut self, keys: &[Key<'_>], success: bool) -> usize {
        let mut completed = 0;
        let mut done = Vec::new();
        let resolved = self.policy.find_many(keys);
        for (&key, &found) in keys.iter().zip(&resolved) {
            // Checked against the key: a failed store of a key named twice removed it.
            let Some(handle) = found.filter(|&h| self.policy.is_entry_of(h, key.bytes)) else {
                continue;
            };
            let Some(&chunk) = self.policy.chunk(handle) else {
                continue;
            };
            if self.table.record(chunk).ref_cnt() >= 0 {
                continue;
            }
            self.num_write_pending -= 1;
            completed += 1;
            if success {
                self.table.record(chunk).set_ref_cnt(0);
                self.num_evictable += 1;
                self.policy.set_evictable(handle, true);
            } else {
                self.policy.remove(handle);
                self.table.free(chunk);
            }
            if self.events.is_some() {
                done.push(KeyBuf::new(key.bytes));
            }
        }
        if let (Some(events), false) = (&mut self.events, done.is_empty()) {
            events.push(Event {
                keys: done,
                removed: !success,
                metadata_only: !success,
                removal_expected: success && self.config.semantics.stored_events_expect_removal(),
            });
        }
        completed
    }

    /// The keys a request observed, in the order [`finish_request`](Self::finish_request) asks
    /// for their positions; `None` if the request is unknown or already finished (then
    /// finishing it changes nothing).
    pub fn unfinished_request_keys(&self, token: RequestToken) -> Option<Vec<&[u8]>> {
        let req = self.requests.get(token).filter(|r| !r.finished)?;
        Some(req.keys_in_order().map(|k| k.key.as_slice()).collect())
    }

    /// How many keys an unfinished request observed (see
    /// [`unfinished_request_keys`](Self::unfinished_request_keys)).
    pub fn unfinished_request_len(&self, token: RequestToken) -> Option<usize> {
        let req = self.requests.get(token).filter(|r| !r.finished)?;
        Some(req.num_keys())
    }

    /// Applies the finished request's accesses to the policy, once. `positions[i]` is the
    /// token position of the request's `i`-th observed key (missing entries: unknown).
    pub fn finish_request(&mut self, token: RequestToken, positions: &[Option<i64>]) {
        let Some(req) = self.requests.get(token) else {
            return;
        };
        if req.finished {
            return;
        }
        // vLLM's order_request_keys: key groups by group index, each in first-seen order and
        // sorted by position when all its keys have one; across groups by position when every
        // key has one (stable, so ties keep the group order).
        let mut ordered: Vec<Finished> = Vec::with_capacity(req.num_keys());
        let mut all_positioned = true;
        let mut one_group = true;
        for (i, k) in req.keys_in_order().enumerate() {
            let position = positions.get(i).copied().flatten();
            all_positioned &= position.is_some();
            one_group &= k.group == ordered.first().map_or(k.group, |f: &Finished| f.group);
            let key = k.key.as_slice();
            let cached = k.handle.filter(|&h| self.policy.is_entry_of(h, key));
            let handle = cached
                .or_else(|| {
                    self.policy.find(Key {
                        bytes: key,
                        hash: k.hash,
                    })
                })
                .filter(|&h| self.policy.chunk(h).is_some());
            let access = if !P::READS_ACCESS {
                Access::Other
            } else if k.flags & REUSED != 0 {
                Access::Reused
            } else if k.flags & INSERTED != 0 {
                Access::InsertionOnly
            } else {
                Access::Other
            };
            ordered.push(Finished {
                group: k.group,
                position,
                handle,
                access,
            });
        }
        if all_positioned {
            // Usually in prefix order already (then the stable sort would change nothing).
            if !ordered.is_sorted_by_key(|f| (f.position, f.group)) {
                ordered.sort_by_key(|f| (f.position, f.group));
            }
        } else {
            if !one_group {
                ordered.sort_by_key(|f| f.group);
            }
            for run in ordered.chunk_by_mut(|a, b| a.group == b.group) {
                if run.iter().all(|f| f.position.is_some()) {
                    run.sort_by_key(|f| f.position);
                }
            }
        }
        let accesses: Vec<(Option<EntryId>, Access)> =
            ordered.iter().map(|f| (f.handle, f.access)).collect();
        let req = self.requests.get_mut(token).expect("checked above");
        req.hand_hint(&mut self.policy);
        self.policy
            .on_request_finished(&mut req.policy_state, &accesses);
        req.finished = true;
    }

    /// Takes the events collected so far. A failed store's cleanup only names keys no retry
    /// has stored again since.
    pub fn take_events(&mut self) -> Vec<Event> {
        let Some(events) = &mut self.events else {
            return Vec::new();
        };
        let events = std::mem::take(events);
        events
            .into_iter()
            .filter_map(|mut e| {
                if e.metadata_only {
                    e.keys.retain(|k| {
                        self.policy
                            .get(Key::new(&self.hasher, k.as_slice()))
                            .is_none()
                    });
                    if e.keys.is_empty() {
                        return None;
                    }
                }
                Some(e)
            })
            .collect()
    }

    /// Puts back events a caller took but could not deliver, in front of those collected
    /// since: the next [`take_events`](Self::take_events) returns them first (and filters a
    /// failed store's cleanup again).
    pub fn requeue_events(&mut self, mut events: Vec<Event>) {
        if let Some(queue) = &mut self.events {
            events.append(queue);
            *queue = events;
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

    /// vLLM's `get_stats`: usage gauges, and the allocation sizes and skipped stores since the
    /// last call (which this call resets).
    pub fn take_stats(&mut self) -> Stats {
        let n = self.table.num_chunks();
        let used = self.table.num_resident() - self.num_evictable;
        let usage = ratio(used, n);
        let write_usage = ratio(self.num_write_pending, n);
        let stores_skipped = self
            .tracker
            .is_some()
            .then(|| std::mem::take(&mut self.stores_skipped));
        let kept_hits = self.policy.hint_kept_hits();
        let hints = std::mem::take(&mut self.hints);
        self.hints.kept_hits_taken = kept_hits;
        Stats {
            usage,
            write_usage,
            read_usage: f64::max(usage - write_usage, 0.0),
            allocation_sizes: std::mem::take(&mut self.allocation_sizes),
            stores_skipped,
            hinted_requests: hints.hinted_requests,
            ignored_hints: hints.ignored_hints,
            hint_kept_hits: kept_hits.saturating_sub(hints.kept_hits_taken),
        }
    }

    pub fn memory_usage(&self) -> MemoryUsage {
        MemoryUsage {
            policy: self.policy.heap_bytes(),
            table: self.table.heap_bytes(),
            tracker: self.tracker.as_ref().map_or(0, |t| t.heap_bytes()),
            requests: self.requests.heap_bytes(),
        }
    }

    /// Checks the manager's invariants and its policy's.
    #[cfg(any(test, feature = "validate"))]
    pub fn validate(&self) -> Result<(), String> {
        self.policy.validate()?;
        let n = self.table.num_chunks();
        let resident = self.table.num_resident();
        if resident != self.policy.len() + self.deferred.len() {
            return Err(format!(
                "{resident} chunks allocated, policy holds {} and {} are deferred",
                self.policy.len(),
                self.deferred.len()
            ));
        }
        if let Some(c) = self
            .deferred
            .iter()
            .find(|&&c| self.table.record(c).ref_cnt() != PENDING)
        {
            return Err(format!("deferred chunk {c} is not write-pending"));
        }
        let (mut evictable, mut pending, mut used) = (0, 0, 0);
        for (id, r) in self.table.records().iter().enumerate() {
            let cnt = r.ref_cnt();
            if usize::try_from(r.chunk_id()).ok() != Some(id) {
                return Err(format!("record {id} has the wrong chunk id"));
            }
            match cnt {
                FREE => {}
                PENDING => pending += 1,
                0 => evictable += 1,
                c if c > 0 => {}
                c => return Err(format!("chunk {id} has ref_cnt {c}")),
            }
            if cnt != FREE {
                used += 1;
            }
        }
        if used != resident {
            return Err(format!("{used} records in use, {resident} chunks resident"));
        }
        if evictable != self.num_evictable || pending != self.num_write_pending {
            return Err(format!(
                "counts evictable {}/{evictable}, pending {}/{pending} disagree with the table",
                self.num_evictable, self.num_write_pending
            ));
        }
        if self.table.num_free() + resident != n {
            return Err("free and resident chunks do not add up".into());
        }
        Ok(())
    }
}

/// Refuses an offer that names a key twice (`table` is scratch space).
fn unique_in(keys: &[Key<'_>], table: &mut hashbrown::HashTable<usize>) -> CoreResult<()> {
    if keys.len() < 2 {
        return Ok(());
    }
    table.clear();
    table.reserve(keys.len(), |&j| keys[j].hash.0);
    for (i, key) in keys.iter().enumerate() {
        let entry = table.entry(
            key.hash.0,
            |&j| keys[j].bytes == key.bytes,
            |&j| keys[j].hash.0,
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(_) => {
                return Err(CoreError::DuplicateInOffer(KeyBuf::new(key.bytes)));
            }
            hashbrown::hash_table::Entry::Vacant(slot) => {
                slot.insert(i);
            }
        }
    }
    Ok(())
}

/// `part / whole` as vLLM computes its usage gauges (0 for an empty cache).
#[allow(
    clippy::cast_precision_loss,
    reason = "chunk counts are far below 2^53"
)]
fn ratio(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ArcPolicy, LruPolicy};

    fn failed_store_named_twice_frees_its_chunk_once<P: Policy<ChunkId>>() {
        let config = ManagerConfig {
            num_chunks: 4,
            enable_events: false,
            store_threshold: 1,
            max_tracker_size: 16,
            semantics: VllmSemantics::default(),
        };
        let bytes = [
            crate::testing::manager_key(1),
            crate::testing::manager_key(2),
        ];
        let mut m: Manager<P> = Manager::new(config).unwrap();
        let t = m.request(None);
        let ks: Vec<Key<'_>> = bytes.iter().map(|b| m.key(b)).collect();
        let out = m
            .prepare_store(t, &ks, &[None, None], &mut Vec::new())
            .unwrap()
            .unwrap();
        assert_eq!(out.chunk_ids, vec![0, 1]);
        let twice = [ks[0], ks[0], ks[1]];
        m.complete_store(&twice, false);
        m.validate().unwrap();
        assert_eq!(m.table().num_free(), 4);
        assert_eq!(m.policy().len(), 0);
    }

    #[test]
    fn a_failed_store_named_twice_frees_its_chunk_once() {
        failed_store_named_twice_frees_its_chunk_once::<LruPolicy<ChunkId>>();
        failed_store_named_twice_frees_its_chunk_once::<ArcPolicy<ChunkId>>();
    }

    #[test]
    fn a_huge_cache_is_refused_or_free_until_used() {
        let config = |num_chunks| ManagerConfig {
            num_chunks,
            enable_events: false,
            store_threshold: 1,
            max_tracker_size: 16,
            semantics: VllmSemantics::default(),
        };
        // 2^32 - 1 chunks: nothing per chunk up front (the key index is presized, capped).
        let m = Manager::<LruPolicy<ChunkId>>::new(config(MAX_CHUNKS)).unwrap();
        assert_eq!(m.memory_usage().table, 0);
        assert!(m.memory_usage().total() <= 64 << 20);
        assert!(matches!(
            Manager::<ArcPolicy<ChunkId>>::new(config(MAX_CHUNKS + 1)),
            Err(CoreError::TooManyChunks { .. })
        ));
    }
}
