//! `cargo xtask check-arch`: ARCHITECTURE.md's dependency rules, checked.
//!
//! The rules are the ```` ```arch-rules ```` block of ARCHITECTURE.md (read
//! here, so the document and the check cannot disagree):
//!
//! - `crate NAME: DEPS…` — the workspace crates `NAME` may depend on
//!   (normal dependencies; dev-dependencies are free). Every workspace crate
//!   has exactly one such line.
//! - `runtime: CRATES…` — crates that do I/O or run tasks.
//! - `io: PATTERNS…` — what a core's `src/` never says outside comments.
//! - `core NAME [except FILES…]` — a pure core: no `runtime` crate among its
//!   normal dependencies however deep (with the core's own features, as
//!   `cargo build -p NAME` resolves them), no `io` pattern in its `src/`
//!   but in the files named.
//! - `core-files NAME: FILES…` — only the source check, on those files (a
//!   core that shares its crate with a driver).
//! - `no-runtime NAME` — only the dependency check.
//! - `sockets: PATTERNS…` and `socket-crates: CRATES…` — only those crates
//!   name a socket in their `src/`.
//! - `exception NAME -> DEP: REASON` — a known violation, printed each run;
//!   the check fails once it is no longer needed, so that it gets removed.
//!
//! The dependency graph is `cargo metadata`'s. Its `resolve` section unifies
//! features across the whole workspace (lapin turns on `amq-protocol`'s
//! tokio support for everyone), so the features of each core are resolved
//! again here from the packages' manifests, starting from the core alone.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde_json::Value;

/// The document that holds the rules, under the workspace root.
const DOC: &str = "ARCHITECTURE.md";
/// The fence that opens the rules block.
const FENCE: &str = "```arch-rules";

/// Runs the check: reads the rules and `cargo metadata`, prints the known
/// exceptions and fails listing every violation.
pub(crate) fn main(root: &Path) -> anyhow::Result<()> {
    let doc = std::fs::read_to_string(root.join(DOC)).context("reading ARCHITECTURE.md")?;
    let rules = Rules::parse(&doc)?;
    let out = crate::cargo()
        .args(["metadata", "--format-version", "1"])
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let meta: Value = serde_json::from_slice(&out.stdout).context("parsing cargo metadata")?;
    let graph = Graph::new(&meta)?;
    let report = check(&rules, &graph, &|krate, file| {
        let dir = graph.dir(krate)?;
        std::fs::read_to_string(dir.join(file)).ok()
    });
    for line in &report.notes {
        println!("note: {line}");
    }
    if report.errors.is_empty() {
        println!(
            "check-arch: {} crates, {} cores: the workspace keeps ARCHITECTURE.md's rules",
            graph.members.len(),
            rules.cores.len()
        );
        return Ok(());
    }
    for e in &report.errors {
        eprintln!("error: {e}");
    }
    bail!(
        "{} violation(s) of ARCHITECTURE.md's rules (the `arch-rules` block)",
        report.errors.len()
    )
}

/// How strictly a crate is held to the core rules.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Core {
    /// No runtime crate below it; no I/O pattern in `src/` but in these files.
    Pure { except: BTreeSet<String> },
    /// Only the source check, on these files.
    Files(BTreeSet<String>),
    /// Only the dependency check.
    NoRuntime,
}

/// The rules of the `arch-rules` block.
#[derive(Debug, Default)]
struct Rules {
    /// Each workspace crate and the workspace crates it may depend on.
    layers: BTreeMap<String, BTreeSet<String>>,
    /// Crates no core may reach.
    runtime: BTreeSet<String>,
    /// Source patterns a core never uses.
    io: Vec<String>,
    /// The cores.
    cores: BTreeMap<String, Core>,
    /// Source patterns that name a socket.
    sockets: Vec<String>,
    /// The crates that may name one.
    socket_crates: BTreeSet<String>,
    /// Known violations (crate, runtime crate) and why.
    exceptions: BTreeMap<(String, String), String>,
}

impl Rules {
    /// Parses the first `arch-rules` block of `doc`.
    fn parse(doc: &str) -> anyhow::Result<Self> {
        let start = doc
            .find(FENCE)
            .with_context(|| format!("{DOC} has no {FENCE} block"))?;
        let body = &doc[start + FENCE.len()..];
        let end = body
            .find("\n```")
            .with_context(|| format!("the {FENCE} block of {DOC} is not closed"))?;
        let mut rules = Self::default();
        for (i, raw) in body[..end].lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            rules
                .line(line)
                .with_context(|| format!("{DOC}, arch-rules line {i}: {raw:?}"))?;
        }
        if rules.layers.is_empty() {
            bail!("the {FENCE} block of {DOC} has no `crate` line");
        }
        Ok(rules)
    }

    /// Takes one line of the block.
    fn line(&mut self, line: &str) -> anyhow::Result<()> {
        let words = |s: &str| -> Vec<String> { s.split_whitespace().map(str::to_owned).collect() };
        let (head, tail) = line.split_once(':').unwrap_or((line, ""));
        let head = words(head);
        let head: Vec<&str> = head.iter().map(String::as_str).collect();
        match head.as_slice() {
            ["crate", name] => {
                let deps = words(tail).into_iter().collect();
                if self.layers.insert((*name).to_owned(), deps).is_some() {
                    bail!("crate {name} has two lines");
                }
            }
            ["runtime"] => self.runtime.extend(words(tail)),
            ["io"] => self.io.extend(words(tail)),
            ["sockets"] => self.sockets.extend(words(tail)),
            ["socket-crates"] => self.socket_crates.extend(words(tail)),
            ["core", name] | ["core", name, "except"] => {
                let except = words(tail).into_iter().collect();
                self.core(name, Core::Pure { except })?;
            }
            ["core-files", name] => {
                let files: BTreeSet<String> = words(tail).into_iter().collect();
                if files.is_empty() {
                    bail!("core-files {name} names no file");
                }
                self.core(name, Core::Files(files))?;
            }
            ["no-runtime", name] => self.core(name, Core::NoRuntime)?,
            ["exception", name, "->", dep] => {
                let reason = tail.trim();
                if reason.is_empty() {
                    bail!("an exception needs its reason after the colon");
                }
                self.exceptions
                    .insert(((*name).to_owned(), (*dep).to_owned()), reason.to_owned());
            }
            _ => bail!("not a rule"),
        }
        Ok(())
    }

    fn core(&mut self, name: &str, core: Core) -> anyhow::Result<()> {
        if self.cores.insert(name.to_owned(), core).is_some() {
            bail!("{name} is named a core twice");
        }
        Ok(())
    }
}

/// One dependency as a package's manifest declares it.
#[derive(Debug)]
struct Dep {
    /// The package it names.
    package: String,
    /// The name features use for it (its rename, else the package name).
    key: String,
    /// A normal dependency (not a dev- or build-dependency).
    normal: bool,
    optional: bool,
    default_features: bool,
    features: Vec<String>,
    /// The package id cargo resolved it to, if it is in the graph at all.
    id: Option<String>,
}

/// One package of the graph.
#[derive(Debug)]
struct Package {
    name: String,
    /// Its manifest's directory.
    dir: PathBuf,
    /// Its `[features]` table.
    features: BTreeMap<String, Vec<String>>,
    deps: Vec<Dep>,
}

/// The packages of `cargo metadata`, with each declared dependency tied to
/// the package cargo resolved it to.
#[derive(Debug)]
struct Graph {
    packages: BTreeMap<String, Package>,
    /// The workspace members: name → package id.
    members: BTreeMap<String, String>,
}

impl Graph {
    /// Reads the output of `cargo metadata --format-version 1`.
    fn new(meta: &Value) -> anyhow::Result<Self> {
        let str_of = |v: &Value| v.as_str().map(str::to_owned);
        let list = |v: &Value| -> Vec<String> {
            v.as_array()
                .map(|a| a.iter().filter_map(str_of).collect())
                .unwrap_or_default()
        };
        // Resolved edges: package id → (package name → ids).
        let mut resolved: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
        let nodes = meta["resolve"]["nodes"]
            .as_array()
            .context("cargo metadata has no resolve graph")?;
        let mut names = BTreeMap::new();
        for p in meta["packages"].as_array().context("no packages")? {
            names.insert(
                str_of(&p["id"]).context("a package without id")?,
                str_of(&p["name"]).context("a package without name")?,
            );
        }
        for n in nodes {
            let id = str_of(&n["id"]).context("a node without id")?;
            let edges = resolved.entry(id).or_default();
            for d in n["deps"].as_array().into_iter().flatten() {
                let pkg = str_of(&d["pkg"]).context("an edge without pkg")?;
                let name = names.get(&pkg).cloned().unwrap_or_default();
                edges.entry(name).or_default().push(pkg);
            }
        }
        let mut packages = BTreeMap::new();
        for p in meta["packages"].as_array().into_iter().flatten() {
            let id = str_of(&p["id"]).context("a package without id")?;
            let edges = resolved.get(&id);
            let deps = p["dependencies"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| {
                    let package = str_of(&d["name"]).unwrap_or_default();
                    let key = str_of(&d["rename"]).unwrap_or_else(|| package.clone());
                    // Two versions of one package among the dependencies
                    // (rare): the one whose extern name matches the rename.
                    let candidates = edges.and_then(|e| e.get(&package));
                    let id = candidates.and_then(|c| {
                        if c.len() == 1 {
                            return c.first().cloned();
                        }
                        let extern_name = key.replace('-', "_");
                        c.iter()
                            .find(|id| {
                                nodes.iter().any(|n| {
                                    n["deps"].as_array().into_iter().flatten().any(|e| {
                                        e["pkg"].as_str() == Some(id.as_str())
                                            && e["name"].as_str() == Some(extern_name.as_str())
                                    })
                                })
                            })
                            .or(c.first())
                            .cloned()
                    });
                    Dep {
                        package,
                        key,
                        normal: d["kind"].is_null(),
                        optional: d["optional"].as_bool().unwrap_or(false),
                        default_features: d["uses_default_features"].as_bool().unwrap_or(true),
                        features: list(&d["features"]),
                        id,
                    }
                })
                .collect();
            let features = p["features"]
                .as_object()
                .map(|f| f.iter().map(|(k, v)| (k.clone(), list(v))).collect())
                .unwrap_or_default();
            let manifest = PathBuf::from(str_of(&p["manifest_path"]).unwrap_or_default());
            packages.insert(
                id,
                Package {
                    name: str_of(&p["name"]).unwrap_or_default(),
                    dir: manifest.parent().map(Path::to_path_buf).unwrap_or_default(),
                    features,
                    deps,
                },
            );
        }
        let mut members = BTreeMap::new();
        for id in list(&meta["workspace_members"]) {
            let p = packages
                .get(&id)
                .with_context(|| format!("workspace member {id} is not among the packages"))?;
            members.insert(p.name.clone(), id);
        }
        Ok(Self { packages, members })
    }

    /// The directory of workspace crate `name`.
    fn dir(&self, name: &str) -> Option<&Path> {
        let id = self.members.get(name)?;
        Some(self.packages.get(id)?.dir.as_path())
    }

    /// The workspace crates `name` has as normal dependencies.
    fn workspace_deps(&self, name: &str) -> BTreeSet<String> {
        let Some(p) = self.members.get(name).and_then(|id| self.packages.get(id)) else {
            return BTreeSet::new();
        };
        p.deps
            .iter()
            .filter(|d| d.normal && self.members.contains_key(&d.package))
            .map(|d| d.package.clone())
            .collect()
    }

    /// Every package `root` builds with (normal dependencies, however deep,
    /// with the features `cargo build -p root` turns on), each with the
    /// package that first brought it in (`None` for `root`).
    fn closure(&self, root: &str) -> BTreeMap<String, Option<String>> {
        let mut parent: BTreeMap<String, Option<String>> = BTreeMap::new();
        let Some(root) = self.members.get(root) else {
            return parent;
        };
        // Features on per package; optional dependencies on per package.
        let mut on: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut deps_on: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        parent.insert(root.clone(), None);
        on.entry(root.clone()).or_default().insert("default".into());
        // A fixed point: features only ever get turned on.
        let mut queue: VecDeque<String> = VecDeque::from([root.clone()]);
        while let Some(id) = queue.pop_front() {
            let Some(p) = self.packages.get(&id) else {
                continue;
            };
            // The package's features, expanded.
            let mut feats: BTreeSet<String> = BTreeSet::new();
            let mut todo: Vec<String> = on.get(&id).into_iter().flatten().cloned().collect();
            let mut dep_feats: Vec<(String, String, bool)> = Vec::new();
            let mut enabled_deps: BTreeSet<String> = deps_on.get(&id).cloned().unwrap_or_default();
            while let Some(f) = todo.pop() {
                if !feats.insert(f.clone()) {
                    continue;
                }
                match p.features.get(&f) {
                    Some(items) => {
                        for item in items {
                            if let Some(dep) = item.strip_prefix("dep:") {
                                enabled_deps.insert(dep.to_owned());
                            } else if let Some((dep, feat)) = item.split_once('/') {
                                let (dep, weak) = match dep.strip_suffix('?') {
                                    Some(d) => (d, true),
                                    None => (dep, false),
                                };
                                if !weak {
                                    enabled_deps.insert(dep.to_owned());
                                }
                                dep_feats.push((dep.to_owned(), feat.to_owned(), weak));
                            } else {
                                todo.push(item.clone());
                            }
                        }
                    }
                    // An optional dependency's implicit feature.
                    None => {
                        if p.deps.iter().any(|d| d.optional && d.key == f) {
                            enabled_deps.insert(f);
                        }
                    }
                }
            }
            deps_on.insert(id.clone(), enabled_deps.clone());
            for d in p.deps.iter().filter(|d| d.normal) {
                let Some(dep_id) = &d.id else { continue };
                if d.optional && !enabled_deps.contains(&d.key) {
                    continue;
                }
                let mut want: BTreeSet<String> = d.features.iter().cloned().collect();
                if d.default_features {
                    want.insert("default".into());
                }
                for (dep, feat, _) in &dep_feats {
                    if *dep == d.key {
                        want.insert(feat.clone());
                    }
                }
                let had = on.entry(dep_id.clone()).or_default();
                let before = had.len();
                had.extend(want);
                let new_package = !parent.contains_key(dep_id);
                if new_package {
                    parent.insert(dep_id.clone(), Some(id.clone()));
                }
                if new_package || had.len() > before {
                    queue.push_back(dep_id.clone());
                }
            }
        }
        parent
    }

    /// The chain of package names from the root of `closure` to `id`.
    fn path(&self, closure: &BTreeMap<String, Option<String>>, id: &str) -> String {
        let mut chain = Vec::new();
        let mut at = Some(id.to_owned());
        while let Some(i) = at {
            chain.push(self.packages.get(&i).map_or(i.clone(), |p| p.name.clone()));
            at = closure.get(&i).cloned().flatten();
        }
        chain.reverse();
        chain.join(" → ")
    }
}

/// What a check found.
#[derive(Debug, Default)]
struct Report {
    /// Violations.
    errors: Vec<String>,
    /// Known exceptions, still needed.
    notes: Vec<String>,
}

/// Checks `graph` (and the sources `read(crate, file)` gives) against `rules`.
fn check(rules: &Rules, graph: &Graph, read: &dyn Fn(&str, &str) -> Option<String>) -> Report {
    let mut r = Report::default();
    // Layering.
    for name in graph.members.keys() {
        let Some(allowed) = rules.layers.get(name) else {
            r.errors.push(format!(
                "workspace crate {name} has no `crate {name}:` line in the arch-rules block"
            ));
            continue;
        };
        for dep in graph.workspace_deps(name) {
            if !allowed.contains(&dep) {
                r.errors.push(format!(
                    "{name} depends on {dep}, which its `crate` line does not allow"
                ));
            }
        }
    }
    let named = rules
        .layers
        .iter()
        .flat_map(|(k, v)| std::iter::once(k).chain(v))
        .chain(rules.cores.keys())
        .chain(&rules.socket_crates)
        .chain(rules.exceptions.keys().map(|(k, _)| k));
    for name in named.collect::<BTreeSet<_>>() {
        if !graph.members.contains_key(name) {
            r.errors.push(format!(
                "the arch-rules block names {name}, which is not a workspace crate"
            ));
        }
    }
    // Cores: dependencies.
    let mut used = BTreeSet::new();
    for (name, core) in &rules.cores {
        if matches!(core, Core::Files(_)) {
            continue;
        }
        let closure = graph.closure(name);
        for id in closure.keys() {
            let Some(p) = graph.packages.get(id) else {
                continue;
            };
            if !rules.runtime.contains(&p.name) {
                continue;
            }
            // Report the first runtime crate of each path, not what it pulls in.
            let mut at = closure.get(id).cloned().flatten();
            let mut below_another = false;
            while let Some(i) = at {
                below_another |= graph
                    .packages
                    .get(&i)
                    .is_some_and(|q| rules.runtime.contains(&q.name));
                at = closure.get(&i).cloned().flatten();
            }
            if below_another {
                continue;
            }
            let path = graph.path(&closure, id);
            let key = (name.clone(), p.name.clone());
            if let Some(reason) = rules.exceptions.get(&key) {
                used.insert(key);
                r.notes.push(format!("known exception: {path} ({reason})"));
            } else {
                r.errors.push(format!(
                    "core {name} must not depend on {} (a runtime crate), but does: {path}",
                    p.name
                ));
            }
        }
    }
    for key in rules.exceptions.keys() {
        if !used.contains(key) {
            r.errors.push(format!(
                "the exception {} -> {} is no longer needed: remove it from the arch-rules block",
                key.0, key.1
            ));
        }
    }
    // Cores: sources.
    for (name, core) in &rules.cores {
        let files: Vec<String> = match core {
            Core::NoRuntime => continue,
            Core::Files(files) => files.iter().cloned().collect(),
            Core::Pure { except } => graph
                .dir(name)
                .map(|d| rust_files(&d.join("src"), d))
                .unwrap_or_default()
                .into_iter()
                .filter(|f| !except.contains(f))
                .collect(),
        };
        for file in files {
            let Some(text) = read(name, &file) else {
                r.errors.push(format!(
                    "core {name}: cannot read {file} (named in arch-rules?)"
                ));
                continue;
            };
            for (line, pattern) in find(&text, &rules.io) {
                r.errors.push(format!(
                    "core {name} does I/O: {file}:{line} says `{pattern}`"
                ));
            }
        }
    }
    // Sockets.
    for name in graph.members.keys() {
        if rules.socket_crates.contains(name) {
            continue;
        }
        let Some(dir) = graph.dir(name) else { continue };
        for file in rust_files(&dir.join("src"), dir) {
            let Some(text) = read(name, &file) else {
                continue;
            };
            for (line, pattern) in find(&text, &rules.sockets) {
                r.errors.push(format!(
                    "{name} names a socket ({file}:{line}: `{pattern}`), which only the socket-crates may"
                ));
            }
        }
    }
    r
}

/// The `.rs` files under `dir`, as paths relative to `base`, sorted.
fn rust_files(dir: &Path, base: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|x| x == "rs")
                && let Ok(rel) = path.strip_prefix(base)
            {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

/// The code of `text` with comments and the contents of string literals
/// removed, line by line (a message may mention what the code does not do).
fn code_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = 0usize;
    for line in text.lines() {
        let mut code = String::new();
        let mut chars = line.chars().peekable();
        let mut in_str = false;
        while let Some(c) = chars.next() {
            if in_block > 0 {
                if c == '*' && chars.peek() == Some(&'/') {
                    chars.next();
                    in_block -= 1;
                } else if c == '/' && chars.peek() == Some(&'*') {
                    chars.next();
                    in_block += 1;
                }
                continue;
            }
            if in_str {
                if c == '\\' {
                    chars.next();
                } else if c == '"' {
                    in_str = false;
                    code.push(c);
                }
                continue;
            }
            match (c, chars.peek()) {
                ('/', Some('/')) => break,
                ('/', Some('*')) => {
                    chars.next();
                    in_block += 1;
                }
                ('"', _) => {
                    in_str = true;
                    code.push(c);
                }
                // The character literal '"' opens no string.
                ('\'', Some('"')) => {
                    code.push(c);
                    code.push('"');
                    chars.next();
                }
                _ => code.push(c),
            }
        }
        out.push(code);
    }
    out
}

/// Where `patterns` occur in the code of `text`: (1-based line, pattern).
/// `use std::{fs, …}` counts as `std::fs` (and likewise `net`, `thread`).
fn find(text: &str, patterns: &[String]) -> Vec<(usize, String)> {
    let mut hits = Vec::new();
    let mut group: Option<String> = None;
    for (i, code) in code_lines(text).iter().enumerate() {
        let mut spelled = code.clone();
        // Expand `use std::{a, b::c}` into `std::a std::b::c` for the match.
        if let Some(g) = group.as_mut() {
            g.push_str(code);
        } else if let Some(at) = code.find("std::{") {
            group = Some(code[at + "std::{".len()..].to_owned());
        }
        if let Some(g) = group.clone()
            && let Some(end) = g.find('}')
        {
            for item in g[..end].split(',') {
                let _ = write!(spelled, " std::{}", item.trim());
            }
            group = None;
        }
        for p in patterns {
            if spelled.contains(p.as_str()) {
                hits.push((i + 1, p.clone()));
            }
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "intro\n```arch-rules\n# comment\ncrate a:\ncrate b: a # why\n\
        crate c: a b\nruntime: rt\nio: std::fs thread::spawn\ncore a\ncore b except: src/io.rs\n\
        no-runtime c\nsockets: TcpStream\nsocket-crates: c\n\
        exception c -> rt: through b, for now\n```\nmore\n";

    fn package(id: &str, deps: Value, features: Value) -> Value {
        serde_json::json!({
            "id": id, "name": id, "manifest_path": format!("/w/{id}/Cargo.toml"),
            "dependencies": deps, "features": features,
        })
    }

    fn dep(name: &str, optional: bool, default: bool, features: &[&str]) -> Value {
        serde_json::json!({
            "name": name, "rename": null, "kind": null, "optional": optional,
            "uses_default_features": default, "features": features,
        })
    }

    /// A workspace of a, b, c and a registry crate `lib` whose feature `rt`
    /// pulls in `rt`: b asks for lib without it, c with it (so the
    /// workspace-wide resolve has lib → rt).
    fn metadata() -> Value {
        let edge =
            |to: &str| serde_json::json!({"name": to, "pkg": to, "dep_kinds": [{"kind": null}]});
        serde_json::json!({
            "packages": [
                package("a", serde_json::json!([]), serde_json::json!({})),
                package("b", serde_json::json!([dep("a", false, true, &[]), dep("lib", false, false, &[])]), serde_json::json!({})),
                package("c", serde_json::json!([dep("b", false, true, &[]), dep("lib", false, true, &["rt"])]), serde_json::json!({})),
                package("lib", serde_json::json!([dep("rt", true, true, &[])]), serde_json::json!({"rt": ["dep:rt"], "default": []})),
                package("rt", serde_json::json!([]), serde_json::json!({})),
            ],
            "workspace_members": ["a", "b", "c"],
            "resolve": {"nodes": [
                {"id": "a", "deps": []},
                {"id": "b", "deps": [edge("a"), edge("lib")]},
                {"id": "c", "deps": [edge("b"), edge("lib")]},
                {"id": "lib", "deps": [edge("rt")]},
                {"id": "rt", "deps": []},
            ]},
        })
    }

    fn no_sources(_: &str, _: &str) -> Option<String> {
        Some(String::new())
    }

    #[test]
    fn the_rules_block_is_parsed() {
        let r = Rules::parse(DOC).unwrap();
        assert_eq!(r.layers["c"], ["a".to_owned(), "b".to_owned()].into());
        assert_eq!(r.layers["b"], ["a".to_owned()].into());
        assert_eq!(
            r.cores["b"],
            Core::Pure {
                except: ["src/io.rs".to_owned()].into()
            }
        );
        assert_eq!(r.cores["c"], Core::NoRuntime);
        assert_eq!(r.io, ["std::fs", "thread::spawn"]);
        assert!(Rules::parse("no block").is_err());
        assert!(Rules::parse("```arch-rules\ncrate a:\nfrobnicate\n```").is_err());
        assert!(Rules::parse("```arch-rules\nexception a -> b:\n```").is_err());
    }

    #[test]
    fn features_are_resolved_per_crate_not_workspace_wide() {
        let g = Graph::new(&metadata()).unwrap();
        let names = |root| -> BTreeSet<String> { g.closure(root).into_keys().collect() };
        assert_eq!(names("b"), ["a", "b", "lib"].map(str::to_owned).into());
        assert!(names("c").contains("rt"));
        let c = g.closure("c");
        assert_eq!(g.path(&c, "rt"), "c → lib → rt");
    }

    #[test]
    fn violations_name_the_crate_the_dependency_and_the_path() {
        let g = Graph::new(&metadata()).unwrap();
        let rules = Rules::parse(DOC).unwrap();
        let r = check(&rules, &g, &no_sources);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert_eq!(
            r.notes,
            ["known exception: c → lib → rt (through b, for now)"]
        );

        let strict =
            Rules::parse(&DOC.replace("exception c -> rt: through b, for now\n", "")).unwrap();
        let r = check(&strict, &g, &no_sources);
        assert_eq!(
            r.errors,
            ["core c must not depend on rt (a runtime crate), but does: c → lib → rt"]
        );

        let layered = Rules::parse(&DOC.replace("crate c: a b", "crate c: a")).unwrap();
        let r = check(&layered, &g, &no_sources);
        assert_eq!(
            r.errors,
            ["c depends on b, which its `crate` line does not allow"]
        );

        let stale = Rules::parse(
            &DOC.replace("core b except: src/io.rs", "core b\nexception b -> rt: old"),
        )
        .unwrap();
        let r = check(&stale, &g, &no_sources);
        assert_eq!(
            r.errors,
            ["the exception b -> rt is no longer needed: remove it from the arch-rules block"]
        );
    }

    #[test]
    fn io_in_a_cores_source_is_found_outside_comments() {
        let text = "// std::fs in a comment\n/* thread::spawn\n */ let x = 1;\n\
            let s = \"// not a comment\"; std::thread::spawn(f);\n\
            use std::{\n    fs,\n    io,\n};\nlet m = \"no std::fs here\"; let q = '\"';\n";
        let patterns = ["std::fs".to_owned(), "thread::spawn".to_owned()];
        assert_eq!(
            find(text, &patterns),
            [(4, "thread::spawn".to_owned()), (8, "std::fs".to_owned())]
        );
    }
}
