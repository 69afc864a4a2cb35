//! `cudaHostRegister`/`cudaHostUnregister`/`cudaGetLastError` (and optionally `cudaSetDevice`),
//! called through raw function addresses the Python layer found in the loaded runtime.
//!
//! Why addresses and not linking or `dlopen` here: the process already has exactly one CUDA
//! runtime loaded (torch's), whose per-thread error state and contexts we must share. The same
//! mechanism lets the tests pass ctypes callbacks that imitate failures. A wrong address is
//! undefined behaviour, exactly as with ctypes itself: these entry points are private API.

use std::ffi::{c_int, c_uint, c_void};

use kvcache_core::host::HostRegistrar;
use pyo3::prelude::*;

use crate::errors::typed;

type RegisterFn = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> c_int;
type UnregisterFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type GetLastErrorFn = unsafe extern "C" fn() -> c_int;
type SetDeviceFn = unsafe extern "C" fn(c_int) -> c_int;

/// Refuses a NULL function address with a typed error.
pub(crate) fn nonzero(addr: usize, what: &str) -> PyResult<usize> {
    if addr == 0 {
        Err(typed(
            |e| &e.invalid_argument,
            format!("{what}: NULL function address"),
        ))
    } else {
        Ok(addr)
    }
}

/// The function addresses of one registrar (see [`CudartRegistrar::new`]).
pub(crate) struct RuntimeFns {
    pub register: usize,
    pub unregister: usize,
    pub get_last_error: usize,
    /// `cudaSetDevice`, or 0 to leave the thread's device alone.
    pub set_device: usize,
    pub device: i32,
}

pub(crate) struct CudartRegistrar {
    register: RegisterFn,
    unregister: UnregisterFn,
    get_last_error: GetLastErrorFn,
    set_device: Option<(SetDeviceFn, c_int)>,
    flags: c_uint,
    /// Keeps the library (or the test's callback objects) alive while the functions may run.
    keepalive: Option<Py<PyAny>>,
}

impl CudartRegistrar {
    pub(crate) fn new(fns: &RuntimeFns, flags: u32, keepalive: Py<PyAny>) -> PyResult<Self> {
        let (r, u, e) = (
            nonzero(fns.register, "register")?,
            nonzero(fns.unregister, "unregister")?,
            nonzero(fns.get_last_error, "get_last_error")?,
        );
        // SAFETY: non-null addresses that the (private) caller contract says are the named
        // CUDA runtime functions, whose C signatures match these types. Converting an address
        // to a function pointer is only possible through transmute.
        unsafe {
            Ok(CudartRegistrar {
                register: std::mem::transmute::<usize, RegisterFn>(r),
                unregister: std::mem::transmute::<usize, UnregisterFn>(u),
                get_last_error: std::mem::transmute::<usize, GetLastErrorFn>(e),
                set_device: (fns.set_device != 0).then(|| {
                    (
                        std::mem::transmute::<usize, SetDeviceFn>(fns.set_device),
                        fns.device,
                    )
                }),
                flags,
                keepalive: Some(keepalive),
            })
        }
    }
}

impl Drop for CudartRegistrar {
    fn drop(&mut self) {
        // A failed registration drops the registrar while the GIL is released (or on the
        // pinning thread); give the reference back with the interpreter attached rather than
        // deferring it. After interpreter shutdown there is nothing to release it to: leak it.
        let mut slot = self.keepalive.take();
        if Python::try_attach(|_| drop(slot.take())).is_none() {
            std::mem::forget(slot.take());
        }
    }
}

fn check(rc: c_int) -> Result<(), i32> {
    if rc == 0 {
        Ok(())
    } else {
        Err(rc)
    }
}

impl HostRegistrar for CudartRegistrar {
    fn register(&mut self, addr: usize, len: usize) -> Result<(), i32> {
        // SAFETY: `register` is cudaHostRegister (see `new`); the range is a live mapping
        // owned by the region that calls us.
        check(unsafe {
            (self.register)(std::ptr::with_exposed_provenance_mut(addr), len, self.flags)
        })
    }

    fn unregister(&mut self, addr: usize) -> Result<(), i32> {
        // SAFETY: `unregister` is cudaHostUnregister and `addr` a range registered above.
        check(unsafe { (self.unregister)(std::ptr::with_exposed_provenance_mut(addr)) })
    }

    fn clear_error(&mut self) {
        // SAFETY: `get_last_error` is cudaGetLastError, which takes no arguments.
        unsafe {
            (self.get_last_error)();
        }
    }

    fn bind_thread(&mut self) -> Result<(), i32> {
        match self.set_device {
            // SAFETY: `f` is cudaSetDevice, taking a device ordinal.
            Some((f, device)) => check(unsafe { f(device) }),
            None => Ok(()),
        }
    }
}
