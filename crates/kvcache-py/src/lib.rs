//! `kvcache._core`: the Python bindings of kvcache-core.
//!
//! Conversions live in `conversion` (keys, counts) and `context` (request contexts), errors in
//! `errors` and `exceptions`, the policy classes (from the core's list) in `kinds`, the
//! manager over any policy in `any_manager`; this file only assembles the module. The module
//! relies on the GIL (see the `SAFETY` notes in `chunk`), so it is built for the stable ABI of
//! GIL builds (abi3, CPython ≥ 3.11).

use pyo3::prelude::*;

// First: its `dispatch!` macro is used by the modules declared after it.
#[macro_use]
mod any_manager;
mod chunk;
mod context;
mod conversion;
mod errors;
mod exceptions;
mod guard;
mod hints;
mod kinds;
mod manager;
mod policy;
mod request_state;
mod results;
mod transfer;

#[pymodule(gil_used = true)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_ITEMS", conversion::MAX_ITEMS)?;
    m.add_class::<chunk::ChunkStatus>()?;
    m.add_class::<policy::BaseCachePolicy>()?;
    kinds::register(m)?;
    m.add_class::<request_state::RequestState>()?;
    m.add_class::<manager::PyManager>()?;
    m.add_class::<manager::ChunkTableView>()?;
    m.add_class::<results::LoadStoreSpec>()?;
    m.add_class::<results::PrepareStoreOutput>()?;
    m.add_class::<results::EvictedKeys>()?;
    m.add_class::<results::OffloadingEvent>()?;
    m.add_function(wrap_pyfunction!(policy::order_request_keys_py, m)?)?;
    m.add_function(wrap_pyfunction!(errors::refuse_pickling, m)?)?;
    exceptions::register(m)?;
    transfer::register(m)?;
    Ok(())
}
