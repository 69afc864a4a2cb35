//! Fuzzes both policies with manager-shaped operation sequences (see `kvcache_core::testing`):
//! every byte string decodes to a valid program, and any violated invariant panics.
#![no_main]

use kvcache_core::testing::{Harness, Op};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&capacity, program)) = data.split_first() else { return };
    let ops = Op::decode(program);
    for mut harness in [Harness::lru(1 + capacity as usize % 8), Harness::arc(1 + capacity as usize % 8)] {
        for op in &ops {
            if let Err(e) = harness.apply(op) {
                panic!("{op:?}: {e}");
            }
        }
    }
});
