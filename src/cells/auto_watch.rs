//! VarStores are watched where a cell makes them: `tchmem::watch(&vs);` goes in right after
//! `let vs = nn::VarStore::new(…);`, on the same line (so the lines compile errors name do not
//! move), and the cell's own memory record counts the store as parameters. Stores made any other
//! way are found after the cell ran, from the variables' types, at the cost of a second compile.

use crate::cell_syntax;

/// `code` with a watch call after each `let` that makes a VarStore (nested ones too: a store
/// made inside a block is watched while it lives), and the names of the session's variables
/// (top-level `let`s) watched that way.
pub fn watch_where_made(code: &str) -> (String, Vec<String>) {
    let mut bindings = cell_syntax::var_store_bindings(code);
    if bindings.is_empty() {
        return (code.to_string(), Vec::new());
    }
    // From the end, so that earlier insertion points stay where they were.
    bindings.sort_by_key(|b| std::cmp::Reverse((b.line, b.column)));
    let mut lines: Vec<String> = code.split('\n').map(str::to_string).collect();
    let mut names = Vec::new();
    for binding in bindings {
        let Some(line) = lines.get_mut(binding.line) else {
            continue;
        };
        let at = line
            .char_indices()
            .nth(binding.column)
            .map_or(line.len(), |(byte, _)| byte);
        line.insert_str(at, &format!(" tchmem::watch(&{});", binding.name));
        if binding.top_level {
            names.push(binding.name);
        }
    }
    (lines.join("\n"), names)
}

#[cfg(test)]
mod tests {
    use super::watch_where_made;

    #[test]
    fn a_var_store_is_watched_on_the_line_that_makes_it() {
        let code = "use tch::nn;\nlet vs = nn::VarStore::new(tch::Device::Cpu); // store\n\
                    let lin = nn::linear(vs.root(), 2, 2, Default::default());\n\
                    let typed: tch::nn::VarStore = make();\nlet other = f(nn::VarStore::new(d));";
        let (watched, names) = watch_where_made(code);
        assert_eq!(names, ["typed", "vs"]);
        let lines: Vec<&str> = watched.lines().collect();
        assert_eq!(
            lines[1],
            "let vs = nn::VarStore::new(tch::Device::Cpu); tchmem::watch(&vs); // store"
        );
        assert_eq!(
            lines[3],
            "let typed: tch::nn::VarStore = make(); tchmem::watch(&typed);"
        );
        assert_eq!(lines.len(), code.lines().count());
        assert!(!lines[4].contains("watch"), "{}", lines[4]);
    }

    #[test]
    fn cells_without_a_new_store_are_left_as_they_are() {
        for code in [
            "let x = 1;",
            "let x = ;",
            "let other = f(nn::VarStore::new(d));",
        ] {
            assert_eq!(watch_where_made(code), (code.to_string(), Vec::new()));
        }
    }

    #[test]
    fn a_store_made_in_a_block_or_function_is_watched_there_but_is_no_session_variable() {
        let code =
            "{\n    let vs = nn::VarStore::new(d);\n}\nfn f() { let s = nn::VarStore::new(d); }";
        let (watched, names) = watch_where_made(code);
        assert!(names.is_empty());
        assert!(
            watched.contains("let vs = nn::VarStore::new(d); tchmem::watch(&vs);"),
            "{watched}"
        );
        assert!(
            watched.contains("let s = nn::VarStore::new(d); tchmem::watch(&s); }"),
            "{watched}"
        );
    }
}
