//! The bounded access tracker behind `store_threshold`: how often each recently offered key was
//! offered, so a chunk is stored only once it was offered `store_threshold` times.
//!
//! Semantics of vLLM's `_record_accesses`: an ordered map from key to count, bounded by
//! `max_tracker_size`. Keys of an offer already tracked move to the most recent end and count
//! once more (and are safe from eviction during this offer); new keys start at 1, evicting the
//! least recent unprotected entries to make room, and are skipped when only protected entries
//! remain. Under vLLM 0.34 a key the request counted in an earlier offer stays tracked (and
//! protected, and moves) but does not count again.

use crate::index::{KeyIndex, Keyed};
use crate::key::{Key, KeyBuf, KeyHasher};
use crate::slab::{Links, List, Slab};

struct Tracked {
    key: KeyBuf,
    links: Links,
    count: u32,
}

crate::entries::keyed_entry!(Tracked);

pub struct AccessTracker {
    max_size: usize,
    slab: Slab<Tracked>,
    index: KeyIndex,
    order: List,
    hasher: KeyHasher,
}

impl AccessTracker {
    pub fn new(max_size: usize) -> Self {
        AccessTracker {
            max_size,
            slab: Slab::default(),
            index: KeyIndex::default(),
            order: List::default(),
            hasher: KeyHasher::global(),
        }
    }

    pub fn count(&self, key: Key<'_>) -> u32 {
        self.index
            .find(&self.slab, key)
            .map_or(0, |i| self.slab.get(i).count)
    }

    /// Records one offer of `keys` (in offer order, duplicates counted as vLLM counts them).
    /// `counted(i)`: `keys[i]` was already counted for this request, so it does not count
    /// again.
    pub fn record(&mut self, keys: &[Key<'_>], counted: impl Fn(usize) -> bool) {
        let found = self.index.find_many(&self.slab, keys);
        // Protected: tracked keys of this offer (distinct entries).
        let mut protected = 0usize;
        let mut seen = hashbrown::HashSet::<_, foldhash::fast::FixedState>::default();
        for (i, idx) in found.iter().enumerate() {
            let Some(idx) = *idx else { continue };
            self.order.move_to_back(&mut self.slab, idx);
            if !counted(i) {
                let t = self.slab.get_mut(idx);
                t.count = t.count.saturating_add(1);
            }
            if seen.insert(idx) {
                protected += 1;
            }
        }
        let mut unprotected = self.index.len() - protected;
        for (&key, &idx) in keys.iter().zip(&found) {
            if idx.is_some() || self.index.find(&self.slab, key).is_some() {
                continue;
            }
            if self.index.len() >= self.max_size {
                if unprotected == 0 {
                    continue;
                }
                let oldest = self.order.head().expect("a full tracker has entries");
                self.order.unlink(&mut self.slab, oldest);
                let old_key = Key::new(&self.hasher, self.slab.get(oldest).key());
                self.index.remove(&self.slab, old_key);
                self.slab.remove(oldest);
                unprotected -= 1;
            }
            let idx = self.slab.insert(Tracked {
                key: KeyBuf::new(key.bytes),
                links: Links::default(),
                count: 1,
            });
            self.index.insert(&self.slab, &self.hasher, key, idx);
            self.order.push_back(&mut self.slab, idx);
        }
    }

    pub fn heap_bytes(&self) -> usize {
        self.slab.allocation_size() + self.index.allocation_size()
    }

    /// Tracked keys and their counts, least recent first (vLLM's `counts` in order).
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], u32)> + '_ {
        self.order.iter(&self.slab).map(|idx| {
            let tracked = self.slab.get(idx);
            (tracked.key(), tracked.count)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_offers_and_evicts_the_oldest_unprotected() {
        let h = KeyHasher::global();
        let k = |b: &'static [u8]| Key::new(&h, b);
        let mut t = AccessTracker::new(2);
        t.record(&[k(b"a"), k(b"b")], |_| false);
        t.record(&[k(b"a"), k(b"c")], |_| false);
        // "b" was the oldest unprotected entry; "a" was protected by this offer.
        assert_eq!(
            (t.count(k(b"a")), t.count(k(b"b")), t.count(k(b"c"))),
            (2, 0, 1)
        );
        // Both tracked keys are protected: a new key is not tracked.
        t.record(&[k(b"a"), k(b"c"), k(b"d")], |_| false);
        assert_eq!(
            (t.count(k(b"a")), t.count(k(b"c")), t.count(k(b"d"))),
            (3, 2, 0)
        );
        let entries: Vec<(&[u8], u32)> = t.entries().collect();
        assert_eq!(entries, [(&b"a"[..], 3), (&b"c"[..], 2)]);
    }

    #[test]
    fn a_counted_key_moves_and_stays_protected_without_counting() {
        let h = KeyHasher::global();
        let k = |b: &'static [u8]| Key::new(&h, b);
        let mut t = AccessTracker::new(2);
        t.record(&[k(b"a"), k(b"b")], |_| false);
        // "a" was counted before: it moves to the recent end (so "b" is the oldest) and is
        // protected, but keeps its count.
        t.record(&[k(b"a"), k(b"c")], |i| i == 0);
        assert_eq!(
            (t.count(k(b"a")), t.count(k(b"b")), t.count(k(b"c"))),
            (1, 0, 1)
        );
    }
}
