//! The check of a change to the planner's numerics (issue 27): 72 engine
//! plans, the Azure trace with its categories, its code requests, an
//! LMSYS-like and the agent-heavy CDF (the fidelity grid's,
//! python/routecore/planning.py) at 100 / 1,000 / 3,000 req/s, TTFT 0.5 / 1 /
//! 2 s, TPOT 80 ms or none, against `tests/fixtures/planner/fleets.json`.
//!
//! The team's rule: a change of the numerics may move the last bits of the
//! figures, never a fleet. So every fleet is compared exactly (each
//! candidate's boundary, bandwidth, pools' GPU counts, contexts, slots,
//! feasibility and binding, which figures are finite, the chosen candidates)
//! through a digest, and the figures to 1e-9 relative (1e-12 absolute near
//! zero): the fixture holds, per plan and per figure, the sum of `|x|` over
//! every candidate, which moves by at most 1e-9 of itself when each figure
//! does (a necessary condition, in a few KB).
//!
//! `cargo test --release --lib -- --ignored planner_fleets_dump` (the trace
//! read with `gzip -dc` from the package's copy, or from the CSV that
//! `ROUTECORE_AZURE_CSV` names). With `ROUTECORE_PLAN_DUMP=<file>` it also
//! writes every field of every candidate (`{:?}`), and with
//! `ROUTECORE_PLAN_BASE=<file>` compares such a dump of another build line by
//! line: words exactly, integers exactly, other numbers to the same
//! tolerance (the full check, figure by figure). `ROUTECORE_PLAN_FIXTURE=write`
//! rewrites the fixture: only for a change meant to move fleets or figures.
//! The plans are made twice, by the sweep `plan` picks for this CPU and by
//! the portable one ([`super::Isa`]), whose dumps must be identical.

use std::fmt::Write;

use serde_json::{json, Value};

use super::{plan_on, Candidate, Isa, Plan, PlanConfig, PoolPlan};
use crate::profile::Profile;
use crate::workload::Workload;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/planner/fleets.json"
);
const REL: f64 = 1e-9;
const ABS: f64 = 1e-12;

fn azure_csv() -> String {
    if let Ok(path) = std::env::var("ROUTECORE_AZURE_CSV") {
        return std::fs::read_to_string(path).expect("the trace");
    }
    let gz = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/python/routecore/data/azure-llm-2023/azure_llm_2023.csv.gz"
    );
    let out = std::process::Command::new("gzip")
        .args(["-dc", gz])
        .output()
        .expect("gzip");
    assert!(out.status.success(), "gzip -dc {gz}");
    String::from_utf8(out.stdout).expect("utf-8")
}

/// The 72 cases: a name and the plan (or its error).
fn cases(isa: Isa) -> Vec<(String, crate::error::Result<Plan>)> {
    let cols = crate::workload::CsvColumns {
        input: "ContextTokens",
        output: "GeneratedTokens",
        arrival: None,
        category: Some("category"),
    };
    let azure = Workload::from_csv_text(&azure_csv(), &cols).expect("csv");
    let code_id = azure
        .category_names()
        .iter()
        .position(|n| n == "code")
        .expect("code") as u32;
    let (mut inputs, mut outputs) = (Vec::new(), Vec::new());
    for (i, &c) in azure.category_ids().iter().enumerate() {
        if c == code_id {
            inputs.push(azure.input_tokens()[i] as i64);
            outputs.push(azure.output_tokens()[i] as i64);
        }
    }
    let code = Workload::new(&inputs, &outputs, None, None).expect("code");
    let lmsys = Workload::from_cdf(
        &[
            (64, 0.06769873079356836),
            (128, 0.19040573377734155),
            (256, 0.39756593427258413),
            (512, 0.639490480802875),
            (768, 0.7635820862646214),
            (1024, 0.8349337097107752),
            (1536, 0.909),
            (2048, 0.9441497962961394),
            (3072, 0.9744935919576142),
            (4096, 0.9863550584620481),
            (6144, 0.9948874360919426),
            (8192, 0.9976292897973289),
            (12288, 0.9992759079282141),
            (16384, 0.9997100502271707),
            (24576, 0.9999281237262816),
            (32768, 0.9999752096917729),
            (49152, 0.9999950276101246),
            (65536, 1.0),
        ],
        0.8,
    )
    .expect("lmsys");
    let agent = Workload::from_cdf(
        &[
            (64, 0.0),
            (128, 0.0),
            (256, 0.00007),
            (512, 0.00407),
            (768, 0.02237),
            (1024, 0.05757),
            (1536, 0.15871),
            (2048, 0.26459),
            (3072, 0.43163),
            (4096, 0.53802),
            (6144, 0.65987),
            (8192, 0.74042),
            (12288, 0.85213),
            (16384, 0.91717),
            (24576, 0.97282),
            (32768, 0.99046),
            (49152, 0.99849),
            (65536, 1.0),
        ],
        0.8,
    )
    .expect("agent-heavy");
    let profile = Profile::llama3_70b_a100();
    let mut out = Vec::new();
    for (name, w) in [
        ("azure", &azure),
        ("code", &code),
        ("lmsys", &lmsys),
        ("agent", &agent),
    ] {
        for rate in [100.0, 1000.0, 3000.0] {
            for ttft in [0.5, 1.0, 2.0] {
                for tpot in [Some(0.08), None] {
                    let cfg = PlanConfig {
                        slo_tpot_s: tpot,
                        ..PlanConfig::new(rate, ttft)
                    };
                    out.push((
                        format!("{name} {rate} {ttft} {tpot:?}"),
                        plan_on(isa, w, &profile, &cfg),
                    ));
                }
            }
        }
    }
    out
}

/// A pool's figures, by name.
fn pool_figures(p: &PoolPlan) -> [(&'static str, f64); 11] {
    [
        ("arrival_rate", p.arrival_rate),
        ("mu_gpu", p.mu_gpu),
        ("cs2", p.cs2),
        ("utilization", p.utilization),
        ("occupancy", p.occupancy),
        ("prefill_utilization", p.prefill_utilization),
        ("kv_utilization", p.kv_utilization),
        ("t_iter_s", p.t_iter_s),
        ("prefill_p99_s", p.prefill_p99_s),
        ("p99_wait_s", p.p99_wait_s),
        ("p99_ttft_s", p.p99_ttft_s),
    ]
}

/// Every figure of a candidate, by name (`short.` / `long.` for its pools).
fn figures(c: &Candidate) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = vec![
        ("alpha".into(), c.alpha),
        ("beta".into(), c.beta),
        ("alpha_prime".into(), c.alpha_prime),
        ("annual_cost_usd".into(), c.annual_cost_usd),
    ];
    out.extend(c.savings_vs_homogeneous.map(|s| ("savings".into(), s)));
    for (side, pool) in [("short", &c.short), ("long", &c.long)] {
        for (name, x) in pool_figures(pool) {
            out.push((format!("{side}.{name}"), x));
        }
    }
    out
}

/// A candidate's fleet, exactly: what the tolerance must never blur.
fn fleet(c: &Candidate, out: &mut String) {
    let _ = write!(
        out,
        "{} {:x} {} {} {};",
        c.b_short,
        c.gamma.to_bits(),
        c.feasible,
        c.gpus,
        c.savings_vs_homogeneous.is_some()
    );
    for p in [&c.short, &c.long] {
        let finite: String = pool_figures(p)
            .iter()
            .map(|(_, x)| if x.is_finite() { '1' } else { '0' })
            .collect();
        let _ = write!(
            out,
            " {} {} {} {} {} {finite};",
            p.gpus,
            p.feasible,
            p.context,
            p.n_slots,
            p.binding.name()
        );
    }
}

/// `b_short gamma n_short+n_long` of the chosen candidate, or null.
fn chosen(plan: &Plan, at: Option<usize>) -> Value {
    at.map_or(Value::Null, |i| {
        let c = &plan.sweep[i];
        json!(format!(
            "{} {} {}+{}",
            c.b_short, c.gamma, c.short.gpus, c.long.gpus
        ))
    })
}

/// One plan's entry of the fixture.
fn fingerprint(name: &str, result: &crate::error::Result<Plan>) -> Value {
    let plan = match result {
        Ok(p) => p,
        Err(e) => return json!({"case": name, "error": e.to_string()}),
    };
    let all = || std::iter::once(&plan.homogeneous).chain(&plan.sweep);
    let mut fleets = String::new();
    for c in all() {
        fleet(c, &mut fleets);
    }
    let _ = write!(fleets, "{:?} {:?}", plan.best, plan.pool_routing);
    // Sums of |x| of the finite figures, short and long pools together.
    let mut sums = serde_json::Map::new();
    for c in all() {
        for (name, x) in figures(c) {
            let key = name
                .trim_start_matches("short.")
                .trim_start_matches("long.");
            let entry = sums.entry(key.to_string()).or_insert(json!(0.0));
            if x.is_finite() {
                *entry = json!(entry.as_f64().unwrap_or(0.0) + x.abs());
            }
        }
    }
    json!({
        "case": name,
        "candidates": plan.sweep.len(),
        "fleets": format!("{:016x}", xxhash_rust::xxh3::xxh3_64(fleets.as_bytes())),
        "homogeneous": plan.homogeneous.gpus,
        "best": chosen(plan, plan.best),
        "pool_routing": chosen(plan, plan.pool_routing),
        "figure_sums": sums,
    })
}

/// Whether two figures (or sums of figures over `n` candidates) agree to
/// the team's tolerance.
fn close(a: f64, b: f64, n: f64) -> bool {
    a == b
        || (a.is_finite() && b.is_finite() && (a - b).abs() <= REL * a.abs().max(b.abs()) + ABS * n)
}

/// The differences between a plan's entry and the fixture's, in words.
fn differences(want: &Value, got: &Value, out: &mut Vec<String>) {
    let case = got["case"].as_str().unwrap_or("?");
    for key in [
        "error",
        "candidates",
        "fleets",
        "homogeneous",
        "best",
        "pool_routing",
    ] {
        if want.get(key) != got.get(key) {
            out.push(format!(
                "{case}: {key} {} (fixture) != {} (now)",
                want.get(key).unwrap_or(&Value::Null),
                got.get(key).unwrap_or(&Value::Null)
            ));
        }
    }
    let n = got["candidates"].as_f64().unwrap_or(0.0) + 1.0;
    let (w, g) = (&want["figure_sums"], &got["figure_sums"]);
    if let (Some(w), Some(g)) = (w.as_object(), g.as_object()) {
        if w.len() != g.len() {
            out.push(format!("{case}: figures {w:?} != {g:?}"));
        }
        for (key, a) in w {
            let (a, b) = (a.as_f64(), g.get(key).and_then(Value::as_f64));
            match (a, b) {
                (Some(a), Some(b)) if close(a, b, 2.0 * n) => {}
                _ => out.push(format!(
                    "{case}: sum of {key} {a:?} (fixture) != {b:?} (now)"
                )),
            }
        }
    }
}

/// The figure-by-figure comparison of two dumps' lines: the words equal,
/// integers equal, other numbers to the tolerance.
fn same_line(a: &str, b: &str) -> bool {
    let split = |s: &str| -> Vec<String> {
        s.split(|c: char| " ,{}()[]:".contains(c))
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect()
    };
    let (ta, tb) = (split(a), split(b));
    ta.len() == tb.len()
        && ta.iter().zip(&tb).all(|(x, y)| {
            let float = |t: &str| t.contains(['.', 'e', 'E']) || t == "inf" || t == "NaN";
            match (x.parse::<f64>(), y.parse::<f64>()) {
                (Ok(u), Ok(v)) if float(x) && float(y) => {
                    (u.is_nan() && v.is_nan()) || close(u, v, 1.0)
                }
                _ => x == y,
            }
        })
}

/// The dump of every field of every candidate (`{:?}` round-trips an f64).
fn dump(cases: &[(String, crate::error::Result<Plan>)]) -> String {
    let mut dump = String::new();
    for (name, result) in cases {
        let _ = writeln!(dump, "{name}");
        match result {
            Ok(p) => {
                let _ = writeln!(dump, "{:?}", p.homogeneous);
                let _ = writeln!(dump, "{:?} {:?}", p.best, p.pool_routing);
                for c in &p.sweep {
                    let _ = writeln!(dump, "{c:?}");
                }
            }
            Err(e) => {
                let _ = writeln!(dump, "{e}");
            }
        }
    }
    dump
}

#[test]
fn tolerance_keeps_fleets_and_allows_last_bits() {
    // Words and integers exact, figures to 1e-9 relative.
    let a = "PoolPlan { gpus: 17, binding: Slot, t_iter_s: 0.0321, p99_wait_s: 1.5e-13 }";
    let last_bits =
        "PoolPlan { gpus: 17, binding: Slot, t_iter_s: 0.032100000000001, p99_wait_s: 1.6e-13 }";
    assert!(same_line(a, last_bits));
    for moved in [
        "PoolPlan { gpus: 18, binding: Slot, t_iter_s: 0.0321, p99_wait_s: 1.5e-13 }",
        "PoolPlan { gpus: 17, binding: Prefill, t_iter_s: 0.0321, p99_wait_s: 1.5e-13 }",
        "PoolPlan { gpus: 17, binding: Slot, t_iter_s: 0.03210001, p99_wait_s: 1.5e-13 }",
        "PoolPlan { gpus: 17, binding: Slot, t_iter_s: 0.0321, p99_wait_s: 3e-12 }",
        "PoolPlan { gpus: 17, binding: Slot, t_iter_s: inf, p99_wait_s: 1.5e-13 }",
    ] {
        assert!(!same_line(a, moved), "{moved}");
    }
    assert!(close(1.0, 1.0 + 0.9e-9, 1.0) && !close(1.0, 1.0 + 1.1e-9, 1.0));
    assert!(close(0.0, 0.9e-12, 1.0) && !close(0.0, 1.1e-12, 1.0));
    assert!(close(f64::INFINITY, f64::INFINITY, 1.0) && !close(f64::INFINITY, 1e300, 1.0));
    // A plan's entry: the fleets' digest exactly, the sums to the tolerance.
    let entry = |fleets: &str, t_iter: f64| {
        json!({"case": "c", "candidates": 1, "fleets": fleets, "homogeneous": 3,
               "best": "256 1 1+2", "pool_routing": null,
               "figure_sums": {"t_iter_s": t_iter}})
    };
    let want = entry("00ff", 0.5);
    let wrong = |got: Value| {
        let mut out = Vec::new();
        differences(&want, &got, &mut out);
        out.len()
    };
    assert_eq!(wrong(entry("00ff", 0.5 * (1.0 + 0.9e-9))), 0);
    assert_eq!(wrong(entry("00ff", 0.5 * (1.0 + 2e-9))), 1);
    assert_eq!(wrong(entry("00fe", 0.5)), 1);
}

#[test]
#[ignore]
fn planner_fleets_dump() {
    // The sweep this CPU runs (`plan`'s choice), checked below against the
    // fixture, and the portable build forced: the same dump to the last bit.
    let portable = dump(&cases(Isa::Portable));
    let cases = cases(Isa::detect());
    let got: Vec<Value> = cases.iter().map(|(n, r)| fingerprint(n, r)).collect();
    let path = FIXTURE;
    if std::env::var("ROUTECORE_PLAN_FIXTURE").as_deref() == Ok("write") {
        // One plan a line: a diff of the fixture reads plan by plan.
        let lines: Vec<String> = got.iter().map(Value::to_string).collect();
        let text = format!("{{\"plans\": [\n{}\n]}}\n", lines.join(",\n"));
        std::fs::write(path, text).expect("fixture written");
    }
    let text = dump(&cases);
    assert!(
        text == portable,
        "{:?} and the portable sweep differ",
        Isa::detect()
    );
    if let Ok(out) = std::env::var("ROUTECORE_PLAN_DUMP") {
        std::fs::write(out, &text).expect("dump written");
    }
    let mut wrong = Vec::new();
    if let Ok(base) = std::env::var("ROUTECORE_PLAN_BASE") {
        let base = std::fs::read_to_string(base).expect("base dump");
        let (mut lines, mut exact) = (0, 0);
        for (i, (a, b)) in base.lines().zip(text.lines()).enumerate() {
            lines += 1;
            exact += usize::from(a == b);
            if !same_line(a, b) {
                wrong.push(format!("dump line {}: {a}\n  now: {b}", i + 1));
            }
        }
        if base.lines().count() != text.lines().count() {
            wrong.push("the dumps differ in length".into());
        }
        println!(
            "{lines} dump lines, {exact} identical, the rest within the tolerance unless listed"
        );
    }
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json");
    let want = fixture["plans"].as_array().expect("plans");
    assert_eq!(want.len(), got.len(), "the fixture's plans");
    for (w, g) in want.iter().zip(&got) {
        differences(w, g, &mut wrong);
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
