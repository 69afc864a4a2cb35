//! Id arrays from Python, converted once into `Vec<i64>`: 1-d int64 or int32 buffers (numpy
//! arrays, as vLLM's specs hold them) are read directly; anything else goes through
//! `kvcache.transfer._checks.as_ids` (vectorised numpy: lists, other integer dtypes, typed
//! errors for the rest). Also short integer sequences (group spans) and job ids. Every copy is
//! checked and allocated fallibly (`conversion::Drain`): a buffer's item count is its exporter's
//! word, and a zero-stride numpy view claims any count over eight bytes.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyInt};

use super::plan::Plan;
use crate::conversion::{declared_len, int_in_range, items, type_name, Drain};
use crate::errors::typed;

/// Copies a 1-d native-order buffer of int64 or int32 into a vector, or converts any other
/// object with the package's `as_ids` (which raises `InvalidTypeError`, `OutOfRangeError` or
/// `InvalidArgumentError` on what is not a 1-d sequence of ints).
pub(crate) fn id_vec(py: Python<'_>, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Some(ids) = id_buffer(py, name, obj)? {
        return Ok(ids);
    }
    // Looked up once per process: the slow path still costs no import per call.
    static AS_IDS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let converted = AS_IDS
        .import(py, "kvcache.transfer._checks", "as_ids")?
        .call1((name, obj))?;
    id_buffer(py, name, &converted)?.ok_or_else(|| {
        typed(
            |e| &e.invalid_type,
            format!("{name} must be a 1-d sequence of ints"),
        )
    })
}

/// The ids of a 1-d native-order int64 or int32 buffer; None for any other object.
fn id_buffer(py: Python<'_>, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
    let usable =
        |dims: usize, format: &std::ffi::CStr| dims == 1 && native_order(format.to_bytes());
    if let Ok(buf) = PyBuffer::<i64>::get(obj) {
        if usable(buf.dimensions(), buf.format()) {
            return copied(py, name, &buf).map(Some);
        }
    }
    if let Ok(buf) = PyBuffer::<i32>::get(obj) {
        if usable(buf.dimensions(), buf.format()) {
            let narrow = copied(py, name, &buf)?;
            let mut ids = Vec::new();
            Drain::new(py).claim(&mut ids, narrow.len(), name)?;
            ids.extend(narrow.into_iter().map(i64::from));
            return Ok(Some(ids));
        }
    }
    Ok(None)
}

/// A buffer's items, copied into a vector whose size is checked (`conversion::MAX_ITEMS`) and
/// allocated fallibly.
fn copied<T: pyo3::buffer::Element + Copy + Default>(
    py: Python<'_>,
    name: &str,
    buf: &PyBuffer<T>,
) -> PyResult<Vec<T>> {
    let n = buf.item_count();
    let mut out = Vec::new();
    Drain::new(py).claim(&mut out, n, name)?;
    out.resize(n, T::default());
    buf.copy_to_slice(py, &mut out)?;
    Ok(out)
}

/// A copier's `job_id`: an int from 0 to 2**64 - 1 (pyo3's own would be a bare
/// `OverflowError` or `TypeError`).
pub(crate) fn job_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int_in_range(obj, "job_id", ">= 0 and < 2**64")
}

/// A copier's `plan`: a `_core.Plan`, else `InvalidTypeError`.
pub(crate) fn plan_arg<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Plan>> {
    obj.cast::<Plan>().cloned().map_err(|_| {
        typed(
            |e| &e.invalid_type,
            format!("plan must be a kvcache._core.Plan, got {}", type_name(obj)),
        )
    })
}

/// `wait`'s `job_ids`: None (every job), or an iterable of job ids.
pub(crate) fn job_ids(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u64>>> {
    if obj.is_none() {
        return Ok(None);
    }
    items(obj, "job_ids").map(Some)
}

/// Whether a buffer's struct format is in this machine's byte order. `PyBuffer` matches the
/// element size and kind only, so a byte-swapped array (numpy's `>i8` here) would otherwise
/// be read as other ids.
pub(crate) fn native_order(format: &[u8]) -> bool {
    let foreign: &[u8] = if cfg!(target_endian = "little") {
        b">!"
    } else {
        b"<"
    };
    !format.first().is_some_and(|c| foreign.contains(c))
}

/// Non-negative integers from any iterable of ints (a list, tuple or array) of at most `max`
/// items, with typed errors; `what` names the argument in messages.
pub(crate) fn small_ints(what: &str, obj: &Bound<'_, PyAny>, max: usize) -> PyResult<Vec<u64>> {
    let too_many = || {
        typed(
            |e| &e.invalid_argument,
            format!("{what} has more than {max} entries"),
        )
    };
    // What it says it holds first; a length that lies ends the read one item past `max`.
    if declared_len(obj, what)?.is_some_and(|n| n > max) {
        return Err(too_many());
    }
    let iter = obj.try_iter().map_err(|_| {
        typed(
            |e| &e.invalid_type,
            format!("{what} must be a sequence of ints"),
        )
    })?;
    let mut out = Vec::new();
    for (i, item) in iter.enumerate() {
        let item = item?;
        if i == max {
            return Err(too_many());
        }
        if item.is_instance_of::<PyBool>() {
            return Err(typed(
                |e| &e.invalid_type,
                format!("{what}[{i}] is a bool, not an int"),
            ));
        }
        let v: i64 = item.extract().map_err(|_| {
            // An integer (numpy's included) that does not fit is a bad value, not a bad type.
            if item.is_instance_of::<PyInt>() || item.hasattr("__index__").unwrap_or(false) {
                typed(
                    |e| &e.invalid_argument,
                    format!("{what}[{i}] is out of range (at most 2**63 - 1)"),
                )
            } else {
                typed(|e| &e.invalid_type, format!("{what}[{i}] is not an int"))
            }
        })?;
        let v = u64::try_from(v).map_err(|_| {
            typed(
                |e| &e.invalid_argument,
                format!("{what}[{i}] is negative ({v})"),
            )
        })?;
        out.push(v);
    }
    Ok(out)
}
