//! Belady's offline policy: the bound `kvcache replay --policy belady` reports beside the online
//! policies. It is not a vLLM policy (no Python class, no vLLM name): it must be told when each
//! key is used next ([`Policy::hint_next_use`]), which only a caller that knows the whole
//! workload in advance can do.
//!
//! Eviction order: the idle, unprotected chunk whose next use is farthest away first (a key with
//! no next use, or none given yet, counts as never used again), ties by the deepest token
//! position first, then by slot (a deterministic but arbitrary last resort). A request that uses
//! a chunk also uses every chunk of its prefix, so a parent's next use is never later than its
//! child's; with the depth tie-break the cache never keeps a chunk whose parent it dropped for
//! a later use. The manager decides everything else exactly as for the online policies
//! (pending and pinned chunks stay, protected keys stay, a failed prepare stores nothing), so
//! the bound is measured under the same semantics; in what sense it is optimal is discussed in
//! `docs/replay.md`.
//!
//! Complexity: `insert`, `remove`, each hint and each victim O(log n) (one ordered set of every
//! resident entry by `(next use, position, slot)`); planning an eviction of `n` is
//! O((n + entries skipped) log n). Memory: one slab entry (key, chunk, next use, position) plus
//! one ordered-set element (24 bytes in a B-tree node) and ~5 bytes of hash table per key.

use std::collections::BTreeSet;

use crate::chunk::RefCounts;
use crate::entries::Entries;
use crate::index::Keyed;
use crate::key::{Key, KeyBuf};
use crate::policy::{Access, EntryId, Evicted, Inspection, Policy, Stat};
use crate::slab::Idx;

/// The next use of a key that will not be used again (or whose next use is not known yet).
pub const NEVER: u64 = u64::MAX;

struct BeladyEntry<C> {
    key: KeyBuf,
    chunk: Option<C>,
    next_use: u64,
    position: i64,
}

impl<C> Keyed for BeladyEntry<C> {
    fn key_buf(&self) -> &KeyBuf {
        &self.key
    }
    fn key_buf_mut(&mut self) -> &mut KeyBuf {
        &mut self.key
    }
}

/// Eviction order, ascending: the last element goes first.
type Rank = (u64, i64, Idx);

pub struct BeladyPolicy<C> {
    capacity: usize,
    entries: Entries<BeladyEntry<C>>,
    order: BTreeSet<Rank>,
}

impl<C> BeladyPolicy<C> {
    fn rank(&self, idx: Idx) -> Rank {
        let e = self.entries.get(idx);
        (e.next_use, e.position, idx)
    }

    fn delete(&mut self, idx: Idx) -> BeladyEntry<C> {
        let removed = self.order.remove(&self.rank(idx));
        debug_assert!(removed, "every entry is ranked");
        self.entries.remove(idx)
    }
}

impl<C> Policy<C> for BeladyPolicy<C> {
    type Request = ();

    const NAME: &'static str = "belady";
    const READS_POSITIONS: bool = true;
    const READS_ACCESS: bool = false;

    fn new(capacity: usize) -> Self {
        BeladyPolicy {
            capacity,
            entries: Entries::with_capacity(capacity),
            order: BTreeSet::new(),
        }
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.entries.len()
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
        self.order.iter().map(move |&(_, _, idx)| {
            let e = self.entries.get(idx);
            (e.key(), e.chunk.as_ref().expect("every entry is resident"))
        })
    }

    /// A new chunk's next use is unknown until hinted: it counts as never used again.
    fn insert(
        &mut self,
        _request: &mut (),
        _found: Option<EntryId>,
        key: Key<'_>,
        chunk: C,
        position: Option<i64>,
        _evictable: bool,
    ) -> EntryId {
        let position = position.unwrap_or(0);
        let idx = self.entries.insert(
            key,
            BeladyEntry {
                key: KeyBuf::EMPTY,
                chunk: Some(chunk),
                next_use: NEVER,
                position,
            },
        );
        self.order.insert((NEVER, position, idx));
        EntryId(idx)
    }

    /// Uses do not reorder anything: only the hinted next use does.
    fn touch(&mut self, _ids: &[Option<EntryId>], _counts: &impl RefCounts<C>) {}

    fn on_request_finished(&mut self, _request: &mut (), _entries: &[(Option<EntryId>, Access)]) {}

    fn hint_next_use(&mut self, id: EntryId, next_use: u64) {
        let rank = self.rank(id.0);
        if rank.0 == next_use {
            return;
        }
        self.order.remove(&rank);
        self.entries.get_mut(id.0).next_use = next_use;
        self.order.insert((next_use, rank.1, id.0));
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }

    fn victims<'a>(
        &'a self,
        idle: impl Fn(EntryId, &C) -> bool + 'a,
    ) -> impl Iterator<Item = EntryId> + 'a {
        self.order.iter().rev().filter_map(move |&(_, _, idx)| {
            let chunk = self.entries.get(idx).chunk.as_ref()?;
            idle(EntryId(idx), chunk).then_some(EntryId(idx))
        })
    }

    fn evict_entry(&mut self, id: EntryId) -> Evicted<C> {
        let mut entry = self.delete(id.0);
        Evicted {
            key: std::mem::replace(&mut entry.key, KeyBuf::EMPTY),
            chunk: entry.chunk.take().expect("every entry is resident"),
        }
    }

    fn heap_bytes(&self) -> usize {
        // A B-tree holds up to 11 elements per node, each node a little over the elements.
        self.entries.heap_bytes() + self.order.len() * std::mem::size_of::<Rank>() * 12 / 11
    }

    fn stats(&self) -> Vec<(&'static str, Stat)> {
        let never = self.order.iter().rev().take_while(|r| r.0 == NEVER).count();
        vec![("never_used_again", Stat::Count(never))]
    }

    fn inspect(&self) -> Inspection<'_> {
        Inspection {
            lists: vec![(
                "order",
                self.order
                    .iter()
                    .rev()
                    .map(|&(_, _, idx)| self.entries.get(idx).key())
                    .collect(),
            )],
            ranks: None,
            stats: self.stats(),
        }
    }

    #[cfg(any(test, feature = "validate"))]
    fn validate(&self) -> Result<(), String> {
        if self.order.len() != self.entries.len() {
            return Err(format!(
                "{} ranked entries, {} indexed",
                self.order.len(),
                self.entries.len()
            ));
        }
        for &(next_use, position, idx) in &self.order {
            let e = self.entries.get(idx);
            if (e.next_use, e.position) != (next_use, position) {
                return Err(format!("{:?} is ranked with a stale next use", e.key));
            }
            if e.chunk.is_none() {
                return Err(format!("{:?} is ranked but not resident", e.key));
            }
            self.entries.check_indexed(idx)?;
        }
        self.entries.check_counts(self.order.len(), 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{SelfCounted, TestChunk};
    use crate::policy::{PolicyExt, Protected};

    fn ready(id: u64) -> TestChunk {
        TestChunk::new(id, 0)
    }

    #[test]
    fn evicts_the_farthest_next_use_then_the_deepest() {
        let mut p: BeladyPolicy<TestChunk> = BeladyPolicy::new(8);
        for (i, key) in [b"a", b"b", b"c", b"d"].iter().enumerate() {
            let pos = i64::try_from(16 * (i + 1)).unwrap();
            let k = p.key(&key[..]);
            p.insert(
                &mut (),
                None,
                k,
                ready(u64::try_from(i).unwrap()),
                Some(pos),
                true,
            );
        }
        // a and b are used again at request 5, c at 9; d never.
        for (key, next) in [(b"a", 5), (b"b", 5), (b"c", 9)] {
            let id = p.find(p.key(&key[..])).unwrap();
            p.hint_next_use(id, next);
        }
        p.validate().unwrap();
        let out = p.evict(3, &Protected::new(), &SelfCounted).unwrap();
        let keys: Vec<&[u8]> = out.iter().map(|e| e.key.as_slice()).collect();
        // d (never), then c (9), then b (5, deeper than a).
        assert_eq!(keys, [&b"d"[..], &b"c"[..], &b"b"[..]]);
        p.validate().unwrap();
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn busy_and_protected_chunks_are_skipped() {
        let mut p: BeladyPolicy<TestChunk> = BeladyPolicy::new(4);
        let ka = p.key(b"a");
        let kb = p.key(b"b");
        p.insert(&mut (), None, ka, TestChunk::new(0, 1), Some(16), false);
        p.insert(&mut (), None, kb, ready(1), Some(32), true);
        assert!(p.evict(2, &Protected::new(), &SelfCounted).is_none());
        let protected = Protected::from_ids(vec![p.find(kb).unwrap()]);
        assert!(p.evict(1, &protected, &SelfCounted).is_none());
        p.validate().unwrap();
        assert_eq!(p.len(), 2);
    }
}
