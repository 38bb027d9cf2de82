//! One model endpoint: a vLLM-style iteration-level continuous-batching engine.
//!
//! Every iteration, in this order:
//!
//! 1. Admission, first come first served: the head of the waiting queue enters
//!    the batch while a slot is free (`max_num_seqs`) and the KV blocks of its
//!    whole prompt fit in the free blocks; otherwise it and everything behind
//!    it wait.
//! 2. Decode reservation: every decoding sequence, oldest first, needs the
//!    blocks for one more token. When they are not free, the newest running
//!    sequence is preempted (its blocks freed, its progress dropped) until they
//!    are, as vLLM's recompute preemption does; a preempted sequence goes back
//!    to the front of the queue and later re-prefills its prompt plus the
//!    tokens it had generated.
//! 3. Prefill: up to `chunk` prompt tokens (C_chunk) are shared among the
//!    prefilling sequences in admission order.
//!
//! The iteration lasts `t_iter` from the [`TimingModel`] over the sequences
//! that took part. The iteration that finishes a prompt samples that
//! sequence's next token (the first token, so TTFT = ceil(L_in / C_chunk)
//! iterations for a request alone); each decode iteration samples one more.
//! KV is counted in 16-token blocks: after the prefill of a prompt of `p`
//! tokens a sequence holds `p` tokens of KV; each decode step adds one, so a
//! sequence with `g` generated tokens holds `L_in + g - 1` tokens, at most
//! `L_in + L_out - 1 < L_total`. A pool whose block budget holds
//! `max_num_seqs * ceil(max_context / 16)` blocks can therefore never preempt a
//! request that fits its `max_context`: the token-budget paper's
//! "failure-free by construction".
//!
//! Prefix cache: each endpoint keeps the block hashes of the KV blocks it has
//! computed in a [`PrefixCache`] bounded by its `kv_blocks`, when the workload
//! gives its requests' block hashes (prompt and reply, 16-token blocks). At
//! every admission the prompt's leading cached blocks are looked up and their
//! tokens count as prefilled (at most `prompt - 1`: the last token is always
//! computed, as in vLLM), so a hit skips that part of the prefill; a sequence
//! still allocates the blocks of its whole prompt (sharing is not modelled).
//! A prompt's full blocks are cached when its prefill completes, and every full
//! block of prompt and output when the sequence finishes. A publishing cache
//! (the blocks' token ids known) emits the engine's KV-cache events for
//! these insertions and evictions ([`super::cache`]).
//!
//! Fast-forward: when every running sequence is decoding and the free blocks
//! hold all of them to their last token, the next iterations are identical
//! until the first of them finishes, so they are planned as one stretch of `k`
//! iterations of the same `t_iter`. A request dispatched to the endpoint
//! during the stretch cuts it at the next iteration boundary
//! ([`Endpoint::interrupt`]), where it would have been admitted anyway: the
//! outcome is the iteration-by-iteration one, in far fewer events.

use std::collections::VecDeque;

use super::cache::PrefixCache;
pub use super::cache::BLOCK_TOKENS;
use super::timing::{Batch, TimingModel};
use super::RequestBlocks;

/// KV blocks that hold `tokens` tokens.
pub fn blocks_for(tokens: u64) -> u64 {
    tokens.div_ceil(BLOCK_TOKENS)
}

/// The per-endpoint limits the engine schedules against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLimits {
    pub max_num_seqs: usize,
    pub kv_blocks: u64,
    pub chunk: u64,
    /// Plan identical decode iterations as one stretch (same outcome, fewer
    /// events); off only to check that equivalence.
    pub fast_forward: bool,
}

/// Something that happened to a request during an iteration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event {
    /// Entered the batch (after waiting since arrival or since a preemption),
    /// with `cached` prompt tokens served from the prefix cache.
    Admitted {
        request: usize,
        time: f64,
        cached: u64,
    },
    /// Its first output token was sampled at the end of the iteration.
    FirstToken { request: usize, time: f64 },
    /// Its last output token was sampled; it left the endpoint.
    Finished { request: usize, time: f64 },
}

#[derive(Debug, Clone)]
struct Seq {
    request: usize,
    input: u64,
    output: u64,
    generated: u64,
    /// Prompt of the current (re)computation: the input plus the tokens
    /// generated before the last preemption.
    prompt: u64,
    prefilled: u64,
    blocks: u64,
    /// The request's blocks (prompt and output): `hashes[start..end]` of the
    /// blocks the caller passes to `step`.
    hashes: (usize, usize),
    /// Its prompt's KV was computed elsewhere and transferred here (a
    /// disaggregated decode, [`super::disagg`]): admitted with all of it but
    /// the last token in place, until a preemption drops it.
    transferred: bool,
}

/// A planned run of identical decode iterations.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Stretch {
    start: f64,
    dt: f64,
    iterations: u64,
}

/// One engine. Requests are identified by the caller's index.
#[derive(Debug, Clone)]
pub struct Endpoint {
    limits: EngineLimits,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    free_blocks: u64,
    pub cache: PrefixCache,
    /// An iteration is under way (its end is scheduled by the fleet).
    pub busy: bool,
    pub preemptions: u64,
    /// Slot-seconds occupied inside the measurement window.
    pub slot_seconds: f64,
    /// Iterations run and prompt tokens prefilled, inside the measurement
    /// window (by the iteration's start).
    pub iterations: f64,
    pub prefill_tokens: f64,
    /// Events of the iteration under way, stamped with its end time.
    pub pending: Vec<Event>,
    stretch: Option<Stretch>,
    /// End of the single iteration under way, whose sequences leave then.
    iteration_end: Option<f64>,
}

impl Endpoint {
    pub fn new(limits: EngineLimits) -> Self {
        Self {
            limits,
            waiting: VecDeque::new(),
            running: Vec::new(),
            free_blocks: limits.kv_blocks,
            cache: PrefixCache::new(limits.kv_blocks as usize),
            busy: false,
            preemptions: 0,
            slot_seconds: 0.0,
            iterations: 0.0,
            prefill_tokens: 0.0,
            pending: Vec::new(),
            stretch: None,
            iteration_end: None,
        }
    }

    /// Requests on the endpoint, running or waiting: the dispatch load.
    pub fn load(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    /// Running sequences and the share of KV blocks they hold, as the engine's
    /// metrics report them (vLLM's `num_requests_running`,
    /// `num_requests_waiting`, `kv_cache_usage_perc`).
    pub fn running(&self) -> usize {
        self.running.len()
    }
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn kv_usage(&self) -> f64 {
        1.0 - self.free_blocks as f64 / self.limits.kv_blocks as f64
    }

    /// Queues a request of `input` prompt and `output` generated tokens
    /// (`output` >= 1) whose block hashes are `hashes` (a range of the slice
    /// passed to `step`; empty when unknown). The caller has checked that it
    /// fits the endpoint.
    pub fn enqueue(&mut self, request: usize, input: u64, output: u64, hashes: (usize, usize)) {
        self.waiting.push_back(Seq {
            request,
            input,
            output,
            generated: 0,
            prompt: input,
            prefilled: 0,
            blocks: 0,
            hashes,
            transferred: false,
        });
    }

    /// Queues a request whose prompt's KV arrives with it (see
    /// [`Seq::transferred`]): its first iteration computes the prompt's last
    /// token and samples the first output token.
    pub fn enqueue_transferred(&mut self, request: usize, input: u64, output: u64) {
        self.enqueue(request, input, output, (0, 0));
        if let Some(s) = self.waiting.back_mut() {
            s.transferred = true;
        }
    }

    fn preempt_last(&mut self) {
        if let Some(mut s) = self.running.pop() {
            self.free_blocks += s.blocks;
            s.blocks = 0;
            s.prefilled = 0;
            s.transferred = false;
            s.prompt = s.input + s.generated;
            self.waiting.push_front(s);
            self.preemptions += 1;
        }
    }

    /// Plans one iteration (or a stretch) starting at `now`; returns its
    /// duration, or None when there is nothing to run. Admissions and
    /// preemptions happen now; sequences leave at the end, in `end_iteration`.
    /// Events go to `pending`. Slot occupancy inside `window` is added to
    /// `slot_seconds`. `blocks` holds every request's blocks.
    pub fn step(
        &mut self,
        now: f64,
        timing: &dyn TimingModel,
        window: (f64, f64),
        blocks: &RequestBlocks,
    ) -> Option<f64> {
        // 1. Admission.
        while let Some(head) = self.waiting.front() {
            let need = blocks_for(head.prompt);
            if self.running.len() >= self.limits.max_num_seqs || need > self.free_blocks {
                break;
            }
            if let Some(mut s) = self.waiting.pop_front() {
                self.free_blocks -= need;
                s.blocks = need;
                let prompt_blocks = full_blocks(&s, s.prompt);
                let hit = self.cache.lookup(&blocks.hashes[prompt_blocks]) as u64;
                s.prefilled = if s.transferred {
                    s.prompt.saturating_sub(1)
                } else {
                    (hit * BLOCK_TOKENS).min(s.prompt - 1)
                };
                self.pending.push(Event::Admitted {
                    request: s.request,
                    time: now,
                    cached: s.prefilled,
                });
                self.running.push(s);
            }
        }
        if self.limits.fast_forward {
            if let Some(dt) = self.plan_stretch(now, timing) {
                return Some(dt);
            }
        }
        // 2. Decode reservation, preempting the newest when blocks run out.
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if s.prefilled == s.prompt {
                let extra = blocks_for(s.input + s.generated) - s.blocks;
                while extra > self.free_blocks && self.running.len() > i + 1 {
                    self.preempt_last();
                }
                if extra > self.free_blocks {
                    self.preempt_last();
                    break;
                }
                self.free_blocks -= extra;
                self.running[i].blocks += extra;
            }
            i += 1;
        }
        // 3. Prefill chunk, then the batch's members.
        let mut budget = self.limits.chunk;
        let mut n_active = 0;
        let mut prefill_tokens = 0;
        for s in &mut self.running {
            if s.prefilled < s.prompt {
                if budget == 0 {
                    continue;
                }
                let take = budget.min(s.prompt - s.prefilled);
                s.prefilled += take;
                budget -= take;
                prefill_tokens += take;
                if s.prefilled < s.prompt {
                    n_active += 1;
                    continue;
                }
                insert(&mut self.cache, blocks, full_blocks(s, s.prompt));
            }
            // A decode step, or the end of a prefill: one token is sampled.
            n_active += 1;
            s.generated += 1;
        }
        if n_active == 0 {
            return None;
        }
        let dt = timing.iteration_time(Batch {
            n_active,
            prefill_tokens,
        });
        let end = now + dt;
        self.occupy(now, end, window);
        if now >= window.0 && now < window.1 {
            self.iterations += 1.0;
            self.prefill_tokens += prefill_tokens as f64;
        }
        self.iteration_end = Some(end);
        Some(dt)
    }

    fn occupy(&mut self, start: f64, end: f64, window: (f64, f64)) {
        let overlap = (end.min(window.1) - start.max(window.0)).max(0.0);
        self.slot_seconds += overlap * self.running.len() as f64;
    }

    /// First tokens and finished sequences of an iteration ending at `end`.
    /// Sequences still prefilling did not sample.
    fn release(&mut self, end: f64, blocks: &RequestBlocks) {
        let pending = &mut self.pending;
        let free = &mut self.free_blocks;
        let cache = &mut self.cache;
        self.running.retain(|s| {
            if s.prefilled < s.prompt {
                return true;
            }
            if s.generated == 1 && s.prompt == s.input {
                pending.push(Event::FirstToken {
                    request: s.request,
                    time: end,
                });
            }
            if s.generated >= s.output {
                pending.push(Event::Finished {
                    request: s.request,
                    time: end,
                });
                // Its KV holds the prompt and every output token but the last.
                insert(cache, blocks, full_blocks(s, s.input + s.output - 1));
                *free += s.blocks;
                return false;
            }
            true
        });
    }

    /// A stretch of identical decode iterations from `now`, if the batch is
    /// all decoding and the free blocks hold every sequence to its end.
    /// Returns its length in seconds.
    fn plan_stretch(&mut self, now: f64, timing: &dyn TimingModel) -> Option<f64> {
        let mut need = 0;
        let mut iterations = u64::MAX;
        for s in &self.running {
            if s.prefilled < s.prompt {
                return None;
            }
            need += blocks_for(s.input + s.output - 1) - s.blocks;
            iterations = iterations.min(s.output - s.generated);
        }
        if self.running.is_empty() || need > self.free_blocks {
            return None;
        }
        let dt = timing.iteration_time(Batch {
            n_active: self.running.len(),
            prefill_tokens: 0,
        });
        self.stretch = Some(Stretch {
            start: now,
            dt,
            iterations,
        });
        Some(dt * iterations as f64)
    }

    /// A request was queued at `now` during a stretch: cut the stretch at the
    /// first iteration boundary at or after `now`. Returns the new end time
    /// when the stretch was shortened.
    pub fn interrupt(&mut self, now: f64) -> Option<f64> {
        let st = self.stretch.as_mut()?;
        let done = ((now - st.start) / st.dt).ceil().max(1.0) as u64;
        if done >= st.iterations {
            return None;
        }
        st.iterations = done;
        Some(st.start + st.dt * done as f64)
    }

    /// At the end of the iteration or stretch under way: applies it, records
    /// first tokens, and lets finished sequences leave with their blocks.
    pub fn end_iteration(&mut self, window: (f64, f64), blocks: &RequestBlocks) {
        if let Some(end) = self.iteration_end.take() {
            self.release(end, blocks);
        }
        let Some(st) = self.stretch.take() else {
            return;
        };
        let end = st.start + st.dt * st.iterations as f64;
        self.occupy(st.start, end, window);
        // Decode-only iterations whose start falls inside the window.
        let first = ((window.0 - st.start) / st.dt).ceil().max(0.0);
        let last = ((window.1 - st.start) / st.dt)
            .ceil()
            .min(st.iterations as f64);
        self.iterations += (last - first).max(0.0);
        for s in &mut self.running {
            s.generated += st.iterations;
            let blocks = blocks_for(s.input + s.generated - 1);
            self.free_blocks -= blocks - s.blocks;
            s.blocks = blocks;
        }
        self.release(end, blocks);
    }
}

/// The full blocks of `s`'s first `tokens` tokens (as many as the workload
/// gave), as indices into the blocks.
fn full_blocks(s: &Seq, tokens: u64) -> std::ops::Range<usize> {
    super::leading_blocks(s.hashes, tokens)
}

/// Caches blocks `range` (one sequence's computed blocks) with their token ids.
fn insert(cache: &mut PrefixCache, blocks: &RequestBlocks, range: std::ops::Range<usize>) {
    let tokens = blocks.tokens_of(range.clone()).unwrap_or_default();
    cache.insert(&blocks.hashes[range], tokens);
}
