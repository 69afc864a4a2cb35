//! `OffloadingManager`: vLLM's `CPUOffloadingManager` protocol over the Rust manager.
//!
//! Keys stay in Rust: per chunk the manager keeps its key bytes and a 16-byte record, no Python
//! object. Every batch call converts its input once (keys hashed once, positions read once),
//! then runs its whole loop in Rust. Results are built from the Python types the subclass names
//! in `_result_types`: kvcache's own (`kvcache.OffloadingManager`) or vLLM's
//! (`kvcache.vllm.CPUOffloadingManager`), so each caller gets objects of the types it expects.

use std::ffi::c_int;
use std::ptr;

use kvcache_core::manager::{ChunkId, Event, Manager, ManagerConfig};
use kvcache_core::{ArcPolicy, Key, KeyHasher, ListId, LruPolicy};
use pyo3::exceptions::{PyAssertionError, PyBufferError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple, PyType};

use crate::chunk::{fill_record_view, release_record_view};
use crate::conversion::{
    as_key, collect_keys, count, key_bytes, with_hashed_keys, ContextTypeCache, PositionWalk,
    Positions,
};
use crate::errors::IntoPyResult;
use crate::exceptions::{exceptions, new_err};
use crate::request_state::{require_context, Owner};
use crate::results::ResultTypes;

enum Inner {
    Lru(Manager<LruPolicy<ChunkId>>),
    Arc(Manager<ArcPolicy<ChunkId>>),
}

/// Runs `$body` with `$m` bound to the concrete manager.
macro_rules! with_manager {
    ($inner:expr, $m:ident => $body:expr) => {
        match $inner {
            Inner::Lru($m) => $body,
            Inner::Arc($m) => $body,
        }
    };
}

/// A request call's keys, their token positions, where the walk over the position dict
/// stopped, and the request's state.
type RequestCall<'py> = (
    Vec<Bound<'py, PyBytes>>,
    Vec<Option<i64>>,
    isize,
    kvcache_core::RequestToken,
);

/// What the bindings keep per live request.
#[derive(Default)]
struct Observed {
    /// The key objects the request observed, in the order the core recorded them, so
    /// finishing reads their positions without building new bytes objects.
    keys: Vec<Py<PyBytes>>,
    /// Where the last walk over the request's position dict stopped ([`PositionWalk`]): the
    /// next call's keys usually come next.
    cursor: isize,
}

/// vLLM's default bound of the `store_threshold` access tracker.
const DEFAULT_MAX_TRACKER_SIZE: usize = 64_000;

/// Offloading manager for host-memory KV chunks: vLLM 0.33.0's `CPUOffloadingManager`
/// decisions, in Rust. Subclassed by `kvcache.OffloadingManager` and
/// `kvcache.vllm.CPUOffloadingManager`, which choose the result types.
#[pyclass(name = "OffloadingManager", module = "kvcache._core", subclass)]
pub struct PyManager {
    inner: Inner,
    types: ResultTypes,
    owner: Owner,
    contexts: ContextTypeCache,
    hasher: KeyHasher,
    /// Per live request (by token id): its key objects and position-walk cursor.
    observed: hashbrown::HashMap<u64, Observed, foldhash::fast::RandomState>,
}

fn policy_kind(cache_policy: &str, module_path: Option<&str>) -> Option<&'static str> {
    let ours = matches!(module_path, None | Some("kvcache.vllm" | "kvcache"));
    match cache_policy {
        "lru" if module_path.is_none() => Some("lru"),
        "arc" if module_path.is_none() => Some("arc"),
        "LRUCachePolicy" if ours => Some("lru"),
        "ARCCachePolicy" if ours => Some("arc"),
        _ => None,
    }
}

impl PyManager {
    fn bury_dead(&mut self) {
        for token in self.owner.graveyard.take() {
            self.observed.remove(&token.id);
            with_manager!(&mut self.inner, m => m.release_request(token.into()));
        }
    }

    /// Remembers the key objects a call showed the request for the first time, and where its
    /// position walk stopped.
    fn remember(
        &mut self,
        token: kvcache_core::RequestToken,
        keys: &[Bound<'_, PyBytes>],
        observed: &[usize],
        cursor: isize,
    ) {
        // Nothing new and no walk (ARC never walks while a request runs): no entry to touch.
        if observed.is_empty() && cursor == 0 {
            return;
        }
        let seen = self.observed.entry(token.id).or_default();
        seen.keys
            .extend(observed.iter().map(|&i| keys[i].clone().unbind()));
        seen.cursor = cursor;
    }

    fn is_lru(&self) -> bool {
        matches!(self.inner, Inner::Lru(_))
    }

    fn key<'a>(&self, bytes: &'a [u8]) -> Key<'a> {
        with_manager!(&self.inner, m => m.key(bytes))
    }

    fn keys<'a>(&self, keys: &'a [Bound<'_, PyBytes>]) -> Vec<Key<'a>> {
        keys.iter().map(|k| self.key(key_bytes(k))).collect()
    }

    /// Runs a core call on `keys` (an iterable of bytes). Lists and tuples are read in place
    /// (no new reference per key); `call` must not run Python code.
    fn with_keys<R>(
        &mut self,
        keys: &Bound<'_, PyAny>,
        call: impl FnOnce(&mut Inner, &[Key<'_>]) -> R,
    ) -> PyResult<R> {
        // SAFETY: the callers pass closures over `Manager` methods, which never call into
        // Python.
        unsafe { with_hashed_keys(&mut self.inner, keys, &self.hasher, call) }
    }

    /// Token positions of `keys` (only LRU reads them while a request runs), and where the
    /// walk over the position dict stopped. The walk resumes where the request's previous
    /// call left it, found without side effects (a context not seen recently starts over).
    fn positions(
        &mut self,
        ctx: &Bound<'_, PyAny>,
        keys: &[Bound<'_, PyBytes>],
    ) -> PyResult<(Vec<Option<i64>>, isize)> {
        if !self.is_lru() {
            return Ok((vec![None; keys.len()], 0));
        }
        let start = self
            .owner
            .cached(ctx)
            .and_then(|token| self.observed.get(&token.id))
            .map_or(0, |o| o.cursor);
        let mut walk = PositionWalk::new(Positions::new(Some(ctx), &mut self.contexts)?, start);
        let positions = keys.iter().map(|k| walk.get(k)).collect::<PyResult<_>>()?;
        Ok((positions, walk.cursor()))
    }

    /// What `prepare_load` and `prepare_store` start with: the keys (checked), their token
    /// positions, and the request's state (in that order: the checks come before any change).
    fn request_call<'py>(
        &mut self,
        req_context: &Bound<'py, PyAny>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<RequestCall<'py>> {
        let ctx = require_context(Some(req_context))?;
        let keys = collect_keys(keys)?;
        let (positions, cursor) = self.positions(ctx, &keys)?;
        let token = self.request(ctx)?;
        Ok((keys, positions, cursor, token))
    }

    /// The manager's request state for `ctx` (created on first sight, as vLLM does).
    fn request(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<kvcache_core::RequestToken> {
        self.bury_dead();
        if let Some(token) = self.owner.cached(ctx) {
            if with_manager!(&self.inner, m => m.is_live_request(token.into())) {
                return Ok(token.into());
            }
        }
        let inner = &mut self.inner;
        let token = self.owner.token(
            ctx,
            |current| with_manager!(inner, m => m.request(current.map(Into::into)).into()),
        )?;
        Ok(token.into())
    }

    fn event<'py>(&self, py: Python<'py>, e: Event) -> PyResult<Bound<'py, PyAny>> {
        let keys = PyList::new(py, e.keys.iter().map(|k| PyBytes::new(py, k.as_slice())))?;
        self.types.event(py, keys, e.removed, e.metadata_only)
    }
}

#[pymethods]
impl PyManager {
    #[new]
    #[classmethod]
    #[pyo3(signature = (
        num_chunks,
        cache_policy = "lru",
        cache_policy_module_path = None,
        enable_events = false,
        store_threshold = 1,
        max_tracker_size = None,
        **_extra
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        cls: &Bound<'_, PyType>,
        num_chunks: Bound<'_, PyAny>,
        cache_policy: &str,
        cache_policy_module_path: Option<&str>,
        enable_events: bool,
        store_threshold: i64,
        max_tracker_size: Option<Bound<'_, PyAny>>,
        _extra: Option<Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let py = cls.py();
        let num_chunks = count(&num_chunks, "num_chunks")?;
        if num_chunks > u32::MAX as usize {
            return Err(new_err(
                py,
                &exceptions(py).invalid_argument,
                format!("num_chunks {num_chunks} exceeds 2**32 - 1"),
            ));
        }
        let max_tracker_size = match max_tracker_size {
            Some(n) => count(&n, "max_tracker_size")?,
            None => DEFAULT_MAX_TRACKER_SIZE,
        };
        let Some(kind) = policy_kind(cache_policy, cache_policy_module_path) else {
            return Err(new_err(
                py,
                &exceptions(py).invalid_argument,
                format!(
                    "unsupported cache policy {cache_policy:?} (module {cache_policy_module_path:?}); \
                     kvcache's manager runs 'lru' and 'arc' (or LRUCachePolicy/ARCCachePolicy \
                     from kvcache.vllm)"
                ),
            ));
        };
        let config = ManagerConfig {
            num_chunks,
            enable_events,
            store_threshold,
            max_tracker_size,
        };
        let inner = match kind {
            "lru" => Inner::Lru(Manager::new(config)),
            _ => Inner::Arc(Manager::new(config)),
        };
        Ok(PyManager {
            inner,
            types: ResultTypes::from_class(cls)?,
            owner: Owner::default(),
            contexts: ContextTypeCache::positions(),
            hasher: KeyHasher::global(),
            observed: Default::default(),
        })
    }

    /// Chunk slots in the cache.
    #[getter]
    fn num_chunks(&self) -> usize {
        with_manager!(&self.inner, m => m.config().num_chunks)
    }

    /// "lru" or "arc".
    #[getter]
    fn cache_policy(&self) -> &'static str {
        if self.is_lru() {
            "lru"
        } else {
            "arc"
        }
    }

    #[getter]
    fn store_threshold(&self) -> i64 {
        with_manager!(&self.inner, m => m.config().store_threshold)
    }

    /// Always true: an empty manager is still a manager (vLLM tests `if not self._manager`).
    fn __bool__(&self) -> bool {
        true
    }

    /// Resident chunks (ready or pending).
    fn __len__(&self) -> usize {
        with_manager!(&self.inner, m => m.table().num_allocated() - m.table().free_list_len())
    }

    #[getter]
    fn num_evictable(&self) -> usize {
        with_manager!(&self.inner, m => m.num_evictable())
    }

    #[getter]
    fn num_write_pending(&self) -> usize {
        with_manager!(&self.inner, m => m.num_write_pending())
    }

    /// Live per-request states (requests whose context is still alive).
    #[getter]
    fn num_requests(&mut self) -> usize {
        self.bury_dead();
        with_manager!(&self.inner, m => m.num_requests())
    }

    /// HIT if the key's chunk is ready, HIT_PENDING if its store is in flight, else MISS.
    #[pyo3(signature = (key, req_context = None))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        key: Bound<'py, PyAny>,
        req_context: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = req_context;
        let key = as_key(key)?;
        let result = with_manager!(&self.inner, m => m.lookup(m.key(key_bytes(&key))));
        Ok(self.types.lookup(py, result))
    }

    /// Pins the keys' ready chunks for reading; returns a spec naming their chunk ids.
    fn prepare_load<'py>(
        &mut self,
        py: Python<'py>,
        keys: Bound<'py, PyAny>,
        req_context: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (keys, positions, cursor, token) = self.request_call(&req_context, &keys)?;
        let ks = self.keys(&keys);
        let mut observed = Vec::new();
        let ids = with_manager!(&mut self.inner, m => m.prepare_load(token, &ks, &positions, &mut observed))
            .py_err()?;
        self.remember(token, &keys, &observed, cursor);
        self.types.spec(py, &ids)
    }

    /// Marks keys recently used.
    #[pyo3(signature = (keys, req_context = None))]
    fn touch(
        &mut self,
        keys: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.with_keys(&keys, |inner, ks| with_manager!(inner, m => m.touch(ks)))
    }

    /// Unpins chunks whose loads finished.
    #[pyo3(signature = (keys, req_context = None))]
    fn complete_load(
        &mut self,
        keys: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.with_keys(
            &keys,
            |inner, ks| with_manager!(inner, m => m.complete_load(ks)),
        )?
        .py_err()
    }

    /// Decides which keys to store and where, evicting to make room. Returns an object with
    /// `keys_to_store`, `store_spec` and `evicted_keys`, or None when the keys cannot be stored.
    fn prepare_store<'py>(
        &mut self,
        py: Python<'py>,
        keys: Bound<'py, PyAny>,
        req_context: Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let (keys, positions, cursor, token) = self.request_call(&req_context, &keys)?;
        let ks = self.keys(&keys);
        let mut observed = Vec::new();
        let out = with_manager!(&mut self.inner, m => m.prepare_store(token, &ks, &positions, &mut observed))
            .py_err()?;
        self.remember(token, &keys, &observed, cursor);
        let Some(out) = out else { return Ok(None) };
        let stored = PyList::new(py, out.stored.iter().map(|&i| &keys[i]))?;
        let spec = self.types.spec(py, &out.chunk_ids)?;
        self.types
            .store_output(py, stored, spec, out.evicted)
            .map(Some)
    }

    /// Completes stores: on success the chunks become readable and evictable; on failure the
    /// pending ones are dropped.
    #[pyo3(signature = (keys, req_context = None, success = true))]
    fn complete_store(
        &mut self,
        keys: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
        success: bool,
    ) -> PyResult<()> {
        let _ = req_context;
        self.with_keys(
            &keys,
            |inner, ks| with_manager!(inner, m => m.complete_store(ks, success)),
        )
    }

    /// Starts tracking a request.
    fn on_new_request<'py>(
        &mut self,
        py: Python<'py>,
        req_context: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.request(&req_context)?;
        self.types.new_request(py)
    }

    /// Applies the request's accesses to the policy in prefix order (once).
    fn on_request_finished(
        &mut self,
        py: Python<'_>,
        req_context: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.bury_dead();
        let Some(token) = self.owner.existing_token(&req_context)? else {
            return Ok(());
        };
        let positions = Positions::new(Some(&req_context), &mut self.contexts)?;
        let mut walk = PositionWalk::new(positions, 0);
        let seen = self
            .observed
            .get(&token.id)
            .map(|o| o.keys.as_slice())
            .unwrap_or_default();
        with_manager!(&mut self.inner, m => {
            m.finish_request(token.into(), |i, key| match seen.get(i) {
                Some(object) => walk.get(object.bind(py)),
                None => walk.get(&PyBytes::new(py, key)),
            })
        })?;
        // A finished request observes no new key: its key objects are no longer needed.
        self.observed.remove(&token.id);
        Ok(())
    }

    /// Events (stored / removed keys) since the last call.
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = with_manager!(&mut self.inner, m => m.take_events());
        let objects: Vec<_> = events
            .into_iter()
            .map(|e| self.event(py, e))
            .collect::<PyResult<_>>()?;
        PyList::new(py, objects)
    }

    /// Drops every chunk and request state.
    fn reset_cache(&mut self) {
        with_manager!(&mut self.inner, m => m.reset());
        self.owner.graveyard.take();
        self.observed.clear();
    }

    /// `(usage, write_usage, read_usage, allocation_sizes, stores_skipped)` since the last
    /// call; `stores_skipped` is None unless `store_threshold >= 2`.
    fn _take_stats<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let s = with_manager!(&mut self.inner, m => m.take_stats());
        (
            s.usage,
            s.write_usage,
            s.read_usage,
            s.allocation_sizes,
            s.stores_skipped,
        )
            .into_pyobject(py)
    }

    /// Heap bytes by structure, and per resident chunk.
    fn memory_usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (usage, resident) = with_manager!(&self.inner, m => {
            (m.memory_usage(), m.table().num_allocated() - m.table().free_list_len())
        });
        let d = PyDict::new(py);
        d.set_item("policy", usage.policy)?;
        d.set_item("table", usage.table)?;
        d.set_item("tracker", usage.tracker)?;
        d.set_item("requests", usage.requests)?;
        d.set_item("total", usage.total())?;
        d.set_item("resident_chunks", resident)?;
        Ok(d)
    }

    /// The chunk table: a read-only buffer of `num_chunks` ChunkStatus records (index = chunk
    /// id; `ref_cnt` −2 marks a free slot). `numpy.asarray(manager.chunk_table())` views it.
    fn chunk_table(slf: Bound<'_, Self>) -> PyResult<ChunkTableView> {
        Ok(ChunkTableView {
            manager: slf.unbind(),
        })
    }

    /// Internal state for tests: the policy's (as `BaseCachePolicy._debug_state`), the free
    /// list, the allocation count and the evictable / write-pending counts.
    fn _debug_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let state = PyDict::new(py);
        match &self.inner {
            Inner::Lru(m) => {
                let ranks = PyDict::new(py);
                for e in m.policy().entries() {
                    ranks.set_item(PyBytes::new(py, e.key), (e.rank, -(e.position as i128)))?;
                }
                state.set_item("ranks", ranks)?;
            }
            Inner::Arc(m) => {
                let p = m.policy();
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
        let chunks = PyDict::new(py);
        let add = |key: &[u8], id: ChunkId, ref_cnt: i32| {
            chunks.set_item(PyBytes::new(py, key), (id, ref_cnt))
        };
        match &self.inner {
            Inner::Lru(m) => m
                .policy()
                .iter()
                .try_for_each(|(k, &c)| add(k, c, m.table().record(c).ref_cnt()))?,
            Inner::Arc(m) => m
                .policy()
                .iter()
                .try_for_each(|(k, &c)| add(k, c, m.table().record(c).ref_cnt()))?,
        }
        state.set_item("chunks", chunks)?;
        with_manager!(&self.inner, m => {
            state.set_item("free_list", m.table().free_list().to_vec())?;
            state.set_item("num_allocated", m.table().num_allocated())?;
            state.set_item("num_evictable", m.num_evictable())?;
            state.set_item("num_write_pending", m.num_write_pending())?;
        });
        Ok(state)
    }

    /// Checks the manager's and its policy's invariants; raises AssertionError if one is broken.
    fn validate(&self) -> PyResult<()> {
        with_manager!(&self.inner, m => m.validate()).map_err(PyAssertionError::new_err)
    }
}

/// A read-only export of a manager's chunk table; keeps the manager alive while viewed.
#[pyclass(name = "ChunkTableView", module = "kvcache._core", frozen)]
pub struct ChunkTableView {
    manager: Py<PyManager>,
}

#[pymethods]
impl ChunkTableView {
    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if flags & ffi::PyBUF_WRITABLE != 0 {
            return Err(PyBufferError::new_err("the chunk table is read-only"));
        }
        let manager = slf.get().manager.bind(slf.py()).try_borrow()?;
        let records = with_manager!(&manager.inner, m => m.table().records());
        let (buf, len) = (records.as_ptr().cast_mut().cast(), records.len());
        drop(manager);
        if len == 0 {
            // An empty table: export zero bytes (a valid, non-null pointer still).
            // SAFETY: `view` is valid (CPython's contract).
            unsafe { fill_empty_view(view, flags, slf.into_any()) };
            return Ok(());
        }
        // SAFETY: `buf` points at `len` records in a boxed slice the manager never reallocates;
        // the view's owner (`slf`) keeps the manager alive. Rust writes the records through
        // atomics (shared references), never `&mut`, so Python may read them while exported.
        unsafe {
            fill_record_view(view, flags, buf, len, slf.into_any());
            (*view).readonly = 1;
        }
        Ok(())
    }

    /// # Safety
    /// Called by CPython with the view it got from `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, view: *mut ffi::Py_buffer) {
        // SAFETY: `view` was filled by `__getbuffer__` above and is released once.
        unsafe { release_record_view(view) }
    }
}

/// Fills `view` with an empty 1-d buffer.
///
/// # Safety
/// `view` must be a valid `Py_buffer` to fill.
unsafe fn fill_empty_view(view: *mut ffi::Py_buffer, flags: c_int, owner: Bound<'_, PyAny>) {
    static EMPTY: [u8; 16] = [0; 16];
    // SAFETY: the caller passes a valid view; the buffer is a static with zero length exported.
    unsafe {
        fill_record_view(
            view,
            flags,
            ptr::addr_of!(EMPTY).cast_mut().cast(),
            1,
            owner,
        );
        (*view).len = 0;
        (*view).readonly = 1;
        *(*view).shape = 0;
    }
}
