//! The layout's import rules, read from the paths the code of `rust/` names
//! (`crate::...`, `super::...`, `self::...`, with their `use` groups;
//! comments and literals left out):
//!
//! - only the data plane (`serve/`) and the binding layer (`py/`, which
//!   wraps the data plane for Python) name `crate::serve`; only `py/` and
//!   the `#[pymodule]` in `lib.rs` name pyo3;
//! - no circle of imports between modules, at any depth: a file's module
//!   depends on the module a path it names resolves to (the longest module
//!   prefix of the path), seen from their closest common parent (so
//!   `serve/engine/dispatch.rs` naming `super::super::front::Door` is
//!   `serve::engine -> serve::front`); a module naming its own parent or
//!   child is not an edge, and a module's tests count as the module. Any
//!   circle fails (the last seven moved below what imported them in issue
//!   30).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

/// A module path (`["serve", "engine"]`; the crate root is empty).
type Module = Vec<String>;

/// A source file (relative to `rust/`), its module and its tokens.
struct Source {
    file: String,
    module: Module,
    tokens: Vec<String>,
}

/// Every source file under `rust/`; this file, whose tests name what they
/// look for, left out.
fn sources() -> Vec<Source> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<Source>) {
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
                out.push(source(&rel.to_string_lossy().replace('\\', "/"), &text));
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("rust");
    let mut out = Vec::new();
    walk(&root, &root, &mut out);
    out
}

fn source(file: &str, text: &str) -> Source {
    Source {
        file: file.to_owned(),
        module: module_of(file),
        tokens: tokens(text),
    }
}

/// The module a file defines (`serve/engine/mod.rs` -> `serve::engine`,
/// `lib.rs` -> the root).
fn module_of(file: &str) -> Module {
    let mut parts: Module = file
        .strip_suffix(".rs")
        .unwrap_or(file)
        .split('/')
        .map(str::to_owned)
        .collect();
    if parts.last().is_some_and(|p| p == "mod") || parts == ["lib"] {
        parts.pop();
    }
    parts
}

/// The identifiers, `::` and punctuation of `text`, without comments,
/// string, byte and char literals (lifetimes are left as `'` and a name).
fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        let c = rest.chars().next().unwrap_or(' ');
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |e| e + 2);
        } else if let Some(n) = literal(rest) {
            i += n;
        } else if c.is_alphabetic() || c == '_' {
            let n = rest
                .find(|ch: char| !(ch.is_alphanumeric() || ch == '_'))
                .unwrap_or(rest.len());
            out.push(rest[..n].to_owned());
            i += n;
        } else if rest.starts_with("::") {
            out.push("::".to_owned());
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push(c.to_string());
            }
            i += c.len_utf8();
        }
    }
    out
}

/// The length of the string, raw string or char literal `rest` starts
/// with (a `b` prefix included), if it starts with one.
fn literal(rest: &str) -> Option<usize> {
    let prefix = usize::from(rest.starts_with('b'));
    let body = &rest[prefix..];
    let len = if let Some(raw) = body.strip_prefix('r') {
        let hashes = raw.len() - raw.trim_start_matches('#').len();
        let quoted = raw[hashes..].strip_prefix('"')?;
        let close = format!("\"{}", "#".repeat(hashes));
        1 + hashes + 1 + quoted.find(&close)? + close.len()
    } else if let Some(quoted) = body.strip_prefix('"') {
        let mut escaped = false;
        let end = quoted.char_indices().find(|&(_, ch)| {
            let end = ch == '"' && !escaped;
            escaped = ch == '\\' && !escaped;
            end
        })?;
        1 + end.0 + 1
    } else if let Some(quoted) = body.strip_prefix('\'') {
        let mut chars = quoted.char_indices();
        let (_, first) = chars.next()?;
        if first == '\\' {
            1 + 2 + quoted.get(2..)?.find('\'')? + 1
        } else if chars.next().is_some_and(|(_, ch)| ch == '\'') {
            1 + first.len_utf8() + 1
        } else {
            return None; // a lifetime or a label
        }
    } else {
        return None;
    };
    Some(prefix + len)
}

fn is_name(token: &str) -> bool {
    token
        .chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// The paths of the use tree at `t[i..]` under `path`, into `out`; returns
/// the index after it (`a::{b::C, d as e, self}`, `a::*`).
fn use_tree(t: &[String], mut i: usize, mut path: Module, out: &mut Vec<Module>) -> usize {
    loop {
        match t.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                while t.get(i).is_some_and(|x| x != "}") {
                    let next = use_tree(t, i, path.clone(), out);
                    i = if next == i { i + 1 } else { next };
                    if t.get(i).is_some_and(|x| x == ",") {
                        i += 1;
                    }
                }
                return i + 1;
            }
            Some(name) if is_name(name) => {
                if name != "self" {
                    path.push(name.to_owned());
                }
                i += 1;
                if t.get(i).is_some_and(|x| x == "::") {
                    i += 1;
                    continue;
                }
                if t.get(i).is_some_and(|x| x == "as") {
                    i += 2;
                }
                out.push(path);
                return i;
            }
            Some("*") => {
                out.push(path);
                return i + 1;
            }
            _ => {
                out.push(path);
                return i;
            }
        }
    }
}

/// The absolute paths a source names through `crate::`, `super::` and
/// `self::` (inline modules, such as `mod tests { use super::*; }`, taken
/// into account).
fn paths(src: &Source) -> Vec<Module> {
    let t = &src.tokens;
    let mut out = Vec::new();
    // The inline modules the cursor is in, with the brace depth each opened at.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < t.len() {
        let word = t[i].as_str();
        let next = |k: usize| t.get(i + k).map(String::as_str);
        match word {
            "mod" if next(1).is_some_and(is_name) && next(2) == Some("{") => {
                inline.push((t[i + 1].clone(), depth));
                i += 2;
                continue;
            }
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|&(_, d)| d == depth) {
                    inline.pop();
                }
            }
            "crate" | "super" | "self" if next(1) == Some("::") && (i == 0 || t[i - 1] != "::") => {
                let mut base: Module = Vec::new();
                if word != "crate" {
                    base.clone_from(&src.module);
                    base.extend(inline.iter().map(|(name, _)| name.clone()));
                }
                let mut j = i;
                while t
                    .get(j)
                    .is_some_and(|x| x == "super" || x == "self" || x == "crate")
                    && t.get(j + 1).is_some_and(|x| x == "::")
                {
                    if t[j] == "super" {
                        base.pop();
                    }
                    j += 2;
                }
                i = use_tree(t, j, base, &mut out);
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The longest module prefix of `path` (a path names an item of that module).
fn resolve<'a>(path: &[String], modules: &'a BTreeSet<Module>) -> Option<&'a Module> {
    (0..=path.len()).rev().find_map(|n| modules.get(&path[..n]))
}

/// The import graph between sibling modules, at every depth.
fn graph(files: &[Source]) -> BTreeMap<String, BTreeSet<String>> {
    let modules: BTreeSet<Module> = files.iter().map(|s| s.module.clone()).collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for src in files {
        for path in paths(src) {
            let Some(to) = resolve(&path, &modules) else {
                continue;
            };
            let from = &src.module;
            let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == to.len() {
                continue; // itself, a parent or a child
            }
            g.entry(from[..=common].join("::"))
                .or_default()
                .insert(to[..=common].join("::"));
        }
    }
    g
}

/// A shortest path from `from` to `to` in `g` (both ends included).
fn path_between(
    g: &BTreeMap<String, BTreeSet<String>>,
    from: &str,
    to: &str,
) -> Option<Vec<String>> {
    let mut before: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = VecDeque::from([from]);
    while let Some(m) = queue.pop_front() {
        for n in g.get(m).into_iter().flatten() {
            if n == to {
                let mut out = vec![to.to_owned(), m.to_owned()];
                let mut at = m;
                while let Some(&p) = before.get(at) {
                    out.push(p.to_owned());
                    at = p;
                }
                out.reverse();
                return Some(out);
            }
            if n != from && !before.contains_key(n.as_str()) {
                before.insert(n, m);
                queue.push_back(n);
            }
        }
    }
    None
}

/// Every circle of `g`, one per edge that closes one, as
/// `a -> b -> ... -> a` (the shortest circle through that edge).
fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (from, tos) in g {
        for to in tos {
            if let Some(back) = path_between(g, to, from) {
                let mut circle = vec![from.clone()];
                circle.extend(back);
                // The same circle from each of its edges: name it from its least module.
                let n = circle.len() - 1;
                let start = (0..n).min_by_key(|&k| &circle[k]).unwrap_or(0);
                let turned: Vec<&str> = (0..=n).map(|k| circle[(start + k) % n].as_str()).collect();
                out.insert(turned.join(" -> "));
            }
        }
    }
    out
}

/// Files that break the rules on who names `serve` and pyo3.
fn misplaced(files: &[Source]) -> Vec<String> {
    let mut bad = Vec::new();
    for src in files {
        let top = src.module.first().map_or("", String::as_str);
        let names_serve = paths(src)
            .iter()
            .any(|p| p.first().is_some_and(|m| m == "serve"));
        if top != "serve" && top != "py" && names_serve {
            bad.push(format!("{} imports crate::serve", src.file));
        }
        if top != "py" && src.file != "lib.rs" && src.tokens.iter().any(|t| t == "pyo3") {
            bad.push(format!("{} imports pyo3", src.file));
        }
    }
    bad
}

#[test]
fn only_the_data_plane_and_the_bindings_name_serve_and_only_the_bindings_pyo3() {
    assert_eq!(misplaced(&sources()), Vec::<String>::new());
}

#[test]
fn no_import_circle_between_modules() {
    let files = sources();
    let g = graph(&files);
    for module in ["kv", "pick", "serve", "serve::engine", "serve::front"] {
        assert!(g.contains_key(module), "{module} is a module that imports");
    }
    assert_eq!(circles(&g), BTreeSet::new(), "import circles");
}

#[test]
fn the_rules_see_what_they_check() {
    let files =
        |v: &[(&str, &str)]| -> Vec<Source> { v.iter().map(|(f, t)| source(f, t)).collect() };
    let bad = files(&[
        ("lib.rs", "mod kv; mod serve; mod prefix; mod pick; mod budget; mod compress;"),
        ("kv/mod.rs", "use crate::serve::config::KvEventsSpec;"),
        ("serve/mod.rs", "pub mod config; pub mod engine; pub mod front;"),
        ("serve/config.rs", "pub struct Spec;"),
        ("serve/engine/mod.rs", "use super::config::Spec; mod tests { use super::*; }"),
        (
            "serve/engine/dispatch.rs",
            "fn f() { let s = \"super::front::x\"; let c = '\"'; super::super::front::go::<u8>(); }",
        ),
        ("serve/front.rs", "use crate::{kv, serve::{config::Spec, engine::{self as e}}};"),
        ("pick/a.rs", "use pyo3::prelude::*;"),
        (
            "prefix.rs",
            "// crate::serve in a comment; pyo3 too\nuse crate::pick::X; /* crate::serve */",
        ),
        ("pick/mod.rs", "pub mod a; use crate::prefix::Y; const S: &str = r#\"pyo3 \"crate::serve\"\"#;"),
        ("budget.rs", "fn f<'a>(x: &'a str) -> char { let _ = crate::compress::MAX; 'b' }"),
        ("compress.rs", "pub const MAX: u64 = 1; use crate::budget::f;"),
    ]);
    assert_eq!(
        misplaced(&bad),
        ["kv/mod.rs imports crate::serve", "pick/a.rs imports pyo3"]
    );
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        circles(&graph(&bad)),
        names(&[
            "budget -> compress -> budget",
            "kv -> serve -> kv",
            "pick -> prefix -> pick",
            "serve::engine -> serve::front -> serve::engine",
        ])
    );
    // The engine's `mod tests { use super::*; }` names the engine itself,
    // not `serve`; a circle through one known import is not reported.
    let g = graph(&bad);
    assert_eq!(
        g["serve::engine"],
        names(&["serve::config", "serve::front"])
    );
    assert_eq!(
        g["serve::front"],
        names(&["serve::config", "serve::engine"])
    );
    let mut without = g.clone();
    without
        .get_mut("serve::front")
        .expect("front")
        .remove("serve::engine");
    assert!(!circles(&without).iter().any(|c| c.contains("serve::front")));
}
