//! DMA submission of a plan's runs through a [`CudaApi`]: one `cudaMemcpyAsync` per run, or one
//! `cuMemcpyBatchAsync` for the whole plan (CUDA 12.8+ drivers). The caller holds the pool's
//! copy guard, so no copy overlaps the registration of the range it touches (background
//! pinning), and keeps the runs' memory alive until the stream has executed them.

use std::ffi::c_int;

use kvcache_core::host::CopyRuns;

use super::api::{Batch, CudaApi, MemcpyAttributes, Stream};

/// cudaMemcpyDefault: the direction follows from unified virtual addresses.
pub(crate) const MEMCPY_DEFAULT: c_int = 4;

/// Why [`memcpy_each_run`] stopped at run `index`.
pub(super) enum RunFailure {
    /// An address or length this process cannot hold.
    Unaddressable { index: usize },
    /// `cudaMemcpyAsync` returned `code`.
    Cuda { index: usize, code: c_int },
}

/// One `cudaMemcpyAsync(dst, src, len, cudaMemcpyDefault, stream)` per run, in order,
/// stopping at the first failure.
///
/// # Safety
/// Every run must lie in memory that stays valid until the stream has executed the copies,
/// and `stream` must be a live stream.
pub(super) unsafe fn memcpy_each_run(
    api: &CudaApi,
    runs: &CopyRuns,
    stream: Stream,
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
        // SAFETY: cudaMemcpyAsync on runs inside live memory (the caller's contract).
        let code = unsafe {
            (api.memcpy_async)(
                std::ptr::with_exposed_provenance_mut(dst),
                std::ptr::with_exposed_provenance(src),
                len,
                MEMCPY_DEFAULT,
                stream,
            )
        };
        if code != 0 {
            return Err(RunFailure::Cuda { index, code });
        }
    }
    Ok(())
}

/// What a failed batched call returned: the driver's code and, where the driver says, the
/// index of the copy it failed on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchFailure {
    pub code: c_int,
    pub index: Option<usize>,
}

/// Every run of `runs` in one batched call on `stream`. `src_access_order` is
/// `CUmemcpySrcAccessOrder` (1: stream order, for sources the device may still be writing;
/// 3: any, for host sources nobody writes meanwhile).
///
/// # Safety
/// As [`memcpy_each_run`].
pub(crate) unsafe fn batch_copy(
    batch: Batch,
    runs: &CopyRuns,
    stream: Stream,
    src_access_order: c_int,
) -> Result<(), BatchFailure> {
    let count = runs.len();
    if count == 0 {
        return Ok(());
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
    let rc = match batch {
        // SAFETY: the three arrays hold `count` entries and stay alive for the call, which
        // reads them before returning; the copies target memory the plan was validated
        // against (the caller's contract).
        Batch::WithFailIdx(call) => unsafe {
            call(
                runs.dst().as_ptr(),
                runs.src().as_ptr(),
                sizes.as_ptr(),
                count,
                &attrs,
                &first,
                1,
                &mut fail_idx,
                stream,
            )
        },
        // SAFETY: as above, without failIdx.
        Batch::V2(call) => unsafe {
            call(
                runs.dst().as_ptr(),
                runs.src().as_ptr(),
                sizes.as_ptr(),
                count,
                &attrs,
                &first,
                1,
                stream,
            )
        },
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(BatchFailure {
            code: rc,
            index: (fail_idx < count).then_some(fail_idx),
        })
    }
}
