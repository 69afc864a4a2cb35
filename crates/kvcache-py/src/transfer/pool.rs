//! `_core.HostChunkPool`: the Rust half of `kvcache.transfer.HostChunkPool`.
//!
//! It owns the mapping (through `Arc<HostRegion>`) and exports it with the buffer protocol as
//! one flat, writable run of unsigned bytes. Pinning policy, logging and `tensor()` live in the
//! Python subclass.

use std::ffi::c_int;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvcache_core::host::{HostRegion, PinStatus};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyMemoryView};
use pyo3::PyTraverseError;

use super::api::PyCudaApi;
use super::registrar::CudartRegistrar;
use crate::errors::{typed, IntoPyResult};
use crate::exceptions::exceptions;

#[pyclass(module = "kvcache._core", name = "HostChunkPool", subclass, frozen)]
pub struct PyHostChunkPool {
    pub(crate) region: Arc<HostRegion>,
    /// The export of the caller's buffer a pool over one holds (also the region's owner):
    /// shown to the garbage collector and released by it ([`PyHostChunkPool::__clear__`]).
    held: Option<Arc<HeldBuffer>>,
    num_chunks: usize,
    chunk_bytes: usize,
    /// Shape and strides handed to buffer consumers; they point into this object, which every
    /// export keeps alive through `Py_buffer.obj`.
    shape: [ffi::Py_ssize_t; 1],
    strides: [ffi::Py_ssize_t; 1],
}

impl PyHostChunkPool {
    /// The region, for a call that acts on its memory (pinning, prefaulting; exports and
    /// layouts check the same), unless the pool or the pool whose memory it uses is closed:
    /// `PoolClosedError` then.
    fn open_region(&self) -> PyResult<&Arc<HostRegion>> {
        if self.region.is_closed() {
            return Err(typed(
                |e| &e.pool_closed,
                "the host chunk pool is closed (or the pool it was built over is)",
            ));
        }
        Ok(&self.region)
    }

    /// Whether the garbage collector may see, and release, the export this pool holds: no
    /// transfer holds a lease on the memory and no registration is pinning it. Everything
    /// else that shares the region either references this pool from Python (a layout: while
    /// it is reachable, so is the pool) or never touches the memory again without a lease
    /// (a plan that ran), which a closed region refuses.
    fn collectable(&self) -> bool {
        !self.region.is_in_use()
    }

    pub(crate) fn num_chunks_usize(&self) -> usize {
        self.num_chunks
    }
    pub(crate) fn chunk_bytes_usize(&self) -> usize {
        self.chunk_bytes
    }
}

#[pymethods]
impl PyHostChunkPool {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    /// A pool of `num_chunks * chunk_bytes` bytes: its own anonymous mapping, or with
    /// `buffer`, the memory of that writable, C-contiguous buffer (at least as many bytes,
    /// page-aligned, whole pages), kept exported for as long as the pool or anything using
    /// it lives; closing such a pool unpins it and leaves its bytes alone.
    #[new]
    #[pyo3(signature = (num_chunks, chunk_bytes, *, buffer=None))]
    fn new(
        #[pyo3(from_py_with = num_chunks_arg)] num_chunks: usize,
        #[pyo3(from_py_with = chunk_bytes_arg)] chunk_bytes: usize,
        buffer: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        if num_chunks == 0 || chunk_bytes == 0 {
            return Err(typed(
                |e| &e.invalid_argument,
                "num_chunks and chunk_bytes must be positive",
            ));
        }
        let (len, exported) = num_chunks
            .checked_mul(chunk_bytes)
            .and_then(|n| Some((n, ffi::Py_ssize_t::try_from(n).ok()?)))
            .ok_or_else(|| {
                typed(
                    |e| &e.invalid_argument,
                    "num_chunks * chunk_bytes is too large",
                )
            })?;
        let (region, held) = match buffer {
            None => (HostRegion::new(len).py_err()?, None),
            Some(obj) => {
                let (region, held) = borrowed_region(obj, len)?;
                (region, Some(held))
            }
        };
        Ok(PyHostChunkPool {
            region: Arc::new(region),
            held,
            num_chunks,
            chunk_bytes,
            shape: [exported],
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

    /// Whether the memory is registered (pinned) with the CUDA runtime, every piece of it.
    #[getter]
    fn pinned(&self) -> bool {
        self.region.is_registered()
    }

    /// Pieces registered now: every piece when `pinned`, or those a failed background
    /// registration left pinned until `close()`.
    #[getter]
    fn registration_pieces(&self) -> usize {
        self.region.registered_pieces()
    }

    /// Bytes per registration piece of the registration in place or under way (None: none).
    #[getter]
    fn registration_piece_bytes(&self) -> Option<usize> {
        self.region.registration_piece_bytes()
    }

    /// Where pinning stands: `{"state": "unpinned"}`, `{"state": "pinning", "done": n,
    /// "total": m}`, `{"state": "pinned", "pieces": n, "seconds": s}` or `{"state":
    /// "failed", "code": c, "offset": o, "len": n}`.
    fn pin_status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        status_dict(py, self.region.pin_status())
    }

    /// Blocks (GIL released) until a background registration has finished or `timeout_s`
    /// passed; returns :meth:`pin_status` then.
    fn wait_pinned<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = timeout_arg)] timeout_s: Duration,
    ) -> PyResult<Bound<'py, PyDict>> {
        let timeout = timeout_s;
        let region = Arc::clone(&self.region);
        let status = py.detach(move || region.wait_pinned(timeout));
        status_dict(py, status)
    }

    /// Prefaults every page of the pool with `threads` threads, at most the available
    /// parallelism (capped at 8) (GIL released); False when the kernel lacks
    /// `MADV_POPULATE_WRITE`. Raises `TransferError` when the system refuses a thread, and
    /// `PoolClosedError` on a closed pool (it would take back the memory `close()` gave up).
    fn populate(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = threads_arg)] threads: usize,
    ) -> PyResult<bool> {
        let region = Arc::clone(self.open_region()?);
        py.detach(move || region.populate(threads)).py_err()
    }

    /// Bytes of the pool resident in RAM right now (`mincore`); 0 once `close()` gave its own
    /// pages back. A status, like `closed` and `pin_status`: it answers on a closed pool too.
    fn resident_bytes(&self) -> PyResult<usize> {
        self.region
            .resident_bytes()
            .map_err(|e| typed(|e| &e.transfer, format!("mincore failed: {e}")))
    }

    /// Unregisters the memory and returns its pages to the system; idempotent. Stops a
    /// background registration first (GIL released meanwhile). Raises `TransferError` while
    /// transfers are in flight. Returns how many unregister calls failed.
    fn close(&self, py: Python<'_>) -> PyResult<usize> {
        let region = Arc::clone(&self.region);
        py.detach(move || region.close()).py_err()
    }

    /// Registers the mapping with the CUDA runtime `api` (`cudaHostRegister` with `flags`) in
    /// pieces of at most `max_piece_bytes`, each prefaulted by several threads first.
    ///
    /// Every registration call, and the unregistration on `close()`, runs with `device`
    /// current (None: the calling thread's). With `background`, a thread of its own
    /// registers (pieces of at most `BACKGROUND_PIECE_BYTES`), bound to `device` first, and
    /// the call returns at once; see :meth:`pin_status`.
    /// Otherwise it blocks (GIL released) and raises `TransferError` (all pieces rolled back,
    /// error cleared) on failure. Returns the number of pieces.
    #[pyo3(signature = (api, flags, max_piece_bytes, *, background=false, device=None))]
    fn _register(
        &self,
        py: Python<'_>,
        api: &Bound<'_, PyAny>,
        flags: u32,
        max_piece_bytes: usize,
        background: bool,
        device: Option<i32>,
    ) -> PyResult<usize> {
        let api = api.cast::<PyCudaApi>().map_err(|_| {
            typed(
                |e| &e.invalid_type,
                "api must be a kvcache._core.CudaApi (a runtime loaded by name)",
            )
        })?;
        let registrar = Box::new(CudartRegistrar::new(
            Arc::clone(&api.get().api),
            flags,
            device,
        ));
        let region = Arc::clone(&self.region);
        let unit = self.chunk_bytes;
        if background {
            return region
                .register_background(registrar, unit, max_piece_bytes)
                .py_err();
        }
        py.detach(move || region.register(registrar, unit, max_piece_bytes))
            .py_err()
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
            return Err(typed(
                |e| &e.pool_closed,
                "the host chunk pool is closed: it exports no memory",
            ));
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

    /// The exporter of the buffer the pool was built over, which its export keeps alive: a
    /// cycle back to the pool through it (an attribute of a `bytearray` or numpy subclass)
    /// is then collectable. Shown only while no transfer or registration uses the memory
    /// (`collectable`), the case in which `__clear__` may release it.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        let Some(held) = &self.held else {
            return Ok(());
        };
        if !self.collectable() {
            return Ok(());
        }
        // Never waits: only `__clear__` and the last drop lock it, both with the interpreter
        // attached, so a held lock here means a collection inside one of them; skip a round.
        let Ok(slot) = held.0.try_lock() else {
            return Ok(());
        };
        if let Some(buf) = slot.as_ref() {
            // SAFETY: the collector calls `tp_traverse` with the interpreter attached (pyo3
            // only refuses `Python::attach` here); `obj` reads a field of the view and runs
            // no Python code.
            let py = unsafe { Python::assume_attached() };
            if let Some(obj) = buf.obj(py) {
                visit.call(obj.as_unbound())?;
            }
        }
        Ok(())
    }

    /// Breaks a cycle through the buffer's exporter: closes the pool, then releases the
    /// export. Only when `__traverse__` showed it (`collectable`): a transfer or registration
    /// in progress keeps the export, and the memory.
    fn __clear__(&self) {
        let Some(held) = &self.held else {
            return;
        };
        // Closed first, so that nothing exports, pins or leases the memory once it may be
        // gone (a plan that ran and still holds the region cannot run again); `close()` is
        // refused if a transfer started meanwhile, and then the export stays.
        if !self.collectable() || self.region.close().is_err() {
            return;
        }
        let buf = held.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        // Released outside the lock: the exporter's release may run Python code.
        drop(buf);
    }
}

fn status_dict(py: Python<'_>, status: PinStatus) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    match status {
        PinStatus::Unpinned => d.set_item("state", "unpinned")?,
        PinStatus::Pinning { done, total } => {
            d.set_item("state", "pinning")?;
            d.set_item("done", done)?;
            d.set_item("total", total)?;
        }
        PinStatus::Pinned { pieces, seconds } => {
            d.set_item("state", "pinned")?;
            d.set_item("pieces", pieces)?;
            d.set_item("seconds", seconds)?;
        }
        PinStatus::Failed { code, offset, len } => {
            d.set_item("state", "failed")?;
            d.set_item("code", code)?;
            d.set_item("offset", offset)?;
            d.set_item("len", len)?;
        }
    }
    Ok(d)
}

/// Seconds to wait: an int or a float (not a bool, not NaN); a negative one waits not at all.
fn timeout_arg(obj: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let number = (obj.is_instance_of::<PyInt>() || obj.is_instance_of::<PyFloat>())
        && !obj.is_instance_of::<PyBool>();
    if !number {
        return Err(typed(
            |e| &e.invalid_type,
            format!(
                "timeout_s must be a number of seconds, got {}",
                crate::conversion::type_name(obj)
            ),
        ));
    }
    let secs: f64 = obj
        .extract()
        .map_err(|_| typed(|e| &e.invalid_argument, "timeout_s is too large"))?;
    if secs.is_nan() {
        return Err(typed(
            |e| &e.invalid_argument,
            "timeout_s must be a number, got nan",
        ));
    }
    Duration::try_from_secs_f64(secs.max(0.0))
        .map_err(|e| typed(|e| &e.invalid_argument, format!("timeout_s: {e}")))
}

fn threads_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    crate::conversion::count(obj, "threads")
}

fn num_chunks_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    crate::conversion::count(obj, "num_chunks")
}

fn chunk_bytes_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    crate::conversion::count(obj, "chunk_bytes")
}

/// A buffer export held for as long as a borrowed region lives, shared by the pool (for the
/// garbage collector) and the region (whose memory it keeps valid). Released with the
/// interpreter attached; after interpreter shutdown there is nothing to release it to: leaked.
struct HeldBuffer(Mutex<Option<PyBuffer<u8>>>);

impl Drop for HeldBuffer {
    fn drop(&mut self) {
        let mut slot = self.0.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if Python::try_attach(|_| drop(slot.take())).is_none() {
            std::mem::forget(slot.take());
        }
    }
}

/// A region over `obj`'s memory (the first `len` bytes of a writable, C-contiguous buffer of
/// at least `len` bytes), keeping the export alive; inside the region of the pool `obj` is,
/// or views (a memoryview or numpy array over a pool), so that closing that pool closes this
/// one's use of its memory. A closed pool refuses to export, and a view of one taken before it
/// closed is refused too: `PoolClosedError`.
fn borrowed_region(obj: &Bound<'_, PyAny>, len: usize) -> PyResult<(HostRegion, Arc<HeldBuffer>)> {
    let py = obj.py();
    let buf = PyBuffer::<u8>::get(obj).map_err(|e| {
        if e.is_instance(py, exceptions(py).pool_closed.bind(py)) {
            return e;
        }
        typed(
            |e| &e.invalid_type,
            format!(
                "buffer must export bytes (the buffer protocol), got {}",
                crate::conversion::type_name(obj)
            ),
        )
    })?;
    if buf.readonly() || !buf.is_c_contiguous() {
        return Err(typed(
            |e| &e.invalid_argument,
            "buffer must be writable and C-contiguous",
        ));
    }
    if buf.len_bytes() < len {
        return Err(typed(
            |e| &e.invalid_argument,
            format!(
                "buffer holds {} bytes, the pool needs {len}",
                buf.len_bytes()
            ),
        ));
    }
    let ptr = std::ptr::NonNull::new(buf.buf_ptr().cast::<u8>())
        .ok_or_else(|| typed(|e| &e.invalid_argument, "buffer has no memory"))?;
    let parent = pool_region_under(obj);
    // A view taken before its pool closed still exports; a pool over it would be closed
    // from birth, so it is refused as the closed pool itself is.
    if parent.as_ref().is_some_and(|p| p.is_closed()) {
        return Err(typed(
            |e| &e.pool_closed,
            "buffer views a host chunk pool that is closed",
        ));
    }
    let held = Arc::new(HeldBuffer(Mutex::new(Some(buf))));
    // SAFETY: a writable, C-contiguous export of at least `len` bytes from `ptr`; the export
    // (held in the owner box) keeps the exporter's memory valid until it is released, which
    // happens when the region drops or, once the region is closed and the pool alone holds
    // it, in `__clear__`.
    let region = unsafe { HostRegion::borrowed(ptr, len, Box::new(Arc::clone(&held))) }.py_err()?;
    let region = match parent {
        Some(parent) => region.within(parent),
        None => region,
    };
    Ok((region, held))
}

/// The region of the pool whose memory `obj` is: `obj` itself, or what a memoryview
/// (`.obj`) or numpy array (`.base`) over it views, a few levels down.
fn pool_region_under(obj: &Bound<'_, PyAny>) -> Option<Arc<HostRegion>> {
    let mut at = obj.clone();
    for _ in 0..16 {
        if let Ok(pool) = at.cast::<PyHostChunkPool>() {
            return Some(Arc::clone(&pool.get().region));
        }
        let under = if at.is_instance_of::<PyMemoryView>() {
            at.getattr(pyo3::intern!(at.py(), "obj")).ok()?
        } else if at.is_instance_of::<numpy::PyUntypedArray>() {
            at.getattr(pyo3::intern!(at.py(), "base")).ok()?
        } else {
            return None;
        };
        if under.is_none() {
            return None;
        }
        at = under;
    }
    None
}
