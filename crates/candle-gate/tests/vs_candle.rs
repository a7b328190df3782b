//! Our llama forward against Candle's own `candle-transformers` quantized llama on the same
//! file. Both quantize activations to Q8 inside Candle's kernels, so they agree closely but
//! not bitwise once Candle's attention changes its matmul path; the greedy choice must agree.
use std::sync::Arc;

use candle_core::{Device, Tensor};
use candle_gate::*;
use candle_transformers::models::quantized_llama::ModelWeights;

#[test]
fn logits_match_candle_transformers() {
    let path = registry::resolve(registry::DEFAULT_MODEL).expect("run `candle-gate fetch` first");
    let policy = Arc::new(Policy::new(Mode::Native));
    let model = Model::load(&path, WeightLayout::for_mode(policy.mode)).unwrap();
    let chat = serde_json::json!([{"role": "user", "content": "What is 2+2?"}]);
    let all = model.tokenizer.encode_chat(&chat, None).unwrap();
    for n in [1, 2, 5, all.len()] {
        let ids = &all[..n];
        let mut f = std::fs::File::open(&path).unwrap();
        let ct = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
        let mut theirs = ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
        let input = Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let want: Vec<f32> = theirs.forward(&input, 0).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        // Candle's model keeps f32 K/V: compare with f32 storage (f16 is one more rounding).
        let mut cache = model.decoder.new_cache_with(decoder::KvDtype::F32);
        let out = model
            .decoder
            .forward(&policy, &mut [decoder::SeqRows { cache: &mut cache, tokens: ids, logit_rows: 1 }])
            .unwrap();
        let got = out[0].clone().unwrap();
        let scale = want.iter().fold(0f32, |a, &b| a.max(b.abs()));
        let max_diff = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        let am = |v: &[f32]| decoder::argmax_margin(v).0;
        eprintln!("{n} tokens: max |diff| = {max_diff} (scale {scale})");
        if n < 5 {
            // Short prompts take the same matmul kernels on both sides, so they agree to float
            // rounding. Not bitwise by promise: candle-transformers takes exp/sin/cos from the
            // platform's libm (chosen per CPU and glibc release), candle-gate from `detmath`.
            assert!(max_diff <= 1e-5 * scale, "{n} tokens: max diff {max_diff} vs scale {scale}");
        }
        assert!(max_diff <= 0.1 * scale, "max diff {max_diff} vs scale {scale}");
        assert_eq!(am(&got), am(&want));
    }
}
