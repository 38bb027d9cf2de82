//! What a client can make the data plane hold, bounded by `limits.*`
//! whatever it sends (issue 22, item 4):
//!
//! - `limits.max_connections`: connections open at once (a connection past
//!   it is closed as it is accepted);
//! - `limits.max_streams_per_connection`: ext_proc streams open at once on
//!   one connection (a stream past it ends with RESOURCE_EXHAUSTED);
//! - `limits.body_timeout_s`: from a stream's opening to its routing (the
//!   request headers and the whole body); past it the stream is answered
//!   408 and ended, and what it buffered is freed;
//! - `limits.max_buffered_bytes`: the bytes every stream's buffers hold
//!   together ([`Hold`]): request bodies being accumulated and response
//!   bodies being read for their usage ([`Buffer`]), and the receive buffer
//!   the gRPC layer keeps for each stream, as large as the largest message
//!   the stream sent (tonic keeps its capacity while the stream is open). A
//!   request that would take the total past it is refused with 503
//!   (Retry-After), a response message ends its stream with
//!   RESOURCE_EXHAUSTED, and a response body whose usage would not fit is
//!   passed on without its usage being read.
//!
//! Each limit reached is counted in `routecore_faults_total{source="client",
//! kind=<the limit's name>}` and logged once per state change
//! (`limit-reached`, [`super::logs::Repeats`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use hyper::body::{Body, Bytes, Frame};
use tonic::codegen::{http, Service, StdError};
use tonic::server::NamedService;
use tonic::Status;

use super::logs::{Occurrence, Repeats};
use super::metrics::{FGauge, Metrics};

/// The `limits` section of the data plane's spec.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSpec {
    pub max_body_bytes: u64,
    pub max_message_bytes: u64,
    pub request_timeout_s: f64,
    pub default_max_tokens: u64,
    /// Tokens charged per image and per audio part of a request.
    pub image_tokens: u64,
    pub audio_tokens: u64,
    /// Bodies at least this long are tokenized off the async worker.
    #[serde(default = "default_tokenize_inline_bytes")]
    pub tokenize_inline_bytes: u64,
    /// What a client can make the data plane hold (`serve::limits`): the
    /// time from a stream's opening to its routing, the bytes all streams
    /// buffer together, streams per connection, connections.
    #[serde(default = "default_body_timeout_s")]
    pub body_timeout_s: f64,
    #[serde(default = "default_max_buffered_bytes")]
    pub max_buffered_bytes: u64,
    #[serde(default = "default_max_streams_per_connection")]
    pub max_streams_per_connection: u64,
    #[serde(default = "default_max_connections")]
    pub max_connections: u64,
}

// The defaults of `routecore.config.Limits` (the Python side fills them in).
fn default_body_timeout_s() -> f64 {
    60.0
}

fn default_max_buffered_bytes() -> u64 {
    256 << 20
}

fn default_max_streams_per_connection() -> u64 {
    1024
}

fn default_max_connections() -> u64 {
    64
}

/// Below this, tokenizing inline costs less than handing it to another
/// thread (benches/RESULTS.md, "Tokenizing off the worker").
pub const TOKENIZE_INLINE_BYTES: u64 = 512;

fn default_tokenize_inline_bytes() -> u64 {
    TOKENIZE_INLINE_BYTES
}

impl LimitsSpec {
    /// The timeouts are positive and finite (the other limits are
    /// unsigned; Python checked their ranges).
    pub fn check(&self) -> crate::error::Result<()> {
        for (name, s) in [
            ("request_timeout_s", self.request_timeout_s),
            ("body_timeout_s", self.body_timeout_s),
        ] {
            if !(s.is_finite() && s > 0.0) {
                return Err(crate::error::invalid(format!("limits.{name} must be > 0")));
            }
        }
        Ok(())
    }
}

/// The limits' names, as in the configuration and the metric's `kind`.
pub const BODY_TIMEOUT: &str = "body_timeout_s";
pub const MAX_BUFFERED_BYTES: &str = "max_buffered_bytes";
pub const MAX_STREAMS_PER_CONNECTION: &str = "max_streams_per_connection";
pub const MAX_CONNECTIONS: &str = "max_connections";

/// The accounting shared by every stream of one data plane.
pub struct Overload {
    metrics: Arc<Metrics>,
    /// One per limit name.
    repeats: Mutex<HashMap<&'static str, Repeats>>,
    buffered: AtomicUsize,
    max_buffered: AtomicUsize,
    /// `routecore_buffered_bytes`.
    gauge: FGauge,
}

impl Overload {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            gauge: metrics.buffered_bytes.clone(),
            metrics,
            repeats: Mutex::new(HashMap::new()),
            buffered: AtomicUsize::new(0),
            max_buffered: AtomicUsize::new(usize::MAX),
        }
    }

    /// `limits.max_buffered_bytes` of the running configuration (a reload
    /// sets it; what is held already stays held).
    pub fn set_max_buffered(&self, bytes: u64) {
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        self.max_buffered.store(bytes, Ordering::Relaxed);
    }

    /// The bytes the streams' buffers hold now.
    pub fn buffered(&self) -> usize {
        self.buffered.load(Ordering::Relaxed)
    }

    /// A client reached `limit`: counted, and logged once per state change.
    pub fn reached(&self, limit: &'static str) {
        self.metrics.fault("client", limit);
        let occurrence = {
            let mut repeats = self.repeats.lock().unwrap_or_else(|e| e.into_inner());
            repeats.entry(limit).or_default().occur(Instant::now())
        };
        if let Occurrence::Log { suppressed } = occurrence {
            tracing::warn!(limit, suppressed, "limit-reached");
        }
    }

    /// Takes `bytes` more out of the budget; false (nothing taken, counted)
    /// when that would pass `limits.max_buffered_bytes`.
    fn hold(&self, bytes: usize) -> bool {
        let max = self.max_buffered.load(Ordering::Relaxed);
        let taken = self
            .buffered
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= max)
            });
        match taken {
            Ok(used) => {
                self.gauge.set((used + bytes) as f64);
                true
            }
            Err(_) => {
                self.reached(MAX_BUFFERED_BYTES);
                false
            }
        }
    }

    /// Holds `bytes` whatever the limit (what an allocator gave beyond the
    /// capacity asked for: already allocated).
    fn hold_anyway(&self, bytes: usize) {
        let used = self.buffered.fetch_add(bytes, Ordering::AcqRel);
        self.gauge.set((used + bytes) as f64);
    }

    fn release(&self, bytes: usize) {
        if bytes > 0 {
            let used = self.buffered.fetch_sub(bytes, Ordering::AcqRel);
            self.gauge.set(used.saturating_sub(bytes) as f64);
        }
    }
}

/// Bytes held in the data plane's budget (`limits.max_buffered_bytes`),
/// given back when dropped.
pub struct Hold {
    bytes: usize,
    overload: Arc<Overload>,
}

impl Hold {
    pub fn new(overload: &Arc<Overload>) -> Self {
        Self {
            bytes: 0,
            overload: Arc::clone(overload),
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Holds at least `bytes`; false (nothing changed, counted) when the
    /// budget cannot give the difference.
    pub fn grow_to(&mut self, bytes: usize) -> bool {
        if bytes <= self.bytes {
            return true;
        }
        if !self.overload.hold(bytes - self.bytes) {
            return false;
        }
        self.bytes = bytes;
        true
    }

    /// Holds at least `bytes`, whatever the budget (memory already taken).
    fn force_to(&mut self, bytes: usize) {
        if bytes > self.bytes {
            self.overload.hold_anyway(bytes - self.bytes);
            self.bytes = bytes;
        }
    }

    /// Holds at most `bytes`.
    fn shrink_to(&mut self, bytes: usize) {
        if bytes < self.bytes {
            self.overload.release(self.bytes - bytes);
            self.bytes = bytes;
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.overload.release(self.bytes);
    }
}

/// A byte buffer whose capacity is held in the data plane's budget, given
/// back when it is freed or dropped.
pub struct Buffer {
    data: Vec<u8>,
    /// The capacity, or more while copies of freed bytes are still to be
    /// sent ([`Buffer::free`]).
    held: Hold,
}

impl Buffer {
    pub fn new(overload: &Arc<Overload>) -> Self {
        Self {
            data: Vec::new(),
            held: Hold::new(overload),
        }
    }

    pub fn data(&self) -> &[u8] {
        &self.data
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Appends `chunk`, the capacity growing (doubling) up to `max` bytes
    /// at most (or what the data needs, if more); false, and nothing
    /// changed, when the budget cannot hold the growth.
    pub fn extend(&mut self, chunk: &[u8], max: usize) -> bool {
        let need = self.data.len().saturating_add(chunk.len());
        let cap = self.data.capacity();
        if need > cap {
            let grown = need.max(cap.saturating_mul(2).min(max));
            if !self.held.grow_to(grown) {
                return false;
            }
            self.data.reserve_exact(grown - self.data.len());
            // The allocator may give more than asked: hold that too.
            self.held.force_to(self.data.capacity());
        }
        self.data.extend_from_slice(chunk);
        true
    }

    /// Frees the bytes but keeps their budget until [`Buffer::settle`]: the
    /// answers that carry copies of them are still to be sent.
    pub fn free(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.data)
    }

    /// Gives back what is held beyond the capacity (answers sent).
    pub fn settle(&mut self) {
        self.held.shrink_to(self.data.capacity());
    }

    /// Empties the buffer, keeping its capacity (and budget) for what comes next.
    pub fn clear(&mut self) {
        self.data.clear();
    }

    /// Empties the buffer and gives its memory and budget back.
    pub fn release(&mut self) {
        self.data = Vec::new();
        self.settle();
    }
}

/// The message of the status a stream ends with when the budget cannot hold
/// what it sends.
pub const BUFFERS_FULL: &str = "routecore's buffers are full";

/// A stream's request body (its gRPC messages) as it arrives: the bytes the
/// gRPC layer keeps for it (the message being received and, once
/// received, a buffer as large as the largest, which it keeps while the
/// stream is open) are held in the budget before it gets them. When the
/// budget cannot hold them, the body ends with RESOURCE_EXHAUSTED
/// ([`BUFFERS_FULL`]).
pub struct Received<B> {
    inner: B,
    hold: Hold,
    /// Bytes of the message being received (its 5-byte prefix included).
    partial: usize,
    /// The prefix bytes read of the message being received.
    prefix: [u8; 5],
    /// Bytes of its payload still to come (meaningful once the prefix is in).
    due: usize,
    failed: bool,
}

impl<B> Received<B> {
    pub fn new(inner: B, overload: &Arc<Overload>) -> Self {
        Self {
            inner,
            hold: Hold::new(overload),
            partial: 0,
            prefix: [0; 5],
            due: 0,
            failed: false,
        }
    }

    /// Follows the gRPC framing (a flag byte, a big-endian u32 length, the
    /// payload) over `data`: the bytes of the message left unfinished.
    fn follow(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let n = if self.partial < 5 {
                let n = (5 - self.partial).min(data.len());
                self.prefix[self.partial..self.partial + n].copy_from_slice(&data[..n]);
                if self.partial + n == 5 {
                    let len = [
                        self.prefix[1],
                        self.prefix[2],
                        self.prefix[3],
                        self.prefix[4],
                    ];
                    self.due = u32::from_be_bytes(len) as usize;
                }
                n
            } else {
                let n = self.due.min(data.len());
                self.due -= n;
                n
            };
            self.partial += n;
            data = &data[n..];
            if self.partial >= 5 && self.due == 0 {
                self.partial = 0; // a whole message
            }
        }
    }
}

impl<B> Body for Received<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<StdError>,
{
    type Data = Bytes;
    type Error = StdError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StdError>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if let Some(data) = frame.data_ref() {
            // The gRPC layer holds what it had of the message and this data
            // until a message is whole: at most their sum.
            let holds = self.partial + data.len();
            if !self.hold.grow_to(holds) {
                self.failed = true;
                return Poll::Ready(Some(Err(Box::new(Status::resource_exhausted(
                    BUFFERS_FULL,
                )))));
            }
            self.follow(data);
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }
}

/// A gRPC service whose requests' bodies are [`Received`]: what they bring
/// in is held in the buffer budget.
#[derive(Clone)]
pub struct Bounded<S> {
    inner: S,
    overload: Arc<Overload>,
}

impl<S> Bounded<S> {
    pub fn new(inner: S, overload: &Arc<Overload>) -> Self {
        Self {
            inner,
            overload: Arc::clone(overload),
        }
    }
}

impl<S: NamedService> NamedService for Bounded<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<tonic::body::Body>> for Bounded<S>
where
    S: Service<http::Request<Received<tonic::body::Body>>, Error = Infallible>,
{
    type Response = S::Response;
    type Error = Infallible;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let overload = &self.overload;
        self.inner.call(req.map(|b| Received::new(b, overload)))
    }
}

/// The ext_proc streams open on one connection.
#[derive(Clone, Default)]
pub struct StreamCount(Arc<AtomicUsize>);

impl StreamCount {
    /// One more stream, unless `max` are open already.
    pub fn open(&self, max: usize) -> Option<StreamSlot> {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| StreamSlot(Arc::clone(&self.0)))
    }
}

/// One open stream of a connection, counted until dropped.
pub struct StreamSlot(Arc<AtomicUsize>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overload(max: u64) -> Arc<Overload> {
        let o = Arc::new(Overload::new(Arc::new(Metrics::new())));
        o.set_max_buffered(max);
        o
    }

    #[test]
    fn buffers_hold_their_capacity_and_refuse_past_the_budget() {
        let o = overload(1000);
        let mut a = Buffer::new(&o);
        assert!(a.extend(&[1; 300], 600));
        assert_eq!(o.buffered(), a.data.capacity());
        assert!(a.extend(&[2; 300], 600));
        assert_eq!(a.data(), [[1; 300], [2; 300]].concat());
        let held = o.buffered();
        assert!((600..=1000).contains(&held), "{held}");
        let mut b = Buffer::new(&o);
        // 600 and more held: 500 more cannot be.
        assert!(!b.extend(&[3; 500], 600));
        assert!(b.is_empty() && o.buffered() == held);
        assert_eq!(
            o.metrics.value("faults", &["client", MAX_BUFFERED_BYTES]),
            Some(1.0)
        );
        // Freed, the bytes stay held until settled (their copies in flight).
        let copy = a.free();
        assert_eq!(copy.len(), 600);
        assert_eq!(o.buffered(), held);
        a.settle();
        assert_eq!(o.buffered(), 0);
        assert!(b.extend(&[3; 500], 600));
        drop(b);
        assert_eq!(o.buffered(), 0);
        assert_eq!(o.metrics.value("buffered_bytes", &[]), Some(0.0));
    }

    #[test]
    fn a_hold_grows_to_its_largest_and_gives_all_back() {
        let o = overload(100);
        let mut h = Hold::new(&o);
        assert!(h.grow_to(60) && h.grow_to(40) && h.bytes() == 60);
        let mut other = Hold::new(&o);
        assert!(!other.grow_to(41));
        assert!(other.grow_to(40));
        assert_eq!(o.buffered(), 100);
        drop(h);
        assert_eq!(o.buffered(), 40);
    }

    #[test]
    fn doubling_never_grows_past_the_buffers_maximum() {
        let o = overload(u64::MAX);
        let mut a = Buffer::new(&o);
        for _ in 0..10 {
            assert!(a.extend(&[0; 100], 1000));
        }
        assert_eq!(a.len(), 1000);
        assert!(a.data.capacity() < 1100, "{}", a.data.capacity());
        a.clear();
        assert!(a.is_empty() && o.buffered() == a.data.capacity());
        a.release();
        assert_eq!(o.buffered(), 0);
    }

    #[test]
    fn received_bodies_hold_the_message_being_received_and_the_largest() {
        use http_body_util::BodyExt;
        let o = overload(1 << 20);
        let message = |n: usize| {
            let mut m = vec![0u8];
            m.extend_from_slice(&(n as u32).to_be_bytes());
            m.extend(std::iter::repeat_n(7u8, n));
            m
        };
        // Two messages (1,000 and 100 bytes of payload) cut in every way.
        let wire = [message(1000), message(100)].concat();
        for cut in [1, 3, 5, 7, 64, 1005, wire.len()] {
            let chunks: Vec<Result<Frame<Bytes>, Infallible>> = wire
                .chunks(cut)
                .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
                .collect();
            let body = http_body_util::StreamBody::new(futures_util::stream::iter(chunks));
            let mut r = Received::new(body, &o);
            let mut got = Vec::new();
            while let Some(frame) = futures_util::FutureExt::now_or_never(r.frame())
                .flatten()
                .map(|f| f.expect("frame"))
            {
                got.extend_from_slice(frame.data_ref().expect("data"));
            }
            assert_eq!(got, wire, "cut {cut}");
            // The largest moment: the first message whole, plus what came with its end.
            let held = o.buffered();
            assert!((1005..1005 + cut).contains(&held), "cut {cut}: {held}");
            assert_eq!(r.partial, 0);
            drop(r);
            assert_eq!(o.buffered(), 0);
        }
        // A message the budget cannot hold ends the body with RESOURCE_EXHAUSTED.
        let small = overload(500);
        let frames: Vec<Result<Frame<Bytes>, Infallible>> = message(1000)
            .chunks(100)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
        let mut r = Received::new(body, &small);
        let mut statuses = Vec::new();
        while let Some(Some(frame)) = futures_util::FutureExt::now_or_never(r.frame()) {
            if let Err(e) = frame {
                statuses.push(Status::from_error(e));
            }
        }
        assert_eq!(statuses.len(), 1);
        assert_eq!(statuses[0].code(), tonic::Code::ResourceExhausted);
        assert!(small.buffered() <= 500);
    }

    #[test]
    fn a_connection_opens_at_most_its_streams() {
        let count = StreamCount::default();
        let slots: Vec<_> = (0..3).filter_map(|_| count.open(3)).collect();
        assert_eq!(slots.len(), 3);
        assert!(count.open(3).is_none());
        drop(slots);
        assert!(count.open(3).is_some());
    }
}
