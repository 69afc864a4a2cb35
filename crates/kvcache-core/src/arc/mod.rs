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
//! Complexity: `find`, `insert`, `remove`, and each entry of `touch`, `on_store_miss` and
//! `on_request_finished` are O(1); planning an eviction of `n` is O(n + entries skipped)
//! (two monotonic cursors, like vLLM's iterators). Memory: one 64-byte, cache-line aligned slab
//! entry (40-byte inline key, links, list tag, chunk handle) plus ~5 bytes of hash table per
//! key, for resident and ghost keys alike.

#[cfg(any(test, feature = "validate"))]
mod validate;

use crate::chunk::RefCounts;
use crate::entries::Entries;
use crate::index::Keyed;
use crate::key::{Key, KeyBuf};
use crate::policy::{Access, EntryId, Evicted, Inspection, Policy, Stat};
use crate::slab::{Idx, Links, List};
use crate::semantics::VllmSemantics;

/// Which ARC list an entry is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub(crate) enum ListId {
    T1 = 0,
    T2 = 1,
    B1 = 2,
    B2 = 3,
}

impl ListId {
    const ALL: [ListId; 4] = [ListId::T1, ListId::T2, ListId::B1, ListId::B2];

    #[inline]
    fn is_resident(self) -> bool {
        matches!(self, ListId::T1 | ListId::T2)
    }

    /// The name vLLM gives the list.
    fn name(self) -> &'static str {
        match self {
            ListId::T1 => "t1",
            ListId::T2 => "t2",
            ListId::B1 => "b1",
            ListId::B2 => "b2",
        }
    }
}

/// Cache-line aligned: an entry (64 bytes for `u32` chunk handles) never straddles two lines.
#[repr(align(64))]
struct ArcEntry<C> {
    key: KeyBuf,
    links: Links,
    list: ListId,
    /// `Some` exactly when the entry is resident (T1/T2).
    chunk: Option<C>,
}

crate::entries::keyed_entry!(ArcEntry<C>);

pub struct ArcPolicy<C> {
    capacity: usize,
    target_t1_size: f64,
    entries: Entries<ArcEntry<C>>,
    lists: [List; 4],
}

impl<C> ArcPolicy<C> {
    /// The name of ARC's adaptive target size of T1 in [`Policy::stats`] (a
    /// [`Stat::Value`] in `[0, capacity]`).
    pub const TARGET_T1_SIZE: &'static str = "target_t1_size";

    fn list_len(&self, list: ListId) -> usize {
        self.lists[list as usize].len()
    }

    /// Keys of one list from LRU to MRU.
    fn list_keys(&self, list: ListId) -> impl Iterator<Item = &[u8]> + '_ {
        self.lists[list as usize]
            .iter(&self.entries.slab)
            .map(|i| self.entries.get(i).key())
    }

    #[inline]
    fn move_to(&mut self, idx: Idx, to: ListId) {
        let from = self.entries.get(idx).list;
        if from == to {
            self.lists[to as usize].move_to_back(&mut self.entries.slab, idx);
        } else {
            self.lists[from as usize].unlink(&mut self.entries.slab, idx);
            self.lists[to as usize].push_back(&mut self.entries.slab, idx);
            self.entries.get_mut(idx).list = to;
        }
    }

    fn delete(&mut self, idx: Idx) -> ArcEntry<C> {
        let list = self.entries.get(idx).list;
        self.lists[list as usize].unlink(&mut self.entries.slab, idx);
        self.entries.remove(idx)
    }

    /// On a ghost hit, moves `target_t1_size` and refreshes the ghost; resident entries are
    /// left alone.
    fn adapt_to_ghost_hit(&mut self, idx: Idx) {
        let list = self.entries.get(idx).list;
        let (b1, b2) = (
            usize_as_f64(self.list_len(ListId::B1)),
            usize_as_f64(self.list_len(ListId::B2)),
        );
        let capacity = usize_as_f64(self.capacity);
        match list {
            ListId::B1 => {
                let delta = f64::max(1.0, b2 / b1);
                self.target_t1_size = f64::min(self.target_t1_size + delta, capacity);
            }
            ListId::B2 => {
                let delta = f64::max(1.0, b1 / b2);
                self.target_t1_size = f64::max(self.target_t1_size - delta, 0.0);
            }
            ListId::T1 | ListId::T2 => return,
        }
        self.lists[list as usize].move_to_back(&mut self.entries.slab, idx);
    }

}

/// Lengths as the floats vLLM's arithmetic uses (exact below 2^53 entries).
#[inline]
#[allow(
    clippy::cast_precision_loss,
    reason = "list lengths are far below 2^53"
)]
fn usize_as_f64(n: usize) -> f64 {
    n as f64
}

/// ARC's victim order: two monotonic cursors over T1 and T2 and the simulated T1 size.
struct Victims<'a, C, F> {
    policy: &'a ArcPolicy<C>,
    idle: F,
    t1: Option<Idx>,
    t2: Option<Idx>,
    virtual_t1_size: usize,
    /// `int(target_t1_size)`.
    target: usize,
}

impl<C, F: Fn(EntryId, &C) -> bool> Victims<'_, C, F> {
    /// The next idle entry at or after `cursor`, moving the cursor past it.
    fn next_idle(&mut self, t1: bool) -> Option<Idx> {
        let cursor = if t1 { &mut self.t1 } else { &mut self.t2 };
        while let Some(idx) = *cursor {
            let entry = self.policy.entries.get(idx);
            *cursor = entry.links.next;
            let chunk = entry.chunk.as_ref().expect("resident entries hold a chunk");
            if (self.idle)(EntryId(idx), chunk) {
                return Some(idx);
            }
        }
        None
    }
}

impl<C, F: Fn(EntryId, &C) -> bool> Iterator for Victims<'_, C, F> {
    type Item = EntryId;

    fn next(&mut self) -> Option<EntryId> {
        if self.virtual_t1_size >= self.target {
            if let Some(idx) = self.next_idle(true) {
                self.virtual_t1_size = self.virtual_t1_size.saturating_sub(1);
                return Some(EntryId(idx));
            }
        }
        if let Some(idx) = self.next_idle(false) {
            return Some(EntryId(idx));
        }
        let idx = self.next_idle(true)?;
        self.virtual_t1_size = self.virtual_t1_size.saturating_sub(1);
        Some(EntryId(idx))
    }
}

impl<C> Policy<C> for ArcPolicy<C> {
    type Request = ();

    const NAME: &'static str = "arc";
    const READS_POSITIONS: bool = false;
    const READS_ACCESS: bool = true;

    fn new(capacity: usize) -> Self {
        ArcPolicy {
            capacity,
            target_t1_size: 0.0,
            entries: Entries::with_capacity(capacity),
            lists: [List::default(); 4],
        }
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.list_len(ListId::T1) + self.list_len(ListId::T2)
    }

    crate::entries::entry_lookups!();

    #[inline]
    fn is_entry_of(&self, id: EntryId, key: &[u8]) -> bool {
        self.entries.entry_of(id.0, key).is_some()
    }

    fn resident<'a>(&'a self) -> impl Iterator<Item = (&'a [u8], &'a C)>
    where
        C: 'a,
    {
        [ListId::T1, ListId::T2].into_iter().flat_map(move |l| {
            self.lists[l as usize]
                .iter(&self.entries.slab)
                .map(move |i| {
                    let e = self.entries.get(i);
                    (
                        e.key(),
                        e.chunk.as_ref().expect("resident entries hold a chunk"),
                    )
                })
        })
    }

    /// New chunks enter T1 at its MRU end; a ghost of the key becomes that entry.
    fn insert(
        &mut self,
        _request: &mut (),
        found: Option<EntryId>,
        key: Key<'_>,
        chunk: C,
        _position: Option<i64>,
        _evictable: bool,
    ) -> EntryId {
        let ghost = found.filter(|id| {
            self.entries
                .entry_of(id.0, key.bytes)
                .is_some_and(|e| !e.list.is_resident())
        });
        if let Some(EntryId(idx)) = ghost {
            self.entries.get_mut(idx).chunk = Some(chunk);
            self.move_to(idx, ListId::T1);
            return EntryId(idx);
        }
        let idx = self.entries.insert(
            key,
            ArcEntry {
                key: KeyBuf::EMPTY,
                links: Links::default(),
                list: ListId::T1,
                chunk: Some(chunk),
            },
        );
        self.lists[ListId::T1 as usize].push_back(&mut self.entries.slab, idx);
        EntryId(idx)
    }

    /// Ready T1 entries are promoted to T2, pending ones stay in T1 at MRU, T2 entries move to
    /// MRU, ghosts adapt the target.
    fn touch(&mut self, ids: &[Option<EntryId>], counts: &impl RefCounts<C>) {
        for id in ids.iter().flatten() {
            if let Some(chunk) = &self.entries.prefetch_neighbours(id.0).chunk {
                counts.prefetch(chunk);
            }
        }
        for &EntryId(idx) in ids.iter().rev().flatten() {
            let entry = self.entries.get(idx);
            match entry.list {
                ListId::T1 => {
                    let ready = counts.is_ready(entry.chunk.as_ref().expect("resident"));
                    self.move_to(idx, if ready { ListId::T2 } else { ListId::T1 });
                }
                ListId::T2 => self.move_to(idx, ListId::T2),
                ListId::B1 | ListId::B2 => self.adapt_to_ghost_hit(idx),
            }
        }
    }

    /// Only ghost hits matter: they adapt `target_t1_size` (alike in every vLLM release).
    fn on_store_miss(
        &mut self,
        ids: &[Option<EntryId>],
        _counts: &impl RefCounts<C>,
        _semantics: VllmSemantics,
    ) {
        for &EntryId(idx) in ids.iter().rev().flatten() {
            self.adapt_to_ghost_hit(idx);
        }
    }

    /// A key only stored by the request keeps its list and moves to its MRU end; a reused key
    /// moves to T2's MRU end (one frequency hit); ghosts and other keys stay.
    fn on_request_finished(&mut self, _request: &mut (), entries: &[(Option<EntryId>, Access)]) {
        let moving = |&(id, access): &(Option<EntryId>, Access)| {
            id.filter(|_| access != Access::Other)
                .map(|id| (id.0, access))
        };
        for (idx, _) in entries.iter().filter_map(moving) {
            self.entries.prefetch_neighbours(idx);
        }
        for (idx, access) in entries.iter().rev().filter_map(moving) {
            let list = self.entries.get(idx).list;
            match (access, list) {
                (Access::InsertionOnly, ListId::T1 | ListId::T2) => self.move_to(idx, list),
                (Access::Reused, ListId::T1 | ListId::T2) => self.move_to(idx, ListId::T2),
                _ => {}
            }
        }
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.lists = [List::default(); 4];
        self.target_t1_size = 0.0;
    }

    fn victims<'a>(
        &'a self,
        idle: impl Fn(EntryId, &C) -> bool + 'a,
    ) -> impl Iterator<Item = EntryId> + 'a {
        // `int()` of a non-negative float truncates, i.e. floors; the target never exceeds the
        // capacity, a usize.
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "0 <= target_t1_size <= capacity (checked by validate)"
        )]
        let target = self.target_t1_size as usize;
        Victims {
            policy: self,
            idle,
            t1: self.lists[ListId::T1 as usize].head(),
            t2: self.lists[ListId::T2 as usize].head(),
            virtual_t1_size: self.list_len(ListId::T1),
            target,
        }
    }

    /// T1 victims become B1 ghosts, T2 victims B2 ghosts.
    fn evict_entry(&mut self, id: EntryId) -> Evicted<C> {
        let entry = self.entries.get_mut(id.0);
        let chunk = entry.chunk.take().expect("victims are resident");
        let ghost = if entry.list == ListId::T1 {
            ListId::B1
        } else {
            ListId::B2
        };
        let key = entry.key.clone();
        self.move_to(id.0, ghost);
        Evicted { key, chunk }
    }

    /// Trims both ghost lists to the capacity from their LRU ends.
    fn after_eviction(&mut self) {
        for ghost in [ListId::B1, ListId::B2] {
            while self.list_len(ghost) > self.capacity {
                let oldest = self.lists[ghost as usize].head().expect("a non-empty list");
                self.delete(oldest);
            }
        }
    }

    fn heap_bytes(&self) -> usize {
        self.entries.heap_bytes()
    }

    fn stats(&self) -> Vec<(&'static str, Stat)> {
        vec![(Self::TARGET_T1_SIZE, Stat::Value(self.target_t1_size))]
    }

    fn inspect(&self) -> Inspection<'_> {
        Inspection {
            lists: ListId::ALL
                .iter()
                .map(|&l| (l.name(), self.list_keys(l).collect()))
                .collect(),
            ranks: None,
            stats: self.stats(),
        }
    }

    #[cfg(any(test, feature = "validate"))]
    fn validate(&self) -> Result<(), String> {
        self.check_invariants()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{SelfCounted, TestChunk};
    use crate::policy::{PolicyExt, Protected};

    #[test]
    fn an_entry_fills_exactly_one_cache_line() {
        // The crate docs quote this size as the memory per key.
        assert_eq!(std::mem::size_of::<ArcEntry<u32>>(), 64);
        assert_eq!(std::mem::align_of::<ArcEntry<u32>>(), 64);
    }

    fn keys<'a>(p: &ArcPolicy<TestChunk>, raw: &'a [&'a [u8]]) -> Vec<Key<'a>> {
        raw.iter().map(|k| p.key(k)).collect()
    }

    fn lists(p: &ArcPolicy<TestChunk>) -> Vec<Vec<Vec<u8>>> {
        ListId::ALL
            .iter()
            .map(|&l| p.list_keys(l).map(<[u8]>::to_vec).collect())
            .collect()
    }

    fn insert(p: &mut ArcPolicy<TestChunk>, key: &[u8], id: u64, ref_cnt: i32) {
        let k = p.key(key);
        p.insert_key(&mut (), k, TestChunk::new(id, ref_cnt), None, false)
            .unwrap();
    }

    #[test]
    fn eviction_goes_to_ghosts_and_ghost_hits_adapt() {
        let mut p = ArcPolicy::new(2);
        for (i, k) in [b"a", b"b", b"c"].iter().enumerate() {
            insert(&mut p, *k, i as u64, 0);
        }
        p.touch_keys(&keys(&p, &[b"a"]), &SelfCounted);
        assert_eq!(lists(&p)[1], vec![b"a".to_vec()]);
        let out = p.evict(2, &Protected::new(), &SelfCounted).unwrap();
        assert_eq!(
            out.iter().map(|e| e.key.as_slice()).collect::<Vec<_>>(),
            [b"b", b"c"]
        );
        assert_eq!(lists(&p)[2], vec![b"b".to_vec(), b"c".to_vec()]);
        p.on_store_miss_keys(&keys(&p, &[b"b"]), &SelfCounted, VllmSemantics::V0_34);
        assert_eq!(p.target_t1_size, 1.0);
        // Inserting a ghost's key turns that ghost back into a T1 entry.
        insert(&mut p, b"b", 9, -1);
        assert_eq!(lists(&p)[0], vec![b"b".to_vec()]);
        assert_eq!(lists(&p)[2], vec![b"c".to_vec()]);
        p.validate().unwrap();
    }

    #[test]
    fn failed_eviction_changes_nothing() {
        let mut p = ArcPolicy::new(4);
        insert(&mut p, b"a", 0, 0);
        insert(&mut p, b"b", 1, 1);
        let before = lists(&p);
        assert!(p.evict(2, &Protected::new(), &SelfCounted).is_none());
        let protected = p.protect([p.key(b"a")]);
        assert!(p.evict(1, &protected, &SelfCounted).is_none());
        assert!(p
            .evict(usize::MAX, &Protected::new(), &SelfCounted)
            .is_none());
        assert_eq!(lists(&p), before);
        assert_eq!(
            p.evict(0, &Protected::new(), &SelfCounted).unwrap().len(),
            0
        );
    }

    #[test]
    fn key_level_errors_change_nothing() {
        let mut p = ArcPolicy::new(4);
        insert(&mut p, b"a", 0, 0);
        let k = p.key(b"a");
        assert!(matches!(
            p.insert_key(&mut (), k, TestChunk::new(1, 0), None, false),
            Err(crate::CoreError::DuplicateKey(_))
        ));
        assert!(p.remove_key(p.key(b"zz")).is_err());
        assert!(p.mark_evictable(p.key(b"zz")).is_err());
        // ARC keeps no evictable mark: marking a resident key is accepted either way.
        p.mark_non_evictable(k).unwrap();
        p.mark_non_evictable(k).unwrap();
        assert_eq!(lists(&p)[0], vec![b"a".to_vec()]);
        p.validate().unwrap();
    }
}
