//! Per-request state, named by tokens.
//!
//! vLLM keeps per-request state on the request's context object, so it lives exactly as long
//! as the request. kvcache keeps the state itself here and puts only a [`RequestToken`] on the
//! context; the owner removes the state when the context dies. A reset makes every token stale
//! (a new generation), as vLLM's `reset_cache` makes the states on contexts stale.

use hashbrown::HashMap;

/// Names one request's state for one generation of a [`Registry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestToken {
    pub generation: u64,
    pub id: u64,
}

pub struct Registry<T> {
    live: HashMap<u64, T, foldhash::fast::FixedState>,
    next_id: u64,
    generation: u64,
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Registry {
            live: HashMap::default(),
            next_id: 0,
            generation: 0,
        }
    }
}

impl<T> Registry<T> {
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    /// The state `current` names, or a fresh one made by `make` if it is missing or stale.
    pub fn get_or_insert_with(
        &mut self,
        current: Option<RequestToken>,
        make: impl FnOnce() -> T,
    ) -> RequestToken {
        if let Some(t) = current.filter(|&t| self.get(t).is_some()) {
            return t;
        }
        self.next_id += 1;
        self.live.insert(self.next_id, make());
        RequestToken {
            generation: self.generation,
            id: self.next_id,
        }
    }

    /// A valid token's state (None for a stale or removed token).
    #[inline]
    pub fn get(&self, token: RequestToken) -> Option<&T> {
        if token.generation != self.generation {
            return None;
        }
        self.live.get(&token.id)
    }

    #[inline]
    pub fn get_mut(&mut self, token: RequestToken) -> Option<&mut T> {
        if token.generation != self.generation {
            return None;
        }
        self.live.get_mut(&token.id)
    }

    /// Forgets the request (its context died) and returns its state.
    pub fn remove(&mut self, token: RequestToken) -> Option<T> {
        if token.generation != self.generation {
            return None;
        }
        self.live.remove(&token.id)
    }

    /// Every token becomes stale; returns the states that were live.
    pub fn reset(&mut self) -> impl Iterator<Item = T> + '_ {
        self.generation += 1;
        self.live.drain().map(|(_, state)| state)
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.live.values()
    }

    /// Bytes of the table itself (not of what the states own).
    pub(crate) fn allocation_size(&self) -> usize {
        self.live.allocation_size()
    }
}
