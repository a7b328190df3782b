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
    /// A request or engine option out of range. `param` names it as the crate spells it, so a
    /// caller (the server, the binding) maps the error to its own field without reading `msg`.
    #[error("{msg}")]
    InvalidParam { param: &'static str, msg: String },
    #[error("the engine has been shut down")]
    ShutDown,
}

impl Error {
    pub fn invalid(param: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidParam { param, msg: msg.into() }
    }

    /// The parameter an [`Error::InvalidParam`] names.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            Error::InvalidParam { param, .. } => Some(param),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
