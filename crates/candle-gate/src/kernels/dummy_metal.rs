//! Stand-in when candle-gate is built without the `metal` feature.
use candle_core::{quantized::QMatMul, Tensor};

pub const AVAILABLE: bool = false;

pub fn row_split(_: &QMatMul, _: &Tensor) -> candle_core::Result<Tensor> {
    candle_core::bail!("candle-gate was built without the `metal` feature")
}
