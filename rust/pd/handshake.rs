//! The engines' prefill/decode handshakes, as body rewrites: what a split
//! request's two upstream requests carry when routecore sends them itself
//! (`disaggregation.handoff`, [`Handoff`]). Pure: serde_json only, no I/O;
//! the data plane's sender (`serve::pd_send`) moves the bytes.
//!
//! From the engines' documents:
//!
//! - **vLLM** (disaggregated prefilling with a KV connector; the
//!   `disagg_proxy` example's request flow, NixlConnector's usage guide):
//!   two steps. The prefill is the client's request with `max_tokens` (and
//!   `max_completion_tokens` when present) 1, `stream` false (no
//!   `stream_options`) and `kv_transfer_params` asking for a remote decode
//!   ([`vllm_prefill`]); its answer's `kv_transfer_params` (the prefill
//!   engine and its blocks) go into the decode request, the client's
//!   request otherwise unchanged ([`vllm_decode`]).
//! - **SGLang** (`--disaggregation-mode prefill|decode`, its PD router):
//!   one step. The same request goes to both engines at once with
//!   `bootstrap_host` and `bootstrap_port` of the prefill engine and a
//!   random `bootstrap_room` shared by the two ([`sglang`]): the decode
//!   engine meets the prefill engine's KV in that room.
//!
//! Whatever the client put in these fields is replaced: its own
//! `kv_transfer_params` or bootstrap fields never reach an engine.

use std::fmt;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::{invalid, Result};

/// How a split request travels (a pool's `disaggregation.handoff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Handoff {
    /// One request to the decode endpoint, the prefill endpoint named in
    /// `x-prefiller-host-port` for llm-d's routing sidecar (or an Envoy
    /// filter) beside the decode engine, which sends the two requests.
    #[default]
    Header,
    /// routecore sends the prefill ([`vllm_prefill`]) and waits for its
    /// answer, then the decode request ([`vllm_decode`]) goes on.
    Vllm,
    /// routecore sends the prefill while the decode request goes on, both
    /// with the same bootstrap fields ([`sglang`]).
    Sglang,
}

/// The handoff names, as config spells them.
pub const HANDOFFS: [&str; 3] = ["header", "vllm", "sglang"];

impl Handoff {
    pub fn as_str(self) -> &'static str {
        HANDOFFS[self as usize]
    }
    /// routecore sends the prefill request itself.
    pub fn sends(self) -> bool {
        self != Handoff::Header
    }
}

/// Why a split request was served aggregated on its decode endpoint (the
/// `reason` of `routecore_pd_fallbacks_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fallback {
    /// The prefill endpoint could not be reached (or closed the connection).
    Connect,
    /// It answered with another status than 200.
    Status,
    /// No answer within `disaggregation.prefill_timeout_s`.
    Timeout,
    /// Its answer is not a JSON object within the size bound.
    BadAnswer,
    /// Its answer carries no `kv_transfer_params` object (vLLM).
    NoParams,
}

/// The fallback reasons, as the metric labels them.
pub const FALLBACKS: [&str; 5] = ["connect", "status", "timeout", "bad-answer", "no-params"];

impl Fallback {
    pub fn as_str(self) -> &'static str {
        FALLBACKS[self as usize]
    }
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fallback::Connect => "the prefill endpoint could not be reached",
            Fallback::Status => "the prefill endpoint answered with an error status",
            Fallback::Timeout => "the prefill endpoint did not answer in time",
            Fallback::BadAnswer => "the prefill answer is not a JSON object within the size bound",
            Fallback::NoParams => "the prefill answer carries no kv_transfer_params object",
        })
    }
}

/// A JSON object of at most `max` bytes: a request body or an answer.
fn object(bytes: &[u8], max: usize, what: &str) -> Result<Map<String, Value>> {
    if bytes.len() > max {
        return Err(invalid(format!(
            "{what} of {} bytes is over the bound of {max}",
            bytes.len()
        )));
    }
    match serde_json::from_slice(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(invalid(format!("{what} is not a JSON object"))),
        Err(e) => Err(invalid(format!("{what} is not JSON: {e}"))),
    }
}

fn bytes(m: Map<String, Value>) -> Vec<u8> {
    // A map of JSON values always serializes.
    serde_json::to_vec(&Value::Object(m)).unwrap_or_default()
}

/// The `kv_transfer_params` of a prefill request: the decode runs
/// elsewhere, and nothing is known yet of where the blocks will be.
pub fn remote_decode() -> Value {
    serde_json::json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

/// vLLM's prefill request from the client's `body` (at most `max` bytes):
/// one output token, not streamed, `kv_transfer_params` asking for a
/// remote decode.
pub fn vllm_prefill(body: &[u8], max: usize) -> Result<Vec<u8>> {
    let mut m = object(body, max, "the request body")?;
    m.insert("max_tokens".into(), 1.into());
    if m.contains_key("max_completion_tokens") {
        m.insert("max_completion_tokens".into(), 1.into());
    }
    m.insert("stream".into(), false.into());
    m.remove("stream_options");
    m.insert("kv_transfer_params".into(), remote_decode());
    Ok(bytes(m))
}

/// vLLM's decode request: the client's `body` with the `kv_transfer_params`
/// of the prefill's `answer` (each at most `max` bytes). Without them
/// (`null` or absent): `NoParams` when `require` (a connector such as NIXL
/// that the decode engine needs them for), else the body without any
/// (a connector that hands the KV over by itself, e.g. vLLM's
/// ExampleConnector through shared storage).
pub fn vllm_decode(
    body: &[u8],
    answer: &[u8],
    max: usize,
    require: bool,
) -> std::result::Result<Vec<u8>, Fallback> {
    let answer = object(answer, max, "the prefill answer").map_err(|_| Fallback::BadAnswer)?;
    let mut m = object(body, max, "the request body").map_err(|_| Fallback::BadAnswer)?;
    match answer.get("kv_transfer_params") {
        Some(p @ Value::Object(_)) => {
            m.insert("kv_transfer_params".into(), p.clone());
        }
        _ if require => return Err(Fallback::NoParams),
        _ => {
            m.remove("kv_transfer_params");
        }
    }
    Ok(bytes(m))
}

/// The host of an `ip:port` / `host:port` / `[v6]:port` endpoint (the
/// whole string when it has no port).
pub fn host(endpoint: &str) -> &str {
    if let Some(rest) = endpoint.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match endpoint.rsplit_once(':') {
        Some((h, port)) if !h.contains(':') && port.parse::<u16>().is_ok() => h,
        _ => endpoint,
    }
}

/// The largest bootstrap room: rooms stay within a signed 64-bit integer,
/// which every engine's JSON reader holds.
pub const MAX_ROOM: u64 = i64::MAX as u64;

/// SGLang's request, sent to both endpoints: the client's `body` (at most
/// `max` bytes) with `bootstrap_host` (the prefill endpoint's host),
/// `bootstrap_port` (the prefill engine's bootstrap server; None: `null`,
/// the engine's default) and `bootstrap_room` (`room`, at most
/// [`MAX_ROOM`]: the caller draws it at random).
pub fn sglang(
    body: &[u8],
    max: usize,
    prefill_endpoint: &str,
    bootstrap_port: Option<u16>,
    room: u64,
) -> Result<Vec<u8>> {
    if room > MAX_ROOM {
        return Err(invalid(format!("bootstrap_room {room} is over {MAX_ROOM}")));
    }
    let mut m = object(body, max, "the request body")?;
    m.insert("bootstrap_host".into(), host(prefill_endpoint).into());
    m.insert(
        "bootstrap_port".into(),
        bootstrap_port.map_or(Value::Null, Value::from),
    );
    m.insert("bootstrap_room".into(), room.into());
    Ok(bytes(m))
}

#[cfg(test)]
mod tests;
