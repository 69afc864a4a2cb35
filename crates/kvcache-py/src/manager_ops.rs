//! [`ManagerOps`]: the core manager's API with the policy type erased, so one Python class
//! runs a manager over any policy (`kinds` makes them, `manager` drives them).

use kvcache_core::manager::{
    ChunkId, ChunkTable, Event, LookupResult, Manager, ManagerConfig, MemoryUsage, Stats,
    StoreOutput,
};
use kvcache_core::{CoreResult, Inspection, Key, Policy, RequestToken, RetentionHint};

/// The Rust manager over any policy: its API with the policy type erased.
pub trait ManagerOps: Send {
    fn config(&self) -> &ManagerConfig;
    fn reads_positions(&self) -> bool;
    fn len(&self) -> usize;
    fn num_evictable(&self) -> usize;
    fn num_write_pending(&self) -> usize;
    fn num_requests(&self) -> usize;
    fn lookup(&self, key: Key<'_>) -> LookupResult;
    fn request(&mut self, current: Option<RequestToken>) -> RequestToken;
    fn is_live_request(&self, token: RequestToken) -> bool;
    fn wants_retention_hint(&self, token: RequestToken) -> bool;
    fn set_retention_hint(&mut self, token: RequestToken, hint: Option<RetentionHint>);
    fn note_ignored_hint(&mut self);
    fn check_request_call(&self, keys: &[Key<'_>], load: bool) -> CoreResult<()>;
    fn release_request(&mut self, token: RequestToken);
    fn prepare_load(
        &mut self,
        token: RequestToken,
        keys: &[Key<'_>],
        positions: &[Option<i64>],
        observed: &mut Vec<usize>,
    ) -> CoreResult<Vec<ChunkId>>;
    fn touch(&mut self, keys: &[Key<'_>]) -> CoreResult<()>;
    fn hint_next_uses(&mut self, keys: &[Key<'_>], next_uses: &[u64]);
    fn complete_load(&mut self, keys: &[Key<'_>]) -> CoreResult<()>;
    fn prepare_store(
        &mut self,
        token: RequestToken,
        keys: &[Key<'_>],
        positions: &[Option<i64>],
        observed: &mut Vec<usize>,
    ) -> CoreResult<Option<StoreOutput>>;
    fn complete_store(&mut self, keys: &[Key<'_>], success: bool) -> usize;
    fn unfinished_request_len(&self, token: RequestToken) -> Option<usize>;
    fn unfinished_request_keys(&self, token: RequestToken) -> Option<Vec<&[u8]>>;
    /// Finishes the request; `positions[i]` is the token position of its `i`-th observed key.
    fn finish_request(&mut self, token: RequestToken, positions: &[Option<i64>]);
    fn take_events(&mut self) -> Vec<Event>;
    fn requeue_events(&mut self, events: Vec<Event>);
    /// `reset`, refused while chunks of failed writes are deferred; and vLLM 0.34's CPU
    /// primary tier (tiering), see `kvcache_core::manager` `primary`.
    fn prepare_read(&mut self, keys: &[Key<'_>]) -> CoreResult<Vec<ChunkId>>;
    fn defer_write_release(&mut self, keys: &[Key<'_>]) -> CoreResult<Vec<ChunkId>>;
    fn release_deferred_write(&mut self, chunk_ids: &[i64]) -> CoreResult<()>;
    fn num_deferred(&self) -> usize;
    fn try_reset(&mut self) -> CoreResult<()>;
    fn take_stats(&mut self) -> Stats;
    fn memory_usage(&self) -> MemoryUsage;
    fn table(&self) -> &ChunkTable;
    fn inspect(&self) -> Inspection<'_>;
    /// Resident keys with their chunk ids.
    fn chunks(&self) -> Vec<(&[u8], ChunkId)>;
    /// The `store_threshold` tracker, least recent first; `None` when the threshold is off.
    fn tracked_offers(&self) -> Option<Vec<(&[u8], u32)>>;
    fn stores_skipped(&self) -> u64;
    #[cfg(feature = "validate")]
    fn validate(&self) -> Result<(), String>;
}

impl<P: Policy<ChunkId> + Send> ManagerOps for Manager<P>
where
    P::Request: Send,
{
    fn config(&self) -> &ManagerConfig {
        Manager::config(self)
    }
    fn reads_positions(&self) -> bool {
        P::READS_POSITIONS
    }
    fn len(&self) -> usize {
        Manager::len(self)
    }
    fn num_evictable(&self) -> usize {
        Manager::num_evictable(self)
    }
    fn num_write_pending(&self) -> usize {
        Manager::num_write_pending(self)
    }
    fn num_requests(&self) -> usize {
        Manager::num_requests(self)
    }
    fn lookup(&self, key: Key<'_>) -> LookupResult {
        Manager::lookup(self, key)
    }
    fn request(&mut self, current: Option<RequestToken>) -> RequestToken {
        Manager::request(self, current)
    }
    fn is_live_request(&self, token: RequestToken) -> bool {
        Manager::is_live_request(self, token)
    }
    fn wants_retention_hint(&self, token: RequestToken) -> bool {
        Manager::wants_retention_hint(self, token)
    }
    fn set_retention_hint(&mut self, token: RequestToken, hint: Option<RetentionHint>) {
        Manager::set_retention_hint(self, token, hint);
    }
    fn note_ignored_hint(&mut self) {
        Manager::note_ignored_hint(self);
    }
    fn check_request_call(&self, keys: &[Key<'_>], load: bool) -> CoreResult<()> {
        Manager::check_request_call(self, keys, load)
    }
    fn release_request(&mut self, token: RequestToken) {
        Manager::release_request(self, token);
    }
    fn prepare_load(
        &mut self,
        token: RequestToken,
        keys: &[Key<'_>],
        positions: &[Option<i64>],
        observed: &mut Vec<usize>,
    ) -> CoreResult<Vec<ChunkId>> {
        Manager::prepare_load(self, token, keys, positions, observed)
    }
    fn touch(&mut self, keys: &[Key<'_>]) -> CoreResult<()> {
        Manager::touch(self, keys)
    }
    fn hint_next_uses(&mut self, keys: &[Key<'_>], next_uses: &[u64]) {
        Manager::hint_next_uses(self, keys, next_uses);
    }
    fn complete_load(&mut self, keys: &[Key<'_>]) -> CoreResult<()> {
        Manager::complete_load(self, keys)
    }
    fn prepare_store(
        &mut self,
        token: RequestToken,
        keys: &[Key<'_>],
        positions: &[Option<i64>],
        observed: &mut Vec<usize>,
    ) -> CoreResult<Option<StoreOutput>> {
        Manager::prepare_store(self, token, keys, positions, observed)
    }
    fn complete_store(&mut self, keys: &[Key<'_>], success: bool) -> usize {
        Manager::complete_store(self, keys, success)
    }
    fn unfinished_request_len(&self, token: RequestToken) -> Option<usize> {
        Manager::unfinished_request_len(self, token)
    }
    fn unfinished_request_keys(&self, token: RequestToken) -> Option<Vec<&[u8]>> {
        Manager::unfinished_request_keys(self, token)
    }
    fn finish_request(&mut self, token: RequestToken, positions: &[Option<i64>]) {
        Manager::finish_request(self, token, positions);
    }
    fn take_events(&mut self) -> Vec<Event> {
        Manager::take_events(self)
    }
    fn requeue_events(&mut self, events: Vec<Event>) {
        Manager::requeue_events(self, events);
    }
    fn prepare_read(&mut self, keys: &[Key<'_>]) -> CoreResult<Vec<ChunkId>> {
        Manager::prepare_read(self, keys)
    }
    fn defer_write_release(&mut self, keys: &[Key<'_>]) -> CoreResult<Vec<ChunkId>> {
        Manager::defer_write_release(self, keys)
    }
    fn release_deferred_write(&mut self, chunk_ids: &[i64]) -> CoreResult<()> {
        Manager::release_deferred_write(self, chunk_ids)
    }
    fn num_deferred(&self) -> usize {
        Manager::num_deferred(self)
    }
    fn try_reset(&mut self) -> CoreResult<()> {
        Manager::try_reset(self)
    }
    fn take_stats(&mut self) -> Stats {
        Manager::take_stats(self)
    }
    fn memory_usage(&self) -> MemoryUsage {
        Manager::memory_usage(self)
    }
    fn table(&self) -> &ChunkTable {
        Manager::table(self)
    }
    fn inspect(&self) -> Inspection<'_> {
        self.policy().inspect()
    }
    fn chunks(&self) -> Vec<(&[u8], ChunkId)> {
        self.policy().resident().map(|(k, &c)| (k, c)).collect()
    }
    fn tracked_offers(&self) -> Option<Vec<(&[u8], u32)>> {
        Manager::tracked_offers(self).map(Iterator::collect)
    }
    fn stores_skipped(&self) -> u64 {
        Manager::stores_skipped(self)
    }
    #[cfg(feature = "validate")]
    fn validate(&self) -> Result<(), String> {
        Manager::validate(self)
    }
}
