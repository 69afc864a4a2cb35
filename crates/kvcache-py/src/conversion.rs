//! Python → Rust conversions of keys, counts and callers' iterables. (Everything read from a
//! request context is in `context`.)
//!
//! Every batch call converts and validates all of its input before the core is touched, so a
//! bad element anywhere raises with nothing changed. Every iterable a caller passes is read
//! through [`Drain`], which bounds what it may cost.

use kvcache_core::{Key, KeyHasher, VllmSemantics};

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyIterator, PyList, PyString, PyTuple};

use crate::errors::{no_memory_for, too_many_items};
use crate::exceptions::{exceptions, new_err};

/// The most items kvcache reads from one argument (2**22): the keys of one call (the key
/// groups of `on_request_finished` together), a spec's chunk ids, a transfer's block or chunk
/// ids, job ids, a layout's layers, groups or offsets. A long request's keys are far fewer
/// (a million tokens at 16 per key is 65,536 keys). The bound keeps every allocation a call
/// makes for its items (our copy, the hashed keys, the core's per-call vectors) bounded, and
/// ends an endless iterable after a fixed amount of work.
pub const MAX_ITEMS: usize = 1 << 22;

/// Items read between two checks for a pending signal. An iterator written in C
/// (`itertools.repeat`) runs no bytecode, so without them Ctrl-C would wait for the bound.
const SIGNAL_EVERY: usize = 1 << 14;

/// Reads callers' iterables into Rust vectors, for one call: the one place where a caller's
/// iterable sizes a Rust allocation. A vector grows fallibly (the system refusing memory is
/// `OutOfMemoryError`, a `MemoryError`, with the partial vector freed first), the call reads
/// at most [`MAX_ITEMS`] items in all (then `InvalidArgumentError`), and a pending signal
/// (Ctrl-C) ends a long read. The bound is checked before an iterable is read: what it says it
/// holds (`len()`: a list's or a `range`'s length, an array's first dimension, a user's
/// `__len__`) must fit first ([`Drain::iter`]), and a read that goes on past it stops at the
/// item after the bound, whatever the length said. A length only ever refuses: it never sizes
/// an allocation. The call fails before the core is touched, so nothing changes.
///
/// Every binding that reads a caller's iterable reads it here:
/// - policies: `touch`, `on_store_miss`, `on_request_access`, `on_request_finished` (the key
///   groups and their keys), `evict` (`protected`); `order_request_keys`;
/// - managers: `prepare_load`, `prepare_store`, `touch`, `complete_load`, `complete_store`,
///   `_hint_next_uses` (keys and next uses); as vLLM 0.34's primary tier: `prepare_read`,
///   `defer_write_release` (keys), `release_deferred_write` (chunk ids, also bounded by the
///   deferred chunks: `bounded_ints`);
/// - `LoadStoreSpec(block_ids)`;
/// - transfer: `TransferLayout(layers, groups, offsets)`, `TransferLayout.plan` and the
///   engines' submits (block and chunk ids, `transfer::ids::id_vec`), both copiers' `wait`
///   (`job_ids`).
///
/// Group sizes, block indices and per-group pointer counts (`transfer::ids::small_ints`) stop
/// at the layout's group count instead, their length checked against it first; device
/// pointer arrays are checked against the counts before they are read. The transfer engine's
/// Python methods and vLLM's worker read what they keep in Python (job ids, layers, one-shot
/// groups and offsets, a refused load's spans) with the same rules
/// (`kvcache.transfer._checks.bounded_list`), and ids that are not an id array are converted
/// under them (`kvcache.transfer._checks.as_ids`).
pub struct Drain<'py> {
    py: Python<'py>,
    /// Items read so far in this call, across all of its arguments.
    read: usize,
}

impl<'py> Drain<'py> {
    pub fn new(py: Python<'py>) -> Self {
        Drain { py, read: 0 }
    }

    /// Refuses `obj` when what it says it holds (see [`declared_len`]) is more than this call
    /// may still read; reads nothing. Returns that length when it passed.
    pub fn check_len(&self, obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Option<usize>> {
        match declared_len(obj, what)? {
            Some(n) if n > MAX_ITEMS - self.read => Err(too_many_items(what, MAX_ITEMS)),
            len => Ok(len),
        }
    }

    /// `obj`'s iterator, for [`Drain::read_into`], once its length passed [`Drain::check_len`];
    /// `not_iterable` is the error when it has none.
    pub fn iter(
        &self,
        obj: &Bound<'py, PyAny>,
        what: &str,
        not_iterable: impl FnOnce() -> PyErr,
    ) -> PyResult<Bound<'py, PyIterator>> {
        self.check_len(obj, what)?;
        obj.try_iter().map_err(|_| not_iterable())
    }

    /// Appends `items`, each converted by `convert`, to `out`. Take `items` from
    /// [`Drain::iter`], which checks the iterable's length first.
    pub fn read_into<T>(
        &mut self,
        items: impl IntoIterator<Item = PyResult<Bound<'py, PyAny>>>,
        out: &mut Vec<T>,
        what: &str,
        mut convert: impl FnMut(Bound<'py, PyAny>) -> PyResult<T>,
    ) -> PyResult<()> {
        for item in items {
            let item = convert(item?)?;
            self.push(out, item, what)?;
        }
        Ok(())
    }

    /// The items of `obj`, an iterable, each converted by `convert`; `what` names the argument.
    pub fn read<T>(
        &mut self,
        obj: &Bound<'py, PyAny>,
        what: &str,
        convert: impl FnMut(Bound<'py, PyAny>) -> PyResult<T>,
    ) -> PyResult<Vec<T>> {
        let items = self.iter(obj, what, || {
            new_err(
                self.py,
                &exceptions(self.py).invalid_type,
                format!("{what} must be iterable, got {}", type_name(obj)),
            )
        })?;
        let mut out = Vec::new();
        self.read_into(items, &mut out, what, convert)?;
        Ok(out)
    }

    /// Appends one item the caller read (for loops that convert items with their index).
    #[inline]
    pub fn push<T>(&mut self, out: &mut Vec<T>, item: T, what: &str) -> PyResult<()> {
        if self.read == MAX_ITEMS {
            return Err(too_many_items(what, MAX_ITEMS));
        }
        if out.len() == out.capacity() {
            self.grow(out, what)?;
        }
        out.push(item);
        self.read += 1;
        if self.read % SIGNAL_EVERY == 0 {
            self.py.check_signals()?;
        }
        Ok(())
    }

    /// Doubles `out`'s room, never beyond [`MAX_ITEMS`].
    #[cold]
    fn grow<T>(&self, out: &mut Vec<T>, what: &str) -> PyResult<()> {
        // `out` holds at most `read` < MAX_ITEMS items here, so there is room.
        let more = out.capacity().max(64).min(MAX_ITEMS - out.len());
        out.try_reserve_exact(more).map_err(|_| {
            // Freed before the error is built: raising needs memory too.
            *out = Vec::new();
            no_memory_for(what, self.read)
        })
    }

    /// Room in `out` for exactly `n` more items, which the caller reads from a container of
    /// known size (a list, a tuple, a buffer) and appends with plain pushes; they count as
    /// read. Checks nothing else, so it suits loops that must not run Python code.
    pub fn claim<T>(&mut self, out: &mut Vec<T>, n: usize, what: &str) -> PyResult<()> {
        if n > MAX_ITEMS - self.read {
            return Err(too_many_items(what, MAX_ITEMS));
        }
        out.try_reserve_exact(n)
            .map_err(|_| no_memory_for(what, self.read))?;
        self.read += n;
        Ok(())
    }
}

/// How many items `obj` says it holds (`len(obj)`), which kvcache checks against its bounds
/// before reading it: None when it has no length (a generator; `__len__` raising `TypeError`,
/// as `operator.length_hint` reads it), `usize::MAX` when the length is beyond a Python index
/// (`OverflowError`: `range(2**70)`). A `ValueError` (Python's answer to a negative `__len__`)
/// is a length that cannot be true: `InvalidArgumentError` naming `what`, the original as its
/// cause. Any other error `__len__` raises (a `KeyboardInterrupt`) is the caller's.
pub fn declared_len(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<usize>> {
    let py = obj.py();
    match obj.len() {
        Ok(n) => Ok(Some(n)),
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => Ok(Some(usize::MAX)),
        Err(e) if e.is_instance_of::<PyTypeError>(py) => Ok(None),
        Err(e)
            if e.is_instance_of::<PyValueError>(py)
                && !e.is_instance(py, exceptions(py).base.bind(py)) =>
        {
            let err = new_err(
                py,
                &exceptions(py).invalid_argument,
                format!("{what}: its length cannot be read ({e})"),
            );
            err.set_cause(py, Some(e));
            Err(err)
        }
        Err(e) => Err(e),
    }
}

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
        // A size is never negative: `unsigned_abs` is exact here and free.
        std::slice::from_raw_parts(data.cast::<u8>(), len.unsigned_abs())
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
    let mut keys = Vec::new();
    Drain::new(obj.py()).claim(&mut keys, n.max(0).unsigned_abs(), "keys")?;
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
            std::slice::from_raw_parts(data.cast::<u8>(), len.unsigned_abs())
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
    let mut ks = Vec::new();
    // At most `MAX_ITEMS` keys: `owned` passed the same check.
    Drain::new(keys.py()).claim(&mut ks, owned.len(), "keys")?;
    ks.extend(owned.iter().map(|k| Key::new(hasher, key_bytes(k))));
    Ok(call(target, &ks))
}

/// Runs `call`, a core policy or manager method, on `target` with the keys of `keys` hashed
/// by `hasher` (see [`with_hashed_keys`]). `call` is a plain function, so it captures no
/// Python object to run code on.
pub fn with_core_keys<T, R>(
    target: &mut T,
    keys: &Bound<'_, PyAny>,
    hasher: &KeyHasher,
    call: fn(&mut T, &[Key<'_>]) -> R,
) -> PyResult<R> {
    // SAFETY: every caller passes a core policy or manager method over its pure-Rust state:
    // they read chunk records from memory, and neither call into Python nor drop a Python
    // object (which could run a `__del__`).
    unsafe { with_hashed_keys(target, keys, hasher, call) }
}

/// Collects an iterable of keys (lists and tuples without the iterator protocol).
pub fn collect_keys<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    collect_named_keys(obj, "keys")
}

/// [`collect_keys`] for an argument named `what` in messages (`protected`).
pub fn collect_named_keys<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let mut keys = Vec::new();
    collect_keys_into(&mut Drain::new(obj.py()), obj, &mut keys, what)?;
    Ok(keys)
}

/// Appends the keys of `obj` (see [`collect_keys`]) to `keys`, counted by `drain`.
pub fn collect_keys_into<'py>(
    drain: &mut Drain<'py>,
    obj: &Bound<'py, PyAny>,
    keys: &mut Vec<Bound<'py, PyBytes>>,
    what: &str,
) -> PyResult<()> {
    if let Ok(list) = obj.cast::<PyList>() {
        // `as_key` runs no Python code, so the list keeps its length while it is read.
        drain.claim(keys, list.len(), what)?;
        for item in list.iter() {
            keys.push(as_key(item)?);
        }
        return Ok(());
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        drain.claim(keys, tuple.len(), what)?;
        for item in tuple.iter() {
            keys.push(as_key(item)?);
        }
        return Ok(());
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
    // As `Drain::iter`, keeping the length: within the bound, but still only a claim, so it
    // reserves a little at most.
    let hint = drain.check_len(obj, what)?.unwrap_or(0);
    let iter = obj.try_iter().map_err(|_| {
        let py = obj.py();
        new_err(
            py,
            &exceptions(py).invalid_key,
            format!("expected an iterable of bytes keys, got {}", type_name(obj)),
        )
    })?;
    if keys.is_empty() {
        keys.reserve_exact(hint.min(1024));
    }
    drain.read_into(iter, keys, what, as_key)
}

/// The items of the iterable argument `what`, each extracted as `T`, read by a [`Drain`]: what
/// pyo3's `Vec<T>` gives, without letting a `__len__` size the vector. A `str` or `bytes` is
/// refused (`InvalidTypeError`), as pyo3 refuses a `str`: its items are not what was meant.
/// An item of the wrong type is `InvalidTypeError` and one out of `T`'s range
/// `InvalidArgumentError` (pyo3's own are a bare `TypeError` and `OverflowError`).
pub fn items<'py, T>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Vec<T>>
where
    T: pyo3::conversion::FromPyObjectOwned<'py>,
{
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        let py = obj.py();
        return Err(new_err(
            py,
            &exceptions(py).invalid_type,
            format!("{what} must be a sequence, got {}", type_name(obj)),
        ));
    }
    let py = obj.py();
    let mut at = 0usize;
    Drain::new(py).read(obj, what, |item| {
        let i = at;
        at += 1;
        item.extract::<T>().map_err(|e| {
            let e: PyErr = e.into();
            let ex = exceptions(py);
            let why = e.value(py).to_string();
            if e.is_instance(py, ex.base.bind(py)) {
                e
            } else if e.is_instance_of::<PyOverflowError>(py) {
                new_err(
                    py,
                    &ex.invalid_argument,
                    format!("{what}[{i}] is out of range: {why}"),
                )
            } else if e.is_instance_of::<PyTypeError>(py) {
                new_err(py, &ex.invalid_type, format!("{what}[{i}]: {why}"))
            } else {
                e // raised by the item's own code (its `__index__`): the caller's
            }
        })
    })
}

/// A Python int (not a bool) as an `i128`, for range checks on our side; a type error otherwise.
fn int_value(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i128> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        return Err(new_err(
            py,
            &exceptions(py).invalid_type,
            format!("{what} must be an int, got {}", type_name(obj)),
        ));
    }
    obj.extract::<i128>().map_err(|_| {
        new_err(
            py,
            &exceptions(py).invalid_argument,
            format!("{what} is out of range"),
        )
    })
}

/// An int argument converted to `T`, with `InvalidArgumentError` naming the range when it
/// does not fit.
pub fn int_in_range<T: TryFrom<i128>>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    range: &str,
) -> PyResult<T> {
    let value = int_value(obj, what)?;
    T::try_from(value).map_err(|_| {
        let py = obj.py();
        new_err(
            py,
            &exceptions(py).invalid_argument,
            format!("{what} must be {range}, got {value}"),
        )
    })
}

/// A count such as `evict`'s `n`: a non-negative int (not a bool).
pub fn count(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    int_in_range(obj, what, ">= 0 and < 2**64")
}

/// A `bytes` key argument (vLLM's `OffloadKey`), borrowed from the call's arguments: the
/// one-key calls (`lookup`, `get`) are the scheduler's most frequent, and a borrowed key costs
/// no reference count round trip (a function call each under the stable ABI).
pub struct PyKey<'a, 'py>(pub Borrowed<'a, 'py, PyBytes>);

impl<'a, 'py> FromPyObject<'a, 'py> for PyKey<'a, 'py> {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        // SAFETY: `obj` is a live object, so its type pointer is readable; `PyBytes_Type` is
        // a static, and `PyBytes_Check` only reads the type's flags.
        let is_bytes = unsafe {
            ffi::Py_TYPE(obj.as_ptr()) == &raw mut ffi::PyBytes_Type
                || ffi::PyBytes_Check(obj.as_ptr()) != 0
        };
        if is_bytes {
            // SAFETY: just checked that `obj` is a `bytes` (or a subclass).
            return Ok(PyKey(unsafe { obj.cast_unchecked::<PyBytes>() }));
        }
        Err(as_key(obj.to_owned()).expect_err("not bytes"))
    }
}

impl<'py> PyKey<'_, 'py> {
    #[inline]
    pub fn bytes(&self) -> &[u8] {
        let mut data: *mut std::ffi::c_char = std::ptr::null_mut();
        let mut len: ffi::Py_ssize_t = 0;
        // SAFETY: `self.0` is a live `bytes` object, for which this call cannot fail; its buffer
        // lives as long as the object, which the call's arguments keep alive for `self`'s
        // lifetime.
        unsafe {
            let rc = ffi::PyBytes_AsStringAndSize(self.0.as_ptr(), &mut data, &mut len);
            debug_assert_eq!(rc, 0);
            std::slice::from_raw_parts(data.cast::<u8>(), len.unsigned_abs())
        }
    }

    /// An owned reference to the key object.
    pub fn bound(&self) -> Bound<'py, PyBytes> {
        self.0.to_owned()
    }
}

/// A count argument: a non-negative int (not a bool) that fits in `usize`.
pub struct Count(pub usize);

impl FromPyObject<'_, '_> for Count {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        count(&obj, "count").map(Count)
    }
}

/// A count that only bounds a search (`evict`'s `n`): any non-negative int, those beyond
/// `usize` saturating (no such count can be met, which is what `usize::MAX` says too).
pub struct EvictCount(pub usize);

impl FromPyObject<'_, '_> for EvictCount {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let py = obj.py();
        match int_value(&obj, "the count") {
            Ok(v) => match usize::try_from(v) {
                Ok(n) => Ok(EvictCount(n)),
                Err(_) if v > 0 => Ok(EvictCount(usize::MAX)),
                Err(_) => Err(new_err(
                    py,
                    &exceptions(py).invalid_argument,
                    format!("the count must be >= 0, got {v}"),
                )),
            },
            // Beyond i128: huge positive saturates, huge negative is an error.
            Err(e) if e.is_instance(py, &exceptions(py).invalid_argument.bind(py).clone()) => {
                let negative = obj.lt(0i32).unwrap_or(false);
                if negative {
                    Err(e)
                } else {
                    Ok(EvictCount(usize::MAX))
                }
            }
            Err(e) => Err(e),
        }
    }
}

/// A `bool` argument (an int or anything else is refused, as vLLM passes real bools).
pub struct Flag(pub bool);

impl FromPyObject<'_, '_> for Flag {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        match obj.cast::<PyBool>() {
            Ok(b) => Ok(Flag(b.is_true())),
            Err(_) => {
                let py = obj.py();
                Err(new_err(
                    py,
                    &exceptions(py).invalid_type,
                    format!("expected a bool, got {}", type_name(&obj)),
                ))
            }
        }
    }
}

/// A `str` argument named `what`: a type error for anything else, and an argument error for a
/// string UTF-8 cannot hold (a lone surrogate).
pub fn text(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    let py = obj.py();
    let s = obj.cast::<PyString>().map_err(|_| {
        new_err(
            py,
            &exceptions(py).invalid_type,
            format!("{what} must be a str, got {}", type_name(obj)),
        )
    })?;
    s.to_str().map(str::to_owned).map_err(|_| {
        new_err(
            py,
            &exceptions(py).invalid_argument,
            format!("{what} must be valid Unicode text, got a lone surrogate"),
        )
    })
}

/// A `vllm_semantics` argument: `"0.33"`, `"0.34"`, or None (resolved by the caller with
/// [`default_semantics`]).
pub fn semantics_arg(obj: &Bound<'_, PyAny>) -> PyResult<Option<VllmSemantics>> {
    if obj.is_none() {
        return Ok(None);
    }
    let py = obj.py();
    let name = obj.cast::<PyString>().map_err(|_| {
        new_err(
            py,
            &exceptions(py).invalid_type,
            format!(
                "vllm_semantics must be a string such as {:?} or None",
                VllmSemantics::default().name()
            ),
        )
    })?;
    let name = name.to_str()?;
    VllmSemantics::from_name(name).map(Some).ok_or_else(|| {
        let names: Vec<_> = VllmSemantics::ALL.iter().map(|s| s.name()).collect();
        new_err(
            py,
            &exceptions(py).invalid_argument,
            format!("vllm_semantics must be one of {names:?} or None, got {name:?}"),
        )
    })
}

/// The semantics to follow when none is given: the installed vLLM's, else the newest (decided
/// in Python, by `kvcache._semantics.default_semantics`, from the package metadata).
pub fn default_semantics(py: Python<'_>) -> PyResult<VllmSemantics> {
    let name = py
        .import(pyo3::intern!(py, "kvcache._semantics"))?
        .call_method0(pyo3::intern!(py, "default_semantics"))?;
    Ok(semantics_arg(&name)?.unwrap_or_default())
}

/// At most `max` ints (each within `i64`) from any iterable, through [`Drain`] (so never past
/// [`MAX_ITEMS`] either): an iterable longer than `max` is refused with `InvalidArgumentError`
/// after `max + 1` items. `what` names the argument in messages.
pub fn bounded_ints(obj: &Bound<'_, PyAny>, what: &str, max: usize) -> PyResult<Vec<i64>> {
    let py = obj.py();
    if declared_len(obj, what)?.is_some_and(|n| n > max) {
        return Err(more_than(py, what, max));
    }
    let mut at = 0usize;
    let ints = Drain::new(py).read(obj, what, |item| {
        let i = at;
        at += 1;
        if i == max {
            return Err(more_than(py, what, max));
        }
        if item.is_instance_of::<pyo3::types::PyBool>() {
            return Err(new_err(
                py,
                &exceptions(py).invalid_type,
                format!("{what}[{i}] is a bool, not an int"),
            ));
        }
        item.extract::<i64>().map_err(|_| {
            new_err(
                py,
                &exceptions(py).invalid_type,
                format!("{what}[{i}] is not an int within 64 bits"),
            )
        })
    })?;
    Ok(ints)
}

fn more_than(py: Python<'_>, what: &str, max: usize) -> PyErr {
    new_err(
        py,
        &exceptions(py).invalid_argument,
        format!("{what} has more than the {max} entries it may have"),
    )
}
