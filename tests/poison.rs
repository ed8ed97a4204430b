//! Poison messages: one the database refuses, and one delivered too often.
//! Neither blocks the good messages around it.

mod common;

use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::{PullConsumer, pull};
use common::{Backend, Nats, TestDb, publish, wait_input_drained, wait_stream};
use device_list_updater::worker;
use futures::StreamExt as _;
use sea_orm::{ConnectionTrait, EntityTrait};
use serde_json::json;

const ALICE: &str = "@alice:remote.example";

fn deletion(device: &str, stream: i64) -> String {
    // a deletion applies without stored state: a simple good message
    json!({"user_id": ALICE, "device_id": device, "stream_id": stream, "prev_id": [], "deleted": true}).to_string()
}

/// The database refuses to insert into `table` a row whose `column` is
/// `value` (a trigger raising `error`).
async fn refuse(
    db: &sea_orm::DatabaseConnection,
    backend: Backend,
    (table, column, value): (&str, &str, &str),
    error: &str,
) {
    let statements = match backend {
        Backend::Sqlite => vec![format!(
            "CREATE TRIGGER refuse_poison BEFORE INSERT ON {table} \
             WHEN NEW.{column} = '{value}' BEGIN SELECT RAISE(ABORT, '{error}'); END"
        )],
        Backend::Postgres => vec![
            format!(
                "CREATE FUNCTION refuse_poison() RETURNS trigger AS $$ BEGIN \
                 IF NEW.{column} = '{value}' THEN RAISE EXCEPTION '{error}'; END IF; \
                 RETURN NEW; END $$ LANGUAGE plpgsql"
            ),
            format!(
                "CREATE TRIGGER refuse_poison BEFORE INSERT ON {table} \
                 FOR EACH ROW EXECUTE FUNCTION refuse_poison()"
            ),
        ],
    };
    for sql in statements {
        db.execute_unprepared(&sql).await.unwrap();
    }
}

async fn refuse_poison_devices(db: &sea_orm::DatabaseConnection, backend: Backend) {
    let poison = ("remote_device", "device_id", "POISON");
    refuse(db, backend, poison, "poison device").await;
}

/// The database refuses every membership of the room `!poison:our.example`.
async fn refuse_poison_room(db: &sea_orm::DatabaseConnection, backend: Backend) {
    let poison = ("room_member", "room_id", "!poison:our.example");
    refuse(db, backend, poison, "poison room").await;
}

async fn a_refused_message_is_dead_lettered_alone(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    let store = worker::open_store(&db.url, Duration::from_secs(10))
        .await
        .unwrap();
    refuse_poison_devices(store.connection(), backend).await;
    common::create_input_stream(&js).await;
    publish(&js, "devicelist.in.update", &deletion("GOOD1", 1), None).await;
    publish(&js, "devicelist.in.update", &deletion("POISON", 2), None).await;
    publish(&js, "devicelist.in.update", &deletion("GOOD2", 3), None).await;
    let running = worker::start(common::config(&nats, &db)).await.unwrap();
    let dead = wait_stream(&js, "DEVICE_LIST_DEAD", 1).await;
    assert_eq!(dead[0].subject, "devicelist.dead.unprocessable");
    assert!(dead[0].header("error").unwrap().contains("poison device"));
    wait_input_drained(&js).await;
    for device in ["GOOD1", "GOOD2"] {
        let row = entity::remote_device::Entity::find_by_id((ALICE.to_owned(), device.to_owned()))
            .one(running.store.connection())
            .await
            .unwrap();
        assert!(row.is_some_and(|r| r.deleted), "{device} applied");
    }
    running.stop(Duration::from_secs(5)).await;
}
both_backends!(unprocessable, a_refused_message_is_dead_lettered_alone);

async fn a_message_delivered_too_often_is_dead_lettered(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    let config = common::config(&nats, &db);
    common::create_input_stream(&js).await;
    // the worker's consumer, created ahead so the message can be delivered
    // (and naked) max_deliver - 1 times before the worker sees it
    let stream = js.get_stream("DEVICE_LIST_INPUT").await.unwrap();
    let consumer: PullConsumer = stream
        .get_or_create_consumer(
            "device-list-updater-input",
            pull::Config {
                durable_name: Some("device-list-updater-input".into()),
                filter_subjects: config.settings.input_subjects().all(),
                max_deliver: config.settings.max_deliver,
                ack_wait: config.settings.ack_wait,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    publish(&js, "devicelist.in.update", &deletion("TIRED", 1), None).await;
    for _ in 1..config.settings.max_deliver {
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .expires(Duration::from_secs(2))
            .messages()
            .await
            .unwrap();
        let message = batch.next().await.expect("delivered").unwrap();
        message.ack_with(AckKind::Nak(None)).await.unwrap();
    }
    publish(&js, "devicelist.in.update", &deletion("FRESH", 2), None).await;
    let running = worker::start(config).await.unwrap();
    let dead = wait_stream(&js, "DEVICE_LIST_DEAD", 1).await;
    assert_eq!(dead[0].subject, "devicelist.dead.max_deliver");
    wait_input_drained(&js).await;
    let fresh = entity::remote_device::Entity::find_by_id((ALICE.to_owned(), "FRESH".to_owned()))
        .one(running.store.connection())
        .await
        .unwrap();
    assert!(fresh.is_some(), "the next message is applied");
    running.stop(Duration::from_secs(5)).await;
}
both_backends!(max_deliver, a_message_delivered_too_often_is_dead_lettered);

/// Applied one by one (the database refused the batch), a link change the
/// planner refuses as a conflict is still dead-lettered (SPEC §5.6.2),
/// next to the message the database refused.
async fn a_conflict_beside_a_refused_message(backend: Backend) {
    use device_list_updater::config::Switch;
    const KEY: &str = "@AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE";
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    let store = worker::open_store(&db.url, Duration::from_secs(10))
        .await
        .unwrap();
    refuse_poison_room(store.connection(), backend).await;
    common::create_input_stream(&js).await;
    let link = |user: &str, at: i64| {
        json!({"room_id": "!k:our.example", "member_key": KEY, "user_id": user,
               "verified": true, "stream_ordering": at})
        .to_string()
    };
    publish(
        &js,
        "devicelist.in.member_key",
        &link("@bob:remote.example", 1),
        None,
    )
    .await;
    let poison = json!({"room_id": "!poison:our.example", "state_key": "@bob:remote.example",
                        "membership": "join", "stream_ordering": 1});
    publish(&js, "devicelist.in.membership", &poison.to_string(), None).await;
    publish(
        &js,
        "devicelist.in.member_key",
        &link("@carol:remote.example", 2),
        None,
    )
    .await;
    let mut config = common::config(&nats, &db);
    config.settings.membership = Switch::On;
    config.settings.msc4430 = Switch::On;
    let running = worker::start(config).await.unwrap();
    let dead = wait_stream(&js, "DEVICE_LIST_DEAD", 2).await;
    let mut subjects: Vec<&str> = dead.iter().map(|d| d.subject.as_str()).collect();
    subjects.sort_unstable();
    assert_eq!(
        subjects,
        [
            "devicelist.dead.link_conflict",
            "devicelist.dead.unprocessable"
        ]
    );
    let conflict = dead
        .iter()
        .find(|d| d.subject == "devicelist.dead.link_conflict")
        .unwrap();
    assert!(String::from_utf8_lossy(&conflict.body).contains("carol"));
    wait_input_drained(&js).await;
    running.stop(Duration::from_secs(5)).await;
}
both_backends!(conflict_one_by_one, a_conflict_beside_a_refused_message);
