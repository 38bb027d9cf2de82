//! Envoy's `envoy.service.ext_proc.v3.ExternalProcessor`, on tonic with the
//! `envoy-types` wire types.
//!
//! One gRPC stream is one HTTP request. Following the Gateway API Inference
//! Extension's Endpoint Picker Protocol (v1.0):
//!
//! - Request headers: the tenant's API key is read from the key header
//!   (`raw_value`, or `value` when that is empty: the same bytes either way;
//!   401 / 403 as an ImmediateResponse when unknown or expired). Every answer
//!   that mutates the request's headers removes the key header and
//!   `server.strip_headers`, so they never reach the engine whatever Envoy's
//!   configuration, and the headers routecore sets overwrite any the client
//!   sent. In BUFFERED and STREAMED body modes the headers are answered at
//!   once; in FULL_DUPLEX_STREAMED, and in STREAMED when Envoy sends the body
//!   without waiting for that answer (`send_body_without_waiting_for_header_response`),
//!   the answer waits for the whole body, so that it can carry the routing headers. Headers that end the stream route
//!   to the default pool. The objective and fairness id come from llm-d's
//!   `x-llm-d-inference-objective` / `x-llm-d-inference-fairness-id`, or the
//!   GIE's `x-gateway-inference-*` names (aliases).
//! - Request body: chunks are accumulated up to `limits.max_body_bytes` (413
//!   above; 503 when every stream's buffers together would pass
//!   `limits.max_buffered_bytes`; 408 when the stream is not routed within
//!   `limits.body_timeout_s` of its opening: `serve::limits`), parsed and
//!   routed (pool by token budget, endpoint inside it, admission). The answer
//!   sets `x-gateway-destination-endpoint` to the ordered list
//!   `ip:port,ip:port,...` (the chosen endpoint, then its fallbacks, for
//!   Envoy's retries) and `x-routecore-pool` with `clear_route_cache`, and
//!   the `envoy.lb` dynamic metadata `{x-gateway-destination-endpoint: <the
//!   same list>}`; a compressed body
//!   is sent as a body mutation with its `content-length`.
//!   In STREAMED mode every chunk but the last is answered empty and the last
//!   carries the routing; when the headers' answer waited for the body, it
//!   carries the routing and every chunk's answer follows it (empty, or the
//!   compressed body in the first and the others cleared); in
//!   FULL_DUPLEX_STREAMED the headers answer comes first, then the body is
//!   sent back as `streamed_response` chunks.
//! - Refusals (malformed body 400, context too long 400, oversize 413, no
//!   endpoint 503, admission 429 with Retry-After, an internal failure under
//!   `failure_mode: closed` 503) are an ImmediateResponse with a JSON error
//!   body, and end the stream.
//! - Observing stream (a second filter in Envoy's `observability_mode`, for a
//!   routing stream Envoy sends no response body: examples/envoy-observe.yaml):
//!   the routing answer adds the `routecore` metadata `request_id`; Envoy
//!   ends the routing stream once routed, which hands the lease over; the
//!   observing stream's first message (the request's headers) names it by
//!   that id and holds it from then on, reads the response as below and
//!   releases it at its end (or at the stream's own end, without usage);
//!   nothing is answered on it. A lease no observing stream names within
//!   [`OBSERVER_GRACE`] is reaped.
//! - Response: the endpoint that served (after Envoy's retries) arrives in the
//!   `envoy.lb` metadata `x-gateway-destination-endpoint-served`; when it is
//!   not the chosen one, the lease's accounting moves there once
//!   ([`Shared::served`]). Usage is read from a JSON body or from the SSE event that
//!   carries it ([`UsageReader`]; SSE told by the response's content-type, or
//!   by the body's first bytes when Envoy skips the response headers, as the
//!   shipped envoy.yaml does); at the end of the response the lease is
//!   released (calibrator fed, in-flight counts and the admission ticket
//!   released). A stream that ends, fails or is cancelled before that
//!   releases the lease without usage (the conversation's `Drop`); one that
//!   stays open past `limits.request_timeout_s` is reaped.
//! - What the protocol does not allow (request headers after other messages,
//!   response headers twice) ends the stream with FAILED_PRECONDITION. Any
//!   other failure never ends the stream: in the request phase it is a 503
//!   (or the default pool under `failure_mode: open`), in the response phase
//!   the rest of the response passes unchanged.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_request::Request as Msg,
    processing_response::Response as Answer, BodyMutation, BodyResponse, CommonResponse,
    HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse, ProcessingRequest,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use futures_util::{FutureExt, Stream, StreamExt};
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};

use super::engine::{Engine, Hints, Outcome, Reject, Routed, Shared};
use super::flow::WaitNotice;
use super::front::{Door, Routing};
use super::limits::{
    Buffer, StreamCount, StreamSlot, BODY_TIMEOUT, BUFFERS_FULL, MAX_STREAMS_PER_CONNECTION,
};
use super::pd_send;
use super::usage::{looks_like_sse, UsageReader};
use crate::error::Result;
use crate::pd::handshake::Handoff;

/// The header and `envoy.lb` key of the endpoints to try, in order:
/// `ip:port,ip:port,...` (the chosen endpoint, then its fallbacks).
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The prefill endpoint of a split request, `ip:port`, for llm-d's routing
/// sidecar beside the decode engine (which sends the prefill there, then
/// decodes locally). routecore sets it on a split request and removes it
/// from every other: a client's is never trusted.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The `envoy.lb` key of the endpoint that served, in the response's metadata.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The filter-metadata namespace and key of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The request's objective: llm-d's header, then the GIE's name (an alias).
pub const OBJECTIVE_HEADERS: [&str; 2] = [
    "x-llm-d-inference-objective",
    "x-gateway-inference-objective",
];
/// The request's fairness id: llm-d's header, then the GIE's name (an alias).
pub const FAIRNESS_HEADERS: [&str; 2] = [
    "x-llm-d-inference-fairness-id",
    "x-gateway-inference-fairness-id",
];
pub const POOL_HEADER: &str = "x-routecore-pool";
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The dynamic-metadata namespace and key of the request id routecore gives
/// a routed request: a second ext_proc filter in Envoy's `observability_mode`
/// (examples/envoy-observe.yaml) forwards it with the response, which routecore reads
/// without Envoy waiting (see [`Conversation`]'s observer).
pub const ROUTECORE_NAMESPACE: &str = "routecore";
pub const REQUEST_ID_KEY: &str = "request_id";
/// Size of the streamed_response chunks a body is sent back in (as the GIE does).
pub const BODY_CHUNK: usize = 62_000;

/// How long a request whose routing stream ended waits for the observing
/// filter's stream to name it (it does within milliseconds; without one, the
/// reaper releases it after this).
pub const OBSERVER_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

const FULL_DUPLEX: i32 = BodySendMode::FullDuplexStreamed as i32;
const STREAMED: i32 = BodySendMode::Streamed as i32;
const BUFFERED: i32 = BodySendMode::Buffered as i32;

/// A message the ext_proc protocol does not allow at this point of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtocolError(pub String);

fn answer(a: Answer) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(a),
        ..Default::default()
    }
}

/// A header routecore sets: it replaces any value the client sent.
/// Asks Envoy to wait `wait` for the answer to the message it sent last
/// (a request waiting in a flow-control queue).
pub fn extend_timeout(wait: std::time::Duration) -> ProcessingResponse {
    ProcessingResponse {
        override_message_timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: i64::try_from(wait.as_secs()).unwrap_or(i64::MAX),
            nanos: i32::try_from(wait.subsec_nanos()).unwrap_or(0),
        }),
        ..ProcessingResponse::default()
    }
}

fn header(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.into(),
            raw_value: value.to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// A header's value as bytes, whichever field carries it (Envoy sends `raw_value`).
fn header_bytes(h: &HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

fn find_header<'a>(headers: &'a HttpHeaders, name: &[u8]) -> Option<&'a [u8]> {
    headers
        .headers
        .as_ref()?
        .headers
        .iter()
        .find(|h| h.key.as_bytes().eq_ignore_ascii_case(name))
        .map(header_bytes)
}

/// An OpenAI-style JSON error body.
pub fn error_body(status: u16, reason: &str, message: &str) -> Vec<u8> {
    serde_json::json!({"error": {"message": message, "type": reason, "code": status}})
        .to_string()
        .into_bytes()
}

/// The ImmediateResponse refusing a request (Retry-After in whole seconds, rounded up).
pub fn immediate(rej: &Reject) -> ProcessingResponse {
    let mut headers = vec![header("content-type", b"application/json")];
    if rej.retry_after_s > 0.0 {
        let secs = rej.retry_after_s.ceil() as u64;
        headers.push(header("retry-after", secs.to_string().as_bytes()));
    }
    answer(Answer::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(rej.status),
        }),
        headers: Some(HeaderMutation {
            set_headers: headers,
            ..Default::default()
        }),
        body: error_body(rej.status, &rej.reason, &rej.message),
        details: rej.reason.clone(),
        ..Default::default()
    }))
}

/// A namespace of dynamic metadata holding one string.
fn namespace(name: &str, key: &str, value: String) -> (String, Value) {
    let inner = Struct {
        fields: [(
            key.to_string(),
            Value {
                kind: Some(Kind::StringValue(value)),
            },
        )]
        .into(),
    };
    let value = Value {
        kind: Some(Kind::StructValue(inner)),
    };
    (name.to_string(), value)
}

/// The routing's dynamic metadata: in `envoy.lb` the endpoints to try (the
/// same list as the header), and in `routecore` the request id when an
/// observing filter reads the response (it sends the id back with it).
fn lb_metadata(destination: String, request_id: Option<String>) -> Struct {
    let lb = namespace(LB_NAMESPACE, DESTINATION_HEADER, destination);
    let id = request_id.map(|id| namespace(ROUTECORE_NAMESPACE, REQUEST_ID_KEY, id));
    Struct {
        fields: std::iter::once(lb).chain(id).collect(),
    }
}

/// A string of a message's forwarded metadata (`namespace` / `key`).
fn metadata_str<'a>(req: &'a ProcessingRequest, namespace: &str, key: &str) -> Option<&'a str> {
    let md = req.metadata_context.as_ref()?;
    match md
        .filter_metadata
        .get(namespace)?
        .fields
        .get(key)?
        .kind
        .as_ref()?
    {
        Kind::StringValue(s) => Some(s.trim()),
        _ => None,
    }
}

fn streamed(chunk: &[u8], end: bool, request: bool) -> ProcessingResponse {
    let body = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                    body: chunk.to_vec(),
                    end_of_stream: end,
                    ..Default::default()
                })),
            }),
            ..Default::default()
        }),
    };
    answer(if request {
        Answer::RequestBody(body)
    } else {
        Answer::ResponseBody(body)
    })
}

/// The subset hint of a request's filter metadata
/// (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`: a list
/// of "ip:port"), None when it has none. Entries that are not strings are
/// ignored; an empty list is a hint that allows no endpoint (503).
pub fn subset_hint(req: &ProcessingRequest) -> Option<Vec<String>> {
    let md = req.metadata_context.as_ref()?;
    let ns = md.filter_metadata.get(SUBSET_NAMESPACE)?;
    match ns.fields.get(SUBSET_KEY)?.kind.as_ref()? {
        Kind::ListValue(list) => Some(
            list.values
                .iter()
                .filter_map(|v| match v.kind.as_ref() {
                    Some(Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
        ),
        Kind::StringValue(s) => Some(
            s.split(',')
                .map(str::trim)
                .filter(|x| !x.is_empty())
                .map(String::from)
                .collect(),
        ),
        _ => None,
    }
}

/// The endpoint that served, from a response message's `envoy.lb` metadata.
pub fn served_endpoint(req: &ProcessingRequest) -> Option<&str> {
    metadata_str(req, LB_NAMESPACE, SERVED_KEY)
}

/// The request id routecore gave the request, from a message's `routecore`
/// metadata (an observing filter's).
pub fn observed_request_id(req: &ProcessingRequest) -> Option<&str> {
    metadata_str(req, ROUTECORE_NAMESPACE, REQUEST_ID_KEY)
}

/// The state of one ext_proc stream (one HTTP request and its response).
pub struct Conversation {
    /// Pinned: a reload does not move this request.
    engine: Arc<Engine>,
    shared: Arc<Shared>,
    request_mode: i32,
    response_mode: i32,
    /// The request headers are answered with the routing, once the body has
    /// arrived: FULL_DUPLEX_STREAMED, or STREAMED with Envoy's
    /// `send_body_without_waiting_for_header_response`.
    defer_headers: bool,
    /// STREAMED chunks received while the headers' answer waits: each gets
    /// its answer after it, in order.
    unanswered_chunks: usize,
    /// The key, the body limit, the routing under the failure mode.
    door: Door,
    body: Buffer,
    lease: Option<u128>,
    routed: bool,
    usage: Option<UsageReader>,
    /// The stream is answered for good (an ImmediateResponse was sent).
    pub done: bool,
    seen: u64,
    responding: bool,
    /// A failure in the response phase: the rest of the stream passes unchanged.
    failed: bool,
    /// The protocol's hints (subset, objective, fairness id) read so far.
    hints: Hints,
    /// The served endpoint was read from the response's metadata.
    served: bool,
    /// The request's `:path`, kept when a pool's split requests are sent by
    /// routecore (`serve::pd_send`): the prefill goes to the same API.
    path: Option<Vec<u8>>,
    /// The stream of an observing filter (Envoy's `observability_mode`):
    /// `lease` is the one named by the request id in its messages'
    /// `routecore` metadata, which this stream ends (at the response's end,
    /// with its usage; at its own, without).
    observer: bool,
    /// Envoy sends this stream no response body (`response_body_mode:
    /// NONE`): an observing filter reads the response, and this stream's end
    /// hands the lease over to it ([`Shared::hand_over`]).
    response_elsewhere: bool,
}

impl Conversation {
    pub fn new(engine: Arc<Engine>, shared: Arc<Shared>) -> Self {
        Self {
            door: Door::new(Arc::clone(&engine), Arc::clone(&shared)),
            body: Buffer::new(&shared.overload),
            engine,
            shared,
            request_mode: BUFFERED,
            response_mode: BodySendMode::None as i32,
            defer_headers: false,
            unanswered_chunks: 0,
            lease: None,
            routed: false,
            usage: None,
            done: false,
            seen: 0,
            responding: false,
            failed: false,
            hints: Hints::default(),
            served: false,
            path: None,
            observer: false,
            response_elsewhere: false,
        }
    }

    /// Answers one message. Any failure other than a protocol error is
    /// answered here (see the module doc).
    pub async fn handle(
        &mut self,
        req: &ProcessingRequest,
    ) -> std::result::Result<Vec<ProcessingResponse>, ProtocolError> {
        self.check_order(req.request.as_ref())?;
        if self.failed {
            return Ok(if self.observer {
                Vec::new()
            } else {
                self.passthrough(req.request.as_ref())
            });
        }
        let handled = AssertUnwindSafe(self.dispatch(req)).catch_unwind().await;
        let out = match handled {
            Ok(Ok(out)) => out,
            Ok(Err(e)) => self.fail(req.request.as_ref(), &e.to_string()),
            Err(_) => self.fail(req.request.as_ref(), "panic"),
        };
        // An observing filter reads no answer.
        Ok(if self.observer { Vec::new() } else { out })
    }

    fn check_order(&mut self, msg: Option<&Msg>) -> std::result::Result<(), ProtocolError> {
        self.seen += 1;
        match msg {
            Some(Msg::RequestHeaders(_)) if self.seen > 1 => Err(ProtocolError(
                "request_headers after other messages of the stream".into(),
            )),
            Some(Msg::ResponseHeaders(_)) if self.responding => {
                Err(ProtocolError("response_headers sent twice".into()))
            }
            Some(Msg::ResponseHeaders(_) | Msg::ResponseBody(_) | Msg::ResponseTrailers(_)) => {
                self.responding = true;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    async fn dispatch(&mut self, req: &ProcessingRequest) -> Result<Vec<ProcessingResponse>> {
        if req.observability_mode {
            return self.observe(req);
        }
        if self.hints.subset.is_none() {
            self.hints.subset = subset_hint(req);
        }
        if let Some(pc) = &req.protocol_config {
            self.request_mode = if pc.request_body_mode == 0 {
                BUFFERED
            } else {
                pc.request_body_mode
            };
            self.response_mode = pc.response_body_mode;
            self.response_elsewhere = pc.response_body_mode == BodySendMode::None as i32;
            self.defer_headers = self.request_mode == FULL_DUPLEX
                || (self.request_mode == STREAMED
                    && pc.send_body_without_waiting_for_header_response);
        }
        if self.responding && !self.served {
            self.read_served(req);
        }
        match req.request.as_ref() {
            Some(Msg::RequestHeaders(h)) => self.on_request_headers(h).await,
            Some(Msg::RequestBody(b)) => self.on_request_body(&b.body, b.end_of_stream).await,
            Some(Msg::RequestTrailers(_)) => {
                // The body ended without end_of_stream.
                let mut out = if self.routed {
                    Vec::new()
                } else {
                    self.on_request_body(&[], true).await?
                };
                if !self.done {
                    out.push(answer(Answer::RequestTrailers(TrailersResponse::default())));
                }
                Ok(out)
            }
            Some(Msg::ResponseHeaders(h)) => self.on_response_headers(h),
            Some(Msg::ResponseBody(b)) => self.on_response_body(&b.body, b.end_of_stream),
            Some(Msg::ResponseTrailers(_)) => {
                self.finish();
                Ok(vec![answer(Answer::ResponseTrailers(
                    TrailersResponse::default(),
                ))])
            }
            None => Ok(Vec::new()),
        }
    }

    /// A message of an observing filter: Envoy sent it without waiting and
    /// reads no answer, so none is sent. The first one (the request's
    /// headers, sent once routecore's answer let the request go on) names
    /// the lease, which this stream then owns (a stream naming none in
    /// flight ends there); the response is read as on a routing stream, and
    /// its end releases the lease with its usage and ends this stream.
    fn observe(&mut self, req: &ProcessingRequest) -> Result<Vec<ProcessingResponse>> {
        if !self.observer {
            self.observer = true;
            self.routed = true; // nothing to route on this stream
            let shared = &self.shared;
            self.lease = observed_request_id(req)
                .and_then(|id| shared.parse_id(id))
                .filter(|&id| shared.observe(id));
        }
        if self.responding && !self.served {
            self.read_served(req);
        }
        match req.request.as_ref() {
            Some(Msg::ResponseHeaders(h)) => {
                self.on_response_headers(h)?;
            }
            Some(Msg::ResponseBody(b)) => {
                self.on_response_body(&b.body, b.end_of_stream)?;
            }
            Some(Msg::ResponseTrailers(_)) => self.finish(),
            _ => {}
        }
        self.done = self.lease.is_none();
        Ok(Vec::new())
    }

    /// The first response message naming the endpoint that served moves the
    /// lease's accounting there when Envoy retried it elsewhere.
    fn read_served(&mut self, req: &ProcessingRequest) {
        let (Some(id), Some(endpoint)) = (self.lease, served_endpoint(req)) else {
            return;
        };
        self.served = true;
        if self.shared.served(id, endpoint) {
            tracing::debug!(
                request_id = self.shared.request_id(id),
                endpoint,
                "served-by-fallback"
            );
        }
    }

    /// An unexpected failure: release, then refuse (request phase) or pass (response).
    fn fail(&mut self, msg: Option<&Msg>, error: &str) -> Vec<ProcessingResponse> {
        self.door.fail(error);
        self.close();
        if self.responding {
            self.failed = true;
            return self.passthrough(msg);
        }
        self.done = true;
        vec![immediate(&self.door.internal_error())]
    }

    /// The answer that lets `msg` pass unchanged.
    fn passthrough(&self, msg: Option<&Msg>) -> Vec<ProcessingResponse> {
        match msg {
            Some(Msg::RequestBody(b)) => self.pass_body(&b.body, b.end_of_stream, true),
            Some(Msg::ResponseBody(b)) => self.pass_body(&b.body, b.end_of_stream, false),
            Some(Msg::RequestHeaders(_)) => {
                vec![answer(Answer::RequestHeaders(HeadersResponse::default()))]
            }
            Some(Msg::ResponseHeaders(_)) => {
                vec![answer(Answer::ResponseHeaders(HeadersResponse::default()))]
            }
            Some(Msg::RequestTrailers(_)) => {
                vec![answer(Answer::RequestTrailers(TrailersResponse::default()))]
            }
            Some(Msg::ResponseTrailers(_)) => {
                vec![answer(
                    Answer::ResponseTrailers(TrailersResponse::default()),
                )]
            }
            None => Vec::new(),
        }
    }

    async fn on_request_headers(
        &mut self,
        headers: &HttpHeaders,
    ) -> Result<Vec<ProcessingResponse>> {
        self.shared.fault("request_headers")?;
        let text = |name: &str| {
            find_header(headers, name.as_bytes())
                .map(|v| String::from_utf8_lossy(v).trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let first = |names: [&str; 2]| names.into_iter().find_map(text);
        self.hints.objective = first(OBJECTIVE_HEADERS);
        self.hints.fairness_id = first(FAIRNESS_HEADERS);
        if self.engine.handoffs.iter().any(|h| h.handoff.sends()) {
            self.path = find_header(headers, b":path").map(<[u8]>::to_vec);
        }
        let key = find_header(headers, &self.engine.key_header);
        if let Err(rej) = self.door.authenticate(key) {
            return Ok(self.refuse(rej));
        }
        if headers.end_of_stream {
            // No body to route on: the default pool.
            self.routed = true;
            let outcome = self.door.route(Routing::Default, &self.hints).await;
            return Ok(self.answer(outcome, false));
        }
        if self.defer_headers {
            return Ok(Vec::new());
        }
        Ok(vec![answer(Answer::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(self.mutation(Vec::new())),
                ..Default::default()
            }),
        }))])
    }

    /// A mutation of the request's headers: `set` (without what the
    /// configuration strips), and the key header and `server.strip_headers`
    /// removed, and [`PREFILLER_HEADER`] unless `set` sets it.
    fn mutation(&self, mut set: Vec<HeaderValueOption>) -> HeaderMutation {
        let strip = &self.engine.strip_headers;
        set.retain(|h| h.header.as_ref().is_none_or(|h| !strip.contains(&h.key)));
        let mut remove_headers = strip.clone();
        let sets = |key: &str| {
            set.iter()
                .any(|h| h.header.as_ref().is_some_and(|h| h.key == key))
        };
        if !sets(PREFILLER_HEADER) {
            remove_headers.push(PREFILLER_HEADER.into());
        }
        HeaderMutation {
            set_headers: set,
            remove_headers,
        }
    }

    /// Whether the request is still to be routed (its headers and body are
    /// awaited, within `limits.body_timeout_s`).
    pub fn awaits_routing(&self) -> bool {
        !self.routed && !self.done
    }

    /// The request was not routed within `limits.body_timeout_s`: 408, and
    /// what its body held is freed.
    pub fn time_out(&mut self) -> Vec<ProcessingResponse> {
        self.shared.overload.reached(BODY_TIMEOUT);
        let secs = self.engine.spec.limits.body_timeout_s;
        let message = format!("the request was not received within {secs} s");
        let rej = self
            .engine
            .refuse(self.door.tenant(), 408, "body-timeout", message, 0.0);
        self.body.release();
        self.refuse(rej)
    }

    /// The data plane's buffers cannot hold this request
    /// (`limits.max_buffered_bytes`): 503, retry; what its body held is freed.
    pub fn buffers_full(&mut self) -> Vec<ProcessingResponse> {
        let message = "too many requests are being received; retry";
        let rej = self
            .engine
            .refuse(self.door.tenant(), 503, "buffers-full", message, 1.0);
        self.body.release();
        self.refuse(rej)
    }

    /// The answers carrying copies of the body are sent: its budget is given back.
    pub fn settle(&mut self) {
        self.body.settle();
    }

    async fn on_request_body(
        &mut self,
        chunk: &[u8],
        end: bool,
    ) -> Result<Vec<ProcessingResponse>> {
        if self.routed {
            // Chunks after routing pass through (duplex: echoed back).
            return Ok(self.pass_body(chunk, end, true));
        }
        // (When Envoy skipped the headers, the door checks a request without a key.)
        if let Err(rej) = self.door.check_body(self.body.len() + chunk.len()) {
            return Ok(self.refuse(rej));
        }
        if !self.body.extend(chunk, self.limit()) {
            return Ok(self.buffers_full());
        }
        if end || (self.request_mode != STREAMED && self.request_mode != FULL_DUPLEX) {
            return Ok(self.route_now().await);
        }
        if self.request_mode == STREAMED && !self.defer_headers {
            return Ok(vec![answer(Answer::RequestBody(BodyResponse::default()))]);
        }
        if self.request_mode == STREAMED {
            self.unanswered_chunks += 1;
        }
        Ok(Vec::new())
    }

    async fn route_now(&mut self) -> Vec<ProcessingResponse> {
        self.routed = true;
        let mut outcome = self
            .door
            .route(Routing::Body(self.body.data()), &self.hints)
            .await;
        if let Ok(routed) = &mut outcome {
            self.hand_off(routed).await;
        }
        self.answer(outcome, true)
    }

    /// A split request of a pool whose handoff is `vllm` or `sglang`:
    /// routecore sends its prefill (`serve::pd_send`).
    async fn hand_off(&mut self, routed: &mut Routed) {
        if routed.prefill_endpoint.is_none() {
            return; // not split: nothing to look up
        }
        let engine = Arc::clone(&self.engine);
        let pool = engine.spec.pools.iter().position(|p| p.name == routed.pool);
        let Some(h) = pool.and_then(|i| engine.handoffs.get(i)) else {
            return;
        };
        if !h.handoff.sends() {
            return;
        }
        // A stream dropped while the prefill is out releases the lease.
        self.lease = Some(routed.id);
        let path = pd_send::request_path(self.path.as_deref());
        let max = usize::try_from(engine.spec.limits.max_body_bytes).unwrap_or(usize::MAX);
        let wait = self.hints.on_wait.as_ref();
        pd_send::hand_off(&self.shared, h, routed, self.body.data(), path, max, wait).await;
    }

    fn answer(&mut self, outcome: Outcome, has_body: bool) -> Vec<ProcessingResponse> {
        let routed: Routed = match outcome {
            Err(rej) => return self.refuse(rej),
            Ok(r) => r,
        };
        self.lease = Some(routed.id);
        tracing::debug!(
            request_id = routed.request_id.as_str(),
            tenant = self.engine.tenant_name(self.door.tenant()),
            pool = routed.pool.as_str(),
            endpoint = routed.endpoint.as_str(),
            reason = routed.reason,
            "routed"
        );
        let destination = std::iter::once(&routed.endpoint)
            .chain(&routed.fallbacks)
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(",");
        let mut set_headers = vec![
            header(DESTINATION_HEADER, destination.as_bytes()),
            header(POOL_HEADER, routed.pool.as_bytes()),
        ];
        if let Some(p) = &routed.prefill_endpoint {
            set_headers.push(header(PREFILLER_HEADER, p.as_bytes()));
        }
        if let Some(b) = &routed.body {
            set_headers.push(header("content-length", b.len().to_string().as_bytes()));
        }
        let mut common = CommonResponse {
            header_mutation: Some(self.mutation(set_headers)),
            clear_route_cache: true,
            ..Default::default()
        };
        let id = self.response_elsewhere.then(|| routed.request_id.clone());
        let md = Some(lb_metadata(destination.clone(), id));
        if !has_body {
            let mut r = answer(Answer::RequestHeaders(HeadersResponse {
                response: Some(common),
            }));
            r.dynamic_metadata = md;
            return vec![r];
        }
        // Copies of the body go out in the answers: its budget is held until
        // they are sent (`settle`).
        let original = self.body.free();
        if self.request_mode == FULL_DUPLEX {
            let body = routed.body.as_deref().unwrap_or(&original);
            let mut first = answer(Answer::RequestHeaders(HeadersResponse {
                response: Some(common),
            }));
            first.dynamic_metadata = md;
            let mut out = vec![first];
            if body.is_empty() {
                out.push(streamed(&[], true, true));
            }
            let n = body.len().div_ceil(BODY_CHUNK);
            for (i, chunk) in body.chunks(BODY_CHUNK).enumerate() {
                out.push(streamed(chunk, i + 1 == n, true));
            }
            return out;
        }
        if self.defer_headers {
            // STREAMED, the headers held: their answer routes, then one answer
            // per chunk received (this last one included). The body passes
            // as it came, or the first chunk carries the compressed body and
            // the others are cleared.
            let mut first = answer(Answer::RequestHeaders(HeadersResponse {
                response: Some(common),
            }));
            first.dynamic_metadata = md;
            let chunks = std::mem::take(&mut self.unanswered_chunks) + 1;
            let compressed = routed.body.is_some();
            let mut rewritten = routed.body;
            let mut out = vec![first];
            for _ in 0..chunks {
                let mutation = match rewritten.take() {
                    Some(b) => Some(Mutation::Body(b)),
                    None => compressed.then_some(Mutation::ClearBody(true)),
                };
                out.push(answer(Answer::RequestBody(BodyResponse {
                    response: Some(CommonResponse {
                        body_mutation: mutation.map(|m| BodyMutation { mutation: Some(m) }),
                        ..Default::default()
                    }),
                })));
            }
            return out;
        }
        if let Some(b) = routed.body {
            common.body_mutation = Some(BodyMutation {
                mutation: Some(Mutation::Body(b)),
            });
        }
        let mut r = answer(Answer::RequestBody(BodyResponse {
            response: Some(common),
        }));
        r.dynamic_metadata = md;
        vec![r]
    }

    /// Answers a refusal (counted and logged by `Engine::refuse`).
    fn refuse(&mut self, rej: Reject) -> Vec<ProcessingResponse> {
        self.done = true;
        vec![immediate(&rej)]
    }

    fn pass_body(&self, chunk: &[u8], end: bool, request: bool) -> Vec<ProcessingResponse> {
        let mode = if request {
            self.request_mode
        } else {
            self.response_mode
        };
        if mode == FULL_DUPLEX {
            return vec![streamed(chunk, end, request)];
        }
        vec![answer(if request {
            Answer::RequestBody(BodyResponse::default())
        } else {
            Answer::ResponseBody(BodyResponse::default())
        })]
    }

    fn on_response_headers(&mut self, headers: &HttpHeaders) -> Result<Vec<ProcessingResponse>> {
        self.shared.fault("response_headers")?;
        let sse = find_header(headers, b"content-type")
            .is_some_and(|v| v.windows(17).any(|w| w == b"text/event-stream"));
        self.usage = Some(UsageReader::new(sse, self.limit(), &self.shared.overload));
        if headers.end_of_stream {
            self.finish();
        }
        Ok(vec![answer(Answer::ResponseHeaders(
            HeadersResponse::default(),
        ))])
    }

    fn limit(&self) -> usize {
        usize::try_from(self.engine.spec.limits.max_body_bytes).unwrap_or(usize::MAX)
    }

    fn on_response_body(&mut self, chunk: &[u8], end: bool) -> Result<Vec<ProcessingResponse>> {
        self.shared.fault("response_body")?;
        let limit = self.limit();
        let overload = &self.shared.overload;
        self.usage
            .get_or_insert_with(|| UsageReader::new(looks_like_sse(chunk), limit, overload))
            .feed(chunk, end);
        if end {
            self.finish();
        }
        Ok(self.pass_body(chunk, end, false))
    }

    /// Releases the lease, learning from the usage if the response carried it.
    fn finish(&mut self) {
        if let Some(id) = self.lease.take() {
            let usage = self.usage.as_ref().and_then(UsageReader::usage);
            self.shared.release(id, usage);
        }
    }

    /// The stream ended: a request still in flight is released without
    /// usage, or handed over to the observing filter that reads its response.
    pub fn close(&mut self) {
        if let Some(id) = self.lease.take() {
            if self.response_elsewhere && !self.observer {
                self.shared.hand_over(id, OBSERVER_GRACE);
            } else {
                self.shared.release(id, None);
            }
        }
    }
}

impl Drop for Conversation {
    fn drop(&mut self) {
        self.close();
    }
}

/// The current engine, swapped atomically on reload.
pub type Current = Arc<RwLock<Arc<Engine>>>;

pub fn current(c: &Current) -> Arc<Engine> {
    Arc::clone(&c.read().unwrap_or_else(|e| e.into_inner()))
}

pub struct Processor {
    pub current: Current,
    pub shared: Arc<Shared>,
    /// Turns true when the drain's grace has run out: open streams end.
    pub closing: watch::Receiver<bool>,
}

struct StreamState {
    conv: Conversation,
    inbound: Streaming<ProcessingRequest>,
    pending: VecDeque<ProcessingResponse>,
    ended: bool,
    closing: watch::Receiver<bool>,
    /// `limits.body_timeout_s` after the stream opened: the request must be
    /// routed by then.
    deadline: tokio::time::Instant,
    /// Counts the stream on its connection while it is open.
    _slot: Option<StreamSlot>,
}

type ResponseStream =
    Pin<Box<dyn Stream<Item = std::result::Result<ProcessingResponse, Status>> + Send>>;

/// The next answer of a stream. The state is boxed and so is the (large)
/// future of `handle`, so that the future made for each answer stays small:
/// `unfold` moves it into place once per answer.
async fn next(
    mut st: Box<StreamState>,
) -> Option<(
    std::result::Result<ProcessingResponse, Status>,
    Box<StreamState>,
)> {
    loop {
        if let Some(r) = st.pending.pop_front() {
            return Some((Ok(r), st));
        }
        if st.ended || st.conv.done {
            return None;
        }
        st.conv.settle();
        // The end of the client's stream, a client error or a cancel ends the
        // stream (with the error's status); dropping the state releases. So
        // does the end of the drain's grace: UNAVAILABLE, retry elsewhere; and
        // a request not routed by its deadline: 408.
        let routing = st.conv.awaits_routing();
        let message = tokio::select! {
            biased;
            m = st.inbound.message() => Some(m),
            _ = st.closing.wait_for(|closing| *closing) => None,
            () = tokio::time::sleep_until(st.deadline), if routing => {
                let out = st.conv.time_out();
                st.pending.extend(out);
                continue;
            }
        };
        let Some(message) = message else {
            st.ended = true;
            return Some((Err(Status::unavailable("routecore is shutting down")), st));
        };
        let msg = match message {
            Ok(Some(msg)) => msg,
            Ok(None) => return None,
            // The buffer budget cannot hold what the stream sends
            // (`limits::Received`): a request still to be routed is refused.
            Err(status) if status.message() == BUFFERS_FULL && st.conv.awaits_routing() => {
                st.ended = true;
                let out = st.conv.buffers_full();
                st.pending.extend(out);
                continue;
            }
            Err(status) => {
                st.ended = true;
                // tonic reports a message over the size limit as OUT_OF_RANGE;
                // gRPC's code for it is RESOURCE_EXHAUSTED.
                let status = if status.code() == tonic::Code::OutOfRange {
                    Status::resource_exhausted(status.message().to_string())
                } else {
                    status
                };
                return Some((Err(status), st));
            }
        };
        match Box::pin(st.conv.handle(&msg)).await {
            Ok(out) => st.pending.extend(out),
            Err(ProtocolError(e)) => {
                st.conv.close();
                st.conv.shared.metrics.protocol_errors.inc();
                tracing::warn!(error = e.as_str(), "protocol-error");
                st.ended = true;
                return Some((Err(Status::failed_precondition(e)), st));
            }
        }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> std::result::Result<Response<Self::ProcessStream>, Status> {
        let engine = current(&self.current);
        let limits = &engine.spec.limits;
        // The connection's streams (none known: a connection not accepted by
        // the data plane's listener, e.g. in a test).
        let slot = match request.extensions().get::<StreamCount>() {
            Some(streams) => {
                let max = usize::try_from(limits.max_streams_per_connection).unwrap_or(usize::MAX);
                let Some(slot) = streams.open(max) else {
                    self.shared.overload.reached(MAX_STREAMS_PER_CONNECTION);
                    return Err(Status::resource_exhausted(format!(
                        "more than {max} streams open on this connection"
                    )));
                };
                Some(slot)
            }
            None => None,
        };
        let deadline = tokio::time::Instant::now()
            + std::time::Duration::from_secs_f64(limits.body_timeout_s.min(1e9));
        let mut conv = Conversation::new(Arc::clone(&engine), Arc::clone(&self.shared));
        // With flow control, a request that waits in a queue tells Envoy to
        // extend its message timeout (`max_message_timeout` bounds it): an
        // answer of its own beside the conversation's, ended with it.
        // So does a split request whose prefill routecore sends and awaits.
        let awaits_prefill = engine.handoffs.iter().any(|h| h.handoff == Handoff::Vllm);
        let waits = (engine.flow(0).is_some() || awaits_prefill).then(|| {
            let (notice, waits) = tokio::sync::mpsc::unbounded_channel();
            conv.hints.on_wait = Some(WaitNotice(notice));
            tokio_stream::wrappers::UnboundedReceiverStream::new(waits)
        });
        let state = Box::new(StreamState {
            conv,
            inbound: request.into_inner(),
            pending: VecDeque::new(),
            ended: false,
            closing: self.closing.clone(),
            deadline,
            _slot: slot,
        });
        let answers = futures_util::stream::unfold(state, next);
        Ok(Response::new(match waits {
            Some(waits) => Box::pin(futures_util::stream::select(
                answers,
                waits.map(|wait| Ok(extend_timeout(wait))),
            )),
            None => Box::pin(answers),
        }))
    }
}

#[cfg(test)]
mod pd_tests;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::serve::config::testing::{plane_json, tenant};
    use crate::serve::config::Spec;
    use crate::serve::engine::test_plane;
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, ProtocolConfiguration};

    const KEY: &[u8] = "demo-kéy".as_bytes();

    pub(crate) fn spec() -> Spec {
        let mut json = plane_json(
            "least-request",
            serde_json::json!([
                {"name": "short", "max_context": 8192, "budget": null, "queue_limit": null,
                 "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]},
                {"name": "long", "max_context": 65536, "budget": null, "queue_limit": null,
                 "endpoints": ["10.0.0.3:8000"]}
            ]),
        );
        json["tenants"] = serde_json::json!([tenant("demo", KEY, None)]);
        Spec::from_json(&json.to_string()).expect("spec")
    }

    fn plane() -> (Arc<Shared>, Arc<Engine>) {
        test_plane(spec())
    }

    pub(crate) fn headers(pairs: &[(&str, &[u8])], raw: bool, end: bool) -> ProcessingRequest {
        let headers = pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                raw_value: if raw { v.to_vec() } else { Vec::new() },
                value: if raw {
                    String::new()
                } else {
                    String::from_utf8_lossy(v).into()
                },
            })
            .collect();
        ProcessingRequest {
            request: Some(Msg::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers }),
                end_of_stream: end,
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    pub(crate) fn body(b: &[u8], end: bool, response: bool) -> ProcessingRequest {
        let b = HttpBody {
            body: b.to_vec(),
            end_of_stream: end,
            ..Default::default()
        };
        ProcessingRequest {
            request: Some(if response {
                Msg::ResponseBody(b)
            } else {
                Msg::RequestBody(b)
            }),
            ..Default::default()
        }
    }

    pub(crate) fn chat(text: &str) -> Vec<u8> {
        serde_json::json!({"messages": [{"role": "user", "content": text}], "max_tokens": 10})
            .to_string()
            .into_bytes()
    }

    fn routed_to(r: &ProcessingResponse) -> Option<String> {
        let common = match r.response.as_ref()? {
            Answer::RequestBody(b) => b.response.as_ref()?,
            Answer::RequestHeaders(h) => h.response.as_ref()?,
            _ => return None,
        };
        let h = common
            .header_mutation
            .as_ref()?
            .set_headers
            .iter()
            .find(|h| {
                h.header
                    .as_ref()
                    .is_some_and(|h| h.key == DESTINATION_HEADER)
            })?;
        String::from_utf8(h.header.as_ref()?.raw_value.clone()).ok()
    }

    fn status(r: &ProcessingResponse) -> Option<i32> {
        match r.response.as_ref()? {
            Answer::ImmediateResponse(i) => i.status.as_ref().map(|s| s.code),
            _ => None,
        }
    }

    #[tokio::test]
    async fn buffered_conversation_routes_learns_and_releases_once() {
        let (shared, engine) = plane();
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        let out = c
            .handle(&headers(&[("x-api-key", KEY)], true, false))
            .await
            .expect("ok");
        assert!(matches!(out[0].response, Some(Answer::RequestHeaders(_))));
        let text = "hello world ".repeat(50);
        let out = c
            .handle(&body(&chat(&text), true, false))
            .await
            .expect("ok");
        assert_eq!(
            routed_to(&out[0]).as_deref(),
            Some("10.0.0.1:8000,10.0.0.2:8000")
        );
        assert_eq!(shared.lease_count(), 1);
        let usage = br#"{"usage":{"prompt_tokens":120,"completion_tokens":2}}"#;
        c.handle(&body(usage, true, true)).await.expect("ok");
        assert_eq!(shared.lease_count(), 0);
        assert_eq!(engine.router().in_flight(0).expect("pool"), 0);
        assert_eq!(
            shared.calibrator.read().expect("cal").stats("prose").count,
            1
        );
        drop(c); // released already: nothing more to release
        assert_eq!(engine.choosers[0].loads(), vec![0, 0]);
    }

    #[tokio::test]
    async fn key_in_value_or_raw_value_is_the_same_key() {
        let (shared, engine) = plane();
        for raw in [true, false] {
            let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
            let out = c
                .handle(&headers(&[("X-Api-Key", KEY)], raw, true))
                .await
                .expect("ok");
            assert_eq!(
                routed_to(&out[0]).as_deref(),
                Some("10.0.0.1:8000,10.0.0.2:8000"),
                "raw {raw}"
            );
        }
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        let out = c
            .handle(&headers(&[("x-api-key", b"demo-key")], true, false))
            .await
            .expect("ok");
        assert_eq!(status(&out[0]), Some(401));
        assert!(c.done);
    }

    #[tokio::test]
    async fn dropped_stream_releases_its_lease() {
        let (shared, engine) = plane();
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        c.handle(&headers(&[("x-api-key", KEY)], true, false))
            .await
            .expect("ok");
        c.handle(&body(&chat("hi"), true, false)).await.expect("ok");
        assert_eq!(shared.lease_count(), 1);
        drop(c);
        assert_eq!(shared.lease_count(), 0);
        assert_eq!(engine.router().in_flight(0).expect("pool"), 0);
    }

    #[tokio::test]
    async fn repeated_request_headers_are_a_protocol_error() {
        let (shared, engine) = plane();
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        let h = headers(&[("x-api-key", KEY)], true, true);
        c.handle(&h).await.expect("ok");
        assert!(c.handle(&h).await.is_err());
        c.close();
        assert_eq!(shared.lease_count(), 0);
    }

    #[tokio::test]
    async fn absurd_usage_is_counted_never_learned_and_releases() {
        let (shared, engine) = plane();
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        c.handle(&headers(&[("x-api-key", KEY)], true, false))
            .await
            .expect("ok");
        c.handle(&body(&chat(&"x".repeat(400)), true, false))
            .await
            .expect("ok");
        let usage = br#"{"usage":{"prompt_tokens":2147483648,"completion_tokens":1}}"#;
        let out = c.handle(&body(usage, true, true)).await.expect("ok");
        assert!(matches!(out[0].response, Some(Answer::ResponseBody(_))));
        assert_eq!(shared.lease_count(), 0);
        assert_eq!(shared.metrics.value("absurd_usage", &["short"]), Some(1.0));
        assert_eq!(
            shared.calibrator.read().expect("cal").stats("prose").count,
            0
        );
    }

    #[tokio::test]
    async fn duplex_body_is_answered_with_headers_then_echoed() {
        let (shared, engine) = plane();
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        let mut h = headers(&[("x-api-key", KEY)], true, false);
        h.protocol_config = Some(ProtocolConfiguration {
            request_body_mode: FULL_DUPLEX,
            ..Default::default()
        });
        assert!(c.handle(&h).await.expect("ok").is_empty());
        let b = chat("stream me");
        let (first, rest) = b.split_at(10);
        assert!(c
            .handle(&body(first, false, false))
            .await
            .expect("ok")
            .is_empty());
        let out = c.handle(&body(rest, true, false)).await.expect("ok");
        assert!(routed_to(&out[0]).is_some());
        match out[1].response.as_ref() {
            Some(Answer::RequestBody(r)) => {
                let m = r.response.as_ref().and_then(|c| c.body_mutation.as_ref());
                match m.and_then(|m| m.mutation.as_ref()) {
                    Some(Mutation::StreamedResponse(s)) => {
                        assert_eq!(s.body, b);
                        assert!(s.end_of_stream);
                    }
                    other => panic!("not streamed: {other:?}"),
                }
            }
            other => panic!("not a body: {other:?}"),
        }
    }

    #[tokio::test]
    async fn streamed_body_sent_without_waiting_is_routed_in_the_headers_answer() {
        let (shared, engine) = plane();
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        let mut h = headers(&[("x-api-key", KEY)], true, false);
        h.protocol_config = Some(ProtocolConfiguration {
            request_body_mode: STREAMED,
            send_body_without_waiting_for_header_response: true,
            ..Default::default()
        });
        assert!(c.handle(&h).await.expect("ok").is_empty());
        let b = chat("stream me");
        let (first, rest) = b.split_at(10);
        let (second, last) = rest.split_at(5);
        for chunk in [first, second] {
            let out = c.handle(&body(chunk, false, false)).await.expect("ok");
            assert!(out.is_empty(), "no answer before the headers'");
        }
        let out = c.handle(&body(last, true, false)).await.expect("ok");
        // The headers' answer routes, then one empty answer per chunk: the
        // body passes unchanged (not sent back).
        assert_eq!(out.len(), 4);
        assert!(matches!(out[0].response, Some(Answer::RequestHeaders(_))));
        assert_eq!(
            routed_to(&out[0]).as_deref(),
            Some("10.0.0.1:8000,10.0.0.2:8000")
        );
        assert!(out[0].dynamic_metadata.is_some());
        for r in &out[1..] {
            match r.response.as_ref() {
                Some(Answer::RequestBody(b)) => {
                    assert!(b
                        .response
                        .as_ref()
                        .is_none_or(|c| c.body_mutation.is_none()));
                }
                other => panic!("not a body answer: {other:?}"),
            }
        }
        assert_eq!(shared.lease_count(), 1);
        let usage = br#"{"usage":{"prompt_tokens":120,"completion_tokens":2}}"#;
        c.handle(&body(usage, true, true)).await.expect("ok");
        assert_eq!(shared.lease_count(), 0);
    }

    #[tokio::test]
    async fn sse_usage_is_learned_when_the_response_headers_are_skipped() {
        let (shared, engine) = plane();
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        c.handle(&headers(&[("x-api-key", KEY)], true, false))
            .await
            .expect("ok");
        c.handle(&body(&chat(&"hello ".repeat(80)), true, false))
            .await
            .expect("ok");
        // No response headers (Envoy's response_header_mode: SKIP): the SSE
        // stream is told by its first bytes.
        let events = [
            &b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n"[..],
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":120,\"completion_tokens\":1}}\n\n",
            b"data: [DONE]\n\n",
        ];
        for (i, e) in events.iter().enumerate() {
            c.handle(&body(e, i + 1 == events.len(), true))
                .await
                .expect("ok");
        }
        assert_eq!(shared.lease_count(), 0);
        assert_eq!(
            shared.calibrator.read().expect("cal").stats("prose").count,
            1
        );
    }

    #[tokio::test]
    async fn streamed_body_with_headers_answered_at_once_routes_on_its_last_chunk() {
        let (shared, engine) = plane();
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        let mut h = headers(&[("x-api-key", KEY)], true, false);
        h.protocol_config = Some(ProtocolConfiguration {
            request_body_mode: STREAMED,
            ..Default::default()
        });
        let out = c.handle(&h).await.expect("ok");
        assert!(matches!(out[0].response, Some(Answer::RequestHeaders(_))));
        assert!(routed_to(&out[0]).is_none());
        let b = chat("stream me");
        let (first, rest) = b.split_at(10);
        let out = c.handle(&body(first, false, false)).await.expect("ok");
        assert!(matches!(
            out[..],
            [ProcessingResponse {
                response: Some(Answer::RequestBody(_)),
                ..
            }]
        ));
        let out = c.handle(&body(rest, true, false)).await.expect("ok");
        assert_eq!(out.len(), 1);
        assert!(routed_to(&out[0]).is_some());
    }

    #[tokio::test]
    async fn oversize_body_is_413_and_injected_failures_never_leak() {
        let (shared, engine) = plane();
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        c.handle(&headers(&[("x-api-key", KEY)], true, false))
            .await
            .expect("ok");
        let out = c
            .handle(&body(&vec![b'x'; 20000], true, false))
            .await
            .expect("ok");
        assert_eq!(status(&out[0]), Some(413));
        for phase in ["routing", "response_headers", "response_body"] {
            shared.inject_fault(phase).expect("phase");
            let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
            c.handle(&headers(&[("x-api-key", KEY)], true, false))
                .await
                .expect("ok");
            c.handle(&body(&chat("hi"), true, false)).await.expect("ok");
            drop(c);
            assert_eq!(shared.lease_count(), 0, "{phase}");
            assert_eq!(engine.router().in_flight(0).expect("pool"), 0, "{phase}");
        }
    }

    fn with_subset(mut req: ProcessingRequest, subset: &[&str]) -> ProcessingRequest {
        use envoy_types::pb::envoy::config::core::v3::Metadata;
        use envoy_types::pb::google::protobuf::ListValue;
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: subset
                    .iter()
                    .map(|s| Value {
                        kind: Some(Kind::StringValue((*s).into())),
                    })
                    .collect(),
            })),
        };
        let hint = Struct {
            fields: [(SUBSET_KEY.to_string(), list)].into(),
        };
        req.metadata_context = Some(Metadata {
            filter_metadata: [(SUBSET_NAMESPACE.to_string(), hint)].into(),
            ..Default::default()
        });
        req
    }

    fn lb_field(r: &ProcessingResponse, key: &str) -> Option<String> {
        let md = r.dynamic_metadata.as_ref()?.fields.get(LB_NAMESPACE)?;
        let Some(Kind::StructValue(inner)) = md.kind.as_ref() else {
            return None;
        };
        match inner.fields.get(key)?.kind.as_ref()? {
            Kind::StringValue(s) => Some(s.clone()),
            _ => None,
        }
    }

    #[tokio::test]
    async fn subset_hint_restricts_the_choice_and_one_naming_no_endpoint_is_503() {
        let (shared, engine) = plane();
        for _ in 0..3 {
            let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
            let h = with_subset(
                headers(&[("x-api-key", KEY)], true, false),
                &["10.0.0.2:8000"],
            );
            c.handle(&h).await.expect("ok");
            let out = c.handle(&body(&chat("hi"), true, false)).await.expect("ok");
            // The hint allows one endpoint: no fallback to offer.
            assert_eq!(routed_to(&out[0]).as_deref(), Some("10.0.0.2:8000"));
            assert_eq!(
                lb_field(&out[0], DESTINATION_HEADER).as_deref(),
                Some("10.0.0.2:8000")
            );
        }
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        let h = with_subset(
            headers(&[("x-api-key", KEY)], true, false),
            &["10.9.9.9:80"],
        );
        c.handle(&h).await.expect("ok");
        let out = c.handle(&body(&chat("hi"), true, false)).await.expect("ok");
        assert_eq!(status(&out[0]), Some(503));
        drop(c);
        assert_eq!(engine.router().in_flight(0).expect("pool"), 0);
        assert_eq!(engine.choosers[0].loads(), vec![0, 0]);
    }

    #[tokio::test]
    async fn answer_names_the_chosen_endpoint_then_its_fallbacks() {
        let (shared, engine) = plane();
        let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        c.handle(&headers(&[("x-api-key", KEY)], true, false))
            .await
            .expect("ok");
        let out = c.handle(&body(&chat("hi"), true, false)).await.expect("ok");
        // One ordered list, the same in the header and the metadata (GIE v1.0).
        let listed = routed_to(&out[0]).expect("routed");
        assert_eq!(lb_field(&out[0], DESTINATION_HEADER), Some(listed.clone()));
        let (chosen, other) = listed.split_once(',').expect("a fallback");
        let loads = engine.choosers[0].loads();
        let i = usize::from(chosen == "10.0.0.2:8000");
        assert_eq!((loads[i], loads[1 - i]), (1, 0), "the first one is chosen");
        assert_eq!(
            [chosen, other]
                .iter()
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            2
        );
        let md = out[0].dynamic_metadata.as_ref().expect("metadata");
        let Some(Kind::StructValue(lb)) = md.fields[LB_NAMESPACE].kind.as_ref() else {
            panic!("no envoy.lb")
        };
        assert_eq!(
            lb.fields.len(),
            1,
            "no other key (v0.3's -fallback is gone)"
        );
        // The response comes back on this stream: no request id for an observer.
        assert_eq!(md.fields.len(), 1);
    }

    /// The header mutation of a request's answer.
    fn mutation_of(r: &ProcessingResponse) -> HeaderMutation {
        let common = match r.response.as_ref() {
            Some(Answer::RequestBody(b)) => b.response.clone(),
            Some(Answer::RequestHeaders(h)) => h.response.clone(),
            _ => None,
        };
        common
            .and_then(|c| c.header_mutation)
            .expect("a header mutation")
    }

    #[tokio::test]
    async fn a_split_request_names_its_prefill_endpoint_and_a_clients_header_is_removed() {
        let sent: &[u8] = b"10.6.6.6:1";
        for split in [false, true] {
            let mut spec = spec();
            if split {
                spec.pools[0].roles = [("10.0.0.2:8000".to_string(), crate::pd::Role::Prefill)]
                    .into_iter()
                    .collect();
            }
            let (shared, engine) = test_plane(spec);
            let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
            let pairs = [("x-api-key", KEY), (PREFILLER_HEADER, sent)];
            let first = c.handle(&headers(&pairs, true, false)).await.expect("ok");
            let out = c.handle(&body(&chat("hi"), true, false)).await.expect("ok");
            let m = mutation_of(&out[0]);
            let set: Vec<(String, Vec<u8>)> = m
                .set_headers
                .iter()
                .filter_map(|h| h.header.as_ref())
                .filter(|h| h.key == PREFILLER_HEADER)
                .map(|h| (h.key.clone(), h.raw_value.clone()))
                .collect();
            let removed = m.remove_headers.iter().any(|h| h == PREFILLER_HEADER);
            if split {
                assert_eq!(routed_to(&out[0]).as_deref(), Some("10.0.0.1:8000"));
                let want = (PREFILLER_HEADER.to_string(), b"10.0.0.2:8000".to_vec());
                assert_eq!((set, removed), (vec![want], false));
            } else {
                assert_eq!(
                    (set, removed),
                    (vec![], true),
                    "a client's header is removed"
                );
            }
            // The headers' answer already removes the client's header.
            if let Some(r) = first.first() {
                let m = mutation_of(r);
                assert!(m.remove_headers.iter().any(|h| h == PREFILLER_HEADER));
            }
        }
    }

    fn served_by(mut req: ProcessingRequest, endpoint: &str) -> ProcessingRequest {
        use envoy_types::pb::envoy::config::core::v3::Metadata;
        let lb = Struct {
            fields: [(
                SERVED_KEY.to_string(),
                Value {
                    kind: Some(Kind::StringValue(endpoint.into())),
                },
            )]
            .into(),
        };
        req.metadata_context = Some(Metadata {
            filter_metadata: [(LB_NAMESPACE.to_string(), lb)].into(),
            ..Default::default()
        });
        req
    }

    fn response_headers() -> ProcessingRequest {
        ProcessingRequest {
            request: Some(Msg::ResponseHeaders(HttpHeaders::default())),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn the_served_endpoint_gets_the_in_flight_count_prefix_and_usage_once() {
        let mut spec = spec();
        spec.router.policy = "prefix".into();
        let (shared, engine) = test_plane(spec);
        let prompt = "a long shared system prompt ".repeat(40);
        let route = || async {
            let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
            c.handle(&headers(&[("x-api-key", KEY)], true, false))
                .await
                .expect("ok");
            let out = c
                .handle(&body(&chat(&prompt), true, false))
                .await
                .expect("ok");
            let listed = routed_to(&out[0]).expect("routed");
            let (chosen, fallback) = listed.split_once(',').expect("a fallback");
            (c, chosen.to_string(), fallback.to_string())
        };
        let (mut c, chosen, fallback) = route().await;
        let index = |e: &str| usize::from(e == "10.0.0.2:8000");
        let (from, to) = (index(&chosen), index(&fallback));
        assert_eq!(engine.choosers[0].loads()[from], 1);
        // Envoy retried on the fallback: the served endpoint comes with the response.
        c.handle(&served_by(response_headers(), &fallback))
            .await
            .expect("ok");
        let loads = engine.choosers[0].loads();
        assert_eq!((loads[from], loads[to]), (0, 1), "moved to the server");
        // Every later message carries it too: moved once, not again.
        let usage = br#"{"usage":{"prompt_tokens":300,"completion_tokens":2}}"#;
        c.handle(&served_by(body(&usage[..10], false, true), &fallback))
            .await
            .expect("ok");
        assert_eq!(engine.choosers[0].loads()[to], 1);
        c.handle(&served_by(body(&usage[10..], true, true), &chosen))
            .await
            .expect("ok");
        assert_eq!(engine.choosers[0].loads(), vec![0, 0]);
        assert_eq!(shared.lease_count(), 0);
        assert_eq!(
            shared.calibrator.read().expect("cal").stats("prose").count,
            1
        );
        // The prompt is known on the server now: the next one goes there first.
        let (mut c, next, _) = route().await;
        assert_eq!(next, fallback);
        c.close();
        assert_eq!(engine.choosers[0].loads(), vec![0, 0]);
    }

    #[tokio::test]
    async fn a_served_endpoint_outside_the_pool_or_unknown_leaves_the_lease_as_chosen() {
        let (shared, engine) = plane();
        for served in ["10.0.0.3:8000", "10.9.9.9:1", ""] {
            let mut c = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
            c.handle(&headers(&[("x-api-key", KEY)], true, false))
                .await
                .expect("ok");
            c.handle(&body(&chat("hi"), true, false)).await.expect("ok");
            let before = engine.choosers[0].loads();
            c.handle(&served_by(response_headers(), served))
                .await
                .expect("ok");
            assert_eq!(engine.choosers[0].loads(), before, "{served}");
            drop(c);
            assert_eq!(engine.choosers[0].loads(), vec![0, 0], "{served}");
            assert_eq!(engine.choosers[1].loads(), vec![0], "{served}");
        }
    }

    #[tokio::test]
    async fn a_model_no_pool_serves_is_an_openai_404() {
        let mut spec = spec();
        spec.pools[0].models = vec!["m".into()];
        spec.pools[1].adapters = vec!["lora-a".into()];
        let (_shared, engine) = test_plane(spec);
        let ask = |model: &str| {
            serde_json::json!({"model": model, "max_tokens": 10,
                               "messages": [{"role": "user", "content": "hi"}]})
            .to_string()
            .into_bytes()
        };
        let hints = Hints::default();
        let r = engine
            .route_body(&ask("m"), Some(0), &hints)
            .await
            .expect("ok");
        assert_eq!(r.as_ref().map(|r| r.pool.as_str()), Ok("short"));
        // Served by the long pool only: routed there though the budget picks short.
        let r = engine
            .route_body(&ask("lora-a"), Some(0), &hints)
            .await
            .expect("ok");
        assert_eq!(r.as_ref().map(|r| r.pool.as_str()), Ok("long"));
        let r = engine
            .route_body(&ask("gpt-9"), Some(0), &hints)
            .await
            .expect("ok");
        let rej = r.expect_err("refused");
        assert_eq!((rej.status, rej.reason.as_str()), (404, "model-not-found"));
        let Some(Answer::ImmediateResponse(imm)) = immediate(&rej).response else {
            panic!("not immediate")
        };
        let v: serde_json::Value = serde_json::from_slice(&imm.body).expect("json");
        assert_eq!(v["error"]["message"], "The model `gpt-9` does not exist.");
        assert_eq!(engine.router().in_flight(0).expect("pool"), 1);
        assert_eq!(engine.router().in_flight(1).expect("pool"), 1);
    }

    /// A routing stream as examples/envoy.yaml opens it (the request body
    /// STREAMED without waiting, the response not sent): routed on its one
    /// chunk; the request id of its answer's `routecore` metadata.
    async fn routed_without_response(
        engine: &Arc<Engine>,
        shared: &Arc<Shared>,
        text: &str,
    ) -> (Conversation, String, String) {
        let mut c = Conversation::new(Arc::clone(engine), Arc::clone(shared));
        let mut h = headers(&[("x-api-key", KEY)], true, false);
        h.protocol_config = Some(ProtocolConfiguration {
            request_body_mode: STREAMED,
            send_body_without_waiting_for_header_response: true,
            ..Default::default()
        });
        c.handle(&h).await.expect("ok");
        let out = c.handle(&body(&chat(text), true, false)).await.expect("ok");
        let listed = routed_to(&out[0]).expect("routed");
        let md = out[0].dynamic_metadata.as_ref().expect("metadata");
        let Some(Kind::StructValue(ns)) = md.fields[ROUTECORE_NAMESPACE].kind.as_ref() else {
            panic!("no routecore namespace")
        };
        let Some(Kind::StringValue(id)) = ns.fields[REQUEST_ID_KEY].kind.as_ref() else {
            panic!("no request id")
        };
        let chosen = listed.split(',').next().expect("one").to_string();
        (c, id.clone(), chosen)
    }

    /// A message of the observing filter: sent without waiting, with the
    /// request id and the served endpoint forwarded in its metadata.
    fn observed(mut req: ProcessingRequest, id: &str, served: &str) -> ProcessingRequest {
        use envoy_types::pb::envoy::config::core::v3::Metadata;
        let fields = [
            namespace(LB_NAMESPACE, SERVED_KEY, served.into()),
            namespace(ROUTECORE_NAMESPACE, REQUEST_ID_KEY, id.into()),
        ];
        let filter_metadata = fields
            .into_iter()
            .map(|(name, v)| match v.kind {
                Some(Kind::StructValue(s)) => (name, s),
                _ => unreachable!(),
            })
            .collect();
        req.metadata_context = Some(Metadata {
            filter_metadata,
            ..Default::default()
        });
        req.observability_mode = true;
        req
    }

    /// The observing filter's first message: the request's headers, sent
    /// once routecore's answer let the request go on.
    fn observed_headers(id: &str) -> ProcessingRequest {
        observed(
            headers(&[(":path", b"/v1/chat/completions")], true, false),
            id,
            "",
        )
    }

    #[tokio::test]
    async fn an_observer_learns_the_usage_and_releases_once_without_answering() {
        let (shared, engine) = plane();
        let at = |e: &str| usize::from(e == "10.0.0.2:8000");
        for observer_first in [false, true] {
            let (router, id, chosen) =
                routed_without_response(&engine, &shared, &"hello ".repeat(80)).await;
            let other = if at(&chosen) == 0 {
                "10.0.0.2:8000"
            } else {
                "10.0.0.1:8000"
            };
            assert_eq!(engine.choosers[0].loads()[at(&chosen)], 1);
            let mut observer = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
            // Envoy ends the routing stream once it expects nothing more of
            // it, about when the observer's stream opens: either order.
            if observer_first {
                observer.handle(&observed_headers(&id)).await.expect("ok");
                drop(router);
            } else {
                drop(router);
                observer.handle(&observed_headers(&id)).await.expect("ok");
            }
            assert_eq!(shared.lease_count(), 1, "the observer holds it");
            std::thread::sleep(OBSERVER_GRACE);
            assert_eq!(shared.reap(), 0, "named in time: not reaped");
            // SSE, its headers skipped: told by its first bytes; Envoy retried
            // on the other endpoint, which the messages name.
            let events = [
                &b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n"[..],
                b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":120,\"completion_tokens\":1}}\n\n",
                b"data: [DONE]\n\n",
            ];
            for (i, e) in events.iter().enumerate() {
                let end = i + 1 == events.len();
                let out = observer
                    .handle(&observed(body(e, end, true), &id, other))
                    .await
                    .expect("ok");
                assert!(out.is_empty(), "an observer is never answered");
                if !end {
                    assert_eq!(shared.lease_count(), 1);
                    assert_eq!(engine.choosers[0].loads()[at(other)], 1, "moved");
                    assert!(!observer.done);
                }
            }
            assert!(observer.done, "the response ended: the stream ends");
            assert_eq!(shared.lease_count(), 0);
            drop(observer);
            assert_eq!(engine.choosers[0].loads(), vec![0, 0]);
            assert_eq!(engine.router().in_flight(0).expect("pool"), 0);
        }
        let learned = shared.calibrator.read().expect("cal").stats("prose").count;
        assert_eq!(learned, 2, "each usage once");
    }

    #[tokio::test]
    async fn an_observer_s_end_releases_and_an_unnamed_lease_is_reaped_after_the_grace() {
        let (shared, engine) = plane();
        let learned = || shared.calibrator.read().expect("cal").stats("prose").count;
        let usage = br#"{"usage":{"prompt_tokens":120,"completion_tokens":2}}"#;
        // The client went away (or the engine died, or Envoy) before the
        // response's end: the observer's stream ends, and releases.
        let (router, id, chosen) = routed_without_response(&engine, &shared, "cut").await;
        drop(router);
        let mut observer = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        observer.handle(&observed_headers(&id)).await.expect("ok");
        observer
            .handle(&observed(body(&usage[..9], false, true), &id, &chosen))
            .await
            .expect("ok");
        assert_eq!(shared.lease_count(), 1);
        drop(observer);
        assert_eq!(shared.lease_count(), 0);
        assert_eq!(engine.choosers[0].loads(), vec![0, 0]);
        // No observing filter: the lease waits for one during the grace, then
        // the reaper releases it; an observer coming after finds nothing.
        let (router, id, chosen) = routed_without_response(&engine, &shared, "bye").await;
        drop(router);
        assert_eq!(shared.reap(), 0);
        assert_eq!(shared.lease_count(), 1);
        std::thread::sleep(OBSERVER_GRACE);
        assert_eq!(shared.reap(), 1);
        assert_eq!(engine.choosers[0].loads(), vec![0, 0]);
        assert_eq!(engine.router().in_flight(0).expect("pool"), 0);
        let mut late = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
        late.handle(&observed(body(usage, true, true), &id, &chosen))
            .await
            .expect("ok");
        assert!(late.done);
        // An observer naming no request (or not one of routecore's ids) ends at once.
        for md in ["", "not-an-id"] {
            let mut stray = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
            let out = stray
                .handle(&observed(body(usage, false, true), md, &chosen))
                .await
                .expect("ok");
            assert!(out.is_empty() && stray.done);
        }
        assert_eq!(learned(), 0);
        assert_eq!(shared.lease_count(), 0);
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up() {
        let rej = Reject {
            status: 429,
            reason: "concurrency".into(),
            message: "not admitted".into(),
            retry_after_s: 1.2,
        };
        let Some(Answer::ImmediateResponse(imm)) = immediate(&rej).response else {
            panic!("not immediate")
        };
        let retry = imm
            .headers
            .expect("headers")
            .set_headers
            .into_iter()
            .find_map(|h| {
                h.header
                    .filter(|h| h.key == "retry-after")
                    .map(|h| h.raw_value)
            });
        assert_eq!(retry.as_deref(), Some(&b"2"[..]));
        let v: serde_json::Value = serde_json::from_slice(&imm.body).expect("json");
        assert_eq!(v["error"]["type"], "concurrency");
        assert_eq!(v["error"]["code"], 429);
    }
}
