//! Metal: Candle takes the mat-vec kernel only for one-row inputs and the matrix-matrix kernel
//! otherwise. Row-split forces mat-vec for every row; `native` and `gemm` are Candle's mm.
use candle_core::{quantized::QMatMul, Tensor};

pub const AVAILABLE: bool = true;

pub fn row_split(native: &QMatMul, xs2: &Tensor) -> candle_core::Result<Tensor> {
    super::row_split_via_candle(native, xs2)
}
