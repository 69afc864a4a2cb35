//! A request's state in the manager: creating and releasing it, its retention hint, and what
//! every request call shares (the up-front checks, recording the keys it observes).

use super::store::unique_in;
use super::{ChunkId, Manager, Recorded};
use crate::error::{CoreError, CoreResult};
use crate::key::Key;
use crate::policy::{Observed, Policy};
use crate::registry::RequestToken;
use crate::retention::RetentionHint;

impl<P: Policy<ChunkId>> Manager<P> {
    /// The request's state for this cache generation: `current` if still valid, else new
    /// (vLLM's `on_new_request` / `_get_request_cache_access`).
    pub fn request(&mut self, current: Option<RequestToken>) -> RequestToken {
        self.requests.get_or_create(current)
    }

    /// Whether `token` still names a request state (not released, not reset).
    pub fn is_live_request(&self, token: RequestToken) -> bool {
        self.requests.get(token).is_some()
    }

    /// Whether the live request still waits for its retention hint (a caller reads a request's
    /// hint once, when it first sees the request).
    pub fn wants_retention_hint(&self, token: RequestToken) -> bool {
        self.requests.get(token).is_some_and(|r| !r.hint_given)
    }

    /// The request's retention hint (`None`: it has none), given once; later calls, and calls
    /// for a stale token, change nothing. It is counted now, and handed to the policy right
    /// before the policy first sees the request (its first observed or inserted key, or its
    /// finish), so a policy decides alike under this manager and under vLLM's.
    pub fn set_retention_hint(&mut self, token: RequestToken, hint: Option<RetentionHint>) {
        let Some(req) = self.requests.get_mut(token).filter(|r| !r.hint_given) else {
            return;
        };
        req.hint_given = true;
        if hint.is_some() {
            self.hints.hinted_requests += 1;
        }
        req.pending_hint = hint;
    }

    /// A caller found a retention hint it could not read and ignored it.
    pub fn note_ignored_hint(&mut self) {
        self.hints.ignored_hints += 1;
    }

    /// The request's context is gone: drop its state (and the policy's).
    pub fn release_request(&mut self, token: RequestToken) {
        if let Some(mut access) = self.requests.release(token) {
            self.policy
                .release_request(std::mem::take(&mut access.policy_state));
            self.requests.recycle(access);
        }
    }

    /// Whether `prepare_load` (`load`) or `prepare_store` of `keys` would be refused for
    /// reasons that do not depend on the request (an absent or pending chunk; a key offered
    /// twice). A caller about to create a request's state checks first, so that a refused
    /// first call leaves no state behind.
    pub fn check_request_call(&self, keys: &[Key<'_>], load: bool) -> CoreResult<()> {
        if !load {
            return unique_in(keys, &mut hashbrown::HashTable::new());
        }
        for (&key, found) in keys.iter().zip(self.policy.find_many(keys)) {
            self.loadable(key, found)?;
        }
        Ok(())
    }

    /// vLLM asserts no new key is observed once a request finished.
    pub(super) fn check_not_finished<'k>(
        &self,
        token: RequestToken,
        mut recorded: impl Iterator<Item = Key<'k>>,
    ) -> CoreResult<()> {
        let req = self.requests.get(token).ok_or(CoreError::StaleRequest)?;
        if req.finished && recorded.any(|k| req.find(k).is_none()) {
            return Err(CoreError::RequestFinished);
        }
        Ok(())
    }

    /// vLLM's `_record_request_cache_access`: new keys join the request's key groups and are
    /// shown to the policy. Returns each recorded key's entry in the request. `observed`
    /// receives the offer indices of newly observed keys.
    pub(super) fn record_access(
        &mut self,
        token: RequestToken,
        recorded: &[Recorded<'_>],
        observed: &mut Vec<usize>,
    ) -> Vec<crate::slab::Idx> {
        let req = self.requests.get_mut(token).expect("checked by the caller");
        if req.num_keys() == 0 {
            req.reserve(&self.hasher, recorded.len());
        }
        let mut entries = Vec::with_capacity(recorded.len());
        let mut new_keys = Vec::new();
        for r in recorded {
            let (entry, new) = req.observe(&self.hasher, r.key, r.resident);
            if new {
                new_keys.push(Observed {
                    key: r.key,
                    id: r.resident,
                    position: r.position,
                });
                observed.push(r.offer_index);
            }
            entries.push(entry);
        }
        if !new_keys.is_empty() {
            req.hand_hint(&mut self.policy);
            self.policy
                .on_request_access(&mut req.policy_state, &new_keys);
        }
        entries
    }
}
