//! Stored device state and the "is this a real change?" test.

use serde_json::Value;

/// The state of one device as stored (or about to be stored).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceRow {
    /// Display name.
    pub display_name: Option<String>,
    /// Device-keys JSON as received.
    pub keys: Option<String>,
    /// Stream id that wrote it.
    pub stream_id: i64,
    /// A tombstone.
    pub deleted: bool,
}

/// Two JSON texts mean the same value (byte equality first, as it is the common case).
pub fn same_json(a: Option<&str>, b: Option<&str>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) if a == b => true,
        (Some(a), Some(b)) => match (
            serde_json::from_str::<Value>(a),
            serde_json::from_str::<Value>(b),
        ) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        },
        _ => false,
    }
}

/// Whether going from `old` to `new` is a change a sync worker must hear of.
/// A new stream id alone is not: re-storing an identical device emits nothing.
pub fn is_visible_change(old: Option<&DeviceRow>, new: &DeviceRow) -> bool {
    match old {
        None => !new.deleted,
        Some(old) if old.deleted => !new.deleted,
        Some(old) => {
            new.deleted
                || old.display_name != new.display_name
                || !same_json(old.keys.as_deref(), new.keys.as_deref())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: Option<&str>, keys: Option<&str>, deleted: bool) -> DeviceRow {
        DeviceRow {
            display_name: name.map(str::to_owned),
            keys: keys.map(str::to_owned),
            stream_id: 1,
            deleted,
        }
    }

    #[test]
    fn change_table() {
        let live = row(Some("A"), Some(r#"{"a":1,"b":2}"#), false);
        let gone = row(None, None, true);
        assert!(is_visible_change(None, &live));
        assert!(
            !is_visible_change(None, &gone),
            "deleting an unknown device is no change"
        );
        assert!(is_visible_change(Some(&live), &gone));
        assert!(!is_visible_change(Some(&gone), &gone));
        assert!(is_visible_change(Some(&gone), &live));
        assert!(!is_visible_change(Some(&live), &live));
        let reordered = row(Some("A"), Some(r#"{ "b":2, "a":1 }"#), false);
        assert!(
            !is_visible_change(Some(&live), &reordered),
            "same JSON, other bytes"
        );
        assert!(is_visible_change(
            Some(&live),
            &row(Some("B"), live.keys.as_deref(), false)
        ));
        assert!(is_visible_change(
            Some(&live),
            &row(Some("A"), Some(r#"{"a":1}"#), false)
        ));
    }
}
