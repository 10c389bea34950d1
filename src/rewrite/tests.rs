//! Tests of the rewrites: golden outputs for the reference loops in `tests/loops/`, refusals,
//! idempotence, and a deterministic fuzz of the parser, the rewriter and the magic's flags.
//!
//! `UPDATE_GOLDEN=1 cargo test … rewrite` rewrites `tests/loops/rewritten/` from the current
//! output; review the diff before committing it.

use std::path::{Path, PathBuf};

use super::earlier::{Known, ModelKind, ModelOrigin};
use super::*;
use crate::magics::optimize::parse_args;

fn loops_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/loops")
}

fn reference(name: &str) -> String {
    let path = loops_dir().join(format!("{name}.rs"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

const LOOPS: [&str; 7] = [
    "mlp",
    "dropout",
    "struct_model",
    "epochs",
    "while_loop",
    "lm_head",
    "func_model",
];

/// What the rewriter knows of earlier cells: these functions.
fn known(functions: &[super::earlier::EarlierFn]) -> Known {
    Known {
        functions: functions.to_vec(),
        ..Known::default()
    }
}

fn options(flags: &str) -> Options {
    let args: Vec<&str> = flags.split_whitespace().collect();
    parse_args(&args)
        .unwrap_or_else(|e| panic!("{flags}: {e:?}"))
        .options
}

fn rewrite_ok(src: &str, flags: &str) -> Rewritten {
    rewrite_cell(src, &options(flags), &Known::default())
        .unwrap_or_else(|refusal| panic!("{flags}: {refusal}"))
}

fn refusal(src: &str, flags: &str) -> Refusal {
    match rewrite_cell(src, &options(flags), &Known::default()) {
        Ok(rewritten) => panic!("{flags}: expected a refusal, got\n{}", rewritten.code),
        Err(refusal) => refusal,
    }
}

/// Generated code must be Rust: it parses as a cell.
fn assert_parses(code: &str, what: &str) {
    if let Err(refusal) = cell::parse(code) {
        panic!("{what}: the output does not parse: {refusal}\n{code}");
    }
}

/// The rewrites checked against `tests/loops/rewritten/<loop>--<flags>.rs`.
const GOLDEN: [(&str, &str); 33] = [
    ("lm_head", "--fused-loss"),
    (
        "func_model",
        "--checkpoint --offload --amp bf16 --fused-loss 128 --optimizer adafactor --step-in-backward",
    ),
    ("func_model", "--checkpoint --fused-loss --amp bf16"),
    ("struct_model", "--fused-loss 32"),
    ("mlp", "--fused-loss"),
    (
        "lm_head",
        "--checkpoint --offload --fused-loss 64 --step-in-backward",
    ),
    (
        "lm_head",
        "--checkpoint --compress-activations int8 --amp bf16 --fused-loss",
    ),
    ("mlp", "--step-in-backward"),
    ("while_loop", "--optimizer adafactor --step-in-backward"),
    ("mlp", "--checkpoint"),
    ("mlp", "--checkpoint 2"),
    ("mlp", "--amp bf16"),
    ("mlp", "--amp f16"),
    ("mlp", "--accumulate 4"),
    ("mlp", "--optimizer lion"),
    ("mlp", "--amp f16 --accumulate 2"),
    (
        "mlp",
        "--checkpoint --amp bf16 --accumulate 4 --optimizer adafactor",
    ),
    ("dropout", "--checkpoint 2"),
    ("dropout", "--amp f16"),
    ("dropout", "--accumulate 4"),
    (
        "dropout",
        "--checkpoint --amp f16 --accumulate 2 --optimizer adamw8bit",
    ),
    ("struct_model", "--amp bf16"),
    ("struct_model", "--optimizer sgd"),
    ("struct_model", "--accumulate 2"),
    ("struct_model", "--amp bf16 --accumulate 4 --optimizer lion"),
    ("epochs", "--checkpoint"),
    ("epochs", "--amp bf16"),
    ("epochs", "--accumulate 4"),
    (
        "epochs",
        "--checkpoint 3 --amp bf16 --accumulate 2 --optimizer adafactor",
    ),
    ("while_loop", "--amp f16"),
    ("while_loop", "--accumulate 2"),
    ("while_loop", "--optimizer adamw8bit"),
    (
        "while_loop",
        "--checkpoint --amp f16 --accumulate 4 --optimizer sgd",
    ),
];

/// `--checkpoint 3 --amp bf16` → `checkpoint-3-amp-bf16`.
fn slug(flags: &str) -> String {
    flags
        .split_whitespace()
        .map(|word| word.trim_start_matches('-'))
        .collect::<Vec<_>>()
        .join("-")
}

/// Compares `actual` with the golden file `name`, or writes it with UPDATE_GOLDEN=1.
fn check_golden(name: &str, actual: &str, mismatches: &mut Vec<String>) {
    let path = loops_dir().join("rewritten").join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    if expected != actual {
        let line = expected
            .lines()
            .zip(actual.lines())
            .position(|(e, a)| e != a)
            .unwrap_or(expected.lines().count().min(actual.lines().count()));
        mismatches.push(format!(
            "{name} differs from line {}: expected {:?}, got {:?}",
            line + 1,
            expected.lines().nth(line),
            actual.lines().nth(line)
        ));
    }
}

/// The golden file's text: the changes as comments, then the code.
fn golden_text(rewritten: &Rewritten) -> String {
    let mut text = String::new();
    for change in &rewritten.changes {
        text.push_str(&format!("// change: {change}\n"));
    }
    text.push_str(&rewritten.code);
    text
}

#[test]
fn rewrite_golden_outputs_match() {
    let mut mismatches = Vec::new();
    for (name, flags) in GOLDEN {
        let rewritten = rewrite_ok(&reference(name), flags);
        assert_parses(&rewritten.code, &format!("{name} {flags}"));
        check_golden(
            &format!("{name}--{}.rs", slug(flags)),
            &golden_text(&rewritten),
            &mut mismatches,
        );
    }
    for name in LOOPS {
        let instrumented = instrument_for_compare(&reference(name))
            .unwrap_or_else(|refusal| panic!("{name} --compare: {refusal}"));
        assert_parses(&instrumented, name);
        check_golden(
            &format!("{name}--compare.rs"),
            &instrumented,
            &mut mismatches,
        );
    }
    // A rewritten cell is instrumented too (--compare runs both).
    for (name, flags) in [
        (
            "mlp",
            "--checkpoint --amp bf16 --accumulate 4 --optimizer adafactor",
        ),
        ("dropout", "--amp f16"),
        ("while_loop", "--amp f16 --accumulate 2"),
    ] {
        let rewritten = rewrite_ok(&reference(name), flags);
        let instrumented = instrument_for_compare(&rewritten.code)
            .unwrap_or_else(|refusal| panic!("{name} {flags} --compare: {refusal}"));
        assert_parses(&instrumented, name);
        check_golden(
            &format!("{name}--{}--compare.rs", slug(flags)),
            &instrumented,
            &mut mismatches,
        );
    }
    assert!(
        mismatches.is_empty(),
        "golden outputs differ (UPDATE_GOLDEN=1 rewrites them):\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn rewrite_is_deterministic_and_never_wraps_twice() {
    for (name, flags) in GOLDEN {
        let src = reference(name);
        let first = rewrite_ok(&src, flags);
        assert_eq!(first, rewrite_ok(&src, flags), "{name} {flags}");
        // Rewriting the output again skips every rewrite that is already there.
        match rewrite_cell(&first.code, &options(flags), &Known::default()) {
            Ok(again) => {
                assert!(
                    again.changes.iter().all(|c| c.what.contains("skipped")),
                    "{name} {flags}: rewritten twice: {:?}",
                    again.changes
                );
                for call in ["autocast(", "accumulate :: split", "GradScaler :: new"] {
                    let count = |code: &str| {
                        let block = cell::parse(code).unwrap().block;
                        quote::ToTokens::to_token_stream(&block)
                            .to_string()
                            .matches(call)
                            .count()
                    };
                    assert_eq!(count(&first.code), count(&again.code), "{name} {flags}");
                }
            }
            Err(refusal) => assert!(
                refusal.message.contains("already"),
                "{name} {flags}: {refusal}"
            ),
        }
    }
}

#[test]
fn rewrite_keeps_comments_outside_changed_statements() {
    let rewritten = rewrite_ok(&reference("mlp"), "--amp bf16");
    assert!(rewritten
        .code
        .contains("// A three-layer perceptron on random data."));
    // The loop's own comment was inside the changed statement.
    assert!(
        rewritten.code.contains("were dropped"),
        "{}",
        rewritten.code
    );
    assert!(rewritten
        .code
        .starts_with("// %%optimize --amp bf16: rewritten by tchmem\n"));
    // An optimizer swap changes only the optimizer's line and spells out the step to mark its
    // phases: the step line's comment is dropped, and said so; the others stay.
    let swapped = rewrite_ok(&reference("mlp"), "--optimizer sgd");
    assert!(swapped
        .code
        .contains("// A three-layer perceptron on random data."));
    assert!(swapped.code.contains("were dropped"), "{}", swapped.code);
    assert!(
        swapped
            .code
            .contains("tchmem::phase::step();\n        opt.step();"),
        "{}",
        swapped.code
    );
}

#[test]
fn rewrite_checkpoint_refuses_models_it_cannot_see() {
    let refused = refusal(&reference("struct_model"), "--checkpoint");
    assert!(
        refused.message.contains(
            "--checkpoint cannot checkpoint `Net` (a struct implementing Module in \
                       this cell)"
        ),
        "{refused}"
    );
    assert!(
        refused
            .message
            .contains("tchmem::checkpoint::seq_t() in `Net`'s constructor"),
        "{refused}"
    );
    assert_eq!(refused.line, Some(48), "{refused}");
    // A model from another cell.
    let src = "for (xs, ys) in batches.iter() {\n    let loss = model.forward(xs).mse_loss(ys, \
               tch::Reduction::Mean);\n    opt.backward_step(&loss);\n}\n";
    let refused = refusal(src, "--checkpoint");
    assert_eq!(refused.line, Some(2));
    assert!(
        refused
            .to_string()
            .starts_with("line 2: --checkpoint looks for"),
        "{refused}"
    );
    // An earlier cell's model whose kind is known: the refusal says what it is and what would
    // let it be checkpointed.
    let said = |kind: ModelKind| {
        let known = Known {
            models: vec![ModelOrigin {
                name: "model".into(),
                run: 3,
                kind,
            }],
            ..Known::default()
        };
        rewrite_cell(src, &options("--checkpoint"), &known)
            .unwrap_err()
            .message
    };
    let message = said(ModelKind::Struct {
        name: "Net".into(),
        run: 2,
    });
    assert!(
        message.contains("`model` (cell [3]): it is a `Net`, a struct (its forward in cell [2])")
            && message.contains("built with tchmem::checkpoint::seq_t() in `Net`'s constructor"),
        "{message}"
    );
    let message = said(ModelKind::Recurrent {
        function: "lstm".into(),
    });
    assert!(
        message.contains("`model` (cell [3]): an nn::lstm runs the whole sequence in one call"),
        "{message}"
    );
    let message = said(ModelKind::Library {
        function: "resnet18".into(),
    });
    assert!(
        message.contains("it is built by `resnet18`, a function the notebook did not define"),
        "{message}"
    );
}

#[test]
fn rewrite_refusals_name_the_missing_pattern_and_line() {
    // No training step.
    let refused = refusal("let x = 1;\nprintln!(\"{x}\");\n", "--amp bf16");
    assert!(
        refused.message.contains("opt.backward_step(&loss)"),
        "{refused}"
    );
    // No optimizer built in the cell.
    let src = "for (xs, ys) in batches.iter() {\n    let loss = model.forward(xs).mse_loss(ys, \
               tch::Reduction::Mean);\n    opt.backward_step(&loss);\n}\n";
    let refused = refusal(src, "--optimizer lion");
    assert!(
        refused
            .message
            .contains("nn::Adam::default().build(&vs, lr)"),
        "{refused}"
    );
    assert_eq!(refused.line, Some(3));
    // f16 needs the optimizer to create the scaler next to it.
    let refused = refusal(src, "--amp f16");
    assert!(refused.message.contains("GradScaler"), "{refused}");
    assert_eq!(refused.line, Some(3));
    // bf16 needs nothing else.
    let rewritten = rewrite_ok(src, "--amp bf16");
    assert!(
        rewritten.code.contains("tchmem::amp::autocast("),
        "{}",
        rewritten.code
    );
    assert!(
        rewritten.code.contains("tch::Kind::BFloat16"),
        "{}",
        rewritten.code
    );
    // Two training loops.
    let twice = format!("{src}{src}");
    let refused = refusal(&twice, "--accumulate 2");
    assert!(
        refused.message.contains(
            "2 training steps (the first at line 3, the second here); it rewrites cells with \
             one training loop. Put each loop in its own cell."
        ),
        "{refused}"
    );
    assert_eq!(refused.line, Some(7));
    // Below a magic line, the line the message names moves with the refusal's.
    let shifted = refused.shifted(1);
    assert!(
        shifted.message.contains("the first at line 4,"),
        "{shifted}"
    );
    // Two optimizers stepped in turn in one loop (a GAN).
    let gan = "for _ in 0..3 {\n    opt_d.backward_step(&d_loss);\n    \
               opt_g.backward_step(&g_loss);\n}\n";
    let refused = refusal(gan, "--amp bf16");
    assert!(
        refused
            .message
            .contains("(the first at line 2, the second here): a loop that steps several"),
        "{refused}"
    );
    assert_eq!(refused.line, Some(3));
    // One optimizer stepped twice in one loop is not a GAN.
    let same = "for _ in 0..3 {\n    opt.backward_step(&a);\n    opt.backward_step(&b);\n}\n";
    let refused = refusal(same, "--amp bf16");
    assert!(
        refused
            .message
            .ends_with(": it rewrites a loop with one training step."),
        "{refused}"
    );
    // The loss bound outside the step's block.
    let src = "let loss = model.forward(&xs).mean(None);\nfor _ in 0..3 {\n    \
               opt.backward_step(&loss);\n}\n";
    let refused = refusal(src, "--amp bf16");
    assert!(refused.message.contains("`let loss = …;`"), "{refused}");
    assert_eq!(refused.line, Some(3));
    // `?` would move into the autocast closure.
    let src = "for (xs, ys) in batches.iter() {\n    let out = model.forward(xs);\n    let loss \
               = out.f_mse_loss(ys, tch::Reduction::Mean)?;\n    opt.backward_step(&loss);\n}\n";
    let refused = refusal(src, "--amp bf16");
    assert!(refused.message.contains("`?`"), "{refused}");
    assert_eq!(refused.line, Some(3));
    // ... which a micro-batch loop does not mind.
    rewrite_ok(src, "--accumulate 2");
    // A value of the forward pass used after the loss.
    let src = "for (xs, ys) in batches.iter() {\n    let logits = model.forward(xs);\n    let \
               loss = logits.cross_entropy_for_logits(ys);\n    opt.backward_step(&loss);\n    \
               let acc = logits.accuracy_for_logits(ys);\n}\n";
    let refused = refusal(src, "--accumulate 2");
    assert!(refused.message.contains("`logits`"), "{refused}");
    assert_eq!(refused.line, Some(5));
    // ... which mixed precision keeps available.
    let rewritten = rewrite_ok(src, "--amp bf16");
    assert!(
        rewritten
            .code
            .contains("let (logits, loss) = tchmem::amp::autocast"),
        "{}",
        rewritten.code
    );
    // Updates of outer variables would run once per micro-batch.
    let src = "for (xs, ys) in batches.iter() {\n    let out = model.forward(xs);\n    seen += \
               1;\n    let loss = out.mse_loss(ys, tch::Reduction::Mean);\n    \
               opt.backward_step(&loss);\n}\n";
    let refused = refusal(src, "--accumulate 2");
    assert!(refused.message.contains("`seen`"), "{refused}");
    assert_eq!(refused.line, Some(3));
    // A sum loss would be weighted wrongly.
    let src = "for (xs, ys) in batches.iter() {\n    let loss = model.forward(xs).mse_loss(ys, \
               tch::Reduction::Sum);\n    opt.backward_step(&loss);\n}\n";
    let refused = refusal(src, "--accumulate 2");
    assert!(refused.message.contains("Reduction::Sum"), "{refused}");
    // No batch tensors: the forward pass uses the whole data set.
    let src = "for epoch in 0..10 {\n    let loss = model.forward(&train_x).mse_loss(&train_y, \
               tch::Reduction::Mean);\n    opt.backward_step(&loss);\n}\n";
    let refused = refusal(src, "--accumulate 2");
    assert!(refused.message.contains("batch tensors"), "{refused}");
    assert_eq!(refused.line, Some(2));
    // A batch struct whose fields the forward call does not take as they are.
    let src =
        "for batch in loader {\n    let loss = model.forward(&prepare(batch.images)).mse_loss(\
               &labels_of(&batch), tch::Reduction::Mean);\n    opt.backward_step(&loss);\n}\n";
    let refused = refusal(src, "--accumulate 2");
    assert!(
        refused.message.contains("batch is used through a field"),
        "{refused}"
    );
    // Split steps without zero_grad.
    let src =
        "for (xs, ys) in batches.iter() {\n    let loss = model.forward(xs).mean(None);\n    \
               loss.backward();\n    opt.step();\n}\n";
    let refused = refusal(src, "--accumulate 2");
    assert!(refused.message.contains("`opt.zero_grad()`"), "{refused}");
    assert_eq!(refused.line, Some(4));
    // f16 and clipping.
    let refused = refusal(&reference("epochs"), "--amp f16");
    assert!(refused.message.contains("backward_step_clip"), "{refused}");
    assert_eq!(refused.line, Some(35));
    // An optimizer method tchmem's optimizers lack.
    let src = format!("{}\nopt.set_momentum(0.5);\n", reference("mlp"));
    let refused = refusal(&src, "--optimizer lion");
    assert!(refused.message.contains("opt.set_momentum"), "{refused}");
    assert_eq!(refused.line, Some(29));
    // Parameter groups (min-gpt's no-decay group) are kept: tchmem's optimizers have them.
    let src = format!(
        "{}\nopt.set_weight_decay_group(0, 0.0);\nopt.set_lr_group(1, 1e-4);\n",
        reference("mlp")
    );
    let swapped = rewrite_cell(&src, &options("--optimizer lion"), &Known::default()).unwrap();
    assert!(
        swapped.code.contains("opt.set_weight_decay_group(0, 0.0);"),
        "{}",
        swapped.code
    );
    // Not Rust; the line moves with the body's place in the cell.
    let refused = refusal("let x = ;\n", "--amp bf16");
    assert_eq!(refused.line, Some(1));
    assert_eq!(
        refused.clone().shifted(1).to_string().get(..7),
        Some("line 2:")
    );
    assert!(
        refused.message.contains("could not read the cell"),
        "{refused}"
    );
}

#[test]
fn rewrite_compare_refusals_and_forms() {
    let no_loop = "let loss = model.forward(&xs).mean(None);\nopt.backward_step(&loss);\n";
    let refused = instrument_for_compare(no_loop).unwrap_err();
    assert!(
        refused.message.contains("`for`, `while` or `loop`"),
        "{refused}"
    );
    assert_eq!(refused.line, Some(2));
    // `loop` with a label of its own, and a loss moved after the step.
    let src = "'outer: loop {\n    let loss = model.forward(&xs).mean(None);\n    \
               opt.backward_step(&loss);\n    losses.push(loss);\n}\n";
    let instrumented = instrument_for_compare(src).unwrap();
    assert!(
        instrumented.contains(
            "opt.backward_step(&loss);\n    if tchmem::compare::record_step(&loss) {\n        \
             break 'outer;"
        ),
        "{instrumented}"
    );
    assert!(instrument_for_compare(&instrumented).is_err());
    // Logging every N steps with `continue`: the end of the body is not reached every step, so
    // the step is recorded right after it.
    let src = "for (i, xs) in batches.iter().enumerate() {\n    let loss = model.forward(xs).mean(None);\n    \
               opt.backward_step(&loss);\n    if i % 100 != 0 {\n        continue;\n    }\n    \
               println!(\"{}\", loss.double_value(&Known::default()));\n}\n";
    let instrumented = instrument_for_compare(src).unwrap();
    let step = instrumented.find("opt.backward_step(&loss);").unwrap();
    let record = instrumented.find("tchmem::compare::record_step").unwrap();
    let skip = instrumented.find("continue").unwrap();
    assert!(step < record && record < skip, "{instrumented}");
}

#[test]
fn rewrite_inline_loss_is_bound_first() {
    let src = "for (xs, ys) in batches.iter() {\n    \
               opt.backward_step(&model.forward(xs).mse_loss(ys, tch::Reduction::Mean));\n}\n";
    let rewritten = rewrite_ok(src, "--accumulate 2");
    assert!(
        rewritten.code.contains("let loss = {"),
        "{}",
        rewritten.code
    );
    assert_parses(&rewritten.code, "inline loss");
    let instrumented = instrument_for_compare(src).unwrap();
    assert!(
        instrumented
            .contains("opt.backward_step(&loss);\n    if tchmem::compare::record_step(&loss)"),
        "{instrumented}"
    );
}

#[test]
fn rewrite_accumulate_splits_only_the_batch() {
    let src =
        "for (xs, ys) in batches.iter() {\n    let mask = Tensor::ones([8, 8], (Kind::Float, \
               Device::Cpu));\n    let n = xs.size()[0];\n    let xs = xs.to_device(device);\n    \
               let out = model.forward(&xs) * &mask;\n    opt.zero_grad();\n    let loss = \
               out.mse_loss(ys, tch::Reduction::Mean);\n    loss.backward();\n    opt.step();\n}\n";
    let rewritten = rewrite_ok(src, "--accumulate 2");
    let code = &rewritten.code;
    assert!(code.contains("split(2, [&xs, &ys])"), "{code}");
    assert_eq!(code.matches("opt.zero_grad()").count(), 1, "{code}");
    assert!(!code.contains("loss.backward()"), "{code}");
    assert!(code.contains("opt.step();"), "{code}");
    assert_parses(code, "split batch");
}

#[test]
fn rewrite_accumulate_splits_a_data_set_that_a_full_batch_loop_reads_through_fields() {
    // tch-rs's mnist_nn: every step trains on the whole data set, `m.train_images`.
    let src = "for epoch in 1..20 {
    let loss = net.forward(&m.train_images).cross_entropy_for_logits(&m.train_labels);
    opt.backward_step(&loss);
    let test_accuracy = net.forward(&m.test_images).accuracy_for_logits(&m.test_labels);
    println!(\"{epoch} {}\", f64::try_from(&test_accuracy)?);
}";
    let rewritten = rewrite_ok(src, "--accumulate 2");
    let code = &rewritten.code;
    let flat: String = code.split_whitespace().collect();
    assert!(
        flat.contains("[refmicro_train_images,refmicro_train_labels]")
            && flat.contains("split(2,[&m.train_images,&m.train_labels],)"),
        "{code}"
    );
    assert!(
        flat.contains(
            "net.forward(&micro_train_images).cross_entropy_for_logits(&micro_train_labels)"
        ),
        "{code}"
    );
    // What the step does after the loss still reads the whole test set.
    assert!(flat.contains("net.forward(&m.test_images)"), "{code}");
    assert!(
        rewritten.changes.iter().any(|c| c
            .what
            .contains("the batch (m.train_images, m.train_labels) runs as 2")),
        "{:?}",
        rewritten.changes
    );
    assert_parses(code, "full batch");
    // A batch struct's fields, moved to the device; a tuple's; the model's own fields are not
    // the batch.
    let struct_fields = "for batch in loader {
    let loss = model.forward(&batch.images.to_device(d)).mse_loss(&batch.labels.to_device(d), tch::Reduction::Mean);
    opt.backward_step(&loss);
}";
    let tuple_fields = "for batch in loader {
    let out = net.forward(&batch.0).matmul(&net.proj);
    let loss = out.cross_entropy_for_logits(&batch.1);
    opt.backward_step(&loss);
}";
    for (src, split, forward) in [
        (
            struct_fields,
            "split(2,[&batch.images,&batch.labels],)",
            "model.forward(&micro_images.to_device(d))",
        ),
        (
            tuple_fields,
            "split(2,[&batch.0,&batch.1],)",
            "net.forward(&micro_0).matmul(&net.proj)",
        ),
    ] {
        let flat: String = rewrite_ok(src, "--accumulate 2")
            .code
            .split_whitespace()
            .collect();
        assert!(flat.contains(split) && flat.contains(forward), "{flat}");
        // `batch` is the batch, not its size.
        assert!(!flat.contains("micro_size"), "{flat}");
    }
    // A model held in the same struct as the data is not split; the data is.
    let shared_root = "for epoch in 0..10 {
    let loss = t.net.forward(&t.xs).mse_loss(&t.ys, tch::Reduction::Mean);
    opt.backward_step(&loss);
}";
    let flat: String = rewrite_ok(shared_root, "--accumulate 2")
        .code
        .split_whitespace()
        .collect();
    assert!(
        flat.contains("split(2,[&t.xs,&t.ys],)") && flat.contains("t.net.forward(&micro_xs)"),
        "{flat}"
    );
    // Rows the loop selects itself, and a field a macro reads, are not a data set to split.
    for selecting in [
        "for i in 0..n {
    let loss = net.forward(&m.train_images.narrow(0, i * BATCH_SIZE, BATCH_SIZE)).cross_entropy_for_logits(&m.train_labels.narrow(0, i * BATCH_SIZE, BATCH_SIZE));
    opt.backward_step(&loss);
}",
        "for epoch in 1..20 {
    let logits = net.forward(&m.train_images);
    assert_eq!(logits.size()[0], m.train_labels.size()[0]);
    let loss = logits.cross_entropy_for_logits(&m.train_labels);
    opt.backward_step(&loss);
}",
    ] {
        let refused = refusal(selecting, "--accumulate 2").to_string();
        assert!(refused.contains("looks for the batch tensors"), "{refused}");
    }
}

#[test]
fn rewrite_accumulate_runs_recurrent_nets_per_micro_batch_and_reads_the_micro_batch_size() {
    // tch-rs's char-rnn: the LSTM runs the sequence (`seq`), and the loss spells the batch size.
    let src = "for batch in data.iter_shuffle(SEQ_LEN + 1, BATCH_SIZE) {\n    let xs_onehot = \
               batch.narrow(1, 0, SEQ_LEN).onehot(labels);\n    let ys = batch.narrow(1, 1, \
               SEQ_LEN).to_kind(Kind::Int64);\n    let (lstm_out, _) = \
               lstm.seq(&xs_onehot.to_device(device));\n    let logits = \
               linear.forward(&lstm_out);\n    let loss = logits.view([BATCH_SIZE * SEQ_LEN, \
               labels]).cross_entropy_for_logits(&ys.to_device(device).view([BATCH_SIZE * \
               SEQ_LEN]));\n    opt.backward_step_clip(&loss, 0.5);\n    sum_loss += \
               f64::try_from(loss)?;\n}\n";
    let rewritten = rewrite_ok(src, "--accumulate 2");
    let code = &rewritten.code;
    let flat: String = code.split_whitespace().collect();
    assert!(flat.contains("split(2,[&xs_onehot,&ys],)"), "{code}");
    let micro = code.find("tchmem::accumulate::micro_size(");
    let lstm = code.find("lstm.seq(");
    assert!(micro.is_some() && micro < lstm, "{code}");
    // Inside the micro-batch loop the batch size is the micro-batch's; the loop's own use of
    // it (the iterator) is the whole batch's.
    assert!(
        code.contains("view([micro_batch_size * SEQ_LEN, labels])"),
        "{code}"
    );
    assert!(
        rewritten
            .changes
            .iter()
            .any(|c| c.what.contains("`BATCH_SIZE` reads the micro-batch's size")),
        "{:?}",
        rewritten.changes
    );
    assert!(
        code.contains("iter_shuffle(SEQ_LEN + 1, BATCH_SIZE)"),
        "{code}"
    );
    assert_parses(code, "micro-batch size");
    // A count of batches keeps its value.
    let counted = src.replace(
        "view([BATCH_SIZE * SEQ_LEN, labels])",
        "view([-1, labels]).g_mul_scalar(NUM_BATCHES)",
    );
    let code = rewrite_ok(&counted, "--accumulate 2").code;
    assert!(code.contains("g_mul_scalar(NUM_BATCHES)"), "{code}");
}

#[test]
fn rewrite_amp_refuses_a_loss_that_autocast_refuses_even_in_a_function_of_an_earlier_cell() {
    // tch-rs's vae: the loss function of an earlier cell calls binary_cross_entropy.
    let src = "for (bimages, _) in m.train_iter(128).shuffle().to_device(vs.device()) {\n    let \
               (recon_batch, mu, logvar) = vae.forward(&bimages);\n    let loss = \
               loss(&recon_batch, &bimages, &mu, &logvar);\n    opt.backward_step(&loss);\n}\n";
    let earlier = |code: &str| super::earlier::EarlierFn {
        name: "loss".into(),
        run: 2,
        code: code.into(),
    };
    let bce = earlier(
        "fn loss(recon_x: &Tensor, x: &Tensor) -> Tensor {\n    \
         recon_x.binary_cross_entropy::<Tensor>(&x.view([-1, 784]), None, Reduction::Sum)\n}",
    );
    let refusal = rewrite_cell(
        src,
        &options("--amp bf16"),
        &known(std::slice::from_ref(&bce)),
    )
    .unwrap_err();
    assert_eq!(refusal.line, Some(2), "{refusal}");
    assert!(
        refusal.message.contains(
            "binary_cross_entropy (in `loss`, a function of cell [2]); libtorch refuses it \
             under autocast"
        ),
        "{refusal}"
    );
    assert!(
        refusal.message.contains("binary_cross_entropy_with_logits"),
        "{refusal}"
    );
    // With logits it is fine, and so is the op outside the forward pass and loss.
    let logits = earlier(
        "fn loss(r: &Tensor, x: &Tensor) -> Tensor {\n    \
         r.binary_cross_entropy_with_logits::<Tensor>(x, None, None, Reduction::Mean)\n}",
    );
    rewrite_cell(src, &options("--amp bf16"), &known(&[logits])).unwrap();
    rewrite_cell(src, &options("--accumulate 2"), &known(&[bce])).unwrap();
}

#[test]
fn rewrite_checkpoint_renames_the_builders_type_where_a_function_returns_it() {
    // tch-rs's cifar example imports `SequentialT` and returns it from its builders.
    let src = "fn conv_bn(vs: &nn::Path, c_in: i64, c_out: i64) -> SequentialT {\n    \
               nn::seq_t().add(nn::conv2d(vs, c_in, c_out, 3, Default::default()))\n}\nfn \
               head(vs: &nn::Path) -> nn::Sequential {\n    nn::seq().add(nn::linear(vs, 4, 2, \
               Default::default()))\n}\nlet net = conv_bn(&vs.root(), 3, 8);\nfor (xs, ys) in \
               batches.iter() {\n    let loss = net.forward_t(xs, true).mse_loss(ys, \
               tch::Reduction::Mean);\n    opt.backward_step(&loss);\n}\n";
    let code = rewrite_ok(src, "--checkpoint").code;
    assert!(
        code.contains("-> tchmem::checkpoint::SequentialT {"),
        "{code}"
    );
    assert!(
        code.contains("-> tchmem::checkpoint::Sequential {"),
        "{code}"
    );
    assert_parses(&code, "renamed builder types");
}

#[test]
fn rewrite_generated_names_avoid_the_cells() {
    let src = "let weight = 1.0;\nlet grad_scaler = 2;\nlet mut opt = \
               nn::Adam::default().build(&vs, 1e-3)?;\nfor (xs, ys) in batches.iter() {\n    let \
               loss = model.forward(xs).mse_loss(ys, tch::Reduction::Mean);\n    \
               opt.backward_step(&loss);\n}\n";
    let rewritten = rewrite_ok(src, "--amp f16 --accumulate 2");
    assert!(
        rewritten.code.contains("tchmem_weight"),
        "{}",
        rewritten.code
    );
    assert!(
        rewritten.code.contains("let mut tchmem_grad_scaler"),
        "{}",
        rewritten.code
    );
}

#[test]
fn rewrite_amp_moves_adam_to_the_fused_one_with_its_settings() {
    let cell = |build: &str, extra: &str| {
        format!(
            "let mut opt = {build}.build(&vs, 1e-3)?;\n{extra}for (xs, ys) in batches.iter() {{\n    \
             let loss = model.forward(xs).mse_loss(ys, tch::Reduction::Mean);\n    \
             opt.backward_step(&loss);\n}}\n"
        )
    };
    let literal = cell("nn::AdamW { wd: 0.1, ..Default::default() }", "");
    let rewritten = rewrite_ok(&literal, "--amp bf16");
    assert!(
        rewritten
            .code
            .contains("tchmem::optim::AdamW::from(nn::AdamW {")
            && rewritten.code.contains("wd: 0.1,"),
        "{}",
        rewritten.code
    );
    assert!(
        rewritten
            .changes
            .iter()
            .any(|c| c.what.contains("nn::AdamW → tchmem::optim::AdamW::from")),
        "{:?}",
        rewritten.changes
    );
    let builder = rewrite_ok(
        &cell("nn::adam(0.8, 0.9, 0.0).amsgrad(true)", ""),
        "--amp f16",
    );
    assert!(
        builder
            .code
            .contains("tchmem::optim::Adam::from(nn::adam(0.8, 0.9, 0.0).amsgrad(true))"),
        "{}",
        builder.code
    );
    // A method tchmem's optimizer lacks keeps tch's, with a note saying why.
    let kept = rewrite_ok(
        &cell("nn::Adam::default()", "opt.set_momentum(0.5);\n"),
        "--amp bf16",
    );
    assert!(
        kept.code.contains("= nn::Adam::default().build"),
        "{}",
        kept.code
    );
    assert!(
        kept.changes
            .iter()
            .any(|c| c.what.contains("kept tch's optimizer") && c.what.contains("opt.set_momentum")),
        "{:?}",
        kept.changes
    );
    // Not without --amp, and not when --optimizer picks one.
    for flags in ["--accumulate 2", "--amp bf16 --optimizer lion"] {
        let code = rewrite_ok(&literal, flags).code;
        assert!(!code.contains("AdamW::from"), "{flags}: {code}");
    }
}

/// A small deterministic generator (xorshift64*), so the fuzz test needs no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Splits source into tokens (identifier runs, whitespace runs, single other characters).
fn tokens(src: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for c in src.chars() {
        let word = c.is_alphanumeric() || c == '_';
        match out.last_mut() {
            Some(last) if word && last.chars().all(|d| d.is_alphanumeric() || d == '_') => {
                last.push(c)
            }
            Some(last) if c.is_whitespace() && last.chars().all(char::is_whitespace) => {
                last.push(c)
            }
            _ => out.push(c.to_string()),
        }
    }
    out
}

/// Deletes, duplicates or swaps tokens, characters or lines.
fn mutate(src: &str, rng: &mut Rng) -> String {
    let mut units: Vec<String> = match rng.below(3) {
        0 => tokens(src),
        1 => src.chars().map(String::from).collect(),
        _ => src.split_inclusive('\n').map(String::from).collect(),
    };
    for _ in 0..1 + rng.below(3) {
        if units.is_empty() {
            break;
        }
        let i = rng.below(units.len());
        match rng.below(3) {
            0 => {
                units.remove(i);
            }
            1 => {
                let copy = units[i].clone();
                units.insert(rng.below(units.len() + 1), copy);
            }
            _ => {
                let j = rng.below(units.len());
                units.swap(i, j);
            }
        }
    }
    units.concat()
}

const FLAG_SETS: [&str; 8] = [
    "--checkpoint",
    "--amp bf16",
    "--amp f16",
    "--accumulate 3",
    "--optimizer lion",
    "--checkpoint 2 --amp f16 --accumulate 2 --optimizer adafactor",
    "--amp bf16 --accumulate 4",
    "--optimizer sgd --amp f16",
];

#[test]
fn rewrite_fuzzed_cells_never_panic() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let started = std::time::Instant::now();
    let mut rewritten = 0;
    for name in LOOPS {
        let src = reference(name);
        for _ in 0..600 {
            let mutated = mutate(&src, &mut rng);
            let flags = FLAG_SETS[rng.below(FLAG_SETS.len())];
            if let Ok(out) = rewrite_cell(&mutated, &options(flags), &Known::default()) {
                assert_parses(&out.code, &format!("{flags} on\n{mutated}"));
                rewritten += 1;
                // Rewriting and instrumenting the output must not panic either.
                let again = FLAG_SETS[rng.below(FLAG_SETS.len())];
                let _ = rewrite_cell(&out.code, &options(again), &Known::default());
                if let Ok(instrumented) = compare::instrument(&out.code) {
                    assert_parses(&instrumented, &format!("--compare on\n{}", out.code));
                }
            }
            if let Ok(out) = compare::instrument(&mutated) {
                assert_parses(&out, &format!("--compare on\n{mutated}"));
            }
        }
    }
    // Some mutations keep the loop rewritable, so the rewriter itself is fuzzed too.
    assert!(
        rewritten > 100,
        "only {rewritten} mutated cells were rewritten"
    );
    assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
}

#[test]
fn rewrite_fuzzed_flags_never_panic() {
    const WORDS: [&str; 24] = [
        "--checkpoint",
        "--amp",
        "bf16",
        "f16",
        "fp8",
        "--accumulate",
        "--optimizer",
        "sgd",
        "lion",
        "adamw8bit",
        "adafactor",
        "adam",
        "--show",
        "--compare",
        "0",
        "1",
        "4",
        "-1",
        "99999999999",
        "--",
        "-",
        "--checkpoint=2",
        "é\u{0}",
        "--amp=bf16",
    ];
    let mut rng = Rng(42);
    for _ in 0..3000 {
        let words: Vec<&str> = (0..rng.below(7))
            .map(|_| WORDS[rng.below(WORDS.len())])
            .collect();
        let _ = parse_args(&words);
        let cell = format!("%%optimize {}\nlet x = 1;\n", words.join(" "));
        if let Some(source) = crate::magics::cell_magic(&cell) {
            let _ = crate::magics::parse_cell(&source);
        }
    }
}

#[test]
fn rewrite_isolated_entry_points_survive_bad_input() {
    let deep = format!("let x = {}1{};", "(".repeat(5000), ")".repeat(5000));
    assert!(rewrite(&deep, &options("--amp bf16"), &Known::default()).is_err());
    assert!(instrument_for_compare("fn (").is_err());
    assert!(rewrite("", &options("--amp bf16"), &Known::default()).is_err());
    let ok = rewrite(&reference("mlp"), &options("--amp bf16"), &Known::default()).unwrap();
    assert_eq!(
        ok,
        rewrite_cell(&reference("mlp"), &options("--amp bf16"), &Known::default()).unwrap()
    );
}

/// Long flat expressions parse into trees as deep as they are long: up to the limit they are
/// read, beyond it refused, and neither overflows the rewriter's stack.
#[test]
fn rewrite_deep_expressions_do_not_overflow() {
    for unit in ["a + ", "- ", "! ", "& "] {
        for (count, accepted) in [
            (4000 / unit.split_whitespace().count(), true),
            (300_000, false),
        ] {
            let src = format!(
                "for (xs, ys) in b.iter() {{\n    let loss = {}xs;\n    opt.backward_step(&loss);\n}}\n",
                unit.repeat(count)
            );
            let result = rewrite(&src, &options("--amp bf16"), &Known::default());
            assert_eq!(
                result.is_ok(),
                accepted,
                "{unit:?} × {count}: {:?}",
                result.err()
            );
            assert_eq!(instrument_for_compare(&src).is_ok(), accepted);
        }
    }
    let chain = format!("let x = a{};\n", ".f()".repeat(200_000));
    let refused = rewrite(&chain, &options("--amp bf16"), &Known::default()).unwrap_err();
    assert!(refused.message.contains("tokens"), "{refused}");
}

#[test]
fn rewrite_changes_are_listed_in_line_order() {
    let rewritten = rewrite_ok(
        &reference("dropout"),
        "--checkpoint --amp bf16 --accumulate 4 --optimizer adafactor",
    );
    let lines: Vec<usize> = rewritten
        .changes
        .iter()
        .filter_map(|change| change.lines.map(|(first, _)| first))
        .collect();
    assert!(lines.len() >= 3, "{:?}", rewritten.changes);
    assert!(
        lines.windows(2).all(|pair| pair[0] <= pair[1]),
        "{:?}",
        rewritten.changes
    );
}

#[test]
fn rewrite_fused_loss_finds_tied_heads_and_struct_heads() {
    // GPT's tied head, the loss written inline.
    let tied = "let vs = nn::VarStore::new(device);\n\
        let wte = nn::embedding(vs.root() / \"wte\", 1000, 64, Default::default());\n\
        let mut opt = nn::AdamW::default().build(&vs, 1e-3).unwrap();\n\
        for (xs, ys) in batches.iter() {\n\
            let h = xs.apply(&wte).gelu(\"none\");\n\
            let loss = h.matmul(&wte.ws.tr()).view([-1, 1000]).cross_entropy_loss(&ys.view([-1]), None::<Tensor>, tch::Reduction::Mean, -1, 0.0);\n\
            opt.backward_step(&loss);\n\
        }\n";
    let rewritten = rewrite_ok(tied, "--fused-loss 128");
    let code = rewritten
        .code
        .replace(char::is_whitespace, "")
        .replace(",)", ")");
    assert!(
        code.contains(
            "tchmem::fused_loss::FusedLoss::default().chunk(128).ignore_index(-1).loss(&h,&wte.ws,None,&ys.view([-1]))"
        ),
        "{}",
        rewritten.code
    );
    assert!(rewritten
        .changes
        .iter()
        .any(|c| c.what.contains("tied head `wte.ws`")));

    // A struct whose forward returns hidden states, its head a field.
    let fields = "struct Lm { body: nn::Sequential, head: nn::Linear }\n\
        let vs = nn::VarStore::new(device);\n\
        let lm = Lm { body: nn::seq(), head: nn::linear(vs.root() / \"head\", 64, 1000, Default::default()) };\n\
        let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();\n\
        for (xs, ys) in batches.iter() {\n\
            let loss = lm.head.forward(&xs.apply(&lm.body)).cross_entropy_for_logits(ys);\n\
            opt.backward_step(&loss);\n\
        }\n";
    let code = rewrite_ok(fields, "--fused-loss")
        .code
        .replace(char::is_whitespace, "")
        .replace(",)", ")");
    assert!(
        code.contains(
            "tchmem::fused_loss::linear_cross_entropy(&xs.apply(&lm.body),&lm.head.ws,lm.head.bs.as_ref(),ys)"
        ),
        "{code}"
    );
}

#[test]
fn rewrite_new_techniques_refuse_with_their_reasons() {
    // The model's last layer is no head.
    let softmax = reference("mlp").replace(
        ".add(nn::linear(&root / \"l3\", 1024, 10, Default::default()));",
        ".add(nn::linear(&root / \"l3\", 1024, 10, Default::default()))\n    \
         .add_fn(|xs| xs.log_softmax(-1, Kind::Float));",
    );
    let why = refusal(&softmax, "--fused-loss");
    assert!(
        why.message
            .contains("ends in `….add_fn(|xs| xs.log_softmax(-1, Kind::Float))`"),
        "{why}"
    );
    assert!(why.message.contains("not a linear head"), "{why}");
    assert_eq!(why.line, Some(23));
    // The loss takes something that is neither a head nor a forward pass.
    let other = reference("mlp").replace("model.forward(xs)", "model.forward(xs).relu()");
    let why = refusal(&other, "--fused-loss");
    assert!(
        why.message.contains("neither a linear head's output"),
        "{why}"
    );
    // The logits are read again (an accuracy): the fused loss never makes them.
    let reused = reference("lm_head").replace(
        "total += loss.double_value(&[]);",
        "total += loss.double_value(&[]) + logits.argmax(-1, false).double_value(&[0, 0]);",
    );
    let why = refusal(&reused, "--fused-loss");
    assert!(why.message.contains("read by more than the loss"), "{why}");
    // Gradients added up by hand over several backward passes, the step taken every fourth.
    let by_hand = reference("mlp").replace(
        "opt.backward_step(&loss); // zero_grad, backward, step",
        "loss.backward();\n        if epoch % 4 == 0 { opt.step(); opt.zero_grad(); }",
    );
    let why = refusal(&by_hand, "--step-in-backward");
    assert!(why.message.contains("runs under a condition"), "{why}");
    // A head used through a field, with a type annotation, read a statement later: a
    // reference is bound (nothing moves), the annotation goes.
    let field = reference("lm_head")
        .replace(
            "let hidden = body.forward(&xs.apply(&embed));",
            "let out = (body.forward(&xs.apply(&embed)), 0);",
        )
        .replace(
            "let logits = hidden.apply(&head);",
            "let logits: Tensor = head.forward(&out.0);\n        let n = 1;",
        );
    let code = rewrite_ok(&field, "--fused-loss").code;
    assert!(code.contains("let hidden = &(out.0);"), "{code}");
    // A gradient read after backward (a norm logged by hand): freed by then.
    let read = reference("mlp").replace(
        "total += loss.double_value(&[]);",
        "total += loss.double_value(&[]);\n        let g = vs.trainable_variables()[0].grad().norm();",
    );
    let why = refusal(&read, "--step-in-backward");
    assert!(
        why.message
            .contains("`vs.trainable_variables()[0].grad()` reads a gradient"),
        "{why}"
    );
    // Global-norm clipping needs every gradient first.
    let clipped = reference("mlp").replace(
        "opt.backward_step(&loss); // zero_grad, backward, step",
        "opt.backward_step_clip_norm(&loss, 1.0);",
    );
    let why = refusal(&clipped, "--step-in-backward");
    assert!(
        why.message.contains("global norm needs every gradient"),
        "{why}"
    );
    // tch's RMSprop has no tchmem counterpart to step per parameter.
    let why = refusal(&reference("while_loop"), "--step-in-backward");
    assert!(
        why.message.contains("tch's RmsProp has no counterpart"),
        "{why}"
    );
    assert_eq!(why.line, Some(10));
    // Flags that need another flag, or exclude one.
    for (flags, expected) in [
        ("--offload", "Add --checkpoint"),
        ("--compress-activations int8", "Add --checkpoint"),
        ("--step-in-backward --accumulate 4", "must live across"),
        ("--step-in-backward --amp f16", "Use --amp bf16"),
        ("--fused-loss 0", "at least 1"),
    ] {
        let args: Vec<&str> = flags.split_whitespace().collect();
        let message = match parse_args(&args) {
            Err(crate::magics::MagicReply::Error(message)) => message,
            other => panic!("{flags}: {other:?}"),
        };
        assert!(message.contains(expected), "{flags}: {message}");
    }
}

#[test]
fn rewrite_fused_loss_marks_the_head_inside_a_model_where_it_is_built() {
    // A seq of the cell: its last layer is wrapped; the loss runs the forward in split_head.
    let code = rewrite_ok(&reference("mlp"), "--fused-loss").code;
    assert!(
        code.replace(char::is_whitespace, "").contains(
            ".add(tchmem::fused_loss::SplitHead(nn::linear(&root/\"l3\",1024,10,Default::default()),),)"
        ),
        "{code}"
    );
    assert!(
        code.contains("let logits = tchmem::fused_loss::split_head(|| model.forward(xs));"),
        "{code}"
    );
    assert!(
        code.contains("let loss = logits.cross_entropy(ys);"),
        "{code}"
    );
    // A struct's forward: its last field applied.
    let code = rewrite_ok(&reference("struct_model"), "--fused-loss").code;
    assert!(
        code.contains(".apply(&tchmem::fused_loss::SplitHead::of(&self.fc2))"),
        "{code}"
    );
    // A tied head at the end of a func_t closure.
    let tied = "let vs = nn::VarStore::new(device);\n\
        let wte = nn::embedding(vs.root() / \"wte\", 100, 8, Default::default());\n\
        let model = nn::func_t(move |xs, _train| { let h = xs.apply(&wte); h.matmul(&wte.ws.tr()) });\n\
        let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();\n\
        for (xs, ys) in batches.iter() {\n\
            let loss = model.forward_t(xs, true).cross_entropy_for_logits(ys);\n\
            opt.backward_step(&loss);\n\
        }\n";
    let rewritten = rewrite_ok(tied, "--fused-loss 16");
    let code = rewritten.code.replace(char::is_whitespace, "");
    assert!(
        code.contains("tchmem::fused_loss::tied_head(&h,&wte.ws)"),
        "{code}"
    );
    assert!(
        code.contains(
            "tchmem::fused_loss::FusedLoss::default().chunk(16).loss_of(&tchmem::fused_loss::split_head(||model.forward_t(xs,true)),ys)"
        ),
        "{code}"
    );
    assert!(
        rewritten.changes.iter().any(|c| c
            .what
            .contains("the tied head `wte.ws`, the last layer of `model`")),
        "{:?}",
        rewritten.changes
    );
}

#[test]
fn rewrite_fused_loss_follows_a_model_of_earlier_cells_into_their_functions() {
    use super::earlier::{assemble, EarlierCell, Wanted};
    let source = reference("func_model");
    let (items, rest) = source.split_at(source.find("let device").unwrap());
    let (model, training) = rest.split_at(rest.find("let data").unwrap());
    let cell = |run: usize, code: &str| EarlierCell {
        run,
        code: code.to_string(),
    };
    assert!(loss_takes_model_output(training));
    assert!(!loss_takes_model_output(&reference("lm_head")));
    let head = Wanted {
        batch: false,
        optimizer: false,
        model: false,
        head: true,
    };

    // The model built by an earlier cell: rebuilt with its functions, the head marked there.
    let assembled = assemble(training, &[cell(1, items), cell(2, model)], head);
    // The model, and the optimizer on its new variables.
    let brought: Vec<&str> = assembled.rebuilt.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(brought, ["model", "opt"]);
    let rewritten = rewrite_cell(&assembled.code, &options("--fused-loss"), &assembled.known)
        .unwrap_or_else(|refusal| panic!("{refusal}"));
    let code = &rewritten.code;
    assert!(
        code.contains(".apply(&tchmem::fused_loss::SplitHead::of(&head))"),
        "{code}"
    );
    assert!(
        code.contains("let logits = tchmem::fused_loss::split_head(|| xs.apply_t(&model, true));"),
        "{code}"
    );
    let changes = assembled.cell_changes(rewritten.changes);
    assert!(
        changes.iter().any(|c| c
            .what
            .contains("`head`, the last layer of `model` → `gpt(…)`")),
        "{changes:?}"
    );

    // The model built in the cell by an earlier cell's function: the function is redefined in
    // the cell with its head marked.
    let here = format!("{model}{training}");
    let assembled = assemble(
        &here,
        &[cell(1, items)],
        Wanted {
            head: false,
            ..head
        },
    );
    let rewritten = rewrite_cell(&assembled.code, &options("--fused-loss"), &assembled.known)
        .unwrap_or_else(|refusal| panic!("{refusal}"));
    assert!(
        rewritten.code.contains("fn gpt(p: nn::Path)"),
        "{}",
        rewritten.code
    );
    assert!(
        rewritten.changes.iter().any(|c| c
            .what
            .contains("`fn gpt` of cell [1] is redefined in this cell")),
        "{:?}",
        rewritten.changes
    );

    // An impl of an earlier cell is not rewritten: the refusal says what to do.
    let earlier_impl = reference("struct_model");
    let (defs, body) = earlier_impl.split_at(earlier_impl.find("let device").unwrap());
    let assembled = assemble(body, &[cell(1, defs)], Wanted::TRIAL);
    let why = rewrite_cell(&assembled.code, &options("--fused-loss"), &assembled.known)
        .expect_err("a refusal");
    assert!(
        why.message.contains("cannot see `impl Module for Net`"),
        "{why}"
    );
    assert!(why.message.contains("SplitHead"), "{why}");
}

#[test]
fn rewrite_fused_loss_takes_a_head_of_an_earlier_cell_and_rebuilds_no_model_in_parts() {
    use super::earlier::{assemble, EarlierCell, Wanted};
    // char-rnn: the head is a `let` of an earlier cell beside the LSTM, on the same store.
    let earlier = [EarlierCell {
        run: 1,
        code: "let vs = nn::VarStore::new(device);\n\
               let lstm = nn::lstm(vs.root(), labels, 256, Default::default());\n\
               let linear = nn::linear(vs.root(), 256, labels, Default::default());\n\
               let mut opt = nn::Adam::default().build(&vs, 1e-3)?;"
            .into(),
    }];
    let cell = "for batch in batches.iter() {\n\
                \x20   let (lstm_out, _) = lstm.seq(&batch.xs);\n\
                \x20   let logits = linear.forward(&lstm_out);\n\
                \x20   let loss = logits.view([-1, labels]).cross_entropy_for_logits(&batch.ys);\n\
                \x20   opt.backward_step(&loss);\n\
                }";
    let wanted = Wanted {
        batch: false,
        optimizer: false,
        model: true,
        head: loss_takes_model_output(cell),
    };
    let assembled = assemble(cell, &earlier, wanted);
    // No model rebuilt: `linear` is a head the cell applies, and a rebuilt `lstm` would leave
    // the head on the notebook's store (the optimizer rebuilt on the new one would not train it).
    assert!(assembled.rebuilt.is_empty(), "{:?}", assembled.rebuilt);
    assert_eq!(assembled.known.linears, ["linear"]);
    let rewritten = rewrite_cell(&assembled.code, &options("--fused-loss"), &assembled.known)
        .unwrap_or_else(|refusal| panic!("{refusal}"));
    let code = rewritten.code.replace(char::is_whitespace, "");
    assert!(
        code.contains(
            "tchmem::fused_loss::linear_cross_entropy(&lstm_out,&linear.ws,linear.bs.as_ref(),&batch.ys,)"
        ),
        "{code}"
    );
}

#[test]
fn rewrite_fused_loss_follows_a_function_local_builder_and_names_a_library_model() {
    // vgg: the function's own `net` (a seq built up in a loop) is not the notebook's `net`; the
    // function's tail chain ends in the head.
    let vgg = "fn vgg(p: &nn::Path, classes: i64) -> nn::SequentialT {\n\
               \x20   let mut net = nn::seq_t();\n\
               \x20   for i in 0..2 { net = net.add(nn::conv2d(p / i, 3, 3, 3, Default::default())); }\n\
               \x20   net.add_fn(|x| x.flat_view()).add(nn::linear(p / \"fc\", 12, classes, Default::default()))\n\
               }\n\
               let vs = nn::VarStore::new(device);\n\
               let net = vgg(&vs.root(), 10);\n\
               let mut opt = nn::Adam::default().build(&vs, 1e-3)?;\n\
               for (x, y) in batches.iter() {\n\
               \x20   let loss = net.forward_t(x, true).cross_entropy_for_logits(y);\n\
               \x20   opt.backward_step(&loss);\n\
               }";
    let code = rewrite_ok(vgg, "--fused-loss")
        .code
        .replace(char::is_whitespace, "");
    assert!(
        code.contains(".add(tchmem::fused_loss::SplitHead(nn::linear(p/\"fc\",12,classes,Default::default()),),)"),
        "{code}"
    );
    // tch::vision's resnet18: its head is in the library.
    let library = "let vs = nn::VarStore::new(device);\n\
                   let net = resnet::resnet18(&vs.root(), 10);\n\
                   let mut opt = nn::Adam::default().build(&vs, 1e-3)?;\n\
                   for (x, y) in batches.iter() {\n\
                   \x20   let loss = net.forward_t(x, true).cross_entropy_for_logits(y);\n\
                   \x20   opt.backward_step(&loss);\n\
                   }";
    let why = refusal(library, "--fused-loss");
    assert!(
        why.message
            .contains("built by `resnet::resnet18(…)`, a library's model"),
        "{why}"
    );
}

#[test]
fn rewrite_step_in_backward_keeps_clipping_by_value_as_one_call() {
    let clipped = reference("mlp").replace(
        "opt.backward_step(&loss); // zero_grad, backward, step",
        "opt.backward_step_clip(&loss, 0.5);",
    );
    let code = rewrite_ok(&clipped, "--step-in-backward").code;
    assert!(
        code.contains("opt.backward_step_clip(&loss, 0.5);"),
        "{code}"
    );
    assert!(!code.contains("clip_grad_value"), "{code}");
    assert!(
        code.contains(".map(tchmem::optim::Optimizer::in_backward)"),
        "{code}"
    );
}

#[test]
fn rewrite_fused_loss_follows_reassignments_marks_once_and_rebuilds_no_earlier_head() {
    // The closure's variable is reassigned: its last value ends in the head.
    let reassigned = "let vs = nn::VarStore::new(device);\n\
        let l1 = nn::linear(vs.root() / \"l1\", 8, 8, Default::default());\n\
        let l2 = nn::linear(vs.root() / \"l2\", 8, 100, Default::default());\n\
        let model = nn::func(move |xs| { let mut x = xs.apply(&l1); x = x.relu().apply(&l2); x });\n\
        let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();\n\
        for (xs, ys) in batches.iter() {\n\
            let loss = model.forward(xs).cross_entropy_for_logits(ys);\n\
            opt.backward_step(&loss);\n\
        }\n";
    let code = rewrite_ok(reassigned, "--fused-loss")
        .code
        .replace(char::is_whitespace, "");
    assert!(
        code.contains("x=x.relu().apply(&tchmem::fused_loss::SplitHead::of(&l2));"),
        "{code}"
    );
    assert!(code.contains("letmutx=xs.apply(&l1);"), "{code}");
    // Reassigned in a loop: what it ends with cannot be read off.
    let looped = reassigned.replace(
        "x = x.relu().apply(&l2); x",
        "for _ in 0..2 { x = x.relu().apply(&l2); } x",
    );
    let why = refusal(&looped, "--fused-loss");
    assert!(why.message.contains("reassigned inside a loop"), "{why}");

    // Two models built by one function: the head is marked once, both losses fused.
    let two = "fn lm(p: nn::Path) -> impl Module {\n\
        \x20   let head = nn::linear(&p / \"head\", 8, 100, Default::default());\n\
        \x20   nn::func(move |xs| xs.apply(&head))\n\
        }\n\
        let vs = nn::VarStore::new(device);\n\
        let a = lm(vs.root() / \"a\");\n\
        let b = lm(vs.root() / \"b\");\n\
        let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();\n\
        for (xs, ys) in batches.iter() {\n\
            let loss = a.forward(xs).cross_entropy_for_logits(ys) + b.forward(xs).cross_entropy_for_logits(ys);\n\
            opt.backward_step(&loss);\n\
        }\n";
    let code = rewrite_ok(two, "--fused-loss").code;
    assert_eq!(code.matches("SplitHead::of(&head)").count(), 1, "{code}");
    assert_eq!(code.matches("split_head(").count(), 2, "{code}");

    // A head of an earlier cell the cell applies itself: no model rebuilt for it.
    use super::earlier::{assemble, EarlierCell, Wanted};
    let earlier = [EarlierCell {
        run: 1,
        code: "let vs = nn::VarStore::new(device);\n\
               let head = nn::linear(vs.root() / \"h\", 8, 100, Default::default());"
            .into(),
    }];
    let cell = "let loss = h.apply(&head).cross_entropy_for_logits(&y);";
    let head = Wanted {
        batch: false,
        optimizer: false,
        model: false,
        head: true,
    };
    let assembled = assemble(cell, &earlier, head);
    assert!(assembled.rebuilt.is_empty(), "{:?}", assembled.rebuilt);
}

#[test]
fn rewrite_of_tchs_optimizers_names_one_the_notebook_wrote() {
    use super::earlier::{assemble, EarlierCell, Wanted};
    // tch-rs's custom-optimizer example: `SparseAdam` built in an earlier cell, stepped here.
    let earlier = [
        EarlierCell {
            run: 1,
            code: "struct SparseAdam { lr: f64 }\nimpl SparseAdam {\n    fn new(vs: &VarStore, \
                   lr: f64) -> SparseAdam { SparseAdam { lr } }\n    fn step(&mut self) {}\n    \
                   fn zero_grad(&mut self) {}\n}"
                .into(),
        },
        EarlierCell {
            run: 2,
            code: "let vs = nn::VarStore::new(Device::Cpu);\nlet net = net(&vs.root());\n\
                   let mut opt = SparseAdam::new(&vs, 5e-3);"
                .into(),
        },
    ];
    let cell = "for _ in 0..2 {\n    let loss = net.forward(&xs).mean(Kind::Float);\n    \
                opt.zero_grad();\n    loss.backward();\n    opt.step();\n}";
    let assembled = assemble(cell, &earlier, Wanted::TRIAL);
    for (flags, says) in [
        (
            "--optimizer lion",
            "(`tchmem::optim::Lion::default().build(&vs, lr)?`)",
        ),
        ("--step-in-backward", "cannot be taken apart per parameter"),
    ] {
        let refusal =
            rewrite_cell(&assembled.code, &options(flags), &assembled.known).expect_err(flags);
        let refusal = assembled.in_cell_terms(refusal);
        let message = refusal.to_string();
        assert!(
            message.contains(&format!(
                "{flags}: the training step's optimizer is `opt` (a `SparseAdam`, built in cell \
                 [2]), one the notebook wrote"
            )),
            "{message}"
        );
        assert!(message.contains(says), "{message}");
        assert_eq!(refusal.line, Some(5), "{message}");
    }
    // What does not change the optimizer applies.
    rewrite_cell(&assembled.code, &options("--amp bf16"), &assembled.known)
        .unwrap_or_else(|refusal| panic!("{refusal}"));
}

/// tch-rs's neural-style-transfer loop: the trained variable is the image; a frozen network's
/// every layer's output goes into the loss.
const STYLE_TRANSFER: &str = "for step_idx in 1..(1 + TOTAL_STEPS) {
    let input_layers = net.forward_all_t(&input_var, false, Some(max_layer));
    let style_loss: Tensor =
        STYLE_INDEXES.iter().map(|&i| style_loss(&input_layers[i], &style_layers[i])).sum();
    let content_loss: Tensor = CONTENT_INDEXES
        .iter()
        .map(|&i| input_layers[i].mse_loss(&content_layers[i], tch::Reduction::Mean))
        .sum();
    let loss = style_loss * STYLE_WEIGHT + content_loss;
    opt.backward_step(&loss);
}";

#[test]
fn rewrite_of_a_loop_that_takes_every_layers_output() {
    // Mixed precision runs the network under autocast, not the loss alone.
    let amp = rewrite_ok(STYLE_TRANSFER, "--amp bf16");
    let autocast = amp.code.find("autocast").expect("autocast");
    let forward = amp.code.find("forward_all_t").expect("the forward call");
    assert!(autocast < forward, "{}", amp.code);
    // The losses are not a batch to split: the loop has none.
    let accumulate = refusal(STYLE_TRANSFER, "--accumulate 2").to_string();
    assert!(
        accumulate.contains("--accumulate looks for the batch tensors")
            && accumulate.contains("(lines 2–9) use none"),
        "{accumulate}"
    );
    // Every layer's output is kept for the loss: nothing for checkpointing to recompute.
    let checkpoint = refusal(
        &format!("let net = nn::seq_t().add_fn(|x| x.relu());\n{STYLE_TRANSFER}"),
        "--checkpoint",
    );
    assert!(
        checkpoint
            .to_string()
            .contains("--checkpoint would save nothing here: the loop takes every layer's output of `net` (`net.forward_all_t(…)`)"),
        "{checkpoint}"
    );
    assert_eq!(checkpoint.line, Some(3));
    // A perceptual loss: a network's every layer's output scores the checkpointed generator's.
    let perceptual = "let gen = nn::seq_t().add_fn(|x| x.relu());
for (xs, _) in batches {
    let out = xs.apply_t(&gen, true);
    let features = vgg.forward_all_t(&out, false, Some(4));
    let loss = features[3].mean(Kind::Float);
    opt.backward_step(&loss);
}";
    let rewritten = rewrite_ok(perceptual, "--checkpoint");
    assert!(
        rewritten.code.contains("tchmem::checkpoint::seq_t()"),
        "{}",
        rewritten.code
    );
}

#[test]
fn rewrite_checkpoint_names_the_parts_that_share_a_models_store() {
    use super::earlier::{assemble, EarlierCell, Wanted};
    // A fine-tuned backbone and its new head on one store, the optimizer on it.
    let earlier = [EarlierCell {
        run: 3,
        code: "let mut vs = nn::VarStore::new(Device::Cpu);\n\
               let net = resnet::resnet18_no_final_layer(&(vs.root() / \"backbone\"));\n\
               vs.freeze();\n\
               let head = nn::linear(vs.root() / \"head\", 512, 10, Default::default());\n\
               let mut opt = nn::Adam::default().build(&vs, 1e-3)?;"
            .into(),
    }];
    let cell = "for (xs, ys) in batches {\n    let features = xs.apply_t(&net, false);\n    \
                let loss = features.apply(&head).cross_entropy_for_logits(&ys);\n    \
                opt.backward_step(&loss);\n}";
    let wanted = Wanted {
        model: true,
        ..Wanted::TRIAL
    };
    let assembled = assemble(cell, &earlier, wanted);
    let refusal = rewrite_cell(&assembled.code, &options("--checkpoint"), &assembled.known)
        .expect_err("--checkpoint");
    let message = assembled.in_cell_terms(refusal).to_string();
    assert!(
        message.contains(
            "--checkpoint cannot checkpoint `net` (cell [3]): it shares its VarStore `vs` with \
             `head`"
        ),
        "{message}"
    );
    // The same for a model built with nn::seq_t() beside its head.
    let earlier = [EarlierCell {
        run: 2,
        code: "let vs = nn::VarStore::new(Device::Cpu);
               let net = nn::seq_t().add(nn::linear(vs.root() / \"l\", 8, 8, Default::default()));
               let head = nn::linear(vs.root() / \"head\", 8, 2, Default::default());
               let mut opt = nn::Adam::default().build(&vs, 1e-3)?;"
            .into(),
    }];
    let assembled = assemble(cell, &earlier, wanted);
    let refusal = rewrite_cell(&assembled.code, &options("--checkpoint"), &assembled.known)
        .expect_err("--checkpoint");
    let message = assembled.in_cell_terms(refusal).to_string();
    assert!(
        message.contains("`net` (cell [2]): it shares its VarStore `vs` with `head`"),
        "{message}"
    );
}
