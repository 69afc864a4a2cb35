//! ARC (adaptive replacement cache), decision-identical to vLLM 0.33.0's `ARCCachePolicy`.
//!
//! Four lists share one slab: T1 (resident, seen once), T2 (resident, reused), and the ghost
//! lists B1/B2 (keys recently evicted from T1/T2, no chunk). `target_t1_size` (a float in
//! `[0, capacity]`) moves up on a B1 hit and down on a B2 hit by
//! `max(1, |other ghost| / |this ghost|)`. Eviction takes from T1 while the simulated T1 size
//! is at least `int(target_t1_size)`, else from T2, else from T1 again, considering only
//! chunks with `ref_cnt == 0` that are not protected; the ghost lists are trimmed to the
//! capacity when an eviction commits.
//!
//! Complexity: `get`, `insert`, `remove`, and each key of `touch`, `on_store_miss` and
//! `on_request_finished` are O(1); planning an eviction of `n` is O(n + entries skipped)
//! (two monotonic cursors, like vLLM's iterators). Memory: one 64-byte, cache-line aligned slab
//! entry (40-byte inline key, links, list tag, chunk handle) plus ~5 bytes of hash table per
//! key, for resident and ghost keys alike.

use crate::chunk::RefCounts;
use crate::error::{CoreError, CoreResult};
use crate::eviction::{next_policy_id, Evicted, EvictionPlan, Protected};
use crate::index::{KeyIndex, Keyed};
use crate::key::{key_eq, Key, KeyBuf, KeyHasher};
use crate::slab::{Linked, Links, List, Slab, NIL};

/// Which ARC list an entry is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ListId {
    T1 = 0,
    T2 = 1,
    B1 = 2,
    B2 = 3,
}

impl ListId {
    pub const ALL: [ListId; 4] = [ListId::T1, ListId::T2, ListId::B1, ListId::B2];

    #[inline]
    pub fn is_resident(self) -> bool {
        matches!(self, ListId::T1 | ListId::T2)
    }
}

/// Cache-line aligned: an entry (64 bytes for `u32` chunk handles) never straddles two lines.
#[repr(align(64))]
pub struct ArcEntry<C> {
    key: KeyBuf,
    links: Links,
    list: ListId,
    /// `Some` exactly when the entry is resident (T1/T2).
    chunk: Option<C>,
}

impl<C> Linked for ArcEntry<C> {
    #[inline]
    fn links(&self) -> &Links {
        &self.links
    }
    #[inline]
    fn links_mut(&mut self) -> &mut Links {
        &mut self.links
    }
}

impl<C> Keyed for ArcEntry<C> {
    #[inline]
    fn key(&self) -> &[u8] {
        self.key.as_slice()
    }
}

/// How a request used a key, for [`ArcPolicy::on_request_finished`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Only stored by the request: restores recency, is not a frequency hit.
    InsertionOnly,
    /// Read by the request while ready: one frequency hit.
    Reused,
    /// Neither: ARC ignores it.
    Other,
}

pub struct ArcPolicy<C> {
    capacity: usize,
    target_t1_size: f64,
    slab: Slab<ArcEntry<C>>,
    index: KeyIndex,
    lists: [List; 4],
    hasher: KeyHasher,
    epoch: u64,
    id: u64,
}

impl<C> ArcPolicy<C> {
    pub fn new(capacity: usize) -> Self {
        ArcPolicy {
            capacity,
            target_t1_size: 0.0,
            slab: Slab::default(),
            index: KeyIndex::with_capacity(capacity),
            lists: [List::default(); 4],
            hasher: KeyHasher::global(),
            epoch: 0,
            id: next_policy_id(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn target_t1_size(&self) -> f64 {
        self.target_t1_size
    }

    pub fn hasher(&self) -> &KeyHasher {
        &self.hasher
    }

    #[inline]
    pub fn key<'a>(&self, bytes: &'a [u8]) -> Key<'a> {
        Key::new(&self.hasher, bytes)
    }

    pub fn list_len(&self, list: ListId) -> usize {
        self.lists[list as usize].len()
    }

    /// Resident entries (T1 + T2).
    pub fn len(&self) -> usize {
        self.list_len(ListId::T1) + self.list_len(ListId::T2)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keys of one list from LRU to MRU (for inspection and tests).
    pub fn list_keys(&self, list: ListId) -> impl Iterator<Item = &[u8]> + '_ {
        self.lists[list as usize]
            .iter(&self.slab)
            .map(|i| self.slab.get(i).key())
    }

    /// The list a key is on, if any.
    pub fn list_of(&self, key: Key<'_>) -> Option<ListId> {
        self.index
            .find(&self.slab, key)
            .map(|i| self.slab.get(i).list)
    }

    #[inline]
    pub fn get(&self, key: Key<'_>) -> Option<&C> {
        let idx = self.index.find(&self.slab, key)?;
        self.slab.get(idx).chunk.as_ref()
    }

    /// Resident chunks with their keys, T1 then T2, each from LRU to MRU.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &C)> + '_ {
        [ListId::T1, ListId::T2].into_iter().flat_map(move |l| {
            self.lists[l as usize].iter(&self.slab).map(move |i| {
                let e = self.slab.get(i);
                (
                    e.key(),
                    e.chunk.as_ref().expect("resident entry has a chunk"),
                )
            })
        })
    }

    #[inline]
    fn bump(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
    }

    #[inline]
    fn move_to(&mut self, idx: u32, to: ListId) {
        let from = self.slab.get(idx).list;
        if from == to {
            self.lists[to as usize].move_to_back(&mut self.slab, idx);
        } else {
            self.lists[from as usize].unlink(&mut self.slab, idx);
            self.lists[to as usize].push_back(&mut self.slab, idx);
            self.slab.get_mut(idx).list = to;
        }
    }

    /// Adds a new chunk at the MRU end of T1, forgetting any ghost of the key.
    pub fn insert(&mut self, key: Key<'_>, chunk: C) -> CoreResult<()> {
        match self.index.find(&self.slab, key) {
            Some(idx) if self.slab.get(idx).list.is_resident() => {
                Err(CoreError::DuplicateKey(KeyBuf::new(key.bytes)))
            }
            found => {
                self.insert_resolved(found.unwrap_or(NIL), key, chunk);
                Ok(())
            }
        }
    }

    /// [`insert`](Self::insert) for a key the caller resolved: `entry` is the key's ghost entry
    /// or [`NIL`] when the key is absent (no lookup is repeated). A handle that went stale since
    /// it was resolved (its ghost was trimmed) is detected by key and treated as absent. Returns the entry's handle.
    pub fn insert_resolved(&mut self, entry: u32, key: Key<'_>, chunk: C) -> u32 {
        self.bump();
        if self.handle_matches(entry, key.bytes) && !self.slab.get(entry).list.is_resident() {
            self.slab.get_mut(entry).chunk = Some(chunk);
            self.move_to(entry, ListId::T1);
            return entry;
        }
        debug_assert!(self.index.find(&self.slab, key).is_none());
        let idx = self.slab.insert(ArcEntry {
            key: KeyBuf::EMPTY,
            links: Links::default(),
            list: ListId::T1,
            chunk: Some(chunk),
        });
        // Written in place (see `KeyBuf::assign`), before the index may rehash it.
        self.slab.get_mut(idx).key.assign(key.bytes);
        self.index.insert(&self.slab, &self.hasher, key, idx);
        self.lists[ListId::T1 as usize].push_back(&mut self.slab, idx);
        idx
    }

    /// [`on_store_miss`](Self::on_store_miss) for resolved entries (`NIL`: absent), head to
    /// tail; walked tail to head.
    pub fn on_store_miss_resolved(&mut self, entries: &[u32]) {
        self.bump();
        for &idx in entries.iter().rev() {
            if idx != NIL {
                self.adapt_to_ghost_hit(idx);
            }
        }
    }

    /// Whether `handle` still names the entry of `key` (it may have been removed since it was
    /// resolved, and its slot reused).
    #[inline]
    pub fn handle_matches(&self, handle: u32, key: &[u8]) -> bool {
        self.slab
            .try_get(handle)
            .is_some_and(|e| key_eq(e.key(), key))
    }

    /// Drops a resident chunk (a failed store) without leaving a ghost.
    pub fn remove(&mut self, key: Key<'_>) -> CoreResult<C> {
        let idx = self
            .index
            .find(&self.slab, key)
            .ok_or_else(|| CoreError::KeyNotFound(KeyBuf::new(key.bytes)))?;
        let list = self.slab.get(idx).list;
        if !list.is_resident() {
            return Err(CoreError::KeyNotFound(KeyBuf::new(key.bytes)));
        }
        self.bump();
        Ok(self
            .delete(idx, list)
            .chunk
            .expect("resident entry has a chunk"))
    }

    fn delete(&mut self, idx: u32, list: ListId) -> ArcEntry<C> {
        self.lists[list as usize].unlink(&mut self.slab, idx);
        let removed = self
            .index
            .remove(&self.slab, Key::new(&self.hasher, self.slab.get(idx).key()));
        debug_assert_eq!(removed, Some(idx));
        self.slab.remove(idx)
    }

    /// Whether `key` is resident; an error otherwise (ARC keeps no evictable flag: `mark_*`
    /// only check the key exists).
    pub fn check_resident(&self, key: Key<'_>) -> CoreResult<()> {
        self.get(key)
            .map(|_| ())
            .ok_or_else(|| CoreError::KeyNotFound(KeyBuf::new(key.bytes)))
    }

    /// Moves `target_t1_size` on a ghost hit and refreshes the ghost; false if not a ghost.
    fn adapt_to_ghost_hit(&mut self, idx: u32) -> bool {
        let list = self.slab.get(idx).list;
        let (b1, b2) = (
            self.list_len(ListId::B1) as f64,
            self.list_len(ListId::B2) as f64,
        );
        match list {
            ListId::B1 => {
                let delta = f64::max(1.0, b2 / b1);
                self.target_t1_size = f64::min(self.target_t1_size + delta, self.capacity as f64);
            }
            ListId::B2 => {
                let delta = f64::max(1.0, b1 / b2);
                self.target_t1_size = f64::max(self.target_t1_size - delta, 0.0);
            }
            ListId::T1 | ListId::T2 => return false,
        }
        self.lists[list as usize].move_to_back(&mut self.slab, idx);
        true
    }

    /// Store misses, observed tail to head before their entries are inserted: a ghost hit
    /// adapts `target_t1_size`.
    pub fn on_store_miss(&mut self, keys: &[Key<'_>]) {
        self.bump();
        for idx in self.index.find_many(&self.slab, keys).into_iter().rev() {
            if idx != NIL {
                self.adapt_to_ghost_hit(idx);
            }
        }
    }

    /// Marks keys used, tail to head: ready T1 entries are promoted to T2, pending ones stay in
    /// T1 at MRU, T2 entries move to MRU, ghosts adapt the target.
    pub fn touch(&mut self, keys: &[Key<'_>], counts: &impl RefCounts<C>) {
        self.bump();
        let entries = self.index.find_many(&self.slab, keys);
        self.prefetch_moves(&entries, counts);
        for idx in entries.into_iter().rev() {
            if idx == NIL {
                continue;
            }
            let entry = self.slab.get(idx);
            match entry.list {
                ListId::T1 => {
                    let ready = counts.is_ready(entry.chunk.as_ref().expect("resident"));
                    self.move_to(idx, if ready { ListId::T2 } else { ListId::T1 });
                }
                ListId::T2 => self.move_to(idx, ListId::T2),
                ListId::B1 | ListId::B2 => {
                    self.adapt_to_ghost_hit(idx);
                }
            }
        }
    }

    /// Prefetches what moving these entries will touch: their chunks' counts and their list
    /// neighbours.
    fn prefetch_moves(&self, entries: &[u32], counts: &impl RefCounts<C>) {
        for &idx in entries {
            if idx != NIL {
                let e = self.slab.get(idx);
                if let Some(chunk) = &e.chunk {
                    counts.prefetch(chunk);
                }
                self.slab.prefetch(e.links.prev);
                self.slab.prefetch(e.links.next);
            }
        }
    }

    /// Resolves keys to entry handles ([`NIL`] when absent) in one pass; see
    /// [`KeyIndex::find_many`].
    pub fn resolve(&self, keys: &[Key<'_>]) -> Vec<u32> {
        self.index.find_many(&self.slab, keys)
    }

    /// The handle of a key's entry (resident or ghost): valid until that entry is removed.
    #[inline]
    pub fn find(&self, key: Key<'_>) -> Option<u32> {
        self.index.find(&self.slab, key)
    }

    /// The chunk of an entry (None for a ghost).
    #[inline]
    pub fn chunk_at(&self, handle: u32) -> Option<&C> {
        self.slab.get(handle).chunk.as_ref()
    }

    /// Removes a resident entry by handle (no ghost is left).
    pub fn remove_at(&mut self, handle: u32) -> C {
        self.bump();
        let list = self.slab.get(handle).list;
        debug_assert!(list.is_resident());
        self.delete(handle, list)
            .chunk
            .expect("handles name resident entries")
    }

    /// Whether a resolved handle names a resident entry.
    pub fn is_resident(&self, idx: u32) -> bool {
        idx != NIL && self.slab.get(idx).list.is_resident()
    }

    /// Applies one finished request's accesses, walking its entries (resolved with
    /// [`resolve`](Self::resolve) since the last change, in head-to-tail order) from tail to
    /// head.
    pub fn on_request_finished(&mut self, keys: &[(u32, Access)]) {
        self.bump();
        for &(idx, access) in keys {
            if idx != NIL && access != Access::Other {
                let e = self.slab.get(idx);
                self.slab.prefetch(e.links.prev);
                self.slab.prefetch(e.links.next);
            }
        }
        for &(idx, access) in keys.iter().rev() {
            if access == Access::Other || idx == NIL {
                continue;
            }
            let list = self.slab.get(idx).list;
            match (access, list) {
                (Access::InsertionOnly, ListId::T1 | ListId::T2) => self.move_to(idx, list),
                (Access::Reused, ListId::T1 | ListId::T2) => self.move_to(idx, ListId::T2),
                _ => {}
            }
        }
    }

    /// Resolves keys to the entries an eviction must skip (non-resident keys are ignored).
    pub fn protect<'k>(&self, keys: impl IntoIterator<Item = Key<'k>>) -> Protected {
        self.index.protect(&self.slab, keys)
    }

    /// Chooses exactly `n` victims without changing anything, or `None` if there are fewer
    /// than `n` idle, unprotected resident chunks.
    pub fn plan_eviction(
        &self,
        n: usize,
        protected: &Protected,
        counts: &impl RefCounts<C>,
    ) -> Option<EvictionPlan> {
        let mut victims = Vec::with_capacity(n);
        let mut virtual_t1_size = self.list_len(ListId::T1) as i64;
        // `int()` of a non-negative float truncates, i.e. floors.
        let target = self.target_t1_size as i64;
        let mut t1 = self.lists[ListId::T1 as usize].head();
        let mut t2 = self.lists[ListId::T2 as usize].head();
        let next_candidate = |cursor: &mut u32| -> Option<u32> {
            while *cursor != NIL {
                let idx = *cursor;
                let entry = self.slab.get(idx);
                *cursor = entry.links.next;
                let chunk = entry.chunk.as_ref().expect("resident entry has a chunk");
                if counts.ref_cnt(chunk) == 0 && !protected.contains(idx) {
                    return Some(idx);
                }
            }
            None
        };
        for _ in 0..n {
            let mut victim = None;
            if virtual_t1_size >= target {
                victim = next_candidate(&mut t1);
                if victim.is_some() {
                    virtual_t1_size -= 1;
                }
            }
            if victim.is_none() {
                victim = next_candidate(&mut t2);
            }
            if victim.is_none() {
                victim = Some(next_candidate(&mut t1)?);
                virtual_t1_size -= 1;
            }
            victims.extend(victim);
        }
        Some(EvictionPlan {
            victims,
            epoch: self.epoch,
            policy_id: self.id,
        })
    }

    /// Evicts the planned victims (T1 → B1, T2 → B2, in plan order), then trims both ghost
    /// lists to the capacity from their LRU ends.
    pub fn commit_eviction(&mut self, plan: EvictionPlan) -> CoreResult<Vec<Evicted<C>>> {
        if plan.epoch != self.epoch || plan.policy_id != self.id {
            return Err(CoreError::StalePlan);
        }
        self.bump();
        let mut evicted = Vec::with_capacity(plan.victims.len());
        for idx in plan.victims {
            let entry = self.slab.get_mut(idx);
            let chunk = entry.chunk.take().expect("planned victims are resident");
            let ghost = if entry.list == ListId::T1 {
                ListId::B1
            } else {
                ListId::B2
            };
            evicted.push(Evicted {
                key: entry.key.clone(),
                chunk,
            });
            self.move_to(idx, ghost);
        }
        for ghost in [ListId::B1, ListId::B2] {
            while self.list_len(ghost) > self.capacity {
                let oldest = self.lists[ghost as usize].head();
                self.delete(oldest, ghost);
            }
        }
        Ok(evicted)
    }

    /// `plan_eviction` + `commit_eviction`: exactly `n` victims, or `None` and no change.
    pub fn evict(
        &mut self,
        n: usize,
        protected: &Protected,
        counts: &impl RefCounts<C>,
    ) -> Option<Vec<Evicted<C>>> {
        let plan = self.plan_eviction(n, protected, counts)?;
        Some(
            self.commit_eviction(plan)
                .expect("a fresh plan is never stale"),
        )
    }

    /// Forgets everything: resident chunks, ghosts and the adaptive target.
    pub fn clear(&mut self) {
        self.bump();
        self.slab.clear();
        self.index = KeyIndex::with_capacity(self.capacity);
        self.lists = [List::default(); 4];
        self.target_t1_size = 0.0;
    }

    /// Heap bytes held by the policy's own structures (slab, table, spilled keys).
    pub fn heap_bytes(&self) -> usize {
        let spilled: usize = self.slab.iter().map(|(_, e)| e.key.heap_bytes()).sum();
        self.slab.allocation_size() + self.index.allocation_size() + spilled
    }

    /// Checks every structural invariant; `Err` names the first one broken.
    #[cfg(any(test, fuzzing, feature = "validate"))]
    pub fn validate(&self, counts: &impl RefCounts<C>) -> Result<(), String> {
        let _ = counts;
        let mut total = 0;
        for list in ListId::ALL {
            let members = self.lists[list as usize].validate(&self.slab)?;
            for idx in &members {
                let e = self.slab.get(*idx);
                if e.list != list {
                    return Err(format!(
                        "{:?} is on {list:?} but tagged {:?}",
                        e.key, e.list
                    ));
                }
                if e.chunk.is_some() != list.is_resident() {
                    return Err(format!("{:?} on {list:?}: chunk presence is wrong", e.key));
                }
                if self.index.find(&self.slab, Key::new(&self.hasher, e.key())) != Some(*idx) {
                    return Err(format!("{:?} is not indexed at its slot", e.key));
                }
            }
            total += members.len();
        }
        if total != self.slab.len() || total != self.index.len() {
            return Err(format!(
                "lists hold {total} entries, slab {}, index {}",
                self.slab.len(),
                self.index.len()
            ));
        }
        for ghost in [ListId::B1, ListId::B2] {
            if self.list_len(ghost) > self.capacity {
                return Err(format!(
                    "{ghost:?} holds {} > capacity {}",
                    self.list_len(ghost),
                    self.capacity
                ));
            }
        }
        if !(0.0..=self.capacity as f64).contains(&self.target_t1_size) {
            return Err(format!(
                "target_t1_size {} outside [0, {}]",
                self.target_t1_size, self.capacity
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{SelfCounted, TestChunk};

    #[test]
    fn an_entry_fills_exactly_one_cache_line() {
        assert_eq!(std::mem::size_of::<ArcEntry<u32>>(), 64);
        assert_eq!(std::mem::align_of::<ArcEntry<u32>>(), 64);
    }

    fn keys<'a>(p: &ArcPolicy<TestChunk>, raw: &'a [&'a [u8]]) -> Vec<Key<'a>> {
        raw.iter().map(|k| p.key(k)).collect()
    }

    fn lists(p: &ArcPolicy<TestChunk>) -> Vec<Vec<Vec<u8>>> {
        ListId::ALL
            .iter()
            .map(|&l| p.list_keys(l).map(|k| k.to_vec()).collect())
            .collect()
    }

    #[test]
    fn eviction_goes_to_ghosts_and_ghost_hits_adapt() {
        let mut p = ArcPolicy::new(2);
        for (i, k) in [b"a", b"b", b"c"].iter().enumerate() {
            p.insert(p.key(*k), TestChunk::new(i as u64, 0)).unwrap();
        }
        p.touch(&keys(&p, &[b"a"]), &SelfCounted);
        assert_eq!(lists(&p)[1], vec![b"a".to_vec()]);
        let out = p.evict(2, &Protected::new(), &SelfCounted).unwrap();
        assert_eq!(
            out.iter().map(|e| e.key.as_slice()).collect::<Vec<_>>(),
            [b"b", b"c"]
        );
        assert_eq!(lists(&p)[2], vec![b"b".to_vec(), b"c".to_vec()]);
        p.on_store_miss(&keys(&p, &[b"b"]));
        assert_eq!(p.target_t1_size(), 1.0);
        p.validate(&SelfCounted).unwrap();
    }

    #[test]
    fn failed_eviction_changes_nothing() {
        let mut p = ArcPolicy::new(4);
        p.insert(p.key(b"a"), TestChunk::new(0, 0)).unwrap();
        p.insert(p.key(b"b"), TestChunk::new(1, 1)).unwrap();
        let before = lists(&p);
        assert!(p.evict(2, &Protected::new(), &SelfCounted).is_none());
        let protected = p.protect([p.key(b"a")]);
        assert!(p.evict(1, &protected, &SelfCounted).is_none());
        assert_eq!(lists(&p), before);
    }

    #[test]
    fn stale_plans_are_refused() {
        let mut p = ArcPolicy::new(4);
        p.insert(p.key(b"a"), TestChunk::new(0, 0)).unwrap();
        let plan = p.plan_eviction(1, &Protected::new(), &SelfCounted).unwrap();
        p.touch(&keys(&p, &[b"a"]), &SelfCounted);
        assert_eq!(p.commit_eviction(plan).unwrap_err(), CoreError::StalePlan);
        assert_eq!(p.len(), 1);
    }
}
