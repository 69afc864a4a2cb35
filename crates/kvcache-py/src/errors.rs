//! Mapping core errors to Python exceptions: the one place that decides which exception a
//! [`CoreError`] or a [`HostError`] becomes.

use kvcache_core::host::HostError;
use kvcache_core::CoreError;
use pyo3::prelude::*;
use pyo3::types::PyType;

use crate::exceptions::{exceptions, new_err, Exceptions};

/// A core error on its way to Python (a local type: `From<CoreError> for PyErr` would be an
/// orphan impl).
pub struct Error(pub CoreError);

impl From<CoreError> for Error {
    fn from(e: CoreError) -> Self {
        Error(e)
    }
}

impl From<Error> for PyErr {
    fn from(Error(e): Error) -> PyErr {
        Python::attach(|py| {
            let ex = exceptions(py);
            let message = e.to_string();
            let ty = match e {
                CoreError::KeyNotFound(_) => &ex.key_not_found,
                CoreError::DuplicateKey(_) => &ex.duplicate_key,
                CoreError::NotEvictable(_) => &ex.not_evictable,
                CoreError::DuplicateInOffer(_) | CoreError::TooManyChunks { .. } => {
                    &ex.invalid_argument
                }
                CoreError::StaleRequest
                | CoreError::RequestFinished
                | CoreError::ChunkPending(_)
                | CoreError::NoLoadPending(_)
                | CoreError::NotWritePending(_)
                | CoreError::DeferredWrites(_) => &ex.invalid_state,
                CoreError::NotDeferred(_) => &ex.invalid_argument,
                CoreError::OutOfMemory { .. } => &ex.out_of_memory,
                CoreError::Unsupported { .. } => &ex.unsupported,
            };
            new_err(py, ty, message)
        })
    }
}

/// `?`-friendly conversion of core results.
pub trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, CoreError> {
    #[inline]
    fn py_err(self) -> PyResult<T> {
        self.map_err(|e| Error(e).into())
    }
}

/// A host-memory error on its way to Python (the transfer half of the conversion point).
pub struct HostErr(pub HostError);

impl From<HostError> for HostErr {
    fn from(e: HostError) -> Self {
        HostErr(e)
    }
}

impl From<HostErr> for PyErr {
    fn from(HostErr(e): HostErr) -> PyErr {
        Python::attach(|py| {
            let ex = exceptions(py);
            let message = e.to_string();
            let ty = match e {
                HostError::Geometry(_)
                | HostError::Mismatch(_)
                | HostError::DuplicateDestination { .. }
                | HostError::Unaddressable { .. } => &ex.invalid_argument,
                HostError::OutOfRange { .. }
                | HostError::PointerOutOfRange { .. }
                | HostError::NoSuchGroup { .. } => &ex.out_of_range,
                HostError::AlreadyRegistered => &ex.invalid_state,
                // A `PoolClosedError` (an `InvalidStateError`) wherever the pool refuses, as
                // its buffer export does.
                HostError::Closed => &ex.pool_closed,
                HostError::Busy { .. } | HostError::Register { .. } | HostError::Spawn(_) => {
                    &ex.transfer
                }
                HostError::Map(_) | HostError::Alloc { .. } => &ex.out_of_memory,
            };
            new_err(py, ty, message)
        })
    }
}

impl<T> IntoPyResult<T> for Result<T, HostError> {
    #[inline]
    fn py_err(self) -> PyResult<T> {
        self.map_err(|e| HostErr(e).into())
    }
}

/// Raises the `kvcache` exception `pick` selects, e.g. `typed(|e| &e.invalid_argument, msg)`.
pub fn typed(pick: impl FnOnce(&Exceptions) -> &Py<PyType>, message: impl Into<String>) -> PyErr {
    Python::attach(|py| new_err(py, pick(exceptions(py)), message.into()))
}

/// An argument with more items than kvcache reads from one (see `conversion::MAX_ITEMS`).
pub fn too_many_items(what: &str, max: usize) -> PyErr {
    typed(
        |e| &e.invalid_argument,
        format!("{what}: more than {max} items, the most kvcache reads from one argument"),
    )
}

/// The system refused memory for an argument's items: `OutOfMemoryError` (a `MemoryError`).
pub fn no_memory_for(what: &str, read: usize) -> PyErr {
    typed(
        |e| &e.out_of_memory,
        format!("not enough memory to read {what} ({read} items read)"),
    )
}

/// The refusal every kvcache class gives `pickle`, `copy.copy` and `copy.deepcopy` (all three
/// go through `__reduce__`). Policies, managers, pools and plans own Rust state no constructor
/// call rebuilds, and a copy that shared it would be two objects mutating one cache; the small
/// value classes refuse too, so that the rule is one rule. Python's own refusal is a bare
/// `TypeError`; this one is also a `KvCacheError`.
pub fn not_picklable(obj: &Bound<'_, PyAny>) -> PyErr {
    // The type's name, as in Python's own "cannot pickle 'X' object".
    let name = obj
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string());
    typed(
        |e| &e.invalid_type,
        format!("cannot pickle '{name}' object: kvcache objects cannot be pickled or copied"),
    )
}

/// `not_picklable` for kvcache's Python classes (`_core._refuse_pickling(self)` in their
/// `__reduce__`), so that one message and one exception class serve every kvcache object.
#[pyfunction]
#[pyo3(name = "_refuse_pickling")]
pub fn refuse_pickling(obj: &Bound<'_, PyAny>) -> PyResult<()> {
    Err(not_picklable(obj))
}
