//! SentencePiece-style tokenization from a GGUF vocabulary (`tokenizer.ggml.model = "llama"`:
//! Gemma, Llama 2), the way llama.cpp's SPM tokenizer does it: spaces become `▁`, the text is
//! cut into UTF-8 characters, and the adjacent pair whose joined text is the highest-scoring
//! token (the leftmost among equals) is merged, again and again, until no pair joins into a
//! token. A piece left that is no token falls back to its bytes (`<0xXX>` tokens).
//!
//! Control tokens never come out of a merge: user text never becomes one (llama.cpp would
//! merge up to a control token's text if the pieces on the way exist; none do in Gemma's
//! vocabulary, and the golden test pins that we agree with llama.cpp there).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// SentencePiece's visible space.
pub const SPACE: char = '\u{2581}';

pub struct Spm {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    byte_ids: [Option<u32>; 256],
    unk_id: Option<u32>,
}

/// A candidate merge of the pieces starting at `left` and `right`, as `text_len` bytes.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// The heap's top is the highest score, then the leftmost.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

/// One piece of the text being merged: a byte range, linked to its neighbours.
#[derive(Clone, Copy)]
struct Piece {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    /// `kinds[i]`: the GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined,
    /// 5 unused, 6 byte).
    pub fn new(tokens: &[String], scores: &[f32], kinds: &[u32], unk_id: Option<u32>) -> Self {
        let mut ids = HashMap::with_capacity(tokens.len());
        let mut byte_ids = [None; 256];
        for (i, t) in tokens.iter().enumerate() {
            let kind = kinds.get(i).copied().unwrap_or(1);
            if kind == 6 {
                if let Some(b) = t.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                    if let Ok(b) = u8::from_str_radix(b, 16) {
                        byte_ids[b as usize] = Some(i as u32);
                    }
                }
                continue;
            }
            if kind == 3 || t.is_empty() {
                continue;
            }
            // The first of equal texts wins, as in llama.cpp's map.
            ids.entry(t.clone()).or_insert(i as u32);
        }
        let mut scores = scores.to_vec();
        scores.resize(tokens.len(), 0.0);
        Spm { ids, scores, byte_ids, unk_id }
    }

    /// The ids of `text` (no BOS; spaces are escaped here).
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let text: String = text.chars().map(|c| if c == ' ' { SPACE } else { c }).collect();
        let mut pieces: Vec<Piece> = Vec::new();
        for (start, c) in text.char_indices() {
            let n = pieces.len();
            pieces.push(Piece { start, len: c.len_utf8(), prev: n.checked_sub(1), next: Some(n + 1) });
        }
        if let Some(last) = pieces.last_mut() {
            last.next = None;
        }
        let mut queue = BinaryHeap::new();
        let try_pair = |queue: &mut BinaryHeap<Bigram>, pieces: &[Piece], left: usize, right: usize| {
            let (a, b) = (pieces[left], pieces[right]);
            let joined = &text[a.start..b.start + b.len];
            if let Some(&id) = self.ids.get(joined) {
                queue.push(Bigram { score: self.scores[id as usize], left, right, len: joined.len() });
            }
        };
        for i in 1..pieces.len() {
            try_pair(&mut queue, &pieces, i - 1, i);
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (pieces[b.left], pieces[b.right]);
            // Stale: one side was merged into something else since this pair was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            pieces[b.left].len += r.len;
            pieces[b.left].next = r.next;
            pieces[b.right].len = 0;
            if let Some(n) = r.next {
                pieces[n].prev = Some(b.left);
            }
            if let Some(p) = pieces[b.left].prev {
                try_pair(&mut queue, &pieces, p, b.left);
            }
            if let Some(n) = pieces[b.left].next {
                try_pair(&mut queue, &pieces, b.left, n);
            }
        }
        let mut at = (!pieces.is_empty()).then_some(0);
        while let Some(i) = at {
            let p = pieces[i];
            let piece = &text[p.start..p.start + p.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        if let Some(id) = self.byte_ids[b as usize].or(self.unk_id) {
                            out.push(id);
                        }
                    }
                }
            }
            at = p.next;
        }
    }
}

/// A token's text as the bytes it stands for: `▁` is a space, `<0xXX>` byte tokens their byte.
pub fn token_bytes(text: &str, kind: u32) -> Vec<u8> {
    if kind == 6 {
        if let Some(b) = text.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
            if let Ok(b) = u8::from_str_radix(b, 16) {
                return vec![b];
            }
        }
    }
    if kind == 3 || kind == 4 {
        return text.as_bytes().to_vec();
    }
    text.replace(SPACE, " ").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> Spm {
        let toks: Vec<String> =
            ["<unk>", "a", "b", "ab", "abc", "c", "\u{2581}", "\u{2581}a", "<0x41>", "<0xE2>", "<0x82>", "<0xAC>"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        let scores = [0.0, -1.0, -1.0, -0.5, -0.2, -1.0, -1.0, -0.1, 0.0, 0.0, 0.0, 0.0];
        let kinds = [2, 1, 1, 1, 1, 1, 1, 1, 6, 6, 6, 6];
        Spm::new(&toks, &scores, &kinds, Some(0))
    }

    fn enc(s: &Spm, t: &str) -> Vec<u32> {
        let mut v = Vec::new();
        s.encode(t, &mut v);
        v
    }

    #[test]
    fn merges_by_score_and_falls_back_to_bytes() {
        let s = vocab();
        assert_eq!(enc(&s, "abc"), vec![4]);
        assert_eq!(enc(&s, " a b"), vec![7, 6, 2]);
        // 'A' is a byte token; '€' has no token: its three bytes.
        assert_eq!(enc(&s, "A€"), vec![8, 9, 10, 11]);
        assert_eq!(enc(&s, ""), Vec::<u32>::new());
    }
}
