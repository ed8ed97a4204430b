//! Downstream full: `KEY_CHANGE` at its message limit with `discard: new`
//! refuses publishes. The outbox keeps the events, input goes on being
//! applied, `/metrics` shows the backlog, and once there is room again every
//! event is published, each once.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream::stream::DiscardPolicy;
use common::{Backend, Nats, TestDb, publish, read_stream, wait_input_drained};
use device_list_updater::worker;
use entity::{remote_device, remote_user};
use sea_orm::{ActiveValue::Set, EntityTrait, PaginatorTrait};
use serde_json::json;

const ALICE: &str = "@alice:remote.example";
const UPDATES: i64 = 8;
const ROOM_FOR: i64 = 3;

async fn a_full_key_change_stream_holds_events_in_the_outbox(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    // The operator capped KEY_CHANGE: three messages, then refuse.
    // Otherwise as the worker would create it (docs/interface.md).
    let mut capped = async_nats::jetstream::stream::Config {
        name: "KEY_CHANGE".into(),
        subjects: vec!["key_change.>".into()],
        duplicate_window: Duration::from_secs(600),
        max_messages: ROOM_FOR,
        discard: DiscardPolicy::New,
        ..Default::default()
    };
    js.create_stream(capped.clone())
        .await
        .expect("capped stream");
    let running = worker::start(common::config(&nats, &db)).await.unwrap();
    remote_user::Entity::insert(remote_user::ActiveModel {
        user_id: Set(ALICE.into()),
        server_name: Set("remote.example".into()),
        known_stream_ids: Set("[0]".into()),
        max_stream_id: Set(0),
        fetched_stream_id: Set(0),
        fetched_at_ms: Set(0),
    })
    .exec_without_returning(running.store.connection())
    .await
    .unwrap();
    for stream_id in 1..=UPDATES {
        let body = json!({"user_id": ALICE, "device_id": format!("D{stream_id}"),
            "stream_id": stream_id, "prev_id": [stream_id - 1],
            "device_display_name": "Phone", "keys": {"n": stream_id}});
        publish(&js, "devicelist.in.update", &body.to_string(), None).await;
    }

    // Every update is applied and acked although its event cannot go out.
    wait_input_drained(&js).await;
    let devices = remote_device::Entity::find()
        .count(running.store.connection())
        .await
        .unwrap();
    assert_eq!(devices, UPDATES as u64, "input goes on being applied");
    let backlog = common::eventually(Duration::from_secs(20), "the backlog metric", || async {
        let (_, text) = common::http_get(running.http_addr, "/metrics").await;
        common::metric_sample(&text, "dlu_outbox_backlog").filter(|&n| n > 0.0)
    })
    .await;
    assert!(backlog > 0.0);
    // The publisher fills what room there is, and keeps the rest.
    common::eventually(Duration::from_secs(20), "KEY_CHANGE full", || async {
        (common::stream_len(&js, "KEY_CHANGE").await == ROOM_FOR as u64).then_some(())
    })
    .await;
    assert!(running.store.outbox_len().await.unwrap() > 0, "events kept");

    // Room again: everything goes out, each event once.
    capped.max_messages = -1;
    js.update_stream(capped).await.expect("lift the cap");
    common::eventually(Duration::from_secs(30), "the outbox empty", || async {
        (running.store.outbox_len().await.ok()? == 0).then_some(())
    })
    .await;
    let events = read_stream(&js, "KEY_CHANGE").await;
    let streams: HashSet<i64> = events
        .iter()
        .filter_map(|e| e.json["stream_id"].as_i64())
        .collect();
    assert_eq!(events.len() as i64, UPDATES, "each event once: {events:#?}");
    assert_eq!(streams, (1..=UPDATES).collect::<HashSet<_>>());
    running.stop(Duration::from_secs(10)).await;
}
both_backends!(
    key_change_full,
    a_full_key_change_stream_holds_events_in_the_outbox
);
