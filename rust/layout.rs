//! The layout's import rules, read from the `use` lines and paths of
//! `rust/` (comments left out): only the data plane (`serve/`) and the
//! binding layer (`py/`, which wraps the data plane for Python) name
//! `crate::serve`; only `py/` and the `#[pymodule]` in `lib.rs` name pyo3;
//! and no circle of imports between the top-level modules runs through
//! `kv`, `pick` or `serve` (the pure index, the picker and the data plane).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each source file (relative to `rust/`) and its text without comments;
/// this file, whose tests name what they look for, left out.
fn sources() -> Vec<(String, String)> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .expect("rust/ is readable")
            .map(|e| e.expect("an entry").path())
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                walk(&path, root, out);
            } else if path.extension().is_some_and(|e| e == "rs") && !path.ends_with("layout.rs") {
                let text = std::fs::read_to_string(&path).expect("a source file");
                let rel = path.strip_prefix(root).expect("under rust/");
                out.push((rel.to_string_lossy().replace('\\', "/"), code(&text)));
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("rust");
    let mut out = Vec::new();
    walk(&root, &root, &mut out);
    out
}

/// The text without `//` comments (doc comments name modules freely).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level module a file belongs to (`kv/index.rs` -> `kv`).
fn top(file: &str) -> &str {
    let first = file.split('/').next().unwrap_or(file);
    first.strip_suffix(".rs").unwrap_or(first)
}

/// The top-level modules `text` names as `crate::<module>`.
fn imports(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

/// Files that break the rules on who names `serve` and pyo3.
fn misplaced(files: &[(String, String)]) -> Vec<String> {
    let mut bad = Vec::new();
    for (file, text) in files {
        let module = top(file);
        if module != "serve" && module != "py" && imports(text).contains("serve") {
            bad.push(format!("{file} imports crate::serve"));
        }
        if module != "py" && file != "lib.rs" && text.contains("pyo3") {
            bad.push(format!("{file} imports pyo3"));
        }
    }
    bad
}

/// The import graph between top-level modules.
fn graph(files: &[(String, String)]) -> BTreeMap<String, BTreeSet<String>> {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, text) in files {
        let module = top(file);
        let to: Vec<String> = imports(text).into_iter().filter(|m| m != module).collect();
        g.entry(module.to_owned()).or_default().extend(to);
    }
    g
}

/// The modules reachable from `from` (itself excluded unless on a circle).
fn reachable(g: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack: Vec<&str> = g
        .get(from)
        .into_iter()
        .flatten()
        .map(|s| s.as_str())
        .collect();
    while let Some(m) = stack.pop() {
        if seen.insert(m.to_owned()) {
            stack.extend(g.get(m).into_iter().flatten().map(|s| s.as_str()));
        }
    }
    seen
}

/// The circles through `module`: the modules it reaches that reach it back.
fn circle(g: &BTreeMap<String, BTreeSet<String>>, module: &str) -> BTreeSet<String> {
    reachable(g, module)
        .into_iter()
        .filter(|m| reachable(g, m).contains(module))
        .collect()
}

#[test]
fn only_the_data_plane_and_the_bindings_name_serve_and_only_the_bindings_pyo3() {
    assert_eq!(misplaced(&sources()), Vec::<String>::new());
}

#[test]
fn no_import_circle_runs_through_kv_pick_or_serve() {
    let g = graph(&sources());
    for module in ["kv", "pick", "serve"] {
        assert!(g.contains_key(module), "{module} is a module");
        assert_eq!(
            circle(&g, module),
            BTreeSet::new(),
            "circle through {module}"
        );
    }
}

#[test]
fn the_rules_see_what_they_check() {
    let files = |v: &[(&str, &str)]| -> Vec<(String, String)> {
        v.iter().map(|(f, t)| (f.to_string(), code(t))).collect()
    };
    let bad = files(&[
        ("kv/mod.rs", "use crate::serve::config::KvEventsSpec;"),
        ("serve/x.rs", "use crate::serve::y; use crate::kv;"),
        ("pick/a.rs", "use pyo3::prelude::*;"),
        (
            "prefix.rs",
            "// crate::serve in a comment; pyo3 too\nuse crate::pick::X;",
        ),
        ("pick/mod.rs", "use crate::prefix::Y;"),
    ]);
    assert_eq!(
        misplaced(&bad),
        ["kv/mod.rs imports crate::serve", "pick/a.rs imports pyo3"]
    );
    let g = graph(&bad);
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(circle(&g, "kv"), names(&["kv", "serve"]));
    assert_eq!(circle(&g, "pick"), names(&["pick", "prefix"]));
}
