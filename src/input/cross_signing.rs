//! The well-formedness check for cross-signing keys (SPEC §5.3): exactly one
//! key, key id `ed25519:<the key>`, a 32-byte key, the right owner and usage.
//! Used on input (`m.signing_key_update`) and on fetched answers alike, so it
//! lives at the bottom, with the other input checks.

use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD_NO_PAD;
use ruma::UserId;
use serde::Deserialize;

/// Which cross-signing key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KeyUsage {
    /// The master key.
    Master,
    /// The self-signing key (signs the user's devices).
    SelfSigning,
}

impl KeyUsage {
    /// The `usage` string, also the stored `key_usage`.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyUsage::Master => "master",
            KeyUsage::SelfSigning => "self_signing",
        }
    }

    /// Parses a stored `key_usage`.
    pub fn from_str_opt(s: &str) -> Option<Self> {
        match s {
            "master" => Some(KeyUsage::Master),
            "self_signing" => Some(KeyUsage::SelfSigning),
            _ => None,
        }
    }
}

#[derive(Deserialize)]
struct Shape {
    user_id: String,
    usage: Vec<String>,
    keys: BTreeMap<String, String>,
}

/// What is wrong with a key object.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyProblem {
    /// Not a JSON object with `user_id`, `usage` and `keys`.
    #[error("not a key object: {0}")]
    NotAKeyObject(String),
    /// Someone else's key.
    #[error("user_id {found:?} is not {expected}")]
    WrongUser {
        /// The key's `user_id`.
        found: String,
        /// The user it should be.
        expected: String,
    },
    /// `usage` lacks the usage it is sent as.
    #[error("usage does not contain {0:?}")]
    WrongUsage(&'static str),
    /// Zero or several keys.
    #[error("has {0} keys, not exactly one")]
    KeyCount(usize),
    /// The key id is not `ed25519:<the key>`.
    #[error("key id {0:?} is not ed25519:<the key>")]
    KeyId(String),
    /// The key is not 32 bytes of unpadded base64.
    #[error("key is not 32 bytes of unpadded base64")]
    KeyBytes,
}

/// Checks one key object.
pub fn check(raw: &str, user_id: &UserId, usage: KeyUsage) -> Result<(), KeyProblem> {
    let key: Shape =
        serde_json::from_str(raw).map_err(|e| KeyProblem::NotAKeyObject(e.to_string()))?;
    if key.user_id != user_id.as_str() {
        return Err(KeyProblem::WrongUser {
            found: key.user_id,
            expected: user_id.to_string(),
        });
    }
    if !key.usage.iter().any(|u| u == usage.as_str()) {
        return Err(KeyProblem::WrongUsage(usage.as_str()));
    }
    let mut keys = key.keys.iter();
    let (Some((key_id, public_key)), None) = (keys.next(), keys.next()) else {
        return Err(KeyProblem::KeyCount(key.keys.len()));
    };
    if key_id.strip_prefix("ed25519:") != Some(public_key.as_str()) {
        return Err(KeyProblem::KeyId(key_id.clone()));
    }
    match STANDARD_NO_PAD.decode(public_key) {
        Ok(bytes) if bytes.len() == 32 => Ok(()),
        _ => Err(KeyProblem::KeyBytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "nqOvzeuGWT/sRx3h7+MHoInYj3Uk2LD/unI9kDYcHwk";

    fn user() -> &'static UserId {
        <&UserId>::try_from("@alice:remote.example").unwrap()
    }

    fn key_json(user: &str, usage: &str, keys: &str) -> String {
        format!(r#"{{"user_id":"{user}","usage":["{usage}"],"keys":{keys},"signatures":{{}}}}"#)
    }

    #[test]
    fn accepts_a_well_formed_key() {
        let raw = key_json(
            user().as_str(),
            "master",
            &format!(r#"{{"ed25519:{KEY}":"{KEY}"}}"#),
        );
        assert_eq!(check(&raw, user(), KeyUsage::Master), Ok(()));
    }

    #[test]
    fn refuses_each_kind_of_malformed_key() {
        let one = format!(r#"{{"ed25519:{KEY}":"{KEY}"}}"#);
        let cases = [
            (key_json("@bob:remote.example", "master", &one), "WrongUser"),
            (
                key_json(user().as_str(), "self_signing", &one),
                "WrongUsage",
            ),
            (key_json(user().as_str(), "master", "{}"), "KeyCount"),
            (
                key_json(
                    user().as_str(),
                    "master",
                    &format!(r#"{{"ed25519:{KEY}":"{KEY}","ed25519:other":"other"}}"#),
                ),
                "KeyCount",
            ),
            (
                key_json(
                    user().as_str(),
                    "master",
                    &format!(r#"{{"ed25519:wrong":"{KEY}"}}"#),
                ),
                "KeyId",
            ),
            (
                key_json(user().as_str(), "master", r#"{"ed25519:AAAA":"AAAA"}"#),
                "KeyBytes",
            ),
            (
                key_json(user().as_str(), "master", r#"{"ed25519:!!":"!!"}"#),
                "KeyBytes",
            ),
            ("[]".to_owned(), "NotAKeyObject"),
        ];
        for (raw, problem) in cases {
            let found = check(&raw, user(), KeyUsage::Master).unwrap_err();
            assert!(
                format!("{found:?}").starts_with(problem),
                "{raw}: {found:?}"
            );
        }
    }
}
