//! Room input inside a batch (SPEC §5.5, §5.6): folds membership and link
//! changes over the stored room state, turns the transitions of
//! [`super::membership`] into shared-room counts, and says who starts being
//! tracked (stale, fetched) and who is untracked.
//!
//! The rule that keeps this incremental and resumable: a (room, user) pair
//! *shares* when the user is remote, joined in the room, and the room is
//! ours. Each pair stores whether it is counted ([`RoomUser::shares`](super::RoomUser::shares)); a
//! change sets the pairs it touches to what they should be, and only a flip
//! moves the user's count. When the room itself becomes ours or stops being
//! ours, every pair may be wrong: the room is marked for a sweep
//! ([`plan_sweep`]), which fixes pairs in bounded chunks until none is left.
//! A sweep cut short by a crash just runs again: fixing a pair is idempotent.

use ruma::{OwnedUserId, RoomId, UserId};

use super::membership::{
    RoomCounts, RoomPlan, Skip, Transition, plan_link, plan_membership, resolve,
};
use super::plan::{Outcome, Plan, RoomSnapshot, Snapshot, mark_stale};
use crate::input::identity::Identity;
use crate::input::{MemberKeyLink, MembershipChange};

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
    let is_ours = row.local_joined > 0;
    if !is_ours {
        // In a room that is not ours no pair shares: the pairs this change
        // touches are set so now, or one left here meanwhile would count
        // again when the room becomes ours before its sweep.
        set.extend(
            room_plan
                .joined
                .iter()
                .filter(|(user, _)| user.server_name() != own)
                .map(|(user, _)| (user.clone(), false)),
        );
    }
    rooms.rooms.insert(room.to_owned(), row);
    plan.rooms.rooms.insert(room.to_owned(), row);
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
mod tests;
