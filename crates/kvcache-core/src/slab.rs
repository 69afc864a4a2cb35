//! Index-based storage and intrusive doubly-linked lists.
//!
//! Entries live in a [`Slab`] and refer to each other by `u32` index, so a list link costs
//! 8 bytes instead of two pointers plus an allocation per node, there is no `unsafe`, and a
//! freed slot is reused by the next insert. A [`List`] is just a head, a tail and a length;
//! the links live in the entries ([`Linked`]), so one entry can move between lists (ARC's
//! T1/T2/B1/B2) in O(1) without reallocating.

/// "No entry": the end of a list, or an empty free list.
pub const NIL: u32 = u32::MAX;

/// Asks the CPU to start loading the cache line of `value`. Batch operations resolve all their
/// entries first, prefetch what they will touch next, then act: the cache misses of a batch
/// overlap instead of following one another. A hint only: no effect on results.
#[inline(always)]
#[allow(unsafe_code)]
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Links {
    pub prev: u32,
    pub next: u32,
}

impl Default for Links {
    fn default() -> Self {
        Links {
            prev: NIL,
            next: NIL,
        }
    }
}

/// An entry that can sit in one [`List`] at a time.
pub trait Linked {
    fn links(&self) -> &Links;
    fn links_mut(&mut self) -> &mut Links;
}

enum Slot<T> {
    Occupied(T),
    Vacant { next_free: u32 },
}

/// Slots per page (a power of two). Pages never move, so growing the slab never copies
/// entries, and at most one page is allocated but unused.
const PAGE_BITS: u32 = 10;
const PAGE: usize = 1 << PAGE_BITS;

/// Entries addressed by `u32`, stored in fixed-size pages, with a free list of vacated slots.
pub struct Slab<T> {
    pages: Vec<Vec<Slot<T>>>,
    /// Slots ever used (occupied or vacant): the next fresh index.
    used: u32,
    free_head: u32,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            pages: Vec::new(),
            used: 0,
            free_head: NIL,
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated for slots (occupied or vacant) and the page table.
    pub fn allocation_size(&self) -> usize {
        let slots: usize = self.pages.iter().map(Vec::capacity).sum();
        slots * std::mem::size_of::<Slot<T>>()
            + self.pages.capacity() * std::mem::size_of::<Vec<Slot<T>>>()
    }

    /// Makes room for `additional` more entries in the page being filled (small slabs grow
    /// their first page like a vector; later pages are allocated whole).
    pub fn reserve(&mut self, additional: usize) {
        match self.pages.last_mut() {
            Some(page) if page.len() < PAGE => {
                let room = PAGE - page.len();
                page.reserve_exact(additional.min(room));
            }
            _ => self.pages.push(Vec::with_capacity(additional.min(PAGE))),
        }
    }

    #[inline]
    fn slot(&self, idx: u32) -> &Slot<T> {
        &self.pages[(idx >> PAGE_BITS) as usize][idx as usize & (PAGE - 1)]
    }

    #[inline]
    fn slot_mut(&mut self, idx: u32) -> &mut Slot<T> {
        &mut self.pages[(idx >> PAGE_BITS) as usize][idx as usize & (PAGE - 1)]
    }

    /// Stores `value` and returns its index. Panics only past `u32::MAX - 1` entries.
    pub fn insert(&mut self, value: T) -> u32 {
        self.len += 1;
        if self.free_head != NIL {
            let idx = self.free_head;
            let slot = self.slot_mut(idx);
            let Slot::Vacant { next_free } = *slot else {
                unreachable!("free list points at an occupied slot")
            };
            *slot = Slot::Occupied(value);
            self.free_head = next_free;
            return idx;
        }
        assert!(self.used < NIL, "slab holds at most u32::MAX - 1 entries");
        let idx = self.used;
        match self.pages.last_mut() {
            Some(page) if page.len() < PAGE => page.push(Slot::Occupied(value)),
            _ => {
                // The first page grows like a vector (small slabs stay small); later pages
                // are allocated whole.
                let mut page = Vec::with_capacity(if self.pages.is_empty() { 4 } else { PAGE });
                page.push(Slot::Occupied(value));
                self.pages.push(page);
            }
        }
        self.used += 1;
        idx
    }

    pub fn remove(&mut self, idx: u32) -> T {
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
        self.free_head = idx;
        self.len -= 1;
        value
    }

    #[inline]
    pub fn get(&self, idx: u32) -> &T {
        match self.slot(idx) {
            Slot::Occupied(v) => v,
            Slot::Vacant { .. } => unreachable!("reading a vacant slab slot"),
        }
    }

    /// The entry at `idx`, or `None` if the slot is vacant or was never used (for handles that
    /// may have gone stale).
    #[inline]
    pub fn try_get(&self, idx: u32) -> Option<&T> {
        let page = self.pages.get((idx >> PAGE_BITS) as usize)?;
        match page.get(idx as usize & (PAGE - 1))? {
            Slot::Occupied(v) => Some(v),
            Slot::Vacant { .. } => None,
        }
    }

    #[inline]
    pub fn get_mut(&mut self, idx: u32) -> &mut T {
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
            page.clear();
        }
        self.used = 0;
        self.free_head = NIL;
        self.len = 0;
    }

    /// Slots the first page holds without growing.
    pub fn first_page_capacity(&self) -> usize {
        self.pages.first().map_or(0, Vec::capacity)
    }

    /// Hints the CPU to load slot `idx` (ignored for `NIL`); see [`prefetch`].
    #[inline]
    pub fn prefetch(&self, idx: u32) {
        if idx != NIL {
            prefetch(self.slot(idx));
        }
    }

    /// Occupied entries with their indices, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.pages
            .iter()
            .flatten()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Occupied(v) => Some((i as u32, v)),
                Slot::Vacant { .. } => None,
            })
    }
}

/// A doubly-linked list threaded through the entries of one slab.
#[derive(Clone, Copy, Debug)]
pub struct List {
    head: u32,
    tail: u32,
    len: u32,
}

impl Default for List {
    fn default() -> Self {
        List {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl List {
    #[inline]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The least recently used end.
    #[inline]
    pub fn head(&self) -> u32 {
        self.head
    }

    /// The most recently used end.
    #[inline]
    pub fn tail(&self) -> u32 {
        self.tail
    }

    pub fn clear(&mut self) {
        *self = List::default();
    }

    /// Appends `idx` (not in any list) at the tail.
    pub fn push_back<T: Linked>(&mut self, slab: &mut Slab<T>, idx: u32) {
        let old_tail = self.tail;
        *slab.get_mut(idx).links_mut() = Links {
            prev: old_tail,
            next: NIL,
        };
        if old_tail == NIL {
            self.head = idx;
        } else {
            slab.get_mut(old_tail).links_mut().next = idx;
        }
        self.tail = idx;
        self.len += 1;
    }

    /// Inserts `idx` (not in any list) just before `at` (in this list).
    pub fn insert_before<T: Linked>(&mut self, slab: &mut Slab<T>, at: u32, idx: u32) {
        let prev = slab.get(at).links().prev;
        *slab.get_mut(idx).links_mut() = Links { prev, next: at };
        slab.get_mut(at).links_mut().prev = idx;
        if prev == NIL {
            self.head = idx;
        } else {
            slab.get_mut(prev).links_mut().next = idx;
        }
        self.len += 1;
    }

    /// Inserts `idx` (not in any list) just after `at` (in this list).
    pub fn insert_after<T: Linked>(&mut self, slab: &mut Slab<T>, at: u32, idx: u32) {
        let next = slab.get(at).links().next;
        if next == NIL {
            self.push_back(slab, idx);
        } else {
            self.insert_before(slab, next, idx);
        }
    }

    /// Removes `idx` (in this list) from the list; the entry stays in the slab.
    pub fn unlink<T: Linked>(&mut self, slab: &mut Slab<T>, idx: u32) {
        let Links { prev, next } = *slab.get(idx).links();
        if prev == NIL {
            self.head = next;
        } else {
            slab.get_mut(prev).links_mut().next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            slab.get_mut(next).links_mut().prev = prev;
        }
        *slab.get_mut(idx).links_mut() = Links::default();
        self.len -= 1;
    }

    /// Moves `idx` (in this list) to the tail.
    pub fn move_to_back<T: Linked>(&mut self, slab: &mut Slab<T>, idx: u32) {
        if self.tail != idx {
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
    #[cfg(any(test, fuzzing, feature = "validate"))]
    pub fn validate<T: Linked>(&self, slab: &Slab<T>) -> Result<Vec<u32>, String> {
        let mut seen = Vec::with_capacity(self.len());
        let mut prev = NIL;
        let mut cur = self.head;
        while cur != NIL {
            if seen.len() > slab.len() {
                return Err("list longer than its slab (cycle?)".into());
            }
            let links = slab.get(cur).links();
            if links.prev != prev {
                return Err(format!("entry {cur}: prev {} != {}", links.prev, prev));
            }
            seen.push(cur);
            prev = cur;
            cur = links.next;
        }
        if prev != self.tail {
            return Err(format!("tail {} != last entry {prev}", self.tail));
        }
        if seen.len() != self.len() {
            return Err(format!("len {} != {} linked entries", self.len, seen.len()));
        }
        Ok(seen)
    }
}

pub struct ListIter<'a, T> {
    slab: &'a Slab<T>,
    next: u32,
}

impl<T: Linked> Iterator for ListIter<'_, T> {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        if self.next == NIL {
            return None;
        }
        let idx = self.next;
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
        let ids: Vec<u32> = (0..5)
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
        let removed = list.head();
        list.unlink(&mut slab, removed);
        assert_eq!(slab.remove(removed).0, 2);
        let reused = slab.insert(Node(7, Links::default()));
        assert_eq!(reused, removed, "freed slots are reused");
        list.validate(&slab).unwrap();
    }
}
