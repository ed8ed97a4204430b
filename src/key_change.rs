//! Key-change events (SPEC §4.2): what sync workers read from `KEY_CHANGE`.

use ruma::{OwnedDeviceId, OwnedUserId, UserId};
use serde::Serialize;
use serde_json::value::RawValue;

/// Subject of device events.
pub const DEVICE_SUBJECT: &str = "key_change.device";
/// Subject of cross-signing events.
pub const CROSS_SIGNING_SUBJECT: &str = "key_change.cross_signing";

/// One real change of a remote user's keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyChange {
    /// A device was added, changed or deleted.
    Device(DeviceChange),
    /// The user's master or self-signing key changed.
    CrossSigning(CrossSigningChange),
}

/// A device that was added, changed or deleted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceChange {
    /// Owner of the device.
    pub user_id: OwnedUserId,
    /// The device.
    pub device_id: OwnedDeviceId,
    /// Its display name, if any.
    pub display_name: Option<String>,
    /// The device-keys JSON as the remote sent it; None when deleted or absent.
    pub keys: Option<String>,
    /// The device is gone.
    pub deleted: bool,
    /// Stream id of the update or fetch that made the change.
    pub stream_id: i64,
}

/// The user's current cross-signing keys after a change (None: never received).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CrossSigningChange {
    /// Owner of the keys.
    pub user_id: OwnedUserId,
    /// The master key JSON as received.
    pub master_key: Option<String>,
    /// The self-signing key JSON as received.
    pub self_signing_key: Option<String>,
}

#[derive(Serialize)]
struct DeviceWire<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    user_id: &'a str,
    device_id: &'a str,
    display_name: Option<&'a str>,
    keys: Option<&'a RawValue>,
    deleted: bool,
    stream_id: i64,
}

#[derive(Serialize)]
struct CrossSigningWire<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    user_id: &'a str,
    master_key: Option<&'a RawValue>,
    self_signing_key: Option<&'a RawValue>,
}

/// Borrows stored JSON text as a raw value, so it is published without re-encoding.
/// Text that is not JSON (it never should be: it was checked on input) becomes null.
fn raw(json: Option<&str>) -> Option<Box<RawValue>> {
    json.and_then(|j| RawValue::from_string(j.to_owned()).ok())
}

impl KeyChange {
    /// The subject it is published on.
    pub fn subject(&self) -> &'static str {
        match self {
            KeyChange::Device(_) => DEVICE_SUBJECT,
            KeyChange::CrossSigning(_) => CROSS_SIGNING_SUBJECT,
        }
    }

    /// The owner of the keys (the `user_id` header).
    pub fn user_id(&self) -> &UserId {
        match self {
            KeyChange::Device(d) => &d.user_id,
            KeyChange::CrossSigning(c) => &c.user_id,
        }
    }

    /// The JSON body.
    pub fn to_json(&self) -> String {
        let result = match self {
            KeyChange::Device(d) => {
                let keys = raw(d.keys.as_deref());
                serde_json::to_string(&DeviceWire {
                    kind: "device",
                    user_id: d.user_id.as_str(),
                    device_id: d.device_id.as_str(),
                    display_name: d.display_name.as_deref(),
                    keys: keys.as_deref(),
                    deleted: d.deleted,
                    stream_id: d.stream_id,
                })
            }
            KeyChange::CrossSigning(c) => {
                let master = raw(c.master_key.as_deref());
                let self_signing = raw(c.self_signing_key.as_deref());
                serde_json::to_string(&CrossSigningWire {
                    kind: "cross_signing",
                    user_id: c.user_id.as_str(),
                    master_key: master.as_deref(),
                    self_signing_key: self_signing.as_deref(),
                })
            }
        };
        // Serializing these plain structs cannot fail.
        result.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_event_keeps_keys_verbatim() {
        let change = KeyChange::Device(DeviceChange {
            user_id: "@a:r.example".try_into().unwrap(),
            device_id: "D".into(),
            display_name: Some("Phone".into()),
            keys: Some(r#"{"z":1,"a":{"unknown":true}}"#.into()),
            deleted: false,
            stream_id: 6,
        });
        assert_eq!(change.subject(), "key_change.device");
        assert_eq!(
            change.to_json(),
            r#"{"type":"device","user_id":"@a:r.example","device_id":"D","display_name":"Phone","keys":{"z":1,"a":{"unknown":true}},"deleted":false,"stream_id":6}"#
        );
    }

    #[test]
    fn deleted_device_and_cross_signing_shapes() {
        let deleted = KeyChange::Device(DeviceChange {
            user_id: "@a:r.example".try_into().unwrap(),
            device_id: "D".into(),
            display_name: None,
            keys: None,
            deleted: true,
            stream_id: 7,
        });
        assert_eq!(
            deleted.to_json(),
            r#"{"type":"device","user_id":"@a:r.example","device_id":"D","display_name":null,"keys":null,"deleted":true,"stream_id":7}"#
        );
        let cs = KeyChange::CrossSigning(CrossSigningChange {
            user_id: "@a:r.example".try_into().unwrap(),
            master_key: Some(r#"{"k":1}"#.into()),
            self_signing_key: None,
        });
        assert_eq!(
            cs.to_json(),
            r#"{"type":"cross_signing","user_id":"@a:r.example","master_key":{"k":1},"self_signing_key":null}"#
        );
    }
}
