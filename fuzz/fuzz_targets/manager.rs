//! Fuzzes the manager over every policy with request-shaped operation sequences (see
//! `kvcache_core::testing`): `validate()` after every step, and refused calls change nothing.
#![no_main]

use kvcache_core::testing::ManagerProgram;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = ManagerProgram::from_bytes(data).run_every_policy() {
        panic!("{e}");
    }
});
