//! candle-gate: batch-invariant quantized inference on Candle.
//!
//! * [`dispatch::QMatMul`]: a drop-in for Candle's `QMatMul` whose kernel choice belongs to
//!   a [`dispatch::Policy`] ([`Mode::ALL`]) instead of the row count.
//! * [`kernels`]: the CPU `gemv` / `invariant` / `split_k_f16` kernels, CUDA and Metal behind
//!   features.
//! * [`decoder::Decoder`]: a GGUF decoder (`llama`, `qwen2`: [`decoder::Arch`]) whose one layer loop takes rows of many
//!   sequences at once, in the fast lane or the [`reference`] lane.
//! * [`host`]: what the compile target and the host's run-time dispatch add to fingerprints.
//! * [`engine::Engine`]: continuous batching with a margin gate and a reference lane.
//! * [`sampling`]: seeded sampling whose draws depend on the request alone; logprobs.
//! * [`profile`]: measured crossover profiles.

// Kernels index several arrays in lockstep; the index form reads like the math it implements.
#![allow(clippy::needless_range_loop)]

pub mod attention;
pub mod chat;
pub mod decoder;
pub mod detmath;
pub mod dispatch;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod gguf_check;
pub mod host;
pub mod huge_pages;
pub mod kernels;
pub mod kv_cache;
pub mod model;
pub mod ops;
pub mod prefix_cache;
pub mod profile;
pub mod reference;
pub mod registry;
pub mod sampling;
mod scratch;
pub mod spm;
pub mod tokenizer;

pub use dispatch::{Backend, Kernel, Mode, Policy, QMatMul, WeightLayout};
pub use engine::{Engine, EngineConfig, GateConfig, GateMode, Output, Request};
pub use error::{Error, Result};
pub use model::Model;
pub use sampling::SamplingParams;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
