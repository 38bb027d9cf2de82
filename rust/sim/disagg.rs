//! A disaggregated fleet in the simulator: prefill endpoints (role
//! `prefill`) and decode endpoints (role `decode`, or `both` for the
//! requests the decider keeps aggregated) as separate resources, each the
//! continuous-batching [`Endpoint`] of [`super::engine`].
//!
//! A request arrives, and the decider says whether to split it: `always`,
//! `never`, or `conditional` when its uncached prompt tokens exceed a
//! threshold (no prefix cache is modelled here: every prompt token is
//! uncached). A split request is prefilled on the least-loaded prefill
//! endpoint as a request of one output token (vLLM's prefill step, sent with
//! `max_tokens = 1`); when that token is sampled its KV is sent to decode, a
//! delay of [`Transfer::delay_s`]; it then joins the least-loaded decode
//! endpoint with its prompt's KV in place ([`Endpoint::enqueue_transferred`]):
//! the decode endpoint's first iteration computes the prompt's last token and
//! samples the first token (its TTFT), then one token per iteration. A
//! request kept aggregated runs whole on the least-loaded decode endpoint,
//! prefill and all. With `never` and no prefill pool this is the aggregated
//! fleet, so the three are compared by one loop on one trace.
//!
//! Dispatch is least-loaded (running plus waiting requests, the lowest
//! index on ties), the discipline the planner's engine model assumes
//! ([`crate::planner::disagg`]). The first `warmup` of the requests by
//! arrival are left out of the figures, and utilization is measured over the
//! window from the first measured arrival to the last, as in [`super`].

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::engine::{Endpoint, Event};
use super::{check_sorted, PoolConfig, PoolReport, RequestBlocks, SimRequest};
use crate::error::{invalid, Result};
use crate::planner::disagg::Transfer;

/// Whether a request is prefilled on a prefill endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decider {
    Always,
    Never,
    /// Split when the uncached prompt tokens exceed this many.
    Conditional(u64),
}

impl Decider {
    /// `always`, `never` or `conditional` (with `threshold` tokens).
    pub fn parse(name: &str, threshold: u64) -> Result<Self> {
        match name {
            "always" => Ok(Self::Always),
            "never" => Ok(Self::Never),
            "conditional" => Ok(Self::Conditional(threshold)),
            _ => Err(invalid(format!(
                "decider must be always, never or conditional, got {name:?}"
            ))),
        }
    }

    /// Whether a request of `uncached` prompt tokens is split.
    pub fn split(self, uncached: u64) -> bool {
        match self {
            Self::Always => true,
            Self::Never => false,
            Self::Conditional(threshold) => uncached > threshold,
        }
    }
}

/// A disaggregated fleet.
#[derive(Debug, Clone)]
pub struct DisaggFleet {
    /// The prefill pool; None with the `never` decider only.
    pub prefill: Option<PoolConfig>,
    /// The decode pool (it also runs the requests kept aggregated).
    pub decode: PoolConfig,
    pub decider: Decider,
    pub transfer: Transfer,
    /// Fraction of requests, by arrival, left out of the figures.
    pub warmup: f64,
    /// See [`super::engine::EngineLimits::fast_forward`].
    pub fast_forward: bool,
}

/// What happened to each request (NaN where it does not apply) and to each pool.
#[derive(Debug, Clone, Default)]
pub struct DisaggReport {
    pub ttft: Vec<f64>,
    /// (e2e - ttft) / (L_out - 1); NaN for one-token outputs.
    pub tpot: Vec<f64>,
    pub e2e: Vec<f64>,
    /// Prefilled on a prefill endpoint.
    pub disaggregated: Vec<bool>,
    pub measured: Vec<bool>,
    /// The prefill pool's figures (when there is one), then the decode pool's.
    pub pools: Vec<PoolReport>,
    pub window: (f64, f64),
    pub makespan: f64,
}

/// An iteration end of endpoint `id` (tag 0, with its version) or the end of
/// request `id`'s transfer (tag 1), at a time given by its bits.
type Heap = BinaryHeap<Reverse<(u64, u8, usize, u64)>>;

struct Run<'a> {
    requests: &'a [SimRequest],
    fleet: &'a DisaggFleet,
    pools: Vec<&'a PoolConfig>,
    /// Prefill endpoints first, then decode endpoints.
    endpoints: Vec<Endpoint>,
    first_decode: usize,
    version: Vec<u64>,
    blocks: RequestBlocks,
    window: (f64, f64),
    report: DisaggReport,
}

impl<'a> Run<'a> {
    fn pool_of(&self, i: usize) -> usize {
        usize::from(i >= self.first_decode && self.fleet.prefill.is_some())
    }

    /// The least-loaded endpoint of `lo..hi`.
    fn least_loaded(&self, lo: usize, hi: usize) -> usize {
        (lo..hi)
            .min_by_key(|&i| self.endpoints[i].load())
            .unwrap_or(lo)
    }

    fn wake(&mut self, i: usize, now: f64, heap: &mut Heap) {
        let e = &mut self.endpoints[i];
        let at = if e.busy {
            e.interrupt(now)
        } else {
            e.busy = true;
            Some(now)
        };
        if let Some(t) = at {
            self.version[i] += 1;
            heap.push(Reverse((t.to_bits(), 0, i, self.version[i])));
        }
    }

    fn start(&mut self, i: usize, now: f64, heap: &mut Heap) {
        let timing = self.pools[self.pool_of(i)].timing.as_ref();
        let e = &mut self.endpoints[i];
        match e.step(now, timing, self.window, &self.blocks) {
            Some(dt) => {
                e.busy = true;
                self.version[i] += 1;
                heap.push(Reverse(((now + dt).to_bits(), 0, i, self.version[i])));
            }
            None => e.busy = false,
        }
    }

    fn arrive(&mut self, k: usize, heap: &mut Heap) {
        let r = self.requests[k];
        let n = self.endpoints.len();
        if self.fleet.prefill.is_some() && self.fleet.decider.split(r.input_tokens) {
            self.report.disaggregated[k] = true;
            let i = self.least_loaded(0, self.first_decode);
            self.endpoints[i].enqueue(k, r.input_tokens, 1, (0, 0));
            self.wake(i, r.arrival, heap);
        } else {
            let i = self.least_loaded(self.first_decode, n);
            self.endpoints[i].enqueue(k, r.input_tokens, r.output_tokens, (0, 0));
            self.wake(i, r.arrival, heap);
        }
    }

    /// Request `k`'s KV has arrived at `now`: on to decode.
    fn transferred(&mut self, k: usize, now: f64, heap: &mut Heap) {
        let r = self.requests[k];
        let i = self.least_loaded(self.first_decode, self.endpoints.len());
        self.endpoints[i].enqueue_transferred(k, r.input_tokens, r.output_tokens);
        self.wake(i, now, heap);
    }

    fn handle(&mut self, i: usize, event: Event, heap: &mut Heap) {
        let prefill = i < self.first_decode;
        let rep = &mut self.report;
        match event {
            Event::Admitted { .. } => {}
            Event::FirstToken { request, time } if !prefill => {
                rep.ttft[request] = time - self.requests[request].arrival;
            }
            Event::FirstToken { .. } => {}
            Event::Finished { request, time } if prefill => {
                let delay = self
                    .fleet
                    .transfer
                    .delay_s(self.requests[request].input_tokens);
                heap.push(Reverse(((time + delay).to_bits(), 1, request, 0)));
            }
            Event::Finished { request, time } => {
                let r = &self.requests[request];
                let e2e = time - r.arrival;
                rep.e2e[request] = e2e;
                if r.output_tokens > 1 {
                    rep.tpot[request] = (e2e - rep.ttft[request]) / (r.output_tokens - 1) as f64;
                }
                rep.makespan = rep.makespan.max(time);
            }
        }
    }

    fn run(mut self) -> DisaggReport {
        let mut heap = Heap::new();
        let mut next = 0;
        let mut events = Vec::new();
        loop {
            let t_end = heap.peek().map(|Reverse((t, ..))| f64::from_bits(*t));
            let t_arr = self.requests.get(next).map(|r| r.arrival);
            let arrival_first = match (t_arr, t_end) {
                (None, None) => break,
                (Some(ta), Some(te)) => ta <= te,
                (Some(_), None) => true,
                (None, Some(_)) => false,
            };
            if arrival_first {
                self.arrive(next, &mut heap);
                next += 1;
                continue;
            }
            let Some(Reverse((te, tag, i, version))) = heap.pop() else {
                break;
            };
            let now = f64::from_bits(te);
            if tag == 1 {
                self.transferred(i, now, &mut heap);
                continue;
            }
            if version != self.version[i] {
                continue;
            }
            self.endpoints[i].end_iteration(self.window, &self.blocks);
            std::mem::swap(&mut events, &mut self.endpoints[i].pending);
            for e in events.drain(..) {
                self.handle(i, e, &mut heap);
            }
            self.start(i, now, &mut heap);
        }
        self.finish()
    }

    fn finish(mut self) -> DisaggReport {
        let span = self.window.1 - self.window.0;
        let mut lo = 0;
        for (p, pool) in self.pools.iter().enumerate() {
            let hi = if p + 1 < self.pools.len() {
                self.first_decode
            } else {
                self.endpoints.len()
            };
            let insts = &self.endpoints[lo..hi];
            let on_prefill = p == 0 && self.fleet.prefill.is_some();
            let requests = (0..self.requests.len())
                .filter(|&k| self.report.measured[k])
                .filter(|&k| !on_prefill || self.report.disaggregated[k])
                .count() as u64;
            let slot_seconds: f64 = insts.iter().map(|e| e.slot_seconds).sum();
            let slots = (pool.endpoints * pool.max_num_seqs) as f64;
            let iterations: f64 = insts.iter().map(|e| e.iterations).sum();
            let prefilled: f64 = insts.iter().map(|e| e.prefill_tokens).sum();
            self.report.pools.push(PoolReport {
                name: pool.name.clone(),
                endpoints: pool.endpoints,
                gpus: pool.endpoints as u64 * pool.gpus_per_endpoint,
                max_context: pool.max_context,
                requests,
                utilization_simulated: if span > 0.0 {
                    slot_seconds / slots / span
                } else {
                    f64::NAN
                },
                utilization_model: f64::NAN,
                prefill_utilization_simulated: if iterations > 0.0 {
                    prefilled / (iterations * pool.chunk as f64)
                } else {
                    f64::NAN
                },
                prefill_utilization_model: f64::NAN,
                preemptions: insts.iter().map(|e| e.preemptions).sum(),
                rejections: 0,
                compressed: 0,
            });
            lo = hi;
        }
        self.report
    }
}

/// Simulates `requests` (arrival-sorted, every request fitting the decode
/// pool's context and, when split, the prefill pool's) on `fleet`.
pub fn simulate_disagg(requests: &[SimRequest], fleet: &DisaggFleet) -> Result<DisaggReport> {
    check_sorted(requests)?;
    if !(0.0..1.0).contains(&fleet.warmup) {
        return Err(invalid(format!(
            "warmup must be in [0, 1), got {}",
            fleet.warmup
        )));
    }
    Transfer::new(
        fleet.transfer.bytes_per_token,
        fleet.transfer.bandwidth_bytes_s,
        fleet.transfer.latency_s,
    )?;
    if fleet.prefill.is_none() && fleet.decider != Decider::Never {
        return Err(invalid(
            "a disaggregated fleet needs a prefill pool (at least one endpoint of role \
             prefill) unless its decider is never",
        ));
    }
    for (k, r) in requests.iter().enumerate() {
        crate::error::non_negative("arrival time", r.arrival)?;
        if r.input_tokens < 1 || r.output_tokens < 1 {
            return Err(invalid(format!(
                "request {k}: input and output tokens must be >= 1"
            )));
        }
        let total = r.input_tokens + r.output_tokens;
        let pools = fleet.prefill.iter().chain([&fleet.decode]);
        if let Some(p) = pools.into_iter().find(|p| total > p.max_context) {
            return Err(invalid(format!(
                "request {k}: {total} tokens exceed pool {:?}'s max_context {}",
                p.name, p.max_context
            )));
        }
    }
    let pools: Vec<&PoolConfig> = fleet.prefill.iter().chain([&fleet.decode]).collect();
    let mut endpoints = Vec::new();
    for p in &pools {
        for _ in 0..p.endpoints {
            endpoints.push(Endpoint::new(p.limits(fleet.fast_forward)));
        }
    }
    let first_decode = fleet.prefill.as_ref().map_or(0, |p| p.endpoints);
    let n = requests.len();
    let first_measured = ((n as f64) * fleet.warmup).floor() as usize;
    let window = match (requests.get(first_measured), requests.last()) {
        (Some(a), Some(b)) => (a.arrival, b.arrival),
        _ => (0.0, 0.0),
    };
    let nan = vec![f64::NAN; n];
    let run = Run {
        requests,
        fleet,
        pools,
        version: vec![0; endpoints.len()],
        endpoints,
        first_decode,
        blocks: RequestBlocks::none(n),
        window,
        report: DisaggReport {
            ttft: nan.clone(),
            tpot: nan.clone(),
            e2e: nan,
            disaggregated: vec![false; n],
            measured: (0..n).map(|k| k >= first_measured).collect(),
            pools: Vec::new(),
            window,
            makespan: 0.0,
        },
    };
    Ok(run.run())
}

#[cfg(test)]
mod tests;
