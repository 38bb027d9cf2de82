//! What a plugin is: the small traits a filter and a scorer implement, and
//! the description ([`Describe`]) each plugin file gives of itself (its
//! name, kind, what it reads, how its parameters build it). The registry
//! (`registry.rs`) lists the descriptions.

use std::any::Any;
use std::fmt::Debug;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::{Ctx, PickConfig, PickRequest, Ranking, Recorded, Ties};
use crate::endpoint::EndpointState;
use crate::error::{invalid, Result};
use crate::snapshot::{Reader, Writer};

/// Keeps a subset of the candidates (pure: the same answer for the same
/// request and state). The pipeline calls the provided methods, once per
/// filter and pick, each a loop over `keep` compiled for the filter.
pub trait Filter: Debug + Send + Sync + CloneFilter {
    fn keep(&self, req: &PickRequest<'_>, i: usize, s: &EndpointState) -> bool;
    /// How many of the candidates `cand` it keeps.
    fn count(&self, req: &PickRequest<'_>, cand: &[usize], states: &[EndpointState]) -> usize {
        cand.iter()
            .filter(|&&i| self.keep(req, i, &states[i]))
            .count()
    }
    /// Keeps those of `cand` it keeps.
    fn retain(&self, req: &PickRequest<'_>, cand: &mut Vec<usize>, states: &[EndpointState]) {
        cand.retain(|&i| self.keep(req, i, &states[i]));
    }
}

/// Gives each candidate a score in [0, 1] (higher is better). A stateful
/// scorer learns through the hooks (each a no-op by default) and writes
/// what it learned into the pipeline's snapshot.
pub trait Scorer: Debug + Send + Sync + CloneScorer {
    /// Scores per candidate, in `ctx.cand` order, into `out`.
    fn score(&mut self, req: &PickRequest<'_>, ctx: &Ctx<'_>, out: &mut [f64]) -> Result<()>;
    /// Readies the scorer for the endpoints `names` (may fail: a full index).
    fn prepare(&mut self, _names: &[String]) -> Result<()> {
        Ok(())
    }
    /// A request went to `endpoint`; `recorded`, when given, keeps what a
    /// prefix scorer recorded of it.
    fn started(
        &mut self,
        _req: &PickRequest<'_>,
        _names: &[String],
        _endpoint: usize,
        _recorded: Option<&mut Recorded>,
    ) -> Result<()> {
        Ok(())
    }
    /// A request started on `from` was served by `to`.
    fn moved(
        &mut self,
        _names: &[String],
        _from: usize,
        _to: usize,
        _recorded: &Recorded,
        _now: f64,
    ) -> Result<()> {
        Ok(())
    }
    /// A request ended with this usage (`req` as it was picked).
    fn completed(&mut self, _req: &PickRequest<'_>, _input_tokens: u64, _output_tokens: u64) {}
    /// An endpoint was appended.
    fn added(&mut self) {}
    /// Endpoint `i` (`name`) was removed; the ones after it move down one.
    fn removed(&mut self, _i: usize, _name: &str) -> Result<()> {
        Ok(())
    }
    /// Writes the learned state (nothing for a stateless scorer).
    fn write(&self, _w: &mut Writer) {}
    /// Reads what `write` wrote, for a pool of `endpoints` endpoints.
    fn read(&mut self, _r: &mut Reader<'_>, _endpoints: usize) -> Result<()> {
        Ok(())
    }
}

/// Clones a boxed filter (implemented for every `Filter + Clone`).
pub trait CloneFilter {
    fn clone_box(&self) -> Box<dyn Filter>;
}

impl<T: Filter + Clone + 'static> CloneFilter for T {
    fn clone_box(&self) -> Box<dyn Filter> {
        Box::new(self.clone())
    }
}

impl Clone for Box<dyn Filter> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// Clones a boxed scorer and reaches its concrete type (implemented for
/// every `Scorer + Clone`).
pub trait CloneScorer {
    fn clone_box(&self) -> Box<dyn Scorer>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<T: Scorer + Clone + 'static> CloneScorer for T {
    fn clone_box(&self) -> Box<dyn Scorer> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Clone for Box<dyn Scorer> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// Chooses one candidate from the totals, the pipeline's last step (at
/// most one per pipeline). Stateless: the pipeline keeps the count of its
/// picks and the endpoint after the last one chosen, which [`Ranking`]
/// hands it (`draw`, `cursor`).
pub trait Picker: Debug + Send + Sync {
    /// The position in `rank.cand` of the candidate chosen.
    fn choose(&self, rank: &Ranking<'_>) -> usize;
    /// How equal totals are ordered (the fallbacks' ranking too).
    fn ties(&self) -> Ties {
        Ties::First
    }
    /// The seed of its draws (0: it draws nothing of its own).
    fn seed(&self) -> u64 {
        0
    }
}

/// A plugin built from its parameters.
#[derive(Debug)]
pub enum Built {
    Filter(Box<dyn Filter>),
    Scorer(Box<dyn Scorer>),
    Picker(Arc<dyn Picker>),
}

/// Where a plugin sits in the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A *soft* filter that would leave no candidate is skipped; a hard one
    /// gives an empty answer.
    Filter {
        soft: bool,
    },
    Scorer,
    Picker,
}

impl Kind {
    /// The words of the kind column of docs/picker.md's plugin table.
    pub fn words(self) -> &'static str {
        match self {
            Kind::Filter { soft: false } => "filter (hard)",
            Kind::Filter { soft: true } => "filter (soft)",
            Kind::Scorer => "scorer",
            Kind::Picker => "picker",
        }
    }
}

/// What a plugin reads besides the request's own fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Needs {
    /// The scraped endpoint state (health, queue, KV use, adapters, load).
    pub scraped: bool,
    /// The prompt's block hashes (`PickRequest::hashes`).
    pub hashes: bool,
    /// The prompt's token ids (`PickRequest::token_ids`).
    pub token_ids: bool,
    /// The engines' KV-event index (`PickConfig::kv_index`).
    pub kv_index: bool,
}

impl Needs {
    /// Nothing besides the request.
    pub const NOTHING: Needs = Needs {
        scraped: false,
        hashes: false,
        token_ids: false,
        kv_index: false,
    };
    /// The scraped endpoint state only.
    pub const SCRAPED: Needs = Needs {
        scraped: true,
        ..Needs::NOTHING
    };
}

/// What the data plane's `router` section sets in the pipelines it builds
/// (each plugin takes what it uses, see [`Describe::shared`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shared {
    /// Bytes (or tokens) per block hash of the prefix scorers.
    pub prefix_block_size: usize,
    /// The saturation filter's thresholds.
    pub saturation: crate::endpoint::Saturation,
}

/// A plugin, as its file describes it: the registry's entry.
pub struct Describe {
    /// The name a plugin spec gives (`PluginSpec::name`).
    pub name: &'static str,
    pub kind: Kind,
    pub needs: Needs,
    /// Builds the plugin from its parameters (a JSON object without nulls;
    /// unknown names refused, see [`params`]).
    pub build: fn(&Value, &PickConfig) -> Result<Built>,
    /// The parameters it takes from the data plane's [`Shared`] settings
    /// (None: none; they replace the spec's).
    pub shared: Option<fn(&Shared) -> Value>,
    /// Writes into the parameters what it takes from the config (a random
    /// seed), so a snapshot restores the same draws.
    pub resolve: Option<fn(&mut ParamMap, &PickConfig)>,
}

/// A plugin spec's parameters, as `Describe::resolve` edits them.
pub type ParamMap = Map<String, Value>;

/// A plugin's parameters (an object without nulls) as its parameter struct
/// (`#[serde(default, deny_unknown_fields)]`); an error names the key.
pub fn params<P: DeserializeOwned>(params: &Value) -> Result<P> {
    P::deserialize(params).map_err(|e| {
        // A flat struct with defaults: the first key that fails alone is
        // the one to name.
        let key = params.as_object().and_then(|m| {
            m.iter().find_map(|(k, v)| {
                let one = Value::Object(Map::from_iter([(k.clone(), v.clone())]));
                P::deserialize(&one).err().map(|e| (k.clone(), e))
            })
        });
        match key {
            Some((k, e)) => {
                let msg = e.to_string();
                match msg.strip_prefix("unknown field ") {
                    Some(rest) => invalid(format!(
                        "{k}: unknown parameter{}",
                        rest.split_once(',')
                            .map_or(String::new(), |(_, r)| format!(";{r}"))
                    )),
                    None => invalid(format!("{k}: {msg}")),
                }
            }
            None => invalid(e.to_string()),
        }
    })
}

/// The parameters of a plugin without any.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// The build of a parameterless filter.
pub fn filter_without_params<F: Filter + Default + 'static>(
    p: &Value,
    _: &PickConfig,
) -> Result<Built> {
    params::<NoParams>(p)?;
    Ok(Built::Filter(Box::new(F::default())))
}

/// The build of a parameterless scorer.
pub fn scorer_without_params<S: Scorer + Default + Clone + 'static>(
    p: &Value,
    _: &PickConfig,
) -> Result<Built> {
    params::<NoParams>(p)?;
    Ok(Built::Scorer(Box::new(S::default())))
}
