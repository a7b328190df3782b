//! Arbitrary bytes as a GGUF file: the bounded pre-check, then (when it accepts) Candle's
//! header reader, every tensor read, and the library's own `GgufFile` on top (the tokenizer
//! built from a hostile header is `gguf_tokenizer`'s, as it costs 10x more per input).
//! Run with `-rss_limit_mb=2048 -malloc_limit_mb=1024`: nothing may allocate what a header
//! merely claims.
#![no_main]

use std::io::Cursor;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file::Content;
use candle_core::Device;
use candle_gate::gguf::GgufFile;
use candle_gate::gguf_check::check_bytes;
use libfuzzer_sys::fuzz_target;

/// A per-process scratch file, in memory where the host has /dev/shm.
fn scratch() -> &'static std::path::Path {
    static P: OnceLock<std::path::PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
        dir.join(format!("candle-gate-fuzz-{}.gguf", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(summary) = check_bytes(data) else { return };
    // What the check accepts, Candle's reader reads, and agrees on where the data starts.
    let content = match Content::read(&mut Cursor::new(data)) {
        Ok(c) => c,
        Err(e) => panic!("accepted by gguf_check but refused by Candle: {e}"),
    };
    assert_eq!(content.tensor_data_offset, summary.tensor_data_offset);
    assert!(content.tensor_infos.len() as u64 <= summary.tensor_count);
    let mut cur = Cursor::new(data);
    for (name, info) in &content.tensor_infos {
        // Candle reads a tensor of no elements through an unaligned dangling pointer (UB, caught
        // by debug assertions); `GgufFile::tensor` refuses those, so the library never does.
        if info.shape.elem_count() > 0 {
            let _ = content.tensor(&mut cur, name, &Device::Cpu);
        }
    }

    // The library's path: open the file, read its tensors and metadata.
    let path = scratch();
    std::fs::write(path, data).expect("scratch file");
    let mut f = match GgufFile::open(path) {
        Ok(f) => f,
        Err(e) => panic!("accepted by gguf_check but GgufFile::open refused: {e}"),
    };
    let names: Vec<String> = f.content.tensor_infos.keys().cloned().collect();
    for n in &names {
        let _ = f.tensor_dims(n);
        let _ = f.tensor(n);
    }
    for key in ["general.alignment", "llama.block_count", "tokenizer.ggml.eos_token_id"] {
        let _ = f.get_usize(key);
        let _ = f.get_f32(key);
        let _ = f.get_str(key);
    }
});
