//! The data plane's sender of a split request's prefill, for the pools
//! whose `disaggregation.handoff` is `vllm` or `sglang` (routecore sends
//! the two upstream requests, no llm-d sidecar needed). Thin: the bodies
//! and the fallback reasons come from [`crate::pd::handshake`].
//!
//! The ext_proc front end calls [`hand_off`] once a split request is
//! placed, before it answers Envoy:
//!
//! - `vllm`: the prefill is sent and its answer awaited (Envoy is asked to
//!   wait that long); the decode request Envoy then sends to the decode
//!   endpoint carries the answer's `kv_transfer_params` (a body mutation).
//! - `sglang`: a connection to the prefill endpoint is opened; the prefill
//!   is sent on it while Envoy sends the decode request, both with the
//!   same bootstrap fields.
//!
//! When the prefill cannot be sent or fails before the decode request
//! leaves (connect error, a status other than 200, the timeout, an answer
//! without `kv_transfer_params`), the request is served aggregated on its
//! decode endpoint with its body as it came: counted in
//! `routecore_pd_fallbacks_total{pool,reason}`, logged once per run of
//! failures (`logs::Repeats`). The prefill half of the lease is released
//! as soon as the prefill ended or fell back ([`Shared::release_prefill`]),
//! the rest with the lease: each once. Only the body and
//! `content-type` / `host` go to the prefill endpoint: no header of the
//! client's (its API key included) ever does.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use super::engine::{Routed, Shared};
use super::flow::{WaitNotice, WAIT_MARGIN};
use super::handoff::PoolHandoff;
use super::scrape::{answer, Failure};
use crate::pd::handshake::{self, Fallback, Handoff, MAX_ROOM};

fn failure(f: Failure) -> Fallback {
    match f {
        Failure::Connect | Failure::Garbage => Fallback::Connect,
        Failure::Timeout => Fallback::Timeout,
        Failure::Status => Fallback::Status,
        Failure::TooLarge => Fallback::BadAnswer,
    }
}

type Sender = SendRequest<Full<Bytes>>;

/// A connection to `endpoint`, driven by a task of its own until the
/// sender is dropped.
async fn connect(endpoint: &str) -> std::result::Result<Sender, Fallback> {
    let stream = tokio::net::TcpStream::connect(endpoint)
        .await
        .map_err(|_| Fallback::Connect)?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|_| Fallback::Connect)?;
    tokio::spawn(conn);
    Ok(sender)
}

/// One POST of `body` to `path` on `sender`'s `endpoint`: the answer's
/// body (a 200, at most `max` bytes).
async fn post(
    sender: &mut Sender,
    endpoint: &str,
    path: &str,
    body: Vec<u8>,
    max: usize,
) -> std::result::Result<Bytes, Fallback> {
    let request = hyper::Request::post(path)
        .header(hyper::header::HOST, endpoint)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|_| Fallback::Connect)?;
    answer(sender, request, max).await.map_err(failure)
}

/// The path of the client's request when it is an API path (`/v1/...`,
/// printable, at most 1 KiB; the query dropped), else the chat API's.
pub fn request_path(path: Option<&[u8]>) -> &str {
    const CHAT: &str = "/v1/chat/completions";
    let Some(p) = path.and_then(|p| std::str::from_utf8(p).ok()) else {
        return CHAT;
    };
    let p = p.split('?').next().unwrap_or(p);
    let printable = p.bytes().all(|b| b.is_ascii_graphic());
    if p.starts_with("/v1/") && p.len() <= 1024 && printable {
        p
    } else {
        CHAT
    }
}

/// Hands a split request off (see the module doc): on success `routed`'s
/// body is the decode request's; on a fallback it is left as it came. The
/// prefill endpoint is taken out of `routed` either way (no sidecar
/// header: routecore sent the prefill). Pools with the `header` handoff,
/// and requests not split, are left untouched.
pub async fn hand_off(
    shared: &Arc<Shared>,
    handoff: &PoolHandoff,
    routed: &mut Routed,
    body: &[u8],
    path: &str,
    max: usize,
    wait: Option<&WaitNotice>,
) {
    if !handoff.handoff.sends() {
        return;
    }
    let Some(prefill) = routed.prefill_endpoint.take() else {
        return;
    };
    let body = routed.body.as_deref().unwrap_or(body);
    let sent = match handoff.handoff {
        Handoff::Vllm => {
            if let Some(w) = wait {
                let _ = w.0.send(handoff.timeout + WAIT_MARGIN);
            }
            vllm(handoff, &prefill, path, body, max).await
        }
        Handoff::Sglang => sglang(shared, handoff, routed.id, &prefill, path, body, max).await,
        Handoff::Header => return,
    };
    match sent {
        Ok(decode_body) => {
            if handoff.handoff == Handoff::Vllm {
                // The prefill has answered: its endpoint's part is done.
                shared.release_prefill(routed.id);
            }
            handoff.handed_off(&prefill);
            routed.body = Some(decode_body);
        }
        Err(reason) => {
            shared.release_prefill(routed.id);
            handoff.fell_back(reason, &prefill, &routed.request_id);
        }
    }
}

/// vLLM's two steps: the prefill sent and answered, then the decode body.
async fn vllm(
    h: &PoolHandoff,
    prefill: &str,
    path: &str,
    body: &[u8],
    max: usize,
) -> std::result::Result<Vec<u8>, Fallback> {
    // The body was parsed when it was routed: a refusal here is a body the
    // engine would refuse as well; it is served (and refused) aggregated.
    let first = handshake::vllm_prefill(body, max).map_err(|_| Fallback::BadAnswer)?;
    let sent = async {
        let mut sender = connect(prefill).await?;
        post(&mut sender, prefill, path, first, max).await
    };
    let answer = tokio::time::timeout(h.timeout, sent)
        .await
        .map_err(|_| Fallback::Timeout)??;
    handshake::vllm_decode(body, &answer, max, h.require_params)
}

/// SGLang's one step: connected to the prefill endpoint, the same body
/// goes there (a task that ends the prefill half of the lease when the
/// answer is in, or at the timeout) while the decode request goes on.
async fn sglang(
    shared: &Arc<Shared>,
    h: &PoolHandoff,
    id: u128,
    prefill: &str,
    path: &str,
    body: &[u8],
    max: usize,
) -> std::result::Result<Vec<u8>, Fallback> {
    let room = rand_room();
    let both = handshake::sglang(body, max, prefill, h.bootstrap_port, room)
        .map_err(|_| Fallback::BadAnswer)?;
    let mut sender = tokio::time::timeout(h.timeout, connect(prefill))
        .await
        .map_err(|_| Fallback::Timeout)??;
    let (shared, endpoint, path, sent) = (
        Arc::clone(shared),
        prefill.to_string(),
        path.to_string(),
        both.clone(),
    );
    let timeout = h.timeout;
    tokio::spawn(async move {
        let posted = post(&mut sender, &endpoint, &path, sent, max);
        let failed = match tokio::time::timeout(timeout, posted).await {
            Ok(Ok(_)) => None,
            Ok(Err(reason)) => Some(reason),
            Err(_) => Some(Fallback::Timeout),
        };
        if let Some(reason) = failed {
            // The decode request has gone: it ends as its engine decides.
            tracing::debug!(
                endpoint = endpoint.as_str(),
                reason = reason.as_str(),
                "sglang-prefill-failed"
            );
        }
        shared.release_prefill(id);
    });
    Ok(both)
}

/// A random bootstrap room in `0..=MAX_ROOM`.
fn rand_room() -> u64 {
    let mut b = [0u8; 8];
    // Without the OS's randomness, the clock's nanoseconds (a room only
    // has to differ from the rooms in flight).
    if getrandom::fill(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        b = (t.as_nanos() as u64).to_le_bytes();
    }
    u64::from_le_bytes(b) & MAX_ROOM
}

#[cfg(test)]
pub(crate) mod support;
#[cfg(test)]
mod tests;
