//! Room identities (SPEC §5.5, §5.6): a member of a room is a user id or, in
//! an MSC4430 member-key room, a per-room ed25519 member key.
//!
//! Parse, don't validate: a [`MemberKey`] is its own type, checked once
//! here, with no way to turn it into a user id. Everything past this module
//! that needs the user behind a key has to go through a verified link in the
//! key's own room (`decide::membership`).

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ruma::{OwnedUserId, UserId};

/// Characters after the `@` of a member key: 32 bytes in unpadded base64.
const KEY_CHARS: usize = 43;

/// An MSC4430 member key: `@` and the unpadded URL-safe base64 of a
/// 32-byte ed25519 public key. Not a user id, and never becomes one.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MemberKey(String);

/// Why a text is not a member key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MemberKeyError {
    /// It does not start with `@`.
    #[error("a member key starts with @")]
    NoSigil,
    /// Not 43 characters after the `@`.
    #[error("a member key has {KEY_CHARS} characters after the @, not {0}")]
    Length(usize),
    /// Not unpadded URL-safe base64 of 32 bytes.
    #[error("a member key is unpadded URL-safe base64 of 32 bytes")]
    NotBase64,
}

impl MemberKey {
    /// Checks `text`.
    pub fn parse(text: &str) -> Result<MemberKey, MemberKeyError> {
        let encoded = text.strip_prefix('@').ok_or(MemberKeyError::NoSigil)?;
        if encoded.len() != KEY_CHARS {
            return Err(MemberKeyError::Length(encoded.chars().count()));
        }
        match URL_SAFE_NO_PAD.decode(encoded) {
            Ok(bytes) if bytes.len() == 32 => Ok(MemberKey(text.to_owned())),
            _ => Err(MemberKeyError::NotBase64),
        }
    }

    /// The key as sent (`@…`).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for MemberKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who a membership event is about: a user id, or a member key.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Identity {
    /// A user id (every room without MSC4430).
    User(OwnedUserId),
    /// A member key (MSC4430 rooms): names a user only through its link.
    Key(MemberKey),
}

/// Why a `state_key` names no identity.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// Neither a user id nor, with member keys on, a member key.
    #[error("{text:?} is not a user id{}", if *.member_keys { " or a member key" } else { "" })]
    Neither {
        /// The text.
        text: String,
        /// Whether member keys were accepted.
        member_keys: bool,
    },
}

impl Identity {
    /// The text it was read from (as stored).
    pub fn as_str(&self) -> &str {
        match self {
            Identity::User(user) => user.as_str(),
            Identity::Key(key) => key.as_str(),
        }
    }

    /// Reads a `state_key`. A member key is accepted only when `member_keys`
    /// (`DLU_MSC4430=on`); otherwise it is a malformed identity (SPEC §5.5.7).
    /// The two cannot be confused: a user id has a `:` and a server name,
    /// a member key has neither (`:` is not in its alphabet).
    pub fn parse(text: &str, member_keys: bool) -> Result<Identity, IdentityError> {
        if let Ok(user) = UserId::parse(text) {
            return Ok(Identity::User(user));
        }
        match MemberKey::parse(text) {
            Ok(key) if member_keys => Ok(Identity::Key(key)),
            _ => Err(IdentityError::Neither {
                text: text.to_owned(),
                member_keys,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "@l8Hft5qXKn1vfHrg3p4-W8gELQVo8N13JkluMfmn2sQ";

    #[test]
    fn member_keys_are_checked() {
        assert_eq!(MemberKey::parse(KEY).map(|k| k.to_string()), Ok(KEY.into()));
        let cases = [
            (&KEY[1..], MemberKeyError::NoSigil),
            ("@short", MemberKeyError::Length(5)),
            (&format!("{KEY}A")[..], MemberKeyError::Length(44)),
            // Standard base64 ('+', '/') is not the URL-safe alphabet.
            (
                "@l8Hft5qXKn1vfHrg3p4+W8gELQVo8N13JkluMfmn2sQ",
                MemberKeyError::NotBase64,
            ),
            (
                "@l8Hft5qXKn1vfHrg3p4:W8gELQVo8N13JkluMfmn2sQ",
                MemberKeyError::NotBase64,
            ),
        ];
        for (text, error) in cases {
            assert_eq!(MemberKey::parse(text), Err(error), "{text}");
        }
    }

    #[test]
    fn identities_are_user_ids_or_keys_never_both() {
        let user = Identity::parse("@bob:remote.example", false).unwrap();
        assert!(matches!(user, Identity::User(_)));
        assert!(matches!(
            Identity::parse(KEY, true),
            Ok(Identity::Key(key)) if key.as_str() == KEY
        ));
        let off = Identity::parse(KEY, false).unwrap_err();
        assert!(off.to_string().ends_with("is not a user id"), "{off}");
        for bad in ["", "bob", "@", "!room:example.org"] {
            assert!(Identity::parse(bad, true).is_err(), "{bad:?}");
        }
    }
}
