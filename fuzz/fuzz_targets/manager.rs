//! Fuzzes the manager over both policies with request-shaped operation sequences (see
//! `kvcache_core::testing`): `validate()` after every step, and refused calls change nothing.
#![no_main]

use kvcache_core::manager::ChunkId;
use kvcache_core::testing::ManagerProgram;
use kvcache_core::{ArcPolicy, LruPolicy};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let program = ManagerProgram::from_bytes(data);
    if let Err(e) = program.run::<LruPolicy<ChunkId>>() {
        panic!("LRU: {e}");
    }
    if let Err(e) = program.run::<ArcPolicy<ChunkId>>() {
        panic!("ARC: {e}");
    }
});
