//! The Python `Dispatcher`'s steps in Rust: [`crate::dispatch::Steps`] over
//! the Rust parts a `Dispatcher` holds (a `TokenBudgetRouter`, the
//! `AdmissionController` of an `InMemoryAdmission`, `EndpointPicker`s), run
//! by [`dispatch_now`] in one call: route -> admit -> pick, and on a refusal
//! or an error what the earlier steps took given back in reverse (admission
//! released, nothing learned; the pool's count). Each part keeps its own
//! lock, taken for its step only, as the Python path takes them.

use std::future::Future;

use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyString};

use super::admission::{PyAdmission, PyAdmissionController};
use super::budget::{PyRouteDecision, PyTokenBudgetRouter};
use super::int_arg;
use super::pick::PyEndpointPicker;
use crate::admission::Admission;
use crate::budget::{Decision, MAX_TOKENS};
use crate::dispatch::{dispatch_now, Steps};
use crate::error::{finite, non_negative};

/// The picker of a request.
enum Pickers {
    None,
    /// One picker for every request.
    All(Py<PyEndpointPicker>),
    /// Each router pool's picker, by pool index (None: the pool has none).
    ByPool(Vec<Option<Py<PyEndpointPicker>>>),
}

/// What ``acquire`` returns, a lease's fields: the input estimate, the
/// route decision, the admission, the endpoint and the prefill endpoint.
type Acquired = (
    i64,
    Option<Py<PyRouteDecision>>,
    Option<Py<PyAdmission>>,
    Option<Py<PyString>>,
    Option<Py<PyString>>,
);

/// The steps of ``Dispatcher.acquire`` over Rust parts, in one call (see
/// ``routecore.Dispatcher``, which uses it when its router, pickers and
/// admission are a ``TokenBudgetRouter``, ``EndpointPicker`` objects and an
/// ``InMemoryAdmission``).
///
/// ``refused(step, status, reason, retry_after_s)`` makes the exception a
/// refusal raises (``RequestRefused``). ``pickers``: one picker, or a
/// mapping from the router's pool names to pickers (KeyError for a name
/// that is not a pool). ``admission``: the controller; ``clock``: its clock
/// when ``now`` is None (None: ``monotonic``). The parts are fixed here.
#[pyclass(frozen, name = "DispatchSteps", module = "routecore")]
pub struct PyDispatchSteps {
    refused: Py<PyAny>,
    router: Option<Py<PyTokenBudgetRouter>>,
    pickers: Pickers,
    admission: Option<Py<PyAdmissionController>>,
    clock: Option<Py<PyAny>>,
}

impl PyDispatchSteps {
    /// The exception of a refusal at `step`.
    fn refuse(
        &self,
        py: Python<'_>,
        step: &str,
        status: u16,
        reason: &str,
        retry_after_s: Option<f64>,
    ) -> PyErr {
        match self
            .refused
            .call1(py, (step, status, reason, retry_after_s))
        {
            Ok(e) => PyErr::from_value(e.into_bound(py)),
            Err(e) => e,
        }
    }

    /// Admission's `now`: as given, else its clock's.
    fn admission_now(&self, py: Python<'_>, now: Option<f64>) -> PyResult<f64> {
        match (now, &self.clock) {
            (Some(now), _) => Ok(now),
            (None, None) => Ok(crate::clock::monotonic()),
            (None, Some(clock)) => clock.bind(py).call0()?.extract(),
        }
    }

    /// The picker of a request routed to `pool` (None: no picker places
    /// it); KeyError when its pool has none.
    fn picker(&self, py: Python<'_>, pool: Option<usize>) -> PyResult<Option<&PyEndpointPicker>> {
        match (&self.pickers, pool) {
            (Pickers::None, _) | (Pickers::ByPool(_), None) => Ok(None),
            (Pickers::All(p), _) => Ok(Some(p.get())),
            (Pickers::ByPool(by), Some(i)) => match (&by[i], &self.router) {
                (Some(p), _) => Ok(Some(p.get())),
                (None, Some(router)) => Err(PyKeyError::new_err(router.get().name(py, i))),
                (None, None) => Ok(None),
            },
        }
    }
}

/// One request's arguments.
struct Ask<'a, 'py> {
    max_output_tokens: i64,
    prompt_bytes: Option<i64>,
    category: &'a str,
    input_tokens: Option<i64>,
    entitlement: Option<&'a str>,
    tokens: Option<&'a Bound<'py, PyAny>>,
    fairness_id: Option<&'a str>,
    session: Option<&'a str>,
    now: Option<f64>,
}

/// One request's steps over the parts.
struct Request<'a, 'py> {
    py: Python<'py>,
    parts: &'a PyDispatchSteps,
    ask: Ask<'a, 'py>,
    /// The input estimate: given, else the router's, else 0.
    input_tokens: i64,
    /// The first error giving a step back (raised instead of the refusal,
    /// as the Python path does).
    failed: Option<PyErr>,
}

/// A token count in [0, MAX_TOKENS].
fn count(what: &str, v: i64) -> PyResult<u64> {
    match u64::try_from(v) {
        Ok(n) if n <= MAX_TOKENS => Ok(n),
        _ => Err(PyValueError::new_err(format!(
            "{what} must be an int in [0, {MAX_TOKENS}], got {v}"
        ))),
    }
}

/// The UTF-8 length of a `str` prompt, or the length of a `bytes` one.
fn text_length(tokens: Option<&Bound<'_, PyAny>>) -> PyResult<i64> {
    let n = match tokens {
        Some(t) if t.is_instance_of::<PyString>() => t.cast::<PyString>()?.to_str()?.len(),
        Some(t) if t.is_instance_of::<PyBytes>() => t.cast::<PyBytes>()?.as_bytes().len(),
        Some(t) if t.is_instance_of::<PyByteArray>() => t.cast::<PyByteArray>()?.len(),
        _ => {
            return Err(PyValueError::new_err(
                "prompt_bytes is needed unless tokens is str or bytes",
            ))
        }
    };
    Ok(n as i64)
}

impl Request<'_, '_> {
    fn admit_now(&mut self) -> PyResult<Option<(Admission, f64)>> {
        let (Some(controller), Some(entitlement)) = (&self.parts.admission, self.ask.entitlement)
        else {
            return Ok(None);
        };
        let now = self.parts.admission_now(self.py, self.ask.now)?;
        let max_tokens = Some(self.ask.max_output_tokens);
        let a = controller
            .get()
            .lock()
            .admit(entitlement, self.input_tokens, max_tokens, now)?;
        if !a.admitted {
            let (status, reason, retry) = (a.status, a.reason, a.retry_after_s);
            return Err(self
                .parts
                .refuse(self.py, "admission", status, reason, retry));
        }
        Ok(Some((a, now)))
    }
}

impl Steps for Request<'_, '_> {
    type Pool = Option<Decision>;
    type Admitted = Option<(Admission, f64)>;
    type Picked = Option<(Py<PyString>, Option<Py<PyString>>)>;
    type Refused = PyErr;

    fn route(&mut self) -> PyResult<Option<Decision>> {
        let Some(router) = &self.parts.router else {
            self.input_tokens = self.ask.input_tokens.unwrap_or(0);
            return Ok(None);
        };
        let prompt_bytes = match self.ask.prompt_bytes {
            Some(b) => b,
            None => text_length(self.ask.tokens)?,
        };
        let ask = &self.ask;
        let d = router
            .get()
            .decide(prompt_bytes, ask.category, ask.max_output_tokens)?;
        if d.pool.is_none() {
            return Err(self
                .parts
                .refuse(self.py, "route", 413, d.reason.as_str(), None));
        }
        self.input_tokens = ask.input_tokens.unwrap_or(d.est_input_tokens as i64);
        Ok(Some(d))
    }

    fn admit(
        &mut self,
        _: &Option<Decision>,
    ) -> impl Future<Output = PyResult<Option<(Admission, f64)>>> {
        std::future::ready(self.admit_now())
    }

    fn pick(
        &mut self,
        pool: &Option<Decision>,
        _: &Option<(Admission, f64)>,
    ) -> PyResult<Self::Picked> {
        let (py, ask) = (self.py, &self.ask);
        let Some(picker) = self.parts.picker(py, pool.and_then(|d| d.pool))? else {
            return Ok(None);
        };
        let pair = picker.pick_pair(
            py,
            ask.tokens,
            None,
            None,
            None,
            ask.fairness_id,
            ask.session,
            count("input_tokens", self.input_tokens)?,
            count("output_tokens", ask.max_output_tokens)?,
            ask.now,
        )?;
        match pair {
            Some(pair) => Ok(Some(pair)),
            None => Err(self.parts.refuse(py, "endpoint", 503, "no-endpoint", None)),
        }
    }

    fn unadmit(&mut self, _: &Option<Decision>, admitted: Option<(Admission, f64)>) {
        let (Some(controller), Some(ticket)) =
            (&self.parts.admission, admitted.and_then(|(a, _)| a.ticket))
        else {
            return;
        };
        // Never served: nothing charged, nothing learned.
        let released = self
            .parts
            .admission_now(self.py, self.ask.now)
            .and_then(|now| Ok(controller.get().lock().release(ticket, now)?));
        if let Err(e) = released {
            self.failed.get_or_insert(e);
        }
    }

    fn unroute(&mut self, pool: Option<Decision>) {
        let (Some(router), Some(i)) = (&self.parts.router, pool.and_then(|d| d.pool)) else {
            return;
        };
        if let Err(e) = router.get().inner.complete(i) {
            self.failed.get_or_insert(e.into());
        }
    }
}

#[pymethods]
impl PyDispatchSteps {
    #[new]
    #[pyo3(signature = (refused, router=None, pickers=None, admission=None, clock=None))]
    fn new(
        refused: Py<PyAny>,
        router: Option<Py<PyTokenBudgetRouter>>,
        pickers: Option<&Bound<'_, PyAny>>,
        admission: Option<Py<PyAdmissionController>>,
        clock: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        if router.is_none() && pickers.is_none() && admission.is_none() {
            return Err(PyValueError::new_err("give a router, pickers or admission"));
        }
        let pickers = match pickers {
            None => Pickers::None,
            Some(p) => match p.cast::<PyEndpointPicker>() {
                Ok(p) => Pickers::All(p.clone().unbind()),
                Err(_) => {
                    let Some(router) = &router else {
                        return Err(PyValueError::new_err(
                            "pickers per pool need a router to choose the pool",
                        ));
                    };
                    let router = &router.get().inner;
                    let mut by: Vec<_> = router.pools().iter().map(|_| None).collect();
                    for item in p.call_method0("items")?.try_iter()? {
                        let (name, picker): (String, Bound<'_, PyAny>) = item?.extract()?;
                        let picker = picker.cast_into::<PyEndpointPicker>().map_err(|_| {
                            PyTypeError::new_err(format!(
                                "pickers[{name:?}] must be an EndpointPicker"
                            ))
                        })?;
                        by[router.pool_index(&name)?] = Some(picker.unbind());
                    }
                    Pickers::ByPool(by)
                }
            },
        };
        Ok(Self {
            refused,
            router,
            pickers,
            admission,
            clock,
        })
    }

    /// Routes, admits and picks one request (``Dispatcher.acquire``'s
    /// arguments, ``wait`` aside) and returns ``(input_tokens, decision,
    /// admission, endpoint, prefill_endpoint)``; a refusal raises
    /// ``refused(...)`` and a bad argument its error, with nothing held.
    #[pyo3(signature = (max_output_tokens, prompt_bytes, category, input_tokens, entitlement, tokens, fairness_id, session, now))]
    #[allow(clippy::too_many_arguments)]
    fn acquire(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = int_arg)] max_output_tokens: i64,
        #[pyo3(from_py_with = int_arg)] prompt_bytes: Option<i64>,
        category: &str,
        #[pyo3(from_py_with = int_arg)] input_tokens: Option<i64>,
        entitlement: Option<&str>,
        tokens: Option<&Bound<'_, PyAny>>,
        fairness_id: Option<&str>,
        session: Option<&str>,
        now: Option<f64>,
    ) -> PyResult<Acquired> {
        // Checked before any step: a bad argument holds nothing.
        if let Some(now) = now {
            finite("now", now)?;
        }
        count("max_output_tokens", max_output_tokens)?;
        if let Some(input) = input_tokens {
            count("input_tokens", input)?;
        }
        if self.admission.is_some() {
            if entitlement.is_none() {
                return Err(PyValueError::new_err(
                    "entitlement is needed with admission",
                ));
            }
            if self.router.is_none() && input_tokens.is_none() {
                return Err(PyValueError::new_err(
                    "input_tokens is needed for admission without a router",
                ));
            }
        }
        let mut request = Request {
            py,
            parts: self,
            ask: Ask {
                max_output_tokens,
                prompt_bytes,
                category,
                input_tokens,
                entitlement,
                tokens,
                fairness_id,
                session,
                now,
            },
            input_tokens: 0,
            failed: None,
        };
        let outcome = dispatch_now(&mut request);
        let failed = request.failed.take();
        let d = match outcome {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(failed.unwrap_or(e)),
            None => return Err(failed.unwrap_or_else(|| PyRuntimeError::new_err("a step waited"))),
        };
        let decision = match (d.pool, &self.router) {
            (Some(decision), Some(router)) => {
                Some(Py::new(py, router.get().decision(py, decision))?)
            }
            _ => None,
        };
        let admission = d
            .admitted
            .map(|(a, _)| Py::new(py, PyAdmission::from(a)))
            .transpose()?;
        let (endpoint, prefill) = d.picked.map_or((None, None), |(e, p)| (Some(e), p));
        Ok((request.input_tokens, decision, admission, endpoint, prefill))
    }

    /// Gives back what a lease from ``acquire`` holds, as
    /// ``Dispatcher``'s lease does: the endpoint (``completed`` with the
    /// usage, the estimates and ``fairness_id``), the prefill endpoint, the
    /// admission ticket (``complete`` with the usage and ``latency_s``) and
    /// the pool; every part attempted, the first error raised after.
    #[pyo3(signature = (decision, admission, endpoint, prefill_endpoint, fairness_id, input_tokens, max_output_tokens, actual_input, actual_output, latency_s, now))]
    #[allow(clippy::too_many_arguments)]
    fn release(
        &self,
        py: Python<'_>,
        decision: Option<&Bound<'_, PyRouteDecision>>,
        admission: Option<&Bound<'_, PyAdmission>>,
        endpoint: Option<&str>,
        prefill_endpoint: Option<&str>,
        fairness_id: Option<&str>,
        #[pyo3(from_py_with = int_arg)] input_tokens: i64,
        #[pyo3(from_py_with = int_arg)] max_output_tokens: i64,
        #[pyo3(from_py_with = int_arg)] actual_input: i64,
        #[pyo3(from_py_with = int_arg)] actual_output: i64,
        latency_s: f64,
        now: Option<f64>,
    ) -> PyResult<()> {
        // Checked before any part is given back: a bad argument releases nothing.
        let counts = [
            ("input_tokens", input_tokens),
            ("max_output_tokens", max_output_tokens),
            ("actual_input", actual_input),
            ("actual_output", actual_output),
        ];
        let [input_tokens, max_output_tokens, actual_input_n, actual_output_n] =
            counts.map(|(what, v)| count(what, v));
        let (input_tokens, max_output_tokens) = (input_tokens?, max_output_tokens?);
        let (actual_input_n, actual_output_n) = (actual_input_n?, actual_output_n?);
        non_negative("latency_s", latency_s)?;
        if let Some(now) = now {
            finite("now", now)?;
        }
        let pool = decision.and_then(|d| d.get().decision.pool);
        let mut first: Option<PyErr> = None;
        let mut keep = |r: PyResult<()>| {
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        };
        if endpoint.is_some() || prefill_endpoint.is_some() {
            match self.picker(py, pool) {
                Err(e) => keep(Err(e)),
                Ok(None) => {}
                Ok(Some(picker)) => {
                    if let Some(e) = endpoint {
                        keep(picker.completed(
                            e,
                            actual_input_n,
                            actual_output_n,
                            fairness_id,
                            input_tokens,
                            max_output_tokens,
                            now,
                        ));
                    }
                    if let Some(e) = prefill_endpoint {
                        keep(picker.completed_prefill(e, input_tokens, now));
                    }
                }
            }
        }
        let ticket = admission.and_then(|a| a.get().ticket);
        if let (Some(controller), Some(ticket)) = (&self.admission, ticket) {
            keep(self.admission_now(py, now).and_then(|now| {
                let mut c = controller.get().lock();
                Ok(c.complete(ticket, actual_input, actual_output, latency_s, now)?)
            }));
        }
        if let (Some(router), Some(i)) = (&self.router, pool) {
            keep(router.get().inner.complete(i).map_err(Into::into));
        }
        first.map_or(Ok(()), Err)
    }

    fn __repr__(&self) -> String {
        let pickers = match &self.pickers {
            Pickers::None => "None",
            Pickers::All(_) => "one",
            Pickers::ByPool(_) => "per pool",
        };
        format!(
            "DispatchSteps(router={}, pickers={pickers}, admission={})",
            self.router.is_some(),
            self.admission.is_some()
        )
    }
}
