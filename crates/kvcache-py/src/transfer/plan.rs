//! `_core.TransferLayout` (validated geometry) and `_core.Plan` (one job's copy runs).

use std::borrow::Cow;
use std::sync::{Arc, Mutex, OnceLock};

use kvcache_core::host::{
    CopyGuard, CopyRuns, Direction, GroupRef, GroupSpan, HostError, HostGeometry, HostRegion,
    LayerGeometry, Lease, PlanScratch, Request, TransferLayout,
};
use numpy::{
    PyArray1, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods,
};
use pyo3::buffer::PyBuffer;
use pyo3::ffi;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyIterator, PyString, PyTuple};
use pyo3::PyTraverseError;

use super::ids::{id_vec, native_order, small_ints};
use super::pool::PyHostChunkPool;
use crate::conversion::{count, int_in_range, type_name, Drain, MAX_ITEMS};
use crate::errors::{typed, IntoPyResult};

/// `(device base, block stride, segment offset, page slot bytes, bytes copied)`.
type RefRow = (u64, u64, u64, u64, u64);

/// Requests with at least this many ids are validated with the GIL released.
const DETACH_IDS: usize = 4096;

/// What a plan needs to stay valid: the geometry, the pool mapping, and (CPU layers) the
/// buffers that keep the layer memory alive.
pub(crate) struct LayoutShared {
    layout: TransferLayout,
    region: Arc<HostRegion>,
    /// One exported buffer per layer when the layers are host memory (the CPU path); empty
    /// for device layers. Holding the export keeps the memory alive and in place.
    host_buffers: Vec<PyBuffer<u8>>,
}

impl LayoutShared {
    pub(crate) fn is_host(&self) -> bool {
        !self.host_buffers.is_empty()
    }
}

#[pyclass(module = "kvcache._core", name = "TransferLayout", frozen)]
pub struct PyTransferLayout {
    shared: Arc<LayoutShared>,
    scratch: Mutex<PlanScratch>,
    /// The pool whose region `shared` uses: a layout that can still plan keeps its pool
    /// reachable, so the collector never releases a buffer the pool borrowed while a layout
    /// over it lives (see `PyHostChunkPool::__traverse__`).
    pool: Py<PyHostChunkPool>,
}

fn to_u64(v: isize, what: &str, index: usize) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| {
        typed(
            |e| &e.invalid_argument,
            format!("layer {index}: negative {what}"),
        )
    })
}

fn host_layer(buf: &PyBuffer<u8>, index: usize, segment: u64) -> PyResult<LayerGeometry> {
    let bad = |why: &str| typed(|e| &e.invalid_argument, format!("layer {index}: {why}"));
    if buf.dimensions() != 2 {
        return Err(bad("expected a 2-d (blocks, page bytes) byte buffer"));
    }
    if buf.readonly() {
        return Err(bad("the buffer is read-only"));
    }
    let (shape, strides) = (buf.shape(), buf.strides());
    let blocks = u64::try_from(shape[0]).map_err(|_| bad("too many blocks"))?;
    let page = u64::try_from(shape[1]).map_err(|_| bad("page too large"))?;
    if shape[1] > 1 && strides[1] != 1 {
        return Err(bad("pages must be contiguous"));
    }
    let stride = to_u64(strides[0], "block stride", index)?;
    if blocks > 1 && stride < page {
        return Err(bad("blocks overlap"));
    }
    let base = u64::try_from(buf.buf_ptr().expose_provenance()).map_err(|_| bad("address"))?;
    Ok(LayerGeometry {
        base,
        // With one block the stride is irrelevant; make it valid for the checks.
        block_stride: if blocks > 1 { stride } else { page },
        page_bytes: page,
        num_blocks: blocks,
        segment,
    })
}

fn blocks_per_chunk_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    count(obj, "blocks_per_chunk")
}

/// The items of an iterable argument, with a type error naming it otherwise. With a `drain`,
/// its length is checked against the drain's bound first (named `bound`, the argument).
fn items<'py>(
    drain: Option<(&Drain<'py>, &str)>,
    obj: &Bound<'py, PyAny>,
    what: &str,
    expected: &str,
) -> PyResult<Bound<'py, PyIterator>> {
    let refuse = || {
        typed(
            |e| &e.invalid_type,
            format!("{what} must be {expected}, got {}", type_name(obj)),
        )
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(refuse());
    }
    match drain {
        Some((drain, bound)) => drain.iter(obj, bound, refuse),
        None => obj.try_iter().map_err(|_| refuse()),
    }
}

/// An integer entry of `groups` or `offsets`: an int or any integer type (`__index__`, e.g. a
/// numpy integer), never a bool or a float.
fn index_in_range<T: TryFrom<i128>>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<T> {
    let range = ">= 0 and < 2**64";
    if obj.is_instance_of::<PyInt>() || obj.is_instance_of::<PyBool>() {
        return int_in_range(obj, what, range);
    }
    // SAFETY: `obj` is a live object; `PyNumber_Index` returns a new reference or NULL with an
    // exception set.
    let index =
        unsafe { Bound::from_owned_ptr_or_err(obj.py(), ffi::PyNumber_Index(obj.as_ptr())) };
    match index {
        Ok(int) => int_in_range(&int, what, range),
        // Not an integer type: the error names the type given.
        Err(_) => int_in_range(obj, what, range),
    }
}

/// `groups`: per KV-cache group, `(layer index, bytes per block)` pairs of ints. The groups
/// and all their pairs count against one bound ([`Drain`]).
fn group_refs(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<GroupRef>>> {
    let mut drain = Drain::new(obj.py());
    let mut groups = Vec::new();
    let expected = "a sequence of groups";
    let groups_of = items(Some((&drain, "groups")), obj, "groups", expected)?;
    for (g, group) in groups_of.enumerate() {
        let group = group?;
        let mut refs = Vec::new();
        let what = format!("groups[{g}]");
        let pairs = "a sequence of (layer index, bytes) pairs";
        for (r, pair) in items(Some((&drain, "groups")), &group, &what, pairs)?.enumerate() {
            let pair = pair?;
            let what = format!("groups[{g}][{r}]");
            // At most one item more than a pair is read: enough to refuse it.
            let fields: Vec<_> = items(None, &pair, &what, "a (layer index, bytes) pair")?
                .take(3)
                .collect::<PyResult<_>>()?;
            let [tensor, bytes] = fields.as_slice() else {
                return Err(typed(
                    |e| &e.invalid_argument,
                    format!("{what} must be a (layer index, bytes) pair"),
                ));
            };
            let group_ref = GroupRef {
                tensor: index_in_range(tensor, &format!("{what}[0] (layer index)"))?,
                bytes: index_in_range(bytes, &format!("{what}[1] (bytes per block)"))?,
            };
            drain.push(&mut refs, group_ref, "groups")?;
        }
        drain.push(&mut groups, refs, "groups")?;
    }
    Ok(groups)
}

/// `offsets`: each layer's segment offset inside a chunk, in bytes.
fn segment_offsets(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let mut drain = Drain::new(obj.py());
    let mut offsets = Vec::new();
    let offsets_of = items(
        Some((&drain, "offsets")),
        obj,
        "offsets",
        "a sequence of ints",
    )?;
    for (i, o) in offsets_of.enumerate() {
        let offset = index_in_range(&o?, &format!("offsets[{i}]"))?;
        drain.push(&mut offsets, offset, "offsets")?;
    }
    Ok(offsets)
}

/// `layers`, read by a [`Drain`] (pyo3's `Vec` would size itself by `__len__`).
fn layers_arg<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
    crate::conversion::items(obj, "layers")
}

/// A caller's output buffer: writable int64 memory in native byte order.
fn out_buffer(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<PyBuffer<i64>> {
    let refuse = || {
        typed(
            |e| &e.invalid_type,
            format!(
                "{what} must be a writable native-order int64 buffer (e.g. a numpy array), \
                 got {}",
                type_name(obj)
            ),
        )
    };
    let buf = PyBuffer::<i64>::get(obj).map_err(|_| refuse())?;
    if !native_order(buf.format().to_bytes()) {
        return Err(refuse());
    }
    if buf.readonly() {
        return Err(typed(
            |e| &e.invalid_argument,
            format!("{what} is read-only"),
        ));
    }
    Ok(buf)
}

/// A 1-d uint64 numpy array, read in place when it is contiguous and aligned (as vLLM's
/// are), else copied through the buffer protocol, which handles any strides. Its length is
/// the array's word: a zero-stride view claims any length over eight bytes, so a caller checks
/// it ([`Words::len`]) before anything is copied.
struct Words<'py> {
    view: PyReadonlyArray1<'py, u64>,
    obj: Bound<'py, PyAny>,
    what: &'static str,
}

impl Words<'_> {
    fn len(&self) -> usize {
        self.view.len()
    }

    /// The words, borrowed, or copied into memory the allocator may refuse
    /// (`OutOfMemoryError`).
    fn get(&self) -> PyResult<Cow<'_, [u64]>> {
        if let Ok(slice) = self.view.as_slice() {
            return Ok(Cow::Borrowed(slice));
        }
        let buf = PyBuffer::<u64>::get(&self.obj)?;
        let n = buf.item_count();
        let mut out = Vec::new();
        out.try_reserve_exact(n).map_err(|_| {
            typed(
                |e| &e.out_of_memory,
                format!("not enough memory to copy {} ({n} entries)", self.what),
            )
        })?;
        out.resize(n, 0);
        buf.copy_to_slice(self.obj.py(), &mut out)?;
        Ok(Cow::Owned(out))
    }
}

/// `obj` as [`Words`]: exactly a 1-d numpy array of native uint64 (what vLLM's
/// `DevicePointers` hold); anything else is refused with `InvalidTypeError`, a byte-swapped
/// or otherwise foreign dtype included, since its values would be read as other addresses.
fn words<'py>(what: &'static str, obj: &Bound<'py, PyAny>) -> PyResult<Words<'py>> {
    let refuse = || {
        typed(
            |e| &e.invalid_type,
            format!(
                "{what} must be a 1-d numpy uint64 array, got {}",
                type_name(obj)
            ),
        )
    };
    let array = obj.cast::<PyArray1<u64>>().map_err(|_| refuse())?;
    if !array.dtype().is_equiv_to(&numpy::dtype::<u64>(obj.py())) {
        return Err(refuse());
    }
    let view = array.try_readonly().map_err(|_| {
        typed(
            |e| &e.invalid_argument,
            format!("{what} is being written elsewhere"),
        )
    })?;
    Ok(Words {
        view,
        obj: obj.clone(),
        what,
    })
}

fn piece_bytes_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int_in_range(obj, "max_piece_bytes", ">= 0 and < 2**64")
}

fn group_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    count(obj, "group")
}

fn store_arg(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    obj.extract::<crate::conversion::Flag>().map(|f| f.0)
}

fn pool_arg<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyHostChunkPool>> {
    obj.cast::<PyHostChunkPool>().cloned().map_err(|_| {
        typed(
            |e| &e.invalid_type,
            format!("pool must be a HostChunkPool, got {}", type_name(obj)),
        )
    })
}

/// Field `at` of layer tuple `layer` (number `index`): an int from 0 to 2**64 - 1.
fn layer_field(layer: &Bound<'_, PyTuple>, index: usize, at: usize, what: &str) -> PyResult<u64> {
    let value = layer.get_item(at)?;
    int_in_range(
        &value,
        &format!("layers[{index}] {what}"),
        ">= 0 and < 2**64",
    )
}

#[pymethods]
impl PyTransferLayout {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    /// `layers`: for host memory (CPU tensors), `(buffer, segment)` with a 2-d writable byte
    /// buffer of shape `(blocks, page bytes)`; for device memory, the integers
    /// `(base, block_stride, page_bytes, num_blocks, segment)`. `segment` names the allocation
    /// the layer lives in. All layers must be of the same kind.
    ///
    /// Without `groups` and `offsets`: one group copying every layer's whole page, layers back
    /// to back in a chunk of exactly `pool.chunk_bytes` bytes. `groups` lists, per KV-cache
    /// group, `(layer index, bytes per block)` references (a padded page copies its payload
    /// only); `offsets` gives each layer's segment offset inside a chunk (default: back to
    /// back). Every segment must fit in `pool.chunk_bytes`.
    #[new]
    #[pyo3(signature = (pool, layers, blocks_per_chunk, groups=None, offsets=None))]
    fn new(
        #[pyo3(from_py_with = pool_arg)] pool: Bound<'_, PyHostChunkPool>,
        #[pyo3(from_py_with = layers_arg)] layers: Vec<Bound<'_, PyTuple>>,
        #[pyo3(from_py_with = blocks_per_chunk_arg)] blocks_per_chunk: usize,
        groups: Option<Bound<'_, PyAny>>,
        offsets: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        // Read in full before anything else: a bad entry raises naming where it is.
        let groups = groups
            .filter(|g| !g.is_none())
            .map(|g| group_refs(&g))
            .transpose()?;
        let offsets = offsets
            .filter(|o| !o.is_none())
            .map(|o| segment_offsets(&o))
            .transpose()?;
        let pool_ref = pool.clone().unbind();
        let pool = pool.get();
        let region = Arc::clone(&pool.region);
        if region.is_closed() {
            return Err(HostError::Closed).py_err();
        }
        let mut geoms = Vec::with_capacity(layers.len());
        let mut buffers = Vec::new();
        for (i, t) in layers.iter().enumerate() {
            match t.len() {
                2 => {
                    let buf = PyBuffer::<u8>::get(&t.get_item(0)?).map_err(|e| {
                        typed(
                            |e| &e.invalid_type,
                            format!("layer {i}: not a byte buffer: {e}"),
                        )
                    })?;
                    let segment = layer_field(t, i, 1, "segment")?;
                    geoms.push(host_layer(&buf, i, segment)?);
                    buffers.push(buf);
                }
                5 => {
                    geoms.push(LayerGeometry {
                        base: layer_field(t, i, 0, "base")?,
                        block_stride: layer_field(t, i, 1, "block stride")?,
                        page_bytes: layer_field(t, i, 2, "page bytes")?,
                        num_blocks: layer_field(t, i, 3, "blocks")?,
                        segment: layer_field(t, i, 4, "segment")?,
                    });
                }
                n => {
                    return Err(typed(
                        |e| &e.invalid_type,
                        format!("layer {i}: expected a 2- or 5-tuple, got {n} items"),
                    ))
                }
            }
        }
        if !buffers.is_empty() && buffers.len() != geoms.len() {
            return Err(typed(
                |e| &e.invalid_type,
                "layers mix host buffers and device addresses",
            ));
        }
        // Registration pieces are boundaries only when there is more than one.
        let split = match region.registration_piece_bytes() {
            Some(p) if region.registration_piece_count() > 1 => {
                u64::try_from(p).unwrap_or(u64::MAX)
            }
            _ => 0,
        };
        let num_chunks = u64::try_from(pool.num_chunks_usize()).unwrap_or(u64::MAX);
        let chunk_bytes = u64::try_from(pool.chunk_bytes_usize()).unwrap_or(u64::MAX);
        let base = u64::try_from(region.addr()).unwrap_or(u64::MAX);
        let layout = if groups.is_none() && offsets.is_none() {
            TransferLayout::new(
                geoms,
                blocks_per_chunk,
                base,
                num_chunks,
                chunk_bytes,
                split,
            )
        } else {
            let offsets = match offsets {
                Some(o) => o,
                None => {
                    let mut packed =
                        TransferLayout::packed_offsets(&geoms, blocks_per_chunk).py_err()?;
                    packed.pop();
                    packed
                }
            };
            let groups = groups.unwrap_or_else(|| {
                vec![geoms
                    .iter()
                    .enumerate()
                    .map(|(tensor, l)| GroupRef {
                        tensor,
                        bytes: l.page_bytes,
                    })
                    .collect()]
            });
            TransferLayout::with_groups(
                geoms,
                offsets,
                groups,
                blocks_per_chunk,
                HostGeometry {
                    base,
                    num_chunks,
                    chunk_stride: chunk_bytes,
                    split_bytes: split,
                },
            )
        }
        .py_err()?;
        Ok(PyTransferLayout {
            shared: Arc::new(LayoutShared {
                layout,
                region,
                host_buffers: buffers,
            }),
            scratch: Mutex::new(PlanScratch::default()),
            pool: pool_ref,
        })
    }

    /// Shows the pool it keeps reachable to the garbage collector. Nothing to clear: the
    /// reference never changes, and a cycle through it is broken at the pool or its buffer.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.pool)
    }

    /// Valid device block ids are `range(num_blocks)` (the smallest layer's count).
    #[getter]
    fn num_blocks(&self) -> u64 {
        self.shared.layout.num_blocks()
    }

    #[getter]
    fn num_groups(&self) -> usize {
        self.shared.layout.num_groups()
    }

    #[getter]
    fn blocks_per_chunk(&self) -> usize {
        self.shared.layout.blocks_per_chunk()
    }

    #[getter]
    fn is_host(&self) -> bool {
        self.shared.is_host()
    }

    /// Validates ids and builds the runs of one job. `gpu_ids` and `chunk_ids` are 1-d int64
    /// or int32 buffers. Without spans, the layout's single group moves whole chunks
    /// (`blocks_per_chunk` blocks per chunk id); with `group_sizes` and `block_indices` (one
    /// entry per group, as vLLM's `GPULoadStoreSpec`), groups may enter their first chunk
    /// part-way and end on a short chunk. Raises `InvalidArgumentError`/`OutOfRangeError`
    /// (nothing planned) on bad input, `InvalidStateError` if the pool is closed.
    #[pyo3(signature = (store, gpu_ids, chunk_ids, group_sizes=None, block_indices=None))]
    fn plan(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = store_arg)] store: bool,
        gpu_ids: &Bound<'_, PyAny>,
        chunk_ids: &Bound<'_, PyAny>,
        group_sizes: Option<&Bound<'_, PyAny>>,
        block_indices: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Plan> {
        let g = id_vec(py, "gpu_block_ids", gpu_ids)?;
        let c = id_vec(py, "chunk_ids", chunk_ids)?;
        let dir = if store {
            Direction::Store
        } else {
            Direction::Load
        };
        let groups = self.shared.layout.num_groups();
        let spans = match (group_sizes, block_indices) {
            (None, None) => None,
            (Some(sizes), Some(indices)) => {
                let sizes = small_ints("group_sizes", sizes, groups)?;
                let indices = small_ints("block_indices", indices, groups)?;
                if sizes.len() != indices.len() {
                    return Err(typed(
                        |e| &e.invalid_argument,
                        format!(
                            "{} group sizes but {} block indices",
                            sizes.len(),
                            indices.len()
                        ),
                    ));
                }
                let spans = sizes
                    .into_iter()
                    .zip(indices)
                    .map(|(blocks, first_index)| {
                        Ok(GroupSpan {
                            blocks: usize::try_from(blocks).map_err(|_| {
                                typed(|e| &e.invalid_argument, "group size too large")
                            })?,
                            first_index,
                        })
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                Some(spans)
            }
            _ => {
                return Err(typed(
                    |e| &e.invalid_argument,
                    "give both group_sizes and block_indices, or neither",
                ))
            }
        };
        let shared = Arc::clone(&self.shared);
        let spans = match spans {
            Some(s) => s,
            None => {
                let bpc = shared.layout.blocks_per_chunk();
                if groups != 1 {
                    return Err(typed(
                        |e| &e.invalid_argument,
                        format!("this layout has {groups} groups: give group_sizes"),
                    ));
                }
                if c.len().checked_mul(bpc) != Some(g.len()) {
                    return Err(typed(
                        |e| &e.invalid_argument,
                        format!(
                            "{} block ids for {} chunk ids: expected blocks_per_chunk ({bpc}) \
                             per chunk",
                            g.len(),
                            c.len()
                        ),
                    ));
                }
                vec![GroupSpan {
                    blocks: g.len(),
                    first_index: 0,
                }]
            }
        };
        let large = g.len() >= DETACH_IDS;
        let check = move || {
            let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            shared.layout.validate(dir, g, c, spans, &mut scratch)
        };
        let req = if large { py.detach(check) } else { check() }.py_err()?;
        let lease = self.shared.region.lease().py_err()?;
        Ok(Plan {
            data: Arc::new(PlanData {
                req,
                runs: OnceLock::new(),
                shared: Arc::clone(&self.shared),
                store,
                lease: Mutex::new(Some(lease)),
            }),
        })
    }

    /// The device block ids (an int64 array, group after group) that device pointers name,
    /// as vLLM 0.34's connector gives them: `ptrs` and `sizes` are 1-d uint64 numpy arrays in
    /// (group, reference, block) order, `group_block_counts` and `group_data_ref_counts` one
    /// int per group. Every pointer must start a block of its reference's tensor, the
    /// references of a group must agree on the blocks, every size must be its reference's
    /// bytes and every count must match the layout; else `InvalidTypeError` (not uint64
    /// arrays), `OutOfRangeError` (a pointer outside its tensor) or `InvalidArgumentError`.
    fn block_ids_from_pointers<'py>(
        &self,
        py: Python<'py>,
        ptrs: &Bound<'py, PyAny>,
        sizes: &Bound<'py, PyAny>,
        group_block_counts: &Bound<'py, PyAny>,
        group_data_ref_counts: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let groups = self.shared.layout.num_groups();
        let counts = small_ints("group_block_counts", group_block_counts, groups)?;
        let refs = small_ints("group_data_ref_counts", group_data_ref_counts, groups)?;
        let ptrs = words("ptrs", ptrs)?;
        let sizes = words("sizes", sizes)?;
        // The counts, then the arrays' lengths, are checked before any pointer is read or
        // copied: only the layout and a bound size what this call allocates.
        let layout = &self.shared.layout;
        let need = layout.pointer_counts(&counts, &refs).py_err()?;
        if need.blocks > MAX_ITEMS {
            return Err(typed(
                |e| &e.invalid_argument,
                format!(
                    "group_block_counts name {} blocks, more than the {MAX_ITEMS} a transfer \
                     may take",
                    need.blocks
                ),
            ));
        }
        need.check_lengths(ptrs.len(), sizes.len()).py_err()?;
        let ids = layout
            .block_ids_from_pointers(&ptrs.get()?, &sizes.get()?, &counts, &refs)
            .py_err()?;
        Ok(PyArray1::from_vec(py, ids))
    }

    /// Why the copy kernel cannot serve `group` (None: it can): the first address or size it
    /// would form that is not a multiple of 8 bytes (the pool's and the chunks' included).
    fn kernel_problem(
        &self,
        #[pyo3(from_py_with = group_arg)] group: usize,
    ) -> PyResult<Option<String>> {
        self.shared.layout.kernel_problem(group).py_err()
    }

    /// A group's distinct references as `(device base, block stride, segment offset, page
    /// slot bytes, bytes copied)` tuples (the copy kernel's per-tensor table).
    fn group_refs(&self, #[pyo3(from_py_with = group_arg)] group: usize) -> PyResult<Vec<RefRow>> {
        Ok(self
            .shared
            .layout
            .group_refs(group)
            .py_err()?
            .into_iter()
            .map(|[a, b, c, d, e]| (a, b, c, d, e))
            .collect())
    }
}

pub(crate) struct PlanData {
    /// The validated request; its runs are built on first use ([`PlanData::runs`]), usually
    /// by the thread that executes the job.
    req: Request,
    runs: OnceLock<CopyRuns>,
    shared: Arc<LayoutShared>,
    store: bool,
    /// Held until the copies are done; `close()` on the pool is refused meanwhile.
    lease: Mutex<Option<Lease>>,
}

impl PlanData {
    /// The copy runs, built the first time they are asked for.
    pub(crate) fn runs(&self) -> &CopyRuns {
        self.runs
            .get_or_init(|| self.shared.layout.build(&self.req))
    }
    pub(crate) fn is_host(&self) -> bool {
        self.shared.is_host()
    }
    pub(crate) fn region(&self) -> &HostRegion {
        &self.shared.region
    }
    /// Held while this plan's copies are submitted: keeps a background registration off the
    /// chunks they touch (and only those).
    pub(crate) fn copy_guard(&self) -> CopyGuard<'_> {
        let ranges = self
            .shared
            .layout
            .chunk_ranges(&self.req)
            .map(|(addr, len)| {
                // Inside the mapping, hence addressable (validated against the pool).
                (
                    usize::try_from(addr).unwrap_or(usize::MAX),
                    usize::try_from(len).unwrap_or(usize::MAX),
                )
            });
        self.shared.region.copy_guard_for(ranges)
    }
    /// Marks the plan executed; false if it already was.
    pub(crate) fn take_lease(&self) -> Option<Lease> {
        self.lease.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
    pub(crate) fn has_lease(&self) -> bool {
        self.lease
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Refuses a plan that already ran (its lease is gone): what every executor checks before
    /// queueing one.
    pub(crate) fn check_not_executed(&self) -> PyResult<()> {
        if self.has_lease() {
            Ok(())
        } else {
            Err(typed(
                |e| &e.invalid_state,
                "this plan was already executed",
            ))
        }
    }
}

/// The runs of one job, plus what keeps their memory valid.
#[pyclass(module = "kvcache._core", name = "Plan", frozen)]
pub struct Plan {
    data: Arc<PlanData>,
}

impl Plan {
    pub(crate) fn data(&self) -> Arc<PlanData> {
        Arc::clone(&self.data)
    }
}

#[pymethods]
impl Plan {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    /// Number of copy runs (descriptors) after coalescing (builds them if needed).
    fn __len__(&self, py: Python<'_>) -> usize {
        let data = Arc::clone(&self.data);
        py.detach(move || data.runs().len())
    }

    /// Whether this plan moves device blocks to host chunks.
    #[getter]
    fn store(&self) -> bool {
        self.data.store
    }

    /// Pages (block x tensor pairs) the job moves, before coalescing.
    #[getter]
    fn num_pages(&self) -> u64 {
        self.data.req.pages()
    }

    /// Bytes the job moves.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.data.req.bytes()
    }

    /// Bytes as vLLM's worker reports them (`TransferResult.transfer_size`).
    #[getter]
    fn logical_nbytes(&self) -> u64 {
        self.data.req.logical_bytes()
    }

    /// Device blocks of each group, in group order.
    #[getter]
    fn group_blocks(&self) -> Vec<usize> {
        self.data.req.group_blocks().collect()
    }

    /// Writes group `group`'s block table (device ids, then chunk addresses, then slots; the
    /// copy kernel's per-block input) into `out`, a writable int64 buffer of exactly
    /// `3 * group_blocks[group]` entries.
    fn write_block_table(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = group_arg)] group: usize,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let out = out_buffer(out, "out")?;
        let mut table = Vec::new();
        self.data
            .shared
            .layout
            .block_table(&self.data.req, group, &mut table)
            .py_err()?;
        if out.item_count() != table.len() {
            return Err(typed(
                |e| &e.invalid_argument,
                format!(
                    "block table buffer holds {} entries, expected {}",
                    out.item_count(),
                    table.len()
                ),
            ));
        }
        out.copy_from_slice(py, &table)
    }

    /// Runs the plan makes at most, counted from its block ids without building them (exact
    /// unless runs join tensors or chunks); what the engine weighs DMA against a kernel with.
    #[getter]
    fn max_runs(&self) -> u64 {
        self.data.shared.layout.max_runs(&self.data.req)
    }

    #[getter]
    fn max_run_bytes(&self) -> u64 {
        self.data.runs().max_run_bytes()
    }

    /// Largest power of two dividing every address and length (decides kernel word size).
    #[getter]
    fn alignment(&self) -> u64 {
        self.data.runs().alignment()
    }

    /// Whether the plan has not been executed (its pool lease is still held).
    #[getter]
    fn pending(&self) -> bool {
        self.data.has_lease()
    }

    /// Drops the pool lease: call once the copies are complete (GPU path).
    fn release(&self) {
        drop(self.data.take_lease());
    }

    /// Descriptors after cutting runs into pieces of at most `max_piece_bytes` (0: none).
    #[pyo3(signature = (max_piece_bytes=0))]
    fn num_pieces(&self, #[pyo3(from_py_with = piece_bytes_arg)] max_piece_bytes: u64) -> usize {
        self.data.runs().count_pieces(max_piece_bytes)
    }

    /// Writes every source, then every destination, then every length (int64, runs cut into
    /// pieces of at most `max_piece_bytes`, 0: none) into `out`, a writable C-contiguous int64
    /// buffer of exactly `3 * num_pieces(max_piece_bytes)` entries.
    #[pyo3(signature = (out, max_piece_bytes=0))]
    fn write_runs(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = piece_bytes_arg)] max_piece_bytes: u64,
    ) -> PyResult<()> {
        let out = out_buffer(out, "out")?;
        let n = self.data.runs().count_pieces(max_piece_bytes);
        if Some(out.item_count()) != n.checked_mul(3) {
            return Err(typed(
                |e| &e.invalid_argument,
                format!(
                    "descriptor buffer holds {} entries, expected 3 * {n}",
                    out.item_count()
                ),
            ));
        }
        // Sized by the plan (built from validated ids), checked against `out` above.
        let mut v = vec![0i64; out.item_count()];
        self.data
            .runs()
            .write_soa(max_piece_bytes, &mut v)
            .py_err()?;
        out.copy_from_slice(py, &v)
    }
}
