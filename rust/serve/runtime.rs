//! The data plane: a tokio runtime owned by the extension, serving Envoy's
//! ext_proc and `grpc.health.v1` on tonic, Prometheus metrics on their own
//! port, and a reaper for requests whose response never came back.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use super::config::Spec;
use super::engine::{Engine, Shared};
use super::extproc::{current, Current, Processor};
use super::metrics;
use crate::calibrate::Calibrator;
use crate::error::{invalid, Result};

/// The services the health service reports on ("" is the server as a whole).
pub const SERVICES: [&str; 3] = [
    "",
    "envoy.service.ext_proc.v3.ExternalProcessor",
    "routecore.v1.RouteCore",
];

/// Where and how the data plane listens.
#[derive(Debug, Clone)]
pub struct Listen {
    pub host: String,
    pub port: u16,
    /// None: no metrics listener.
    pub metrics_port: Option<u16>,
    pub worker_threads: usize,
}

pub struct DataPlane {
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    pub shared: Arc<Shared>,
    pub current: Current,
    pub port: u16,
    pub metrics_port: Option<u16>,
    stop: watch::Sender<bool>,
    server: Mutex<Option<JoinHandle<()>>>,
    health: tonic_health::server::HealthReporter,
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

impl DataPlane {
    /// Builds the engine from `spec`, binds the listeners and starts serving.
    pub fn start(spec: Spec, calibrator: Calibrator, listen: &Listen) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(listen.worker_threads.max(1))
            .thread_name("routecore-dp")
            .enable_all()
            .build()
            .map_err(|e| invalid(format!("cannot start the runtime: {e}")))?;
        let kv_spec = spec.kv_events.clone();
        let kv = crate::kv::index_for(kv_spec.as_ref())?;
        let shared = Arc::new(Shared::new(calibrator, runtime.handle().clone()).with_kv(kv));
        let max_message = usize::try_from(spec.limits.max_message_bytes).unwrap_or(usize::MAX);
        let engine = Engine::build(spec, &shared, None)?;
        let current: Current = Arc::new(RwLock::new(engine));
        let grpc = bind(&listen.host, listen.port)?;
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
        crate::kv::subscribe(kv_spec.as_ref(), &shared.kv, runtime.handle(), &stopped)?;
        let (health, health_service) = tonic_health::server::health_reporter();
        let server = runtime.block_on(async {
            for name in SERVICES {
                health
                    .set_service_status(name, ServingStatus::Serving)
                    .await;
            }
            let incoming = TcpIncoming::from(
                tokio::net::TcpListener::from_std(grpc)
                    .map_err(|e| invalid(format!("cannot listen: {e}")))?,
            )
            .with_nodelay(Some(true));
            let processor = ExternalProcessorServer::new(Processor {
                current: Arc::clone(&current),
                shared: Arc::clone(&shared),
            })
            .max_decoding_message_size(max_message)
            .max_encoding_message_size(max_message);
            let mut until = stopped.clone();
            let server = tonic::transport::Server::builder()
                .add_service(health_service)
                .add_service(processor)
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = until.wait_for(|s| *s).await;
                });
            let task = tokio::spawn(async move {
                if let Err(e) = server.await {
                    tracing::error!(error = %e, "server-failed");
                }
            });
            if let Some(l) = metrics_listener {
                let l = tokio::net::TcpListener::from_std(l)
                    .map_err(|e| invalid(format!("cannot listen: {e}")))?;
                tokio::spawn(metrics::serve(
                    l,
                    Arc::clone(&shared.metrics),
                    stopped.clone(),
                ));
            }
            tokio::spawn(reap_forever(
                Arc::clone(&shared),
                Arc::clone(&current),
                stopped.clone(),
            ));
            Ok::<_, crate::error::Error>(task)
        })?;
        Ok(Self {
            runtime: Mutex::new(Some(runtime)),
            shared,
            current,
            port,
            metrics_port,
            stop,
            server: Mutex::new(Some(server)),
            health,
        })
    }

    pub fn engine(&self) -> Arc<Engine> {
        current(&self.current)
    }

    /// Routes new streams with `spec`; open streams finish on the engine
    /// they started with. In-memory admission state is carried over.
    pub fn reload(&self, spec: Spec) -> Result<()> {
        let old = self.engine();
        let engine = Engine::build(spec, &self.shared, Some(&old))?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = engine;
        Ok(())
    }

    /// Runs `f` on the runtime and waits for it (the caller is not a runtime thread).
    pub fn block_on<F: std::future::Future>(&self, f: F) -> Result<F::Output> {
        let guard = self.runtime.lock().unwrap_or_else(|e| e.into_inner());
        let rt = guard
            .as_ref()
            .ok_or_else(|| invalid("the data plane is stopped"))?;
        let handle = rt.handle().clone();
        drop(guard);
        Ok(handle.block_on(f))
    }

    /// Stops taking new streams, gives open ones `grace_s` seconds to finish,
    /// then ends the rest (their leases are released) and stops the runtime.
    pub fn drain(&self, grace_s: f64) {
        let task = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        let grace = Duration::from_secs_f64(grace_s.clamp(0.0, 3600.0));
        let health = self.health.clone();
        let _ = self.block_on(async {
            for name in SERVICES {
                health
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
        });
        let _ = self.stop.send(true);
        if let Some(mut task) = task {
            let _ = self.block_on(async {
                if tokio::time::timeout(grace, &mut task).await.is_err() {
                    task.abort();
                    let _ = task.await;
                }
            });
        }
        let runtime = self
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(rt) = runtime {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
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
        // Lost Redis replies are settled as soon as Redis answers again.
        let mut seen: Vec<usize> = Vec::new();
        for engine in shared.engines() {
            if let Some(a) = engine.admission.as_ref() {
                if !seen.contains(&(Arc::as_ptr(a) as usize)) {
                    seen.push(Arc::as_ptr(a) as usize);
                    a.reconcile().await;
                }
            }
        }
    }
}
