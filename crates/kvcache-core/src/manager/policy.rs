//! What the manager needs from a policy, implemented by [`LruPolicy`] and [`ArcPolicy`] over
//! the manager's chunk ids. Per-request policy state (LRU's request rank) lives in the
//! manager's request registry, so it dies with the request like vLLM's state on `ReqContext`.

use crate::arc::{Access, ArcPolicy};
use crate::error::CoreResult;
use crate::eviction::Protected;
use crate::key::{Key, KeyBuf};
use crate::lru::{InsertRank, LruPolicy, RequestRank};
use crate::manager::table::{ChunkId, ChunkTable};
use crate::slab::NIL;

pub trait ManagerPolicy {
    /// Per-request state the policy keeps (dropped or released with the request).
    type RequestState: Default;

    fn new(capacity: usize) -> Self;
    fn name(&self) -> &'static str;
    /// The handle of a resident key (valid until that entry is removed).
    fn find(&self, key: Key<'_>) -> Option<u32>;
    fn chunk_at(&self, handle: u32) -> ChunkId;
    #[inline]
    fn get(&self, key: Key<'_>) -> Option<ChunkId> {
        self.find(key).map(|h| self.chunk_at(h))
    }
    /// The handle of any entry the policy keeps for each key (ARC: ghosts too), else `NIL`:
    /// what [`insert_resolved`](Self::insert_resolved) and
    /// [`on_store_miss_resolved`](Self::on_store_miss_resolved) take. One batched pass, so the
    /// lookups overlap their cache misses.
    fn resolve_entries(&self, keys: &[Key<'_>]) -> Vec<u32>;
    /// Whether a handle from [`resolve_entries`](Self::resolve_entries) names a resident entry.
    fn is_resident_at(&self, handle: u32) -> bool;
    /// Whether `handle` still names the resident entry of `key` (handles go stale when their
    /// entry is removed and the slot reused).
    fn handle_matches(&self, handle: u32, key: &[u8]) -> bool;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A new pending chunk for a non-resident key; `entry` is what
    /// [`resolve_entries`](Self::resolve_entries) returned for it (possibly stale since: checked).
    /// `position` is the key's token position in the storing request. Returns the new
    /// entry's handle.
    fn insert_resolved(
        &mut self,
        state: &mut Self::RequestState,
        entry: u32,
        key: Key<'_>,
        chunk: ChunkId,
        position: Option<i64>,
    ) -> CoreResult<u32>;
    fn remove_at(&mut self, handle: u32) -> ChunkId;
    fn touch(&mut self, keys: &[Key<'_>], table: &ChunkTable);
    /// Store misses, resolved with [`resolve_entries`](Self::resolve_entries) (so never resident),
    /// in offer order.
    fn on_store_miss_resolved(&mut self, entries: &[u32]);
    /// Keys a request observes for the first time, resolved (`NIL`: not resident).
    fn on_request_access(&mut self, state: &mut Self::RequestState, entries: &[(u32, Option<i64>)]);
    /// One finished request's resident entries (`NIL`: not resident) in prefix order, each
    /// with how the request used it.
    fn on_request_finished(&mut self, entries: &[(u32, Access)]);
    fn evict(
        &mut self,
        n: usize,
        protected: &[u32],
        table: &ChunkTable,
    ) -> Option<Vec<(KeyBuf, ChunkId)>>;
    fn mark_evictable_at(&mut self, handle: u32);
    fn mark_non_evictable_at(&mut self, handle: u32);
    fn release_request(&mut self, state: Self::RequestState);
    fn clear(&mut self);
    fn heap_bytes(&self) -> usize;
    #[cfg(any(test, fuzzing, feature = "validate"))]
    fn validate(&self, table: &ChunkTable) -> Result<(), String>;
}

impl ManagerPolicy for LruPolicy<ChunkId> {
    /// The request's rank and its group (checked before each use).
    type RequestState = Option<(RequestRank, u32)>;

    fn new(capacity: usize) -> Self {
        LruPolicy::new(capacity)
    }

    fn name(&self) -> &'static str {
        "lru"
    }

    #[inline]
    fn find(&self, key: Key<'_>) -> Option<u32> {
        LruPolicy::find(self, key)
    }

    #[inline]
    fn chunk_at(&self, handle: u32) -> ChunkId {
        *LruPolicy::chunk_at(self, handle)
    }

    fn resolve_entries(&self, keys: &[Key<'_>]) -> Vec<u32> {
        LruPolicy::resolve(self, keys)
    }

    #[inline]
    fn is_resident_at(&self, handle: u32) -> bool {
        handle != NIL
    }

    #[inline]
    fn handle_matches(&self, handle: u32, key: &[u8]) -> bool {
        LruPolicy::handle_matches(self, handle, key)
    }

    fn len(&self) -> usize {
        LruPolicy::len(self)
    }

    fn insert_resolved(
        &mut self,
        state: &mut Self::RequestState,
        entry: u32,
        key: Key<'_>,
        chunk: ChunkId,
        position: Option<i64>,
    ) -> CoreResult<u32> {
        debug_assert_eq!(entry, NIL, "LRU resolves only resident keys");
        // A new chunk is pending (ref_cnt −1), so never evictable yet.
        match position {
            None => LruPolicy::insert_absent(self, key, chunk, InsertRank::Fresh, false),
            Some(pos) => {
                let (rank, gid) = self.request_group(*state);
                *state = Some((rank, gid));
                Ok(LruPolicy::insert_absent_in_group(
                    self, key, chunk, gid, pos,
                ))
            }
        }
    }

    fn remove_at(&mut self, handle: u32) -> ChunkId {
        LruPolicy::remove_at(self, handle)
    }

    fn touch(&mut self, keys: &[Key<'_>], _table: &ChunkTable) {
        LruPolicy::touch(self, keys)
    }

    fn on_store_miss_resolved(&mut self, _entries: &[u32]) {
        // vLLM's default on_store_miss touches the keys; store misses are not resident and a
        // touch only re-ranks resident keys, so it changes nothing.
    }

    fn on_request_access(
        &mut self,
        state: &mut Self::RequestState,
        entries: &[(u32, Option<i64>)],
    ) {
        let (rank, gid) = self.request_group(*state);
        *state = Some((rank, gid));
        LruPolicy::on_request_access_at(self, rank, entries)
            .expect("a fresh request rank is valid");
    }

    fn on_request_finished(&mut self, entries: &[(u32, Access)]) {
        let entries: Vec<u32> = entries.iter().map(|&(h, _)| h).collect();
        LruPolicy::touch_resolved(self, &entries)
    }

    fn evict(
        &mut self,
        n: usize,
        protected: &[u32],
        table: &ChunkTable,
    ) -> Option<Vec<(KeyBuf, ChunkId)>> {
        let guard = Protected::from_handles(protected.iter().copied());
        let evicted = LruPolicy::evict(self, n, &guard, table)?;
        Some(evicted.into_iter().map(|e| (e.key, e.chunk)).collect())
    }

    fn mark_evictable_at(&mut self, handle: u32) {
        self.set_evictable_at(handle, true);
    }

    fn mark_non_evictable_at(&mut self, handle: u32) {
        let was = self.set_evictable_at(handle, false);
        debug_assert!(was, "idle ready chunks are evictable");
    }

    fn release_request(&mut self, state: Self::RequestState) {
        if let Some((rank, _)) = state {
            self.release_request_rank(rank);
        }
    }

    fn clear(&mut self) {
        LruPolicy::clear(self)
    }

    fn heap_bytes(&self) -> usize {
        LruPolicy::heap_bytes(self)
    }

    #[cfg(any(test, fuzzing, feature = "validate"))]
    fn validate(&self, _table: &ChunkTable) -> Result<(), String> {
        LruPolicy::validate(self)
    }
}

impl ManagerPolicy for ArcPolicy<ChunkId> {
    type RequestState = ();

    fn new(capacity: usize) -> Self {
        ArcPolicy::new(capacity)
    }

    fn name(&self) -> &'static str {
        "arc"
    }

    #[inline]
    fn find(&self, key: Key<'_>) -> Option<u32> {
        ArcPolicy::find(self, key).filter(|&h| self.is_resident(h))
    }

    #[inline]
    fn chunk_at(&self, handle: u32) -> ChunkId {
        *ArcPolicy::chunk_at(self, handle).expect("handles name resident entries")
    }

    fn resolve_entries(&self, keys: &[Key<'_>]) -> Vec<u32> {
        ArcPolicy::resolve(self, keys)
    }

    #[inline]
    fn is_resident_at(&self, handle: u32) -> bool {
        ArcPolicy::is_resident(self, handle)
    }

    #[inline]
    fn handle_matches(&self, handle: u32, key: &[u8]) -> bool {
        ArcPolicy::handle_matches(self, handle, key) && ArcPolicy::is_resident(self, handle)
    }

    fn len(&self) -> usize {
        ArcPolicy::len(self)
    }

    fn insert_resolved(
        &mut self,
        _: &mut (),
        entry: u32,
        key: Key<'_>,
        chunk: ChunkId,
        _: Option<i64>,
    ) -> CoreResult<u32> {
        Ok(ArcPolicy::insert_resolved(self, entry, key, chunk))
    }

    fn remove_at(&mut self, handle: u32) -> ChunkId {
        ArcPolicy::remove_at(self, handle)
    }

    fn touch(&mut self, keys: &[Key<'_>], table: &ChunkTable) {
        ArcPolicy::touch(self, keys, table)
    }

    fn on_store_miss_resolved(&mut self, entries: &[u32]) {
        ArcPolicy::on_store_miss_resolved(self, entries)
    }

    fn on_request_access(&mut self, _: &mut (), _: &[(u32, Option<i64>)]) {}

    fn on_request_finished(&mut self, entries: &[(u32, Access)]) {
        ArcPolicy::on_request_finished(self, entries)
    }

    fn evict(
        &mut self,
        n: usize,
        protected: &[u32],
        table: &ChunkTable,
    ) -> Option<Vec<(KeyBuf, ChunkId)>> {
        let guard = Protected::from_handles(protected.iter().copied());
        let evicted = ArcPolicy::evict(self, n, &guard, table)?;
        Some(evicted.into_iter().map(|e| (e.key, e.chunk)).collect())
    }

    // ARC reads ref_cnt itself; vLLM's ARC ignores these notifications.
    fn mark_evictable_at(&mut self, _handle: u32) {}

    fn mark_non_evictable_at(&mut self, _handle: u32) {}

    fn release_request(&mut self, _: ()) {}

    fn clear(&mut self) {
        ArcPolicy::clear(self)
    }

    fn heap_bytes(&self) -> usize {
        ArcPolicy::heap_bytes(self)
    }

    #[cfg(any(test, fuzzing, feature = "validate"))]
    fn validate(&self, table: &ChunkTable) -> Result<(), String> {
        ArcPolicy::validate(self, table)
    }
}
