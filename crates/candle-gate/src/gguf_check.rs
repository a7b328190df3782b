//! A bounded walk over a GGUF header, before Candle's reader sees it.
//!
//! Candle's `gguf_file::Content::read` caps some header counts, but it still builds one
//! `Value` (32 bytes) per array element and one `TensorInfo` per tensor the header declares,
//! divides by `general.alignment` (0 panics), and leaves tensor extents to whoever reads them.
//! This pass reads the same bytes with fixed-size reads only and refuses, by name, any header
//! that cannot be what it claims:
//!
//! * a count or length that cannot fit in the bytes left in the file (every metadata entry,
//!   array element, string byte and tensor info has a minimum size on disk);
//! * an unknown value type or tensor dtype, a bool that is neither 0 nor 1;
//! * arrays nested deeper than [`MAX_ARRAY_DEPTH`], more than [`MAX_ARRAY_ELEMENTS`] array
//!   elements in all, more than [`MAX_TENSORS`] tensors, keys or tensor names over
//!   [`MAX_NAME_LEN`] bytes;
//! * a tensor with more than [`MAX_TENSOR_DIMS`] dims, dims whose product (zeros left out)
//!   overflows or exceeds [`MAX_TENSOR_ELEMS`], a count not a multiple of its dtype's block, an extent that
//!   overflows or lies past the end of the file;
//! * a `general.alignment` of 0 or not a power of two (llama.cpp's rule).
//!
//! The only allocation it makes is a metadata key (at most [`MAX_NAME_LEN`] bytes), so a
//! header claiming 2^40 entries or a 2^60-element tensor is refused before anything is
//! allocated for it. What it accepts, Candle's reader reads without error; valid files are
//! accepted as they were.

use std::io::{Cursor, Read};

use candle_core::quantized::GgmlDType;

use crate::error::{Error, Result};

/// Deepest array nesting accepted (an array of arrays is depth 2). Real files use 1.
pub const MAX_ARRAY_DEPTH: usize = 4;
/// Array elements in all metadata arrays together (a 256k vocabulary's tokens, types and
/// merges are under 2^20). Bounds the memory Candle's reader spends on `Value`s.
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 24;
/// Longest metadata string value (Candle's own cap).
pub const MAX_STRING_LEN: u64 = 1 << 30;
/// Longest metadata key or tensor name (the GGUF spec limits keys to 65535 bytes).
pub const MAX_NAME_LEN: u64 = 65_535;
/// Most tensors one file may declare.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most dims of one tensor (GGML_MAX_DIMS).
pub const MAX_TENSOR_DIMS: u32 = 4;
/// Most elements of one tensor.
pub const MAX_TENSOR_ELEMS: u64 = 1 << 48;
/// Candle's alignment when the metadata names none.
const DEFAULT_ALIGNMENT: u64 = 32;

/// What the walk learned about a header it accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderSummary {
    pub version: u32,
    pub tensor_count: u64,
    pub metadata_count: u64,
    /// Where the tensor data starts (the header's end, aligned), as Candle computes it.
    pub tensor_data_offset: u64,
    /// The end of the furthest tensor's bytes (at least `tensor_data_offset`).
    pub data_end: u64,
}

/// Checks a whole GGUF file held in memory.
pub fn check_bytes(bytes: &[u8]) -> Result<HeaderSummary> {
    check_reader(Cursor::new(bytes), bytes.len() as u64, "<bytes>")
}

/// Checks the GGUF header that `reader` yields from its current position, in a file of
/// `file_size` bytes (counted from that position); `name` names it in errors. Reads the header
/// once, sequentially, never past `file_size`: give it a buffered reader.
pub fn check_reader<R: Read>(reader: R, file_size: u64, name: &str) -> Result<HeaderSummary> {
    let mut w = Walker { r: reader, pos: 0, size: file_size, v1: false, elements: 0 };
    w.header().map_err(|msg| Error::Model { path: name.to_string(), msg })
}

type Walk<T> = std::result::Result<T, String>;

struct Walker<R> {
    r: R,
    pos: u64,
    size: u64,
    v1: bool,
    /// Array elements seen so far, all arrays together.
    elements: u64,
}

/// Value types, numbered as on disk.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// The dtypes Candle reads, by their GGML id.
fn dtype(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

impl<R: Read> Walker<R> {
    fn remaining(&self) -> u64 {
        self.size - self.pos
    }

    fn len_size(&self) -> u64 {
        if self.v1 {
            4
        } else {
            8
        }
    }

    /// Refuses unless `n` more bytes exist.
    fn need(&self, n: u64, what: &dyn Fn() -> String) -> Walk<()> {
        if n > self.remaining() {
            return Err(format!(
                "truncated or corrupt GGUF header: {} needs {n} bytes at offset {} but the file has {} left",
                what(),
                self.pos,
                self.remaining()
            ));
        }
        Ok(())
    }

    /// [`Self::need`] for a size computed with checked arithmetic: one that overflowed (None) is
    /// refused as such, rather than as a saturated 18446744073709551615 bytes.
    fn need_checked(&self, n: Option<u64>, what: &dyn Fn() -> String) -> Walk<u64> {
        let n =
            n.ok_or_else(|| format!("truncated or corrupt GGUF header: the size of {} overflows 64 bits", what()))?;
        self.need(n, what)?;
        Ok(n)
    }

    fn bytes<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Walk<[u8; N]> {
        self.need(N as u64, what)?;
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|e| format!("cannot read {} at offset {}: {e}", what(), self.pos))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u8(&mut self, what: &dyn Fn() -> String) -> Walk<u8> {
        Ok(self.bytes::<1>(what)?[0])
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Walk<u32> {
        Ok(u32::from_le_bytes(self.bytes(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Walk<u64> {
        Ok(u64::from_le_bytes(self.bytes(what)?))
    }

    /// A length or count: u32 in GGUF v1, u64 after.
    fn len(&mut self, what: &dyn Fn() -> String) -> Walk<u64> {
        if self.v1 {
            Ok(self.u32(what)? as u64)
        } else {
            self.u64(what)
        }
    }

    fn skip(&mut self, n: u64, what: &dyn Fn() -> String) -> Walk<()> {
        self.need(n, what)?;
        let got = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink())
            .map_err(|e| format!("cannot read {} at offset {}: {e}", what(), self.pos))?;
        if got != n {
            return Err(format!("{} ends early: the file is shorter than its size", what()));
        }
        self.pos += n;
        Ok(())
    }

    /// A length-prefixed string of at most `max` bytes, skipped.
    fn string(&mut self, max: u64, what: &dyn Fn() -> String) -> Walk<()> {
        let len = self.len(&|| format!("the length of {}", what()))?;
        if len > max {
            return Err(format!("{} claims {len} bytes, more than the {max} accepted", what()));
        }
        self.skip(len, what)
    }

    /// A length-prefixed name (metadata key), read: at most [`MAX_NAME_LEN`] bytes.
    fn name(&mut self, what: &dyn Fn() -> String) -> Walk<Vec<u8>> {
        let len = self.len(&|| format!("the length of {}", what()))?;
        if len > MAX_NAME_LEN {
            return Err(format!("{} claims {len} bytes, more than the {MAX_NAME_LEN} accepted", what()));
        }
        self.need(len, what)?;
        let mut v = vec![0u8; len as usize];
        self.r.read_exact(&mut v).map_err(|e| format!("cannot read {} at offset {}: {e}", what(), self.pos))?;
        self.pos += len;
        // Candle drops trailing NULs from every string.
        while v.last() == Some(&0) {
            v.pop();
        }
        Ok(v)
    }

    /// Bytes a value of type `t` takes on disk at least (`None`: not a value type).
    fn min_size(&self, t: u32) -> Option<u64> {
        Some(match t {
            T_U8 | T_I8 | T_BOOL => 1,
            T_U16 | T_I16 => 2,
            T_U32 | T_I32 | T_F32 => 4,
            T_U64 | T_I64 | T_F64 => 8,
            T_STRING => self.len_size(),
            T_ARRAY => 4 + self.len_size(),
            _ => return None,
        })
    }

    /// Walks one value of type `t`; returns it when it is an integer Candle would take as an
    /// alignment (u8/u16/u32, or i8/i16/i32 not negative).
    fn value(&mut self, t: u32, depth: usize, what: &dyn Fn() -> String) -> Walk<Option<u64>> {
        Ok(match t {
            T_U8 => Some(self.u8(what)? as u64),
            T_I8 => u64::try_from(self.u8(what)? as i8).ok(),
            T_U16 => Some(u16::from_le_bytes(self.bytes(what)?) as u64),
            T_I16 => u64::try_from(i16::from_le_bytes(self.bytes(what)?)).ok(),
            T_U32 => Some(self.u32(what)? as u64),
            T_I32 => u64::try_from(self.u32(what)? as i32).ok(),
            T_F32 => self.skip(4, what).map(|_| None)?,
            T_U64 | T_I64 | T_F64 => self.skip(8, what).map(|_| None)?,
            T_BOOL => match self.u8(what)? {
                0 | 1 => None,
                b => return Err(format!("{} is a bool of value {b} (only 0 and 1 are)", what())),
            },
            T_STRING => self.string(MAX_STRING_LEN, what).map(|_| None)?,
            T_ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("{} nests arrays deeper than {MAX_ARRAY_DEPTH}", what()));
                }
                let et = self.u32(&|| format!("the element type of {}", what()))?;
                let Some(min) = self.min_size(et) else {
                    return Err(format!("{} has elements of unknown type {et}", what()));
                };
                let n = self.len(&|| format!("the length of {}", what()))?;
                // Refuse before walking: `n` elements need at least `n * min` bytes.
                let need = self.need_checked(n.checked_mul(min), &|| format!("{} of {n} elements", what()))?;
                self.elements = self.elements.saturating_add(n);
                if self.elements > MAX_ARRAY_ELEMENTS {
                    return Err(format!(
                        "{} makes the metadata arrays hold more than {MAX_ARRAY_ELEMENTS} elements in all",
                        what()
                    ));
                }
                match et {
                    T_U8 | T_I8 | T_U16 | T_I16 | T_U32 | T_I32 | T_F32 | T_U64 | T_I64 | T_F64 => {
                        self.skip(need, what)?
                    }
                    _ => {
                        for i in 0..n {
                            self.value(et, depth + 1, &|| format!("element {i} of {}", what()))?;
                        }
                    }
                }
                None
            }
            _ => return Err(format!("{} has unknown value type {t}", what())),
        })
    }

    fn header(&mut self) -> Walk<HeaderSummary> {
        let magic = self.bytes::<4>(&|| "the magic".into())?;
        if &magic != b"GGUF" {
            return Err("not a GGUF file (the first four bytes are not \"GGUF\")".into());
        }
        let version = self.u32(&|| "the version".into())?;
        if !(1..=3).contains(&version) {
            return Err(format!("unsupported GGUF version {version} (1, 2 and 3 are read)"));
        }
        self.v1 = version == 1;
        let tensor_count = self.len(&|| "the tensor count".into())?;
        let metadata_count = self.len(&|| "the metadata count".into())?;
        if tensor_count > MAX_TENSORS {
            return Err(format!("the header declares {tensor_count} tensors, more than the {MAX_TENSORS} accepted"));
        }
        // Each entry's smallest form: a key length, a type and a one-byte value; each tensor's:
        // a name length, n_dims, dtype and offset.
        let per_kv = self.len_size() + 4 + 1;
        let per_tensor = self.len_size() + 4 + 4 + 8;
        let need = metadata_count
            .checked_mul(per_kv)
            .and_then(|m| tensor_count.checked_mul(per_tensor).and_then(|t| m.checked_add(t)));
        self.need_checked(need, &|| {
            format!("a header of {metadata_count} metadata entries and {tensor_count} tensors")
        })?;

        let mut alignment = DEFAULT_ALIGNMENT;
        for i in 0..metadata_count {
            let key = self.name(&|| format!("metadata key {i}"))?;
            let key_text = || String::from_utf8_lossy(&key).into_owned();
            let what = || format!("metadata `{}`", key_text());
            let t = self.u32(&|| format!("the type of {}", what()))?;
            let v = self.value(t, 0, &what)?;
            if key == b"general.alignment" {
                // As Candle reads it: the last entry wins, a non-integer means the default.
                alignment = v.unwrap_or(DEFAULT_ALIGNMENT);
            }
        }
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(format!("general.alignment is {alignment}; it must be a power of two"));
        }

        let mut data_len = 0u64;
        for i in 0..tensor_count {
            let what = || format!("tensor info {i}");
            self.string(MAX_NAME_LEN, &|| format!("the name of {}", what()))?;
            let n_dims = self.u32(&|| format!("the dim count of {}", what()))?;
            if n_dims > MAX_TENSOR_DIMS {
                return Err(format!("{} has {n_dims} dims, more than {MAX_TENSOR_DIMS}", what()));
            }
            // The product of the dims other than 0 is bounded, not only the element count: Candle
            // multiplies the dims in its own order, and [2^40, 2^40, 0] overflows before the 0.
            let (mut nonzero, mut zero) = (1u64, false);
            for d in 0..n_dims {
                let dim = self.len(&|| format!("dim {d} of {}", what()))?;
                zero |= dim == 0;
                nonzero = nonzero
                    .checked_mul(dim.max(1))
                    .filter(|&e| e <= MAX_TENSOR_ELEMS)
                    .ok_or_else(|| format!("{} has more than {MAX_TENSOR_ELEMS} elements", what()))?;
            }
            let elems = if zero { 0 } else { nonzero };
            let id = self.u32(&|| format!("the dtype of {}", what()))?;
            let Some(dt) = dtype(id) else {
                return Err(format!("{} has unknown dtype {id}", what()));
            };
            let block = dt.block_size() as u64;
            if elems % block != 0 {
                return Err(format!("{} has {elems} elements, not a multiple of {dt:?}'s block of {block}", what()));
            }
            let bytes = (elems / block).checked_mul(dt.type_size() as u64);
            let offset = self.u64(&|| format!("the offset of {}", what()))?;
            let end = bytes
                .and_then(|b| offset.checked_add(b))
                .ok_or_else(|| format!("{} lies past any file: offset {offset}, {elems} elements of {dt:?}", what()))?;
            data_len = data_len.max(end);
        }
        let tensor_data_offset = self
            .pos
            .div_ceil(alignment)
            .checked_mul(alignment)
            .ok_or_else(|| format!("the header end {} aligned to {alignment} overflows", self.pos))?;
        let data_end = tensor_data_offset.checked_add(data_len).ok_or_else(|| {
            format!("the tensors' data overflows 64 bits: {data_len} bytes after the header's {tensor_data_offset}")
        })?;
        if data_end > self.size {
            // A truncated download must fail here, by name, rather than deep inside a tensor read.
            return Err(format!("truncated file: its tensors need {data_end} bytes but the file has {}", self.size));
        }
        Ok(HeaderSummary { version, tensor_count, metadata_count, tensor_data_offset, data_end })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{self, Content, Value};
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};
    use std::time::{Duration, Instant};

    fn header(tensors: u64, kvs: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(tensors.to_le_bytes());
        b.extend(kvs.to_le_bytes());
        b
    }

    fn string(b: &mut Vec<u8>, s: &str) {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    }

    fn refused(bytes: &[u8], needle: &str) {
        let t = Instant::now();
        let e = check_bytes(bytes).expect_err("must be refused").to_string();
        assert!(t.elapsed() < Duration::from_millis(100), "took {:?}", t.elapsed());
        assert!(e.contains(needle), "error `{e}` does not say `{needle}`");
    }

    fn small_gguf() -> Vec<u8> {
        let dev = Device::Cpu;
        let w = Tensor::arange(0f32, 64., &dev).unwrap().reshape((2, 32)).unwrap();
        let q4 = QTensor::quantize(&w, GgmlDType::Q4_0).unwrap();
        let f = QTensor::quantize(&Tensor::ones(3, candle_core::DType::F32, &dev).unwrap(), GgmlDType::F32).unwrap();
        let tokens = Value::Array(vec![Value::String("a".into()), Value::String("b".into())]);
        let nested = Value::Array(vec![Value::Array(vec![Value::U8(1), Value::U8(2)]), Value::Array(vec![])]);
        let owned = [
            ("general.architecture", Value::String("llama".into())),
            ("general.alignment", Value::U32(32)),
            ("tokenizer.ggml.tokens", tokens),
            ("nested", nested),
            ("flag", Value::Bool(true)),
            ("pi", Value::F64(3.14)),
            ("neg", Value::I64(-3)),
        ];
        let md: Vec<(&str, &Value)> = owned.iter().map(|(k, v)| (*k, v)).collect();
        let mut c = Cursor::new(Vec::new());
        gguf_file::write(&mut c, &md, &[("w", &q4), ("f", &f)]).unwrap();
        c.into_inner()
    }

    #[test]
    fn valid_small_gguf_is_accepted_and_agrees_with_candle() {
        let bytes = small_gguf();
        let s = check_bytes(&bytes).unwrap();
        assert_eq!((s.version, s.tensor_count, s.metadata_count), (2, 2, 7));
        let c = Content::read(&mut Cursor::new(&bytes)).unwrap();
        assert_eq!(s.tensor_data_offset, c.tensor_data_offset);
        assert!(s.data_end <= bytes.len() as u64);
        assert_eq!(s.tensor_data_offset % 32, 0);
        // Cut anywhere before the data ends: refused.
        for cut in [4, 9, 23, 40, bytes.len() / 2, s.data_end as usize - 1] {
            assert!(check_bytes(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    /// The models in the cache, where present: accepted, with Candle's data offset, quickly.
    #[test]
    fn cached_models_are_accepted() {
        let dir = std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache/candle-gate"));
        let Some(Ok(entries)) = dir.map(std::fs::read_dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_none_or(|x| x != "gguf") {
                continue;
            }
            let size = std::fs::metadata(&p).unwrap().len();
            let t = Instant::now();
            let mut r = std::io::BufReader::new(std::fs::File::open(&p).unwrap());
            let s = check_reader(&mut r, size, &p.display().to_string()).unwrap();
            let took = t.elapsed();
            let c = Content::read(&mut std::io::BufReader::new(std::fs::File::open(&p).unwrap())).unwrap();
            assert_eq!(s.tensor_data_offset, c.tensor_data_offset, "{}", p.display());
            assert_eq!(s.tensor_count as usize, c.tensor_infos.len());
            assert!(took < Duration::from_secs(2), "{}: {took:?}", p.display());
        }
    }

    /// An overflowing size is said to overflow, never printed as u64::MAX (saturated).
    #[test]
    fn overflowing_sizes_say_so() {
        let saturated = u64::MAX.to_string();
        for b in [
            {
                let mut b = header(0, u64::MAX / 4); // entries x 13 bytes
                b.extend([0u8; 64]);
                b
            },
            {
                let mut b = header(0, 1);
                string(&mut b, "a");
                b.extend(9u32.to_le_bytes()); // an array
                b.extend(10u32.to_le_bytes()); // of u64
                b.extend((u64::MAX / 4).to_le_bytes());
                b.extend([0u8; 64]);
                b
            },
            {
                let mut b = header(1, 0);
                string(&mut b, "w");
                b.extend(1u32.to_le_bytes());
                b.extend(32u64.to_le_bytes());
                b.extend(0u32.to_le_bytes()); // F32: 128 bytes
                b.extend((u64::MAX - 130).to_le_bytes()); // ends 2 bytes short of 2^64, before the header
                b.extend([0u8; 64]);
                b
            },
        ] {
            let e = check_bytes(&b).expect_err("must be refused").to_string();
            assert!(e.contains("overflows") && !e.contains(&saturated), "{e}");
        }
    }

    #[test]
    fn refuses_2_pow_40_metadata_entries() {
        let mut b = header(0, 1 << 40);
        b.extend([0u8; 64]);
        refused(&b, "1099511627776 metadata entries");
    }

    #[test]
    fn refuses_2_pow_60_element_tensor() {
        let mut b = header(1, 0);
        string(&mut b, "w");
        b.extend(2u32.to_le_bytes());
        b.extend((1u64 << 30).to_le_bytes());
        b.extend((1u64 << 30).to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend([0u8; 64]);
        refused(&b, "more than 281474976710656 elements");
        // An element count that wraps u64: refused the same way.
        let mut b = header(1, 0);
        string(&mut b, "w");
        b.extend(2u32.to_le_bytes());
        b.extend((1u64 << 33).to_le_bytes());
        b.extend((1u64 << 33).to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        refused(&b, "elements");
        // A zero dim does not excuse the others (found by the `gguf_header` fuzz target with
        // overflow checks: Candle's element count overflowed on [2^40, 2^40, 0]).
        let mut b = header(1, 0);
        string(&mut b, "w");
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend((1u64 << 40).to_le_bytes());
        b.extend((1u64 << 40).to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend([0u8; 64]);
        refused(&b, "more than 281474976710656 elements");
    }

    #[test]
    fn refuses_string_past_eof() {
        let mut b = header(0, 1);
        string(&mut b, "general.name");
        b.extend(T_STRING.to_le_bytes());
        b.extend(1000u64.to_le_bytes());
        b.extend(b"short");
        refused(&b, "metadata `general.name` needs 1000 bytes");
        // A key longer than the file, and one longer than any key may be.
        let mut b = header(0, 1);
        b.extend((1u64 << 62).to_le_bytes());
        b.extend([b'k'; 16]);
        refused(&b, "metadata key 0 claims");
    }

    #[test]
    fn refuses_arrays_that_cannot_fit_or_nest_too_deep() {
        let mut b = header(0, 1);
        string(&mut b, "tokenizer.ggml.tokens");
        b.extend(T_ARRAY.to_le_bytes());
        b.extend(T_STRING.to_le_bytes());
        b.extend((1u64 << 29).to_le_bytes());
        b.extend([0u8; 64]);
        refused(&b, "of 536870912 elements needs");

        let mut b = header(0, 1);
        string(&mut b, "deep");
        b.extend(T_ARRAY.to_le_bytes());
        for _ in 0..MAX_ARRAY_DEPTH + 1 {
            b.extend(T_ARRAY.to_le_bytes());
            b.extend(1u64.to_le_bytes());
        }
        b.extend([0u8; 64]);
        refused(&b, "nests arrays deeper");

        let mut b = header(0, 1);
        string(&mut b, "x");
        b.extend(13u32.to_le_bytes());
        b.extend([0u8; 16]);
        refused(&b, "unknown value type 13");
    }

    #[test]
    fn refuses_zero_alignment_candle_would_divide_by() {
        let mut b = header(0, 1);
        string(&mut b, "general.alignment");
        b.extend(T_U32.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend([0u8; 32]);
        refused(&b, "general.alignment is 0");
        // What the check keeps Candle's reader from: `position.div_ceil(0)`.
        let candle = std::panic::catch_unwind(|| Content::read(&mut Cursor::new(&b)));
        assert!(candle.is_err(), "Candle 0.11.1 panics on a zero alignment; if no longer, keep the check anyway");
    }

    /// Found by the `gguf_header` fuzz target (with debug assertions): Candle reads a tensor of
    /// no elements through an unaligned dangling pointer. Such a file still opens; reading that
    /// tensor is an error.
    #[test]
    fn a_tensor_of_no_elements_is_an_error_not_undefined_behaviour() {
        let mut b = header(1, 0);
        string(&mut b, "empty");
        b.extend(2u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend(4u64.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.resize(b.len().div_ceil(32) * 32, 0);
        check_bytes(&b).unwrap();
        let path = std::env::temp_dir().join(format!("candle-gate-empty-tensor-{}.gguf", std::process::id()));
        std::fs::write(&path, &b).unwrap();
        let mut f = crate::gguf::GgufFile::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(f.tensor_dims("empty").unwrap(), vec![4, 0]);
        let e = f.tensor("empty").err().expect("refused").to_string();
        assert!(e.contains("has no elements"), "{e}");
    }

    #[test]
    fn refuses_tensor_past_eof_and_unknown_dtype() {
        let bytes = small_gguf();
        let s = check_bytes(&bytes).unwrap();
        refused(&bytes[..s.data_end as usize - 1], "truncated file: its tensors need");
        let mut b = header(1, 0);
        string(&mut b, "w");
        b.extend(1u32.to_le_bytes());
        b.extend(32u64.to_le_bytes());
        b.extend(4u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        refused(&b, "unknown dtype 4");
    }
}
