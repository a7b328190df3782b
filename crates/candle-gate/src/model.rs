//! A loaded model: weights in one layout, tokenizer, and what identifies it in fingerprints.
//! Which kernels run over it is an engine's policy, not the model's.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

use crate::decoder::Decoder;
use crate::dispatch::WeightLayout;
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::tokenizer::GgufTokenizer;

pub struct Model {
    pub decoder: Decoder,
    pub tokenizer: GgufTokenizer,
    pub path: PathBuf,
    /// How its matmul weights sit in memory (every mode reads every layout).
    pub layout: WeightLayout,
    sha256: OnceLock<String>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("path", &self.path).field("arch", &self.decoder.cfg.arch.name()).finish()
    }
}

impl Model {
    pub fn load(path: &Path, layout: WeightLayout) -> Result<Self> {
        let mut f = GgufFile::open(path)?;
        let tokenizer = GgufTokenizer::from_gguf(&f)?;
        let decoder = Decoder::from_gguf(&mut f, layout)?;
        Ok(Model { decoder, tokenizer, path: path.to_path_buf(), layout, sha256: OnceLock::new() })
    }

    /// sha256 of the model file, computed once on first use.
    pub fn sha256(&self) -> Result<String> {
        if let Some(s) = self.sha256.get() {
            return Ok(s.clone());
        }
        let mut h = Sha256::new();
        let mut f = std::fs::File::open(&self.path)?;
        std::io::copy(&mut f, &mut h)?;
        let s = format!("{:x}", h.finalize());
        Ok(self.sha256.get_or_init(|| s).clone())
    }
}

/// Hash of what decides a result's tokens: model file, candle-gate version, kernel policy
/// (and gate settings), the host and build (`host::signature`), and the tokens themselves. Two results with equal token ids but
/// different fingerprints ran on different stacks; equal stacks with different tokens hit a
/// near-tie.
pub fn fingerprint(model_sha256: &str, policy: &str, gate: &str, host: &str, tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    h.update(b"candle-gate fingerprint v2\0");
    h.update(model_sha256.as_bytes());
    h.update(b"\0");
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    h.update(b"\0");
    h.update(policy.as_bytes());
    h.update(b"\0");
    h.update(gate.as_bytes());
    h.update(b"\0");
    h.update(host.as_bytes());
    h.update(b"\0");
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    format!("{:x}", h.finalize())[..32].to_string()
}

/// The server's `system_fingerprint`: `fp_` and 16 hex digits of SHA-256 over the stack a
/// result's [`fingerprint`] covers (model file, version, kernel policy, gate, host), without the
/// tokens: equal for every response one stack gives.
pub fn system_fingerprint(model_sha256: &str, policy: &str, gate: &str, host: &str) -> String {
    let stack = [model_sha256, env!("CARGO_PKG_VERSION"), policy, gate, host].join("\n");
    format!("fp_{}", &format!("{:x}", Sha256::digest(stack.as_bytes()))[..16])
}

#[cfg(test)]
mod tests {
    #[test]
    fn fingerprint_covers_every_input() {
        let base = super::fingerprint("sha", "mode=invariant", "off", "target=x86_64:avx2", &[1, 2]);
        assert_eq!(base.len(), 32);
        for other in [
            super::fingerprint("sha2", "mode=invariant", "off", "target=x86_64:avx2", &[1, 2]),
            super::fingerprint("sha", "mode=gemm", "off", "target=x86_64:avx2", &[1, 2]),
            super::fingerprint("sha", "mode=invariant", "gated", "target=x86_64:avx2", &[1, 2]),
            super::fingerprint("sha", "mode=invariant", "off", "target=x86_64:avx2;gemm[fma]", &[1, 2]),
            super::fingerprint("sha", "mode=invariant", "off", "target=x86_64:avx2", &[1, 3]),
        ] {
            assert_ne!(base, other);
        }
    }
}
