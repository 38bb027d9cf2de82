//! The ext_proc load client: drives conversations as Envoy holds them
//! (BUFFERED mode: request headers, request body, response headers, a
//! response body carrying usage; each message answered before the next) over
//! tonic, and reports throughput, the added latency (what Envoy waits on the
//! processor before the request can go upstream: the headers and body round
//! trips) and, from the server process's own counters in /proc, its CPU time
//! and context switches per conversation.
//!
//! Closed loop: `concurrency` streams, each starting its next conversation
//! when the last ends. Paced: conversation `i` starts at `i / rate` seconds
//! (at most `concurrency` in flight). Bounded by `requests` and, if given,
//! `duration_s`.
//!
//! Every conversation is read to the end of its stream, and every step (the
//! call, each answer, the end) is bounded by `timeout_s`: a server that
//! stalls or goes away ends conversations with a gRPC status (the client's
//! own timeout is DEADLINE_EXCEEDED), never hangs the run. The report counts
//! the streams per gRPC status they ended with and the refusals per HTTP
//! status of their immediate response.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::rpc::Code as RpcCode;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::error::{invalid, Error};

/// What to drive.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSpec {
    /// `HOST:PORT` of the ext_proc server.
    pub target: String,
    /// Conversations to run (at most).
    pub requests: u64,
    /// Streams in flight at once.
    pub concurrency: usize,
    /// Conversations started per second; None: closed loop.
    pub rate: Option<f64>,
    /// Stop starting conversations after this long.
    pub duration_s: Option<f64>,
    /// Size of the request body (a chat request padded to it).
    pub body_bytes: usize,
    pub api_key: String,
    /// The server's process id, for its CPU time and context switches.
    pub server_pid: Option<u32>,
    /// How long the upstream takes: each routed conversation waits this long
    /// before its response headers (as Envoy waits on the engine), holding
    /// its stream open.
    pub response_delay_s: f64,
    /// Bound on each step of a conversation (the call, each answer, the
    /// stream's end), seconds.
    pub timeout_s: f64,
}

impl Default for LoadSpec {
    fn default() -> Self {
        Self {
            target: "127.0.0.1:9002".into(),
            requests: 200,
            concurrency: 8,
            rate: None,
            duration_s: None,
            body_bytes: 1024,
            api_key: "demo-key".into(),
            server_pid: None,
            response_delay_s: 0.0,
            timeout_s: 10.0,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadReport {
    /// Conversations run to their end.
    pub requests: u64,
    /// Conversations answered with an immediate response (401, 429, 503 ...).
    pub refused: u64,
    /// Conversations that failed (a gRPC error, a missing answer, a timeout).
    pub errors: u64,
    /// Conversations per gRPC status their stream ended with (`"OK"`,
    /// `"UNAVAILABLE"`, `"DEADLINE_EXCEEDED"` for the client's timeout ...).
    pub statuses: BTreeMap<String, u64>,
    /// Refused conversations per HTTP status of the immediate response (`"429"`).
    pub refusals: BTreeMap<String, u64>,
    pub seconds: f64,
    pub throughput_per_s: f64,
    /// Added latency, milliseconds, over the conversations that ended
    /// (refused ones included: Envoy waits for a refusal too).
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
    /// The server's CPU time (user + system) per conversation, milliseconds.
    pub server_cpu_ms: Option<f64>,
    /// The server's context switches (voluntary + involuntary) per conversation.
    pub server_context_switches: Option<f64>,
    /// This process's CPU time per conversation (the client's own cost).
    pub client_cpu_ms: Option<f64>,
}

/// Streams one run may hold at once.
pub const MAX_STREAMS: usize = 100_000;
/// The largest request body a run sends (64 MiB).
pub const MAX_BODY_BYTES: usize = 1 << 26;
/// The longest response delay and step timeout, seconds.
pub const MAX_WAIT_S: f64 = 3600.0;

/// USER_HZ: /proc reports CPU time in these ticks per second (fixed by the
/// Linux ABI).
const CLOCK_TICKS_PER_S: f64 = 100.0;

/// CPU seconds (user + system) of process `pid`, from /proc/<pid>/stat.
pub fn cpu_s(pid: u32) -> Option<f64> {
    stat_cpu_s(&format!("/proc/{pid}/stat"))
}

/// CPU seconds (user + system) of a /proc `stat` file.
fn stat_cpu_s(path: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the command name (which may hold spaces) in parentheses:
    // state is field 3, utime and stime fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / CLOCK_TICKS_PER_S)
}

/// Context switches (voluntary + involuntary) of process `pid`'s threads,
/// from /proc/<pid>/task/*/status (the process's own status line counts only
/// its main thread).
pub fn context_switches(pid: u32) -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let Ok(status) = std::fs::read_to_string(task.ok()?.path().join("status")) else {
            continue; // the thread ended meanwhile
        };
        for line in status.lines() {
            if let Some(v) = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                total += v.trim().parse::<u64>().ok()?;
            }
        }
    }
    Some(total)
}

fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}

/// The messages of one conversation, built once and cloned per conversation.
struct Messages {
    request_headers: ProcessingRequest,
    request_body: ProcessingRequest,
    response_headers: ProcessingRequest,
    response_body: ProcessingRequest,
}

fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

/// A chat request of about `bytes` bytes.
pub fn chat_body(bytes: usize) -> Vec<u8> {
    let head = r#"{"model":"m","max_tokens":100,"messages":[{"role":"user","content":""#;
    let tail = r#""}]}"#;
    let pad = bytes.saturating_sub(head.len() + tail.len()).max(1);
    let text: String = "Summarise the following text. "
        .chars()
        .cycle()
        .take(pad)
        .collect();
    format!("{head}{text}{tail}").into_bytes()
}

impl Messages {
    fn new(spec: &LoadSpec) -> Self {
        let headers = |end| HttpHeaders {
            headers: Some(header_map(&[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                (":authority", "routecore-load"),
                ("content-type", "application/json"),
                ("x-api-key", &spec.api_key),
            ])),
            end_of_stream: end,
            ..Default::default()
        };
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":300,"completion_tokens":50}}"#;
        Self {
            request_headers: message(Request::RequestHeaders(headers(false))),
            request_body: message(Request::RequestBody(HttpBody {
                body: chat_body(spec.body_bytes),
                end_of_stream: true,
                ..Default::default()
            })),
            response_headers: message(Request::ResponseHeaders(HttpHeaders {
                headers: Some(header_map(&[
                    (":status", "200"),
                    ("content-type", "application/json"),
                ])),
                ..Default::default()
            })),
            response_body: message(Request::ResponseBody(HttpBody {
                body: usage.to_vec(),
                end_of_stream: true,
                ..Default::default()
            })),
        }
    }
}

/// How one conversation ended.
enum Outcome {
    /// Routed and finished; the added latency.
    Done(Duration),
    /// An immediate response ended it (a refusal): the added latency, the HTTP status.
    Refused(Duration, i32),
    Failed,
}

/// The gRPC status name of `code` (`"OK"`, `"UNAVAILABLE"` ...).
fn code_name(code: tonic::Code) -> &'static str {
    RpcCode::try_from(code as i32).map_or("UNKNOWN", |c| c.as_str_name())
}

/// One step of a conversation that failed: the gRPC status it ended with.
type Step<T> = Result<T, tonic::Code>;

async fn bounded<T>(
    timeout: Duration,
    f: impl std::future::Future<Output = Result<T, tonic::Status>>,
) -> Step<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => r.map_err(|s| s.code()),
        Err(_) => Err(tonic::Code::DeadlineExceeded),
    }
}

/// Runs one conversation; how it ended and the gRPC status of its stream.
async fn conversation(
    client: &mut ExternalProcessorClient<Channel>,
    m: &Messages,
    spec: &LoadSpec,
) -> (Outcome, tonic::Code) {
    let timeout = Duration::from_secs_f64(spec.timeout_s);
    let (tx, rx) = mpsc::unbounded_channel();
    let start = Instant::now();
    // The request headers go out with the call.
    let _ = tx.send(m.request_headers.clone());
    let mut answers = match bounded(timeout, client.process(UnboundedReceiverStream::new(rx))).await
    {
        Ok(r) => r.into_inner(),
        Err(code) => return (Outcome::Failed, code),
    };
    let mut next = async |msg: Option<&ProcessingRequest>| -> Step<Option<ProcessingResponse>> {
        if let Some(msg) = msg {
            // A closed stream shows as its status on the read below.
            let _ = tx.send(msg.clone());
        }
        bounded(timeout, answers.message()).await
    };
    let refusal = |a: &ProcessingResponse| match &a.response {
        Some(Response::ImmediateResponse(r)) => Some(r.status.as_ref().map_or(0, |s| s.code)),
        _ => None,
    };
    // The added latency: until the request body's answer (the routing).
    let mut added = Duration::ZERO;
    let mut outcome = Outcome::Failed;
    let steps = [
        None, // the request headers went out with the call
        Some(&m.request_body),
        Some(&m.response_headers),
        Some(&m.response_body),
    ];
    for (i, msg) in steps.into_iter().enumerate() {
        if i == 2 && spec.response_delay_s > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(spec.response_delay_s)).await;
        }
        match next(msg).await {
            Err(code) => return (Outcome::Failed, code),
            Ok(None) => break, // the stream ended early: a failed conversation
            Ok(Some(a)) => {
                if let Some(status) = refusal(&a) {
                    outcome = Outcome::Refused(start.elapsed(), status);
                    break;
                }
                match i {
                    1 => added = start.elapsed(),
                    3 => outcome = Outcome::Done(added),
                    _ => {}
                }
            }
        }
    }
    drop(tx); // half-close: the server ends the stream with its status
    let code = loop {
        match bounded(timeout, answers.message()).await {
            Ok(Some(_)) => {} // answers past the protocol's: read to the end
            Ok(None) => break tonic::Code::Ok,
            Err(code) => break code,
        }
    };
    if code != tonic::Code::Ok {
        // Answered, but the stream failed after: not a clean conversation.
        outcome = Outcome::Failed;
    }
    (outcome, code)
}

/// What one load worker counted.
#[derive(Default)]
struct Tally {
    latencies: Vec<f64>,
    errors: u64,
    statuses: BTreeMap<String, u64>,
    refusals: BTreeMap<String, u64>,
}

/// Runs the load; call on a tokio runtime.
pub async fn run(spec: &LoadSpec) -> Result<LoadReport, Error> {
    if spec.requests == 0 {
        return Err(invalid("requests must be >= 1"));
    }
    if !(1..=MAX_STREAMS).contains(&spec.concurrency) {
        return Err(invalid(format!(
            "concurrency must be in [1, {MAX_STREAMS}], got {}",
            spec.concurrency
        )));
    }
    if spec.body_bytes > MAX_BODY_BYTES {
        return Err(invalid(format!(
            "body_bytes must be at most {MAX_BODY_BYTES}, got {}",
            spec.body_bytes
        )));
    }
    if spec.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
        return Err(invalid("rate must be a finite number > 0"));
    }
    if spec.duration_s.is_some_and(|d| !(d.is_finite() && d > 0.0)) {
        return Err(invalid("duration_s must be a finite number > 0"));
    }
    if !(0.0..=MAX_WAIT_S).contains(&spec.response_delay_s) {
        return Err(invalid(format!(
            "response_delay_s must be in [0, {MAX_WAIT_S}], got {}",
            spec.response_delay_s
        )));
    }
    if !(spec.timeout_s > 0.0 && spec.timeout_s <= MAX_WAIT_S) {
        return Err(invalid(format!(
            "timeout_s must be in (0, {MAX_WAIT_S}], got {}",
            spec.timeout_s
        )));
    }
    let endpoint = Endpoint::from_shared(format!("http://{}", spec.target))
        .map_err(|e| invalid(format!("target {:?}: {e}", spec.target)))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5));
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| invalid(format!("cannot connect to {}: {e}", spec.target)))?;
    let messages = std::sync::Arc::new(Messages::new(spec));
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let me = std::process::id();
    let server_before = spec.server_pid.and_then(cpu_s);
    let switches_before = spec.server_pid.and_then(context_switches);
    let client_before = cpu_s(me);
    let start = Instant::now();
    let deadline = spec.duration_s.map(|d| start + Duration::from_secs_f64(d));
    let streams = spec
        .concurrency
        .min(usize::try_from(spec.requests).unwrap_or(usize::MAX));
    let workers: Vec<_> = (0..streams)
        .map(|_| {
            let mut client = ExternalProcessorClient::new(channel.clone());
            let (m, next, spec) = (messages.clone(), next.clone(), spec.clone());
            tokio::spawn(async move {
                let mut out = Tally::default();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= spec.requests || deadline.is_some_and(|d| Instant::now() >= d) {
                        break;
                    }
                    if let Some(rate) = spec.rate {
                        tokio::time::sleep_until(
                            (start + Duration::from_secs_f64(i as f64 / rate)).into(),
                        )
                        .await;
                    }
                    let (outcome, code) = conversation(&mut client, &m, &spec).await;
                    *out.statuses.entry(code_name(code).into()).or_default() += 1;
                    match outcome {
                        Outcome::Done(d) => out.latencies.push(d.as_secs_f64()),
                        Outcome::Refused(d, status) => {
                            out.latencies.push(d.as_secs_f64());
                            *out.refusals.entry(status.to_string()).or_default() += 1;
                        }
                        Outcome::Failed => out.errors += 1,
                    }
                }
                out
            })
        })
        .collect();
    let mut all = Tally::default();
    for w in workers {
        let t = w.await.map_err(|e| invalid(format!("load worker: {e}")))?;
        all.latencies.extend(t.latencies);
        all.errors += t.errors;
        for (into, from) in [
            (&mut all.statuses, t.statuses),
            (&mut all.refusals, t.refusals),
        ] {
            for (k, n) in from {
                *into.entry(k).or_default() += n;
            }
        }
    }
    let Tally {
        mut latencies,
        errors,
        statuses,
        refusals,
    } = all;
    let refused = refusals.values().sum();
    let seconds = start.elapsed().as_secs_f64();
    let n = latencies.len() as u64 + errors;
    latencies.sort_by(f64::total_cmp);
    let pick = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .map_or(0.0, |s| s * 1e3)
    };
    let per = |d: Option<f64>| d.filter(|_| n > 0).map(|d| d / n as f64);
    let server_after = spec.server_pid.and_then(cpu_s);
    let switches_after = spec.server_pid.and_then(context_switches);
    Ok(LoadReport {
        requests: n,
        refused,
        errors,
        statuses,
        refusals,
        seconds,
        throughput_per_s: n as f64 / seconds,
        p50_ms: pick(0.5),
        p99_ms: pick(0.99),
        mean_ms: if latencies.is_empty() {
            0.0
        } else {
            latencies.iter().sum::<f64>() / latencies.len() as f64 * 1e3
        },
        server_cpu_ms: per(server_before.zip(server_after).map(|(a, b)| (b - a) * 1e3)),
        server_context_switches: per(switches_before
            .zip(switches_after)
            .map(|(a, b)| b.saturating_sub(a) as f64)),
        client_cpu_ms: per(client_before.zip(cpu_s(me)).map(|(a, b)| (b - a) * 1e3)),
    })
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use envoy_types::pb::envoy::r#type::v3::HttpStatus;
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
        ExternalProcessor, ExternalProcessorServer,
    };
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        BodyResponse, HeadersResponse, ImmediateResponse, ProcessingResponse,
    };
    use tonic::transport::server::TcpIncoming;
    use tonic::{Request as Req, Response as Resp, Status, Streaming};

    use super::*;

    /// Answers every message with the empty answer of its kind; refuses the
    /// request headers when `refuse`.
    struct Mock {
        refuse: bool,
    }

    #[tonic::async_trait]
    impl ExternalProcessor for Mock {
        type ProcessStream = UnboundedReceiverStream<Result<ProcessingResponse, Status>>;

        async fn process(
            &self,
            request: Req<Streaming<ProcessingRequest>>,
        ) -> Result<Resp<Self::ProcessStream>, Status> {
            let mut incoming = request.into_inner();
            let (tx, rx) = mpsc::unbounded_channel();
            let refuse = self.refuse;
            tokio::spawn(async move {
                while let Ok(Some(m)) = incoming.message().await {
                    let response = match m.request {
                        Some(Request::RequestHeaders(_)) if refuse => {
                            Response::ImmediateResponse(ImmediateResponse {
                                status: Some(HttpStatus { code: 429 }),
                                ..Default::default()
                            })
                        }
                        Some(Request::RequestHeaders(_)) => {
                            Response::RequestHeaders(HeadersResponse::default())
                        }
                        Some(Request::ResponseHeaders(_)) => {
                            Response::ResponseHeaders(HeadersResponse::default())
                        }
                        Some(Request::RequestBody(_)) => {
                            Response::RequestBody(BodyResponse::default())
                        }
                        Some(Request::ResponseBody(_)) => {
                            Response::ResponseBody(BodyResponse::default())
                        }
                        _ => continue,
                    };
                    let answer = ProcessingResponse {
                        response: Some(response),
                        ..Default::default()
                    };
                    if tx.send(Ok(answer)).is_err() {
                        break;
                    }
                }
            });
            Ok(Resp::new(UnboundedReceiverStream::new(rx)))
        }
    }

    /// A mock server on its own thread and runtime: its address, and a
    /// sender that stops it (dropping the sender stops it too, so callers
    /// hold it for as long as the server must run).
    fn mock(refuse: bool) -> (SocketAddr, std::sync::mpsc::Sender<()>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let incoming = TcpIncoming::bind(([127, 0, 0, 1], 0).into())
                    .expect("bind")
                    .with_nodelay(Some(true));
                tx.send(incoming.local_addr().expect("addr")).expect("send");
                let stopped = async move {
                    let _ = tokio::task::spawn_blocking(move || stop_rx.recv()).await;
                };
                let _ = tonic::transport::Server::builder()
                    .add_service(ExternalProcessorServer::new(Mock { refuse }))
                    .serve_with_incoming_shutdown(incoming, stopped)
                    .await;
            });
        });
        (rx.recv().expect("address"), stop_tx)
    }

    fn spec(addr: SocketAddr) -> LoadSpec {
        LoadSpec {
            target: addr.to_string(),
            server_pid: Some(std::process::id()),
            ..LoadSpec::default()
        }
    }

    #[tokio::test]
    async fn load_runs_every_conversation_to_its_end() {
        let (addr, _server) = mock(false);
        let r = run(&LoadSpec {
            requests: 300,
            ..spec(addr)
        })
        .await
        .expect("run");
        assert_eq!((r.requests, r.refused, r.errors), (300, 0, 0));
        assert_eq!(r.statuses, BTreeMap::from([("OK".into(), 300)]));
        assert!(r.refusals.is_empty());
        assert!(0.0 < r.p50_ms && r.p50_ms <= r.p99_ms);
        assert!(r.server_cpu_ms.is_some() && r.server_context_switches.is_some());
        let (refusing, _refusing_server) = mock(true);
        let refused = run(&LoadSpec {
            requests: 20,
            ..spec(refusing)
        })
        .await
        .expect("run");
        assert_eq!(
            (refused.requests, refused.refused, refused.errors),
            (20, 20, 0)
        );
        assert_eq!(refused.statuses, BTreeMap::from([("OK".into(), 20)]));
        assert_eq!(refused.refusals, BTreeMap::from([("429".into(), 20)]));
    }

    #[tokio::test]
    async fn a_server_that_never_answers_is_reported_not_waited_on() {
        // Accepts connections and never answers a byte.
        let stalled = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = stalled.local_addr().expect("addr");
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = stalled.accept().await {
                held.push(conn);
            }
        });
        let start = Instant::now();
        let r = run(&LoadSpec {
            requests: 4,
            concurrency: 2,
            timeout_s: 0.2,
            ..spec(addr)
        })
        .await
        .expect("run");
        assert_eq!((r.requests, r.errors), (4, 4));
        assert_eq!(
            r.statuses,
            BTreeMap::from([("DEADLINE_EXCEEDED".into(), 4)])
        );
        // Two rounds of one timeout each, not a hang.
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_server_that_goes_away_mid_run_is_reported() {
        let (addr, stop) = mock(false);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let _ = stop.send(());
        });
        let start = Instant::now();
        let r = run(&LoadSpec {
            requests: 1_000_000,
            concurrency: 4,
            duration_s: Some(0.6),
            response_delay_s: 0.002,
            timeout_s: 2.0,
            ..spec(addr)
        })
        .await
        .expect("run");
        assert!(start.elapsed() < Duration::from_secs(5));
        assert_eq!(r.requests, r.statuses.values().sum::<u64>());
        assert!(r.statuses.get("OK").is_some_and(|&n| n > 0), "{r:?}");
        assert!(
            r.errors > 0 && r.statuses.get("UNAVAILABLE").is_some_and(|&n| n > 0),
            "{r:?}"
        );
        assert!(!r.statuses.contains_key("UNKNOWN"), "{r:?}");
    }

    #[tokio::test]
    async fn load_refuses_bad_specs_and_unreachable_targets() {
        let (addr, _server) = mock(false);
        for bad in [
            LoadSpec {
                requests: 0,
                ..spec(addr)
            },
            LoadSpec {
                concurrency: 0,
                ..spec(addr)
            },
            LoadSpec {
                rate: Some(f64::NAN),
                ..spec(addr)
            },
            LoadSpec {
                duration_s: Some(-1.0),
                ..spec(addr)
            },
            LoadSpec {
                target: "no port".into(),
                ..spec(addr)
            },
        ] {
            assert!(run(&bad).await.is_err(), "{bad:?}");
        }
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = closed.local_addr().expect("addr").port();
        drop(closed);
        let spec = LoadSpec {
            target: format!("127.0.0.1:{port}"),
            ..LoadSpec::default()
        };
        assert!(run(&spec).await.is_err());
    }

    #[test]
    fn proc_counters_read_this_process() {
        assert!(cpu_s(std::process::id()).is_some());
        assert!(context_switches(std::process::id()).is_some());
        assert!(cpu_s(u32::MAX).is_none());
    }

    /// The client's own CPU per conversation against a do-nothing server (on
    /// another thread): `cargo test --release --features server -- --ignored
    /// --nocapture load_client_cpu`.
    #[tokio::test]
    #[ignore]
    async fn load_client_cpu() {
        let (addr, _server) = mock(false);
        for concurrency in [1, 8, 64] {
            let before = stat_cpu_s("/proc/thread-self/stat").expect("cpu");
            let r = run(&LoadSpec {
                requests: 5_000,
                concurrency,
                ..spec(addr)
            })
            .await
            .expect("run");
            let after = stat_cpu_s("/proc/thread-self/stat").expect("cpu");
            println!(
                "concurrency {concurrency}: {:.0} conv/s, p50 {:.3} ms, p99 {:.3} ms, \
                 client thread CPU {:.4} ms/conv, client+server process {:.4} ms/conv",
                r.throughput_per_s,
                r.p50_ms,
                r.p99_ms,
                (after - before) * 1e3 / r.requests as f64,
                r.server_cpu_ms.unwrap_or(f64::NAN),
            );
        }
    }
}
