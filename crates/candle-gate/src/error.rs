//! One error type for the crate; every public fallible call returns it.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Candle(#[from] candle_core::Error),
    #[error("{path}: {msg}")]
    Model { path: String, msg: String },
    #[error("bad input: {0}")]
    BadInput(String),
    #[error("profile: {0}")]
    Profile(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("engine: {0}")]
    Engine(String),
}

pub type Result<T> = std::result::Result<T, Error>;
