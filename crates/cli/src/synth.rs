//! `tboost synth`: writes a synthetic model (`model::synthetic`) as a GGUF file, so tboost
//! and llama.cpp can be measured on identical weights (`scripts/bench-vs-llamacpp.sh`).

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Args;

use tboost_engine::Result;
use tboost_testkit::{gguf_write, synthetic};

#[derive(Args)]
pub(crate) struct SynthArgs {
    /// A synthetic model shape: tinyllama-1.1b or small (dense llama shapes).
    #[arg(long)]
    shape: String,
    /// Weight type of the matrices: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, iq4_xs, q2_k, q3_k, q4_k, q5_k or q6_k
    /// (norm gains stay f32).
    #[arg(long)]
    dtype: String,
    /// Seed of the weights; 42 is what `tboost bench --synthetic` uses.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// The GGUF file to write.
    #[arg(long)]
    out: PathBuf,
}

pub(crate) fn run(a: SynthArgs) -> Result<()> {
    let dtype = synthetic::parse_dtype(&a.dtype)?;
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("writing {msg} {bar:40} {bytes}/{total_bytes} ({eta})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(a.out.display().to_string());
        bar
    });
    let res = gguf_write::write_synthetic(&a.shape, dtype, a.seed, &a.out, &mut |done, total| {
        if let Some(b) = &bar {
            b.set_length(total);
            b.set_position(done);
        }
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if res.is_err() {
        // Never leave a partial file that looks like a model.
        let _ = std::fs::remove_file(&a.out);
    }
    res?;
    eprintln!("wrote {} ({} {}, seed {})", a.out.display(), a.shape, dtype, a.seed);
    Ok(())
}
