//! Fuzzes every policy with manager-shaped operation sequences (see `kvcache_core::testing`):
//! the bytes decode to a program the same way the property tests decode theirs, and any
//! violated invariant panics.
#![no_main]

use kvcache_core::testing::PolicyProgram;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = PolicyProgram::from_bytes(data).run_every_policy() {
        panic!("{e}");
    }
});
