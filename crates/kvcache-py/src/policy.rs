//! vLLM's `CachePolicy` protocol over any core [`Policy`].
//!
//! `BaseCachePolicy` implements every protocol method once, for every policy: the Python
//! classes (`LRUCachePolicy`, `ARCCachePolicy`, …) are declared in `kinds` and differ only in
//! the core policy they wrap. Each call converts and validates its whole input (keys, chunks,
//! positions, protected sets) before the core is touched, then runs its loop in Rust; eviction
//! reads reference counts straight from chunk memory. Calls are serialised by the object's lock
//! (see `guard`).

use kvcache_core::{
    Access, CoreError, Evicted, Observed, Policy, PolicyExt, Registry, SelfCounted, Stat,
    VllmSemantics,
};
use pyo3::gc::{PyTraverseError, PyVisit};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySet, PyTuple};

use crate::chunk::PyChunk;
use crate::context::{order_request_keys, require_context, ContextTypeCache, Positions};
use crate::conversion::{
    collect_keys, collect_named_keys, key_bytes, type_name, with_core_keys, EvictCount, PyKey,
};
use crate::errors::IntoPyResult;
use crate::exceptions::{exceptions, new_err};
use crate::guard::Guarded;
use crate::hints::read_hint;
use crate::request_state::{Owner, Token};

/// The `CachePolicy` protocol on one core policy, whatever its type.
pub trait PolicyOps: Send {
    fn capacity(&self) -> usize;
    fn len(&self) -> usize;
    fn get<'py>(&self, py: Python<'py>, key: &PyKey<'_, 'py>) -> Option<Bound<'py, PyAny>>;
    fn insert(
        &mut self,
        key: &PyKey<'_, '_>,
        chunk: PyChunk,
        ctx: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()>;
    fn remove(&mut self, key: &PyKey<'_, '_>) -> PyResult<()>;
    fn touch(&mut self, keys: &Bound<'_, PyAny>) -> PyResult<()>;
    fn on_store_miss(&mut self, keys: &Bound<'_, PyAny>) -> PyResult<()>;
    fn semantics(&self) -> VllmSemantics;
    fn on_request_access(
        &mut self,
        keys: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyAny>,
    ) -> PyResult<()>;
    fn on_request_finished(
        &mut self,
        key_groups: &Bound<'_, PyAny>,
        insertion_only: &Bound<'_, PyAny>,
        reused: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyAny>,
    ) -> PyResult<()>;
    fn evict<'py>(
        &mut self,
        py: Python<'py>,
        n: usize,
        protected: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyList>>>;
    fn clear(&mut self);
    fn mark_evictable(&mut self, key: &PyKey<'_, '_>) -> PyResult<()>;
    fn mark_non_evictable(&mut self, key: &PyKey<'_, '_>) -> PyResult<()>;
    fn stat(&self, name: &str) -> Option<Stat>;
    fn debug_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>>;
    fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError>;
    #[cfg(feature = "validate")]
    fn validate(&self) -> Result<(), String>;
}

/// A core policy with what the bindings keep beside it: per-request states (named by tokens
/// stored on the request contexts) and the context type cache.
pub struct Host<P: Policy<PyChunk>> {
    policy: P,
    /// The vLLM release whose protocol the policy follows (`touch`, `on_store_miss`).
    semantics: VllmSemantics,
    owner: Owner,
    contexts: ContextTypeCache,
    requests: Registry<HostRequest<P::Request>>,
}

/// A request's policy state, and whether its retention hint was read yet.
#[derive(Default)]
struct HostRequest<S> {
    state: S,
    hint_given: bool,
}

impl<P: Policy<PyChunk>> Host<P> {
    pub fn new(capacity: usize, semantics: VllmSemantics) -> Self {
        Host {
            policy: P::new(capacity),
            semantics,
            owner: Owner::default(),
            contexts: ContextTypeCache::positions(),
            requests: Registry::default(),
        }
    }

    /// Releases the states of requests whose context was collected since the last call.
    fn bury_dead(&mut self) {
        let (requests, policy) = (&mut self.requests, &mut self.policy);
        self.owner.bury_dead(|token| {
            if let Some(request) = requests.remove(token) {
                policy.release_request(request.state);
            }
        });
    }

    /// The token of the request's state, kept on the context like vLLM's
    /// `_get_request_rank` keeps its state (made on first use). Every Python call happens
    /// before the policy changes.
    fn request_token(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<Token> {
        self.bury_dead();
        let token = self.owner.live_token(
            ctx,
            &mut self.requests,
            |requests, token| requests.get(token).is_some(),
            |requests, current| requests.get_or_insert_with(current, HostRequest::default),
        )?;
        if !self
            .requests
            .get(token)
            .expect("a validated token")
            .hint_given
        {
            // Reading may run Python code, but that cannot reach this policy: it is locked.
            let hint = read_hint(ctx)?.hint();
            let request = self.requests.get_mut(token).expect("a validated token");
            request.hint_given = true;
            if let Some(hint) = hint {
                self.policy.on_request_hint(&mut request.state, hint);
            }
        }
        Ok(token)
    }

    /// Runs `call` on the policy with `keys` (an iterable of bytes) hashed.
    fn with_keys<R>(
        &mut self,
        keys: &Bound<'_, PyAny>,
        call: fn(&mut P, &[kvcache_core::Key<'_>]) -> R,
    ) -> PyResult<R> {
        let hasher = self.policy.hasher().clone();
        with_core_keys(&mut self.policy, keys, &hasher, call)
    }
}

impl<P: Policy<PyChunk> + Send> PolicyOps for Host<P>
where
    P::Request: Send,
{
    fn capacity(&self) -> usize {
        self.policy.capacity()
    }

    fn len(&self) -> usize {
        self.policy.len()
    }

    fn get<'py>(&self, py: Python<'py>, key: &PyKey<'_, 'py>) -> Option<Bound<'py, PyAny>> {
        let k = self.policy.key(key.bytes());
        self.policy.get(k).map(|c| c.object(py))
    }

    fn insert(
        &mut self,
        key: &PyKey<'_, '_>,
        chunk: PyChunk,
        ctx: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let k = self.policy.key(key.bytes());
        let found = self.policy.find_vacant(k).py_err()?;
        let position = if P::READS_POSITIONS {
            Positions::new(ctx, &mut self.contexts)?.get(&key.bound())?
        } else {
            None
        };
        let evictable = kvcache_core::HasRefCnt::ref_cnt(&chunk) == 0;
        // Policies that read absent keys keep per-request state even without positions.
        let token = match (position, ctx) {
            (Some(_), Some(ctx)) => Some(self.request_token(ctx)?),
            (None, Some(ctx)) if P::READS_ABSENT => Some(self.request_token(ctx)?),
            _ => None,
        };
        let mut no_request = P::Request::default();
        let request = match token {
            Some(token) => {
                &mut self
                    .requests
                    .get_mut(token)
                    .expect("a validated token")
                    .state
            }
            None => &mut no_request,
        };
        self.policy
            .insert(request, found, k, chunk, position, evictable);
        Ok(())
    }

    fn remove(&mut self, key: &PyKey<'_, '_>) -> PyResult<()> {
        let k = self.policy.key(key.bytes());
        self.policy.remove_key(k).py_err().map(drop)
    }

    fn touch(&mut self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        if !self.semantics.has_touch() {
            return Err(CoreError::Unsupported {
                what: "touch",
                semantics: self.semantics.name(),
            })
            .py_err();
        }
        self.with_keys(keys, |p, ks| p.touch_keys(ks, &SelfCounted))
    }

    fn on_store_miss(&mut self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        // One plain function per release (`with_keys` runs no closure state: see its safety
        // argument).
        match self.semantics {
            VllmSemantics::V0_33 => self.with_keys(keys, |p, ks| {
                p.on_store_miss_keys(ks, &SelfCounted, VllmSemantics::V0_33)
            }),
            VllmSemantics::V0_34 => self.with_keys(keys, |p, ks| {
                p.on_store_miss_keys(ks, &SelfCounted, VllmSemantics::V0_34)
            }),
        }
    }

    fn semantics(&self) -> VllmSemantics {
        self.semantics
    }

    fn on_request_access(
        &mut self,
        keys: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        if !P::READS_POSITIONS && !P::READS_ABSENT {
            // vLLM's default: nothing to observe (the arguments are not even read).
            return Ok(());
        }
        let ctx = require_context(Some(ctx))?;
        let keys = collect_keys(keys)?;
        let positions = if P::READS_POSITIONS {
            Some(Positions::new(Some(ctx), &mut self.contexts)?)
        } else {
            None
        };
        let mut observed = Vec::with_capacity(keys.len());
        for key in &keys {
            let k = self.policy.key(key_bytes(key));
            let id = self.policy.find_resident(k);
            // Non-resident keys cannot change rank: skip their position lookups, and the
            // keys themselves unless the policy asks for them.
            let position = match (id, positions.as_ref()) {
                (Some(_), Some(positions)) => positions.get(key)?,
                _ => None,
            };
            if id.is_some() || P::READS_ABSENT {
                observed.push(Observed {
                    key: k,
                    id,
                    position,
                });
            }
        }
        // Finding the request's state changes no entry, so the handles are still valid.
        let token = self.request_token(ctx)?;
        let request = self.requests.get_mut(token).expect("a validated token");
        self.policy.on_request_access(&mut request.state, &observed);
        Ok(())
    }

    fn on_request_finished(
        &mut self,
        key_groups: &Bound<'_, PyAny>,
        insertion_only: &Bound<'_, PyAny>,
        reused: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let positions = Positions::new(Some(ctx), &mut self.contexts)?;
        let ordered = order_request_keys(key_groups, positions)?;
        let (insertion_only, reused) = if P::READS_ACCESS {
            (
                Some(KeySet::new(insertion_only)?),
                Some(KeySet::new(reused)?),
            )
        } else {
            (None, None)
        };
        let ks: Vec<_> = ordered
            .iter()
            .map(|k| self.policy.key(key_bytes(k)))
            .collect();
        let ids = self.policy.find_many(&ks);
        let mut accesses = Vec::with_capacity(ordered.len());
        for (key, id) in ordered.iter().zip(ids) {
            // Only resident keys can move: classify just those.
            let resident = id.filter(|&id| self.policy.chunk(id).is_some());
            let access = match (&insertion_only, &reused, resident) {
                (Some(insertion_only), Some(reused), Some(_)) => {
                    if insertion_only.contains(key)? {
                        Access::InsertionOnly
                    } else if reused.contains(key)? {
                        Access::Reused
                    } else {
                        Access::Other
                    }
                }
                _ => Access::Other,
            };
            accesses.push((resident, access));
        }
        let token = self.request_token(ctx)?;
        let request = self.requests.get_mut(token).expect("a validated token");
        self.policy
            .on_request_finished(&mut request.state, &accesses);
        Ok(())
    }

    fn evict<'py>(
        &mut self,
        py: Python<'py>,
        n: usize,
        protected: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let protected = collect_named_keys(protected, "protected")?;
        self.bury_dead();
        let guard = self
            .policy
            .protect(protected.iter().map(|k| self.policy.key(key_bytes(k))));
        let Some(evicted) = self.policy.evict(n, &guard, &SelfCounted) else {
            return Ok(None);
        };
        let items = evicted.into_iter().map(|Evicted { key, chunk }| {
            PyTuple::new(
                py,
                [
                    PyBytes::new(py, key.as_slice()).into_any(),
                    chunk.object(py),
                ],
            )
        });
        let items: Vec<_> = items.collect::<PyResult<_>>()?;
        Ok(Some(PyList::new(py, items)?))
    }

    fn clear(&mut self) {
        self.policy.clear();
        // States handed out before are stale now, and so are those of dead requests.
        self.requests.reset().for_each(drop);
        self.owner.graveyard.take();
    }

    fn mark_evictable(&mut self, key: &PyKey<'_, '_>) -> PyResult<()> {
        let k = self.policy.key(key.bytes());
        self.policy.mark_evictable(k).py_err()
    }

    fn mark_non_evictable(&mut self, key: &PyKey<'_, '_>) -> PyResult<()> {
        let k = self.policy.key(key.bytes());
        self.policy.mark_non_evictable(k).py_err()
    }

    fn stat(&self, name: &str) -> Option<Stat> {
        self.policy
            .stats()
            .into_iter()
            .find_map(|(n, v)| (n == name).then_some(v))
    }

    fn debug_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        inspection_dict(py, &self.policy.inspect())
    }

    fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        for (_, chunk) in self.policy.resident() {
            chunk.traverse(visit)?;
        }
        Ok(())
    }

    #[cfg(feature = "validate")]
    fn validate(&self) -> Result<(), String> {
        self.policy.validate()
    }
}

/// A policy's [`Inspection`](kvcache_core::Inspection) as a dict: named lists of keys, ranks
/// as vLLM keeps them (`{key: (rank, -position)}`) with the evictable keys, and named stats.
pub fn inspection_dict<'py>(
    py: Python<'py>,
    inspection: &kvcache_core::Inspection<'_>,
) -> PyResult<Bound<'py, PyDict>> {
    let state = PyDict::new(py);
    for (name, keys) in &inspection.lists {
        let keys = keys.iter().map(|k| PyBytes::new(py, k));
        state.set_item(*name, PyList::new(py, keys)?)?;
    }
    if let Some(ranked) = &inspection.ranks {
        let ranks = PyDict::new(py);
        let evictable = PyList::empty(py);
        for e in ranked {
            let key = PyBytes::new(py, e.key);
            ranks.set_item(&key, (e.rank, -i128::from(e.position)))?;
            if e.evictable {
                evictable.append(&key)?;
            }
        }
        state.set_item("ranks", ranks)?;
        state.set_item("evictable", evictable)?;
    }
    for (name, stat) in &inspection.stats {
        match stat {
            Stat::Count(n) => state.set_item(*name, n)?,
            Stat::Value(v) => state.set_item(*name, v)?,
        }
    }
    Ok(state)
}

/// Shared implementation of the `CachePolicy` protocol; not instantiable itself.
#[pyclass(
    name = "BaseCachePolicy",
    module = "kvcache._core",
    subclass,
    frozen,
    weakref
)]
pub struct BaseCachePolicy {
    inner: Guarded<Box<dyn PolicyOps>>,
}

impl BaseCachePolicy {
    pub fn new<P>(capacity: usize, semantics: VllmSemantics) -> Self
    where
        P: Policy<PyChunk> + Send + 'static,
        P::Request: Send,
    {
        BaseCachePolicy {
            inner: Guarded::new(
                Box::new(Host::<P>::new(capacity, semantics)),
                "cache policy",
            ),
        }
    }

    /// A figure the policy reports (e.g. ARC's `target_t1_size`).
    pub fn stat(&self, py: Python<'_>, name: &str) -> PyResult<Option<Stat>> {
        Ok(self.inner.lock(py)?.stat(name))
    }
}

#[pymethods]
impl BaseCachePolicy {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    /// The number of chunks the cache holds (the manager's `num_chunks`).
    #[getter]
    fn cache_capacity(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner.lock(py)?.capacity())
    }

    /// The chunk stored under `key` (the very object inserted), or None.
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: PyKey<'_, 'py>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.inner.lock(py)?.get(py, &key))
    }

    fn __contains__(&self, py: Python<'_>, key: PyKey<'_, '_>) -> PyResult<bool> {
        Ok(self.inner.lock(py)?.get(py, &key).is_some())
    }

    /// Always true: an empty policy is still a policy (truth tests must not depend on `len`).
    fn __bool__(&self) -> bool {
        true
    }

    /// Number of resident chunks.
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner.lock(py)?.len())
    }

    /// Adds a newly allocated chunk. `req_context` (vLLM ≥ 0.33) gives LRU the key's token
    /// position; without one (the two-argument form) the key gets a fresh rank.
    #[pyo3(signature = (key, chunk, req_context=None))]
    fn insert(
        &self,
        py: Python<'_>,
        key: PyKey<'_, '_>,
        chunk: PyChunk,
        req_context: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ctx = req_context.as_ref().filter(|c| !c.is_none());
        self.inner.lock(py)?.insert(&key, chunk, ctx)
    }

    /// Drops a chunk whose store failed.
    fn remove(&self, py: Python<'_>, key: PyKey<'_, '_>) -> PyResult<()> {
        self.inner.lock(py)?.remove(&key)
    }

    /// The vLLM release whose policy protocol this policy follows (`"0.33"` or `"0.34"`).
    #[getter]
    fn vllm_semantics(&self, py: Python<'_>) -> PyResult<&'static str> {
        Ok(self.inner.lock(py)?.semantics().name())
    }

    /// Marks keys recently used (the last key first, so the first key ends most recent).
    /// vLLM 0.33's protocol only: under 0.34 semantics it raises `UnsupportedOperationError`.
    #[pyo3(signature = (keys, req_context=None))]
    fn touch(
        &self,
        py: Python<'_>,
        keys: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.inner.lock(py)?.touch(&keys)
    }

    /// Store misses before insertion: ARC adapts to ghost hits; LRU takes the protocol's
    /// default, a touch under vLLM 0.33 (it only affects resident keys) and nothing under 0.34.
    #[pyo3(signature = (keys, req_context=None))]
    fn on_store_miss(
        &self,
        py: Python<'_>,
        keys: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.inner.lock(py)?.on_store_miss(&keys)
    }

    /// A request's first observation of keys: LRU gives resident ones the request's rank at
    /// their token position; ARC ignores it (like vLLM's).
    fn on_request_access(
        &self,
        py: Python<'_>,
        keys: Bound<'_, PyAny>,
        req_context: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.inner.lock(py)?.on_request_access(&keys, &req_context)
    }

    /// Applies one finished request's accesses in prefix order (see `order_request_keys`).
    fn on_request_finished(
        &self,
        py: Python<'_>,
        key_groups: Bound<'_, PyAny>,
        insertion_only_keys: Bound<'_, PyAny>,
        reused_keys: Bound<'_, PyAny>,
        req_context: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut inner = self.inner.lock(py)?;
        let ctx = require_context(Some(&req_context))?;
        inner.on_request_finished(&key_groups, &insertion_only_keys, &reused_keys, ctx)
    }

    /// Evicts exactly `n` idle chunks not in `protected`, returning `[(key, chunk), ...]` in
    /// eviction order, or None (and no change) if that many cannot be found.
    fn evict<'py>(
        &self,
        py: Python<'py>,
        n: EvictCount,
        protected: Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        self.inner.lock(py)?.evict(py, n.0, &protected)
    }

    /// Removes every chunk regardless of `ref_cnt`, and all adaptive/request state.
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.lock(py)?.clear();
        Ok(())
    }

    /// The chunk's `ref_cnt` went to 0. ARC reads `ref_cnt` itself and only checks the key.
    fn mark_evictable(&self, py: Python<'_>, key: PyKey<'_, '_>) -> PyResult<()> {
        self.inner.lock(py)?.mark_evictable(&key)
    }

    /// The chunk's `ref_cnt` left 0. LRU requires the key to be evictable now.
    fn mark_non_evictable(&self, py: Python<'_>, key: PyKey<'_, '_>) -> PyResult<()> {
        self.inner.lock(py)?.mark_non_evictable(&key)
    }

    /// Checks the policy's invariants; raises AssertionError naming the first broken one.
    #[cfg(feature = "validate")]
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.inner
            .lock(py)?
            .validate()
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    /// Internal state for tests and debugging (LRU: ranks in eviction order as vLLM's
    /// `(rank, -position)`; ARC: the four lists from LRU to MRU and the target).
    fn _debug_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.inner.lock(py)?.debug_state(py)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // A policy in the middle of a call is reachable from that call: skipping it only keeps
        // its chunks alive a little longer.
        match self.inner.try_peek() {
            Some(inner) => inner.traverse(&visit),
            None => Ok(()),
        }
    }

    fn __clear__(&self) {
        if let Some(mut inner) = self.inner.try_peek() {
            inner.clear();
        }
    }
}

/// A collection of keys tested for membership once per key: an exact `set` (what vLLM's
/// manager passes) is asked directly, any other container (a subclass may override
/// `__contains__`) through the container protocol.
enum KeySet<'a, 'py> {
    Set(Bound<'py, PySet>),
    Other(&'a Bound<'py, PyAny>),
}

impl<'a, 'py> KeySet<'a, 'py> {
    fn new(keys: &'a Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(set) = keys.cast_exact::<PySet>() {
            return Ok(KeySet::Set(set.clone()));
        }
        let py = keys.py();
        let container = py.import(pyo3::intern!(py, "collections.abc"))?;
        let container = container.getattr(pyo3::intern!(py, "Container"))?;
        if !keys.is_instance(&container)? {
            return Err(new_err(
                py,
                &exceptions(py).invalid_type,
                format!(
                    "insertion_only_keys and reused_keys must be sets of keys, got {}",
                    type_name(keys)
                ),
            ));
        }
        Ok(KeySet::Other(keys))
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
    let ctx = require_context(Some(&req_context))?;
    let positions = Positions::new(Some(ctx), &mut ContextTypeCache::positions())?;
    order_request_keys(&key_groups, positions)
}
