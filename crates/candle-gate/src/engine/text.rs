//! A sequence's text as the output stage builds it (held by the sequence, written by
//! `output`).

use crate::tokenizer::StreamDecoder;

/// A sequence's text so far and how much of it has been streamed.
#[derive(Default)]
pub(crate) struct TextState {
    pub decoder: StreamDecoder,
    pub text: String,
    pub emitted: usize,
    /// A token arrived since the last event.
    pub new_token: bool,
}
