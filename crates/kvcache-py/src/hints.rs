//! A request's retention hint, read from its context once, when a policy or manager first
//! sees the request (the schema and its checks are `kvcache._hints`, in Python).
//!
//! Most requests carry no hint: a context whose `kv_transfer_params` is None or a dict without
//! kvcache's key, and whose `kv_hints` is None or absent, is answered here without calling
//! into Python. A hint that cannot be read never fails the request: any `Exception` raised
//! while reading it (by the context, the hint objects, or a call back into the same manager)
//! makes it an ignored hint, logged once per kind of mistake. Only a `BaseException` that is
//! not an `Exception` (`KeyboardInterrupt`, `SystemExit`) propagates.

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

/// `kvcache._hints.read_retention` and `note_problem`, imported on first use.
static HINTS: PyOnceLock<(Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();

fn functions(py: Python<'_>) -> PyResult<&(Py<PyAny>, Py<PyAny>)> {
    HINTS.get_or_try_init(py, || {
        let module = py.import(intern!(py, "kvcache._hints"))?;
        Ok((
            module.getattr(intern!(py, "read_retention"))?.unbind(),
            module.getattr(intern!(py, "note_problem"))?.unbind(),
        ))
    })
}

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
        // An exact dict without kvcache's key settles it here; a lookup that raises (a key
        // of the dict's own whose `__eq__` does) leaves it to `read_retention`.
        Some(p) => p
            .cast_exact::<PyDict>()
            .is_ok_and(|d| !d.contains(intern!(py, "kvcache")).unwrap_or(true)),
    };
    if no_params && envelope.is_none() {
        return Ok(HintRead::Absent);
    }
    let (read_retention, _) = functions(py)?;
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
    let is_exception = |err: &PyErr| err.is_instance_of::<PyException>(py);
    match read(ctx) {
        Ok(found) => Ok(found),
        Err(err) if is_exception(&err) => {
            // The context itself raised (`read_retention` never does): log it as unreadable,
            // as `read_retention` logs what it cannot read. Logging is best effort.
            let logged = functions(py)
                .and_then(|(_, note_problem)| note_problem.bind(py).call1(("unreadable",)));
            match logged {
                Err(err) if !is_exception(&err) => Err(err),
                _ => Ok(HintRead::Ignored),
            }
        }
        Err(err) => Err(err),
    }
}
