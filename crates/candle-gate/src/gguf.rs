//! Reading a llama-architecture GGUF file with clear errors for the ways a file goes wrong.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::error::{Error, Result};

pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    reader: BufReader<File>,
}

fn model_err<T>(path: &Path, msg: impl Into<String>) -> Result<T> {
    Err(Error::Model { path: path.display().to_string(), msg: msg.into() })
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path)
            .map_err(|e| Error::Model { path: path.display().to_string(), msg: format!("cannot open: {e}") })?;
        let size = file.metadata()?.len();
        let mut magic = [0u8; 4];
        if size < 4 || file.read_exact(&mut magic).is_err() || &magic != b"GGUF" {
            return model_err(path, "not a GGUF file (the first four bytes are not \"GGUF\")");
        }
        file.rewind()?;
        let mut reader = BufReader::new(file);
        // Every count, length and extent in the header is checked against the file's size with
        // bounded reads first: Candle's reader allocates what the header claims.
        crate::gguf_check::check_reader(&mut reader, size, &path.display().to_string())?;
        reader.rewind()?;
        let content = Content::read(&mut reader).map_err(|e| Error::Model {
            path: path.display().to_string(),
            msg: format!("corrupt or truncated GGUF header: {e}"),
        })?;
        Ok(GgufFile { path: path.to_path_buf(), content, reader })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// A tensor's shape (Candle's order: rows first) without reading its data.
    pub fn tensor_dims(&self, name: &str) -> Result<Vec<usize>> {
        match self.content.tensor_infos.get(name) {
            Some(info) => Ok(info.shape.dims().to_vec()),
            None => model_err(&self.path, format!("missing tensor `{name}`")),
        }
    }

    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        match self.content.tensor_infos.get(name) {
            None => return model_err(&self.path, format!("missing tensor `{name}`")),
            // Candle 0.11.1 makes a slice of blocks from the empty buffer's dangling, unaligned
            // pointer: undefined behaviour (found by the `gguf_header` fuzz target).
            Some(info) if info.shape.elem_count() == 0 => {
                return model_err(&self.path, format!("tensor `{name}` has no elements ({:?})", info.shape.dims()))
            }
            Some(_) => {}
        }
        self.content.tensor(&mut self.reader, name, &Device::Cpu).map_err(|e| Error::Model {
            path: self.path.display().to_string(),
            msg: format!("cannot read tensor `{name}`: {e}"),
        })
    }

    /// A tensor whose shape must be `dims` (Candle's order: rows first).
    pub fn tensor_shaped(&mut self, name: &str, dims: &[usize]) -> Result<QTensor> {
        let t = self.tensor(name)?;
        if t.shape().dims() != dims {
            return model_err(
                &self.path,
                format!("tensor `{name}` has shape {:?} but the metadata implies {dims:?}", t.shape().dims()),
            );
        }
        Ok(t)
    }

    pub fn get(&self, key: &str) -> Result<&Value> {
        match self.content.metadata.get(key) {
            Some(v) => Ok(v),
            None => model_err(&self.path, format!("missing metadata key `{key}`")),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<String> {
        self.get(key)?
            .to_string()
            .cloned()
            .or_else(|_| model_err(&self.path, format!("metadata `{key}` is not a string")))
    }

    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        let n = match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I8(x) if *x >= 0 => *x as u64,
            Value::I16(x) if *x >= 0 => *x as u64,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            _ => return model_err(&self.path, format!("metadata `{key}` is not a count: {v:?}")),
        };
        Ok(n as usize)
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match self.get(key)? {
            Value::F32(x) => Ok(*x),
            Value::F64(x) => Ok(*x as f32),
            v => model_err(&self.path, format!("metadata `{key}` is not a float: {v:?}")),
        }
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        if self.content.metadata.contains_key(key) {
            self.get_f32(key).map(Some)
        } else {
            Ok(None)
        }
    }
}
