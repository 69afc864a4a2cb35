//! Cache keys: owned byte strings with inline storage, hashed once per operation.
//!
//! vLLM's `OffloadKey` is a block hash followed by a 4-byte big-endian KV-cache group index
//! (36 bytes with the default 32-byte hashes). Keys of any length work; keys up to
//! [`INLINE_KEY_BYTES`] bytes live inline in the entry (no allocation, one cache line with the
//! entry's links), longer ones spill to the heap.
//!
//! Hashing uses `foldhash`: it is the hasher `hashbrown` itself defaults to, it hashes a
//! 36-byte key in a handful of cycles, and its per-process random seed keeps the table safe
//! against inputs chosen to collide (block hashes come from user prompts).

use std::fmt;
use std::hash::BuildHasher;

/// Longest key stored without a heap allocation.
pub const INLINE_KEY_BYTES: usize = 38;

/// An owned cache key. 40 bytes; keys up to [`INLINE_KEY_BYTES`] long are stored inline.
#[derive(Clone)]
pub enum KeyBuf {
    Inline {
        len: u8,
        bytes: [u8; INLINE_KEY_BYTES],
    },
    Heap(Box<[u8]>),
}

impl KeyBuf {
    pub(crate) fn new(key: &[u8]) -> Self {
        if key.len() <= INLINE_KEY_BYTES {
            let mut bytes = [0u8; INLINE_KEY_BYTES];
            copy_short(&mut bytes, key);
            KeyBuf::Inline {
                len: inline_len(key),
                bytes,
            }
        } else {
            KeyBuf::Heap(key.into())
        }
    }

    /// The empty key: a placeholder for an entry whose key is then written in place
    /// ([`assign`](Self::assign)).
    pub(crate) const EMPTY: KeyBuf = KeyBuf::Inline {
        len: 0,
        bytes: [0; INLINE_KEY_BYTES],
    };

    /// Replaces the key with `key`, writing the bytes where the entry already lives. Building
    /// a key on the stack and moving it into place instead makes the move re-read bytes just
    /// written in other widths, which stalls store forwarding on every entry created.
    #[inline]
    pub(crate) fn assign(&mut self, key: &[u8]) {
        match self {
            KeyBuf::Inline { len, bytes } if key.len() <= INLINE_KEY_BYTES => {
                copy_short(bytes, key);
                *len = inline_len(key);
            }
            _ => *self = KeyBuf::new(key),
        }
    }

    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        match self {
            KeyBuf::Inline { len, bytes } => &bytes[..*len as usize],
            KeyBuf::Heap(b) => b,
        }
    }

    /// Heap bytes owned by this key beyond its inline size (for memory accounting).
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            KeyBuf::Inline { .. } => 0,
            KeyBuf::Heap(b) => b.len(),
        }
    }
}

/// The length of a key short enough to live inline.
#[inline(always)]
#[allow(
    clippy::cast_possible_truncation,
    reason = "inline keys are at most INLINE_KEY_BYTES < 256 long"
)]
fn inline_len(key: &[u8]) -> u8 {
    debug_assert!(key.len() <= INLINE_KEY_BYTES);
    key.len() as u8
}

/// `dst[..src.len()] = src` for `src.len() <= dst.len()`, as fixed-size 16-byte moves (the
/// head, the middle, and an overlapping tail) rather than a call to `memcpy` for the usual
/// 36-byte key: this runs for every entry and request key created.
#[inline(always)]
fn copy_short(dst: &mut [u8; INLINE_KEY_BYTES], src: &[u8]) {
    let n = src.len();
    if n < 16 {
        dst[..n].copy_from_slice(src);
        return;
    }
    dst[..16].copy_from_slice(&src[..16]);
    if n > 32 {
        dst[16..32].copy_from_slice(&src[16..32]);
    }
    dst[n - 16..n].copy_from_slice(&src[n - 16..]);
}

impl PartialEq for KeyBuf {
    fn eq(&self, other: &Self) -> bool {
        key_eq(self.as_slice(), other.as_slice())
    }
}

/// Byte equality for keys, inlined: word compares (the last word overlapping the tail) instead
/// of a call to `memcmp`, which costs more than the compare itself for 36-byte keys.
#[inline]
pub fn key_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n < 8 {
        return a == b;
    }
    let word = |s: &[u8], i: usize| u64::from_ne_bytes(s[i..i + 8].try_into().expect("8 bytes"));
    let mut i = 0;
    while i + 8 < n {
        if word(a, i) != word(b, i) {
            return false;
        }
        i += 8;
    }
    word(a, n - 8) == word(b, n - 8)
}
impl Eq for KeyBuf {}

impl fmt::Debug for KeyBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key(")?;
        for b in self.as_slice() {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

/// The hash of a key, computed once and reused by every table the key is looked up in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyHash(pub u64);

/// Seeds key hashing. One per process, so hashes computed by one structure (a manager) can be
/// reused to probe another (its policy, its access tracker).
#[derive(Clone)]
pub struct KeyHasher(foldhash::fast::FixedState);

impl KeyHasher {
    /// The process-wide hasher (seeded randomly once per process).
    pub fn global() -> Self {
        use std::sync::OnceLock;
        static SEED: OnceLock<u64> = OnceLock::new();
        let seed = *SEED.get_or_init(|| {
            use std::hash::{BuildHasher, Hasher};
            // RandomState draws from the OS once per process.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(0x006b_7663_6163_6865);
            h.finish()
        });
        KeyHasher(foldhash::fast::FixedState::with_seed(seed))
    }

    #[inline]
    pub(crate) fn hash(&self, key: &[u8]) -> KeyHash {
        KeyHash(self.0.hash_one(key))
    }
}

impl Default for KeyHasher {
    fn default() -> Self {
        Self::global()
    }
}

/// A borrowed key with its hash: what every lookup takes.
#[derive(Clone, Copy, Debug)]
pub struct Key<'a> {
    pub bytes: &'a [u8],
    pub hash: KeyHash,
}

impl<'a> Key<'a> {
    #[inline]
    pub fn new(hasher: &KeyHasher, bytes: &'a [u8]) -> Self {
        Key {
            bytes,
            hash: hasher.hash(bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_heap_round_trip() {
        for len in [0usize, 1, 36, INLINE_KEY_BYTES, INLINE_KEY_BYTES + 1, 100] {
            let key: Vec<u8> = (0..=255u8).cycle().take(len).collect();
            let buf = KeyBuf::new(&key);
            assert_eq!(buf.as_slice(), &key[..]);
            assert_eq!(matches!(buf, KeyBuf::Heap(_)), len > INLINE_KEY_BYTES);
        }
        assert_eq!(std::mem::size_of::<KeyBuf>(), 40);
    }

    #[test]
    fn assign_writes_every_length_in_place() {
        let long: Vec<u8> = (0..100u8).map(|i| i.wrapping_mul(37)).collect();
        for len in 0..=INLINE_KEY_BYTES + 2 {
            let key = &long[..len];
            assert_eq!(KeyBuf::new(key).as_slice(), key, "new, length {len}");
            // Over a longer key, a shorter one, the empty key and a spilled one alike.
            for before in [&long[..INLINE_KEY_BYTES], &long[..3], &[][..], &long[..]] {
                let mut buf = KeyBuf::new(before);
                buf.assign(key);
                assert_eq!(buf.as_slice(), key, "assign {len} over {}", before.len());
                assert_eq!(buf, KeyBuf::new(key));
            }
        }
        assert_eq!(KeyBuf::EMPTY.as_slice(), b"");
    }

    #[test]
    fn key_eq_matches_slice_equality() {
        for n in [0usize, 1, 7, 8, 9, 15, 16, 17, 35, 36, 37, 64] {
            let a: Vec<u8> = (0..=255u8).take(n).collect();
            assert!(key_eq(&a, &a.clone()));
            for i in 0..n {
                let mut b = a.clone();
                b[i] ^= 1;
                assert!(!key_eq(&a, &b), "length {n}, byte {i}");
            }
            assert!(!key_eq(&a, &a[..n.saturating_sub(1)]) || n == 0);
        }
    }

    #[test]
    fn hashing_is_deterministic_within_a_process() {
        let h = KeyHasher::global();
        assert_eq!(h.hash(b"abc"), KeyHasher::global().hash(b"abc"));
        assert_ne!(h.hash(b"abc"), h.hash(b"abd"));
    }
}
