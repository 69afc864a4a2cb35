//! What the bindings keep beside the Rust manager (result types, request contexts, the key
//! objects each request observed), and the steps the Python methods share: a request call's
//! keys, positions and state, and its retention hint.

use kvcache_core::manager::Event;
use kvcache_core::{CoreResult, Key, KeyHasher, RequestToken};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::any_manager::{reads_positions, AnyManager};
use crate::context::{require_context, ContextTypeCache, PositionWalk, Positions};
use crate::conversion::{collect_keys, key_bytes, with_core_keys};
use crate::errors::IntoPyResult;
use crate::hints::{read_hint, HintRead};
use crate::request_state::Owner;
use crate::results::ResultTypes;

/// What the bindings keep per live request.
#[derive(Default)]
pub(super) struct Observed {
    /// The key objects the request observed, in the order the core recorded them, so
    /// finishing reads their positions without building new bytes objects.
    pub(super) keys: Vec<Py<PyBytes>>,
    /// Where the last walk over the request's position dict stopped ([`PositionWalk`]): the
    /// next call's keys usually come next.
    pub(super) cursor: isize,
}

/// The manager and what the bindings keep beside it.
pub(super) struct State {
    pub(super) manager: AnyManager,
    /// The policy's short name (`"lru"`, `"arc"`, or the replay's `"belady"`).
    pub(super) policy_name: &'static str,
    pub(super) types: ResultTypes,
    pub(super) owner: Owner,
    pub(super) contexts: ContextTypeCache,
    pub(super) hasher: KeyHasher,
    /// Per live request (by token id): its key objects and position-walk cursor.
    pub(super) observed: hashbrown::HashMap<u64, Observed, foldhash::fast::RandomState>,
    /// The request context of every stored event not yet taken, oldest first (vLLM 0.34
    /// semantics with events on: a stored event carries its request's context).
    pub(super) stored_contexts: std::collections::VecDeque<Option<Py<PyAny>>>,
}

impl State {
    pub(super) fn bury_dead(&mut self) {
        let (observed, manager) = (&mut self.observed, &mut self.manager);
        self.owner.bury_dead(|token| {
            observed.remove(&token.id);
            dispatch!(&mut *manager, |m| m.release_request(token));
        });
    }

    /// Remembers the key objects a call showed the request for the first time, and where its
    /// position walk stopped.
    pub(super) fn remember(
        &mut self,
        token: RequestToken,
        keys: &[Bound<'_, PyBytes>],
        observed: &[usize],
        cursor: isize,
    ) {
        // Nothing new and no walk (ARC never walks while a request runs): no entry to touch.
        if observed.is_empty() && cursor == 0 {
            return;
        }
        let seen = self.observed.entry(token.id).or_default();
        seen.keys
            .extend(observed.iter().map(|&i| keys[i].clone().unbind()));
        seen.cursor = cursor;
    }

    pub(super) fn keys<'a>(&self, keys: &'a [Bound<'_, PyBytes>]) -> Vec<Key<'a>> {
        keys.iter()
            .map(|k| Key::new(&self.hasher, key_bytes(k)))
            .collect()
    }

    /// Runs a core call on `keys` (an iterable of bytes); see [`with_core_keys`].
    pub(super) fn with_keys<R>(
        &mut self,
        keys: &Bound<'_, PyAny>,
        call: fn(&mut AnyManager, &[Key<'_>]) -> R,
    ) -> PyResult<R> {
        with_core_keys(&mut self.manager, keys, &self.hasher, call)
    }

    /// Token positions of `keys` (only policies that read them get them), and where the walk
    /// over the position dict stopped. The walk resumes where the request's previous call
    /// left it, found without side effects (a context not seen recently starts over).
    pub(super) fn positions(
        &mut self,
        ctx: &Bound<'_, PyAny>,
        keys: &[Bound<'_, PyBytes>],
    ) -> PyResult<(Vec<Option<i64>>, isize)> {
        if !dispatch!(&self.manager, |m| reads_positions(m)) {
            return Ok((vec![None; keys.len()], 0));
        }
        let start = self
            .owner
            .cached(ctx)
            .and_then(|token| self.observed.get(&token.id))
            .map_or(0, |o| o.cursor);
        let mut walk = PositionWalk::new(Positions::new(Some(ctx), &mut self.contexts)?, start);
        let positions = keys.iter().map(|k| walk.get(k)).collect::<PyResult<_>>()?;
        Ok((positions, walk.cursor()))
    }

    /// A request's `prepare_load` (`load`) or `prepare_store` on the core manager, with what
    /// both do around it. First the keys (checked, then hashed once for every step), their
    /// token positions and the request's state, in that order: the checks come before any
    /// change. Then `core`; then the keys the request observed for the first time are
    /// remembered, and `finish` builds the result from `core`'s output and the keys.
    pub(super) fn request_op<'py, R, T>(
        &mut self,
        req_context: &Bound<'py, PyAny>,
        keys: &Bound<'py, PyAny>,
        load: bool,
        core: impl FnOnce(
            &mut AnyManager,
            RequestToken,
            &[Key<'_>],
            &[Option<i64>],
            &mut Vec<usize>,
        ) -> CoreResult<R>,
        finish: impl FnOnce(&mut Self, &[Bound<'py, PyBytes>], &[Key<'_>], R) -> PyResult<T>,
    ) -> PyResult<T> {
        let ctx = require_context(Some(req_context))?;
        let keys = collect_keys(keys)?;
        let (positions, cursor) = self.positions(ctx, &keys)?;
        let ks = self.keys(&keys);
        let token = self.call_token(ctx, &ks, load)?;
        let mut observed = Vec::new();
        let out = core(&mut self.manager, token, &ks, &positions, &mut observed).py_err()?;
        self.remember(token, &keys, &observed, cursor);
        finish(self, &keys, &ks, out)
    }

    /// The request state a load or store call on `keys` runs under. A request seen for the
    /// first time gets its state only once the call is known not to be refused (vLLM checks
    /// before it records anything), and its retention hint, read before anything changes.
    fn call_token(
        &mut self,
        ctx: &Bound<'_, PyAny>,
        ks: &[Key<'_>],
        load: bool,
    ) -> PyResult<RequestToken> {
        self.bury_dead();
        let manager = &self.manager;
        if let Some(token) = self
            .owner
            .cached_live(ctx, |t| dispatch!(manager, |m| m.is_live_request(t)))
        {
            let hint = self.pending_hint(ctx, Some(token))?;
            self.give_hint(token, hint);
            return Ok(token);
        }
        let live = self
            .owner
            .existing_token(ctx)?
            .filter(|&t| dispatch!(&self.manager, |m| m.is_live_request(t)));
        if live.is_none() {
            dispatch!(&self.manager, |m| m.check_request_call(ks, load)).py_err()?;
        }
        let hint = self.pending_hint(ctx, live)?;
        let manager = &mut self.manager;
        let token = self
            .owner
            .token(ctx, |current| dispatch!(manager, |m| m.request(current)))?;
        self.give_hint(token, hint);
        Ok(token)
    }

    /// The manager's request state for `ctx` (created on first sight, as vLLM does), with its
    /// retention hint.
    pub(super) fn request(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<RequestToken> {
        self.bury_dead();
        // A context not seen recently is read (vLLM calls this once, for a new request):
        // looking its state up first would cost a `get_state` call on every request.
        let manager = &self.manager;
        let live = self
            .owner
            .cached_live(ctx, |t| dispatch!(manager, |m| m.is_live_request(t)));
        let hint = self.pending_hint(ctx, live)?;
        let token = self.owner.live_token(
            ctx,
            &mut self.manager,
            |manager, token| dispatch!(manager, |m| m.is_live_request(token)),
            |manager, current| dispatch!(manager, |m| m.request(current)),
        )?;
        self.give_hint(token, hint);
        Ok(token)
    }

    /// The retention hint of `ctx`'s request, read unless its live state (`live`) already has
    /// one: read before anything changes, since reading runs the context's Python code (a
    /// `BaseException` it raises then propagates with the manager untouched).
    pub(super) fn pending_hint(
        &self,
        ctx: &Bound<'_, PyAny>,
        live: Option<RequestToken>,
    ) -> PyResult<Option<HintRead>> {
        if live.is_some_and(|token| !dispatch!(&self.manager, |m| m.wants_retention_hint(token))) {
            return Ok(None);
        }
        read_hint(ctx).map(Some)
    }

    /// Gives the request its hint if it still waits for one (a state made just now, or one
    /// made after a reset), and counts a hint that could not be read.
    pub(super) fn give_hint(&mut self, token: RequestToken, found: Option<HintRead>) {
        let Some(found) = found else { return };
        if !dispatch!(&self.manager, |m| m.wants_retention_hint(token)) {
            return;
        }
        if found == HintRead::Ignored {
            dispatch!(&mut self.manager, |m| m.note_ignored_hint());
        }
        let hint = found.hint();
        dispatch!(&mut self.manager, |m| m.set_retention_hint(token, hint));
    }

    pub(super) fn event<'py>(
        &self,
        py: Python<'py>,
        e: &Event,
        req_context: Option<&Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let keys = PyList::new(py, e.keys.iter().map(|k| PyBytes::new(py, k.as_slice())))?;
        self.types.event(py, keys, e, req_context)
    }

    /// Whether stored events carry their request's context.
    pub(super) fn stored_events_carry_context(&self) -> bool {
        let config = self.manager.config();
        config.enable_events && config.semantics.stored_events_expect_removal()
    }
}
