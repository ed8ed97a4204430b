//! A worker with a mock fleet of remote servers, for the fetch tests.

use std::time::Duration;

use device_list_updater::config::Config;
use device_list_updater::testkit::remote::{MockFederation, device_keys};
use device_list_updater::worker::{self, Running};
use entity::{remote_device, stale_user};
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter};
use serde_json::json;

use super::{Backend, Nats, TestDb, publish};

/// A worker, its NATS and database, and a mock fleet playing its remote servers.
pub struct Env {
    /// The NATS server.
    pub nats: Nats,
    /// The database.
    pub db: TestDb,
    /// JetStream on `nats`.
    pub js: async_nats::jetstream::Context,
    /// The worker.
    pub worker: Running,
    /// The remote servers.
    pub fleet: MockFederation,
    /// The worker's configuration (to start more replicas, or again).
    pub config: Config,
}

impl Env {
    /// A worker whose remote servers `servers` are all played by one fleet.
    pub async fn start(
        backend: Backend,
        servers: &[&str],
        latency: Duration,
        tune: impl FnOnce(&mut Config),
    ) -> Env {
        let nats = Nats::start().await;
        let db = TestDb::new(backend).await;
        let mut config = super::config(&nats, &db);
        let fleet = MockFederation::trusting(&config, latency).await;
        fleet.serve(&mut config, servers.iter().copied());
        tune(&mut config);
        fleet.guard(config.settings.retry_min);
        let worker = worker::start(config.clone()).await.expect("worker starts");
        let js = nats.js().await;
        Env {
            nats,
            db,
            js,
            worker,
            fleet,
            config,
        }
    }

    /// Stops the worker (SIGTERM's path), deletes the fetch stream when
    /// `lose_queue`, and starts a new worker on the same NATS and database.
    pub async fn restart(self, lose_queue: bool) -> Env {
        self.restart_after(async |js, _| {
            if lose_queue {
                js.delete_stream("DEVICE_LIST_FETCH")
                    .await
                    .expect("delete the fetch stream");
            }
        })
        .await
    }

    /// Stops the worker, runs `between` while none runs (it may publish,
    /// so that one pull takes everything at once, or change the fleet), and
    /// starts the worker again with the same configuration.
    pub async fn restart_after(
        self,
        between: impl AsyncFnOnce(&async_nats::jetstream::Context, &MockFederation),
    ) -> Env {
        let Env {
            nats,
            db,
            js,
            worker,
            fleet,
            config,
        } = self;
        worker.stop(Duration::from_secs(10)).await;
        between(&js, &fleet).await;
        let worker = worker::start(config.clone())
            .await
            .expect("worker restarts");
        Env {
            nats,
            db,
            js,
            worker,
            fleet,
            config,
        }
    }

    /// The worker's database connection.
    pub fn db(&self) -> &sea_orm::DatabaseConnection {
        self.worker.store.connection()
    }

    /// Publishes an update (a reason to fetch its user again).
    pub async fn update(&self, body: serde_json::Value) {
        if let Some(user) = body["user_id"].as_str() {
            self.fleet.reason(user);
            // An update from a server in back-off ends it (SPEC §5.2).
            if let Some((_, server)) = user.split_once(':') {
                self.fleet.reason(server);
            }
        }
        publish(&self.js, "devicelist.in.update", &body.to_string(), None).await;
    }

    /// Publishes a resync request (a reason to fetch the user again).
    pub async fn resync(&self, user: &str) {
        self.fleet.reason(user);
        publish(
            &self.js,
            "devicelist.in.resync",
            &json!({"user_id": user}).to_string(),
            None,
        )
        .await;
    }

    /// Whether `user` is marked stale.
    pub async fn is_stale(&self, user: &str) -> bool {
        stale_user::Entity::find_by_id(user.to_owned())
            .one(self.db())
            .await
            .expect("query")
            .is_some()
    }

    /// Waits until `user` has been asked for `requests` times and is fresh.
    pub async fn wait_fresh(&self, user: &str, requests: usize) {
        super::eventually(
            Duration::from_secs(20),
            &format!("{user} fetched {requests}× and fresh"),
            || async {
                (self.fleet.requests(user) >= requests && !self.is_stale(user).await).then_some(())
            },
        )
        .await;
    }

    /// Waits until the input is drained and every committed event is published.
    pub async fn settled(&self) {
        super::wait_input_drained(&self.js).await;
        super::eventually(Duration::from_secs(10), "outbox empty", || async {
            (self.worker.store.outbox_len().await.ok()? == 0).then_some(())
        })
        .await;
    }

    pub async fn devices(&self, user: &str) -> Vec<(String, bool)> {
        let mut rows: Vec<(String, bool)> = remote_device::Entity::find()
            .filter(remote_device::Column::UserId.eq(user))
            .all(self.db())
            .await
            .expect("query")
            .into_iter()
            .map(|d| (d.device_id, d.deleted))
            .collect();
        rows.sort();
        rows
    }
}

/// An update of `device` with keys, chained on `prev`.
pub fn update(
    user: &str,
    device: &str,
    stream_id: i64,
    prev: &[i64],
    name: &str,
) -> serde_json::Value {
    json!({"user_id": user, "device_id": device, "stream_id": stream_id, "prev_id": prev,
           "device_display_name": name, "keys": device_keys(user, device)})
}
