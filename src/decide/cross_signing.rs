//! The well-formedness check for cross-signing keys (SPEC §5.3): exactly one
//! key, key id `ed25519:<the key>`, a 32-byte key, the right owner and usage.

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

/// Checks one key object. The error says what is wrong.
pub fn check(raw: &str, user_id: &UserId, usage: KeyUsage) -> Result<(), String> {
    let key: Shape = serde_json::from_str(raw).map_err(|e| format!("not a key object: {e}"))?;
    if key.user_id != user_id.as_str() {
        return Err(format!("user_id {:?} is not {user_id}", key.user_id));
    }
    if !key.usage.iter().any(|u| u == usage.as_str()) {
        return Err(format!("usage does not contain {:?}", usage.as_str()));
    }
    let mut keys = key.keys.iter();
    let (Some((key_id, public_key)), None) = (keys.next(), keys.next()) else {
        return Err(format!("has {} keys, not exactly one", key.keys.len()));
    };
    if key_id.strip_prefix("ed25519:") != Some(public_key.as_str()) {
        return Err(format!("key id {key_id:?} is not ed25519:<the key>"));
    }
    match STANDARD_NO_PAD.decode(public_key) {
        Ok(bytes) if bytes.len() == 32 => Ok(()),
        Ok(bytes) => Err(format!("key has {} bytes, not 32", bytes.len())),
        Err(_) => Err("key is not unpadded base64".to_owned()),
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
            key_json("@bob:remote.example", "master", &one),
            key_json(user().as_str(), "self_signing", &one),
            key_json(user().as_str(), "master", "{}"),
            key_json(
                user().as_str(),
                "master",
                &format!(r#"{{"ed25519:{KEY}":"{KEY}","ed25519:other":"other"}}"#),
            ),
            key_json(
                user().as_str(),
                "master",
                &format!(r#"{{"ed25519:wrong":"{KEY}"}}"#),
            ),
            key_json(user().as_str(), "master", r#"{"ed25519:AAAA":"AAAA"}"#),
            key_json(user().as_str(), "master", r#"{"ed25519:!!":"!!"}"#),
            "[]".to_owned(),
        ];
        for raw in cases {
            assert!(check(&raw, user(), KeyUsage::Master).is_err(), "{raw}");
        }
    }
}
