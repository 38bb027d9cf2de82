//! Scorer `precise-prefix`: the leading prompt blocks each endpoint's engine
//! actually holds, from its KV-cache events (`crate::kv::KvIndex`, llm-d's
//! precise prefix-cache scorer and Dynamo's KV router).
//!
//! It needs the request's token ids (`PickRequest::token_ids`: a tokenizer or
//! the caller): it hashes them as the index keys blocks (routecore's chained
//! block hashes, the request's LoRA adapter's own seed) and scores a
//! candidate `leading_blocks / blocks`. A candidate whose event stream is
//! down or stale, and every candidate of a request without token ids, is
//! scored by the approximate `prefix` scorer it carries (same parameters as
//! `prefix`), which also keeps recording what was routed so the fallback
//! stays warm.

use std::sync::Arc;

use super::prefix::PrefixScorer;
use super::{Ctx, PickRequest};
use crate::error::Result;
use crate::kv::KvIndex;
use crate::snapshot::{Reader, Writer};

#[derive(Debug, Clone)]
pub struct PrecisePrefixScorer {
    kv: Arc<KvIndex>,
    approx: PrefixScorer,
    // Scratch, reused by every pick.
    hashes: Vec<u64>,
    fallback: Vec<f64>,
}

impl PrecisePrefixScorer {
    pub fn new(kv: Arc<KvIndex>, approx: PrefixScorer) -> Self {
        Self {
            kv,
            approx,
            hashes: Vec::new(),
            fallback: Vec::new(),
        }
    }

    /// The approximate scorer that stands in for endpoints without live events.
    pub fn approx(&self) -> &PrefixScorer {
        &self.approx
    }
    pub fn approx_mut(&mut self) -> &mut PrefixScorer {
        &mut self.approx
    }

    pub(super) fn score(
        &mut self,
        req: &PickRequest<'_>,
        ctx: &Ctx<'_>,
        out: &mut [f64],
    ) -> Result<()> {
        let Some(ids) = req.token_ids else {
            return self.approx.score(req, ctx, out);
        };
        self.hashes = self.kv.request_hashes(ids, req.adapter);
        let blocks = self.hashes.len().max(1) as f64;
        let mut approx_scored = false;
        for (k, o) in out.iter_mut().enumerate() {
            match self
                .kv
                .leading_blocks(&ctx.names[ctx.cand[k]], &self.hashes)
            {
                Some(held) => *o = held as f64 / blocks,
                None => {
                    if !approx_scored {
                        self.fallback.resize(ctx.cand.len(), 0.0);
                        self.approx.score(req, ctx, &mut self.fallback)?;
                        approx_scored = true;
                    }
                    *o = self.fallback[k];
                }
            }
        }
        Ok(())
    }

    pub(super) fn write(&self, w: &mut Writer) {
        self.approx.write(w);
    }

    pub(super) fn read(&mut self, r: &mut Reader<'_>) -> Result<()> {
        self.approx.read(r)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{EndpointState, PickConfig, Pipeline};
    use super::*;
    use crate::kv::{Event, KvConfig, Stored};
    use crate::prefix::{block_hashes, Tokens};

    const BS: usize = 4;

    fn names() -> Vec<String> {
        (0..3).map(|i| format!("e{i}")).collect()
    }

    /// A KV index where every endpoint is live and `holder` holds `prompt`.
    fn kv_with(holder: &str, prompt: &[u32], lora: Option<&str>) -> Arc<KvIndex> {
        let kv = KvIndex::new(KvConfig {
            block_size: BS,
            ..KvConfig::default()
        })
        .expect("kv");
        for n in names() {
            kv.add_endpoint(&n);
            kv.set_connected(&n, true).expect("endpoint");
        }
        let blocks = prompt.len() / BS;
        let event = Event::Stored(Stored {
            hashes: (0..blocks as u64).collect(),
            parent: None,
            token_ids: prompt[..blocks * BS].to_vec(),
            block_size: BS,
            lora: lora.map(str::to_owned),
            medium: None,
        });
        kv.observe(holder, 0).expect("seq");
        kv.apply(holder, 0, &[Ok(event)], 0.0).expect("apply");
        Arc::new(kv)
    }

    fn pipeline(kv: &Arc<KvIndex>) -> Pipeline {
        let config = PickConfig {
            kv_index: Some(Arc::clone(kv)),
            ..PickConfig::default()
        };
        Pipeline::preset("precise-prefix", &names(), &config).expect("pipeline")
    }

    fn request<'a>(hashes: &'a [u64], ids: Option<&'a [u32]>) -> PickRequest<'a> {
        PickRequest {
            hashes,
            token_ids: ids,
            ..PickRequest::default()
        }
    }

    #[test]
    fn the_endpoint_holding_the_most_leading_blocks_wins() {
        let prompt: Vec<u32> = (0..16).collect();
        let kv = kv_with("e2", &prompt[..8], None);
        let mut p = pipeline(&kv);
        let states = vec![EndpointState::default(); 3];
        assert_eq!(
            p.pick_one(&request(&[], Some(&prompt)), &states),
            Ok(Some(2))
        );
        // Another prompt sharing no first block: no endpoint holds it; ties
        // go to the least loaded (the first here).
        let other: Vec<u32> = (100..116).collect();
        assert_eq!(
            p.pick_one(&request(&[], Some(&other)), &states),
            Ok(Some(0))
        );
    }

    #[test]
    fn adapters_match_only_their_own_blocks() {
        let prompt: Vec<u32> = (0..8).collect();
        let kv = kv_with("e1", &prompt, Some("sql"));
        let mut p = pipeline(&kv);
        let states = vec![EndpointState::default(); 3];
        let mut r = request(&[], Some(&prompt));
        assert_eq!(p.pick_one(&r, &states), Ok(Some(0)), "base model: no hit");
        r.adapter = Some("sql");
        assert_eq!(p.pick_one(&r, &states), Ok(Some(1)));
    }

    /// Without token ids, or for an endpoint whose stream is not live, the
    /// approximate prefix index (what routecore routed) scores.
    #[test]
    fn without_token_ids_or_live_events_the_approximate_index_scores() {
        let prompt: Vec<u32> = (0..32).collect();
        let hashes = block_hashes(Tokens::Ids(&prompt), 16, 0).expect("hashes");
        let kv = kv_with("e2", &[], None);
        let mut p = pipeline(&kv);
        let states = vec![EndpointState::default(); 3];
        // The approximate index learns that e1 got this prompt.
        p.started(&request(&hashes, None), 1).expect("started");
        assert_eq!(p.pick_one(&request(&hashes, None), &states), Ok(Some(1)));
        // With token ids, the live events say nobody holds it.
        let with_ids = request(&hashes, Some(&prompt));
        assert_eq!(p.pick_one(&with_ids, &states), Ok(Some(0)));
        // e1's stream goes down: its score comes from the approximate index.
        kv.set_connected("e1", false).expect("e1");
        assert_eq!(p.pick_one(&with_ids, &states), Ok(Some(1)));
    }

    /// `precise-prefix+queue+kv`: the holder wins over a shorter queue; once
    /// its engine clears its cache the next request goes by load.
    #[test]
    fn a_held_prompt_goes_to_its_holder_until_the_engine_clears() {
        let prompt: Vec<u32> = (0..32).collect();
        let kv = kv_with("e1", &prompt, None);
        let config = PickConfig {
            kv_index: Some(Arc::clone(&kv)),
            ..PickConfig::default()
        };
        let mut p = Pipeline::preset("precise-prefix+queue+kv", &names(), &config).expect("p");
        let states: Vec<EndpointState> = [1.0, 2.0, 3.0]
            .into_iter()
            .map(|w| EndpointState {
                waiting: Some(w),
                running: Some(0.0),
                kv_usage: Some(0.1),
                ..EndpointState::default()
            })
            .collect();
        let r = request(&[], Some(&prompt));
        assert_eq!(p.pick_one(&r, &states), Ok(Some(1)));
        kv.observe("e1", 1).expect("seq");
        kv.apply("e1", 1, &[Ok(Event::Cleared)], 0.0)
            .expect("apply");
        assert_eq!(p.pick_one(&r, &states), Ok(Some(0)), "by load");
    }
}
