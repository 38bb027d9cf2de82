//! A small discrete-event evaluation of assignment policies on a fleet shaped
//! like RouteBalance's testbed (Table 1: Qwen2.5 3B / 7B / 14B / 72B, TPOT
//! 10.2 / 19.6 / 13.9 / 41.6 ms, 3 / 5 / 3 / 2 endpoints, USD 0.06 / 0.07 /
//! 0.15 / 0.38-0.40 per million tokens).
//!
//! Serving model: every endpoint runs iteration-level continuous batching. A
//! step admits queued requests (FIFO) into free slots (up to `max_batch`),
//! lasts `tpot + prefill of the admitted prompts`, and gives every running
//! request one token; a request finishes at the end of the step that produced
//! its last token. TPOT does not depend on the batch size (a simplification:
//! the paper's TPOT is measured under load).
//!
//! Arrivals are Poisson at `rate`; the scheduler fires every `interval_s` and
//! assigns all requests that arrived since the last firing, reading each
//! endpoint's telemetry first: `pending_decode` = remaining decode tokens of
//! running and queued requests, `batch_size` = running requests. Latency is
//! completion minus arrival, so it includes the wait for the batch to fire.
//!
//! Synthetic workload (seeded, known exactly): each prompt has a difficulty
//! `d ~ U(0, 1)`, `in_tokens = clamp(round(exp(N(ln 200, 0.8))), 8, 4096)` and
//! a base length `L = exp(N(ln 200, 0.6))`. On model m with skill `s_m` (0.30 /
//! 0.45 / 0.60 / 0.80) the quality is `clamp(1 - 1.5 max(0, d - s_m) + 0.05
//! N(0, 1), 0, 1)`: easy prompts are served equally well by every model, hard
//! ones only by large models. The output length is `clamp(round(L f_m
//! exp(0.1 N(0, 1))), 1, 4096)` with conciseness `f_m` 1.25 / 1.15 / 1.0 / 0.9
//! (larger models answer more briefly). Policies see these values exactly (an
//! oracle estimator), so the comparison isolates the assignment policy.
//!
//! Policies: the BatchScheduler at a weight vector; decoupled routing (a model
//! router maximising `w_q quality + w_c (1 - cost / max cost)` over models,
//! then the endpoint picker's `least-request` preset among that model's
//! endpoints (a subset hint), counting requests running, queued and assigned
//! earlier in the batch; `w_c = 0` is quality argmax); the picker's
//! `round-robin` and `random` presets over all endpoints.

use std::collections::VecDeque;

use super::{BatchScheduler, BudgetFallback, Endpoint, Load, LptKey, Weights};
use crate::endpoint::EndpointState;
use crate::error::{invalid, positive, Result};
use crate::pick::{PickConfig, PickRequest, Pipeline};
use crate::rng::Rng;

/// One model tier of the paper's fleet.
#[derive(Debug, Clone, Copy)]
pub struct Tier {
    pub model: &'static str,
    pub tpot_s: f64,
    pub price_in_per_mtok: f64,
    pub price_out_per_mtok: f64,
    pub endpoints: usize,
    /// Difficulty up to which the model answers perfectly.
    pub skill: f64,
    /// Output length relative to the prompt's base length.
    pub conciseness: f64,
}

/// RouteBalance's Table 1 with this evaluation's skill and conciseness.
pub const PAPER_FLEET: [Tier; 4] = [
    tier("qwen2.5-3b", 0.0102, 0.06, 0.06, 3, 0.30, 1.25),
    tier("qwen2.5-7b", 0.0196, 0.07, 0.07, 5, 0.45, 1.15),
    tier("qwen2.5-14b", 0.0139, 0.15, 0.15, 3, 0.60, 1.0),
    tier("qwen2.5-72b", 0.0416, 0.38, 0.40, 2, 0.80, 0.9),
];

const fn tier(
    model: &'static str,
    tpot_s: f64,
    price_in_per_mtok: f64,
    price_out_per_mtok: f64,
    endpoints: usize,
    skill: f64,
    conciseness: f64,
) -> Tier {
    Tier {
        model,
        tpot_s,
        price_in_per_mtok,
        price_out_per_mtok,
        endpoints,
        skill,
        conciseness,
    }
}

/// The evaluation's knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalConfig {
    /// Mean arrivals per second.
    pub rate: f64,
    pub requests: usize,
    pub seed: u64,
    /// Decode slots per endpoint.
    pub max_batch: i64,
    /// Seconds between scheduler firings.
    pub interval_s: f64,
}

impl EvalConfig {
    fn check(&self) -> Result<()> {
        positive("rate", self.rate)?;
        positive("interval_s", self.interval_s)?;
        if !(1..=1_000_000).contains(&self.requests) {
            return Err(invalid(format!(
                "requests must be in [1, 1000000], got {}",
                self.requests
            )));
        }
        if !(1..=4096).contains(&self.max_batch) {
            return Err(invalid(format!(
                "max_batch must be in [1, 4096], got {}",
                self.max_batch
            )));
        }
        Ok(())
    }
}

/// How requests are assigned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    Scheduler(Weights),
    /// Model router on `quality` and `cost` weights, then shortest queue.
    Decoupled {
        quality: f64,
        cost: f64,
    },
    RoundRobin,
    Random,
}

/// One request of the synthetic workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub arrival: f64,
    pub in_tokens: u64,
    /// Per model, in fleet order.
    pub quality: Vec<f64>,
    pub out_len: Vec<f64>,
}

/// The seeded synthetic workload described in the module docs.
pub fn workload(cfg: &EvalConfig, fleet: &[Tier]) -> Vec<Prompt> {
    let mut rng = Rng::new(cfg.seed);
    let mut t = 0.0;
    (0..cfg.requests)
        .map(|_| {
            t += rng.exponential(cfg.rate);
            let d = rng.uniform();
            let in_tokens = (200f64.ln() + 0.8 * rng.normal()).exp().round();
            let base = (200f64.ln() + 0.6 * rng.normal()).exp();
            let mut quality = Vec::with_capacity(fleet.len());
            let mut out_len = Vec::with_capacity(fleet.len());
            for tier in fleet {
                let q = 1.0 - 1.5 * (d - tier.skill).max(0.0) + 0.05 * rng.normal();
                quality.push(q.clamp(0.0, 1.0));
                let len = base * tier.conciseness * (0.1 * rng.normal()).exp();
                out_len.push(len.round().clamp(1.0, 4096.0));
            }
            Prompt {
                arrival: t,
                in_tokens: in_tokens.clamp(8.0, 4096.0) as u64,
                quality,
                out_len,
            }
        })
        .collect()
}

/// The endpoints of `fleet`, named `<model>-<n>`, in tier order.
pub fn fleet_endpoints(fleet: &[Tier], max_batch: i64) -> Result<Vec<Endpoint>> {
    let mut out = Vec::new();
    for t in fleet {
        for n in 0..t.endpoints {
            out.push(Endpoint::new(
                &format!("{}-{n}", t.model),
                t.model,
                t.tpot_s,
                t.price_in_per_mtok,
                t.price_out_per_mtok,
                max_batch,
                None,
            )?);
        }
    }
    Ok(out)
}

/// What one policy achieved.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub quality: f64,
    pub mean_latency_s: f64,
    pub p95_latency_s: f64,
    pub cost_per_request_usd: f64,
    /// Share of requests served by each model, in fleet order.
    pub model_share: Vec<f64>,
}

#[derive(Debug, Default)]
struct Server {
    clock: f64,
    /// (request, tokens left)
    running: Vec<(usize, f64)>,
    queue: VecDeque<usize>,
}

impl Server {
    fn telemetry(&self, job: &Job<'_>) -> (f64, u64) {
        let pending = self.running.iter().map(|r| r.1).sum::<f64>()
            + self.queue.iter().map(|&r| job.out_len(r)).sum::<f64>();
        (pending, self.running.len() as u64)
    }

    /// Runs steps that start before `until` (all remaining work when infinite).
    fn advance(&mut self, until: f64, inst: &Endpoint, job: &Job<'_>, finish: &mut [f64]) {
        loop {
            if self.running.is_empty() && self.queue.is_empty() {
                if until.is_finite() {
                    self.clock = self.clock.max(until);
                }
                return;
            }
            if self.clock >= until {
                return;
            }
            let mut step = inst.tpot_s;
            while (self.running.len() as u64) < inst.max_batch {
                let Some(r) = self.queue.pop_front() else {
                    break;
                };
                step += job.prompts[r].in_tokens as f64 * inst.prefill_s_per_token;
                self.running.push((r, job.out_len(r)));
            }
            self.clock += step;
            let clock = self.clock;
            self.running.retain_mut(|(r, left)| {
                *left -= 1.0;
                if *left <= 0.0 {
                    finish[*r] = clock;
                }
                *left > 0.0
            });
        }
    }
}

struct Job<'a> {
    prompts: &'a [Prompt],
    /// Model column of each endpoint.
    model_of: Vec<usize>,
    /// Per request, the endpoint it went to.
    placed: Vec<usize>,
}

impl Job<'_> {
    /// The true output length of request `r` on the model it was placed on.
    fn out_len(&self, r: usize) -> f64 {
        self.prompts[r].out_len[self.model_of[self.placed[r]]]
    }
}

/// Runs `policy` over the workload and measures it.
pub fn run(cfg: &EvalConfig, fleet: &[Tier], policy: Policy) -> Result<Outcome> {
    cfg.check()?;
    let prompts = workload(cfg, fleet);
    let endpoints = fleet_endpoints(fleet, cfg.max_batch)?;
    let weights = match policy {
        Policy::Scheduler(w) => w,
        _ => Weights::new(1.0, 0.0, 0.0)?,
    };
    let sched = BatchScheduler::new(
        endpoints.clone(),
        weights,
        LptKey::Max,
        BudgetFallback::Reject,
    )?;
    let n = endpoints.len();
    let mut job = Job {
        prompts: &prompts,
        model_of: sched.model_of().to_vec(),
        placed: vec![usize::MAX; prompts.len()],
    };
    let mut servers: Vec<Server> = (0..n).map(|_| Server::default()).collect();
    let mut finish = vec![f64::NAN; prompts.len()];
    let names: Vec<&str> = endpoints.iter().map(|e| e.name.as_str()).collect();
    let preset = match policy {
        Policy::Scheduler(_) | Policy::Decoupled { .. } => "least-request",
        Policy::RoundRobin => "round-robin",
        Policy::Random => "random",
    };
    let pick_config = PickConfig {
        seed: cfg.seed ^ 0x5eed_7a11,
        ..PickConfig::default()
    };
    let mut picker = Pipeline::preset(preset, &names, &pick_config)?;
    let mut states = vec![EndpointState::default(); n];
    let mut next = 0usize;
    let mut tick = 0u64;
    while next < prompts.len() {
        tick += 1;
        let now = tick as f64 * cfg.interval_s;
        for (s, inst) in servers.iter_mut().zip(&endpoints) {
            s.advance(now, inst, &job, &mut finish);
        }
        let end = next + prompts[next..].partition_point(|p| p.arrival <= now);
        if end == next {
            continue;
        }
        let batch = &prompts[next..end];
        let choice = match policy {
            Policy::Scheduler(_) => scheduler_choice(&sched, batch, &servers, &job)?,
            Policy::Decoupled { quality, cost } => {
                let choose_model =
                    |p: &Prompt| decoupled_model(&endpoints, &job.model_of, p, quality, cost);
                pick_each(
                    &mut picker,
                    &mut states,
                    batch,
                    &servers,
                    &job.model_of,
                    Some(&choose_model),
                    now,
                )?
            }
            Policy::RoundRobin | Policy::Random => pick_each(
                &mut picker,
                &mut states,
                batch,
                &servers,
                &job.model_of,
                None,
                now,
            )?,
        };
        for (k, i) in choice.into_iter().enumerate() {
            job.placed[next + k] = i;
            servers[i].queue.push_back(next + k);
        }
        next = end;
    }
    for (s, inst) in servers.iter_mut().zip(&endpoints) {
        s.advance(f64::INFINITY, inst, &job, &mut finish);
    }
    Ok(measure(&prompts, &endpoints, &job, &finish, fleet.len()))
}

/// The policy set the evaluation compares, as `(name, family, policy)`:
/// the four presets, a sweep of the scheduler (quality weight `w`, the rest
/// split evenly between latency and cost), the decoupled router over the same
/// quality weights (the rest on cost; `w = 1` is quality argmax), round-robin
/// and random. The sweeps trace the two frontiers.
pub fn policies() -> Result<Vec<(String, &'static str, Policy)>> {
    let mut out = Vec::new();
    for (name, _) in super::PRESETS {
        out.push((
            name.to_owned(),
            "preset",
            Policy::Scheduler(Weights::preset(name)?),
        ));
    }
    for w in SWEEP {
        let rest = (1.0 - w) / 2.0;
        out.push((
            format!("scheduler q={w:.2}"),
            "scheduler sweep",
            Policy::Scheduler(Weights::new(w, rest, rest)?),
        ));
    }
    for w in SWEEP.into_iter().chain([1.0]) {
        out.push((
            format!("decoupled q={w:.2}"),
            "decoupled sweep",
            Policy::Decoupled {
                quality: w,
                cost: 1.0 - w,
            },
        ));
    }
    out.push(("round-robin".to_owned(), "dispatcher", Policy::RoundRobin));
    out.push(("random".to_owned(), "dispatcher", Policy::Random));
    Ok(out)
}

const SWEEP: [f64; 5] = [0.95, 0.9, 0.7, 0.5, 0.2];

/// Runs every policy of `policies()` on the same workload.
pub fn evaluate(cfg: &EvalConfig) -> Result<Vec<(String, &'static str, Outcome)>> {
    policies()?
        .into_iter()
        .map(|(name, family, p)| Ok((name, family, run(cfg, &PAPER_FLEET, p)?)))
        .collect()
}

fn scheduler_choice(
    sched: &BatchScheduler,
    batch: &[Prompt],
    servers: &[Server],
    job: &Job<'_>,
) -> Result<Vec<usize>> {
    let quality: Vec<f64> = batch.iter().flat_map(|p| p.quality.clone()).collect();
    let out_len: Vec<f64> = batch.iter().flat_map(|p| p.out_len.clone()).collect();
    let in_tokens: Vec<u64> = batch.iter().map(|p| p.in_tokens).collect();
    let (pending, sizes) = servers.iter().map(|s| s.telemetry(job)).unzip();
    let got = sched.assign(
        &super::Batch {
            quality: &quality,
            out_len: &out_len,
            in_tokens: &in_tokens,
            budget: None,
        },
        &Load {
            pending,
            batch: sizes,
        },
    )?;
    got.into_iter()
        .map(|i| usize::try_from(i).map_err(|_| invalid("a request was left unassigned")))
        .collect()
}

/// The decoupled router's model for `p`: the best `w_quality * quality +
/// w_cost * (1 - cost / max cost)`, the first on ties.
fn decoupled_model(
    endpoints: &[Endpoint],
    model_of: &[usize],
    p: &Prompt,
    w_quality: f64,
    w_cost: f64,
) -> usize {
    let models = p.quality.len();
    // one representative endpoint per model, for its prices
    let cost: Vec<f64> = (0..models)
        .map(|m| {
            let rep = model_of.iter().position(|&x| x == m).unwrap_or(0);
            endpoints[rep].cost(p.in_tokens as f64, p.out_len[m])
        })
        .collect();
    let max_cost = cost.iter().copied().fold(0.0, f64::max);
    let score =
        |m: usize| w_quality * p.quality[m] + w_cost - super::slope(w_cost, max_cost) * cost[m];
    (0..models).fold(0, |b, m| if score(m) > score(b) { m } else { b })
}

/// The endpoint picker's choice for each request of the batch, among the
/// endpoints of the model `model` names (all when None), with every
/// endpoint's requests running and queued as its in-flight count and each
/// choice counted before the next (dead reckoning).
fn pick_each(
    picker: &mut Pipeline,
    states: &mut [EndpointState],
    batch: &[Prompt],
    servers: &[Server],
    model_of: &[usize],
    model: Option<&dyn Fn(&Prompt) -> usize>,
    now: f64,
) -> Result<Vec<usize>> {
    for (st, s) in states.iter_mut().zip(servers) {
        st.in_flight = (s.running.len() + s.queue.len()) as u64;
    }
    let mut subset = Vec::new();
    batch
        .iter()
        .map(|p| {
            if let Some(model) = model {
                let m = model(p);
                subset.clear();
                subset.extend((0..model_of.len()).filter(|&i| model_of[i] == m));
            }
            let req = PickRequest {
                subset: model.map(|_| subset.as_slice()),
                input_tokens: p.in_tokens,
                now,
                ..PickRequest::default()
            };
            let i = picker
                .pick_one(&req, states)?
                .ok_or_else(|| invalid("the endpoint picker chose no endpoint"))?;
            picker.started(&req, i)?;
            states[i].in_flight += 1;
            Ok(i)
        })
        .collect()
}

fn measure(
    prompts: &[Prompt],
    endpoints: &[Endpoint],
    job: &Job<'_>,
    finish: &[f64],
    models: usize,
) -> Outcome {
    let n = prompts.len() as f64;
    let mut latency: Vec<f64> = prompts
        .iter()
        .zip(finish)
        .map(|(p, f)| f - p.arrival)
        .collect();
    latency.sort_by(f64::total_cmp);
    let mut share = vec![0.0; models];
    let (mut quality, mut cost) = (0.0, 0.0);
    for (r, p) in prompts.iter().enumerate() {
        let i = job.placed[r];
        let m = job.model_of[i];
        quality += p.quality[m];
        cost += endpoints[i].cost(p.in_tokens as f64, p.out_len[m]);
        share[m] += 1.0 / n;
    }
    let p95 = latency[((latency.len() as f64 * 0.95) as usize).min(latency.len() - 1)];
    Outcome {
        quality: quality / n,
        mean_latency_s: latency.iter().sum::<f64>() / n,
        p95_latency_s: p95,
        cost_per_request_usd: cost / n,
        model_share: share,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EvalConfig {
        EvalConfig {
            rate: 8.0,
            requests: 600,
            seed: 1,
            max_batch: 16,
            interval_s: 0.05,
        }
    }

    #[test]
    fn one_request_takes_prefill_plus_decode_after_the_firing() {
        let c = EvalConfig {
            requests: 1,
            ..cfg()
        };
        let p = &workload(&c, &PAPER_FLEET)[0];
        let out = run(&c, &PAPER_FLEET, Policy::RoundRobin).expect("run");
        // round-robin starts at endpoint 0, a 3B
        let t = &PAPER_FLEET[0];
        let fire = (p.arrival / c.interval_s).ceil() * c.interval_s;
        let prefill = p.in_tokens as f64 * t.tpot_s / super::super::DEFAULT_PREFILL_TOKENS_PER_STEP;
        let want = fire - p.arrival + prefill + p.out_len[0] * t.tpot_s;
        assert!(
            (out.mean_latency_s - want).abs() < 1e-9,
            "{out:?} vs {want}"
        );
        assert_eq!(out.model_share, vec![1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn presets_reach_their_corners_and_latency_pricing_helps() {
        let c = cfg();
        let run_w = |name| {
            run(
                &c,
                &PAPER_FLEET,
                Policy::Scheduler(Weights::preset(name).expect("w")),
            )
            .expect("run")
        };
        let (q, l, k) = (run_w("quality"), run_w("latency"), run_w("cost"));
        assert!(q.quality > l.quality && q.quality > k.quality);
        assert!(l.mean_latency_s < q.mean_latency_s);
        assert!(k.cost_per_request_usd < q.cost_per_request_usd);
        let argmax = run(
            &c,
            &PAPER_FLEET,
            Policy::Decoupled {
                quality: 1.0,
                cost: 0.0,
            },
        )
        .expect("run");
        // quality argmax piles onto the slow 72B tier
        assert!(argmax.model_share[3] > 0.4);
        assert!(argmax.mean_latency_s > l.mean_latency_s);
        let shares: f64 = argmax.model_share.iter().sum();
        assert!((shares - 1.0).abs() < 1e-9);
        assert!(run(&EvalConfig { rate: 0.0, ..c }, &PAPER_FLEET, Policy::Random).is_err());
    }
}
