//! `_core.CudaApi`: the CUDA runtime and driver entry points kvcache calls, resolved by name
//! (`dlopen` + `dlsym`) in the libraries the caller names.
//!
//! Why here and not through addresses handed over from Python: an address is a raw pointer a
//! caller could make up, and calling it is undefined behaviour. A library path is resolved
//! by the loader, and every symbol is then typed once, below, with CUDA's C signature; every
//! other module (registration, the DMA queues, batched copies) takes a [`CudaApi`] and can no
//! longer be handed a function pointer.
//!
//! Why `dlopen` of a path rather than linking CUDA: the process already has exactly one CUDA
//! runtime loaded (torch's), whose per-thread error state and contexts kvcache must share;
//! `dlopen` of that same file returns that same instance. Tests name a fake runtime built
//! from `tests/fakecuda/` instead, and so go through these very declarations. The handles are
//! never closed: unloading a CUDA runtime that streams may still use is undefined.
//!
//! A library that exports CUDA's names with other signatures is undefined behaviour, as with
//! ctypes: kvcache names only the runtime torch loaded and `libcuda.so.1`.

use std::ffi::{c_char, c_float, c_int, c_uint, c_void, CStr, CString};
use std::sync::Arc;

use pyo3::prelude::*;

use crate::errors::typed;

pub(crate) type Event = *mut c_void;
pub(crate) type Stream = *mut c_void;

pub(crate) type RegisterFn = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> c_int;
pub(crate) type UnregisterFn = unsafe extern "C" fn(*mut c_void) -> c_int;
pub(crate) type NoArgFn = unsafe extern "C" fn() -> c_int;
pub(crate) type SetDeviceFn = unsafe extern "C" fn(c_int) -> c_int;
pub(crate) type GetDeviceFn = unsafe extern "C" fn(*mut c_int) -> c_int;
pub(crate) type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
pub(crate) type EventCreateFn = unsafe extern "C" fn(*mut Event, c_uint) -> c_int;
pub(crate) type EventFn = unsafe extern "C" fn(Event) -> c_int;
pub(crate) type EventRecordFn = unsafe extern "C" fn(Event, Stream) -> c_int;
pub(crate) type ElapsedFn = unsafe extern "C" fn(*mut c_float, Event, Event) -> c_int;
pub(crate) type StreamWaitFn = unsafe extern "C" fn(Stream, Event, c_uint) -> c_int;
pub(crate) type StreamFn = unsafe extern "C" fn(Stream) -> c_int;
pub(crate) type MemcpyAsyncFn =
    unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, Stream) -> c_int;
pub(crate) type HostDevicePointerFn =
    unsafe extern "C" fn(*mut *mut c_void, *mut c_void, c_uint) -> c_int;
type DriverErrorStringFn = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MemLocation {
    pub kind: c_int,
    pub id: c_int,
}

/// `CUmemcpyAttributes` (CUDA 12.8+): source access order, location hints, flags.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MemcpyAttributes {
    pub src_access_order: c_int,
    pub src_loc_hint: MemLocation,
    pub dst_loc_hint: MemLocation,
    pub flags: c_uint,
}

/// `cuMemcpyBatchAsync` as exported by 12.8+ drivers (with `failIdx`).
pub(crate) type BatchFn = unsafe extern "C" fn(
    *const u64,
    *const u64,
    *const usize,
    usize,
    *const MemcpyAttributes,
    *const usize,
    usize,
    *mut usize,
    Stream,
) -> c_int;

/// `cuMemcpyBatchAsync_v2` (CUDA 13 drivers): the same without `failIdx`.
pub(crate) type BatchV2Fn = unsafe extern "C" fn(
    *const u64,
    *const u64,
    *const usize,
    usize,
    *const MemcpyAttributes,
    *const usize,
    usize,
    Stream,
) -> c_int;

/// The driver's batched copy, in whichever form the driver exports.
#[derive(Clone, Copy)]
pub(crate) enum Batch {
    WithFailIdx(BatchFn),
    V2(BatchV2Fn),
}

/// Errors after which CUDA's context is unusable for the whole process ("sticky"): every
/// later call fails with the same code, and nothing run on the device can be trusted.
/// (cudaErrorIllegalAddress, LaunchTimeout, HardwareStackError, IllegalInstruction,
/// MisalignedAddress, InvalidAddressSpace, InvalidPc, LaunchFailure.)
pub(crate) fn is_sticky(code: c_int) -> bool {
    matches!(code, 700 | 702 | 714..=719)
}

/// Every entry point kvcache uses, typed.
pub(crate) struct CudaApi {
    pub host_register: RegisterFn,
    pub host_unregister: UnregisterFn,
    pub host_get_device_pointer: HostDevicePointerFn,
    pub get_last_error: NoArgFn,
    pub get_error_string: ErrorStringFn,
    pub set_device: SetDeviceFn,
    pub get_device: GetDeviceFn,
    pub event_create: EventCreateFn,
    pub event_destroy: EventFn,
    pub event_record: EventRecordFn,
    pub event_query: EventFn,
    pub event_synchronize: EventFn,
    pub event_elapsed: ElapsedFn,
    pub stream_wait_event: StreamWaitFn,
    pub stream_synchronize: StreamFn,
    pub memcpy_async: MemcpyAsyncFn,
    pub batch: Option<Batch>,
    driver_error_string: Option<DriverErrorStringFn>,
    runtime_path: String,
    driver_path: Option<String>,
}

// SAFETY: plain function pointers into the CUDA runtime and driver, which are thread-safe.
unsafe impl Send for CudaApi {}
// SAFETY: as above; nothing in the struct is mutated after construction.
unsafe impl Sync for CudaApi {}

/// A loaded library handle (never closed, see the module docs).
struct Library {
    handle: *mut c_void,
    path: String,
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by the loader, valid
    // until the next dl* call on this thread; it is copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown loader error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

impl Library {
    fn open(path: &str) -> PyResult<Library> {
        // No path the system can open is longer (ENAMETOOLONG), and glibc's `dlopen` copies
        // the name onto the stack: a name of megabytes overflows it (SIGSEGV).
        if path.len() >= PATH_MAX {
            return Err(typed(
                |e| &e.invalid_argument,
                format!(
                    "a library path may be at most {} bytes, got {}",
                    PATH_MAX - 1,
                    path.len()
                ),
            ));
        }
        let name = CString::new(path).map_err(|_| {
            typed(
                |e| &e.invalid_argument,
                "a library path may not contain NUL bytes",
            )
        })?;
        // SAFETY: a NUL-terminated path; loading runs the library's initialisers, as loading
        // it with ctypes would. The handle is kept for the life of the process.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(typed(
                |e| &e.transfer,
                format!("cannot load {path}: {}", dl_error()),
            ));
        }
        Ok(Library {
            handle,
            path: path.into(),
        })
    }

    /// The address of `name`, or None when the library does not export it.
    fn symbol(&self, name: &str) -> Option<usize> {
        let c = CString::new(name).ok()?;
        // SAFETY: a live handle (never closed) and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        (!p.is_null()).then(|| p.expose_provenance())
    }

    fn require(&self, name: &str) -> PyResult<usize> {
        self.symbol(name).ok_or_else(|| {
            typed(
                |e| &e.transfer,
                format!("{} does not export {name}", self.path),
            )
        })
    }
}

/// Types an address found by `dlsym` as the named CUDA function.
macro_rules! typed_fn {
    ($lib:expr, $name:literal, $ty:ty) => {{
        let a = $lib.require($name)?;
        // SAFETY: `a` is the address the loader gives for the CUDA function `$name`, whose C
        // signature is `$ty` (see the module docs for libraries that lie about it).
        unsafe { std::mem::transmute::<usize, $ty>(a) }
    }};
}

impl CudaApi {
    /// Resolves the runtime's entry points in `runtime_path` and the batched copy in
    /// `driver_path` (none: one `cudaMemcpyAsync` per run). `batch=false` ignores the
    /// driver's batched copy even where it exists.
    fn load(runtime_path: &str, driver_path: Option<&str>, batch: bool) -> PyResult<CudaApi> {
        let rt = Library::open(runtime_path)?;
        let driver = driver_path.map(Library::open).transpose()?;
        let mut found = None;
        let mut error_string = None;
        if let Some(d) = &driver {
            if let Some(a) = d.symbol("cuGetErrorString") {
                // SAFETY: cuGetErrorString(CUresult, const char **) -> CUresult.
                error_string =
                    Some(unsafe { std::mem::transmute::<usize, DriverErrorStringFn>(a) });
            }
            // The original export (with failIdx) first: 12.8+ and 13.x drivers both have it.
            if let Some(a) = d.symbol("cuMemcpyBatchAsync") {
                // SAFETY: the 12.8+ signature, `BatchFn`.
                found = Some(Batch::WithFailIdx(unsafe {
                    std::mem::transmute::<usize, BatchFn>(a)
                }));
            } else if let Some(a) = d.symbol("cuMemcpyBatchAsync_v2") {
                // SAFETY: the CUDA 13 signature, `BatchV2Fn`.
                found = Some(Batch::V2(unsafe {
                    std::mem::transmute::<usize, BatchV2Fn>(a)
                }));
            }
        }
        Ok(CudaApi {
            host_register: typed_fn!(rt, "cudaHostRegister", RegisterFn),
            host_unregister: typed_fn!(rt, "cudaHostUnregister", UnregisterFn),
            host_get_device_pointer: typed_fn!(rt, "cudaHostGetDevicePointer", HostDevicePointerFn),
            get_last_error: typed_fn!(rt, "cudaGetLastError", NoArgFn),
            get_error_string: typed_fn!(rt, "cudaGetErrorString", ErrorStringFn),
            set_device: typed_fn!(rt, "cudaSetDevice", SetDeviceFn),
            get_device: typed_fn!(rt, "cudaGetDevice", GetDeviceFn),
            event_create: typed_fn!(rt, "cudaEventCreateWithFlags", EventCreateFn),
            event_destroy: typed_fn!(rt, "cudaEventDestroy", EventFn),
            event_record: typed_fn!(rt, "cudaEventRecord", EventRecordFn),
            event_query: typed_fn!(rt, "cudaEventQuery", EventFn),
            event_synchronize: typed_fn!(rt, "cudaEventSynchronize", EventFn),
            event_elapsed: typed_fn!(rt, "cudaEventElapsedTime", ElapsedFn),
            stream_wait_event: typed_fn!(rt, "cudaStreamWaitEvent", StreamWaitFn),
            stream_synchronize: typed_fn!(rt, "cudaStreamSynchronize", StreamFn),
            memcpy_async: typed_fn!(rt, "cudaMemcpyAsync", MemcpyAsyncFn),
            batch: if batch { found } else { None },
            driver_error_string: error_string,
            runtime_path: rt.path,
            driver_path: driver.map(|d| d.path),
        })
    }

    /// Reads and clears the calling thread's last runtime error.
    pub(crate) fn clear_error(&self) -> c_int {
        // SAFETY: cudaGetLastError takes no arguments.
        unsafe { (self.get_last_error)() }
    }

    /// The runtime's name for `code`.
    pub(crate) fn error_name(&self, code: c_int) -> String {
        // SAFETY: cudaGetErrorString returns NULL or a static NUL-terminated string.
        let p = unsafe { (self.get_error_string)(code) };
        if p.is_null() {
            format!("CUDA error {code}")
        } else {
            // SAFETY: non-null, static, NUL-terminated.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    /// Clears the calling thread's last error and says what failed: `"{what} failed: {name}
    /// ({code})"`.
    pub(crate) fn describe(&self, what: &str, code: c_int) -> String {
        self.clear_error();
        format!("{what} failed: {} ({code})", self.error_name(code))
    }

    /// The driver's name for a `CUresult`.
    pub(crate) fn driver_error_name(&self, code: c_int) -> String {
        let Some(f) = self.driver_error_string else {
            return format!("CUDA driver error {code}");
        };
        let mut out: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString writes a static string's address into `out`.
        let rc = unsafe { f(code, &mut out) };
        if rc != 0 || out.is_null() {
            return format!("CUDA driver error {code}");
        }
        // SAFETY: non-null, static, NUL-terminated.
        unsafe { CStr::from_ptr(out) }
            .to_string_lossy()
            .into_owned()
    }

    /// The calling thread's current device.
    pub(crate) fn current_device(&self) -> Result<c_int, c_int> {
        let mut d: c_int = 0;
        // SAFETY: cudaGetDevice writes one int.
        match unsafe { (self.get_device)(&mut d) } {
            0 => Ok(d),
            rc => Err(rc),
        }
    }

    /// Makes `device` current on this thread for the guard's life, then restores the device
    /// the thread had (CUDA's current device is per thread; a caller's must not change).
    pub(crate) fn on_device(&self, device: c_int) -> Result<DeviceGuard<'_>, String> {
        self.bind(device)
            .map_err(|(what, code)| self.describe(what, code))
    }

    /// [`Self::on_device`], failing with the call and its code.
    pub(crate) fn bind(&self, device: c_int) -> Result<DeviceGuard<'_>, (&'static str, c_int)> {
        let before = self.current_device().map_err(|rc| ("cudaGetDevice", rc))?;
        if before != device {
            // SAFETY: cudaSetDevice takes a device ordinal.
            let rc = unsafe { (self.set_device)(device) };
            if rc != 0 {
                return Err(("cudaSetDevice", rc));
            }
        }
        Ok(DeviceGuard {
            api: self,
            restore: (before != device).then_some(before),
        })
    }
}

/// See [`CudaApi::on_device`].
pub(crate) struct DeviceGuard<'a> {
    api: &'a CudaApi,
    restore: Option<c_int>,
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        if let Some(d) = self.restore {
            // SAFETY: cudaSetDevice takes a device ordinal (the one the thread had).
            if unsafe { (self.api.set_device)(d) } != 0 {
                self.api.clear_error();
            }
        }
    }
}

/// The CUDA runtime (and driver) kvcache's copies go through; see the module docs.
#[pyclass(module = "kvcache._core", name = "CudaApi", frozen)]
pub struct PyCudaApi {
    pub(crate) api: Arc<CudaApi>,
}

#[pymethods]
impl PyCudaApi {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    /// Loads `runtime` (a path or soname of `libcudart`) and, when given, `driver`
    /// (`libcuda`), and resolves every entry point kvcache uses; `TransferError` when a
    /// library cannot be loaded or lacks a runtime function. The driver's batched copy is
    /// optional (none, or `batch=False`: one `cudaMemcpyAsync` per run).
    #[new]
    #[pyo3(signature = (runtime, driver=None, *, batch=true))]
    fn new(
        #[pyo3(from_py_with = runtime_arg)] runtime: String,
        #[pyo3(from_py_with = driver_arg)] driver: Option<String>,
        #[pyo3(from_py_with = batch_arg)] batch: bool,
    ) -> PyResult<Self> {
        Ok(PyCudaApi {
            api: Arc::new(CudaApi::load(&runtime, driver.as_deref(), batch)?),
        })
    }

    #[getter]
    fn runtime_path(&self) -> &str {
        &self.api.runtime_path
    }

    #[getter]
    fn driver_path(&self) -> Option<&str> {
        self.api.driver_path.as_deref()
    }

    /// Whether the driver's batched copy (`cuMemcpyBatchAsync`) is in use.
    #[getter]
    fn batched(&self) -> bool {
        self.api.batch.is_some()
    }

    /// Reads and clears the calling thread's last CUDA error; returns it.
    fn clear_error(&self) -> i32 {
        self.api.clear_error()
    }

    /// The runtime's name for an error code.
    fn error_string(&self, code: i32) -> String {
        self.api.error_name(code)
    }

    /// The driver's name for a `CUresult`.
    fn driver_error_string(&self, code: i32) -> String {
        self.api.driver_error_name(code)
    }

    /// Whether `code` leaves the CUDA context unusable for the whole process.
    #[staticmethod]
    fn is_sticky(code: i32) -> bool {
        is_sticky(code)
    }

    /// The calling thread's current device.
    fn current_device(&self) -> PyResult<i32> {
        self.api
            .current_device()
            .map_err(|rc| typed(|e| &e.transfer, self.api.describe("cudaGetDevice", rc)))
    }

    /// The device address of registered host memory at `host_address`, or None (its error
    /// cleared). CUDA looks the address up in its registrations; it is not dereferenced.
    /// `device`: made current for the call (the caller's is restored).
    #[pyo3(signature = (host_address, device=None))]
    fn device_pointer(&self, host_address: usize, device: Option<i32>) -> Option<usize> {
        let _bound = device.map(|d| self.api.on_device(d));
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: cudaHostGetDevicePointer writes one pointer into `out`; the host address is
        // only looked up, never dereferenced.
        let rc = unsafe {
            (self.api.host_get_device_pointer)(
                &mut out,
                std::ptr::with_exposed_provenance_mut(host_address),
                0,
            )
        };
        if rc != 0 {
            self.api.clear_error();
            return None;
        }
        Some(out.expose_provenance())
    }
}

/// The longest path the system opens, terminating NUL included (Linux's `PATH_MAX`).
const PATH_MAX: usize = 4096;

fn runtime_arg(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    crate::conversion::text(obj, "runtime")
}

fn driver_arg(obj: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    if obj.is_none() {
        return Ok(None);
    }
    crate::conversion::text(obj, "driver").map(Some)
}

fn batch_arg(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    obj.extract::<crate::conversion::Flag>().map(|f| f.0)
}
