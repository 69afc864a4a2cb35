//! Mapping core errors to Python exceptions: the one place that decides which exception a
//! [`CoreError`] becomes.

use kvcache_core::CoreError;
use pyo3::prelude::*;

use crate::exceptions::{exceptions, new_err};

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
                | CoreError::NoLoadPending(_) => &ex.invalid_state,
                CoreError::OutOfMemory { .. } => &ex.out_of_memory,
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
