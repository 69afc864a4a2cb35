//! `_core.TransferLayout` (validated geometry) and `_core.Plan` (one job's copy runs).

use std::sync::{Arc, Mutex};

use kvcache_core::host::{
    CopyRuns, Direction, HostRegion, LayerGeometry, Lease, PlanScratch, TransferLayout,
};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::host_err;
use super::pool::PyHostChunkPool;

/// Requests with at least this many pages are planned with the GIL released.
const DETACH_PAGES: usize = 4096;

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
}

fn host_layer(buf: &PyBuffer<u8>, index: usize, segment: u64) -> PyResult<LayerGeometry> {
    let bad = |why: &str| PyValueError::new_err(format!("layer {index}: {why}"));
    if buf.dimensions() != 2 {
        return Err(bad("expected a 2-d (blocks, page bytes) byte buffer"));
    }
    if buf.readonly() {
        return Err(bad("the buffer is read-only"));
    }
    let (shape, strides) = (buf.shape(), buf.strides());
    if shape[1] > 1 && strides[1] != 1 {
        return Err(bad("pages must be contiguous"));
    }
    let stride = u64::try_from(strides[0]).map_err(|_| bad("negative block stride"))?;
    if shape[0] > 1 && stride < shape[1] as u64 {
        return Err(bad("blocks overlap"));
    }
    Ok(LayerGeometry {
        base: buf.buf_ptr() as usize as u64,
        // With one block the stride is irrelevant; make it valid for the checks.
        block_stride: if shape[0] > 1 {
            stride
        } else {
            shape[1] as u64
        },
        page_bytes: shape[1] as u64,
        num_blocks: shape[0] as u64,
        segment,
    })
}

#[pymethods]
impl PyTransferLayout {
    /// `layers`: for host memory (CPU tensors), `(buffer, segment)` with a 2-d writable byte
    /// buffer of shape `(blocks, page bytes)`; for device memory, the integers
    /// `(base, block_stride, page_bytes, num_blocks, segment)`. `segment` names the allocation
    /// the layer lives in. All layers must be of the same kind.
    #[new]
    fn new(
        pool: &Bound<'_, PyHostChunkPool>,
        layers: Vec<Bound<'_, PyTuple>>,
        blocks_per_chunk: usize,
    ) -> PyResult<Self> {
        let pool = pool.get();
        let region = Arc::clone(&pool.region);
        if region.is_closed() {
            return Err(host_err(kvcache_core::host::HostError::Closed));
        }
        let mut geoms = Vec::with_capacity(layers.len());
        let mut buffers = Vec::new();
        for (i, t) in layers.iter().enumerate() {
            match t.len() {
                2 => {
                    let buf = PyBuffer::<u8>::get(&t.get_item(0)?).map_err(|e| {
                        PyTypeError::new_err(format!("layer {i}: not a byte buffer: {e}"))
                    })?;
                    geoms.push(host_layer(&buf, i, t.get_item(1)?.extract()?)?);
                    buffers.push(buf);
                }
                5 => {
                    let (base, block_stride, page_bytes, num_blocks, segment) = t.extract()?;
                    geoms.push(LayerGeometry {
                        base,
                        block_stride,
                        page_bytes,
                        num_blocks,
                        segment,
                    });
                }
                n => {
                    return Err(PyTypeError::new_err(format!(
                        "layer {i}: expected a 2- or 5-tuple, got {n} items"
                    )))
                }
            }
        }
        if !buffers.is_empty() && buffers.len() != geoms.len() {
            return Err(PyTypeError::new_err(
                "layers mix host buffers and device addresses",
            ));
        }
        // Registration pieces are boundaries only when there is more than one.
        let split = match region.registration_piece_bytes() {
            Some(p) if region.registered_pieces() > 1 => p as u64,
            _ => 0,
        };
        let layout = TransferLayout::new(
            geoms,
            blocks_per_chunk,
            region.addr() as u64,
            pool.num_chunks_usize() as u64,
            pool.chunk_bytes_usize() as u64,
            split,
        )
        .map_err(host_err)?;
        Ok(PyTransferLayout {
            shared: Arc::new(LayoutShared {
                layout,
                region,
                host_buffers: buffers,
            }),
            scratch: Mutex::new(PlanScratch::default()),
        })
    }

    /// Largest valid device block id + 1 (over all layers).
    #[getter]
    fn num_blocks(&self) -> u64 {
        self.shared.layout.num_blocks()
    }

    #[getter]
    fn is_host(&self) -> bool {
        self.shared.is_host()
    }

    /// Validates ids and builds the runs of one job. `gpu_ids` and `chunk_ids` are 1-d
    /// buffers of int64. Raises `ValueError`/`IndexError` (nothing planned) on bad input,
    /// `ValueError` if the pool is closed.
    fn plan(
        &self,
        py: Python<'_>,
        store: bool,
        gpu_ids: PyBuffer<i64>,
        chunk_ids: PyBuffer<i64>,
    ) -> PyResult<Plan> {
        for (name, b) in [("gpu_ids", &gpu_ids), ("chunk_ids", &chunk_ids)] {
            if b.dimensions() != 1 {
                return Err(PyValueError::new_err(format!("{name} must be 1-d")));
            }
        }
        let g = gpu_ids.to_vec(py)?;
        let c = chunk_ids.to_vec(py)?;
        let dir = if store {
            Direction::Store
        } else {
            Direction::Load
        };
        let shared = Arc::clone(&self.shared);
        let build = || {
            let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            shared.layout.plan(dir, &g, &c, &mut scratch)
        };
        let pages = g.len().saturating_mul(shared.layout.layers().len());
        let runs = if pages >= DETACH_PAGES {
            py.detach(build)
        } else {
            build()
        }
        .map_err(host_err)?;
        let lease = self.shared.region.lease().map_err(host_err)?;
        Ok(Plan {
            data: Arc::new(PlanData {
                runs,
                shared,
                lease: Mutex::new(Some(lease)),
            }),
        })
    }
}

pub(crate) struct PlanData {
    runs: CopyRuns,
    shared: Arc<LayoutShared>,
    /// Held until the copies are done; `close()` on the pool is refused meanwhile.
    lease: Mutex<Option<Lease>>,
}

impl PlanData {
    pub(crate) fn runs(&self) -> &CopyRuns {
        &self.runs
    }
    pub(crate) fn is_host(&self) -> bool {
        self.shared.is_host()
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
    /// Number of copy runs (descriptors) after coalescing.
    fn __len__(&self) -> usize {
        self.data.runs.len()
    }

    /// Pages (layer x block pairs) the job moves, before coalescing.
    #[getter]
    fn num_pages(&self) -> u64 {
        self.data.runs.pages()
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.data.runs.bytes()
    }

    #[getter]
    fn max_run_bytes(&self) -> u64 {
        self.data.runs.max_run_bytes()
    }

    /// Largest power of two dividing every address and length (decides kernel word size).
    #[getter]
    fn alignment(&self) -> u64 {
        self.data.runs.alignment()
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
    fn num_pieces(&self, max_piece_bytes: u64) -> usize {
        self.data.runs.count_pieces(max_piece_bytes)
    }

    /// Writes every source, then every destination, then every length (int64, runs cut into
    /// pieces of at most `max_piece_bytes`, 0: none) into `out`, a writable C-contiguous int64
    /// buffer of exactly `3 * num_pieces(max_piece_bytes)` entries.
    #[pyo3(signature = (out, max_piece_bytes=0))]
    fn write_runs(&self, py: Python<'_>, out: PyBuffer<i64>, max_piece_bytes: u64) -> PyResult<()> {
        let n = self.data.runs.count_pieces(max_piece_bytes);
        if out.item_count() != 3 * n {
            return Err(PyValueError::new_err(format!(
                "descriptor buffer holds {} entries, expected 3 * {n}",
                out.item_count()
            )));
        }
        let mut v = vec![0i64; 3 * n];
        self.data
            .runs
            .write_soa(max_piece_bytes, &mut v)
            .map_err(host_err)?;
        out.copy_from_slice(py, &v)
    }
}
