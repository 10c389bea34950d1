//! `%memestimate` before any training loop: "will this model train here?" answered from the
//! model and optimizer earlier cells built, with the exact terms (parameters, gradients,
//! optimizer state by its rule, the CUDA context), and what the rest needs.

use tchmem_wire::estimate::{tensor_bytes, ModelShapes, OptimizerRule, MODEL_SHAPES_MIME};

use super::{fail, Cells, Runner};
use crate::fit::estimate::Fixed;
use crate::magics::fit::{DataParallel, EstimateRequest};
use crate::report::fit::{model_terms_display, ModelTerms, StateCounted};
use crate::rewrite::earlier::{self, LiveModel, LiveOptimizer};
use crate::session::{CellError, CellIo, CellOutcome, CellOutput, ErrorName};

/// What the terms are of, in words: the stores, then each optimizer with its rule (`choice`,
/// the one `--optimizer` counts, for all) or its type.
fn model_words(model: &LiveModel, choice: Option<&str>) -> String {
    let stores: Vec<String> = model
        .stores
        .iter()
        .map(|(name, run)| format!("`{name}` (cell [{run}])"))
        .collect();
    let mut what = format!("the model in {}", stores.join(" and "));
    let optimizers: Vec<String> = model
        .optimizers
        .iter()
        .map(|optimizer| {
            let kind = match (choice, &optimizer.rule, &optimizer.unknown) {
                (Some(choice), _, _) => format!("{choice}, "),
                (None, Some((_, rule)), _) => format!("{}, ", rule.label()),
                (None, None, Some(unknown)) => format!("`{}`, ", unknown.kind.name),
                (None, None, None) => String::new(),
            };
            format!("`{}` ({kind}cell [{}])", optimizer.name, optimizer.run)
        })
        .collect();
    match (optimizers.len(), choice) {
        (0, Some(choice)) => what.push_str(&format!(", with {choice}")),
        (0, None) => {}
        (1, _) => what.push_str(&format!(", optimizer {}", optimizers[0])),
        _ => what.push_str(&format!(", optimizers {}", optimizers.join(" and "))),
    }
    what
}

/// How the state line names an optimizer whose state no rule counts.
fn unread(optimizer: &LiveOptimizer) -> String {
    match &optimizer.unknown {
        Some(unknown) => unknown.described(),
        None => format!(
            "`{}` (cell [{}]), an optimizer whose state rule the kernel does not know",
            optimizer.name, optimizer.run
        ),
    }
}

/// How `%memestimate` before a loop counts each store's optimizer state.
struct StateRules<'a> {
    model: &'a LiveModel,
    /// The rule `--optimizer NAME` counts for every store.
    choice: Option<OptimizerRule>,
}

impl StateRules<'_> {
    /// A store's rule: `--optimizer`'s, its optimizer's, none (no state) without an optimizer,
    /// or `None` for an optimizer no rule counts.
    fn rule_of(&self, store: &str) -> Option<OptimizerRule> {
        match self.model.optimizers.iter().find(|o| o.store == store) {
            Some(optimizer) => self
                .choice
                .or(optimizer.rule.as_ref().map(|(_, rule)| *rule)),
            None => Some(
                self.choice
                    .unwrap_or(OptimizerRule::Sgd { momentum: false }),
            ),
        }
    }

    /// The optimizers no rule counts, named for the state line: any of them leaves the whole
    /// state uncounted.
    fn unread(&self) -> Vec<String> {
        self.model
            .optimizers
            .iter()
            .filter(|o| self.rule_of(&o.store).is_none())
            .map(unread)
            .collect()
    }

    /// The rules counted, in words ("Adam", "Adam and SGD").
    fn words(&self) -> String {
        if let Some(choice) = self.choice {
            return choice.label().to_string();
        }
        let mut labels: Vec<&str> = Vec::new();
        for optimizer in &self.model.optimizers {
            if let Some(rule) = self.rule_of(&optimizer.store) {
                if !labels.contains(&rule.label()) {
                    labels.push(rule.label());
                }
            }
        }
        labels.join(" and ")
    }

    /// The fixed terms, store by store, each with its optimizer's rule (under ZeRO, each
    /// store's share of its most loaded rank: with several stores this may count more than one
    /// rank holds).
    fn fixed(&self, shapes: &ModelShapes, zero_ranks: Option<usize>) -> Fixed {
        let counted = self.unread().is_empty();
        let by_store = shapes.trainable_by_store();
        let stores = &self.model.stores;
        let mut fixed = Fixed::default();
        for (index, trainable) in by_store.iter().enumerate() {
            let store = if by_store.len() == stores.len() {
                &stores[index].0
            } else {
                &stores[0].0
            };
            let rule = self
                .rule_of(store)
                .filter(|_| counted)
                .unwrap_or(OptimizerRule::Sgd { momentum: false });
            let mut own = Fixed::of(trainable, &rule);
            if let Some(ranks) = zero_ranks {
                own = own.zero_share(trainable, &rule, ranks);
            }
            fixed.parameters += own.parameters;
            fixed.gradients += own.gradients;
            fixed.optimizer_state += own.optimizer_state;
        }
        fixed
    }
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
            .chain(model.optimizers.iter().map(|o| o.run))
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
        let rules = StateRules {
            model,
            choice: request.optimizer.map(|choice| choice.rule()),
        };
        let (rule_words, unread_words) = (rules.words(), rules.unread().join(" and "));
        let state = if !unread_words.is_empty() {
            StateCounted::Unread(&unread_words)
        } else if model.optimizers.is_empty() && rules.choice.is_none() {
            StateCounted::NoOptimizer
        } else {
            StateCounted::Rule(&rule_words)
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
        let mut what = model_words(model, rules.choice.map(|rule| rule.label()));
        let zero_ranks = match request.data_parallel {
            Some(DataParallel {
                ranks,
                zero: Some(stage),
            }) => {
                what.push_str(&format!(
                    ", on the most loaded of {ranks} ranks under ZeRO stage {stage}"
                ));
                Some(ranks as usize)
            }
            _ => None,
        };
        let fixed = rules.fixed(&shapes, zero_ranks);
        // The stores' variables and the gradients they hold now are the model's; the rest of
        // what is allocated is the notebook's too, and stays through training.
        let parameters = tensor_bytes(&shapes.trainable);
        let held = room.as_ref().map_or(0, |room| {
            room.allocated
                .saturating_sub(parameters + shapes.frozen_bytes + shapes.gradient_bytes)
        });
        let terms = ModelTerms {
            what: &what,
            fixed,
            frozen: shapes.frozen_bytes,
            state,
            device: room.map(|room| (room.context.unwrap_or(0), room.total)),
            held,
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
