//! `LRUCachePolicy` and `ARCCachePolicy`: vLLM's `CachePolicy` protocol over the core policies.
//!
//! Both Python classes derive from `BaseCachePolicy`, which implements every protocol method
//! once and dispatches to the core policy. Each call converts and validates its whole input
//! (keys, chunks, positions, protected sets) before the core is touched, then runs its loop in
//! Rust; eviction reads reference counts straight from chunk memory.

use kvcache_core::{
    Access, ArcPolicy, InsertRank, Key, ListId, LruPolicy, RequestRank, SelfCounted,
};
use pyo3::exceptions::PyAssertionError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySet, PyTuple};

use crate::chunk::PyChunk;
use crate::conversion::{
    as_key, collect_keys, count, key_bytes, order_request_keys, with_hashed_keys, ContextTypeCache,
    Positions,
};
use crate::errors::IntoPyResult;
use crate::request_state::{require_context, Owner};

enum Inner {
    Lru(LruPolicy<PyChunk>),
    Arc(ArcPolicy<PyChunk>),
}

/// Shared implementation of the `CachePolicy` protocol; not instantiable itself.
#[pyclass(name = "BaseCachePolicy", module = "kvcache._core", subclass)]
pub struct BaseCachePolicy {
    inner: Inner,
    owner: Owner,
    contexts: ContextTypeCache,
}

fn capacity_arg(cache_capacity: &Bound<'_, PyAny>) -> PyResult<usize> {
    count(cache_capacity, "cache_capacity")
}

impl BaseCachePolicy {
    fn new(inner: Inner) -> Self {
        BaseCachePolicy {
            inner,
            owner: Owner::default(),
            contexts: ContextTypeCache::positions(),
        }
    }

    fn key<'a>(&self, bytes: &'a [u8]) -> Key<'a> {
        match &self.inner {
            Inner::Lru(p) => p.key(bytes),
            Inner::Arc(p) => p.key(bytes),
        }
    }

    /// Runs a policy call on `keys` (an iterable of bytes). Lists and tuples are read in place
    /// (no new reference per key); `call` must not run Python code.
    fn with_keys<R>(
        &mut self,
        keys: &Bound<'_, PyAny>,
        call: impl FnOnce(&mut Inner, &[Key<'_>]) -> R,
    ) -> PyResult<R> {
        let hasher = match &self.inner {
            Inner::Lru(p) => p.hasher().clone(),
            Inner::Arc(p) => p.hasher().clone(),
        };
        // SAFETY: the callers pass policy methods, which read chunk records from memory and
        // never call into Python.
        unsafe { with_hashed_keys(&mut self.inner, keys, &hasher, call) }
    }

    fn get_chunk(&self, key: Key<'_>) -> Option<&PyChunk> {
        match &self.inner {
            Inner::Lru(p) => p.get(key),
            Inner::Arc(p) => p.get(key),
        }
    }
}

/// Releases the ranks of requests whose state was collected since the last call.
fn bury_dead(lru: &mut LruPolicy<PyChunk>, owner: &Owner) {
    for token in owner.graveyard.take() {
        lru.release_request_rank(token.into());
    }
}

/// The request's rank in `lru`, kept on the context like vLLM's `_get_request_rank` does.
/// Every Python call happens before the policy changes.
fn request_rank(
    lru: &mut LruPolicy<PyChunk>,
    owner: &mut Owner,
    ctx: Option<&Bound<'_, PyAny>>,
) -> PyResult<RequestRank> {
    let ctx = require_context(ctx)?;
    bury_dead(lru, owner);
    if let Some(token) = owner
        .cached(ctx)
        .filter(|&t| lru.is_live_request_rank(t.into()))
    {
        return Ok(token.into());
    }
    let token = owner.token(ctx, |current| {
        lru.request_rank(current.map(Into::into)).into()
    })?;
    Ok(token.into())
}

#[pymethods]
impl BaseCachePolicy {
    /// The number of chunks the cache holds (the manager's `num_chunks`).
    #[getter]
    fn cache_capacity(&self) -> usize {
        match &self.inner {
            Inner::Lru(p) => p.capacity(),
            Inner::Arc(p) => p.capacity(),
        }
    }

    /// The chunk stored under `key` (the very object inserted), or None.
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let key = as_key(key)?;
        Ok(self
            .get_chunk(self.key(key_bytes(&key)))
            .map(|c| c.object(py)))
    }

    fn __contains__(&self, key: Bound<'_, PyAny>) -> PyResult<bool> {
        let key = as_key(key)?;
        Ok(self.get_chunk(self.key(key_bytes(&key))).is_some())
    }

    /// Always true: an empty policy is still a policy (truth tests must not depend on `len`).
    fn __bool__(&self) -> bool {
        true
    }

    /// Number of resident chunks.
    fn __len__(&self) -> usize {
        match &self.inner {
            Inner::Lru(p) => p.len(),
            Inner::Arc(p) => p.len(),
        }
    }

    /// Adds a newly allocated chunk. `req_context` (vLLM ≥ 0.33) gives LRU the key's token
    /// position; without one (the two-argument form) the key gets a fresh rank.
    #[pyo3(signature = (key, chunk, req_context=None))]
    fn insert(
        &mut self,
        key: Bound<'_, PyAny>,
        chunk: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let key = as_key(key)?;
        let chunk = PyChunk::extract(&chunk)?;
        let k = self.key(key_bytes(&key));
        match &mut self.inner {
            Inner::Arc(p) => p.insert(k, chunk).py_err(),
            Inner::Lru(p) => {
                if p.get(k).is_some() {
                    return Err(kvcache_core::CoreError::DuplicateKey(
                        kvcache_core::KeyBuf::new(k.bytes),
                    ))
                    .py_err();
                }
                let positions = Positions::new(req_context.as_ref(), &mut self.contexts)?;
                let rank = match positions.get(&key)? {
                    None => InsertRank::Fresh,
                    Some(pos) => InsertRank::Request(
                        request_rank(p, &mut self.owner, req_context.as_ref())?,
                        pos,
                    ),
                };
                let evictable = kvcache_core::HasRefCnt::ref_cnt(&chunk) == 0;
                p.insert(k, chunk, rank, evictable).py_err()
            }
        }
    }

    /// Drops a chunk whose store failed.
    fn remove(&mut self, key: Bound<'_, PyAny>) -> PyResult<()> {
        let key = as_key(key)?;
        let k = self.key(key_bytes(&key));
        let removed = match &mut self.inner {
            Inner::Lru(p) => p.remove(k),
            Inner::Arc(p) => p.remove(k),
        };
        removed.py_err().map(drop)
    }

    /// Marks keys recently used (the last key first, so the first key ends most recent).
    #[pyo3(signature = (keys, req_context=None))]
    fn touch(
        &mut self,
        keys: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.with_keys(&keys, |inner, ks| match inner {
            Inner::Lru(p) => p.touch(ks),
            Inner::Arc(p) => p.touch(ks, &SelfCounted),
        })
    }

    /// Store misses before insertion: ARC adapts to ghost hits; LRU treats them as a touch
    /// (vLLM's default), which only affects resident keys.
    #[pyo3(signature = (keys, req_context=None))]
    fn on_store_miss(
        &mut self,
        keys: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.with_keys(&keys, |inner, ks| match inner {
            Inner::Lru(p) => p.touch(ks),
            Inner::Arc(p) => p.on_store_miss(ks),
        })
    }

    /// A request's first observation of keys: LRU gives resident ones the request's rank at
    /// their token position; ARC ignores it (like vLLM's).
    fn on_request_access(
        &mut self,
        keys: Bound<'_, PyAny>,
        req_context: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let Inner::Lru(p) = &mut self.inner else {
            return Ok(());
        };
        let ctx = Some(&req_context);
        let keys = collect_keys(&keys)?;
        let positions = Positions::new(ctx, &mut self.contexts)?;
        let mut observed = Vec::with_capacity(keys.len());
        for key in &keys {
            let k = p.key(key_bytes(key));
            // Non-resident keys cannot change rank: skip their position lookups.
            if p.get(k).is_some() {
                observed.push((k, positions.get(key)?));
            }
        }
        let rank = request_rank(p, &mut self.owner, ctx)?;
        p.on_request_access(rank, &observed).py_err()
    }

    /// Applies one finished request's accesses in prefix order (see `order_request_keys`).
    fn on_request_finished(
        &mut self,
        key_groups: Bound<'_, PyAny>,
        insertion_only_keys: Bound<'_, PyAny>,
        reused_keys: Bound<'_, PyAny>,
        req_context: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let positions = Positions::new(Some(&req_context), &mut self.contexts)?;
        let ordered = order_request_keys(&key_groups, positions)?;
        match &mut self.inner {
            Inner::Lru(p) => {
                let ks: Vec<Key<'_>> = ordered.iter().map(|k| p.key(key_bytes(k))).collect();
                p.touch(&ks);
            }
            Inner::Arc(p) => {
                let ks: Vec<Key<'_>> = ordered.iter().map(|k| p.key(key_bytes(k))).collect();
                let entries = p.resolve(&ks);
                let insertion_only = KeySet::new(&insertion_only_keys);
                let reused = KeySet::new(&reused_keys);
                let mut accesses = Vec::with_capacity(ordered.len());
                for (key, idx) in ordered.iter().zip(entries) {
                    // Only resident keys can move: classify just those.
                    let access = if !p.is_resident(idx) {
                        Access::Other
                    } else if insertion_only.contains(key)? {
                        Access::InsertionOnly
                    } else if reused.contains(key)? {
                        Access::Reused
                    } else {
                        Access::Other
                    };
                    accesses.push((idx, access));
                }
                p.on_request_finished(&accesses);
            }
        }
        Ok(())
    }

    /// Evicts exactly `n` idle chunks not in `protected`, returning `[(key, chunk), ...]` in
    /// eviction order, or None (and no change) if that many cannot be found.
    fn evict<'py>(
        &mut self,
        py: Python<'py>,
        n: Bound<'py, PyAny>,
        protected: Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let n = count(&n, "n")?;
        let protected = collect_keys(&protected)?;
        let evicted = match &mut self.inner {
            Inner::Lru(p) => {
                bury_dead(p, &self.owner);
                let guard = p.protect(protected.iter().map(|k| p.key(key_bytes(k))));
                p.evict(n, &guard, &SelfCounted)
            }
            Inner::Arc(p) => {
                let guard = p.protect(protected.iter().map(|k| p.key(key_bytes(k))));
                p.evict(n, &guard, &SelfCounted)
            }
        };
        let Some(evicted) = evicted else {
            return Ok(None);
        };
        let items = evicted.into_iter().map(|e| {
            PyTuple::new(
                py,
                [
                    PyBytes::new(py, e.key.as_slice()).into_any(),
                    e.chunk.object(py),
                ],
            )
        });
        let items: Vec<_> = items.collect::<PyResult<_>>()?;
        Ok(Some(PyList::new(py, items)?))
    }

    /// Removes every chunk regardless of `ref_cnt`, and all adaptive/request state.
    fn clear(&mut self) {
        match &mut self.inner {
            Inner::Lru(p) => {
                p.clear();
                // Ranks buried before the clear are stale now.
                self.owner.graveyard.take();
            }
            Inner::Arc(p) => p.clear(),
        }
    }

    /// The chunk's `ref_cnt` went to 0. ARC reads `ref_cnt` itself and only checks the key.
    fn mark_evictable(&mut self, key: Bound<'_, PyAny>) -> PyResult<()> {
        let key = as_key(key)?;
        let k = self.key(key_bytes(&key));
        match &mut self.inner {
            Inner::Lru(p) => p.mark_evictable(k).py_err(),
            Inner::Arc(p) => p.check_resident(k).py_err(),
        }
    }

    /// The chunk's `ref_cnt` left 0. LRU requires the key to be evictable now.
    fn mark_non_evictable(&mut self, key: Bound<'_, PyAny>) -> PyResult<()> {
        let key = as_key(key)?;
        let k = self.key(key_bytes(&key));
        match &mut self.inner {
            Inner::Lru(p) => p.mark_non_evictable(k).py_err(),
            Inner::Arc(p) => p.check_resident(k).py_err(),
        }
    }

    /// Checks the policy's invariants; raises AssertionError naming the first broken one.
    fn validate(&self) -> PyResult<()> {
        let result = match &self.inner {
            Inner::Lru(p) => p.validate(),
            Inner::Arc(p) => p.validate(&SelfCounted),
        };
        result.map_err(PyAssertionError::new_err)
    }

    /// Internal state for tests and debugging (LRU: ranks in eviction order as vLLM's
    /// `(rank, -position)`; ARC: the four lists from LRU to MRU and the target).
    fn _debug_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let state = PyDict::new(py);
        match &self.inner {
            Inner::Lru(p) => {
                let ranks = PyDict::new(py);
                let evictable = PyList::empty(py);
                for e in p.entries() {
                    let key = PyBytes::new(py, e.key);
                    ranks.set_item(&key, (e.rank, -(e.position as i128)))?;
                    if e.evictable {
                        evictable.append(&key)?;
                    }
                }
                state.set_item("ranks", ranks)?;
                state.set_item("evictable", evictable)?;
                state.set_item("request_groups", p.num_request_groups())?;
            }
            Inner::Arc(p) => {
                for (name, list) in [
                    ("t1", ListId::T1),
                    ("t2", ListId::T2),
                    ("b1", ListId::B1),
                    ("b2", ListId::B2),
                ] {
                    let keys: Vec<_> = p.list_keys(list).map(|k| PyBytes::new(py, k)).collect();
                    state.set_item(name, PyList::new(py, keys)?)?;
                }
                state.set_item("target_t1_size", p.target_t1_size())?;
            }
        }
        Ok(state)
    }
}

/// Least-recently-used eviction with logical recency independent of pinning (vLLM's LRU).
#[pyclass(extends = BaseCachePolicy, name = "LRUCachePolicy", module = "kvcache._core")]
pub struct LruCachePolicy;

#[pymethods]
impl LruCachePolicy {
    #[new]
    fn new(cache_capacity: Bound<'_, PyAny>) -> PyResult<PyClassInitializer<Self>> {
        let capacity = capacity_arg(&cache_capacity)?;
        let base = BaseCachePolicy::new(Inner::Lru(LruPolicy::new(capacity)));
        Ok(PyClassInitializer::from(base).add_subclass(LruCachePolicy))
    }
}

/// Adaptive replacement (T1/T2 with ghost lists B1/B2), as vLLM's ARC.
#[pyclass(extends = BaseCachePolicy, name = "ARCCachePolicy", module = "kvcache._core")]
pub struct ArcCachePolicy;

#[pymethods]
impl ArcCachePolicy {
    #[new]
    fn new(cache_capacity: Bound<'_, PyAny>) -> PyResult<PyClassInitializer<Self>> {
        let capacity = capacity_arg(&cache_capacity)?;
        let base = BaseCachePolicy::new(Inner::Arc(ArcPolicy::new(capacity)));
        Ok(PyClassInitializer::from(base).add_subclass(ArcCachePolicy))
    }

    /// ARC's adaptive target size of T1, in `[0, cache_capacity]`.
    #[getter]
    fn target_t1_size(slf: PyRef<'_, Self>) -> f64 {
        match &slf.as_super().inner {
            Inner::Arc(p) => p.target_t1_size(),
            Inner::Lru(_) => unreachable!("ARCCachePolicy always wraps an ARC policy"),
        }
    }
}

/// A collection of keys tested for membership once per key: an exact `set` (what vLLM's
/// manager passes) is asked directly, anything else (a subclass may override `__contains__`)
/// through the container protocol.
enum KeySet<'a, 'py> {
    Set(Bound<'py, PySet>),
    Other(&'a Bound<'py, PyAny>),
}

impl<'a, 'py> KeySet<'a, 'py> {
    fn new(keys: &'a Bound<'py, PyAny>) -> Self {
        match keys.cast_exact::<PySet>() {
            Ok(set) => KeySet::Set(set.clone()),
            Err(_) => KeySet::Other(keys),
        }
    }

    fn contains(&self, key: &Bound<'py, PyBytes>) -> PyResult<bool> {
        match self {
            KeySet::Set(set) => set.contains(key),
            KeySet::Other(keys) => keys.contains(key),
        }
    }
}

/// vLLM's `order_request_keys`: one head-to-tail order across all KV-cache groups.
#[pyfunction(name = "order_request_keys")]
pub fn order_request_keys_py<'py>(
    key_groups: Bound<'py, PyAny>,
    req_context: Bound<'py, PyAny>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let positions = Positions::new(Some(&req_context), &mut ContextTypeCache::positions())?;
    order_request_keys(&key_groups, positions)
}
