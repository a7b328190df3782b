//! Tokenizer and chat template, both from the GGUF metadata.
//!
//! Encoding goes through the `tokenizers` crate (Candle's GGUF tokenizer support). Decoding is
//! done here at the byte level: every token maps to the raw bytes it stands for, and streaming
//! only ever emits whole UTF-8 characters, so a token that ends inside a multi-byte character
//! is held back until the character is complete.

use std::collections::HashSet;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use serde::{Deserialize, Serialize};
use tokenizers::pre_tokenizers::{byte_level::ByteLevel, digits::Digits, sequence::Sequence};
use tokenizers::Tokenizer;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct GgufTokenizer {
    inner: Tokenizer,
    token_bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Tokens that end a turn: EOS plus the template's end-of-turn markers that exist in the vocab.
    pub stop_ids: HashSet<u32>,
    chat_template: Option<String>,
    bos_text: String,
    eos_text: String,
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

impl GgufTokenizer {
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let err = |e: candle_core::Error| Error::Tokenizer(format!("{}: {e}", f.path.display()));
        let mut inner = Tokenizer::from_gguf(&f.content).map_err(err)?;
        let pre = f.get_str("tokenizer.ggml.pre").unwrap_or_default();
        if pre == "smollm" {
            // SmolLM's tokenizer.json splits every digit before the GPT-2 byte-level split.
            let seq = Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]);
            inner.with_pre_tokenizer(Some(seq));
        }
        let tokens: Vec<String> = match f.get("tokenizer.ggml.tokens")? {
            Value::Array(a) => a.iter().map(|v| v.to_string().cloned().unwrap_or_default()).collect(),
            _ => return Err(Error::Tokenizer("tokenizer.ggml.tokens is not an array".into())),
        };
        let types: Vec<u32> = match f.metadata().get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a.iter().map(|v| v.to_i32().map(|x| x as u32).unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let table = unicode_to_byte();
        let mut token_bytes = Vec::with_capacity(tokens.len());
        let mut special = Vec::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            let ty = types.get(i).copied().unwrap_or(1);
            // 3 = control, 4 = user-defined: their text is literal, not byte-level encoded.
            let is_control = ty == 3;
            special.push(is_control);
            if ty == 3 || ty == 4 {
                token_bytes.push(t.as_bytes().to_vec());
            } else {
                token_bytes.push(t.chars().map(|c| table.get(&c).copied().unwrap_or(b'?')).collect());
            }
        }
        let id_of = |key: &str| f.get_usize(key).ok().map(|x| x as u32);
        let bos_id = id_of("tokenizer.ggml.bos_token_id");
        let eos_id = id_of("tokenizer.ggml.eos_token_id");
        let mut stop_ids: HashSet<u32> = eos_id.into_iter().collect();
        for marker in ["<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"] {
            if let Some(id) = inner.token_to_id(marker) {
                stop_ids.insert(id);
            }
        }
        let text_of = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned().unwrap_or_default();
        Ok(GgufTokenizer {
            bos_text: text_of(bos_id),
            eos_text: text_of(eos_id),
            inner,
            token_bytes,
            special,
            bos_id,
            eos_id,
            stop_ids,
            chat_template: f.get_str("tokenizer.chat_template").ok(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
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

    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        let tpl = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::Tokenizer("the model has no chat template in its metadata".into()))?;
        if messages.is_empty() {
            return Err(Error::BadInput("a chat needs at least one message".into()));
        }
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", tpl).map_err(|e| Error::Tokenizer(format!("chat template: {e}")))?;
        let t = env.get_template("chat").map_err(|e| Error::Tokenizer(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_text,
            eos_token => self.eos_text,
        })
        .map_err(|e| Error::Tokenizer(format!("chat template: {e}")))
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
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) => match e.error_len() {
                // Invalid bytes (not merely incomplete): emit them as U+FFFD and move on.
                Some(_) => self.pending.len(),
                None => e.valid_up_to(),
            },
        };
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
