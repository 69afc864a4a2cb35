use super::super::{GroupRef, HostGeometry, LayerGeometry, TransferLayout};
use super::HostError;
use proptest::prelude::*;

fn layer(base: u64, stride: u64, page: u64, n: u64) -> LayerGeometry {
    LayerGeometry {
        base,
        block_stride: stride,
        page_bytes: page,
        num_blocks: n,
        segment: base,
    }
}

fn w(x: usize) -> u64 {
    u64::try_from(x).expect("fits in u64")
}

fn r(tensor: usize, bytes: u64) -> GroupRef {
    GroupRef { tensor, bytes }
}

/// Two tensors (the second smaller, with padded blocks) and the given groups over them.
fn over_two_tensors(groups: Vec<Vec<GroupRef>>) -> TransferLayout {
    let layers = vec![layer(1 << 20, 64, 64, 10), layer(1 << 30, 96, 64, 6)];
    TransferLayout::with_groups(
        layers,
        vec![0, 128],
        groups,
        2,
        HostGeometry {
            base: 1 << 40,
            num_chunks: 4,
            chunk_stride: 256,
            split_bytes: 0,
        },
    )
    .unwrap()
}

/// Two groups: one referencing both tensors, the other the first tensor twice (a repeated
/// reference, as vLLM's packed layouts give).
fn two_groups() -> TransferLayout {
    over_two_tensors(vec![vec![r(0, 64), r(1, 48)], vec![r(0, 32), r(0, 64)]])
}

/// What vLLM's `resolve_device_pointers` produces for `ids` (group after group).
fn resolve(lay: &TransferLayout, ids: &[i64], counts: &[usize]) -> (Vec<u64>, Vec<u64>) {
    let (mut ptrs, mut sizes, mut at) = (vec![], vec![], 0);
    for (group, &n) in lay.groups.iter().zip(counts) {
        for r in &group.given {
            let l = &lay.layers[r.tensor];
            for &b in &ids[at..at + n] {
                ptrs.push(l.base + u64::try_from(b).unwrap() * l.block_stride);
                sizes.push(r.bytes);
            }
        }
        at += n;
    }
    (ptrs, sizes)
}

fn decode(
    lay: &TransferLayout,
    ptrs: &[u64],
    sizes: &[u64],
    counts: &[u64],
) -> Result<Vec<i64>, HostError> {
    let refs: Vec<u64> = lay.groups.iter().map(|g| w(g.given.len())).collect();
    lay.block_ids_from_pointers(ptrs, sizes, counts, &refs)
}

#[test]
fn resolved_pointers_give_back_their_block_ids() {
    let lay = two_groups();
    let ids = [5, 0, 3, 3, 9, 0];
    let (ptrs, sizes) = resolve(&lay, &ids, &[3, 3]);
    assert_eq!(decode(&lay, &ptrs, &sizes, &[3, 3]).unwrap(), ids);
    // An empty group takes no pointers.
    let (ptrs, sizes) = resolve(&lay, &ids[..3], &[0, 3]);
    assert_eq!(decode(&lay, &ptrs, &sizes, &[0, 3]).unwrap(), &ids[..3]);
    assert_eq!(decode(&lay, &[], &[], &[0, 0]).unwrap(), Vec::<i64>::new());
}

#[test]
fn the_counts_say_what_the_arrays_must_hold_before_any_is_read() {
    let lay = two_groups();
    let need = lay.pointer_counts(&[3, 2], &[2, 2]).unwrap();
    assert_eq!((need.pointers, need.blocks), (3 * 2 + 2 * 2, 5));
    assert!(need.check_lengths(10, 10).is_ok());
    for (p, s) in [(9, 10), (10, 11), (1 << 40, 1 << 40)] {
        assert!(matches!(
            need.check_lengths(p, s),
            Err(HostError::Mismatch(_))
        ));
    }
    // Counts that disagree with the layout are refused without any array at all.
    for (c, rc) in [
        (&[3u64][..], &[2u64][..]),
        (&[3, 2], &[2, 1]),
        (&[u64::MAX, 0], &[2, 2]),
    ] {
        assert!(matches!(
            lay.pointer_counts(c, rc),
            Err(HostError::Mismatch(_))
        ));
    }
}

#[test]
fn every_bad_pointer_job_is_refused() {
    let lay = two_groups();
    let ids = [5, 1, 3];
    let (ptrs, sizes) = resolve(&lay, &ids, &[3, 0]);
    let refs = [2u64, 2];
    let mismatch = |p: &[u64], s: &[u64], c: &[u64], rc: &[u64]| {
        matches!(
            lay.block_ids_from_pointers(p, s, c, rc),
            Err(HostError::Mismatch(_))
        )
    };
    let outside = |p: &[u64]| {
        matches!(
            lay.block_ids_from_pointers(p, &sizes, &[3, 0], &refs),
            Err(HostError::PointerOutOfRange { .. })
        )
    };
    let with = |i: usize, v: u64| {
        let mut p = ptrs.clone();
        p[i] = v;
        p
    };
    // Out of its tensor: before it, past its last block, in the other tensor, at 0.
    assert!(outside(&with(0, (1 << 20) - 64)));
    assert!(outside(&with(1, (1 << 20) + 10 * 64)));
    assert!(outside(&with(2, 0)));
    assert!(
        outside(&with(4, (1 << 20) + 64)),
        "tensor 0's block in tensor 1's slot"
    );
    assert!(outside(&with(5, u64::MAX)));
    // Inside, not at a block start; a block the first reference does not name.
    assert!(mismatch(&with(0, (1 << 20) + 65), &sizes, &[3, 0], &refs));
    assert!(mismatch(
        &with(4, (1 << 30) + 96 + 8),
        &sizes,
        &[3, 0],
        &refs
    ));
    assert!(mismatch(
        &with(3, (1 << 30) + 2 * 96),
        &sizes,
        &[3, 0],
        &refs
    ));
    // Both references name block 7, which the second tensor (6 blocks) does not have; with
    // only the first changed, the two disagree.
    let (big, _) = resolve(&lay, &[5, 1, 7], &[3, 0]);
    assert!(outside(&big));
    assert!(mismatch(&with(2, big[2]), &sizes, &[3, 0], &refs));
    // Sizes other than the reference's bytes.
    let mut s = sizes.clone();
    s[4] = 64;
    assert!(mismatch(&ptrs, &s, &[3, 0], &refs));
    // Counts that do not match the layout or the arrays.
    assert!(mismatch(&ptrs, &sizes, &[3], &[2]));
    assert!(mismatch(&ptrs, &sizes, &[3, 0], &[1, 2]));
    assert!(mismatch(&ptrs, &sizes, &[3, 0], &[2, 3]));
    assert!(mismatch(&ptrs, &sizes, &[2, 0], &refs));
    assert!(mismatch(&ptrs, &sizes, &[3, 1], &refs));
    assert!(mismatch(&ptrs, &sizes[..5], &[3, 0], &refs));
    assert!(mismatch(&ptrs, &sizes, &[u64::MAX, 0], &refs));
    assert!(mismatch(&ptrs, &sizes, &[u64::MAX / 2 + 1, 1], &refs));
    assert!(decode(&lay, &ptrs, &sizes, &[3, 0]).is_ok());
}

proptest! {
    /// Any block ids round-trip; any single changed pointer or size is refused, unless the
    /// change makes it the same valid pointer.
    #[test]
    fn one_changed_pointer_is_refused(
        ids in proptest::collection::vec(0i64..6, 0..12),
        split in 0usize..12,
        at in any::<prop::sample::Index>(),
        delta in prop_oneof![Just(1u64), Just(8), Just(64), Just(96), Just(1 << 20), any::<u64>()],
        in_sizes in any::<bool>(),
    ) {
        prop_assume!(delta != 0);
        let lay = two_groups();
        let split = split.min(ids.len());
        let counts = [split, ids.len() - split];
        let (ptrs, sizes) = resolve(&lay, &ids, &counts);
        let c = [w(split), w(ids.len() - split)];
        prop_assert_eq!(decode(&lay, &ptrs, &sizes, &c).unwrap(), ids.clone());
        if ptrs.is_empty() {
            return Ok(());
        }
        let i = at.index(ptrs.len());
        let (mut p, mut s) = (ptrs.clone(), sizes.clone());
        if in_sizes {
            s[i] = s[i].wrapping_add(delta);
        } else {
            p[i] = p[i].wrapping_add(delta);
        }
        prop_assert!(decode(&lay, &p, &s, &c).is_err());
    }
}

proptest! {
    #[test]
    fn the_reciprocal_divides_exactly(
        x in prop_oneof![any::<u64>(), 0u64..1 << 20, Just(u64::MAX)],
        d in prop_oneof![1u64..1 << 20, any::<u64>().prop_map(|d| d.max(1)), Just(u64::MAX)],
    ) {
        prop_assert_eq!(super::Reciprocal::new(d).quotient(x), x / d);
    }
}

#[test]
fn the_reciprocal_divides_exactly_at_the_edges() {
    for d in [
        1,
        2,
        3,
        7,
        64,
        96,
        4096,
        1 << 32,
        (1 << 63) - 1,
        1 << 63,
        u64::MAX,
    ] {
        let r = super::Reciprocal::new(d);
        for x in [0, 1, d - 1, d, d.wrapping_add(1), u64::MAX - 1, u64::MAX] {
            assert_eq!(r.quotient(x), x / d, "{x} / {d}");
        }
    }
}

/// The first group of `two_groups`, plus a group without references (a pipeline stage that
/// holds none of its layers: vLLM passes its block count and no pointers).
fn with_empty_group() -> TransferLayout {
    over_two_tensors(vec![vec![r(0, 64), r(1, 48)], vec![]])
}

#[test]
fn a_group_without_references_gets_placeholders_up_to_the_pools_capacity() {
    let lay = with_empty_group();
    let ids = [5, 1, 3];
    let (ptrs, sizes) = resolve(&lay, &ids, &[3, 0]);
    assert_eq!(
        lay.block_ids_from_pointers(&ptrs, &sizes, &[3, 2], &[2, 0])
            .unwrap(),
        [5, 1, 3, 0, 0]
    );
    // Only the empty group: its blocks are placeholders (this used to index its missing
    // first reference and panic).
    assert_eq!(
        lay.block_ids_from_pointers(&[], &[], &[0, 8], &[2, 0])
            .unwrap(),
        [0; 8]
    );
    // More blocks than 4 chunks of 2 can hold: refused before anything is allocated (a
    // count of 2**40 used to size an 8 TiB allocation and abort the process).
    for blocks in [9, 1 << 40, u64::MAX >> 1, u64::MAX] {
        assert!(
            matches!(
                lay.block_ids_from_pointers(&[], &[], &[0, blocks], &[2, 0]),
                Err(HostError::Mismatch(_))
            ),
            "{blocks} blocks"
        );
    }
}

#[test]
fn placeholders_of_a_group_without_references_may_repeat_in_a_load() {
    use super::super::{Direction, GroupSpan, PlanScratch};
    let lay = with_empty_group();
    let mut scratch = PlanScratch::default();
    let spans = vec![
        GroupSpan {
            blocks: 2,
            first_index: 0,
        },
        GroupSpan {
            blocks: 3,
            first_index: 0,
        },
    ];
    let req = lay
        .validate(
            Direction::Load,
            vec![4, 5, 0, 0, 0],
            vec![0, 1, 2],
            spans.clone(),
            &mut scratch,
        )
        .unwrap();
    // Nothing of the empty group is copied.
    assert_eq!(req.pages(), 4);
    // A group with references still may not write a block twice.
    assert!(matches!(
        lay.validate(
            Direction::Load,
            vec![4, 4, 0, 0, 0],
            vec![0, 1, 2],
            spans,
            &mut scratch
        ),
        Err(HostError::DuplicateDestination { .. })
    ));
}
