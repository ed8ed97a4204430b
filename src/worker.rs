//! Worker: starts everything `device-list-updater run` needs and stops it
//! cleanly. Tests start workers in-process through [`start`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::bus::publisher::Publisher;
use crate::bus::{self, lease, streams};
use crate::config::Config;
use crate::fetch::federation::{FederationClient, FederationSettings};
use crate::fetch::jobs::{self, Fetcher};
use crate::fetch::retry::RetryPolicy;
use crate::fetch::wake::Wakeups;
use crate::fetch::writer::FetchWriter;
use crate::http::{self, Health};
use crate::ingest::Ingest;
use crate::metrics::Metrics;
use crate::store::Store;

/// Fault injection for crash tests, set with `DLU_FAULT` (never in production).
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// Abort the process right after a batch commits, before publish and ack.
    pub crash_after_commit: bool,
    /// Abort right after events are published, before they leave the outbox.
    pub crash_after_publish: bool,
}

impl Faults {
    /// Reads `DLU_FAULT` (`crash_after_commit` or `crash_after_publish`).
    pub fn from_env() -> Self {
        let value = std::env::var("DLU_FAULT").unwrap_or_default();
        Faults {
            crash_after_commit: value == "crash_after_commit",
            crash_after_publish: value == "crash_after_publish",
        }
    }
}

/// Why the worker could not start. All of these exit with code 2.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// NATS did not answer within the start-up timeout.
    #[error("{0}")]
    Nats(String),
    /// The database did not answer, or migrations failed.
    #[error("{0}")]
    Database(String),
    /// Streams or consumers could not be created.
    #[error("{0}")]
    Bus(String),
    /// The health listener could not bind.
    #[error("cannot listen on {0}: {1}")]
    Http(SocketAddr, std::io::Error),
    /// The federation client could not be set up (key or TLS).
    #[error("{0}")]
    Federation(String),
}

/// A running worker.
pub struct Running {
    shutdown: watch::Sender<bool>,
    tasks: JoinSet<()>,
    /// Where the health listener actually listens (useful with port 0).
    pub http_addr: SocketAddr,
    /// The worker's database handle.
    pub store: Store,
}

impl Running {
    /// Stops pulling, finishes the batch in hand, drains the outbox, and
    /// returns; gives up waiting after `grace`.
    pub async fn stop(mut self, grace: Duration) {
        let _ = self.shutdown.send(true);
        let all = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(grace, all).await.is_err() {
            tracing::warn!("shutdown grace period over; aborting remaining tasks");
            self.tasks.abort_all();
        }
    }
}

/// Connects to the database, retrying until `wait` has passed, and migrates.
pub async fn open_store(url: &str, wait: Duration) -> Result<Store, StartError> {
    let deadline = tokio::time::Instant::now() + wait;
    let store = loop {
        match Store::connect(url).await {
            Ok(store) => break store,
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(StartError::Database(format!(
                    "cannot connect to the database: {e}"
                )));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    };
    store
        .migrate()
        .await
        .map_err(|e| StartError::Database(format!("migrations failed: {e}")))?;
    Ok(store)
}

/// Starts a worker.
pub async fn start(config: Config, faults: Faults) -> Result<Running, StartError> {
    let client = bus::connect(&config.nats_url, config.startup_timeout)
        .await
        .map_err(StartError::Nats)?;
    let store = open_store(&config.database_url, config.startup_timeout).await?;
    let instance_id = store
        .instance_id()
        .await
        .map_err(|e| StartError::Database(e.to_string()))?;
    let js = jetstream::new(client.clone());
    let inputs = streams::ensure_all(&js, &config.input.all())
        .await
        .map_err(StartError::Bus)?;
    let settings = streams::InputConsumerSettings {
        max_deliver: config.max_deliver,
        max_ack_pending: (config.batch_size * 4).max(1000) as i64,
        ack_wait: config.ack_wait,
    };
    let mut consumers = Vec::new();
    for (stream, subjects) in &inputs {
        let consumer = streams::input_consumer(&js, stream, subjects, &settings)
            .await
            .map_err(StartError::Bus)?;
        consumers.push((stream.clone(), consumer));
    }
    let fetch_consumer = jobs::consumer(&js, config.ack_wait)
        .await
        .map_err(StartError::Bus)?;
    let key = config
        .signing_key
        .key_pair()
        .map_err(|e| StartError::Federation(e.to_string()))?;
    let federation = FederationClient::new(FederationSettings {
        origin: config.server_name.clone(),
        key,
        overrides: config.federation_overrides.clone(),
        timeout: config.federation_timeout,
    })
    .map_err(StartError::Federation)?;
    let leases = lease::bucket(&js, config.lease_ttl)
        .await
        .map_err(StartError::Bus)?;
    let listener = TcpListener::bind(config.http_addr)
        .await
        .map_err(|e| StartError::Http(config.http_addr, e))?;
    let http_addr = listener
        .local_addr()
        .map_err(|e| StartError::Http(config.http_addr, e))?;

    let (shutdown, stop) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let metrics = Metrics::new();
    let federation = Arc::new(federation);
    let health = Health {
        nats: client.clone(),
        js: js.clone(),
        store: store.clone(),
        metrics: metrics.clone(),
        federation: federation.clone(),
    };
    tasks.spawn(http::serve(listener, health, stop.clone()));
    let (publisher, outbox) = Publisher::new(
        store.clone(),
        js.clone(),
        instance_id,
        faults,
        metrics.clone(),
    );
    let fetcher = Fetcher {
        js: js.clone(),
        store: store.clone(),
        client: federation,
        policy: RetryPolicy {
            min: config.retry_min,
            max: config.retry_max,
        },
        max_devices: config.max_devices,
        concurrency: config.fetch_concurrency,
        writer: FetchWriter::start(store.clone(), config.max_devices, outbox.clone()),
        ack_wait: config.ack_wait,
        metrics: metrics.clone(),
    };
    tasks.spawn(fetcher.run(fetch_consumer, stop.clone()));
    let wakeups = Wakeups::default();
    tasks.spawn(wakeups.clone().run(
        store.clone(),
        js.clone(),
        config.retry_min,
        metrics.clone(),
        stop.clone(),
    ));
    let rpc = crate::rpc::Rpc {
        client: client.clone(),
        js: js.clone(),
        store: store.clone(),
        own_server: config.server_name.clone(),
        wakeups: wakeups.clone(),
    };
    let rpc = rpc.subscribe().await.map_err(StartError::Bus)?;
    tasks.spawn(rpc.run(stop.clone()));
    tasks.spawn(rescan_stale(
        js.clone(),
        store.clone(),
        config.startup_spread,
        stop.clone(),
    ));
    let ingest = Ingest {
        js: js.clone(),
        store: store.clone(),
        own_server: config.server_name.clone(),
        subjects: config.input.clone(),
        batch_size: config.batch_size,
        max_deliver: config.max_deliver,
        outbox,
        faults,
        leases,
        lease_ttl: config.lease_ttl,
        ack_wait: config.ack_wait,
        metrics,
        wakeups,
    };
    for (stream, consumer) in consumers {
        tasks.spawn(ingest.clone().run(stream, consumer, stop.clone()));
    }
    // Ends after the ingest loops (the last outbox handles) have stopped.
    tasks.spawn(publisher.run());
    drop(stop);
    tracing::info!(%http_addr, server_name = %config.server_name, "worker started");
    Ok(Running {
        shutdown,
        tasks,
        http_addr,
        store,
    })
}

/// Start-up rescan (SPEC §5.2): enqueues a fetch job for every server that
/// still has stale users, spread evenly over `spread` so a restart does not
/// hit every remote server at once. Jobs already queued are refused by the
/// stream, so replicas starting together do no double work.
async fn rescan_stale(
    js: jetstream::Context,
    store: Store,
    spread: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let servers = match store.servers_with_stale_users().await {
        Ok(servers) => servers,
        Err(e) => {
            tracing::warn!(error = %e, "start-up rescan failed; stale users wait for their next update");
            return;
        }
    };
    let servers: Vec<ruma::OwnedServerName> = servers
        .into_iter()
        .filter_map(|s| ruma::OwnedServerName::try_from(s).ok())
        .collect();
    if servers.is_empty() {
        return;
    }
    tracing::info!(
        servers = servers.len(),
        ?spread,
        "fetching users still stale from before the start"
    );
    let step = spread / u32::try_from(servers.len()).unwrap_or(u32::MAX);
    for (i, server) in servers.iter().enumerate() {
        if i > 0 && !step.is_zero() {
            // Pacing, not synchronisation: the spread is the point.
            tokio::select! {
                () = tokio::time::sleep(step) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
        if let Err(e) = crate::bus::fetch_jobs::enqueue(&js, [server]).await {
            tracing::warn!(error = %e, %server, "start-up rescan could not enqueue a job");
        }
    }
}
