//! Model-checking harnesses shared by the property tests and the fuzz targets.
//!
//! One generator makes the operation sequences for both: [`PolicyProgram`] and
//! [`ManagerProgram`] implement [`arbitrary::Arbitrary`], so proptest feeds them random bytes
//! (`from_bytes`) and cargo-fuzz feeds them its corpus, through the same code.
//!
//! [`PolicyHarness`] drives any [`Policy`] with manager-shaped calls (keys from a small universe
//! so they collide, reference counts changed only through the manager's transitions) and then
//! checks: `validate()`; the policy holds exactly the model's chunks; every evicted entry was
//! resident, idle and unprotected; a failed eviction or a refused call changed nothing; victims
//! of a ranking policy (LRU) are the smallest eligible ranks. [`ManagerHarness`] drives a
//! [`Manager`](crate::Manager) through requests (lookups, loads, stores, completions, finishes, releases,
//! resets) with `validate()` after every step and the same "an error changes nothing" check.
//!
//! The policy half lives in `policy`, the manager half in `manager`; this file holds what
//! they share.

use arbitrary::{Arbitrary, Unstructured};

use crate::policy::Policy;
use crate::retention::RetentionHint;

mod manager;
mod policy;
#[cfg(test)]
mod tests;

pub use manager::{manager_key, ManagerHarness, ManagerOp, ManagerProgram};
pub use policy::{PolicyHarness, PolicyOp, PolicyProgram, K, KEYS};

/// Operations until the input runs out (a program is the whole input).
fn ops<'a, T: Arbitrary<'a>>(u: &mut Unstructured<'a>) -> arbitrary::Result<Vec<T>> {
    let mut ops = Vec::new();
    while !u.is_empty() {
        ops.push(u.arbitrary()?);
    }
    Ok(ops)
}

/// Either retention hint.
fn hint(u: &mut Unstructured<'_>) -> arbitrary::Result<RetentionHint> {
    Ok(*u.choose(&[RetentionHint::Continues, RetentionHint::Ends])?)
}

/// A program of operations, run on a fresh policy of any type (or a manager over it).
trait Program {
    /// The chunk handle the policies hold.
    type Chunk;

    /// Runs the program on a fresh policy of type `P`; `Err` names the op and the violation.
    fn run<P: Policy<Self::Chunk>>(&self) -> Result<(), String>;
}

/// Runs `program` on every policy of [`crate::for_each_policy!`]; `Err` names the policy.
fn run_listed<T: Program>(program: &T) -> Result<(), String> {
    macro_rules! run_all {
        ($($(#[$doc:meta])* $module:ident::$policy:ident as $kind:ident = $class:literal;)*) => {
            $(
                program.run::<crate::$policy<T::Chunk>>().map_err(|e| {
                    format!("{}: {e}", <crate::$policy<T::Chunk> as Policy<T::Chunk>>::NAME)
                })?;
            )*
        };
    }
    crate::for_each_policy!(run_all);
    Ok(())
}
