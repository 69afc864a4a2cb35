//! `kvcache.ChunkStatus` and the chunk handles policies keep.
//!
//! vLLM's manager creates a ctypes `ChunkStatus` per stored chunk and mutates its `ref_cnt` in
//! place on whatever object the policy's `get()` returned. Our policies must therefore keep the
//! very object they were given, and must read `ref_cnt` while choosing victims without calling
//! into Python per entry. Both chunk types expose the same 16 bytes (int32 `ref_cnt` at offset
//! 0, int64 `chunk_id` at offset 8): ours holds them inline, a foreign object through the buffer
//! protocol, and a policy reads the count straight from that memory.

use std::ffi::{c_int, CStr};
use std::mem::ManuallyDrop;
use std::ptr::{self, NonNull};
use std::sync::atomic::Ordering;

use kvcache_core::manager::ChunkRecord;
use kvcache_core::HasRefCnt;
use pyo3::ffi;
use pyo3::gc::{PyTraverseError, PyVisit};
use pyo3::prelude::*;

use crate::conversion::{int_in_range, type_name};
use crate::exceptions::{exceptions, new_err};

pub const CHUNK_STATUS_BYTES: usize = std::mem::size_of::<ChunkRecord>();
/// [`CHUNK_STATUS_BYTES`] as CPython's size type.
const ITEM_SIZE: ffi::Py_ssize_t = 16;
const _: () = assert!(CHUNK_STATUS_BYTES == 16);

/// PEP 3118 format of one record: int32 `ref_cnt`, 4 pad bytes, int64 `chunk_id`
/// (little-endian, as on every platform vLLM runs on). numpy turns it into a structured dtype.
pub const CHUNK_STATUS_FORMAT: &CStr = c"T{<i:ref_cnt:4x<q:chunk_id:}";

/// Offloading status of one chunk: `ref_cnt` (−1 while the store is pending, else the number
/// of loads reading it) and `chunk_id` (its slot in host memory).
#[pyclass(name = "ChunkStatus", module = "kvcache._core", frozen)]
pub struct ChunkStatus {
    raw: ChunkRecord,
}

#[pymethods]
impl ChunkStatus {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    /// A new record starts "not ready" (`ref_cnt == -1`), like vLLM's.
    #[new]
    fn new(chunk_id: Bound<'_, PyAny>) -> PyResult<Self> {
        let chunk_id = int_in_range(&chunk_id, "chunk_id", "a 64-bit int")?;
        Ok(ChunkStatus {
            raw: ChunkRecord::new(chunk_id, -1),
        })
    }

    #[getter]
    fn ref_cnt(&self) -> i32 {
        self.raw.ref_cnt.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_ref_cnt(&self, value: Bound<'_, PyAny>) -> PyResult<()> {
        let value = int_in_range(&value, "ref_cnt", "a 32-bit int")?;
        self.raw.ref_cnt.store(value, Ordering::Relaxed);
        Ok(())
    }

    #[getter]
    fn chunk_id(&self) -> i64 {
        self.raw.chunk_id.load(Ordering::Relaxed)
    }

    /// Whether the chunk can be read (`ref_cnt >= 0`).
    #[getter]
    fn is_ready(&self) -> bool {
        self.ref_cnt() >= 0
    }

    fn __repr__(&self) -> String {
        format!(
            "ChunkStatus(chunk_id={}, ref_cnt={})",
            self.chunk_id(),
            self.ref_cnt()
        )
    }

    /// Exports the 16-byte record, writable, as one item of [`CHUNK_STATUS_FORMAT`].
    ///
    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let buf = ptr::from_ref(&slf.get().raw).cast_mut().cast();
        // SAFETY: `view` is valid (CPython's contract); `buf` points at 16 bytes inside `slf`,
        // which the view keeps alive through its `obj` reference.
        unsafe { fill_record_view(view, flags, buf, 0, slf.into_any()) };
        Ok(())
    }

    /// Nothing to free: the view points into the object and its format is static.
    ///
    /// # Safety
    /// Called by CPython with the view it got from `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// Fills `view` with `len_items` records (or one 0-d record when `len_items == 0`) at `buf`.
///
/// # Safety
/// `view` must be a valid `Py_buffer` to fill; `buf` must point at
/// `max(1, len_items) * 16` writable bytes that stay valid while `owner` is alive.
pub unsafe fn fill_record_view(
    view: *mut ffi::Py_buffer,
    flags: c_int,
    buf: *mut std::ffi::c_void,
    len_items: usize,
    owner: Bound<'_, PyAny>,
) {
    // SAFETY: the caller passes a valid view; we write every field CPython reads.
    let view = unsafe { &mut *view };
    let count = len_items.max(1);
    view.obj = owner.into_ptr();
    view.buf = buf;
    let items = ffi::Py_ssize_t::try_from(count).expect("a table's records fit in memory");
    view.len = items * ITEM_SIZE;
    view.readonly = 0;
    view.itemsize = ITEM_SIZE;
    view.format = if flags & ffi::PyBUF_FORMAT != 0 {
        CHUNK_STATUS_FORMAT.as_ptr().cast_mut()
    } else {
        ptr::null_mut()
    };
    view.suboffsets = ptr::null_mut();
    view.internal = ptr::null_mut();
    if len_items == 0 {
        // A single record is a 0-d item, as ctypes exports a Structure.
        view.ndim = 0;
        view.shape = ptr::null_mut();
        view.strides = ptr::null_mut();
    } else {
        // `shape` and `strides` must live as long as the view: keep them in a small box owned
        // by the view through `internal` (freed by `release_record_view`).
        let dims = Box::new([items, ITEM_SIZE]);
        let dims = Box::into_raw(dims);
        view.ndim = 1;
        // SAFETY: `dims` is a live allocation of two Py_ssize_t, freed by `release_record_view`.
        unsafe {
            view.shape = (*dims).as_mut_ptr();
            view.strides = (*dims).as_mut_ptr().add(1);
        }
        view.internal = dims.cast();
    }
}

/// Frees what [`fill_record_view`] allocated for a 1-d view.
///
/// # Safety
/// `view` must have been filled by [`fill_record_view`] and not released before.
pub unsafe fn release_record_view(view: *mut ffi::Py_buffer) {
    // SAFETY: the caller passes a view we filled; `internal` is null or our boxed dims.
    unsafe {
        let internal = (*view).internal;
        if !internal.is_null() {
            drop(Box::from_raw(internal.cast::<[ffi::Py_ssize_t; 2]>()));
            (*view).internal = ptr::null_mut();
        }
    }
}

/// A buffer export held for as long as a policy keeps a foreign chunk: the export keeps the
/// object alive and its memory in place (e.g. a `bytearray` cannot resize while exported).
pub struct ForeignChunk {
    /// The object inserted; stored inline so `get()` touches one line less.
    obj: Py<PyAny>,
    /// The export's own reference (`view.obj`): the object inserted, or another one that
    /// owns the memory (a `PickleBuffer`'s `bytearray`, a `memoryview`'s base). Released by
    /// `PyBuffer_Release`, never dropped here.
    exporter: ManuallyDrop<Py<PyAny>>,
    ref_cnt: NonNull<i32>,
    view: Box<ffi::Py_buffer>,
}

// SAFETY: the export is only read (one aligned-or-not i32 load) and released while attached to
// the interpreter; this abi3 extension runs on GIL builds only, so attached threads do not run
// Python code concurrently.
unsafe impl Send for ForeignChunk {}
// SAFETY: as above; `&ForeignChunk` only allows those reads.
unsafe impl Sync for ForeignChunk {}

impl Drop for ForeignChunk {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released once.
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut *self.view) });
    }
}

/// What a policy stores for a chunk: our record, or a foreign object's buffer.
pub enum PyChunk {
    Native(Py<ChunkStatus>),
    Foreign(ForeignChunk),
}

impl HasRefCnt for PyChunk {
    #[inline]
    fn ref_cnt(&self) -> i32 {
        match self {
            PyChunk::Native(c) => c.get().raw.ref_cnt.load(Ordering::Relaxed),
            // SAFETY: `ref_cnt` points at the first 4 bytes of a ≥16-byte buffer whose export we
            // hold, so the memory is alive and in place.
            PyChunk::Foreign(f) => unsafe { f.ref_cnt.as_ptr().read_unaligned() },
        }
    }

    #[inline]
    fn prefetch(&self) {
        match self {
            PyChunk::Native(c) => kvcache_core::prefetch(c.get()),
            // SAFETY: as above, the exported memory is alive; the reference is only used as an
            // address to prefetch.
            PyChunk::Foreign(f) => kvcache_core::prefetch(unsafe { f.ref_cnt.as_ref() }),
        }
    }
}

/// Formats (PEP 3118) a chunk buffer may have besides raw bytes: vLLM's ctypes `ChunkStatus`
/// (ctypes writes no padding) and kvcache's own.
const CHUNK_FORMATS: [&[u8]; 2] = [
    b"T{<i:ref_cnt:<q:chunk_id:}",
    CHUNK_STATUS_FORMAT.to_bytes(),
];

/// Whether a buffer of `itemsize`-byte items in `format` (None: unsigned bytes) is laid out
/// as a chunk record: one of [`CHUNK_FORMATS`] in one 16-byte item, or plain bytes (`B`, `b`,
/// `c`, with any byte-order prefix), taken as the raw record.
fn is_chunk_layout(format: Option<&[u8]>, itemsize: ffi::Py_ssize_t) -> bool {
    let format = format.unwrap_or(b"B");
    if itemsize == ITEM_SIZE && CHUNK_FORMATS.contains(&format) {
        return true;
    }
    let bytes = match format {
        [b'@' | b'=' | b'<' | b'>' | b'!', rest @ ..] => rest,
        f => f,
    };
    itemsize == 1 && matches!(bytes, b"B" | b"b" | b"c")
}

impl PyChunk {
    /// Accepts a `kvcache.ChunkStatus`, or any object exporting exactly 16 contiguous,
    /// writable bytes laid out like vLLM's ctypes `ChunkStatus`: its ctypes format, ours, or
    /// raw bytes (`B`/`b`/`c`) read as that layout. The manager that owns a chunk updates its
    /// `ref_cnt`, so a read-only buffer cannot be a chunk; another layout (fields in another
    /// order, other types) would be misread, so it is refused.
    pub fn from_object(obj: &Bound<'_, PyAny>) -> PyResult<PyChunk> {
        if let Ok(native) = obj.cast::<ChunkStatus>() {
            return Ok(PyChunk::Native(native.clone().unbind()));
        }
        let py = obj.py();
        let invalid = |why: &str| {
            let ty = type_name(obj);
            new_err(
                py,
                &exceptions(py).invalid_chunk,
                format!(
                    "chunk must be kvcache.ChunkStatus or expose a writable 16-byte buffer laid \
                     out as vLLM's ChunkStatus (int32 ref_cnt at offset 0, int64 chunk_id at \
                     offset 8: ctypes format 'T{{<i:ref_cnt:<q:chunk_id:}}', or raw bytes); got \
                     {ty}: {why}"
                ),
            )
        };
        // SAFETY: an all-zero Py_buffer is a valid "empty" value for PyObject_GetBuffer to fill.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: `obj` is a live object and `view` is writable storage for the export.
        let rc = unsafe {
            ffi::PyObject_GetBuffer(
                obj.as_ptr(),
                &mut *view,
                // A format comes with a shape (PEP 3118); no strides: contiguous memory.
                ffi::PyBUF_ND | ffi::PyBUF_WRITABLE | ffi::PyBUF_FORMAT,
            )
        };
        if rc != 0 {
            // Replace the exporter's error with ours, chained for context.
            let cause = PyErr::take(py).map(|e| e.to_string()).unwrap_or_default();
            return Err(invalid(&format!("no writable buffer ({cause})")));
        }
        let (len, itemsize) = (view.len, view.itemsize);
        // SAFETY: a non-null format of a successful export is a NUL-terminated string that
        // lives as long as the export.
        let format = (!view.format.is_null())
            .then(|| unsafe { CStr::from_ptr(view.format) }.to_bytes().to_vec());
        let (Some(ref_cnt), false) = (NonNull::new(view.buf.cast::<i32>()), view.obj.is_null())
        else {
            // SAFETY: the export succeeded; release it exactly once.
            unsafe { ffi::PyBuffer_Release(&mut *view) };
            return Err(invalid("the buffer has no memory or no owner"));
        };
        let chunk = ForeignChunk {
            obj: obj.clone().unbind(),
            // SAFETY: `view.obj` is a live object the export holds a reference to; wrapped
            // without taking one, and never dropped (the export's release gives it back).
            exporter: ManuallyDrop::new(unsafe { Bound::from_owned_ptr(py, view.obj) }.unbind()),
            ref_cnt,
            view,
        };
        if len != ITEM_SIZE {
            drop(chunk);
            return Err(invalid(&format!("buffer is {len} bytes")));
        }
        if !is_chunk_layout(format.as_deref(), itemsize) {
            drop(chunk);
            let format = String::from_utf8_lossy(format.as_deref().unwrap_or(b"B")).into_owned();
            return Err(invalid(&format!(
                "buffer format {format:?} (item size {itemsize}) is another layout"
            )));
        }
        Ok(PyChunk::Foreign(chunk))
    }

    /// The object that was inserted.
    pub fn object<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        match self {
            PyChunk::Native(c) => c.bind(py).clone().into_any(),
            PyChunk::Foreign(f) => f.obj.bind(py).clone(),
        }
    }

    /// Reports the references a policy holds through this chunk to the garbage collector.
    pub fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        match self {
            PyChunk::Native(c) => visit.call(c),
            // Ours to the object inserted, and the export's to its exporter (often the same
            // object, then visited twice: it holds two references to it).
            PyChunk::Foreign(f) => {
                visit.call(&f.obj)?;
                visit.call(&*f.exporter)
            }
        }
    }
}

impl<'py> FromPyObject<'_, 'py> for PyChunk {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        PyChunk::from_object(&obj)
    }
}
