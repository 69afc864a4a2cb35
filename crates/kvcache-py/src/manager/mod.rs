//! `OffloadingManager`: vLLM's `CPUOffloadingManager` protocol over the Rust manager.
//!
//! Keys stay in Rust: per chunk the manager keeps its key bytes and a 16-byte record, no Python
//! object. Every batch call converts its input once (keys hashed once, positions read once),
//! then runs its whole loop in Rust. Results are built from the Python types the subclass names
//! in `_result_types`: kvcache's own (`kvcache.OffloadingManager`) or vLLM's
//! (`kvcache.vllm.CPUOffloadingManager`), so each caller gets objects of the types it expects.
//! Calls are serialised by the object's lock (see `guard`).
//!
//! This file is the Python surface; what the bindings keep beside the Rust manager, and the
//! steps its methods share, are in `state`; the chunk table's buffer export in `table_view`.

mod state;
mod table_view;

use kvcache_core::manager::{
    ChunkId, ChunkRecord, Manager, ManagerConfig, StoreOutput, VllmSemantics,
};
use kvcache_core::{CoreError, Key, KeyHasher, Policy};
use pyo3::gc::{PyTraverseError, PyVisit};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple, PyType};

use crate::any_manager::AnyManager;
use crate::context::{require_context, ContextTypeCache, PositionWalk, Positions};
use crate::conversion::{
    bounded_ints, collect_keys, count, default_semantics, int_in_range, semantics_arg, text, Flag,
    PyKey,
};
use crate::errors::IntoPyResult;
use crate::exceptions::{exceptions, new_err};
use crate::guard::Guarded;
use crate::kinds::PolicyKind;
use crate::policy::inspection_dict;
use crate::request_state::Owner;
use crate::results::ResultTypes;
use state::State;
pub use table_view::ChunkTableView;

/// The replay's offline bound: a manager over [`BeladyPolicy`], not a vLLM policy.
const BELADY: &str = "belady";

/// vLLM's default bound of the `store_threshold` access tracker.
const DEFAULT_MAX_TRACKER_SIZE: usize = 64_000;

/// Offloading manager for host-memory KV chunks: vLLM 0.33.0's `CPUOffloadingManager`
/// decisions, in Rust. Subclassed by `kvcache.OffloadingManager` and
/// `kvcache.vllm.CPUOffloadingManager`, which choose the result types.
#[pyclass(
    name = "OffloadingManager",
    module = "kvcache._core",
    subclass,
    frozen,
    weakref
)]
pub struct PyManager {
    inner: Guarded<State>,
    /// vLLM's `OffloadingManager.lock`, made on first use.
    lock: PyOnceLock<Py<PyAny>>,
}

#[pymethods]
impl PyManager {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    #[new]
    #[classmethod]
    #[allow(
        clippy::too_many_arguments,
        reason = "vLLM's CPUOffloadingManager signature"
    )]
    #[pyo3(signature = (
        num_chunks,
        cache_policy = "lru".to_owned(),
        cache_policy_module_path = None,
        enable_events = Flag(false),
        store_threshold = 1,
        max_tracker_size = DEFAULT_MAX_TRACKER_SIZE,
        *,
        vllm_semantics = None,
    ),
    text_signature = "(num_chunks, cache_policy='lru', cache_policy_module_path=None, \
                      enable_events=False, store_threshold=1, max_tracker_size=64000, *, \
                      vllm_semantics=None)")]
    fn new(
        cls: &Bound<'_, PyType>,
        #[pyo3(from_py_with = num_chunks_arg)] num_chunks: usize,
        #[pyo3(from_py_with = cache_policy_arg)] cache_policy: String,
        #[pyo3(from_py_with = module_path_arg)] cache_policy_module_path: Option<String>,
        enable_events: Flag,
        #[pyo3(from_py_with = store_threshold_arg)] store_threshold: i64,
        #[pyo3(from_py_with = max_tracker_size_arg)] max_tracker_size: usize,
        #[pyo3(from_py_with = semantics_arg)] vllm_semantics: Option<VllmSemantics>,
    ) -> PyResult<Self> {
        let py = cls.py();
        let module_path = cache_policy_module_path.as_deref();
        let offline = cache_policy == BELADY && module_path.is_none();
        let kind = PolicyKind::resolve(&cache_policy, module_path);
        if kind.is_none() && !offline {
            return Err(new_err(
                py,
                &exceptions(py).invalid_argument,
                format!(
                    "unsupported cache policy {:?} (module {module_path:?}); kvcache's manager \
                     runs {} (or {} from kvcache.vllm)",
                    cache_policy,
                    names(PolicyKind::name),
                    names(PolicyKind::class_name),
                ),
            ));
        }
        let config = ManagerConfig {
            num_chunks,
            enable_events: enable_events.0,
            store_threshold,
            max_tracker_size,
            semantics: match vllm_semantics {
                Some(semantics) => semantics,
                None => default_semantics(py)?,
            },
        };
        let (manager, policy_name) = match kind {
            Some(kind) => (kind.new_manager(config).py_err()?, kind.name()),
            None => (AnyManager::Belady(Manager::new(config).py_err()?), BELADY),
        };
        Ok(PyManager {
            inner: Guarded::new(
                State {
                    manager,
                    policy_name,
                    types: ResultTypes::from_class(cls)?,
                    owner: Owner::default(),
                    contexts: ContextTypeCache::positions(),
                    hasher: KeyHasher::global(),
                    observed: Default::default(),
                    stored_contexts: Default::default(),
                },
                "offloading manager",
            ),
            lock: PyOnceLock::new(),
        })
    }

    /// vLLM's `OffloadingManager.lock`: a `threading.Lock` callers hold across a sequence of
    /// calls that must see one state (a `lookup` hit and the `prepare_load` that pins it).
    /// Every call is safe from any thread on its own (each is serialised); this lock is for
    /// the sequences. Not reentrant, as vLLM's contract allows.
    #[getter]
    fn lock<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let lock = self.lock.get_or_try_init(py, || {
            py.import(pyo3::intern!(py, "threading"))?
                .call_method0(pyo3::intern!(py, "Lock"))
                .map(Bound::unbind)
        })?;
        Ok(lock.bind(py).clone())
    }

    /// Chunk slots in the cache.
    #[getter]
    fn num_chunks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner.lock(py)?.manager.config().num_chunks)
    }

    /// The policy's short name ("lru", "arc", "turn").
    #[getter]
    fn cache_policy(&self, py: Python<'_>) -> PyResult<&'static str> {
        Ok(self.inner.lock(py)?.policy_name)
    }

    #[getter]
    fn store_threshold(&self, py: Python<'_>) -> PyResult<i64> {
        Ok(self.inner.lock(py)?.manager.config().store_threshold)
    }

    /// The vLLM release whose decisions this manager reproduces (`"0.33"` or `"0.34"`).
    #[getter]
    fn vllm_semantics(&self, py: Python<'_>) -> PyResult<&'static str> {
        Ok(self.inner.lock(py)?.manager.config().semantics.name())
    }

    /// Always true: an empty manager is still a manager (vLLM tests `if not self._manager`).
    fn __bool__(&self) -> bool {
        true
    }

    /// Resident chunks (ready or pending).
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(dispatch!(&self.inner.lock(py)?.manager, |m| m.len()))
    }

    #[getter]
    fn num_evictable(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(dispatch!(&self.inner.lock(py)?.manager, |m| m.num_evictable()))
    }

    #[getter]
    fn num_write_pending(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(dispatch!(&self.inner.lock(py)?.manager, |m| m.num_write_pending()))
    }

    /// Live per-request states (requests whose context is still alive).
    #[getter]
    fn num_requests(&self, py: Python<'_>) -> PyResult<usize> {
        let mut state = self.inner.lock(py)?;
        state.bury_dead();
        Ok(dispatch!(&state.manager, |m| m.num_requests()))
    }

    /// HIT if the key's chunk is ready, HIT_PENDING if its store is in flight, else MISS.
    #[pyo3(signature = (key, req_context = None))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        key: PyKey<'_, 'py>,
        req_context: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = req_context;
        let state = self.inner.lock(py)?;
        let key = Key::new(&state.hasher, key.bytes());
        let result = dispatch!(&state.manager, |m| m.lookup(key));
        Ok(state.types.lookup(py, result))
    }

    /// Pins the keys' ready chunks for reading; returns a spec naming their chunk ids. If the
    /// spec cannot be built (e.g. a KeyboardInterrupt), the pins are released and the call
    /// raises; the request has still observed the keys.
    fn prepare_load<'py>(
        &self,
        py: Python<'py>,
        keys: Bound<'py, PyAny>,
        req_context: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut state = self.inner.lock(py)?;
        let shell = state.types.spec_shell(py)?;
        state.request_op(
            &req_context,
            &keys,
            true,
            |manager, token, ks, positions, observed| {
                dispatch!(manager, |m| m.prepare_load(token, ks, positions, observed))
            },
            |state, _, ks, ids| {
                // The pins are taken: a result that cannot be built (a MemoryError, a
                // KeyboardInterrupt in Python code) gives them back, or no caller could ever
                // unpin them.
                state.types.spec(py, shell, &ids).inspect_err(|_| {
                    // Pinned just now, under the same lock: the unpin cannot fail.
                    let _ = dispatch!(&mut state.manager, |m| m.complete_load(ks));
                })
            },
        )
    }

    /// vLLM 0.34's CPU primary tier: pins the keys' ready chunks for a secondary tier to read
    /// (a cascade), like `prepare_load` but without recording an access of any request, and
    /// returns a spec naming their chunk ids. `complete_load` (`complete_read`) unpins them.
    #[pyo3(signature = (keys, req_context = None))]
    fn prepare_read<'py>(
        &self,
        py: Python<'py>,
        keys: Bound<'py, PyAny>,
        req_context: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = req_context;
        let mut state = self.inner.lock(py)?;
        let keys = collect_keys(&keys)?;
        let ks = state.keys(&keys);
        let shell = state.types.spec_shell(py)?;
        let ids = dispatch!(&mut state.manager, |m| m.prepare_read(&ks)).py_err()?;
        state.types.spec(py, shell, &ids).inspect_err(|_| {
            // Pinned just now, under the same lock: the unpin cannot fail.
            let _ = dispatch!(&mut state.manager, |m| m.complete_load(&ks));
        })
    }

    /// vLLM 0.34's CPU primary tier: fails the pending writes of `keys` as
    /// `complete_store(keys, success=False)` does (the keys leave the cache), but keeps their
    /// chunks out of the free list until `release_deferred_write`: the tier that was writing
    /// them may still do so. Returns those chunk ids. Every key must be a distinct pending
    /// write (`InvalidStateError`, `KeyNotFoundError`, `InvalidArgumentError`); nothing changes
    /// on an error.
    fn defer_write_release(&self, py: Python<'_>, keys: Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        self.inner
            .lock(py)?
            .with_keys(&keys, |manager, ks| {
                dispatch!(manager, |m| m.defer_write_release(ks))
            })?
            .py_err()
    }

    /// Returns chunks whose release `defer_write_release` deferred to the free list, in the
    /// order given. Every id must be a deferred chunk named once (`InvalidArgumentError`);
    /// nothing changes on an error.
    fn release_deferred_write(&self, py: Python<'_>, chunk_ids: Bound<'_, PyAny>) -> PyResult<()> {
        let mut state = self.inner.lock(py)?;
        // At most the deferred chunks: a longer iterable is refused before it is drained.
        let ids = bounded_ints(
            &chunk_ids,
            "chunk_ids",
            dispatch!(&state.manager, |m| m.num_deferred()),
        )?;
        dispatch!(&mut state.manager, |m| m.release_deferred_write(&ids)).py_err()
    }

    /// Chunks whose release is deferred (`defer_write_release`).
    #[getter]
    fn num_deferred_release_chunks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(dispatch!(&self.inner.lock(py)?.manager, |m| m.num_deferred()))
    }

    /// Marks keys recently used (vLLM 0.33 semantics; under 0.34, which has no `touch`, it
    /// raises `UnsupportedOperationError`).
    #[pyo3(signature = (keys, req_context = None))]
    fn touch(
        &self,
        py: Python<'_>,
        keys: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.inner
            .lock(py)?
            .with_keys(&keys, |manager, ks| dispatch!(manager, |m| m.touch(ks)))?
            .py_err()
    }

    /// The replay's bound only (`cache_policy="belady"`): when each resident key of `keys`
    /// is next used (`next_uses`, request indices; `2**64 - 1`: never). Other policies ignore
    /// it. `InvalidArgumentError` if the lengths differ.
    fn _hint_next_uses(
        &self,
        py: Python<'_>,
        keys: Bound<'_, PyAny>,
        #[pyo3(from_py_with = next_uses_arg)] next_uses: Vec<u64>,
    ) -> PyResult<()> {
        let mut state = self.inner.lock(py)?;
        let keys = collect_keys(&keys)?;
        if keys.len() != next_uses.len() {
            return Err(new_err(
                py,
                &exceptions(py).invalid_argument,
                format!("{} keys but {} next uses", keys.len(), next_uses.len()),
            ));
        }
        let ks = state.keys(&keys);
        dispatch!(&mut state.manager, |m| m.hint_next_uses(&ks, &next_uses));
        Ok(())
    }

    /// Unpins chunks whose loads finished.
    #[pyo3(signature = (keys, req_context = None))]
    fn complete_load(
        &self,
        py: Python<'_>,
        keys: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.inner
            .lock(py)?
            .with_keys(&keys, |manager, ks| {
                dispatch!(manager, |m| m.complete_load(ks))
            })?
            .py_err()
    }

    /// Decides which keys to store and where, evicting to make room. Returns an object with
    /// `keys_to_store`, `store_spec` and `evicted_keys`, or None when the keys cannot be stored.
    /// If the result cannot be built (e.g. a KeyboardInterrupt), the new chunks are dropped as
    /// by `complete_store(success=False)` and the call raises; evictions it made stay.
    fn prepare_store<'py>(
        &self,
        py: Python<'py>,
        keys: Bound<'py, PyAny>,
        req_context: Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let mut state = self.inner.lock(py)?;
        let shell = state.types.spec_shell(py)?;
        state.request_op(
            &req_context,
            &keys,
            false,
            |manager, token, ks, positions, observed| {
                dispatch!(manager, |m| m.prepare_store(token, ks, positions, observed))
            },
            |state, keys, ks, out| {
                let Some(StoreOutput {
                    stored,
                    chunk_ids,
                    evicted,
                }) = out
                else {
                    return Ok(None);
                };
                let built =
                    PyList::new(py, stored.iter().map(|&i| &keys[i])).and_then(|to_store| {
                        let spec = state.types.spec(py, shell, &chunk_ids)?;
                        state.types.store_output(py, to_store, spec, evicted)
                    });
                built.map(Some).inspect_err(|_| {
                    // The new chunks are pending and nobody will ever hear of them: drop them
                    // as a failed store would (evictions made for them stay, and their events
                    // too).
                    let new: Vec<Key<'_>> = stored.iter().map(|&i| ks[i]).collect();
                    dispatch!(&mut state.manager, |m| m.complete_store(&new, false));
                })
            },
        )
    }

    /// Completes stores: on success the chunks become readable and evictable; on failure the
    /// pending ones are dropped.
    #[pyo3(
        signature = (keys, req_context = None, success = Flag(true)),
        text_signature = "(self, keys, req_context=None, success=True)"
    )]
    fn complete_store(
        &self,
        py: Python<'_>,
        keys: Bound<'_, PyAny>,
        req_context: Option<Bound<'_, PyAny>>,
        success: Flag,
    ) -> PyResult<()> {
        let complete: fn(&mut AnyManager, &[Key<'_>]) -> usize = if success.0 {
            |manager, ks| dispatch!(manager, |m| m.complete_store(ks, true))
        } else {
            |manager, ks| dispatch!(manager, |m| m.complete_store(ks, false))
        };
        let mut state = self.inner.lock(py)?;
        let completed = state.with_keys(&keys, complete)?;
        if success.0 && completed > 0 && state.stored_events_carry_context() {
            state
                .stored_contexts
                .push_back(req_context.map(Bound::unbind));
        }
        Ok(())
    }

    /// Starts tracking a request.
    fn on_new_request<'py>(
        &self,
        py: Python<'py>,
        req_context: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut state = self.inner.lock(py)?;
        let ctx = require_context(Some(&req_context))?;
        state.request(ctx)?;
        state.types.new_request(py)
    }

    /// Applies the request's accesses to the policy in prefix order (once).
    fn on_request_finished(&self, py: Python<'_>, req_context: Bound<'_, PyAny>) -> PyResult<()> {
        let mut state = self.inner.lock(py)?;
        let state = &mut *state;
        let ctx = require_context(Some(&req_context))?;
        state.bury_dead();
        let Some(token) = state.owner.existing_token(ctx)? else {
            return Ok(());
        };
        let Some(n) = dispatch!(&state.manager, |m| m.unfinished_request_len(token)) else {
            return Ok(());
        };
        // Every position is read before anything changes (a failing read changes nothing).
        let mut walk = PositionWalk::new(Positions::new(Some(ctx), &mut state.contexts)?, 0);
        let seen = state
            .observed
            .get(&token.id)
            .map(|o| o.keys.as_slice())
            .unwrap_or_default();
        let mut positions = Vec::with_capacity(n);
        if let Some(seen) = seen.get(..n) {
            for object in seen {
                positions.push(walk.get(object.bind(py))?);
            }
        } else {
            // Key objects not kept (a context the bindings lost track of): make them.
            let keys =
                dispatch!(&state.manager, |m| m.unfinished_request_keys(token)).unwrap_or_default();
            for (i, key) in keys.iter().enumerate() {
                positions.push(match seen.get(i) {
                    Some(object) => walk.get(object.bind(py))?,
                    None => walk.get(&PyBytes::new(py, key))?,
                });
            }
        }
        dispatch!(&mut state.manager, |m| m.finish_request(token, &positions));
        // A finished request observes no new key: its key objects are no longer needed.
        state.observed.remove(&token.id);
        Ok(())
    }

    /// Events (stored / removed keys) since the last call.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let mut state = self.inner.lock(py)?;
        let events = dispatch!(&mut state.manager, |m| m.take_events());
        // All or nothing: every event is built before any is handed out; if one cannot be,
        // they all go back to the manager for the next call (and the contexts stay queued).
        let mut contexts = 0;
        let built = events
            .iter()
            .map(|e| {
                let context = if e.removal_expected {
                    contexts += 1;
                    state
                        .stored_contexts
                        .get(contexts - 1)
                        .and_then(Option::as_ref)
                } else {
                    None
                };
                state.event(py, e, context)
            })
            .collect::<PyResult<Vec<_>>>()
            .and_then(|objects| PyList::new(py, objects));
        if built.is_err() {
            dispatch!(&mut state.manager, |m| m.requeue_events(events));
        } else {
            let used = contexts.min(state.stored_contexts.len());
            state.stored_contexts.drain(..used);
        }
        built
    }

    /// Drops every chunk and request state. Refused (`InvalidStateError`, nothing changed)
    /// while chunks of failed writes are deferred (`defer_write_release`).
    fn reset_cache(&self, py: Python<'_>) -> PyResult<()> {
        let mut state = self.inner.lock(py)?;
        dispatch!(&mut state.manager, |m| m.try_reset()).py_err()?;
        state.owner.graveyard.take();
        state.observed.clear();
        Ok(())
    }

    /// `(usage, write_usage, read_usage, allocation_sizes, stores_skipped, (hinted_requests,
    /// ignored_hints, hint_kept_hits))` since the last call; `stores_skipped` is None unless
    /// `store_threshold >= 2`.
    fn _take_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let s = dispatch!(&mut self.inner.lock(py)?.manager, |m| m.take_stats());
        (
            s.usage,
            s.write_usage,
            s.read_usage,
            s.allocation_sizes,
            s.stores_skipped,
            (s.hinted_requests, s.ignored_hints, s.hint_kept_hits),
        )
            .into_pyobject(py)
    }

    /// Heap bytes by structure, and per resident chunk.
    fn memory_usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let state = self.inner.lock(py)?;
        let usage = dispatch!(&state.manager, |m| m.memory_usage());
        let d = PyDict::new(py);
        d.set_item("policy", usage.policy)?;
        d.set_item("table", usage.table)?;
        d.set_item("tracker", usage.tracker)?;
        d.set_item("requests", usage.requests)?;
        d.set_item("total", usage.total())?;
        d.set_item("resident_chunks", dispatch!(&state.manager, |m| m.len()))?;
        Ok(d)
    }

    /// A read-only copy of the chunk table: one `ChunkStatus` record per chunk id handed out
    /// since the last reset (index = chunk id; `ref_cnt` −2 marks a freed slot; later ids are
    /// free). `numpy.asarray(manager.chunk_table())` views it as a structured array.
    fn chunk_table(&self, py: Python<'_>) -> PyResult<ChunkTableView> {
        let state = self.inner.lock(py)?;
        let live = dispatch!(&state.manager, |m| m.table()).records();
        let mut records = Vec::new();
        records
            .try_reserve_exact(live.len())
            .map_err(|_| CoreError::OutOfMemory {
                what: "a copy of the chunk table",
            })
            .py_err()?;
        records.extend(
            live.iter()
                .map(|r| ChunkRecord::new(r.chunk_id(), r.ref_cnt())),
        );
        Ok(ChunkTableView {
            records: records.into_boxed_slice(),
        })
    }

    /// Internal state for tests: the policy's (as `BaseCachePolicy._debug_state`), the chunks,
    /// the free list, the allocation count, the evictable / write-pending counts, the
    /// `store_threshold` tracker's `(key, count)` least recent first (only when the threshold
    /// is on) and the stores it skipped since the last `get_stats`.
    fn _debug_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let state = self.inner.lock(py)?;
        dispatch!(&state.manager, |m| debug_state(py, m))
    }

    /// Checks the manager's and its policy's invariants; raises AssertionError if one is broken.
    #[cfg(feature = "validate")]
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        dispatch!(&self.inner.lock(py)?.manager, |m| m.validate())
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Busy: reachable from the running call (see `BaseCachePolicy.__traverse__`).
        let Some(state) = self.inner.try_peek() else {
            return Ok(());
        };
        state.types.traverse(&visit)?;
        for seen in state.observed.values() {
            for key in &seen.keys {
                visit.call(key)?;
            }
        }
        for ctx in state.stored_contexts.iter().flatten() {
            visit.call(ctx)?;
        }
        Ok(())
    }

    fn __clear__(&self) {
        if let Some(mut state) = self.inner.try_peek() {
            state.observed.clear();
            // The events themselves stay; they lose only the contexts they would carry.
            for ctx in &mut state.stored_contexts {
                *ctx = None;
            }
        }
    }
}

/// `_debug_state` of one manager (see there).
fn debug_state<'py, P: Policy<ChunkId>>(
    py: Python<'py>,
    m: &Manager<P>,
) -> PyResult<Bound<'py, PyDict>> {
    let debug = inspection_dict(py, &m.policy().inspect())?;
    let chunks = PyDict::new(py);
    for (key, &id) in m.policy().resident() {
        let ref_cnt = m.table().record(id).ref_cnt();
        chunks.set_item(PyBytes::new(py, key), (id, ref_cnt))?;
    }
    debug.set_item("chunks", chunks)?;
    debug.set_item("free_list", m.table().free_list().to_vec())?;
    debug.set_item("num_allocated", m.table().num_allocated())?;
    debug.set_item("num_evictable", m.num_evictable())?;
    debug.set_item("num_write_pending", m.num_write_pending())?;
    if let Some(offers) = m.tracked_offers() {
        let tracked = PyList::empty(py);
        for (key, count) in offers {
            tracked.append((PyBytes::new(py, key), count))?;
        }
        debug.set_item("tracked_offers", tracked)?;
    }
    debug.set_item("stores_skipped", m.stores_skipped())?;
    Ok(debug)
}

fn num_chunks_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    count(obj, "num_chunks")
}

fn cache_policy_arg(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    text(obj, "cache_policy")
}

fn module_path_arg(obj: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    if obj.is_none() {
        return Ok(None);
    }
    text(obj, "cache_policy_module_path").map(Some)
}

fn store_threshold_arg(obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    int_in_range(obj, "store_threshold", "a 64-bit int")
}

fn next_uses_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    crate::conversion::items(obj, "next_uses")
}

fn max_tracker_size_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    count(obj, "max_tracker_size")
}

/// `a, b or c` of the policies' names.
fn names(name: fn(PolicyKind) -> &'static str) -> String {
    let all: Vec<_> = PolicyKind::ALL
        .iter()
        .map(|&k| format!("{:?}", name(k)))
        .collect();
    all.join(", ")
}
