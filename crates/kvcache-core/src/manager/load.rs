//! Loads: pinning ready chunks for reading (`prepare_load`), unpinning them
//! (`complete_load`), and the calls that only inform the policy (`touch`, next-use hints).

use super::request::{INSERTED, REUSED};
use super::{ChunkId, ChunkTable, Manager, Recorded};
use crate::error::{CoreError, CoreResult};
use crate::key::{Key, KeyBuf};
use crate::policy::{EntryId, Policy, PolicyExt};
use crate::registry::RequestToken;

impl<P: Policy<ChunkId>> Manager<P> {
    /// Pins ready chunks for reading; returns their chunk ids. `observed` receives the offer
    /// indices of keys the request sees for the first time, in the order it records them (the
    /// order of the indices [`finish_request`](Self::finish_request) passes back).
    pub fn prepare_load(
        &mut self,
        token: RequestToken,
        keys: &[Key<'_>],
        positions: &[Option<i64>],
        observed: &mut Vec<usize>,
    ) -> CoreResult<Vec<ChunkId>> {
        debug_assert_eq!(keys.len(), positions.len());
        let mut recorded = Vec::with_capacity(keys.len());
        let mut chunks = Vec::with_capacity(keys.len());
        let resolved = self.policy.find_many(keys);
        for (i, ((&key, &position), &found)) in
            keys.iter().zip(positions).zip(&resolved).enumerate()
        {
            let (handle, chunk) = self.loadable(key, found)?;
            recorded.push(Recorded {
                offer_index: i,
                key,
                resident: Some(handle),
                ghost: None,
                position,
            });
            chunks.push(chunk);
        }
        self.check_not_finished(token, keys.iter().copied())?;
        for (r, &chunk) in recorded.iter().zip(&chunks) {
            self.pin(r.resident.expect("loads are resident"), chunk);
        }
        let entries = self.record_access(token, &recorded, observed);
        let req = self.requests.get_mut(token).expect("checked above");
        for e in entries {
            if req.flags(e) & INSERTED == 0 {
                req.set(e, REUSED);
            }
        }
        Ok(chunks)
    }

    /// One more reader of a ready chunk: a chunk nobody read becomes non-evictable.
    pub(super) fn pin(&mut self, handle: EntryId, chunk: ChunkId) {
        let record = self.table.record(chunk);
        let cnt = record.ref_cnt();
        if cnt == 0 {
            debug_assert_ne!(self.policy.evictable(handle), Some(false));
            self.policy.set_evictable(handle, false);
            self.num_evictable -= 1;
        }
        record.set_ref_cnt(cnt + 1);
    }

    /// vLLM 0.33's `touch`: marks keys recently used. vLLM 0.34 has no `touch`.
    pub fn touch(&mut self, keys: &[Key<'_>]) -> CoreResult<()> {
        if !self.config.semantics.has_touch() {
            return Err(CoreError::Unsupported {
                what: "touch",
                semantics: self.config.semantics.name(),
            });
        }
        self.policy.touch_keys(keys, &self.table);
        Ok(())
    }

    /// Tells the policy when each resident key of `keys` is used next (`next_uses[i]`, a
    /// request index; `u64::MAX`: never). Absent keys are skipped. Only an offline caller
    /// knows this; online policies ignore it.
    pub fn hint_next_uses(&mut self, keys: &[Key<'_>], next_uses: &[u64]) {
        debug_assert_eq!(keys.len(), next_uses.len());
        let resolved = self.policy.find_many(keys);
        for (found, &next) in resolved.into_iter().zip(next_uses) {
            if let Some((id, _)) = self.resident(found) {
                self.policy.hint_next_use(id, next);
            }
        }
    }

    /// Unpins chunks after their loads finished.
    pub fn complete_load(&mut self, keys: &[Key<'_>]) -> CoreResult<()> {
        // Checked and applied in one pass, undone if a key fails: a key named twice unpins
        // twice, and must have been pinned twice. `zeroed`: this unpin made the count 0.
        let mut done: Vec<(EntryId, ChunkId, bool)> = Vec::with_capacity(keys.len());
        let undo = |table: &ChunkTable, done: &[(EntryId, ChunkId, bool)]| {
            for &(_, chunk, _) in done.iter().rev() {
                let record = table.record(chunk);
                record.set_ref_cnt(record.ref_cnt() + 1);
            }
        };
        let resolved = self.policy.find_many(keys);
        for (&key, &found) in keys.iter().zip(&resolved) {
            let Some((handle, chunk)) = self.resident(found) else {
                undo(&self.table, &done);
                return Err(CoreError::KeyNotFound(KeyBuf::new(key.bytes)));
            };
            let record = self.table.record(chunk);
            let cnt = record.ref_cnt();
            if cnt <= 0 {
                undo(&self.table, &done);
                return Err(CoreError::NoLoadPending(KeyBuf::new(key.bytes)));
            }
            record.set_ref_cnt(cnt - 1);
            done.push((handle, chunk, cnt == 1));
        }
        for (handle, _, zeroed) in done {
            if zeroed {
                self.num_evictable += 1;
                self.policy.set_evictable(handle, true);
            }
        }
        Ok(())
    }
}
