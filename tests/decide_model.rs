//! Property tests of the decision core (`decide::plan_batch` and
//! `decide::fetched::plan_fetch`) against a model of remote servers.
//!
//! Each remote user has a true device list that changes step by step; every
//! change is announced with an `m.device_list_update` whose `prev_id` is the
//! previous change's stream id, as Synapse and Dendrite send them. The network
//! between the remote and us loses, duplicates and reorders those updates,
//! and fetches of the full list start and finish at any time (so an answer
//! can be older than updates applied meanwhile). Our side is the pure
//! decision core plus an in-memory copy of what the store would hold.
//!
//! Properties, for every generated history:
//! 1. Convergence: once the remote's last update has arrived and every user
//!    left stale has been fetched, our devices equal the remote's.
//! 2. Events tell the whole story: replaying the emitted key changes over
//!    the initial (empty) state gives our final devices.
//! 3. Nothing is emitted twice in a row for the same device state.

use std::collections::{BTreeMap, HashMap};

use device_list_updater::decide::device::DeviceRow;
use device_list_updater::decide::fetched::{FetchedDevice, FetchedList, StoredUser, plan_fetch};
use device_list_updater::decide::{Snapshot, StaleMark, UserState, plan_batch};
use device_list_updater::input::{DeviceListUpdate, InputMessage};
use device_list_updater::key_change::KeyChange;
use proptest::prelude::*;
use ruma::{OwnedDeviceId, OwnedUserId};

const USERS: usize = 3;
const DEVICES: usize = 4;

/// One step of a generated history.
#[derive(Clone, Debug)]
enum Step {
    /// The remote changes a device (`None`: deletes it) and sends an update.
    RemoteChange {
        user: usize,
        device: usize,
        name: Option<u8>,
    },
    /// Up to `count` in-flight updates arrive together, as one batch, picked
    /// from the in-flight pool starting at `pick` (so out of order).
    Deliver { pick: usize, count: usize },
    /// An in-flight update is lost.
    Lose { pick: usize },
    /// An update that already arrived arrives again.
    Duplicate { pick: usize },
    /// A fetch of a stale user starts: the remote answers with its list now.
    FetchStart { user: usize },
    /// A started fetch's answer is stored.
    FetchFinish { pick: usize },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..USERS, 0..DEVICES, proptest::option::weighted(0.8, any::<u8>()))
            .prop_map(|(user, device, name)| Step::RemoteChange { user, device, name }),
        4 => (any::<usize>(), 1..6usize).prop_map(|(pick, count)| Step::Deliver { pick, count }),
        1 => any::<usize>().prop_map(|pick| Step::Lose { pick }),
        1 => any::<usize>().prop_map(|pick| Step::Duplicate { pick }),
        1 => (0..USERS).prop_map(|user| Step::FetchStart { user }),
        1 => any::<usize>().prop_map(|pick| Step::FetchFinish { pick }),
    ]
}

fn user_id(user: usize) -> OwnedUserId {
    OwnedUserId::try_from(format!("@u{user}:remote{user}.example")).expect("user id")
}

fn device_id(device: usize) -> OwnedDeviceId {
    OwnedDeviceId::from(format!("D{device}"))
}

/// The device-keys JSON the remote sends for a device in a given state.
fn keys_json(user: usize, device: usize, name: u8) -> String {
    format!(
        r#"{{"user_id":"{}","device_id":"D{device}","keys":{{"v":"{name}"}}}}"#,
        user_id(user)
    )
}

/// What a device looks like to a client: display name and keys.
type Visible = BTreeMap<(OwnedUserId, OwnedDeviceId), (Option<String>, Option<String>)>;

/// The remote servers: the true lists and their stream positions.
#[derive(Default)]
struct Remote {
    devices: HashMap<usize, BTreeMap<usize, u8>>,
    stream: HashMap<usize, i64>,
}

impl Remote {
    fn change(&mut self, user: usize, device: usize, name: Option<u8>) -> InputMessage {
        let stream = self.stream.entry(user).or_insert(0);
        let prev = *stream;
        *stream += 1;
        let list = self.devices.entry(user).or_default();
        match name {
            Some(name) => list.insert(device, name),
            None => list.remove(&device),
        };
        InputMessage::Update(DeviceListUpdate {
            user_id: user_id(user),
            device_id: device_id(device),
            display_name: name.map(|n| format!("name {n}")),
            stream_id: *stream,
            // A user's first update has no predecessor, as on Synapse.
            prev_ids: if prev == 0 { vec![] } else { vec![prev] },
            deleted: name.is_none(),
            keys: name.map(|n| keys_json(user, device, n)),
        })
    }

    fn list(&self, user: usize) -> FetchedList {
        let devices = self.devices.get(&user).cloned().unwrap_or_default();
        FetchedList {
            user_id: user_id(user).to_string(),
            stream_id: self.stream.get(&user).copied().unwrap_or(0),
            devices: devices
                .iter()
                .map(|(&device, &name)| FetchedDevice {
                    device_id: device_id(device),
                    display_name: Some(format!("name {name}")),
                    keys: keys_json(user, device, name),
                })
                .collect(),
            master_key: None,
            self_signing_key: None,
        }
    }

    fn visible(&self) -> Visible {
        let mut out = Visible::new();
        for (&user, devices) in &self.devices {
            for (&device, &name) in devices {
                out.insert(
                    (user_id(user), device_id(device)),
                    (
                        Some(format!("name {name}")),
                        Some(keys_json(user, device, name)),
                    ),
                );
            }
        }
        out
    }
}

/// What the store would hold, and every event emitted.
#[derive(Default)]
struct Ours {
    users: HashMap<OwnedUserId, UserState>,
    devices: HashMap<(OwnedUserId, OwnedDeviceId), DeviceRow>,
    stale: HashMap<OwnedUserId, StaleMark>,
    events: Vec<KeyChange>,
}

impl Ours {
    fn ingest(&mut self, batch: &[InputMessage]) {
        let snapshot = Snapshot {
            users: self.users.clone(),
            devices: self.devices.clone(),
            stale: self.stale.clone(),
            cross_signing: HashMap::new(),
            rooms: None,
        };
        let plan = plan_batch(snapshot, batch, 0);
        self.users.extend(plan.users);
        self.devices.extend(plan.devices);
        self.stale.extend(plan.stale);
        self.events.extend(plan.events);
    }

    fn stored(&self, user: &OwnedUserId) -> StoredUser {
        StoredUser {
            devices: self
                .devices
                .iter()
                .filter(|((u, _), _)| u == user)
                .map(|((_, d), row)| (d.clone(), row.clone()))
                .collect(),
            state: self.users.get(user).cloned().unwrap_or_default(),
            cross_signing: BTreeMap::new(),
            stale: self.stale.get(user).cloned(),
        }
    }

    /// Stores an answer, as `Store::apply_fetch` does with the plan.
    fn finish_fetch(&mut self, fetch: &Fetch) {
        let stored = self.stored(&fetch.user);
        let plan = plan_fetch(
            &fetch.user,
            &stored,
            fetch.stale_at_start.as_ref(),
            &fetch.answer,
            1000,
        )
        .expect("the answer is about the requested user");
        for (device, row) in plan.devices {
            self.devices.insert((fetch.user.clone(), device), row);
        }
        self.users.insert(fetch.user.clone(), plan.state);
        match plan.still_stale {
            Some(mark) => self.stale.insert(fetch.user.clone(), mark),
            None => self.stale.remove(&fetch.user),
        };
        self.events.extend(plan.events);
    }

    fn visible(&self) -> Visible {
        self.devices
            .iter()
            .filter(|(_, row)| !row.deleted)
            .map(|(key, row)| (key.clone(), (row.display_name.clone(), row.keys.clone())))
            .collect()
    }
}

/// A fetch in flight: what was stale when it started and the remote's answer.
struct Fetch {
    user: OwnedUserId,
    stale_at_start: Option<StaleMark>,
    answer: FetchedList,
}

fn start_fetch(remote: &Remote, ours: &Ours, user: usize) -> Option<Fetch> {
    let id = user_id(user);
    let mark = ours.stale.get(&id)?;
    Some(Fetch {
        user: id,
        stale_at_start: Some(mark.clone()),
        answer: remote.list(user),
    })
}

/// Replays key-change events over an empty state.
fn replay(events: &[KeyChange]) -> Visible {
    let mut state = Visible::new();
    for event in events {
        let KeyChange::Device(change) = event else {
            continue;
        };
        let key = (change.user_id.clone(), change.device_id.clone());
        if change.deleted {
            state.remove(&key);
        } else {
            state.insert(key, (change.display_name.clone(), change.keys.clone()));
        }
    }
    state
}

fn run(steps: &[Step]) -> Result<(), TestCaseError> {
    let mut remote = Remote::default();
    let mut ours = Ours::default();
    let mut in_flight: Vec<InputMessage> = Vec::new();
    let mut arrived: Vec<InputMessage> = Vec::new();
    let mut fetches: Vec<Fetch> = Vec::new();
    for step in steps {
        match *step {
            Step::RemoteChange { user, device, name } => {
                in_flight.push(remote.change(user, device, name));
            }
            Step::Deliver { pick, count } if !in_flight.is_empty() => {
                let mut batch = Vec::new();
                for _ in 0..count.min(in_flight.len()) {
                    batch.push(in_flight.remove(pick % in_flight.len()));
                }
                ours.ingest(&batch);
                arrived.extend(batch);
            }
            Step::Lose { pick } if !in_flight.is_empty() => {
                in_flight.remove(pick % in_flight.len());
            }
            Step::Duplicate { pick } if !arrived.is_empty() => {
                let again = arrived[pick % arrived.len()].clone();
                ours.ingest(&[again]);
            }
            Step::FetchStart { user } => fetches.extend(start_fetch(&remote, &ours, user)),
            Step::FetchFinish { pick } if !fetches.is_empty() => {
                let fetch = fetches.remove(pick % fetches.len());
                ours.finish_fetch(&fetch);
            }
            _ => {}
        }
    }
    // The network settles: what is in flight arrives, answers come back,
    // and each remote announces one last change that is not lost (a loss is
    // only detectable through a later update).
    for message in std::mem::take(&mut in_flight) {
        ours.ingest(&[message]);
    }
    for fetch in std::mem::take(&mut fetches) {
        ours.finish_fetch(&fetch);
    }
    for user in 0..USERS {
        let last = remote.change(user, 0, Some(255));
        ours.ingest(&[last]);
    }
    // The fetcher retries every stale user until none is left.
    for _round in 0..3 {
        for user in 0..USERS {
            if let Some(fetch) = start_fetch(&remote, &ours, user) {
                ours.finish_fetch(&fetch);
            }
        }
    }
    prop_assert!(
        ours.stale.is_empty(),
        "still stale: {:?}",
        ours.stale.keys()
    );
    prop_assert_eq!(ours.visible(), remote.visible(), "converged");
    prop_assert_eq!(replay(&ours.events), ours.visible(), "events replay");
    // No event repeats the state its device already had.
    let mut seen: HashMap<(OwnedUserId, OwnedDeviceId), (bool, Option<String>)> = HashMap::new();
    for event in &ours.events {
        if let KeyChange::Device(change) = event {
            let key = (change.user_id.clone(), change.device_id.clone());
            let state = (change.deleted, change.keys.clone());
            prop_assert!(
                seen.insert(key, state.clone()) != Some(state),
                "an event repeated the device's state: {:?}",
                change
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512),
        ..ProptestConfig::default()
    })]

    #[test]
    fn histories_converge_and_events_replay(steps in proptest::collection::vec(step(), 0..120)) {
        run(&steps)?;
    }
}

/// A slow fetch answer, older than an update applied since, must not win:
/// two fetches start together, the first makes the user fresh, an update is
/// applied, then the second (older) answer arrives.
#[test]
fn an_answer_older_than_an_applied_update_does_not_win() {
    let steps = [
        Step::RemoteChange {
            user: 0,
            device: 1,
            name: Some(1),
        },
        Step::Deliver { pick: 0, count: 1 },
        Step::FetchStart { user: 0 },
        Step::FetchStart { user: 0 },
        Step::FetchFinish { pick: 0 },
        Step::RemoteChange {
            user: 0,
            device: 1,
            name: Some(2),
        },
        Step::Deliver { pick: 0, count: 1 },
        Step::FetchFinish { pick: 0 },
    ];
    run(&steps).expect("holds");
}

/// Two fetches of one user race and the older answer is stored last: it must
/// not bring back a device the newer answer no longer listed.
#[test]
fn an_older_answer_stored_last_does_not_win() {
    let steps = [
        Step::RemoteChange {
            user: 1,
            device: 3,
            name: Some(0),
        },
        Step::Deliver { pick: 0, count: 1 },
        Step::FetchStart { user: 1 },
        Step::RemoteChange {
            user: 1,
            device: 3,
            name: None,
        },
        Step::FetchStart { user: 1 },
        Step::FetchFinish { pick: 1 },
        Step::FetchFinish { pick: 0 },
    ];
    run(&steps).expect("holds");
}

/// An old update redelivered after a fetch that already covers it must not
/// bring back a device the fetched list did not have (found by the property
/// test above: the device had never been stored, so no row guarded it).
#[test]
fn a_redelivered_update_older_than_a_fetch_does_not_revive_a_device() {
    let steps = [
        Step::RemoteChange {
            user: 2,
            device: 0,
            name: Some(0),
        },
        Step::Deliver { pick: 0, count: 1 },
        Step::RemoteChange {
            user: 2,
            device: 2,
            name: Some(0),
        },
        Step::Deliver { pick: 0, count: 1 },
        Step::RemoteChange {
            user: 2,
            device: 2,
            name: None,
        },
        Step::Lose { pick: 0 },
        Step::FetchStart { user: 2 },
        Step::FetchFinish { pick: 0 },
        Step::Duplicate { pick: 1 },
    ];
    run(&steps).expect("holds");
}
