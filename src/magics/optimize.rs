//! `%%optimize`: the cell magic that rewrites the training loop below it to use less memory.

use clap::{Args, Parser, ValueEnum};

use super::MagicReply;
use crate::rewrite::{Amp, Compress, OptimizerChoice, Options};

/// Mixed-precision kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AmpArg {
    /// bfloat16: f32's range, no loss scaling needed (Ampere GPUs and later).
    Bf16,
    /// float16: adds a GradScaler so that small gradients do not underflow.
    F16,
}

/// Leaner optimizers, from tchmem::optim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    /// SGD with momentum: one state tensor per parameter (Adam keeps two).
    Sgd,
    /// Lion: one momentum per parameter, sign updates (learning rate / 3).
    Lion,
    /// AdamW with 8-bit moments: about a quarter of Adam's state.
    #[value(name = "adamw8bit")]
    AdamW8bit,
    /// Adafactor: factored second moments, rows + columns per matrix.
    Adafactor,
}

/// How `--compress-activations` stores segment inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CompressArg {
    /// 8-bit integers, a scale per row: each element within half a step of its row.
    Int8,
    /// 8-bit floats (e4m3), a scale per row: 3 bits of mantissa.
    Fp8,
}

impl CompressArg {
    /// The rewriter's value.
    pub fn compress(self) -> Compress {
        match self {
            CompressArg::Int8 => Compress::Int8,
            CompressArg::Fp8 => Compress::Fp8,
        }
    }
}

impl AmpArg {
    /// The rewriter's kind for this value.
    pub fn amp(self) -> Amp {
        match self {
            AmpArg::Bf16 => Amp::Bf16,
            AmpArg::F16 => Amp::F16,
        }
    }
}

impl OptimizerArg {
    /// The rewriter's choice for this value.
    pub fn choice(self) -> OptimizerChoice {
        match self {
            OptimizerArg::Sgd => OptimizerChoice::Sgd,
            OptimizerArg::Lion => OptimizerChoice::Lion,
            OptimizerArg::AdamW8bit => OptimizerChoice::AdamW8bit,
            OptimizerArg::Adafactor => OptimizerChoice::Adafactor,
        }
    }
}

/// The memory `--fit` must stay within.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitTarget {
    /// This many bytes of device memory (the loop's peak reserved plus the CUDA context).
    Bytes(u64),
    /// The device as it is now: what the allocator may still take, plus the context.
    Device,
}

fn parse_fit_target(text: &str) -> Result<FitTarget, String> {
    if text == "device" {
        return Ok(FitTarget::Device);
    }
    match crate::fit::parse_size(text)? {
        bytes if bytes < 1 << 20 => Err(format!(
            "--fit {text}: that is {bytes} bytes; give a size with its unit (16GiB, 512MiB) or \
             `device`"
        )),
        bytes => Ok(FitTarget::Bytes(bytes)),
    }
}

/// The flags of the techniques beyond PyTorch's built-in recipe, shared by `%%optimize` and
/// `%memestimate`.
#[derive(Args, Debug, Clone, Default)]
pub struct BeyondArgs {
    /// Compute a linear head and its cross-entropy together, chunk by chunk over the tokens: no
    /// logits tensor (tokens × vocabulary) in forward or backward. CHUNK: tokens per chunk
    /// (default: sized by the vocabulary).
    #[arg(long, value_name = "CHUNK", num_args = 0..=1)]
    pub fused_loss: Option<Option<u32>>,
    /// With --checkpoint: keep each segment's input (all checkpointing keeps) in pinned host
    /// memory until backward, brought back one segment ahead.
    #[arg(long)]
    pub offload: bool,
    /// With --checkpoint: keep each segment's input quantized to 8 bits until backward.
    #[arg(long, value_name = "FORMAT")]
    pub compress_activations: Option<CompressArg>,
    /// Update each parameter inside backward as soon as its gradient is complete, and free the
    /// gradient: the model's gradients never all live at once.
    #[arg(long)]
    pub step_in_backward: bool,
}

impl BeyondArgs {
    /// Checks what clap cannot: the flags among themselves and with `checkpoint`, `accumulate`
    /// and f16 (the rest of the magic's flags).
    pub fn validate(&self, checkpoint: bool, accumulate: bool, f16: bool) -> Result<(), String> {
        if let Some(Some(0)) = self.fused_loss {
            return Err(
                "--fused-loss 0: CHUNK is how many tokens each chunk holds; give at least \
                        1, or leave it out for chunks sized by the vocabulary"
                    .to_string(),
            );
        }
        if !checkpoint {
            let needs = match (self.offload, self.compress_activations) {
                (true, _) => Some("--offload"),
                (false, Some(_)) => Some("--compress-activations"),
                _ => None,
            };
            if let Some(flag) = needs {
                return Err(format!(
                    "{flag} works on what --checkpoint keeps (each segment's input, the only \
                     activation left): without --checkpoint every layer's activations are kept, \
                     and moving or rounding them all would cost more than it saves. Add \
                     --checkpoint"
                ));
            }
        }
        if self.step_in_backward && accumulate {
            return Err(
                "--step-in-backward with --accumulate: accumulation adds the \
                        micro-batches' gradients before one step, so they must live across \
                        backward passes, and the step in backward frees each at once. Use \
                        one or the other"
                    .to_string(),
            );
        }
        if self.step_in_backward && f16 {
            return Err(
                "--step-in-backward with --amp f16: the f16 grad scaler must see \
                        every gradient (for inf/nan) before any step, and the step in \
                        backward takes each at once. Use --amp bf16 (no scaler needed)"
                    .to_string(),
            );
        }
        Ok(())
    }

    /// `options` with these techniques.
    pub fn apply(&self, options: Options) -> Options {
        Options {
            fused_loss: self.fused_loss,
            offload: self.offload,
            compress: self.compress_activations.map(CompressArg::compress),
            step_in_backward: self.step_in_backward,
            ..options
        }
    }
}

/// Rewrite the tch training loop in this cell to use less GPU memory, show the rewritten code,
/// and run it.
///
/// The cell below the magic line must hold the training loop: the model (nn::seq, or a struct
/// implementing Module), the optimizer (`nn::Adam::default().build(&vs, lr)` …) and a loop with
/// the forward pass, the loss and `opt.backward_step(&loss)` (or `loss.backward(); opt.step()`
/// with `opt.zero_grad()`). When the cell does not match what a rewrite needs, nothing runs and
/// the message says what was looked for and where.
///
/// A model, optimizer or batch const made in an earlier cell is followed back to the cell that
/// made it. `--optimizer` rebuilds an optimizer of an earlier cell as the new one (shown in the
/// code, with its cell); `--compare` runs both versions from the notebook's weights with a
/// fresh optimizer each and puts the model back as it was afterwards (weights, gradients).
#[derive(Parser, Debug)]
#[command(
    name = "%%optimize",
    no_binary_name = true,
    disable_version_flag = true,
    after_help = "Examples:\n  %%optimize --checkpoint --amp bf16 --accumulate 4\n  \
                  %%optimize --optimizer adafactor --show\n  %%optimize --fit 16GiB"
)]
pub struct OptimizeArgs {
    /// Recompute activations in the backward pass instead of keeping them (nn::seq models);
    /// SEGMENTS defaults to √layers.
    #[arg(long, value_name = "SEGMENTS", num_args = 0..=1)]
    pub checkpoint: Option<Option<u32>>,
    /// Run the forward pass and loss in bf16 or f16: activations take half the memory (f16 adds
    /// a grad scaler; tch's Adam/AdamW become tchmem's fused ones, the same update in fewer
    /// kernels).
    #[arg(long, value_name = "KIND")]
    pub amp: Option<AmpArg>,
    /// Split each batch into K micro-batches and add up their gradients: about 1/K of the
    /// activations, same effective batch.
    #[arg(long, value_name = "K")]
    pub accumulate: Option<u32>,
    /// Swap the optimizer for one with less state.
    #[arg(long, value_name = "NAME")]
    pub optimizer: Option<OptimizerArg>,
    /// The techniques beyond PyTorch's built-in recipe.
    #[command(flatten)]
    pub beyond: BeyondArgs,
    /// Show the rewritten code without running it.
    #[arg(long, conflicts_with = "compare")]
    pub show: bool,
    /// Run the original and the rewritten cell for STEPS optimizer steps each, and compare
    /// their memory, time and loss side by side.
    #[arg(long, value_name = "STEPS")]
    pub compare: Option<u32>,
    /// Find the fastest combination of the rewrites whose peak fits in SIZE (16GiB, 8GB, or
    /// `device`: the device as it is now), by short trials: calibrate, rank by the estimator,
    /// confirm the best at the cell's batch; then show the table and run the winner (or, with
    /// --show, only show it). SIZE counts the loop's peak reserved bytes plus the CUDA context.
    #[arg(
        long,
        value_name = "SIZE",
        value_parser = parse_fit_target,
        conflicts_with_all = ["checkpoint", "amp", "accumulate", "optimizer", "compare",
            "fused_loss", "offload", "compress_activations", "step_in_backward"]
    )]
    pub fit: Option<FitTarget>,
}

/// What `%%optimize` was asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptimizeRequest {
    /// The rewrites.
    pub options: Options,
    /// Show the rewritten code without running it.
    pub show: bool,
    /// Run original and rewritten for this many optimizer steps each and compare them.
    pub compare: Option<u32>,
    /// Choose the rewrites by trials so that the loop fits (`--fit SIZE`).
    pub fit: Option<FitTarget>,
}

impl OptimizeArgs {
    /// Checks the values clap cannot, and converts to a request.
    pub fn validate(self) -> Result<OptimizeRequest, String> {
        if let Some(Some(n @ (0 | 1))) = self.checkpoint {
            // The last segment is never recomputed: fewer than 2 would checkpoint nothing.
            return Err(format!(
                "--checkpoint {n}: SEGMENTS is how many segments the model is split into (each \
                 keeps only its input); the last one is not recomputed (backward needs its \
                 activations at once), so it must be at least 2, or leave it out for √layers"
            ));
        }
        if let Some(k) = self.accumulate {
            if k < 2 {
                return Err(format!(
                    "--accumulate {k}: K is how many micro-batches each batch is split into; it \
                     must be at least 2 ({k} would change nothing)"
                ));
            }
        }
        self.beyond.validate(
            self.checkpoint.is_some(),
            self.accumulate.is_some(),
            self.amp == Some(AmpArg::F16),
        )?;
        if self.compare == Some(0) {
            return Err(
                "--compare 0: STEPS is how many optimizer steps each version runs; it \
                        must be at least 1"
                    .to_string(),
            );
        }
        let options = self.beyond.apply(Options {
            checkpoint: self.checkpoint,
            amp: self.amp.map(AmpArg::amp),
            accumulate: self.accumulate,
            optimizer: self.optimizer.map(OptimizerArg::choice),
            ..Options::default()
        });
        if options.is_empty() && self.fit.is_none() {
            return Err(
                "%%optimize needs at least one rewrite: --checkpoint, --amp bf16|f16, \
                        --accumulate K, --optimizer NAME, --fused-loss, --step-in-backward \
                        (--offload and --compress-activations with --checkpoint), or --fit SIZE \
                        to choose them (%%optimize --help explains each)"
                    .to_string(),
            );
        }
        Ok(OptimizeRequest {
            options,
            show: self.show,
            compare: self.compare,
            fit: self.fit,
        })
    }
}

/// Parses `%%optimize`'s arguments (the words after the name on the magic line).
pub fn parse_args(args: &[&str]) -> Result<OptimizeRequest, MagicReply> {
    let parsed = OptimizeArgs::try_parse_from(args).map_err(super::reply)?;
    parsed
        .validate()
        .map_err(|message| MagicReply::Error(format!("error: {message}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<OptimizeRequest, MagicReply> {
        let args: Vec<&str> = line.split_whitespace().collect();
        parse_args(&args)
    }

    fn error(line: &str) -> String {
        match parse(line) {
            Err(MagicReply::Error(message)) => message,
            other => panic!("{line}: expected an error, got {other:?}"),
        }
    }

    #[test]
    fn optimize_flags_convert_to_options() {
        let request =
            parse("--checkpoint --amp bf16 --accumulate 4 --optimizer adamw8bit --show").unwrap();
        assert_eq!(
            request.options,
            Options {
                checkpoint: Some(None),
                amp: Some(Amp::Bf16),
                accumulate: Some(4),
                optimizer: Some(OptimizerChoice::AdamW8bit),
                ..Options::default()
            }
        );
        assert!(request.show);
        assert_eq!(request.compare, None);
        assert_eq!(
            parse("--fit 8GiB").unwrap().fit,
            Some(FitTarget::Bytes(8 << 30))
        );
        assert_eq!(
            parse("--fit device --show").unwrap().fit,
            Some(FitTarget::Device)
        );
        let request = parse("--checkpoint 3 --compare 20").unwrap();
        assert_eq!(request.options.checkpoint, Some(Some(3)));
        assert_eq!(request.compare, Some(20));
        // --checkpoint's value is optional, even before another flag.
        let request = parse("--amp f16 --checkpoint").unwrap();
        assert_eq!(request.options.checkpoint, Some(None));
        assert_eq!(request.options.amp, Some(Amp::F16));
    }

    #[test]
    fn optimize_help_lists_every_flag() {
        let Err(MagicReply::Help(help)) = parse("--help") else {
            panic!("no help")
        };
        for flag in [
            "--checkpoint",
            "--amp",
            "--accumulate",
            "--optimizer",
            "--show",
            "--compare",
            "--fit",
            "adamw8bit",
            "bf16",
        ] {
            assert!(help.contains(flag), "{flag} missing from:\n{help}");
        }
    }

    #[test]
    fn optimize_mistakes_are_explained() {
        assert!(error("--accumulate 0").contains("at least 2"));
        assert!(error("--accumulate 1").contains("at least 2"));
        assert!(error("--compare 0 --amp bf16").contains("at least 1"));
        assert!(error("--checkpoint 0").contains("at least 2"));
        assert!(error("--checkpoint 1").contains("at least 2"));
        let unknown = error("--optimizer adam");
        for valid in ["sgd", "lion", "adamw8bit", "adafactor"] {
            assert!(unknown.contains(valid), "{unknown}");
        }
        assert!(error("--amp fp8").contains("bf16"));
        assert!(error("").contains("at least one rewrite"));
        assert!(error("--show").contains("at least one rewrite"));
        assert!(error("--amp bf16 --show --compare 3").contains("--show"));
        assert!(error("--accumulate many").contains("many"));
        assert!(error("--fit 8GiB --amp bf16").contains("--amp"));
        assert!(error("--fit lots").contains("16GiB"));
        assert!(error("--fit 16").contains("with its unit"));
        assert!(error("--turbo").contains("--turbo"));
    }
}
