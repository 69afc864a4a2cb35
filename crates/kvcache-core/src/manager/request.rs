//! Per-request cache access tracking (vLLM's `_RequestCacheAccess`).
//!
//! For each request the manager remembers the keys it observed, in first-seen order and by KV
//! cache group, and which of them it stored (inserted), reused (read while ready) or missed on
//! store. When the request finishes, the policy sees one access per key in prefix order. The
//! registry owns this state; the request's context holds only a [`RequestToken`], and the state
//! lives until the token is released (its context died) or the cache is reset. Under vLLM 0.34
//! semantics with a `store_threshold` it also remembers every key the request offered, which
//! counts toward the threshold once per request (vLLM's `counted_keys`).

use crate::index::{KeyIndex, Keyed};
use crate::key::{Key, KeyBuf, KeyHash, KeyHasher};
use crate::policy::EntryId;
use crate::registry::{Registry, RequestToken};
use crate::retention::RetentionHint;
use crate::slab::{Idx, Slab};

pub(crate) const INSERTED: u8 = 1;
pub(crate) const REUSED: u8 = 2;
pub(crate) const STORE_MISS: u8 = 4;

/// Cache-line aligned (64 bytes): an entry never straddles two lines.
#[repr(align(64))]
pub(crate) struct SeenKey {
    pub key: KeyBuf,
    /// Kept so that finishing the request hashes no key again.
    pub hash: KeyHash,
    pub group: u32,
    pub flags: u8,
    /// The key's policy entry when last seen resident, so finishing the request need not look
    /// the key up again; checked before use, as entries come and go.
    pub handle: Option<EntryId>,
}

impl Keyed for SeenKey {
    fn key_buf(&self) -> &KeyBuf {
        &self.key
    }
    fn key_buf_mut(&mut self) -> &mut KeyBuf {
        &mut self.key
    }
}

/// A key the request offered for store, counted toward `store_threshold` (vLLM 0.34).
pub(crate) struct CountedKey {
    key: KeyBuf,
}

impl Keyed for CountedKey {
    fn key_buf(&self) -> &KeyBuf {
        &self.key
    }
    fn key_buf_mut(&mut self) -> &mut KeyBuf {
        &mut self.key
    }
}

/// One request's accesses. `S` is the policy's own per-request state (LRU's rank).
pub(crate) struct RequestAccess<S> {
    pub(crate) seen: Slab<SeenKey>,
    pub(crate) index: KeyIndex,
    /// Keys counted toward `store_threshold` (kept apart from `seen`: a counted key is not
    /// necessarily observed, and `seen`'s order is the request's first-seen order).
    counted: Slab<CountedKey>,
    counted_index: KeyIndex,
    pub(crate) finished: bool,
    /// The caller has given the request's retention hint (or said it has none).
    pub(crate) hint_given: bool,
    /// The hint, until the policy first sees the request (see `Manager::set_retention_hint`).
    pub(crate) pending_hint: Option<RetentionHint>,
    pub(crate) policy_state: S,
}

impl<S> RequestAccess<S> {
    /// Hands the request's retention hint to `policy` if it still holds it: called right
    /// before each policy call that takes the request's state, so the policy hears of the
    /// hint when the request first reaches it, as under vLLM's manager (whose policy reads
    /// the hint from the request's context then: it never sees `on_new_request`).
    pub(crate) fn hand_hint<C, P: crate::Policy<C, Request = S>>(&mut self, policy: &mut P) {
        if let Some(hint) = self.pending_hint.take() {
            policy.on_request_hint(&mut self.policy_state, hint);
        }
    }
}

impl<S: Default> RequestAccess<S> {
    fn new() -> Self {
        RequestAccess {
            seen: Slab::default(),
            index: KeyIndex::default(),
            counted: Slab::default(),
            counted_index: KeyIndex::default(),
            finished: false,
            hint_given: false,
            pending_hint: None,
            policy_state: S::default(),
        }
    }
}

impl<S> RequestAccess<S> {
    pub(crate) fn find(&self, key: Key<'_>) -> Option<Idx> {
        self.index.find(&self.seen, key)
    }

    /// The request's entry for `key`, recording it if new: `(entry, newly observed)`.
    /// `handle` (the key's resident policy entry) is remembered unless `None`.
    pub(crate) fn observe(
        &mut self,
        hasher: &KeyHasher,
        key: Key<'_>,
        handle: Option<EntryId>,
    ) -> (Idx, bool) {
        let (idx, new) = self
            .index
            .find_or_insert(&mut self.seen, hasher, key, || SeenKey {
                key: KeyBuf::EMPTY,
                hash: key.hash,
                group: group_index(key.bytes),
                flags: 0,
                handle,
            });
        if new {
            self.seen.get_mut(idx).key.assign(key.bytes);
        } else if handle.is_some() {
            self.seen.get_mut(idx).handle = handle;
        }
        (idx, new)
    }

    /// Whether an earlier offer of this request counted `key` toward `store_threshold`.
    pub(crate) fn is_counted(&self, key: Key<'_>) -> bool {
        self.counted_index.find(&self.counted, key).is_some()
    }

    /// Remembers that this request counted `keys` toward `store_threshold`.
    pub(crate) fn count(&mut self, hasher: &KeyHasher, keys: &[Key<'_>]) {
        for &key in keys {
            self.counted_index
                .find_or_insert(&mut self.counted, hasher, key, || CountedKey {
                    key: KeyBuf::new(key.bytes),
                });
        }
    }

    pub(crate) fn set_handle(&mut self, idx: Idx, handle: EntryId) {
        self.seen.get_mut(idx).handle = Some(handle);
    }

    pub(crate) fn flags(&self, idx: Idx) -> u8 {
        self.seen.get(idx).flags
    }

    pub(crate) fn set(&mut self, idx: Idx, flag: u8) {
        self.seen.get_mut(idx).flags |= flag;
    }

    /// Keys in first-seen order (slab order: the slab never frees while the request lives).
    pub(crate) fn keys_in_order(&self) -> impl Iterator<Item = &SeenKey> {
        self.seen.iter().map(|(_, k)| k)
    }

    pub(crate) fn num_keys(&self) -> usize {
        self.seen.len()
    }

    /// Makes room for `n` more keys at once (a request's first offer is usually its prefix).
    pub(crate) fn reserve(&mut self, hasher: &KeyHasher, n: usize) {
        self.seen.reserve(n);
        self.index.reserve(&self.seen, hasher, n);
    }

    fn heap_bytes(&self) -> usize {
        self.seen.allocation_size()
            + self.index.allocation_size()
            + self.counted.allocation_size()
            + self.counted_index.allocation_size()
    }

    /// Empties a released request's tables for the next request, keeping their memory.
    fn recycle(&mut self)
    where
        S: Default,
    {
        self.seen.clear_keep_memory();
        self.index.clear_keep_memory();
        self.counted.clear_keep_memory();
        self.counted_index.clear_keep_memory();
        self.finished = false;
        self.hint_given = false;
        self.pending_hint = None;
        self.policy_state = S::default();
    }
}

/// Released request states kept for reuse (their tables' memory), so a request costs no
/// allocation in the steady state.
const POOL_SIZE: usize = 32;
/// Tables larger than this are freed rather than kept.
const POOL_MAX_KEYS: usize = 1024;

/// vLLM's `get_offload_group_idx`: the key's last 4 bytes, big-endian (fewer if shorter).
pub(crate) fn group_index(key: &[u8]) -> u32 {
    let tail = &key[key.len().saturating_sub(4)..];
    tail.iter().fold(0u32, |acc, &b| (acc << 8) | u32::from(b))
}

/// The manager's request states: a [`Registry`] of access tables, plus a pool of released
/// tables whose memory the next requests reuse.
pub(crate) struct RequestRegistry<S> {
    live: Registry<RequestAccess<S>>,
    pool: Vec<RequestAccess<S>>,
}

impl<S: Default> RequestRegistry<S> {
    pub(crate) fn new() -> Self {
        RequestRegistry {
            live: Registry::default(),
            pool: Vec::new(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    /// The request's state: `current` if it is still valid, else a fresh one.
    pub(crate) fn get_or_create(&mut self, current: Option<RequestToken>) -> RequestToken {
        let pool = &mut self.pool;
        self.live
            .get_or_insert_with(current, || pool.pop().unwrap_or_else(RequestAccess::new))
    }

    /// A valid token's state (None for a stale or released token).
    #[inline]
    pub(crate) fn get(&self, token: RequestToken) -> Option<&RequestAccess<S>> {
        self.live.get(token)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, token: RequestToken) -> Option<&mut RequestAccess<S>> {
        self.live.get_mut(token)
    }

    /// Forgets the request (its context died); returns its state for the policy to release.
    pub(crate) fn release(&mut self, token: RequestToken) -> Option<RequestAccess<S>> {
        self.live.remove(token)
    }

    /// Takes back a released request's state (its policy state already handed back) to reuse
    /// its memory.
    pub(crate) fn recycle(&mut self, mut access: RequestAccess<S>) {
        if self.pool.len() < POOL_SIZE && access.seen.first_page_capacity() <= POOL_MAX_KEYS {
            access.recycle();
            self.pool.push(access);
        }
    }

    /// Every request's state becomes stale (vLLM's `reset_cache`).
    pub(crate) fn reset(&mut self) {
        self.live.reset().for_each(drop);
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.live.allocation_size()
            + self
                .live
                .values()
                .chain(&self.pool)
                .map(RequestAccess::heap_bytes)
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_index_reads_the_last_four_bytes_big_endian() {
        assert_eq!(group_index(&[9, 9, 0, 0, 1, 2]), 0x0102);
        assert_eq!(group_index(&[1, 2]), 0x0102);
        assert_eq!(group_index(&[]), 0);
    }

    #[test]
    fn tokens_go_stale_on_reset_and_release() {
        let mut r = RequestRegistry::<()>::new();
        let t = r.get_or_create(None);
        assert_eq!(r.get_or_create(Some(t)), t);
        r.reset();
        assert_eq!(r.len(), 0);
        assert!(r.get(t).is_none());
        let t2 = r.get_or_create(Some(t));
        assert_ne!(t2, t);
        assert!(r.release(t2).is_some());
        assert!(r.get(t2).is_none());
    }
}
