//! Fetching that one bad user or one restart cannot stall (SPEC §5.2): a
//! user's own failures back off that user alone, asked waits and
//! `DLU_RETRY_MIN` are floors, an update from a server in back-off ends it
//! (across replicas, without a storm), a restart keeps the wait, a lost fetch
//! queue is rebuilt, a woken job whose replacement is not published at
//! first still runs, a job's lost ack reply strands nobody, and user ids
//! are percent-encoded in the path. Real nats-server, SQLite and
//! PostgreSQL, and a mock fleet that checks every X-Matrix signature and its
//! destination.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fetch_env::{Env, update};
use common::{Backend, metric_sample};
use device_list_updater::faults::Fault;
use device_list_updater::testkit::remote::{Reply, device_list};
use device_list_updater::worker;
use entity::{fetch_server, stale_user};
use sea_orm::EntityTrait;
use serde_json::json;
use tokio::sync::Notify;

const SERVER: &str = "remote.example";
const BAD: &str = "@bad:remote.example";

fn good_users() -> Vec<String> {
    (1..=4).map(|i| format!("@good{i}:{SERVER}")).collect()
}

fn list(user: &str) -> Reply {
    Reply::Json(device_list(user, 7, &[("D", "Phone")]))
}

fn unavailable() -> Reply {
    Reply::Status(503, json!({"errcode": "M_UNKNOWN"}), None)
}

/// The worker's `/metrics` sample `name`.
async fn metric(env: &Env, name: &str) -> Option<f64> {
    let (_, text) = common::http_get(env.worker.http_addr, "/metrics").await;
    metric_sample(&text, name)
}

async fn server_wait(env: &Env) -> Option<fetch_server::Model> {
    fetch_server::Entity::find_by_id(SERVER.to_owned())
        .one(env.db())
        .await
        .expect("query")
}

/// Waits until the server's job is in back-off after `failures` failures.
async fn wait_backing_off(env: &Env, failures: i32) -> fetch_server::Model {
    common::eventually(
        Duration::from_secs(20),
        "the server backing off",
        || async {
            server_wait(env)
                .await
                .filter(|w| w.failures >= failures && w.next_attempt_ms > 0)
        },
    )
    .await
}

/// The gaps between the requests for `user`.
fn gaps(env: &Env, user: &str) -> Vec<Duration> {
    env.fleet
        .request_times(user)
        .windows(2)
        .map(|w| w[1] - w[0])
        .collect()
}

/// What a user's own failure can look like: the server answers, but not with
/// a usable list for that user.
#[derive(Clone, Copy, Debug)]
enum BadAnswer {
    NotFound,
    Oversized,
    WrongUser,
}

impl BadAnswer {
    fn reply(self) -> Reply {
        match self {
            BadAnswer::NotFound => Reply::Status(404, json!({"errcode": "M_NOT_FOUND"}), None),
            BadAnswer::Oversized => Reply::Raw(vec![b' '; 11 * 1024 * 1024]),
            BadAnswer::WrongUser => {
                Reply::Json(device_list("@mallory:remote.example", 7, &[("D", "Phone")]))
            }
        }
    }
}

/// A server with one user whose answers are unusable and four good users:
/// the four are fresh while the bad one waits out its first back-off; the
/// bad one stays stale and is asked again no sooner than `DLU_RETRY_MIN`,
/// then no sooner than twice that.
async fn one_bad_user_blocks_nobody(backend: Backend, bad: BadAnswer) {
    let env = Env::start(backend, &[SERVER], Duration::ZERO, |c| {
        c.settings.retry_min = Duration::from_secs(3);
        c.settings.retry_max = Duration::from_secs(60);
    })
    .await;
    env.fleet.script(BAD, vec![bad.reply()]);
    let good = good_users();
    for user in &good {
        env.fleet.script(user, vec![list(user)]);
    }
    // The bad user first, so it is the oldest mark the job would retry.
    env.resync(BAD).await;
    common::eventually(Duration::from_secs(20), "the bad user asked", || async {
        (env.fleet.requests(BAD) >= 1).then_some(())
    })
    .await;
    for user in &good {
        env.resync(user).await;
    }
    for user in &good {
        env.wait_fresh(user, 1).await;
    }
    // All of them before the bad user's own wait was over.
    assert_eq!(
        env.fleet.requests(BAD),
        1,
        "the good users waited for the bad one"
    );
    common::eventually(
        Duration::from_secs(40),
        "the bad user asked three times",
        || async { (env.fleet.requests(BAD) >= 3).then_some(()) },
    )
    .await;
    let gaps = gaps(&env, BAD);
    assert!(gaps[0] >= Duration::from_secs(3), "first wait {gaps:?}");
    assert!(gaps[1] >= Duration::from_secs(6), "second wait {gaps:?}");
    // The third failure recorded (the request is answered before that).
    let row = common::eventually(
        Duration::from_secs(10),
        "three failures recorded",
        || async {
            stale_user::Entity::find_by_id(BAD.to_owned())
                .one(env.db())
                .await
                .expect("query")
                .filter(|row| row.failures >= 3)
        },
    )
    .await;
    assert!(row.last_error.is_some(), "{row:?}");
    // The server itself is fine; only the user backs off.
    assert!(server_wait(&env).await.is_none_or(|w| w.failures == 0));
    assert_eq!(metric(&env, "dlu_users_backing_off").await, Some(1.0));
    assert_eq!(metric(&env, "dlu_servers_backing_off").await, Some(0.0));
    assert!(good.iter().all(|u| env.fleet.requests(u) == 1));
    assert_eq!(env.fleet.bad_signatures(), 0);
}
both_backends!(not_found_user, |b| one_bad_user_blocks_nobody(
    b,
    BadAnswer::NotFound
));
both_backends!(oversized_user, |b| one_bad_user_blocks_nobody(
    b,
    BadAnswer::Oversized
));
both_backends!(wrong_user_id, |b| one_bad_user_blocks_nobody(
    b,
    BadAnswer::WrongUser
));

/// A wait the remote asks for (429 `retry_after_ms`, `Retry-After` on 429
/// and on 503) and `DLU_RETRY_MIN` are floors: never retried sooner.
async fn asked_waits_are_floors(backend: Backend) {
    let cases = [
        (
            "@a:one.example",
            Reply::Status(
                429,
                json!({"errcode": "M_LIMIT_EXCEEDED", "retry_after_ms": 1500}),
                None,
            ),
            Duration::from_millis(1500),
        ),
        (
            "@b:two.example",
            Reply::Status(429, json!({"errcode": "M_LIMIT_EXCEEDED"}), Some(2)),
            Duration::from_secs(2),
        ),
        (
            "@c:three.example",
            Reply::Status(503, json!({"errcode": "M_UNKNOWN"}), Some(2)),
            Duration::from_secs(2),
        ),
        // No wait asked: DLU_RETRY_MIN.
        (
            "@d:four.example",
            unavailable(),
            Duration::from_millis(1200),
        ),
    ];
    let servers = [
        "one.example",
        "two.example",
        "three.example",
        "four.example",
    ];
    let env = Env::start(backend, &servers, Duration::ZERO, |c| {
        c.settings.retry_min = Duration::from_millis(1200);
        c.settings.retry_max = Duration::from_secs(30);
    })
    .await;
    for (user, first, _) in &cases {
        env.fleet.script(user, vec![first.clone(), list(user)]);
        env.resync(user).await;
    }
    for (user, _, floor) in &cases {
        env.wait_fresh(user, 2).await;
        let gaps = gaps(&env, user);
        assert!(
            gaps[0] >= *floor,
            "{user}: retried after {gaps:?}, asked {floor:?}"
        );
    }
}
both_backends!(asked_waits, asked_waits_are_floors);

/// A server in a 40 s back-off comes back and sends an update: every stale
/// user of it is fresh within seconds, on one replica or two.
/// With `fault`, the woken job's waiting message is deleted but the job
/// replacing it is not published at first: it is enqueued all the same.
async fn update_ends_back_off(backend: Backend, replicas: usize, fault: Option<Fault>) {
    let env = Env::start(backend, &[SERVER], Duration::ZERO, |c| {
        c.settings.retry_min = Duration::from_secs(40);
        c.settings.retry_max = Duration::from_secs(60);
        c.settings.fault = fault;
    })
    .await;
    let mut others = Vec::new();
    for _ in 1..replicas {
        others.push(
            worker::start(env.config.clone())
                .await
                .expect("replica starts"),
        );
    }
    let users = good_users();
    env.fleet
        .script(&users[0], vec![unavailable(), list(&users[0])]);
    for user in &users[1..] {
        env.fleet.script(user, vec![list(user)]);
    }
    env.resync(&users[0]).await;
    wait_backing_off(&env, 1).await;
    for user in &users[1..] {
        env.resync(user).await;
    }
    // The server is up again and says so with an update.
    let carol = format!("@carol:{SERVER}");
    env.fleet.script(&carol, vec![list(&carol)]);
    let sent = Instant::now();
    env.update(update(&carol, "D", 7, &[], "Phone")).await;
    for user in users.iter().chain([&carol]) {
        env.wait_fresh(user, 1).await;
    }
    // Well before the 40 s back-off would have ended by itself.
    let took = sent.elapsed();
    assert!(took < Duration::from_secs(40), "fresh after {took:?}");
    assert_eq!(env.fleet.max_in_flight(SERVER), 1);
    assert_eq!(env.fleet.bad_signatures(), 0);
    for other in others {
        other.stop(Duration::from_secs(10)).await;
    }
}
both_backends!(update_wakes, |b| update_ends_back_off(b, 1, None));
both_backends!(update_wakes_two_replicas, |b| update_ends_back_off(
    b, 2, None
));
both_backends!(woken_job_not_published, |b| update_ends_back_off(
    b,
    1,
    Some(Fault::FailWakePublish)
));

/// A flapping server sends a storm of updates while it keeps failing: one
/// request in flight at a time, and at most one wake-up per `DLU_RETRY_MIN`.
async fn a_storm_of_updates_is_not_a_storm_of_requests(backend: Backend) {
    let env = Env::start(backend, &[SERVER], Duration::ZERO, |c| {
        c.settings.retry_min = Duration::from_secs(1);
        c.settings.retry_max = Duration::from_secs(30);
    })
    .await;
    let users: Vec<String> = (0..300).map(|i| format!("@u{i}:{SERVER}")).collect();
    for user in &users {
        env.fleet.script(user, vec![unavailable()]);
    }
    env.resync(&users[0]).await;
    wait_backing_off(&env, 1).await;
    let started = Instant::now();
    // Pacing, not synchronisation: the storm lasts about three seconds.
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for user in &users {
        tick.tick().await;
        env.update(update(user, "D", 1, &[], "Phone")).await;
    }
    common::wait_input_drained(&env.js).await;
    let window = started.elapsed();
    let wakes = metric(&env, "dlu_fetch_wakeups_total{reason=\"back_off_ended\"}")
        .await
        .unwrap_or(0.0);
    let allowed = window.as_secs_f64().ceil() + 1.0;
    assert!(wakes >= 1.0, "no wake-up at all");
    assert!(wakes <= allowed, "{wakes} wake-ups in {window:?}");
    let requests = env.fleet.total_requests();
    // The first failure, the wake-ups, and the back-off's own retries
    // (1 s, 2 s, 4 s, … after each failure).
    assert!(
        requests as f64 <= 1.0 + wakes + allowed,
        "{requests} requests in {window:?} with {wakes} wake-ups"
    );
    assert_eq!(env.fleet.max_in_flight(SERVER), 1);
}
both_backends!(update_storm, a_storm_of_updates_is_not_a_storm_of_requests);

/// A restart during a back-off does not end it: no request before the wait
/// is over, whether the fetch queue survived or was lost meanwhile.
async fn restart_keeps_the_wait(backend: Backend, lose_queue: bool) {
    let env = Env::start(backend, &[SERVER], Duration::ZERO, |c| {
        c.settings.retry_min = Duration::from_secs(4);
        c.settings.retry_max = Duration::from_secs(30);
    })
    .await;
    let user = &good_users()[0];
    env.fleet.script(user, vec![unavailable(), list(user)]);
    env.resync(user).await;
    wait_backing_off(&env, 1).await;
    let env = env.restart(lose_queue).await;
    env.wait_fresh(user, 2).await;
    let gaps = gaps(&env, user);
    assert!(gaps[0] >= Duration::from_secs(4), "retried after {gaps:?}");
}
both_backends!(restart_in_back_off, |b| restart_keeps_the_wait(b, false));
both_backends!(restart_lost_queue_in_back_off, |b| restart_keeps_the_wait(
    b, true
));

/// The fetch stream deleted while the worker is stopped: its stale users are
/// fetched after the start all the same, also when (`fault`) the start-up
/// rescan's first enqueue fails.
async fn lost_queue_is_rebuilt(backend: Backend, fault: Option<Fault>) {
    let env = Env::start(backend, &[SERVER], Duration::ZERO, |c| {
        c.settings.fault = fault;
    })
    .await;
    let users = good_users();
    // The first user's request hangs, so the job is in hand at the stop.
    env.fleet
        .script(&users[0], vec![Reply::Hang, list(&users[0])]);
    for user in &users[1..] {
        env.fleet.script(user, vec![list(user)]);
    }
    env.resync(&users[0]).await;
    common::eventually(Duration::from_secs(20), "a request hanging", || async {
        (env.fleet.requests(&users[0]) == 1).then_some(())
    })
    .await;
    for user in &users[1..] {
        env.resync(user).await;
    }
    common::wait_input_drained(&env.js).await;
    let env = env.restart(true).await;
    for user in &users[1..] {
        env.wait_fresh(user, 1).await;
    }
    env.wait_fresh(&users[0], 2).await;
}
both_backends!(lost_queue, |b| lost_queue_is_rebuilt(b, None));
both_backends!(lost_queue_rescan_fails, |b| lost_queue_is_rebuilt(
    b,
    Some(Fault::FailRescanEnqueue)
));

/// A job's final ack reaches NATS but its reply is lost: the job is gone,
/// and a user marked stale again while its request was in flight (kept
/// stale after the answer, and its own enqueue refused while the job was
/// in hand) is fetched all the same.
async fn lost_ack_reply_strands_nobody(backend: Backend) {
    let env = Env::start(backend, &[SERVER], Duration::ZERO, |c| {
        c.settings.fault = Some(Fault::LoseJobAckReply);
    })
    .await;
    let user = &good_users()[0];
    let gate = Arc::new(Notify::new());
    env.fleet.script(
        user,
        vec![Reply::Held(gate.clone(), Box::new(list(user))), list(user)],
    );
    env.resync(user).await;
    common::eventually(Duration::from_secs(20), "the request held", || async {
        (env.fleet.requests(user) == 1).then_some(())
    })
    .await;
    // A gap while the request is in flight: a new trigger, so the answer
    // to come leaves the user stale.
    env.update(update(user, "D2", 20, &[19], "Laptop")).await;
    common::eventually(
        Duration::from_secs(20),
        "the new trigger marked",
        || async {
            stale_user::Entity::find_by_id(user.to_owned())
                .one(env.db())
                .await
                .expect("query")
                .filter(|row| row.trigger_stream_ids.contains("20"))
        },
    )
    .await;
    gate.notify_one();
    env.wait_fresh(user, 2).await;
    assert_eq!(env.fleet.bad_signatures(), 0);
}
both_backends!(lost_ack_reply, lost_ack_reply_strands_nobody);

/// User ids are percent-encoded outside RFC 3986's unreserved set, and the
/// signature covers the path exactly as sent.
async fn path_is_encoded(backend: Backend) {
    let env = Env::start(backend, &[SERVER], Duration::ZERO, |_| {}).await;
    let cases = [
        (
            "@carol/q+r=s:remote.example",
            "/_matrix/federation/v1/user/devices/%40carol%2Fq%2Br%3Ds%3Aremote.example",
        ),
        (
            "@al~ice_.-9:remote.example",
            "/_matrix/federation/v1/user/devices/%40al~ice_.-9%3Aremote.example",
        ),
    ];
    for (user, _) in &cases {
        env.fleet.script(user, vec![list(user)]);
        env.resync(user).await;
    }
    for (user, _) in &cases {
        env.wait_fresh(user, 1).await;
    }
    let mut paths = env.fleet.raw_paths();
    paths.sort();
    let mut expected: Vec<&str> = cases.iter().map(|(_, path)| *path).collect();
    expected.sort();
    assert_eq!(paths, expected);
    assert_eq!(env.fleet.bad_signatures(), 0);
}
both_backends!(path_encoding, path_is_encoded);
