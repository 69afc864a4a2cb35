//! LRU with logical recency independent of pinning, decision-identical to vLLM 0.33.0's
//! `LRUCachePolicy`.
//!
//! Every resident key has a rank `(rank, position)`, ordered by `rank` ascending then
//! `position` descending (vLLM's tuple `(rank, -position)`), ties broken by the key bytes.
//! `touch` and `on_request_finished` give keys fresh ranks from a counter (the largest rank so
//! far); a request's `insert`/`on_request_access` give its keys a provisional rank shared by the
//! whole request (allocated from the same counter when the request is first seen) so that its
//! tails precede its heads. Eviction takes the smallest ranks among keys marked evictable
//! (`mark_evictable`, or inserted with `ref_cnt == 0`) whose `ref_cnt` is 0, skipping protected
//! keys. (vLLM asserts that a key marked evictable has `ref_cnt == 0`; a key that breaks this is
//! skipped here instead.)
//!
//! vLLM keeps a lazily invalidated heap. Here every resident key sits on one list kept in rank
//! order: a fresh rank is always the largest, so those keys append at the tail in O(1). A
//! request rank `R` gets an *anchor* node appended when `R` is allocated; the request's keys sit
//! right after it, ordered by position ([`group`]: O(1) at either end, O(log k) in the middle
//! of a group of k keys). The anchor stays while the request can still rank keys; its owner
//! releases it ([`Policy::release_request`]) when the request is gone. Eviction walks the list
//! from the head: O(n + entries skipped). Memory: one 80-byte slab entry (40-byte inline key,
//! links, rank, position, group, flags, chunk handle) plus ~5 bytes of hash table per key; one
//! anchor and one group per live request.

mod group;
#[cfg(any(test, feature = "validate"))]
mod validate;

use crate::chunk::RefCounts;
use crate::entries::Entries;
use crate::index::Keyed;
use crate::key::{Key, KeyBuf};
use crate::policy::{Access, EntryId, Evicted, Inspection, Observed, Policy, RankedEntry, Stat};
use crate::slab::{Idx, Links, List, Slab};
use group::Group;

/// A request's shared rank and its group, valid for one cache generation (until `clear`) and
/// until released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestGroup {
    generation: u64,
    rank: u64,
    group: Idx,
}

const ANCHOR: u8 = 1;
const IN_GROUP: u8 = 2;
const EVICTABLE: u8 = 4;

struct LruEntry<C> {
    key: KeyBuf,
    links: Links,
    rank: u64,
    pos: i64,
    /// The request group (members and anchors).
    group: Option<Idx>,
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

crate::entries::keyed_entry!(LruEntry<C>);

/// Insertions land at either end of a group in prefix-order traffic (O(1)); one that lands
/// farther than this from both ends builds the group's position index (O(log k) from then on).
const WALK_LIMIT: usize = 8;

pub struct LruPolicy<C> {
    capacity: usize,
    /// Resident keys (indexed) and request anchors (not indexed), all on `order`.
    entries: Entries<LruEntry<C>>,
    order: List,
    groups: Slab<Group>,
    walk_limit: usize,
    next_rank: u64,
    generation: u64,
}

impl<C> LruPolicy<C> {
    /// Live request groups (anchors on the list).
    fn num_request_groups(&self) -> usize {
        self.groups.len()
    }

    /// Resident keys with their ranks, in eviction order (ascending rank), evictable or not.
    fn entries(&self) -> impl Iterator<Item = RankedEntry<'_>> + '_ {
        self.order.iter(&self.entries.slab).filter_map(move |i| {
            let e = self.entries.get(i);
            (!e.has(ANCHOR)).then_some(RankedEntry {
                key: e.key(),
                rank: e.rank,
                position: e.pos,
                evictable: e.has(EVICTABLE),
            })
        })
    }

    /// The steps an insertion may walk before indexing its group (tests force the index).
    #[cfg(any(test, feature = "testing"))]
    pub fn set_walk_limit(&mut self, steps: usize) {
        self.walk_limit = steps;
    }

    /// The group of `request` if it is still live (not released, not cleared).
    fn live_group(&self, request: Option<RequestGroup>) -> Option<Idx> {
        let r = request?;
        let live = r.generation == self.generation
            && self
                .groups
                .try_get(r.group)
                .is_some_and(|g| g.alive && g.rank == r.rank);
        live.then_some(r.group)
    }

    /// The request's group, allocating a rank (and its anchor) if the request has none in this
    /// generation. Allocation consumes a rank exactly where vLLM's `_get_request_rank` does,
    /// so rank numbers match vLLM's.
    fn request_group(&mut self, request: &mut Option<RequestGroup>) -> Idx {
        if let Some(group) = self.live_group(*request) {
            return group;
        }
        self.next_rank += 1;
        let rank = self.next_rank;
        let group = self.new_group(rank);
        *request = Some(RequestGroup {
            generation: self.generation,
            rank,
            group,
        });
        group
    }

    /// A new, unattached entry for an absent key, indexed.
    fn add_entry(&mut self, key: Key<'_>, chunk: C, evictable: bool) -> Idx {
        self.entries.insert(
            key,
            LruEntry {
                key: KeyBuf::EMPTY,
                links: Links::default(),
                rank: 0,
                pos: 0,
                group: None,
                flags: if evictable { EVICTABLE } else { 0 },
                chunk: Some(chunk),
            },
        )
    }

    /// Gives `idx` (detached) the next fresh rank: the tail of the list.
    fn attach_fresh(&mut self, idx: Idx) {
        self.next_rank += 1;
        let e = self.entries.get_mut(idx);
        e.rank = self.next_rank;
        e.pos = 0;
        self.order.push_back(&mut self.entries.slab, idx);
    }

    /// Takes `idx` off the list (and out of its group).
    fn detach(&mut self, idx: Idx) {
        if self.entries.get(idx).has(IN_GROUP) {
            self.leave_group(idx);
        }
        self.order.unlink(&mut self.entries.slab, idx);
    }

    fn delete(&mut self, idx: Idx) -> LruEntry<C> {
        self.detach(idx);
        self.entries.remove(idx)
    }
}

impl<C> Policy<C> for LruPolicy<C> {
    type Request = Option<RequestGroup>;

    const NAME: &'static str = "lru";
    const READS_POSITIONS: bool = true;
    const READS_ACCESS: bool = false;

    fn new(capacity: usize) -> Self {
        LruPolicy {
            capacity,
            entries: Entries::with_capacity(capacity),
            order: List::default(),
            groups: Slab::default(),
            walk_limit: WALK_LIMIT,
            next_rank: 0,
            generation: 0,
        }
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    crate::entries::entry_lookups!();

    /// Anchors have no key of their own: a stale handle now naming one matches nothing.
    #[inline]
    fn is_entry_of(&self, id: EntryId, key: &[u8]) -> bool {
        self.entries
            .entry_of(id.0, key)
            .is_some_and(|e| e.chunk.is_some())
    }

    fn resident<'a>(&'a self) -> impl Iterator<Item = (&'a [u8], &'a C)>
    where
        C: 'a,
    {
        self.order.iter(&self.entries.slab).filter_map(move |i| {
            let e = self.entries.get(i);
            e.chunk.as_ref().map(|c| (e.key(), c))
        })
    }

    fn insert(
        &mut self,
        request: &mut Option<RequestGroup>,
        _found: Option<EntryId>,
        key: Key<'_>,
        chunk: C,
        position: Option<i64>,
        evictable: bool,
    ) -> EntryId {
        let group = position.map(|pos| (self.request_group(request), pos));
        let idx = self.add_entry(key, chunk, evictable);
        match group {
            None => self.attach_fresh(idx),
            Some((group, pos)) => self.attach_to_group(idx, group, pos),
        }
        EntryId(idx)
    }

    /// Fresh ranks for the resident keys, from the last key to the first (so the first key
    /// ends most recent).
    fn touch(&mut self, ids: &[Option<EntryId>], _counts: &impl RefCounts<C>) {
        self.touch_ids(ids);
    }

    /// Resident keys whose rank is older than `(request rank, -position)` join the request's
    /// group. The request gets a rank even when no key is resident, as in vLLM.
    fn on_request_access(&mut self, request: &mut Option<RequestGroup>, entries: &[Observed<'_>]) {
        let group = self.request_group(request);
        let rank = self.groups.get(group).rank;
        for o in entries {
            let (Some(EntryId(idx)), Some(pos)) = (o.id, o.position) else {
                continue;
            };
            let e = self.entries.get(idx);
            // vLLM: skip when (cur_rank, -cur_pos) >= (rank, -pos).
            if e.rank > rank || (e.rank == rank && e.pos <= pos) {
                continue;
            }
            self.detach(idx);
            self.attach_to_group(idx, group, pos);
        }
    }

    /// A finished request's keys get fresh ranks in prefix order (its head most recent).
    fn on_request_finished(
        &mut self,
        _request: &mut Option<RequestGroup>,
        entries: &[(Option<EntryId>, Access)],
    ) {
        let ids: Vec<Option<EntryId>> = entries.iter().map(|&(id, _)| id).collect();
        self.touch_ids(&ids);
    }

    #[inline]
    fn evictable(&self, id: EntryId) -> Option<bool> {
        Some(self.entries.get(id.0).has(EVICTABLE))
    }

    #[inline]
    fn set_evictable(&mut self, id: EntryId, evictable: bool) {
        let e = self.entries.get_mut(id.0);
        if evictable {
            e.flags |= EVICTABLE;
        } else {
            e.flags &= !EVICTABLE;
        }
    }

    /// No key can join the request's group any more: its anchor goes once the group is empty.
    fn release_request(&mut self, request: Option<RequestGroup>) {
        let Some(group) = self.live_group(request) else {
            return;
        };
        let g = self.groups.get_mut(group);
        g.alive = false;
        if g.len == 0 {
            self.drop_group(group);
        }
    }

    /// Forgets every key and request rank; ranks restart, and request ranks handed out before
    /// become stale.
    fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
        self.groups.clear();
        self.next_rank = 0;
        self.generation += 1;
    }

    /// Evictable keys in rank order; anchors and pinned keys are passed over.
    fn victims<'a>(
        &'a self,
        idle: impl Fn(EntryId, &C) -> bool + 'a,
    ) -> impl Iterator<Item = EntryId> + 'a {
        self.order
            .iter(&self.entries.slab)
            .filter(move |&idx| {
                let e = self.entries.get(idx);
                e.has(EVICTABLE)
                    && e.chunk
                        .as_ref()
                        .is_some_and(|chunk| idle(EntryId(idx), chunk))
            })
            .map(EntryId)
    }

    fn evict_entry(&mut self, id: EntryId) -> Evicted<C> {
        let entry = self.delete(id.0);
        Evicted {
            key: entry.key,
            chunk: entry.chunk.expect("victims are resident"),
        }
    }

    /// Heap bytes: slab, table, groups, position indexes and spilled keys.
    fn heap_bytes(&self) -> usize {
        let position_indexes: usize = self.groups.iter().map(|(_, g)| g.heap_bytes()).sum();
        self.entries.heap_bytes() + self.groups.allocation_size() + position_indexes
    }

    fn stats(&self) -> Vec<(&'static str, Stat)> {
        vec![("request_groups", Stat::Count(self.num_request_groups()))]
    }

    fn inspect(&self) -> Inspection<'_> {
        Inspection {
            lists: Vec::new(),
            ranks: Some(self.entries().collect()),
            stats: self.stats(),
        }
    }

    #[cfg(any(test, feature = "validate"))]
    fn validate(&self) -> Result<(), String> {
        self.check_invariants()
    }
}

impl<C> LruPolicy<C> {
    /// [`Policy::touch`] without counts (LRU reads none).
    fn touch_ids(&mut self, ids: &[Option<EntryId>]) {
        for &EntryId(idx) in ids.iter().flatten() {
            self.entries.prefetch_neighbours(idx);
        }
        for &EntryId(idx) in ids.iter().rev().flatten() {
            self.detach(idx);
            self.attach_fresh(idx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{SelfCounted, TestChunk};
    use crate::policy::{PolicyExt, Protected};
    use crate::CoreError;

    #[test]
    fn an_entry_takes_80_bytes() {
        // The crate docs quote this size as the memory per key.
        assert_eq!(std::mem::size_of::<LruEntry<u32>>(), 80);
    }

    fn order(p: &LruPolicy<TestChunk>) -> Vec<Vec<u8>> {
        p.entries().map(|e| e.key.to_vec()).collect()
    }

    fn evict(p: &mut LruPolicy<TestChunk>, n: usize) -> Option<Vec<Vec<u8>>> {
        let out = p.evict(n, &Protected::new(), &SelfCounted)?;
        Some(out.into_iter().map(|e| e.key.as_slice().to_vec()).collect())
    }

    fn insert(
        p: &mut LruPolicy<TestChunk>,
        request: &mut Option<RequestGroup>,
        key: &[u8],
        pos: Option<i64>,
    ) {
        let k = p.key(key);
        p.insert_key(request, k, TestChunk::new(0, 0), pos, true)
            .unwrap();
    }

    #[test]
    fn request_ranks_order_tails_before_heads_and_precede_later_touches() {
        let mut p = LruPolicy::new(8);
        let mut rr = None;
        // A request stores blocks at positions 16, 32, 48 ...
        for (k, pos) in [(b"h", 16), (b"m", 32), (b"t", 48)] {
            insert(&mut p, &mut rr, k, Some(pos));
        }
        // ... then another key is touched (a fresh, larger rank).
        insert(&mut p, &mut None, b"x", None);
        assert_eq!(
            order(&p),
            [b"t".to_vec(), b"m".to_vec(), b"h".to_vec(), b"x".to_vec()]
        );
        // Later keys of the same request still go before "x".
        insert(&mut p, &mut rr, b"u", Some(64));
        assert_eq!(order(&p)[0], b"u".to_vec());
        p.validate().unwrap();
        assert_eq!(evict(&mut p, 2).unwrap(), [b"u".to_vec(), b"t".to_vec()]);
        p.validate().unwrap();
    }

    #[test]
    fn equal_positions_tie_on_key_bytes() {
        let mut p = LruPolicy::new(8);
        let mut rr = None;
        for k in [b"b1", b"a1", b"c1"] {
            insert(&mut p, &mut rr, k, Some(7));
        }
        assert_eq!(order(&p), [b"a1".to_vec(), b"b1".to_vec(), b"c1".to_vec()]);
        p.validate().unwrap();
    }

    #[test]
    fn pinned_entries_keep_their_rank() {
        let mut p = LruPolicy::new(8);
        for k in [b"a", b"b", b"c"] {
            insert(&mut p, &mut None, k, None);
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
        assert!(evict(&mut p, usize::MAX).is_none());
        assert_eq!(order(&p), [b"c".to_vec()]);
    }

    #[test]
    fn released_groups_drop_their_anchor_once_empty() {
        let mut p = LruPolicy::new(8);
        let mut rr = None;
        insert(&mut p, &mut rr, b"a", Some(1));
        p.release_request(rr);
        assert_eq!(
            p.num_request_groups(),
            1,
            "a non-empty group keeps its anchor"
        );
        p.touch_keys(&[p.key(b"a")], &SelfCounted);
        assert_eq!(p.num_request_groups(), 0);
        p.validate().unwrap();
        let mut rr2 = None;
        p.on_request_access(&mut rr2, &[]);
        assert_eq!(p.num_request_groups(), 1);
        p.release_request(rr2);
        assert_eq!(p.num_request_groups(), 0);
        // After a clear, a request's old rank is stale: it gets a new one.
        let mut rr3 = None;
        p.on_request_access(&mut rr3, &[]);
        p.clear();
        insert(&mut p, &mut rr3, b"z", Some(1));
        assert_eq!(p.entries().next().map(|e| e.rank), Some(1));
        p.validate().unwrap();
    }

    #[test]
    fn a_stale_handle_naming_an_anchor_matches_no_key() {
        let mut p: LruPolicy<TestChunk> = LruPolicy::new(8);
        insert(&mut p, &mut None, b"", None);
        let id = p.find(p.key(b"")).unwrap();
        p.remove(id);
        // The freed slot now holds a request anchor, whose key is empty too.
        p.on_request_access(&mut None, &[]);
        assert!(!p.is_entry_of(id, b""));
    }
}
