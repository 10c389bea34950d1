//! `%%optimize`'s rewrites: pure functions from a cell's source to the rewritten source.
//!
//! A cell holds an ordinary tch training loop. [`rewrite`] parses it with syn, applies the
//! requested rewrites (activation checkpointing, mixed precision, micro-batching, a leaner
//! optimizer), and prints the result; statements it did not change keep their original text and
//! comments. When the cell does not match a pattern a rewrite needs, it refuses with a
//! [`Refusal`] that says what it looked for and where. [`instrument_for_compare`] prepares a cell
//! (original or rewritten) for `--compare`: it stops after the runtime's number of steps.
//!
//! The modules, one job each: `cell` parses and prints, `tree` indexes a cell's blocks,
//! `syntax` holds small syntax helpers, `step` finds the training step, `span` the forward pass
//! up to the loss; `optimizer`, `checkpoint`, `amp`, `accumulate` and `compare` build each
//! rewrite, and `training` applies mixed precision and micro-batching together (both rewrite
//! the training step).

mod accumulate;
mod amp;
pub mod batch;
mod cell;
mod change;
mod checkpoint;
mod compare;
pub mod earlier;
mod fused_loss;
mod in_backward;
mod optimizer;
mod phases;
mod span;
mod step;
mod syntax;
mod training;
mod tree;

#[cfg(test)]
mod tests;

use std::fmt;

use crate::parse_thread::{self, ParseThreadError};

pub use change::Change;

pub(crate) use cell::parses_safely;

/// Mixed-precision kind for `--amp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Amp {
    /// bfloat16: f32's range, so no loss scaling is needed.
    Bf16,
    /// float16: needs a `GradScaler` so that small gradients do not underflow.
    F16,
}

/// Optimizer for `--optimizer`, from `tchmem::optim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerChoice {
    /// SGD with momentum: one state tensor per parameter (Adam keeps two).
    Sgd,
    /// Lion: one momentum per parameter, sign updates.
    Lion,
    /// AdamW with block-wise 8-bit moments: a quarter of Adam's state.
    AdamW8bit,
    /// Adafactor: factored second moments, state ~ rows + columns per matrix.
    Adafactor,
}

impl OptimizerChoice {
    /// The type's name in `tchmem::optim`.
    pub fn type_name(self) -> &'static str {
        match self {
            OptimizerChoice::Sgd => "Sgd",
            OptimizerChoice::Lion => "Lion",
            OptimizerChoice::AdamW8bit => "AdamW8bit",
            OptimizerChoice::Adafactor => "Adafactor",
        }
    }

    /// The value `--optimizer` takes for it.
    pub fn flag_value(self) -> &'static str {
        match self {
            OptimizerChoice::Sgd => "sgd",
            OptimizerChoice::Lion => "lion",
            OptimizerChoice::AdamW8bit => "adamw8bit",
            OptimizerChoice::Adafactor => "adafactor",
        }
    }
}

/// How `--compress-activations` stores checkpointed segments' inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compress {
    /// 8-bit integers, a scale per row.
    Int8,
    /// 8-bit floats (e4m3), a scale per row.
    Fp8,
}

impl Compress {
    /// The value the flag takes.
    pub fn flag_value(self) -> &'static str {
        match self {
            Compress::Int8 => "int8",
            Compress::Fp8 => "fp8",
        }
    }

    /// The runtime's `tchmem::checkpoint::Compression` variant.
    pub fn runtime_variant(self) -> &'static str {
        match self {
            Compress::Int8 => "Int8",
            Compress::Fp8 => "Fp8",
        }
    }
}

/// Which rewrites to apply; `None` leaves that aspect of the cell alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// Activation checkpointing; the inner value is the number of segments (default: √layers,
    /// chosen by the runtime).
    pub checkpoint: Option<Option<u32>>,
    /// Mixed precision for the forward pass and the loss.
    pub amp: Option<Amp>,
    /// Split each batch into this many micro-batches, accumulating gradients.
    pub accumulate: Option<u32>,
    /// Swap the optimizer.
    pub optimizer: Option<OptimizerChoice>,
    /// Fuse a linear head with its cross-entropy; the inner value is the tokens per chunk.
    pub fused_loss: Option<Option<u32>>,
    /// Keep checkpointed segments' inputs in pinned host memory (with `checkpoint`).
    pub offload: bool,
    /// Keep checkpointed segments' inputs quantized (with `checkpoint`).
    pub compress: Option<Compress>,
    /// Step each parameter inside backward, as soon as its gradient is complete.
    pub step_in_backward: bool,
}

impl Options {
    /// True when no rewrite is requested.
    pub fn is_empty(&self) -> bool {
        *self == Options::default()
    }

    /// The options as `%%optimize` flags, e.g. `--checkpoint --amp bf16`.
    pub fn flags(&self) -> String {
        let mut flags = Vec::new();
        match self.checkpoint {
            Some(Some(segments)) => flags.push(format!("--checkpoint {segments}")),
            Some(None) => flags.push("--checkpoint".to_string()),
            None => {}
        }
        match self.amp {
            Some(Amp::Bf16) => flags.push("--amp bf16".to_string()),
            Some(Amp::F16) => flags.push("--amp f16".to_string()),
            None => {}
        }
        if let Some(k) = self.accumulate {
            flags.push(format!("--accumulate {k}"));
        }
        if let Some(choice) = self.optimizer {
            flags.push(format!("--optimizer {}", choice.flag_value()));
        }
        if self.offload {
            flags.push("--offload".to_string());
        }
        if let Some(compress) = self.compress {
            flags.push(format!("--compress-activations {}", compress.flag_value()));
        }
        match self.fused_loss {
            Some(Some(chunk)) => flags.push(format!("--fused-loss {chunk}")),
            Some(None) => flags.push("--fused-loss".to_string()),
            None => {}
        }
        if self.step_in_backward {
            flags.push("--step-in-backward".to_string());
        }
        flags.join(" ")
    }
}

/// A rewritten cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewritten {
    /// The code to show and run; it starts with a comment header saying what was rewritten.
    pub code: String,
    /// One line per change (or skipped rewrite), for the user.
    pub changes: Vec<Change>,
}

/// Why a cell was not rewritten: what the rewriter looked for, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct Refusal {
    /// What was looked for and not found (or found and not safe to rewrite), and what to do.
    pub message: String,
    /// The 1-based line in the cell source the message is about, when there is one.
    pub line: Option<usize>,
    /// Lines the message names in its text ("the forward pass and loss (lines 5–6)"), so that
    /// they move with `line` when the refusal is told in another frame (below a magic line,
    /// after code brought from earlier cells).
    pub named: Option<(usize, usize)>,
}

/// "line 5" or "lines 5–6".
pub(crate) fn describe_lines((first, last): (usize, usize)) -> String {
    if first == last {
        format!("line {first}")
    } else {
        format!("lines {first}–{last}")
    }
}

impl Refusal {
    pub(crate) fn new(message: impl Into<String>, line: Option<usize>) -> Refusal {
        Refusal {
            message: message.into(),
            line,
            named: None,
        }
    }

    pub(crate) fn at(line: usize, message: impl Into<String>) -> Refusal {
        Refusal::new(message, Some(line))
    }

    /// A refusal at `line` whose message names `named` (written with [`describe_lines`]).
    pub(crate) fn naming(
        line: usize,
        named: (usize, usize),
        message: impl Into<String>,
    ) -> Refusal {
        Refusal {
            named: Some(named),
            ..Refusal::at(line, message)
        }
    }

    /// The same refusal with its lines moved down by `lines` (for a cell body that starts
    /// below a magic line).
    pub fn shifted(self, lines: usize) -> Refusal {
        self.moved(|line| Some(line + lines))
    }

    /// The same refusal with every line it names mapped by `to` (`None`: a line the new frame
    /// does not have: the refusal then names no line, and its text keeps the old numbers).
    pub fn moved(self, to: impl Fn(usize) -> Option<usize>) -> Refusal {
        let named = self.named.and_then(|(a, b)| Some((to(a)?, to(b)?)));
        let message = match (self.named, named) {
            (Some(old), Some(new)) => {
                self.message
                    .replacen(&describe_lines(old), &describe_lines(new), 1)
            }
            _ => self.message,
        };
        Refusal {
            line: self.line.and_then(&to),
            named,
            message,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "line {line}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// Rewrites the training loop in `src` (a cell's code) as `options` ask.
///
/// Every requested rewrite is applied or the whole cell is refused; a rewrite whose `tchmem::`
/// module the cell already uses is skipped (with a line in `changes`), so rewriting twice never
/// wraps twice. Never panics: malformed input is a [`Refusal`].
///
/// `known` is what an [`earlier::Assembled`] read of the earlier cells (the functions the cell
/// calls, the models it uses): the rewriter reads it where a rewrite depends on it.
pub fn rewrite(src: &str, options: &Options, known: &earlier::Known) -> Result<Rewritten, Refusal> {
    let options = options.clone();
    let known = known.clone();
    isolated(src, move |src| rewrite_cell(src, &options, &known))
}

/// Instruments `src` (an original or rewritten cell) for `--compare`: labels the outermost loop
/// around the training step `'tchmem_train` (or reuses its label) and, after the step, calls
/// `tchmem::compare::record_step(&loss)`, breaking out once it returns true (the runtime decides
/// after how many steps).
pub fn instrument_for_compare(src: &str) -> Result<String, Refusal> {
    isolated(src, compare::instrument)
}

/// The rewrite, on the calling thread (tests call it directly so that a panic fails them).
pub(crate) fn rewrite_cell(
    src: &str,
    options: &Options,
    known: &earlier::Known,
) -> Result<Rewritten, Refusal> {
    let cell = cell::parse(src)?;
    let mut block = cell.block.clone();
    let mut names = syntax::Names::of(&block);
    let present = syntax::tchmem_modules(&block);
    let step_line = step::the_step(&tree::Tree::of(&block), "%%optimize")
        .ok()
        .map(|s| s.line);
    let mut changes = Vec::new();
    let skip = |module: &str, flag: &str, changes: &mut Vec<Change>| -> bool {
        let found = present.contains(module);
        if found {
            changes.push(Change::general(format!(
                "{flag}: skipped, the cell already uses tchmem::{module} (rewrite the original \
                 cell instead, to combine rewrites)"
            )));
        }
        found
    };

    // The optimizer first, so that the f16 grad scaler is created next to the optimizer the
    // cell ends up with.
    if let Some(choice) = options.optimizer {
        if !skip("optim", "--optimizer", &mut changes) {
            optimizer::swap(&mut block, choice, &known.unknown_optimizers, &mut changes)?;
        }
    }
    if let Some(segments) = options.checkpoint {
        if !skip("checkpoint", "--checkpoint", &mut changes) {
            let keep = checkpoint::Keep {
                offload: options.offload,
                compress: options.compress,
            };
            checkpoint::apply(&mut block, segments, keep, &known.models, &mut changes)?;
        }
    }
    let amp = options.amp.filter(|_| !skip("amp", "--amp", &mut changes));
    if let (Some(amp), None) = (amp, options.optimizer) {
        let flag = Options {
            amp: Some(amp),
            ..Options::default()
        }
        .flags();
        optimizer::fuse_adam(&mut block, &flag, &mut changes);
    }
    let stepping_in_backward = syntax::stmts_mention(&block.stmts, "in_backward");
    if options.step_in_backward && !stepping_in_backward {
        in_backward::apply(&mut block, &known.unknown_optimizers, &mut changes)?;
    } else if options.step_in_backward {
        changes.push(Change::general(
            "--step-in-backward: skipped, the cell's optimizer already steps in backward \
             (rewrite the original cell instead, to combine rewrites)",
        ));
    }
    if let Some(chunk) = options.fused_loss {
        if !skip("fused_loss", "--fused-loss", &mut changes) {
            fused_loss::apply(&mut block, chunk, &mut names, known, &mut changes)?;
        }
    }
    let accumulate = options
        .accumulate
        .filter(|_| !skip("accumulate", "--accumulate", &mut changes));
    if amp.is_some() || accumulate.is_some() {
        let plan = training::Plan {
            amp,
            accumulate,
            functions: &known.functions,
        };
        training::apply(&mut block, &plan, &mut names, &mut changes)?;
    }
    if !present.contains("phase") {
        phases::mark(&mut block, step_line, &mut names, &mut changes)?;
    }

    let header = format!("%%optimize {}: rewritten by tchmem", options.flags());
    let code = cell::print(&cell, &block, &header);
    change::in_line_order(&mut changes);
    Ok(Rewritten { code, changes })
}

/// The stack the rewriter runs on: syn and the visitors recurse once per nesting level.
const STACK_BYTES: usize = 256 << 20;

/// Runs `job` on a parsing thread with a large stack (see [`crate::parse_thread`]): deeply
/// nested input cannot overflow the caller's stack, and a bug becomes a refusal.
fn isolated<T: Send + 'static>(
    src: &str,
    job: impl FnOnce(&str) -> Result<T, Refusal> + Send + 'static,
) -> Result<T, Refusal> {
    let src = src.to_owned();
    match parse_thread::run("tchmem-rewrite", STACK_BYTES, move || job(&src)) {
        Ok(result) => result,
        Err(ParseThreadError::Panicked) => Err(Refusal::new(
            "the rewriter failed on this cell (an internal error, please report it with the \
             cell); nothing was run",
            None,
        )),
        Err(error) => Err(Refusal::new(error.to_string(), None)),
    }
}

/// Whether a cross-entropy of `src` takes a model's forward pass (`model.forward_t(&x, true)`)
/// rather than a head the cell applies: `--fused-loss` then marks the head where the model is
/// built, so a model of earlier cells is brought in. A cell that does not parse takes none.
pub fn loss_takes_model_output(src: &str) -> bool {
    !models_under_loss(src).is_empty()
}

/// The models whose forward pass a cross-entropy of `src` takes (see
/// [`loss_takes_model_output`]).
pub fn models_under_loss(src: &str) -> Vec<String> {
    let src = src.to_owned();
    parse_thread::run("tchmem-facts", STACK_BYTES, move || {
        cell::parse(&src)
            .map(|cell| fused_loss::models_under_loss(&cell.block))
            .unwrap_or_default()
    })
    .unwrap_or_default()
}

/// What the "will it fit?" magics read from a training cell.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrainingFacts {
    /// Whether it has a training step `%%optimize` recognises.
    pub trains: bool,
    /// The optimizer it builds (the first, if several): tch's or tchmem's name, and its rule.
    pub optimizer: Option<(String, OptimizerRule)>,
}

use tchmem_wire::estimate::OptimizerRule;

/// Reads `src`'s training step and optimizer; a cell that does not parse has neither.
pub fn training_facts(src: &str) -> TrainingFacts {
    let src = src.to_owned();
    let facts = parse_thread::run("tchmem-facts", STACK_BYTES, move || {
        let Ok(cell) = cell::parse(&src) else {
            return TrainingFacts::default();
        };
        let tree = tree::Tree::of(&cell.block);
        let optimizer = optimizer::builds(&tree)
            .into_iter()
            .find_map(|build| rule_of(&build.config));
        TrainingFacts {
            trains: step::the_step(&tree, "%memfit").is_ok(),
            optimizer,
        }
    });
    facts.unwrap_or_default()
}

/// The rule of an optimizer configuration, and its name.
fn rule_of(config: &optimizer::Config) -> Option<(String, OptimizerRule)> {
    let (name, rule) = match config {
        // tch's SGD and RMSprop keep momentum only when configured (the defaults have none).
        optimizer::Config::Nn { name, customised } => match name.as_str() {
            "Adam" | "adam" => ("Adam", OptimizerRule::Adam),
            "AdamW" | "adamw" => ("AdamW", OptimizerRule::AdamW),
            "Sgd" | "sgd" => (
                "Sgd",
                OptimizerRule::Sgd {
                    momentum: *customised,
                },
            ),
            "RmsProp" | "rms_prop" => (
                "RmsProp",
                OptimizerRule::RmsProp {
                    momentum: *customised,
                    centered: false,
                },
            ),
            _ => return None,
        },
        optimizer::Config::Tchmem(name) => match name.as_str() {
            "Adam" => ("Adam", OptimizerRule::Adam),
            "AdamW" => ("AdamW", OptimizerRule::AdamW),
            "Sgd" => ("Sgd", OptimizerRule::Sgd { momentum: true }),
            "Lion" => ("Lion", OptimizerRule::Lion),
            "AdamW8bit" => ("AdamW8bit", OptimizerRule::AdamW8bit),
            "Adafactor" => ("Adafactor", OptimizerRule::Adafactor),
            _ => return None,
        },
    };
    Some((name.to_string(), rule))
}

impl OptimizerChoice {
    /// The state rule of the optimizer this choice builds (with tchmem's defaults).
    pub fn rule(self) -> OptimizerRule {
        match self {
            OptimizerChoice::Sgd => OptimizerRule::Sgd { momentum: true },
            OptimizerChoice::Lion => OptimizerRule::Lion,
            OptimizerChoice::AdamW8bit => OptimizerRule::AdamW8bit,
            OptimizerChoice::Adafactor => OptimizerRule::Adafactor,
        }
    }
}
