//! Embedding candle-gate in a Candle program: `candle_gate::QMatMul` where Candle's `QMatMul`
//! was, and a row's output no longer depends on how many rows share the call.
//!
//!     cargo run --release -p candle-gate --example embed_qmatmul [-- path/to/model.gguf]
//!
//! Without a path it uses Qwen2.5-Coder-0.5B (`candle-gate fetch --model
//! qwen2.5-coder-0.5b-instruct-q4_k_m`), whose Q6_K/Q4_K layers Candle runs with kernels that
//! depend on the row count on many x86 hosts (SmolLM2's Q4_1 takes Candle's exact generic path).
//! On the Zen 4 development host: 896 of 896 outputs equal for candle-gate, 77 of 896 for Candle.

use candle_core::quantized::{gguf_file, QMatMul as CandleQMatMul};
use candle_core::{Device, Module, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = match std::env::args().nth(1) {
        Some(p) => p.into(),
        None => candle_gate::registry::resolve("qwen2.5-coder-0.5b-instruct-q4_k_m")?,
    };
    let mut file = std::fs::File::open(&path)?;
    let content = gguf_file::Content::read(&mut file)?;
    let weight = content.tensor(&mut file, "blk.0.ffn_down.weight", &Device::Cpu)?;
    let k = weight.shape().dims()[1];

    // The only line that changes in a Candle model: the type.
    let ours = candle_gate::QMatMul::from_qtensor(weight)?;
    let theirs = CandleQMatMul::from_qtensor(content.tensor(&mut file, "blk.0.ffn_down.weight", &Device::Cpu)?)?;

    // One activation row, alone and as the first of 7 rows.
    let rows = Tensor::randn(0f32, 1.0, (7, k), &Device::Cpu)?;
    let first = rows.narrow(0, 0, 1)?;
    for (name, alone, batched) in [
        ("candle_gate::QMatMul", ours.forward(&first)?, ours.forward(&rows)?),
        ("candle's QMatMul", theirs.forward(&first)?, theirs.forward(&rows)?),
    ] {
        let a = alone.flatten_all()?.to_vec1::<f32>()?;
        let b = batched.narrow(0, 0, 1)?.flatten_all()?.to_vec1::<f32>()?;
        let same = a.iter().zip(&b).filter(|(x, y)| x.to_bits() == y.to_bits()).count();
        println!("{name:22}: row 0 alone vs in 7 rows: {same} of {} outputs bit-identical", a.len());
    }
    Ok(())
}
