//! `kvcache.transfer` bindings: the host chunk pool, copy layouts and plans, the CPU copy
//! worker, and the CUDA entry points (registration, per-run and batched DMA submission).
//!
//! The Python package (`python/kvcache/transfer`) is the public API; these classes are its
//! building blocks and are not meant to be used directly. CUDA is never linked: `api` resolves
//! the runtime and driver the process already loaded (torch's) by name, which also lets tests
//! name a fake one; no entry point takes a function address from Python.
//!
//! Module dependencies run one way: `api` <- `registrar` <- `pool` <- `plan` <- {`copier`,
//! `cuda`} and `cuda` <- `queue`; `copier` and `queue` run their threads through `thread`.

use pyo3::prelude::*;

mod api;
mod copier;
mod cuda;
mod ids;
mod plan;
mod pool;
mod queue;
mod registrar;
mod thread;

pub use api::PyCudaApi;
pub use copier::CpuCopier;
pub use plan::{Plan, PyTransferLayout};
pub use pool::PyHostChunkPool;
pub use queue::CudaQueue;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyHostChunkPool>()?;
    m.add_class::<PyTransferLayout>()?;
    m.add_class::<Plan>()?;
    m.add_class::<CpuCopier>()?;
    m.add_class::<CudaQueue>()?;
    m.add_class::<PyCudaApi>()?;
    m.add("PAGE_SIZE", kvcache_core::host::page_size())?;
    m.add(
        "BACKGROUND_PIECE_BYTES",
        kvcache_core::host::BACKGROUND_PIECE_BYTES,
    )?;
    Ok(())
}
