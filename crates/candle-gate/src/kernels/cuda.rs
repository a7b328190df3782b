//! CUDA. Candle's own dispatch (`native`) picks its mat-vec kernel for up to 8 rows and a
//! matrix kernel above, with launch shapes that follow the row count. Row-split forces the
//! one-row launch for every row; `invariant` (and `canonical`) run `cuda/canonical.cu` in the
//! canonical order (`kernels::canonical`): one warp per output column for one row, the tiled
//! kernel (activation chunks in shared memory, several columns per warp) for more. Every kernel
//! and tile computes each output in the same order, so a row's bits depend on nothing but the
//! row and equal the CPU's canonical mode, whichever the row count picks.
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

pub const AVAILABLE: bool = true;

/// `cuda/canonical.cu`, compiled to PTX for compute capability 8.0 by `build.rs` (the driver
/// compiles it for the GPU it runs on: 8.0, 8.6, 8.9, 9.0, ...).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/canonical.ptx"));
const MODULE: &str = "candle_gate_canonical";
/// Warps (output columns) per thread block: `WARPS` in canonical.cu.
const WARPS: usize = 4;
const THREADS: u32 = (WARPS * 32) as u32;

pub use super::canonical_emulate::{tile_for_rows, Tile, MMA_COLS, MMA_ROWS, MMA_WARPS, TILES, TILE_WARPS};

/// Which kernel of canonical.cu computes a quantized call. Every choice gives the same bits
/// (`tests/canonical.rs` emulates each); [`Kernel::for_rows`] picks one for speed, and the
/// device check (`examples/cuda_check.rs`) runs and times them all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// `canonical_<dtype>_r<rows>`: one warp per column, `rows` (1, 2, 4 or 8) rows per block.
    Warp(usize),
    /// `canonical_<dtype>_r1_u4`: the warp kernel for one row, each lane decoding 4 of its units
    /// before accumulating them (more loads in flight).
    WarpUnrolled,
    /// `canonical_tile_<dtype>_r<rows>_c<cols>`: [`TILE_WARPS`] warps per block, `cols` columns
    /// per warp, `rows` rows staged in shared memory.
    Tile(Tile),
    /// `canonical_mma_<dtype>`: the integer part on int8 tensor cores, [`MMA_ROWS`] rows by
    /// [`MMA_COLS`] columns per block of [`MMA_WARPS`] warps.
    Mma,
}

impl Kernel {
    /// The kernel `canonical` launches for `m` rows.
    pub fn for_rows(m: usize) -> Kernel {
        match tile_for_rows(m) {
            Some(t) => Kernel::Tile(t),
            None => Kernel::Warp(1),
        }
    }

    /// Every kernel, for the device check: the warp kernel's tiles, the tiled kernel's, the
    /// tensor-core kernel.
    pub fn all() -> Vec<Kernel> {
        [1, 2, 4, 8]
            .into_iter()
            .map(Kernel::Warp)
            .chain([Kernel::WarpUnrolled])
            .chain(TILES.into_iter().map(Kernel::Tile))
            .chain([Kernel::Mma])
            .collect()
    }

    /// A short label: `warp_r8`, `tile_r16_c4`.
    pub fn label(&self) -> String {
        match self {
            Kernel::Warp(r) => format!("warp_r{r}"),
            Kernel::WarpUnrolled => "warp_r1_u4".to_string(),
            Kernel::Tile(t) => format!("tile_r{}_c{}", t.rows, t.cols),
            Kernel::Mma => "mma".to_string(),
        }
    }

    fn function(&self, dtype: &str) -> String {
        match self {
            Kernel::Warp(r) => format!("canonical_{dtype}_r{r}"),
            Kernel::WarpUnrolled => format!("canonical_{dtype}_r1_u4"),
            Kernel::Tile(t) => format!("canonical_tile_{dtype}_r{}_c{}", t.rows, t.cols),
            Kernel::Mma => format!("canonical_mma_{dtype}"),
        }
    }

    fn launch_config(&self, n: usize, m: usize) -> LaunchConfig {
        match self {
            Kernel::Warp(r) => launch_config(n, m, *r),
            Kernel::WarpUnrolled => launch_config(n, m, 1),
            Kernel::Tile(t) => LaunchConfig {
                grid_dim: (m.div_ceil(t.rows) as u32, n.div_ceil(TILE_WARPS * t.cols) as u32, 1),
                block_dim: ((TILE_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            Kernel::Mma => LaunchConfig {
                grid_dim: (m.div_ceil(MMA_ROWS) as u32, n.div_ceil(MMA_COLS) as u32, 1),
                block_dim: ((MMA_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            },
        }
    }
}

pub fn row_split(native: &QMatMul, xs2: &Tensor) -> candle_core::Result<Tensor> {
    super::row_split_via_candle(native, xs2)
}

/// The kernel name's dtype part, for the dtypes canonical.cu decodes.
pub fn canonical_dtype(dtype: GgmlDType) -> Option<&'static str> {
    Some(match dtype {
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q4K => "q4k",
        GgmlDType::Q6K => "q6k",
        _ => return None,
    })
}

/// Activation rows per thread block. Any choice gives the same bits (each row's arithmetic is
/// its own); fewer rows than the tile only waste lanes, so small inputs get small tiles.
fn tile_rows(m: usize) -> usize {
    match m {
        1 => 1,
        2 => 2,
        3 | 4 => 4,
        _ => 8,
    }
}

fn launch_config(n: usize, m: usize, tile: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(WARPS) as u32, m.div_ceil(tile) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rows_of(layout: &Layout, k: usize) -> candle_core::Result<(usize, usize, usize)> {
    let (m, kx) = layout.shape().dims2()?;
    if kx != k {
        candle_core::bail!("canonical matmul: input has {kx} columns, weight has {k}");
    }
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok((m, start, end)),
        None => candle_core::bail!("canonical matmul: input is not contiguous"),
    }
}

fn to_i32(v: usize, what: &str) -> candle_core::Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("canonical matmul: {what} = {v} exceeds i32")))
}

/// `x · Wᵀ` for a quantized `W` on the GPU in the canonical order.
struct Canonical {
    weight: Arc<QTensor>,
    name: &'static str,
    /// `None`: [`Kernel::for_rows`].
    kernel: Option<Kernel>,
}

impl CustomOp1 for Canonical {
    fn name(&self) -> &'static str {
        "candle-gate-canonical"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("the CUDA canonical kernel takes CUDA tensors")
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = &storage.device;
        let (n, k) = self.weight.shape().dims2()?;
        let (m, start, end) = rows_of(layout, k)?;
        if k % super::canonical::UNIT != 0 {
            candle_core::bail!("canonical matmul: k = {k} is not a multiple of 32");
        }
        let x = storage.as_cuda_slice::<f32>()?.slice(start..end);
        let units = m * k / super::canonical::UNIT;
        // SAFETY: both buffers are written whole by the quantize kernel before they are read.
        let q = unsafe { dev.alloc::<i8>(m * k)? };
        let d = unsafe { dev.alloc::<f32>(units)? };
        let quantize = dev.get_or_load_custom_func("canonical_quantize", MODULE, PTX)?;
        let units_i32 = to_i32(units, "units")?;
        let mut b = quantize.builder();
        b.arg(&x).arg(&q).arg(&d).arg(&units_i32);
        let cfg =
            LaunchConfig { grid_dim: (units.div_ceil(128) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match canonical_quantize's signature; the grid covers `units`.
        unsafe { b.launch(cfg) }.w()?;

        let kernel = self.kernel.unwrap_or_else(|| Kernel::for_rows(m));
        if let Kernel::Warp(r) = kernel {
            if ![1, 2, 4, 8].contains(&r) {
                candle_core::bail!("canonical matmul: no warp kernel with {r} rows");
            }
        }
        if let Kernel::Tile(t) = kernel {
            if !TILES.contains(&t) {
                candle_core::bail!("canonical matmul: no tiled kernel {t:?}");
            }
            if n.div_ceil(TILE_WARPS * t.cols) > 65535 {
                candle_core::bail!("canonical matmul: n = {n} is past the tiled kernel's grid");
            }
        }
        if kernel == Kernel::Mma && n.div_ceil(MMA_COLS) > 65535 {
            candle_core::bail!("canonical matmul: n = {n} is past the tensor-core kernel's grid");
        }
        let f = dev.get_or_load_custom_func(&kernel.function(self.name), MODULE, PTX)?;
        // SAFETY: every output element is written by the kernel (each (row, column) by one warp).
        let y = unsafe { dev.alloc::<f32>(m * n)? };
        let w = self.weight.device_ptr()? as u64;
        let (n_i32, k_i32, m_i32) = (to_i32(n, "n")?, to_i32(k, "k")?, to_i32(m, "rows")?);
        let mut b = f.builder();
        b.arg(&w).arg(&q).arg(&d).arg(&y).arg(&n_i32).arg(&k_i32).arg(&m_i32);
        // SAFETY: the arguments match the kernel's signature (both kernels take the same ones);
        // `w` holds n rows of k values of this dtype (checked by the caller), `q`/`d`/`y` are
        // sized for m rows.
        unsafe { b.launch(kernel.launch_config(n, m)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), Shape::from((m, n))))
    }
}

/// `x · Wᵀ` for a dense F32 `W` (`[n, k]`) on the GPU in the canonical order: the reference
/// lane's matmul, whose order does not follow the row count the way cuBLAS's may.
struct CanonicalDense;

impl CustomOp2 for CanonicalDense {
    fn name(&self) -> &'static str {
        "candle-gate-canonical-dense"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("the CUDA canonical kernel takes CUDA tensors")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = &xs.device;
        let (n, k) = wl.shape().dims2()?;
        let (m, start, end) = rows_of(xl, k)?;
        let (ws0, ws1) = match wl.contiguous_offsets() {
            Some(o) => o,
            None => candle_core::bail!("canonical matmul: weight is not contiguous"),
        };
        let x = xs.as_cuda_slice::<f32>()?.slice(start..end);
        let w = ws.as_cuda_slice::<f32>()?.slice(ws0..ws1);
        let tile = tile_rows(m);
        let f = dev.get_or_load_custom_func(&format!("canonical_f32_r{tile}"), MODULE, PTX)?;
        // SAFETY: every output element is written by the kernel.
        let y = unsafe { dev.alloc::<f32>(m * n)? };
        let (n_i32, k_i32, m_i32) = (to_i32(n, "n")?, to_i32(k, "k")?, to_i32(m, "rows")?);
        let mut b = f.builder();
        b.arg(&w).arg(&x).arg(&y).arg(&n_i32).arg(&k_i32).arg(&m_i32);
        // SAFETY: the arguments match canonical_f32_rN's signature and the buffers' sizes.
        unsafe { b.launch(launch_config(n, m, tile)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), Shape::from((m, n))))
    }
}

/// `xs2` (`[m, k]`, any float dtype, on the weight's GPU) times `weightᵀ` in the canonical
/// order; the result has `xs2`'s dtype. `None` for dtypes canonical.cu does not decode.
pub fn canonical(weight: &Arc<QTensor>, xs2: &Tensor) -> candle_core::Result<Option<Tensor>> {
    canonical_with(weight, xs2, None)
}

/// [`canonical`] with the kernel named (`None`: the one [`Kernel::for_rows`] picks). The same
/// bits for every kernel: the device check runs each to show it.
pub fn canonical_with(
    weight: &Arc<QTensor>,
    xs2: &Tensor,
    kernel: Option<Kernel>,
) -> candle_core::Result<Option<Tensor>> {
    let Some(name) = canonical_dtype(weight.dtype()) else { return Ok(None) };
    if !weight.device().same_device(xs2.device()) {
        candle_core::bail!("canonical matmul: the input and the weight are on different devices");
    }
    let x = xs2.to_dtype(DType::F32)?.contiguous()?;
    let y = x.apply_op1_no_bwd(&Canonical { weight: weight.clone(), name, kernel })?;
    Ok(Some(y.to_dtype(xs2.dtype())?))
}

/// `xs2` times `dense_f32ᵀ` (an F32 `[n, k]` tensor on the same GPU) in the canonical order.
pub fn canonical_dense(dense_f32: &Tensor, xs2: &Tensor) -> candle_core::Result<Tensor> {
    let x = xs2.to_dtype(DType::F32)?.contiguous()?;
    let y = x.apply_op2_no_bwd(&dense_f32.contiguous()?, &CanonicalDense)?;
    y.to_dtype(xs2.dtype())
}
