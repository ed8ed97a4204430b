//! Two workers on one stream and one database: per-user order holds over
//! thousands of interleaved updates, across a failover of the pinned replica.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Backend, Nats, TestDb, wait_input_drained, wait_stream};
use device_list_updater::worker;
use entity::{remote_user, stale_user};
use sea_orm::{ActiveValue::Set, EntityTrait, PaginatorTrait};
use serde_json::json;

const USERS: usize = 60;
const ROUNDS: i64 = 40;

fn user(i: usize) -> String {
    format!("@u{i}:s{}.example", i % 7)
}

async fn publish_round(js: &async_nats::jetstream::Context, round: i64) {
    let mut acks = Vec::new();
    for i in 0..USERS {
        let user = user(i);
        let body = json!({"user_id": user, "device_id": format!("D{}", round % 3),
            "device_display_name": format!("round {round}"), "stream_id": round, "prev_id": [round - 1],
            "keys": {"round": round}});
        acks.push(
            js.publish("devicelist.in.update", body.to_string().into())
                .await
                .unwrap(),
        );
    }
    for ack in acks {
        ack.await.unwrap();
    }
}

async fn two_workers_keep_per_user_order(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    let first = worker::start(common::config(&nats, &db)).await.unwrap();
    // every user is known up to stream id 0, as after a fetch
    let users: Vec<_> = (0..USERS)
        .map(|i| remote_user::ActiveModel {
            user_id: Set(user(i)),
            server_name: Set(format!("s{}.example", i % 7)),
            known_stream_ids: Set("[0]".into()),
            max_stream_id: Set(0),
            fetched_stream_id: Set(0),
        })
        .collect();
    remote_user::Entity::insert_many(users)
        .exec_without_returning(first.store.connection())
        .await
        .unwrap();

    // the first worker takes the pin; the second starts on standby
    publish_round(&js, 1).await;
    wait_stream(&js, "KEY_CHANGE", USERS as u64).await;
    let second = worker::start(common::config(&nats, &db)).await.unwrap();
    for round in 2..=ROUNDS / 2 {
        publish_round(&js, round).await;
    }
    // stop the pinned worker mid-stream: the standby takes over
    first.stop(Duration::from_secs(10)).await;
    for round in ROUNDS / 2 + 1..=ROUNDS {
        publish_round(&js, round).await;
    }
    let events = wait_stream(&js, "KEY_CHANGE", USERS as u64 * ROUNDS as u64).await;
    let mut last: HashMap<String, i64> = HashMap::new();
    for event in &events {
        let user = event.header("user_id").unwrap().to_owned();
        let stream = event.json["stream_id"].as_i64().unwrap();
        let previous = last.insert(user.clone(), stream).unwrap_or(0);
        assert_eq!(
            stream,
            previous + 1,
            "{user}: event {stream} after {previous}"
        );
    }
    assert!(last.values().all(|&s| s == ROUNDS));
    wait_input_drained(&js).await;
    let stale = stale_user::Entity::find()
        .count(second.store.connection())
        .await
        .unwrap();
    assert_eq!(stale, 0, "no update was ever seen out of order");
    second.stop(Duration::from_secs(10)).await;
}
both_backends!(per_user_order, two_workers_keep_per_user_order);
