//! Host memory for offloaded chunks, and the copy plans that move chunks to and from KV-cache
//! blocks.
//!
//! - [`HostRegion`]: one page-aligned anonymous mapping owned by Rust. Nothing is rounded up to
//!   a power of two; pages become resident only when touched (or when pinned). Optional
//!   piecewise registration with an accelerator runtime through [`HostRegistrar`], undone
//!   exactly once on [`HostRegion::close`] or on drop.
//! - [`TransferLayout`] / [`CopyRuns`]: turn `(block ids, chunk ids)` into `(src, dst, len)`
//!   copy descriptors, validating every id first and merging pages that are contiguous on
//!   both sides into one run.
//! - [`copy_runs`]: executes a plan with plain memory copies (the CPU path).
//!
//! Only `region` and `copy` contain `unsafe` (mmap/munmap/madvise/mincore and raw copies);
//! the planning code is safe Rust.

// The transfer code is being rebuilt for the vLLM worker; its numeric casts are audited one by
// one (as in the rest of the workspace) when that lands.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    clippy::cast_lossless
)]

mod copy;
mod error;
mod plan;
mod region;

pub use copy::copy_runs;
pub use error::{HostError, HostResult};
pub use plan::{CopyRuns, Direction, LayerGeometry, PlanScratch, TransferLayout};
pub use region::{page_size, registration_piece_bytes, HostRegion, HostRegistrar, Lease};
