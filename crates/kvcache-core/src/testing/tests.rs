//! The harnesses' own property tests: every policy and every manager over random programs.

use proptest::prelude::*;

use super::*;

fn program_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..1536)
}

#[test]
fn programs_use_their_whole_input() {
    let bytes: Vec<u8> = (0..1200u32).map(|i| (i * 97 % 251) as u8).collect();
    assert!(PolicyProgram::from_bytes(&bytes).ops.len() > 100);
    assert!(ManagerProgram::from_bytes(&bytes).ops.len() > 100);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    // Too slow for Miri (and proptest persists failures to files, which Miri's isolation
    // forbids).
    #[cfg_attr(miri, ignore)]
    #[test]
    fn every_policy_keeps_its_invariants(bytes in program_bytes()) {
        PolicyProgram::from_bytes(&bytes).run_every_policy().map_err(TestCaseError::fail)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[cfg_attr(miri, ignore)]
    #[test]
    fn every_manager_keeps_its_invariants(bytes in program_bytes()) {
        ManagerProgram::from_bytes(&bytes).run_every_policy().map_err(TestCaseError::fail)?;
    }
}

/// A deterministic sweep of byte programs, as the fuzzers would feed them (also runs under
/// Miri, with fewer programs).
#[test]
fn decoded_byte_programs_run_clean() {
    let programs = if cfg!(miri) { 4 } else { 300 };
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..programs {
        let bytes: Vec<u8> = (0..400)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state.to_le_bytes()[0]
            })
            .collect();
        PolicyProgram::from_bytes(&bytes)
            .run_every_policy()
            .unwrap();
        ManagerProgram::from_bytes(&bytes)
            .run_every_policy()
            .unwrap();
    }
}
