//! Results of manager calls: kvcache's own types (Rust classes, cheap to build) or vLLM's
//! (built the way vLLM's manager builds them, minus redundant work).
//!
//! A subclass of the Rust manager names its result types in `_result_types`: `native=True`
//! selects the classes below (`kvcache.OffloadingManager`); otherwise the object names vLLM's
//! classes (`kvcache.vllm.CPUOffloadingManager`).

use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::gc::{PyTraverseError, PyVisit};
use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyIterator, PyList, PyType};

use kvcache_core::manager::{ChunkId, Event, LookupResult};

use crate::conversion::{int_in_range, type_name, Drain};
use crate::exceptions::{exceptions, new_err};
use kvcache_core::KeyBuf;

/// Chunk ids of a load or store: `block_ids` is an `np.int32` array (as vLLM's spec).
#[pyclass(name = "LoadStoreSpec", module = "kvcache._core", frozen)]
pub struct LoadStoreSpec {
    block_ids: Py<PyArray1<i32>>,
}

#[pymethods]
impl LoadStoreSpec {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    #[new]
    fn new(py: Python<'_>, block_ids: Bound<'_, PyAny>) -> PyResult<Self> {
        let mut drain = Drain::new(py);
        let items = drain.iter(&block_ids, "block_ids", || {
            new_err(
                py,
                &exceptions(py).invalid_type,
                format!(
                    "block_ids must be an iterable of ints, got {}",
                    type_name(&block_ids)
                ),
            )
        })?;
        let mut ids = Vec::new();
        drain.read_into(items, &mut ids, "block_ids", |item| {
            int_in_range::<i32>(&item, "a chunk id", "a 32-bit int")
        })?;
        Ok(LoadStoreSpec {
            block_ids: PyArray1::from_vec(py, ids).unbind(),
        })
    }

    #[getter]
    fn block_ids(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.block_ids.clone_ref(py)
    }

    /// The same array, under the tiering layer's name.
    #[getter]
    fn chunk_ids(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.block_ids.clone_ref(py)
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.block_ids.bind(py).len()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "LoadStoreSpec({})",
            self.block_ids
                .bind(py)
                .to_vec()?
                .iter()
                .map(i32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
}

/// The keys a `prepare_store` evicted: a read-only sequence of `bytes`. Its length is known
/// at once; the `bytes` objects are made on first use (indexing, iteration, comparison) and
/// kept. vLLM 0.33's scheduler never reads `evicted_keys`, so a manager that evicts on most
/// stores would otherwise allocate a Python object per eviction for nobody.
#[pyclass(name = "EvictedKeys", module = "kvcache._core", frozen, sequence)]
pub struct EvictedKeys {
    keys: Vec<KeyBuf>,
    list: PyOnceLock<Py<PyList>>,
}

impl EvictedKeys {
    pub fn new(keys: Vec<KeyBuf>) -> Self {
        EvictedKeys {
            keys,
            list: PyOnceLock::new(),
        }
    }

    fn list<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyList>> {
        let list = self.list.get_or_try_init(py, || {
            PyList::new(py, self.keys.iter().map(|k| PyBytes::new(py, k.as_slice())))
                .map(Bound::unbind)
        })?;
        Ok(list.bind(py))
    }
}

#[pymethods]
impl EvictedKeys {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    fn __len__(&self) -> usize {
        self.keys.len()
    }

    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        index: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.list(py)?.as_any().get_item(index)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        self.list(py)?.as_any().try_iter()
    }

    fn __contains__(&self, py: Python<'_>, key: Bound<'_, PyAny>) -> PyResult<bool> {
        self.list(py)?.contains(key)
    }

    fn __reversed__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.list(py)?
            .as_any()
            .call_method0(pyo3::intern!(py, "__reversed__"))
    }

    /// `Sequence.index`: the first position of `value` in `[start, stop)`.
    #[pyo3(signature = (value, start = None, stop = None, /))]
    fn index<'py>(
        &self,
        py: Python<'py>,
        value: Bound<'py, PyAny>,
        start: Option<Bound<'py, PyAny>>,
        stop: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let list = self.list(py)?.as_any();
        let name = pyo3::intern!(py, "index");
        match (start, stop) {
            (None, None) => list.call_method1(name, (value,)),
            (start, None) => list.call_method1(name, (value, start)),
            (start, Some(stop)) => {
                let start =
                    start.unwrap_or_else(|| 0usize.into_pyobject(py).expect("int").into_any());
                list.call_method1(name, (value, start, stop))
            }
        }
    }

    /// `Sequence.count`.
    #[pyo3(signature = (value, /))]
    fn count<'py>(&self, py: Python<'py>, value: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.list(py)?
            .as_any()
            .call_method1(pyo3::intern!(py, "count"), (value,))
    }

    /// Equal to another `EvictedKeys` with the same keys, or to a list of the same keys (as
    /// vLLM's `list` field would be).
    fn __richcmp__<'py>(
        &self,
        py: Python<'py>,
        other: Bound<'py, PyAny>,
        op: CompareOp,
    ) -> PyResult<Py<PyAny>> {
        let equal = match other.cast::<EvictedKeys>() {
            Ok(o) => Some(self.keys == o.get().keys),
            Err(_) if other.is_instance_of::<PyList>() => Some(self.list(py)?.as_any().eq(&other)?),
            Err(_) => None,
        };
        Ok(match (equal, op) {
            (Some(e), CompareOp::Eq) => e.into_pyobject(py)?.to_owned().into_any().unbind(),
            (Some(e), CompareOp::Ne) => (!e).into_pyobject(py)?.to_owned().into_any().unbind(),
            _ => py.NotImplemented(),
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.list(py)?.repr()?.to_string())
    }

    /// Unhashable, like the list it stands for (it compares equal to one by value).
    fn __hash__(&self) -> PyResult<isize> {
        Err(PyTypeError::new_err("unhashable type: 'EvictedKeys'"))
    }
}

/// What `prepare_store` decided: keys to store, where (`store_spec`), and keys evicted.
#[pyclass(name = "PrepareStoreOutput", module = "kvcache._core", frozen)]
pub struct PrepareStoreOutput {
    #[pyo3(get)]
    keys_to_store: Py<PyList>,
    #[pyo3(get)]
    store_spec: Py<PyAny>,
    #[pyo3(get)]
    evicted_keys: Py<EvictedKeys>,
}

#[pymethods]
impl PrepareStoreOutput {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "PrepareStoreOutput(keys_to_store={}, store_spec={}, evicted_keys={})",
            self.keys_to_store.bind(py).repr()?,
            self.store_spec.bind(py).repr()?,
            self.evicted_keys.bind(py).repr()?
        ))
    }
}

/// Keys stored in (`removed=False`) or removed from (`removed=True`) the CPU tier;
/// `metadata_only` marks the cleanup of a failed store rather than an eviction. Under vLLM
/// 0.34 semantics a stored event has `removal_expected=True` and carries the storing
/// request's context (`req_context`, not compared, as in vLLM).
#[pyclass(name = "OffloadingEvent", module = "kvcache._core", frozen, eq)]
pub struct OffloadingEvent {
    #[pyo3(get)]
    keys: Py<PyList>,
    #[pyo3(get)]
    removed: bool,
    #[pyo3(get)]
    metadata_only: bool,
    #[pyo3(get)]
    removal_expected: bool,
    #[pyo3(get)]
    req_context: Option<Py<PyAny>>,
}

impl PartialEq for OffloadingEvent {
    fn eq(&self, other: &Self) -> bool {
        Python::attach(|py| {
            self.removed == other.removed
                && self.metadata_only == other.metadata_only
                && self.removal_expected == other.removal_expected
                && self.keys.bind(py).eq(other.keys.bind(py)).unwrap_or(false)
        })
    }
}

#[pymethods]
impl OffloadingEvent {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    #[getter]
    fn medium(&self) -> &'static str {
        "CPU"
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.keys)?;
        if let Some(ctx) = &self.req_context {
            visit.call(ctx)?;
        }
        Ok(())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "OffloadingEvent(keys={}, medium='CPU', removed={}, removal_expected={}, \
             metadata_only={})",
            self.keys.bind(py).repr()?,
            if self.removed { "True" } else { "False" },
            if self.removal_expected {
                "True"
            } else {
                "False"
            },
            if self.metadata_only { "True" } else { "False" },
        ))
    }
}

/// vLLM's classes, when results must be vLLM's own objects.
struct Foreign {
    spec_cls: Py<PyType>,
    output_cls: Py<PyAny>,
    event_cls: Py<PyAny>,
    /// vLLM 0.34's event type has a `req_context` field; 0.33's has none.
    event_takes_context: bool,
    medium: Py<PyAny>,
    new_request: Py<PyAny>,
}

pub struct ResultTypes {
    miss: Py<PyAny>,
    hit: Py<PyAny>,
    hit_pending: Py<PyAny>,
    foreign: Option<Foreign>,
}

impl ResultTypes {
    /// Reports the objects these types hold to the garbage collector.
    pub fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.miss)?;
        visit.call(&self.hit)?;
        visit.call(&self.hit_pending)?;
        if let Some(f) = &self.foreign {
            visit.call(&f.spec_cls)?;
            visit.call(&f.output_cls)?;
            visit.call(&f.event_cls)?;
            visit.call(&f.medium)?;
            visit.call(&f.new_request)?;
        }
        Ok(())
    }

    /// Reads `cls._result_types` (see the module docs).
    pub fn from_class(cls: &Bound<'_, PyType>) -> PyResult<Self> {
        let types = cls.getattr("_result_types").map_err(|_| {
            new_err(
                cls.py(),
                &exceptions(cls.py()).invalid_type,
                "use kvcache.OffloadingManager or kvcache.vllm.CPUOffloadingManager \
                 (the base class names no result types)"
                    .into(),
            )
        })?;
        let get = |name: &str| types.getattr(name).map(Bound::unbind);
        let native = types
            .getattr("native")
            .and_then(|v| v.is_truthy())
            .unwrap_or(false);
        let foreign = if native {
            None
        } else {
            Some(Foreign {
                spec_cls: types.getattr("spec_cls")?.cast_into::<PyType>()?.unbind(),
                output_cls: get("output_cls")?,
                event_cls: get("event_cls")?,
                event_takes_context: types
                    .getattr("event_takes_context")
                    .and_then(|v| v.is_truthy())
                    .unwrap_or(false),
                medium: get("medium")?,
                new_request: get("new_request")?,
            })
        };
        Ok(ResultTypes {
            miss: get("miss")?,
            hit: get("hit")?,
            hit_pending: get("hit_pending")?,
            foreign,
        })
    }

    #[inline]
    pub fn lookup<'py>(&self, py: Python<'py>, result: LookupResult) -> Bound<'py, PyAny> {
        let member = match result {
            LookupResult::Miss => &self.miss,
            LookupResult::Hit => &self.hit,
            LookupResult::HitPending => &self.hit_pending,
        };
        member.bind(py).clone()
    }

    /// What of a spec can be made before the manager changes: vLLM's spec object, made
    /// without running its `__init__` (which would only copy the array we build as
    /// `np.int32`); nothing for ours.
    pub fn spec_shell<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        match &self.foreign {
            None => Ok(None),
            Some(f) => {
                let cls = f.spec_cls.bind(py);
                cls.call_method1(pyo3::intern!(py, "__new__"), (cls,))
                    .map(Some)
            }
        }
    }

    /// A spec naming `ids`, completing `shell` (from [`spec_shell`](Self::spec_shell)).
    pub fn spec<'py>(
        &self,
        py: Python<'py>,
        shell: Option<Bound<'py, PyAny>>,
        ids: &[ChunkId],
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids: Vec<i32> = ids
            .iter()
            .map(|&id| i32::try_from(id).expect("chunk ids are below MAX_CHUNKS = i32::MAX"))
            .collect();
        let array = PyArray1::from_slice(py, &ids);
        match shell {
            None => Ok(Bound::new(
                py,
                LoadStoreSpec {
                    block_ids: array.unbind(),
                },
            )?
            .into_any()),
            Some(spec) => {
                spec.setattr(pyo3::intern!(py, "block_ids"), array)?;
                Ok(spec)
            }
        }
    }

    pub fn store_output<'py>(
        &self,
        py: Python<'py>,
        keys_to_store: Bound<'py, PyList>,
        spec: Bound<'py, PyAny>,
        evicted_keys: Vec<KeyBuf>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let evicted_keys = Bound::new(py, EvictedKeys::new(evicted_keys))?;
        match &self.foreign {
            None => Ok(Bound::new(
                py,
                PrepareStoreOutput {
                    keys_to_store: keys_to_store.unbind(),
                    store_spec: spec.unbind(),
                    evicted_keys: evicted_keys.unbind(),
                },
            )?
            .into_any()),
            Some(f) => f
                .output_cls
                .bind(py)
                .call1((keys_to_store, spec, evicted_keys)),
        }
    }

    /// An event object; `req_context` is given only for a stored event under vLLM 0.34
    /// semantics (vLLM 0.33's event type has no such field).
    pub fn event<'py>(
        &self,
        py: Python<'py>,
        keys: Bound<'py, PyList>,
        e: &Event,
        req_context: Option<&Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match &self.foreign {
            None => Ok(Bound::new(
                py,
                OffloadingEvent {
                    keys: keys.unbind(),
                    removed: e.removed,
                    metadata_only: e.metadata_only,
                    removal_expected: e.removal_expected,
                    req_context: req_context.map(|c| c.clone_ref(py)),
                },
            )?
            .into_any()),
            Some(f) => {
                let event = f.event_cls.bind(py);
                if !(e.metadata_only || e.removal_expected) {
                    return event.call1((keys, f.medium.bind(py), e.removed));
                }
                let kwargs = pyo3::types::PyDict::new(py);
                if e.metadata_only {
                    kwargs.set_item(pyo3::intern!(py, "metadata_only"), true)?;
                }
                if e.removal_expected {
                    kwargs.set_item(pyo3::intern!(py, "removal_expected"), true)?;
                }
                if let (Some(ctx), true) = (req_context, f.event_takes_context) {
                    kwargs.set_item(pyo3::intern!(py, "req_context"), ctx)?;
                }
                event.call((keys, f.medium.bind(py), e.removed), Some(&kwargs))
            }
        }
    }

    /// What `on_new_request` returns: vLLM's `RequestOffloadingContext()`, or None.
    pub fn new_request<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match &self.foreign {
            None => Ok(py.None().into_bound(py)),
            Some(f) => f.new_request.bind(py).call0(),
        }
    }
}
