//! Who decides which quantized kernel runs: candle-gate, not the row count.
//!
//! [`QMatMul`] is a drop-in for Candle's `QMatMul` (built from a `QTensor`, implements
//! `Module`); its [`Policy`] picks the kernel for each call from the mode, the backend, the
//! weight dtype and the number of rows.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use candle_core::quantized::{GgmlDType, QMatMul as CandleQMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::error::{Error, Result};
use crate::kernels;

/// The fast lane's kernel choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Candle's own dispatch: whatever `QMatMul` does for this row count. The baseline.
    Native,
    /// Rows ≤ `row_split_max` through the single-row kernel once per row, larger inputs through
    /// the batched (dequantized GEMM) kernel.
    RowSplit,
    /// The batch-invariant multi-row kernel at every row count.
    Invariant,
    /// The dequantized dense GEMM at every row count: fast for prefill, not batch invariant.
    Gemm,
    /// The dense GEMM with half-precision storage: F16 weights and activations, F32
    /// accumulation, F16 results (what a GPU's tensor-core lane does). On the CPU, Candle's F32
    /// GEMM on f16-rounded operands, rounded to f16. How its bits move with the row count is the
    /// `gemm` crate's run-time choice, so it differs between hosts: use `SplitKF16` where a
    /// lane whose bits follow the batch is needed.
    GemmF16,
    /// Half-precision GEMM with split-K chosen by the row count (`kernels::cpu_split_k`): f16
    /// operands, f32 fused accumulation in k chunks whose number follows the row count, f16
    /// results, all in code fixed at compile time. Its bits depend on the row count by
    /// construction and on nothing about the host: the machine-independent non-invariant lane
    /// the margin gate is tested, calibrated and measured on.
    SplitKF16,
    /// The canonical order (`kernels::canonical`): one fixed order per dtype that a CUDA warp
    /// computes natively and the CPU reproduces bit for bit. On CUDA it is the `invariant`
    /// kernel; on the CPU it is slower than `invariant` and exists so that a GPU's results can
    /// be checked on any CPU.
    Canonical,
}

impl Mode {
    /// The mode a policy, a model and an engine take when none is named: batch-invariant
    /// and the fastest on the CPU (docs/DESIGN.md §3 says why not `canonical` yet).
    pub const DEFAULT: Mode = Mode::Invariant;
    pub const ALL: [Mode; 7] =
        [Mode::Native, Mode::RowSplit, Mode::Invariant, Mode::Gemm, Mode::GemmF16, Mode::SplitKF16, Mode::Canonical];
    pub fn name(self) -> &'static str {
        match self {
            Mode::Native => "native",
            Mode::RowSplit => "row_split",
            Mode::Invariant => "invariant",
            Mode::Gemm => "gemm",
            Mode::GemmF16 => "gemm_f16",
            Mode::SplitKF16 => "split_k_f16",
            Mode::Canonical => "canonical",
        }
    }
}

impl FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Mode::ALL.into_iter().find(|m| m.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Mode::ALL.iter().map(|m| m.name()).collect();
            Error::invalid("mode", format!("unknown mode {s:?}; expected one of {}", names.join(", ")))
        })
    }
}

/// How a matmul's quantized weight sits in memory: the GGUF file's blocks, or the same bytes
/// repacked for one mode's CPU kernels. A model holds its weights in one layout; an engine owns
/// the policy (the mode) its kernels run. Every mode reads every layout and gets the same bits;
/// the mode a layout was made for reads it fastest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// As in the file.
    Gguf,
    /// Sixteen-column tiles for the invariant kernels (Q4_K, Q6_K, Q4_1, Q5_0; the rest as in
    /// the file), on hosts whose kernels run AVX-512.
    Invariant,
    /// The canonical kernels' tiles (the invariant ones, and Q8_0 transposed), on hosts with
    /// AVX2 or wider.
    Canonical,
}

impl WeightLayout {
    pub const ALL: [WeightLayout; 3] = [WeightLayout::Gguf, WeightLayout::Invariant, WeightLayout::Canonical];
    pub fn name(self) -> &'static str {
        match self {
            WeightLayout::Gguf => "gguf",
            WeightLayout::Invariant => "invariant",
            WeightLayout::Canonical => "canonical",
        }
    }
    /// The layout `mode`'s kernels read fastest.
    pub fn for_mode(mode: Mode) -> Self {
        match mode {
            Mode::Invariant => WeightLayout::Invariant,
            Mode::Canonical => WeightLayout::Canonical,
            _ => WeightLayout::Gguf,
        }
    }
    /// The mode an engine over weights in this layout runs when none is named.
    pub fn mode(self) -> Mode {
        match self {
            WeightLayout::Canonical => Mode::Canonical,
            WeightLayout::Invariant | WeightLayout::Gguf => Mode::DEFAULT,
        }
    }
    /// Whether this host's kernels read `dtype` packed in this layout (else the weights stay
    /// as in the file).
    fn packs_here(self, dtype: GgmlDType) -> bool {
        match self {
            // The invariant kernels read every packed dtype fast with AVX-512, and packed Q4_K,
            // Q4_1 and Q5_0 with AVX2 too (Q6_K's AVX2 kernel is the file layout's); the
            // canonical ones have an AVX2 tier for all.
            WeightLayout::Invariant => match kernels::isa() {
                kernels::Isa::Avx512 => true,
                kernels::Isa::Avx2 => dtype != GgmlDType::Q6K,
                _ => false,
            },
            WeightLayout::Canonical => kernels::isa() >= kernels::Isa::Avx2,
            WeightLayout::Gguf => false,
        }
    }
}

impl FromStr for WeightLayout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|l| l.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|l| l.name()).collect();
            Error::invalid("layout", format!("unknown weight layout {s:?}; expected one of {}", names.join(", ")))
        })
    }
}

/// The kernel a call actually ran (or would run).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    GemvRowSplit,
    Invariant,
    Gemm,
    GemmF16,
    SplitKF16,
    Canonical,
    Candle,
}

impl Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Kernel::GemvRowSplit => "gemv_row_split",
            Kernel::Invariant => "invariant",
            Kernel::Gemm => "gemm",
            Kernel::GemmF16 => "gemm_f16",
            Kernel::SplitKF16 => "split_k_f16",
            Kernel::Canonical => "canonical",
            Kernel::Candle => "candle",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    Cpu,
    Cuda,
    Metal,
}

impl Backend {
    pub fn of(device: &Device) -> Backend {
        match device {
            Device::Cpu => Backend::Cpu,
            Device::Cuda(_) => Backend::Cuda,
            Device::Metal(_) => Backend::Metal,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Metal => "metal",
        }
    }
}

pub use crate::kernels::dtype_name;

pub fn dtype_from_name(s: &str) -> Result<GgmlDType> {
    kernels::cpu::SUPPORTED
        .into_iter()
        .chain([GgmlDType::BF16, GgmlDType::Q8_1])
        .find(|d| dtype_name(*d) == s.to_lowercase())
        .ok_or_else(|| Error::BadInput(format!("unknown GGML dtype {s:?}")))
}

/// Default for every backend and dtype until a measured profile says otherwise: the crossover
/// measured on an M2 (docs/DESIGN.md §1) lay between 4 and 5 rows.
pub const DEFAULT_ROW_SPLIT_MAX: usize = 4;

/// Kernel policy: mode plus per-(backend, dtype) row-split thresholds.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    pub mode: Mode,
    pub default_row_split_max: usize,
    pub row_split_max: BTreeMap<(Backend, String), usize>,
    /// Where the thresholds came from (a profile path), for people reading a policy. Not part
    /// of result fingerprints: those hash the values ([`Policy::describe`]), which alone decide
    /// the bits, so two profiles that set the same thresholds fingerprint alike.
    pub source: Option<String>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy::new(Mode::DEFAULT)
    }
}

impl Policy {
    pub fn new(mode: Mode) -> Self {
        Policy { mode, default_row_split_max: DEFAULT_ROW_SPLIT_MAX, row_split_max: BTreeMap::new(), source: None }
    }

    pub fn row_split_max(&self, backend: Backend, dtype: GgmlDType) -> usize {
        *self.row_split_max.get(&(backend, dtype_name(dtype))).unwrap_or(&self.default_row_split_max)
    }

    pub fn kernel(&self, backend: Backend, dtype: GgmlDType, rows: usize) -> Kernel {
        match self.mode {
            Mode::Native => Kernel::Candle,
            Mode::Gemm => Kernel::Gemm,
            Mode::GemmF16 => Kernel::GemmF16,
            Mode::SplitKF16 => Kernel::SplitKF16,
            Mode::Invariant => Kernel::Invariant,
            Mode::Canonical => Kernel::Canonical,
            Mode::RowSplit if rows <= self.row_split_max(backend, dtype) => Kernel::GemvRowSplit,
            Mode::RowSplit => Kernel::Gemm,
        }
    }

    /// A stable text form, hashed into result fingerprints.
    pub fn describe(&self) -> String {
        let mut s = format!("mode={};default={}", self.mode.name(), self.default_row_split_max);
        for ((b, d), v) in &self.row_split_max {
            s.push_str(&format!(";{}:{}={}", b.name(), d, v));
        }
        s
    }
}

/// Drop-in for Candle's `QMatMul` (same constructors, implements `Module`) whose kernel choice
/// belongs to a [`Policy`] instead of the row count: embedding candle-gate in a Candle project
/// is `use candle_gate::QMatMul` in place of `use candle_core::quantized::QMatMul`.
pub struct QMatMul {
    /// The weight as given, or (`packed`) its bytes repacked for the CPU's invariant kernels
    /// (`kernels::cpu::pack`), which then replace the GGUF layout rather than sit beside it.
    weight: Arc<QTensor>,
    packed: bool,
    /// A packed weight in GGUF layout, made the first time another reader needs it.
    plain: OnceLock<Arc<QTensor>>,
    /// Candle's own matmul (the `native` lane), made on first use.
    native: OnceLock<CandleQMatMul>,
    dense: OnceLock<Tensor>,
    dense_f16: OnceLock<Tensor>,
    half: OnceLock<Vec<half::f16>>,
    policy: Arc<Policy>,
}

impl std::fmt::Debug for QMatMul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QMatMul({:?} {:?}, {})", self.weight.dtype(), self.weight.shape(), self.policy.mode.name())
    }
}

impl QMatMul {
    /// Same constructor as Candle's `QMatMul::from_qtensor`; the policy is the default
    /// (`invariant` mode, row-split threshold 4).
    pub fn from_qtensor(weight: QTensor) -> Result<Self> {
        Self::from_arc(Arc::new(weight))
    }

    /// Same constructor as Candle's `QMatMul::from_arc`, with the default policy.
    pub fn from_arc(weight: Arc<QTensor>) -> Result<Self> {
        Self::new(weight, Arc::new(Policy::default()))
    }

    /// A matmul over `weight` whose kernels `policy` chooses, its weight laid out for the
    /// policy's mode ([`QMatMul::laid_out`]).
    pub fn new(weight: Arc<QTensor>, policy: Arc<Policy>) -> Result<Self> {
        Self::laid_out(weight, WeightLayout::for_mode(policy.mode), policy)
    }

    /// A matmul over `weight` in `layout`. `policy` is what [`Module::forward`] runs (Candle's
    /// interface has no room for one); an engine passes its own to every call.
    ///
    /// In the `invariant` layout on a host whose kernels run AVX-512, a Q4_K, Q6_K, Q4_1 or Q5_0
    /// weight nobody else holds (this is its only `Arc`) is repacked in place for the
    /// sixteen-column kernels ([`QMatMul::is_packed`]): the same bits, at about the memory rate
    /// at one row where the GGUF layout's transposes or per-element sums cost compute. In the
    /// `canonical` layout, on a host with AVX2 or wider, Q8_0 is packed too
    /// (`kernels::cpu_canonical`). `CANDLE_GATE_PACK=0` keeps the GGUF layout.
    pub fn laid_out(weight: Arc<QTensor>, layout: WeightLayout, policy: Arc<Policy>) -> Result<Self> {
        Self::laid_out_in(weight, layout, policy, None)
    }

    /// [`QMatMul::laid_out`], the weight (packed or not) then copied into `arena` where one is
    /// given and nobody else holds it: a model's loader places all its weights side by side in
    /// huge pages ([`crate::huge_pages::WeightArena`]), where each alone would mostly have
    /// stayed on 4 KB pages.
    pub fn laid_out_in(
        weight: Arc<QTensor>,
        layout: WeightLayout,
        policy: Arc<Policy>,
        arena: Option<&crate::huge_pages::WeightArena>,
    ) -> Result<Self> {
        let only_holder = Arc::strong_count(&weight) == 1;
        let pack = layout.packs_here(weight.dtype())
            && only_holder
            && std::env::var("CANDLE_GATE_PACK").map_or(true, |v| v != "0");
        Self::build(weight, layout, policy, pack, arena.filter(|_| only_holder))
    }

    /// [`QMatMul::laid_out`] with the packing chosen: `pack` repacks the weight for `layout`
    /// when its packed kernels take the weight's dtype and shape (`kernels::cpu::packable`),
    /// whoever else holds it and whatever the host (the kernel tiers without AVX-512 unpack a
    /// copy on each call: the differential tests use that).
    pub fn with_packing(weight: Arc<QTensor>, layout: WeightLayout, policy: Arc<Policy>, pack: bool) -> Result<Self> {
        Self::build(weight, layout, policy, pack, None)
    }

    fn build(
        weight: Arc<QTensor>,
        layout: WeightLayout,
        policy: Arc<Policy>,
        pack: bool,
        arena: Option<&crate::huge_pages::WeightArena>,
    ) -> Result<Self> {
        if weight.rank() != 2 {
            return Err(Error::BadInput(format!("a matmul weight must be rank 2, got shape {:?}", weight.shape())));
        }
        let packed = match (pack, layout) {
            (false, _) | (_, WeightLayout::Gguf) => None,
            (true, WeightLayout::Canonical) => kernels::cpu_canonical::pack(&weight)?.map(Arc::new),
            (true, WeightLayout::Invariant) => kernels::cpu::pack(&weight)?.map(Arc::new),
        };
        let is_packed = packed.is_some();
        let mut weight = packed.unwrap_or(weight);
        if let Some(placed) = arena.map(|a| a.place(&weight)).transpose()?.flatten() {
            weight = Arc::new(placed);
        } else if weight.device().is_cpu() {
            if let Ok(std::borrow::Cow::Borrowed(bytes)) = weight.data() {
                crate::huge_pages::advise(bytes, true);
            }
        }
        Ok(QMatMul {
            weight,
            packed: is_packed,
            plain: OnceLock::new(),
            native: OnceLock::new(),
            dense: OnceLock::new(),
            dense_f16: OnceLock::new(),
            half: OnceLock::new(),
            policy,
        })
    }

    pub fn with_policy(&self, policy: Arc<Policy>) -> Self {
        QMatMul {
            weight: self.weight.clone(),
            packed: self.packed,
            plain: self.plain.clone(),
            native: self.native.clone(),
            dense: OnceLock::new(),
            dense_f16: OnceLock::new(),
            half: OnceLock::new(),
            policy,
        }
    }

    /// The weight in GGUF layout. For a packed weight that is a copy, made on the first call
    /// and kept (as it is for Candle's lane and the dense lanes, which read it).
    pub fn weight(&self) -> &Arc<QTensor> {
        self.plain().expect("unpacking a weight cannot fail once it was packed")
    }

    /// Rows `rows` of the weight dequantized to f32, row-major (a packed weight unpacks only
    /// the groups that hold them).
    pub fn dequantize_rows(&self, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
        if self.packed {
            kernels::cpu_canonical::dequantize_rows_packed(&self.weight, rows)
        } else {
            kernels::cpu::dequantize_rows(&self.weight, rows)
        }
    }

    /// Bytes the weight occupies (a packed layout has the GGUF size).
    pub fn weight_bytes(&self) -> usize {
        self.weight.storage_size_in_bytes()
    }

    /// Whether the CPU's invariant or canonical kernels read this weight repacked
    /// ([`QMatMul::new`]).
    pub fn is_packed(&self) -> bool {
        self.packed
    }

    /// Whether the weight is in the invariant kernels' packed layout: the canonical mode's
    /// for Q4_K, Q6_K, Q4_1 and Q5_0 is the same one; its Q8_0 layout is its own.
    fn invariant_packed(&self) -> bool {
        self.packed && kernels::cpu::packable(&self.weight)
    }

    fn plain(&self) -> Result<&Arc<QTensor>> {
        if !self.packed {
            return Ok(&self.weight);
        }
        if let Some(p) = self.plain.get() {
            return Ok(p);
        }
        let p = Arc::new(kernels::cpu_canonical::unpack(&self.weight)?);
        Ok(self.plain.get_or_init(|| p))
    }

    /// The weight in GGUF layout for a reader that keeps what it makes of it (a dense copy):
    /// the kept unpacked copy if there is one, else a temporary.
    fn unpacked(&self) -> Result<Arc<QTensor>> {
        match self.plain.get() {
            Some(p) => Ok(p.clone()),
            None if self.packed => Ok(Arc::new(kernels::cpu_canonical::unpack(&self.weight)?)),
            None => Ok(self.weight.clone()),
        }
    }

    fn native(&self) -> Result<&CandleQMatMul> {
        if let Some(n) = self.native.get() {
            return Ok(n);
        }
        let n = CandleQMatMul::from_arc(self.plain()?.clone())?;
        Ok(self.native.get_or_init(|| n))
    }
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }
    /// The weight's GGML dtype (whatever its layout).
    pub fn dtype(&self) -> GgmlDType {
        self.weight.dtype()
    }
    /// `(n, k)`: output features, input features.
    pub fn dims(&self) -> (usize, usize) {
        let d = self.weight.shape().dims();
        (d[0], d[1])
    }

    /// The weight dequantized to a dense FP32 `[n, k]` tensor, made once and cached.
    pub fn dense_f32(&self) -> Result<&Tensor> {
        self.dense()
    }

    /// The weight in half precision. On the CPU it is kept as F32 holding f16-rounded values
    /// (every f16 is an exact f32), so the fast F32 GEMM computes exactly the products of the f16
    /// operands; on GPUs it is a real F16 tensor.
    fn dense_f16(&self) -> Result<&Tensor> {
        if let Some(t) = self.dense_f16.get() {
            return Ok(t);
        }
        let dev = self.weight.device();
        let t = self.unpacked()?.dequantize_f16(&dev)?;
        let t = if dev.is_cpu() { t.to_dtype(DType::F32)? } else { t };
        Ok(self.dense_f16.get_or_init(|| t))
    }

    /// The weight dequantized and rounded to f16, row-major `[n, k]`, for the split-K lane.
    fn half(&self) -> Result<&[half::f16]> {
        if let Some(h) = self.half.get() {
            return Ok(h);
        }
        // Not through `dense()`: that would keep an f32 copy alive beside the f16 one.
        let wd = self.unpacked()?.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        let h = wd.into_iter().map(half::f16::from_f32).collect();
        Ok(self.half.get_or_init(|| h))
    }

    fn dense(&self) -> Result<&Tensor> {
        if let Some(t) = self.dense.get() {
            return Ok(t);
        }
        let t = self.unpacked()?.dequantize(&self.weight.device())?;
        Ok(self.dense.get_or_init(|| t))
    }

    /// `xs` (`[.., k]`) times the weight dequantized to F32, in the canonical order for dense
    /// weights (`kernels::canonical`): the reference lane's matmul, on the CPU or on a CUDA GPU,
    /// whose bits depend on neither the row count nor the device.
    pub fn forward_reference(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (n, k) = self.dims();
        let dims = xs.dims().to_vec();
        if dims.last() != Some(&k) {
            candle_core::bail!("QMatMul inner dimension mismatch: input {dims:?}, weight [{n}, {k}]");
        }
        let m = xs.elem_count() / k;
        let mut out_dims = dims.clone();
        *out_dims.last_mut().unwrap() = n;
        let dense = self.dense().map_err(candle_core::Error::wrap)?;
        let ys = match Backend::of(xs.device()) {
            Backend::Cuda => kernels::cuda::canonical_dense(dense, &xs.reshape((m, k))?)?,
            Backend::Cpu => {
                let w = QTensor::quantize(dense, GgmlDType::F32)?;
                let x = xs.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let y = kernels::canonical::matmul(&w, &x, m).map_err(candle_core::Error::wrap)?;
                Tensor::from_vec(y, (m, n), &Device::Cpu)?.to_dtype(xs.dtype())?
            }
            Backend::Metal => candle_core::bail!("the canonical reference matmul has no Metal kernel"),
        };
        ys.reshape(out_dims)
    }

    /// CPU fast path over plain rows: `x` is `m` rows of `k`, row-major; returns `m` rows of `n`.
    pub fn forward_rows(&self, policy: &Policy, x: &[f32], m: usize) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.forward_rows_into(policy, x, m, &mut out)?;
        Ok(out)
    }

    /// [`QMatMul::forward_rows`] into `out` (made `m` rows of `n`), reusing its allocation.
    pub fn forward_rows_into(&self, policy: &Policy, x: &[f32], m: usize, out: &mut Vec<f32>) -> Result<()> {
        let kernel = policy.kernel(Backend::Cpu, self.weight.dtype(), m);
        match kernel {
            Kernel::GemvRowSplit | Kernel::Invariant | Kernel::Canonical if self.weight.device().is_cpu() => {
                let n = self.dims().0;
                let out = crate::scratch::sized(out, m * n);
                match kernel {
                    Kernel::GemvRowSplit => kernels::cpu::gemv_rows_into(self.plain()?, x, m, out),
                    Kernel::Canonical if self.packed => {
                        kernels::cpu_canonical::matmul_packed_into(&self.weight, x, m, out)
                    }
                    Kernel::Canonical => {
                        out.copy_from_slice(&kernels::canonical::matmul(&self.weight, x, m)?);
                        Ok(())
                    }
                    _ if self.invariant_packed() => kernels::cpu::invariant_packed_into(&self.weight, x, m, out),
                    _ => kernels::cpu::invariant_into(self.plain()?, x, m, out),
                }
            }
            _ => {
                *out = self.run_cpu(kernel, x, m)?;
                Ok(())
            }
        }
    }

    /// Runs one named kernel on the CPU (benchmarks and differential tests use this directly).
    pub fn run_cpu(&self, kernel: Kernel, x: &[f32], m: usize) -> Result<Vec<f32>> {
        if !self.weight.device().is_cpu() {
            return Err(Error::Unsupported("run_cpu needs a CPU weight".into()));
        }
        let (n, k) = self.dims();
        match kernel {
            Kernel::GemvRowSplit => kernels::cpu::gemv_rows(self.plain()?, x, m),
            Kernel::Invariant if self.invariant_packed() => {
                let mut out = vec![0f32; m * n];
                kernels::cpu::invariant_packed_into(&self.weight, x, m, &mut out)?;
                Ok(out)
            }
            Kernel::Invariant => kernels::cpu::invariant(self.plain()?, x, m),
            Kernel::Canonical if self.packed => {
                let mut out = vec![0f32; m * n];
                kernels::cpu_canonical::matmul_packed_into(&self.weight, x, m, &mut out)?;
                Ok(out)
            }
            Kernel::Canonical => kernels::canonical::matmul(&self.weight, x, m),
            Kernel::SplitKF16 => {
                kernels::cpu::check(&self.weight, x, m)?;
                Ok(kernels::cpu_split_k::matmul(self.half()?, x, m, k, n))
            }
            Kernel::Gemm | Kernel::GemmF16 | Kernel::Candle => {
                kernels::cpu::check(&self.weight, x, m)?;
                let ys = match kernel {
                    Kernel::Gemm => Tensor::from_slice(x, (m, k), &Device::Cpu)?.matmul(&self.dense()?.t()?)?,
                    Kernel::GemmF16 => {
                        Tensor::from_vec(round_f16(x), (m, k), &Device::Cpu)?.matmul(&self.dense_f16()?.t()?)?
                    }
                    _ => self.native()?.forward(&Tensor::from_slice(x, (m, k), &Device::Cpu)?)?,
                };
                debug_assert_eq!(ys.dims(), &[m, n]);
                let mut y = ys.flatten_all()?.to_vec1::<f32>()?;
                if kernel == Kernel::GemmF16 {
                    y = round_f16(&y);
                }
                Ok(y)
            }
        }
    }
}

impl Module for QMatMul {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let dims = xs.dims().to_vec();
        let (n, k) = self.dims();
        if dims.len() < 2 {
            candle_core::bail!("QMatMul input must have rank >= 2, got shape {dims:?}");
        }
        if dims[dims.len() - 1] != k {
            candle_core::bail!("QMatMul inner dimension mismatch: input {dims:?}, weight [{n}, {k}]");
        }
        if !xs.is_contiguous() {
            candle_core::bail!("QMatMul input is not contiguous (shape {dims:?}); call .contiguous() first");
        }
        let m: usize = dims[..dims.len() - 1].iter().product();
        if m == 0 {
            candle_core::bail!("QMatMul input has zero rows (shape {dims:?})");
        }
        let mut out_dims = dims.clone();
        *out_dims.last_mut().unwrap() = n;
        let backend = Backend::of(xs.device());
        let kernel = self.policy.kernel(backend, self.weight.dtype(), m);
        let xs2 = xs.reshape((m, k))?;
        let ys = match backend {
            Backend::Cpu => {
                if xs.dtype() != DType::F32 {
                    candle_core::bail!("QMatMul on the CPU takes f32 input, got {:?}", xs.dtype());
                }
                let x = xs2.flatten_all()?.to_vec1::<f32>()?;
                let y = self.run_cpu(kernel, &x, m).map_err(candle_core::Error::wrap)?;
                Tensor::from_vec(y, (m, n), &Device::Cpu)?
            }
            Backend::Cuda | Backend::Metal => {
                let native = self.native().map_err(candle_core::Error::wrap)?;
                let row_split = |x: &Tensor| match backend {
                    Backend::Cuda => kernels::cuda::row_split(native, x),
                    _ => kernels::metal::row_split(native, x),
                };
                match kernel {
                    Kernel::Invariant | Kernel::Canonical if backend == Backend::Cuda => {
                        match kernels::cuda::canonical(self.plain().map_err(candle_core::Error::wrap)?, &xs2)? {
                            Some(ys) => ys,
                            // A dtype canonical.cu does not decode: one mat-vec launch per row
                            // is invariant too, only slower, but it is not the canonical order.
                            None if kernel == Kernel::Invariant => row_split(&xs2)?,
                            None => {
                                candle_core::bail!("canonical mode has no CUDA kernel for {:?}", self.weight.dtype())
                            }
                        }
                    }
                    Kernel::Canonical => {
                        candle_core::bail!("canonical mode has no {} kernel", backend.name())
                    }
                    // No multi-row invariant Metal kernel yet: one mat-vec launch per row is
                    // invariant by construction, only slower.
                    Kernel::GemvRowSplit | Kernel::Invariant => row_split(&xs2)?,
                    Kernel::Candle => native.forward(&xs2)?,
                    Kernel::Gemm => xs2.matmul(&self.dense().map_err(candle_core::Error::wrap)?.t()?)?,
                    // On a GPU the half-precision GEMM library picks its own split-K from the
                    // row count: that is the lane split_k_f16 stands in for on the CPU.
                    Kernel::GemmF16 | Kernel::SplitKF16 => xs2
                        .to_dtype(DType::F16)?
                        .matmul(&self.dense_f16().map_err(candle_core::Error::wrap)?.t()?)?
                        .to_dtype(xs.dtype())?,
                }
            }
        };
        ys.reshape(out_dims)
    }
}

/// Each value rounded to the nearest f16 (round-to-nearest-even), kept as f32.
fn round_f16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect()
}

/// What differs between the two lanes that run the layer loop: how a linear layer is computed.
pub trait Lane: Sync {
    /// `y = x · Wᵀ` for `m` rows of `x`: `out` becomes `m` rows of `n` (its allocation reused).
    fn matmul_into(&self, w: &QMatMul, x: &[f32], m: usize, out: &mut Vec<f32>) -> Result<()>;

    /// [`Lane::matmul_into`] into a new vector.
    fn matmul(&self, w: &QMatMul, x: &[f32], m: usize) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.matmul_into(w, x, m, &mut out)?;
        Ok(out)
    }
}

/// The fast lane: the policy's kernel for this row count.
impl Lane for Policy {
    fn matmul_into(&self, w: &QMatMul, x: &[f32], m: usize, out: &mut Vec<f32>) -> Result<()> {
        w.forward_rows_into(self, x, m, out)
    }
}
