//! `devicelist.in.update`: the content of an `m.device_list_update` EDU.

use ruma::{OwnedDeviceId, OwnedUserId};
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

use super::dead_letter::{DeadReason, Rejection};
use super::fields;

/// A checked device-list update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceListUpdate {
    /// Owner of the device.
    pub user_id: OwnedUserId,
    /// The device that changed.
    pub device_id: OwnedDeviceId,
    /// `device_display_name`, if any.
    pub display_name: Option<String>,
    /// This update's stream id.
    pub stream_id: i64,
    /// Stream ids of earlier updates this one follows (may be empty).
    pub prev_ids: Vec<i64>,
    /// The device was deleted.
    pub deleted: bool,
    /// The device-keys object, byte for byte as received (None when absent or null).
    pub keys: Option<String>,
}

/// The wire form: loosely typed so each bad field gets its own reason.
#[derive(Deserialize)]
struct Wire<'a> {
    user_id: Option<Value>,
    device_id: Option<Value>,
    device_display_name: Option<Value>,
    stream_id: Option<Value>,
    prev_id: Option<Value>,
    deleted: Option<Value>,
    #[serde(borrow)]
    keys: Option<&'a RawValue>,
}

impl DeviceListUpdate {
    /// Parses an EDU `content`.
    pub fn parse(body: &[u8]) -> Result<Self, Rejection> {
        let wire: Wire<'_> = super::from_json(body)?;
        let user_id = fields::user_id(wire.user_id.as_ref())?;
        let device_id = fields::device_id(wire.device_id.as_ref())?;
        let stream_id = fields::stream_id(wire.stream_id.as_ref())?;
        let prev_ids = fields::prev_ids(wire.prev_id.as_ref())?;
        let display_name = fields::display_name(wire.device_display_name.as_ref())?;
        let deleted = fields::flag("deleted", wire.deleted.as_ref())?;
        let keys = match wire.keys {
            None => None,
            Some(raw) if raw.get().trim_start().starts_with('{') => Some(raw.get().to_owned()),
            Some(_) => {
                return Err(Rejection::new(
                    DeadReason::InvalidKeys,
                    "keys must be a JSON object",
                ));
            }
        };
        Ok(DeviceListUpdate {
            user_id,
            device_id,
            display_name,
            stream_id,
            prev_ids,
            deleted,
            // A deletion carries no keys, whatever the sender put there.
            keys: if deleted { None } else { keys },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(body: &str) -> DeadReason {
        DeviceListUpdate::parse(body.as_bytes()).unwrap_err().reason
    }

    #[test]
    fn parses_a_full_update_and_keeps_keys_verbatim() {
        let body = r#"{"user_id":"@a:remote.example","device_id":"D","device_display_name":"Phone",
            "stream_id":6,"prev_id":[5],"keys":{"b":1,  "a":{"x":"y"}},"extra":true}"#;
        let u = DeviceListUpdate::parse(body.as_bytes()).unwrap();
        assert_eq!(u.user_id.as_str(), "@a:remote.example");
        assert_eq!(u.device_id.as_str(), "D");
        assert_eq!(u.display_name.as_deref(), Some("Phone"));
        assert_eq!(
            (u.stream_id, u.prev_ids.clone(), u.deleted),
            (6, vec![5], false)
        );
        assert_eq!(u.keys.as_deref(), Some(r#"{"b":1,  "a":{"x":"y"}}"#));
    }

    #[test]
    fn accepts_numeric_strings_and_missing_prev_id() {
        let u = DeviceListUpdate::parse(
            br#"{"user_id":"@a:b","device_id":"D","stream_id":"12","prev_id":["10",11]}"#,
        )
        .unwrap();
        assert_eq!((u.stream_id, u.prev_ids), (12, vec![10, 11]));
        let u = DeviceListUpdate::parse(br#"{"user_id":"@a:b","device_id":"D","stream_id":1}"#)
            .unwrap();
        assert!(u.prev_ids.is_empty());
        assert_eq!(u.keys, None);
    }

    #[test]
    fn deletion_drops_keys() {
        let u = DeviceListUpdate::parse(
            br#"{"user_id":"@a:b","device_id":"D","stream_id":3,"deleted":true,"keys":{"k":1}}"#,
        )
        .unwrap();
        assert!(u.deleted);
        assert_eq!(u.keys, None);
    }

    #[test]
    fn each_bad_field_has_its_reason() {
        let cases = [
            ("not json", DeadReason::NotJson),
            ("[1,2]", DeadReason::InvalidShape),
            (
                r#"{"device_id":"D","stream_id":1}"#,
                DeadReason::InvalidUserId,
            ),
            (
                r#"{"user_id":"alice","device_id":"D","stream_id":1}"#,
                DeadReason::InvalidUserId,
            ),
            (
                r#"{"user_id":"@a:b","stream_id":1}"#,
                DeadReason::InvalidDeviceId,
            ),
            (
                r#"{"user_id":"@a:b","device_id":"","stream_id":1}"#,
                DeadReason::InvalidDeviceId,
            ),
            (
                r#"{"user_id":"@a:b","device_id":7,"stream_id":1}"#,
                DeadReason::InvalidDeviceId,
            ),
            (
                r#"{"user_id":"@a:b","device_id":"D"}"#,
                DeadReason::InvalidStreamId,
            ),
            (
                r#"{"user_id":"@a:b","device_id":"D","stream_id":-1}"#,
                DeadReason::InvalidStreamId,
            ),
            (
                r#"{"user_id":"@a:b","device_id":"D","stream_id":"1x"}"#,
                DeadReason::InvalidStreamId,
            ),
            (
                r#"{"user_id":"@a:b","device_id":"D","stream_id":1.5}"#,
                DeadReason::InvalidStreamId,
            ),
            (
                r#"{"user_id":"@a:b","device_id":"D","stream_id":1,"prev_id":5}"#,
                DeadReason::InvalidPrevId,
            ),
            (
                r#"{"user_id":"@a:b","device_id":"D","stream_id":1,"prev_id":["x"]}"#,
                DeadReason::InvalidPrevId,
            ),
            (
                r#"{"user_id":"@a:b","device_id":"D","stream_id":1,"deleted":"yes"}"#,
                DeadReason::InvalidField,
            ),
            (
                r#"{"user_id":"@a:b","device_id":"D","stream_id":1,"device_display_name":3}"#,
                DeadReason::InvalidField,
            ),
            (
                r#"{"user_id":"@a:b","device_id":"D","stream_id":1,"keys":[1]}"#,
                DeadReason::InvalidKeys,
            ),
        ];
        for (body, want) in cases {
            assert_eq!(reason(body), want, "{body}");
        }
    }
}
