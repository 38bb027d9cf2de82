//! One subscriber task per endpoint, on the data plane's tokio runtime: a
//! ZeroMQ SUB socket (the pure-Rust `zeromq` crate) on the engine's KV-event
//! PUB socket, and a DEALER on its replay ROUTER socket, both behind a size
//! guard (`guard`). Every decision about a batch is `KvIndex`'s; this file
//! moves frames, decodes batches off the runtime's worker threads (a
//! blocking-pool thread: a conversation never waits on a batch) and logs
//! what changed, one line per state change (`serve::logs::Repeats`).
//!
//! Replay (vLLM's `ZmqEventPublisher`): the request is `["", start_seq as 8
//! bytes big-endian]`; vLLM 0.32 answers `["", topic, seq, payload]` for each
//! buffered batch from `start_seq` on, then `["", "", -1, ""]`; vLLM before
//! the topic was added (and SGLang) answers `["", seq, payload]` and ends
//! with `["", -1, ""]`: both are read. Replay serves three purposes:
//!
//! - a gap (a batch number skipped) is filled from it;
//! - at the start, or after an engine restart, the subscriber asks for
//!   everything from 0, so a replica started after the engine learns what the
//!   engine already caches;
//! - after a reconnect the subscriber asks from its last batch: the answer
//!   fills what was missed while the stream was down, and shows that the
//!   engine still holds that very batch (the same payload), else the engine
//!   restarted and the endpoint is cleared;
//! - with `stale_after_s`, an engine silent for half of it is asked from the
//!   batch after its last (an idle engine answers with the end marker alone):
//!   an idle engine that answers stays live, one that does not goes stale.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use xxhash_rust::xxh3::xxh3_64;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::decode::{decode_batch, decode_seq, Limits};
use super::guard::{self, Ended, Guard};
use super::{Faults, KvSourceSpec};
use crate::kv::index::{KvIndex, Seq, Skip};
use crate::serve::logs::{Occurrence, Repeats};

/// vLLM's largest practical step (2^20 new tokens at block size 16) stores
/// 2^16 blocks and may evict as many, one `BlockRemoved` each: about 9.5 MB
/// of msgpack with 32-byte hashes and 5-byte token ids. The defaults hold
/// twice that.
pub const DEFAULT_MAX_MESSAGE_BYTES: u64 = 16 << 20;
pub const DEFAULT_MAX_BATCH_EVENTS: usize = 1 << 17;
pub const DEFAULT_MAX_BATCH_BLOCKS: usize = 1 << 18;
/// The ranges a limit is checked against.
pub const MESSAGE_BYTES_RANGE: (u64, u64) = (1 << 10, 1 << 30);
pub const BATCH_RANGE: (usize, usize) = (1, 1 << 24);

/// What a subscriber accepts from its peer (`kv_events.max_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerLimits {
    /// Bytes of one ZeroMQ message (and so of any frame), checked on the
    /// frame headers before anything is allocated.
    pub max_message_bytes: u64,
    pub max_batch_events: usize,
    /// Block hashes per batch; token ids are bounded by this times the block size.
    pub max_batch_blocks: usize,
}

impl Default for PeerLimits {
    fn default() -> Self {
        Self {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_batch_events: DEFAULT_MAX_BATCH_EVENTS,
            max_batch_blocks: DEFAULT_MAX_BATCH_BLOCKS,
        }
    }
}

impl PeerLimits {
    pub fn check(self) -> crate::error::Result<Self> {
        let (lo, hi) = MESSAGE_BYTES_RANGE;
        if !(lo..=hi).contains(&self.max_message_bytes) {
            return Err(crate::error::invalid(format!(
                "kv_events.max_message_bytes must be in [{lo}, {hi}], got {}",
                self.max_message_bytes
            )));
        }
        let (lo, hi) = BATCH_RANGE;
        for (key, v) in [
            ("max_batch_events", self.max_batch_events),
            ("max_batch_blocks", self.max_batch_blocks),
        ] {
            if !(lo..=hi).contains(&v) {
                return Err(crate::error::invalid(format!(
                    "kv_events.{key} must be in [{lo}, {hi}], got {v}"
                )));
            }
        }
        Ok(self)
    }

    fn batch(&self, block_size: usize) -> Limits {
        Limits {
            max_events: self.max_batch_events,
            max_blocks: self.max_batch_blocks,
            max_tokens: self.max_batch_blocks.saturating_mul(block_size),
        }
    }
}

/// Checks a source's addresses (`tcp://host:port`, a host to connect to):
/// a clear error naming the key, before any task starts.
pub fn check(source: &KvSourceSpec) -> crate::error::Result<()> {
    for (key, addr) in [
        ("zmq", Some(&source.zmq)),
        ("replay", source.replay.as_ref()),
    ] {
        let Some(addr) = addr else { continue };
        let bad = |why: String| {
            crate::error::invalid(format!(
                "kv_events.{key}: {addr:?} is not a ZeroMQ address to connect to (tcp://host:port): {why}"
            ))
        };
        match addr.parse::<zeromq::Endpoint>() {
            Ok(zeromq::Endpoint::Tcp(host, _)) => {
                let any = match &host {
                    zeromq::Host::Ipv4(a) => a.is_unspecified(),
                    zeromq::Host::Ipv6(a) => a.is_unspecified(),
                    zeromq::Host::Domain(d) => d == "*",
                };
                if any {
                    return Err(bad(format!(
                        "{host} is the engine's bind address; give the engine's host"
                    )));
                }
            }
            Ok(_) => return Err(bad("only tcp:// is supported".into())),
            Err(e) => return Err(bad(e.to_string())),
        }
    }
    Ok(())
}

/// How long one connect attempt, and one replay answer, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest pause between two connect attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Answers one replay may bring (vLLM buffers 10,000 batches by default).
const MAX_REPLAY_BATCHES: usize = 1 << 20;

/// Starts one subscriber per source on `runtime`; each ends when `stop` turns true.
pub fn spawn(
    runtime: &tokio::runtime::Handle,
    index: &Arc<KvIndex>,
    sources: &[KvSourceSpec],
    limits: PeerLimits,
    faults: &Faults,
    stop: &watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    sources
        .iter()
        .map(|source| {
            index.add_endpoint(&source.endpoint);
            runtime.spawn(
                Subscriber {
                    index: Arc::clone(index),
                    source: source.clone(),
                    limits,
                    batch: limits.batch(index.config().block_size),
                    faults: Arc::clone(faults),
                    epoch: Instant::now(),
                    replay: None,
                    last: None,
                    heard_at: Instant::now(),
                    logs: HashMap::new(),
                }
                .run(stop.clone()),
            )
        })
        .collect()
}

/// What one replay did.
#[derive(Debug, Default)]
struct Replayed {
    /// The engine no longer has the batch the index applied last (it
    /// restarted, or the subscriber missed more than it buffers).
    diverged: bool,
}

struct Subscriber {
    index: Arc<KvIndex>,
    source: KvSourceSpec,
    limits: PeerLimits,
    batch: Limits,
    faults: Faults,
    epoch: Instant,
    replay: Option<(DealerSocket, Guard)>,
    /// The last batch applied: its number and its payload's xxh3 (a probe
    /// checks that the engine still has that very batch).
    last: Option<(u64, u64)>,
    /// When the engine was last heard from (a batch or a replay answer).
    heard_at: Instant,
    /// One line per state change, per kind of fault.
    logs: HashMap<&'static str, Repeats>,
}

/// Reads a replay answer: `(seq, payload)`, or None for the end marker.
fn replay_answer(frames: &[Bytes]) -> Result<Option<(u64, Bytes)>, String> {
    let (seq, payload) = match frames {
        [empty, _, seq, payload] | [empty, seq, payload] if empty.is_empty() => {
            (decode_seq(seq), payload)
        }
        _ => return Err(format!("a replay answer of {} frames", frames.len())),
    };
    match seq {
        Some(-1) => Ok(None),
        Some(s) if s >= 0 => Ok(Some((s as u64, payload.clone()))),
        _ => Err("a replay answer without a sequence number".into()),
    }
}

impl Subscriber {
    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    fn name(&self) -> &str {
        &self.source.endpoint
    }

    /// Whether to write an occurrence of `kind` now (one line per state
    /// change: the first of a run, then one a period with the count held
    /// back), and that count.
    fn repeats(&mut self, kind: &'static str) -> Option<u64> {
        match self.logs.entry(kind).or_default().occur(Instant::now()) {
            Occurrence::Log { suppressed } => Some(suppressed),
            Occurrence::Quiet => None,
        }
    }

    /// A fault of the peer: counted every time, logged once per state change.
    fn fault(&mut self, kind: &'static str, detail: &dyn std::fmt::Display) {
        (self.faults)(kind);
        if let Some(suppressed) = self.repeats(kind) {
            tracing::warn!(endpoint = self.name(), suppressed, %detail, "kv-events-{kind}");
        }
    }

    /// Logs a switch between the precise index and the approximate fallback
    /// (a flapping endpoint: once a period, with the count).
    fn switched(&mut self, changed: bool, why: &str) {
        if !changed {
            return;
        }
        let live = self
            .index
            .stats(self.name())
            .map(|s| s.live)
            .unwrap_or(false);
        if let Some(suppressed) = self.repeats("switch") {
            tracing::info!(
                endpoint = self.name(),
                live,
                why,
                suppressed,
                "kv-events-{}",
                if live { "precise" } else { "fallback" }
            );
        }
    }

    fn set_connected(&mut self, connected: bool, why: &str) {
        let changed = self
            .index
            .set_connected(self.name(), connected)
            .unwrap_or(false);
        self.switched(changed, why);
    }

    fn heard(&mut self) {
        self.heard_at = Instant::now();
        let revived = self.index.heard(self.name(), self.now()).unwrap_or(false);
        self.switched(revived, "heard");
    }

    async fn connect_sub(&self) -> Result<(SubSocket, Guard), String> {
        let mut sub = SubSocket::new();
        let guard = guard::connect(
            &mut sub,
            &self.source.zmq,
            self.limits.max_message_bytes,
            CONNECT_TIMEOUT,
        )
        .await?;
        sub.subscribe(&self.source.topic)
            .await
            .map_err(|e| e.to_string())?;
        Ok((sub, guard))
    }

    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            if *stop.borrow() {
                return;
            }
            let (mut sub, mut guard) = match self.connect_sub().await {
                Ok(c) => c,
                Err(error) => {
                    self.fault("connect-failed", &error);
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.changed() => return,
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            };
            if let Some(suppressed) = self.logs.get("connect-failed").and_then(Repeats::end) {
                tracing::info!(endpoint = self.name(), suppressed, "kv-events-connected");
            }
            self.set_connected(true, "connected");
            let since = Instant::now();
            self.sync(true).await;
            let period = self
                .index
                .config()
                .stale_after_s
                .map_or(Duration::from_secs(1), |s| {
                    Duration::from_secs_f64((s / 4.0).clamp(0.01, 1.0))
                });
            let mut tick = tokio::time::interval(period);
            let ended = loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    ended = guard.ended() => break ended,
                    msg = sub.recv() => match msg {
                        Ok(msg) => self.receive(msg).await,
                        Err(e) => break Ended::Closed(e.to_string()),
                    },
                    _ = tick.tick() => self.tick().await,
                }
            };
            drop(sub);
            drop(guard);
            match ended {
                Ended::Cut(cut) => self.fault("message-too-large", &cut),
                Ended::Closed(why) => self.fault("disconnected", &why),
            }
            self.set_connected(false, "disconnected");
            // A peer that accepts and drops connections is not retried in a
            // tight loop: the pause resets only after a connection that
            // brought a batch or an answer.
            if self.heard_at >= since {
                backoff = Duration::from_millis(100);
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.changed() => return,
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// The periodic check: with `stale_after_s`, an engine silent for half of
    /// it is asked (a replay from its last batch); then staleness is updated.
    async fn tick(&mut self) {
        let Some(stale_after) = self.index.config().stale_after_s else {
            return;
        };
        if self.heard_at.elapsed().as_secs_f64() >= stale_after / 2.0 {
            if self.source.replay.is_some() {
                self.sync(false).await;
            } else {
                // Nothing to ask: silence alone is no sign of a fault (an
                // idle engine sends nothing), only a lost connection is.
                self.heard();
            }
        }
        let changed = self
            .index
            .check_stale(self.name(), self.now())
            .unwrap_or(false);
        self.switched(changed, "no answer");
    }

    /// Catches up through replay: from 0 when the index follows nothing yet
    /// (the start, a restart); else from the last batch applied, checking
    /// that the engine still has it (`verify`, after a reconnect), or from
    /// the batch after it.
    async fn sync(&mut self, verify: bool) {
        if self.source.replay.is_none() {
            return;
        }
        let from = self
            .last
            .map_or(0, |(seq, _)| if verify { seq } else { seq + 1 });
        match self.replay(from, None).await {
            Ok(r) if r.diverged => {
                tracing::info!(endpoint = self.name(), from, "kv-events-engine-restart");
                let _ = self.index.restarted(self.name());
                self.last = None;
                if let Err(error) = self.replay(0, None).await {
                    self.replay_failed(&error);
                }
            }
            Ok(_) => self.heard(),
            Err(error) => self.replay_failed(&error),
        }
    }

    fn replay_failed(&mut self, error: &str) {
        self.fault("replay-failed", &error);
        self.replay = None;
    }

    /// One `(topic, seq, payload)` message from the PUB socket.
    async fn receive(&mut self, msg: ZmqMessage) {
        let frames = msg.into_vec();
        let (seq, payload) = match frames.as_slice() {
            [_topic, seq, payload] => (decode_seq(seq), payload.clone()),
            _ => (None, Bytes::new()),
        };
        let Some(seq) = seq.and_then(|s| u64::try_from(s).ok()) else {
            let _ = self.index.garbage(self.name());
            self.fault(
                "garbage-frame",
                &format!(
                    "a message of {} frames, not (topic, seq, payload)",
                    frames.len()
                ),
            );
            return;
        };
        match self.index.observe(self.name(), seq) {
            Ok(Seq::Next) => {}
            Ok(Seq::Duplicate) => {
                tracing::debug!(endpoint = self.name(), seq, "kv-events-duplicate");
                return;
            }
            Ok(Seq::Restart) => {
                self.last = None;
                tracing::info!(endpoint = self.name(), seq, "kv-events-engine-restart");
            }
            Ok(Seq::Gap { from }) => self.recover(from, seq).await,
            Err(_) => return,
        }
        self.apply(seq, payload).await;
    }

    /// Applies batch `seq`, decoded on a blocking-pool thread. A payload that
    /// cannot be read (not a batch, or over a limit) still consumes its
    /// number, and clears the endpoint: what it said, removals too, is unknown.
    async fn apply(&mut self, seq: u64, payload: Bytes) {
        let (index, name, limits, now) = (
            Arc::clone(&self.index),
            self.source.endpoint.clone(),
            self.batch,
            self.now(),
        );
        let done = tokio::task::spawn_blocking(move || {
            let digest = xxh3_64(&payload);
            match decode_batch(&payload, &limits) {
                Ok(batch) => (
                    digest,
                    index.apply(&name, seq, &batch.events, now).ok(),
                    None,
                ),
                Err(refused) => (digest, index.refused(&name, seq, now).ok(), Some(refused)),
            }
        })
        .await;
        let Ok((digest, applied, refused)) = done else {
            return;
        };
        self.last = Some((seq, digest));
        self.heard_at = Instant::now();
        if let Some(refused) = refused {
            self.fault(refused.kind(), &format_args!("batch {seq}: {refused}"));
        }
        let Some(applied) = applied else { return };
        self.switched(applied.revived, "events again");
        for skip in &applied.skipped {
            match skip {
                Skip::Malformed(_) => self.fault("malformed-event", skip),
                // Not a fault: another tier, an evicted parent, a newer tag.
                _ => {
                    if let Some(suppressed) = self.repeats("event-skipped") {
                        tracing::info!(endpoint = self.name(), seq, suppressed, reason = %skip, "kv-event-skipped");
                    }
                }
            }
        }
    }

    /// Replays batches `from..seq` through the replay socket; a gap that
    /// stays open clears the endpoint (`KvIndex::unrecovered`).
    async fn recover(&mut self, from: u64, seq: u64) {
        tracing::debug!(endpoint = self.name(), from, to = seq, "kv-events-gap");
        if self.source.replay.is_some() {
            if let Err(error) = self.replay(from, Some(seq)).await {
                self.replay_failed(&error);
            }
        }
        // Closed: the batch before `seq` is the last applied.
        let last = self.index.stats(self.name()).ok().and_then(|s| s.last_seq);
        if last == seq.checked_sub(1) {
            let _ = self.index.replayed(self.name());
        } else {
            self.fault(
                "gap-unrecovered",
                &format_args!("batches {from} to {} missed", seq - 1),
            );
            let _ = self.index.unrecovered(self.name());
            self.last = None;
        }
    }

    /// Asks the replay socket for the batches from `from` and applies, as
    /// they come, those the index expects (below `until`, the live batch
    /// that showed a gap). With `self.last` at `from`, the first answer must
    /// be that very batch, else the stream has `diverged`.
    async fn replay(&mut self, from: u64, until: Option<u64>) -> Result<Replayed, String> {
        let endpoint = self
            .source
            .replay
            .clone()
            .ok_or("no replay endpoint configured")?;
        if self
            .replay
            .as_ref()
            .is_some_and(|(_, guard)| guard.is_closed())
        {
            self.replay = None; // the engine closed it (a restart): connect again
        }
        if self.replay.is_none() {
            let mut dealer = DealerSocket::new();
            let guard = guard::connect(
                &mut dealer,
                &endpoint,
                self.limits.max_message_bytes,
                CONNECT_TIMEOUT,
            )
            .await?;
            self.replay = Some((dealer, guard));
        }
        let request = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
        let request = ZmqMessage::try_from(request).map_err(|e| e.to_string())?;
        let (dealer, _) = self.replay.as_mut().ok_or("no replay socket")?;
        dealer.send(request).await.map_err(|e| e.to_string())?;
        let check = self.last.filter(|&(seq, _)| seq == from);
        let mut out = Replayed {
            diverged: check.is_some(),
        };
        for answered in 0.. {
            if answered > MAX_REPLAY_BATCHES {
                return Err(format!("more than {MAX_REPLAY_BATCHES} batches replayed"));
            }
            let (dealer, guard) = self.replay.as_mut().ok_or("no replay socket")?;
            let msg = tokio::select! {
                msg = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv()) => msg
                    .map_err(|_| "replay timed out".to_string())?
                    .map_err(|e| e.to_string())?,
                ended = guard.ended() => return Err(match ended {
                    Ended::Cut(cut) => {
                        self.fault("message-too-large", &cut);
                        cut.to_string()
                    }
                    Ended::Closed(why) => why,
                }),
            };
            let Some((rseq, payload)) = replay_answer(&msg.into_vec())? else {
                break;
            };
            if answered == 0 {
                if let Some((seq, digest)) = check {
                    out.diverged = rseq != seq || xxh3_64(&payload) != digest;
                }
            }
            if out.diverged || until.is_some_and(|u| rseq >= u) {
                continue;
            }
            if self.index.expects(self.name(), rseq).unwrap_or(false) {
                self.apply(rseq, payload).await;
            }
        }
        self.heard_at = Instant::now();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &[u8]) -> Bytes {
        Bytes::copy_from_slice(s)
    }

    #[test]
    fn replay_answers_of_vllm_032_and_before_are_read() {
        let seq = 7u64.to_be_bytes();
        let end = (-1i64).to_be_bytes();
        assert_eq!(
            replay_answer(&[b(b""), b(b"kv"), b(&seq), b(b"p")]),
            Ok(Some((7, b(b"p"))))
        );
        assert_eq!(replay_answer(&[b(b""), b(b""), b(&end), b(b"")]), Ok(None));
        assert_eq!(
            replay_answer(&[b(b""), b(&seq), b(b"p")]),
            Ok(Some((7, b(b"p"))))
        );
        assert_eq!(replay_answer(&[b(b""), b(&end), b(b"")]), Ok(None));
        for bad in [
            vec![b(&seq), b(b"p")],
            vec![b(b"x"), b(&seq), b(b"p")],
            vec![b(b""), b(b"kv"), b(b"short"), b(b"p")],
            vec![b(b""), b(b"kv"), b(&(-2i64).to_be_bytes()), b(b"p")],
            vec![b(b""); 5],
        ] {
            assert!(replay_answer(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn addresses_to_connect_to_are_checked() {
        let source = |zmq: &str| KvSourceSpec {
            endpoint: "e".into(),
            zmq: zmq.into(),
            topic: String::new(),
            replay: None,
        };
        for good in [
            "tcp://127.0.0.1:5557",
            "tcp://[::ffff:127.0.0.1]:5557",
            "tcp://[::1]:5557",
            "tcp://engine-0.svc:5557",
        ] {
            assert!(check(&source(good)).is_ok(), "{good}");
        }
        for bad in [
            "tcp://*:5557",
            "tcp://0.0.0.0:5557",
            "tcp://[::]:5557",
            "ipc:///tmp/kv",
            "localhost:5557",
        ] {
            assert!(check(&source(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn limits_are_checked() {
        assert!(PeerLimits::default().check().is_ok());
        for bad in [
            PeerLimits {
                max_message_bytes: 10,
                ..PeerLimits::default()
            },
            PeerLimits {
                max_batch_events: 0,
                ..PeerLimits::default()
            },
            PeerLimits {
                max_batch_blocks: 1 << 30,
                ..PeerLimits::default()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }
}
