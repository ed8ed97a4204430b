//! Which input partition a message belongs to (SPEC §4.5): fixed by its
//! user id (updates, signing-key updates, resyncs) or its room id
//! (membership changes, member-key links).
//!
//! Only the key is read, so routing a message costs a partial parse, not
//! the whole check; the full check happens once, in the partition's ingest.
//! A message whose key cannot be read (not JSON, no key) goes to partition
//! 0, where that check dead-letters it (SPEC §4.3).

use std::borrow::Cow;

use serde::Deserialize;

use super::InputKind;

/// The partition of a message of `kind` with body `body`, out of
/// `partitions` (at least 1).
pub fn partition_of(kind: Option<InputKind>, body: &[u8], partitions: u16) -> u16 {
    match kind.and_then(|kind| key(kind, body)) {
        Some(key) => partition_of_key(&key, partitions),
        None => 0,
    }
}

/// The partition of key `key` out of `partitions`: FNV-1a (32 bits) of its
/// bytes, modulo the count, as NATS's own `partition()` subject transform
/// computes it.
///
/// Written here rather than taken from a crate: the `fnv` crate gives the
/// 64-bit variant through `Hasher`, and the value must never change between
/// versions (a rolling upgrade would otherwise send one user's messages to
/// two partitions at once).
pub fn partition_of_key(key: &str, partitions: u16) -> u16 {
    const OFFSET: u32 = 2_166_136_261;
    const PRIME: u32 = 16_777_619;
    let hash = key.bytes().fold(OFFSET, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(PRIME)
    });
    // The remainder is below `partitions`, so it fits.
    u16::try_from(hash % u32::from(partitions.max(1))).unwrap_or(0)
}

/// The fields a key can come from; the rest of the body is skipped.
#[derive(Deserialize)]
struct Keys<'a> {
    #[serde(borrow, default)]
    user_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    room_id: Option<Cow<'a, str>>,
}

/// The partition key of a message: its user id or its room id, as text
/// (a malformed id is still a key; the check rejects it later).
fn key(kind: InputKind, body: &[u8]) -> Option<String> {
    let keys: Keys<'_> = serde_json::from_slice(body).ok()?;
    let key = match kind {
        InputKind::Update | InputKind::SigningKey | InputKind::Resync => keys.user_id,
        InputKind::Membership | InputKind::MemberKey => keys.room_id,
    };
    key.map(Cow::into_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_published_test_vectors() {
        // FNV-1a 32-bit of "" and "a" (from the FNV reference test suite).
        assert_eq!(
            partition_of_key("", u16::MAX),
            (2_166_136_261u32 % 65_535) as u16
        );
        assert_eq!(
            partition_of_key("a", u16::MAX),
            (0xe40c_292c_u32 % 65_535) as u16
        );
    }

    #[test]
    fn users_by_user_id_rooms_by_room_id() {
        let update = br#"{"user_id": "@bob:remote.example", "device_id": "D", "stream_id": 1}"#;
        let member =
            br#"{"room_id": "!r:remote.example", "state_key": "@bob:remote.example", "membership": "join"}"#;
        let link = br#"{"room_id": "!r:remote.example", "member_key": "@k", "user_id": "@bob:remote.example"}"#;
        let user = partition_of_key("@bob:remote.example", 8);
        let room = partition_of_key("!r:remote.example", 8);
        assert_ne!(user, room, "the example needs two partitions");
        for kind in [InputKind::Update, InputKind::SigningKey, InputKind::Resync] {
            assert_eq!(partition_of(Some(kind), update, 8), user);
        }
        assert_eq!(partition_of(Some(InputKind::Membership), member, 8), room);
        // A link names a user too, but goes with its room.
        assert_eq!(partition_of(Some(InputKind::MemberKey), link, 8), room);
    }

    #[test]
    fn escaped_ids_are_read_as_the_check_reads_them() {
        let escaped = br#"{"user_id": "@bob:remote\u002eexample"}"#;
        assert_eq!(
            partition_of(Some(InputKind::Update), escaped, 8),
            partition_of_key("@bob:remote.example", 8)
        );
    }

    #[test]
    fn what_has_no_key_goes_to_partition_zero() {
        for body in [&b"not json"[..], b"{}", br#"{"user_id": 7}"#, b"[1]"] {
            assert_eq!(partition_of(Some(InputKind::Update), body, 8), 0);
        }
        assert_eq!(partition_of(None, br#"{"user_id": "@a:b"}"#, 8), 0);
    }

    #[test]
    fn one_partition_holds_everything() {
        for key in ["@a:b", "!r:c", ""] {
            assert_eq!(partition_of_key(key, 1), 0);
        }
    }
}
