//! `kvcache._core`: the PyO3 bindings of kvcache-core.
use pyo3::prelude::*;

mod transfer;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    transfer::register(m)
}
