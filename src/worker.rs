//! Worker: starts everything `device-list-updater run` needs and stops it
//! cleanly. Tests start workers in-process through [`start`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use ruma::OwnedServerName;
use sea_orm::DbErr;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::bus::publisher::{OutboxHandle, Publisher};
use crate::bus::{self, BusError, streams};
use crate::config::{Config, Settings};
use crate::faults::Faults;
use crate::fetch::error::ClientError;
use crate::fetch::federation::{FederationClient, FederationSettings};
use crate::fetch::give_way::IngestBacklog;
use crate::fetch::jobs::Fetcher;
use crate::fetch::jobs::USERS_PER_ROUND;
use crate::fetch::jobs::follow_up::FollowUps;
use crate::fetch::jobs::starts::JobStarts;
use crate::fetch::queue::FetchQueue;
use crate::fetch::retry::RetryPolicy;
use crate::fetch::wake::{WakeChecker, Wakeups};
use crate::fetch::writer::FetchWriter;
use crate::http::{self, Health};
use crate::ingest::{Feed, Ingest, PartitionDealer, Presence};
use crate::input::Tracking;
use crate::metrics::Metrics;
use crate::server_key::KeyError;
use crate::shutdown::{Shutdown, ShutdownTrigger};
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

/// What the worker connects to and sets up before any task starts; any
/// failure here stops the start (exit 2).
struct Connected {
    client: async_nats::Client,
    js: jetstream::Context,
    store: Store,
    instance_id: String,
    inputs: Inputs,
    fetch_consumer: jetstream::consumer::PullConsumer,
    federation: Arc<FederationClient>,
    leases: jetstream::kv::Store,
    listener: TcpListener,
    http_addr: SocketAddr,
    warnings: Vec<String>,
}

/// The input streams' consumers and what their ingest needs to know of
/// partitions (SPEC §4.5).
struct Inputs {
    /// One pull consumer per input stream, with the stream's name.
    consumers: Vec<(String, jetstream::consumer::PullConsumer)>,
    /// `DLU_INPUT_PARTITIONS`.
    partitions: u16,
    /// The partition-count bucket, once any replica has used input
    /// partitions.
    counts: Option<jetstream::kv::Store>,
    /// Settings of the input and partition consumers.
    consumer_settings: streams::InputConsumerSettings,
}

/// Starts a worker: connects, then starts its tasks, in this order.
pub async fn start(config: Config) -> Result<Running, StartError> {
    let tracking = config.settings.tracking_for(&config.server_name);
    let connected = connect(&config, tracking.clone()).await?;
    let (trigger, shutdown) = Shutdown::new();
    let mut tasks = Tasks {
        set: JoinSet::new(),
        shutdown,
        metrics: Metrics::new(),
        faults: config.settings.faults(),
        store: connected.store.clone(),
        js: connected.js.clone(),
    };
    let settings = &config.settings;
    let Connected {
        client,
        instance_id,
        inputs,
        fetch_consumer,
        federation,
        leases,
        listener,
        http_addr,
        warnings,
        ..
    } = connected;
    tasks.health_listener(listener, client.clone(), federation.clone(), warnings);
    let (publisher, outbox) = tasks.outbox_publisher(instance_id);
    let backlog = IngestBacklog::new(settings.fetch_concurrency);
    let queue = tasks.fetching(
        settings,
        federation,
        fetch_consumer,
        outbox.clone(),
        backlog.clone(),
    );
    tasks
        .rpc(client, &config.server_name, queue.clone())
        .await?;
    tasks.startup_rescan(queue.clone(), settings.startup_spread);
    let replica = replica_id();
    tasks.revalidation(queue.clone(), settings, leases.clone(), replica.clone());
    let sweeps = tasks.room_sweeps(queue.clone(), tracking.by_rooms());
    let ingest = Ingest {
        js: tasks.js.clone(),
        store: tasks.store.clone(),
        own_server: config.server_name.clone(),
        subjects: settings.input_subjects(),
        batch_size: settings.batch_size,
        max_deliver: settings.max_deliver,
        outbox,
        faults: tasks.faults,
        leases,
        lease_ttl: settings.lease_ttl,
        ack_wait: settings.ack_wait,
        metrics: tasks.metrics.clone(),
        queue,
        tracking,
        sweeps,
        backlog,
        // Set per loop by `Tasks::ingest`.
        feed: Feed::Partition {
            stream: String::new(),
            partition: 0,
        },
        replica,
    };
    tasks.ingest(ingest, inputs);
    // Last: it ends after every outbox handle (ingest, the fetch writer) has
    // gone, so it publishes what they handed over before the worker stops.
    tasks.set.spawn(publisher.run());
    tracing::info!(%http_addr, server_name = %config.server_name, "worker started");
    Ok(Running {
        shutdown: trigger,
        tasks: tasks.set,
        http_addr,
        store: tasks.store,
    })
}

/// The worker's tasks as they are started, and what they all share.
struct Tasks {
    set: JoinSet<()>,
    shutdown: Shutdown,
    metrics: Metrics,
    faults: Faults,
    store: Store,
    js: jetstream::Context,
}

impl Tasks {
    /// The health and metrics listener (SPEC §7).
    fn health_listener(
        &mut self,
        listener: TcpListener,
        nats: async_nats::Client,
        federation: Arc<FederationClient>,
        warnings: Vec<String>,
    ) {
        let health = Health {
            nats,
            js: self.js.clone(),
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            federation,
            warnings: Arc::new(warnings),
        };
        self.set
            .spawn(http::serve(listener, health, self.shutdown.clone()));
    }

    /// The outbox publisher (not started yet) and the handle its writers
    /// hand committed events to.
    fn outbox_publisher(&self, instance_id: String) -> (Publisher, OutboxHandle) {
        Publisher::new(
            self.store.clone(),
            self.js.clone(),
            instance_id,
            self.faults,
            self.metrics.clone(),
        )
    }

    /// Fetching: the fetch writer (it ends once the fetcher, its last
    /// handle, has stopped and what it handed over is stored), the fetcher
    /// running fetch jobs, and the wake-ups running a parked server's job
    /// when a path says it may be up. Returns the one way into the queue.
    fn fetching(
        &mut self,
        settings: &Settings,
        federation: Arc<FederationClient>,
        consumer: jetstream::consumer::PullConsumer,
        outbox: OutboxHandle,
        backlog: IngestBacklog,
    ) -> FetchQueue {
        let (writer, writer_task) =
            FetchWriter::new(self.store.clone(), settings.max_devices, outbox);
        self.set.spawn(writer_task);
        let (follow_ups, follow_up_task) =
            FollowUps::new(self.store.clone(), self.js.clone(), self.shutdown.clone());
        self.set.spawn(follow_up_task);
        let (starts, starts_task) = JobStarts::new(self.store.clone(), USERS_PER_ROUND);
        self.set.spawn(starts_task);
        let fetcher = Fetcher {
            js: self.js.clone(),
            store: self.store.clone(),
            client: federation,
            policy: RetryPolicy {
                min: settings.retry_min,
                max: settings.retry_max,
            },
            concurrency: settings.fetch_concurrency,
            writer,
            ack_wait: settings.ack_wait,
            metrics: self.metrics.clone(),
            backlog,
            revalidation_slots: Fetcher::revalidation_slots(settings.fetch_concurrency),
            store_turns: Fetcher::store_turns(),
            starts,
            follow_ups,
            faults: self.faults,
        };
        self.set.spawn(fetcher.run(consumer, self.shutdown.clone()));
        let wakeups = Wakeups::default();
        let checker = WakeChecker {
            store: self.store.clone(),
            js: self.js.clone(),
            min_gap: settings.retry_min,
            metrics: self.metrics.clone(),
            faults: self.faults,
        };
        self.set
            .spawn(wakeups.clone().run(checker, self.shutdown.clone()));
        FetchQueue::new(self.js.clone(), wakeups)
    }

    /// The request-reply subjects (SPEC §4.4).
    async fn rpc(
        &mut self,
        client: async_nats::Client,
        own_server: &OwnedServerName,
        queue: FetchQueue,
    ) -> Result<(), BusError> {
        let rpc = crate::rpc::Rpc {
            client,
            store: self.store.clone(),
            own_server: own_server.clone(),
            queue,
        };
        let subscribed = rpc.subscribe().await?;
        self.set.spawn(subscribed.run(self.shutdown.clone()));
        Ok(())
    }

    /// The start-up rescan of users still stale (SPEC §5.2).
    fn startup_rescan(&mut self, queue: FetchQueue, spread: Duration) {
        self.set.spawn(crate::fetch::rescan::rescan_stale(
            queue,
            self.store.clone(),
            spread,
            self.shutdown.clone(),
            self.faults,
        ));
    }

    /// The revalidation pacer (SPEC §5.7), on whichever replica holds its
    /// lease; none when `DLU_REVALIDATE_AFTER` is zero.
    fn revalidation(
        &mut self,
        queue: FetchQueue,
        settings: &Settings,
        leases: jetstream::kv::Store,
        replica: String,
    ) {
        if settings.revalidate_after.is_zero() {
            return;
        }
        let revalidator = crate::fetch::revalidate::Revalidator {
            store: self.store.clone(),
            queue,
            after: settings.revalidate_after,
            leases,
            replica,
            lease_ttl: settings.lease_ttl,
            faults: self.faults,
        };
        self.set.spawn(revalidator.run(self.shutdown.clone()));
    }

    /// Room sweeps (SPEC §5.5.5) when rooms decide who is tracked; returns
    /// what ingest wakes them with.
    fn room_sweeps(&mut self, queue: FetchQueue, by_rooms: bool) -> Arc<tokio::sync::Notify> {
        let wake = Arc::new(tokio::sync::Notify::new());
        if !by_rooms {
            return wake;
        }
        let sweeper = crate::sweep::Sweeper {
            store: self.store.clone(),
            queue,
            wake: wake.clone(),
            metrics: self.metrics.clone(),
            faults: self.faults,
        };
        self.set.spawn(sweeper.run(self.shutdown.clone()));
        wake
    }

    /// Ingest: one loop per input stream (applying or routing it), and,
    /// once input partitions are in use, this replica's presence and the
    /// loops of the partitions dealt to it (SPEC §4.5).
    fn ingest(&mut self, ingest: Ingest, inputs: Inputs) {
        let Inputs {
            consumers,
            partitions,
            counts,
            consumer_settings: consumer,
        } = inputs;
        if let Some(counts) = &counts {
            let presence = Presence {
                leases: ingest.leases.clone(),
                replica: ingest.replica.clone(),
                ttl: ingest.lease_ttl,
            };
            self.set.spawn(presence.run(self.shutdown.clone()));
            for (stream, _) in &consumers {
                let dealer = PartitionDealer {
                    template: ingest.clone(),
                    stream: stream.clone(),
                    counts: counts.clone(),
                    consumer: consumer.clone(),
                };
                self.set.spawn(dealer.run(self.shutdown.clone()));
            }
        }
        for (stream, input) in consumers {
            let ingest = Ingest {
                feed: Feed::Input {
                    stream,
                    partitions,
                    counts: counts.clone().map(Box::new),
                },
                ..ingest.clone()
            };
            self.set.spawn(ingest.run(input, self.shutdown.clone()));
        }
    }
}

/// This replica's id in leases and `admin streams`: the host name (a
/// container's is its id) and a random part, unique per start.
fn replica_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .unwrap_or_default();
    // KV keys allow letters, digits, `-`, `_`, `=` and `/`.
    let host: String = host
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .take(40)
        .collect();
    let random = uuid::Uuid::new_v4().simple().to_string();
    if host.is_empty() {
        random[..12].to_owned()
    } else {
        format!("{host}-{}", &random[..8])
    }
}

/// Connects to NATS and the database (waiting up to `startup_timeout`),
/// sets up the streams, consumers, lease bucket and federation client, and
/// binds the health listener.
async fn connect(config: &Config, tracking: Tracking) -> Result<Connected, StartError> {
    let settings = &config.settings;
    let client = bus::connect(
        &bus::NatsConnection::from_settings(settings),
        settings.startup_timeout,
    )
    .await?;
    let store = open_store(&settings.database_url, settings.startup_timeout)
        .await?
        .with_tracking(tracking);
    let instance_id = store.instance_id().await.map_err(StartError::Database)?;
    let js = jetstream::new(client.clone());
    let bus::setup::SetUp {
        inputs: consumers,
        consumer_settings,
        counts,
        fetch_consumer,
        leases,
        warnings,
    } = bus::setup::set_up_within(&js, settings, settings.startup_timeout).await?;
    let federation = FederationClient::new(FederationSettings {
        origin: config.server_name.clone(),
        key: config.server_key.key_pair()?,
        overrides: settings.federation_overrides.clone(),
        timeout: settings.federation_timeout,
    })?;
    for warning in &warnings {
        tracing::warn!("{warning}");
    }
    let listener = TcpListener::bind(settings.http_addr)
        .await
        .map_err(|e| StartError::Http(settings.http_addr, e))?;
    let http_addr = listener
        .local_addr()
        .map_err(|e| StartError::Http(settings.http_addr, e))?;
    Ok(Connected {
        client,
        js,
        store,
        instance_id,
        inputs: Inputs {
            consumers,
            partitions: settings.input_partitions,
            counts,
            consumer_settings,
        },
        fetch_consumer,
        federation: Arc::new(federation),
        leases,
        listener,
        http_addr,
        warnings,
    })
}
