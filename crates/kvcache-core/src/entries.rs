//! The keyed entry store every policy builds on: entries in a [`Slab`], found through a
//! [`KeyIndex`] that stores each key once (inside its entry) and probes with the hash the
//! caller computed once per key.

use crate::index::{KeyIndex, Keyed};
use crate::key::{key_eq, Key, KeyHash, KeyHasher};
use crate::slab::{Idx, Linked, Slab};

/// [`Linked`](crate::slab::Linked) and [`Keyed`] for an entry type with `links` and `key`
/// fields (`keyed_entry!(ArcEntry<C>)`, `keyed_entry!(Plain)`).
macro_rules! keyed_entry {
    ($ty:ident) => {
        crate::entries::keyed_entry!($ty<>);
    };
    ($ty:ident < $($param:ident),* >) => {
        impl<$($param),*> crate::slab::Linked for $ty<$($param),*> {
            #[inline]
            fn links(&self) -> &crate::slab::Links {
                &self.links
            }
            #[inline]
            fn links_mut(&mut self) -> &mut crate::slab::Links {
                &mut self.links
            }
        }

        impl<$($param),*> crate::index::Keyed for $ty<$($param),*> {
            #[inline]
            fn key_buf(&self) -> &crate::key::KeyBuf {
                &self.key
            }
            #[inline]
            fn key_buf_mut(&mut self) -> &mut crate::key::KeyBuf {
                &mut self.key
            }
        }
    };
}
pub(crate) use keyed_entry;

/// The [`Policy`](crate::Policy) methods that only look entries up, and `remove`, for a policy
/// whose entries live in `self.entries` and that takes one off its lists and out of the store
/// with `self.delete(idx)`: written once here, expanded into each policy's `impl Policy`.
/// `entry_lookups!()` is for entries with a `chunk: Option<C>` field (a policy that keeps
/// ghosts in its slab); `entry_lookups!(resident)` for entries with a `chunk: C` field, every
/// one of them resident.
macro_rules! entry_lookups {
    () => {
        crate::entries::entry_lookups!(@find);

        #[inline]
        fn chunk(&self, id: crate::policy::EntryId) -> Option<&C> {
            self.entries.get(id.0).chunk.as_ref()
        }

        fn remove(&mut self, id: crate::policy::EntryId) -> C {
            self.delete(id.0)
                .chunk
                .expect("only resident entries are removed")
        }
    };
    (resident) => {
        crate::entries::entry_lookups!(@find);

        #[inline]
        fn chunk(&self, id: crate::policy::EntryId) -> Option<&C> {
            Some(&self.entries.get(id.0).chunk)
        }

        fn remove(&mut self, id: crate::policy::EntryId) -> C {
            self.delete(id.0).chunk
        }
    };
    (@find) => {
        fn hasher(&self) -> &crate::key::KeyHasher {
            self.entries.hasher()
        }

        #[inline]
        fn find(&self, key: crate::key::Key<'_>) -> Option<crate::policy::EntryId> {
            self.entries.find(key).map(crate::policy::EntryId)
        }

        fn find_many(&self, keys: &[crate::key::Key<'_>]) -> Vec<Option<crate::policy::EntryId>> {
            let found = self.entries.find_many(keys);
            found
                .into_iter()
                .map(|i| i.map(crate::policy::EntryId))
                .collect()
        }
    };
}
pub(crate) use entry_lookups;

pub(crate) struct Entries<E> {
    pub(crate) slab: Slab<E>,
    index: KeyIndex,
    hasher: KeyHasher,
    /// What the index is presized for (kept for `clear`).
    expected: usize,
}

impl<E: Keyed> Entries<E> {
    /// A store presized for `expected` keys (see [`KeyIndex::with_capacity`]).
    pub(crate) fn with_capacity(expected: usize) -> Self {
        Entries {
            slab: Slab::default(),
            index: KeyIndex::with_capacity(expected),
            hasher: KeyHasher::global(),
            expected,
        }
    }

    #[inline]
    pub(crate) fn hasher(&self) -> &KeyHasher {
        &self.hasher
    }

    /// Indexed entries (nodes added with [`insert_unindexed`](Self::insert_unindexed) excluded).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    #[inline]
    pub(crate) fn find(&self, key: Key<'_>) -> Option<Idx> {
        self.index.find(&self.slab, key)
    }

    /// [`find`](Self::find) for a batch, in one pass whose cache misses overlap.
    pub(crate) fn find_many(&self, keys: &[Key<'_>]) -> Vec<Option<Idx>> {
        self.index.find_many(&self.slab, keys)
    }

    #[inline]
    pub(crate) fn get(&self, idx: Idx) -> &E {
        self.slab.get(idx)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, idx: Idx) -> &mut E {
        self.slab.get_mut(idx)
    }

    /// The entry at `idx` if it is still the entry of `key` (a handle goes stale when its
    /// entry is removed and the slot reused).
    #[inline]
    pub(crate) fn entry_of(&self, idx: Idx, key: &[u8]) -> Option<&E> {
        self.slab.try_get(idx).filter(|e| key_eq(e.key(), key))
    }

    /// Prefetches the list neighbours of `idx`, which a batch is about to move, and returns
    /// the entry (batches prefetch every entry first, so their cache misses overlap).
    #[inline]
    pub(crate) fn prefetch_neighbours(&self, idx: Idx) -> &E
    where
        E: Linked,
    {
        let e = self.slab.get(idx);
        self.slab.prefetch(e.links().prev);
        self.slab.prefetch(e.links().next);
        e
    }

    /// Adds `entry` under `key`, which must be absent. The key is written in place (see
    /// `KeyBuf::assign`) before the index may rehash it.
    pub(crate) fn insert(&mut self, key: Key<'_>, entry: E) -> Idx {
        debug_assert!(self.find(key).is_none());
        let idx = self.slab.insert(entry);
        self.slab.get_mut(idx).key_buf_mut().assign(key.bytes);
        self.index.insert(&self.slab, &self.hasher, key, idx);
        idx
    }

    /// Adds a node that no key finds (a list marker such as LRU's request anchors).
    pub(crate) fn insert_unindexed(&mut self, entry: E) -> Idx {
        self.slab.insert(entry)
    }

    /// Removes an entry added by [`insert`](Self::insert).
    pub(crate) fn remove(&mut self, idx: Idx) -> E {
        let key = Key::new(&self.hasher, self.slab.get(idx).key());
        let removed = self.index.remove(&self.slab, key);
        debug_assert_eq!(removed, Some(idx));
        self.slab.remove(idx)
    }

    /// [`remove`](Self::remove), also returning the key's hash (computed once for both).
    pub(crate) fn remove_hashed(&mut self, idx: Idx) -> (E, KeyHash) {
        let key = Key::new(&self.hasher, self.slab.get(idx).key());
        let hash = key.hash;
        let removed = self.index.remove(&self.slab, key);
        debug_assert_eq!(removed, Some(idx));
        (self.slab.remove(idx), hash)
    }

    /// Removes a node added by [`insert_unindexed`](Self::insert_unindexed).
    pub(crate) fn remove_unindexed(&mut self, idx: Idx) -> E {
        self.slab.remove(idx)
    }

    /// Drops every entry and releases the memory (the index is presized again).
    pub(crate) fn clear(&mut self) {
        self.slab.clear();
        self.index = KeyIndex::with_capacity(self.expected);
    }

    /// Heap bytes: slots, table and keys too long to live inline.
    pub(crate) fn heap_bytes(&self) -> usize {
        let spilled: usize = self
            .slab
            .iter()
            .map(|(_, e)| e.key_buf().heap_bytes())
            .sum();
        self.slab.allocation_size() + self.index.allocation_size() + spilled
    }

    /// Checks that `idx` is found under its own key.
    #[cfg(any(test, feature = "validate"))]
    pub(crate) fn check_indexed(&self, idx: Idx) -> Result<(), String> {
        let e = self.slab.get(idx);
        if self.find(Key::new(&self.hasher, e.key())) == Some(idx) {
            Ok(())
        } else {
            Err(format!("{:?} is not indexed at its slot", e.key_buf()))
        }
    }

    /// Checks that the index holds exactly `indexed` entries and the slab `indexed + unindexed`.
    #[cfg(any(test, feature = "validate"))]
    pub(crate) fn check_counts(&self, indexed: usize, unindexed: usize) -> Result<(), String> {
        if self.index.len() != indexed || self.slab.len() != indexed + unindexed {
            return Err(format!(
                "{indexed} keyed and {unindexed} other nodes listed; index holds {}, slab {}",
                self.index.len(),
                self.slab.len()
            ));
        }
        Ok(())
    }
}
