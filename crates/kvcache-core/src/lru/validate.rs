//! LRU's invariant checker (tests, fuzzing and the Python test build only).

use std::collections::HashSet;

use super::{LruPolicy, ANCHOR, EVICTABLE, IN_GROUP};
use crate::index::Keyed;

impl<C> LruPolicy<C> {
    /// Checks every structural invariant; `Err` names the first one broken.
    pub(super) fn check_invariants(&self) -> Result<(), String> {
        let order = self.order.validate(&self.entries.slab)?;
        // Sort key of a node: anchors sort before their members.
        let sort_key = |i| {
            let e = self.entries.get(i);
            let member = (!e.has(ANCHOR)).then(|| (std::cmp::Reverse(e.pos), e.key()));
            (e.rank, member)
        };
        for pair in order.windows(2) {
            if sort_key(pair[0]) >= sort_key(pair[1]) {
                return Err(format!(
                    "list out of rank order at nodes {:?} and {:?}",
                    pair[0], pair[1]
                ));
            }
        }
        let group_ranks: HashSet<u64> = self.groups.iter().map(|(_, g)| g.rank).collect();
        let (mut anchors, mut keyed, mut grouped) = (0usize, 0usize, 0usize);
        for &i in &order {
            let e = self.entries.get(i);
            if e.rank > self.next_rank {
                return Err(format!(
                    "rank {} beyond the counter {}",
                    e.rank, self.next_rank
                ));
            }
            if e.has(ANCHOR) {
                anchors += 1;
                let group = e
                    .group
                    .and_then(|g| self.groups.try_get(g))
                    .ok_or("anchor without a group")?;
                if group.anchor != i || group.rank != e.rank {
                    return Err("anchor and group disagree".into());
                }
                if e.chunk.is_some() || e.has(EVICTABLE) || e.has(IN_GROUP) {
                    return Err("anchor with entry state".into());
                }
                continue;
            }
            keyed += 1;
            if e.chunk.is_none() {
                return Err(format!("{:?} has no chunk", e.key));
            }
            self.entries.check_indexed(i)?;
            if e.has(IN_GROUP) {
                grouped += 1;
                let group = e.group.and_then(|g| self.groups.try_get(g));
                if group.is_none_or(|g| g.rank != e.rank) {
                    return Err("grouped entry with a foreign rank".into());
                }
            } else if e.group.is_some() || group_ranks.contains(&e.rank) {
                return Err("fresh entry tied to a request group".into());
            }
        }
        if anchors != self.groups.len() {
            return Err(format!(
                "{anchors} anchors for {} groups",
                self.groups.len()
            ));
        }
        let mut members = 0usize;
        for (gid, group) in self.groups.iter() {
            if !group.alive && group.len == 0 {
                return Err(format!("dead empty group {gid:?} kept"));
            }
            // Members follow the anchor, contiguously, and first/last/len describe them.
            let mut seen = Vec::new();
            let mut cur = self.entries.get(group.anchor).links.next;
            while let Some(i) = cur {
                let e = self.entries.get(i);
                if !e.has(IN_GROUP) || e.group != Some(gid) {
                    break;
                }
                seen.push(i);
                cur = e.links.next;
            }
            if seen.len() != group.len as usize
                || seen.first().copied() != group.first
                || seen.last().copied() != group.last
            {
                return Err(format!(
                    "group {gid:?}: first/last/len do not match its members"
                ));
            }
            members += seen.len();
            if let Some(index) = &group.index {
                let mut runs = Vec::new();
                for &m in &seen {
                    let pos = self.entries.get(m).pos;
                    match runs.last_mut() {
                        Some((p, _, last)) if *p == pos => *last = m,
                        _ => runs.push((pos, m, m)),
                    }
                }
                let indexed: Vec<_> = index
                    .iter()
                    .rev()
                    .map(|(&p, r)| (p, r.first, r.last))
                    .collect();
                if runs != indexed {
                    return Err(format!("group {gid:?}: position index out of date"));
                }
            }
        }
        if members != grouped {
            return Err(format!("{grouped} grouped entries, {members} in groups"));
        }
        self.entries.check_counts(keyed, anchors)
    }
}
