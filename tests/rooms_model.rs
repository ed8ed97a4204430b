//! Rooms and fetching against a model, end to end (SPEC §5.2, §5.5, §5.6):
//! a real worker, nats-server and database, and the mock fleet with its
//! request-loop guard on, under seeded random walks of joins and leaves
//! (remote users, member keys, our own user), links turning verified or
//! not, updates and resyncs, while the fleet answers each request at random
//! with a list, 404 or 500, every answer taking 30 ms.
//!
//! The model decides sharing by its definition (SPEC §5.5.1, §5.6.1) from
//! the latest change of each identity and link. Each step's input is
//! applied before the next is sent (so no later input can hide what it
//! did), and after each step:
//! - the users sharing a room are exactly the model's (the query RPC's
//!   `shared_rooms`, once sweeps are done);
//! - every user sharing a room whose server is not in back-off, and that is
//!   not in its own, has been fetched and is fresh (back-offs last an hour
//!   here, so none ends by itself: a user waiting only on another user's
//!   back-off would stay stale), and nothing is stored for anyone else;
//! - a user that shared no room before or after the step was not asked for
//!   during it;
//! - and throughout, no user is asked for again within `DLU_RETRY_MIN`
//!   without a reason (the fleet's guard).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::Backend;
use common::fetch_env::{Env, update};
use common::rooms::{link, member, query};
use device_list_updater::config::Switch;
use device_list_updater::testkit::remote::{Reply, device_list};
use serde_json::json;

const ME: &str = "@me:our.example";
const SERVERS: &[&str] = &["s0.example", "s1.example", "s2.example"];
const USERS: usize = 6;
const ROOMS: usize = 3;
/// Room 2 is a member-key room: its remote members join by keys.
const KEY_ROOM: usize = 2;
const STEPS: usize = 60;

fn user(u: usize) -> String {
    format!("@u{u}:s{}.example", u % SERVERS.len())
}

fn room(r: usize) -> String {
    format!("!r{r}:our.example")
}

/// User `u`'s member key in the key room.
fn key(u: usize) -> String {
    use base64::Engine as _;
    format!(
        "@{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode([u as u8 + 1; 32])
    )
}

/// A small deterministic generator (no extra crate for a test's dice).
struct Dice(u64);

impl Dice {
    fn roll(&mut self, bound: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as usize % bound
    }
}

/// The latest change per identity and link, and sharing by definition.
#[derive(Default)]
struct Model {
    /// (room, identity) joined.
    joined: BTreeSet<(usize, String)>,
    /// Key room: user → (link known, verified).
    links: BTreeMap<usize, bool>,
}

impl Model {
    fn ours(&self, r: usize) -> bool {
        self.joined.contains(&(r, ME.to_owned()))
    }

    fn shares(&self, u: usize) -> bool {
        (0..ROOMS).any(|r| {
            self.ours(r)
                && if r == KEY_ROOM {
                    self.joined.contains(&(r, key(u))) && self.links.get(&u) == Some(&true)
                } else {
                    self.joined.contains(&(r, user(u)))
                }
        })
    }
}

/// One random answer per request for a while, then lists for good.
fn script_at_random(env: &Env, dice: &mut Dice, u: usize) {
    let list = || Reply::Json(device_list(&user(u), 1, &[("PHONE", "Phone")]));
    let replies = (0..6)
        .map(|_| match dice.roll(4) {
            0 => Reply::Status(404, json!({"errcode": "M_NOT_FOUND"}), None),
            1 => Reply::Status(500, json!({"errcode": "M_UNKNOWN"}), None),
            _ => list(),
        })
        .chain([list()])
        .collect();
    env.fleet.script(&user(u), replies);
}

async fn walk(backend: Backend, seed: u64) {
    let env = Env::start(backend, SERVERS, Duration::from_millis(30), |config| {
        config.settings.membership = Switch::On;
        config.settings.msc4430 = Switch::On;
        // Back-offs that do not end by themselves within the test: a user
        // fetched anyway was fetched for a reason, and one left stale
        // stays so.
        config.settings.retry_min = Duration::from_secs(3600);
        config.settings.retry_max = Duration::from_secs(7200);
    })
    .await;
    let mut dice = Dice(seed);
    let mut model = Model::default();
    let mut ordering: i64 = 0;
    for u in 0..USERS {
        script_at_random(&env, &mut dice, u);
    }
    for _ in 0..STEPS {
        let shared_before: BTreeSet<usize> = (0..USERS).filter(|&u| model.shares(u)).collect();
        let requests_before: Vec<usize> =
            (0..USERS).map(|u| env.fleet.requests(&user(u))).collect();
        ordering += 1;
        let u = dice.roll(USERS);
        let action = dice.roll(10);
        // Half of the membership changes are in the key room.
        let r = if action < 2 {
            KEY_ROOM
        } else {
            dice.roll(ROOMS)
        };
        match action {
            // A remote member joins or leaves (by key in the key room).
            0..=3 => {
                let who = if r == KEY_ROOM { key(u) } else { user(u) };
                let join = !model.joined.contains(&(r, who.clone()));
                let what = if join { "join" } else { "leave" };
                member(&env, &room(r), &who, what, ordering).await;
                match join {
                    true => model.joined.insert((r, who)),
                    false => model.joined.remove(&(r, who)),
                };
            }
            // Our user joins or leaves.
            4 => {
                let join = !model.ours(r);
                let what = if join { "join" } else { "leave" };
                member(&env, &room(r), ME, what, ordering).await;
                match join {
                    true => model.joined.insert((r, ME.to_owned())),
                    false => model.joined.remove(&(r, ME.to_owned())),
                };
            }
            // A key's link turns verified or not.
            5 => {
                let verified = !model.links.get(&u).copied().unwrap_or(false);
                link(
                    &env,
                    &room(KEY_ROOM),
                    &key(u),
                    Some(&user(u)),
                    verified,
                    ordering,
                )
                .await;
                model.links.insert(u, verified);
            }
            // An update that does not chain (the user goes stale).
            6 => {
                let stream = 100 + ordering;
                env.update(update(&user(u), "LAPTOP", stream, &[stream - 50], "Laptop"))
                    .await;
            }
            // A resync.
            _ => env.resync(&user(u)).await,
        }
        // Each step settles before the next, so no later input can hide
        // what this one did (a wake-up noted for another user's message).
        env.settled().await;
        settled_as_modelled(&env, &model, seed).await;
        for (u, before) in requests_before.iter().enumerate() {
            let asked = env.fleet.requests(&user(u));
            if !shared_before.contains(&u) && !model.shares(u) {
                assert_eq!(
                    asked,
                    *before,
                    "{} asked for while sharing no room, seed {seed}",
                    user(u)
                );
            }
        }
    }
}

/// Waits until the worker agrees with the model: sweeps done; the users
/// sharing a room exactly the model's; each of them fresh, or waiting on a
/// back-off of its own (404) or of its server (500); nothing stored for
/// the others.
async fn settled_as_modelled(env: &Env, model: &Model, seed: u64) {
    let what = format!("the model's state, seed {seed}");
    common::eventually(Duration::from_secs(10), &what, || async {
        if !env.worker.store.rooms_to_sweep().await.ok()?.is_empty() {
            return None;
        }
        for u in 0..USERS {
            let view = query(env, &user(u)).await;
            let shares = view["shared_rooms"].as_u64().is_some_and(|n| n > 0);
            let right = match model.shares(u) {
                true => shares && (view["stale"] == json!(false) || backing_off(env, u).await),
                false => !shares && view["tracked"] == json!(false),
            };
            if !right {
                return None;
            }
        }
        Some(())
    })
    .await;
}

/// Whether user `u` or its server waits out a back-off.
async fn backing_off(env: &Env, u: usize) -> bool {
    use sea_orm::EntityTrait as _;
    let now = device_list_updater::store::now_ms();
    let own = entity::stale_user::Entity::find_by_id(user(u))
        .one(env.db())
        .await
        .ok()
        .flatten()
        .is_some_and(|row| row.next_attempt_ms > now);
    let server = format!("s{}.example", u % SERVERS.len());
    let server = entity::fetch_server::Entity::find_by_id(server)
        .one(env.db())
        .await
        .ok()
        .flatten()
        .is_some_and(|row| row.failures > 0 && row.next_attempt_ms > now);
    own || server
}

async fn walks(backend: Backend) {
    for seed in [11, 2026, 90210] {
        walk(backend, seed).await;
    }
}
both_backends!(walks_match_the_model, walks);
