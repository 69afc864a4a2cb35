//! Finishing a request: its keys in vLLM's order (`order_request_keys`), handed to the policy
//! once with how the request used each.

use super::request::{INSERTED, REUSED};
use super::{ChunkId, Manager};
use crate::key::Key;
use crate::policy::{Access, EntryId, Policy};
use crate::registry::RequestToken;

/// A finished request's key, for ordering: group, position, resident entry, access.
struct Finished {
    group: u32,
    position: Option<i64>,
    handle: Option<EntryId>,
    access: Access,
}

impl<P: Policy<ChunkId>> Manager<P> {
    /// The keys a request observed, in the order [`finish_request`](Self::finish_request) asks
    /// for their positions; `None` if the request is unknown or already finished (then
    /// finishing it changes nothing).
    pub fn unfinished_request_keys(&self, token: RequestToken) -> Option<Vec<&[u8]>> {
        let req = self.requests.get(token).filter(|r| !r.finished)?;
        Some(req.keys_in_order().map(|k| k.key.as_slice()).collect())
    }

    /// How many keys an unfinished request observed (see
    /// [`unfinished_request_keys`](Self::unfinished_request_keys)).
    pub fn unfinished_request_len(&self, token: RequestToken) -> Option<usize> {
        let req = self.requests.get(token).filter(|r| !r.finished)?;
        Some(req.num_keys())
    }

    /// Applies the finished request's accesses to the policy, once. `positions[i]` is the
    /// token position of the request's `i`-th observed key (missing entries: unknown).
    pub fn finish_request(&mut self, token: RequestToken, positions: &[Option<i64>]) {
        let Some(req) = self.requests.get(token) else {
            return;
        };
        if req.finished {
            return;
        }
        // vLLM's order_request_keys: key groups by group index, each in first-seen order and
        // sorted by position when all its keys have one; across groups by position when every
        // key has one (stable, so ties keep the group order).
        let mut ordered: Vec<Finished> = Vec::with_capacity(req.num_keys());
        let mut all_positioned = true;
        let mut one_group = true;
        for (i, k) in req.keys_in_order().enumerate() {
            let position = positions.get(i).copied().flatten();
            all_positioned &= position.is_some();
            one_group &= k.group == ordered.first().map_or(k.group, |f: &Finished| f.group);
            let key = k.key.as_slice();
            let cached = k.handle.filter(|&h| self.policy.is_entry_of(h, key));
            let handle = cached
                .or_else(|| {
                    self.policy.find(Key {
                        bytes: key,
                        hash: k.hash,
                    })
                })
                .filter(|&h| self.policy.chunk(h).is_some());
            let access = if !P::READS_ACCESS {
                Access::Other
            } else if k.flags & REUSED != 0 {
                Access::Reused
            } else if k.flags & INSERTED != 0 {
                Access::InsertionOnly
            } else {
                Access::Other
            };
            ordered.push(Finished {
                group: k.group,
                position,
                handle,
                access,
            });
        }
        if all_positioned {
            // Usually in prefix order already (then the stable sort would change nothing).
            if !ordered.is_sorted_by_key(|f| (f.position, f.group)) {
                ordered.sort_by_key(|f| (f.position, f.group));
            }
        } else {
            if !one_group {
                ordered.sort_by_key(|f| f.group);
            }
            for run in ordered.chunk_by_mut(|a, b| a.group == b.group) {
                if run.iter().all(|f| f.position.is_some()) {
                    run.sort_by_key(|f| f.position);
                }
            }
        }
        let accesses: Vec<(Option<EntryId>, Access)> =
            ordered.iter().map(|f| (f.handle, f.access)).collect();
        let req = self.requests.get_mut(token).expect("checked above");
        req.hand_hint(&mut self.policy);
        self.policy
            .on_request_finished(&mut req.policy_state, &accesses);
        req.finished = true;
    }
}
