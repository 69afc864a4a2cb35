//! `kvcache.transfer` bindings: host chunk pool and transfer engine. Placeholder until implemented.

use pyo3::prelude::*;

pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
