//! The policies kvcache offers, from the core's one list ([`kvcache_core::for_each_policy!`]):
//! each line there makes a Python class here (a subclass of `BaseCachePolicy` over the core
//! policy), its [`PolicyKind`] (the names vLLM's configuration uses), the manager over it and
//! its entry in `_core.POLICY_KINDS`, from which the Python package derives its policy lists.
//! A new policy needs no line here unless its class has attributes of its own
//! ([`class_methods!`]).

use kvcache_core::manager::{ChunkId, Manager, ManagerConfig};
use kvcache_core::{CoreResult, Policy, VllmSemantics};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::PyClass;

use crate::any_manager::AnyManager;
use crate::chunk::PyChunk;
use crate::conversion::default_semantics;
use crate::policy::BaseCachePolicy;

/// The Python class of a policy: a `BaseCachePolicy` over the core policy `P`.
/// `vllm_semantics` None: the installed vLLM's, else the newest.
fn class_initializer<P, T>(
    py: Python<'_>,
    cache_capacity: usize,
    vllm_semantics: Option<VllmSemantics>,
    class: T,
) -> PyResult<PyClassInitializer<T>>
where
    P: Policy<PyChunk> + Send + 'static,
    P::Request: Send,
    T: PyClass<BaseType = BaseCachePolicy>,
{
    let semantics = match vllm_semantics {
        Some(semantics) => semantics,
        None => default_semantics(py)?,
    };
    Ok(
        PyClassInitializer::from(BaseCachePolicy::new::<P>(cache_capacity, semantics))
            .add_subclass(class),
    )
}

/// The methods of a policy's Python class: the constructor, and for ARC its adaptive target.
macro_rules! class_methods {
    (Arc, $policy:ident) => {
        #[pymethods]
        impl Arc {
            #[new]
            #[pyo3(signature = (cache_capacity, *, vllm_semantics = None))]
            fn new(
                py: Python<'_>,
                cache_capacity: Count,
                #[pyo3(from_py_with = semantics_arg)] vllm_semantics: Option<VllmSemantics>,
            ) -> PyResult<PyClassInitializer<Self>> {
                class_initializer::<kvcache_core::$policy<PyChunk>, _>(
                    py,
                    cache_capacity.0,
                    vllm_semantics,
                    Arc,
                )
            }

            /// ARC's adaptive target size of T1, in `[0, cache_capacity]`.
            #[getter]
            fn target_t1_size(slf: PyRef<'_, Self>) -> PyResult<f64> {
                let name = kvcache_core::$policy::<PyChunk>::TARGET_T1_SIZE;
                let stat = slf.as_super().stat(slf.py(), name)?;
                stat.map(kvcache_core::Stat::as_f64).ok_or_else(|| {
                    crate::errors::typed(|e| &e.invalid_state, format!("no {name} reported"))
                })
            }
        }
    };
    ($kind:ident, $policy:ident) => {
        #[pymethods]
        impl $kind {
            #[new]
            #[pyo3(signature = (cache_capacity, *, vllm_semantics = None))]
            fn new(
                py: Python<'_>,
                cache_capacity: Count,
                #[pyo3(from_py_with = semantics_arg)] vllm_semantics: Option<VllmSemantics>,
            ) -> PyResult<PyClassInitializer<Self>> {
                class_initializer::<kvcache_core::$policy<PyChunk>, _>(
                    py,
                    cache_capacity.0,
                    vllm_semantics,
                    $kind,
                )
            }
        }
    };
}

macro_rules! policies {
    ($($(#[$doc:meta])* $module:ident::$policy:ident as $kind:ident = $class_name:literal;)*) => {
        /// A policy by the names vLLM's configuration gives it (`"lru"`, `"LRUCachePolicy"`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum PolicyKind {
            $($kind),*
        }

        impl PolicyKind {
            pub const ALL: &'static [PolicyKind] = &[$(PolicyKind::$kind),*];

            /// The short name (`"lru"`), as vLLM's factory registers it ([`Policy::NAME`]).
            pub fn name(self) -> &'static str {
                match self {
                    $(PolicyKind::$kind => {
                        <kvcache_core::$policy<ChunkId> as Policy<ChunkId>>::NAME
                    }),*
                }
            }

            /// The Python class name (`"LRUCachePolicy"`), vLLM's name for the policy.
            pub fn class_name(self) -> &'static str {
                match self {
                    $(PolicyKind::$kind => $class_name),*
                }
            }

            /// A manager over this policy.
            pub fn new_manager(self, config: ManagerConfig) -> CoreResult<AnyManager> {
                Ok(match self {
                    $(PolicyKind::$kind => AnyManager::$kind(Manager::new(config)?)),*
                })
            }

            /// The Python class of this policy.
            fn class(self, py: Python<'_>) -> Bound<'_, pyo3::types::PyType> {
                match self {
                    $(PolicyKind::$kind => py.get_type::<classes::$kind>()),*
                }
            }
        }

        /// The Python classes, one per policy.
        mod classes {
            use pyo3::prelude::*;

            use kvcache_core::VllmSemantics;

            use super::class_initializer;
            use crate::chunk::PyChunk;
            use crate::conversion::{semantics_arg, Count};
            use crate::policy::BaseCachePolicy;

            $(
                $(#[$doc])*
                #[pyclass(
                    extends = BaseCachePolicy,
                    name = $class_name,
                    module = "kvcache._core",
                    frozen,
                    weakref
                )]
                pub struct $kind;

                class_methods!($kind, $policy);
            )*
        }

        /// Adds every policy class to the module.
        fn add_classes(m: &Bound<'_, PyModule>) -> PyResult<()> {
            $(m.add_class::<classes::$kind>()?;)*
            Ok(())
        }
    };
}

kvcache_core::for_each_policy!(policies);

impl PolicyKind {
    /// The kind a short or class name means.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|k| k.name() == name || k.class_name() == name)
    }

    /// The policy kvcache's manager runs for vLLM's `cache_policy` and
    /// `cache_policy_module_path`: a registered short name without a module path, or a class
    /// name with kvcache's module path (or none). `None`: a policy kvcache does not implement.
    pub fn resolve(cache_policy: &str, module_path: Option<&str>) -> Option<Self> {
        let kind = Self::from_name(cache_policy)?;
        let ours = matches!(module_path, None | Some("kvcache.vllm" | "kvcache"));
        let by_short_name = kind.name() == cache_policy && module_path.is_none();
        (by_short_name || (kind.class_name() == cache_policy && ours)).then_some(kind)
    }
}

/// Adds every policy class and `POLICY_KINDS` (short name → class, in the core's order) to
/// the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    add_classes(m)?;
    let py = m.py();
    let kinds = PyDict::new(py);
    for &kind in PolicyKind::ALL {
        kinds.set_item(kind.name(), kind.class(py))?;
    }
    m.add("POLICY_KINDS", kinds)?;
    Ok(())
}
