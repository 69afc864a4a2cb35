//! [`AnyManager`]: the core manager over whichever policy a Python manager runs, one variant
//! per policy of [`kvcache_core::for_each_policy!`] plus the replay's offline bound, and
//! `dispatch!`, which runs one expression on the `Manager<P>` a variant holds. A core manager
//! method reaches the bindings with no forwarder: the Python method calls it through
//! `dispatch!` (`manager` drives the managers, `kinds` makes them).

use kvcache_core::manager::{ChunkId, Manager, ManagerConfig};
use kvcache_core::{BeladyPolicy, Policy};

/// Declares [`AnyManager`] and `dispatch!` from the policy list. `dispatch!` is itself a
/// macro with metavariables, so this passes itself a `$` to write them with.
macro_rules! any_manager {
    ($($(#[$doc:meta])* $module:ident::$policy:ident as $kind:ident = $class:literal;)*) => {
        any_manager!(@with_dollar ($) $($kind $policy)*);
    };
    (@with_dollar ($d:tt) $($kind:ident $policy:ident)*) => {
        /// The core manager over one of kvcache's policies, or over the replay's offline bound.
        #[allow(
            clippy::large_enum_variant,
            reason = "one per Python manager, held in place: a box would add a pointer to chase"
        )]
        pub enum AnyManager {
            $($kind(Manager<kvcache_core::$policy<ChunkId>>),)*
            /// The replay's offline bound ([`BeladyPolicy`]), not a vLLM policy.
            Belady(Manager<BeladyPolicy<ChunkId>>),
        }

        /// `dispatch!(manager, |m| expr)`: `expr` with `m` bound to the `Manager<P>` that
        /// `manager` (a reference to an [`AnyManager`]) holds, by reference as `manager` is.
        /// One `match`: no allocation and no dynamic call.
        macro_rules! dispatch {
            ($d manager:expr, |$d m:ident| $d body:expr) => {
                match $d manager {
                    $(crate::any_manager::AnyManager::$kind($d m) => $d body,)*
                    crate::any_manager::AnyManager::Belady($d m) => $d body,
                }
            };
        }
    };
}

kvcache_core::for_each_policy!(any_manager);

impl AnyManager {
    /// The manager's configuration (read by several Python methods).
    pub fn config(&self) -> &ManagerConfig {
        dispatch!(self, |m| m.config())
    }
}

/// Whether the manager's policy reads token positions (only then are they read for it).
pub fn reads_positions<P: Policy<ChunkId>>(_: &Manager<P>) -> bool {
    P::READS_POSITIONS
}
