//! Per-request state kept on vLLM's `ReqContext`, and how it is let go.
//!
//! vLLM's LRU and manager store their per-request state on the context (`set_state`, keyed by
//! type), so it lives exactly as long as the request's context. Ours does the same with its own
//! type (`_RequestState`), which holds one slot per owner (a policy or a manager instance): two
//! owners seeing one context never share or overwrite each other's state, and vLLM's objects
//! (keyed by their own types) are untouched. A slot holds only a token naming state the owner
//! keeps in Rust. When the context dies, the state object's destructor reports each token to its
//! owner's graveyard, and the owner frees that state at its next call. A token from before a
//! cache reset is stale and replaced on first use, as in vLLM.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use pyo3::prelude::*;
use pyo3::types::PyWeakrefReference;

use crate::context::{context_error, StateAccess};

/// Names an owner's state for one request in one generation of its registry.
pub use kvcache_core::RequestToken as Token;

/// Tokens whose request context was collected, waiting for their owner to free them.
#[derive(Default)]
pub struct Graveyard {
    pending: AtomicBool,
    tokens: Mutex<Vec<Token>>,
}

impl Graveyard {
    fn bury(&self, token: Token) {
        self.tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(token);
        self.pending.store(true, Ordering::Release);
    }

    /// Takes the buried tokens, if any (one atomic swap when there are none).
    pub fn take(&self) -> Vec<Token> {
        if !self.pending.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.tokens.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

struct Slot {
    owner: u64,
    token: Token,
    graveyard: Weak<Graveyard>,
}

/// The tokens of every kvcache policy or manager that has seen one request context.
#[pyclass(name = "_RequestState", module = "kvcache._core", frozen)]
#[derive(Default)]
pub struct RequestState {
    slots: Mutex<Vec<Slot>>,
}

#[pymethods]
impl RequestState {
    /// Refused, with `kvcache.InvalidTypeError` (see `errors::not_picklable`): the tokens
    /// name entries of live policies and managers in this process only.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }
}

impl RequestState {
    fn get(&self, owner: u64) -> Option<Token> {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.iter().find(|s| s.owner == owner).map(|s| s.token)
    }

    /// Records `token` for `owner`; a replaced token is stale (from before a reset), so it is
    /// not reported to the graveyard.
    fn set(&self, owner: u64, token: Token, graveyard: &Arc<Graveyard>) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        match slots.iter_mut().find(|s| s.owner == owner) {
            Some(slot) => slot.token = token,
            None => slots.push(Slot {
                owner,
                token,
                graveyard: Arc::downgrade(graveyard),
            }),
        }
    }
}

impl Drop for RequestState {
    fn drop(&mut self) {
        let slots = std::mem::take(self.slots.get_mut().unwrap_or_else(|p| p.into_inner()));
        for slot in slots {
            if let Some(graveyard) = slot.graveyard.upgrade() {
                graveyard.bury(slot.token);
            }
        }
    }
}

/// How many contexts an owner remembers: the scheduler keeps a request's context alive while
/// its transfers are in flight, and finishes it after a few other requests started.
const RECENT_CONTEXTS: usize = 32;

struct Recent {
    /// The context's address, compared first; the weak reference then proves it is the same
    /// live object (an address can be reused once a context dies).
    addr: usize,
    weak: Py<PyWeakrefReference>,
    token: Token,
}

/// An owner of per-request state: a unique id and the graveyard its dead requests go to.
pub struct Owner {
    pub uid: u64,
    pub graveyard: Arc<Graveyard>,
    /// Recently seen contexts (weakly, so their lifetimes are unchanged) with this owner's
    /// token on each, so the calls of a request and of the requests still in flight skip the
    /// `get_state` call. Contexts that cannot be weakly referenced are not cached.
    recent: Vec<Recent>,
    /// Where the next context goes once `recent` is full (oldest first).
    next_slot: usize,
    /// How this owner's tokens are read from and stored on contexts.
    states: StateAccess,
}

impl Default for Owner {
    fn default() -> Self {
        use std::sync::atomic::AtomicU64;
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Owner {
            uid: NEXT.fetch_add(1, Ordering::Relaxed),
            graveyard: Arc::default(),
            recent: Vec::new(),
            next_slot: 0,
            states: StateAccess::default(),
        }
    }
}

impl Owner {
    /// The owner's token on `ctx`, made valid by `validate` (which returns the current token,
    /// allocating one if the stored token is missing or stale). Every Python call happens
    /// before `validate` runs, so an error leaves the owner unchanged.
    pub fn token(
        &mut self,
        ctx: &Bound<'_, PyAny>,
        validate: impl FnOnce(Option<Token>) -> Token,
    ) -> PyResult<Token> {
        let py = ctx.py();
        let stored = self.states.open(ctx)?;
        let state = match stored.get(&py.get_type::<RequestState>())? {
            Some(existing) => existing
                .cast_into::<RequestState>()
                .map_err(|_| context_error(ctx, "get_state returned a foreign object"))?,
            None => {
                let fresh = Bound::new(py, RequestState::default())?;
                stored.set(&fresh)?;
                fresh
            }
        };
        let current = state.get().get(self.uid);
        let token = validate(current);
        if current != Some(token) {
            state.get().set(self.uid, token, &self.graveyard);
        }
        self.remember(ctx, token);
        Ok(token)
    }

    fn remember(&mut self, ctx: &Bound<'_, PyAny>, token: Token) {
        let addr = ctx.as_ptr() as usize;
        if let Some(r) = self.recent.iter_mut().find(|r| r.addr == addr) {
            if let Ok(weak) = PyWeakrefReference::new(ctx) {
                r.weak = weak.unbind();
                r.token = token;
            }
            return;
        }
        let Ok(weak) = PyWeakrefReference::new(ctx) else {
            return;
        };
        let entry = Recent {
            addr,
            weak: weak.unbind(),
            token,
        };
        if self.recent.len() < RECENT_CONTEXTS {
            self.recent.push(entry);
        } else {
            self.recent[self.next_slot] = entry;
            self.next_slot = (self.next_slot + 1) % RECENT_CONTEXTS;
        }
    }

    /// The token cached for `ctx` if it is a recently seen context (callers check it is still
    /// live before using it instead of [`token`](Self::token)).
    pub fn cached(&self, ctx: &Bound<'_, PyAny>) -> Option<Token> {
        let addr = ctx.as_ptr() as usize;
        let r = self.recent.iter().find(|r| r.addr == addr)?;
        let alive = r.weak.bind(ctx.py()).upgrade()?;
        alive.is(ctx).then_some(r.token)
    }

    /// Releases the states of requests whose context was collected since the last call
    /// (`release` frees one owner's state named by a token).
    pub fn bury_dead(&self, release: impl FnMut(Token)) {
        self.graveyard.take().into_iter().for_each(release);
    }

    /// The owner's token on `ctx`, for a state kept in `states`: a recently seen context's if
    /// `is_live` says its state still exists, else [`token`](Self::token) with `validate`.
    pub fn live_token<S: ?Sized>(
        &mut self,
        ctx: &Bound<'_, PyAny>,
        states: &mut S,
        is_live: impl FnOnce(&S, Token) -> bool,
        validate: impl FnOnce(&mut S, Option<Token>) -> Token,
    ) -> PyResult<Token> {
        if let Some(token) = self.cached_live(ctx, |t| is_live(states, t)) {
            return Ok(token);
        }
        self.token(ctx, |current| validate(states, current))
    }

    /// The first half of [`live_token`](Self::live_token), for callers that must check
    /// something before a state is created: a recently seen context's token if `is_live`.
    pub fn cached_live(
        &self,
        ctx: &Bound<'_, PyAny>,
        is_live: impl FnOnce(Token) -> bool,
    ) -> Option<Token> {
        self.cached(ctx).filter(|&t| is_live(t))
    }

    /// The owner's token on `ctx` if it has one (no state is created).
    pub fn existing_token(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<Option<Token>> {
        if let Some(token) = self.cached(ctx) {
            return Ok(Some(token));
        }
        let existing = self
            .states
            .open(ctx)?
            .get(&ctx.py().get_type::<RequestState>())?;
        Ok(existing
            .and_then(|s| s.cast_into::<RequestState>().ok())
            .and_then(|s| s.get().get(self.uid)))
    }
}
