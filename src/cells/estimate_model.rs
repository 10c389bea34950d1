//! `%memestimate` before any training loop: "will this model train here?" answered from the
//! model and optimizer earlier cells built, with the exact terms (parameters, gradients,
//! optimizer state by its rule, the CUDA context), and what the rest needs.

use tchmem_wire::estimate::{ModelShapes, OptimizerRule, MODEL_SHAPES_MIME};

use super::{fail, Cells, Runner};
use crate::fit::estimate::Fixed;
use crate::magics::fit::{DataParallel, EstimateRequest};
use crate::report::fit::{model_terms_display, ModelTerms, StateCounted};
use crate::rewrite::earlier::{self, LiveModel};
use crate::session::{CellError, CellIo, CellOutcome, CellOutput, ErrorName};

/// What the terms are of, in words.
fn model_words(model: &LiveModel, rule: Option<&str>) -> String {
    let stores: Vec<String> = model
        .stores
        .iter()
        .map(|(name, run)| format!("`{name}` (cell [{run}])"))
        .collect();
    let mut what = format!("the model in {}", stores.join(" and "));
    match (&model.optimizer, rule) {
        (Some(optimizer), Some(rule)) => what.push_str(&format!(
            ", optimizer `{}` ({rule}, cell [{}])",
            optimizer.name, optimizer.run
        )),
        (None, Some(rule)) => what.push_str(&format!(", with {rule}")),
        (Some(optimizer), None) => what.push_str(&format!(
            ", optimizer `{}` ({}cell [{}])",
            optimizer.name,
            optimizer
                .written
                .as_ref()
                .map_or(String::new(), |type_name| format!("`{type_name}`, ")),
            optimizer.run
        )),
        (None, None) => {}
    }
    what
}

impl<R: Runner> Cells<R> {
    /// The model earlier cells built (a VarStore, or its optimizer) after the last training
    /// cell ran, or when no training cell ran: `%memestimate` alone is then about it.
    pub(super) fn model_newer_than_training(&self) -> Option<LiveModel> {
        let model = earlier::live_model(&self.history)?;
        let made = model
            .stores
            .iter()
            .map(|(_, run)| *run)
            .chain(model.optimizer.as_ref().map(|o| o.run))
            .max()
            .unwrap_or(0);
        self.last_training_cell
            .as_ref()
            .is_none_or(|(trained, _)| made > *trained)
            .then_some(model)
    }

    /// `%memestimate` alone in a cell before `model`'s training loop ran: the model's terms.
    pub(super) fn estimate_model(
        &mut self,
        model: &LiveModel,
        request: &EstimateRequest,
        io: &CellIo,
    ) -> CellOutcome {
        let built = model.optimizer.as_ref().and_then(|o| o.rule.as_ref());
        let rule = match request.optimizer.map(|choice| choice.rule()) {
            Some(rule) => Some(rule),
            None => built.map(|(_, rule)| *rule),
        };
        let rule_name = rule.map(|rule| rule.label().to_string());
        let unread = model
            .optimizer
            .as_ref()
            .map(|optimizer| match &optimizer.written {
                Some(type_name) => format!(
                    "`{}` (a `{type_name}`, built in cell [{}])",
                    optimizer.name, optimizer.run
                ),
                None => format!(
                    "`{}` (cell [{}]), an optimizer whose state rule the kernel does not know",
                    optimizer.name, optimizer.run
                ),
            });
        // No state counted without a rule: none yet, or one that cannot be read.
        let (rule, state) = match (rule, &rule_name, &unread) {
            (Some(rule), Some(name), _) => (rule, StateCounted::Rule(name)),
            (_, _, Some(unread)) => (
                OptimizerRule::Sgd { momentum: false },
                StateCounted::Unread(unread),
            ),
            _ => (
                OptimizerRule::Sgd { momentum: false },
                StateCounted::NoOptimizer,
            ),
        };
        let stores: Vec<String> = model
            .stores
            .iter()
            .map(|(name, _)| format!("&{name}"))
            .collect();
        let code = format!("tchmem::estimate::model(&[{}])", stores.join(", "));
        let outcome = self.run(&code, CellIo::quiet());
        let shapes = outcome
            .data
            .get(MODEL_SHAPES_MIME)
            .and_then(|json| serde_json::from_str::<ModelShapes>(json).ok());
        let Some(shapes) = shapes else {
            let why = outcome
                .error
                .map_or_else(|| "no answer".to_string(), |error| error.evalue);
            return fail(CellError::new(
                ErrorName::EstimateFailed,
                format!(
                    "%memestimate could not read the model's variables ({}): {why}",
                    stores.join(", ")
                ),
            ));
        };
        let room = if shapes.cuda {
            self.device_room()
        } else {
            None
        };
        let mut what = model_words(model, rule_name.as_deref());
        let mut fixed = Fixed::of(&shapes.trainable, &rule);
        if let Some(DataParallel {
            ranks,
            zero: Some(stage),
        }) = request.data_parallel
        {
            fixed = fixed.zero_share(&shapes.trainable, &rule, ranks as usize);
            what.push_str(&format!(
                ", on the most loaded of {ranks} ranks under ZeRO stage {stage}"
            ));
        }
        let terms = ModelTerms {
            what: &what,
            fixed,
            frozen: shapes.frozen_bytes,
            state,
            device: room.map(|room| (room.context.unwrap_or(0), room.total)),
        };
        (io.output)(CellOutput::Display(model_terms_display(&terms)));
        let ignored: Vec<&str> = [
            (request.batch.is_some(), "--batch"),
            (request.accumulate.is_some(), "--accumulate"),
            (request.check, "--check"),
            (!request.calibrated.is_empty(), "--checkpoint/--amp"),
        ]
        .into_iter()
        .filter_map(|(given, flag)| given.then_some(flag))
        .collect();
        if !ignored.is_empty() {
            return fail(CellError::new(
                ErrorName::NoTrainingCell,
                format!(
                    "{} need a training cell (they act on its loop): the model's terms are \
                     above; run the training cell, then %memestimate with them",
                    ignored.join(", ")
                ),
            ));
        }
        CellOutcome::default()
    }
}
