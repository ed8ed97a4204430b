//! Overlapping batches (`Store::apply_batch_in_turn`): a batch that is ready
//! first still applies after the batch before it, and a batch whose
//! predecessor failed does not commit ahead of it.

mod common;

use std::time::Duration;

use device_list_updater::input::{self, InputKind, InputMessage, Parsed};
use device_list_updater::store::{Store, Turn};
use entity::remote_user;
use sea_orm::{ActiveModelTrait, ActiveValue::Set};

const USER: &str = "@alice:remote.example";

fn update(stream_id: i64, prev: &[i64]) -> InputMessage {
    let body = serde_json::json!({
        "user_id": USER, "device_id": "DEV", "stream_id": stream_id, "prev_id": prev,
        "keys": {"user_id": USER, "device_id": "DEV", "algorithms": [],
                 "keys": {"ed25519:DEV": format!("key{stream_id}")}, "signatures": {}}
    })
    .to_string();
    let rules = input::Rules::new(common::OUR_SERVER.try_into().unwrap());
    match input::parse(InputKind::Update, body.as_bytes(), None, &rules) {
        Ok(Parsed::Accept(message)) => message,
        _ => panic!("test update does not parse"),
    }
}

async fn store(db: &common::TestDb) -> Store {
    let store = Store::connect(&db.url).await.unwrap();
    store.migrate().await.unwrap();
    store
}

/// Batch 2 (prev_id 1) is started before batch 1 (stream id 1, after a known
/// id 0). Its turn makes it wait, so both apply and nobody goes stale.
async fn later_batch_waits_for_earlier(backend: common::Backend) {
    let db = common::TestDb::new(backend).await;
    let store = store(&db).await;
    // Stream id 0 is known for the user (as after a fetch).
    remote_user::ActiveModel {
        user_id: Set(USER.into()),
        server_name: Set("remote.example".into()),
        known_stream_ids: Set("[0]".into()),
        max_stream_id: Set(0),
        fetched_stream_id: Set(0),
        fetched_at_ms: Set(0),
    }
    .insert(store.connection())
    .await
    .unwrap();

    let (first, baton) = Turn::after(None);
    let (second, _next) = Turn::after(Some(baton));
    let second_batch = [update(2, &[1])];
    let mut later = {
        let store = store.clone();
        tokio::spawn(async move { store.apply_batch_in_turn(&second_batch, 0, second).await })
    };
    // The later batch must not commit on its own: given far longer than a
    // commit takes, it is still waiting for its turn. (Were it to run ahead,
    // it would also see the gap and mark the user stale, checked below.)
    let ran_ahead = tokio::time::timeout(Duration::from_millis(500), &mut later).await;
    assert!(
        ran_ahead.is_err(),
        "the later batch committed before the earlier one: {ran_ahead:?}"
    );
    let earlier = tokio::time::timeout(
        Duration::from_secs(10),
        store.apply_batch_in_turn(&[update(1, &[0])], 0, first),
    )
    .await
    .expect("the earlier batch is not blocked by the later one")
    .unwrap()
    .expect("the first batch commits");
    assert!(earlier.plan.stale.is_empty());
    let later = tokio::time::timeout(Duration::from_secs(10), later)
        .await
        .expect("the later batch finishes")
        .unwrap()
        .unwrap()
        .expect("the later batch commits");
    assert!(
        later.plan.stale.is_empty(),
        "applied in order, so no gap: {:?}",
        later.plan.stale
    );
    assert_eq!(later.plan.events.len(), 1);
}
both_backends!(in_order, later_batch_waits_for_earlier);

/// When the earlier batch gives up, the later one rolls back (Ok(None)) and
/// writes nothing.
async fn later_batch_rolls_back_when_earlier_fails(backend: common::Backend) {
    let db = common::TestDb::new(backend).await;
    let store = store(&db).await;
    let (first, baton) = Turn::after(None);
    let (second, _next) = Turn::after(Some(baton));
    drop(first); // the earlier batch failed before locking
    let outcome = store
        .apply_batch_in_turn(&[update(5, &[])], 0, second)
        .await
        .unwrap();
    assert!(outcome.is_none(), "rolled back");
    assert_eq!(store.outbox_len().await.unwrap(), 0, "nothing was written");
}
both_backends!(rolled_back, later_batch_rolls_back_when_earlier_fails);
