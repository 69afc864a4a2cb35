//! `ChunkTableView`: a copy of a manager's chunk table, exported read-only through the buffer
//! protocol.

use std::ffi::c_int;
use std::ptr;

use kvcache_core::manager::{ChunkRecord, FREE};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::chunk::{fill_record_view, release_record_view};

/// A copy of a manager's chunk table, exported read-only through the buffer protocol.
#[pyclass(name = "ChunkTableView", module = "kvcache._core", frozen)]
pub struct ChunkTableView {
    pub(super) records: Box<[ChunkRecord]>,
}

#[pymethods]
impl ChunkTableView {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    fn __len__(&self) -> usize {
        self.records.len()
    }

    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if flags & ffi::PyBUF_WRITABLE != 0 {
            return Err(PyBufferError::new_err("the chunk table is read-only"));
        }
        let records = &slf.get().records;
        let (buf, len) = (records.as_ptr().cast_mut().cast(), records.len());
        if len == 0 {
            // An empty table: export zero bytes (a valid, non-null pointer still).
            // SAFETY: `view` is valid (CPython's contract).
            unsafe { fill_empty_view(view, flags, slf.into_any()) };
            return Ok(());
        }
        // SAFETY: `buf` points at `len` records in a boxed slice that never changes and lives
        // as long as `slf`, which the view's owner reference keeps alive; the export is
        // read-only.
        unsafe {
            fill_record_view(view, flags, buf, len, slf.into_any());
            (*view).readonly = 1;
        }
        Ok(())
    }

    /// # Safety
    /// Called by CPython with the view it got from `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, view: *mut ffi::Py_buffer) {
        // SAFETY: `view` was filled by `__getbuffer__` above and is released once.
        unsafe { release_record_view(view) }
    }
}

/// Fills `view` with an empty 1-d buffer.
///
/// # Safety
/// `view` must be a valid `Py_buffer` to fill.
unsafe fn fill_empty_view(view: *mut ffi::Py_buffer, flags: c_int, owner: Bound<'_, PyAny>) {
    static EMPTY: [u8; 16] = [0; 16];
    // SAFETY: the caller passes a valid view; the buffer is a static with zero length exported.
    unsafe {
        fill_record_view(
            view,
            flags,
            ptr::addr_of!(EMPTY).cast_mut().cast(),
            1,
            owner,
        );
        (*view).len = 0;
        (*view).readonly = 1;
        *(*view).shape = 0;
    }
}

/// Free slots read −2: kept in sync with the core's constant.
const _: () = assert!(FREE == -2);
