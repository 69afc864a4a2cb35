//! The CPU copy path: executes a [`CopyRuns`] plan with `memmove`.
#![allow(unsafe_code, reason = "raw copies between plan addresses")]

use super::error::{HostError, HostResult};
use super::plan::CopyRuns;

/// Copies every run of `runs`, in order. Fails (before copying anything more) on a run whose
/// address or length does not fit in `usize`, which no plan over real memory contains.
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
pub unsafe fn copy_runs(runs: &CopyRuns) -> HostResult<()> {
    for ((&src, &dst), &len) in runs.src().iter().zip(runs.dst()).zip(runs.lens()) {
        let fit =
            |value: u64| usize::try_from(value).map_err(|_| HostError::Unaddressable { value });
        let (src, dst, len) = (fit(src)?, fit(dst)?, fit(len)?);
        // SAFETY: the caller guarantees both ranges are valid (see above); `ptr::copy`
        // tolerates overlap. Integer-to-pointer conversion is how plans carry addresses.
        unsafe {
            std::ptr::copy(
                std::ptr::with_exposed_provenance::<u8>(src),
                std::ptr::with_exposed_provenance_mut::<u8>(dst),
                len,
            );
        }
    }
    Ok(())
}
