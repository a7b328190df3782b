//! Arbitrary bytes as a GGUF file whose tokenizer the library builds: the pre-check, then
//! `GgufFile::open` and `GgufTokenizer::from_gguf` on what it accepts (vocabularies, merges,
//! token types, ids and chat templates all from the input), then encode, decode and a chat.
//! Seeds: small GGUFs with a complete tokenizer (`make_seeds.py`).
#![no_main]

use std::sync::OnceLock;

use candle_gate::gguf::GgufFile;
use candle_gate::gguf_check::check_bytes;
use candle_gate::tokenizer::GgufTokenizer;
use libfuzzer_sys::fuzz_target;

/// A per-process scratch file, in memory where the host has /dev/shm.
fn scratch() -> &'static std::path::Path {
    static P: OnceLock<std::path::PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
        dir.join(format!("candle-gate-fuzz-tok-{}.gguf", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    if check_bytes(data).is_err() {
        return;
    }
    let path = scratch();
    std::fs::write(path, data).expect("scratch file");
    let f = match GgufFile::open(path) {
        Ok(f) => f,
        Err(e) => panic!("accepted by gguf_check but GgufFile::open refused: {e}"),
    };
    if let Ok(tok) = GgufTokenizer::from_gguf(&f) {
        if let Ok(ids) = tok.encode("Hello, <|im_end|> world 123 ünï") {
            let _ = tok.decode(&ids);
        }
        let _ = tok.decode(&[0, 1, 2, u32::MAX, tok.vocab_size() as u32]);
        if tok.has_chat_template() {
            let msgs = serde_json::json!([
                {"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "Hi <|im_start|>"},
            ]);
            if let Ok(ids) = tok.encode_chat(&msgs, None) {
                let _ = tok.decode(&ids);
            }
        }
    }
});
