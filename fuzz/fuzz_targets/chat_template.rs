//! Chat templates from untrusted places. The first byte picks the mode:
//! * even: the input is a template source and a messages value, split at the first NUL byte,
//!   rendered by `ChatTemplate::render` (the template may loop, recurse, write without end:
//!   fuel and the output cap must stop it with an error);
//! * odd: the input is a messages value (or `{"messages": .., "tools": ..}`, or, when it is not
//!   JSON, one user message's text) rendered and encoded by the real Qwen2.5 (bit 1 clear) or
//!   SmolLM2 template through `GgufTokenizer::encode_chat`.
#![no_main]

#[path = "common.rs"]
mod common;

use candle_gate::chat::ChatTemplate;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

const CONTROLS: [&str; 4] = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>"];

/// Messages and tools from fuzz bytes.
fn chat(bytes: &[u8]) -> (Value, Option<Value>) {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(mut o)) if o.contains_key("messages") => {
            let m = o.remove("messages").unwrap();
            (m, o.remove("tools"))
        }
        Ok(v @ Value::Array(_)) => (v, None),
        Ok(v) => (json!([{"role": "user", "content": v.to_string()}]), None),
        Err(_) => (json!([{"role": "user", "content": String::from_utf8_lossy(bytes)}]), None),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    if sel & 1 == 0 {
        let cut = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        let source = String::from_utf8_lossy(&rest[..cut]).into_owned();
        let (messages, tools) = chat(rest.get(cut + 1..).unwrap_or(&[]));
        let t = ChatTemplate::new(source, "<s>".into(), "</s>".into());
        if let Ok(r) = t.render(&messages, tools.as_ref(), sel & 2 == 0, &CONTROLS) {
            let _ = r.plain();
        }
    } else {
        let tok = if sel & 2 == 0 { common::qwen() } else { common::smol() };
        let (messages, tools) = chat(rest);
        if let Ok(ids) = tok.encode_chat(&messages, tools.as_ref()) {
            assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()));
            let _ = tok.decode(&ids);
        }
        let _ = tok.render_chat(&messages, tools.as_ref());
    }
});
