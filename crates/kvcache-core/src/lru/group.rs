//! Request groups: the keys one request ranked, contiguous on the LRU list right after the
//! request's anchor, ordered by position descending (ties: key bytes ascending).
//!
//! In prefix-order traffic a key joins at either end of its group (O(1)). One that lands
//! farther than `walk_limit` steps from both ends builds the group's position index, a map
//! from position to the run of members sharing it, and joins in O(log k) from then on.

use std::collections::BTreeMap;

use super::{LruEntry, LruPolicy, ANCHOR, IN_GROUP};
use crate::index::Keyed;
use crate::key::KeyBuf;
use crate::slab::{Idx, Links};

/// Consecutive members of a group sharing one position.
#[derive(Clone, Copy, Debug)]
pub(super) struct Run {
    pub(super) first: Idx,
    pub(super) last: Idx,
}

pub(super) struct Group {
    pub(super) anchor: Idx,
    pub(super) rank: u64,
    /// First and last member (`None` when empty).
    pub(super) first: Option<Idx>,
    pub(super) last: Option<Idx>,
    pub(super) len: u32,
    /// False once the request is gone: no key can join any more.
    pub(super) alive: bool,
    /// Position → run of members, built only once an insertion lands mid-group.
    pub(super) index: Option<BTreeMap<i64, Run>>,
}

/// Bytes a position index spends per run (B-tree node share, key and value), for accounting.
const BYTES_PER_RUN: usize = 48;

impl Group {
    pub(super) fn heap_bytes(&self) -> usize {
        self.index.as_ref().map_or(0, |i| i.len() * BYTES_PER_RUN)
    }
}

impl<C> LruPolicy<C> {
    /// A new live group of rank `rank`, its anchor appended to the list.
    pub(super) fn new_group(&mut self, rank: u64) -> Idx {
        let anchor = self.entries.insert_unindexed(LruEntry {
            key: KeyBuf::EMPTY,
            links: Links::default(),
            rank,
            pos: 0,
            group: None,
            flags: ANCHOR,
            chunk: None,
        });
        self.order.push_back(&mut self.entries.slab, anchor);
        let group = self.groups.insert(Group {
            anchor,
            rank,
            first: None,
            last: None,
            len: 0,
            alive: true,
            index: None,
        });
        self.entries.get_mut(anchor).group = Some(group);
        group
    }

    pub(super) fn drop_group(&mut self, group: Idx) {
        let g = self.groups.remove(group);
        self.order.unlink(&mut self.entries.slab, g.anchor);
        self.entries.remove_unindexed(g.anchor);
    }

    /// Takes member `idx` out of its group (it stays on the list); a released group that
    /// empties goes with its anchor.
    pub(super) fn leave_group(&mut self, idx: Idx) {
        let e = self.entries.get(idx);
        let (group_id, pos) = (e.group.expect("members name their group"), e.pos);
        let Links { prev, next } = e.links;
        let group = self.groups.get_mut(group_id);
        if let Some(index) = &mut group.index {
            let run = index.get_mut(&pos).expect("indexed member has a run");
            match (run.first == idx, run.last == idx) {
                (true, true) => {
                    index.remove(&pos);
                }
                (true, false) => run.first = next.expect("a run continues after its first"),
                (false, true) => run.last = prev.expect("a run starts before its last"),
                (false, false) => {}
            }
        }
        match (group.first == Some(idx), group.last == Some(idx)) {
            (true, true) => (group.first, group.last) = (None, None),
            (true, false) => group.first = next,
            (false, true) => group.last = prev,
            (false, false) => {}
        }
        group.len -= 1;
        let emptied = group.len == 0;
        if emptied {
            group.index = None;
        }
        let drop_group = emptied && !group.alive;
        let e = self.entries.get_mut(idx);
        e.flags &= !IN_GROUP;
        e.group = None;
        if drop_group {
            self.drop_group(group_id);
        }
    }

    /// Whether member-to-be `idx` sorts before group member `other` (position descending, key
    /// bytes ascending).
    #[inline]
    fn sorts_before(&self, idx: Idx, other: Idx) -> bool {
        let (a, b) = (self.entries.get(idx), self.entries.get(other));
        a.pos > b.pos || (a.pos == b.pos && a.key() < b.key())
    }

    /// Puts `idx` (detached) into group `group_id` at `pos`, keeping the group sorted.
    pub(super) fn attach_to_group(&mut self, idx: Idx, group_id: Idx, pos: i64) {
        let group = self.groups.get(group_id);
        let (anchor, first, last, rank, indexed) = (
            group.anchor,
            group.first,
            group.last,
            group.rank,
            group.index.is_some(),
        );
        {
            let e = self.entries.get_mut(idx);
            e.rank = rank;
            e.pos = pos;
            e.group = Some(group_id);
            e.flags |= IN_GROUP;
        }
        match (first, last) {
            _ if indexed => self.attach_indexed(idx, group_id, pos),
            (Some(first), Some(last)) => {
                if self.sorts_before(idx, first) {
                    self.order.insert_before(&mut self.entries.slab, first, idx);
                } else if !self.sorts_before(idx, last) {
                    self.order.insert_after(&mut self.entries.slab, last, idx);
                } else if !self.attach_near_ends(idx, first, last) {
                    self.build_index(group_id);
                    self.attach_indexed(idx, group_id, pos);
                }
            }
            _ => self.order.insert_after(&mut self.entries.slab, anchor, idx),
        }
        let prev = self.entries.get(idx).links.prev;
        let group = self.groups.get_mut(group_id);
        if group.len == 0 {
            (group.first, group.last) = (Some(idx), Some(idx));
        } else {
            if prev == Some(anchor) {
                group.first = Some(idx);
            }
            if prev == last {
                group.last = Some(idx);
            }
        }
        group.len += 1;
    }

    /// Tries to place `idx` (strictly between `first` and `last`) within `walk_limit` steps of
    /// either end.
    fn attach_near_ends(&mut self, idx: Idx, first: Idx, last: Idx) -> bool {
        let mut cur = self.entries.get(first).links.next;
        for _ in 0..self.walk_limit {
            let Some(at) = cur else { break };
            if self.sorts_before(idx, at) {
                self.order.insert_before(&mut self.entries.slab, at, idx);
                return true;
            }
            if at == last {
                break;
            }
            cur = self.entries.get(at).links.next;
        }
        let mut cur = self.entries.get(last).links.prev;
        for _ in 0..self.walk_limit {
            let Some(at) = cur else { break };
            if !self.sorts_before(idx, at) {
                self.order.insert_after(&mut self.entries.slab, at, idx);
                return true;
            }
            if at == first {
                break;
            }
            cur = self.entries.get(at).links.prev;
        }
        false
    }

    /// Indexes the group's members by position (one pass over the group).
    fn build_index(&mut self, group_id: Idx) {
        let group = self.groups.get(group_id);
        let mut index: BTreeMap<i64, Run> = BTreeMap::new();
        let mut cur = group.first;
        while let Some(idx) = cur {
            let pos = self.entries.get(idx).pos;
            index
                .entry(pos)
                .and_modify(|r| r.last = idx)
                .or_insert(Run {
                    first: idx,
                    last: idx,
                });
            if Some(idx) == group.last {
                break;
            }
            cur = self.entries.get(idx).links.next;
        }
        self.groups.get_mut(group_id).index = Some(index);
    }

    /// Inserts `idx` into an indexed group.
    fn attach_indexed(&mut self, idx: Idx, group_id: Idx, pos: i64) {
        let group = self.groups.get(group_id);
        let index = group.index.as_ref().expect("the group is indexed");
        if let Some(run) = index.get(&pos).copied() {
            // Same position (keys of several KV-cache groups): order by key bytes.
            let mut cur = run.first;
            loop {
                if self.entries.get(cur).key() > self.entries.get(idx).key() {
                    self.order.insert_before(&mut self.entries.slab, cur, idx);
                    if cur == run.first {
                        self.run_mut(group_id, pos).first = idx;
                    }
                    return;
                }
                if cur == run.last {
                    self.order.insert_after(&mut self.entries.slab, cur, idx);
                    self.run_mut(group_id, pos).last = idx;
                    return;
                }
                cur = self
                    .entries
                    .get(cur)
                    .links
                    .next
                    .expect("a run continues to its last member");
            }
        }
        let before = index.range(..pos).next_back().map(|(_, r)| r.first);
        let after = index.range(pos..).next().map(|(_, r)| r.last);
        let anchor = group.anchor;
        let slab = &mut self.entries.slab;
        match (before, after) {
            (Some(successor), _) => self.order.insert_before(slab, successor, idx),
            (None, Some(predecessor)) => self.order.insert_after(slab, predecessor, idx),
            (None, None) => self.order.insert_after(slab, anchor, idx),
        }
        self.groups
            .get_mut(group_id)
            .index
            .as_mut()
            .expect("the group is indexed")
            .insert(
                pos,
                Run {
                    first: idx,
                    last: idx,
                },
            );
    }

    fn run_mut(&mut self, group_id: Idx, pos: i64) -> &mut Run {
        self.groups
            .get_mut(group_id)
            .index
            .as_mut()
            .expect("the group is indexed")
            .get_mut(&pos)
            .expect("run exists")
    }
}
