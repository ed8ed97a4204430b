//! Property test of the room-sharing rules (SPEC §5.5, §5.6) against a
//! model that recomputes everything from scratch.
//!
//! Our side is the pure core (`decide::plan_batch` and `decide::rooms::
//! plan_sweep`) over an in-memory copy of what the store would hold, with
//! random batch boundaries and the room sweeps run to completion between
//! batches (at random chunk sizes). The model keeps only the latest applied
//! change per (room, identity) and per (room, key) and decides sharing by
//! its definition: a remote user shares a room when it is joined there
//! under its user id or under a key of *that room* whose verified link names
//! it, and a local identity (a local user id, or a key verified-linked to a
//! local user) is joined too.
//!
//! Generated: joins, leaves, bans, link changes (verified or not, erasures,
//! conflicting users), replays of older changes and reorderings, over a few
//! rooms, users and keys. Properties after every batch and its sweeps:
//! 1. the shared-room count of every user equals the model's;
//! 2. a user is tracked (its count above zero) exactly when the model says
//!    it shares a room, and it never shares through another room's key;
//! 3. every user that starts sharing with nothing stored is marked stale
//!    (to be fetched), and every user that stops is untracked;
//! 4. right after a batch, before any sweep, no user the model says shares
//!    nothing counts as sharing a room now (our server leaving a room
//!    untracks its members at once, §5.5.4).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use device_list_updater::decide::membership::{Link, Member};
use device_list_updater::decide::rooms::plan_sweep;
use device_list_updater::decide::{Plan, Snapshot, UserState, plan_batch};
use device_list_updater::decide::{RoomRow, RoomSnapshot, RoomUser};
use device_list_updater::input::identity::{Identity, MemberKey};
use device_list_updater::input::membership::Membership;
use device_list_updater::input::{InputMessage, MemberKeyLink, MembershipChange};
use proptest::prelude::*;
use ruma::{OwnedRoomId, OwnedUserId};

const ROOMS: usize = 3;
const OWN: &str = "our.example";
/// Users 0 and 1 are ours; 2..5 remote.
const USERS: [&str; 5] = [
    "@me:our.example",
    "@you:our.example",
    "@bob:remote.example",
    "@carol:remote.example",
    "@dan:other.example",
];
/// Member keys (43 URL-safe base64 characters after `@`).
const KEYS: [&str; 3] = [
    "@AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
    "@AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE",
    "@l8Hft5qXKn1vfHrg3p4-W8gELQVo8N13JkluMfmn2sQ",
];

#[derive(Clone, Debug)]
enum Step {
    /// A membership change of a user id or (`key`) a member key.
    Member {
        room: usize,
        who: usize,
        key: bool,
        membership: usize,
    },
    /// A link change of a key (`user: None`: no link / erased).
    Link {
        room: usize,
        key: usize,
        user: Option<usize>,
        verified: bool,
    },
    /// A replay of an earlier message (older `stream_ordering`).
    Replay(usize),
    /// A batch boundary.
    Cut,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (0..ROOMS, 0..USERS.len(), any::<bool>(), 0..3usize).prop_map(
            |(room, who, key, membership)| Step::Member { room, who: if key { who % KEYS.len() } else { who }, key, membership }
        ),
        3 => (0..ROOMS, 0..KEYS.len(), proptest::option::weighted(0.85, 0..USERS.len()), any::<bool>())
            .prop_map(|(room, key, user, verified)| Step::Link { room, key, user, verified }),
        1 => (0..64usize).prop_map(Step::Replay),
        2 => Just(Step::Cut),
    ]
}

fn room(n: usize) -> OwnedRoomId {
    OwnedRoomId::try_from(format!("!r{n}:our.example")).unwrap()
}

fn user(n: usize) -> OwnedUserId {
    OwnedUserId::try_from(USERS[n]).unwrap()
}

fn key(n: usize) -> MemberKey {
    MemberKey::parse(KEYS[n]).unwrap()
}

fn membership(n: usize) -> Membership {
    [Membership::Join, Membership::Leave, Membership::Ban][n]
}

/// What the store holds, as the store would after each commit.
#[derive(Default)]
struct Stored {
    rooms: HashMap<OwnedRoomId, RoomRow>,
    members: HashMap<(OwnedRoomId, Identity), Member>,
    links: HashMap<(OwnedRoomId, MemberKey), Link>,
    room_users: HashMap<(OwnedRoomId, OwnedUserId), RoomUser>,
    shared: HashMap<OwnedUserId, u32>,
    users: HashMap<OwnedUserId, UserState>,
    stale: BTreeSet<OwnedUserId>,
}

impl Stored {
    fn snapshot(&self) -> Snapshot {
        let mut rooms = RoomSnapshot::new(OWN.try_into().unwrap());
        rooms.rooms = self.rooms.clone();
        rooms.members = self.members.clone();
        rooms.links = self.links.clone();
        rooms.room_users = self.room_users.clone();
        rooms.shared = self.shared.clone();
        rooms.shared_now = self.shared_now();
        let stale = self
            .stale
            .iter()
            .map(|u| {
                let mark = device_list_updater::decide::StaleMark {
                    trigger_ids: vec![],
                    marked_at_ms: 0,
                };
                (u.clone(), mark)
            })
            .collect();
        Snapshot {
            users: self.users.clone(),
            stale,
            rooms: Some(rooms),
            ..Snapshot::default()
        }
    }

    /// The rooms each user shares now, as the store reads them: pairs
    /// counted as sharing in rooms that are ours.
    fn shared_now(&self) -> HashMap<OwnedUserId, u32> {
        let mut counts: HashMap<OwnedUserId, u32> = HashMap::new();
        for ((room, user), pair) in &self.room_users {
            let ours = self.rooms.get(room).is_some_and(|r| r.local_joined > 0);
            if pair.shares && ours {
                *counts.entry(user.clone()).or_default() += 1;
            }
        }
        counts
    }

    fn commit(&mut self, plan: &Plan) {
        for user in &plan.rooms.untrack {
            self.users.remove(user);
            self.stale.remove(user);
        }
        self.rooms.extend(plan.rooms.rooms.clone());
        self.members.extend(plan.rooms.members.clone());
        self.links.extend(plan.rooms.links.clone());
        self.room_users.extend(plan.rooms.room_users.clone());
        for (user, n) in &plan.rooms.shared {
            match n {
                0 => self.shared.remove(user),
                n => self.shared.insert(user.clone(), *n),
            };
        }
        self.users.extend(plan.users.clone());
        self.stale.extend(plan.stale.keys().cloned());
    }

    /// Runs every pending sweep to its end, `chunk` pairs at a time.
    fn sweep(&mut self, chunk: usize) {
        let pending: Vec<OwnedRoomId> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.sweep)
            .map(|(id, _)| id.clone())
            .collect();
        for id in pending {
            let ours = self.rooms[&id].local_joined > 0;
            loop {
                // The store's query: remote pairs counted wrongly.
                let wrong: Vec<OwnedUserId> = self
                    .room_users
                    .iter()
                    .filter(|((r, u), pair)| {
                        *r == id
                            && u.server_name() != OWN
                            && pair.shares != (ours && pair.joined > 0)
                    })
                    .map(|((_, u), _)| u.clone())
                    .take(chunk)
                    .collect();
                let last = wrong.len() < chunk;
                let plan = plan_sweep(self.snapshot(), &id, &wrong, last, 0);
                self.commit(&plan);
                if last {
                    break;
                }
            }
        }
    }
}

/// (first user, erased, verified, ordering) of a key's link in the model.
type ModelLink = (Option<usize>, bool, bool, i64);

/// The model: the latest applied change per identity and key, by rule.
#[derive(Default)]
struct Model {
    members: BTreeMap<(usize, Identity), (Membership, i64)>,
    /// Per (room, key).
    links: BTreeMap<(usize, usize), ModelLink>,
}

impl Model {
    fn apply(&mut self, message: &InputMessage, room_n: usize, key_n: Option<usize>) {
        match message {
            InputMessage::Membership(change) => {
                let slot = (room_n, change.identity.clone());
                if self
                    .members
                    .get(&slot)
                    .is_none_or(|(_, at)| change.stream_ordering > *at)
                {
                    self.members
                        .insert(slot, (change.membership, change.stream_ordering));
                }
            }
            InputMessage::MemberKey(link) => {
                let slot = (room_n, key_n.unwrap());
                let named = link
                    .user_id
                    .as_ref()
                    .map(|u| USERS.iter().position(|x| *x == u.as_str()).unwrap());
                let old = self.links.get(&slot).copied();
                if old.is_some_and(|(_, _, _, at)| link.stream_ordering <= at) {
                    return;
                }
                let first = old.and_then(|(first, ..)| first);
                if let (Some(first), Some(named)) = (first, named)
                    && first != named
                {
                    return; // link_conflict
                }
                let erased = named.is_none() && first.is_some();
                self.links.insert(
                    slot,
                    (first.or(named), erased, link.verified, link.stream_ordering),
                );
            }
            _ => unreachable!(),
        }
    }

    /// The users joined in `room_n` (each identity resolved in that room).
    fn joined(&self, room_n: usize) -> Vec<usize> {
        let mut out = Vec::new();
        for ((r, identity), (membership, _)) in &self.members {
            if *r != room_n || *membership != Membership::Join {
                continue;
            }
            match identity {
                Identity::User(u) => out.push(USERS.iter().position(|x| *x == u.as_str()).unwrap()),
                Identity::Key(k) => {
                    let k = KEYS.iter().position(|x| *x == k.as_str()).unwrap();
                    if let Some((Some(user), false, true, _)) = self.links.get(&(room_n, k)) {
                        out.push(*user);
                    }
                }
            }
        }
        out
    }

    fn shared(&self) -> BTreeMap<OwnedUserId, u32> {
        let mut counts = BTreeMap::new();
        for r in 0..ROOMS {
            let joined = self.joined(r);
            if !joined.iter().any(|&u| u < 2) {
                continue;
            }
            let remote: BTreeSet<usize> = joined.into_iter().filter(|&u| u >= 2).collect();
            for u in remote {
                *counts.entry(user(u)).or_default() += 1;
            }
        }
        counts
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn sharing_matches_the_model(steps in proptest::collection::vec(step(), 1..60), chunk in 1..4usize) {
        let mut stored = Stored::default();
        let mut model = Model::default();
        let mut sent: Vec<(InputMessage, usize, Option<usize>)> = Vec::new();
        let mut batch: Vec<(InputMessage, usize, Option<usize>)> = Vec::new();
        let mut ordering = 1_i64;
        let flush = |batch: &mut Vec<(InputMessage, usize, Option<usize>)>,
                         stored: &mut Stored,
                         model: &mut Model| {
            if batch.is_empty() {
                return;
            }
            let messages: Vec<InputMessage> = batch.iter().map(|(m, ..)| m.clone()).collect();
            let before: BTreeSet<OwnedUserId> = stored.shared.keys().cloned().collect();
            let plan = plan_batch(stored.snapshot(), &messages, 0);
            stored.commit(&plan);
            for (message, room_n, key_n) in batch.drain(..) {
                model.apply(&message, room_n, key_n);
            }
            // 4: before any sweep, a user the model says shares nothing
            // shares nothing for every decision (SPEC §5.5.4), and nothing
            // is stored for it unless it was stored before the batch.
            let expected = model.shared();
            for (user, n) in stored.shared_now() {
                assert!(n == 0 || expected.contains_key(&user), "{user} shares {n} rooms now");
            }
            stored.sweep(chunk);
            let counts: BTreeMap<OwnedUserId, u32> = stored.shared.clone().into_iter().collect();
            assert_eq!(counts, model.shared(), "after a batch and its sweeps");
            let after: BTreeSet<OwnedUserId> = stored.shared.keys().cloned().collect();
            // 3: the newly shared are stale or stored; the no longer shared
            // have nothing stored.
            for user in after.difference(&before) {
                assert!(stored.stale.contains(user) || stored.users.contains_key(user));
            }
            for user in before.difference(&after) {
                assert!(!stored.stale.contains(user) && !stored.users.contains_key(user));
            }
        };
        for step in steps {
            let item = match step {
                Step::Member { room: r, who, key: is_key, membership: m } => {
                    let identity = if is_key {
                        Identity::Key(key(who % KEYS.len()))
                    } else {
                        Identity::User(user(who))
                    };
                    let message = InputMessage::Membership(MembershipChange {
                        room_id: room(r),
                        identity,
                        membership: membership(m),
                        stream_ordering: ordering,
                    });
                    (message, r, None)
                }
                Step::Link { room: r, key: k, user: u, verified } => {
                    let message = InputMessage::MemberKey(MemberKeyLink {
                        room_id: room(r),
                        member_key: key(k),
                        user_id: u.map(user),
                        verified,
                        stream_ordering: ordering,
                    });
                    (message, r, Some(k))
                }
                Step::Replay(n) => {
                    if sent.is_empty() {
                        continue;
                    }
                    sent[n % sent.len()].clone()
                }
                Step::Cut => {
                    flush(&mut batch, &mut stored, &mut model);
                    continue;
                }
            };
            ordering += 1;
            sent.push(item.clone());
            batch.push(item);
        }
        flush(&mut batch, &mut stored, &mut model);
        // 1, 2: the counts are the model's, so the tracked set is too.
        let ours: BTreeMap<OwnedUserId, u32> = stored.shared.clone().into_iter().collect();
        prop_assert_eq!(ours, model.shared());
        for (user, _) in stored.shared.iter() {
            prop_assert!(user.server_name() != OWN);
        }
    }
}
