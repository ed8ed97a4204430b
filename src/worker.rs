//! Worker: starts everything `device-list-updater run` needs and stops it
//! cleanly. Tests start workers in-process through [`start`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use sea_orm::DbErr;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::bus::publisher::Publisher;
use crate::bus::{self, BusError, fetch_jobs, lease, streams};
use crate::config::Config;
use crate::fetch::federation::{ClientError, FederationClient, FederationSettings};
use crate::fetch::give_way::IngestBacklog;
use crate::fetch::jobs::Fetcher;
use crate::fetch::queue::FetchQueue;
use crate::fetch::retry::RetryPolicy;
use crate::fetch::wake::Wakeups;
use crate::fetch::writer::FetchWriter;
use crate::http::{self, Health};
use crate::ingest::Ingest;
use crate::metrics::Metrics;
use crate::shutdown::{Shutdown, ShutdownTrigger};
use crate::signing_key::KeyError;
use crate::store::Store;

/// Why the worker could not start. All of these exit with code 2.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// NATS did not answer, or streams, consumers or subscriptions could not
    /// be set up.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The database did not answer within the start-up wait.
    #[error("cannot connect to the database: {0}")]
    Database(#[source] DbErr),
    /// Migrations failed.
    #[error("migrations failed: {0}")]
    Migrations(#[source] DbErr),
    /// The health listener could not bind.
    #[error("cannot listen on {0}: {1}")]
    Http(SocketAddr, #[source] std::io::Error),
    /// The signing key is not a usable ed25519 key.
    #[error("signing key: {0}")]
    Key(#[from] KeyError),
    /// The federation client could not be set up (DNS or TLS).
    #[error(transparent)]
    Federation(#[from] ClientError),
}

/// A running worker.
pub struct Running {
    shutdown: ShutdownTrigger,
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
        self.shutdown.trigger();
        let all = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(grace, all).await.is_err() {
            tracing::warn!("shutdown grace period over; aborting remaining tasks");
            self.tasks.abort_all();
        }
    }
}

/// Connects to the database, retrying until `wait` has passed, and migrates.
pub async fn open_store(url: &str, wait: Duration) -> Result<Store, StartError> {
    let store = Store::connect_within(url, wait)
        .await
        .map_err(StartError::Database)?;
    store.migrate().await.map_err(StartError::Migrations)?;
    Ok(store)
}

/// Starts a worker.
pub async fn start(config: Config) -> Result<Running, StartError> {
    let Config {
        server_name,
        signing_key,
        settings,
    } = config;
    let faults = settings.faults();
    let client = bus::connect(&settings.nats(), settings.startup_timeout).await?;
    let store = open_store(&settings.database_url, settings.startup_timeout).await?;
    let store = match settings.membership.is_on() {
        true => store.with_membership(server_name.clone()),
        false => store,
    };
    let instance_id = store.instance_id().await.map_err(StartError::Database)?;
    let js = jetstream::new(client.clone());
    let subjects = settings.input_subjects();
    let streams::Ensured {
        inputs,
        mut warnings,
    } = streams::ensure_all(&js, &subjects.all(), settings.stream_replicas).await?;
    let consumer_settings = streams::InputConsumerSettings {
        max_deliver: settings.max_deliver,
        max_ack_pending: (settings.batch_size * 4).max(1000) as i64,
        ack_wait: settings.ack_wait,
    };
    let mut consumers = Vec::new();
    for (stream, stream_subjects) in &inputs {
        let consumer =
            streams::input_consumer(&js, stream, stream_subjects, &consumer_settings).await?;
        consumers.push((stream.clone(), consumer));
    }
    let fetch_consumer = fetch_jobs::consumer(&js, settings.ack_wait).await?;
    let federation = FederationClient::new(FederationSettings {
        origin: server_name.clone(),
        key: signing_key.key_pair()?,
        overrides: settings.federation_overrides.clone(),
        timeout: settings.federation_timeout,
    })?;
    let leases = lease::bucket(&js, settings.lease_ttl, settings.stream_replicas).await?;
    // A KV bucket is a stream named after it.
    let lease_stream = format!("KV_{}", lease::BUCKET);
    warnings.extend(streams::replica_warning(&js, &lease_stream, settings.stream_replicas).await);
    for warning in &warnings {
        tracing::warn!("{warning}");
    }
    let listener = TcpListener::bind(settings.http_addr)
        .await
        .map_err(|e| StartError::Http(settings.http_addr, e))?;
    let http_addr = listener
        .local_addr()
        .map_err(|e| StartError::Http(settings.http_addr, e))?;

    let (trigger, shutdown) = Shutdown::new();
    let mut tasks = JoinSet::new();
    let metrics = Metrics::new();
    let federation = Arc::new(federation);
    let health = Health {
        nats: client.clone(),
        js: js.clone(),
        store: store.clone(),
        metrics: metrics.clone(),
        federation: federation.clone(),
        warnings: Arc::new(warnings),
    };
    tasks.spawn(http::serve(listener, health, shutdown.clone()));
    let (publisher, outbox) = Publisher::new(
        store.clone(),
        js.clone(),
        instance_id,
        faults,
        metrics.clone(),
    );
    let (writer, writer_task) =
        FetchWriter::new(store.clone(), settings.max_devices, outbox.clone());
    // Ends once the fetcher (its last handle) has stopped and what it
    // handed over is stored.
    tasks.spawn(writer_task);
    let backlog = IngestBacklog::new(settings.fetch_concurrency);
    let fetcher = Fetcher {
        js: js.clone(),
        store: store.clone(),
        client: federation,
        policy: RetryPolicy {
            min: settings.retry_min,
            max: settings.retry_max,
        },
        concurrency: settings.fetch_concurrency,
        writer,
        ack_wait: settings.ack_wait,
        metrics: metrics.clone(),
        backlog: backlog.clone(),
    };
    tasks.spawn(fetcher.run(fetch_consumer, shutdown.clone()));
    let wakeups = Wakeups::default();
    tasks.spawn(wakeups.clone().run(
        store.clone(),
        js.clone(),
        settings.retry_min,
        metrics.clone(),
        shutdown.clone(),
    ));
    let queue = FetchQueue::new(js.clone(), wakeups);
    let rpc = crate::rpc::Rpc {
        client: client.clone(),
        store: store.clone(),
        own_server: server_name.clone(),
        queue: queue.clone(),
    };
    let rpc = rpc.subscribe().await?;
    tasks.spawn(rpc.run(shutdown.clone()));
    tasks.spawn(rescan_stale(
        queue.clone(),
        store.clone(),
        settings.startup_spread,
        shutdown.clone(),
    ));
    let sweeps = Arc::new(tokio::sync::Notify::new());
    if settings.membership.is_on() {
        let sweeper = crate::sweep::Sweeper {
            store: store.clone(),
            queue: queue.clone(),
            wake: sweeps.clone(),
            metrics: metrics.clone(),
            faults,
        };
        tasks.spawn(sweeper.run(shutdown.clone()));
    }
    let ingest = Ingest {
        js: js.clone(),
        store: store.clone(),
        own_server: server_name.clone(),
        subjects,
        batch_size: settings.batch_size,
        max_deliver: settings.max_deliver,
        outbox,
        faults,
        leases,
        lease_ttl: settings.lease_ttl,
        ack_wait: settings.ack_wait,
        metrics,
        queue,
        membership: settings.membership.is_on(),
        member_keys: settings.msc4430.is_on(),
        sweeps,
        backlog,
    };
    for (stream, consumer) in consumers {
        tasks.spawn(ingest.clone().run(stream, consumer, shutdown.clone()));
    }
    // Ends after the ingest loops and the fetch writer (the last outbox
    // handles) have stopped.
    tasks.spawn(publisher.run());
    tracing::info!(%http_addr, %server_name, "worker started");
    Ok(Running {
        shutdown: trigger,
        tasks,
        http_addr,
        store,
    })
}

/// Start-up rescan (SPEC §5.2): hands every server that still has stale
/// users to the fetch queue (a parked job with a user due runs now), spread evenly over `spread` so a restart does not
/// hit every remote server at once. Jobs already queued are refused by the
/// stream, so replicas starting together do no double work.
async fn rescan_stale(queue: FetchQueue, store: Store, spread: Duration, stop: Shutdown) {
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
                () = stop.requested() => return,
            }
        }
        if let Err(e) = queue.stale([server]).await {
            tracing::warn!(error = %e, %server, "start-up rescan could not enqueue a job");
        }
    }
}
