//! `kvcache.transfer` bindings: the host chunk pool, copy plans, the CPU copy worker and the
//! two CUDA entry points (registration, batched `cudaMemcpyAsync`).
//!
//! The Python package (`python/kvcache/transfer`) is the public API; these classes are its
//! building blocks and are not meant to be used directly. CUDA is never linked: the Python
//! side looks up the runtime the process already loaded (torch's) and passes function
//! addresses in, which also lets tests substitute fakes.

// The transfer code is being rebuilt for the vLLM worker; its numeric casts are audited one by
// one (as in the rest of the workspace) when that lands.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    clippy::cast_lossless
)]

use kvcache_core::host::HostError;
use pyo3::exceptions::{PyIndexError, PyMemoryError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

mod copier;
mod cuda;
mod plan;
mod pool;

pub use copier::CpuCopier;
pub use plan::{Plan, PyTransferLayout};
pub use pool::PyHostChunkPool;

/// Maps core errors onto the Python exceptions the API documents.
pub(crate) fn host_err(e: HostError) -> PyErr {
    let msg = e.to_string();
    match e {
        HostError::InvalidArgument(_) | HostError::Closed => PyValueError::new_err(msg),
        HostError::OutOfRange(_) => PyIndexError::new_err(msg),
        HostError::Busy { .. } | HostError::Register { .. } => PyRuntimeError::new_err(msg),
        HostError::Map(_) => PyMemoryError::new_err(msg),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyHostChunkPool>()?;
    m.add_class::<PyTransferLayout>()?;
    m.add_class::<Plan>()?;
    m.add_class::<CpuCopier>()?;
    m.add_function(wrap_pyfunction!(cuda::cuda_memcpy_runs, m)?)?;
    m.add("PAGE_SIZE", kvcache_core::host::page_size())?;
    Ok(())
}
