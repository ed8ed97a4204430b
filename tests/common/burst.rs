//! The burst the fault tests run faults during: 200 known users × 50 chained
//! updates, each a visible change, plus a few stale users of mocked servers;
//! and the check that afterwards every update is reflected and every key
//! change is in `KEY_CHANGE` exactly once (distinct `Nats-Msg-Id`s, one event
//! per update).

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream;
use device_list_updater::config::Config;
use device_list_updater::testkit::remote::{MockFederation, Reply, device_list};
use device_list_updater::testkit::{stream_len, wait_for};
use device_list_updater::worker;
use futures::StreamExt as _;
use sea_orm::{ActiveValue::Set, EntityTrait, PaginatorTrait};
use serde_json::json;

/// Users of the burst, each known up to stream id 0.
pub const USERS: usize = 200;
/// Updates per user.
pub const ROUNDS: usize = 50;
/// Updates in the burst.
pub const TOTAL: usize = USERS * ROUNDS;
/// Users of other servers, marked stale by a resync request.
pub const STALE_USERS: usize = 20;
/// The mocked servers of the stale users.
pub const STALE_SERVERS: usize = 4;

/// The `s`-th mocked server.
pub fn stale_server(s: usize) -> String {
    format!("stale{s}.example")
}

/// The `u`-th stale user.
pub fn stale_user(u: usize) -> String {
    format!("@s{u}:{}", stale_server(u % STALE_SERVERS))
}

/// The `u`-th user of the burst.
pub fn user(u: usize) -> String {
    format!("@burst{u}:remote.example")
}

/// Seeds the burst's users and publishes the whole burst (the input stream
/// created first, with one replica).
pub async fn seed_and_publish(db_url: &str, js: &jetstream::Context) {
    seed(db_url).await;
    crate::common::create_input_stream(js).await;
    publish_rounds(js, 1..=ROUNDS).await;
}

/// Stores the burst's users, each known up to stream id 0.
pub async fn seed(db_url: &str) {
    seed_users(db_url, (0..USERS).map(user)).await;
}

/// Stores `users`, each known up to stream id 0 (their server taken from
/// the id), in chunks of 500.
pub async fn seed_users(db_url: &str, users: impl Iterator<Item = String>) {
    let store = worker::open_store(db_url, Duration::from_secs(10))
        .await
        .expect("store");
    let users: Vec<String> = users.collect();
    for chunk in users.chunks(500) {
        let rows: Vec<_> = chunk
            .iter()
            .map(|id| entity::remote_user::ActiveModel {
                user_id: Set(id.clone()),
                server_name: Set(id.split_once(':').expect("a user id").1.to_owned()),
                known_stream_ids: Set("[0]".into()),
                max_stream_id: Set(0),
                fetched_stream_id: Set(0),
                fetched_at_ms: Set(0),
            })
            .collect();
        entity::remote_user::Entity::insert_many(rows)
            .exec_without_returning(store.connection())
            .await
            .expect("seed");
    }
}

/// Publishes `rounds` of the burst (every user's update of each round),
/// each round's acks awaited before the next.
pub async fn publish_rounds(js: &jetstream::Context, rounds: std::ops::RangeInclusive<usize>) {
    let users: Vec<String> = (0..USERS).map(user).collect();
    for round in rounds {
        publish_round_of(js, &users, round).await;
    }
}

/// Publishes round `round` of a chained burst for `users` (each update's
/// `prev_id` is the round before, so an update applied out of order leaves
/// its user stale) and waits for every ack.
pub async fn publish_round_of(js: &jetstream::Context, users: &[String], round: usize) {
    let mut acks = Vec::with_capacity(users.len());
    for user in users {
        let body = json!({"user_id": user, "device_id": "D", "stream_id": round,
            "prev_id": [round - 1], "device_display_name": format!("name {round}"),
            "keys": {"user_id": user, "device_id": "D", "round": round}});
        acks.push(
            js.publish("devicelist.in.update", body.to_string().into())
                .await
                .expect("publish"),
        );
    }
    for ack in acks {
        ack.await.expect("publish ack");
    }
}

/// Every update applied, and `KEY_CHANGE` holds exactly one event per update.
pub async fn assert_all_reflected_once(js: &jetstream::Context, db: &sea_orm::DatabaseConnection) {
    wait_for(Duration::from_secs(120), "every key change", || async {
        (stream_len(js, "KEY_CHANGE").await >= TOTAL as u64).then_some(())
    })
    .await;
    wait_for(
        Duration::from_secs(60),
        "every user at its last update",
        || async {
            let done = entity::remote_device::Entity::find()
                .all(db)
                .await
                .ok()?
                .iter()
                .filter(|d| d.stream_id == ROUNDS as i64)
                .count();
            (done == USERS).then_some(())
        },
    )
    .await;
    // published rows are deleted just after their acks arrive
    wait_for(Duration::from_secs(30), "outbox drained", || async {
        let rows = entity::key_change_outbox::Entity::find()
            .count(db)
            .await
            .ok()?;
        (rows == 0).then_some(())
    })
    .await;
    // distinct (user, stream id) pairs: exactly once each
    let mut seen = HashSet::new();
    let mut ids = HashSet::new();
    let mut fetched = 0;
    for (body, id) in read_key_changes(js).await {
        let key = (
            body["user_id"].as_str().unwrap_or_default().to_owned(),
            body["stream_id"].as_i64().unwrap_or_default(),
        );
        assert!(seen.insert(key.clone()), "duplicate key change {key:?}");
        if !key.0.starts_with("@burst") {
            fetched += 1;
        }
        assert!(
            ids.insert(id.expect("Nats-Msg-Id")),
            "duplicate Nats-Msg-Id"
        );
    }
    assert_eq!(seen.len() - fetched, TOTAL, "one key change per update");
}

/// Every key change in `KEY_CHANGE`, in order, through an ordered consumer
/// (fast at volume): its body, and its `Nats-Msg-Id` if it has one.
pub async fn read_key_changes(js: &jetstream::Context) -> Vec<(serde_json::Value, Option<String>)> {
    let total = stream_len(js, "KEY_CHANGE").await;
    // Just after a node of a cluster was killed and started again, a
    // JetStream request can time out while the stream's leader settles:
    // asked again until it answers.
    let mut messages =
        super::eventually(Duration::from_secs(30), "an ordered consumer", || async {
            let stream = js.get_stream("KEY_CHANGE").await.ok()?;
            let consumer = stream
                .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
                .await
                .ok()?;
            consumer.messages().await.ok()
        })
        .await;
    let mut changes = Vec::new();
    for _ in 0..total {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("read in time")
            .expect("a message")
            .expect("readable");
        let body: serde_json::Value = serde_json::from_slice(&message.payload).expect("json");
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.to_string());
        changes.push((body, id));
    }
    changes
}

/// Starts an in-process worker with `config` (small batches, so the burst
/// takes many), with a few stale users of mocked servers to fetch, and
/// returns once a fifth of the burst's key changes are out.
pub async fn start_and_let_a_fifth_through(
    mut config: Config,
    js: &jetstream::Context,
) -> (worker::Running, MockFederation) {
    config.settings.batch_size = 100;
    // A few users to fetch too, so the fault also meets pending fetches.
    let remote = MockFederation::trusting(&config, Duration::from_millis(50)).await;
    let servers: Vec<String> = (0..STALE_SERVERS).map(stale_server).collect();
    remote.serve(&mut config, servers.iter().map(String::as_str));
    for u in 0..STALE_USERS {
        let user = stale_user(u);
        remote.script(
            &user,
            vec![Reply::Json(device_list(&user, 3, &[("D", "fetched")]))],
        );
        crate::common::publish(
            js,
            "devicelist.in.resync",
            &json!({"user_id": user}).to_string(),
            None,
        )
        .await;
    }
    let running = worker::start(config).await.expect("worker");
    wait_for(Duration::from_secs(120), "part of the burst", || async {
        (stream_len(js, "KEY_CHANGE").await >= (TOTAL / 5) as u64).then_some(())
    })
    .await;
    (running, remote)
}

/// Every user marked stale is fetched again within the back-off's reach
/// (`common::config` caps it at 2 s; the bound here leaves room for a slow
/// machine).
pub async fn assert_no_user_left_stale(
    js: &jetstream::Context,
    running: &worker::Running,
    remote: &MockFederation,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let asked = (0..STALE_USERS).all(|u| remote.requests(&stale_user(u)) > 0);
        if asked && running.store.stale_user_count().await.ok() == Some(0) {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "timed out waiting for every stale user fetched\n{}",
                fetch_state(js, running.store.connection(), remote).await
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the fetch queue holds, for a failure's message: the users still
/// stale, the servers' waits, the jobs in `DEVICE_LIST_FETCH` and its
/// consumer's state, and the stale users never asked for.
async fn fetch_state(
    js: &jetstream::Context,
    db: &sea_orm::DatabaseConnection,
    remote: &MockFederation,
) -> String {
    let stale = entity::stale_user::Entity::find().all(db).await;
    let servers = entity::fetch_server::Entity::find().all(db).await;
    let never_asked: Vec<String> = (0..STALE_USERS)
        .map(stale_user)
        .filter(|u| remote.requests(u) == 0)
        .collect();
    let (jobs, consumer) = match js.get_stream("DEVICE_LIST_FETCH").await {
        Ok(mut stream) => {
            let state = stream.info().await.map(|i| format!("{:?}", i.state));
            let consumer = match stream
                .get_consumer::<jetstream::consumer::pull::Config>("device-list-updater-fetch")
                .await
            {
                Ok(mut c) => format!("{:?}", c.info().await.cloned()),
                Err(e) => format!("{e}"),
            };
            (format!("{state:?}"), consumer)
        }
        Err(e) => (format!("{e}"), String::new()),
    };
    format!(
        "stale: {stale:#?}\nservers: {servers:#?}\nnever asked: {never_asked:?}\n\
         fetch stream: {jobs}\nfetch consumer: {consumer}"
    )
}
