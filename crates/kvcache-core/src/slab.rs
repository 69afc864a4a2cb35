//! Index-based storage and intrusive doubly-linked lists.
//!
//! Entries live in a [`Slab`] and refer to each other by [`Idx`], a 4-byte slot number that is
//! never 0: `Option<Idx>` is 4 bytes too, so a list link costs 8 bytes instead of two pointers
//! plus an allocation per node, "no entry" is `None` rather than a sentinel, and a freed slot
//! is reused by the next insert. A [`List`] is just a head, a tail and a length; the links live
//! in the entries ([`Linked`]), so one entry can move between lists (ARC's T1/T2/B1/B2) in O(1)
//! without reallocating. The module's only `unsafe` is the prefetch hint in [`prefetch`].

use std::num::NonZeroU32;

/// A slot of a [`Slab`]. Slot 0 is never handed out, so the niche makes `Option<Idx>` 4 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Idx(NonZeroU32);

impl Idx {
    #[inline]
    fn new(slot: u32) -> Option<Idx> {
        NonZeroU32::new(slot).map(Idx)
    }

    #[cfg(test)]
    fn get(self) -> u32 {
        self.0.get()
    }

    #[inline]
    fn page(self) -> usize {
        (self.0.get() >> PAGE_BITS) as usize
    }

    #[inline]
    fn offset(self) -> usize {
        self.0.get() as usize & (PAGE - 1)
    }
}

/// Asks the CPU to start loading the cache line of `value`. Batch operations resolve all their
/// entries first, prefetch what they will touch next, then act: the cache misses of a batch
/// overlap instead of following one another. A hint only: no effect on results.
#[inline(always)]
#[allow(unsafe_code, reason = "a CPU prefetch hint (an intrinsic)")]
pub fn prefetch<T>(value: &T) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has (it is in the target's
    // baseline); a prefetch is a hint that never faults and reads nothing observable, and the
    // address comes from a live reference anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            std::ptr::from_ref(value).cast::<i8>(),
        );
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = value;
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Links {
    pub prev: Option<Idx>,
    pub next: Option<Idx>,
}

/// An entry that can sit in one [`List`] at a time.
pub trait Linked {
    fn links(&self) -> &Links;
    fn links_mut(&mut self) -> &mut Links;
}

enum Slot<T> {
    Occupied(T),
    Vacant { next_free: Option<Idx> },
}

/// Slots per page (a power of two). Pages never move, so growing the slab never copies
/// entries, and at most one page is allocated but unused.
const PAGE_BITS: u32 = 10;
const PAGE: usize = 1 << PAGE_BITS;

/// Entries addressed by [`Idx`], stored in fixed-size pages, with a free list of vacated slots.
pub struct Slab<T> {
    pages: Vec<Vec<Slot<T>>>,
    /// Slots ever made (occupied or vacant), slot 0 included once a page exists.
    used: u32,
    free_head: Option<Idx>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            pages: Vec::new(),
            used: 0,
            free_head: None,
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes allocated for slots (occupied or vacant) and the page table.
    pub fn allocation_size(&self) -> usize {
        let slots: usize = self.pages.iter().map(Vec::capacity).sum();
        slots * std::mem::size_of::<Slot<T>>()
            + self.pages.capacity() * std::mem::size_of::<Vec<Slot<T>>>()
    }

    /// A new page holding `capacity` slots; the first page starts with the unused slot 0.
    fn new_page(&self, capacity: usize) -> Vec<Slot<T>> {
        let first = self.pages.is_empty();
        let mut page = Vec::with_capacity(capacity.clamp(1, PAGE) + usize::from(first));
        if first {
            page.push(Slot::Vacant { next_free: None });
        }
        page
    }

    /// Makes room for `additional` more entries in the page being filled (small slabs grow
    /// their first page like a vector; later pages are allocated whole). At most one page is
    /// reserved, however large `additional` is.
    pub fn reserve(&mut self, additional: usize) {
        match self.pages.last_mut() {
            Some(page) if page.len() < PAGE => {
                let room = PAGE - page.len();
                page.reserve_exact(additional.min(room));
            }
            _ => {
                let page = self.new_page(additional);
                self.used += u32::from(self.pages.is_empty());
                self.pages.push(page);
            }
        }
    }

    #[inline]
    fn slot(&self, idx: Idx) -> &Slot<T> {
        &self.pages[idx.page()][idx.offset()]
    }

    #[inline]
    fn slot_mut(&mut self, idx: Idx) -> &mut Slot<T> {
        &mut self.pages[idx.page()][idx.offset()]
    }

    /// Stores `value` and returns its index. Panics only past `u32::MAX - 1` entries (callers
    /// bound their sizes far below that).
    pub fn insert(&mut self, value: T) -> Idx {
        if let Some(idx) = self.free_head {
            let slot = self.slot_mut(idx);
            let Slot::Vacant { next_free } = *slot else {
                unreachable!("free list points at an occupied slot")
            };
            *slot = Slot::Occupied(value);
            self.free_head = next_free;
            self.len += 1;
            return idx;
        }
        if self.pages.is_empty() {
            // The first page grows like a vector (small slabs stay small).
            let page = self.new_page(4);
            self.pages.push(page);
            self.used = 1;
        }
        let idx = Idx::new(self.used).expect("slot 0 is never handed out");
        match self.pages.last_mut() {
            Some(page) if page.len() < PAGE => page.push(Slot::Occupied(value)),
            _ => {
                let mut page = self.new_page(PAGE);
                page.push(Slot::Occupied(value));
                self.pages.push(page);
            }
        }
        self.used = self
            .used
            .checked_add(1)
            .expect("a slab holds fewer than u32::MAX entries");
        self.len += 1;
        idx
    }

    pub fn remove(&mut self, idx: Idx) -> T {
        let free_head = self.free_head;
        let slot = self.slot_mut(idx);
        let old = std::mem::replace(
            slot,
            Slot::Vacant {
                next_free: free_head,
            },
        );
        let Slot::Occupied(value) = old else {
            unreachable!("removing a vacant slab slot")
        };
        self.free_head = Some(idx);
        self.len -= 1;
        value
    }

    #[inline]
    pub fn get(&self, idx: Idx) -> &T {
        match self.slot(idx) {
            Slot::Occupied(v) => v,
            Slot::Vacant { .. } => unreachable!("reading a vacant slab slot"),
        }
    }

    /// The entry at `idx`, or `None` if the slot is vacant or was never used (for handles that
    /// may have gone stale).
    #[inline]
    pub fn try_get(&self, idx: Idx) -> Option<&T> {
        match self.pages.get(idx.page())?.get(idx.offset())? {
            Slot::Occupied(v) => Some(v),
            Slot::Vacant { .. } => None,
        }
    }

    #[inline]
    pub fn get_mut(&mut self, idx: Idx) -> &mut T {
        match self.slot_mut(idx) {
            Slot::Occupied(v) => v,
            Slot::Vacant { .. } => unreachable!("writing a vacant slab slot"),
        }
    }

    /// Drops every entry and releases the memory.
    pub fn clear(&mut self) {
        *self = Slab::default();
    }

    /// Drops every entry but keeps the first page's memory (for reuse).
    pub fn clear_keep_memory(&mut self) {
        self.pages.truncate(1);
        if let Some(page) = self.pages.first_mut() {
            page.truncate(1);
            page[0] = Slot::Vacant { next_free: None };
        }
        self.used = u32::from(!self.pages.is_empty());
        self.free_head = None;
        self.len = 0;
    }

    /// Entries the first page holds without growing.
    pub fn first_page_capacity(&self) -> usize {
        self.pages.first().map_or(0, |p| p.capacity() - 1)
    }

    /// Hints the CPU to load slot `idx` (ignored for `None`); see [`prefetch`].
    #[inline]
    pub fn prefetch(&self, idx: Option<Idx>) {
        if let Some(idx) = idx {
            prefetch(self.slot(idx));
        }
    }

    /// Occupied entries with their indices, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (Idx, &T)> {
        self.pages
            .iter()
            .flatten()
            .zip(0u32..)
            .filter_map(|(s, i)| match s {
                Slot::Occupied(v) => Some((Idx::new(i).expect("slot 0 is vacant"), v)),
                Slot::Vacant { .. } => None,
            })
    }
}

/// A doubly-linked list threaded through the entries of one slab.
#[derive(Clone, Copy, Debug, Default)]
pub struct List {
    head: Option<Idx>,
    tail: Option<Idx>,
    len: u32,
}

impl List {
    #[inline]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// The least recently used end.
    #[inline]
    pub fn head(&self) -> Option<Idx> {
        self.head
    }

    pub fn clear(&mut self) {
        *self = List::default();
    }

    /// Appends `idx` (not in any list) at the tail.
    pub fn push_back<T: Linked>(&mut self, slab: &mut Slab<T>, idx: Idx) {
        let old_tail = self.tail;
        *slab.get_mut(idx).links_mut() = Links {
            prev: old_tail,
            next: None,
        };
        match old_tail {
            None => self.head = Some(idx),
            Some(t) => slab.get_mut(t).links_mut().next = Some(idx),
        }
        self.tail = Some(idx);
        self.len += 1;
    }

    /// Inserts `idx` (not in any list) just before `at` (in this list).
    pub fn insert_before<T: Linked>(&mut self, slab: &mut Slab<T>, at: Idx, idx: Idx) {
        let prev = slab.get(at).links().prev;
        *slab.get_mut(idx).links_mut() = Links {
            prev,
            next: Some(at),
        };
        slab.get_mut(at).links_mut().prev = Some(idx);
        match prev {
            None => self.head = Some(idx),
            Some(p) => slab.get_mut(p).links_mut().next = Some(idx),
        }
        self.len += 1;
    }

    /// Inserts `idx` (not in any list) just after `at` (in this list).
    pub fn insert_after<T: Linked>(&mut self, slab: &mut Slab<T>, at: Idx, idx: Idx) {
        match slab.get(at).links().next {
            None => self.push_back(slab, idx),
            Some(next) => self.insert_before(slab, next, idx),
        }
    }

    /// Removes `idx` (in this list) from the list; the entry stays in the slab.
    pub fn unlink<T: Linked>(&mut self, slab: &mut Slab<T>, idx: Idx) {
        let Links { prev, next } = *slab.get(idx).links();
        match prev {
            None => self.head = next,
            Some(p) => slab.get_mut(p).links_mut().next = next,
        }
        match next {
            None => self.tail = prev,
            Some(n) => slab.get_mut(n).links_mut().prev = prev,
        }
        *slab.get_mut(idx).links_mut() = Links::default();
        self.len -= 1;
    }

    /// Moves `idx` (in this list) to the tail.
    pub fn move_to_back<T: Linked>(&mut self, slab: &mut Slab<T>, idx: Idx) {
        if self.tail != Some(idx) {
            self.unlink(slab, idx);
            self.push_back(slab, idx);
        }
    }

    /// Indices from head (LRU) to tail (MRU).
    pub fn iter<'a, T: Linked>(&self, slab: &'a Slab<T>) -> ListIter<'a, T> {
        ListIter {
            slab,
            next: self.head,
        }
    }

    /// Checks the links of the list against the slab: lengths, back links, ends.
    #[cfg(any(test, feature = "validate"))]
    pub fn validate<T: Linked>(&self, slab: &Slab<T>) -> Result<Vec<Idx>, String> {
        let mut seen = Vec::with_capacity(self.len());
        let mut prev = None;
        let mut cur = self.head;
        while let Some(idx) = cur {
            if seen.len() > slab.len() {
                return Err("list longer than its slab (cycle?)".into());
            }
            let links = slab.try_get(idx).ok_or("list links a vacant slot")?.links();
            if links.prev != prev {
                return Err(format!("entry {idx:?}: prev {:?} != {prev:?}", links.prev));
            }
            seen.push(idx);
            prev = Some(idx);
            cur = links.next;
        }
        if prev != self.tail {
            return Err(format!("tail {:?} != last entry {prev:?}", self.tail));
        }
        if seen.len() != self.len() {
            return Err(format!("len {} != {} linked entries", self.len, seen.len()));
        }
        Ok(seen)
    }
}

pub struct ListIter<'a, T> {
    slab: &'a Slab<T>,
    next: Option<Idx>,
}

impl<T: Linked> Iterator for ListIter<'_, T> {
    type Item = Idx;

    #[inline]
    fn next(&mut self) -> Option<Idx> {
        let idx = self.next?;
        self.next = self.slab.get(idx).links().next;
        Some(idx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Node(u32, Links);
    impl Linked for Node {
        fn links(&self) -> &Links {
            &self.1
        }
        fn links_mut(&mut self) -> &mut Links {
            &mut self.1
        }
    }

    fn values(list: &List, slab: &Slab<Node>) -> Vec<u32> {
        list.iter(slab).map(|i| slab.get(i).0).collect()
    }

    #[test]
    fn list_operations_keep_links_consistent() {
        let mut slab = Slab::default();
        let mut list = List::default();
        let ids: Vec<Idx> = (0..5)
            .map(|v| slab.insert(Node(v, Links::default())))
            .collect();
        for &i in &ids {
            list.push_back(&mut slab, i);
        }
        assert_eq!(values(&list, &slab), [0, 1, 2, 3, 4]);
        list.move_to_back(&mut slab, ids[0]);
        list.unlink(&mut slab, ids[2]);
        list.insert_before(&mut slab, ids[1], ids[2]);
        let nine = slab.insert(Node(9, Links::default()));
        list.insert_after(&mut slab, ids[0], nine);
        assert_eq!(values(&list, &slab), [2, 1, 3, 4, 0, 9]);
        list.validate(&slab).unwrap();
        let removed = list.head().unwrap();
        list.unlink(&mut slab, removed);
        assert_eq!(slab.remove(removed).0, 2);
        let reused = slab.insert(Node(7, Links::default()));
        assert_eq!(reused, removed, "freed slots are reused");
        list.validate(&slab).unwrap();
    }

    #[test]
    fn slots_span_pages_and_slot_zero_is_never_used() {
        let mut slab = Slab::default();
        let n = u32::try_from(3 * PAGE).unwrap();
        let ids: Vec<Idx> = (0..n).map(|v| slab.insert(v)).collect();
        assert!(ids.iter().all(|i| i.get() != 0));
        assert_eq!(slab.len(), 3 * PAGE);
        for (&i, v) in ids.iter().zip(0..) {
            assert_eq!(*slab.get(i), v);
        }
        let iterated: Vec<u32> = slab.iter().map(|(_, v)| *v).collect();
        assert_eq!(iterated, (0..n).collect::<Vec<_>>());
        slab.remove(ids[5]);
        assert!(slab.try_get(ids[5]).is_none());
        assert!(slab.try_get(Idx::new(u32::MAX - 1).unwrap()).is_none());
        slab.clear_keep_memory();
        assert_eq!(slab.len(), 0);
        assert_eq!(slab.insert(42).get(), 1);
        assert_eq!(slab.iter().count(), 1);
    }

    #[test]
    fn option_of_idx_is_four_bytes() {
        assert_eq!(std::mem::size_of::<Option<Idx>>(), 4);
        assert_eq!(std::mem::size_of::<Links>(), 8);
    }
}
