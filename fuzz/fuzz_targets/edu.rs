//! Any bytes on an input subject, with or without an `origin` header: the
//! parser returns a verdict (never panics), and what it accepts plans. The
//! kinds come from `InputKind::ALL`, so membership and member keys are in.
#![no_main]

use device_list_updater::decide::{RoomSnapshot, Snapshot, plan_batch};
use device_list_updater::input::{InputKind, Parsed, RoomRules, Rules, Tracking, parse};
use libfuzzer_sys::fuzz_target;
use ruma::ServerName;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let kinds = InputKind::ALL;
    let kind = kinds[usize::from(selector) % kinds.len()];
    let origin = match usize::from(selector) / kinds.len() % 3 {
        0 => None,
        1 => Some("remote.example"),
        _ => Some("other.example"),
    };
    let Ok(own) = <&ServerName>::try_from("own.example") else {
        return;
    };
    // Membership off, or on with member keys on or off, chosen by the
    // selector too.
    let tracking = match usize::from(selector) / kinds.len() / 3 % 3 {
        0 => Tracking::Everyone,
        keys => Tracking::SharedRooms(RoomRules {
            own_server: own.to_owned(),
            member_keys: keys == 2,
        }),
    };
    let rules = Rules {
        own_server: own,
        tracking: &tracking,
    };
    if let Ok(Parsed::Accept(message)) = parse(kind, body, origin, &rules) {
        // Planned under both tracking rules: everyone, and shared rooms.
        let plan = plan_batch(Snapshot::default(), &[message.clone(), message.clone()], 0);
        assert_eq!(plan.outcomes.len(), 2);
        let rooms = Snapshot {
            rooms: Some(RoomSnapshot::new(own.to_owned())),
            ..Snapshot::default()
        };
        let plan = plan_batch(rooms, &[message.clone(), message], 0);
        assert_eq!(plan.outcomes.len(), 2);
    }
});
