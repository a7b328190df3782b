//! What an engine reports about itself: its configuration and stack, its queues, its KV pool
//! and its counters. Reading them changes nothing.

use std::sync::Arc;

use crate::dispatch::Policy;
use crate::model::Model;

use super::{CacheStats, Engine, EngineConfig, GateStats, SpecStats, SpeculativeConfig};

impl Engine {
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }
    /// The kernel policy and the K/V storage: what, besides the gate and the host, decides a
    /// result's bits (the fingerprint's "policy" part).
    pub fn describe_kernels(&self) -> String {
        self.stack.kernels.clone()
    }
    /// The stack every result of this engine is fingerprinted with, as the server reports it
    /// ([`crate::model::system_fingerprint`]).
    pub fn system_fingerprint(&self) -> String {
        self.stack.system_fingerprint()
    }
    pub fn gate_stats(&self) -> GateStats {
        self.stats.clone()
    }

    pub fn is_shut_down(&self) -> bool {
        self.shut_down
    }
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }
    pub fn num_waiting(&self) -> usize {
        self.scheduler.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.scheduler.running.len()
    }
    /// Blocks of the KV pool held by running sequences' caches now.
    pub fn kv_used_blocks(&self) -> usize {
        self.runner.pool().used_blocks()
    }
    /// Blocks no running sequence holds that keep a cached prefix (reused, least recently
    /// used first, when the free ones run out).
    pub fn kv_cached_blocks(&self) -> usize {
        self.runner.pool().cached_blocks()
    }
    /// The pool's size in blocks (`kv_budget_tokens` rounded up to whole blocks).
    pub fn kv_total_blocks(&self) -> usize {
        self.cfg.kv_budget_blocks()
    }
    /// Prefix-cache and preemption counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.scheduler.stats.clone()
    }
    /// The engine's speculation, if any.
    pub fn speculative(&self) -> Option<&SpeculativeConfig> {
        self.cfg.speculative.as_ref()
    }
    /// The engine's speculation in one line (None: off), e.g. `ngram;k=12;lookup=2..64;max_batch=8`
    /// or `draft;k=3;max_batch=1;draft_model=FILE`.
    pub fn describe_speculation(&self) -> Option<String> {
        let spec = self.cfg.speculative.as_ref()?.describe();
        Some(match self.runner.draft_model() {
            Some(d) => format!("{spec};draft_model={}", d.path.file_name().unwrap_or_default().to_string_lossy()),
            None => spec,
        })
    }
    /// Drafts proposed and kept since the engine started.
    pub fn spec_stats(&self) -> SpecStats {
        self.spec_stats
    }
    /// Steps in which the draft model failed; their sequences decoded without drafts (the
    /// same tokens) and went on.
    pub fn draft_failures(&self) -> u64 {
        self.draft_failures
    }
}
