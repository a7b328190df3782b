//! `cargo bench --bench crossover [-- --quick] [-- --out FILE]`: times row-split gemv,
//! invariant, gemm and Candle's own QMatMul for every dtype, shape and row count, prints the
//! table with side-by-side ratios, and writes the crossover profile (JSON) the engine loads.
use candle_gate::profile::{format_table, measure, MeasureSpec};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "target/candle-gate-profile.json".into());
    let spec = if quick { MeasureSpec::quick() } else { MeasureSpec::full() };
    let mut n = 0;
    let p = measure(&spec, |what| {
        n += 1;
        if n % 25 == 0 {
            eprintln!("[{n}] {what}");
        }
    })
    .expect("measurement failed");
    println!("{}", format_table(&p));
    p.save(std::path::Path::new(&out)).expect("cannot write profile");
    println!("profile written to {out}");
}
