//! Input: turning raw JetStream messages into checked values (SPEC §4.1, §5.1.1).
//!
//! Parse, don't validate: everything past this module holds an [`InputMessage`]
//! whose user id, stream ids and fields are known to be well formed, or the
//! message became a [`Rejection`] bound for the dead-letter stream.

pub mod cross_signing;
pub mod dead_letter;
pub(crate) mod fields;
pub mod identity;
pub mod kind;
pub mod membership;
pub mod partition;
pub mod resync;
pub mod signing_key;
pub mod tracking;
pub mod update;

use ruma::{ServerName, UserId};
use serde::Deserialize;

pub use dead_letter::{DeadReason, Rejection};
pub use kind::{InputKind, InputSubjects};
pub use membership::{MemberKeyLink, MembershipChange};
pub use resync::ResyncRequest;
pub use signing_key::SigningKeyUpdate;
pub use tracking::{RoomRules, Tracking};
pub use update::DeviceListUpdate;

/// Largest accepted message body, in bytes (an EDU is capped at 64 KiB by most servers).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// A checked input message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InputMessage {
    /// A device-list update.
    Update(DeviceListUpdate),
    /// A cross-signing key update.
    SigningKey(SigningKeyUpdate),
    /// A request to refetch a user's list.
    Resync(ResyncRequest),
    /// A room membership change.
    Membership(MembershipChange),
    /// A member key's link to its user.
    MemberKey(MemberKeyLink),
}

impl InputMessage {
    /// The user the message is about. None for a member key's membership:
    /// a key names a user only through its link (SPEC §5.6), never by itself.
    pub fn user_id(&self) -> Option<&UserId> {
        match self {
            InputMessage::Update(u) => Some(&u.user_id),
            InputMessage::SigningKey(s) => Some(&s.user_id),
            InputMessage::Resync(r) => Some(&r.user_id),
            InputMessage::Membership(m) => match &m.identity {
                identity::Identity::User(user) => Some(user),
                identity::Identity::Key(_) => None,
            },
            InputMessage::MemberKey(link) => link.user_id.as_deref(),
        }
    }

    /// The room the message is about (room input only).
    pub fn room_id(&self) -> Option<&ruma::RoomId> {
        match self {
            InputMessage::Membership(m) => Some(&m.room_id),
            InputMessage::MemberKey(link) => Some(&link.room_id),
            InputMessage::Update(_) | InputMessage::SigningKey(_) | InputMessage::Resync(_) => None,
        }
    }

    /// Whether it is news from the user's server (an update of its devices
    /// or keys), which may end that server's fetch back-off (SPEC §5.2).
    pub fn heard_from_server(&self) -> bool {
        match self {
            InputMessage::Update(_) | InputMessage::SigningKey(_) => true,
            InputMessage::Resync(_) | InputMessage::Membership(_) | InputMessage::MemberKey(_) => {
                false
            }
        }
    }
}

/// What to do with a message that is well formed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// Process it.
    Accept(InputMessage),
    /// Ack and ignore it: it is about one of our own users.
    OwnUser,
    /// Ack and ignore it: room input while membership is off (SPEC §5.5.8).
    MembershipOff,
}

/// The settings that change how input is read.
#[derive(Clone, Copy, Debug)]
pub struct Rules<'a> {
    /// Our server: updates about its users are ignored.
    pub own_server: &'a ServerName,
    /// Whether room input is read, and member keys with it.
    pub tracking: &'a Tracking,
}

impl<'a> Rules<'a> {
    /// Membership and member keys off.
    pub fn new(own_server: &'a ServerName) -> Rules<'a> {
        static EVERYONE: Tracking = Tracking::Everyone;
        Rules {
            own_server,
            tracking: &EVERYONE,
        }
    }
}

/// Checks one message: size, JSON shape, fields, and the `origin` rule.
pub fn parse(
    kind: InputKind,
    body: &[u8],
    origin: Option<&str>,
    rules: &Rules<'_>,
) -> Result<Parsed, Rejection> {
    if kind.is_room_input() && !rules.tracking.by_rooms() {
        return Ok(Parsed::MembershipOff);
    }
    if body.len() > MAX_BODY_BYTES {
        return Err(Rejection::new(
            DeadReason::Oversized,
            format!("body has {} bytes, more than {MAX_BODY_BYTES}", body.len()),
        ));
    }
    let message = kind.parse_body(body, rules.tracking.member_keys())?;
    // Room input names our own users on purpose (they make a room ours),
    // and comes from our homeserver, not over federation: no origin.
    if kind.is_room_input() {
        return Ok(Parsed::Accept(message));
    }
    let Some(user) = message.user_id() else {
        return Ok(Parsed::Accept(message));
    };
    let user_server = user.server_name();
    if let Some(origin) = origin
        && origin != user_server.as_str()
    {
        return Err(Rejection::new(
            DeadReason::OriginMismatch,
            format!("origin {origin:?} is not the server of {user}",),
        ));
    }
    if user_server == rules.own_server {
        return Ok(Parsed::OwnUser);
    }
    Ok(Parsed::Accept(message))
}

/// Deserializes a body, telling "not JSON" apart from "JSON of the wrong shape".
fn from_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, Rejection> {
    serde_json::from_slice(body).map_err(|e| {
        let reason = match e.classify() {
            serde_json::error::Category::Data => DeadReason::InvalidShape,
            _ => DeadReason::NotJson,
        };
        Rejection::new(reason, e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own() -> Rules<'static> {
        Rules::new(<&ServerName>::try_from("our.example").unwrap())
    }

    const UPDATE: &str = r#"{"user_id":"@a:remote.example","device_id":"D","stream_id":1}"#;

    #[test]
    fn origin_must_be_the_users_server() {
        let err = parse(
            InputKind::Update,
            UPDATE.as_bytes(),
            Some("evil.example"),
            &own(),
        )
        .unwrap_err();
        assert_eq!(err.reason, DeadReason::OriginMismatch);
        assert!(matches!(
            parse(
                InputKind::Update,
                UPDATE.as_bytes(),
                Some("remote.example"),
                &own()
            ),
            Ok(Parsed::Accept(_))
        ));
        assert!(matches!(
            parse(InputKind::Update, UPDATE.as_bytes(), None, &own()),
            Ok(Parsed::Accept(_))
        ));
    }

    #[test]
    fn own_users_are_ignored() {
        let body = r#"{"user_id":"@me:our.example","device_id":"D","stream_id":1}"#;
        assert_eq!(
            parse(InputKind::Update, body.as_bytes(), None, &own()),
            Ok(Parsed::OwnUser)
        );
        assert_eq!(
            parse(
                InputKind::Resync,
                br#"{"user_id":"@me:our.example"}"#,
                None,
                &own()
            ),
            Ok(Parsed::OwnUser)
        );
    }

    #[test]
    fn oversized_bodies_are_refused_before_parsing() {
        let body = vec![b' '; MAX_BODY_BYTES + 1];
        assert_eq!(
            parse(InputKind::Update, &body, None, &own())
                .unwrap_err()
                .reason,
            DeadReason::Oversized
        );
    }
}
