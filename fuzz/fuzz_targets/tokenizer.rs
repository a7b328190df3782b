//! Arbitrary bytes against the real tokenizers (SmolLM2's, Qwen2.5's or Gemma 3's, picked by
//! the first byte): lossy UTF-8 text through `encode` then `decode`, which must give the text
//! back (SmolLM2; Gemma, whose byte tokens spell anything, exactly; Qwen2.5 normalizes to NFC,
//! so for it: ASCII text exactly, any text stably), and the bytes as arbitrary u32 ids through
//! `decode` and the streaming decoder, which must not panic on ids outside the vocabulary and
//! must agree with each other.
#![no_main]

#[path = "common.rs"]
mod common;

use candle_gate::tokenizer::StreamDecoder;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    let (qwen, gemma) = (sel & 1 == 1 && sel & 4 == 0, sel & 4 == 4);
    let tok = if gemma {
        common::gemma()
    } else if qwen {
        common::qwen()
    } else {
        common::smol()
    };

    let text = String::from_utf8_lossy(rest);
    let ids = tok.encode(&text).expect("any text encodes");
    assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()), "an id outside the vocabulary");
    let back = tok.decode(&ids);
    if gemma {
        // BOS comes first and decodes to nothing; user text never turns into a control token.
        assert_eq!(ids.first(), tok.bos_id.as_ref(), "no BOS");
        assert_eq!(back, text, "decode(encode(text)) is not the text");
    } else if !qwen || text.is_ascii() {
        // What the vocabulary can spell: SmolLM2's has no token for the bytes 0x04, 0x06, 0x13,
        // 0x14, 0x16, 0x1D, 0xF1, 0xF2 (and those never in UTF-8), so, as with Hugging Face's
        // tokenizer, those bytes are lost (and what is left of their character decodes as U+FFFD).
        let spellable = common::spellable(tok);
        let kept: Vec<u8> = text.bytes().filter(|&b| spellable[b as usize]).collect();
        let want = String::from_utf8_lossy(&kept);
        assert_eq!(back, want, "decode(encode(text)) is not the text");
    } else {
        let again = tok.decode(&tok.encode(&back).expect("encodes"));
        assert_eq!(again, back, "decode(encode(.)) is not stable");
    }

    // The same bytes as token ids, most of them far outside the vocabulary.
    let raw: Vec<u32> = rest.chunks(4).map(|c| {
        let mut b = [0u8; 4];
        b[..c.len()].copy_from_slice(c);
        let id = u32::from_le_bytes(b);
        // Every other id folded into the vocabulary, so the decoding gets exercised too.
        if sel & 2 == 0 { id % (tok.vocab_size() as u32 + 8) } else { id }
    }).collect();
    let all = tok.decode(&raw);
    let mut s = StreamDecoder::default();
    let mut streamed: String = raw.iter().map(|&id| s.push(tok, id)).collect();
    streamed.push_str(&s.finish());
    assert_eq!(streamed, all, "streaming decode differs from decode");
});
