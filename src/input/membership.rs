//! `devicelist.in.membership` and `devicelist.in.member_key` (SPEC §4.1,
//! §5.5, §5.6): a room membership change, and a member key's link to its
//! user. Checked here like every input; what they change is decided in
//! `decide::membership`.

use ruma::{OwnedRoomId, OwnedUserId};
use serde::Deserialize;
use serde_json::Value;

use super::dead_letter::{DeadReason, Rejection};
use super::fields;
use super::identity::{Identity, MemberKey};

/// A room membership state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Membership {
    /// In the room: the only state that counts for sharing (SPEC §5.5.1).
    Join,
    /// Left or was kicked.
    Leave,
    /// Invited, not yet in.
    Invite,
    /// Asking to join.
    Knock,
    /// Banned.
    Ban,
}

impl Membership {
    /// The membership named `text` (as in the event and the store).
    pub fn parse(text: &str) -> Option<Membership> {
        Some(match text {
            "join" => Membership::Join,
            "leave" => Membership::Leave,
            "invite" => Membership::Invite,
            "knock" => Membership::Knock,
            "ban" => Membership::Ban,
            _ => return None,
        })
    }

    /// Its name in events and in the store.
    pub fn as_str(self) -> &'static str {
        match self {
            Membership::Join => "join",
            Membership::Leave => "leave",
            Membership::Invite => "invite",
            Membership::Knock => "knock",
            Membership::Ban => "ban",
        }
    }
}

/// One membership change of one identity in one room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MembershipChange {
    /// The room.
    pub room_id: OwnedRoomId,
    /// Whose membership (`state_key`).
    pub identity: Identity,
    /// The new membership.
    pub membership: Membership,
    /// The homeserver's position of the event in the room.
    pub stream_ordering: i64,
}

#[derive(Deserialize)]
struct MembershipWire {
    room_id: Option<Value>,
    state_key: Option<Value>,
    membership: Option<Value>,
    stream_ordering: Option<Value>,
}

impl MembershipChange {
    /// Parses a body; `member_keys`: `DLU_MSC4430=on`.
    pub fn parse(body: &[u8], member_keys: bool) -> Result<Self, Rejection> {
        let wire: MembershipWire = super::from_json(body)?;
        let room_id = fields::room_id(wire.room_id.as_ref())?;
        let identity = match wire.state_key.as_ref() {
            Some(Value::String(text)) => Identity::parse(text, member_keys)
                .map_err(|e| Rejection::new(DeadReason::InvalidIdentity, e.to_string()))?,
            _ => {
                return Err(Rejection::new(
                    DeadReason::InvalidIdentity,
                    "state_key is missing or not a string",
                ));
            }
        };
        let membership = wire
            .membership
            .as_ref()
            .and_then(Value::as_str)
            .and_then(Membership::parse)
            .ok_or_else(|| {
                Rejection::new(
                    DeadReason::InvalidMembership,
                    "membership must be join, leave, invite, knock or ban",
                )
            })?;
        Ok(MembershipChange {
            room_id,
            identity,
            membership,
            stream_ordering: fields::stream_ordering(wire.stream_ordering.as_ref())?,
        })
    }
}

/// A member key's link to its user in one room, or a change of its
/// verification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberKeyLink {
    /// The room the key belongs to (a link counts nowhere else).
    pub room_id: OwnedRoomId,
    /// The key.
    pub member_key: MemberKey,
    /// The linked user (None: no link known, or the user was erased).
    pub user_id: Option<OwnedUserId>,
    /// Whether the homeserver's last check of the link succeeded.
    pub verified: bool,
    /// The homeserver's position of the event in the room.
    pub stream_ordering: i64,
}

#[derive(Deserialize)]
struct LinkWire {
    room_id: Option<Value>,
    member_key: Option<Value>,
    user_id: Option<Value>,
    verified: Option<Value>,
    stream_ordering: Option<Value>,
}

impl MemberKeyLink {
    /// Parses a body.
    pub fn parse(body: &[u8]) -> Result<Self, Rejection> {
        let wire: LinkWire = super::from_json(body)?;
        let room_id = fields::room_id(wire.room_id.as_ref())?;
        let member_key = match wire.member_key.as_ref() {
            Some(Value::String(text)) => MemberKey::parse(text).map_err(|e| {
                Rejection::new(DeadReason::InvalidIdentity, format!("member_key: {e}"))
            })?,
            _ => {
                return Err(Rejection::new(
                    DeadReason::InvalidIdentity,
                    "member_key is missing or not a string",
                ));
            }
        };
        let user_id = match wire.user_id.as_ref() {
            None | Some(Value::Null) => None,
            some => Some(fields::user_id(some)?),
        };
        Ok(MemberKeyLink {
            room_id,
            member_key,
            user_id,
            verified: fields::flag("verified", wire.verified.as_ref())?,
            stream_ordering: fields::stream_ordering(wire.stream_ordering.as_ref())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "@l8Hft5qXKn1vfHrg3p4-W8gELQVo8N13JkluMfmn2sQ";

    fn change(body: serde_json::Value, member_keys: bool) -> Result<MembershipChange, DeadReason> {
        MembershipChange::parse(body.to_string().as_bytes(), member_keys).map_err(|r| r.reason)
    }

    #[test]
    fn membership_changes_parse_and_say_what_is_wrong() {
        use serde_json::json;
        let ok = change(
            json!({"room_id": "!r:example.org", "state_key": "@bob:remote.example",
                   "membership": "join", "stream_ordering": "1234"}),
            false,
        )
        .unwrap();
        assert_eq!(ok.membership, Membership::Join);
        assert_eq!(ok.stream_ordering, 1234, "a numeric string is accepted");
        let key = change(
            json!({"room_id": "!r:example.org", "state_key": KEY, "membership": "leave",
                   "stream_ordering": 7}),
            true,
        )
        .unwrap();
        assert!(matches!(key.identity, Identity::Key(_)));
        let base = json!({"room_id": "!r:example.org", "state_key": "@bob:remote.example",
                          "membership": "join", "stream_ordering": 1});
        let with = |field: &str, value: serde_json::Value| {
            let mut body = base.clone();
            body[field] = value;
            body
        };
        let cases = [
            (
                with("room_id", json!("r:example.org")),
                false,
                DeadReason::InvalidRoomId,
            ),
            (
                with("room_id", json!(null)),
                false,
                DeadReason::InvalidRoomId,
            ),
            (
                with("state_key", json!(KEY)),
                false,
                DeadReason::InvalidIdentity,
            ),
            (
                with("state_key", json!("bob")),
                true,
                DeadReason::InvalidIdentity,
            ),
            (
                with("state_key", json!(5)),
                true,
                DeadReason::InvalidIdentity,
            ),
            (
                with("membership", json!("joined")),
                false,
                DeadReason::InvalidMembership,
            ),
            (
                with("stream_ordering", json!(-1)),
                false,
                DeadReason::InvalidStreamOrdering,
            ),
            (
                with("stream_ordering", json!("1e3")),
                false,
                DeadReason::InvalidStreamOrdering,
            ),
        ];
        for (body, member_keys, reason) in cases {
            assert_eq!(change(body.clone(), member_keys), Err(reason), "{body}");
        }
    }

    #[test]
    fn member_key_links_parse_and_say_what_is_wrong() {
        use serde_json::json;
        let parse = |body: serde_json::Value| {
            MemberKeyLink::parse(body.to_string().as_bytes()).map_err(|r| r.reason)
        };
        let link = parse(json!({"room_id": "!r:example.org", "member_key": KEY,
            "user_id": "@bob:remote.example", "verified": true, "stream_ordering": 1235}))
        .unwrap();
        assert!(link.verified);
        assert_eq!(
            link.user_id.as_deref().map(|u| u.as_str()),
            Some("@bob:remote.example")
        );
        let erased = parse(json!({"room_id": "!r:example.org", "member_key": KEY,
            "user_id": null, "verified": false, "stream_ordering": 1236}))
        .unwrap();
        assert_eq!(erased.user_id, None);
        assert_eq!(
            parse(
                json!({"room_id": "!r:example.org", "member_key": "@bob:remote.example",
                "user_id": "@bob:remote.example", "verified": true, "stream_ordering": 1})
            ),
            Err(DeadReason::InvalidIdentity),
            "a user id is not a member key"
        );
        assert_eq!(
            parse(json!({"room_id": "!r:example.org", "member_key": KEY,
                "user_id": "bob", "verified": true, "stream_ordering": 1})),
            Err(DeadReason::InvalidUserId)
        );
    }
}
