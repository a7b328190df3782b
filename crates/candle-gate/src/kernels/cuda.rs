//! CUDA: Candle picks MMVQ for 1..=8 rows (with a different warp split from 5 rows on) and MMQ
//! above. Row-split forces the single-row MMVQ launch for every row, so a row's bits never
//! depend on its neighbours; `native` and `gemm` are Candle's own dispatch.
use candle_core::{quantized::QMatMul, Tensor};

pub const AVAILABLE: bool = true;

pub fn row_split(native: &QMatMul, xs2: &Tensor) -> candle_core::Result<Tensor> {
    super::row_split_via_candle(native, xs2)
}
