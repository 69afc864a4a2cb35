//! `_core.HostChunkPool`: the Rust half of `kvcache.transfer.HostChunkPool`.
//!
//! It owns the mapping (through `Arc<HostRegion>`) and exports it with the buffer protocol as
//! one flat, writable run of unsigned bytes. Pinning policy, logging and `tensor()` live in the
//! Python subclass.

use std::ffi::c_int;
use std::sync::Arc;

use kvcache_core::host::HostRegion;
use pyo3::exceptions::{PyBufferError, PyOSError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

use super::cuda::CudartRegistrar;
use super::host_err;

#[pyclass(module = "kvcache._core", name = "HostChunkPool", subclass, frozen)]
pub struct PyHostChunkPool {
    pub(crate) region: Arc<HostRegion>,
    num_chunks: usize,
    chunk_bytes: usize,
    /// Shape and strides handed to buffer consumers; they point into this object, which every
    /// export keeps alive through `Py_buffer.obj`.
    shape: [ffi::Py_ssize_t; 1],
    strides: [ffi::Py_ssize_t; 1],
}

impl PyHostChunkPool {
    pub(crate) fn num_chunks_usize(&self) -> usize {
        self.num_chunks
    }
    pub(crate) fn chunk_bytes_usize(&self) -> usize {
        self.chunk_bytes
    }
}

#[pymethods]
impl PyHostChunkPool {
    #[new]
    fn new(num_chunks: usize, chunk_bytes: usize) -> PyResult<Self> {
        if num_chunks == 0 || chunk_bytes == 0 {
            return Err(PyValueError::new_err(
                "num_chunks and chunk_bytes must be positive",
            ));
        }
        let len = num_chunks
            .checked_mul(chunk_bytes)
            .filter(|&n| ffi::Py_ssize_t::try_from(n).is_ok())
            .ok_or_else(|| PyValueError::new_err("num_chunks * chunk_bytes is too large"))?;
        let region = HostRegion::new(len).map_err(host_err)?;
        Ok(PyHostChunkPool {
            region: Arc::new(region),
            num_chunks,
            chunk_bytes,
            shape: [len as ffi::Py_ssize_t],
            strides: [1],
        })
    }

    #[getter]
    fn num_chunks(&self) -> usize {
        self.num_chunks
    }

    #[getter]
    fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// `num_chunks * chunk_bytes`: the bytes the pool exports (the mapping is rounded up to
    /// whole pages).
    #[getter]
    fn nbytes(&self) -> usize {
        self.region.len()
    }

    #[getter]
    fn mapped_bytes(&self) -> usize {
        self.region.mapped_len()
    }

    /// Start address of the pool's memory.
    #[getter]
    fn address(&self) -> usize {
        self.region.addr()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.region.is_closed()
    }

    /// Whether the memory is currently registered (pinned) with the CUDA runtime.
    #[getter]
    fn pinned(&self) -> bool {
        self.region.is_registered()
    }

    #[getter]
    fn registration_pieces(&self) -> usize {
        self.region.registered_pieces()
    }

    /// Bytes of the pool resident in RAM right now (`mincore`).
    fn resident_bytes(&self) -> PyResult<usize> {
        self.region
            .resident_bytes()
            .map_err(|e| PyOSError::new_err(e.to_string()))
    }

    /// Unregisters the memory and returns its pages to the system; idempotent. Raises
    /// `RuntimeError` while transfers are in flight. Returns how many unregister calls failed.
    fn close(&self) -> PyResult<usize> {
        self.region.close().map_err(host_err)
    }

    /// Registers the mapping through the given CUDA runtime functions (addresses of
    /// `cudaHostRegister`, `cudaHostUnregister`, `cudaGetLastError`) in pieces of at most
    /// `max_piece_bytes`. `keepalive` is held as long as the registration (the library or
    /// the callback objects the addresses point into).
    ///
    /// The addresses must point to functions with those exact C signatures; the Python layer
    /// obtains them from the loaded runtime through ctypes. Returns the number of pieces;
    /// raises `RuntimeError` (all pieces rolled back, error cleared) on failure.
    #[pyo3(signature = (register_fn, unregister_fn, get_last_error_fn, flags, max_piece_bytes, keepalive))]
    #[allow(clippy::too_many_arguments)]
    fn _register(
        &self,
        py: Python<'_>,
        register_fn: usize,
        unregister_fn: usize,
        get_last_error_fn: usize,
        flags: u32,
        max_piece_bytes: usize,
        keepalive: Py<PyAny>,
    ) -> PyResult<usize> {
        let registrar = CudartRegistrar::new(
            register_fn,
            unregister_fn,
            get_last_error_fn,
            flags,
            keepalive,
        )?;
        let region = Arc::clone(&self.region);
        let unit = self.chunk_bytes;
        py.detach(move || region.register(Box::new(registrar), unit, max_piece_bytes))
            .map_err(host_err)
    }

    /// Exports the whole pool as a flat writable buffer of unsigned bytes.
    ///
    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("view is NULL"));
        }
        let this = slf.get();
        if this.region.is_closed() {
            return Err(PyBufferError::new_err("the host chunk pool is closed"));
        }
        let want = |f: c_int| flags & f == f;
        // SAFETY: `view` is a valid, writable Py_buffer provided by CPython. Every pointer we
        // store stays valid for the export's lifetime: the memory belongs to the region,
        // which lives at least as long as this object (mapped until the object and all plans
        // drop it); `shape`/`strides` are fields of this frozen object; the format is a
        // static string. `obj` takes a strong reference that `PyBuffer_Release` gives back.
        unsafe {
            (*view).buf = this.region.as_ptr().cast();
            (*view).len = this.shape[0];
            (*view).readonly = 0;
            (*view).itemsize = 1;
            (*view).format = if want(ffi::PyBUF_FORMAT) {
                c"B".as_ptr().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if want(ffi::PyBUF_ND) {
                this.shape.as_ptr().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if want(ffi::PyBUF_STRIDES) {
                this.strides.as_ptr().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
            (*view).obj = slf.into_any().into_ptr();
        }
        Ok(())
    }

    /// Nothing to free: exports borrow the region and static metadata.
    ///
    /// # Safety
    /// Called by CPython with a view this object filled.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
