//! Reading a `/user/devices` answer into a [`FetchedList`], leniently: one
//! unusable device entry is skipped, not a reason to drop the whole list.
//! Whether devices and keys belong to the user is decided later, in
//! [`crate::decide::fetched`].

use ruma::OwnedDeviceId;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::decide::fetched::{FetchedDevice, FetchedList};
use crate::input::fields::{MAX_DEVICE_ID_BYTES, MAX_DISPLAY_NAME_BYTES};

/// Why an answer is unusable as a whole.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AnswerError {
    /// Not a JSON object of the expected shape.
    #[error("the answer is not a device list: {0}")]
    Shape(String),
    /// `stream_id` missing or not a non-negative integer.
    #[error("the answer has no usable stream_id")]
    StreamId,
}

#[derive(Deserialize)]
struct Wire<'a> {
    user_id: String,
    stream_id: Option<serde_json::Value>,
    #[serde(borrow, default)]
    devices: Vec<&'a RawValue>,
    #[serde(borrow, default)]
    master_key: Option<&'a RawValue>,
    #[serde(borrow, default)]
    self_signing_key: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct WireDevice<'a> {
    device_id: String,
    #[serde(borrow)]
    keys: Option<&'a RawValue>,
    device_display_name: Option<String>,
}

/// Only JSON objects count; `null` and anything else read as absent.
fn object(raw: Option<&RawValue>) -> Option<String> {
    raw.filter(|r| r.get().trim_start().starts_with('{'))
        .map(|r| r.get().to_owned())
}

/// Parses an answer body. Returns the list and how many device entries were
/// unreadable (no device id, no keys object) and left out.
pub fn parse(body: &[u8]) -> Result<(FetchedList, usize), AnswerError> {
    let wire: Wire<'_> =
        serde_json::from_slice(body).map_err(|e| AnswerError::Shape(e.to_string()))?;
    let stream_id = match &wire.stream_id {
        Some(serde_json::Value::Number(n)) => n.as_i64().filter(|n| *n >= 0),
        _ => None,
    }
    .ok_or(AnswerError::StreamId)?;
    let mut unreadable = 0;
    let mut devices = Vec::with_capacity(wire.devices.len());
    for raw in wire.devices {
        let Ok(device) = serde_json::from_str::<WireDevice<'_>>(raw.get()) else {
            unreadable += 1;
            continue;
        };
        // The same limits as device ids and names arriving in updates.
        let usable_id = !device.device_id.is_empty()
            && device.device_id.len() <= MAX_DEVICE_ID_BYTES
            && !device.device_id.contains('\0');
        let (true, Some(keys)) = (usable_id, object(device.keys)) else {
            unreadable += 1;
            continue;
        };
        let display_name = device
            .device_display_name
            .filter(|n| n.len() <= MAX_DISPLAY_NAME_BYTES && !n.contains('\0'));
        devices.push(FetchedDevice {
            device_id: OwnedDeviceId::from(device.device_id),
            display_name,
            keys,
        });
    }
    Ok((
        FetchedList {
            user_id: wire.user_id,
            stream_id,
            devices,
            master_key: object(wire.master_key),
            self_signing_key: object(wire.self_signing_key),
        },
        unreadable,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_answer() {
        let body = br#"{"user_id":"@a:r.example","stream_id":7,
            "devices":[{"device_id":"D1","keys":{"user_id":"@a:r.example","device_id":"D1"},
                        "device_display_name":"Phone"},
                       {"device_id":"D2","keys":{"x":1}}],
            "master_key":{"usage":["master"]},"self_signing_key":null}"#;
        let (list, unreadable) = parse(body).unwrap();
        assert_eq!(unreadable, 0);
        assert_eq!(list.user_id, "@a:r.example");
        assert_eq!(list.stream_id, 7);
        assert_eq!(list.devices.len(), 2);
        assert_eq!(list.devices[0].display_name.as_deref(), Some("Phone"));
        assert_eq!(
            list.devices[0].keys,
            r#"{"user_id":"@a:r.example","device_id":"D1"}"#
        );
        assert_eq!(list.master_key.as_deref(), Some(r#"{"usage":["master"]}"#));
        assert_eq!(list.self_signing_key, None);
    }

    #[test]
    fn unusable_entries_are_left_out() {
        let body = br#"{"user_id":"@a:r.example","stream_id":1,
            "devices":[{"device_id":"D1"},{"keys":{}},7,{"device_id":"","keys":{}},
                       {"device_id":"OK","keys":{}}]}"#;
        let (list, unreadable) = parse(body).unwrap();
        assert_eq!(unreadable, 4);
        assert_eq!(list.devices.len(), 1);
    }

    #[test]
    fn unusable_answers() {
        let table: [&[u8]; 6] = [
            b"not json",
            b"[]",
            br#"{"stream_id":1,"devices":[]}"#,
            br#"{"user_id":"@a:r.example","devices":[]}"#,
            br#"{"user_id":"@a:r.example","stream_id":-1}"#,
            br#"{"user_id":"@a:r.example","stream_id":"5"}"#,
        ];
        for body in table {
            assert!(parse(body).is_err(), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn no_devices_is_an_empty_list() {
        let (list, _) = parse(br#"{"user_id":"@a:r.example","stream_id":3}"#).unwrap();
        assert!(list.devices.is_empty());
    }
}
