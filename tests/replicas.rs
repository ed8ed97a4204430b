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
            fetched_at_ms: Set(0),
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

/// Membership and updates interleaved on one input stream, consumed by two
/// replicas with a failover half-way (SPEC §5.5): at the end every user
/// shares exactly the rooms the feed left it in, users in no room are
/// untracked (no devices), those in a room are fetched and fresh, and no
/// update's key change was published twice.
async fn two_workers_track_by_membership(backend: Backend) {
    use common::fetch_env::Env;
    use device_list_updater::config::Switch;
    use device_list_updater::testkit::remote::{Reply, device_list};
    use entity::{remote_device, shared_user};
    use sea_orm::{ColumnTrait, QueryFilter};
    const MEMBERS: usize = 24;
    const ROOMS: usize = 3;
    const STEPS: i64 = 30;
    let servers: Vec<String> = (0..4).map(|s| format!("s{s}.example")).collect();
    let server_names: Vec<&str> = servers.iter().map(String::as_str).collect();
    let member = |i: usize| format!("@m{i}:s{}.example", i % 4);
    let Env {
        nats: _nats,
        db: _db,
        js,
        worker: first,
        fleet,
        config,
    } = Env::start(backend, &server_names, Duration::ZERO, |config| {
        config.settings.membership = Switch::On;
    })
    .await;
    for i in 0..MEMBERS {
        let list = device_list(&member(i), 0, &[("PHONE", "Phone")]);
        fleet.script(&member(i), vec![Reply::Json(list)]);
    }
    let second = worker::start(config.clone()).await.expect("second replica");
    let publish = |subject: &'static str, body: serde_json::Value| {
        let js = js.clone();
        async move { common::publish(&js, subject, &body.to_string(), None).await }
    };
    let room = |r: usize| format!("!r{r}:our.example");
    for r in 0..ROOMS {
        let body = json!({"room_id": room(r), "state_key": "@me:our.example",
                          "membership": "join", "stream_ordering": 1});
        publish("devicelist.in.membership", body).await;
    }
    // A fixed pseudo-random walk of joins and leaves; the model is `joined`.
    let mut joined = [[false; ROOMS]; MEMBERS];
    let mut seed: u64 = 0x5eed;
    let mut next = |bound: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize % bound
    };
    let mut ordering = 1;
    let mut first = Some(first);
    // The walk is published faster than it is applied, and more so while
    // the second replica takes the input over: an update may be applied
    // (and its user asked for again) seconds after its reason was given,
    // and a request abandoned by the stopping replica is asked again by
    // the other. Reasons hold until the input is applied; the tail below
    // is checked by the guard in full.
    fleet.hold_reasons(true);
    for step in 1..=STEPS {
        if step == STEPS / 2 {
            // The replica consuming the input stops; the other takes over.
            if let Some(first) = first.take() {
                first.stop(Duration::from_secs(10)).await;
            }
        }
        for (i, rooms) in joined.iter_mut().enumerate() {
            if step == 1 || next(4) == 0 {
                let r = next(ROOMS);
                rooms[r] = !rooms[r];
                ordering += 1;
                let what = if rooms[r] { "join" } else { "leave" };
                let body = json!({"room_id": room(r), "state_key": member(i),
                                  "membership": what, "stream_ordering": ordering});
                fleet.room_reason();
                publish("devicelist.in.membership", body).await;
            }
            let body = json!({"user_id": member(i), "device_id": format!("D{}", step % 3),
                "device_display_name": format!("step {step}"), "stream_id": step,
                "prev_id": [step - 1], "keys": {"step": step}});
            fleet.reason(&member(i));
            publish("devicelist.in.update", body).await;
        }
    }
    let db = second.store.connection();
    wait_input_drained(&js).await;
    fleet.hold_reasons(false);
    let expected = |i: usize| joined[i].iter().filter(|&&j| j).count() as i32;
    common::eventually(Duration::from_secs(30), "the tracked set", || async {
        let shared: HashMap<String, i32> = shared_user::Entity::find()
            .all(db)
            .await
            .ok()?
            .into_iter()
            .map(|row| (row.user_id, row.shared_rooms))
            .collect();
        let stale = stale_user::Entity::find().count(db).await.ok()?;
        let outbox = second.store.outbox_len().await.ok()?;
        let right =
            (0..MEMBERS).all(|i| shared.get(&member(i)).copied().unwrap_or(0) == expected(i));
        (right
            && shared.len() == (0..MEMBERS).filter(|&i| expected(i) > 0).count()
            && stale == 0
            && outbox == 0)
            .then_some(())
    })
    .await;
    for i in 0..MEMBERS {
        let devices = remote_device::Entity::find()
            .filter(remote_device::Column::UserId.eq(member(i)))
            .count(db)
            .await
            .unwrap();
        if expected(i) == 0 {
            assert_eq!(devices, 0, "{} shares no room: untracked", member(i));
        } else {
            assert!(devices > 0, "{} shares a room: fetched", member(i));
        }
    }
    assert!(
        (0..MEMBERS).any(|i| expected(i) == 0) && (0..MEMBERS).any(|i| expected(i) > 1),
        "the walk leaves some users in no room and some in several"
    );
    // Whether the walk's updates applied or were covered by the fetches
    // depends on how soon the fetches ran (the fan-out gives way to ingest).
    // One more update per tracked user, following what is stored, must
    // apply: so the duplicate check below always has key changes to check.
    let mut tails = std::collections::HashSet::new();
    for i in (0..MEMBERS).filter(|&i| expected(i) > 0) {
        let state = remote_user::Entity::find_by_id(member(i))
            .one(db)
            .await
            .unwrap()
            .expect("a tracked user has stream state");
        let stream = state.max_stream_id + 1;
        let body = json!({"user_id": member(i), "device_id": "TAIL", "stream_id": stream,
            "prev_id": [state.max_stream_id], "keys": {"tail": true}});
        publish("devicelist.in.update", body).await;
        tails.insert((member(i), stream));
    }
    common::eventually(
        Duration::from_secs(30),
        "the tail updates applied",
        || async {
            let events = common::read_stream(&js, "KEY_CHANGE").await;
            let applied: std::collections::HashSet<(String, i64)> = events
                .iter()
                .filter(|event| event.json["device_id"] == "TAIL")
                .map(|event| {
                    let user = event.header("user_id").unwrap_or_default().to_owned();
                    (user, event.json["stream_id"].as_i64().unwrap_or_default())
                })
                .collect();
            (applied == tails).then_some(())
        },
    )
    .await;
    // An update's key change names its stream id; none twice.
    let events = common::read_stream(&js, "KEY_CHANGE").await;
    let mut seen = std::collections::HashSet::new();
    for event in &events {
        let user = event.header("user_id").unwrap_or_default().to_owned();
        let stream = event.json["stream_id"].as_i64().unwrap_or_default();
        let device = event.json["device_id"].to_string();
        if stream > 0 {
            assert!(
                seen.insert((user.clone(), stream, device)),
                "{user}: the key change of update {stream} published twice"
            );
        }
    }
    assert!(!seen.is_empty(), "updates were applied");
    second.stop(Duration::from_secs(10)).await;
}
both_backends!(membership_failover, two_workers_track_by_membership);
