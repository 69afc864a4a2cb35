//! Stores: deciding which offered keys to store and evicting to make room (`prepare_store`),
//! and completing or failing the writes (`complete_store`).

use super::request::{INSERTED, REUSED, STORE_MISS};
use super::{ChunkId, Event, Manager, Recorded, StoreOutput};
use crate::error::{CoreError, CoreResult};
use crate::key::{Key, KeyBuf};
use crate::policy::{EntryId, Policy, PolicyExt, Protected};
use crate::registry::RequestToken;

impl<P: Policy<ChunkId>> Manager<P> {
    /// [`unique_in`] with the manager's scratch table.
    pub(super) fn check_unique(&mut self, keys: &[Key<'_>]) -> CoreResult<()> {
        unique_in(keys, &mut self.scratch.offer)
    }

    /// Decides which offered keys to store, evicting to make room; `None` when it cannot.
    /// `positions[i]` is the token position of `keys[i]` in the request; `observed` as for
    /// [`prepare_load`](Self::prepare_load).
    pub fn prepare_store(
        &mut self,
        token: RequestToken,
        keys: &[Key<'_>],
        positions: &[Option<i64>],
        observed: &mut Vec<usize>,
    ) -> CoreResult<Option<StoreOutput>> {
        debug_assert_eq!(keys.len(), positions.len());
        self.check_unique(keys)?;
        // vLLM 0.34: which keys an earlier offer of this request counted toward the
        // threshold (they do not count again, and are not skipped stores again).
        let counted: Vec<bool> =
            if self.tracker.is_some() && self.config.semantics.counts_once_per_request() {
                let req = self.requests.get(token).ok_or(CoreError::StaleRequest)?;
                keys.iter().map(|&k| req.is_counted(k)).collect()
            } else {
                Vec::new()
            };
        let was_counted = |i: usize| counted.get(i).copied().unwrap_or(false);
        // Each key is looked up once. Recorded: store candidates (not resident; `ghost` is
        // any entry the policy keeps for them) and ready resident keys, in offer order.
        let mut recorded: Vec<Recorded<'_>> = Vec::with_capacity(keys.len());
        let mut protected = Vec::new();
        let mut skipped = 0u64;
        let tracker = self.tracker.as_ref();
        let resolved = self.policy.find_many(keys);
        for (i, ((&key, &position), &entry)) in
            keys.iter().zip(positions).zip(&resolved).enumerate()
        {
            if let Some((id, chunk)) = self.resident(entry) {
                if self.table.record(chunk).ref_cnt() >= 0 {
                    // A chunk this offer names must stay cached.
                    protected.push(id);
                    recorded.push(Recorded {
                        offer_index: i,
                        key,
                        resident: Some(id),
                        ghost: None,
                        position,
                    });
                }
                continue;
            }
            // After this offer is recorded, a tracked candidate counts one more (unless this
            // request counted it already); an untracked one at most 1, below any threshold
            // >= 2.
            if let Some(t) = tracker {
                let c = t.count(key);
                let after = i64::from(c) + i64::from(!was_counted(i));
                if c == 0 || after < self.config.store_threshold {
                    skipped += u64::from(!was_counted(i));
                    continue;
                }
            }
            recorded.push(Recorded {
                offer_index: i,
                key,
                resident: None,
                ghost: entry,
                position,
            });
        }
        self.check_not_finished(token, recorded.iter().map(|r| r.key))?;
        let num_to_store = recorded.iter().filter(|r| r.resident.is_none()).count();
        if num_to_store <= self.table.num_free() + self.num_evictable {
            self.table.reserve(num_to_store)?;
        }

        // Nothing can fail from here on.
        if let Some(tracker) = &mut self.tracker {
            tracker.record(keys, was_counted);
            self.stores_skipped += skipped;
        }
        if !counted.is_empty() {
            let req = self.requests.get_mut(token).expect("checked above");
            req.count(&self.hasher, keys);
        }
        let entries = self.record_access(token, &recorded, observed);
        let req = self.requests.get_mut(token).expect("checked above");
        // ARC learns from B1/B2 before insert() drops the ghost; once per key and request.
        let new_misses: Vec<Option<EntryId>> = recorded
            .iter()
            .zip(&entries)
            .filter(|&(r, &e)| r.resident.is_none() && req.flags(e) & STORE_MISS == 0)
            .map(|(r, _)| r.ghost)
            .collect();
        for (r, &e) in recorded.iter().zip(&entries) {
            if r.resident.is_none() {
                req.set(e, STORE_MISS);
            } else if req.flags(e) & INSERTED == 0 {
                req.set(e, REUSED);
            }
        }
        if !new_misses.is_empty() {
            self.policy
                .on_store_miss(&new_misses, &self.table, self.config.semantics);
        }

        if num_to_store == 0 {
            return Ok(Some(StoreOutput::default()));
        }
        self.allocation_sizes.push(num_to_store);
        let mut evicted = Vec::new();
        let needed = num_to_store.saturating_sub(self.table.num_free());
        if needed > 0 {
            if needed > self.num_evictable {
                return Ok(None);
            }
            let protected = Protected::from_ids(protected);
            let Some(victims) = self.policy.evict(needed, &protected, &self.table) else {
                return Ok(None);
            };
            self.num_evictable -= victims.len();
            evicted.reserve(victims.len());
            for victim in victims {
                self.table.free(victim.chunk);
                evicted.push(victim.key);
            }
        }
        if !evicted.is_empty() {
            if let Some(events) = &mut self.events {
                events.push(Event {
                    keys: evicted.clone(),
                    removed: true,
                    metadata_only: false,
                    removal_expected: false,
                });
            }
        }
        let chunk_ids = self.table.allocate(num_to_store);
        let req = self.requests.get_mut(token).expect("checked above");
        let mut stored = Vec::with_capacity(num_to_store);
        let stores = recorded
            .iter()
            .zip(&entries)
            .filter(|(r, _)| r.resident.is_none());
        req.hand_hint(&mut self.policy);
        for ((r, &e), &chunk) in stores.zip(&chunk_ids) {
            // A new chunk is pending (ref_cnt −1), so not evictable yet.
            let handle = self.policy.insert(
                &mut req.policy_state,
                r.ghost,
                r.key,
                chunk,
                r.position,
                false,
            );
            req.set(e, INSERTED);
            req.set_handle(e, handle);
            stored.push(r.offer_index);
        }
        self.num_write_pending += num_to_store;
        Ok(Some(StoreOutput {
            stored,
            chunk_ids,
            evicted,
        }))
    }

    /// Marks pending stores done: ready and evictable on success, dropped on failure. Keys that
    /// are absent or already ready are ignored. Returns how many keys it completed (with
    /// events on, they make one event).
    pub fn complete_store(&mut self, keys: &[Key<'_>], success: bool) -> usize {
        let mut completed = 0;
        let mut done = Vec::new();
        let resolved = self.policy.find_many(keys);
        for (&key, &found) in keys.iter().zip(&resolved) {
            // Checked against the key: a failed store of a key named twice removed it.
            let Some(handle) = found.filter(|&h| self.policy.is_entry_of(h, key.bytes)) else {
                continue;
            };
            let Some(&chunk) = self.policy.chunk(handle) else {
                continue;
            };
            if self.table.record(chunk).ref_cnt() >= 0 {
                continue;
            }
            self.num_write_pending -= 1;
            completed += 1;
            if success {
                self.table.record(chunk).set_ref_cnt(0);
                self.num_evictable += 1;
                self.policy.set_evictable(handle, true);
            } else {
                self.policy.remove(handle);
                self.table.free(chunk);
            }
            if self.events.is_some() {
                done.push(KeyBuf::new(key.bytes));
            }
        }
        if let (Some(events), false) = (&mut self.events, done.is_empty()) {
            events.push(Event {
                keys: done,
                removed: !success,
                metadata_only: !success,
                removal_expected: success && self.config.semantics.stored_events_expect_removal(),
            });
        }
        completed
    }
}

/// Refuses an offer that names a key twice (`table` is scratch space).
pub(super) fn unique_in(
    keys: &[Key<'_>],
    table: &mut hashbrown::HashTable<usize>,
) -> CoreResult<()> {
    if keys.len() < 2 {
        return Ok(());
    }
    table.clear();
    table.reserve(keys.len(), |&j| keys[j].hash.0);
    for (i, key) in keys.iter().enumerate() {
        let entry = table.entry(
            key.hash.0,
            |&j| keys[j].bytes == key.bytes,
            |&j| keys[j].hash.0,
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(_) => {
                return Err(CoreError::DuplicateInOffer(KeyBuf::new(key.bytes)));
            }
            hashbrown::hash_table::Entry::Vacant(slot) => {
                slot.insert(i);
            }
        }
    }
    Ok(())
}
