//! Room input inside a batch (SPEC §5.5, §5.6): folds membership and link
//! changes over the stored room state, turns the transitions of
//! [`super::membership`] into shared-room counts, and says who starts being
//! tracked (stale, fetched) and who is untracked.
//!
//! The rule that keeps this incremental and resumable: a (room, user) pair
//! *shares* when the user is remote, joined in the room, and the room is
//! ours. Each pair stores whether it is counted ([`RoomUser::shares`]); a
//! change sets the pairs it touches to what they should be, and only a flip
//! moves the user's count. When the room itself becomes ours or stops being
//! ours, every pair may be wrong: the room is marked for a sweep
//! ([`plan_sweep`]), which fixes pairs in bounded chunks until none is left.
//! A sweep cut short by a crash just runs again: fixing a pair is idempotent.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ruma::{OwnedRoomId, OwnedServerName, OwnedUserId, RoomId, UserId};

use super::batch::{Outcome, Plan, Snapshot, mark_stale};
use super::membership::{
    Link, Member, RoomCounts, RoomPlan, Skip, Transition, plan_link, plan_membership, resolve,
};
use crate::input::identity::{Identity, MemberKey};
use crate::input::{MemberKeyLink, MembershipChange};

/// A room's own stored state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoomRow {
    /// Joined local identities: the room is ours while above zero.
    pub local_joined: u32,
    /// A sweep is pending (the room became ours or stopped being ours).
    pub sweep: bool,
}

/// One user in one room.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoomUser {
    /// The user's joined identities in the room.
    pub joined: u32,
    /// Counted in the user's shared rooms.
    pub shares: bool,
}

/// The stored room state a batch needs, and the rule it runs under.
#[derive(Clone, Debug)]
pub struct RoomSnapshot {
    /// Our server: its users are local identities.
    pub own: OwnedServerName,
    /// Rooms the batch names.
    pub rooms: HashMap<OwnedRoomId, RoomRow>,
    /// Stored memberships of the identities the batch names.
    pub members: HashMap<(OwnedRoomId, Identity), Member>,
    /// Stored links of the keys the batch names.
    pub links: HashMap<(OwnedRoomId, MemberKey), Link>,
    /// (room, user) rows of the users the batch may touch.
    pub room_users: HashMap<(OwnedRoomId, OwnedUserId), RoomUser>,
    /// Stored shared-room counts of those users (absent: zero): the pairs
    /// marked as sharing, rooms we left and not yet swept included. Kept
    /// for the sweeps; it decides nothing.
    pub shared: HashMap<OwnedUserId, u32>,
    /// The rooms those users share with us now (absent: zero): pairs marked
    /// as sharing in rooms that are ours. This decides who is tracked.
    pub shared_now: HashMap<OwnedUserId, u32>,
}

impl RoomSnapshot {
    /// An empty snapshot for our server `own`.
    pub fn new(own: OwnedServerName) -> RoomSnapshot {
        RoomSnapshot {
            own,
            rooms: HashMap::new(),
            members: HashMap::new(),
            links: HashMap::new(),
            room_users: HashMap::new(),
            shared: HashMap::new(),
            shared_now: HashMap::new(),
        }
    }

    /// Whether `user` shares a room with us now.
    pub fn is_shared(&self, user: &UserId) -> bool {
        self.shared_now.get(user).is_some_and(|&n| n > 0)
    }

    /// Whether `room` is ours (as far as this snapshot knows it).
    pub fn is_ours(&self, room: &RoomId) -> bool {
        self.rooms.get(room).is_some_and(|r| r.local_joined > 0)
    }
}

/// The room rows a batch writes. Only dirty rows are listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoomWrites {
    /// Room rows to upsert.
    pub rooms: BTreeMap<OwnedRoomId, RoomRow>,
    /// Membership rows to upsert.
    pub members: BTreeMap<(OwnedRoomId, Identity), Member>,
    /// Link rows to upsert.
    pub links: BTreeMap<(OwnedRoomId, MemberKey), Link>,
    /// (room, user) rows to upsert.
    pub room_users: BTreeMap<(OwnedRoomId, OwnedUserId), RoomUser>,
    /// Shared-room counts to write (0: delete the row).
    pub shared: BTreeMap<OwnedUserId, u32>,
    /// Users that stopped sharing every room: everything stored about them
    /// goes (SPEC §5.5.4). Written before any other row of the plan.
    pub untrack: BTreeSet<OwnedUserId>,
}

impl RoomWrites {
    /// Whether nothing is written.
    pub fn is_empty(&self) -> bool {
        *self == RoomWrites::default()
    }
}

/// Applies one membership change.
pub(super) fn apply_membership(
    snapshot: &mut Snapshot,
    plan: &mut Plan,
    change: &MembershipChange,
    now_ms: i64,
) -> Outcome {
    let Some(rooms) = snapshot.rooms.as_ref() else {
        return Outcome::MembershipOff;
    };
    let room = &change.room_id;
    let member_slot = (room.clone(), change.identity.clone());
    let member = rooms.members.get(&member_slot).copied();
    let link = match &change.identity {
        Identity::Key(key) => rooms.links.get(&(room.clone(), key.clone())).cloned(),
        Identity::User(_) => None,
    };
    let users: Vec<OwnedUserId> = resolve(&change.identity, link.as_ref())
        .map(UserId::to_owned)
        .into_iter()
        .collect();
    let counts = counts(rooms, room, &users);
    match plan_membership(change, member, link.as_ref(), &counts, &rooms.own) {
        Err(_) => Outcome::Replayed,
        Ok((row, room_plan)) => {
            if let Some(rooms) = snapshot.rooms.as_mut() {
                rooms.members.insert(member_slot.clone(), row);
            }
            plan.rooms.members.insert(member_slot, row);
            apply_room_plan(snapshot, plan, room, room_plan, now_ms);
            Outcome::MembershipApplied
        }
    }
}

/// Applies one member-key link change.
pub(super) fn apply_link(
    snapshot: &mut Snapshot,
    plan: &mut Plan,
    change: &MemberKeyLink,
    now_ms: i64,
) -> Outcome {
    let Some(rooms) = snapshot.rooms.as_ref() else {
        return Outcome::MembershipOff;
    };
    let room = &change.room_id;
    let link_slot = (room.clone(), change.member_key.clone());
    let link = rooms.links.get(&link_slot).cloned();
    let member = rooms
        .members
        .get(&(room.clone(), Identity::Key(change.member_key.clone())))
        .copied();
    let users: Vec<OwnedUserId> = link
        .as_ref()
        .and_then(|l| l.user.clone())
        .into_iter()
        .chain(change.user_id.clone())
        .collect();
    let counts = counts(rooms, room, &users);
    match plan_link(change, link.as_ref(), member, &counts, &rooms.own) {
        Err(Skip::Stale) => Outcome::Replayed,
        Err(Skip::LinkConflict { .. }) => Outcome::LinkConflict,
        Ok((row, room_plan)) => {
            if let Some(rooms) = snapshot.rooms.as_mut() {
                rooms.links.insert(link_slot.clone(), row.clone());
            }
            plan.rooms.links.insert(link_slot, row);
            apply_room_plan(snapshot, plan, room, room_plan, now_ms);
            Outcome::MembershipApplied
        }
    }
}

/// The counts of `room` for `users`.
fn counts(rooms: &RoomSnapshot, room: &RoomId, users: &[OwnedUserId]) -> RoomCounts {
    RoomCounts {
        local_joined: rooms.rooms.get(room).map_or(0, |r| r.local_joined),
        joined: users
            .iter()
            .map(|user| {
                let joined = rooms
                    .room_users
                    .get(&(room.to_owned(), user.clone()))
                    .map_or(0, |r| r.joined);
                (user.clone(), joined)
            })
            .collect(),
    }
}

/// Writes a change's joined counts and carries out its transitions.
fn apply_room_plan(
    snapshot: &mut Snapshot,
    plan: &mut Plan,
    room: &RoomId,
    room_plan: RoomPlan,
    now_ms: i64,
) {
    let Some(rooms) = snapshot.rooms.as_mut() else {
        return;
    };
    let own = rooms.own.clone();
    let mut row = rooms.rooms.get(room).copied().unwrap_or_default();
    let was_ours = row.local_joined > 0;
    for (user, delta) in &room_plan.joined {
        let remote = user.server_name() != own;
        let slot = (room.to_owned(), user.clone());
        let pair = rooms.room_users.entry(slot.clone()).or_default();
        pair.joined = pair.joined.saturating_add_signed(*delta);
        plan.rooms.room_users.insert(slot, *pair);
        if !remote {
            row.local_joined = row.local_joined.saturating_add_signed(*delta);
        }
    }
    let mut set = Vec::new();
    for transition in room_plan.transitions {
        match transition {
            Transition::Starts(user) => set.push((user, true)),
            Transition::Stops(user) => set.push((user, false)),
            Transition::RoomIsOurs => row.sweep = true,
            Transition::RoomIsNotOurs { also } => {
                row.sweep = true;
                set.extend(also.into_iter().map(|user| (user, false)));
            }
        }
    }
    rooms.rooms.insert(room.to_owned(), row);
    plan.rooms.rooms.insert(room.to_owned(), row);
    let is_ours = row.local_joined > 0;
    if was_ours != is_ours {
        // The pairs already counted in this room count, or stop counting,
        // from this change on, for every decision (SPEC §5.5.4): for the
        // users this batch holds, here; the sweep then only fixes the rows
        // of the others.
        let counted: Vec<OwnedUserId> = rooms
            .room_users
            .iter()
            .filter(|((r, user), pair)| r == room && pair.shares && user.server_name() != own)
            .map(|((_, user), _)| user.clone())
            .collect();
        for user in counted {
            move_shared_now(snapshot, plan, &user, is_ours, now_ms);
        }
    }
    for (user, shares) in set {
        set_shares(snapshot, plan, room, &user, shares, now_ms);
    }
}

/// One room more (`gained`) or less that `user` shares now; reaching or
/// leaving zero starts or ends its tracking.
fn move_shared_now(
    snapshot: &mut Snapshot,
    plan: &mut Plan,
    user: &UserId,
    gained: bool,
    now_ms: i64,
) {
    let Some(rooms) = snapshot.rooms.as_mut() else {
        return;
    };
    let count = rooms.shared_now.entry(user.to_owned()).or_default();
    let before = *count;
    *count = if gained {
        count.saturating_add(1)
    } else {
        count.saturating_sub(1)
    };
    match (before, *count) {
        (0, 1..) => start_tracking(snapshot, plan, user, now_ms),
        (1.., 0) => untrack(snapshot, plan, user),
        _ => {}
    }
}

/// Sets whether (room, user) is counted as shared. A flip moves the user's
/// stored count; in a room that is ours it also moves the rooms the user
/// shares now, which starts or ends tracking at zero. In a room that is not
/// ours (one we left, being swept) the pair already counted for nothing:
/// the stored count reaching zero then only removes the rows of a user
/// that shares nothing now.
pub(super) fn set_shares(
    snapshot: &mut Snapshot,
    plan: &mut Plan,
    room: &RoomId,
    user: &UserId,
    shares: bool,
    now_ms: i64,
) {
    let Some(rooms) = snapshot.rooms.as_mut() else {
        return;
    };
    let ours = rooms.is_ours(room);
    let slot = (room.to_owned(), user.to_owned());
    let pair = rooms.room_users.entry(slot.clone()).or_default();
    if pair.shares == shares {
        return;
    }
    pair.shares = shares;
    plan.rooms.room_users.insert(slot, *pair);
    let count = rooms.shared.entry(user.to_owned()).or_default();
    *count = if shares {
        count.saturating_add(1)
    } else {
        count.saturating_sub(1)
    };
    let stored = *count;
    plan.rooms.shared.insert(user.to_owned(), stored);
    if ours {
        move_shared_now(snapshot, plan, user, shares, now_ms);
    } else if stored == 0 && !rooms.is_shared(user) {
        untrack(snapshot, plan, user);
    }
}

/// A user starts sharing a room: with nothing stored, it is fetched (SPEC
/// §5.5.3); a stored list (tracked before the feed began) stays as it is,
/// unless it is marked stale (an update was dropped while it shared
/// nothing, §5.5.9): then it is fetched now.
fn start_tracking(snapshot: &mut Snapshot, plan: &mut Plan, user: &UserId, now_ms: i64) {
    // Every stored list has its user row (devices are never written
    // without it), so the row and the stale mark say whether anything is.
    if !snapshot.users.contains_key(user) || snapshot.stale.contains_key(user) {
        mark_stale(snapshot, plan, user, None, now_ms);
    }
}

/// A user stops sharing every room: forget everything stored and planned
/// for it (SPEC §5.5.4). Events already planned stay (they happened).
fn untrack(snapshot: &mut Snapshot, plan: &mut Plan, user: &UserId) {
    snapshot.users.remove(user);
    snapshot.stale.remove(user);
    snapshot.devices.retain(|(u, _), _| u != user);
    snapshot.cross_signing.retain(|(u, _), _| u != user);
    plan.users.remove(user);
    plan.stale.remove(user);
    plan.devices.retain(|(u, _), _| u != user);
    plan.cross_signing.retain(|(u, _), _| u != user);
    plan.rooms.untrack.insert(user.to_owned());
}

/// One chunk of a room's sweep: `pairs` are (user, row) pairs of `room`
/// that may be wrong; each remote one is set to what it should be. The
/// snapshot holds the room, those pairs, the users' counts and their user
/// state. The room's sweep ends when `last` (no pairs after these).
pub fn plan_sweep(
    mut snapshot: Snapshot,
    room: &RoomId,
    pairs: &[OwnedUserId],
    last: bool,
    now_ms: i64,
) -> Plan {
    let mut plan = Plan::default();
    let Some(rooms) = snapshot.rooms.as_mut() else {
        return plan;
    };
    let own = rooms.own.clone();
    let mut row = rooms.rooms.get(room).copied().unwrap_or_default();
    let ours = row.local_joined > 0;
    if last {
        row.sweep = false;
        rooms.rooms.insert(room.to_owned(), row);
        plan.rooms.rooms.insert(room.to_owned(), row);
    }
    for user in pairs {
        if user.server_name() == own {
            continue;
        }
        let joined = snapshot
            .rooms
            .as_ref()
            .and_then(|r| r.room_users.get(&(room.to_owned(), user.clone())))
            .is_some_and(|pair| pair.joined > 0);
        set_shares(&mut snapshot, &mut plan, room, user, ours && joined, now_ms);
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::plan_batch;
    use crate::input::InputMessage;
    use crate::input::membership::Membership;

    const KEY: &str = "@l8Hft5qXKn1vfHrg3p4-W8gELQVo8N13JkluMfmn2sQ";
    const BOB: &str = "@bob:remote.example";
    const ME: &str = "@me:our.example";

    fn snapshot() -> Snapshot {
        Snapshot {
            rooms: Some(RoomSnapshot::new("our.example".try_into().unwrap())),
            ..Snapshot::default()
        }
    }

    fn room(n: u32) -> OwnedRoomId {
        OwnedRoomId::try_from(format!("!r{n}:our.example")).unwrap()
    }

    fn join(room_n: u32, who: &str, at: i64) -> InputMessage {
        membership(room_n, who, Membership::Join, at)
    }

    fn membership(room_n: u32, who: &str, membership: Membership, at: i64) -> InputMessage {
        InputMessage::Membership(MembershipChange {
            room_id: room(room_n),
            identity: Identity::parse(who, true).unwrap(),
            membership,
            stream_ordering: at,
        })
    }

    fn link(room_n: u32, user: Option<&str>, verified: bool, at: i64) -> InputMessage {
        InputMessage::MemberKey(MemberKeyLink {
            room_id: room(room_n),
            member_key: MemberKey::parse(KEY).unwrap(),
            user_id: user.map(|u| u.try_into().unwrap()),
            verified,
            stream_ordering: at,
        })
    }

    fn bob() -> OwnedUserId {
        BOB.try_into().unwrap()
    }

    #[test]
    fn a_remote_join_in_our_room_starts_tracking_with_a_fetch() {
        let plan = plan_batch(snapshot(), &[join(1, ME, 1), join(1, BOB, 2)], 7);
        assert_eq!(plan.outcomes, vec![Outcome::MembershipApplied; 2]);
        assert_eq!(plan.rooms.shared.get(&bob()), Some(&1));
        assert_eq!(plan.stale[&bob()].marked_at_ms, 7);
        assert!(plan.fetch_servers.contains(bob().server_name()));
    }

    #[test]
    fn a_room_becoming_ours_is_swept_not_decided_inline() {
        let plan = plan_batch(snapshot(), &[join(1, BOB, 1), join(1, ME, 2)], 0);
        assert!(plan.rooms.rooms[&room(1)].sweep);
        assert!(plan.rooms.shared.is_empty() && plan.stale.is_empty());
    }

    #[test]
    fn a_stored_user_is_not_fetched_again_and_the_last_leave_untracks() {
        let mut s = snapshot();
        s.users.insert(bob(), Default::default());
        let plan = plan_batch(
            s,
            &[
                join(1, ME, 1),
                join(1, BOB, 2),
                join(2, ME, 3),
                join(2, BOB, 4),
                membership(1, BOB, Membership::Leave, 5),
            ],
            0,
        );
        assert!(plan.stale.is_empty(), "a stored list is not fetched again");
        assert_eq!(plan.rooms.shared.get(&bob()), Some(&1));
        assert!(plan.rooms.untrack.is_empty());
        let mut s = snapshot();
        s.users.insert(bob(), Default::default());
        let plan = plan_batch(
            s,
            &[
                join(1, ME, 1),
                join(1, BOB, 2),
                membership(1, BOB, Membership::Ban, 3),
            ],
            0,
        );
        assert_eq!(plan.rooms.shared.get(&bob()), Some(&0));
        assert!(plan.rooms.untrack.contains(&bob()));
        assert!(plan.users.is_empty() && plan.events.is_empty());
    }

    #[test]
    fn updates_for_users_sharing_no_room_are_untracked() {
        let update = InputMessage::Resync(crate::input::ResyncRequest { user_id: bob() });
        let plan = plan_batch(snapshot(), std::slice::from_ref(&update), 0);
        assert_eq!(plan.outcomes, vec![Outcome::Untracked]);
        assert!(plan.stale.is_empty());
        let plan = plan_batch(snapshot(), &[join(1, ME, 1), join(1, BOB, 2), update], 0);
        assert_eq!(plan.outcomes[2], Outcome::ResyncRequested);
    }

    #[test]
    fn a_key_counts_only_with_a_verified_link_in_its_own_room() {
        // Linked in room 1, joined in room 2: names nobody there.
        let plan = plan_batch(
            snapshot(),
            &[join(2, ME, 1), link(1, Some(BOB), true, 2), join(2, KEY, 3)],
            0,
        );
        assert!(plan.rooms.shared.is_empty());
        // Unverified in its own room: nobody; verified later: bob.
        let plan = plan_batch(
            snapshot(),
            &[
                join(1, ME, 1),
                join(1, KEY, 2),
                link(1, Some(BOB), false, 3),
            ],
            0,
        );
        assert!(plan.rooms.shared.is_empty());
        let plan = plan_batch(
            snapshot(),
            &[
                join(1, ME, 1),
                join(1, KEY, 2),
                link(1, Some(BOB), false, 3),
                link(1, Some(BOB), true, 4),
            ],
            0,
        );
        assert_eq!(plan.rooms.shared.get(&bob()), Some(&1));
        assert!(plan.stale.contains_key(&bob()));
    }

    #[test]
    fn a_conflicting_or_replayed_link_is_not_applied() {
        let plan = plan_batch(
            snapshot(),
            &[
                link(1, Some(BOB), true, 5),
                link(1, Some("@eve:remote.example"), true, 6),
                link(1, Some(BOB), false, 5),
                join(1, KEY, 3),
                join(1, KEY, 3),
            ],
            0,
        );
        assert_eq!(
            plan.outcomes,
            vec![
                Outcome::MembershipApplied,
                Outcome::LinkConflict,
                Outcome::Replayed,
                Outcome::MembershipApplied,
                Outcome::Replayed,
            ]
        );
        let stored = &plan.rooms.links[&(room(1), MemberKey::parse(KEY).unwrap())];
        assert_eq!(stored.user.as_ref(), Some(&bob()));
        assert!(stored.verified);
    }

    #[test]
    fn a_change_before_the_sweep_sets_its_pair_without_counting_twice() {
        // Bob shares room 1. In room 2 he joined before it was ours; we join
        // (a sweep is due) and he leaves in the same batch: his pair in room
        // 2 was never counted, so his count stays 1 and he stays tracked.
        let mut s = snapshot();
        let rooms = s.rooms.as_mut().unwrap();
        rooms.rooms.insert(
            room(1),
            RoomRow {
                local_joined: 1,
                sweep: false,
            },
        );
        rooms.room_users.insert(
            (room(1), bob()),
            RoomUser {
                joined: 1,
                shares: true,
            },
        );
        rooms.room_users.insert(
            (room(2), bob()),
            RoomUser {
                joined: 1,
                shares: false,
            },
        );
        rooms.members.insert(
            (room(2), Identity::User(bob())),
            Member {
                membership: Membership::Join,
                stream_ordering: 1,
            },
        );
        rooms.shared.insert(bob(), 1);
        s.users.insert(bob(), Default::default());
        let plan = plan_batch(
            s,
            &[join(2, ME, 2), membership(2, BOB, Membership::Leave, 3)],
            0,
        );
        assert!(plan.rooms.untrack.is_empty(), "{plan:?}");
        assert!(!plan.rooms.shared.contains_key(&bob()));
    }

    /// Bob stored and counted in room 1, which is ours (ME joined).
    fn bob_shares_room_1() -> Snapshot {
        let mut s = snapshot();
        let rooms = s.rooms.as_mut().unwrap();
        rooms.rooms.insert(
            room(1),
            RoomRow {
                local_joined: 1,
                sweep: false,
            },
        );
        rooms.members.insert(
            (room(1), Identity::parse(ME, true).unwrap()),
            Member {
                membership: Membership::Join,
                stream_ordering: 1,
            },
        );
        rooms.room_users.insert(
            (room(1), bob()),
            RoomUser {
                joined: 1,
                shares: true,
            },
        );
        rooms.shared.insert(bob(), 1);
        rooms.shared_now.insert(bob(), 1);
        s.users.insert(bob(), Default::default());
        s
    }

    fn bob_update() -> InputMessage {
        InputMessage::Update(crate::input::DeviceListUpdate {
            user_id: bob(),
            device_id: "D".into(),
            display_name: None,
            stream_id: 5,
            prev_ids: vec![0],
            deleted: false,
            keys: Some("{}".into()),
        })
    }

    #[test]
    fn our_leave_untracks_the_members_it_holds_at_once() {
        let plan = plan_batch(
            bob_shares_room_1(),
            &[membership(1, ME, Membership::Leave, 2), bob_update()],
            0,
        );
        assert!(plan.rooms.rooms[&room(1)].sweep, "the others are swept");
        assert!(plan.rooms.untrack.contains(&bob()), "{plan:?}");
        assert_eq!(plan.outcomes[1], Outcome::Untracked);
        assert!(plan.events.is_empty() && plan.users.is_empty());
        // The pair is still counted until the sweep: only its rows go.
        assert!(!plan.rooms.room_users.contains_key(&(room(1), bob())));
    }

    #[test]
    fn a_room_we_left_counts_for_nobody_before_its_sweep() {
        // Room 1 left, not yet swept: Bob's pair still counted there.
        let mut s = bob_shares_room_1();
        let rooms = s.rooms.as_mut().unwrap();
        rooms.rooms.get_mut(&room(1)).unwrap().local_joined = 0;
        rooms.shared_now.remove(&bob());
        let plan = plan_batch(s.clone(), &[bob_update()], 0);
        assert_eq!(plan.outcomes, vec![Outcome::Untracked]);
        // His list is behind now: marked, but nothing is fetched.
        assert!(plan.stale.contains_key(&bob()) && plan.fetch_servers.is_empty());
        // The sweep removes his rows: the stored count reaches zero.
        let plan = plan_sweep(s, &room(1), &[bob()], true, 0);
        assert!(plan.rooms.untrack.contains(&bob()));
        assert_eq!(plan.rooms.shared.get(&bob()), Some(&0));
    }

    #[test]
    fn a_stale_stored_user_that_starts_sharing_is_fetched() {
        let mut s = snapshot();
        s.users.insert(bob(), Default::default());
        s.stale.insert(
            bob(),
            crate::decide::StaleMark {
                trigger_ids: vec![],
                marked_at_ms: 1,
            },
        );
        let plan = plan_batch(s, &[join(1, ME, 1), join(1, BOB, 2)], 7);
        assert!(plan.fetch_servers.contains(bob().server_name()));
        assert_eq!(plan.stale[&bob()].marked_at_ms, 1, "the mark is kept");
    }

    #[test]
    fn a_sweep_sets_every_pair_and_ends() {
        let mut s = snapshot();
        let rooms = s.rooms.as_mut().unwrap();
        rooms.rooms.insert(
            room(1),
            RoomRow {
                local_joined: 0,
                sweep: true,
            },
        );
        rooms.room_users.insert(
            (room(1), bob()),
            RoomUser {
                joined: 1,
                shares: true,
            },
        );
        rooms.shared.insert(bob(), 1);
        s.users.insert(bob(), Default::default());
        let plan = plan_sweep(s, &room(1), &[bob()], true, 0);
        assert!(plan.rooms.untrack.contains(&bob()));
        assert!(!plan.rooms.rooms[&room(1)].sweep);
        assert!(!plan.rooms.room_users[&(room(1), bob())].shares);
    }
}
