//! An index of a cell's blocks: which is a loop body, a function body, a closure body, and how
//! they nest. A rewrite finds what it needs here, then edits the one block it names by address
//! (the tree is not moved between the two).

use syn::visit::{self, Visit};
use syn::visit_mut::{self, VisitMut};
use syn::{Block, Expr, ExprForLoop, ExprLoop, ExprWhile, Signature};

/// A loop expression.
#[derive(Clone, Copy)]
pub(crate) enum Loop<'a> {
    /// `for pat in iter { … }`
    For(&'a ExprForLoop),
    /// `while cond { … }`
    While(&'a ExprWhile),
    /// `loop { … }`
    Plain(&'a ExprLoop),
}

impl<'a> Loop<'a> {
    pub fn label(&self) -> Option<&'a syn::Label> {
        match self {
            Loop::For(e) => e.label.as_ref(),
            Loop::While(e) => e.label.as_ref(),
            Loop::Plain(e) => e.label.as_ref(),
        }
    }
}

/// What a block is the body of.
#[derive(Clone, Copy)]
pub(crate) enum Role<'a> {
    /// The cell itself.
    Root,
    /// A `for`, `while` or `loop` body.
    Loop(Loop<'a>),
    /// A function's body (free, impl or trait function).
    Fn(&'a Signature),
    /// A closure's body.
    Closure,
    /// Any other block (`if`, `match` arm, `unsafe`, a plain block, …).
    Other,
}

/// One block of the cell.
pub(crate) struct BlockInfo<'a> {
    pub block: &'a Block,
    pub parent: Option<usize>,
    pub role: Role<'a>,
    /// Blocks with equal `fn_scope` are in the same function or closure body (`break` and
    /// `return` reach across them).
    pub fn_scope: usize,
    /// Blocks with equal `item_scope` are in the same function item (local variables are
    /// visible across them; closures capture).
    pub item_scope: usize,
}

/// All blocks of a cell, outer before inner; index 0 is the cell.
pub(crate) struct Tree<'a> {
    pub blocks: Vec<BlockInfo<'a>>,
}

impl<'a> Tree<'a> {
    pub fn of(root: &'a Block) -> Tree<'a> {
        let mut collector = Collector {
            blocks: Vec::new(),
            stack: Vec::new(),
            pending: Some(Role::Root),
            fn_scope: 0,
            item_scope: 0,
            scopes: 0,
        };
        collector.visit_block(root);
        Tree {
            blocks: collector.blocks,
        }
    }

    /// `id` and the blocks around it, innermost first.
    pub fn ancestors(&self, id: usize) -> impl Iterator<Item = usize> + '_ {
        std::iter::successors(Some(id), move |&i| self.blocks[i].parent)
    }

    /// The loop bodies around block `id` (itself included) that `break` there can reach,
    /// innermost first.
    pub fn loops(&self, id: usize) -> Vec<usize> {
        let scope = self.blocks[id].fn_scope;
        self.ancestors(id)
            .take_while(|&i| self.blocks[i].fn_scope == scope)
            .filter(|&i| matches!(self.blocks[i].role, Role::Loop(_)))
            .collect()
    }

    /// Whether a variable bound in block `outer` can be visible in block `inner`.
    pub fn sees(&self, inner: usize, outer: usize) -> bool {
        self.blocks[inner].item_scope == self.blocks[outer].item_scope
            && self.ancestors(inner).any(|i| i == outer)
    }
}

struct Collector<'a> {
    blocks: Vec<BlockInfo<'a>>,
    stack: Vec<usize>,
    /// The role of the next block visited (set just before visiting a body).
    pending: Option<Role<'a>>,
    fn_scope: usize,
    item_scope: usize,
    scopes: usize,
}

impl<'a> Collector<'a> {
    fn body(&mut self, role: Role<'a>, block: &'a Block) {
        self.pending = Some(role);
        self.visit_block(block);
    }

    /// Visits a function or closure: a new scope for `break`; for functions, for variables.
    fn scoped(&mut self, item: bool, f: impl FnOnce(&mut Self)) {
        let saved = (self.fn_scope, self.item_scope);
        self.scopes += 1;
        self.fn_scope = self.scopes;
        if item {
            self.item_scope = self.scopes;
        }
        f(self);
        (self.fn_scope, self.item_scope) = saved;
    }
}

impl<'a> Visit<'a> for Collector<'a> {
    fn visit_block(&mut self, block: &'a Block) {
        let role = self.pending.take().unwrap_or(Role::Other);
        let id = self.blocks.len();
        self.blocks.push(BlockInfo {
            block,
            parent: self.stack.last().copied(),
            role,
            fn_scope: self.fn_scope,
            item_scope: self.item_scope,
        });
        self.stack.push(id);
        visit::visit_block(self, block);
        self.stack.pop();
    }

    fn visit_expr_for_loop(&mut self, e: &'a ExprForLoop) {
        self.visit_pat(&e.pat);
        self.visit_expr(&e.expr);
        self.body(Role::Loop(Loop::For(e)), &e.body);
    }

    fn visit_expr_while(&mut self, e: &'a ExprWhile) {
        self.visit_expr(&e.cond);
        self.body(Role::Loop(Loop::While(e)), &e.body);
    }

    fn visit_expr_loop(&mut self, e: &'a ExprLoop) {
        self.body(Role::Loop(Loop::Plain(e)), &e.body);
    }

    fn visit_expr_closure(&mut self, e: &'a syn::ExprClosure) {
        self.scoped(false, |this| {
            if let Expr::Block(body) = &*e.body {
                this.body(Role::Closure, &body.block);
            } else {
                this.visit_expr(&e.body);
            }
        });
    }

    fn visit_item_fn(&mut self, f: &'a syn::ItemFn) {
        self.scoped(true, |this| this.body(Role::Fn(&f.sig), &f.block));
    }

    fn visit_impl_item_fn(&mut self, f: &'a syn::ImplItemFn) {
        self.scoped(true, |this| this.body(Role::Fn(&f.sig), &f.block));
    }

    fn visit_trait_item_fn(&mut self, f: &'a syn::TraitItemFn) {
        if let Some(block) = &f.default {
            self.scoped(true, |this| this.body(Role::Fn(&f.sig), block));
        }
    }
}

/// Calls `edit` on the block at address `target` inside `root`.
pub(crate) fn edit_block(root: &mut Block, target: *const Block, edit: impl FnOnce(&mut Block)) {
    struct Editor<F> {
        target: *const Block,
        edit: Option<F>,
    }
    impl<F: FnOnce(&mut Block)> VisitMut for Editor<F> {
        fn visit_block_mut(&mut self, block: &mut Block) {
            if self.edit.is_none() {
                return;
            }
            if std::ptr::eq(block, self.target) {
                if let Some(edit) = self.edit.take() {
                    edit(block);
                }
                return;
            }
            visit_mut::visit_block_mut(self, block);
        }
    }
    Editor {
        target,
        edit: Some(edit),
    }
    .visit_block_mut(root);
}

/// Gives the loop whose body is at address `body` the label `label`.
pub(crate) fn label_loop(root: &mut Block, body: *const Block, label: &syn::Label) {
    struct Labeller<'l> {
        body: *const Block,
        label: &'l syn::Label,
    }
    impl VisitMut for Labeller<'_> {
        fn visit_expr_mut(&mut self, expr: &mut Expr) {
            let slot = match expr {
                Expr::ForLoop(e) if std::ptr::eq(&e.body, self.body) => &mut e.label,
                Expr::While(e) if std::ptr::eq(&e.body, self.body) => &mut e.label,
                Expr::Loop(e) if std::ptr::eq(&e.body, self.body) => &mut e.label,
                _ => return visit_mut::visit_expr_mut(self, expr),
            };
            *slot = Some(self.label.clone());
        }
    }
    Labeller { body, label }.visit_block_mut(root);
}
