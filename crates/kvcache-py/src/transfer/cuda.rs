//! DMA submission of a plan's runs through CUDA entry points supplied by the Python layer:
//! one `cudaMemcpyAsync` per run, or one `cuMemcpyBatchAsync` for the whole plan (CUDA 12.8+
//! drivers; resolved at run time, the per-run path is the fallback). Both run with the GIL
//! released and hold the pool's copy guard, so no copy overlaps the registration of the
//! range it touches (background pinning). Private API: a wrong address is undefined
//! behaviour, as with ctypes.

use std::ffi::{c_int, c_uint, c_void};

use kvcache_core::host::CopyRuns;
use pyo3::prelude::*;

use super::plan::Plan;
use super::registrar::nonzero;
use crate::errors::typed;

/// `cudaMemcpyAsync(dst, src, count, kind, stream)`.
pub(super) type MemcpyAsyncFn =
    unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, *mut c_void) -> c_int;

/// Why [`memcpy_each_run`] stopped at run `index`.
pub(super) enum RunFailure {
    /// An address or length this process cannot hold.
    Unaddressable { index: usize },
    /// `cudaMemcpyAsync` returned `code`.
    Cuda { index: usize, code: c_int },
}

/// One `cudaMemcpyAsync(dst, src, len, kind, stream)` per run, in order, stopping at the first
/// failure.
///
/// # Safety
/// `memcpy` must be `cudaMemcpyAsync`, and every run must lie in memory that stays valid until
/// the stream has executed the copies.
pub(super) unsafe fn memcpy_each_run(
    runs: &CopyRuns,
    memcpy: MemcpyAsyncFn,
    kind: c_int,
    stream: *mut c_void,
) -> Result<(), RunFailure> {
    for (index, ((&src, &dst), &len)) in runs
        .src()
        .iter()
        .zip(runs.dst())
        .zip(runs.lens())
        .enumerate()
    {
        let (Ok(src), Ok(dst), Ok(len)) = (
            usize::try_from(src),
            usize::try_from(dst),
            usize::try_from(len),
        ) else {
            return Err(RunFailure::Unaddressable { index });
        };
        // SAFETY: the caller passes cudaMemcpyAsync and runs inside live memory (see above).
        let code = unsafe {
            memcpy(
                std::ptr::with_exposed_provenance_mut(dst),
                std::ptr::with_exposed_provenance(src),
                len,
                kind,
                stream,
            )
        };
        if code != 0 {
            return Err(RunFailure::Cuda { index, code });
        }
    }
    Ok(())
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MemLocation {
    kind: c_int,
    id: c_int,
}

/// `CUmemcpyAttributes` (CUDA 12.8+): source access order, location hints, flags.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MemcpyAttributes {
    src_access_order: c_int,
    src_loc_hint: MemLocation,
    dst_loc_hint: MemLocation,
    flags: c_uint,
}

/// `cuMemcpyBatchAsync` as exported by 12.8+ drivers (with `failIdx`).
type BatchFn = unsafe extern "C" fn(
    *const u64,
    *const u64,
    *const usize,
    usize,
    *const MemcpyAttributes,
    *const usize,
    usize,
    *mut usize,
    *mut c_void,
) -> c_int;

/// `cuMemcpyBatchAsync_v2` (CUDA 13 drivers): the same without `failIdx`.
type BatchV2Fn = unsafe extern "C" fn(
    *const u64,
    *const u64,
    *const usize,
    usize,
    *const MemcpyAttributes,
    *const usize,
    usize,
    *mut c_void,
) -> c_int;

fn stream_ptr(stream: usize) -> *mut c_void {
    std::ptr::with_exposed_provenance_mut(stream)
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
        let _guard = data.copy_guard();
        let runs = data.runs();
        // SAFETY: `memcpy` is cudaMemcpyAsync (above); the plan's runs lie inside the pool and
        // the device layers it was validated against; the plan (held by `data`) keeps the pool
        // mapped, and the caller keeps the device tensors alive until the stream has executed
        // the copies.
        match unsafe { memcpy_each_run(runs, memcpy, kind, stream_ptr(stream)) } {
            Ok(()) => (runs.len(), 0),
            // cudaErrorInvalidValue: an address this process cannot hold.
            Err(RunFailure::Unaddressable { index }) => (index, 1),
            Err(RunFailure::Cuda { index, code }) => (index, code),
        }
    }))
}

/// Enqueues every run of `plan` with one batched call on `stream`. `batch_fn` is
/// `cuMemcpyBatchAsync` (`v2=False`, with `failIdx`) or `cuMemcpyBatchAsync_v2` (`v2=True`).
/// `src_access_order` is `CUmemcpySrcAccessOrder` (1: stream order, for sources the device
/// may still be writing; 3: any, for host sources nobody writes meanwhile). Returns
/// `(CUresult, index of the failing copy or -1)`.
#[pyfunction]
#[pyo3(name = "_cuda_memcpy_batch", signature = (plan, batch_fn, stream, src_access_order, *, v2=false))]
pub(crate) fn cuda_memcpy_batch(
    py: Python<'_>,
    plan: &Bound<'_, Plan>,
    batch_fn: usize,
    stream: usize,
    src_access_order: i32,
    v2: bool,
) -> PyResult<(i32, i64)> {
    let f = nonzero(batch_fn, "memcpy_batch")?;
    if !(1..=3).contains(&src_access_order) {
        return Err(typed(
            |e| &e.invalid_argument,
            format!("src_access_order must be 1, 2 or 3, got {src_access_order}"),
        ));
    }
    let data = plan.get().data();
    Ok(py.detach(move || {
        let _guard = data.copy_guard();
        batch_copy(data.runs(), f, v2, stream, src_access_order)
    }))
}

/// One batched call for every run of `runs` on `stream` (see [`cuda_memcpy_batch`]); the
/// caller holds the pool's copy guard and keeps the runs' memory alive.
pub(crate) fn batch_copy(
    runs: &CopyRuns,
    f: usize,
    v2: bool,
    stream: usize,
    src_access_order: i32,
) -> (i32, i64) {
    let count = runs.len();
    if count == 0 {
        return (0, -1);
    }
    // `size_t` lengths: a u64 slice reinterpreted only where usize is 64 bits wide; other
    // targets get a converted copy.
    let converted: Vec<usize>;
    let sizes: &[usize] = if usize::BITS == 64 {
        // SAFETY: on this target usize and u64 have the same size, alignment and validity,
        // and the slice is only read.
        unsafe { std::slice::from_raw_parts(runs.lens().as_ptr().cast::<usize>(), count) }
    } else {
        converted = runs
            .lens()
            .iter()
            .map(|&l| usize::try_from(l).unwrap_or(usize::MAX))
            .collect();
        &converted
    };
    let attrs = MemcpyAttributes {
        src_access_order,
        ..MemcpyAttributes::default()
    };
    let first: usize = 0;
    let mut fail_idx = usize::MAX;
    let rc = if v2 {
        // SAFETY: per the private caller contract `f` is cuMemcpyBatchAsync_v2; the three
        // arrays hold `count` entries and stay alive for the call, which reads them before
        // returning; the copies themselves target memory the plan was validated against.
        unsafe {
            let call = std::mem::transmute::<usize, BatchV2Fn>(f);
            call(
                runs.dst().as_ptr(),
                runs.src().as_ptr(),
                sizes.as_ptr(),
                count,
                &attrs,
                &first,
                1,
                stream_ptr(stream),
            )
        }
    } else {
        // SAFETY: as above, for cuMemcpyBatchAsync (which also writes `fail_idx`).
        unsafe {
            let call = std::mem::transmute::<usize, BatchFn>(f);
            call(
                runs.dst().as_ptr(),
                runs.src().as_ptr(),
                sizes.as_ptr(),
                count,
                &attrs,
                &first,
                1,
                &mut fail_idx,
                stream_ptr(stream),
            )
        }
    };
    let failed_at = if rc != 0 && fail_idx < count {
        i64::try_from(fail_idx).unwrap_or(-1)
    } else {
        -1
    };
    (rc, failed_at)
}
