//! The turn policy's memory of evicted keys: for each, a 60-bit fingerprint of its hash and how
//! often it had been reused (or that it was a request's unread tail), in two generations of
//! open-addressing tables.
//!
//! A key evicted since the older generation began is remembered; when the newer generation
//! fills, the older one is dropped and the newer one becomes the older. So the table covers
//! between one and two generations' worth of the most recent evictions, with no list to keep
//! in eviction order. A generation's table is allocated at its first ghost, with exactly 5/4
//! slots per ghost it will hold (not a power of two: the home slot is found by multiplying,
//! not masking): 10 bytes per ghost, and no tables outgrown and left behind in the allocator.
//! It holds at most the generation's ghosts, and no more than the caller says it wants now
//! (the turn policy: 2.5 per resident chunk), so a cache given a huge capacity but holding
//! few chunks keeps a small table, replaced by a larger one when an empty generation is
//! reused. If the memory cannot be had, the table is halved until it can (down to nothing:
//! then no ghost is kept), never aborting.
//!
//! Fingerprints are the key's hash (computed once by the caller), so no key is hashed again.
//! Two keys share a fingerprint with probability 2⁻⁶⁰ per pair: a replay of millions of keys
//! meets none, and a collision would only misjudge one key's history, never corrupt state.

/// The low bits of a slot hold the ghost's record; the rest are the fingerprint.
const REUSE_BITS: u32 = 4;
const REUSE_MASK: u64 = (1 << REUSE_BITS) - 1;
/// The largest reuse count a ghost remembers; the one code above it marks an unread tail
/// (a tail is never reused, so the two need not be stored apart).
pub(super) const MAX_GHOST_REUSES: u8 = 14;
const TAIL_CODE: u64 = MAX_GHOST_REUSES as u64 + 1;
const _: () = assert!(TAIL_CODE == REUSE_MASK);

/// What a ghost remembers of its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Ghost {
    /// Requests that reused the chunk (at most [`MAX_GHOST_REUSES`]).
    pub(super) reuses: u8,
    /// The chunk was the last of a finished request and no request had read it since.
    pub(super) tail: bool,
}

impl Ghost {
    fn code(self) -> u64 {
        if self.tail && self.reuses == 0 {
            TAIL_CODE
        } else {
            u64::from(self.reuses.min(MAX_GHOST_REUSES))
        }
    }

    fn of_slot(slot: u64) -> Ghost {
        match slot & REUSE_MASK {
            TAIL_CODE => Ghost {
                reuses: 0,
                tail: true,
            },
            r => Ghost {
                reuses: u8::try_from(r).expect("four bits fit in a u8"),
                tail: false,
            },
        }
    }
}

/// A table is at most 80 % full.
const LOAD_NUM: usize = 4;
const LOAD_DEN: usize = 5;
/// The smallest table worth allocating (slots).
const MIN_SLOTS: usize = 64;

#[inline]
fn fingerprint(hash: u64) -> u64 {
    let fp = hash & !REUSE_MASK;
    // Zero marks an empty slot.
    if fp == 0 {
        1 << REUSE_BITS
    } else {
        fp
    }
}

/// One generation: linear probing with backward-shift deletion (no tombstones).
#[derive(Default)]
struct Generation {
    slots: Vec<u64>,
    len: usize,
}

impl Generation {
    /// Allocates the table for `ghosts` (fewer if the memory cannot be had).
    fn allocate(&mut self, ghosts: usize) {
        let mut want = (ghosts.saturating_mul(LOAD_DEN) / LOAD_NUM + 1).max(MIN_SLOTS);
        loop {
            let mut slots = Vec::new();
            if slots.try_reserve_exact(want).is_ok() {
                slots.resize(want, 0);
                self.slots = slots;
                return;
            }
            if want <= MIN_SLOTS {
                return;
            }
            want /= 2;
        }
    }

    /// Ghosts the table holds at 80 % load.
    fn room(&self) -> usize {
        self.slots.len() * LOAD_NUM / LOAD_DEN
    }

    #[inline]
    fn home(&self, fp: u64) -> usize {
        // The fingerprint is a well-mixed hash: scaled to the table, it picks the slot.
        let n = self.slots.len() as u128;
        usize::try_from((u128::from(fp) * n) >> 64).expect("below the table size")
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// Starts loading the cache line `fp`'s probe begins at (a lookup in the other
    /// generation then overlaps its miss with this one's).
    #[inline]
    fn prefetch(&self, fp: u64) {
        if !self.slots.is_empty() {
            crate::slab::prefetch(&self.slots[self.home(fp)]);
        }
    }

    /// The slot holding `fp`.
    fn position(&self, fp: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut i = self.home(fp);
        loop {
            let s = self.slots[i];
            if s == 0 {
                return None;
            }
            if s & !REUSE_MASK == fp {
                return Some(i);
            }
            i = self.next(i);
        }
    }

    /// Adds `fp` (the caller keeps the table within its room).
    fn insert(&mut self, fp: u64, ghost: Ghost) {
        debug_assert!(self.len < self.room());
        let value = fp | ghost.code();
        let mut i = self.home(fp);
        loop {
            let s = self.slots[i];
            if s == 0 {
                self.slots[i] = value;
                self.len += 1;
                return;
            }
            if s & !REUSE_MASK == fp {
                self.slots[i] = value;
                return;
            }
            i = self.next(i);
        }
    }

    /// Removes the ghost at `i`, shifting later members of its probe run back.
    fn remove_at(&mut self, mut i: usize) -> Ghost {
        let ghost = Ghost::of_slot(self.slots[i]);
        self.slots[i] = 0;
        self.len -= 1;
        let mut j = self.next(i);
        while self.slots[j] != 0 {
            let home = self.home(self.slots[j] & !REUSE_MASK);
            // `j` may move to the hole at `i` unless its home lies cyclically in (i, j].
            let stays = if i <= j {
                i < home && home <= j
            } else {
                i < home || home <= j
            };
            if !stays {
                self.slots[i] = self.slots[j];
                self.slots[j] = 0;
                i = j;
            }
            j = self.next(j);
        }
        ghost
    }

    fn clear(&mut self) {
        self.slots.fill(0);
        self.len = 0;
    }

    #[cfg(any(test, feature = "validate"))]
    fn check(&self) -> Result<(), String> {
        if self.len > self.room() {
            return Err(format!("a ghost table of {} slots holds {}", self.slots.len(), self.len));
        }
        let occupied = self.slots.iter().filter(|&&s| s != 0).count();
        if occupied != self.len {
            return Err(format!("ghost generation counts {} of {occupied}", self.len));
        }
        for (i, &s) in self.slots.iter().enumerate() {
            if s != 0 && self.position(s & !REUSE_MASK) != Some(i) {
                return Err(format!("ghost at slot {i} is not found from its home"));
            }
        }
        Ok(())
    }
}

/// Recently evicted keys with their reuse counts.
pub(super) struct Ghosts {
    newer: Generation,
    older: Generation,
    /// Ghosts per generation (0: remember nothing).
    generation: usize,
}

impl Ghosts {
    pub(super) fn new(generation: usize) -> Self {
        Ghosts {
            newer: Generation::default(),
            older: Generation::default(),
            generation,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.newer.len + self.older.len
    }

    /// Whether the key with this hash was evicted recently.
    #[inline]
    pub(super) fn contains(&self, hash: u64) -> bool {
        let fp = fingerprint(hash);
        self.older.prefetch(fp);
        self.newer.position(fp).is_some() || self.older.position(fp).is_some()
    }

    /// Forgets the key and returns what was remembered of it, if anything (its newest
    /// record: an older generation may hold a stale copy, which goes too).
    pub(super) fn take(&mut self, hash: u64) -> Option<Ghost> {
        let fp = fingerprint(hash);
        self.older.prefetch(fp);
        let newer = self.newer.position(fp).map(|i| self.newer.remove_at(i));
        let older = self.older.position(fp).map(|i| self.older.remove_at(i));
        newer.or(older)
    }

    /// Remembers an evicted key (counts above [`MAX_GHOST_REUSES`] are kept as that);
    /// `wanted` is how many ghosts a generation should hold at present (at most the
    /// generation set at construction).
    pub(super) fn remember(&mut self, hash: u64, ghost: Ghost, wanted: usize) {
        let per_generation = self.generation.min(wanted);
        if per_generation == 0 {
            return;
        }
        if self.newer.len > 0 && self.newer.len >= per_generation.min(self.newer.room()) {
            // The older generation ages out; its table is reused for the new one.
            std::mem::swap(&mut self.newer, &mut self.older);
            self.newer.clear();
        }
        if self.newer.len == 0 && self.newer.room() < per_generation {
            self.newer.allocate(per_generation);
            if self.newer.room() == 0 {
                return;
            }
        }
        // An older generation may still hold a copy of this key (a key stored again by a fresh
        // request is not looked for: see `TurnPolicy::insert`); `take` prefers this newer one
        // and removes both, so it is not looked for here either.
        self.newer.insert(fingerprint(hash), ghost);
    }

    pub(super) fn clear(&mut self) {
        self.newer = Generation::default();
        self.older = Generation::default();
    }

    pub(super) fn heap_bytes(&self) -> usize {
        (self.newer.slots.capacity() + self.older.slots.capacity()) * std::mem::size_of::<u64>()
    }

    #[cfg(any(test, feature = "validate"))]
    pub(super) fn check(&self) -> Result<(), String> {
        self.newer.check()?;
        self.older.check()?;
        if self.newer.len > self.generation || self.older.len > self.generation {
            return Err(format!(
                "a ghost generation holds {} / {} of {}",
                self.newer.len, self.older.len, self.generation
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reused(reuses: u8) -> Ghost {
        Ghost {
            reuses,
            tail: false,
        }
    }

    fn taken(g: &mut Ghosts, hash: u64) -> Option<u8> {
        g.take(hash).map(|ghost| ghost.reuses)
    }

    /// Hashes that collide on their home slot in a small table (same top bits).
    fn colliding(n: u64) -> Vec<u64> {
        (0..n).map(|i| (0xABCD_u64 << 48) | (i << 8)).collect()
    }

    #[test]
    fn remembers_takes_and_forgets_by_generation() {
        let mut g = Ghosts::new(3);
        for h in [0x1000_u64, 0x2000, 0x3000] {
            g.remember(h << 40, reused(2), usize::MAX);
        }
        assert_eq!(g.len(), 3);
        assert!(g.contains(0x1000 << 40));
        // A fourth ghost starts a new generation; the first three are still there.
        g.remember(0x4000 << 40, reused(7), usize::MAX);
        assert_eq!(g.len(), 4);
        assert_eq!(taken(&mut g, 0x2000 << 40), Some(2));
        assert_eq!(taken(&mut g, 0x2000 << 40), None);
        // Filling the new generation drops the old one.
        g.remember(0x5000 << 40, reused(0), usize::MAX);
        g.remember(0x6000 << 40, reused(0), usize::MAX);
        g.remember(0x7000 << 40, reused(0), usize::MAX);
        assert!(!g.contains(0x1000 << 40));
        assert_eq!(taken(&mut g, 0x4000 << 40), Some(7));
        g.check().unwrap();
    }

    #[test]
    fn a_table_is_sized_by_what_is_wanted_now() {
        // A huge generation, but few ghosts wanted: a small table, replaced by a larger one
        // once an empty generation is reused and more are wanted.
        let mut g = Ghosts::new(usize::MAX / 8);
        for i in 0..60_u64 {
            g.remember(i << 50, reused(0), 40);
        }
        assert_eq!(g.newer.slots.len(), MIN_SLOTS);
        assert_eq!(g.len(), 60, "two generations of at most 40");
        for i in 60..200_u64 {
            g.remember(i << 50, reused(0), 1_000);
        }
        assert!(g.newer.slots.len() > 1_000);
        g.check().unwrap();
    }

    #[test]
    fn deletion_keeps_probe_runs_findable() {
        let mut gen = Generation::default();
        gen.allocate(40);
        let hs = colliding(40);
        for (i, &h) in hs.iter().enumerate() {
            gen.insert(fingerprint(h), reused(u8::try_from(i % 15).unwrap()));
        }
        gen.check().unwrap();
        for &h in hs.iter().step_by(3) {
            let i = gen.position(fingerprint(h)).unwrap();
            gen.remove_at(i);
            gen.check().unwrap();
        }
        for (i, &h) in hs.iter().enumerate() {
            assert_eq!(gen.position(fingerprint(h)).is_some(), i % 3 != 0);
        }
    }

    #[test]
    fn the_newest_record_wins_and_counts_saturate() {
        let mut g = Ghosts::new(2);
        g.remember(0x10, reused(1), 2);
        g.remember(0x20, reused(1), 2);
        // A new generation: the key's older copy stays until it is taken.
        g.remember(0x10, reused(200), 2);
        g.check().unwrap();
        assert_eq!(g.len(), 3);
        assert_eq!(taken(&mut g, 0x10), Some(MAX_GHOST_REUSES));
        assert_eq!(taken(&mut g, 0x10), None, "both copies went");
        // Hash 0 still gets a non-empty fingerprint.
        g.remember(0, reused(3), 2);
        assert_eq!(taken(&mut g, 0), Some(3));
        // A tail is told apart from every reuse count.
        let tail = Ghost {
            reuses: 0,
            tail: true,
        };
        g.remember(0x30, tail, 2);
        g.remember(0x40, reused(MAX_GHOST_REUSES), 2);
        assert_eq!(g.take(0x30), Some(tail));
        assert_eq!(g.take(0x40), Some(reused(MAX_GHOST_REUSES)));
        let mut off = Ghosts::new(0);
        off.remember(0x10, reused(1), 9);
        assert_eq!(off.len(), 0);
    }
}
