//! One subscriber task per endpoint, on the data plane's tokio runtime: a
//! ZeroMQ SUB socket (the pure-Rust `zeromq` crate) on the engine's KV-event
//! PUB socket, and a DEALER on its replay ROUTER socket, used when a sequence
//! gap is seen (request: `["", start_seq as 8 bytes big-endian]`; answers:
//! `["", seq, payload]` for each buffered batch from `start_seq` on, then
//! `["", -1, ""]`). Every decision about a batch is `KvIndex`'s; this file
//! moves frames and logs what changed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::decode::{decode_batch, decode_seq};
use super::index::{KvIndex, Seq};

/// One endpoint's event source (the serve config's `kv_events` of an endpoint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub endpoint: String,
    /// The engine's PUB address, e.g. `tcp://10.0.0.5:5557`.
    pub zmq: String,
    pub topic: String,
    /// The engine's replay ROUTER address; None: gaps are not recovered.
    pub replay: Option<String>,
}

/// Checks a source's addresses (`tcp://host:port`): a clear error naming
/// the key, before any task starts.
pub fn check(source: &Source) -> crate::error::Result<()> {
    for (key, addr) in [
        ("zmq", Some(&source.zmq)),
        ("replay", source.replay.as_ref()),
    ] {
        if let Some(addr) = addr {
            addr.parse::<zeromq::Endpoint>().map_err(|e| {
                crate::error::invalid(format!(
                    "kv_events.{key}: {addr:?} is not a ZeroMQ address (tcp://host:port): {e}"
                ))
            })?;
        }
    }
    Ok(())
}

/// How long one connect attempt, and one replay answer, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest pause between two connect attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Skips logged per batch (the rest are counted).
const SKIPS_LOGGED: usize = 3;

/// Starts one subscriber per source on `runtime`; each ends when `stop` turns true.
pub fn spawn(
    runtime: &tokio::runtime::Handle,
    index: &Arc<KvIndex>,
    sources: &[Source],
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
                    epoch: Instant::now(),
                    replay: None,
                }
                .run(stop.clone()),
            )
        })
        .collect()
}

struct Subscriber {
    index: Arc<KvIndex>,
    source: Source,
    epoch: Instant,
    replay: Option<DealerSocket>,
}

async fn connect<S: Socket>(socket: &mut S, endpoint: &str) -> Result<(), String> {
    match tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(endpoint)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("connect timed out".into()),
    }
}

impl Subscriber {
    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    fn name(&self) -> &str {
        &self.source.endpoint
    }

    /// Logs a switch between the precise index and the approximate fallback.
    fn switched(&self, changed: bool, why: &str) {
        if changed {
            let live = self
                .index
                .stats(self.name())
                .map(|s| s.live)
                .unwrap_or(false);
            tracing::info!(
                endpoint = self.name(),
                live,
                why,
                "kv-events-{}",
                if live { "precise" } else { "fallback" }
            );
        }
    }

    fn set_connected(&self, connected: bool, why: &str) {
        let changed = self
            .index
            .set_connected(self.name(), connected)
            .unwrap_or(false);
        self.switched(changed, why);
    }

    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Duration::from_millis(100);
        let mut warned = false;
        loop {
            if *stop.borrow() {
                return;
            }
            let mut sub = SubSocket::new();
            let mut monitor = sub.monitor();
            let connected = match connect(&mut sub, &self.source.zmq).await {
                Ok(()) => sub
                    .subscribe(&self.source.topic)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e),
            };
            if let Err(error) = connected {
                if !warned {
                    tracing::warn!(endpoint = self.name(), zmq = %self.source.zmq, %error, "kv-events-connect-failed");
                    warned = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stop.changed() => return,
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            warned = false;
            backoff = Duration::from_millis(100);
            self.set_connected(true, "connected");
            let period = self
                .index
                .config()
                .stale_after_s
                .map_or(Duration::from_secs(1), |s| {
                    Duration::from_secs_f64((s / 4.0).clamp(0.01, 1.0))
                });
            let mut tick = tokio::time::interval(period);
            let mut monitoring = true;
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    msg = sub.recv() => match msg {
                        Ok(msg) => self.receive(msg).await,
                        Err(error) => {
                            tracing::warn!(endpoint = self.name(), %error, "kv-events-receive-failed");
                            self.set_connected(false, "receive failed");
                            break;
                        }
                    },
                    event = monitor.next(), if monitoring => match event {
                        Some(SocketEvent::Disconnected(_)) => self.set_connected(false, "disconnected"),
                        Some(SocketEvent::Connected(..)) => self.set_connected(true, "reconnected"),
                        Some(_) => {}
                        None => monitoring = false,
                    },
                    _ = tick.tick() => {
                        let changed = self.index.check_stale(self.name(), self.now()).unwrap_or(false);
                        self.switched(changed, "no events");
                    }
                }
            }
        }
    }

    /// One `(topic, seq, payload)` message from the PUB socket.
    async fn receive(&mut self, msg: ZmqMessage) {
        let frames = msg.into_vec();
        let (seq, payload) = match frames.as_slice() {
            [_topic, seq, payload] => (decode_seq(seq), payload.clone()),
            _ => (None, Bytes::new()),
        };
        let Some(seq) = seq.and_then(|s| u64::try_from(s).ok()) else {
            tracing::warn!(
                endpoint = self.name(),
                frames = frames.len(),
                "kv-events-garbage-frame"
            );
            let _ = self.index.garbage(self.name());
            return;
        };
        self.set_connected(true, "event");
        match self.index.observe(self.name(), seq) {
            Ok(Seq::Next) => {}
            Ok(Seq::Duplicate) => {
                tracing::debug!(endpoint = self.name(), seq, "kv-events-duplicate");
                return;
            }
            Ok(Seq::Restart) => {
                tracing::info!(endpoint = self.name(), seq, "kv-events-engine-restart");
            }
            Ok(Seq::Gap { from }) => self.recover(from, seq).await,
            Err(_) => return,
        }
        self.apply(seq, &payload);
    }

    /// Applies batch `seq`: a payload that is not a batch still consumes its
    /// number (counted as garbage), so it is not taken for a gap.
    fn apply(&self, seq: u64, payload: &[u8]) {
        let applied = match decode_batch(payload) {
            Ok(batch) => self
                .index
                .apply(self.name(), seq, &batch.events, self.now()),
            Err(error) => {
                tracing::warn!(endpoint = self.name(), seq, %error, "kv-events-garbage-batch");
                let _ = self.index.garbage(self.name());
                self.index.apply(self.name(), seq, &[], self.now())
            }
        };
        let Ok(applied) = applied else { return };
        self.switched(applied.revived, "events again");
        for skip in applied.skipped.iter().take(SKIPS_LOGGED) {
            tracing::warn!(endpoint = self.name(), seq, reason = %skip, "kv-event-skipped");
        }
    }

    /// Replays batches `from..seq` through the replay socket; a gap that
    /// stays open clears the endpoint (`KvIndex::unrecovered`).
    async fn recover(&mut self, from: u64, seq: u64) {
        tracing::info!(endpoint = self.name(), from, to = seq, "kv-events-gap");
        if let Err(error) = self.replay(from, seq).await {
            tracing::warn!(endpoint = self.name(), %error, "kv-events-replay-failed");
            self.replay = None;
        }
        let closed = self.index.expects(self.name(), seq).unwrap_or(false);
        let _ = if closed {
            self.index.replayed(self.name())
        } else {
            tracing::warn!(
                endpoint = self.name(),
                from,
                to = seq,
                "kv-events-gap-unrecovered"
            );
            self.index.unrecovered(self.name())
        };
    }

    async fn replay(&mut self, from: u64, seq: u64) -> Result<(), String> {
        let Some(endpoint) = self.source.replay.clone() else {
            return Err("no replay endpoint configured".into());
        };
        if self.replay.is_none() {
            let mut dealer = DealerSocket::new();
            connect(&mut dealer, &endpoint).await?;
            self.replay = Some(dealer);
        }
        let dealer = self.replay.as_mut().ok_or("no replay socket")?;
        let request = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
        let request = ZmqMessage::try_from(request).map_err(|e| e.to_string())?;
        dealer.send(request).await.map_err(|e| e.to_string())?;
        let mut answers = Vec::new();
        loop {
            let msg = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
                .await
                .map_err(|_| "replay timed out".to_string())?
                .map_err(|e| e.to_string())?;
            let frames = msg.into_vec();
            let (rseq, payload) = match frames.as_slice() {
                [empty, rseq, payload] if empty.is_empty() => (decode_seq(rseq), payload.clone()),
                [rseq, payload] => (decode_seq(rseq), payload.clone()),
                _ => return Err(format!("a replay answer of {} frames", frames.len())),
            };
            match rseq {
                Some(r) if r >= 0 && !payload.is_empty() => answers.push((r as u64, payload)),
                // The end marker: (-1, b"").
                _ => break,
            }
        }
        for (rseq, payload) in answers {
            if rseq < seq && self.index.expects(self.name(), rseq).unwrap_or(false) {
                self.apply(rseq, &payload);
            }
        }
        Ok(())
    }
}
