//! Calls into the CUDA runtime through function addresses supplied by the Python layer.
//!
//! Why addresses and not linking or `dlopen` here: the process already has exactly one CUDA
//! runtime loaded (torch's), whose per-thread error state and contexts we must share; the
//! Python side finds it (ctypes over the path in `/proc/self/maps`) and hands us its entry
//! points. The same mechanism lets the tests pass ctypes callbacks that imitate failures.
//! These functions are private API (`_`-prefixed in Python): a wrong address is undefined
//! behaviour, exactly as with ctypes itself.

use std::ffi::{c_int, c_uint, c_void};

use kvcache_core::host::HostRegistrar;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::plan::Plan;

type RegisterFn = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> c_int;
type UnregisterFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type GetLastErrorFn = unsafe extern "C" fn() -> c_int;
type MemcpyAsyncFn =
    unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, *mut c_void) -> c_int;

fn nonzero(addr: usize, what: &str) -> PyResult<usize> {
    if addr == 0 {
        Err(PyValueError::new_err(format!(
            "{what}: NULL function address"
        )))
    } else {
        Ok(addr)
    }
}

/// `cudaHostRegister`/`cudaHostUnregister`/`cudaGetLastError`, called through raw addresses.
pub(crate) struct CudartRegistrar {
    register: RegisterFn,
    unregister: UnregisterFn,
    get_last_error: GetLastErrorFn,
    flags: c_uint,
    /// Keeps the library (or the test's callback objects) alive while the functions may run.
    keepalive: Option<Py<PyAny>>,
}

impl CudartRegistrar {
    pub(crate) fn new(
        register: usize,
        unregister: usize,
        get_last_error: usize,
        flags: u32,
        keepalive: Py<PyAny>,
    ) -> PyResult<Self> {
        let (r, u, e) = (
            nonzero(register, "register")?,
            nonzero(unregister, "unregister")?,
            nonzero(get_last_error, "get_last_error")?,
        );
        // SAFETY: non-null addresses that the (private) caller contract says are the named
        // CUDA runtime functions, whose C signatures match these types. Converting an address
        // to a function pointer is only possible through transmute.
        unsafe {
            Ok(CudartRegistrar {
                register: std::mem::transmute::<usize, RegisterFn>(r),
                unregister: std::mem::transmute::<usize, UnregisterFn>(u),
                get_last_error: std::mem::transmute::<usize, GetLastErrorFn>(e),
                flags,
                keepalive: Some(keepalive),
            })
        }
    }
}

impl Drop for CudartRegistrar {
    fn drop(&mut self) {
        // A failed registration drops the registrar while the GIL is released; give the
        // reference back with the interpreter attached rather than deferring it. (After
        // interpreter shutdown there is nothing left to release it to: leak it.)
        let mut slot = self.keepalive.take();
        if Python::try_attach(|_| drop(slot.take())).is_none() {
            std::mem::forget(slot.take());
        }
    }
}

impl HostRegistrar for CudartRegistrar {
    fn register(&mut self, addr: usize, len: usize) -> Result<(), i32> {
        // SAFETY: `register` is cudaHostRegister (see `new`); the range is a live mapping
        // owned by the region that calls us.
        let rc = unsafe { (self.register)(addr as *mut c_void, len, self.flags) };
        if rc == 0 {
            Ok(())
        } else {
            Err(rc)
        }
    }

    fn unregister(&mut self, addr: usize) -> Result<(), i32> {
        // SAFETY: `unregister` is cudaHostUnregister and `addr` a range registered above.
        let rc = unsafe { (self.unregister)(addr as *mut c_void) };
        if rc == 0 {
            Ok(())
        } else {
            Err(rc)
        }
    }

    fn clear_error(&mut self) {
        // SAFETY: `get_last_error` is cudaGetLastError, which takes no arguments.
        unsafe {
            (self.get_last_error)();
        }
    }
}

/// Enqueues one `cudaMemcpyAsync(dst, src, len, kind, stream)` per run of `plan`, with the GIL
/// released. Stops at the first failure. Returns `(runs enqueued, error code or 0)`; the
/// caller clears the runtime's last error and reports the job as failed.
#[pyfunction]
#[pyo3(name = "_cuda_memcpy_runs")]
pub(crate) fn cuda_memcpy_runs(
    py: Python<'_>,
    plan: &Bound<'_, Plan>,
    memcpy_async_fn: usize,
    stream: usize,
    kind: i32,
) -> PyResult<(usize, i32)> {
    let f = nonzero(memcpy_async_fn, "memcpy_async")?;
    // SAFETY: per the private caller contract, `f` is cudaMemcpyAsync, whose C signature is
    // `MemcpyAsyncFn`.
    let memcpy = unsafe { std::mem::transmute::<usize, MemcpyAsyncFn>(f) };
    let data = plan.get().data();
    Ok(py.detach(move || {
        let runs = data.runs();
        for (i, ((&src, &dst), &len)) in runs
            .src()
            .iter()
            .zip(runs.dst())
            .zip(runs.lens())
            .enumerate()
        {
            // SAFETY: the plan's runs lie inside the registered pool and the device layers it
            // was validated against; the plan (held by `data`) keeps the pool mapped, and the
            // caller keeps the device tensors alive until the stream has executed the copies.
            let rc = unsafe {
                memcpy(
                    dst as usize as *mut c_void,
                    src as usize as *const c_void,
                    len as usize,
                    kind,
                    stream as *mut c_void,
                )
            };
            if rc != 0 {
                return (i, rc);
            }
        }
        (runs.len(), 0)
    }))
}
