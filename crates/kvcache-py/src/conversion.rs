//! Python → Rust conversions: keys, counts, token positions, request-ordered key lists.
//!
//! Every batch call converts and validates all of its input before the core is touched, so a
//! bad element anywhere raises with nothing changed.

use std::ptr;

use kvcache_core::{Key, KeyHasher};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyString, PyTuple, PyType};

use crate::exceptions::{exceptions, new_err};

/// Module names of the `ReqContext` classes (vLLM's and ours) whose methods are plain
/// operations on dict attributes (`_offload_key_positions`, `_state`), which kvcache then reads
/// directly instead of calling the methods.
const KNOWN_CONTEXT_MODULES: [&str; 2] = ["vllm.v1.kv_offload.base", "kvcache._context"];

/// The name of `obj`'s type, for error messages.
pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// A key must be `bytes` (vLLM's `OffloadKey`).
#[inline]
pub fn as_key<'py>(obj: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    // SAFETY: `obj` is a live object, so its type pointer is readable; `PyBytes_Type` is a
    // static. Exact `bytes` (every key vLLM makes) is recognised by this compare alone; under
    // the stable ABI the general check below is a function call.
    let exact = unsafe { ffi::Py_TYPE(obj.as_ptr()) == &raw mut ffi::PyBytes_Type };
    if exact {
        // SAFETY: just checked that `obj` is a `bytes`.
        return Ok(unsafe { obj.cast_into_unchecked::<PyBytes>() });
    }
    match obj.cast_into::<PyBytes>() {
        Ok(b) => Ok(b),
        Err(e) => {
            let obj = e.into_inner();
            let py = obj.py();
            Err(new_err(
                py,
                &exceptions(py).invalid_key,
                format!("keys must be bytes, got {}", type_name(&obj)),
            ))
        }
    }
}

/// The bytes of a key, with one call into Python (the stable ABI has no inline accessor).
#[inline]
pub fn key_bytes<'a>(key: &'a Bound<'_, PyBytes>) -> &'a [u8] {
    let mut data: *mut std::ffi::c_char = std::ptr::null_mut();
    let mut len: ffi::Py_ssize_t = 0;
    // SAFETY: `key` is a live `bytes` object, for which this call cannot fail; the buffer it
    // returns lives as long as the object, which outlives the borrow of `key`.
    unsafe {
        let rc = ffi::PyBytes_AsStringAndSize(key.as_ptr(), &mut data, &mut len);
        debug_assert_eq!(rc, 0);
        std::slice::from_raw_parts(data.cast::<u8>(), len as usize)
    }
}

/// The keys of an exact `list` or `tuple`, read in place: no new reference per key and one
/// pass that also hashes them (`make`). `Ok(None)` for any other iterable (use
/// [`collect_keys`]); a non-`bytes` element raises as [`as_key`] does.
///
/// # Safety
/// The returned keys borrow the container's items without owning references to them. The
/// caller must not run any Python code while they are alive: Python code could mutate the
/// list and free the items.
pub unsafe fn borrowed_keys<'a, K>(
    obj: &'a Bound<'_, PyAny>,
    make: impl Fn(&'a [u8]) -> K,
) -> PyResult<Option<Vec<K>>> {
    let ptr = obj.as_ptr();
    // SAFETY: `obj` is live; its type pointer is readable and the two types are statics.
    let (is_list, is_tuple) = unsafe {
        let ty = ffi::Py_TYPE(ptr);
        (
            ty == &raw mut ffi::PyList_Type,
            ty == &raw mut ffi::PyTuple_Type,
        )
    };
    if !is_list && !is_tuple {
        return Ok(None);
    }
    // SAFETY: `ptr` is an exact list or tuple; the size calls cannot fail for them.
    let n = unsafe {
        if is_list {
            ffi::PyList_Size(ptr)
        } else {
            ffi::PyTuple_Size(ptr)
        }
    };
    let mut keys = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n {
        // SAFETY: `i` is in bounds (no Python code runs in this loop, so the size holds);
        // the item is a borrowed reference kept alive by the container.
        let item = unsafe {
            if is_list {
                ffi::PyList_GetItem(ptr, i)
            } else {
                ffi::PyTuple_GetItem(ptr, i)
            }
        };
        // SAFETY: `item` is a live object (see above).
        let exact = unsafe { ffi::Py_TYPE(item) == &raw mut ffi::PyBytes_Type };
        // SAFETY: as above; `PyBytes_Check` only reads the type's flags.
        if !exact && unsafe { ffi::PyBytes_Check(item) } == 0 {
            // SAFETY: `item` is live; this takes a new reference to build the error.
            let owned = unsafe { Bound::from_borrowed_ptr(obj.py(), item) };
            return Err(as_key(owned).expect_err("not bytes"));
        }
        let mut data: *mut std::ffi::c_char = std::ptr::null_mut();
        let mut len: ffi::Py_ssize_t = 0;
        // SAFETY: `item` is a `bytes`, for which this cannot fail; its buffer lives as long as
        // the item, which the caller keeps alive by running no Python code (see # Safety).
        let bytes: &'a [u8] = unsafe {
            let rc = ffi::PyBytes_AsStringAndSize(item, &mut data, &mut len);
            debug_assert_eq!(rc, 0);
            std::slice::from_raw_parts(data.cast::<u8>(), len as usize)
        };
        keys.push(make(bytes));
    }
    Ok(Some(keys))
}

/// Runs `call` on `target` with the keys of `keys` (an iterable of bytes) hashed by `hasher`:
/// lists and tuples read in place ([`borrowed_keys`]), anything else collected first.
///
/// # Safety
/// `call` must not run Python code (see [`borrowed_keys`]).
pub unsafe fn with_hashed_keys<T, R>(
    target: &mut T,
    keys: &Bound<'_, PyAny>,
    hasher: &KeyHasher,
    call: impl FnOnce(&mut T, &[Key<'_>]) -> R,
) -> PyResult<R> {
    // SAFETY: only `call` runs while the borrowed keys live, and the caller guarantees it runs
    // no Python code.
    if let Some(ks) = unsafe { borrowed_keys(keys, |b| Key::new(hasher, b)) }? {
        return Ok(call(target, &ks));
    }
    let owned = collect_keys(keys)?;
    let ks: Vec<Key<'_>> = owned
        .iter()
        .map(|k| Key::new(hasher, key_bytes(k)))
        .collect();
    Ok(call(target, &ks))
}

/// Collects an iterable of keys (lists and tuples without the iterator protocol).
pub fn collect_keys<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return list.iter().map(as_key).collect();
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple.iter().map(as_key).collect();
    }
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyString>() {
        // A lone key is iterable (as ints); refuse it rather than treat bytes as a key list.
        let py = obj.py();
        return Err(new_err(
            py,
            &exceptions(py).invalid_key,
            format!(
                "expected an iterable of bytes keys, got a single {}",
                type_name(obj)
            ),
        ));
    }
    let iter = obj.try_iter().map_err(|_| {
        let py = obj.py();
        new_err(
            py,
            &exceptions(py).invalid_key,
            format!("expected an iterable of bytes keys, got {}", type_name(obj)),
        )
    })?;
    let mut keys = Vec::with_capacity(obj.len().unwrap_or(0));
    for item in iter {
        keys.push(as_key(item?)?);
    }
    Ok(keys)
}

/// A count such as `evict`'s `n`: a non-negative int (not a bool).
pub fn count(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    let py = obj.py();
    let ex = exceptions(py);
    if obj.is_instance_of::<pyo3::types::PyBool>() || !obj.is_instance_of::<PyInt>() {
        return Err(new_err(
            py,
            &ex.invalid_type,
            format!("{what} must be an int, got {}", type_name(obj)),
        ));
    }
    match obj.extract::<i64>() {
        Ok(n) if n >= 0 => Ok(n as usize),
        Ok(n) => Err(new_err(
            py,
            &ex.invalid_argument,
            format!("{what} must be >= 0, got {n}"),
        )),
        Err(_) => Err(new_err(
            py,
            &ex.invalid_argument,
            format!("{what} is out of range"),
        )),
    }
}

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
/// does not shadow them. Remembers the last type that qualified, and whether its instances
/// have a `__dict__`.
pub struct ContextTypeCache {
    methods: &'static [&'static str],
    /// `methods` as Python strings, made once: this check runs on every request call.
    names: Vec<Py<PyString>>,
    fast: Option<(Py<PyType>, bool)>,
}

impl ContextTypeCache {
    /// For contexts whose `methods` (names on `ReqContext`) are to be bypassed.
    pub const fn new(methods: &'static [&'static str]) -> Self {
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

    /// Whether `ctx`'s methods may be bypassed (see the type's docs).
    pub fn bypassable(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<bool> {
        let ty = ctx.get_type();
        let has_dict = match &self.fast {
            Some((fast, has_dict)) if fast.bind(ctx.py()).is(&ty) => *has_dict,
            _ => {
                if !self.known_type(&ty)? {
                    return Ok(false);
                }
                // `__dictoffset__` is 0 when instances have no `__dict__` (`__slots__` only).
                let has_dict = ty
                    .getattr_opt("__dictoffset__")?
                    .and_then(|o| o.extract::<isize>().ok())
                    .is_none_or(|offset| offset != 0);
                self.fast = Some((ty.unbind(), has_dict));
                has_dict
            }
        };
        // An instance attribute could shadow a method: then honour it. (Asking a slotted
        // instance for `__dict__` would raise and catch an AttributeError.)
        if has_dict {
            let py = ctx.py();
            if let Some(d) = ctx.getattr_opt(pyo3::intern!(py, "__dict__"))? {
                if self.names.is_empty() {
                    self.names = self
                        .methods
                        .iter()
                        .map(|name| PyString::intern(py, name).unbind())
                        .collect();
                }
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
            if let Some(dict) = ctx.getattr_opt(pyo3::intern!(py, "_offload_key_positions"))? {
                if let Ok(dict) = dict.cast_into_exact::<PyDict>() {
                    return Ok(Positions::Dict(dict));
                }
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
    let mut keys = Vec::new();
    let groups = key_groups.try_iter().map_err(|_| {
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
    for group in groups {
        keys.extend(collect_keys(&group?)?);
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
