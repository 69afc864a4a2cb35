//! A request's retention hint, read from its context once, when a policy or manager first
//! sees the request (the schema and its checks are `kvcache._hints`, in Python).
//!
//! Most requests carry no hint: a context whose `kv_transfer_params` is None or a dict without
//! kvcache's key, and whose `kv_hints` is None or absent, is answered here without calling
//! into Python. A hint that cannot be read never fails the request: any `Exception` raised
//! while reading it (by the context, the hint objects, or a call back into the same manager)
//! makes it an ignored hint. Only the interpreter's own `BaseException`s (`KeyboardInterrupt`,
//! `SystemExit`) propagate.

use kvcache_core::RetentionHint;
use pyo3::exceptions::PyException;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString, PyTuple};

/// What reading a request's hint found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HintRead {
    /// The request carries no hint.
    Absent,
    Hint(RetentionHint),
    /// It carries one that could not be read (`kvcache._hints` logged why, once per kind).
    Ignored,
}

impl HintRead {
    pub fn hint(self) -> Option<RetentionHint> {
        match self {
            HintRead::Hint(hint) => Some(hint),
            HintRead::Absent | HintRead::Ignored => None,
        }
    }
}

/// `kvcache._hints.read_retention`, imported on first use.
static READ_RETENTION: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `ctx.<name>`, None when the context has no such attribute.
fn attribute<'py>(
    ctx: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    match ctx.getattr_opt(name)? {
        Some(value) if !value.is_none() => Ok(Some(value)),
        _ => Ok(None),
    }
}

fn read(ctx: &Bound<'_, PyAny>) -> PyResult<HintRead> {
    let py = ctx.py();
    let params = attribute(ctx, intern!(py, "kv_transfer_params"))?;
    let envelope = attribute(ctx, intern!(py, "kv_hints"))?;
    let no_params = match &params {
        None => true,
        // An exact dict cannot run code on lookup: a miss settles it here.
        Some(p) => p
            .cast_exact::<PyDict>()
            .is_ok_and(|d| !d.contains(intern!(py, "kvcache")).unwrap_or(true)),
    };
    if no_params && envelope.is_none() {
        return Ok(HintRead::Absent);
    }
    let read_retention = READ_RETENTION.get_or_try_init(py, || {
        py.import(intern!(py, "kvcache._hints"))?
            .getattr(intern!(py, "read_retention"))
            .map(Bound::unbind)
    })?;
    let answer = read_retention.bind(py).call1((params, envelope))?;
    let answer = answer.cast_into::<PyTuple>()?;
    if !answer.get_item(1)?.is_none() {
        return Ok(HintRead::Ignored);
    }
    let hint = answer.get_item(0)?;
    if hint.is_none() {
        return Ok(HintRead::Absent);
    }
    let name = hint.cast_into::<PyString>()?;
    Ok(RetentionHint::from_name(name.to_str()?).map_or(HintRead::Ignored, HintRead::Hint))
}

/// The retention hint `ctx` carries. Errs only with a `BaseException` that is not an
/// `Exception` (the interpreter being interrupted or asked to exit).
pub fn read_hint(ctx: &Bound<'_, PyAny>) -> PyResult<HintRead> {
    let py = ctx.py();
    match read(ctx) {
        Ok(found) => Ok(found),
        Err(err) if err.is_instance_of::<PyException>(py) => Ok(HintRead::Ignored),
        Err(err) => Err(err),
    }
}
