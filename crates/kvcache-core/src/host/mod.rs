//! Host memory for offloaded chunks, and the copy plans that move chunks to and from KV-cache
//! blocks.
//!
//! - [`HostRegion`]: one page-aligned anonymous mapping owned by Rust. Nothing is rounded up to
//!   a power of two; pages become resident only when touched (or when pinned). Optional
//!   piecewise registration with an accelerator runtime through [`HostRegistrar`], undone
//!   exactly once on [`HostRegion::close`] or on drop. Each piece is prefaulted by several
//!   threads first; registration can run on a background thread while copies proceed on
//!   the (still pageable) memory.
//! - [`TransferLayout`] / [`CopyRuns`]: turn `(block ids, chunk ids, group spans)` into
//!   `(src, dst, len)` copy descriptors, validating every id first and merging pages that are
//!   contiguous on both sides into one run. Several KV-cache groups, partial first and last
//!   chunks, padded pages and tensors shared by several layers are part of the geometry.
//! - [`copy_runs`]: executes a plan with plain memory copies (the CPU path).
//!
//! Only `region` and `copy` contain `unsafe` (mmap/munmap/madvise/mincore and raw copies);
//! the planning code is safe Rust.

mod copy;
mod error;
mod plan;
mod region;

pub use copy::copy_runs;
pub use error::{HostError, HostResult};
pub use plan::{
    CopyRuns, Direction, GroupRef, GroupSpan, HostGeometry, LayerGeometry, PlanScratch,
    PointerCounts, Request, TransferLayout,
};
pub use region::{
    page_size, CopyGuard, HostRegion, HostRegistrar, Lease, PinStatus, BACKGROUND_PIECE_BYTES,
};
