//! The runs a plan is built into: parallel arrays of source address, destination address and
//! length, accumulated by [`RunBuilder`] (which merges a page into the open run when it
//! continues it on both sides).

use super::{HostError, HostResult};

/// A finished plan: parallel arrays of source address, destination address and length.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CopyRuns {
    src: Vec<u64>,
    dst: Vec<u64>,
    len: Vec<u64>,
    /// OR of every address and length: its lowest set bit is the common alignment.
    or_bits: u64,
    max_len: u64,
}

impl CopyRuns {
    pub fn src(&self) -> &[u64] {
        &self.src
    }
    pub fn dst(&self) -> &[u64] {
        &self.dst
    }
    pub fn lens(&self) -> &[u64] {
        &self.len
    }
    /// Number of runs (copy descriptors) after coalescing.
    pub fn len(&self) -> usize {
        self.len.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len.is_empty()
    }
    pub fn max_run_bytes(&self) -> u64 {
        self.max_len
    }
    /// Largest power of two dividing every address and length (`1 << 63` for an empty plan).
    pub fn alignment(&self) -> u64 {
        if self.or_bits == 0 {
            1 << 63
        } else {
            1 << self.or_bits.trailing_zeros()
        }
    }

    /// Number of descriptors when every run is cut into pieces of at most `max_piece` bytes
    /// (`0`: no cutting). GPU kernels share work per descriptor, so one long run would
    /// otherwise keep a single program busy while the others idle.
    pub fn count_pieces(&self, max_piece: u64) -> usize {
        if max_piece == 0 {
            return self.len();
        }
        self.len
            .iter()
            .map(|&l| usize::try_from(l.div_ceil(max_piece)).unwrap_or(usize::MAX))
            .fold(0usize, usize::saturating_add)
    }

    /// Writes the descriptors (runs cut as in [`Self::count_pieces`]) into `out` as the signed
    /// 64-bit integers GPU kernels index with: all sources, then all destinations, then all
    /// lengths. `out` must hold exactly `3 * count_pieces(max_piece)` entries.
    pub fn write_soa(&self, max_piece: u64, out: &mut [i64]) -> HostResult<()> {
        let n = self.count_pieces(max_piece);
        if Some(out.len()) != n.checked_mul(3) {
            return Err(HostError::Mismatch(format!(
                "descriptor buffer holds {} entries, expected 3 * {n}",
                out.len()
            )));
        }
        let signed = |v: u64| i64::try_from(v).map_err(|_| HostError::Unaddressable { value: v });
        let (s, rest) = out.split_at_mut(n);
        let (d, l) = rest.split_at_mut(n);
        let step = if max_piece == 0 { u64::MAX } else { max_piece };
        let mut i = 0;
        for ((&src, &dst), &len) in self.src.iter().zip(&self.dst).zip(&self.len) {
            let mut off = 0;
            while off < len {
                let piece = step.min(len - off);
                s[i] = signed(src + off)?;
                d[i] = signed(dst + off)?;
                l[i] = signed(piece)?;
                i += 1;
                off += piece;
            }
        }
        Ok(())
    }
}

/// Accumulates runs; the open run lives in locals so the hot loop touches no vector.
pub(super) struct RunBuilder {
    out: CopyRuns,
    src: u64,
    dst: u64,
    len: u64,
}

impl RunBuilder {
    pub(super) fn new(pages: usize) -> Self {
        // Enough for a fully scattered request (pages come from validated id arrays times the
        // layout's tensor count), capped: coalesced requests need far fewer.
        let cap = pages.min(1 << 20);
        RunBuilder {
            out: CopyRuns {
                src: Vec::with_capacity(cap),
                dst: Vec::with_capacity(cap),
                len: Vec::with_capacity(cap),
                ..CopyRuns::default()
            },
            src: 0,
            dst: 0,
            len: 0,
        }
    }

    #[inline(always)]
    pub(super) fn push(&mut self, src: u64, dst: u64, len: u64, mergeable: bool) {
        if mergeable && self.len != 0 && self.src + self.len == src && self.dst + self.len == dst {
            self.len += len;
        } else {
            self.flush();
            self.src = src;
            self.dst = dst;
            self.len = len;
        }
    }

    #[inline(always)]
    fn flush(&mut self) {
        if self.len != 0 {
            self.out.src.push(self.src);
            self.out.dst.push(self.dst);
            self.out.len.push(self.len);
            self.out.or_bits |= self.src | self.dst | self.len;
            self.out.max_len = self.out.max_len.max(self.len);
        }
    }

    pub(super) fn finish(mut self) -> CopyRuns {
        self.flush();
        self.out
    }
}
