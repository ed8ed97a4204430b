//! Table tests of the room rules: membership and link changes, sharing
//! now, starting and ending tracking, and the sweeps.

use ruma::OwnedRoomId;

use super::*;
use crate::decide::membership::Member;
use crate::decide::plan_batch;
use crate::decide::{RoomRow, RoomUser};
use crate::input::InputMessage;
use crate::input::identity::MemberKey;
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

/// A room's row: `local_joined` local identities, a sweep pending or not.
fn room_row(local_joined: u32, sweep: bool) -> RoomRow {
    RoomRow {
        local_joined,
        sweep,
    }
}

/// A (room, user) pair: `joined` identities, counted as sharing or not.
fn pair(joined: u32, shares: bool) -> RoomUser {
    RoomUser { joined, shares }
}

/// A membership joined at stream ordering `at`.
fn joined_at(at: i64) -> Member {
    Member {
        membership: Membership::Join,
        stream_ordering: at,
    }
}

/// Room 1 stored as `row`, Bob joined there and counted as sharing it
/// (his stored count 1).
fn bob_counted_in_room_1(row: RoomRow) -> Snapshot {
    let mut s = snapshot();
    let rooms = s.rooms.as_mut().unwrap();
    rooms.rooms.insert(room(1), row);
    rooms.room_users.insert((room(1), bob()), pair(1, true));
    rooms.shared.insert(bob(), 1);
    s
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
    let mut s = bob_counted_in_room_1(room_row(1, false));
    let rooms = s.rooms.as_mut().unwrap();
    rooms.room_users.insert((room(2), bob()), pair(1, false));
    rooms
        .members
        .insert((room(2), Identity::User(bob())), joined_at(1));
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
    let mut s = bob_counted_in_room_1(room_row(1, false));
    let rooms = s.rooms.as_mut().unwrap();
    rooms
        .members
        .insert((room(1), Identity::parse(ME, true).unwrap()), joined_at(1));
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
    let mut s = bob_counted_in_room_1(room_row(0, true));
    s.users.insert(bob(), Default::default());
    let plan = plan_sweep(s, &room(1), &[bob()], true, 0);
    assert!(plan.rooms.untrack.contains(&bob()));
    assert!(!plan.rooms.rooms[&room(1)].sweep);
    assert!(!plan.rooms.room_users[&(room(1), bob())].shares);
}

#[test]
fn who_left_a_room_while_it_was_not_ours_is_not_counted_when_we_rejoin() {
    // In one batch, before any sweep: we join, Bob joins, we leave, Bob
    // leaves, we join again. Bob shares nothing at the end.
    let plan = plan_batch(
        snapshot(),
        &[
            join(1, ME, 1),
            join(1, BOB, 2),
            membership(1, ME, Membership::Leave, 3),
            membership(1, BOB, Membership::Leave, 4),
            join(1, ME, 5),
        ],
        0,
    );
    assert!(plan.rooms.untrack.contains(&bob()), "{plan:?}");
    assert!(!plan.stale.contains_key(&bob()), "{plan:?}");
    assert_eq!(plan.rooms.shared.get(&bob()), Some(&0), "{plan:?}");
    assert!(!plan.rooms.room_users[&(room(1), bob())].shares);
}
