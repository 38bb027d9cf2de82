//! The data plane: tokio runtimes owned by the extension, serving Envoy's
//! ext_proc and `grpc.health.v1` on tonic, Prometheus metrics on their own
//! port, a reaper for requests whose response never came back, and the
//! ticker serving flow control's queues while a request waits in one.
//!
//! `worker_threads` is the number of shards: each is a current-thread tokio
//! runtime on a thread of its own, serving the connections it is given
//! (each new connection goes to the shard with the fewest open). A
//! current-thread runtime runs its tasks in the order they were woken, so
//! the answers of all the streams one read of the socket woke are queued
//! before the connection's task runs and writes them: one write carries many
//! answers. (The multi-thread scheduler runs the task a task wakes next, its
//! LIFO slot, which makes that one write per answer, twice the CPU per
//! conversation on loopback.)
//!
//! Work that would hold a shard's thread (tokenizing a long prompt) goes to
//! one blocking pool for all shards (shard 0's `spawn_blocking`), at most as
//! many threads as the machine has cores: CPU-bound work gains nothing from
//! more, and a burst of long prompts queues there instead of stalling every
//! stream.

use std::net::{SocketAddr, TcpListener as StdListener, TcpStream as StdStream};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use futures_util::StreamExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::either::Either;
use tonic::transport::server::Connected;
use tonic_health::ServingStatus;

use super::config::Spec;
use super::engine::{Engine, Shared};
use super::extproc::{current, Current, Processor};
use super::failure::FailureMode;
use super::limits::{Bounded, Overload, StreamCount, MAX_CONNECTIONS};
use super::metrics;
use super::unix_socket::{self, SocketFile};
use crate::calibrate::Calibrator;
use crate::error::{invalid, Result};

/// The services the health service reports as ready: SERVING once every
/// endpoint's state is synced (scraped once, or found unhealthy) and the
/// admission backend is warm (see `warm_admission`), NOT_SERVING from the
/// start of a drain ("" is the server as a whole; `readiness` is
/// the Endpoint Picker Protocol's).
pub const SERVICES: [&str; 4] = [
    "",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
    "routecore.v1.RouteCore",
];
/// SERVING while the process answers, through a drain too (the Endpoint
/// Picker Protocol's liveness).
pub const LIVENESS: &str = "liveness";
/// How often readiness looks at the endpoints' state until it is synced.
const SYNC_POLL: Duration = Duration::from_millis(10);
/// The first wait before warming the admission backend again, and the
/// longest (the wait doubles after each failed try).
const WARM_RETRY: Duration = Duration::from_millis(100);
const WARM_RETRY_MAX: Duration = Duration::from_secs(2);

/// How long the streams ended past the drain's grace get to send their status.
const CLOSE_S: Duration = Duration::from_secs(1);

/// Where and how the data plane listens.
#[derive(Debug, Clone)]
pub struct Listen {
    pub host: String,
    pub port: u16,
    /// None: no metrics listener.
    pub metrics_port: Option<u16>,
    pub worker_threads: usize,
    /// ext_proc on this Unix socket too (`server.unix_socket`), with this mode.
    pub unix_socket: Option<(PathBuf, u32)>,
}

/// One current-thread runtime and the thread that drives it.
struct Shard {
    runtime: Arc<Runtime>,
    halt: watch::Sender<bool>,
    thread: std::thread::JoinHandle<()>,
}

impl Shard {
    fn start() -> Result<Self> {
        let runtime = Arc::new(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .max_blocking_threads(std::thread::available_parallelism().map_or(1, |n| n.get()))
                .build()
                .map_err(|e| invalid(format!("cannot start the runtime: {e}")))?,
        );
        let (halt, mut halted) = watch::channel(false);
        let rt = Arc::clone(&runtime);
        let thread = std::thread::Builder::new()
            .name("routecore-dp".into())
            .spawn(move || {
                rt.block_on(async move {
                    let _ = halted.wait_for(|h| *h).await;
                });
            })
            .map_err(|e| invalid(format!("cannot start the runtime: {e}")))?;
        Ok(Self {
            runtime,
            halt,
            thread,
        })
    }

    /// Stops the driving thread and, when nothing else holds it, the runtime.
    fn stop(self) {
        let _ = self.halt.send(true);
        let _ = self.thread.join();
        if let Ok(rt) = Arc::try_unwrap(self.runtime) {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// Counts a shard's open connections until the connection is dropped.
struct Open(Arc<AtomicUsize>);

impl Open {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(count))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An accepted connection on its way to a shard.
enum Accepted {
    Tcp(StdStream),
    Unix(StdUnixStream),
}

/// A connection's socket, registered with its shard's reactor.
type Io = Either<TcpStream, UnixStream>;

fn registered(accepted: Accepted) -> std::io::Result<Io> {
    match accepted {
        Accepted::Tcp(s) => TcpStream::from_std(s).map(Either::Left),
        Accepted::Unix(s) => UnixStream::from_std(s).map(Either::Right),
    }
}

/// The listeners ext_proc is served on.
enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    async fn accept(&self) -> std::io::Result<Accepted> {
        match self {
            Self::Tcp(l) => {
                let (stream, _) = l.accept().await?;
                let _ = stream.set_nodelay(true);
                stream.into_std().map(Accepted::Tcp)
            }
            Self::Unix(l) => {
                let (stream, _) = l.accept().await?;
                stream.into_std().map(Accepted::Unix)
            }
        }
    }
}

/// A connection served by a shard.
struct Conn {
    io: Io,
    _open: Open,
    /// Its open ext_proc streams (`limits.max_streams_per_connection`).
    streams: StreamCount,
}

impl Connected for Conn {
    /// What each of its requests carries in its extensions.
    type ConnectInfo = StreamCount;

    fn connect_info(&self) -> StreamCount {
        self.streams.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Where the acceptors hand a shard its connections.
#[derive(Clone)]
struct Inbox {
    send: mpsc::UnboundedSender<(Accepted, Open)>,
    open: Arc<AtomicUsize>,
}

/// Accepts connections and gives each to the shard with the fewest open;
/// past `limits.max_connections` open, a new one is closed at once.
async fn accept_forever(
    listener: Listener,
    inboxes: Vec<Inbox>,
    current: Current,
    overload: Arc<Overload>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        let stream = match accepted {
            Ok(stream) => stream,
            Err(e) => {
                // Out of descriptors and the like: try again shortly.
                tracing::warn!(error = %e, "accept-failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let open: usize = inboxes.iter().map(|i| i.open.load(Ordering::Relaxed)).sum();
        let max = super::extproc::current(&current)
            .spec
            .limits
            .max_connections;
        if open as u64 >= max {
            overload.reached(MAX_CONNECTIONS);
            continue; // dropped: closed
        }
        let Some(inbox) = inboxes
            .iter()
            .min_by_key(|i| i.open.load(Ordering::Relaxed))
        else {
            return;
        };
        let _ = inbox.send.send((stream, Open::new(&inbox.open)));
    }
}

pub struct DataPlane {
    /// Shard 0 also runs the acceptor, the metrics listener and the reaper.
    shards: Mutex<Vec<Shard>>,
    pub shared: Arc<Shared>,
    pub current: Current,
    pub port: u16,
    pub metrics_port: Option<u16>,
    /// The ext_proc socket's file, removed when the data plane stops.
    socket_file: Mutex<Option<SocketFile>>,
    stop: watch::Sender<bool>,
    servers: Mutex<Vec<JoinHandle<()>>>,
    /// Ends the streams still open when the drain's grace runs out.
    closing: watch::Sender<bool>,
    health: tonic_health::server::HealthReporter,
    /// Set by the drain; readiness is never reported SERVING after it.
    draining: Arc<tokio::sync::Mutex<bool>>,
    /// Whether `readiness` is reported SERVING (see [`DataPlane::ready`]);
    /// [`DataPlane::wait_ready`] waits on its changes.
    ready: Arc<watch::Sender<bool>>,
}

fn bind(host: &str, port: u16) -> Result<StdListener> {
    let addr: SocketAddr = format!("{host}:{port}")
        .parse()
        .or_else(|_| {
            std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
                .ok()
                .and_then(|mut a| a.next())
                .ok_or(())
        })
        .map_err(|()| invalid(format!("cannot resolve host {host:?}")))?;
    let l =
        StdListener::bind(addr).map_err(|e| invalid(format!("cannot listen on {addr}: {e}")))?;
    l.set_nonblocking(true)
        .map_err(|e| invalid(format!("cannot listen on {addr}: {e}")))?;
    Ok(l)
}

/// glibc's mmap threshold, fixed at its default by [`DataPlane::start`]:
/// each allocation of 128 KiB or more (request bodies, gRPC messages) is
/// mapped on its own and given back to the OS when freed. Left dynamic,
/// glibc raises it to the size of the first such block freed (up to 32 MiB),
/// so that later ones come from the threads' arenas, where freed memory
/// stays in RSS: the peak above idle then depended on which thread freed
/// what (17 to 28 MiB where the documented bound is 30.5 MiB, and once past
/// it, in `tests/test_stream_limits.py`).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 128 << 10;

fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt sets one of malloc's parameters; it takes any value
    // or refuses it (returns 0), and is safe to call from any thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

impl DataPlane {
    /// Builds the engine from `spec`, binds the listeners and starts serving
    /// (glibc's mmap threshold fixed for the process, see [`MMAP_THRESHOLD`]).
    pub fn start(spec: Spec, calibrator: Calibrator, listen: &Listen) -> Result<Self> {
        fix_mmap_threshold();
        let shards = (0..listen.worker_threads.max(1))
            .map(|_| Shard::start())
            .collect::<Result<Vec<_>>>()?;
        match Self::serve(spec, calibrator, listen, &shards) {
            Ok(mut plane) => {
                plane.shards = Mutex::new(shards);
                Ok(plane)
            }
            Err(e) => {
                shards.into_iter().for_each(Shard::stop);
                Err(e)
            }
        }
    }

    fn serve(
        spec: Spec,
        calibrator: Calibrator,
        listen: &Listen,
        shards: &[Shard],
    ) -> Result<Self> {
        let first = &shards[0].runtime;
        let kv_spec = spec.kv_events.clone();
        let kv = super::kv_events::index_for(kv_spec.as_ref())?;
        let shared = Arc::new(Shared::new(calibrator, first.handle().clone()).with_kv(kv));
        let max_message = usize::try_from(spec.limits.max_message_bytes).unwrap_or(usize::MAX);
        let engine = Engine::build(spec, &shared, None)?;
        let current: Current = Arc::new(RwLock::new(engine));
        let grpc = bind(&listen.host, listen.port)?;
        let socket = listen
            .unix_socket
            .as_ref()
            .map(|(path, mode)| unix_socket::bind(path, *mode))
            .transpose()?;
        let port = grpc
            .local_addr()
            .map_err(|e| invalid(e.to_string()))?
            .port();
        let metrics_listener = listen
            .metrics_port
            .map(|p| bind(&listen.host, p))
            .transpose()?;
        let metrics_port = metrics_listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map(|a| a.port());
        let (stop, stopped) = watch::channel(false);
        let (closing, closing_rx) = watch::channel(false);
        let metrics = Arc::clone(&shared.metrics);
        super::kv_events::subscribe(
            kv_spec.as_ref(),
            &shared.kv,
            first.handle(),
            &stopped,
            Arc::new(move |kind| metrics.fault("kv_events", kind)),
        )?;
        let (health, health_service) = tonic_health::server::health_reporter();
        let processor = ExternalProcessorServer::new(Processor {
            current: Arc::clone(&current),
            shared: Arc::clone(&shared),
            closing: closing_rx,
        })
        .max_decoding_message_size(max_message)
        .max_encoding_message_size(max_message);
        // What each stream sends is held in the buffer budget before tonic has it.
        let processor = Bounded::new(processor, &shared.overload);
        let mut inboxes = Vec::new();
        let mut servers = Vec::new();
        for shard in shards {
            let (send, receive) = mpsc::unbounded_channel::<(Accepted, Open)>();
            inboxes.push(Inbox {
                send,
                open: Arc::new(AtomicUsize::new(0)),
            });
            // Registered with the reactor of the shard that polls it.
            let incoming = UnboundedReceiverStream::new(receive).map(|(stream, open)| {
                registered(stream).map(|io| Conn {
                    io,
                    _open: open,
                    streams: StreamCount::default(),
                })
            });
            let mut until = stopped.clone();
            let server = tonic::transport::Server::builder()
                .add_service(health_service.clone())
                .add_service(processor.clone())
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = until.wait_for(|s| *s).await;
                });
            servers.push(shard.runtime.spawn(async move {
                if let Err(e) = server.await {
                    tracing::error!(error = %e, "server-failed");
                }
            }));
        }
        let draining = Arc::new(tokio::sync::Mutex::new(false));
        let ready = Arc::new(watch::Sender::new(false));
        let (socket, socket_file) = socket.map_or((None, None), |(l, f)| (Some(l), Some(f)));
        first.block_on(async {
            health
                .set_service_status(LIVENESS, ServingStatus::Serving)
                .await;
            for name in SERVICES {
                health
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
            tokio::spawn(ready_when_synced(
                Arc::clone(&current),
                health.clone(),
                Arc::clone(&draining),
                Arc::clone(&ready),
                stopped.clone(),
            ));
            let grpc =
                TcpListener::from_std(grpc).map_err(|e| invalid(format!("cannot listen: {e}")))?;
            if let Some(l) = socket {
                let l = UnixListener::from_std(l)
                    .map_err(|e| invalid(format!("cannot listen: {e}")))?;
                tokio::spawn(accept_forever(
                    Listener::Unix(l),
                    inboxes.clone(),
                    Arc::clone(&current),
                    Arc::clone(&shared.overload),
                    stopped.clone(),
                ));
            }
            tokio::spawn(accept_forever(
                Listener::Tcp(grpc),
                inboxes,
                Arc::clone(&current),
                Arc::clone(&shared.overload),
                stopped.clone(),
            ));
            if let Some(l) = metrics_listener {
                let l =
                    TcpListener::from_std(l).map_err(|e| invalid(format!("cannot listen: {e}")))?;
                tokio::spawn(metrics::serve(
                    l,
                    Arc::clone(&shared.metrics),
                    stopped.clone(),
                ));
            }
            tokio::spawn(super::autoscale::autoscale_forever(
                Arc::clone(&current),
                stopped.clone(),
            ));
            tokio::spawn(reap_forever(
                Arc::clone(&shared),
                Arc::clone(&current),
                stopped.clone(),
            ));
            tokio::spawn(Arc::clone(&shared).serve_queues_forever(stopped.clone()));
            Ok::<_, crate::error::Error>(())
        })?;
        Ok(Self {
            shards: Mutex::new(Vec::new()),
            shared,
            current,
            port,
            metrics_port,
            socket_file: Mutex::new(socket_file),
            stop,
            closing,
            servers: Mutex::new(servers),
            health,
            draining,
            ready,
        })
    }

    /// Whether the health service reports `readiness` SERVING: the
    /// endpoints' state is synced and the admission backend warm, and no
    /// drain has started (the RouteCore API's health follows it).
    pub fn ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Waits until the data plane is [ready](Self::ready) (true), or until
    /// `timeout` passes or it stops first (false): what a control plane
    /// awaits instead of polling `ready`. The caller is not a runtime thread.
    pub fn wait_ready(&self, timeout: Option<Duration>) -> bool {
        let (mut ready, mut stop) = (self.ready.subscribe(), self.stop.subscribe());
        let wait = async {
            tokio::select! {
                r = ready.wait_for(|r| *r) => r.is_ok(),
                _ = stop.wait_for(|s| *s) => false,
            }
        };
        self.block_on(async {
            match timeout {
                Some(t) => tokio::time::timeout(t, wait).await.unwrap_or(false),
                None => wait.await,
            }
        })
        .unwrap_or(false)
    }

    pub fn engine(&self) -> Arc<Engine> {
        current(&self.current)
    }

    /// Routes new streams with `spec`; open streams finish on the engine
    /// they started with. In-memory admission state is carried over; a new
    /// Redis backend is warmed at once (one try, beside the first requests:
    /// readiness stays as it is).
    pub fn reload(&self, spec: Spec) -> Result<()> {
        let old = self.engine();
        let engine = Engine::build(spec, &self.shared, Some(&old))?;
        let shards = self.shards.lock().unwrap_or_else(|e| e.into_inner());
        if let (Some(a), Some(shard)) = (engine.admission.clone(), shards.first()) {
            shard.runtime.spawn(async move { a.warm().await });
        }
        drop(shards);
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = engine;
        Ok(())
    }

    /// Runs `f` on the runtime and waits for it (the caller is not a runtime thread).
    pub fn block_on<F: std::future::Future>(&self, f: F) -> Result<F::Output> {
        let shards = self.shards.lock().unwrap_or_else(|e| e.into_inner());
        let handle = shards
            .first()
            .map(|s| s.runtime.handle().clone())
            .ok_or_else(|| invalid("the data plane is stopped"))?;
        drop(shards);
        Ok(handle.block_on(f))
    }

    /// Stops taking new streams, gives open ones `grace_s` seconds to finish,
    /// then ends the rest with UNAVAILABLE (their leases are released) and
    /// stops the runtime.
    pub fn drain(&self, grace_s: f64) {
        let servers = std::mem::take(&mut *self.servers.lock().unwrap_or_else(|e| e.into_inner()));
        let grace = Duration::from_secs_f64(grace_s.clamp(0.0, 86_400.0));
        let health = self.health.clone();
        let draining = Arc::clone(&self.draining);
        let ready = Arc::clone(&self.ready);
        let _ = self.block_on(async {
            *draining.lock().await = true;
            ready.send_replace(false);
            for name in SERVICES {
                health
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
        });
        let _ = self.stop.send(true);
        // A new connection finds no socket file rather than a closed listener.
        drop(
            self.socket_file
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        // Requests waiting in flow control's queues get their refusal now.
        self.shared.drain_queues();
        let closing = &self.closing;
        let _ = self.block_on(async {
            let deadline = tokio::time::Instant::now() + grace;
            for mut task in servers {
                if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                    // Past the grace: the open streams end with a status (not
                    // a torn connection), then the connections close.
                    let _ = closing.send(true);
                    if tokio::time::timeout(CLOSE_S, &mut task).await.is_err() {
                        task.abort();
                        let _ = task.await;
                    }
                }
            }
        });
        // The releases of the streams just ended reach a remote admission
        // backend before the runtime stops (bounded by its flush timeout).
        let _ = self.block_on(self.shared.close());
        self.shared.scraper.stop();
        let shards = std::mem::take(&mut *self.shards.lock().unwrap_or_else(|e| e.into_inner()));
        shards.into_iter().for_each(Shard::stop);
    }
}

impl Drop for DataPlane {
    /// A data plane dropped without `drain` still stops its threads.
    fn drop(&mut self) {
        let shards = std::mem::take(&mut *self.shards.lock().unwrap_or_else(|e| e.into_inner()));
        for shard in shards {
            let _ = shard.halt.send(true);
        }
    }
}

/// Reports the ready services SERVING once the endpoints' state is synced
/// and the admission backend is warm ([`warm_admission`]), unless a drain
/// started first.
async fn ready_when_synced(
    current: Current,
    health: tonic_health::server::HealthReporter,
    draining: Arc<tokio::sync::Mutex<bool>>,
    ready: Arc<watch::Sender<bool>>,
    mut stop: watch::Receiver<bool>,
) {
    let (warm_tx, mut warm) = watch::channel(false);
    tokio::spawn(warm_admission(Arc::clone(&current), warm_tx, stop.clone()));
    let synced = async {
        while !super::extproc::current(&current).synced() {
            tokio::time::sleep(SYNC_POLL).await;
        }
    };
    tokio::select! {
        (warm, ()) = async { tokio::join!(async { warm.wait_for(|w| *w).await.is_ok() }, synced) } => {
            if !warm {
                return; // stopped while warming
            }
        }
        _ = stop.changed() => return,
    }
    let draining = draining.lock().await;
    if !*draining {
        for name in SERVICES {
            health
                .set_service_status(name, ServingStatus::Serving)
                .await;
        }
        ready.send_replace(true);
    }
}

/// Warms the admission backend before readiness (Redis: connected, its
/// scripts loaded, the quotas configured, so the first requests pay none of
/// it), retrying with backoff ([`WARM_RETRY`] doubling up to
/// [`WARM_RETRY_MAX`]) until it is warm. `ready` is set once it is warm, or
/// under `failure_mode: open` after the first try failed: such a replica
/// serves as it would in any outage (admitted unaccounted) while the tries
/// go on; under `closed` it stays NOT_SERVING, since it could only refuse.
async fn warm_admission(
    current: Current,
    ready: watch::Sender<bool>,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = WARM_RETRY;
    loop {
        let admission = super::extproc::current(&current).admission.clone();
        let warm = match &admission {
            Some(a) => a.warm().await,
            None => true,
        };
        let open = admission.is_some_and(|a| a.failure_mode() == Some(FailureMode::Open));
        if warm || open {
            ready.send_replace(true);
        }
        if warm {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(WARM_RETRY_MAX);
    }
}

/// Releases requests whose response never came back, a few times per timeout.
async fn reap_forever(shared: Arc<Shared>, current: Current, mut stop: watch::Receiver<bool>) {
    loop {
        let timeout = super::extproc::current(&current)
            .spec
            .limits
            .request_timeout_s;
        let period = Duration::from_secs_f64((timeout / 4.0).clamp(0.001, 1.0));
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.changed() => return,
        }
        shared.reap();
        // Lost Redis replies are settled as soon as Redis answers again (by
        // the next call, or here once a period passed without one).
        let mut seen: Vec<usize> = Vec::new();
        for engine in shared.engines() {
            if let Some(a) = engine.admission.as_ref() {
                if !seen.contains(&(Arc::as_ptr(a) as usize)) {
                    seen.push(Arc::as_ptr(a) as usize);
                    a.reconcile_idle(period).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::tests::alloc_count::count;
    use crate::serve::extproc::tests::{body, chat, headers, spec};
    use crate::serve::extproc::Conversation;
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProtocolConfiguration};

    /// The messages of one conversation as Envoy sends them with the
    /// shipped examples/envoy.yaml (seen in its ext_proc counters): the
    /// request's headers and body at once (STREAMED, sent without waiting),
    /// then the response's body with usage; each body ends with an empty
    /// chunk of its own, as Envoy's HTTP/1 codec ends a body with a
    /// Content-Length. The request's messages are answered together, then
    /// the response's.
    fn envoy_yaml_conversation() -> [Vec<ProcessingRequest>; 2] {
        let mut h = headers(&[("x-api-key", "demo-kéy".as_bytes())], true, false);
        h.protocol_config = Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Streamed as i32,
            response_body_mode: BodySendMode::Streamed as i32,
            send_body_without_waiting_for_header_response: true,
        });
        let usage = br#"{"usage":{"prompt_tokens":300,"completion_tokens":50}}"#;
        let request = chat(&"hello world ".repeat(80));
        [
            vec![h, body(&request, false, false), body(b"", true, false)],
            vec![body(usage, false, true), body(b"", true, true)],
        ]
    }

    fn calibrator() -> Calibrator {
        Calibrator::new(0.95, 1.0, 4.0, 16).expect("calibrator")
    }

    /// The data plane on a free loopback port, one shard.
    fn one_shard() -> DataPlane {
        one_shard_of(spec())
    }

    /// A data plane of `spec` on a free loopback port, one shard.
    fn one_shard_of(spec: Spec) -> DataPlane {
        let listen = Listen {
            host: "127.0.0.1".into(),
            port: 0,
            metrics_port: None,
            worker_threads: 1,
            unix_socket: None,
        };
        DataPlane::start(spec, calibrator(), &listen).expect("start")
    }

    fn client_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    async fn connect(plane: &DataPlane) -> ExternalProcessorClient<tonic::transport::Channel> {
        let target = format!("http://127.0.0.1:{}", plane.port);
        ExternalProcessorClient::connect(target)
            .await
            .expect("connect")
    }

    /// Allocations per conversation, counted on the thread that serves it
    /// (the one shard: h2, tonic, the service and routecore's conversation
    /// together) and in routecore's [`Conversation`] alone. A measurement,
    /// not a bound: `cargo test --release --features server --lib --
    /// --ignored --nocapture allocations_per_conversation`.
    #[test]
    #[ignore]
    fn allocations_per_conversation() {
        const N: u64 = 2_000;
        let plane = one_shard();
        let shard = plane.shards.lock().expect("shards")[0]
            .runtime
            .handle()
            .clone();
        let client = client_runtime();
        let messages = envoy_yaml_conversation();
        let on_shard = client.block_on(async {
            let mut c = connect(&plane).await;
            let mut one = async || {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let [request, response] = &messages;
                request
                    .iter()
                    .for_each(|m| tx.send(m.clone()).expect("send"));
                let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
                let mut answers = c.process(stream).await.expect("process").into_inner();
                for _ in request {
                    answers.message().await.expect("answer").expect("open");
                }
                for m in response {
                    tx.send(m.clone()).expect("send");
                }
                for _ in response {
                    answers.message().await.expect("answer").expect("open");
                }
                drop(tx);
                while answers.message().await.expect("end").is_some() {}
            };
            for _ in 0..200 {
                one().await; // warm: buffers and tables at their size
            }
            let before = shard.spawn(async { count() }).await.expect("count");
            for _ in 0..N {
                one().await;
            }
            let after = shard.spawn(async { count() }).await.expect("count");
            after - before
        });
        // routecore's own part, on this thread.
        let own = client.block_on(async {
            let shared = Arc::new(Shared::new(calibrator(), tokio::runtime::Handle::current()));
            let engine = Engine::build(spec(), &shared, None).expect("engine");
            let before = count();
            for _ in 0..N {
                let mut conv = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
                for m in messages.iter().flatten() {
                    conv.handle(m).await.expect("answered");
                }
            }
            count() - before
        });
        plane.drain(0.0);
        println!(
            "allocations per conversation (envoy.yaml's messages): {:.1} on the shard \
             (h2, tonic, the service, routecore), {:.1} in routecore's Conversation",
            on_shard as f64 / N as f64,
            own as f64 / N as f64,
        );
    }

    /// A data plane of [`redis_spec`].
    fn redis_plane(url: &str, mode: &str) -> DataPlane {
        one_shard_of(redis_spec(url, mode))
    }

    /// `spec()` with admission in the Redis at `url` (`failure_mode`
    /// `mode`): tenant `demo` holds entitlement `g` of quota `p`.
    fn redis_spec(url: &str, mode: &str) -> Spec {
        let mut spec = spec();
        spec.tenants[0].entitlement = Some("g".into());
        spec.admission = Some(serde_json::json!({"backend": "redis",
            "quotas": [{"name": "p", "tokens_per_s": 1e6, "kv_bytes": 1_i64 << 30,
                        "concurrency": 64}],
            "entitlements": [{"name": "g", "tenant": "demo", "quota": "p",
                              "service_class": "guaranteed", "slo_target_ms": 1000.0,
                              "tokens_per_s": 1e5, "kv_bytes": 1_i64 << 28, "concurrency": 32}],
            "redis": {"url": url, "prefix": "rc", "failure_mode": mode, "socket_timeout_s": 2.0}}));
        spec
    }

    /// Whether `plane` reports `readiness` SERVING (gRPC health, as Envoy asks).
    fn ready(plane: &DataPlane) -> bool {
        use tonic_health::pb::health_check_response::ServingStatus as Status;
        use tonic_health::pb::health_client::HealthClient;
        use tonic_health::pb::HealthCheckRequest;
        client_runtime().block_on(async {
            let channel =
                tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{}", plane.port))
                    .expect("url")
                    .connect()
                    .await
                    .expect("connect");
            let mut c = HealthClient::new(channel);
            let request = HealthCheckRequest {
                service: "readiness".into(),
            };
            let status = c.check(request).await.expect("check").into_inner().status;
            status == Status::Serving as i32
        })
    }

    fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "never: {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the plane's Redis backend is warm.
    fn warm(plane: &DataPlane) -> bool {
        match plane.engine().admission.as_deref() {
            Some(crate::serve::admission::Admission::Redis(r)) => r.warmed(),
            _ => panic!("Redis admission"),
        }
    }

    /// Failed calls to the plane's admission backend so far.
    fn failures(plane: &DataPlane) -> u64 {
        plane
            .engine()
            .admission
            .as_ref()
            .expect("admission")
            .failures()
    }

    /// One request of `demo` through the whole step order, released at once;
    /// the commands Redis ran for it and the connections it accepted meanwhile.
    fn one_request(
        plane: &DataPlane,
        probe: &mut redis::Connection,
    ) -> (std::collections::BTreeMap<String, u64>, u64) {
        use crate::serve::admission::tests::{scripting_since, RedisServer};
        let (calls, connections) = RedisServer::done(probe);
        let engine = plane.engine();
        let body = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}"#;
        let routed = plane
            .block_on(engine.route_body(body, Some(0), &crate::serve::engine::Hints::default()))
            .expect("running")
            .expect("routed")
            .expect("admitted");
        let (after, after_connections) = RedisServer::done(probe);
        assert!(plane.shared.release(routed.id, None));
        (
            scripting_since(&calls, &after),
            after_connections - connections,
        )
    }

    fn admit_alone() -> std::collections::BTreeMap<String, u64> {
        std::collections::BTreeMap::from([("evalsha".to_owned(), 1)])
    }

    #[test]
    fn readiness_waits_for_a_warm_redis_and_the_first_request_pays_no_set_up() {
        use crate::serve::admission::tests::RedisServer;
        let server = RedisServer::start();
        let mut probe = server.probe().expect("probe");
        let plane = redis_plane(&server.url(), "closed");
        eventually("SERVING", || ready(&plane));
        // Reported SERVING only once warm: the quota is configured and the
        // scripts loaded before any request.
        assert!(warm(&plane));
        let configured: i64 = redis::cmd("EXISTS")
            .arg("rc:{p}:quota")
            .query(&mut probe)
            .expect("EXISTS");
        assert_eq!(configured, 1);
        let (calls, connections) = one_request(&plane, &mut probe);
        assert_eq!((calls, connections), (admit_alone(), 0));
        // A reload's new backend is warmed too, before its first request.
        plane
            .reload(redis_spec(&server.url(), "closed"))
            .expect("reload");
        eventually("warm after the reload", || warm(&plane));
        let (calls, connections) = one_request(&plane, &mut probe);
        assert_eq!((calls, connections), (admit_alone(), 0));
        assert_eq!(failures(&plane), 0);
        plane.drain(0.0);
    }

    #[test]
    fn redis_down_at_start_fail_closed_is_not_ready_until_it_is_up_and_warm() {
        use crate::serve::admission::tests::RedisServer;
        let mut server = RedisServer::not_started();
        let plane = redis_plane(&server.url(), "closed");
        // Tried and retried (backoff): not ready, as its requests would all
        // be refused.
        eventually("two failed warm-ups", || failures(&plane) >= 2);
        assert!(!ready(&plane), "SERVING while it can only refuse");
        assert!(!plane.ready());
        assert!(!plane.wait_ready(Some(Duration::from_millis(100))));
        // A waiter is woken by the change (the control plane's health).
        let waiter = std::thread::scope(|s| {
            let waiter = s.spawn(|| plane.wait_ready(Some(Duration::from_secs(60))));
            server.spawn();
            waiter.join().expect("the waiter")
        });
        assert!(waiter, "woken when ready");
        let mut probe = server.probe().expect("probe");
        eventually("SERVING once Redis is up", || ready(&plane));
        // What Python reads agrees with what Envoy is told.
        assert!(plane.ready());
        let (calls, connections) = one_request(&plane, &mut probe);
        assert_eq!((calls, connections), (admit_alone(), 0));
        plane.drain(0.0);
        assert!(!plane.ready(), "ready after the drain");
        assert!(!plane.wait_ready(None), "a drained plane is not waited for");
    }

    #[test]
    fn redis_down_at_start_fail_open_serves_and_warms_when_it_is_up() {
        use crate::serve::admission::tests::RedisServer;
        let mut server = RedisServer::not_started();
        let plane = redis_plane(&server.url(), "open");
        // Ready after its first failed warm-up: admitted unaccounted, as in
        // any outage under fail-open.
        eventually("SERVING", || ready(&plane));
        assert!(failures(&plane) >= 1);
        server.spawn();
        let mut probe = server.probe().expect("probe");
        // Warmed in the background, before any request.
        eventually("warm", || warm(&plane));
        let (calls, connections) = one_request(&plane, &mut probe);
        assert_eq!((calls, connections), (admit_alone(), 0));
        assert!(ready(&plane));
        plane.drain(0.0);
    }
}
