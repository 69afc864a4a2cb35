//! `cudaHostRegister`/`cudaHostUnregister`/`cudaGetLastError` through a [`CudaApi`], as the
//! core's [`HostRegistrar`]. With a device, every call runs with that device current (the
//! registering thread binds it once; an unregistration from `close()` on the caller's thread
//! binds it for the call and restores the caller's), so a rank never touches another GPU.

use std::ffi::c_uint;
use std::sync::Arc;

use kvcache_core::host::HostRegistrar;

use super::api::CudaApi;

pub(crate) struct CudartRegistrar {
    api: Arc<CudaApi>,
    /// The device a registering thread binds first (None: leave the thread's device alone).
    device: Option<i32>,
    flags: c_uint,
}

impl CudartRegistrar {
    pub(crate) fn new(api: Arc<CudaApi>, flags: u32, device: Option<i32>) -> Self {
        CudartRegistrar { api, device, flags }
    }
}

fn check(rc: i32) -> Result<(), i32> {
    if rc == 0 {
        Ok(())
    } else {
        Err(rc)
    }
}

impl HostRegistrar for CudartRegistrar {
    fn register(&mut self, addr: usize, len: usize) -> Result<(), i32> {
        let _bound = self.device.map(|d| self.api.on_device(d));
        // SAFETY: cudaHostRegister(ptr, size, flags); the range is a live mapping owned by the
        // region that calls us.
        check(unsafe {
            (self.api.host_register)(std::ptr::with_exposed_provenance_mut(addr), len, self.flags)
        })
    }

    fn unregister(&mut self, addr: usize) -> Result<(), i32> {
        let _bound = self.device.map(|d| self.api.on_device(d));
        // SAFETY: cudaHostUnregister of a range registered above.
        check(unsafe { (self.api.host_unregister)(std::ptr::with_exposed_provenance_mut(addr)) })
    }

    fn clear_error(&mut self) {
        self.api.clear_error();
    }

    fn bind_thread(&mut self) -> Result<(), i32> {
        match self.device {
            // SAFETY: cudaSetDevice takes a device ordinal.
            Some(device) => check(unsafe { (self.api.set_device)(device) }),
            None => Ok(()),
        }
    }
}
