//! The `KvCacheError` hierarchy.
//!
//! Every error kvcache raises derives from `kvcache.KvCacheError` *and* from the built-in
//! exception a caller of vLLM's pure-Python policies would catch for the same mistake
//! (`KeyError` for an absent key, `ValueError` for a bad value, `TypeError` for a bad type), so
//! code written against vLLM keeps working and code written against kvcache can catch all of
//! ours at once. Multiple inheritance is not expressible with `create_exception!`, so the
//! classes are made once with `type(name, bases, namespace)` at import.

use pyo3::exceptions::{
    PyBufferError, PyException, PyIndexError, PyKeyError, PyMemoryError, PyNotImplementedError,
    PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

pub struct Exceptions {
    pub base: Py<PyType>,
    pub key_not_found: Py<PyType>,
    pub duplicate_key: Py<PyType>,
    pub not_evictable: Py<PyType>,
    pub invalid_argument: Py<PyType>,
    pub invalid_type: Py<PyType>,
    pub invalid_key: Py<PyType>,
    pub invalid_chunk: Py<PyType>,
    pub invalid_state: Py<PyType>,
    pub reentrant_call: Py<PyType>,
    pub out_of_memory: Py<PyType>,
    pub out_of_range: Py<PyType>,
    pub transfer: Py<PyType>,
    pub pool_closed: Py<PyType>,
    pub unsupported: Py<PyType>,
}

static EXCEPTIONS: PyOnceLock<Exceptions> = PyOnceLock::new();

fn make_type(
    py: Python<'_>,
    name: &str,
    doc: &str,
    bases: &[&Bound<'_, PyType>],
) -> PyResult<Py<PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "kvcache")?;
    namespace.set_item("__doc__", doc)?;
    let bases = PyTuple::new(py, bases)?;
    let ty = py.get_type::<PyType>().call1((name, bases, namespace))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

pub fn exceptions(py: Python<'_>) -> &Exceptions {
    EXCEPTIONS.get_or_init(py, || {
        build(py).expect("creating kvcache's exception classes cannot fail")
    })
}

fn build(py: Python<'_>) -> PyResult<Exceptions> {
    let base = make_type(
        py,
        "KvCacheError",
        "Base class of every error raised by kvcache.",
        &[&py.get_type::<PyException>()],
    )?;
    let b = base.bind(py);
    let key_error = py.get_type::<PyKeyError>();
    let value_error = py.get_type::<PyValueError>();
    let type_error = py.get_type::<PyTypeError>();
    let invalid_type = make_type(
        py,
        "InvalidTypeError",
        "An argument of the wrong type.",
        &[b, &type_error],
    )?;
    let t = invalid_type.bind(py).clone();
    let invalid_state = make_type(
        py,
        "InvalidStateError",
        "A call that contradicts the state of a chunk, e.g. loading a chunk still being stored.",
        &[b, &value_error],
    )?;
    let pool_closed = make_type(
        py,
        "PoolClosedError",
        "A buffer asked of a host chunk pool after close(): also a BufferError, as any failed \
         buffer export.",
        &[invalid_state.bind(py), &py.get_type::<PyBufferError>()],
    )?;
    Ok(Exceptions {
        key_not_found: make_type(
            py,
            "KeyNotFoundError",
            "The key is not resident in the cache (or unknown to the manager).",
            &[b, &key_error],
        )?,
        duplicate_key: make_type(
            py,
            "DuplicateKeyError",
            "insert() of a key that is already resident.",
            &[b, &value_error],
        )?,
        not_evictable: make_type(
            py,
            "NotEvictableError",
            "mark_non_evictable() of a key that is not evictable.",
            &[b, &key_error],
        )?,
        invalid_argument: make_type(
            py,
            "InvalidArgumentError",
            "An argument outside its domain, e.g. a negative count.",
            &[b, &value_error],
        )?,
        invalid_key: make_type(
            py,
            "InvalidKeyError",
            "A key that is not a bytes object.",
            &[&t],
        )?,
        invalid_chunk: make_type(
            py,
            "InvalidChunkError",
            "A chunk that is neither kvcache.ChunkStatus nor an object exporting vLLM's 16-byte \
             ChunkStatus buffer.",
            &[&t],
        )?,
        invalid_state,
        pool_closed,
        reentrant_call: make_type(
            py,
            "ReentrantCallError",
            "Python code running inside a call (a request context method, a key iterator, a set's \
             __contains__) called back into the same policy or manager.",
            &[b, &py.get_type::<PyRuntimeError>()],
        )?,
        out_of_memory: make_type(
            py,
            "OutOfMemoryError",
            "Memory kvcache needed could not be had (an allocation, or host memory the operating \
             system refused to map); nothing was changed.",
            &[b, &py.get_type::<PyMemoryError>()],
        )?,
        out_of_range: make_type(
            py,
            "OutOfRangeError",
            "An id or index outside its valid range, e.g. a block id beyond the KV cache.",
            &[b, &py.get_type::<PyIndexError>()],
        )?,
        transfer: make_type(
            py,
            "TransferError",
            "A transfer or host-memory operation the runtime refused: registration failed, \
             the pool is busy, a copy could not be submitted.",
            &[b, &py.get_type::<PyRuntimeError>()],
        )?,
        unsupported: make_type(
            py,
            "UnsupportedOperationError",
            "A call the configured vLLM release's protocol does not have, e.g. touch() on a \
             manager with vLLM 0.34 semantics.",
            &[b, &py.get_type::<PyNotImplementedError>()],
        )?,
        invalid_type,
        base,
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let e = exceptions(py);
    for ty in [
        &e.base,
        &e.key_not_found,
        &e.duplicate_key,
        &e.not_evictable,
        &e.invalid_argument,
        &e.invalid_type,
        &e.invalid_key,
        &e.invalid_chunk,
        &e.invalid_state,
        &e.reentrant_call,
        &e.out_of_memory,
        &e.out_of_range,
        &e.transfer,
        &e.pool_closed,
        &e.unsupported,
    ] {
        let ty = ty.bind(py);
        m.add(ty.name()?, ty)?;
    }
    Ok(())
}

/// Raises `ty(message)`.
pub fn new_err(py: Python<'_>, ty: &Py<PyType>, message: String) -> PyErr {
    PyErr::from_type(ty.bind(py).clone(), message)
}
