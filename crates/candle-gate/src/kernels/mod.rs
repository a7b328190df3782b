//! Kernels, one file per backend as in Candle's own `quantized/{cpu,cuda,metal}.rs`; the
//! GPU backends are stubs unless their cargo feature is on.

pub mod cpu;
mod cpu_q4_1;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "dummy_cuda.rs"]
pub mod cuda;

#[cfg(feature = "metal")]
pub mod metal;
#[cfg(not(feature = "metal"))]
#[path = "dummy_metal.rs"]
pub mod metal;

use candle_core::{quantized::QMatMul, Module, Tensor};

/// Row-split on a GPU: every row through Candle's own single-row (mat-vec) kernel. Shared by
/// the CUDA and Metal backends, whose single-row kernels Candle picks for one-row inputs.
#[allow(dead_code)]
pub(crate) fn row_split_via_candle(native: &QMatMul, xs2: &Tensor) -> candle_core::Result<Tensor> {
    let m = xs2.dim(0)?;
    let rows = (0..m)
        .map(|r| native.forward(&xs2.narrow(0, r, 1)?))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&rows, 0)
}
