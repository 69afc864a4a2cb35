//! LRU with logical recency independent of pinning, decision-identical to vLLM 0.33.0's
//! `LRUCachePolicy`.
//!
//! Every resident key has a rank `(rank, position)`, ordered by `rank` ascending then
//! `position` descending (vLLM's tuple `(rank, -position)`), ties broken by the key bytes.
//! `touch` and `on_request_finished` give keys fresh ranks from a counter (the largest rank so
//! far); a request's `insert`/`on_request_access` give its keys a provisional rank shared by the
//! whole request (allocated from the same counter when the request is first seen) so that its
//! tails precede its heads. Eviction takes the smallest ranks among keys marked evictable
//! (`mark_evictable`, or inserted with `ref_cnt == 0`), skipping protected keys.
//!
//! vLLM keeps a lazily invalidated heap. Here every resident key sits on one list kept in rank
//! order: a fresh rank is always the largest, so those keys append at the tail in O(1). A
//! request rank `R` gets an *anchor* node appended when `R` is allocated; the request's keys sit
//! right after it, ordered by position through a small per-request map of position runs
//! (O(log k) for a request holding k keys). The anchor stays while the request can still rank
//! keys; its owner releases it ([`LruPolicy::release_request_rank`]) when the request state dies.
//! Eviction walks the list from the head: O(n + entries skipped). Memory: one slab entry
//! (40-byte inline key, links, rank, position, flags, chunk handle) plus ~5 bytes of hash table
//! per key; one anchor and one map per live request.

use std::collections::BTreeMap;

use hashbrown::HashMap;

use crate::chunk::RefCounts;
use crate::error::{CoreError, CoreResult};
use crate::eviction::{next_policy_id, Evicted, EvictionPlan, Protected};
use crate::index::{KeyIndex, Keyed};
use crate::key::{key_eq, Key, KeyBuf, KeyHasher};
use crate::slab::{Linked, Links, List, Slab, NIL};

/// A request's provisional rank, valid for one cache generation (until `clear`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestRank {
    pub generation: u64,
    pub rank: u64,
}

/// Where `insert` ranks a new key.
#[derive(Clone, Copy, Debug)]
pub enum InsertRank {
    /// No token position known: a fresh rank (most recent).
    Fresh,
    /// The storing request's rank, at the key's token position.
    Request(RequestRank, i64),
}

const ANCHOR: u8 = 1;
const IN_GROUP: u8 = 2;
const EVICTABLE: u8 = 4;

pub struct LruEntry<C> {
    key: KeyBuf,
    links: Links,
    rank: u64,
    pos: i64,
    /// The request group (members and anchors), else `NIL`.
    group: u32,
    flags: u8,
    /// `None` only for anchors.
    chunk: Option<C>,
}

impl<C> LruEntry<C> {
    #[inline]
    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

impl<C> Linked for LruEntry<C> {
    #[inline]
    fn links(&self) -> &Links {
        &self.links
    }
    #[inline]
    fn links_mut(&mut self) -> &mut Links {
        &mut self.links
    }
}

impl<C> Keyed for LruEntry<C> {
    #[inline]
    fn key(&self) -> &[u8] {
        self.key.as_slice()
    }
}

/// Consecutive members of a group sharing one position.
#[derive(Clone, Copy, Debug)]
struct Run {
    first: u32,
    last: u32,
}

/// Insertions land at either end of a group in prefix-order traffic (O(1)); one that lands
/// farther than this from both ends builds the group's position index (O(log k) from then on).
const WALK_LIMIT: usize = 8;

/// The keys ranked by one request, contiguous on the list right after `anchor`, ordered by
/// position descending (ties: key bytes ascending).
struct Group {
    anchor: u32,
    rank: u64,
    /// First and last member (`NIL` when empty).
    first: u32,
    last: u32,
    len: u32,
    /// False once the request state is gone: no key can join any more.
    alive: bool,
    /// Position → run of members, built only once an insertion lands mid-group.
    index: Option<BTreeMap<i64, Run>>,
}

/// One resident key as reported by [`LruPolicy::entries`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankedEntry<'a> {
    pub key: &'a [u8],
    pub rank: u64,
    pub position: i64,
    pub evictable: bool,
}

pub struct LruPolicy<C> {
    capacity: usize,
    slab: Slab<LruEntry<C>>,
    index: KeyIndex,
    order: List,
    groups: Slab<Group>,
    group_of_rank: HashMap<u64, u32, foldhash::fast::FixedState>,
    walk_limit: usize,
    next_rank: u64,
    generation: u64,
    hasher: KeyHasher,
    epoch: u64,
    id: u64,
}

impl<C> LruPolicy<C> {
    pub fn new(capacity: usize) -> Self {
        LruPolicy {
            capacity,
            slab: Slab::default(),
            index: KeyIndex::with_capacity(capacity),
            order: List::default(),
            groups: Slab::default(),
            group_of_rank: HashMap::default(),
            walk_limit: WALK_LIMIT,
            next_rank: 0,
            generation: 0,
            hasher: KeyHasher::global(),
            epoch: 0,
            id: next_policy_id(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn hasher(&self) -> &KeyHasher {
        &self.hasher
    }

    #[inline]
    pub fn key<'a>(&self, bytes: &'a [u8]) -> Key<'a> {
        Key::new(&self.hasher, bytes)
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Live request groups (anchors on the list).
    pub fn num_request_groups(&self) -> usize {
        self.groups.len()
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    #[inline]
    pub fn get(&self, key: Key<'_>) -> Option<&C> {
        let idx = self.index.find(&self.slab, key)?;
        self.slab.get(idx).chunk.as_ref()
    }

    pub fn is_evictable(&self, key: Key<'_>) -> Option<bool> {
        self.index
            .find(&self.slab, key)
            .map(|i| self.slab.get(i).has(EVICTABLE))
    }

    /// Resident keys in eviction order (ascending rank), evictable or not.
    pub fn entries(&self) -> impl Iterator<Item = RankedEntry<'_>> + '_ {
        self.order.iter(&self.slab).filter_map(move |i| {
            let e = self.slab.get(i);
            (!e.has(ANCHOR)).then_some(RankedEntry {
                key: e.key(),
                rank: e.rank,
                position: e.pos,
                evictable: e.has(EVICTABLE),
            })
        })
    }

    /// Resident chunks with their keys, in eviction order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &C)> + '_ {
        self.order.iter(&self.slab).filter_map(move |i| {
            let e = self.slab.get(i);
            e.chunk.as_ref().map(|c| (e.key(), c))
        })
    }

    #[inline]
    fn bump(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// The request's rank for this generation, allocating one (and its anchor) if `current` is
    /// missing or from before the last `clear`. Allocation consumes a rank exactly where vLLM's
    /// `_get_request_rank` does, so rank numbers match vLLM's.
    pub fn request_rank(&mut self, current: Option<RequestRank>) -> RequestRank {
        if let Some(rr) = current {
            if self.group_id(rr).is_some() {
                return rr;
            }
        }
        self.bump();
        self.next_rank += 1;
        let rank = self.next_rank;
        let anchor = self.slab.insert(LruEntry {
            key: KeyBuf::new(&[]),
            links: Links::default(),
            rank,
            pos: 0,
            group: NIL,
            flags: ANCHOR,
            chunk: None,
        });
        self.order.push_back(&mut self.slab, anchor);
        let gid = self.groups.insert(Group {
            anchor,
            rank,
            first: NIL,
            last: NIL,
            len: 0,
            alive: true,
            index: None,
        });
        self.slab.get_mut(anchor).group = gid;
        self.group_of_rank.insert(rank, gid);
        RequestRank {
            generation: self.generation,
            rank,
        }
    }

    /// Whether `rr` is still the rank of a live request (not released, not cleared).
    pub fn is_live_request_rank(&self, rr: RequestRank) -> bool {
        self.group_id(rr).is_some()
    }

    /// The group of a live request rank.
    fn group_id(&self, rr: RequestRank) -> Option<u32> {
        if rr.generation != self.generation {
            return None;
        }
        self.group_of_rank.get(&rr.rank).copied()
    }

    /// The request that owned `rr` is gone: no key can join its group any more, so its anchor
    /// can go once the group is empty.
    pub fn release_request_rank(&mut self, rr: RequestRank) {
        let Some(gid) = self.group_id(rr) else { return };
        let group = self.groups.get_mut(gid);
        group.alive = false;
        if group.len == 0 {
            self.bump();
            self.drop_group(gid);
        }
    }

    fn drop_group(&mut self, gid: u32) {
        let group = self.groups.remove(gid);
        self.group_of_rank.remove(&group.rank);
        self.order.unlink(&mut self.slab, group.anchor);
        self.slab.remove(group.anchor);
    }

    /// Takes `idx` off the list (and out of its group).
    fn detach(&mut self, idx: u32) {
        let e = self.slab.get(idx);
        if e.has(IN_GROUP) {
            let (gid, pos) = (e.group, e.pos);
            let Links { prev, next } = e.links;
            let group = self.groups.get_mut(gid);
            if let Some(index) = &mut group.index {
                let run = index.get_mut(&pos).expect("indexed member has a run");
                match (run.first == idx, run.last == idx) {
                    (true, true) => {
                        index.remove(&pos);
                    }
                    (true, false) => run.first = next,
                    (false, true) => run.last = prev,
                    (false, false) => {}
                }
            }
            match (group.first == idx, group.last == idx) {
                (true, true) => (group.first, group.last) = (NIL, NIL),
                (true, false) => group.first = next,
                (false, true) => group.last = prev,
                (false, false) => {}
            }
            group.len -= 1;
            let emptied = group.len == 0;
            if emptied {
                group.index = None;
            }
            let drop_group = emptied && !group.alive;
            let e = self.slab.get_mut(idx);
            e.flags &= !IN_GROUP;
            e.group = NIL;
            self.order.unlink(&mut self.slab, idx);
            if drop_group {
                self.drop_group(gid);
            }
        } else {
            self.order.unlink(&mut self.slab, idx);
        }
    }

    /// Gives `idx` (detached) the next fresh rank: the tail of the list.
    fn attach_fresh(&mut self, idx: u32) {
        self.next_rank += 1;
        let e = self.slab.get_mut(idx);
        e.rank = self.next_rank;
        e.pos = 0;
        self.order.push_back(&mut self.slab, idx);
    }

    /// Whether member-to-be `idx` sorts before group member `other` (position descending, key
    /// bytes ascending).
    #[inline]
    fn sorts_before(&self, idx: u32, other: u32) -> bool {
        let (a, b) = (self.slab.get(idx), self.slab.get(other));
        a.pos > b.pos || (a.pos == b.pos && a.key() < b.key())
    }

    /// Puts `idx` (detached) into group `gid` at `pos`, keeping the group sorted.
    fn attach_to_group(&mut self, idx: u32, gid: u32, pos: i64) {
        let group = self.groups.get(gid);
        let (anchor, first, last, len, rank) =
            (group.anchor, group.first, group.last, group.len, group.rank);
        {
            let e = self.slab.get_mut(idx);
            e.rank = rank;
            e.pos = pos;
            e.group = gid;
            e.flags |= IN_GROUP;
        }
        if self.groups.get(gid).index.is_some() {
            self.attach_indexed(idx, gid, pos);
        } else if len == 0 {
            self.order.insert_after(&mut self.slab, anchor, idx);
        } else if self.sorts_before(idx, first) {
            self.order.insert_before(&mut self.slab, first, idx);
        } else if !self.sorts_before(idx, last) {
            self.order.insert_after(&mut self.slab, last, idx);
        } else if !self.attach_near_ends(idx, first, last) {
            self.build_index(gid);
            self.attach_indexed(idx, gid, pos);
        }
        let prev = self.slab.get(idx).links.prev;
        let group = self.groups.get_mut(gid);
        if len == 0 {
            (group.first, group.last) = (idx, idx);
        } else {
            if prev == anchor {
                group.first = idx;
            }
            if prev == last {
                group.last = idx;
            }
        }
        group.len += 1;
    }

    /// Tries to place `idx` (strictly between `first` and `last`) within `walk_limit` steps of
    /// either end.
    fn attach_near_ends(&mut self, idx: u32, first: u32, last: u32) -> bool {
        let mut cur = self.slab.get(first).links.next;
        for _ in 0..self.walk_limit {
            if self.sorts_before(idx, cur) {
                self.order.insert_before(&mut self.slab, cur, idx);
                return true;
            }
            if cur == last {
                break;
            }
            cur = self.slab.get(cur).links.next;
        }
        let mut cur = self.slab.get(last).links.prev;
        for _ in 0..self.walk_limit {
            if !self.sorts_before(idx, cur) {
                self.order.insert_after(&mut self.slab, cur, idx);
                return true;
            }
            if cur == first {
                break;
            }
            cur = self.slab.get(cur).links.prev;
        }
        false
    }

    /// Indexes the group's members by position (one pass over the group).
    fn build_index(&mut self, gid: u32) {
        let group = self.groups.get(gid);
        let (mut cur, last) = (group.first, group.last);
        let mut index: BTreeMap<i64, Run> = BTreeMap::new();
        loop {
            let pos = self.slab.get(cur).pos;
            index
                .entry(pos)
                .and_modify(|r| r.last = cur)
                .or_insert(Run {
                    first: cur,
                    last: cur,
                });
            if cur == last {
                break;
            }
            cur = self.slab.get(cur).links.next;
        }
        self.groups.get_mut(gid).index = Some(index);
    }

    /// Inserts `idx` into an indexed group.
    fn attach_indexed(&mut self, idx: u32, gid: u32, pos: i64) {
        let group = self.groups.get(gid);
        let index = group.index.as_ref().expect("the group is indexed");
        if let Some(run) = index.get(&pos).copied() {
            // Same position (keys of several KV-cache groups): order by key bytes.
            let mut cur = run.first;
            loop {
                if self.slab.get(cur).key() > self.slab.get(idx).key() {
                    self.order.insert_before(&mut self.slab, cur, idx);
                    if cur == run.first {
                        self.run_mut(gid, pos).first = idx;
                    }
                    return;
                }
                if cur == run.last {
                    self.order.insert_after(&mut self.slab, cur, idx);
                    self.run_mut(gid, pos).last = idx;
                    return;
                }
                cur = self.slab.get(cur).links.next;
            }
        }
        let before = index.range(..pos).next_back().map(|(_, r)| r.first);
        let after = index.range(pos..).next().map(|(_, r)| r.last);
        let anchor = group.anchor;
        match (before, after) {
            (Some(successor), _) => self.order.insert_before(&mut self.slab, successor, idx),
            (None, Some(predecessor)) => self.order.insert_after(&mut self.slab, predecessor, idx),
            (None, None) => self.order.insert_after(&mut self.slab, anchor, idx),
        }
        let index = self
            .groups
            .get_mut(gid)
            .index
            .as_mut()
            .expect("the group is indexed");
        index.insert(
            pos,
            Run {
                first: idx,
                last: idx,
            },
        );
    }

    fn run_mut(&mut self, gid: u32, pos: i64) -> &mut Run {
        let index = self
            .groups
            .get_mut(gid)
            .index
            .as_mut()
            .expect("the group is indexed");
        index.get_mut(&pos).expect("run exists")
    }

    /// The steps an insertion may walk before indexing its group (tests force the index).
    #[cfg(any(test, fuzzing, feature = "validate"))]
    pub fn set_walk_limit(&mut self, steps: usize) {
        self.walk_limit = steps;
    }

    /// [`request_rank`](Self::request_rank) with the request's group: `current` (a rank and
    /// the group it had) is checked against the group itself, no rank lookup needed.
    pub fn request_group(&mut self, current: Option<(RequestRank, u32)>) -> (RequestRank, u32) {
        if let Some((rr, gid)) = current {
            let live = rr.generation == self.generation
                && self
                    .groups
                    .try_get(gid)
                    .is_some_and(|g| g.alive && g.rank == rr.rank);
            if live {
                return (rr, gid);
            }
        }
        let rr = self.request_rank(current.map(|(rr, _)| rr));
        let gid = self.group_id(rr).expect("a fresh or live rank has a group");
        (rr, gid)
    }

    /// [`insert_absent`](Self::insert_absent) into a live request group from
    /// [`request_group`](Self::request_group) (pending: not evictable).
    pub fn insert_absent_in_group(&mut self, key: Key<'_>, chunk: C, gid: u32, pos: i64) -> u32 {
        debug_assert!(self.groups.get(gid).alive);
        let idx = self.add_entry(key, chunk, false);
        self.attach_to_group(idx, gid, pos);
        idx
    }

    /// A new, unattached entry for an absent key, indexed.
    fn add_entry(&mut self, key: Key<'_>, chunk: C, evictable: bool) -> u32 {
        debug_assert!(self.index.find(&self.slab, key).is_none());
        self.bump();
        let idx = self.slab.insert(LruEntry {
            key: KeyBuf::EMPTY,
            links: Links::default(),
            rank: 0,
            pos: 0,
            group: NIL,
            flags: if evictable { EVICTABLE } else { 0 },
            chunk: Some(chunk),
        });
        // Written in place (see `KeyBuf::assign`), before the index may rehash it.
        self.slab.get_mut(idx).key.assign(key.bytes);
        self.index.insert(&self.slab, &self.hasher, key, idx);
        idx
    }

    fn check_request_rank(&self, rr: RequestRank) -> CoreResult<u32> {
        self.group_id(rr).ok_or_else(|| {
            CoreError::InvalidArgument("request rank is stale (released or cleared)".into())
        })
    }

    /// Adds a new chunk. `evictable` is whether its `ref_cnt` is 0 now.
    pub fn insert(
        &mut self,
        key: Key<'_>,
        chunk: C,
        rank: InsertRank,
        evictable: bool,
    ) -> CoreResult<()> {
        if self.index.find(&self.slab, key).is_some() {
            return Err(CoreError::DuplicateKey(KeyBuf::new(key.bytes)));
        }
        self.insert_absent(key, chunk, rank, evictable).map(|_| ())
    }

    /// [`insert`](Self::insert) of a key the caller knows is absent (no lookup is repeated); returns
    /// its handle.
    pub fn insert_absent(
        &mut self,
        key: Key<'_>,
        chunk: C,
        rank: InsertRank,
        evictable: bool,
    ) -> CoreResult<u32> {
        let group = match rank {
            InsertRank::Request(rr, pos) => Some((self.check_request_rank(rr)?, pos)),
            InsertRank::Fresh => None,
        };
        let idx = self.add_entry(key, chunk, evictable);
        match group {
            None => self.attach_fresh(idx),
            Some((gid, pos)) => self.attach_to_group(idx, gid, pos),
        }
        Ok(idx)
    }

    /// Whether `handle` still names the resident entry of `key` (it may have been removed
    /// since it was resolved, and its slot reused, possibly by a request anchor).
    #[inline]
    pub fn handle_matches(&self, handle: u32, key: &[u8]) -> bool {
        self.slab
            .try_get(handle)
            .is_some_and(|e| e.chunk.is_some() && key_eq(e.key(), key))
    }

    pub fn remove(&mut self, key: Key<'_>) -> CoreResult<C> {
        let idx = self
            .index
            .find(&self.slab, key)
            .ok_or_else(|| CoreError::KeyNotFound(KeyBuf::new(key.bytes)))?;
        self.bump();
        Ok(self.delete(idx).chunk.expect("resident entry has a chunk"))
    }

    fn delete(&mut self, idx: u32) -> LruEntry<C> {
        self.detach(idx);
        let removed = self
            .index
            .remove(&self.slab, Key::new(&self.hasher, self.slab.get(idx).key()));
        debug_assert_eq!(removed, Some(idx));
        self.slab.remove(idx)
    }

    /// Fresh ranks for the resident keys, from the last key to the first (so the first key
    /// ends most recent). Serves `touch` and `on_request_finished` (given the request's keys in
    /// head-to-tail order).
    pub fn touch(&mut self, keys: &[Key<'_>]) {
        let entries = self.index.find_many(&self.slab, keys);
        self.touch_resolved(&entries);
    }

    /// [`touch`](Self::touch) for resolved entries (`NIL`: absent), head to tail.
    pub fn touch_resolved(&mut self, entries: &[u32]) {
        self.bump();
        for &idx in entries {
            if idx != NIL {
                let e = self.slab.get(idx);
                self.slab.prefetch(e.links.prev);
                self.slab.prefetch(e.links.next);
            }
        }
        for &idx in entries.iter().rev() {
            if idx != NIL {
                self.detach(idx);
                self.attach_fresh(idx);
            }
        }
    }

    /// A request observed `keys` (with their token positions): resident keys whose rank is
    /// older than `(rank, -position)` join the request's group.
    pub fn on_request_access(
        &mut self,
        rr: RequestRank,
        keys: &[(Key<'_>, Option<i64>)],
    ) -> CoreResult<()> {
        let entries: Vec<(u32, Option<i64>)> = keys
            .iter()
            .map(|&(key, pos)| (self.index.find(&self.slab, key).unwrap_or(NIL), pos))
            .collect();
        self.on_request_access_at(rr, &entries)
    }

    pub fn mark_evictable(&mut self, key: Key<'_>) -> CoreResult<()> {
        let idx = self
            .index
            .find(&self.slab, key)
            .ok_or_else(|| CoreError::KeyNotFound(KeyBuf::new(key.bytes)))?;
        self.bump();
        self.slab.get_mut(idx).flags |= EVICTABLE;
        Ok(())
    }

    pub fn mark_non_evictable(&mut self, key: Key<'_>) -> CoreResult<()> {
        let idx = self
            .index
            .find(&self.slab, key)
            .ok_or_else(|| CoreError::KeyNotFound(KeyBuf::new(key.bytes)))?;
        if !self.slab.get(idx).has(EVICTABLE) {
            return Err(CoreError::NotEvictable(KeyBuf::new(key.bytes)));
        }
        self.bump();
        self.slab.get_mut(idx).flags &= !EVICTABLE;
        Ok(())
    }

    /// The handle of a resident key's entry: valid until that entry is removed.
    #[inline]
    pub fn find(&self, key: Key<'_>) -> Option<u32> {
        self.index.find(&self.slab, key)
    }

    /// Resolves keys to entry handles ([`NIL`] when absent) in one pass; see
    /// [`KeyIndex::find_many`].
    pub fn resolve(&self, keys: &[Key<'_>]) -> Vec<u32> {
        self.index.find_many(&self.slab, keys)
    }

    /// The chunk of a resident entry.
    #[inline]
    pub fn chunk_at(&self, handle: u32) -> &C {
        self.slab
            .get(handle)
            .chunk
            .as_ref()
            .expect("handles name resident entries")
    }

    /// Sets or clears the evictable mark of a resident entry; returns the previous mark.
    pub fn set_evictable_at(&mut self, handle: u32, evictable: bool) -> bool {
        self.bump();
        let e = self.slab.get_mut(handle);
        let was = e.has(EVICTABLE);
        if evictable {
            e.flags |= EVICTABLE;
        } else {
            e.flags &= !EVICTABLE;
        }
        was
    }

    /// Removes a resident entry by handle.
    pub fn remove_at(&mut self, handle: u32) -> C {
        self.bump();
        self.delete(handle)
            .chunk
            .expect("handles name resident entries")
    }

    /// [`on_request_access`](Self::on_request_access) for resolved entries (`NIL`: absent).
    pub fn on_request_access_at(
        &mut self,
        rr: RequestRank,
        entries: &[(u32, Option<i64>)],
    ) -> CoreResult<()> {
        let gid = self.check_request_rank(rr)?;
        self.bump();
        for &(idx, pos) in entries {
            let (Some(pos), false) = (pos, idx == NIL) else {
                continue;
            };
            let e = self.slab.get(idx);
            // vLLM: skip when (cur_rank, -cur_pos) >= (rank, -pos).
            if e.rank > rr.rank || (e.rank == rr.rank && e.pos <= pos) {
                continue;
            }
            self.detach(idx);
            self.attach_to_group(idx, gid, pos);
        }
        Ok(())
    }

    /// Resolves keys to the entries an eviction must skip (non-resident keys are ignored).
    pub fn protect<'k>(&self, keys: impl IntoIterator<Item = Key<'k>>) -> Protected {
        self.index.protect(&self.slab, keys)
    }

    /// The `n` evictable, idle, unprotected keys of smallest rank, or `None` if there are fewer.
    /// An entry marked evictable whose `ref_cnt` is not 0 is skipped (vLLM would assert).
    pub fn plan_eviction(
        &self,
        n: usize,
        protected: &Protected,
        counts: &impl RefCounts<C>,
    ) -> Option<EvictionPlan> {
        let mut victims = Vec::with_capacity(n);
        let mut cur = self.order.head();
        while victims.len() < n {
            if cur == NIL {
                return None;
            }
            let e = self.slab.get(cur);
            if e.has(EVICTABLE) && !protected.contains(cur) {
                if let Some(chunk) = &e.chunk {
                    if counts.ref_cnt(chunk) == 0 {
                        victims.push(cur);
                    }
                }
            }
            cur = e.links.next;
        }
        Some(EvictionPlan {
            victims,
            epoch: self.epoch,
            policy_id: self.id,
        })
    }

    pub fn commit_eviction(&mut self, plan: EvictionPlan) -> CoreResult<Vec<Evicted<C>>> {
        if plan.epoch != self.epoch || plan.policy_id != self.id {
            return Err(CoreError::StalePlan);
        }
        self.bump();
        let mut evicted = Vec::with_capacity(plan.victims.len());
        for idx in plan.victims {
            let entry = self.delete(idx);
            evicted.push(Evicted {
                key: entry.key,
                chunk: entry.chunk.expect("victims are resident"),
            });
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

    /// Forgets every key and request rank; ranks restart, and request ranks handed out before
    /// become stale.
    pub fn clear(&mut self) {
        self.bump();
        self.slab.clear();
        self.index = KeyIndex::with_capacity(self.capacity);
        self.order.clear();
        self.groups.clear();
        self.group_of_rank.clear();
        self.next_rank = 0;
        self.generation += 1;
    }

    /// Heap bytes held by the policy's own structures (slab, table, groups, spilled keys).
    pub fn heap_bytes(&self) -> usize {
        let spilled: usize = self.slab.iter().map(|(_, e)| e.key.heap_bytes()).sum();
        let runs: usize = self
            .groups
            .iter()
            .map(|(_, g)| g.index.as_ref().map_or(0, |i| i.len() * 48))
            .sum();
        self.slab.allocation_size()
            + self.index.allocation_size()
            + self.groups.allocation_size()
            + self.group_of_rank.allocation_size()
            + runs
            + spilled
    }

    /// Checks every structural invariant; `Err` names the first one broken.
    #[cfg(any(test, fuzzing, feature = "validate"))]
    pub fn validate(&self) -> Result<(), String> {
        let order = self.order.validate(&self.slab)?;
        if order.len() != self.slab.len() {
            return Err(format!(
                "list holds {} nodes, slab {}",
                order.len(),
                self.slab.len()
            ));
        }
        // Sort key of a node: anchors sort before their members.
        let sort_key = |i: u32| {
            let e = self.slab.get(i);
            let member = if e.has(ANCHOR) {
                None
            } else {
                Some((std::cmp::Reverse(e.pos), e.key()))
            };
            (e.rank, member)
        };
        for pair in order.windows(2) {
            if sort_key(pair[0]) >= sort_key(pair[1]) {
                return Err(format!(
                    "list out of rank order at nodes {} and {}",
                    pair[0], pair[1]
                ));
            }
        }
        let mut anchors = 0;
        let mut grouped = 0usize;
        for &i in &order {
            let e = self.slab.get(i);
            if e.rank > self.next_rank {
                return Err(format!(
                    "rank {} beyond the counter {}",
                    e.rank, self.next_rank
                ));
            }
            if e.has(ANCHOR) {
                anchors += 1;
                let group = self.groups.get(e.group);
                if group.anchor != i || group.rank != e.rank {
                    return Err("anchor and group disagree".into());
                }
                if e.chunk.is_some() || e.has(EVICTABLE) || e.has(IN_GROUP) {
                    return Err("anchor with entry state".into());
                }
                continue;
            }
            if e.chunk.is_none() {
                return Err(format!("{:?} has no chunk", e.key));
            }
            if self.index.find(&self.slab, Key::new(&self.hasher, e.key())) != Some(i) {
                return Err(format!("{:?} is not indexed at its slot", e.key));
            }
            if e.has(IN_GROUP) {
                grouped += 1;
                if self.groups.get(e.group).rank != e.rank {
                    return Err("grouped entry with a foreign rank".into());
                }
            } else if e.group != NIL || self.group_of_rank.contains_key(&e.rank) {
                return Err("fresh entry tied to a request group".into());
            }
        }
        if anchors != self.groups.len() || self.group_of_rank.len() != self.groups.len() {
            return Err(format!(
                "{anchors} anchors for {} groups",
                self.groups.len()
            ));
        }
        let mut members = 0usize;
        for (gid, group) in self.groups.iter() {
            if self.group_of_rank.get(&group.rank) != Some(&gid) {
                return Err(format!("group {gid} is not registered under its rank"));
            }
            if !group.alive && group.len == 0 {
                return Err(format!("dead empty group {gid} kept"));
            }
            // Members follow the anchor, contiguously, and first/last/len describe them.
            let mut seen = Vec::new();
            let mut cur = self.slab.get(group.anchor).links.next;
            while cur != NIL && self.slab.get(cur).has(IN_GROUP) && self.slab.get(cur).group == gid
            {
                seen.push(cur);
                cur = self.slab.get(cur).links.next;
            }
            if seen.len() != group.len as usize
                || seen.first().copied().unwrap_or(NIL) != group.first
                || seen.last().copied().unwrap_or(NIL) != group.last
            {
                return Err(format!(
                    "group {gid}: first/last/len do not match its members"
                ));
            }
            members += seen.len();
            if let Some(index) = &group.index {
                let mut runs: Vec<(i64, u32, u32)> = Vec::new();
                for &m in &seen {
                    let pos = self.slab.get(m).pos;
                    match runs.last_mut() {
                        Some(r) if r.0 == pos => r.2 = m,
                        _ => runs.push((pos, m, m)),
                    }
                }
                let indexed: Vec<(i64, u32, u32)> = index
                    .iter()
                    .rev()
                    .map(|(&p, r)| (p, r.first, r.last))
                    .collect();
                if runs != indexed {
                    return Err(format!("group {gid}: position index out of date"));
                }
            }
        }
        if members != grouped {
            return Err(format!("{grouped} grouped entries, {members} in groups"));
        }
        if self.index.len() + anchors != self.slab.len() {
            return Err("index and slab disagree".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{SelfCounted, TestChunk};

    fn order(p: &LruPolicy<TestChunk>) -> Vec<Vec<u8>> {
        p.entries().map(|e| e.key.to_vec()).collect()
    }

    fn evict(p: &mut LruPolicy<TestChunk>, n: usize) -> Option<Vec<Vec<u8>>> {
        let out = p.evict(n, &Protected::new(), &SelfCounted)?;
        Some(out.into_iter().map(|e| e.key.as_slice().to_vec()).collect())
    }

    #[test]
    fn request_ranks_order_tails_before_heads_and_precede_later_touches() {
        let mut p = LruPolicy::new(8);
        let rr = p.request_rank(None);
        // A request stores blocks at positions 16, 32, 48 ...
        for (k, pos) in [(b"h", 16), (b"m", 32), (b"t", 48)] {
            p.insert(
                p.key(k),
                TestChunk::new(0, 0),
                InsertRank::Request(rr, pos),
                true,
            )
            .unwrap();
        }
        // ... then another key is touched (a fresh, larger rank).
        p.insert(p.key(b"x"), TestChunk::new(1, 0), InsertRank::Fresh, true)
            .unwrap();
        assert_eq!(
            order(&p),
            [b"t".to_vec(), b"m".to_vec(), b"h".to_vec(), b"x".to_vec()]
        );
        // Later keys of the same request still go before "x".
        p.insert(
            p.key(b"u"),
            TestChunk::new(2, 0),
            InsertRank::Request(rr, 64),
            true,
        )
        .unwrap();
        assert_eq!(order(&p)[0], b"u".to_vec());
        p.validate().unwrap();
        assert_eq!(evict(&mut p, 2).unwrap(), [b"u".to_vec(), b"t".to_vec()]);
        p.validate().unwrap();
    }

    #[test]
    fn equal_positions_tie_on_key_bytes() {
        let mut p = LruPolicy::new(8);
        let rr = p.request_rank(None);
        for k in [b"b1", b"a1", b"c1"] {
            p.insert(
                p.key(k),
                TestChunk::new(0, 0),
                InsertRank::Request(rr, 7),
                true,
            )
            .unwrap();
        }
        assert_eq!(order(&p), [b"a1".to_vec(), b"b1".to_vec(), b"c1".to_vec()]);
        p.validate().unwrap();
    }

    #[test]
    fn pinned_entries_keep_their_rank() {
        let mut p = LruPolicy::new(8);
        for k in [b"a", b"b", b"c"] {
            p.insert(p.key(k), TestChunk::new(0, 0), InsertRank::Fresh, true)
                .unwrap();
        }
        p.mark_non_evictable(p.key(b"a")).unwrap();
        assert_eq!(
            p.mark_non_evictable(p.key(b"a")),
            Err(CoreError::NotEvictable(KeyBuf::new(b"a")))
        );
        assert_eq!(evict(&mut p, 1).unwrap(), [b"b".to_vec()]);
        p.mark_evictable(p.key(b"a")).unwrap();
        assert_eq!(evict(&mut p, 1).unwrap(), [b"a".to_vec()]);
        assert!(evict(&mut p, 2).is_none());
        assert_eq!(order(&p), [b"c".to_vec()]);
    }

    #[test]
    fn released_groups_drop_their_anchor_once_empty() {
        let mut p = LruPolicy::new(8);
        let rr = p.request_rank(None);
        p.insert(
            p.key(b"a"),
            TestChunk::new(0, 0),
            InsertRank::Request(rr, 1),
            true,
        )
        .unwrap();
        p.release_request_rank(rr);
        assert_eq!(
            p.num_request_groups(),
            1,
            "a non-empty group keeps its anchor"
        );
        p.touch(&[p.key(b"a")]);
        assert_eq!(p.num_request_groups(), 0);
        p.validate().unwrap();
        let rr2 = p.request_rank(None);
        p.release_request_rank(rr2);
        assert_eq!(p.num_request_groups(), 0);
        p.clear();
        assert!(p
            .insert(
                p.key(b"z"),
                TestChunk::new(0, 0),
                InsertRank::Request(rr, 1),
                true
            )
            .is_err());
    }
}
