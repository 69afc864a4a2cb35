//! The policies kvcache offers, in one list: each line makes the Python class (a subclass of
//! `BaseCachePolicy` over the core policy), its [`PolicyKind`] (names vLLM's configuration
//! uses), and the manager over it. Adding a policy to the bindings is adding one line here.

use kvcache_core::manager::{ChunkId, Manager, ManagerConfig};
use kvcache_core::{ArcPolicy, CoreResult, LruPolicy};
use pyo3::prelude::*;

use crate::chunk::PyChunk;
use crate::conversion::Count;
use crate::manager::ManagerOps;
use crate::policy::BaseCachePolicy;

macro_rules! policies {
    ($(
        $(#[$doc:meta])*
        $kind:ident: $class:ident = $class_name:literal, $name:literal, $policy:ident
            $({ $($extra:tt)* })?;
    )*) => {
        /// A policy by the names vLLM's configuration gives it (`"lru"`, `"LRUCachePolicy"`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum PolicyKind {
            $($kind),*
        }

        impl PolicyKind {
            pub const ALL: &'static [PolicyKind] = &[$(PolicyKind::$kind),*];

            /// The short name (`"lru"`), as vLLM's factory registers it.
            pub fn name(self) -> &'static str {
                match self {
                    $(PolicyKind::$kind => $name),*
                }
            }

            /// The Python class name (`"LRUCachePolicy"`).
            pub fn class_name(self) -> &'static str {
                match self {
                    $(PolicyKind::$kind => $class_name),*
                }
            }

            /// The kind a short or class name means.
            pub fn from_name(name: &str) -> Option<Self> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|k| k.name() == name || k.class_name() == name)
            }

            /// A manager over this policy.
            pub fn new_manager(self, config: ManagerConfig) -> CoreResult<Box<dyn ManagerOps>> {
                Ok(match self {
                    $(PolicyKind::$kind => {
                        Box::new(Manager::<$policy<ChunkId>>::new(config)?)
                    }),*
                })
            }
        }

        $(
            $(#[$doc])*
            #[pyclass(
                extends = BaseCachePolicy,
                name = $class_name,
                module = "kvcache._core",
                frozen,
                weakref
            )]
            pub struct $class;

            #[pymethods]
            impl $class {
                #[new]
                fn new(cache_capacity: Count) -> PyClassInitializer<Self> {
                    let base = BaseCachePolicy::new::<$policy<PyChunk>>(cache_capacity.0);
                    PyClassInitializer::from(base).add_subclass($class)
                }

                $($($extra)*)?
            }
        )*

        /// Adds every policy class to the module.
        pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
            $(m.add_class::<$class>()?;)*
            Ok(())
        }
    };
}

policies! {
    /// Least-recently-used eviction with logical recency independent of pinning (vLLM's LRU).
    Lru: LruCachePolicy = "LRUCachePolicy", "lru", LruPolicy;

    /// Adaptive replacement (T1/T2 with ghost lists B1/B2), as vLLM's ARC.
    Arc: ArcCachePolicy = "ARCCachePolicy", "arc", ArcPolicy {
        /// ARC's adaptive target size of T1, in `[0, cache_capacity]`.
        #[getter]
        fn target_t1_size(slf: PyRef<'_, Self>) -> PyResult<f64> {
            let stat = slf.as_super().stat(slf.py(), "target_t1_size")?;
            Ok(match stat {
                Some(kvcache_core::Stat::Value(v)) => v,
                _ => unreachable!("ARC reports target_t1_size"),
            })
        }
    };
}
