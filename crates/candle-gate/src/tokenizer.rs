//! Tokenizer, from the GGUF metadata.
//!
//! Byte-level BPE goes through the `tokenizers` crate (Candle's GGUF tokenizer support: the
//! GPT-2, `qwen2` and `llama3` pre-tokenizers, NFC for `qwen2` as its `tokenizer.json` has it);
//! SentencePiece-style vocabularies (Gemma) through [`crate::spm`], llama.cpp's algorithm.
//! Added tokens are matched here, not by the `tokenizers` crate, because who wrote the text
//! decides: user-defined tokens (GGUF token type 4) are matched anywhere, as llama.cpp matches
//! them; control tokens (type 3: `<|im_start|>`, `<|im_end|>`, ...) only in a chat template's
//! own text ([`crate::chat`]), never in a prompt or a message.
//!
//! Decoding is done at the byte level: every token maps to the raw bytes it stands for, and
//! streaming only ever emits whole UTF-8 characters, so a token that ends inside a multi-byte
//! character is held back until the character is complete.

use std::collections::HashSet;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::pre_tokenizers::{byte_level::ByteLevel, digits::Digits, sequence::Sequence};
use tokenizers::Tokenizer;

pub use crate::chat::ChatMessage;
use crate::chat::ChatTemplate;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::spm::Spm;

/// An added token's text and id.
#[derive(Clone, Debug)]
struct Piece {
    text: String,
    id: u32,
}

pub struct GgufTokenizer {
    /// BPE or SentencePiece over plain text; it never matches an added token itself.
    inner: Model,
    token_bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    /// User-defined tokens (type 4): one token wherever their text appears.
    user_defined: Vec<Piece>,
    /// Control tokens (type 3): one token only where the chat template wrote them.
    control: Vec<Piece>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Whether a prompt starts with BOS (`tokenizer.ggml.add_bos_token`), as llama.cpp adds it.
    pub add_bos: bool,
    /// Tokens that end a turn: EOS plus the template's end-of-turn markers that exist in the vocab.
    pub stop_ids: HashSet<u32>,
    chat_template: Option<ChatTemplate>,
}

fn sorted(ids: &HashSet<u32>) -> Vec<u32> {
    let mut v: Vec<u32> = ids.iter().copied().collect();
    v.sort_unstable();
    v
}

/// GPT-2's byte ↔ printable-character table, inverted: char → byte.
fn unicode_to_byte() -> std::collections::HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter().zip(cs).map(|(b, c)| (char::from_u32(c).unwrap(), b as u8)).collect()
}

/// tokenizers' BPE builder copies each merge's two halves into a buffer as long as the longest
/// token, and panics (before it looks the joined token up) where they do not fit. Found by the
/// `gguf_tokenizer` fuzzer; refused here first, with the error the builder means to give.
fn check_merge_lengths(f: &GgufFile) -> Result<()> {
    let (Some(Value::Array(tokens)), Some(Value::Array(merges))) =
        (f.metadata().get("tokenizer.ggml.tokens"), f.metadata().get("tokenizer.ggml.merges"))
    else {
        return Ok(()); // missing or mistyped: Candle's reader says so
    };
    let longest = tokens.iter().filter_map(|t| t.to_string().ok()).map(|t| t.len()).max().unwrap_or(0);
    for (i, m) in merges.iter().enumerate() {
        if let Some((a, b)) = m.to_string().ok().and_then(|m| m.split_once(' ')) {
            if a.len() + b.len() > longest {
                return Err(Error::Tokenizer(format!(
                    "{}: merge {i} (`{a}` + `{b}`) makes a token that is not in the vocabulary (longer than any)",
                    f.path.display()
                )));
            }
        }
    }
    Ok(())
}

/// How plain text (between added tokens) becomes ids.
enum Model {
    /// Byte-level BPE (`tokenizer.ggml.model = "gpt2"`).
    Bpe(Box<Tokenizer>),
    /// SentencePiece-style (`"llama"`: Gemma, Llama 2); `add_space_prefix` puts a space before
    /// each run of text, as llama.cpp does.
    Spm { spm: Box<Spm>, add_space_prefix: bool },
}

fn bpe_model(f: &GgufFile) -> Result<Tokenizer> {
    let err = |e: candle_core::Error| Error::Tokenizer(format!("{}: {e}", f.path.display()));
    check_merge_lengths(f)?;
    let mut inner = Tokenizer::from_gguf(&f.content).map_err(err)?;
    inner.set_encode_special_tokens(true);
    // tokenizers 0.23 caches BPE words in thread-locals keyed per tokenizer instance and
    // never frees an instance's entries when it is dropped: each tokenizer built would leave
    // up to 10,000 words behind on every thread that encoded with it, so a process that
    // loads models again and again grows without bound (the gguf_tokenizer fuzzer grew by
    // ~16 KB a run). Capacity 0 caches nothing: a 124 KB text then encodes in 111 ms instead
    // of 84 ms, which is nothing next to prefilling its 38,736 tokens.
    if let tokenizers::ModelWrapper::BPE(bpe) = inner.get_model() {
        let mut bpe = bpe.clone();
        bpe.resize_cache(0);
        inner.with_model(bpe);
    }
    let pre = f.get_str("tokenizer.ggml.pre").unwrap_or_default();
    if pre == "smollm" {
        // SmolLM's tokenizer.json splits every digit before the GPT-2 byte-level split.
        let seq = Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]);
        inner.with_pre_tokenizer(Some(seq));
    }
    Ok(inner)
}

fn f32_array(f: &GgufFile, key: &str) -> Vec<f32> {
    match f.metadata().get(key) {
        Some(Value::Array(a)) => a.iter().map(|v| v.to_f32().unwrap_or(0.0)).collect(),
        _ => Vec::new(),
    }
}

impl GgufTokenizer {
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let tokens: Vec<String> = match f.get("tokenizer.ggml.tokens")? {
            Value::Array(a) => a.iter().map(|v| v.to_string().cloned().unwrap_or_default()).collect(),
            _ => return Err(Error::Tokenizer("tokenizer.ggml.tokens is not an array".into())),
        };
        let types: Vec<u32> = match f.metadata().get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a.iter().map(|v| v.to_i32().map(|x| x as u32).unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let id_of = |key: &str| f.get_usize(key).ok().map(|x| x as u32);
        let flag = |key: &str| match f.metadata().get(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        };
        let kind = f.get_str("tokenizer.ggml.model").unwrap_or_default();
        let spm = kind == "llama";
        let inner = if spm {
            let scores = f32_array(f, "tokenizer.ggml.scores");
            let spm = Box::new(Spm::new(&tokens, &scores, &types, id_of("tokenizer.ggml.unknown_token_id")));
            // llama.cpp's defaults for SentencePiece vocabularies when the metadata is silent.
            Model::Spm { spm, add_space_prefix: flag("tokenizer.ggml.add_space_prefix").unwrap_or(true) }
        } else {
            Model::Bpe(Box::new(bpe_model(f)?))
        };
        let add_bos = flag("tokenizer.ggml.add_bos_token").unwrap_or(spm);
        let table = unicode_to_byte();
        let mut token_bytes = Vec::with_capacity(tokens.len());
        let mut special = Vec::with_capacity(tokens.len());
        let (mut user_defined, mut control) = (Vec::new(), Vec::new());
        for (i, t) in tokens.iter().enumerate() {
            let ty = types.get(i).copied().unwrap_or(1);
            // 3 = control, 4 = user-defined: their text is literal, not byte-level encoded.
            let is_control = ty == 3;
            // Control, unknown (2) and unused (5) tokens are not text: decoding drops them.
            special.push(matches!(ty, 2 | 3 | 5));
            if !t.is_empty() && (ty == 3 || ty == 4) {
                let piece = Piece { text: t.clone(), id: i as u32 };
                if is_control {
                    control.push(piece)
                } else {
                    user_defined.push(piece)
                }
            }
            if spm {
                token_bytes.push(crate::spm::token_bytes(t, ty));
            } else if ty == 3 || ty == 4 {
                token_bytes.push(t.as_bytes().to_vec());
            } else {
                token_bytes.push(t.chars().map(|c| table.get(&c).copied().unwrap_or(b'?')).collect());
            }
        }
        let bos_id = id_of("tokenizer.ggml.bos_token_id");
        let eos_id = id_of("tokenizer.ggml.eos_token_id");
        let mut stop_ids: HashSet<u32> = eos_id.into_iter().collect();
        for marker in ["<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>"] {
            if let Some(id) = tokens.iter().position(|t| t == marker) {
                stop_ids.insert(id as u32);
            }
        }
        let text_of = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned().unwrap_or_default();
        let chat_template =
            f.get_str("tokenizer.chat_template").ok().map(|t| ChatTemplate::new(t, text_of(bos_id), text_of(eos_id)));
        Ok(GgufTokenizer {
            inner,
            token_bytes,
            special,
            user_defined,
            control,
            bos_id,
            eos_id,
            add_bos: add_bos && bos_id.is_some(),
            stop_ids,
            chat_template,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Each token's kind as this tokenizer treats it: (not text, control, user-defined).
    fn kinds(&self) -> Vec<(bool, bool, bool)> {
        let mut k: Vec<(bool, bool, bool)> = self.special.iter().map(|&s| (s, false, false)).collect();
        self.control.iter().for_each(|p| k[p.id as usize].1 = true);
        self.user_defined.iter().for_each(|p| k[p.id as usize].2 = true);
        k
    }

    /// Where `self`'s vocabulary first differs from `other`'s (None: the same tokens with the
    /// same ids, bytes and kinds, the same BOS, EOS and stop ids): what a draft model must share
    /// with its target.
    pub fn vocabulary_difference(&self, other: &GgufTokenizer) -> Option<String> {
        if self.vocab_size() != other.vocab_size() {
            return Some(format!("{} tokens against {}", self.vocab_size(), other.vocab_size()));
        }
        let (mine, theirs) = (self.kinds(), other.kinds());
        let show = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        for i in 0..self.vocab_size() {
            if self.token_bytes[i] != other.token_bytes[i] {
                let (a, b) = (show(&self.token_bytes[i]), show(&other.token_bytes[i]));
                return Some(format!("token {i} is {a:?} against {b:?}"));
            }
            if mine[i] != theirs[i] {
                return Some(format!("token {i} ({:?}) is of another kind", show(&self.token_bytes[i])));
            }
        }
        for (t, a, b) in [("BOS", self.bos_id, other.bos_id), ("EOS", self.eos_id, other.eos_id)] {
            if a != b {
                return Some(format!("the {t} id is {a:?} against {b:?}"));
            }
        }
        if self.stop_ids != other.stop_ids {
            return Some(format!(
                "the stop ids are {:?} against {:?}",
                sorted(&self.stop_ids),
                sorted(&other.stop_ids)
            ));
        }
        None
    }

    /// Token ids of text someone wrote (a completion prompt): control-token texts in it stay
    /// text. BOS first where the model's metadata asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode_marked(text, false, None)?;
        if self.add_bos {
            ids.insert(0, self.bos_id.expect("add_bos implies a BOS id"));
        }
        Ok(ids)
    }

    /// Token ids of text that is a rendered template already (the caller vouches for it):
    /// control-token texts anywhere in it become control tokens.
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_marked(text, true, None)
    }

    /// BPE over `text` between added tokens: user-defined ones anywhere, control ones too when
    /// `controls` (a rendered template), except where the caller's text carries `marker`.
    fn encode_marked(&self, text: &str, controls: bool, marker: Option<char>) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut gap = String::new();
        let mut i = 0;
        while i < text.len() {
            let rest = &text[i..];
            let allowed = if controls { &self.control[..] } else { &[] };
            let hit = self
                .user_defined
                .iter()
                .chain(allowed)
                .filter(|p| rest.starts_with(&p.text))
                .max_by_key(|p| p.text.len());
            if let Some(p) = hit {
                self.encode_plain(&gap, &mut ids)?;
                gap.clear();
                ids.push(p.id);
                i += p.text.len();
                continue;
            }
            let c = rest.chars().next().expect("i is on a char boundary");
            if Some(c) != marker {
                gap.push(c);
            }
            i += c.len_utf8();
        }
        self.encode_plain(&gap, &mut ids)?;
        Ok(ids)
    }

    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        match &self.inner {
            Model::Bpe(t) => {
                let enc = t.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
                ids.extend_from_slice(enc.get_ids());
            }
            // Every run of plain text here follows the start or an added token: where llama.cpp
            // puts the space prefix.
            Model::Spm { spm, add_space_prefix: true } => spm.encode(&format!(" {text}"), ids),
            Model::Spm { spm, add_space_prefix: false } => spm.encode(text, ids),
        }
        Ok(())
    }

    /// Raw bytes of the tokens; control tokens are dropped unless `keep_special`.
    pub fn bytes(&self, ids: &[u32], keep_special: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            let i = id as usize;
            if i < self.token_bytes.len() && (keep_special || !self.special[i]) {
                out.extend_from_slice(&self.token_bytes[i]);
            }
        }
        out
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.bytes(ids, false)).into_owned()
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    fn template(&self) -> Result<&ChatTemplate> {
        self.chat_template.as_ref().ok_or_else(|| {
            Error::invalid(
                "messages",
                "the model has no chat template in its metadata (a base model): send a completion, not a chat",
            )
        })
    }

    fn render(&self, messages: &serde_json::Value, tools: Option<&serde_json::Value>) -> Result<crate::chat::Rendered> {
        let controls: Vec<&str> = self.control.iter().map(|p| p.text.as_str()).collect();
        self.template()?.render(messages, tools, true, &controls)
    }

    /// The chat as the template renders it (with the generation prompt), as text.
    pub fn render_chat(&self, messages: &serde_json::Value, tools: Option<&serde_json::Value>) -> Result<String> {
        Ok(self.render(messages, tools)?.plain())
    }

    /// Token ids of a chat: control tokens where the template wrote them, never where a message
    /// (or a tool definition) did.
    pub fn encode_chat(&self, messages: &serde_json::Value, tools: Option<&serde_json::Value>) -> Result<Vec<u32>> {
        let r = self.render(messages, tools)?;
        self.encode_marked(&r.text, true, Some(r.marker))
    }

    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        self.render_chat(&serde_json::to_value(messages).expect("messages serialize"), None)
    }

    pub fn template_source(&self) -> Option<&str> {
        self.chat_template.as_ref().map(ChatTemplate::source)
    }
}

/// Incremental UTF-8-safe decoder: feed token ids, get back only complete characters.
#[derive(Default, Clone, Debug)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn push(&mut self, tok: &GgufTokenizer, id: u32) -> String {
        self.pending.extend(tok.bytes(&[id], false));
        // Emit everything up to an incomplete character at the end, invalid bytes as U+FFFD (as
        // `decode` does): hold back only a tail that later bytes may still complete, even when
        // invalid bytes come before it.
        let mut valid = 0;
        loop {
            match std::str::from_utf8(&self.pending[valid..]) {
                Ok(_) => {
                    valid = self.pending.len();
                    break;
                }
                Err(e) => match e.error_len() {
                    Some(n) => valid += e.valid_up_to() + n,
                    None => {
                        valid += e.valid_up_to();
                        break;
                    }
                },
            }
        }
        let out: Vec<u8> = self.pending.drain(..valid).collect();
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Whatever is still held back (an incomplete character at the end of the stream).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file;

    /// A byte-level vocabulary: token `b` is byte `b`, token 256 is the bytes FF E3 together.
    fn byte_tokenizer() -> GgufTokenizer {
        let mut to_char: Vec<(u8, char)> = unicode_to_byte().into_iter().map(|(c, b)| (b, c)).collect();
        to_char.sort();
        let mut tokens: Vec<Value> = to_char.iter().map(|&(_, c)| Value::String(c.to_string())).collect();
        let (ff, e3) = (to_char[0xFF].1, to_char[0xE3].1);
        tokens.push(Value::String(format!("{ff}{e3}")));
        let md = [
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.tokens", Value::Array(tokens)),
            ("tokenizer.ggml.merges", Value::Array(vec![Value::String(format!("{ff} {e3}"))])),
        ];
        let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
        let path = std::env::temp_dir().join(format!("candle-gate-tokenizer-test-{}.gguf", std::process::id()));
        let mut w = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut w, &md, &[]).unwrap();
        std::fs::write(&path, w.into_inner()).unwrap();
        let t = GgufTokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        let _ = std::fs::remove_file(&path);
        t
    }

    /// Found by the `gguf_tokenizer` fuzz target: a merge whose halves join into something longer
    /// than every token made the `tokenizers` crate panic while building the BPE.
    #[test]
    fn a_merge_longer_than_every_token_is_an_error_not_a_panic() {
        let md = [
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.tokens", Value::Array(vec![Value::String("a".into()), Value::String("b".into())])),
            ("tokenizer.ggml.merges", Value::Array(vec![Value::String("a b".into())])),
        ];
        let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
        let path = std::env::temp_dir().join(format!("candle-gate-merge-test-{}.gguf", std::process::id()));
        let mut w = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut w, &md, &[]).unwrap();
        std::fs::write(&path, w.into_inner()).unwrap();
        let got = GgufTokenizer::from_gguf(&GgufFile::open(&path).unwrap());
        let _ = std::fs::remove_file(&path);
        let msg = got.err().expect("a merge outside the vocabulary is refused").to_string();
        assert!(msg.contains("merge 0") && msg.contains("not in the vocabulary"), "{msg}");
    }

    /// Found by the `tokenizer` fuzz target: a token holding an invalid byte and then the start
    /// of a character had the start emitted as U+FFFD before the rest of it arrived.
    #[test]
    fn streaming_agrees_with_decode_after_invalid_bytes() {
        let tok = byte_tokenizer();
        for ids in [vec![256, 0x81, 0x82], vec![0xFF, 0xE3, 0x81, 0x82], vec![0x41, 256], vec![256, 0x41]] {
            let mut s = StreamDecoder::default();
            let mut streamed: String = ids.iter().map(|&id| s.push(&tok, id)).collect();
            streamed.push_str(&s.finish());
            assert_eq!(streamed, tok.decode(&ids), "{ids:?}");
        }
        assert_eq!(tok.decode(&[256, 0x81, 0x82]), "\u{FFFD}あ");
    }
}
