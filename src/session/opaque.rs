//! Variables whose type is an `impl Trait`, kept anyway.
//!
//! evcxr keeps every top-level variable of a cell between cells, so it must write its type, and
//! refuses one whose type is opaque ("The variable `gpt` has type `impl ModuleT` which cannot be
//! persisted"): tch-rs's examples build their models in functions returning `impl ModuleT`, and
//! `let gpt = gpt(vs.root(), cfg);` failed. The cell is then run again with that variable boxed:
//! tch's module traits as the runtime's `DynModuleT` / `DynModule` (modules themselves, so
//! `xs.apply_t(&gpt, train)` works on them), any other trait as `Box<dyn Trait>` (its methods
//! work through the box). The `let` gains its type and the call that boxes, on its own lines.

/// The variable and its type in evcxr's "The variable `x` has type `impl T` which cannot be
/// persisted."
pub fn opaque_variable(message: &str) -> Option<(&str, &str)> {
    let rest = message.strip_prefix("The variable `")?;
    let (variable, rest) = rest.split_once("` has type `")?;
    let (ty, _) = rest.split_once("` which cannot be persisted")?;
    ty.starts_with("impl ").then_some((variable, ty))
}

/// The type a variable of opaque type `ty` is kept as.
pub fn kept_as(ty: &str) -> String {
    boxed(ty).0
}

/// The type a variable of opaque type `ty` is kept as, and the function that boxes its value.
fn boxed(ty: &str) -> (String, String) {
    let bounds = ty.trim_start_matches("impl ").trim();
    let first = bounds.split('+').next().unwrap_or(bounds).trim();
    let name = first.rsplit("::").next().unwrap_or(first);
    match name {
        "ModuleT" => (
            "tchmem::boxed::DynModuleT".into(),
            "tchmem::boxed::DynModuleT::new".into(),
        ),
        "Module" => (
            "tchmem::boxed::DynModule".into(),
            "tchmem::boxed::DynModule::new".into(),
        ),
        _ => (format!("Box<dyn {bounds}>"), "Box::new".into()),
    }
}

/// The cell with the top-level `let variable = …;` (no type written) keeping a boxed value, or
/// `None` when there is no such `let`.
pub fn box_variable(code: &str, variable: &str, ty: &str) -> Option<String> {
    let found = super::top_let::find(code, variable, super::top_let::any_value)?;
    let (kept_as, boxing) = boxed(ty);
    let (pattern_end, (value_start, value_end)) = (found.pattern_end, found.value);
    Some(format!(
        "{}: {kept_as}{}{boxing}({}){}",
        &code[..pattern_end],
        &code[pattern_end..value_start],
        &code[value_start..value_end],
        &code[value_end..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_evcxr_message() {
        let message = "The variable `model` has type `impl ModuleT` which cannot be persisted.\n\
                       You might be able to fix this by creating a `Box<dyn YourType>`.";
        assert_eq!(opaque_variable(message), Some(("model", "impl ModuleT")));
        assert_eq!(opaque_variable("The variable `f` is a closure"), None);
    }

    #[test]
    fn tch_modules_become_the_runtime_s_boxed_modules() {
        let code = "let vs = nn::VarStore::new(Device::Cpu);\nlet mut gpt = gpt(vs.root() / \"gpt\", cfg);\nlet n = 1;";
        assert_eq!(
            box_variable(code, "gpt", "impl ModuleT").unwrap(),
            "let vs = nn::VarStore::new(Device::Cpu);\nlet mut gpt: tchmem::boxed::DynModuleT = \
             tchmem::boxed::DynModuleT::new(gpt(vs.root() / \"gpt\", cfg));\nlet n = 1;"
        );
        assert!(box_variable("let m = lin(p);", "m", "impl tch::nn::Module")
            .unwrap()
            .starts_with(
                "let m: tchmem::boxed::DynModule = tchmem::boxed::DynModule::new(lin(p));"
            ));
    }

    #[test]
    fn other_traits_are_boxed_as_trait_objects() {
        assert_eq!(
            box_variable(
                "// 张量\nlet it = (0..3).map(|x| x * 2);",
                "it",
                "impl Iterator<Item = i32>"
            )
            .unwrap(),
            "// 张量\nlet it: Box<dyn Iterator<Item = i32>> = Box::new((0..3).map(|x| x * 2));"
        );
        assert_eq!(box_variable("let (a, b) = f();", "a", "impl Clone"), None);
        assert_eq!(box_variable("{ let a = f(); }", "a", "impl Clone"), None);
        assert_eq!(
            box_variable(":dep foo = \"1\"\nlet a = f();", "a", "impl Clone").unwrap(),
            ":dep foo = \"1\"\nlet a: Box<dyn Clone> = Box::new(f());"
        );
    }
}
