//! The manager's invariant checks (tests, and builds with the `validate` feature).

use super::table::{FREE, PENDING};
use super::{ChunkId, Manager};
use crate::policy::Policy;

impl<P: Policy<ChunkId>> Manager<P> {
    /// Checks the manager's invariants and its policy's.
    pub fn validate(&self) -> Result<(), String> {
        self.policy.validate()?;
        let n = self.table.num_chunks();
        let resident = self.table.num_resident();
        if resident != self.policy.len() + self.deferred.len() {
            return Err(format!(
                "{resident} chunks allocated, policy holds {} and {} are deferred",
                self.policy.len(),
                self.deferred.len()
            ));
        }
        if let Some(c) = self
            .deferred
            .iter()
            .find(|&&c| self.table.record(c).ref_cnt() != PENDING)
        {
            return Err(format!("deferred chunk {c} is not write-pending"));
        }
        let (mut evictable, mut pending, mut used) = (0, 0, 0);
        for (id, r) in self.table.records().iter().enumerate() {
            let cnt = r.ref_cnt();
            if usize::try_from(r.chunk_id()).ok() != Some(id) {
                return Err(format!("record {id} has the wrong chunk id"));
            }
            match cnt {
                FREE => {}
                PENDING => pending += 1,
                0 => evictable += 1,
                c if c > 0 => {}
                c => return Err(format!("chunk {id} has ref_cnt {c}")),
            }
            if cnt != FREE {
                used += 1;
            }
        }
        if used != resident {
            return Err(format!("{used} records in use, {resident} chunks resident"));
        }
        if evictable != self.num_evictable || pending != self.num_write_pending {
            return Err(format!(
                "counts evictable {}/{evictable}, pending {}/{pending} disagree with the table",
                self.num_evictable, self.num_write_pending
            ));
        }
        if self.table.num_free() + resident != n {
            return Err("free and resident chunks do not add up".into());
        }
        Ok(())
    }
}
