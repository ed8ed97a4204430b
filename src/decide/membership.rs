//! Room sharing (SPEC §5.5, §5.6), as pure rules: a membership change or a
//! member-key link change becomes "this user starts / stops sharing a room
//! with us" transitions, computed incrementally from counts, never from a
//! recount of the room.
//!
//! What the store keeps per room, and hands in here for the identities a
//! change is about: each identity's last membership and its
//! `stream_ordering`; each member key's link; and per user the number of
//! that user's joined identities in the room ([`RoomCounts`]). A user is
//! joined in a room when that number is above zero; the room is ours when
//! the sum over local users is. A remote user shares the room while both
//! hold.
//!
//! Keys name users only through their own room's verified link (§5.6.1), so
//! [`resolve`] is the one place an identity becomes a user.

use std::collections::BTreeMap;

use ruma::{OwnedUserId, ServerName, UserId};

use crate::input::identity::Identity;
use crate::input::membership::{MemberKeyLink, Membership, MembershipChange};

/// An identity's stored membership in a room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// The last membership applied.
    pub membership: Membership,
    /// Its `stream_ordering`.
    pub stream_ordering: i64,
}

/// A member key's stored link in its room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// The first user the key was linked to. Kept after an erasure, so a
    /// later link naming someone else is still a conflict (§5.6.2).
    pub user: Option<OwnedUserId>,
    /// The link was removed (`user_id: null` after a known link).
    pub erased: bool,
    /// The homeserver's last check of the link succeeded.
    pub verified: bool,
    /// The `stream_ordering` of the last link message applied.
    pub stream_ordering: i64,
}

/// The user an identity stands for in its room: a user id is itself; a
/// key is its verified, not erased link's user, or nobody.
pub fn resolve<'a>(identity: &'a Identity, link: Option<&'a Link>) -> Option<&'a UserId> {
    match identity {
        Identity::User(user) => Some(user),
        Identity::Key(_) => link
            .filter(|l| l.verified && !l.erased)
            .and_then(|l| l.user.as_deref()),
    }
}

/// The counts of one room the rules need, for the users a change touches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoomCounts {
    /// Joined identities of local users in the room.
    pub local_joined: u32,
    /// Joined identities per user (only the users the change is about need
    /// to be present; absent means zero).
    pub joined: BTreeMap<OwnedUserId, u32>,
}

/// What sharing does after a change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transition {
    /// The remote user starts sharing this room with us.
    Starts(OwnedUserId),
    /// The remote user stops sharing this room with us.
    Stops(OwnedUserId),
    /// The room became ours (its first local identity joined): every remote
    /// user joined after the change starts sharing it.
    RoomIsOurs,
    /// Our last local identity left: every remote user joined after the
    /// change stops sharing it, and so do `also` (joined before, not after).
    RoomIsNotOurs {
        /// Remote users that left in this same change.
        also: Vec<OwnedUserId>,
    },
}

/// What to write for one change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoomPlan {
    /// Changes of joined-identity counts per user (local users included).
    pub joined: Vec<(OwnedUserId, i32)>,
    /// Sharing transitions.
    pub transitions: Vec<Transition>,
}

/// Why a change is not applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Not newer than what was applied for that room and identity (§5.5.2).
    Stale,
    /// A link naming another user than the key's first (§5.6.2).
    LinkConflict {
        /// The key's first user.
        first: OwnedUserId,
    },
}

/// A membership change of an identity whose stored state is `member` (and,
/// for a key, whose link is `link`). Ok: the new member row and the plan.
pub fn plan_membership(
    change: &MembershipChange,
    member: Option<Member>,
    link: Option<&Link>,
    counts: &RoomCounts,
    own: &ServerName,
) -> Result<(Member, RoomPlan), Skip> {
    if member.is_some_and(|m| change.stream_ordering <= m.stream_ordering) {
        return Err(Skip::Stale);
    }
    let was_joined = member.is_some_and(|m| m.membership == Membership::Join);
    let is_joined = change.membership == Membership::Join;
    let mut deltas = Vec::new();
    if let Some(user) = resolve(&change.identity, link)
        && was_joined != is_joined
    {
        deltas.push((user.to_owned(), if is_joined { 1 } else { -1 }));
    }
    let row = Member {
        membership: change.membership,
        stream_ordering: change.stream_ordering,
    };
    Ok((row, plan_deltas(deltas, counts, own)))
}

/// A link change of a key whose stored link is `link` and whose membership
/// in the room is `member`. Ok: the new link row and the plan.
pub fn plan_link(
    change: &MemberKeyLink,
    link: Option<&Link>,
    member: Option<Member>,
    counts: &RoomCounts,
    own: &ServerName,
) -> Result<(Link, RoomPlan), Skip> {
    if link.is_some_and(|l| change.stream_ordering <= l.stream_ordering) {
        return Err(Skip::Stale);
    }
    let first = link.and_then(|l| l.user.clone());
    if let (Some(first), Some(named)) = (&first, &change.user_id)
        && first != named
    {
        return Err(Skip::LinkConflict {
            first: first.clone(),
        });
    }
    let row = Link {
        erased: change.user_id.is_none() && first.is_some(),
        user: first.or_else(|| change.user_id.clone()),
        verified: change.verified,
        stream_ordering: change.stream_ordering,
    };
    let joined = member.is_some_and(|m| m.membership == Membership::Join);
    let key = Identity::Key(change.member_key.clone());
    let before = resolve(&key, link).map(UserId::to_owned);
    let after = resolve(&key, Some(&row)).map(UserId::to_owned);
    let mut deltas = Vec::new();
    if joined && before != after {
        // The key's joined membership moves from one user to the other, as
        // a leave and a join would (§5.6.3).
        deltas.extend(before.map(|user| (user, -1)));
        deltas.extend(after.map(|user| (user, 1)));
    }
    Ok((row, plan_deltas(deltas, counts, own)))
}

/// Turns joined-count changes into transitions.
fn plan_deltas(deltas: Vec<(OwnedUserId, i32)>, counts: &RoomCounts, own: &ServerName) -> RoomPlan {
    let count = |user: &UserId| counts.joined.get(user).copied().unwrap_or(0);
    let after = |user: &UserId, delta: i32| count(user).saturating_add_signed(delta);
    let local_delta: i32 = deltas
        .iter()
        .filter(|(user, _)| user.server_name() == own)
        .map(|(_, delta)| delta)
        .sum();
    let ours_before = counts.local_joined > 0;
    let ours_after = counts.local_joined.saturating_add_signed(local_delta) > 0;
    let remote: Vec<(&OwnedUserId, bool, bool)> = deltas
        .iter()
        .filter(|(user, _)| user.server_name() != own)
        .map(|(user, delta)| (user, count(user) > 0, after(user, *delta) > 0))
        .collect();
    let transitions = match (ours_before, ours_after) {
        (false, true) => vec![Transition::RoomIsOurs],
        (true, false) => vec![Transition::RoomIsNotOurs {
            also: remote
                .iter()
                .filter(|(_, was, is)| *was && !*is)
                .map(|(user, _, _)| (*user).clone())
                .collect(),
        }],
        (false, false) => Vec::new(),
        (true, true) => remote
            .iter()
            .filter_map(|(user, was, is)| match (was, is) {
                (false, true) => Some(Transition::Starts((*user).clone())),
                (true, false) => Some(Transition::Stops((*user).clone())),
                _ => None,
            })
            .collect(),
    };
    RoomPlan {
        joined: deltas,
        transitions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::identity::MemberKey;
    use ruma::{OwnedRoomId, owned_user_id};

    const KEY: &str = "@l8Hft5qXKn1vfHrg3p4-W8gELQVo8N13JkluMfmn2sQ";

    fn own() -> &'static ServerName {
        <&ServerName>::try_from("our.example").unwrap()
    }

    fn room() -> OwnedRoomId {
        OwnedRoomId::try_from("!r:our.example").unwrap()
    }

    fn change(identity: Identity, membership: Membership, at: i64) -> MembershipChange {
        MembershipChange {
            room_id: room(),
            identity,
            membership,
            stream_ordering: at,
        }
    }

    fn user(id: &str) -> Identity {
        Identity::User(OwnedUserId::try_from(id).unwrap())
    }

    fn key() -> Identity {
        Identity::Key(MemberKey::parse(KEY).unwrap())
    }

    fn member(membership: Membership, at: i64) -> Option<Member> {
        Some(Member {
            membership,
            stream_ordering: at,
        })
    }

    fn counts(local: u32, joined: &[(&str, u32)]) -> RoomCounts {
        RoomCounts {
            local_joined: local,
            joined: joined
                .iter()
                .map(|(u, n)| (OwnedUserId::try_from(*u).unwrap(), *n))
                .collect(),
        }
    }

    fn link(user: &str, verified: bool, at: i64) -> Link {
        Link {
            user: Some(OwnedUserId::try_from(user).unwrap()),
            erased: false,
            verified,
            stream_ordering: at,
        }
    }

    const BOB: &str = "@bob:remote.example";
    const ME: &str = "@me:our.example";

    #[test]
    fn membership_changes_become_transitions() {
        use Membership::*;
        let bob = || owned_user_id!("@bob:remote.example");
        // (what happens, stored member, counts, expected transitions)
        type Case = (
            &'static str,
            MembershipChange,
            Option<Member>,
            RoomCounts,
            Vec<Transition>,
        );
        let cases: Vec<Case> = vec![
            (
                "a remote user joins a room of ours",
                change(user(BOB), Join, 2),
                None,
                counts(1, &[]),
                vec![Transition::Starts(bob())],
            ),
            (
                "a remote user joins a room not ours",
                change(user(BOB), Join, 2),
                None,
                counts(0, &[]),
                vec![],
            ),
            (
                "a remote user leaves",
                change(user(BOB), Leave, 3),
                member(Join, 2),
                counts(1, &[(BOB, 1)]),
                vec![Transition::Stops(bob())],
            ),
            (
                "a remote user with a second identity joined leaves",
                change(user(BOB), Leave, 3),
                member(Join, 2),
                counts(1, &[(BOB, 2)]),
                vec![],
            ),
            (
                "an invite is not a join",
                change(user(BOB), Invite, 2),
                None,
                counts(1, &[]),
                vec![],
            ),
            (
                "a join again is no change",
                change(user(BOB), Join, 3),
                member(Join, 2),
                counts(1, &[(BOB, 1)]),
                vec![],
            ),
            (
                "a ban of a joined user stops sharing",
                change(user(BOB), Ban, 3),
                member(Join, 2),
                counts(1, &[(BOB, 1)]),
                vec![Transition::Stops(bob())],
            ),
            (
                "our first user joins",
                change(user(ME), Join, 2),
                None,
                counts(0, &[]),
                vec![Transition::RoomIsOurs],
            ),
            (
                "our second user joins",
                change(user(ME), Join, 2),
                None,
                counts(1, &[(ME, 1)]),
                vec![],
            ),
            (
                "our last user leaves",
                change(user(ME), Leave, 3),
                member(Join, 2),
                counts(1, &[(ME, 1)]),
                vec![Transition::RoomIsNotOurs { also: vec![] }],
            ),
            (
                "a key without a link joins: nobody",
                change(key(), Join, 2),
                None,
                counts(1, &[]),
                vec![],
            ),
        ];
        for (what, change, member, counts, expected) in cases {
            let (row, plan) = plan_membership(&change, member, None, &counts, own()).unwrap();
            assert_eq!(plan.transitions, expected, "{what}");
            assert_eq!(row.stream_ordering, change.stream_ordering, "{what}");
        }
    }

    #[test]
    fn a_key_counts_only_through_its_verified_link() {
        let joined = change(key(), Membership::Join, 5);
        let bob = owned_user_id!("@bob:remote.example");
        let verified = link(BOB, true, 4);
        let (_, plan) =
            plan_membership(&joined, None, Some(&verified), &counts(1, &[]), own()).unwrap();
        assert_eq!(plan.transitions, [Transition::Starts(bob.clone())]);
        assert_eq!(plan.joined, [(bob, 1)]);
        let unverified = link(BOB, false, 4);
        let (_, plan) =
            plan_membership(&joined, None, Some(&unverified), &counts(1, &[]), own()).unwrap();
        assert_eq!(plan, RoomPlan::default(), "an unverified link names nobody");
        let local = link(ME, true, 4);
        let (_, plan) =
            plan_membership(&joined, None, Some(&local), &counts(0, &[]), own()).unwrap();
        assert_eq!(
            plan.transitions,
            [Transition::RoomIsOurs],
            "a verified local key makes the room ours"
        );
    }

    #[test]
    fn stale_changes_are_skipped() {
        let later = member(Membership::Join, 9);
        for at in [8, 9] {
            let old = change(user(BOB), Membership::Leave, at);
            assert_eq!(
                plan_membership(&old, later, None, &counts(1, &[(BOB, 1)]), own()),
                Err(Skip::Stale)
            );
        }
        let old_link = MemberKeyLink {
            room_id: room(),
            member_key: MemberKey::parse(KEY).unwrap(),
            user_id: Some(owned_user_id!("@bob:remote.example")),
            verified: false,
            stream_ordering: 4,
        };
        assert_eq!(
            plan_link(
                &old_link,
                Some(&link(BOB, true, 4)),
                None,
                &counts(1, &[]),
                own()
            ),
            Err(Skip::Stale)
        );
    }

    fn link_change(user: Option<&str>, verified: bool, at: i64) -> MemberKeyLink {
        MemberKeyLink {
            room_id: room(),
            member_key: MemberKey::parse(KEY).unwrap(),
            user_id: user.map(|u| OwnedUserId::try_from(u).unwrap()),
            verified,
            stream_ordering: at,
        }
    }

    #[test]
    fn link_changes_move_a_joined_key_between_users() {
        let bob = owned_user_id!("@bob:remote.example");
        let joined = member(Membership::Join, 3);
        let c = counts(1, &[(BOB, 1)]);
        // verified: the joined key now stands for bob
        let (row, plan) = plan_link(
            &link_change(Some(BOB), true, 5),
            None,
            joined,
            &counts(1, &[]),
            own(),
        )
        .unwrap();
        assert_eq!(plan.transitions, [Transition::Starts(bob.clone())]);
        assert!(row.verified && !row.erased);
        // verification lost: as a leave
        let (_, plan) = plan_link(
            &link_change(Some(BOB), false, 6),
            Some(&link(BOB, true, 5)),
            joined,
            &c,
            own(),
        )
        .unwrap();
        assert_eq!(plan.transitions, [Transition::Stops(bob.clone())]);
        // erased: as a leave, and the first user is remembered
        let (row, plan) = plan_link(
            &link_change(None, false, 6),
            Some(&link(BOB, true, 5)),
            joined,
            &c,
            own(),
        )
        .unwrap();
        assert_eq!(plan.transitions, [Transition::Stops(bob.clone())]);
        assert!(row.erased && row.user.as_ref() == Some(&bob));
        // a key not joined: the link is stored, nothing shares
        let (_, plan) = plan_link(
            &link_change(Some(BOB), true, 5),
            None,
            member(Membership::Leave, 3),
            &counts(1, &[]),
            own(),
        )
        .unwrap();
        assert_eq!(plan, RoomPlan::default());
        // another user for the same key: refused, even after an erasure
        let carol = Some("@carol:remote.example");
        assert_eq!(
            plan_link(
                &link_change(carol, true, 7),
                Some(&link(BOB, true, 5)),
                joined,
                &c,
                own()
            ),
            Err(Skip::LinkConflict { first: bob.clone() })
        );
        let erased = Link {
            erased: true,
            verified: false,
            ..link(BOB, true, 6)
        };
        assert_eq!(
            plan_link(
                &link_change(carol, true, 7),
                Some(&erased),
                joined,
                &c,
                own()
            ),
            Err(Skip::LinkConflict { first: bob })
        );
    }

    /// Link before membership and membership before link end the same.
    #[test]
    fn link_and_membership_commute() {
        let bob = owned_user_id!("@bob:remote.example");
        let verified = link_change(Some(BOB), true, 5);
        let joined = change(key(), Membership::Join, 4);
        // membership first, then the link
        let (member_row, first) =
            plan_membership(&joined, None, None, &counts(1, &[]), own()).unwrap();
        let (_, second) =
            plan_link(&verified, None, Some(member_row), &counts(1, &[]), own()).unwrap();
        let membership_first: Vec<Transition> = [first.transitions, second.transitions].concat();
        // the link first, then the membership
        let (link_row, first) = plan_link(&verified, None, None, &counts(1, &[]), own()).unwrap();
        let (_, second) =
            plan_membership(&joined, None, Some(&link_row), &counts(1, &[]), own()).unwrap();
        let link_first: Vec<Transition> = [first.transitions, second.transitions].concat();
        assert_eq!(membership_first, [Transition::Starts(bob)]);
        assert_eq!(link_first, membership_first);
    }

    #[test]
    fn our_last_identity_leaving_stops_everyone_including_who_left_with_it() {
        // A verified local key moving to a remote user is odd, but the count
        // rules still hold: we lose the room, and the remote user had none.
        let bob = owned_user_id!("@bob:remote.example");
        let plan = plan_deltas(
            vec![(owned_user_id!("@me:our.example"), -1), (bob.clone(), -1)],
            &counts(1, &[(ME, 1), (BOB, 1)]),
            own(),
        );
        assert_eq!(
            plan.transitions,
            [Transition::RoomIsNotOurs { also: vec![bob] }]
        );
    }
}
