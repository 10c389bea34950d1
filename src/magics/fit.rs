//! The "will it fit?" magics: `%memestimate`, `%memfit` (each on the training cell below it, or
//! on the last training cell that ran) and `%memfree`.

use clap::Parser;

use super::optimize::{AmpArg, BeyondArgs, OptimizerArg};
use super::MagicReply;
use crate::fit::parse_percent;
use crate::rewrite::{OptimizerChoice, Options};

/// Predict the peak GPU memory of the training cell below (or of the last training cell that
/// ran) at a batch size and with rewrites, without running it at that size: parameters,
/// gradients and optimizer state exactly, activations from two short trials at small batch
/// sizes, drawn against the device's capacity.
///
/// The batch is a literal bound to a name with `batch` in it (`let batch_size: i64 = 16;`, or
/// `const BATCH_SIZE: i64 = 16;` in an earlier cell), else the literal of `train_iter(N)` or
/// of the shapes of data made in the loop. A model, optimizer or batch const made in an earlier
/// cell is followed back to it: the trials step a fresh optimizer rebuilt from its cell, and
/// the model's weights and gradients are put back after each.
///
/// Alone in a cell before the model's training loop ran, it gives the exact terms of the model
/// and optimizer earlier cells built (parameters, gradients, optimizer state, CUDA context) and
/// what they leave of the device.
#[derive(Parser, Debug)]
#[command(
    name = "%memestimate",
    no_binary_name = true,
    disable_version_flag = true,
    after_help = "Examples:\n  %memestimate\n  %memestimate --batch 64\n  %memestimate --batch 64 \
                  --amp bf16 --checkpoint --accumulate 4 --check\n  %memestimate --checkpoint \
                  --offload --fused-loss --step-in-backward\n  %memestimate --gpus 2 --zero 1"
)]
pub struct EstimateArgs {
    /// The batch size to predict (default: the cell's own).
    #[arg(long, value_name = "N")]
    pub batch: Option<u64>,
    /// With mixed precision (as `%%optimize --amp`).
    #[arg(long, value_name = "KIND")]
    pub amp: Option<AmpArg>,
    /// With another optimizer (as `%%optimize --optimizer`): the trials run it, its state by its
    /// rule.
    #[arg(long, value_name = "NAME")]
    pub optimizer: Option<OptimizerArg>,
    /// With activation checkpointing (as `%%optimize --checkpoint`).
    #[arg(long)]
    pub checkpoint: bool,
    /// With K micro-batches per step (as `%%optimize --accumulate K`).
    #[arg(long, value_name = "K")]
    pub accumulate: Option<u32>,
    /// The techniques beyond PyTorch's recipe (as `%%optimize`'s): the calibration trials run
    /// with them.
    #[command(flatten)]
    pub beyond: BeyondArgs,
    /// Then run the cell at that batch (a short trial) and show the prediction's error.
    #[arg(long)]
    pub check: bool,
    /// Per rank of N data-parallel processes (`%%distributed`), the batch split evenly over
    /// them: the same effective batch, each rank's activations at its share.
    #[arg(long, value_name = "N")]
    pub gpus: Option<u32>,
    /// With ZeRO stage S (1 or 2, `tchmem::dist::ZeroOptimizer`): each rank keeps the optimizer
    /// state of its share of the parameters only. Needs --gpus.
    #[arg(long, value_name = "S", requires = "gpus")]
    pub zero: Option<u8>,
}

/// `%memestimate --gpus N [--zero S]`: the estimate of one rank of N.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataParallel {
    /// How many ranks share the batch.
    pub ranks: u32,
    /// The ZeRO stage (1 or 2), if any.
    pub zero: Option<u8>,
}

/// What `%memestimate` predicts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EstimateRequest {
    /// The batch (None: the cell's).
    pub batch: Option<u64>,
    /// Rewrites that change what the forward pass keeps (calibrated with them applied).
    pub calibrated: Options,
    /// Micro-batches (predicted from the calibration's line).
    pub accumulate: Option<u32>,
    /// Optimizer (the trials run it; its state by its rule).
    pub optimizer: Option<OptimizerChoice>,
    /// Measure the prediction with a trial at the batch.
    pub check: bool,
    /// Per rank of data-parallel ranks (`--gpus`, `--zero`).
    pub data_parallel: Option<DataParallel>,
}

/// Find the largest batch size the training cell below (or the last training cell that ran)
/// fits with, by short trials: grow, then narrow, each trial a few optimizer steps at one batch
/// size, shown as it runs. Out of memory is told by the allocator's own counter and observer.
#[derive(Parser, Debug)]
#[command(
    name = "%memfit",
    no_binary_name = true,
    disable_version_flag = true,
    after_help = "Examples:\n  %memfit\n  %memfit --margin 5% --keep-effective-batch"
)]
pub struct FitArgs {
    /// Memory to keep free: a trial fits when its peak reserved bytes stay under the capacity
    /// less this.
    #[arg(long, value_name = "PERCENT", default_value = "10%", value_parser = parse_percent)]
    pub margin: f64,
    /// When the cell's batch does not fit, keep it as the effective batch: split it into the
    /// fewest micro-batches that fit (`%%optimize --accumulate K`), confirmed by a trial.
    #[arg(long)]
    pub keep_effective_batch: bool,
    /// Most trials of the search.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub max_trials: usize,
    /// Optimizer steps per trial (the second has the optimizer's state).
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub steps: u32,
}

/// Empty the CUDA caching allocator's cache (what is reserved but not allocated), and say how
/// much it gave back to the device.
#[derive(Parser, Debug)]
#[command(name = "%memfree", no_binary_name = true, disable_version_flag = true)]
pub struct FreeArgs {}

/// Parses `%memestimate`'s arguments.
pub fn parse_estimate(args: &[&str]) -> Result<EstimateRequest, MagicReply> {
    let parsed = EstimateArgs::try_parse_from(args).map_err(super::reply)?;
    if parsed.batch == Some(0) {
        return Err(MagicReply::Error(
            "error: --batch 0: the batch size must be at least 1".into(),
        ));
    }
    if let Some(k @ (0 | 1)) = parsed.accumulate {
        return Err(MagicReply::Error(format!(
            "error: --accumulate {k}: K is how many micro-batches each batch is split into; it \
             must be at least 2"
        )));
    }
    if parsed.gpus == Some(0) {
        return Err(MagicReply::Error(
            "error: --gpus 0: the number of data-parallel ranks must be at least 1".into(),
        ));
    }
    if let Some(stage) = parsed.zero.filter(|stage| !(1..=2).contains(stage)) {
        return Err(MagicReply::Error(format!(
            "error: --zero {stage}: tchmem has ZeRO stage 1 (optimizer state shared out) and 2 \
             (gradients too); write --zero 1 or --zero 2"
        )));
    }
    if parsed.zero.is_some() && parsed.beyond.step_in_backward {
        return Err(MagicReply::Error(
            "error: --zero with --step-in-backward: ZeroOptimizer steps after backward (its \
             ranks reduce the gradients first); leave one of them out"
                .into(),
        ));
    }
    if parsed.zero.is_some() && parsed.check {
        return Err(MagicReply::Error(
            "error: --check runs the cell in this one process, which cannot show ZeRO's shares: \
             leave out --check, or run the loop with %%distributed and compare its memory per \
             rank"
                .into(),
        ));
    }
    parsed
        .beyond
        .validate(
            parsed.checkpoint,
            parsed.accumulate.is_some(),
            parsed.amp == Some(AmpArg::F16),
        )
        .map_err(|message| MagicReply::Error(format!("error: {message}")))?;
    Ok(EstimateRequest {
        batch: parsed.batch,
        calibrated: parsed.beyond.apply(Options {
            checkpoint: parsed.checkpoint.then_some(None),
            amp: parsed.amp.map(AmpArg::amp),
            ..Options::default()
        }),
        accumulate: parsed.accumulate,
        optimizer: parsed.optimizer.map(OptimizerArg::choice),
        check: parsed.check,
        data_parallel: parsed.gpus.map(|ranks| DataParallel {
            ranks,
            zero: parsed.zero,
        }),
    })
}

/// What `%memfit` was asked.
#[derive(Debug, Clone, PartialEq)]
pub struct FitRequest {
    /// Fraction of the capacity to keep free.
    pub margin: f64,
    /// Keep the cell's batch as the effective batch, with micro-batches.
    pub keep_effective_batch: bool,
    /// Most trials.
    pub max_trials: usize,
    /// Steps per trial.
    pub steps: u32,
}

impl Eq for FitRequest {}

/// Parses `%memfit`'s arguments.
pub fn parse_fit(args: &[&str]) -> Result<FitRequest, MagicReply> {
    let parsed = FitArgs::try_parse_from(args).map_err(super::reply)?;
    if parsed.max_trials < 2 {
        return Err(MagicReply::Error(
            "error: --max-trials must be at least 2 (one to fit, one not to)".into(),
        ));
    }
    if parsed.steps == 0 {
        return Err(MagicReply::Error(
            "error: --steps must be at least 1".into(),
        ));
    }
    Ok(FitRequest {
        margin: parsed.margin,
        keep_effective_batch: parsed.keep_effective_batch,
        max_trials: parsed.max_trials,
        steps: parsed.steps,
    })
}

/// Parses `%memfree`'s arguments.
pub fn parse_free(args: &[&str]) -> Result<(), MagicReply> {
    FreeArgs::try_parse_from(args)
        .map(|_| ())
        .map_err(super::reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(line: &str) -> Vec<&str> {
        line.split_whitespace().collect()
    }

    #[test]
    fn estimate_flags_split_into_calibrated_and_predicted_rewrites() {
        let request = parse_estimate(&words(
            "--batch 64 --amp bf16 --checkpoint --accumulate 4 --optimizer lion",
        ))
        .unwrap();
        assert_eq!(request.batch, Some(64));
        assert_eq!(request.calibrated.flags(), "--checkpoint --amp bf16");
        assert_eq!(request.accumulate, Some(4));
        assert_eq!(request.optimizer, Some(OptimizerChoice::Lion));
        let Err(MagicReply::Error(zero)) = parse_estimate(&words("--batch 0")) else {
            panic!()
        };
        assert!(zero.contains("at least 1"));
        assert!(matches!(
            parse_estimate(&words("--accumulate 1")),
            Err(MagicReply::Error(_))
        ));
        assert!(
            matches!(parse_estimate(&words("--help")), Err(MagicReply::Help(h)) if h.contains("--batch"))
        );
    }

    #[test]
    fn estimate_takes_the_techniques_beyond_pytorch_as_calibrated_rewrites() {
        let request = parse_estimate(&words(
            "--checkpoint --offload --fused-loss 64 --step-in-backward --amp bf16",
        ))
        .unwrap();
        assert_eq!(
            request.calibrated.flags(),
            "--checkpoint --amp bf16 --offload --fused-loss 64 --step-in-backward"
        );
        // The same checks as %%optimize's.
        for (line, expected) in [
            ("--offload", "Add --checkpoint"),
            ("--step-in-backward --accumulate 4", "must live across"),
            ("--step-in-backward --amp f16", "Use --amp bf16"),
            ("--fused-loss 0", "at least"),
            ("--gpus 0", "at least 1"),
            ("--gpus 2 --zero 3", "--zero 1 or --zero 2"),
            ("--gpus 2 --zero 2 --check", "%%distributed"),
            ("--zero 1", "--gpus"),
            (
                "--gpus 2 --zero 1 --step-in-backward",
                "steps after backward",
            ),
        ] {
            let Err(MagicReply::Error(message)) = parse_estimate(&words(line)) else {
                panic!("{line}: expected an error")
            };
            assert!(message.contains(expected), "{line}: {message}");
        }
    }

    #[test]
    fn data_parallel_flags_give_the_ranks_and_the_stage() {
        let request = parse_estimate(&words("--gpus 4 --zero 2")).unwrap();
        let expected = DataParallel {
            ranks: 4,
            zero: Some(2),
        };
        assert_eq!(request.data_parallel, Some(expected));
        let plain = parse_estimate(&words("--gpus 2 --check")).unwrap();
        assert_eq!(plain.data_parallel.map(|dp| dp.zero), Some(None));
        assert_eq!(parse_estimate(&[]).unwrap().data_parallel, None);
    }

    #[test]
    fn fit_flags_have_defaults_and_explain_mistakes() {
        let args = parse_fit(&[]).unwrap();
        assert_eq!((args.margin, args.max_trials, args.steps), (0.1, 8, 2));
        assert!(!args.keep_effective_batch);
        let args = parse_fit(&words("--margin 5% --keep-effective-batch")).unwrap();
        assert_eq!(args.margin, 0.05);
        assert!(args.keep_effective_batch);
        let Err(MagicReply::Error(bad)) = parse_fit(&words("--margin lots")) else {
            panic!()
        };
        assert!(bad.contains("10%"), "{bad}");
        assert!(matches!(
            parse_fit(&words("--max-trials 1")),
            Err(MagicReply::Error(_))
        ));
        assert!(parse_free(&[]).is_ok());
        assert!(matches!(
            parse_free(&words("--all")),
            Err(MagicReply::Error(_))
        ));
    }
}
