//! Key → slab index map that stores each key once (in the slab entry) and takes a precomputed
//! hash, so one hash of a key serves every table it is probed in.

use hashbrown::HashTable;

use crate::key::{key_eq, Key, KeyBuf, KeyHasher};
use crate::slab::{Idx, Slab};

/// A slab entry that carries its key.
pub trait Keyed {
    fn key_buf(&self) -> &KeyBuf;
    fn key_buf_mut(&mut self) -> &mut KeyBuf;

    #[inline]
    fn key(&self) -> &[u8] {
        self.key_buf().as_slice()
    }
}

/// 4 bytes plus one control byte per slot: the table holds slab indices, not keys.
#[derive(Default)]
pub struct KeyIndex {
    table: HashTable<Idx>,
}

/// The most keys an index reserves room for up front (1 Mi keys: a 10 MiB table). Beyond it a
/// table grows by rehashing, which re-reads every key: presizing spares the scheduler those
/// stalls while a cache fills, and the cap bounds what a mistaken capacity can cost.
const MAX_PRESIZE: usize = 1 << 20;

impl KeyIndex {
    /// An index with room for `expected` keys (at most [`MAX_PRESIZE`]), so a cache filling up
    /// to its capacity never stops to rehash. If the memory cannot be had, the index starts
    /// small and grows as keys arrive.
    pub fn with_capacity(expected: usize) -> Self {
        let mut table = HashTable::new();
        // Failure only means no head start; the table still grows on demand.
        let _ = table.try_reserve(expected.min(MAX_PRESIZE), |_: &Idx| 0);
        KeyIndex { table }
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    #[inline]
    pub fn find<T: Keyed>(&self, slab: &Slab<T>, key: Key<'_>) -> Option<Idx> {
        self.table
            .find(key.hash.0, |&i| key_eq(slab.get(i).key(), key.bytes))
            .copied()
    }

    /// Looks up a batch of keys before any of them is acted on (`None` for absent ones). The lookups do not depend on each other, so the CPU overlaps their cache
    /// misses instead of paying them one after another.
    ///
    /// Three passes: take each key's first candidate slot by hash alone (the table's 7-bit tags
    /// make a wrong candidate rare) without touching any entry; prefetch all candidate entries;
    /// then confirm each candidate's key, falling back to a full lookup when it differs.
    pub fn find_many<T: Keyed>(&self, slab: &Slab<T>, keys: &[Key<'_>]) -> Vec<Option<Idx>> {
        let mut found: Vec<Option<Idx>> = keys
            .iter()
            .map(|k| self.table.find(k.hash.0, |_| true).copied())
            .collect();
        for &idx in &found {
            slab.prefetch(idx);
        }
        for (idx, key) in found.iter_mut().zip(keys) {
            if idx.is_some_and(|i| key_eq(slab.get(i).key(), key.bytes)) {
                continue;
            }
            *idx = self.find(slab, *key);
        }
        found
    }

    /// Adds `idx` under `key`; the caller guarantees the key is absent.
    pub fn insert<T: Keyed>(&mut self, slab: &Slab<T>, hasher: &KeyHasher, key: Key<'_>, idx: Idx) {
        debug_assert!(self.find(slab, key).is_none());
        // Growing rehashes the stored keys (amortised O(1) per insert).
        self.table
            .insert_unique(key.hash.0, idx, |&i| hasher.hash(slab.get(i).key()).0);
    }

    /// The entry of `key`, or a new one made by `make` and stored in `slab`: `(index, new)`.
    /// One probe either way.
    pub fn find_or_insert<T: Keyed>(
        &mut self,
        slab: &mut Slab<T>,
        hasher: &KeyHasher,
        key: Key<'_>,
        make: impl FnOnce() -> T,
    ) -> (Idx, bool) {
        let entry = self.table.entry(
            key.hash.0,
            |&i| key_eq(slab.get(i).key(), key.bytes),
            |&i| hasher.hash(slab.get(i).key()).0,
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(o) => (*o.get(), false),
            hashbrown::hash_table::Entry::Vacant(v) => {
                let idx = slab.insert(make());
                v.insert(idx);
                (idx, true)
            }
        }
    }

    /// Forgets every key but keeps the table's memory (for reuse).
    pub fn clear_keep_memory(&mut self) {
        self.table.clear();
    }

    /// Makes room for `additional` more keys without rehashing on the way.
    pub fn reserve<T: Keyed>(&mut self, slab: &Slab<T>, hasher: &KeyHasher, additional: usize) {
        self.table
            .reserve(additional, |&i| hasher.hash(slab.get(i).key()).0);
    }

    /// Removes the entry for `key` and returns its slab index.
    pub fn remove<T: Keyed>(&mut self, slab: &Slab<T>, key: Key<'_>) -> Option<Idx> {
        match self
            .table
            .find_entry(key.hash.0, |&i| key_eq(slab.get(i).key(), key.bytes))
        {
            Ok(entry) => Some(entry.remove().0),
            Err(_) => None,
        }
    }

    /// Bytes allocated by the table (for memory accounting).
    pub fn allocation_size(&self) -> usize {
        self.table.allocation_size()
    }
}
