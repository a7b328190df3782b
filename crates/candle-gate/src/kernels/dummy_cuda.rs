//! Stand-in when candle-gate is built without the `cuda` feature.
use candle_core::{quantized::QMatMul, Tensor};

pub const AVAILABLE: bool = false;

pub fn row_split(_: &QMatMul, _: &Tensor) -> candle_core::Result<Tensor> {
    candle_core::bail!("candle-gate was built without the `cuda` feature")
}

pub fn canonical(
    _: &std::sync::Arc<candle_core::quantized::QTensor>,
    _: &Tensor,
) -> candle_core::Result<Option<Tensor>> {
    candle_core::bail!("candle-gate was built without the `cuda` feature")
}

pub fn canonical_dense(_: &Tensor, _: &Tensor) -> candle_core::Result<Tensor> {
    candle_core::bail!("candle-gate was built without the `cuda` feature")
}
