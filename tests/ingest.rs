//! End-to-end ingest through JetStream: publish to `devicelist.in.*`, read
//! `KEY_CHANGE`, `DEVICE_LIST_DEAD` and `DEVICE_LIST_FETCH`, on SQLite and
//! PostgreSQL.

mod common;

use std::time::Duration;

use common::{
    Backend, Nats, TestDb, publish, read_stream, stream_len, wait_input_drained, wait_stream,
};
use device_list_updater::worker::{self, Running};
use entity::{key_change_outbox, remote_device, remote_user, stale_user};
use sea_orm::{ActiveModelTrait, ActiveValue::Set, EntityTrait, PaginatorTrait};
use serde_json::json;

const ALICE: &str = "@alice:remote.example";
const BOB: &str = "@bob:remote.example";

struct Env {
    nats: Nats,
    _db: TestDb,
    js: async_nats::jetstream::Context,
    worker: Running,
}

impl Env {
    async fn start(backend: Backend) -> Env {
        let nats = Nats::start().await;
        let db = TestDb::new(backend).await;
        let worker = worker::start(common::config(&nats, &db))
            .await
            .expect("worker starts");
        let js = nats.js().await;
        Env {
            nats,
            _db: db,
            js,
            worker,
        }
    }

    fn db(&self) -> &sea_orm::DatabaseConnection {
        self.worker.store.connection()
    }

    /// Records `ids` as known for `user`, as a successful fetch would.
    async fn seed_user(&self, user: &str, ids: &[i64]) {
        remote_user::ActiveModel {
            user_id: Set(user.into()),
            server_name: Set(user.split_once(':').unwrap().1.into()),
            known_stream_ids: Set(serde_json::to_string(ids).unwrap()),
            max_stream_id: Set(ids.iter().copied().max().unwrap_or(0)),
            fetched_stream_id: Set(0),
            fetched_at_ms: Set(0),
        }
        .insert(self.db())
        .await
        .unwrap();
    }

    async fn seed_device(&self, user: &str, device: &str, stream_id: i64) {
        remote_device::ActiveModel {
            user_id: Set(user.into()),
            device_id: Set(device.into()),
            display_name: Set(Some("seeded".into())),
            keys_json: Set(Some(r#"{"seeded":true}"#.into())),
            stream_id: Set(stream_id),
            deleted: Set(false),
        }
        .insert(self.db())
        .await
        .unwrap();
    }

    async fn device(&self, user: &str, device: &str) -> Option<remote_device::Model> {
        remote_device::Entity::find_by_id((user.to_owned(), device.to_owned()))
            .one(self.db())
            .await
            .unwrap()
    }

    async fn stale(&self, user: &str) -> Option<stale_user::Model> {
        stale_user::Entity::find_by_id(user.to_owned())
            .one(self.db())
            .await
            .unwrap()
    }

    async fn update(&self, body: serde_json::Value) {
        publish(
            &self.js,
            "devicelist.in.update",
            &body.to_string(),
            Some("remote.example"),
        )
        .await;
    }
}

fn update(user: &str, device: &str, stream: i64, prev: &[i64], name: &str) -> serde_json::Value {
    json!({
        "user_id": user, "device_id": device, "device_display_name": name,
        "stream_id": stream, "prev_id": prev,
        "keys": {"user_id": user, "device_id": device, "algorithms": ["m.olm.v1.curve25519-aes-sha2"],
                 "keys": {format!("ed25519:{device}"): name}, "signatures": {}, "unknown_field": [1, 2]}
    })
}

async fn chain_is_applied_in_order(backend: Backend) {
    let env = Env::start(backend).await;
    env.seed_user(ALICE, &[5]).await;
    env.update(update(ALICE, "D1", 6, &[5], "one")).await;
    env.update(update(ALICE, "D2", 7, &[6], "two")).await;
    // stream ids may arrive as numeric strings
    env.update(
        json!({"user_id": ALICE, "device_id": "D1", "stream_id": "8", "prev_id": ["7"],
                      "device_display_name": "three", "keys": {"k": 3}}),
    )
    .await;
    let events = wait_stream(&env.js, "KEY_CHANGE", 3).await;
    let streams: Vec<i64> = events
        .iter()
        .map(|e| e.json["stream_id"].as_i64().unwrap())
        .collect();
    assert_eq!(streams, vec![6, 7, 8]);
    for event in &events {
        assert_eq!(event.subject, "key_change.device");
        assert_eq!(event.header("user_id"), Some(ALICE));
        assert!(event.header("Nats-Msg-Id").is_some());
        assert_eq!(event.json["type"], "device");
        assert_eq!(event.json["deleted"], false);
    }
    // keys are passed through as received, unknown fields included
    assert_eq!(
        events[0].json["keys"],
        update(ALICE, "D1", 6, &[5], "one")["keys"]
    );
    assert_eq!(events[2].json["keys"], json!({"k": 3}));
    assert_eq!(events[2].json["display_name"], "three");
    let d1 = env.device(ALICE, "D1").await.unwrap();
    assert_eq!(
        (d1.stream_id, d1.display_name.as_deref()),
        (8, Some("three"))
    );
    assert!(env.stale(ALICE).await.is_none());
    assert_eq!(stream_len(&env.js, "DEVICE_LIST_FETCH").await, 0);
}
both_backends!(chain_applied, chain_is_applied_in_order);

async fn duplicates_and_older_updates_emit_nothing(backend: Backend) {
    let env = Env::start(backend).await;
    env.seed_user(ALICE, &[5]).await;
    let first = update(ALICE, "D1", 6, &[5], "one");
    env.update(first.clone()).await;
    wait_stream(&env.js, "KEY_CHANGE", 1).await;
    // the identical update re-sent, the same device under a newer stream id,
    // and an older update with different content: no event, no overwrite
    env.update(first).await;
    env.update(update(ALICE, "D1", 7, &[6], "one")).await;
    env.update(update(ALICE, "D1", 5, &[6], "older")).await;
    // a real change afterwards proves the three were processed
    env.update(update(ALICE, "D1", 8, &[7], "newest")).await;
    let events = wait_stream(&env.js, "KEY_CHANGE", 2).await;
    assert_eq!(events[1].json["stream_id"], 8);
    wait_input_drained(&env.js).await;
    assert_eq!(stream_len(&env.js, "KEY_CHANGE").await, 2);
    let d1 = env.device(ALICE, "D1").await.unwrap();
    assert_eq!(
        (d1.stream_id, d1.display_name.as_deref()),
        (8, Some("newest"))
    );
}
both_backends!(duplicates, duplicates_and_older_updates_emit_nothing);

async fn unknown_or_empty_prev_marks_stale_with_one_job_per_server(backend: Backend) {
    let env = Env::start(backend).await;
    env.seed_user(BOB, &[5]).await;
    env.update(update(ALICE, "D1", 4, &[3], "x")).await; // unknown user
    env.update(update(ALICE, "D1", 5, &[4], "y")).await; // chains on an unapplied update
    env.update(update(BOB, "D1", 6, &[], "z")).await; // empty prev_id, known user
    publish(
        &env.js,
        "devicelist.in.update",
        &update("@carol:other.example", "D", 1, &[], "c").to_string(),
        None,
    )
    .await;
    wait_input_drained(&env.js).await;
    let alice = env.stale(ALICE).await.expect("alice stale");
    let ids: Vec<i64> = serde_json::from_str(&alice.trigger_stream_ids).unwrap();
    assert_eq!(ids, vec![4, 5]);
    assert_eq!(alice.server_name, "remote.example");
    assert!(env.stale(BOB).await.is_some());
    assert!(
        env.device(ALICE, "D1").await.is_none(),
        "a stale update is not applied"
    );
    assert_eq!(stream_len(&env.js, "KEY_CHANGE").await, 0);
    // one job per server, however many stale users it has
    let jobs = read_stream(&env.js, "DEVICE_LIST_FETCH").await;
    let mut servers: Vec<&str> = jobs
        .iter()
        .map(|j| j.json["server_name"].as_str().unwrap())
        .collect();
    servers.sort();
    assert_eq!(servers, vec!["other.example", "remote.example"]);
    assert!(
        jobs.iter()
            .all(|j| j.subject.starts_with("devicelist.fetch."))
    );
}
both_backends!(
    stale,
    unknown_or_empty_prev_marks_stale_with_one_job_per_server
);

async fn deletion_with_unknown_prev_is_applied_and_marks_stale(backend: Backend) {
    let env = Env::start(backend).await;
    env.seed_user(ALICE, &[3]).await;
    env.seed_device(ALICE, "D1", 3).await;
    env.update(json!({"user_id": ALICE, "device_id": "D1", "stream_id": 9, "prev_id": [8], "deleted": true}))
        .await;
    let events = wait_stream(&env.js, "KEY_CHANGE", 1).await;
    assert_eq!(events[0].json["deleted"], true);
    assert_eq!(events[0].json["keys"], serde_json::Value::Null);
    assert_eq!(events[0].json["stream_id"], 9);
    let d1 = env.device(ALICE, "D1").await.unwrap();
    assert!(d1.deleted && d1.keys_json.is_none());
    assert!(env.stale(ALICE).await.is_some());
    // an older update cannot revive the deleted device
    env.update(update(ALICE, "D1", 4, &[3], "revived?")).await;
    wait_input_drained(&env.js).await;
    assert!(env.device(ALICE, "D1").await.unwrap().deleted);
    assert_eq!(stream_len(&env.js, "KEY_CHANGE").await, 1);
}
both_backends!(
    deletion,
    deletion_with_unknown_prev_is_applied_and_marks_stale
);

fn cross_signing_key(user: &str, usage: &str, key: &str) -> serde_json::Value {
    json!({"user_id": user, "usage": [usage], "keys": {format!("ed25519:{key}"): key}, "signatures": {}})
}

const MASTER: &str = "nqOvzeuGWT/sRx3h7+MHoInYj3Uk2LD/unI9kDYcHwk";
const SELF_SIGNING: &str = "EmkqvokUn8p+vQAGZitOk4PWjp7Ukp3txV2TbMPEiBQ";

async fn signing_key_updates(backend: Backend) {
    let env = Env::start(backend).await;
    let master = cross_signing_key(ALICE, "master", MASTER);
    let body = json!({"user_id": ALICE, "master_key": master}).to_string();
    publish(
        &env.js,
        "devicelist.in.signing_key",
        &body,
        Some("remote.example"),
    )
    .await;
    publish(
        &env.js,
        "devicelist.in.signing_key",
        &body,
        Some("remote.example"),
    )
    .await; // identical: nothing
    let self_signing = cross_signing_key(ALICE, "self_signing", SELF_SIGNING);
    let bad_master = cross_signing_key(BOB, "master", MASTER); // wrong user: dropped
    let body =
        json!({"user_id": ALICE, "master_key": bad_master, "self_signing_key": self_signing});
    publish(
        &env.js,
        "devicelist.in.signing_key",
        &body.to_string(),
        Some("remote.example"),
    )
    .await;
    let events = wait_stream(&env.js, "KEY_CHANGE", 2).await;
    assert_eq!(events[0].subject, "key_change.cross_signing");
    assert_eq!(events[0].json["master_key"], master);
    assert_eq!(events[0].json["self_signing_key"], serde_json::Value::Null);
    assert_eq!(
        events[1].json["master_key"], master,
        "the malformed master key was ignored"
    );
    assert_eq!(events[1].json["self_signing_key"], self_signing);
    // only malformed keys: dead-lettered
    let wrong_usage = cross_signing_key(ALICE, "self_signing", MASTER);
    let body = json!({"user_id": ALICE, "master_key": wrong_usage});
    publish(
        &env.js,
        "devicelist.in.signing_key",
        &body.to_string(),
        None,
    )
    .await;
    let dead = wait_stream(&env.js, "DEVICE_LIST_DEAD", 1).await;
    assert_eq!(dead[0].subject, "devicelist.dead.invalid_signing_key");
    wait_input_drained(&env.js).await;
    assert_eq!(stream_len(&env.js, "KEY_CHANGE").await, 2);
}
both_backends!(signing_keys, signing_key_updates);

/// Every dead-letter reason, published before the worker starts so that they
/// and a good update share one batch.
async fn dead_letters_do_not_block_good_messages(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    common::create_input_stream(&js).await;
    let u = |v: serde_json::Value| v.to_string();
    let bad: Vec<(&str, String, Option<&str>)> = vec![
        ("not_json", "{not json".into(), None),
        ("invalid_shape", "[1]".into(), None),
        (
            "invalid_user_id",
            u(json!({"user_id": "alice", "device_id": "D", "stream_id": 1})),
            None,
        ),
        (
            "invalid_device_id",
            u(json!({"user_id": ALICE, "stream_id": 1})),
            None,
        ),
        (
            "invalid_stream_id",
            u(json!({"user_id": ALICE, "device_id": "D", "stream_id": "x"})),
            None,
        ),
        (
            "invalid_prev_id",
            u(json!({"user_id": ALICE, "device_id": "D", "stream_id": 1, "prev_id": {}})),
            None,
        ),
        (
            "invalid_field",
            u(json!({"user_id": ALICE, "device_id": "D", "stream_id": 1, "deleted": 1})),
            None,
        ),
        (
            "invalid_keys",
            u(json!({"user_id": ALICE, "device_id": "D", "stream_id": 1, "keys": "k"})),
            None,
        ),
        (
            "origin_mismatch",
            u(json!({"user_id": ALICE, "device_id": "D", "stream_id": 1})),
            Some("evil.example"),
        ),
        (
            "oversized",
            format!("{{\"pad\":\"{}\"}}", "x".repeat(70 * 1024)),
            None,
        ),
    ];
    for (_, body, origin) in &bad {
        publish(&js, "devicelist.in.update", body, *origin).await;
    }
    // a good update for a user nothing is known of: it marks the user stale
    // (checked below), in the same batches as the bad ones
    publish(&js, "devicelist.in.update",
        &u(json!({"user_id": ALICE, "device_id": "GOOD", "stream_id": 2, "prev_id": [1], "deleted": false,
                  "keys": {"k": 1}})), None).await;
    publish(
        &js,
        "devicelist.in.update",
        &u(json!({"user_id": "@me:our.example", "device_id": "D", "stream_id": 1})),
        None,
    )
    .await;
    let worker = worker::start(common::config(&nats, &db)).await.unwrap();
    let dead = wait_stream(&js, "DEVICE_LIST_DEAD", bad.len() as u64).await;
    for ((reason, body, origin), letter) in bad.iter().zip(&dead) {
        assert_eq!(letter.subject, format!("devicelist.dead.{reason}"));
        assert_eq!(
            letter.header("source_subject"),
            Some("devicelist.in.update")
        );
        assert!(
            !letter.header("error").unwrap_or("").is_empty(),
            "{reason} has an error sentence"
        );
        assert_eq!(letter.body, body.as_bytes(), "{reason} keeps its body");
        assert_eq!(
            letter.header("origin"),
            *origin,
            "{reason} keeps its headers"
        );
    }
    wait_input_drained(&js).await;
    // the good update (unknown user, so stale) was processed in the same batch
    let stale = stale_user::Entity::find_by_id(ALICE.to_owned())
        .one(worker.store.connection())
        .await
        .unwrap();
    assert!(stale.is_some());
    // the own-server update was ignored: no state, no dead letter
    let users = remote_user::Entity::find()
        .count(worker.store.connection())
        .await
        .unwrap();
    assert_eq!(users, 0);
    assert_eq!(stream_len(&js, "DEVICE_LIST_DEAD").await, bad.len() as u64);
    worker.stop(Duration::from_secs(5)).await;
}
both_backends!(dead_letters, dead_letters_do_not_block_good_messages);

async fn health_endpoints(backend: Backend) {
    let mut env = Env::start(backend).await;
    let addr = env.worker.http_addr;
    assert_eq!(common::http_status(addr, "/healthz").await, 200);
    assert_eq!(common::http_status(addr, "/readyz").await, 200);
    // readiness follows NATS: down while it is gone, back by itself after
    env.nats.stop();
    common::eventually(Duration::from_secs(10), "readyz 503", || async {
        (common::http_status(addr, "/readyz").await == 503).then_some(())
    })
    .await;
    assert_eq!(common::http_status(addr, "/healthz").await, 200);
    // An event committed while NATS is away waits in the outbox...
    let payload = common::leave_in_outbox(env.db(), ALICE).await;
    env.nats.restart().await;
    common::eventually(Duration::from_secs(20), "readyz 200 again", || async {
        (common::http_status(addr, "/readyz").await == 200).then_some(())
    })
    .await;
    // ...and is published once it is back, without a restart of the worker.
    let js = env.nats.js().await;
    let published = common::wait_stream(&js, "KEY_CHANGE", 1).await;
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].json, payload);
    assert_eq!(published[0].header("user_id"), Some(ALICE));
    common::eventually(Duration::from_secs(10), "the outbox emptied", || async {
        let left = key_change_outbox::Entity::find()
            .count(env.db())
            .await
            .ok()?;
        (left == 0).then_some(())
    })
    .await;
}
both_backends!(health, health_endpoints);

/// A homeserver that owns its input stream (Dendrite's names and subject):
/// the worker adopts it instead of creating `DEVICE_LIST_INPUT` for it.
async fn adopts_a_homeserver_owned_stream(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    js.get_or_create_stream(async_nats::jetstream::stream::Config {
        name: "DendriteInputDeviceListUpdate".into(),
        subjects: vec!["DendriteInputDeviceListUpdate".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut config = common::config(&nats, &db);
    config.settings.input_update_subject = "DendriteInputDeviceListUpdate".into();
    let worker = worker::start(config).await.unwrap();
    let body = json!({"user_id": ALICE, "device_id": "D1", "stream_id": 2, "prev_id": [1],
                      "deleted": false, "keys": {"k": 1}});
    publish(
        &js,
        "DendriteInputDeviceListUpdate",
        &body.to_string(),
        Some("remote.example"),
    )
    .await;
    // unknown user: marked stale, and a fetch job is queued
    common::eventually(Duration::from_secs(20), "stale mark", || async {
        stale_user::Entity::find_by_id(ALICE.to_owned())
            .one(worker.store.connection())
            .await
            .unwrap()
            .map(|_| ())
    })
    .await;
    let stream = js
        .get_stream("DendriteInputDeviceListUpdate")
        .await
        .unwrap();
    assert!(
        stream
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>(
                "device-list-updater-input"
            )
            .await
            .is_ok(),
        "the durable consumer lives on the homeserver's stream"
    );
    let mut ours = js.get_stream("DEVICE_LIST_INPUT").await.unwrap();
    let subjects = ours.info().await.unwrap().config.subjects.clone();
    assert_eq!(
        subjects,
        vec!["devicelist.in.>".to_owned()],
        "only the other inputs use our stream"
    );
    worker.stop(Duration::from_secs(5)).await;
}
both_backends!(adopt_stream, adopts_a_homeserver_owned_stream);
