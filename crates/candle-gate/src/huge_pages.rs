//! Transparent huge pages for the weights, which every decode step streams from end to end.
//! With 4 KB pages a step's reads cross a page every 4 KB, where the hardware prefetchers stop
//! and a TLB miss (a two-level walk under a hypervisor) waits; 2 MB pages take both away. Linux
//! backs anonymous memory with huge pages only where asked when `transparent_hugepage` is
//! `madvise` (a common default), so we ask. Where the kernel says no, nothing changes but the
//! speed: the bytes are the same. (The KV pool is not advised: its slabs hold each region of
//! every block together, so a pool's first block would touch one 2 MB page per region, up to
//! hundreds of MB, and a decode step's attention read no faster with huge pages.)
//! `CANDLE_GATE_HUGE_PAGES=0` turns it off.

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
        if end <= start || std::env::var_os("CANDLE_GATE_HUGE_PAGES").is_some_and(|v| v == "0") {
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
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        let off = std::env::var_os("CANDLE_GATE_HUGE_PAGES").is_some_and(|v| v == "0");
        if thp.contains("[never]") || thp.is_empty() || off {
            eprintln!("transparent huge pages are off (host or CANDLE_GATE_HUGE_PAGES=0): only the bytes were checked");
            return;
        }
        let kb = huge_kb_at(v.as_ptr() as usize + n / 2).expect("the vector's mapping in /proc/self/smaps");
        assert!(kb >= 2048, "no huge page behind 16 MB advised with collapse (THP: {thp:?})");
    }
}
