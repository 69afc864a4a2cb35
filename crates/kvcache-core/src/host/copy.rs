//! The CPU copy path: executes a [`CopyRuns`] plan with `memmove`.
#![allow(unsafe_code)]

use super::plan::CopyRuns;

/// Copies every run of `runs`, in order.
///
/// `memmove` rather than `memcpy`: a caller may (oddly, but legally) use views of the pool
/// itself as the "device" layers, and then source and destination could overlap.
///
/// # Safety
/// For every run `i`, `src[i]..src[i] + len[i]` must be valid for reads and
/// `dst[i]..dst[i] + len[i]` valid for writes for the whole call, and no other thread may
/// access the destination ranges meanwhile. Plans from [`super::TransferLayout::plan`] stay
/// inside the geometry they were built from, so the caller only has to keep that memory
/// alive and unshared until this returns.
pub unsafe fn copy_runs(runs: &CopyRuns) {
    for ((&src, &dst), &len) in runs.src().iter().zip(runs.dst()).zip(runs.lens()) {
        // SAFETY: the caller guarantees both ranges are valid (see above); `ptr::copy`
        // tolerates overlap. Addresses came from real allocations, so they fit in usize.
        unsafe {
            std::ptr::copy(
                src as usize as *const u8,
                dst as usize as *mut u8,
                len as usize,
            );
        }
    }
}
