//! vLLM's CPU *primary tier*: what `TieringOffloadingManager`
//! (`vllm/v1/kv_offload/tiering/manager.py`) asks of the CPU cache beyond the GPU-facing
//! protocol, with the decisions of vLLM's `CPUPrimaryTierOffloadingManager`. vLLM 0.33 asks
//! for `prepare_read` only; the deferred release is 0.34's.
//!
//! - [`Manager::prepare_read`]: pin ready chunks for a secondary tier to read (a cascade of a
//!   store to the secondary tiers). Unlike `prepare_load` it records no request access: a
//!   cascade is tiering's own transfer, not the request reading its cache again, so it moves
//!   no key in recency and does not count as reuse. `complete_load` unpins it.
//! - [`Manager::defer_write_release`]: fail pending writes (a promotion from a secondary tier
//!   that failed) as `complete_store(.., false)` would, except that the chunks are not freed:
//!   the keys leave the cache at once (lookups miss, a later store takes a fresh chunk) while
//!   the tier that was writing may still touch the chunks; they stay write-pending and out of
//!   the free list until [`Manager::release_deferred_write`] hands them back.
//! - [`Manager::try_reset`]: `reset_cache` is refused while released chunks are deferred (a
//!   tier may still write to them).
//!
//! Every call checks all its arguments before changing anything (vLLM asserts part-way).

use super::table::PENDING;
use super::{ChunkId, Event, Manager};
use crate::error::{CoreError, CoreResult};
use crate::key::{Key, KeyBuf};
use crate::policy::Policy;

impl<P: Policy<ChunkId>> Manager<P> {
    /// Pins ready chunks for a secondary tier to read; returns their chunk ids. Records no
    /// access of any request (see the module docs). Errors as `prepare_load`'s; nothing
    /// changes on an error.
    pub fn prepare_read(&mut self, keys: &[Key<'_>]) -> CoreResult<Vec<ChunkId>> {
        let resolved = self.policy.find_many(keys);
        let mut pins = Vec::with_capacity(keys.len());
        for (&key, &found) in keys.iter().zip(&resolved) {
            pins.push(self.loadable(key, found)?);
        }
        for &(handle, chunk) in &pins {
            self.pin(handle, chunk);
        }
        Ok(pins.into_iter().map(|(_, chunk)| chunk).collect())
    }

    /// Fails pending writes of `keys` like `complete_store(keys, false)`, but keeps their
    /// chunks write-pending and out of the free list until [`Self::release_deferred_write`];
    /// returns those chunk ids, in the order of `keys`. With events on, one metadata-only
    /// removal event names the keys. Every key must be a distinct pending write
    /// (`KeyNotFound`, `NotWritePending`, `DuplicateInOffer`); nothing changes on an error.
    pub fn defer_write_release(&mut self, keys: &[Key<'_>]) -> CoreResult<Vec<ChunkId>> {
        self.check_unique(keys)?;
        let resolved = self.policy.find_many(keys);
        let mut pending = Vec::with_capacity(keys.len());
        for (&key, &found) in keys.iter().zip(&resolved) {
            let Some((handle, chunk)) = self.resident(found) else {
                return Err(CoreError::KeyNotFound(KeyBuf::new(key.bytes)));
            };
            if self.table.record(chunk).ref_cnt() != PENDING {
                return Err(CoreError::NotWritePending(KeyBuf::new(key.bytes)));
            }
            pending.push((handle, chunk));
        }
        self.deferred.reserve(pending.len());
        let mut chunks = Vec::with_capacity(pending.len());
        for (handle, chunk) in pending {
            self.policy.remove(handle);
            self.deferred.insert(chunk);
            chunks.push(chunk);
        }
        if let (Some(events), false) = (&mut self.events, keys.is_empty()) {
            events.push(Event {
                keys: keys.iter().map(|k| KeyBuf::new(k.bytes)).collect(),
                removed: true,
                metadata_only: true,
                removal_expected: false,
            });
        }
        Ok(chunks)
    }

    /// Frees chunks whose release [`Self::defer_write_release`] deferred: they leave the
    /// write-pending count and join the free list in the order given. Every id must be a
    /// deferred chunk, named once (`NotDeferred`); nothing changes on an error.
    pub fn release_deferred_write(&mut self, chunk_ids: &[i64]) -> CoreResult<()> {
        // At most the deferred chunks, each once: anything longer fails before it allocates.
        let mut seen: hashbrown::HashSet<ChunkId, foldhash::fast::FixedState> =
            hashbrown::HashSet::default();
        let mut ids = Vec::new();
        for &id in chunk_ids {
            let chunk = ChunkId::try_from(id)
                .ok()
                .filter(|c| self.deferred.contains(c) && seen.insert(*c))
                .ok_or(CoreError::NotDeferred(id))?;
            ids.push(chunk);
        }
        for chunk in ids {
            self.deferred.remove(&chunk);
            self.num_write_pending -= 1;
            self.table.free(chunk);
        }
        Ok(())
    }

    /// Chunks whose release is deferred.
    pub fn num_deferred(&self) -> usize {
        self.deferred.len()
    }

    /// [`Self::reset`], refused (`DeferredWrites`, nothing changed) while chunks whose
    /// release is deferred exist: a secondary tier may still write to them.
    pub fn try_reset(&mut self) -> CoreResult<()> {
        if !self.deferred.is_empty() {
            return Err(CoreError::DeferredWrites(self.deferred.len()));
        }
        self.reset();
        Ok(())
    }
}

#[cfg(test)]
mod tests;
