use std::sync::Arc;
use candle_gate::*;

#[test]
fn smoke() {
    let path = registry::resolve(registry::DEFAULT_MODEL).unwrap();
    let t = std::time::Instant::now();
    let model = Arc::new(Model::load(&path, Arc::new(Policy::default())).unwrap());
    eprintln!("load {:?}", t.elapsed());
    let mut eng = Engine::new(model.clone(), Arc::new(Policy::default()), EngineConfig::default()).unwrap();
    let ids = model.tokenizer.encode("The capital of France is").unwrap();
    eprintln!("{ids:?}");
    let id = eng.submit(Request { prompt_tokens: ids, max_new_tokens: 16, ..Default::default() }).unwrap();
    let t = std::time::Instant::now();
    let out = eng.run_to_completion(&[id]).unwrap();
    eprintln!("gen {:?} {:?} {:?}", t.elapsed(), out[0].text, out[0].margins);
}
