//! The turn policy: recency with credit for reuse, aware of KV prefixes and conversation turns.
//! Not a vLLM policy: kvcache's own, built for multi-turn traffic, where LRU loses most.
//!
//! What the traffic looks like, and what the policy does about it:
//! - **A chunk is worth something only while its whole prefix is cached**, so within a request
//!   the deepest chunk goes first, as in vLLM's LRU: a finished request's chunks are re-ranked
//!   from its tail to its head, and a request's new chunks are inserted tail-first.
//! - **Chunks read again and again (shared system prompts, long conversations) come back
//!   sooner** than chunks read once. Each resident chunk counts the requests that reused it; a
//!   chunk reused `r` times ranks as if used `CREDIT × capacity × log2(1 + min(r, 8))` key
//!   visits later than it was. A chunk's count survives its eviction (see ghosts below).
//! - **A conversation's first turn is mostly not followed by a second**, but a conversation
//!   that came back once will likely come back again. The policy remembers the keys it evicted
//!   recently (ghosts: a 60-bit fingerprint and the reuse count, no chunk). A request that
//!   reuses nothing resident and names no ghost is *fresh*: its new chunks are evicted before
//!   any other chunk until something reuses them. A request that names a ghost is a
//!   conversation coming back: its chunks are not fresh, and a ghost's key, stored again,
//!   gets its old count plus one.
//! - **The last chunk of a finished request is read again less often than the rest**, and in
//!   some traffic almost never: where a prompt's final partial block is hashed, the next
//!   turn's block there differs. The policy counts how many of the tails it ranked were read
//!   again (while resident, or stored again while remembered as ghosts). While fewer than one
//!   in four are, tails are *dead*: evicted before anything else. Otherwise an unreused tail
//!   ranks `capacity` key visits older than the rest of its request.
//! - **The application may know which conversations come back** and say so per request (a
//!   [`RetentionHint`]: the conversation continues, or it ended). The policy learns from a
//!   shadow sample of keys how much more or less often chunks of each hint come back than
//!   the average ([`hints`]), and ranks them that much later or earlier: up to two capacities
//!   of key visits either way, nothing while the evidence is within its statistical error.
//!   A hint that says nothing changes nothing, an inverted one is read the other way round,
//!   and a hinted chunk is still evicted when nothing else can go. A request whose hint is
//!   trusted to mean "comes back" is never judged fresh. Without hints the policy keeps no
//!   sample and decides exactly as it would without this rule.
//!
//! Eviction order: dead tails, then fresh chunks, each oldest first; then every other chunk
//! by its score, the smallest first: `tick + offset(class) + shift(hint)`, where `tick` is a
//! counter advanced once per chunk re-ranked at a request's finish (vLLM's LRU counts the same
//! way), the offset is the reuse credit (or the tail's demotion), and the shift is that of the
//! hint of the request that last ranked the chunk. Chunks of one class and hint share an
//! offset, so each is a list in tick order and the smallest score is at the head of one of
//! the lists. Only chunks marked evictable whose `ref_cnt` is 0 and that are not protected
//! are victims.
//!
//! The constants were chosen on kvcache's built-in multi-turn workload and on Mooncake's
//! public synthetic trace (5–50 % capacity; `docs/policies.md` has the figures): credits up to
//! eight reuses at 0.45 of the capacity per doubling, a tail demotion of one capacity, tails
//! dead below a one-in-four read rate, and ghosts for the last 2.5–5 capacities of evictions.
//! Larger credits win more on the smallest caches and start to lose to LRU at 50 %; fewer
//! ghosts miss more returning conversations.
//!
//! The hint rule's constants were chosen on the same two workloads with hints synthesised
//! from their future (exact, 10 % and 20 % wrong, random, inverted), see [`hints`].
//!
//! Complexity: `find`, `insert`, `remove` and each key of `on_request_access`,
//! `on_request_finished` and `touch` are O(1) (one ghost probe for a key not resident; with
//! hints, one probe of the sample per key stored, and one key in 16 hashed again at the finish
//! for the sample); planning an eviction of `n` is O(n × lists + entries skipped), over 30
//! scored lists. Memory per resident chunk: one 64-byte slab entry (40-byte inline key, links,
//! tick, chunk handle, class, reuse count, flags) plus ~5 bytes of hash table, and up to
//! 2 × 2.5 ghosts of 10 bytes (8-byte slots at most 80 % full), allocated as evictions happen;
//! with hints, the sampled keys awaiting their return (one in 16 of the chunks ranked within
//! four capacities of ticks: at most a quarter of a key per chunk, 13–22 bytes per chunk as
//! measured by `bench/memory_per_chunk.py`). A live request's state holds one insertion point
//! per list (32 × 24 bytes).

mod ghosts;
mod hints;
#[cfg(any(test, feature = "validate"))]
mod validate;

use crate::chunk::RefCounts;
use crate::entries::Entries;
use crate::index::Keyed;
use crate::key::{Key, KeyBuf};
use crate::policy::{Access, EntryId, Evicted, Inspection, Observed, Policy, RankedEntry, Stat};
use crate::retention::RetentionHint;
use crate::slab::{Idx, Links, List};
use ghosts::{Ghost, Ghosts};
use hints::{Group, HintStats, SAMPLE_EVERY};

/// Reuse credit per doubling of the reuse count, in thousandths of the capacity (in key
/// visits). From 0.35 to 0.50 the gain over LRU at 5 % capacity rose from 9 to 10 % on the
/// built-in workload (11–12 % on the trace); at 0.50 its 20 % and 50 % points fell below LRU.
const CREDIT_MILLI: u128 = 450;
/// Reuses that still earn credit; more count as this many.
const MAX_CREDITED_REUSES: u8 = 8;
/// `1000 × log2(1 + r)` for `r` in `0..=8`.
const LOG2_MILLI: [u128; 9] = [0, 1000, 1585, 2000, 2322, 2585, 2807, 3000, 3170];
/// Evictions a ghost generation holds, in tenths of the capacity (2.5: ghosts cover the last
/// 2.5–5 capacities of evictions). The trace's gain over LRU at 5 %: 9 % at 2.0, 12 % at 2.5,
/// 10 % at 3.0 (noisy); each generation costs at most 25 bytes per resident chunk.
const GHOST_GENERATION_TENTHS: usize = 25;
/// Tails are dead while fewer than one in this many marked tails was read again. The two
/// tuning workloads sit far apart (offline counts: the built-in one reads 78 % of its tails
/// again, the Mooncake trace 5 %); 4, 8 and 16 decided alike on both, while at 2 the
/// built-in workload's tails were judged dead at 20 % capacity and it fell below LRU there.
const DEAD_TAIL_RATIO: u32 = 4;
/// Tails marked before the estimate is trusted; until then tails are demoted, not dead.
const TAIL_SAMPLES_MIN: u32 = 64;
/// The estimate follows the traffic: both counts halve when this many tails were marked.
const TAIL_WINDOW: u32 = 4096;

/// A hint whose chunks rank this much later than unhinted ones (thousandths of the capacity)
/// is trusted to say they come back: its fresh requests' chunks are not judged fresh. At 0
/// random hints cost 8 % at 5 % capacity on the trace (a hint with no shift at all counted as
/// trusted); 0.25 and 1 decided alike.
const TRUST_MILLI: u128 = 250;

/// Which list an entry is on: `Dead`, then `Fresh`, are evicted first; the others (the
/// scored lists, from `Tail` on) by score.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Class {
    /// Unread tails while tails are judged dead: evicted before fresh chunks.
    Dead = 0,
    Fresh = 1,
    Tail = 2,
    /// Reused `r` times (`r` up to [`MAX_CREDITED_REUSES`]): `Reused0 as u8 + r`.
    Reused0 = 3,
}

/// Scored lists per group: the tail list and one per credited reuse count.
const GROUP_LISTS: usize = MAX_CREDITED_REUSES as usize + 2;
/// Lists: dead, fresh, then the scored lists of each [`Group`] (unhinted first, so that
/// without hints the lists are exactly those of a policy that knows nothing of hints).
const LISTS: usize = Class::Tail as usize + 3 * GROUP_LISTS;
const LIST_NAMES: [&str; LISTS] = [
    "dead", "fresh", "tail", "reused0", "reused1", "reused2", "reused3", "reused4", "reused5",
    "reused6", "reused7", "reused8", "continues_tail", "continues0", "continues1", "continues2",
    "continues3", "continues4", "continues5", "continues6", "continues7", "continues8",
    "ends_tail", "ends0", "ends1", "ends2", "ends3", "ends4", "ends5", "ends6", "ends7", "ends8",
];

/// The scored list of `group` for the class at `list` (a list of the unhinted group).
#[inline]
fn in_group(list: usize, group: Group) -> usize {
    list + group as usize * GROUP_LISTS
}

/// The group of a scored list.
#[inline]
fn group_of(list: usize) -> Group {
    Group::ALL[(list - Class::Tail as usize) / GROUP_LISTS]
}

const EVICTABLE: u8 = 1;
/// Stored by a fresh request and not reused since.
const FRESH_ORIGIN: u8 = 2;
/// Ranked last of a finished request and not reused since (counted in `tails_marked`).
const TAIL: u8 = 4;
/// The key is in the hint statistics' shadow sample (see [`hints`]).
const SAMPLED: u8 = 8;

struct TurnEntry<C> {
    key: KeyBuf,
    links: Links,
    tick: u64,
    chunk: C,
    list: u8,
    reuses: u8,
    flags: u8,
}

impl<C> TurnEntry<C> {
    #[inline]
    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

crate::entries::keyed_entry!(TurnEntry<C>);

/// Where a request last inserted into a list: its next (deeper) chunk goes just before.
#[derive(Clone, Copy, Debug)]
struct Run {
    idx: Idx,
    tick: u64,
}

/// What the policy knows of a live request.
#[derive(Clone, Debug, Default)]
pub struct TurnRequest {
    /// The request's accesses were shown (`on_request_access`); without them it is never
    /// judged fresh.
    observed: bool,
    /// It reused a resident chunk or named a ghost.
    returning: bool,
    /// What the application said of the request's conversation.
    hint: Option<RetentionHint>,
    runs: [Option<Run>; LISTS],
}

pub struct TurnPolicy<C> {
    capacity: usize,
    entries: Entries<TurnEntry<C>>,
    lists: [List; LISTS],
    /// Score offset of each list but `Fresh` (`Tail`'s is 0: the others start at the
    /// capacity, so the tail's demotion needs no negative numbers).
    offsets: [u64; LISTS],
    ghosts: Ghosts,
    tick: u64,
    /// The most chunks held at once since the policy was built or cleared.
    peak: usize,
    /// Tails marked, and how many of those were read again (both halved every
    /// [`TAIL_WINDOW`] marks).
    tails_marked: u32,
    tails_read: u32,
    /// What each kind of retention hint turned out to be worth.
    hints: HintStats,
    /// Each group's shift, in key visits and in thousandths of the capacity (see [`hints`]);
    /// the unhinted group's is 0.
    shifts: [i64; 3],
    shift_milli: [i64; 3],
    /// Score offset of each class of the unhinted group, before the shift (`Tail`'s is 0: the
    /// others start at the capacity, so the tail's demotion needs no negative numbers).
    class_offsets: [u64; GROUP_LISTS],
    /// Reads of chunks ranked later than unhinted ones because of their hint.
    hint_kept_hits: u64,
    /// A hint trusted this much (key visits of shift) makes its fresh requests' chunks not fresh.
    trust: i64,
    /// A request has carried a hint since the policy was built or cleared (until then the
    /// policy keeps no hint statistics).
    hinted: bool,
    /// Counts insertions since the last one sampled for the hint statistics.
    sample_clock: u32,
}

impl<C> TurnPolicy<C> {
    #[inline]
    fn list_of_reuses(reuses: u8) -> usize {
        Class::Reused0 as usize + usize::from(reuses.min(MAX_CREDITED_REUSES))
    }

    #[inline]
    fn score(&self, idx: Idx) -> u64 {
        let e = self.entries.get(idx);
        e.tick.saturating_add(self.offsets[usize::from(e.list)])
    }

    /// Whether tails are read again too rarely to keep.
    fn tails_dead(&self) -> bool {
        self.tails_marked >= TAIL_SAMPLES_MIN
            && self.tails_read.saturating_mul(DEAD_TAIL_RATIO) < self.tails_marked
    }

    fn note_tail_marked(&mut self) {
        self.tails_marked += 1;
        if self.tails_marked >= TAIL_WINDOW {
            self.tails_marked /= 2;
            self.tails_read /= 2;
        }
    }

    fn note_tail_read(&mut self) {
        self.tails_read = self.tails_read.saturating_add(1);
    }

    /// Starts the policy off judging tails dead (property tests and fuzz programs are too short
    /// to mark the tails that state needs, so they start in it).
    #[cfg(any(test, feature = "testing"))]
    pub fn start_with_dead_tails(&mut self) {
        self.tails_marked = TAIL_WINDOW / 2;
        self.tails_read = 0;
    }

    /// The list a chunk belongs on when its request finishes (`last`: the request's deepest;
    /// `dead`: tails are dead; `group`: of the request's hint).
    fn class_at_finish(&self, e: &TurnEntry<C>, last: bool, dead: bool, group: Group) -> usize {
        if e.reuses == 0 && last && dead {
            Class::Dead as usize
        } else if e.reuses == 0 && e.has(FRESH_ORIGIN) && !self.trusted(group) {
            Class::Fresh as usize
        } else if e.reuses == 0 && last {
            in_group(Class::Tail as usize, group)
        } else {
            in_group(Self::list_of_reuses(e.reuses), group)
        }
    }

    /// Whether the group's hint is trusted to say its chunks come back (they are then never
    /// judged fresh).
    #[inline]
    fn trusted(&self, group: Group) -> bool {
        self.shifts[group as usize] >= self.trust
    }

    /// Whether `list` holds chunks ranked later than unhinted ones because of their hint.
    #[inline]
    fn is_kept(&self, list: usize) -> bool {
        list >= Class::Tail as usize && self.shifts[group_of(list) as usize] > 0
    }

    /// Each scored list's offset: its class's, shifted by its group's. Every offset carries
    /// the largest shift down, so none is negative (a common term changes no order).
    fn refresh_offsets(&mut self) {
        let capacity = i64::try_from(self.capacity).unwrap_or(i64::MAX);
        let shifts = self.hints.shifts_milli();
        self.shift_milli = shifts;
        let max = i128::from(hints::MAX_SHIFT_MILLI);
        let floor = u64::try_from(i128::from(capacity) * max / 1000).unwrap_or(u64::MAX);
        for group in Group::ALL {
            let g = group as usize;
            let shift = i128::from(capacity) * i128::from(shifts[g]) / 1000;
            self.shifts[g] = i64::try_from(shift).unwrap_or(0);
            for (class, &offset) in self.class_offsets.iter().enumerate() {
                let list = in_group(Class::Tail as usize + class, group);
                let value = i128::from(offset) + i128::from(floor) + shift;
                self.offsets[list] = u64::try_from(value.max(0)).unwrap_or(u64::MAX);
            }
        }
    }

    /// Takes `idx` off its list.
    fn unlink(&mut self, idx: Idx) {
        let list = usize::from(self.entries.get(idx).list);
        self.lists[list].unlink(&mut self.entries.slab, idx);
    }

    /// Puts `idx` (on no list) at the tail of `list` with the current tick.
    fn append(&mut self, idx: Idx, list: usize) {
        let e = self.entries.get_mut(idx);
        e.list = u8::try_from(list).expect("LISTS < 256");
        e.tick = self.tick;
        self.lists[list].push_back(&mut self.entries.slab, idx);
    }

    /// Moves `idx` to the tail of `list` with the next tick (one re-ranked chunk).
    fn rerank(&mut self, idx: Idx, list: usize) {
        self.unlink(idx);
        self.tick += 1;
        self.append(idx, list);
    }

    fn delete(&mut self, idx: Idx) -> TurnEntry<C> {
        self.unlink(idx);
        self.entries.remove(idx)
    }

    /// Every resident entry in eviction order with its score, computed by sorting (the
    /// victim iterator merges the lists instead; the property tests compare the two).
    fn ranked(&self) -> Vec<(Idx, u64)> {
        let mut all: Vec<(usize, u64, usize, usize, Idx)> = Vec::with_capacity(self.len());
        for (list, l) in self.lists.iter().enumerate() {
            // Dead, dropped, then fresh, by age; then the scored lists.
            let stage = list.min(Class::Tail as usize);
            for (ordinal, idx) in l.iter(&self.entries.slab).enumerate() {
                let score = if stage < Class::Tail as usize { 0 } else { self.score(idx) };
                all.push((stage, score, list, ordinal, idx));
            }
        }
        all.sort_unstable();
        all.into_iter().map(|(_, s, _, _, idx)| (idx, s)).collect()
    }

    /// A group's shift in capacities, for [`Policy::stats`].
    fn shift_stat(&self, group: Group) -> Stat {
        let milli = i32::try_from(self.shift_milli[group as usize]).unwrap_or(0);
        Stat::Value(f64::from(milli) / 1000.0)
    }

    /// Entries on list `list` (tests).
    #[cfg(test)]
    fn list_len_at(&self, list: usize) -> usize {
        self.lists[list].len()
    }

    /// Entries on each list, for [`Policy::stats`].
    fn list_len(&self, class: Class) -> usize {
        self.lists[class as usize].len()
    }
}

impl<C> Policy<C> for TurnPolicy<C> {
    type Request = TurnRequest;

    const NAME: &'static str = "turn";
    const READS_POSITIONS: bool = false;
    const READS_ACCESS: bool = true;
    const READS_ABSENT: bool = true;

    fn new(capacity: usize) -> Self {
        let credit = |reuses: usize| -> u64 {
            let c = capacity as u128 * CREDIT_MILLI * LOG2_MILLI[reuses] / 1_000_000;
            u64::try_from(c).unwrap_or(u64::MAX)
        };
        let base = u64::try_from(capacity).unwrap_or(u64::MAX);
        let mut class_offsets = [0; GROUP_LISTS];
        for r in 0..=usize::from(MAX_CREDITED_REUSES) {
            class_offsets[1 + r] = base.saturating_add(credit(r));
        }
        let trust = i64::try_from(capacity as u128 * TRUST_MILLI / 1000).unwrap_or(i64::MAX);
        let mut policy = TurnPolicy {
            capacity,
            entries: Entries::with_capacity(capacity),
            lists: [List::default(); LISTS],
            offsets: [0; LISTS],
            ghosts: Ghosts::new(capacity.saturating_mul(GHOST_GENERATION_TENTHS) / 10),
            tick: 0,
            peak: 0,
            tails_marked: 0,
            tails_read: 0,
            hints: HintStats::new(capacity),
            shifts: [0; 3],
            shift_milli: [0; 3],
            class_offsets,
            hint_kept_hits: 0,
            trust,
            hinted: false,
            sample_clock: 0,
        };
        policy.refresh_offsets();
        policy
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    // Every entry is resident (ghosts live outside the slab). `remove` leaves no ghost: a
    // failed store's key was never cached.
    crate::entries::entry_lookups!(resident);

    #[inline]
    fn is_entry_of(&self, id: EntryId, key: &[u8]) -> bool {
        self.entries.entry_of(id.0, key).is_some()
    }

    fn resident<'a>(&'a self) -> impl Iterator<Item = (&'a [u8], &'a C)>
    where
        C: 'a,
    {
        self.lists.iter().flat_map(move |l| {
            l.iter(&self.entries.slab).map(move |i| {
                let e = self.entries.get(i);
                (e.key(), &e.chunk)
            })
        })
    }

    /// A key remembered as a ghost comes back with its old reuse count plus one (its
    /// request is then a returning one); otherwise a fresh request's chunk is fresh. The
    /// request's chunks enter their list tail-first: each goes just before the one the
    /// request inserted there last at the same tick.
    fn insert(
        &mut self,
        request: &mut TurnRequest,
        _found: Option<EntryId>,
        key: Key<'_>,
        chunk: C,
        _position: Option<i64>,
        evictable: bool,
    ) -> EntryId {
        // A fresh request's first key to store was no ghost; its deeper keys, evicted before
        // that one if at all (deepest first), are not looked for: it stays fresh.
        let fresh_request = request.observed && !request.returning;
        let ghost = if fresh_request {
            None
        } else {
            self.ghosts.take(key.hash.0)
        };
        let reuses = match ghost {
            Some(g) => {
                request.returning = true;
                if g.tail {
                    self.note_tail_read();
                }
                g.reuses.saturating_add(1)
            }
            None => 0,
        };
        // A sampled key stored again, after its eviction, has come back.
        let sampled = self.hinted && {
            self.hints.came_back(key.hash.0, self.tick);
            self.sample_clock = (self.sample_clock + 1) % SAMPLE_EVERY;
            self.sample_clock == 0
        };
        let group = Group::of_hint(request.hint);
        let list = if fresh_request && !self.trusted(group) {
            Class::Fresh as usize
        } else {
            in_group(Self::list_of_reuses(reuses), group)
        };
        // The run's entry may have moved or gone since; it still marks the place if it is on
        // this list with the current tick (any such place keeps the list in tick order).
        // Looked up before the new entry takes a slot, which may be the run's old one.
        let before = request.runs[list].filter(|run| {
            run.tick == self.tick
                && self
                    .entries
                    .slab
                    .try_get(run.idx)
                    .is_some_and(|e| usize::from(e.list) == list && e.tick == self.tick)
        });
        let idx = self.entries.insert(
            key,
            TurnEntry {
                key: KeyBuf::EMPTY,
                links: Links::default(),
                tick: self.tick,
                chunk,
                list: u8::try_from(list).expect("LISTS < 256"),
                reuses,
                flags: u8::from(evictable) * EVICTABLE
                    + u8::from(fresh_request) * FRESH_ORIGIN
                    + u8::from(sampled) * SAMPLED,
            },
        );
        match before {
            Some(run) => self.lists[list].insert_before(&mut self.entries.slab, run.idx, idx),
            None => self.lists[list].push_back(&mut self.entries.slab, idx),
        }
        request.runs[list] = Some(Run {
            idx,
            tick: self.tick,
        });
        self.peak = self.peak.max(self.len());
        EntryId(idx)
    }

    /// vLLM 0.33's `touch`: fresh ticks, tail to head, each key keeping its class.
    fn touch(&mut self, ids: &[Option<EntryId>], _counts: &impl RefCounts<C>) {
        for &EntryId(idx) in ids.iter().rev().flatten() {
            let list = usize::from(self.entries.get(idx).list);
            self.rerank(idx, list);
        }
    }

    /// A request that reuses a resident chunk is returning, and so is one whose first key
    /// to store was evicted recently (a conversation's earlier turn is evicted tail first,
    /// so where its next turn stops hitting, the ghosts begin; checking that one key per
    /// call instead of every key decided alike on both tuning workloads).
    fn on_request_access(&mut self, request: &mut TurnRequest, entries: &[Observed<'_>]) {
        request.observed = true;
        if !request.returning {
            request.returning = entries.iter().any(|o| o.id.is_some())
                || entries
                    .iter()
                    .find(|o| o.id.is_none())
                    .is_some_and(|o| self.ghosts.contains(o.key.hash.0));
        }
    }

    /// Reused chunks count one more reuse (a marked tail, a read); then the request's chunks
    /// are re-ranked from its tail to its head, so the head ends most recent. The tail, unless
    /// reused, is marked.
    fn on_request_finished(
        &mut self,
        request: &mut TurnRequest,
        entries: &[(Option<EntryId>, Access)],
    ) {
        for &(id, access) in entries {
            if let (Some(EntryId(idx)), Access::Reused) = (id, access) {
                let e = self.entries.get_mut(idx);
                e.reuses = e.reuses.saturating_add(1);
                let was_tail = e.has(TAIL);
                let list = usize::from(e.list);
                e.flags &= !(FRESH_ORIGIN | TAIL);
                if was_tail {
                    self.note_tail_read();
                }
                self.hint_kept_hits += u64::from(self.is_kept(list));
            }
        }
        let last = entries.len().checked_sub(1);
        if let Some(&(Some(EntryId(idx)), _)) = entries.last() {
            let e = self.entries.get_mut(idx);
            if e.reuses == 0 && !e.has(TAIL) {
                e.flags |= TAIL;
                self.note_tail_marked();
            }
        }
        let dead = self.tails_dead();
        let group = Group::of_hint(request.hint);
        for (i, &(id, access)) in entries.iter().enumerate().rev() {
            let Some(EntryId(idx)) = id else { continue };
            let e = self.entries.get(idx);
            if self.hinted && e.has(SAMPLED) {
                // One key in SAMPLE_DENOMINATOR is hashed again here: entries keep no hash.
                let hash = self.entries.hasher().hash(e.key()).0;
                if access == Access::Reused {
                    self.hints.came_back(hash, self.tick);
                }
                self.hints.mark(hash, group, self.tick);
            }
            let list = self.class_at_finish(self.entries.get(idx), Some(i) == last, dead, group);
            self.rerank(idx, list);
        }
        if self.hinted {
            self.refresh_offsets();
        }
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

    /// Hints are learned, not believed: see [`hints`].
    fn on_request_hint(&mut self, request: &mut TurnRequest, hint: RetentionHint) {
        request.hint = Some(hint);
        self.hinted = true;
    }

    fn hint_kept_hits(&self) -> u64 {
        self.hint_kept_hits
    }

    /// Forgets every chunk, ghost and count; ticks restart.
    fn clear(&mut self) {
        self.entries.clear();
        self.lists = [List::default(); LISTS];
        self.ghosts.clear();
        self.tick = 0;
        self.peak = 0;
        self.tails_marked = 0;
        self.tails_read = 0;
        self.hints.clear();
        self.hinted = false;
        self.sample_clock = 0;
        self.hint_kept_hits = 0;
        self.refresh_offsets();
    }

    /// Dead tails, then fresh chunks, oldest first; then the other lists merged by score
    /// (ties: the list with the lower index first, then list order).
    fn victims<'a>(
        &'a self,
        idle: impl Fn(EntryId, &C) -> bool + 'a,
    ) -> impl Iterator<Item = EntryId> + 'a {
        let slab = &self.entries.slab;
        let eligible = move |idx: Idx| {
            let e = slab.get(idx);
            e.has(EVICTABLE) && idle(EntryId(idx), &e.chunk)
        };
        // The first eligible entry from `at` on, with its score.
        let scan = move |mut at: Option<Idx>, eligible: &dyn Fn(Idx) -> bool| {
            while let Some(idx) = at {
                if eligible(idx) {
                    return Some((self.score(idx), idx));
                }
                at = slab.get(idx).links.next;
            }
            None
        };
        let mut first = self.lists[Class::Dead as usize]
            .iter(slab)
            .chain(self.lists[Class::Fresh as usize].iter(slab));
        let mut heads: Option<[Option<(u64, Idx)>; LISTS]> = None;
        std::iter::from_fn(move || {
            if let Some(idx) = first.by_ref().find(|&idx| eligible(idx)) {
                return Some(EntryId(idx));
            }
            // Each scored list's next candidate and its score, found once the dead and fresh
            // lists are spent.
            let heads = heads.get_or_insert_with(|| {
                std::array::from_fn(|list| {
                    (list >= Class::Tail as usize)
                        .then(|| scan(self.lists[list].head(), &eligible))
                        .flatten()
                })
            });
            let (list, (_, idx)) = heads
                .iter()
                .enumerate()
                .filter_map(|(list, h)| h.map(|h| (list, h)))
                .min_by_key(|&(list, (score, _))| (score, list))?;
            heads[list] = scan(slab.get(idx).links.next, &eligible);
            Some(EntryId(idx))
        })
    }

    /// The victim's key is remembered as a ghost with its reuse count and whether it was a
    /// marked tail.
    fn evict_entry(&mut self, id: EntryId) -> Evicted<C> {
        // A generation holds 2.5 ghosts per chunk of capacity, but a cache that has never held
        // half its capacity keeps ghosts for twice what it held at most (a table to match).
        let wanted = self.peak.saturating_mul(2 * GHOST_GENERATION_TENTHS) / 10;
        self.unlink(id.0);
        let (entry, hash) = self.entries.remove_hashed(id.0);
        let ghost = Ghost {
            reuses: entry.reuses,
            tail: entry.has(TAIL),
        };
        self.ghosts.remember(hash.0, ghost, wanted);
        Evicted {
            key: entry.key,
            chunk: entry.chunk,
        }
    }

    fn heap_bytes(&self) -> usize {
        self.entries.heap_bytes() + self.ghosts.heap_bytes() + self.hints.heap_bytes()
    }

    fn stats(&self) -> Vec<(&'static str, Stat)> {
        let in_groups = |group: Group| -> usize {
            (0..GROUP_LISTS)
                .map(|c| self.lists[in_group(Class::Tail as usize + c, group)].len())
                .sum()
        };
        let unreused = self.list_len(Class::Dead)
            + self.list_len(Class::Fresh)
            + self.list_len(Class::Tail);
        let (continues, ends) = (in_groups(Group::Continues), in_groups(Group::Ends));
        vec![
            ("fresh", Stat::Count(self.list_len(Class::Fresh))),
            ("tail", Stat::Count(self.list_len(Class::Tail))),
            ("dead", Stat::Count(self.list_len(Class::Dead))),
            ("reused", Stat::Count(self.len() - unreused - continues - ends)),
            ("ghosts", Stat::Count(self.ghosts.len())),
            ("tails_marked", Stat::Count(self.tails_marked as usize)),
            ("tails_read", Stat::Count(self.tails_read as usize)),
            ("continues", Stat::Count(continues)),
            ("ends", Stat::Count(ends)),
            ("continues_shift", self.shift_stat(Group::Continues)),
            ("ends_shift", self.shift_stat(Group::Ends)),
            ("hint_kept_hits", Stat::Count(usize::try_from(self.hint_kept_hits).unwrap_or(usize::MAX))),
            ("continues_sampled", Stat::Count(self.hints.marked(Group::Continues) as usize)),
            ("continues_returned", Stat::Count(self.hints.returned(Group::Continues) as usize)),
            ("ends_sampled", Stat::Count(self.hints.marked(Group::Ends) as usize)),
            ("ends_returned", Stat::Count(self.hints.returned(Group::Ends) as usize)),
            ("unhinted_sampled", Stat::Count(self.hints.marked(Group::Unhinted) as usize)),
            ("unhinted_returned", Stat::Count(self.hints.returned(Group::Unhinted) as usize)),
        ]
    }

    /// Lists from the oldest entry, and every entry's rank: its place in eviction order.
    fn inspect(&self) -> Inspection<'_> {
        let lists = LIST_NAMES
            .iter()
            .zip(&self.lists)
            .map(|(&name, l)| {
                let keys = l
                    .iter(&self.entries.slab)
                    .map(|i| self.entries.get(i).key())
                    .collect();
                (name, keys)
            })
            .collect();
        let ranks = self
            .ranked()
            .into_iter()
            .enumerate()
            .map(|(rank, (idx, _))| {
                let e = self.entries.get(idx);
                RankedEntry {
                    key: e.key(),
                    rank: u64::try_from(rank).expect("ranks fit in u64"),
                    position: 0,
                    evictable: e.has(EVICTABLE),
                }
            })
            .collect();
        Inspection {
            lists,
            ranks: Some(ranks),
            stats: self.stats(),
        }
    }

    #[cfg(any(test, feature = "validate"))]
    fn validate(&self) -> Result<(), String> {
        self.check_invariants()
    }
}

#[cfg(test)]
mod hint_tests;
#[cfg(test)]
mod tests;
