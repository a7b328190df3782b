//! Transparent huge pages for the weights, which every decode step streams from end to end.
//! With 4 KB pages a step's reads cross a page every 4 KB, where the hardware prefetchers stop
//! and a TLB miss (a two-level walk under a hypervisor) waits; 2 MB pages take both away. Linux
//! backs anonymous memory with huge pages only where asked when `transparent_hugepage` is
//! `madvise` (a common default), so we ask. Where the kernel says no, nothing changes but the
//! speed: the bytes are the same. (The KV pool is not advised: its slabs hold each region of
//! every block together, so a pool's first block would touch one 2 MB page per region, up to
//! hundreds of MB, and a decode step's attention read no faster with huge pages.)
//! [`advise`] covers the whole 2 MB pages inside one allocation; a model's loader places all its
//! weights side by side in a [`WeightArena`] instead, so that small ones get huge pages too.
//! `CANDLE_GATE_HUGE_PAGES=0` turns both off.

#[cfg(target_os = "linux")]
mod arena;
#[cfg(target_os = "linux")]
pub use arena::WeightArena;

/// Whether huge pages are asked for: not where `CANDLE_GATE_HUGE_PAGES=0`.
#[allow(dead_code)]
fn enabled() -> bool {
    std::env::var_os("CANDLE_GATE_HUGE_PAGES").is_none_or(|v| v != "0")
}

/// Without Linux's huge pages, an arena that places nothing: every weight stays where it is.
#[cfg(not(target_os = "linux"))]
#[derive(Default)]
pub struct WeightArena;

#[cfg(not(target_os = "linux"))]
impl WeightArena {
    pub fn new() -> WeightArena {
        WeightArena
    }

    pub fn place(
        &self,
        _w: &candle_core::quantized::QTensor,
    ) -> candle_core::Result<Option<candle_core::quantized::QTensor>> {
        Ok(None)
    }
}

/// Asks that the whole 2 MB pages inside `bytes` be huge pages. Memory not yet touched (a pool
/// just allocated zeroed) gets them as it is first written; with `collapse`, pages already
/// written (weights read from a file) are moved into huge pages now, a copy of the range.
#[allow(unused_variables)]
pub fn advise(bytes: &[u8], collapse: bool) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (bytes.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (bytes.as_ptr() as usize + bytes.len()) & !(HUGE - 1);
        if end <= start || !enabled() {
            return;
        }
        // SAFETY: advice on whole pages inside a live allocation; it changes how the kernel backs
        // them, never their contents. Failures (no THP, an old kernel) leave things as they were.
        unsafe {
            let p = start as *mut libc::c_void;
            libc::madvise(p, end - start, libc::MADV_HUGEPAGE);
            if collapse {
                libc::madvise(p, end - start, libc::MADV_COLLAPSE);
            }
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    /// AnonHugePages of the mapping holding `addr`, in kB (from /proc/self/smaps).
    fn huge_kb_at(addr: usize) -> Option<usize> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
                let (lo, hi) = (usize::from_str_radix(lo, 16).ok()?, usize::from_str_radix(hi, 16).ok()?);
                inside = (lo..hi).contains(&addr);
            } else if inside && first == "AnonHugePages:" {
                return line.split_whitespace().nth(1)?.parse().ok();
            }
        }
        None
    }

    /// Written memory, advised with `collapse`, keeps its bytes and (where the kernel has THP
    /// at all) lies in huge pages.
    #[test]
    fn collapsed_memory_keeps_its_bytes_and_is_huge() {
        let n = 16 << 20;
        let v: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
        super::advise(&v, true);
        assert!(v.iter().enumerate().all(|(i, &b)| b == (i * 31 % 251) as u8), "advice changed the bytes");
        if let Some(thp) = huge_pages_on() {
            let kb = huge_kb_at(v.as_ptr() as usize + n / 2).expect("the vector's mapping in /proc/self/smaps");
            assert!(kb >= 2048, "no huge page behind 16 MB advised with collapse (THP: {thp:?})");
        }
    }

    /// The host's THP setting where huge pages can be had and are not turned off; `None` (said
    /// on stderr) where a test can check bytes alone.
    fn huge_pages_on() -> Option<String> {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if thp.contains("[never]") || thp.is_empty() || !super::enabled() {
            eprintln!("transparent huge pages are off (host or CANDLE_GATE_HUGE_PAGES=0): only the bytes were checked");
            return None;
        }
        Some(thp)
    }

    fn q4k_weight(n: usize, k: usize, seed: u32) -> QTensor {
        let xs: Vec<f32> =
            (0..n * k).map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) as f32 / u32::MAX as f32 - 0.5).collect();
        let t = Tensor::from_vec(xs, (n, k), &Device::Cpu).unwrap();
        QTensor::quantize(&t, GgmlDType::Q4K).unwrap()
    }

    /// Weights placed in an arena, small ones side by side and one larger than a chunk (9 MB
    /// against the tests' 8 MB), keep
    /// their dtype, shape, bytes and values, and (where the kernel has THP) lie in huge pages,
    /// the small ones included; dropping the arena leaves them whole.
    #[test]
    fn placed_weights_keep_their_bytes_and_are_huge() {
        let arena = super::WeightArena::new();
        let shapes = [(64, 256), (96, 512), (8_000, 2048), (32, 256)];
        let weights: Vec<QTensor> = shapes.iter().enumerate().map(|(i, &(n, k))| q4k_weight(n, k, i as u32)).collect();
        let placed: Vec<QTensor> = weights.iter().map(|w| arena.place(w).unwrap().expect("placed")).collect();
        drop(arena);
        let thp = huge_pages_on();
        for (w, p) in weights.iter().zip(&placed) {
            assert_eq!((p.dtype(), p.shape().dims()), (w.dtype(), w.shape().dims()));
            let (wb, pb) = (w.data().unwrap(), p.data().unwrap());
            assert_eq!(&*wb, &*pb, "placing changed the bytes");
            assert!(!std::ptr::eq(wb.as_ptr(), pb.as_ptr()), "not a copy");
            let (dw, dp) = (w.dequantize(&Device::Cpu).unwrap(), p.dequantize(&Device::Cpu).unwrap());
            assert_eq!(
                dw.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                dp.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
            if let Some(thp) = &thp {
                let kb = huge_kb_at(pb.as_ptr() as usize).expect("the arena's mapping in /proc/self/smaps");
                assert!(kb >= 2048, "no huge page behind a placed {:?} weight (THP: {thp:?})", p.shape());
            }
        }
    }
}
