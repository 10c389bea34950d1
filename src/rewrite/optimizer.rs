//! Optimizers built in the cell (`nn::Adam::default().build(&vs, lr)` and its variants), and
//! swapping them for one of `tchmem::optim`'s leaner ones.

use proc_macro2::Ident;
use quote::ToTokens;
use syn::visit::{self, Visit};
use syn::visit_mut::{self, VisitMut};
use syn::{Block, Expr, Stmt};

use super::cell::line_of;
use super::change::Change;
use super::earlier::UnknownOptimizer;
use super::step::Step;
use super::syntax::{as_ident, comment, is_nn_path, segments, strip_parens};
use super::tree::Tree;
use super::{OptimizerChoice, Refusal};

/// tch's optimizer configurations.
const NN_CONFIGS: [&str; 4] = ["Adam", "AdamW", "Sgd", "RmsProp"];
/// tch's functions that make one (`nn::adam(β1, β2, wd)`, …).
const NN_CONFIG_FNS: [&str; 4] = ["adam", "adamw", "sgd", "rms_prop"];
/// Methods of tch's `nn::Optimizer` that `tchmem::optim::Optimizer` has too.
const SHARED_METHODS: [&str; 14] = [
    "backward_step",
    "backward_step_clip",
    "backward_step_clip_norm",
    "step",
    "zero_grad",
    "set_lr",
    "set_lr_group",
    "set_weight_decay",
    "set_weight_decay_group",
    "clip_grad_value",
    "clip_grad_norm",
    // Generic methods every value has, and ones the rewrites themselves use.
    "lr",
    "state_bytes",
    "name",
];

/// What configures an optimizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Config {
    /// One of tch's (`Adam`, …), and whether it sets anything beyond the defaults.
    Nn { name: String, customised: bool },
    /// One of `tchmem::optim`'s.
    Tchmem(String),
}

/// An optimizer built in the cell.
pub(crate) struct Build {
    /// The block and statement holding the build.
    pub block: usize,
    pub index: usize,
    /// `opt` in `let mut opt = ….build(…)…;`.
    pub binding: Option<Ident>,
    /// The `&vs` argument.
    pub vs: Expr,
    pub config: Config,
    pub line: usize,
}

/// What configures the optimizer `receiver.build(…)` builds, if it is an optimizer config.
pub(crate) fn config(receiver: &Expr) -> Option<Config> {
    let mut expr = strip_parens(receiver);
    let mut customised = false;
    // Builder methods: `nn::Adam::default().wd(1e-4)`.
    while let Expr::MethodCall(call) = expr {
        customised = true;
        expr = strip_parens(&call.receiver);
    }
    match expr {
        Expr::Call(call) => {
            let Expr::Path(func) = &*call.func else {
                return None;
            };
            let names = segments(&func.path);
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            match names.as_slice() {
                ["tchmem", "optim", name, "default" | "from"] => {
                    Some(Config::Tchmem(name.to_string()))
                }
                [.., name, "default"]
                    if NN_CONFIGS.contains(name)
                        && (names.len() == 2 || is_nn_path(&func.path, &[name, "default"])) =>
                {
                    Some(Config::Nn {
                        name: name.to_string(),
                        customised,
                    })
                }
                [.., function]
                    if NN_CONFIG_FNS.contains(function) && is_nn_path(&func.path, &[function]) =>
                {
                    Some(Config::Nn {
                        name: function.to_string(),
                        customised: true,
                    })
                }
                _ => None,
            }
        }
        Expr::Struct(literal) => {
            let names = segments(&literal.path);
            let name = names.last()?;
            let plain = names.len() == 1 || is_nn_path(&literal.path, &[name]);
            (NN_CONFIGS.contains(&name.as_str()) && plain).then(|| Config::Nn {
                name: name.clone(),
                customised: customised || !literal.fields.is_empty(),
            })
        }
        _ => None,
    }
}

/// The `.build(vs, lr)` call of an optimizer config, if `expr` is one.
pub(crate) fn as_build(expr: &Expr) -> Option<(&syn::ExprMethodCall, Config)> {
    match expr {
        Expr::MethodCall(call) if call.method == "build" && call.args.len() == 2 => {
            Some((call, config(&call.receiver)?))
        }
        _ => None,
    }
}

/// Every optimizer built in the cell.
pub(crate) fn builds(tree: &Tree) -> Vec<Build> {
    struct Finder {
        found: Vec<(Expr, Config, usize)>,
    }
    impl<'a> Visit<'a> for Finder {
        fn visit_expr(&mut self, expr: &'a Expr) {
            if let Some((call, config)) = as_build(expr) {
                self.found
                    .push((call.args[0].clone(), config, line_of(call.method.span())));
            }
            visit::visit_expr(self, expr);
        }
        // Nested blocks are the tree's other entries.
        fn visit_block(&mut self, _: &'a Block) {}
    }
    let mut out = Vec::new();
    for (block_id, info) in tree.blocks.iter().enumerate() {
        for (index, stmt) in info.block.stmts.iter().enumerate() {
            let mut finder = Finder { found: Vec::new() };
            finder.visit_stmt(stmt);
            let binding = match stmt {
                Stmt::Local(local) => match &local.pat {
                    syn::Pat::Ident(p) => Some(p.ident.clone()),
                    syn::Pat::Type(t) => match &*t.pat {
                        syn::Pat::Ident(p) => Some(p.ident.clone()),
                        _ => None,
                    },
                    _ => None,
                },
                _ => None,
            };
            for (vs, config, line) in finder.found {
                out.push(Build {
                    block: block_id,
                    index,
                    binding: binding.clone(),
                    vs,
                    config,
                    line,
                });
            }
        }
    }
    out
}

/// The optimizer `step` steps, when it is one of `unknown` (of types tchmem does not know).
pub(crate) fn stepped_unknown<'a>(
    step: Option<&Step>,
    unknown: &'a [UnknownOptimizer],
) -> Option<&'a UnknownOptimizer> {
    let step = step?;
    unknown.iter().find(|optimizer| step.opt == optimizer.name)
}

/// " (`opt` is used at the training step)", or nothing without a step.
pub(crate) fn used_at_step(step: Option<&Step>) -> String {
    step.map_or(String::new(), |step| {
        format!(" (`{}` is used at the training step)", step.opt)
    })
}

/// Swaps every tch optimizer built in the cell for `choice`.
pub(crate) fn swap(
    block: &mut Block,
    choice: OptimizerChoice,
    unknown: &[UnknownOptimizer],
    changes: &mut Vec<Change>,
) -> Result<(), Refusal> {
    let flag = format!("--optimizer {}", choice.flag_value());
    let tree = Tree::of(block);
    let found = tch_builds(&tree);
    if found.is_empty() {
        let step = super::step::the_step(&tree, &flag).ok();
        let line = step.as_ref().map(|s| s.line);
        let message = match stepped_unknown(step.as_ref(), unknown) {
            Some(optimizer) => format!(
                "{flag}: the training step's optimizer is {}, {}, whose update and learning \
                 rate the rewriter cannot read; it swaps tch's optimizers \
                 (`nn::Adam::default().build(&vs, lr)`, AdamW, Sgd, RmsProp) for \
                 tchmem::optim's. To compare the two, build tchmem's in place of `{}` \
                 (`tchmem::optim::{}::default().build(&{}, lr)?`) and run the cell with each.",
                optimizer.described(),
                optimizer.origin(),
                optimizer.name,
                choice.type_name(),
                optimizer.store
            ),
            None => format!(
                "{flag} looks for an optimizer built in this cell: \
                 `nn::Adam::default().build(&vs, lr)` (or AdamW, Sgd, RmsProp; a struct literal \
                 like `nn::Adam {{ wd: 1e-4, ..Default::default() }}`; or `nn::adam(β1, β2, \
                 wd)`); found none{}. Build the optimizer in this cell.",
                used_at_step(step.as_ref())
            ),
        };
        return Err(Refusal::new(message, line));
    }
    // Methods tch's optimizer has and ours lacks would not compile after the swap.
    let variables: Vec<Ident> = found.iter().filter_map(|b| b.binding.clone()).collect();
    if let Some((variable, method, line)) = unsupported_call(block, &variables) {
        return Err(Refusal::at(
            line,
            format!(
                "{flag}: `{variable}.{method}(…)` has no equivalent on \
                 tchmem::optim::Optimizer (it has {}); remove the call or keep the optimizer.",
                SHARED_METHODS[..8].join(", ")
            ),
        ));
    }
    drop(tree);

    for build in &found {
        let Config::Nn { name, customised } = &build.config else {
            continue;
        };
        let mut change = format!(
            "{flag}: nn::{name} → tchmem::optim::{} ({})",
            choice.type_name(),
            state_note(choice)
        );
        if *customised {
            change.push_str(&format!(
                "; the settings given to nn::{name} are not carried over: tchmem::optim::{}'s \
                 defaults apply",
                choice.type_name()
            ));
        }
        change.push_str(match choice {
            OptimizerChoice::Lion => "; learning rate divided by 3 (see the comment in the code)",
            OptimizerChoice::Sgd => {
                "; same learning rate (SGD often wants a larger one than Adam: tune it)"
            }
            _ => "; same learning rate",
        });
        changes.push(Change::at(build.line, change));
    }
    let mut swapper = Swapper {
        choice,
        pending: Vec::new(),
        types: OptimizerTypes::of(block),
    };
    swapper.visit_block_mut(block);
    let fixed = swapper.types.fixed;
    if fixed > 0 {
        changes.push(Change::general(format!(
            "{flag}: {fixed} type annotation{} nn::Optimizer → tchmem::optim::Optimizer",
            if fixed == 1 { "" } else { "s" }
        )));
    }
    Ok(())
}

/// For `--amp`: builds tch's Adam/AdamW as `tchmem::optim::Adam`/`AdamW::from(config)`, the same
/// update and settings on torch's fused kernel. tch's C++ optimizers launch several kernels per
/// parameter, which costs little next to an fp32 step but a tenth of a short mixed-precision one.
/// Left alone (with a note) when the cell builds another optimizer or calls a method ours lacks.
pub(crate) fn fuse_adam(block: &mut Block, flag: &str, changes: &mut Vec<Change>) {
    let tree = Tree::of(block);
    let found = tch_builds(&tree);
    let fused = |build: &Build| match &build.config {
        Config::Nn { name, .. } => fused_counterpart(name),
        Config::Tchmem(_) => None,
    };
    if found.is_empty() || found.iter().any(|b| fused(b).is_none()) {
        return;
    }
    let variables: Vec<Ident> = found.iter().filter_map(|b| b.binding.clone()).collect();
    if let Some((variable, method, line)) = unsupported_call(block, &variables) {
        changes.push(Change::at(
            line,
            format!(
                "{flag}: kept tch's optimizer, since `{variable}.{method}(…)` has no \
             equivalent on tchmem::optim::Optimizer (tchmem's fused Adam/AdamW would make short \
             mixed-precision steps faster)"
            ),
        ));
        return;
    }
    drop(tree);
    for build in &found {
        let kind = fused(build).unwrap_or("AdamW");
        changes.push(Change::at(
            build.line,
            format!(
                "{flag}: nn::{kind} → tchmem::optim::{kind}::from(…): the same update and \
                 settings on torch's fused kernel (tch's launches several kernels per parameter, \
                 a visible share of a mixed-precision step)"
            ),
        ));
    }
    let mut fuser = Fuser {
        types: OptimizerTypes::of(block),
    };
    fuser.visit_block_mut(block);
}

/// Every optimizer built in the cell with one of tch's configs.
fn tch_builds(tree: &Tree) -> Vec<Build> {
    builds(tree)
        .into_iter()
        .filter(|b| matches!(b.config, Config::Nn { .. }))
        .collect()
}

/// The `tchmem::optim` type with the same update as tch's config `name`, if there is one.
fn fused_counterpart(name: &str) -> Option<&'static str> {
    match name {
        "Adam" | "adam" => Some("Adam"),
        "AdamW" | "adamw" => Some("AdamW"),
        _ => None,
    }
}

/// Rewrites tch's `nn::Optimizer` type annotations (and a bare `Optimizer` when the cell imports
/// tch's) to `tchmem::optim::Optimizer`, counting them.
struct OptimizerTypes {
    fix_bare: bool,
    fixed: usize,
}

impl OptimizerTypes {
    fn of(block: &Block) -> OptimizerTypes {
        OptimizerTypes {
            fix_bare: imports_nn_optimizer(block),
            fixed: 0,
        }
    }

    fn fix(&mut self, ty: &mut syn::TypePath) {
        let is_tch = ty.qself.is_none()
            && (is_nn_path(&ty.path, &["Optimizer"])
                || (self.fix_bare && ty.path.is_ident("Optimizer")));
        if is_tch {
            ty.path = syn::parse_quote!(tchmem::optim::Optimizer);
            self.fixed += 1;
        }
    }
}

/// Wraps tch's Adam/AdamW configs in `tchmem::optim::…::from` and fixes `nn::Optimizer` types.
struct Fuser {
    types: OptimizerTypes,
}

impl VisitMut for Fuser {
    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        visit_mut::visit_expr_mut(self, expr);
        let Some(kind) = as_build(expr).and_then(|(_, config)| match config {
            Config::Nn { name, .. } => fused_counterpart(&name),
            Config::Tchmem(_) => None,
        }) else {
            return;
        };
        let Expr::MethodCall(call) = expr else {
            return;
        };
        let kind = Ident::new(kind, proc_macro2::Span::call_site());
        let config = &call.receiver;
        *call.receiver = syn::parse_quote!(tchmem::optim::#kind::from(#config));
    }

    fn visit_type_path_mut(&mut self, ty: &mut syn::TypePath) {
        visit_mut::visit_type_path_mut(self, ty);
        self.types.fix(ty);
    }
}

fn state_note(choice: OptimizerChoice) -> &'static str {
    match choice {
        OptimizerChoice::Sgd => "momentum 0.9: one f32 state tensor per parameter, Adam keeps two",
        OptimizerChoice::Lion => "one f32 momentum per parameter, Adam keeps two",
        OptimizerChoice::AdamW8bit => "8-bit moments: about a quarter of Adam's state",
        OptimizerChoice::Adafactor => {
            "factored second moments: rows + columns per matrix instead of rows × columns"
        }
    }
}

/// The first call on an optimizer variable of a method `tchmem::optim::Optimizer` lacks.
pub(crate) fn unsupported_call(
    block: &Block,
    variables: &[Ident],
) -> Option<(Ident, String, usize)> {
    first_call_on(block, variables, |method| {
        (!SHARED_METHODS.contains(&method)).then_some(())
    })
    .map(|(variable, method, (), line)| (variable, method, line))
}

/// The first call on one of the optimizer `variables` whose method `pick` says something of:
/// the variable, the method, what `pick` said and the line.
pub(crate) fn first_call_on<T>(
    block: &Block,
    variables: &[Ident],
    pick: impl Fn(&str) -> Option<T>,
) -> Option<(Ident, String, T, usize)> {
    struct Finder<'v, T, P> {
        variables: &'v [Ident],
        pick: P,
        found: Option<(Ident, String, T, usize)>,
    }
    impl<'a, T, P: Fn(&str) -> Option<T>> Visit<'a> for Finder<'_, T, P> {
        fn visit_expr_method_call(&mut self, call: &'a syn::ExprMethodCall) {
            if let (None, Some(receiver)) = (&self.found, as_ident(&call.receiver)) {
                let method = call.method.to_string();
                if self.variables.contains(receiver) {
                    if let Some(said) = (self.pick)(&method) {
                        let line = line_of(call.method.span());
                        self.found = Some((receiver.clone(), method, said, line));
                    }
                }
            }
            visit::visit_expr_method_call(self, call);
        }
    }
    let mut finder = Finder {
        variables,
        pick,
        found: None,
    };
    finder.visit_block(block);
    finder.found
}

/// Whether the cell imports `Optimizer` from tch's `nn` (so a bare `Optimizer` type is tch's).
pub(crate) fn imports_nn_optimizer(block: &Block) -> bool {
    block.stmts.iter().any(|stmt| match stmt {
        Stmt::Item(syn::Item::Use(item)) => {
            let text = item.to_token_stream().to_string();
            text.contains("nn") && text.contains("Optimizer")
        }
        _ => false,
    })
}

/// Replaces the configs, the learning rate for Lion, and `nn::Optimizer` types.
struct Swapper {
    choice: OptimizerChoice,
    /// Comments for the statement being visited.
    pending: Vec<String>,
    types: OptimizerTypes,
}

impl VisitMut for Swapper {
    fn visit_block_mut(&mut self, block: &mut Block) {
        let mut stmts = Vec::with_capacity(block.stmts.len());
        for mut stmt in std::mem::take(&mut block.stmts) {
            let outer = std::mem::take(&mut self.pending);
            self.visit_stmt_mut(&mut stmt);
            let mine = std::mem::replace(&mut self.pending, outer);
            stmts.extend(mine.iter().map(|text| comment(text)));
            stmts.push(stmt);
        }
        block.stmts = stmts;
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        visit_mut::visit_expr_mut(self, expr);
        let Expr::MethodCall(call) = expr else {
            return;
        };
        if call.method != "build" || call.args.len() != 2 {
            return;
        }
        if !matches!(config(&call.receiver), Some(Config::Nn { .. })) {
            return;
        }
        let name = Ident::new(self.choice.type_name(), proc_macro2::Span::call_site());
        *call.receiver = syn::parse_quote!(tchmem::optim::#name::default());
        if self.choice == OptimizerChoice::Lion {
            let lr = &call.args[1];
            let lr: Expr = match strip_parens(lr) {
                Expr::Lit(_) | Expr::Path(_) | Expr::Field(_) | Expr::MethodCall(_) => lr.clone(),
                _ => syn::parse_quote!((#lr)),
            };
            call.args[1] = syn::parse_quote!(#lr / 3.0);
            self.pending.push(
                "tchmem: Lion's sign updates move every weight by the whole learning rate, so \
                 it needs a smaller one than Adam: its authors use 3-10x smaller than AdamW's. \
                 This takes lr / 3."
                    .to_string(),
            );
        }
    }

    fn visit_type_path_mut(&mut self, ty: &mut syn::TypePath) {
        visit_mut::visit_type_path_mut(self, ty);
        self.types.fix(ty);
    }
}
