//! Revalidation (SPEC §5.7): lists a remote server changed without telling
//! us are found, stored, emitted once and counted as divergences; the
//! fetches are spread evenly with no burst after a restart or an outage;
//! stale users go first; a server's job not enqueued at first is enqueued
//! later; a failure leaves the list and the user's freshness
//! alone and backs off as §5.2 says; `admin servers` shows it all. Real
//! nats-server, SQLite and PostgreSQL, and a mock fleet that checks every
//! X-Matrix signature and its destination.

mod common;

use std::time::{Duration, Instant};

use common::fetch_env::{Env, update};
use common::{Backend, metric_sample, wait_stream};
use device_list_updater::admin;
use device_list_updater::faults::Fault;
use device_list_updater::testkit::remote::{Reply, device_list};
use entity::{fetch_server, remote_user, revalidation};
use sea_orm::{ActiveValue::Set, EntityTrait};
use serde_json::json;

const SERVER: &str = "remote.example";

/// The worker's `/metrics` sample `name` (0 when absent).
async fn metric(env: &Env, name: &str) -> f64 {
    let (_, text) = common::http_get(env.worker.http_addr, "/metrics").await;
    metric_sample(&text, name).unwrap_or(0.0)
}

fn cross_signing_key(user: &str, usage: &str, seed: u8) -> serde_json::Value {
    use base64::Engine as _;
    let key = base64::engine::general_purpose::STANDARD_NO_PAD.encode([seed; 32]);
    json!({"user_id": user, "usage": [usage], "keys": {format!("ed25519:{key}"): key}})
}

/// A list with `devices` and a master key made from `master`.
fn list(user: &str, stream_id: i64, devices: &[(&str, &str)], master: u8) -> serde_json::Value {
    let mut list = device_list(user, stream_id, devices);
    list["master_key"] = cross_signing_key(user, "master", master);
    list
}

/// Stores `users` as tracked and never fetched, as a database migrated from
/// before revalidation has them: every one is due at once.
async fn seed_never_fetched(env: &Env, users: &[String]) {
    for chunk in users.chunks(500) {
        remote_user::Entity::insert_many(chunk.iter().map(|user| {
            remote_user::ActiveModel {
                user_id: Set(user.clone()),
                server_name: Set(user
                    .split_once(':')
                    .map(|(_, s)| s)
                    .unwrap_or_default()
                    .into()),
                known_stream_ids: Set("[0]".into()),
                max_stream_id: Set(0),
                fetched_stream_id: Set(0),
                fetched_at_ms: Set(0),
            }
        }))
        .exec(env.db())
        .await
        .expect("seed users");
    }
}

/// Each way a remote can change a list without an update is found once.
async fn divergences_are_found_stored_and_counted(backend: Backend) {
    let env = Env::start(backend, &[SERVER], Duration::ZERO, |c| {
        c.settings.revalidate_after = Duration::from_secs(2);
    })
    .await;
    let user = |name: &str| format!("@{name}:{SERVER}");
    let names = ["adds", "changes", "removes", "master", "same"];
    let before = [("A", "Phone"), ("B", "Laptop")];
    for name in names {
        let user = user(name);
        env.fleet
            .script(&user, vec![Reply::Json(list(&user, 1, &before, 1))]);
        env.resync(&user).await;
    }
    for name in names {
        env.wait_fresh(&user(name), 1).await;
    }
    // Two devices and a master key each.
    wait_stream(&env.js, "KEY_CHANGE", 15).await;

    // The remote changes four lists and sends no update.
    let adds = user("adds");
    let after = [("A", "Phone"), ("B", "Laptop"), ("C", "Tablet")];
    env.fleet
        .script(&adds, vec![Reply::Json(list(&adds, 2, &after, 1))]);
    let changes = user("changes");
    let mut changed = list(&changes, 2, &before, 1);
    changed["devices"][0]["keys"]["keys"]["curve25519:A"] = json!("a new curve25519 key");
    env.fleet.script(&changes, vec![Reply::Json(changed)]);
    let removes = user("removes");
    env.fleet.script(
        &removes,
        vec![Reply::Json(list(&removes, 2, &[("A", "Phone")], 1))],
    );
    let master = user("master");
    env.fleet
        .script(&master, vec![Reply::Json(list(&master, 2, &before, 2))]);

    // Every list revalidated twice: the second finds nothing new.
    common::eventually(
        Duration::from_secs(30),
        "every list revalidated twice",
        || async {
            names
                .iter()
                .all(|n| env.fleet.requests(&user(n)) >= 3)
                .then_some(())
        },
    )
    .await;
    env.settled().await;
    let events = wait_stream(&env.js, "KEY_CHANGE", 19).await;
    let new: Vec<(String, String)> = events[15..]
        .iter()
        .map(|e| {
            let who = e.json["user_id"].as_str().unwrap_or_default().to_owned();
            (who, e.subject.clone())
        })
        .collect();
    for (user, subject) in [
        (&adds, "key_change.device"),
        (&changes, "key_change.device"),
        (&removes, "key_change.device"),
        (&master, "key_change.cross_signing"),
    ] {
        assert!(
            new.contains(&(user.clone(), subject.to_owned())),
            "{user}: no {subject} in {new:?}"
        );
    }
    assert_eq!(
        env.devices(&adds).await,
        [
            ("A".into(), false),
            ("B".into(), false),
            ("C".into(), false)
        ]
    );
    assert_eq!(
        env.devices(&removes).await,
        [("A".into(), false), ("B".into(), true)]
    );
    for name in names {
        assert!(!env.is_stale(&user(name)).await, "{name} is not stale");
    }
    assert_eq!(
        metric(&env, "dlu_revalidation_divergences_total").await,
        4.0
    );
    assert_eq!(
        metric(&env, "dlu_revalidations_total{outcome=\"diverged\"}").await,
        4.0
    );
    assert!(metric(&env, "dlu_revalidations_total{outcome=\"unchanged\"}").await >= 6.0);

    // `admin servers`, as JSON and as text.
    let servers = admin::servers(&env.worker.store)
        .await
        .expect("admin servers");
    let row = &servers["servers"][0];
    assert_eq!(row["server_name"], SERVER, "{servers:#}");
    assert_eq!(row["tracked_users"], 5, "{servers:#}");
    assert_eq!(row["stale_users"], 0, "{servers:#}");
    assert_eq!(row["divergences"], 4, "{servers:#}");
    assert!(
        row["revalidations"].as_i64().unwrap_or(0) >= 10,
        "{servers:#}"
    );
    assert!(row["last_success_at_ms"].as_i64().is_some(), "{servers:#}");
    assert!(
        row["last_divergence_at_ms"].as_i64().is_some(),
        "{servers:#}"
    );
    assert_eq!(row["retry_at_ms"], serde_json::Value::Null, "{servers:#}");
    let text = admin::to_text(&servers);
    for line in [
        &format!("server_name: {SERVER}"),
        "divergences: 4",
        "last_success_at: ",
        "tracked_users: 5",
    ] {
        assert!(text.contains(line), "{line:?} not in\n{text}");
    }
    env.worker.stop(Duration::from_secs(10)).await;
}

/// A revalidation that fails (500, a timeout, 404) leaves the list stored
/// and the user fresh, and backs off the server or the user as §5.2 says.
async fn failures_leave_the_list_alone(backend: Backend) {
    const OTHER: &str = "other.example";
    let retry_min = Duration::from_secs(1);
    let env = Env::start(backend, &[SERVER, OTHER], Duration::ZERO, |c| {
        c.settings.revalidate_after = Duration::from_millis(500);
        c.settings.retry_min = retry_min;
        c.settings.retry_max = Duration::from_secs(30);
        c.settings.federation_timeout = Duration::from_secs(1);
    })
    .await;
    let flaky = format!("@flaky:{SERVER}");
    let gone = format!("@gone:{OTHER}");
    let devices = [("A", "Phone")];
    for user in [&flaky, &gone] {
        env.fleet
            .script(user, vec![Reply::Json(list(user, 1, &devices, 1))]);
        env.resync(user).await;
    }
    for user in [&flaky, &gone] {
        env.wait_fresh(user, 1).await;
    }
    wait_stream(&env.js, "KEY_CHANGE", 4).await;
    let error = Reply::Status(500, json!({"errcode": "M_UNKNOWN"}), None);
    env.fleet.script(
        &flaky,
        vec![
            error,
            Reply::Hang,
            Reply::Json(list(&flaky, 1, &devices, 1)),
        ],
    );
    let not_found = Reply::Status(404, json!({"errcode": "M_NOT_FOUND"}), None);
    env.fleet.script(&gone, vec![not_found]);

    // The flaky server: its back-off after the 500 and the timeout, each
    // request at least as far apart as its wait.
    common::eventually(
        Duration::from_secs(30),
        "the flaky server backing off twice",
        || async {
            let wait = fetch_server::Entity::find_by_id(SERVER.to_owned())
                .one(env.db())
                .await
                .ok()??;
            (wait.failures >= 2).then_some(())
        },
    )
    .await;
    // The 404: the user's own back-off, growing; the revalidation stays
    // queued with it.
    let queued = common::eventually(Duration::from_secs(30), "three 404s recorded", || async {
        revalidation::Entity::find_by_id(gone.clone())
            .one(env.db())
            .await
            .ok()?
            .filter(|row| row.failures >= 3)
    })
    .await;
    assert!(queued.next_attempt_ms > 0, "{queued:?}");
    let times = env.fleet.request_times(&gone);
    let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
    // gaps[0]: from the first fetch to the first revalidation.
    assert!(gaps[1] >= retry_min, "{gaps:?}");
    assert!(gaps[2] >= retry_min * 2, "{gaps:?}");

    // The flaky server answers at last: its back-off is over.
    common::eventually(
        Duration::from_secs(30),
        "the flaky server answering",
        || async {
            let wait = fetch_server::Entity::find_by_id(SERVER.to_owned())
                .one(env.db())
                .await
                .ok()?;
            (env.fleet.requests(&flaky) >= 4 && wait.is_none_or(|w| w.failures == 0)).then_some(())
        },
    )
    .await;
    for user in [&flaky, &gone] {
        assert!(!env.is_stale(user).await, "{user} is not stale");
        assert_eq!(env.devices(user).await, [("A".into(), false)], "{user}");
    }
    env.settled().await;
    wait_stream(&env.js, "KEY_CHANGE", 4).await;
    assert!(metric(&env, "dlu_revalidations_total{outcome=\"failed\"}").await >= 5.0);
    assert_eq!(
        metric(&env, "dlu_revalidation_divergences_total").await,
        0.0
    );
    let servers = admin::servers(&env.worker.store)
        .await
        .expect("admin servers");
    let other = servers["servers"]
        .as_array()
        .and_then(|all| all.iter().find(|s| s["server_name"] == OTHER))
        .cloned()
        .unwrap_or_default();
    assert_eq!(other["queued_revalidations"], 1, "{servers:#}");
    env.worker.stop(Duration::from_secs(10)).await;
}

/// While revalidations keep every server busy, a user made stale by an
/// update is fetched within a second.
async fn stale_users_go_first(backend: Backend) {
    const SERVERS: [&str; 2] = ["one.example", "two.example"];
    // 100 ms per request and 50 revalidations per second per server: the
    // servers' jobs are never idle and each has a backlog of revalidations
    // queued (as many as a server may have), which a stale user skips.
    let env = Env::start(backend, &SERVERS, Duration::from_millis(100), |c| {
        c.settings.revalidate_after = Duration::from_secs(2);
    })
    .await;
    let users: Vec<String> = SERVERS
        .iter()
        .flat_map(|s| (0..100).map(move |i| format!("@u{i}:{s}")))
        .collect();
    for user in &users {
        env.fleet
            .script(user, vec![Reply::Json(device_list(user, 1, &[("A", "P")]))]);
    }
    seed_never_fetched(&env, &users).await;
    common::eventually(
        Duration::from_secs(30),
        "a backlog of revalidations",
        || async {
            let queued = metric(&env, "dlu_revalidations_queued").await;
            (queued >= 40.0).then_some(())
        },
    )
    .await;
    let running = metric(&env, "dlu_revalidations_total{outcome=\"diverged\"}").await;
    for (i, server) in SERVERS.iter().cycle().take(4).enumerate() {
        let user = format!("@stale{i}:{server}");
        env.fleet.script(
            &user,
            vec![Reply::Json(device_list(&user, 2, &[("A", "P")]))],
        );
        let published = Instant::now();
        env.update(update(&user, "A", 2, &[1], "P")).await;
        let asked = common::eventually(Duration::from_secs(10), "the stale user asked", || async {
            env.fleet.request_times(&user).first().copied()
        })
        .await;
        let waited = asked - published;
        assert!(
            waited <= Duration::from_secs(1),
            "{user} asked for {waited:?} after its update"
        );
    }
    // Revalidations ran all along.
    let done = metric(&env, "dlu_revalidations_total{outcome=\"diverged\"}").await;
    assert!(done > running, "{done} revalidations, {running} before");
    env.worker.stop(Duration::from_secs(10)).await;
}

/// Requests in the busiest one-second window starting at any request
/// after `from`, and the count after `from`.
fn busiest_second(times: &[Instant], from: Instant) -> (usize, usize) {
    let mut after: Vec<Instant> = times.iter().copied().filter(|t| *t >= from).collect();
    after.sort_unstable();
    let mut most = 0;
    let mut end = 0;
    for start in 0..after.len() {
        while end < after.len() && after[end] < after[start] + Duration::from_secs(1) {
            end += 1;
        }
        most = most.max(end - start);
    }
    (most, after.len())
}

/// Every request time of `users`.
fn all_times(env: &Env, users: &[String]) -> Vec<Instant> {
    users
        .iter()
        .flat_map(|u| env.fleet.request_times(u))
        .collect()
}

/// 2,000 tracked users, all due, on 20 servers, period 20 s: about 100
/// revalidations per second, never more than 200 in any second, also right
/// after a restart and after a 30 s outage of every server.
async fn spread_evenly(backend: Backend) {
    let servers: Vec<String> = (0..20).map(|i| format!("s{i}.example")).collect();
    let names: Vec<&str> = servers.iter().map(String::as_str).collect();
    // Seeded before revalidation starts, so the pacer counts them all at once.
    let mut env = Env::start(backend, &names, Duration::ZERO, |_| {}).await;
    let users: Vec<String> = servers
        .iter()
        .flat_map(|s| (0..100).map(move |i| format!("@u{i}:{s}")))
        .collect();
    let answer = |user: &String| Reply::Json(device_list(user, 1, &[("A", "P")]));
    for user in &users {
        env.fleet.script(user, vec![answer(user)]);
    }
    seed_never_fetched(&env, &users).await;
    env.config.settings.revalidate_after = Duration::from_secs(20);
    let env = env.restart(false).await;
    let started = Instant::now();
    let count = |env: &Env| all_times(env, &users).len();
    common::eventually(Duration::from_secs(30), "1,000 revalidations", || async {
        (count(&env) >= 1_000).then_some(())
    })
    .await;
    let mut times = all_times(&env, &users);
    times.sort_unstable();
    let took = times[times.len() - 1] - times[0];
    let (most, n) = busiest_second(&times, started);
    let rate = (n - 1) as f64 / took.as_secs_f64();
    eprintln!("steady: {n} in {took:?} ({rate:.0}/s), busiest second {most}");
    assert!((75.0..=125.0).contains(&rate), "{rate:.0} per second");
    assert!(most <= 200, "{most} in one second");

    // A restart saves nothing up.
    let env = env.restart(false).await;
    let restarted = Instant::now();
    let before = count(&env);
    common::eventually(
        Duration::from_secs(30),
        "500 more after the restart",
        || async { (count(&env) >= before + 500).then_some(()) },
    )
    .await;
    let (most, n) = busiest_second(&all_times(&env, &users), restarted);
    eprintln!(
        "after the restart: {n} in {:?}, busiest second {most}",
        restarted.elapsed()
    );
    assert!(most <= 200, "{most} in one second after the restart");

    // Every server down for 30 s, then back.
    let down = Reply::Status(503, json!({"errcode": "M_UNKNOWN"}), None);
    for user in &users {
        env.fleet.script(user, vec![down.clone()]);
    }
    // The outage's length is the scenario, not a wait for something.
    tokio::time::sleep(Duration::from_secs(30)).await;
    for user in &users {
        env.fleet.script(user, vec![answer(user)]);
    }
    let back = Instant::now();
    let before = count(&env);
    common::eventually(
        Duration::from_secs(30),
        "500 more after the outage",
        || async { (count(&env) >= before + 500).then_some(()) },
    )
    .await;
    let (most, n) = busiest_second(&all_times(&env, &users), back);
    eprintln!(
        "after the outage: {n} in {:?}, busiest second {most}",
        back.elapsed()
    );
    assert!(most <= 200, "{most} in one second after the outage");
    env.worker.stop(Duration::from_secs(10)).await;
}

/// With membership on, only users who share a room with us are
/// revalidated: a stored user from before the switch-on that shares none is
/// never asked for (SPEC §5.5.9), one that shares a room is, and the queued
/// revalidation of a user who stops sharing goes with the rest of its rows.
async fn only_users_sharing_a_room(backend: Backend) {
    use device_list_updater::config::Switch;
    const ME: &str = "@me:our.example";
    const ROOM: &str = "!a:our.example";
    let bob = format!("@bob:{SERVER}");
    let dan = format!("@dan:{SERVER}");
    let env = Env::start(backend, &[SERVER], Duration::ZERO, |c| {
        c.settings.membership = Switch::On;
        c.settings.revalidate_after = Duration::from_millis(500);
    })
    .await;
    // Stored before membership was switched on, never fetched since.
    common::known_user(env.db(), &bob).await;
    for user in [&bob, &dan] {
        env.fleet
            .script(user, vec![Reply::Json(device_list(user, 1, &[("A", "P")]))]);
    }
    common::rooms::member(&env, ROOM, ME, "join", 1).await;
    common::rooms::member(&env, ROOM, &dan, "join", 2).await;
    common::eventually(Duration::from_secs(30), "dan revalidated twice", || async {
        (env.fleet.requests(&dan) >= 3).then_some(())
    })
    .await;
    assert_eq!(env.fleet.requests(&bob), 0, "bob shares no room");
    assert!(
        revalidation::Entity::find_by_id(bob.clone())
            .one(env.db())
            .await
            .expect("query")
            .is_none(),
        "bob is never queued"
    );
    // Dan leaves with a revalidation queued (held back by its own wait):
    // every row of his goes, the queued revalidation included.
    let held = revalidation::ActiveModel {
        user_id: Set(dan.clone()),
        server_name: Set(SERVER.into()),
        queued_at_ms: Set(0),
        failures: Set(1),
        next_attempt_ms: Set(i64::MAX / 2),
        last_error: Set(None),
    };
    revalidation::Entity::insert(held)
        .on_conflict(
            sea_orm::sea_query::OnConflict::column(revalidation::Column::UserId)
                .update_column(revalidation::Column::NextAttemptMs)
                .to_owned(),
        )
        .exec(env.db())
        .await
        .expect("a queued revalidation");
    common::rooms::member(&env, ROOM, &dan, "leave", 3).await;
    common::eventually(Duration::from_secs(20), "dan's rows gone", || async {
        let user = remote_user::Entity::find_by_id(dan.clone())
            .one(env.db())
            .await
            .ok()?;
        let queued = revalidation::Entity::find_by_id(dan.clone())
            .one(env.db())
            .await
            .ok()?;
        (user.is_none() && queued.is_none()).then_some(())
    })
    .await;
    env.worker.stop(Duration::from_secs(10)).await;
}

/// The pacer queues a revalidation but its server's job is not enqueued at
/// first: it is enqueued later, and the revalidation sent.
async fn unqueued_jobs_are_enqueued_later(backend: Backend) {
    let env = Env::start(backend, &[SERVER], Duration::ZERO, |c| {
        c.settings.revalidate_after = Duration::from_secs(2);
        c.settings.fault = Some(Fault::FailRevalidationEnqueue);
    })
    .await;
    let user = format!("@old:{SERVER}");
    env.fleet.script(
        &user,
        vec![Reply::Json(device_list(&user, 1, &[("A", "P")]))],
    );
    seed_never_fetched(&env, std::slice::from_ref(&user)).await;
    common::eventually(Duration::from_secs(20), "the revalidation sent", || async {
        (env.fleet.requests(&user) > 0).then_some(())
    })
    .await;
    env.worker.stop(Duration::from_secs(10)).await;
}

both_backends!(divergences, divergences_are_found_stored_and_counted);
both_backends!(unqueued, unqueued_jobs_are_enqueued_later);
both_backends!(failures, failures_leave_the_list_alone);
both_backends!(stale_first, stale_users_go_first);
both_backends!(spread, spread_evenly);
both_backends!(sharing, only_users_sharing_a_room);

#[test]
fn busiest_second_counts_a_sliding_window() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let times = [at(0), at(100), at(900), at(1_050), at(1_800), at(2_500)];
    assert_eq!(busiest_second(&times, t0), (3, 6));
    assert_eq!(busiest_second(&times, at(1_000)), (2, 3));
}
