//! Storing a fetched device list (SPEC §5.3, §5.1.7), as a pure plan: which
//! rows change, which events follow, and whether the user is fresh again.
//! The fetcher runs this inside the same per-user lock and
//! transaction as ingest.

use std::collections::{BTreeMap, BTreeSet};

use ruma::{OwnedDeviceId, OwnedUserId, UserId};
use serde::Deserialize;

use super::device::{DeviceRow, is_visible_change, same_json};
use super::{StaleMark, UserState};
use crate::input::cross_signing::{self, KeyUsage};
use crate::key_change::{CrossSigningChange, DeviceChange, KeyChange};

/// One device of a `/user/devices` answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchedDevice {
    /// The device id.
    pub device_id: OwnedDeviceId,
    /// `device_display_name`, if any.
    pub display_name: Option<String>,
    /// The `keys` object as received.
    pub keys: String,
}

/// A `/user/devices` answer, parsed but not yet checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchedList {
    /// `user_id` of the answer.
    pub user_id: String,
    /// `stream_id` of the answer.
    pub stream_id: i64,
    /// The devices.
    pub devices: Vec<FetchedDevice>,
    /// `master_key` as received.
    pub master_key: Option<String>,
    /// `self_signing_key` as received.
    pub self_signing_key: Option<String>,
}

/// What is stored for the user when the answer arrives.
#[derive(Clone, Debug, Default)]
pub struct StoredUser {
    /// Devices, tombstones included.
    pub devices: BTreeMap<OwnedDeviceId, DeviceRow>,
    /// Stream state.
    pub state: UserState,
    /// Cross-signing keys.
    pub cross_signing: BTreeMap<KeyUsage, String>,
    /// The stale mark now (it may have grown while the request was in flight).
    pub stale: Option<StaleMark>,
}

/// An answer that must not be stored; it counts as a failed fetch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FetchRefusal {
    /// The answer is about another user.
    UserMismatch {
        /// Who was asked for.
        requested: OwnedUserId,
        /// Who the answer is about.
        answered: String,
    },
    /// The user stopped sharing every room with us while the request was
    /// in flight (SPEC §5.5.4): it is untracked, so nothing is stored.
    Untracked,
}

/// What storing an answer does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FetchPlan {
    /// Device rows to upsert (tombstones for devices no longer listed).
    pub devices: BTreeMap<OwnedDeviceId, DeviceRow>,
    /// The user's stream state afterwards.
    pub state: UserState,
    /// Cross-signing keys to upsert.
    pub cross_signing: BTreeMap<KeyUsage, String>,
    /// Events, in order.
    pub events: Vec<KeyChange>,
    /// The stale mark to keep: None when the user is fresh; Some with the
    /// triggers that arrived after the request started (the answer may
    /// predate them, so the user needs another fetch).
    pub still_stale: Option<StaleMark>,
    /// Devices skipped because their keys name another user or device.
    pub skipped_devices: Vec<OwnedDeviceId>,
    /// Cross-signing keys ignored as malformed, with the reason.
    pub skipped_keys: Vec<String>,
    /// Set when the list had more than the device cap and was not stored.
    pub too_many_devices: Option<usize>,
    /// The answer is older than the last one stored: nothing of it is kept
    /// but what it says about the stale mark.
    pub superseded: bool,
}

#[derive(Deserialize)]
struct KeyOwner {
    user_id: Option<String>,
    device_id: Option<String>,
}

/// Plans storing `list`, fetched for `requested` while `stale_at_start` was
/// its stale mark.
pub fn plan_fetch(
    requested: &UserId,
    stored: &StoredUser,
    stale_at_start: Option<&StaleMark>,
    list: &FetchedList,
    max_devices: usize,
) -> Result<FetchPlan, FetchRefusal> {
    if list.user_id != requested.as_str() {
        return Err(FetchRefusal::UserMismatch {
            requested: requested.to_owned(),
            answered: list.user_id.clone(),
        });
    }
    let mut plan = FetchPlan {
        state: stored.state.clone(),
        ..Default::default()
    };
    // §5.1.7: the ids that made the user stale count as known after a fetch.
    let triggers_before: BTreeSet<i64> = stale_at_start
        .map(|m| m.trigger_ids.iter().copied().collect())
        .unwrap_or_default();
    for &id in &triggers_before {
        plan.state.known.remember(id);
    }
    plan.state.known.remember(list.stream_id);
    plan.state.max_stream_id = plan.state.max_stream_id.max(list.stream_id);
    plan.state.fetched_stream_id = plan.state.fetched_stream_id.max(list.stream_id);
    plan.still_stale = stored.stale.as_ref().and_then(|now| {
        let newer: Vec<i64> = now
            .trigger_ids
            .iter()
            .copied()
            .filter(|id| !triggers_before.contains(id))
            .collect();
        let resync_requested_since = stale_at_start.is_none();
        (!newer.is_empty() || resync_requested_since).then_some(StaleMark {
            trigger_ids: newer,
            marked_at_ms: now.marked_at_ms,
        })
    });

    if list.stream_id < stored.state.fetched_stream_id {
        // An answer older than one already stored (two fetches raced): its
        // devices and keys are history, and could bring back a device the
        // newer answer no longer listed.
        plan.superseded = true;
        return Ok(plan);
    }
    if list.devices.len() > max_devices {
        // Not stored, but the user counts as fresh: only updates apply from now.
        plan.too_many_devices = Some(list.devices.len());
    } else {
        plan_devices(requested, stored, list, &mut plan);
    }
    plan_cross_signing(requested, stored, list, &mut plan);
    Ok(plan)
}

fn plan_devices(requested: &UserId, stored: &StoredUser, list: &FetchedList, plan: &mut FetchPlan) {
    let mut listed = BTreeSet::new();
    for device in &list.devices {
        let owner: Option<KeyOwner> = serde_json::from_str(&device.keys).ok();
        let matches = owner.is_some_and(|o| {
            o.user_id.as_deref() == Some(requested.as_str())
                && o.device_id.as_deref() == Some(device.device_id.as_str())
        });
        if !matches || !listed.insert(device.device_id.clone()) {
            // Still listed: a skipped device is not deleted.
            listed.insert(device.device_id.clone());
            plan.skipped_devices.push(device.device_id.clone());
            continue;
        }
        let new = DeviceRow {
            display_name: device.display_name.clone(),
            keys: Some(device.keys.clone()),
            stream_id: list.stream_id,
            deleted: false,
        };
        write_device(requested, stored, &device.device_id, new, plan);
    }
    for (device_id, row) in &stored.devices {
        if row.deleted || listed.contains(device_id) {
            continue;
        }
        let gone = DeviceRow {
            display_name: None,
            keys: None,
            stream_id: list.stream_id,
            deleted: true,
        };
        write_device(requested, stored, device_id, gone, plan);
    }
}

/// Writes `new` unless the stored row is newer than the answer (an update
/// applied after the remote took its snapshot), emitting visible changes.
fn write_device(
    user: &UserId,
    stored: &StoredUser,
    device_id: &OwnedDeviceId,
    new: DeviceRow,
    plan: &mut FetchPlan,
) {
    let old = stored.devices.get(device_id);
    if old.is_some_and(|o| o.stream_id > new.stream_id) {
        return;
    }
    if is_visible_change(old, &new) {
        plan.events.push(KeyChange::Device(DeviceChange {
            user_id: user.to_owned(),
            device_id: device_id.clone(),
            display_name: new.display_name.clone(),
            keys: new.keys.clone(),
            deleted: new.deleted,
            stream_id: new.stream_id,
        }));
    }
    if old != Some(&new) {
        plan.devices.insert(device_id.clone(), new);
    }
}

fn plan_cross_signing(
    requested: &UserId,
    stored: &StoredUser,
    list: &FetchedList,
    plan: &mut FetchPlan,
) {
    let mut current = stored.cross_signing.clone();
    for (usage, key) in [
        (KeyUsage::Master, &list.master_key),
        (KeyUsage::SelfSigning, &list.self_signing_key),
    ] {
        let Some(key) = key else { continue };
        if let Err(why) = cross_signing::check(key, requested, usage) {
            plan.skipped_keys.push(format!("{}: {why}", usage.as_str()));
            continue;
        }
        if !same_json(current.get(&usage).map(String::as_str), Some(key)) {
            current.insert(usage, key.clone());
            plan.cross_signing.insert(usage, key.clone());
        }
    }
    if !plan.cross_signing.is_empty() {
        plan.events
            .push(KeyChange::CrossSigning(CrossSigningChange {
                user_id: requested.to_owned(),
                master_key: current.get(&KeyUsage::Master).cloned(),
                self_signing_key: current.get(&KeyUsage::SelfSigning).cloned(),
            }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALICE: &str = "@alice:remote.example";
    const MASTER: &str = "nqOvzeuGWT/sRx3h7+MHoInYj3Uk2LD/unI9kDYcHwk";

    fn alice() -> &'static UserId {
        <&UserId>::try_from(ALICE).unwrap()
    }

    fn keys(user: &str, device: &str, tag: &str) -> String {
        format!(r#"{{"user_id":"{user}","device_id":"{device}","keys":{{"t":"{tag}"}}}}"#)
    }

    fn device(id: &str, tag: &str) -> FetchedDevice {
        FetchedDevice {
            device_id: id.into(),
            display_name: Some(format!("name {tag}")),
            keys: keys(ALICE, id, tag),
        }
    }

    fn list(stream_id: i64, devices: Vec<FetchedDevice>) -> FetchedList {
        FetchedList {
            user_id: ALICE.into(),
            stream_id,
            devices,
            master_key: None,
            self_signing_key: None,
        }
    }

    fn row(tag: &str, device: &str, stream_id: i64) -> DeviceRow {
        DeviceRow {
            display_name: Some(format!("name {tag}")),
            keys: Some(keys(ALICE, device, tag)),
            stream_id,
            deleted: false,
        }
    }

    fn mark(ids: &[i64]) -> StaleMark {
        StaleMark {
            trigger_ids: ids.to_vec(),
            marked_at_ms: 1,
        }
    }

    #[test]
    fn first_fetch_stores_every_device_and_knows_the_triggers() {
        let stored = StoredUser {
            stale: Some(mark(&[4, 5])),
            ..Default::default()
        };
        let plan = plan_fetch(
            alice(),
            &stored,
            Some(&mark(&[4, 5])),
            &list(9, vec![device("A", "1"), device("B", "1")]),
            1000,
        )
        .unwrap();
        assert_eq!(plan.devices.len(), 2);
        assert_eq!(plan.events.len(), 2);
        assert!(
            plan.state.known.contains(9)
                && plan.state.known.contains(4)
                && plan.state.known.contains(5)
        );
        assert_eq!(plan.state.max_stream_id, 9);
        assert_eq!(plan.still_stale, None);
    }

    #[test]
    fn identical_fetch_emits_nothing_and_a_dropped_device_is_deleted() {
        let mut stored = StoredUser::default();
        stored.devices.insert("A".into(), row("1", "A", 9));
        stored.devices.insert("B".into(), row("1", "B", 9));
        let same = plan_fetch(
            alice(),
            &stored,
            None,
            &list(9, vec![device("A", "1"), device("B", "1")]),
            1000,
        )
        .unwrap();
        assert!(same.events.is_empty() && same.devices.is_empty());
        let dropped = plan_fetch(
            alice(),
            &stored,
            None,
            &list(10, vec![device("A", "1")]),
            1000,
        )
        .unwrap();
        assert_eq!(dropped.events.len(), 1);
        assert!(
            matches!(&dropped.events[0], KeyChange::Device(d) if d.device_id == "B" && d.deleted && d.keys.is_none())
        );
        assert!(dropped.devices[<&ruma::DeviceId>::from("B")].deleted);
        // A re-stored under the newer stream id, without an event
        assert_eq!(dropped.devices[<&ruma::DeviceId>::from("A")].stream_id, 10);
    }

    #[test]
    fn mismatching_answers_and_devices() {
        let mut other = list(9, vec![device("A", "1")]);
        other.user_id = "@bob:remote.example".into();
        assert!(matches!(
            plan_fetch(alice(), &StoredUser::default(), None, &other, 1000),
            Err(FetchRefusal::UserMismatch { .. })
        ));
        let mut stored = StoredUser::default();
        stored.devices.insert("BAD".into(), row("0", "BAD", 3));
        let mut bad = device("BAD", "2");
        bad.keys = keys("@bob:remote.example", "BAD", "2");
        let mut wrong_id = device("W", "2");
        wrong_id.keys = keys(ALICE, "OTHER", "2");
        let plan = plan_fetch(
            alice(),
            &stored,
            None,
            &list(9, vec![device("A", "1"), bad, wrong_id]),
            1000,
        )
        .unwrap();
        assert_eq!(plan.skipped_devices.len(), 2);
        assert_eq!(
            plan.events.len(),
            1,
            "only A; the skipped but listed BAD is not deleted"
        );
        assert!(!plan.devices.contains_key(<&ruma::DeviceId>::from("BAD")));
    }

    #[test]
    fn rows_newer_than_the_answer_are_kept() {
        let mut stored = StoredUser::default();
        stored.devices.insert("A".into(), row("new", "A", 12));
        stored.devices.insert("B".into(), row("new", "B", 12));
        let plan = plan_fetch(
            alice(),
            &stored,
            None,
            &list(10, vec![device("A", "old")]),
            1000,
        )
        .unwrap();
        assert!(plan.devices.is_empty() && plan.events.is_empty());
    }

    #[test]
    fn too_many_devices_stores_none_but_marks_fresh() {
        let stored = StoredUser {
            stale: Some(mark(&[4])),
            ..Default::default()
        };
        let plan = plan_fetch(
            alice(),
            &stored,
            Some(&mark(&[4])),
            &list(9, vec![device("A", "1"), device("B", "1")]),
            1,
        )
        .unwrap();
        assert_eq!(plan.too_many_devices, Some(2));
        assert!(plan.devices.is_empty() && plan.events.is_empty());
        assert_eq!(plan.still_stale, None);
    }

    #[test]
    fn triggers_that_arrive_during_the_request_keep_the_user_stale() {
        let stored = StoredUser {
            stale: Some(mark(&[4, 7])),
            ..Default::default()
        };
        let plan = plan_fetch(alice(), &stored, Some(&mark(&[4])), &list(9, vec![]), 1000).unwrap();
        assert_eq!(plan.still_stale.map(|m| m.trigger_ids), Some(vec![7]));
        assert!(plan.state.known.contains(4) && !plan.state.known.contains(7));
    }

    #[test]
    fn cross_signing_keys_are_checked_and_emitted_once() {
        let good = format!(
            r#"{{"user_id":"{ALICE}","usage":["master"],"keys":{{"ed25519:{MASTER}":"{MASTER}"}}}}"#
        );
        let mut answer = list(9, vec![]);
        answer.master_key = Some(good.clone());
        // The master key again, where the self-signing key belongs: its
        // usage is wrong for that place.
        answer.self_signing_key = Some(good.clone());
        let plan = plan_fetch(alice(), &StoredUser::default(), None, &answer, 1000).unwrap();
        assert_eq!(plan.cross_signing.len(), 1);
        assert_eq!(
            plan.skipped_keys,
            ["self_signing: usage does not contain \"self_signing\""],
            "a master key offered as self-signing is ignored"
        );
        assert!(
            matches!(&plan.events[..], [KeyChange::CrossSigning(c)] if c.master_key.as_deref() == Some(good.as_str()) && c.self_signing_key.is_none())
        );
        let mut stored = StoredUser::default();
        stored.cross_signing.insert(KeyUsage::Master, good);
        let again = plan_fetch(alice(), &stored, None, &answer, 1000).unwrap();
        assert!(again.events.is_empty(), "the same keys again emit nothing");
    }
}
