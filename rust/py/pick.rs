use std::sync::{Arc, Mutex, MutexGuard};

use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::{
    detach_if, hash_array, int_arg, int_array, now_or_monotonic, reduce, TokenArg, DETACH_TOKENS,
};
use crate::budget::MAX_TOKENS;
use crate::endpoint::EndpointState;
use crate::error::{finite, invalid, non_negative, Error, Result};
use crate::kv::{KvHeld, KvIndex};
use crate::pd::{Decider, Role, Split};
use crate::pick::{PickConfig, PickRequest, Pipeline, PluginSpec, PoolPicker, PRESETS};
use crate::prefix::{block_hashes_many, check_offsets, Tokens};
use crate::snapshot::{restore_since, Reader, Writer};

/// The default preset (the GIE's default scorers plus prefix match).
const DEFAULT_PRESET: &str = "prefix+queue+kv";
const MAGIC: &[u8; 4] = b"RCPK";
/// Version 2 added the prefill/decode split; version 1 (no split) still
/// loads, as a picker whose endpoints are all `both`.
const SNAPSHOT_VERSION: u16 = 2;

/// The pool picker (pipeline, states, P/D split) and what Python needs
/// beside it.
struct Inner {
    picker: PoolPicker,
    preset: Option<String>,
    /// The endpoint names as Python strings (returned without a copy).
    names: Vec<Py<PyString>>,
    /// Scratch: the current request's block hashes.
    hashes: Hashed,
}

/// A request's block hashes and, when the KV index hashed its token ids,
/// that walk's answers (`PoolPicker::hash_prompt`).
#[derive(Debug, Default)]
struct Hashed {
    hashes: Vec<u64>,
    held: KvHeld,
}

/// One request's arguments, checked.
struct Args<'a> {
    adapter: Option<&'a str>,
    subset: Option<Vec<usize>>,
    fairness_id: Option<&'a str>,
    session: Option<&'a str>,
    input_tokens: u64,
    output_tokens: u64,
    now: f64,
    /// The request's block hashes were computed from its tokens (not given).
    hashes_of_ids: bool,
}

impl<'a> Args<'a> {
    /// The arguments of one `pick` / `rank` call, checked.
    fn of_call(
        inner: &Inner,
        adapter: Option<&'a str>,
        subset: Option<Vec<String>>,
        (fairness_id, session): (Option<&'a str>, Option<&'a str>),
        (input_tokens, output_tokens): (u64, u64),
        now: Option<f64>,
    ) -> Result<Self> {
        Ok(Args {
            adapter,
            subset: subset_indices(inner, subset)?,
            fairness_id,
            session,
            input_tokens: tokens_arg("input_tokens", input_tokens)?,
            output_tokens: tokens_arg("output_tokens", output_tokens)?,
            now: now_or_monotonic(now),
            hashes_of_ids: false,
        })
    }

    /// The request with its block hashes (none: `None`) and token ids
    /// (`ids_of`).
    fn request<'h>(
        &'h self,
        hashed: Option<&'h Hashed>,
        token_ids: Option<&'h [u32]>,
    ) -> PickRequest<'h> {
        PickRequest {
            hashes: hashed.map_or(&[], |h| &h.hashes),
            token_ids,
            hashes_of_ids: self.hashes_of_ids && token_ids.is_some(),
            kv_held: hashed.map(|h| &h.held),
            adapter: self.adapter,
            subset: self.subset.as_deref(),
            fairness_id: self.fairness_id,
            session: self.session,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            now: self.now,
        }
    }
}

/// What is known of one endpoint, as `EndpointPicker.state` and
/// `DataPlane.endpoints` show it.
pub(crate) fn state_dict<'py>(py: Python<'py>, s: &EndpointState) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("healthy", s.healthy)?;
    d.set_item("in_flight", s.in_flight)?;
    d.set_item("dispatched_since_scrape", s.dispatched_since_scrape)?;
    d.set_item("waiting", s.waiting)?;
    d.set_item("running", s.running)?;
    d.set_item("kv_usage", s.kv_usage)?;
    d.set_item("adapters", s.adapters.clone())?;
    Ok(d)
}

/// The token ids of a prompt given as ids (the precise-prefix scorer reads
/// them); None for text, which only the approximate index can key.
fn ids_of(tokens: Option<Tokens<'_>>) -> Option<&[u32]> {
    match tokens {
        Some(Tokens::Ids(ids)) => Some(ids),
        _ => None,
    }
}

/// The index of a `kv_index` argument (a `KvEventIndex`).
fn kv_index_arg(kv_index: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Arc<KvIndex>>> {
    let Some(obj) = kv_index else {
        return Ok(None);
    };
    #[cfg(feature = "kv-events")]
    {
        let k = obj
            .cast::<super::kv::PyKvEventIndex>()
            .map_err(|_| PyTypeError::new_err("kv_index must be a KvEventIndex"))?;
        Ok(Some(Arc::clone(k.get().index())))
    }
    #[cfg(not(feature = "kv-events"))]
    {
        let _ = obj;
        Err(PyValueError::new_err(
            "kv_index: this build has no KvEventIndex (cargo feature kv-events)",
        ))
    }
}

/// A pipeline's `kv_index`, checked: a precise-prefix scorer needs one, and
/// nothing else reads one.
fn check_kv_index(pipeline: &Pipeline, kv_index: Option<&Arc<KvIndex>>) -> PyResult<()> {
    match (pipeline.wants_kv_index(), kv_index.is_some()) {
        (true, false) => Err(PyValueError::new_err(
            "the precise-prefix scorer needs kv_index= (a KvEventIndex fed by the engines' \
             KV events); without one use the prefix scorer",
        )),
        (false, true) => Err(PyValueError::new_err(
            "kv_index is read by the precise-prefix scorer only (presets precise-prefix, \
             precise-prefix+queue+kv)",
        )),
        _ => Ok(()),
    }
}

fn tokens_arg(what: &str, v: u64) -> Result<u64> {
    if v > MAX_TOKENS {
        return Err(invalid(format!(
            "{what} must be in [0, {MAX_TOKENS}], got {v}"
        )));
    }
    Ok(v)
}

impl Inner {
    fn new(picker: PoolPicker, preset: Option<String>, py: Python<'_>) -> Self {
        let names = picker
            .names()
            .iter()
            .map(|s| PyString::new(py, s).unbind())
            .collect();
        Self {
            picker,
            preset,
            names,
            hashes: Hashed::default(),
        }
    }

    fn endpoint(&self, name: &str) -> Result<usize> {
        self.picker.index(name)
    }

    /// On a picker with roles, `pick`, `rank` and `pick_many` place a
    /// request whole (never split): only endpoints that decode (`decode`,
    /// `both`) are candidates, within the request's subset, as in
    /// `pick_pair`'s decode phase.
    fn whole<'a>(&self, mut a: Args<'a>) -> Args<'a> {
        a.subset = self.picker.whole(a.subset.take());
        a
    }

    fn check(&self, a: &Args<'_>) -> Result<()> {
        self.picker.check(&a.request(None, None))
    }

    /// Picks for one request (its block hashes in `self.hashes`, its token
    /// ids) and starts it on the chosen endpoint.
    fn start(&mut self, a: &Args<'_>, ids: Option<&[u32]>) -> Result<Option<usize>> {
        let Inner { picker, hashes, .. } = self;
        picker.start(&a.request(Some(hashes), ids))
    }
}

/// A request's decode endpoint and its prefill endpoint (None: not split).
type Pair = (Py<PyString>, Option<Py<PyString>>);

/// The split of a picker's endpoints: `roles` by endpoint name (the rest
/// `both`) and the decider by name; None when nothing can split.
fn split_of(
    pipeline: &Pipeline,
    roles: Option<std::collections::HashMap<String, String>>,
    decider: Option<&str>,
    threshold: Option<f64>,
) -> Result<Option<Split>> {
    let roles = roles
        .unwrap_or_default()
        .into_iter()
        .map(|(e, r)| Ok((e, Role::parse(&r)?)))
        .collect::<Result<std::collections::HashMap<_, _>>>()?;
    let names = pipeline.endpoints().names();
    let roles = crate::pd::pool_roles(names, Role::Both, &roles)?;
    let decider = match decider {
        Some(d) => Decider::new(d, threshold)?,
        None if threshold.is_some() => return Err(invalid("a threshold needs a decider")),
        None => crate::pd::pool_decider(None, &roles)?,
    };
    Split::of_pool(pipeline, roles, decider)
}

impl PyEndpointPicker {
    /// A request's block hashes: `hashes` as given, else the tokens' with
    /// the prefix plugin's settings (none without one), in a reused buffer.
    /// Long prompts are hashed with the interpreter released (no lock on
    /// the picker is held meanwhile).
    fn hashes(
        &self,
        py: Python<'_>,
        tokens: Option<Tokens<'_>>,
        adapter: Option<&str>,
        hashes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Hashed> {
        if let Some(h) = hashes {
            return Ok(Hashed {
                hashes: hash_array(h)?,
                held: KvHeld::default(),
            });
        }
        let (Some(t), Some(_)) = (tokens, self.block) else {
            return Ok(Hashed::default());
        };
        let mut out = std::mem::take(&mut *lock(&self.spare));
        detach_if(py, t.len() >= DETACH_TOKENS, || {
            let Hashed { hashes, held } = &mut out;
            PoolPicker::hash_prompt(self.block, self.kv.as_deref(), adapter, t, (hashes, held))
        })?;
        Ok(out)
    }

    /// Gives a hash buffer back for the next call.
    fn give_back(&self, buf: Hashed) {
        *lock(&self.spare) = buf;
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A Python scalar as a JSON value (plugin parameters).
fn json_value(v: &Bound<'_, PyAny>, key: &str) -> PyResult<serde_json::Value> {
    if v.is_none() {
        Ok(serde_json::Value::Null)
    } else if v.is_instance_of::<PyBool>() {
        Ok(serde_json::Value::Bool(v.extract()?))
    } else if v.is_instance_of::<PyInt>() {
        match v.extract::<u64>() {
            Ok(u) => Ok(u.into()),
            Err(_) => Ok(int_arg::<i64>(v)?.into()),
        }
    } else if v.is_instance_of::<PyFloat>() {
        let x: f64 = v.extract()?;
        serde_json::Number::from_f64(x)
            .map(serde_json::Value::Number)
            .ok_or_else(|| PyValueError::new_err(format!("{key} must be finite, got {x}")))
    } else if let Ok(s) = v.cast::<PyString>() {
        Ok(serde_json::Value::String(s.to_str()?.to_owned()))
    } else {
        Err(PyTypeError::new_err(format!(
            "{key} must be a number, string, bool or None"
        )))
    }
}

/// `{"name": ..., "weight": ..., **params}` as a plugin spec.
pub(crate) fn plugin_spec(d: &Bound<'_, PyAny>) -> PyResult<PluginSpec> {
    let d = d
        .cast::<PyDict>()
        .map_err(|_| PyTypeError::new_err("each plugin must be a dict with a \"name\""))?;
    let mut name = None;
    let mut weight = 1.0;
    let mut params = serde_json::Map::new();
    for (k, v) in d.iter() {
        let key: String = k.extract()?;
        match key.as_str() {
            "name" => name = Some(v.extract::<String>()?),
            "weight" => weight = v.extract::<f64>()?,
            _ => {
                let value = json_value(&v, &key)?;
                params.insert(key, value);
            }
        }
    }
    let name = name.ok_or_else(|| PyValueError::new_err("a plugin needs a \"name\""))?;
    Ok(PluginSpec {
        name,
        weight,
        params: serde_json::Value::Object(params),
    })
}

/// One pipeline of filters, weighted scorers and a picker choosing the
/// endpoint of each request inside a pool (see the README's "Endpoint
/// picker").
///
/// Built from a preset (``"random"``, ``"round-robin"``, ``"least-request"``,
/// ``"queue+kv"``, ``"prefix"``, ``"prefix+queue+kv"`` (the default),
/// ``"precise-prefix"``, ``"precise-prefix+queue+kv"`` or ``"vtc"``) or from
/// ``plugins``, a list of ``{"name": ..., "weight": ..., **params}`` dicts
/// (filters ``healthy``, ``subset-hint``, ``serves-adapter``, ``saturation``;
/// scorers ``least-request``, ``queue-depth``, ``kv-usage``, ``prefix``,
/// ``precise-prefix``, ``vtc``, ``session-affinity``; pickers ``max-score``,
/// ``random``, ``round-robin``). ``seed`` seeds the random draws.
/// Thread-safe; pickling and ``to_bytes`` keep everything learned (prefix
/// index, VTC counters, sessions, endpoint states).
///
/// The ``precise-prefix`` scorer needs ``kv_index``, a ``KvEventIndex`` (the
/// engines' KV-cache events; ValueError without one, and for a ``kv_index``
/// nothing reads): it scores the prompt's leading blocks an engine holds,
/// for a request whose ``tokens`` are token ids. A request given as text or
/// ``hashes`` only, and an endpoint whose event stream is down or stale, is
/// scored by the approximate prefix index instead (what routecore routed).
/// The index is not in snapshots: ``from_bytes(data, kv_index=...)``
/// restores such a picker, and pickling one is a TypeError.
///
/// Prefill/decode disaggregation (docs/disaggregation.md): ``roles`` maps
/// endpoints to ``"prefill"``, ``"decode"`` or ``"both"`` (the default), and
/// ``decider`` (``"always"``, ``"never"``, ``"uncached-tokens"`` or
/// ``"prefill-load"``, the last two with a ``threshold``; default ``never``
/// when every endpoint is ``both``, else ``always``) says when a request is
/// prefilled apart; ``pick_pair`` places it (decode, then prefill) and
/// ``completed_prefill`` ends its prefill; ``pick``, ``rank`` and
/// ``pick_many`` place a request whole, on the endpoints that decode.
/// ``add_endpoint`` / ``remove_endpoint`` are refused (ValueError) on a
/// picker with roles. ValueError for roles that leave
/// no endpoint able to decode, or decode endpoints with none to prefill
/// while the decider may split.
///
/// ``pick`` returns the chosen endpoint and counts the request started
/// there (``None`` when no endpoint is healthy); ``rank`` returns every
/// candidate, best first, and starts nothing; ``completed`` ends a request.
/// Engine state comes from ``set_state`` (scraped queue, running, KV use,
/// health, adapters); between two scrapes the picker adds its own
/// dispatches to the queue.
///
///     >>> p = EndpointPicker(["a", "b"], preset="least-request")
///     >>> p.pick(now=0.0), p.pick(now=0.0)
///     ('a', 'b')
///     >>> p.completed("a", now=1.0)
///     >>> p.in_flight
///     [0, 1]
#[pyclass(frozen, name = "EndpointPicker", module = "routecore")]
pub struct PyEndpointPicker {
    inner: Mutex<Inner>,
    /// The prefix plugin's block size and hash seed (fixed at construction).
    block: Option<(usize, u64)>,
    /// The KV-event index it reads (which hashes the token ids it holds).
    kv: Option<Arc<KvIndex>>,
    /// A spare hash buffer, filled outside the lock and swapped in.
    spare: Mutex<Hashed>,
}

impl PyEndpointPicker {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        lock(&self.inner)
    }
}

fn subset_indices(inner: &Inner, subset: Option<Vec<String>>) -> Result<Option<Vec<usize>>> {
    subset
        .map(|names| names.iter().map(|n| inner.endpoint(n)).collect())
        .transpose()
}

#[pymethods]
impl PyEndpointPicker {
    #[new]
    #[pyo3(signature = (endpoints, preset=None, plugins=None, seed=0, kv_index=None, *, roles=None, decider=None, threshold=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        endpoints: Vec<String>,
        preset: Option<String>,
        plugins: Option<&Bound<'_, PyList>>,
        #[pyo3(from_py_with = int_arg)] seed: u64,
        kv_index: Option<&Bound<'_, PyAny>>,
        roles: Option<std::collections::HashMap<String, String>>,
        decider: Option<&str>,
        threshold: Option<f64>,
    ) -> PyResult<Self> {
        if endpoints.is_empty() {
            return Err(PyValueError::new_err("endpoints must not be empty"));
        }
        let config = PickConfig {
            seed,
            prefix_index: None,
            kv_index: kv_index_arg(kv_index)?,
        };
        let (pipeline, preset) = match (preset, plugins) {
            (Some(_), Some(_)) => {
                return Err(PyValueError::new_err("give a preset or plugins, not both"))
            }
            (None, Some(list)) => {
                let specs = list
                    .iter()
                    .map(|d| plugin_spec(&d))
                    .collect::<PyResult<Vec<_>>>()?;
                (Pipeline::from_specs(&specs, &endpoints, &config)?, None)
            }
            (preset, None) => {
                let name = preset.unwrap_or_else(|| DEFAULT_PRESET.to_owned());
                (Pipeline::preset(&name, &endpoints, &config)?, Some(name))
            }
        };
        check_kv_index(&pipeline, config.kv_index.as_ref())?;
        let split = split_of(&pipeline, roles, decider, threshold)?;
        let inner = Inner::new(PoolPicker::with_split(pipeline, split), preset, py);
        Ok(Self {
            block: inner.picker.block(),
            kv: inner.picker.kv(),
            inner: Mutex::new(inner),
            spare: Mutex::default(),
        })
    }

    /// The presets' names.
    #[staticmethod]
    fn presets() -> Vec<&'static str> {
        PRESETS.to_vec()
    }

    /// Chooses the endpoint for one request and counts it started there
    /// (in flight, prefix blocks recorded, VTC charged, session bound);
    /// ``None`` when no endpoint passes the health and subset filters.
    ///
    /// ``tokens`` (token ids: a sequence of int, a uint32 NumPy array such
    /// as ``Tokenizer.encode``'s; or ``str``/``bytes``) are hashed with the
    /// prefix plugin's block size and seed, or ``hashes`` (from
    /// ``block_hashes``) given directly; token ids also key the
    /// precise-prefix scorer (with the request's ``adapter``). ``subset``:
    /// endpoint names (Envoy's subset hint). ``now``: seconds, default
    /// ``monotonic()``.
    #[pyo3(signature = (tokens=None, *, hashes=None, adapter=None, subset=None, fairness_id=None, session=None, input_tokens=0, output_tokens=0, now=None))]
    #[allow(clippy::too_many_arguments)]
    fn pick(
        &self,
        py: Python<'_>,
        tokens: Option<&Bound<'_, PyAny>>,
        hashes: Option<&Bound<'_, PyAny>>,
        adapter: Option<&str>,
        subset: Option<Vec<String>>,
        fairness_id: Option<&str>,
        session: Option<&str>,
        #[pyo3(from_py_with = int_arg)] input_tokens: u64,
        #[pyo3(from_py_with = int_arg)] output_tokens: u64,
        now: Option<f64>,
    ) -> PyResult<Option<Py<PyString>>> {
        let arg = tokens.map(|t| TokenArg::new(t, "tokens")).transpose()?;
        let t = arg.as_ref().map(TokenArg::tokens).transpose()?;
        let of_ids = hashes.is_none();
        let hashes = self.hashes(py, t, adapter, hashes)?;
        let mut inner = self.inner();
        let mut args = inner.whole(Args::of_call(
            &inner,
            adapter,
            subset,
            (fairness_id, session),
            (input_tokens, output_tokens),
            now,
        )?);
        args.hashes_of_ids = of_ids;
        self.give_back(std::mem::replace(&mut inner.hashes, hashes));
        let chosen = inner.start(&args, ids_of(t))?;
        Ok(chosen.map(|e| inner.names[e].clone_ref(py)))
    }

    /// Places one request on a pool split by roles (prefill/decode
    /// disaggregation): the decode endpoint (among ``decode`` and ``both``
    /// endpoints, by the picker's plugins), then the decider, then the
    /// prefill endpoint (among ``prefill`` and ``both``, the decode one
    /// excepted). Returns ``(decode, prefill)``, ``prefill`` None when the
    /// request is not split, both counted started; ``None`` when no
    /// endpoint can decode it. On a picker without roles it is ``pick``'s
    /// endpoint and None. Same arguments as ``pick``; end the prefill with
    /// ``completed_prefill`` and the decode with ``completed``.
    #[pyo3(signature = (tokens=None, *, hashes=None, adapter=None, subset=None, fairness_id=None, session=None, input_tokens=0, output_tokens=0, now=None))]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pick_pair(
        &self,
        py: Python<'_>,
        tokens: Option<&Bound<'_, PyAny>>,
        hashes: Option<&Bound<'_, PyAny>>,
        adapter: Option<&str>,
        subset: Option<Vec<String>>,
        fairness_id: Option<&str>,
        session: Option<&str>,
        #[pyo3(from_py_with = int_arg)] input_tokens: u64,
        #[pyo3(from_py_with = int_arg)] output_tokens: u64,
        now: Option<f64>,
    ) -> PyResult<Option<Pair>> {
        let arg = tokens.map(|t| TokenArg::new(t, "tokens")).transpose()?;
        let t = arg.as_ref().map(TokenArg::tokens).transpose()?;
        let of_ids = hashes.is_none();
        let hashes = self.hashes(py, t, adapter, hashes)?;
        let mut inner = self.inner();
        let mut args = Args::of_call(
            &inner,
            adapter,
            subset,
            (fairness_id, session),
            (input_tokens, output_tokens),
            now,
        )?;
        args.hashes_of_ids = of_ids;
        self.give_back(std::mem::replace(&mut inner.hashes, hashes));
        if inner.picker.split().is_none() {
            let chosen = inner.start(&args, ids_of(t))?;
            return Ok(chosen.map(|e| (inner.names[e].clone_ref(py), None)));
        }
        let Inner {
            picker,
            hashes,
            names,
            ..
        } = &mut *inner;
        let pair = picker.place(&args.request(Some(hashes), ids_of(t)))?;
        Ok(pair.map(|p| {
            let prefill = p.prefill.map(|(e, _)| names[e].clone_ref(py));
            (names[p.decode].clone_ref(py), prefill)
        }))
    }

    /// Ends a split request's prefill on ``endpoint`` (``NotInFlightError``
    /// when none is in flight there; ValueError on a picker without roles):
    /// one less in flight, the prefill plugins told (it used
    /// ``input_tokens``).
    #[pyo3(signature = (endpoint, input_tokens=0, *, now=None))]
    pub(super) fn completed_prefill(
        &self,
        endpoint: &str,
        #[pyo3(from_py_with = int_arg)] input_tokens: u64,
        now: Option<f64>,
    ) -> PyResult<()> {
        let mut inner = self.inner();
        let e = inner.endpoint(endpoint)?;
        let input_tokens = tokens_arg("input_tokens", input_tokens)?;
        let now = finite("now", now_or_monotonic(now))?;
        let req = PickRequest {
            input_tokens,
            now,
            ..PickRequest::default()
        };
        inner.picker.complete_prefill(e, &req, input_tokens)?;
        Ok(())
    }

    /// Each endpoint's role (``"prefill"``, ``"decode"`` or ``"both"``), in
    /// endpoint order; ``None`` without roles (every endpoint ``both``).
    #[getter]
    fn roles(&self) -> Option<Vec<&'static str>> {
        let inner = self.inner();
        let split = inner.picker.split()?;
        Some(split.roles().iter().map(|r| r.as_str()).collect())
    }

    /// The decider's name (``"never"`` without roles).
    #[getter]
    fn decider(&self) -> &'static str {
        self.inner()
            .picker
            .split()
            .map_or("never", |s| s.decider().name())
    }

    /// Every candidate endpoint for one request, best first (the chosen one
    /// and then the fallbacks, as for Envoy's retry list); starts nothing.
    /// Same arguments as ``pick``. Empty when no endpoint passes the health
    /// and subset filters.
    #[pyo3(signature = (tokens=None, *, hashes=None, adapter=None, subset=None, fairness_id=None, session=None, input_tokens=0, output_tokens=0, now=None))]
    #[allow(clippy::too_many_arguments)]
    fn rank(
        &self,
        py: Python<'_>,
        tokens: Option<&Bound<'_, PyAny>>,
        hashes: Option<&Bound<'_, PyAny>>,
        adapter: Option<&str>,
        subset: Option<Vec<String>>,
        fairness_id: Option<&str>,
        session: Option<&str>,
        #[pyo3(from_py_with = int_arg)] input_tokens: u64,
        #[pyo3(from_py_with = int_arg)] output_tokens: u64,
        now: Option<f64>,
    ) -> PyResult<Vec<String>> {
        let arg = tokens.map(|t| TokenArg::new(t, "tokens")).transpose()?;
        let t = arg.as_ref().map(TokenArg::tokens).transpose()?;
        let of_ids = hashes.is_none();
        let hashes = self.hashes(py, t, adapter, hashes)?;
        let mut inner = self.inner();
        let mut args = inner.whole(Args::of_call(
            &inner,
            adapter,
            subset,
            (fairness_id, session),
            (input_tokens, output_tokens),
            now,
        )?);
        args.hashes_of_ids = of_ids;
        inner.check(&args)?;
        self.give_back(std::mem::replace(&mut inner.hashes, hashes));
        let Inner { picker, hashes, .. } = &mut *inner;
        let mut out = Vec::new();
        picker.rank(&args.request(Some(hashes), ids_of(t)), &mut out)?;
        let names = picker.names();
        Ok(out.into_iter().map(|e| names[e].clone()).collect())
    }

    /// Picks for a batch exactly as ``pick`` one by one would (each started
    /// before the next is picked). Prompt ``i`` is
    /// ``tokens[offsets[i]:offsets[i + 1]]`` (flat token ids); without
    /// tokens, the batch is as long as the per-request arrays given (token
    /// ids key the precise-prefix scorer too).
    /// Returns endpoint indices into ``endpoints`` (-1: no endpoint).
    #[pyo3(signature = (tokens=None, offsets=None, *, input_tokens=None, output_tokens=None, fairness_ids=None, sessions=None, now=None))]
    #[allow(clippy::too_many_arguments)]
    fn pick_many<'py>(
        &self,
        py: Python<'py>,
        tokens: Option<&Bound<'py, PyAny>>,
        offsets: Option<&Bound<'py, PyAny>>,
        input_tokens: Option<&Bound<'py, PyAny>>,
        output_tokens: Option<&Bound<'py, PyAny>>,
        fairness_ids: Option<Vec<String>>,
        sessions: Option<Vec<String>>,
        now: Option<f64>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let offsets = offsets.map(|o| int_array(o, "offsets")).transpose()?;
        let ins = input_tokens
            .map(|a| int_array(a, "input_tokens"))
            .transpose()?;
        let outs = output_tokens
            .map(|a| int_array(a, "output_tokens"))
            .transpose()?;
        let n = match (&offsets, tokens) {
            (Some(o), _) => o.len().saturating_sub(1),
            (None, Some(_)) => return Err(PyValueError::new_err("tokens need offsets")),
            (None, None) => [
                ins.as_ref().map(Vec::len),
                outs.as_ref().map(Vec::len),
                fairness_ids.as_ref().map(Vec::len),
                sessions.as_ref().map(Vec::len),
            ]
            .into_iter()
            .flatten()
            .next()
            .ok_or_else(|| {
                PyValueError::new_err("give offsets or per-request arrays for the batch")
            })?,
        };
        for (what, len) in [
            ("input_tokens", ins.as_ref().map(Vec::len)),
            ("output_tokens", outs.as_ref().map(Vec::len)),
            ("fairness_ids", fairness_ids.as_ref().map(Vec::len)),
            ("sessions", sessions.as_ref().map(Vec::len)),
        ] {
            if len.is_some_and(|l| l != n) {
                return Err(PyValueError::new_err(format!(
                    "{what} has {} entries for {n} requests",
                    len.unwrap_or(0)
                )));
            }
        }
        let token_arg = tokens.map(|t| TokenArg::new(t, "tokens")).transpose()?;
        let t = token_arg.as_ref().map(|t| t.tokens()).transpose()?;
        let now = now_or_monotonic(now);
        let block = self.block;
        let count = |v: &Option<Vec<i64>>, i: usize, what: &str| -> Result<u64> {
            let x = v.as_ref().map_or(0, |v| v[i]);
            let x = u64::try_from(x).map_err(|_| invalid(format!("{what} must be >= 0")))?;
            tokens_arg(what, x)
        };
        let chosen = py.detach(|| -> Result<Vec<i64>> {
            // Everything is checked before the first pick: the batch picks
            // all or nothing.
            let (hashes, hash_offsets) = match (t, offsets.as_deref(), block) {
                (Some(t), Some(o), Some((size, seed))) => block_hashes_many(t, o, size, seed)?,
                (Some(t), Some(o), None) => {
                    check_offsets(o, t.len())?;
                    (Vec::new(), vec![0; o.len()])
                }
                _ => (Vec::new(), vec![0; n + 1]),
            };
            let mut inner = self.inner();
            let mut batch = Vec::with_capacity(n);
            for i in 0..n {
                let args = inner.whole(Args {
                    adapter: None,
                    subset: None,
                    fairness_id: fairness_ids.as_ref().map(|f| f[i].as_str()),
                    session: sessions.as_ref().map(|s| s[i].as_str()),
                    input_tokens: count(&ins, i, "input_tokens")?,
                    output_tokens: count(&outs, i, "output_tokens")?,
                    now,
                    hashes_of_ids: block.is_some(),
                });
                inner.check(&args)?;
                batch.push(args);
            }
            inner.picker.pipeline.prepare()?;
            // Checked above with the hashes' offsets.
            let ids = |i: usize| {
                let o = offsets.as_deref()?;
                ids_of(t).map(|all| &all[o[i] as usize..o[i + 1] as usize])
            };
            let mut out = Vec::with_capacity(n);
            for (i, args) in batch.iter().enumerate() {
                let h = &hashes[hash_offsets[i] as usize..hash_offsets[i + 1] as usize];
                let hashed = &mut inner.hashes;
                hashed.held.clear();
                hashed.hashes.clear();
                hashed.hashes.extend_from_slice(h);
                out.push(inner.start(args, ids(i))?.map_or(-1, |e| e as i64));
            }
            Ok(out)
        })?;
        Ok(chosen.into_pyarray(py))
    }

    /// Counts a request started on ``endpoint`` (chosen elsewhere, e.g. a
    /// fallback of ``rank``): in flight, and the stateful plugins learn it.
    #[pyo3(signature = (endpoint, tokens=None, *, hashes=None, fairness_id=None, session=None, input_tokens=0, output_tokens=0, now=None))]
    #[allow(clippy::too_many_arguments)]
    fn started(
        &self,
        py: Python<'_>,
        endpoint: &str,
        tokens: Option<&Bound<'_, PyAny>>,
        hashes: Option<&Bound<'_, PyAny>>,
        fairness_id: Option<&str>,
        session: Option<&str>,
        #[pyo3(from_py_with = int_arg)] input_tokens: u64,
        #[pyo3(from_py_with = int_arg)] output_tokens: u64,
        now: Option<f64>,
    ) -> PyResult<()> {
        let arg = tokens.map(|t| TokenArg::new(t, "tokens")).transpose()?;
        let t = arg.as_ref().map(TokenArg::tokens).transpose()?;
        let hashes = self.hashes(py, t, None, hashes)?;
        let mut inner = self.inner();
        let e = inner.endpoint(endpoint)?;
        let args = Args {
            adapter: None,
            subset: None,
            fairness_id,
            session,
            input_tokens: tokens_arg("input_tokens", input_tokens)?,
            output_tokens: tokens_arg("output_tokens", output_tokens)?,
            now: now_or_monotonic(now),
            hashes_of_ids: false,
        };
        inner.check(&args)?;
        self.give_back(std::mem::replace(&mut inner.hashes, hashes));
        let Inner { picker, hashes, .. } = &mut *inner;
        picker.started(&args.request(Some(hashes), None), e)?;
        Ok(())
    }

    /// Ends one request on ``endpoint`` (``NotInFlightError`` when none is
    /// in flight) with its usage; with ``fairness_id`` the VTC charge is
    /// corrected from the estimates given at ``pick`` (``est_*``) to it.
    #[pyo3(signature = (endpoint, input_tokens=0, output_tokens=0, *, fairness_id=None, est_input_tokens=0, est_output_tokens=0, now=None))]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn completed(
        &self,
        endpoint: &str,
        #[pyo3(from_py_with = int_arg)] input_tokens: u64,
        #[pyo3(from_py_with = int_arg)] output_tokens: u64,
        fairness_id: Option<&str>,
        #[pyo3(from_py_with = int_arg)] est_input_tokens: u64,
        #[pyo3(from_py_with = int_arg)] est_output_tokens: u64,
        now: Option<f64>,
    ) -> PyResult<()> {
        let mut inner = self.inner();
        let e = inner.endpoint(endpoint)?;
        let args = Args {
            adapter: None,
            subset: None,
            fairness_id,
            session: None,
            input_tokens: tokens_arg("est_input_tokens", est_input_tokens)?,
            output_tokens: tokens_arg("est_output_tokens", est_output_tokens)?,
            now: now_or_monotonic(now),
            hashes_of_ids: false,
        };
        tokens_arg("input_tokens", input_tokens)?;
        tokens_arg("output_tokens", output_tokens)?;
        inner.check(&args)?;
        inner
            .picker
            .complete(e, &args.request(None, None), input_tokens, output_tokens)?;
        Ok(())
    }

    /// Updates what is known of ``endpoint`` (arguments left ``None`` are
    /// unchanged): the engine's ``waiting`` and ``running`` requests and
    /// ``kv_usage`` in [0, 1] (a new scrape: the picker's own dispatches
    /// since the last one are forgotten), ``healthy``, and the LoRA
    /// ``adapters`` it serves.
    #[pyo3(signature = (endpoint, *, waiting=None, running=None, kv_usage=None, healthy=None, adapters=None))]
    fn set_state(
        &self,
        endpoint: &str,
        waiting: Option<f64>,
        running: Option<f64>,
        kv_usage: Option<f64>,
        healthy: Option<bool>,
        adapters: Option<Vec<String>>,
    ) -> PyResult<()> {
        let mut inner = self.inner();
        let e = inner.endpoint(endpoint)?;
        for (what, v) in [("waiting", waiting), ("running", running)] {
            if let Some(x) = v {
                non_negative(what, x)?;
            }
        }
        if let Some(k) = kv_usage {
            if !(0.0..=1.0).contains(&finite("kv_usage", k)?) {
                return Err(PyValueError::new_err(format!(
                    "kv_usage must be in [0, 1], got {k}"
                )));
            }
        }
        let s = &mut inner.picker.states[e];
        if waiting.is_some() || running.is_some() || kv_usage.is_some() {
            s.dispatched_since_scrape = 0;
        }
        s.waiting = waiting.or(s.waiting);
        s.running = running.or(s.running);
        s.kv_usage = kv_usage.or(s.kv_usage);
        s.healthy = healthy.unwrap_or(s.healthy);
        if let Some(a) = adapters {
            s.adapters = a;
        }
        Ok(())
    }

    /// What is known of ``endpoint``: a dict of ``healthy``, ``in_flight``,
    /// ``dispatched_since_scrape``, ``waiting``, ``running``, ``kv_usage``
    /// (``None``: unknown) and ``adapters``.
    fn state<'py>(&self, py: Python<'py>, endpoint: &str) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.inner();
        state_dict(py, &inner.picker.states[inner.endpoint(endpoint)?])
    }

    /// Adds an endpoint (healthy, idle, nothing cached).
    fn add_endpoint(&self, py: Python<'_>, endpoint: &str) -> PyResult<()> {
        let mut inner = self.inner();
        inner.picker.add_endpoint(endpoint)?;
        inner.names.push(PyString::new(py, endpoint).unbind());
        Ok(())
    }

    /// Removes an endpoint (KeyError if unknown) and what the plugins know
    /// of it; later endpoints move down one index.
    fn remove_endpoint(&self, endpoint: &str) -> PyResult<()> {
        let mut inner = self.inner();
        let i = inner.picker.remove_endpoint(endpoint)?;
        inner.names.remove(i);
        Ok(())
    }

    /// The endpoints, in order (the indices ``pick_many`` returns).
    #[getter]
    fn endpoints(&self) -> Vec<String> {
        self.inner().picker.names().to_vec()
    }

    /// Requests in flight per endpoint (started, not completed).
    #[getter]
    fn in_flight(&self) -> Vec<u64> {
        self.inner().picker.running()
    }

    /// The preset's name (``None`` when built from plugins).
    #[getter]
    fn preset(&self) -> Option<String> {
        self.inner().preset.clone()
    }

    /// The plugins, as ``{"name", "weight", **params}`` dicts.
    #[getter]
    fn plugins<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let specs: Vec<serde_json::Value> = self
            .inner()
            .picker
            .pipeline
            .specs()
            .iter()
            .map(|s| {
                let mut m = match &s.params {
                    serde_json::Value::Object(m) => m.clone(),
                    _ => serde_json::Map::new(),
                };
                m.insert("name".into(), s.name.clone().into());
                m.insert("weight".into(), s.weight.into());
                serde_json::Value::Object(m)
            })
            .collect();
        let text = serde_json::Value::Array(specs).to_string();
        Ok(py
            .import("json")?
            .call_method1("loads", (text,))?
            .cast_into::<PyList>()?)
    }

    /// A snapshot: plugins, endpoints, their states and everything learned.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let inner = self.inner();
        let mut w = Writer::new(MAGIC, SNAPSHOT_VERSION);
        match &inner.preset {
            Some(p) => w.u8(1).str(p),
            None => w.u8(0),
        };
        inner.picker.write(&mut w);
        PyBytes::new(py, &w.finish())
    }

    /// Restores a snapshot written by ``to_bytes``; ValueError if invalid.
    /// A snapshot does not hold the KV-event index (the engines' state): a
    /// precise-prefix picker is restored with ``kv_index`` given again.
    #[staticmethod]
    #[pyo3(signature = (data, kv_index=None))]
    fn from_bytes(
        py: Python<'_>,
        data: &[u8],
        kv_index: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let config = PickConfig {
            kv_index: kv_index_arg(kv_index)?,
            ..PickConfig::default()
        };
        let read = |r: &mut Reader<'_>, version: u16| -> Result<(Option<String>, PoolPicker)> {
            let preset = match r.u8()? {
                0 => None,
                1 => Some(r.str()?),
                b => return Err(Error::Snapshot(format!("bad preset flag {b}"))),
            };
            Ok((preset, PoolPicker::read(r, &config, version >= 2)?))
        };
        let (preset, picker) =
            restore_since(data, MAGIC, 1..=SNAPSHOT_VERSION, "endpoint picker", read)?;
        check_kv_index(&picker.pipeline, config.kv_index.as_ref())?;
        let inner = Inner::new(picker, preset, py);
        Ok(Self {
            block: inner.picker.block(),
            kv: inner.picker.kv(),
            inner: Mutex::new(inner),
            spare: Mutex::default(),
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        if slf.get().inner().picker.pipeline.wants_kv_index() {
            return Err(PyTypeError::new_err(
                "an EndpointPicker with a kv_index cannot be pickled (its KvEventIndex is \
                 live: subscribers on the engines); use to_bytes() and \
                 EndpointPicker.from_bytes(data, kv_index=...)",
            ));
        }
        reduce(slf, slf.get().to_bytes(slf.py()))
    }

    fn __repr__(&self) -> String {
        let inner = self.inner();
        let how = match &inner.preset {
            Some(p) => format!("preset={p:?}"),
            None => format!("plugins={}", inner.picker.pipeline.specs().len()),
        };
        format!(
            "EndpointPicker(endpoints={:?}, {how})",
            inner.picker.names()
        )
    }
}
