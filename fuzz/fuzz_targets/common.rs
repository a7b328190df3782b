//! The real tokenizers, loaded once per process.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_gate::gguf::GgufFile;
use candle_gate::tokenizer::GgufTokenizer;

fn cache(file: &str) -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/candle-gate").join(file)
}

fn load(var: &str, default: &str) -> GgufTokenizer {
    let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| cache(default));
    let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{var}: {e} (set {var} to a GGUF path)"));
    GgufTokenizer::from_gguf(&f).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// SmolLM2's tokenizer (GPT-2 BPE, digits split): `$FUZZ_SMOL_GGUF` or the cached file.
pub fn smol() -> &'static GgufTokenizer {
    static T: OnceLock<GgufTokenizer> = OnceLock::new();
    T.get_or_init(|| load("FUZZ_SMOL_GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf"))
}

/// Qwen2.5-Coder's tokenizer (qwen2 pre-tokenizer, NFC, its chat template):
/// `$FUZZ_QWEN_GGUF` or the cached 0.5B file.
pub fn qwen() -> &'static GgufTokenizer {
    static T: OnceLock<GgufTokenizer> = OnceLock::new();
    T.get_or_init(|| load("FUZZ_QWEN_GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
}

/// Gemma 3's tokenizer (SentencePiece, byte fallback, BOS added): `$FUZZ_GEMMA_GGUF` or the
/// cached 270M file.
pub fn gemma() -> &'static GgufTokenizer {
    static T: OnceLock<GgufTokenizer> = OnceLock::new();
    T.get_or_init(|| load("FUZZ_GEMMA_GGUF", "gemma-3-270m-q4_k_m.gguf"))
}

/// The bytes that some token of the vocabulary spells alone.
pub fn spellable(tok: &GgufTokenizer) -> &'static [bool; 256] {
    static S: OnceLock<[bool; 256]> = OnceLock::new();
    static Q: OnceLock<[bool; 256]> = OnceLock::new();
    let cell = if std::ptr::eq(tok, smol()) { &S } else { &Q };
    cell.get_or_init(|| {
        let mut s = [false; 256];
        for id in 0..tok.vocab_size() as u32 {
            if let [b] = tok.bytes(&[id], false)[..] {
                s[b as usize] = true;
            }
        }
        s
    })
}
