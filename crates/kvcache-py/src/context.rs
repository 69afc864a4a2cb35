//! Everything kvcache reads from a request context (vLLM's `ReqContext` or any object with its
//! methods): token positions (by lookup, or by walking the position dict alongside the keys),
//! the request-ordered key list, and the per-request state stored on it — plus the type cache
//! that decides when a known `ReqContext` class's methods may be bypassed for its dicts.

use std::ptr;

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyString, PyType};

use crate::conversion::{collect_keys_into, key_bytes, type_name, Drain};
use crate::exceptions::{exceptions, new_err};

/// Module names of the `ReqContext` classes (vLLM's and ours) whose methods are plain
/// operations on dict attributes (`_offload_key_positions`, `_state`), which kvcache then reads
/// directly instead of calling the methods.
const KNOWN_CONTEXT_MODULES: [&str; 2] = ["vllm.v1.kv_offload.base", "kvcache._context"];

/// Converts a position returned by `get_offload_key_position`.
fn position_value(value: Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if value.is_none() {
        return Ok(None);
    }
    let py = value.py();
    if !value.is_instance_of::<PyInt>() || value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(new_err(
            py,
            &exceptions(py).invalid_type,
            format!(
                "get_offload_key_position must return an int or None, got {}",
                type_name(&value)
            ),
        ));
    }
    value.extract::<i64>().map(Some).map_err(|_| {
        new_err(
            py,
            &exceptions(py).invalid_argument,
            "token position out of the int64 range".into(),
        )
    })
}

/// `positions.get(key)` on a position dict: the per-key hot path of every request call.
#[inline]
fn dict_position<'py>(
    positions: &Bound<'py, PyDict>,
    key: &Bound<'py, PyBytes>,
) -> PyResult<Option<i64>> {
    let py = positions.py();
    // SAFETY: both pointers are live objects we hold references to, and we hold the GIL.
    // The result is a borrowed reference (or NULL with or without an exception set).
    let value = unsafe { ffi::PyDict_GetItemWithError(positions.as_ptr(), key.as_ptr()) };
    if value.is_null() {
        return match PyErr::take(py) {
            Some(err) => Err(err),
            None => Ok(None),
        };
    }
    // SAFETY: `value` was just returned by the dict, and nothing has run since.
    unsafe { borrowed_position(py, value) }
}

/// Converts a position the dict holds, through the borrowed reference for a plain int (the
/// scheduler's case: no bool or subclass checks, no Python code before the read).
///
/// # Safety
/// `value` must be a live borrowed reference that no Python code has run since obtaining.
#[inline]
unsafe fn borrowed_position(py: Python<'_>, value: *mut ffi::PyObject) -> PyResult<Option<i64>> {
    // SAFETY: the caller passes a live `value`; for an exact int `PyLong_AsLongLong` runs no
    // Python code and fails only on overflow, which the slow path below reports.
    unsafe {
        if ffi::Py_TYPE(value) == &raw mut ffi::PyLong_Type {
            let v = ffi::PyLong_AsLongLong(value);
            if v != -1 || ffi::PyErr_Occurred().is_null() {
                return Ok(Some(v));
            }
            ffi::PyErr_Clear();
        }
    }
    // SAFETY: `value` is live (the caller's contract); this takes a strong reference at once.
    let value = unsafe { Bound::from_borrowed_ptr(py, value) };
    position_value(value)
}

/// Reads token positions for keys that mostly arrive in the order their positions were
/// recorded, which is how the scheduler works: it records a request's keys in prefix order
/// (`set_offload_key_position`) and then offers, loads and finishes them in that order, passing
/// the very same key objects. Walking the position dict's items alongside the keys then finds
/// each key as the next item by identity, without hashing or probing; a key that is not among
/// the next few items is looked up as usual. Identity makes the two reads agree: the item whose
/// key *is* the key object is the one a lookup would find.
pub struct PositionWalk<'py> {
    positions: Positions<'py>,
    /// `PyDict_Next`'s position after the last key found by walking.
    cursor: isize,
}

/// Items a walk looks ahead for a key before looking it up (the scheduler's keys skip few).
const WALK_AHEAD: usize = 2;

impl<'py> PositionWalk<'py> {
    /// A walk from the first recorded position, or from `cursor` (from [`Self::cursor`] of an
    /// earlier walk over the same dict).
    pub fn new(positions: Positions<'py>, cursor: isize) -> Self {
        PositionWalk { positions, cursor }
    }

    /// Where the walk stands, to resume a later walk over the same request's keys.
    pub fn cursor(&self) -> isize {
        self.cursor
    }

    #[inline]
    pub fn get(&mut self, key: &Bound<'py, PyBytes>) -> PyResult<Option<i64>> {
        if let Positions::Dict(dict) = &self.positions {
            let mut pos = self.cursor;
            for _ in 0..WALK_AHEAD {
                let mut item_key = ptr::null_mut();
                let mut value = ptr::null_mut();
                // SAFETY: `dict` is a live dict we hold; `PyDict_Next` accepts any position
                // (it bounds-checks) and returns borrowed references, used before any Python
                // code runs.
                let more =
                    unsafe { ffi::PyDict_Next(dict.as_ptr(), &mut pos, &mut item_key, &mut value) };
                if more == 0 {
                    break;
                }
                if item_key == key.as_ptr() {
                    self.cursor = pos;
                    // SAFETY: `value` came from `PyDict_Next` just now.
                    return unsafe { borrowed_position(dict.py(), value) };
                }
            }
        }
        self.positions.get(key)
    }
}

/// Where a request's token positions come from.
pub enum Positions<'py> {
    /// No request context: no key has a position.
    Absent,
    /// vLLM's (or our) `ReqContext`: read its position dict directly, no method call per key.
    Dict(Bound<'py, PyDict>),
    /// Any other object with `get_offload_key_position`.
    Method(Bound<'py, PyAny>),
}

/// Whether some methods of a request context may be bypassed (their dict read directly): its
/// type defines each of them as one of the known `ReqContext` classes does, and the instance
/// does not shadow them. Remembers the last type that qualified, the functions it had then
/// (a method replaced on the class later, e.g. by a test's patch, is noticed by identity), and
/// whether its instances have a `__dict__`.
pub struct ContextTypeCache {
    methods: &'static [&'static str],
    /// `methods` as Python strings, made once: this check runs on every request call.
    names: Vec<Py<PyString>>,
    fast: Option<FastType>,
}

/// A context type whose methods may be bypassed.
struct FastType {
    ty: Py<PyType>,
    /// The type's functions for `methods` when it qualified.
    functions: Vec<Py<PyAny>>,
    has_dict: bool,
}

impl ContextTypeCache {
    /// For contexts whose `methods` (names on `ReqContext`) are to be bypassed.
    const fn new(methods: &'static [&'static str]) -> Self {
        ContextTypeCache {
            methods,
            names: Vec::new(),
            fast: None,
        }
    }

    /// For the position dict read by `get_offload_key_position`.
    pub const fn positions() -> Self {
        Self::new(&["get_offload_key_position"])
    }

    /// Whether `ty` is the remembered type and still has the functions it had then (one
    /// attribute-cache lookup per method).
    fn remembered(&self, ty: &Bound<'_, PyType>) -> PyResult<Option<bool>> {
        let Some(fast) = &self.fast else {
            return Ok(None);
        };
        let py = ty.py();
        if !fast.ty.bind(py).is(ty) {
            return Ok(None);
        }
        for (name, function) in self.names.iter().zip(&fast.functions) {
            if !ty.getattr(name.bind(py))?.is(function.bind(py)) {
                return Ok(None);
            }
        }
        Ok(Some(fast.has_dict))
    }

    /// Whether `ctx`'s methods may be bypassed (see the type's docs).
    pub fn bypassable(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<bool> {
        let py = ctx.py();
        if self.names.is_empty() {
            self.names = self
                .methods
                .iter()
                .map(|name| PyString::intern(py, name).unbind())
                .collect();
        }
        let ty = ctx.get_type();
        let has_dict = match self.remembered(&ty)? {
            Some(has_dict) => has_dict,
            None => {
                self.fast = None;
                if !self.known_type(&ty)? {
                    return Ok(false);
                }
                // `__dictoffset__` is 0 when instances have no `__dict__` (`__slots__` only).
                let has_dict = ty
                    .getattr_opt("__dictoffset__")?
                    .and_then(|o| o.extract::<isize>().ok())
                    .is_none_or(|offset| offset != 0);
                let functions = self
                    .names
                    .iter()
                    .map(|name| ty.getattr(name.bind(py)).map(Bound::unbind))
                    .collect::<PyResult<_>>()?;
                self.fast = Some(FastType {
                    ty: ty.unbind(),
                    functions,
                    has_dict,
                });
                has_dict
            }
        };
        // An instance attribute could shadow a method: then honour it. (Asking a slotted
        // instance for `__dict__` would raise and catch an AttributeError.)
        if has_dict {
            if let Some(d) = ctx.getattr_opt(pyo3::intern!(py, "__dict__"))? {
                let shadowed = d.cast::<PyDict>().map_or(true, |d| {
                    self.names
                        .iter()
                        .any(|name| d.contains(name.bind(py)).unwrap_or(true))
                });
                if shadowed {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Whether `ty` defines every method as a known `ReqContext` class does.
    fn known_type(&self, ty: &Bound<'_, PyType>) -> PyResult<bool> {
        for name in self.methods {
            let Some(func) = ty.getattr_opt(*name)? else {
                return Ok(false);
            };
            let module = func.getattr_opt("__module__")?;
            let qualname = func.getattr_opt("__qualname__")?;
            let (Some(module), Some(qualname)) = (module, qualname) else {
                return Ok(false);
            };
            let known = module
                .extract::<String>()
                .is_ok_and(|m| KNOWN_CONTEXT_MODULES.contains(&m.as_str()))
                && qualname
                    .extract::<String>()
                    .is_ok_and(|q| q.strip_prefix("ReqContext.") == Some(*name));
            if !known {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl<'py> Positions<'py> {
    /// Resolves how to read positions from `ctx` (None → no positions).
    pub fn new(ctx: Option<&Bound<'py, PyAny>>, cache: &mut ContextTypeCache) -> PyResult<Self> {
        let Some(ctx) = ctx.filter(|c| !c.is_none()) else {
            return Ok(Positions::Absent);
        };
        let py = ctx.py();
        if cache.bypassable(ctx)? {
            let name = pyo3::intern!(py, "_offload_key_positions");
            if let Some(dict) = known_dict(ctx, name)? {
                return Ok(Positions::Dict(dict));
            }
        }
        let method = ctx
            .getattr(pyo3::intern!(py, "get_offload_key_position"))
            .map_err(|_| {
                new_err(
                    py,
                    &exceptions(py).invalid_type,
                    format!(
                        "req_context must have vLLM's ReqContext methods; {} has no \
                     get_offload_key_position",
                        type_name(ctx)
                    ),
                )
            })?;
        Ok(Positions::Method(method))
    }

    #[inline]
    pub fn get(&self, key: &Bound<'py, PyBytes>) -> PyResult<Option<i64>> {
        match self {
            Positions::Absent => Ok(None),
            Positions::Dict(d) => dict_position(d, key),
            Positions::Method(m) => position_value(m.call1((key,))?),
        }
    }
}

/// vLLM's `order_request_keys`: the groups' keys concatenated, then stably sorted by token
/// position — but only when every key has a position and no key repeats (vLLM compares the
/// size of its position dict with the number of keys).
pub fn order_request_keys<'py>(
    key_groups: &Bound<'py, PyAny>,
    positions: Positions<'py>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    // The groups and all their keys count against one bound, so that neither endless groups
    // nor endless keys in one of them run on.
    let mut drain = Drain::new(key_groups.py());
    let groups = drain.iter(key_groups, "key_groups", || {
        let py = key_groups.py();
        new_err(
            py,
            &exceptions(py).invalid_type,
            format!(
                "key_groups must be an iterable of key sequences, got {}",
                type_name(key_groups)
            ),
        )
    })?;
    let groups = {
        let mut out = Vec::new();
        drain.read_into(groups, &mut out, "key_groups", Ok)?;
        out
    };
    let mut keys = Vec::new();
    for group in &groups {
        collect_keys_into(&mut drain, group, &mut keys, "key_groups")?;
    }
    let mut walk = PositionWalk::new(positions, 0);
    let mut ranked = Vec::with_capacity(keys.len());
    for key in &keys {
        match walk.get(key)? {
            Some(p) => ranked.push(p),
            None => return Ok(keys),
        }
    }
    let mut order: Vec<usize> = (0..keys.len()).collect();
    // Keys usually come in prefix order already; a stable sort would leave them as they are.
    if !ranked.is_sorted() {
        order.sort_by_key(|&i| ranked[i]);
    }
    // A repeated key has one position, so repeats can only sit in a run of equal positions
    // (usually one key long): no key needs hashing to rule them out.
    for run in order.chunk_by(|&a, &b| ranked[a] == ranked[b]) {
        if run.len() > 1 && has_repeat(run.iter().map(|&i| key_bytes(&keys[i]))) {
            return Ok(keys);
        }
    }
    Ok(order.into_iter().map(|i| keys[i].clone()).collect())
}

/// Whether any byte string occurs twice.
fn has_repeat<'a>(keys: impl ExactSizeIterator<Item = &'a [u8]>) -> bool {
    let mut seen = hashbrown::HashSet::with_capacity_and_hasher(
        keys.len(),
        foldhash::fast::RandomState::default(),
    );
    !keys.into_iter().all(|k| seen.insert(k))
}

pub fn context_error(ctx: &Bound<'_, PyAny>, what: &str) -> PyErr {
    let py = ctx.py();
    let ty = type_name(ctx);
    new_err(
        py,
        &exceptions(py).invalid_type,
        format!("req_context must have vLLM's ReqContext methods; {ty}: {what}"),
    )
}

/// A request context is required: refuse `None` with a clear error.
pub fn require_context<'a, 'py>(
    ctx: Option<&'a Bound<'py, PyAny>>,
) -> PyResult<&'a Bound<'py, PyAny>> {
    match ctx {
        Some(c) if !c.is_none() => Ok(c),
        _ => Python::attach(|py| {
            Err(new_err(
                py,
                &exceptions(py).invalid_type,
                "this call needs a req_context (vLLM's ReqContext or an object with its methods)"
                    .into(),
            ))
        }),
    }
}

/// How an owner reaches the per-request state stored on contexts (`get_state`/`set_state`).
/// For vLLM's or kvcache's own `ReqContext` these are plain operations on its `_state` dict,
/// used directly to save two Python calls per request; any other context (or one whose
/// instance shadows the methods) gets the method calls.
pub struct StateAccess {
    types: ContextTypeCache,
}

impl Default for StateAccess {
    fn default() -> Self {
        StateAccess {
            types: ContextTypeCache::new(&["get_state", "set_state"]),
        }
    }
}

impl StateAccess {
    /// Resolves how to reach `ctx`'s stored state; the type check runs once per call, not
    /// once per read or write.
    pub fn open<'a, 'py>(&mut self, ctx: &'a Bound<'py, PyAny>) -> PyResult<ContextState<'a, 'py>> {
        let direct = if self.types.bypassable(ctx)? {
            known_dict(ctx, intern!(ctx.py(), "_state"))?
        } else {
            None
        };
        Ok(ContextState { ctx, direct })
    }
}

/// One context's stored state, reached as [`StateAccess::open`] resolved.
pub struct ContextState<'a, 'py> {
    ctx: &'a Bound<'py, PyAny>,
    /// The context's `_state` dict when its methods may be bypassed.
    direct: Option<Bound<'py, PyDict>>,
}

impl<'py> ContextState<'_, 'py> {
    /// `ctx.get_state(cls)`; `None` when the context holds nothing for `cls`.
    pub fn get(&self, cls: &Bound<'py, PyType>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let ctx = self.ctx;
        let value = match &self.direct {
            Some(dict) => dict.get_item(cls)?,
            None => Some(
                ctx.getattr(intern!(ctx.py(), "get_state"))
                    .map_err(|_| context_error(ctx, "no get_state"))?
                    .call1((cls,))?,
            ),
        };
        // A stored `None` reads as no state, as through the method.
        Ok(value.filter(|v| !v.is_none()))
    }

    /// `ctx.set_state(value)`, which keys `value` by its type.
    pub fn set(&self, value: &Bound<'py, PyAny>) -> PyResult<()> {
        let ctx = self.ctx;
        match &self.direct {
            Some(dict) => dict.set_item(value.get_type(), value),
            None => {
                ctx.getattr(intern!(ctx.py(), "set_state"))
                    .map_err(|_| context_error(ctx, "no set_state"))?
                    .call1((value,))?;
                Ok(())
            }
        }
    }
}

/// The dict attribute `name` that a known `ReqContext`'s methods work on: `None` for a dict
/// subclass (its methods are called, which honours its overrides), a typed error when it is
/// missing or not a dict at all (the methods would fail on it with an `AttributeError`).
fn known_dict<'py>(
    ctx: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    let Some(value) = ctx.getattr_opt(name)? else {
        return Err(context_error(ctx, &format!("it has no {name} dict")));
    };
    if value.is_exact_instance_of::<PyDict>() {
        // SAFETY: just checked that `value` is exactly a dict.
        return Ok(Some(unsafe { value.cast_into_unchecked::<PyDict>() }));
    }
    if value.is_instance_of::<PyDict>() {
        return Ok(None);
    }
    Err(context_error(
        ctx,
        &format!("its {name} is {}, not a dict", type_name(&value)),
    ))
}
