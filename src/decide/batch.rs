//! Planning a batch: folds the batch's messages, in order, over the stored
//! state of their users and says what to write and what to emit. No I/O.

use ruma::UserId;

use super::device::{DeviceRow, is_visible_change, same_json};
use super::plan::{Outcome, Plan, Snapshot, mark_stale, record_stale};
use super::rooms;
use super::rules::{UpdateDecision, decide_update};
use crate::input::cross_signing::KeyUsage;
use crate::input::{DeviceListUpdate, InputMessage, SigningKeyUpdate};
use crate::key_change::{CrossSigningChange, DeviceChange, KeyChange};

/// Folds `messages` over `snapshot`. `now_ms` stamps new stale marks.
pub fn plan_batch(mut snapshot: Snapshot, messages: &[InputMessage], now_ms: i64) -> Plan {
    let mut plan = Plan::default();
    for message in messages {
        let untracked = |user: &UserId| {
            snapshot
                .rooms
                .as_ref()
                .is_some_and(|rooms| !rooms.is_shared(user))
        };
        let outcome = match message {
            InputMessage::Update(update) if untracked(&update.user_id) => {
                drop_untracked(&mut snapshot, &mut plan, &update.user_id, now_ms)
            }
            InputMessage::SigningKey(keys) if untracked(&keys.user_id) => {
                drop_untracked(&mut snapshot, &mut plan, &keys.user_id, now_ms)
            }
            InputMessage::Resync(request) if untracked(&request.user_id) => {
                drop_untracked(&mut snapshot, &mut plan, &request.user_id, now_ms)
            }
            InputMessage::Update(update) => apply_update(&mut snapshot, &mut plan, update, now_ms),
            InputMessage::SigningKey(keys) => apply_signing_keys(&mut snapshot, &mut plan, keys),
            InputMessage::Resync(request) => {
                mark_stale(&mut snapshot, &mut plan, &request.user_id, None, now_ms);
                Outcome::ResyncRequested
            }
            InputMessage::Membership(change) => {
                rooms::apply_membership(&mut snapshot, &mut plan, change, now_ms)
            }
            InputMessage::MemberKey(link) => {
                rooms::apply_link(&mut snapshot, &mut plan, link, now_ms)
            }
        };
        plan.outcomes.push(outcome);
    }
    plan
}

/// Input about a user that shares no room with us is dropped (SPEC §5.5.6).
/// A list still stored for it (tracked before the feed began, §5.5.9) is
/// now behind the remote's: it is marked stale, but no fetch is asked for.
/// Fetches only ever ask for users who share a room now, so the mark waits
/// until the user shares one, and it is fetched then.
fn drop_untracked(snapshot: &mut Snapshot, plan: &mut Plan, user: &UserId, now_ms: i64) -> Outcome {
    if snapshot.users.contains_key(user) {
        record_stale(snapshot, plan, user, None, now_ms);
    }
    Outcome::Untracked
}

fn apply_update(
    snapshot: &mut Snapshot,
    plan: &mut Plan,
    update: &DeviceListUpdate,
    now_ms: i64,
) -> Outcome {
    let user = &update.user_id;
    let key = (user.clone(), update.device_id.clone());
    let state = snapshot.users.entry(user.clone()).or_default();
    let stored = snapshot.devices.get(&key);
    let decision = decide_update(
        &update.prev_ids,
        update.deleted,
        update.stream_id,
        &state.known,
        stored.map(|d| d.stream_id),
        state.fetched_stream_id,
    );
    match decision {
        UpdateDecision::Stale => {
            mark_stale(snapshot, plan, user, Some(update.stream_id), now_ms);
            Outcome::Stale
        }
        UpdateDecision::Outdated { also_stale } => {
            if also_stale {
                mark_stale(snapshot, plan, user, Some(update.stream_id), now_ms);
            }
            Outcome::Outdated
        }
        UpdateDecision::Apply { also_stale } => {
            let new = DeviceRow {
                display_name: if update.deleted {
                    None
                } else {
                    update.display_name.clone()
                },
                keys: update.keys.clone(),
                stream_id: update.stream_id,
                deleted: update.deleted,
            };
            let visible = is_visible_change(stored, &new);
            if visible {
                plan.events.push(KeyChange::Device(DeviceChange {
                    user_id: user.clone(),
                    device_id: update.device_id.clone(),
                    display_name: new.display_name.clone(),
                    keys: new.keys.clone(),
                    deleted: new.deleted,
                    stream_id: new.stream_id,
                }));
            }
            state.known.remember(update.stream_id);
            state.max_stream_id = state.max_stream_id.max(update.stream_id);
            plan.users.insert(user.clone(), state.clone());
            snapshot.devices.insert(key.clone(), new.clone());
            plan.devices.insert(key, new);
            if also_stale {
                mark_stale(snapshot, plan, user, Some(update.stream_id), now_ms);
            }
            if visible {
                Outcome::Applied
            } else {
                Outcome::Unchanged
            }
        }
    }
}

fn apply_signing_keys(
    snapshot: &mut Snapshot,
    plan: &mut Plan,
    keys: &SigningKeyUpdate,
) -> Outcome {
    let user = &keys.user_id;
    let mut changed = false;
    for (usage, new) in [
        (KeyUsage::Master, &keys.master_key),
        (KeyUsage::SelfSigning, &keys.self_signing_key),
    ] {
        let Some(new) = new else { continue };
        let slot = (user.clone(), usage);
        if !same_json(
            snapshot.cross_signing.get(&slot).map(String::as_str),
            Some(new),
        ) {
            snapshot.cross_signing.insert(slot.clone(), new.clone());
            plan.cross_signing.insert(slot, new.clone());
            changed = true;
        }
    }
    if !changed {
        return Outcome::KeysUnchanged;
    }
    let current = |usage| snapshot.cross_signing.get(&(user.clone(), usage)).cloned();
    plan.events
        .push(KeyChange::CrossSigning(CrossSigningChange {
            user_id: user.clone(),
            master_key: current(KeyUsage::Master),
            self_signing_key: current(KeyUsage::SelfSigning),
        }));
    Outcome::KeysChanged
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::UserState;
    use crate::input::ResyncRequest;

    fn update(user: &str, device: &str, stream: i64, prev: &[i64], name: &str) -> InputMessage {
        InputMessage::Update(DeviceListUpdate {
            user_id: user.try_into().unwrap(),
            device_id: device.into(),
            display_name: Some(name.into()),
            stream_id: stream,
            prev_ids: prev.to_vec(),
            deleted: false,
            keys: Some(format!(r#"{{"device_id":"{device}"}}"#)),
        })
    }

    fn deletion(user: &str, device: &str, stream: i64, prev: &[i64]) -> InputMessage {
        InputMessage::Update(DeviceListUpdate {
            user_id: user.try_into().unwrap(),
            device_id: device.into(),
            display_name: None,
            stream_id: stream,
            prev_ids: prev.to_vec(),
            deleted: true,
            keys: None,
        })
    }

    fn known_user(user: &str, ids: &[i64]) -> Snapshot {
        let mut state = UserState::default();
        ids.iter().for_each(|&id| state.known.remember(id));
        let mut snapshot = Snapshot::default();
        snapshot.users.insert(user.try_into().unwrap(), state);
        snapshot
    }

    const A: &str = "@a:remote.example";

    #[test]
    fn a_chain_within_one_batch_is_applied_in_order() {
        let messages = [
            update(A, "D", 6, &[5], "one"),
            update(A, "D", 7, &[6], "two"),
            update(A, "E", 8, &[7], "three"),
        ];
        let plan = plan_batch(known_user(A, &[5]), &messages, 0);
        assert_eq!(plan.outcomes, vec![Outcome::Applied; 3]);
        assert_eq!(plan.events.len(), 3);
        assert!(plan.stale.is_empty() && plan.fetch_servers.is_empty());
        let d = &plan.devices[&(A.try_into().unwrap(), "D".into())];
        assert_eq!((d.stream_id, d.display_name.as_deref()), (7, Some("two")));
        let state = &plan.users[<&UserId>::try_from(A).unwrap()];
        assert!(state.known.contains(8) && state.max_stream_id == 8);
    }

    #[test]
    fn identical_resend_emits_nothing() {
        let first = update(A, "D", 6, &[5], "one");
        let plan = plan_batch(known_user(A, &[5]), std::slice::from_ref(&first), 0);
        let mut snapshot = known_user(A, &[5, 6]);
        snapshot.devices.extend(plan.devices);
        // The same update again (a duplicate delivery) is outdated; the same
        // content under a newer stream id is applied without an event.
        let again = plan_batch(snapshot, &[first, update(A, "D", 7, &[6], "one")], 0);
        assert_eq!(again.outcomes, vec![Outcome::Outdated, Outcome::Unchanged]);
        assert!(again.events.is_empty());
    }

    #[test]
    fn unknown_prev_marks_stale_and_later_updates_chain_on_nothing() {
        let messages = [update(A, "D", 9, &[8], "x"), update(A, "D", 10, &[9], "y")];
        let plan = plan_batch(known_user(A, &[5]), &messages, 42);
        // 9 was not applied, so 10's prev_id is unknown too.
        assert_eq!(plan.outcomes, vec![Outcome::Stale, Outcome::Stale]);
        let mark = &plan.stale[<&UserId>::try_from(A).unwrap()];
        assert_eq!(
            (mark.trigger_ids.clone(), mark.marked_at_ms),
            (vec![9, 10], 42)
        );
        assert!(plan.events.is_empty() && plan.devices.is_empty());
        assert_eq!(plan.fetch_servers.len(), 1);
    }

    #[test]
    fn deletion_with_unknown_prev_is_applied_and_marks_stale() {
        let mut snapshot = known_user(A, &[]);
        snapshot.devices.insert(
            (A.try_into().unwrap(), "D".into()),
            DeviceRow {
                display_name: None,
                keys: Some("{}".into()),
                stream_id: 3,
                deleted: false,
            },
        );
        let plan = plan_batch(snapshot, &[deletion(A, "D", 9, &[])], 0);
        assert_eq!(plan.outcomes, vec![Outcome::Applied]);
        assert!(matches!(&plan.events[0], KeyChange::Device(d) if d.deleted && d.keys.is_none()));
        assert!(plan.stale.contains_key(<&UserId>::try_from(A).unwrap()));
    }

    #[test]
    fn resync_and_signing_keys() {
        let keys = InputMessage::SigningKey(SigningKeyUpdate {
            user_id: A.try_into().unwrap(),
            master_key: Some(r#"{"m":1}"#.into()),
            self_signing_key: None,
            dropped: vec![],
        });
        let plan = plan_batch(
            Snapshot::default(),
            &[
                keys.clone(),
                keys,
                InputMessage::Resync(ResyncRequest {
                    user_id: A.try_into().unwrap(),
                }),
            ],
            0,
        );
        assert_eq!(
            plan.outcomes,
            vec![
                Outcome::KeysChanged,
                Outcome::KeysUnchanged,
                Outcome::ResyncRequested
            ]
        );
        assert_eq!(plan.events.len(), 1);
        assert!(matches!(&plan.events[0],
            KeyChange::CrossSigning(c) if c.master_key.is_some() && c.self_signing_key.is_none()));
        assert_eq!(
            plan.stale[<&UserId>::try_from(A).unwrap()].trigger_ids,
            Vec::<i64>::new()
        );
    }
}
