//! Fuzzes both policies with manager-shaped operation sequences (see `kvcache_core::testing`):
//! the bytes decode to a program the same way the property tests decode theirs, and any
//! violated invariant panics.
#![no_main]

use kvcache_core::chunk::TestChunk;
use kvcache_core::testing::PolicyProgram;
use kvcache_core::{ArcPolicy, LruPolicy};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let program = PolicyProgram::from_bytes(data);
    if let Err(e) = program.run::<LruPolicy<TestChunk>>() {
        panic!("LRU: {e}");
    }
    if let Err(e) = program.run::<ArcPolicy<TestChunk>>() {
        panic!("ARC: {e}");
    }
});
