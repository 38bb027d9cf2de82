//! The prefix-cache-aware router (AIBrix gateway routing algorithms,
//! "Prefix Cache Aware"), beside the picker it wraps.
//!
//! `PrefixCacheRouter` is the endpoint picker's `prefix` preset: the
//! `prefix` scorer (`pick/prefix.rs`) with ties to the least-loaded. It
//! decides as the paper's pseudo-code, with its documented defaults:
//!
//! 1. If `max - min` running requests over the endpoints exceeds
//!    `imbalance_abs_count`, route to the least-loaded endpoint.
//! 2. Otherwise match the prompt's hashes from the first block on, per endpoint,
//!    stopping at an endpoint's first miss. Order the endpoints that match at least one
//!    block by matched blocks (descending; the same order as match percent),
//!    then running requests (ascending), then endpoint order; take the first whose
//!    running count is at or below `mean + std_factor * std` (population std
//!    over all endpoints; "at or below", so equal loads keep prefix matching).
//! 3. If nothing was chosen, the least-loaded endpoint (first on ties).
//!
//! The prompt's blocks are then recorded for the chosen endpoint, and the endpoint
//! counts one more running request.

use std::sync::{Arc, Mutex};

use super::prefix::PrefixScorer;
use super::{preset_specs, PickConfig, PickRequest, Pipeline, PluginSpec, PoolPicker};
use crate::endpoint::{check_in_flight, set_in_flight};
use crate::error::{finite, invalid, Error, Result};
use crate::prefix::{check_offsets, lock, PrefixConfig, PrefixIndex, MAX_BLOCK_SIZE};
use crate::snapshot::{restore, Reader, Writer};

const ROUTER_MAGIC: &[u8; 4] = b"RCPR";
const SNAPSHOT_VERSION: u16 = 1;

/// One decision: the endpoint's index in the router and the prompt's blocks
/// it held according to the index when it was chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixDecision {
    pub endpoint: usize,
    pub matched_blocks: usize,
    pub blocks: usize,
}

impl PrefixDecision {
    /// `matched_blocks / blocks`, 0 for a prompt shorter than one block.
    pub fn match_fraction(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            self.matched_blocks as f64 / self.blocks as f64
        }
    }
}

/// The prefix-cache-aware router: the endpoint picker's `prefix` preset
/// (the `prefix` scorer alone, ties to the least-loaded then the first)
/// over a set of endpoints, a (shareable) index and the endpoints' running
/// counts.
#[derive(Debug)]
pub struct PrefixCacheRouter {
    config: PrefixConfig,
    on: PoolPicker,
}

impl PrefixCacheRouter {
    pub fn new<S: AsRef<str>>(
        endpoints: &[S],
        config: PrefixConfig,
        index: Arc<Mutex<PrefixIndex>>,
    ) -> Result<Self> {
        let pick = PickConfig {
            seed: 0,
            prefix_index: Some(index),
            kv_index: None,
        };
        let pipeline = Pipeline::from_specs(&prefix_preset(&config), endpoints, &pick)?;
        Ok(Self {
            config,
            on: PoolPicker::new(pipeline),
        })
    }

    pub fn config(&self) -> &PrefixConfig {
        &self.config
    }
    pub fn endpoints(&self) -> &[String] {
        self.on.names()
    }
    /// Running requests per endpoint, in endpoint order.
    pub fn running(&self) -> Vec<u64> {
        self.on.running()
    }
    pub fn index(&self) -> &Arc<Mutex<PrefixIndex>> {
        self.scorer().index()
    }
    fn scorer(&self) -> &PrefixScorer {
        match self.on.pipeline.prefix() {
            Some(p) => p,
            None => unreachable!("the prefix preset has a prefix scorer"),
        }
    }

    /// Routes one prompt given by its block hashes, records its blocks for the
    /// chosen endpoint and counts it running there. `running`, if given, first
    /// overwrites the endpoints' running counts (telemetry).
    pub fn route_hashes(
        &mut self,
        hashes: &[u64],
        running: Option<&[i64]>,
        now: f64,
    ) -> Result<PrefixDecision> {
        let mut d = self.route_many_hashes(hashes, &[0, hashes.len() as i64], running, now)?;
        d.pop().ok_or_else(|| invalid("no decision"))
    }

    /// Routes a batch (ragged hashes as from `hashes_many`) exactly as
    /// `route_hashes` one by one would, `running` applied before the first.
    pub fn route_many_hashes(
        &mut self,
        hashes: &[u64],
        offsets: &[i64],
        running: Option<&[i64]>,
        now: f64,
    ) -> Result<Vec<PrefixDecision>> {
        let now = finite("now", now)?;
        let offsets = check_offsets(offsets, hashes.len())?;
        if self.on.states.is_empty() {
            return Err(invalid("the router has no endpoints"));
        }
        if let Some(r) = running {
            check_in_flight(&self.on.states, r)?;
        }
        // Interning the endpoints in the index is the one step that may
        // fail (a full index): done before anything changes.
        self.on.pipeline.prepare()?;
        if let Some(r) = running {
            set_in_flight(&mut self.on.states, r)?;
        }
        let mut out = Vec::with_capacity(offsets.len().saturating_sub(1));
        for w in offsets.windows(2) {
            let req = PickRequest {
                hashes: &hashes[w[0]..w[1]],
                now,
                ..PickRequest::default()
            };
            let endpoint = self.on.start(&req)?.ok_or_else(|| invalid("no endpoint"))?;
            let matched_blocks = self.scorer().matched(endpoint);
            out.push(PrefixDecision {
                endpoint,
                matched_blocks,
                blocks: req.hashes.len(),
            });
        }
        Ok(out)
    }

    pub fn add_endpoint(&mut self, name: &str) -> Result<()> {
        self.on.add_endpoint(name).map(drop)
    }

    /// Removes an endpoint from the router and its blocks from the index.
    pub fn remove_endpoint(&mut self, name: &str) -> Result<()> {
        self.on.remove_endpoint(name).map(drop)
    }

    /// Ends one running request on `name`; refused when none is running.
    pub fn complete(&mut self, name: &str) -> Result<()> {
        let e = self.on.index(name)?;
        self.on.complete(e, &PickRequest::default(), 0, 0)
    }

    pub fn set_running(&mut self, counts: &[i64]) -> Result<()> {
        self.on.set_running(counts)
    }

    /// Settings, endpoints, running counts and the index.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(ROUTER_MAGIC, SNAPSHOT_VERSION);
        let c = &self.config;
        w.u64(c.block_size as u64)
            .u64(c.imbalance_abs_count)
            .f64(c.std_factor)
            .u64(c.seed);
        self.on.write_counts(&mut w);
        lock(self.index()).write(&mut w);
        w.finish()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        restore(
            bytes,
            ROUTER_MAGIC,
            SNAPSHOT_VERSION,
            "prefix cache router",
            Self::read,
        )
    }

    fn read(r: &mut Reader<'_>) -> Result<Self> {
        let block_size = r.u64()?;
        let imbalance = r.u64()?;
        let std_factor = r.f64()?;
        let seed = r.u64()?;
        if block_size > MAX_BLOCK_SIZE as u64 || imbalance > i64::MAX as u64 {
            return Err(Error::Snapshot("bad settings".into()));
        }
        let config = PrefixConfig::new(block_size as usize, imbalance as i64, std_factor, seed)?;
        let (names, running) = PoolPicker::read_counts(r)?;
        let index = PrefixIndex::read(r)?;
        let mut router = Self::new(&names, config, Arc::new(Mutex::new(index)))?;
        router.on.restore_running(&running);
        Ok(router)
    }
}

/// The `prefix` preset with this router's settings.
fn prefix_preset(c: &PrefixConfig) -> Vec<PluginSpec> {
    let mut specs = preset_specs("prefix").unwrap_or_default();
    for s in &mut specs {
        if s.name == "prefix" {
            s.params = serde_json::json!({
                "block_size": c.block_size,
                "seed": c.seed,
                "imbalance_abs_count": c.imbalance_abs_count,
                "std_factor": c.std_factor,
            });
        }
    }
    specs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::{block_hashes, block_hashes_many, Tokens};

    fn ids(n: u32) -> Vec<u32> {
        (0..n).map(|i| i.wrapping_mul(2_654_435_761)).collect()
    }

    #[test]
    fn routing_keeps_a_prompt_most_recent_in_prompt_order() {
        let mut r = router(&["a", "b"], 16);
        let p = hashes(Tokens::Ids(&ids(20)));
        let q = hashes(Tokens::Ids(&[7; 12]));
        r.route_hashes(&p, None, 1.0).expect("route");
        r.route_hashes(&q, None, 2.0).expect("route");
        // p again: its blocks are found by matching and moved to the front.
        r.route_hashes(&p, None, 3.0).expect("route");
        let order: Vec<u64> = lock(r.index()).dump().iter().map(|e| e.0).collect();
        assert_eq!(order, [p.clone(), q].concat());
        // A capacity below the prompt keeps its first blocks.
        let mut ix = PrefixIndex::new(3, None).expect("index");
        ix.record(&p, "a", 0.0).expect("record");
        let order: Vec<u64> = ix.dump().iter().map(|e| e.0).collect();
        assert_eq!(order, p[..3].to_vec());
    }

    #[test]
    fn more_than_64_endpoints_use_the_overflow_list() {
        let names: Vec<String> = (0..70).map(|i| format!("p{i}")).collect();
        let config = PrefixConfig::new(4, 1000, 2.0, 0).expect("config");
        let index = Arc::new(Mutex::new(PrefixIndex::new(1000, None).expect("index")));
        let mut r = PrefixCacheRouter::new(&names, config, index).expect("router");
        let p = hashes(Tokens::Ids(&ids(12)));
        let mut running = vec![1i64; 70];
        running[66] = 0;
        assert_eq!(
            r.route_hashes(&p, Some(&running), 0.0)
                .expect("route")
                .endpoint,
            66
        );
        running[66] = 1;
        running[3] = 0;
        let half = &p[..2];
        // p66 (id 66, in the overflow list) holds both blocks: it beats the
        // least-loaded p3.
        assert_eq!(
            r.route_hashes(half, Some(&running), 0.0)
                .expect("route")
                .endpoint,
            66
        );
        let mut ix = lock(r.index()).clone();
        assert_eq!(ix.match_prefix(&p, 0.0), Ok(vec![("p66".into(), 3)]));
        let back = PrefixIndex::from_bytes(&ix.to_bytes()).expect("restore");
        assert_eq!(back.dump(), ix.dump());
        ix.record(half, "p3", 1.0).expect("record");
        assert_eq!(
            ix.match_prefix(&p, 1.0),
            Ok(vec![("p3".into(), 2), ("p66".into(), 3)])
        );
        assert_eq!(ix.remove_endpoint("p66"), Ok(3));
        assert_eq!(ix.match_prefix(&p, 1.0), Ok(vec![("p3".into(), 2)]));
        assert_eq!(ix.len(), 2);
    }

    fn hashes(tokens: Tokens<'_>) -> Vec<u64> {
        block_hashes(tokens, 4, 0).expect("hashes")
    }

    fn router(endpoints: &[&str], imbalance: i64) -> PrefixCacheRouter {
        let config = PrefixConfig::new(4, imbalance, 2.0, 0).expect("config");
        let index = Arc::new(Mutex::new(PrefixIndex::new(1000, None).expect("index")));
        PrefixCacheRouter::new(endpoints, config, index).expect("router")
    }

    #[test]
    fn routes_to_the_longest_match_within_the_load_guard() {
        let mut r = router(&["a", "b", "c"], 16);
        let p1 = hashes(Tokens::Ids(&ids(16)));
        // Nothing cached: least-loaded, first on ties.
        let d = r.route_hashes(&p1, Some(&[0, 0, 0]), 0.0).expect("route");
        assert_eq!((d.endpoint, d.matched_blocks, d.blocks), (0, 0, 4));
        // Equal loads: prefix matching still applies (at or below the limit).
        let d = r.route_hashes(&p1, Some(&[2, 2, 2]), 0.0).expect("route");
        assert_eq!((d.endpoint, d.match_fraction()), (0, 1.0));
        // Loads [3, 0, 0]: mean 1, std sqrt(2), limit 1 + 2 sqrt(2) = 3.83 >= 3.
        assert_eq!(
            r.route_hashes(&p1, Some(&[3, 0, 0]), 0.0)
                .expect("route")
                .endpoint,
            0
        );
        // Loads [5, 0, 0, ...]: with 3 endpoints the limit is 5/3 + 2*2.357 = 6.38;
        // with 9 endpoints mean 5/9, std 1.571, limit 3.70 < 5: the hot spot is avoided.
        let mut r9 = router(&["a", "b", "c", "d", "e", "f", "g", "h", "i"], 16);
        r9.route_hashes(&p1, None, 0.0).expect("route");
        let d = r9
            .route_hashes(&p1, Some(&[5, 0, 0, 0, 0, 0, 0, 0, 0]), 0.0)
            .expect("route");
        assert_eq!((d.endpoint, d.matched_blocks), (1, 0));
        // b gets p1's first 2 blocks (the imbalance guard sends them there).
        let p2 = hashes(Tokens::Ids(&ids(8)));
        assert_eq!(
            r.route_hashes(&p2, Some(&[20, 0, 1]), 0.0)
                .expect("route")
                .endpoint,
            1
        );
        // A longer match wins over a shorter one (a: 4 blocks, b: 2).
        assert_eq!(
            r.route_hashes(&p1, Some(&[1, 0, 0]), 0.0)
                .expect("route")
                .endpoint,
            0
        );
        // Equal matches (2 blocks each): the less loaded.
        let d = r.route_hashes(&p2, Some(&[2, 1, 0]), 0.0).expect("route");
        assert_eq!((d.endpoint, d.matched_blocks), (1, 2));
        // Imbalance (max - min = 17 > 16) skips matching: least-loaded.
        let d = r.route_hashes(&p1, Some(&[0, 17, 1]), 0.0).expect("route");
        assert_eq!((d.endpoint, d.matched_blocks), (0, 4));
        let d = r.route_hashes(&p1, Some(&[17, 1, 0]), 0.0).expect("route");
        assert_eq!(d.endpoint, 2);
    }

    #[test]
    fn batch_equals_one_by_one_and_errors_change_nothing() {
        let prompts: Vec<Vec<u32>> = (0..12).map(|i| ids(4 * (i % 5) + 3)).collect();
        let mut flat = Vec::new();
        let mut offsets = vec![0i64];
        for p in &prompts {
            flat.extend_from_slice(p);
            offsets.push(flat.len() as i64);
        }
        let mut one = router(&["a", "b", "c"], 2);
        let mut many = router(&["a", "b", "c"], 2);
        let singles: Vec<PrefixDecision> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let running: &[i64] = &[1, 0, 2];
                let h = hashes(Tokens::Ids(p));
                one.route_hashes(&h, (i == 0).then_some(running), 1.0)
                    .expect("route")
            })
            .collect();
        let (h, o) = block_hashes_many(Tokens::Ids(&flat), &offsets, 4, 0).expect("hashes");
        let batch = many
            .route_many_hashes(&h, &o, Some(&[1, 0, 2]), 1.0)
            .expect("many");
        assert_eq!(batch, singles);
        assert_eq!(one.to_bytes(), many.to_bytes());

        let before = one.to_bytes();
        let h = hashes(Tokens::Ids(&ids(8)));
        assert!(one.route_hashes(&h, Some(&[1, 2]), 0.0).is_err());
        assert!(one.route_hashes(&h, Some(&[1, -2, 0]), 0.0).is_err());
        assert!(one.route_hashes(&h, None, f64::INFINITY).is_err());
        assert!(one.complete("zz").is_err());
        assert!(one.add_endpoint("a").is_err());
        assert_eq!(one.to_bytes(), before);
        let mut empty = router(&[], 2);
        assert!(empty.route_hashes(&h, None, 0.0).is_err());
    }

    #[test]
    fn endpoints_come_and_go_and_snapshots_restore() {
        let mut r = router(&["a", "b"], 16);
        let p = hashes(Tokens::Ids(&ids(12)));
        assert_eq!(r.route_hashes(&p, None, 0.0).expect("route").endpoint, 0);
        r.add_endpoint("c").expect("add");
        assert_eq!(r.running(), &[1, 0, 0]);
        assert_eq!(r.route_hashes(&p, None, 0.0).expect("route").endpoint, 0);
        r.remove_endpoint("a").expect("remove");
        assert!(lock(r.index()).endpoint_id("a").is_none());
        let d = r.route_hashes(&p, None, 0.0).expect("route");
        assert_eq!(
            (d.endpoint, d.matched_blocks),
            (0, 0),
            "a's blocks left with it"
        );
        r.complete("b").expect("complete");
        assert!(r.complete("b").is_err());
        let bytes = r.to_bytes();
        let back = PrefixCacheRouter::from_bytes(&bytes).expect("restore");
        assert_eq!(back.to_bytes(), bytes);
        assert_eq!(back.endpoints(), r.endpoints());
        assert_eq!(back.config(), r.config());
        for cut in 0..bytes.len() {
            assert!(PrefixCacheRouter::from_bytes(&bytes[..cut]).is_err());
        }
        assert!(PrefixConfig::new(0, 1, 1.0, 0).is_err());
        assert!(PrefixConfig::new(4, -1, 1.0, 0).is_err());
        assert!(PrefixConfig::new(4, 1, -1.0, 0).is_err());
    }
}
